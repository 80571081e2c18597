//! The pre-tokenizer: splits text into the words BPE merges within, as llama.cpp's regexes for
//! each `tokenizer.ggml.pre` type do — but by hand-written scanners, one pass over the text
//! each, with no backtracking and no recursion.
//!
//! Why not a regex engine: the GPT-2 and Llama 3 patterns end in `\s+(?!\S)`, a lookahead, so
//! they need a backtracking engine (fancy-regex), whose greedy loops push a state per
//! character: a 1 MB word overflowed its stack (a panic on the service's worker) and long words
//! cost superlinear time. llama.cpp itself replaces these two patterns with hand-written
//! scanners (`unicode_regex_split_custom_gpt2` / `_llama3`); these scanners reproduce the
//! regexes' leftmost-first semantics exactly (the tests compare them with a regex engine on
//! generated text).

use unicode_properties::{GeneralCategoryGroup, UnicodeGeneralCategory};

/// One of the patterns a pre-tokenizer type applies, in order, each splitting the pieces the
/// previous one left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Split {
    /// `\p{N}`: every numeric character alone.
    Digit,
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`
    Gpt2,
    /// `(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
    /// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    Llama3,
    /// `[\p{P}\$\+<=>\^~\|]+`
    PunctRun,
    /// `\p{N}+`
    NumRun,
    /// `[0-9][0-9][0-9]`
    Digits3,
}

/// The patterns of a pre-tokenizer type (llama.cpp's `llama_vocab` table), or `None` for a
/// type this tokenizer does not know.
pub(crate) fn splits(pre: &str) -> Option<&'static [Split]> {
    Some(match pre {
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => &[Split::Digit, Split::Gpt2],
        "gpt-2" | "gpt2" | "mpt" | "olmo" | "jais" => &[Split::Gpt2],
        "llama-bpe" | "llama3" | "falcon3" | "pixtral" => &[Split::Llama3],
        "default" => &[Split::PunctRun, Split::Gpt2, Split::NumRun, Split::Digits3],
        _ => return None,
    })
}

const L: u8 = 1;
const N: u8 = 2;
const WS: u8 = 4;
const P: u8 = 8;

/// The classes of one character the patterns test.
fn class(c: char) -> u8 {
    if c.is_ascii() {
        // The common case without a table lookup.
        return match c {
            'a'..='z' | 'A'..='Z' => L,
            '0'..='9' => N,
            ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r' => WS,
            '!'..='/' | ':'..='@' | '['..='`' | '{'..='~' => {
                // \p{P} in ASCII: all of these but $ + < = > ^ ` | ~ (symbols, Sc/Sm/Sk).
                if matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '`' | '|' | '~') {
                    0
                } else {
                    P
                }
            }
            _ => 0,
        };
    }
    let mut k = 0;
    if c.is_whitespace() {
        k |= WS;
    }
    k | match c.general_category_group() {
        GeneralCategoryGroup::Letter => L,
        GeneralCategoryGroup::Number => N,
        GeneralCategoryGroup::Punctuation => P,
        _ => 0,
    }
}

/// A piece of text as characters with their classes and byte offsets.
struct Chars<'a> {
    text: &'a str,
    c: Vec<char>,
    k: Vec<u8>,
    /// Byte offset of each character, and the text's length last.
    at: Vec<usize>,
}

impl<'a> Chars<'a> {
    fn new(text: &'a str) -> Self {
        let n = text.len();
        let (mut c, mut k, mut at) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n + 1));
        for (i, ch) in text.char_indices() {
            c.push(ch);
            k.push(class(ch));
            at.push(i);
        }
        at.push(n);
        Self { text, c, k, at }
    }
    fn is(&self, i: usize, class: u8) -> bool {
        self.k.get(i).is_some_and(|&k| k & class != 0)
    }
    fn ch(&self, i: usize) -> Option<char> {
        self.c.get(i).copied()
    }
    /// The end of the run of `class` starting at `i`.
    fn run(&self, mut i: usize, class: u8) -> usize {
        while self.is(i, class) {
            i += 1;
        }
        i
    }
    /// The end of the run of characters that are none of `classes`.
    fn run_not(&self, mut i: usize, classes: u8) -> usize {
        while i < self.c.len() && self.k[i] & classes == 0 {
            i += 1;
        }
        i
    }
}

/// Where the pattern's match starting at character `i` ends, if one does.
fn match_at(s: Split, t: &Chars<'_>, i: usize) -> Option<usize> {
    let n = t.c.len();
    let lower = |j: usize| t.ch(j);
    match s {
        Split::Digit => t.is(i, N).then_some(i + 1),
        Split::NumRun => t.is(i, N).then(|| t.run(i, N)),
        Split::Digits3 => (i + 3 <= n && t.c[i..i + 3].iter().all(char::is_ascii_digit)).then_some(i + 3),
        Split::PunctRun => {
            let punct = |j: usize| t.is(j, P) || matches!(t.ch(j), Some('$' | '+' | '<' | '=' | '>' | '^' | '~' | '|'));
            let mut j = i;
            while j < n && punct(j) {
                j += 1;
            }
            (j > i).then_some(j)
        }
        Split::Gpt2 => {
            if t.ch(i) == Some('\'') {
                match (lower(i + 1), lower(i + 2)) {
                    (Some('s' | 't' | 'm' | 'd'), _) => return Some(i + 2),
                    (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => return Some(i + 3),
                    _ => {}
                }
            }
            // ` ?X+` for X = letters, numbers, and neither-nor-space: with the space when the
            // run follows it, else without (a space is none of the three).
            let j = if t.ch(i) == Some(' ') { i + 1 } else { i };
            if t.is(j, L) {
                return Some(t.run(j, L));
            }
            if t.is(j, N) {
                return Some(t.run(j, N));
            }
            if j < n && t.k[j] & (L | N | WS) == 0 {
                return Some(t.run_not(j, L | N | WS));
            }
            whitespace_not_before_text(t, i)
        }
        Split::Llama3 => {
            if t.ch(i) == Some('\'') {
                let l = |j: usize| t.ch(j).map(|c| c.to_ascii_lowercase());
                match (l(i + 1), l(i + 2)) {
                    (Some('s' | 't' | 'm' | 'd'), _) => return Some(i + 2),
                    (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => return Some(i + 3),
                    _ => {}
                }
            }
            // `[^\r\n\p{L}\p{N}]?\p{L}+`
            let lead = i < n && t.k[i] & (L | N) == 0 && !matches!(t.c[i], '\r' | '\n');
            if lead && t.is(i + 1, L) {
                return Some(t.run(i + 1, L));
            }
            if t.is(i, L) {
                return Some(t.run(i, L));
            }
            // `\p{N}{1,3}`
            if t.is(i, N) {
                let mut j = i;
                while j < i + 3 && t.is(j, N) {
                    j += 1;
                }
                return Some(j);
            }
            // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
            let j = if t.ch(i) == Some(' ') { i + 1 } else { i };
            if j < n && t.k[j] & (L | N | WS) == 0 {
                let mut e = t.run_not(j, L | N | WS);
                while matches!(t.ch(e), Some('\r' | '\n')) {
                    e += 1;
                }
                return Some(e);
            }
            if !t.is(i, WS) {
                return None;
            }
            // `\s*[\r\n]+`: the whitespace run up to and including its last line break.
            let k = t.run(i, WS);
            if let Some(last) = (i..k).rev().find(|&p| matches!(t.c[p], '\r' | '\n')) {
                return Some(last + 1);
            }
            // `\s+(?!\S)`, else `\s+`.
            Some(whitespace_not_before_text(t, i).unwrap_or(k))
        }
    }
}

/// `\s+(?!\S)` at `i`: a whitespace run, less its last character when text follows it (that
/// one goes with the text), so never a single whitespace character before text.
fn whitespace_not_before_text(t: &Chars<'_>, i: usize) -> Option<usize> {
    if !t.is(i, WS) {
        return None;
    }
    let k = t.run(i, WS);
    if k == t.c.len() {
        Some(k)
    } else {
        (k - 1 > i).then_some(k - 1)
    }
}

/// Splits `text` by one pattern into matches and the gaps between them (both kept, in order,
/// as a regex `find_iter` with the unmatched text between matches).
pub(crate) fn split<'a>(s: Split, text: &'a str, out: &mut Vec<&'a str>) {
    let t = Chars::new(text);
    let n = t.c.len();
    let (mut i, mut gap) = (0, 0);
    while i < n {
        match match_at(s, &t, i) {
            Some(e) => {
                if i > gap {
                    out.push(&t.text[t.at[gap]..t.at[i]]);
                }
                out.push(&t.text[t.at[i]..t.at[e]]);
                i = e;
                gap = e;
            }
            None => i += 1,
        }
    }
    if n > gap {
        out.push(&t.text[t.at[gap]..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fancy_regex::Regex;
    use proptest::prelude::*;

    /// The regexes llama.cpp applies, as a backtracking engine runs them: the reference the
    /// scanners must equal (on inputs short enough for it).
    fn regex(s: Split) -> &'static str {
        match s {
            Split::Digit => r"\p{N}",
            Split::Gpt2 => r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
            Split::Llama3 => {
                r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            }
            Split::PunctRun => r"[\p{P}\$\+<=>\^~\|]+",
            Split::NumRun => r"\p{N}+",
            Split::Digits3 => r"[0-9][0-9][0-9]",
        }
    }

    fn by_regex(s: Split, text: &str) -> Vec<&str> {
        let re = Regex::new(regex(s)).unwrap();
        let mut out = Vec::new();
        let mut last = 0;
        for m in re.find_iter(text) {
            let m = m.unwrap();
            if m.start() > last {
                out.push(&text[last..m.start()]);
            }
            if m.end() > m.start() {
                out.push(&text[m.start()..m.end()]);
            }
            last = m.end();
        }
        if last < text.len() {
            out.push(&text[last..]);
        }
        out
    }

    fn by_scanner(s: Split, text: &str) -> Vec<&str> {
        let mut v = Vec::new();
        split(s, text, &mut v);
        v
    }

    const ALL: [Split; 6] = [Split::Digit, Split::Gpt2, Split::Llama3, Split::PunctRun, Split::NumRun, Split::Digits3];

    #[test]
    fn scanners_equal_the_regexes_on_known_text() {
        let texts = [
            "Hello world",
            "  leading spaces and   runs of    spaces\t\ttabs\n\nnewlines\n",
            "don't I'LL we've they'Re 'd ''s x's",
            "Numbers: 0 12 345 6789 3.14159 1,000,000 and 2024-11-22T10:30:00Z",
            "Unicode: naïve café — “quotes” ½ ¾ ∑ ∫ √ 中文字符测试，日本語のテキスト 한국어",
            "emoji 🦀🦀 and\r\n\r\n  \n\t x\u{a0}y\u{2003}z ",
            "$+<=>^~| !?.,;:()[]{} <|im_end|>\n<|im_start|>",
            " ",
            "\n",
            "a\n \n b",
            "",
        ];
        for s in ALL {
            for t in texts {
                assert_eq!(by_scanner(s, t), by_regex(s, t), "{s:?} on {t:?}");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// Generated text from the characters the patterns tell apart.
        #[test]
        fn scanners_equal_the_regexes(chars in proptest::collection::vec(prop::sample::select(vec![
            'a', 'Z', 'é', '中', 's', 't', 'r', 'e', 'v', 'm', 'l', 'd', 'S', 'L', 'E', '\'',
            '0', '7', '½', '٣', ' ', ' ', '\t', '\n', '\r', '\u{a0}', '\u{2028}',
            '.', ',', '!', '$', '+', '<', '|', '~', '^', '`', '—', '“', '🦀', '\u{1}', '\u{301}',
        ]), 0..40)) {
            let t: String = chars.into_iter().collect();
            for s in ALL {
                prop_assert_eq!(by_scanner(s, &t), by_regex(s, &t), "{:?} on {:?}", s, t);
            }
        }
    }
}

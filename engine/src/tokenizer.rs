//! The two tokenizers GGUF Llama-family files carry, from their metadata, splitting text the
//! way llama.cpp does. Special tokens come first (when asked); then either
//! - `gpt2`: GPT-2 style byte-level BPE — the pre-tokenizer patterns of the model's `pre` type
//!   applied in sequence (`pretok.rs`), then merges by rank; or
//! - `llama`: SentencePiece (Gemma, Llama 2) — spaces written as `▁`, the text's characters
//!   merged pairwise by the score of the piece they make, highest first, and a character the
//!   vocabulary lacks written as its UTF-8 bytes' `<0xXX>` tokens (byte fallback).
//!
//! Time is O(n log n) in the text's length and nothing recurses, whatever the text.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Mutex;

use crate::gguf::{GgufFile, Value};
use crate::pretok::{self, Split};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer metadata {key}: {what}")]
    Metadata { key: &'static str, what: String },
    #[error("tokenizer model {0:?} is not supported (gpt2-style BPE and llama-style SentencePiece are)")]
    Model(String),
    #[error("pre-tokenizer {0:?} is not supported (smollm, starcoder, refact, codeshell, gpt2, llama-bpe, default)")]
    Pre(String),
    #[error("text piece {0:?} has no token and no byte fallback")]
    NoToken(String),
}

/// Token attributes as llama.cpp numbers them in `tokenizer.ggml.token_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_i64(v: i64) -> Self {
        match v {
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Normal,
        }
    }
}

/// GPT-2's reversible map from bytes to printable characters.
fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("valid code point")
        };
    }
    table
}

/// Words up to this many bytes are cached (and looked up whole in the vocabulary).
const MAX_CACHED_WORD: usize = 64;

/// Which of the two algorithms a vocabulary uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// GPT-2 byte-level BPE (`tokenizer.ggml.model = gpt2`).
    Bpe,
    /// SentencePiece with byte fallback (`tokenizer.ggml.model = llama`).
    Spm,
}

/// SentencePiece's space.
const SPM_SPACE: &str = "\u{2581}";

#[derive(Debug)]
pub struct Tokenizer {
    kind: Kind,
    /// SentencePiece: each piece's score (merges make the highest-scored piece first).
    scores: Vec<f32>,
    /// SentencePiece: a space before the text (`tokenizer.ggml.add_space_prefix`).
    add_space_prefix: bool,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    token_to_id: HashMap<String, u32>,
    /// (left, right) -> (rank, merged id)
    merges: rustc_hash::FxHashMap<(u32, u32), (u32, u32)>,
    byte_to_token: [Option<u32>; 256],
    char_to_byte: HashMap<char, u8>,
    byte_char: [char; 256],
    /// Characters of the longest token (each stands for one byte of text).
    longest_token: usize,
    /// The pre-tokenizer's patterns, applied in order.
    splits: &'static [Split],
    /// Special tokens matched in text, longest first (llama.cpp's order).
    specials: Vec<u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub add_bos: bool,
    cache: Mutex<HashMap<String, Vec<u32>>>,
}

impl Tokenizer {
    pub fn from_gguf(f: &GgufFile) -> Result<Self, TokenizerError> {
        let meta = |key: &'static str| f.get(key).ok_or(TokenizerError::Metadata { key, what: "missing".into() });
        let model = meta("tokenizer.ggml.model")?.as_str().unwrap_or("").to_string();
        let kind = match model.as_str() {
            "gpt2" => Kind::Bpe,
            "llama" => Kind::Spm,
            _ => return Err(TokenizerError::Model(model)),
        };
        let pre = f.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
        let tokens: Vec<String> = meta("tokenizer.ggml.tokens")?
            .as_array()
            .ok_or(TokenizerError::Metadata { key: "tokenizer.ggml.tokens", what: "not an array".into() })?
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or(TokenizerError::Metadata { key: "tokenizer.ggml.tokens", what: "not an array of strings".into() })?;
        if tokens.is_empty() || tokens.len() > u32::MAX as usize / 2 {
            return Err(TokenizerError::Metadata { key: "tokenizer.ggml.tokens", what: format!("{} tokens", tokens.len()) });
        }
        let types: Vec<TokenType> = match f.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
            Some(a) if a.len() == tokens.len() => a.iter().map(|v| TokenType::from_i64(v.as_i64().unwrap_or(1))).collect(),
            Some(a) => {
                return Err(TokenizerError::Metadata {
                    key: "tokenizer.ggml.token_type",
                    what: format!("{} entries for {} tokens", a.len(), tokens.len()),
                })
            }
            None => vec![TokenType::Normal; tokens.len()],
        };
        let mut token_to_id = HashMap::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            token_to_id.entry(t.clone()).or_insert(u32::try_from(i).expect("bounded above"));
        }
        let mut merges = rustc_hash::FxHashMap::default();
        if let Some(list) = f.get("tokenizer.ggml.merges").and_then(Value::as_array) {
            for (rank, m) in list.iter().enumerate() {
                let s = m.as_str().ok_or(TokenizerError::Metadata { key: "tokenizer.ggml.merges", what: "not strings".into() })?;
                // The separator is the first space after the first character (a merge side may
                // itself be a space-like byte character, never a plain space).
                let Some((l, r)) = s.char_indices().nth(1).and_then(|(i, _)| s[i..].find(' ').map(|j| (&s[..i + j], &s[i + j + 1..])))
                else {
                    return Err(TokenizerError::Metadata {
                        key: "tokenizer.ggml.merges",
                        what: format!("merge {rank} {s:?} has no separator"),
                    });
                };
                let merged = format!("{l}{r}");
                if let (Some(&a), Some(&b), Some(&c)) = (token_to_id.get(l), token_to_id.get(r), token_to_id.get(&merged)) {
                    merges.entry((a, b)).or_insert((u32::try_from(rank).unwrap_or(u32::MAX), c));
                }
            }
        }
        let scores: Vec<f32> = match (kind, f.get("tokenizer.ggml.scores").and_then(Value::as_array)) {
            (Kind::Bpe, _) => Vec::new(),
            (Kind::Spm, Some(a)) if a.len() == tokens.len() => a
                .iter()
                .map(Value::as_f32)
                .collect::<Option<_>>()
                .ok_or(TokenizerError::Metadata { key: "tokenizer.ggml.scores", what: "not an array of numbers".into() })?,
            (Kind::Spm, a) => {
                return Err(TokenizerError::Metadata {
                    key: "tokenizer.ggml.scores",
                    what: a.map_or_else(|| "missing".into(), |a| format!("{} entries for {} tokens", a.len(), tokens.len())),
                })
            }
        };
        let byte_char = byte_to_char_table();
        let mut byte_to_token = [None; 256];
        let mut char_to_byte = HashMap::new();
        for (b, &c) in byte_char.iter().enumerate() {
            let b8 = u8::try_from(b).expect("< 256");
            char_to_byte.insert(c, b8);
            byte_to_token[b] = match kind {
                Kind::Bpe => token_to_id.get(c.to_string().as_str()).copied(),
                // SentencePiece's byte pieces are spelled `<0x0A>` and typed as bytes.
                Kind::Spm => token_to_id.get(format!("<0x{b:02X}>").as_str()).copied().filter(|&i| types[i as usize] == TokenType::Byte),
            };
        }
        // SentencePiece has no pre-tokenizer: the whole text is one word.
        let splits = match kind {
            Kind::Bpe => pretok::splits(pre).ok_or_else(|| TokenizerError::Pre(pre.to_string()))?,
            Kind::Spm => &[],
        };
        let mut specials: Vec<u32> = (0..tokens.len())
            .filter(|&i| matches!(types[i], TokenType::Control | TokenType::UserDefined | TokenType::Unknown) && !tokens[i].is_empty())
            .map(|i| u32::try_from(i).expect("bounded"))
            .collect();
        specials.sort_by_key(|&i| std::cmp::Reverse(tokens[i as usize].len()));
        let id =
            |key: &str| f.get(key).and_then(Value::as_u64).and_then(|v| u32::try_from(v).ok()).filter(|&v| (v as usize) < tokens.len());
        let eot = ["<|im_end|>", "<|eot_id|>", "<end_of_turn>"].iter().find_map(|t| token_to_id.get(*t)).copied();
        let longest_token = tokens.iter().map(|t| t.chars().count()).max().unwrap_or(0);
        Ok(Self {
            kind,
            scores,
            add_space_prefix: kind == Kind::Spm && f.get("tokenizer.ggml.add_space_prefix").and_then(Value::as_bool).unwrap_or(true),
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            eot,
            add_bos: f.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(false),
            tokens,
            types,
            token_to_id,
            merges,
            byte_to_token,
            char_to_byte,
            byte_char,
            longest_token,
            splits,
            specials,
            cache: Mutex::new(HashMap::new()),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// Whether a token stands for plain text (a normal or byte token), not a control,
    /// user-defined or unused one: text can spell the former but never forge the latter.
    pub fn is_plain_text(&self, id: u32) -> bool {
        matches!(self.types.get(id as usize), Some(TokenType::Normal | TokenType::Byte))
    }

    /// The token of one raw byte, if the vocabulary has one.
    pub fn byte_token(&self, b: u8) -> Option<u32> {
        self.byte_to_token[b as usize]
    }

    /// Whether generation should stop at this token (end of generation).
    pub fn is_eog(&self, id: u32) -> bool {
        Some(id) == self.eos || Some(id) == self.eot
    }

    /// Tokenizes `text`. With `parse_special`, control tokens written in the text (such as
    /// `<|im_start|>`) become those tokens, as llama.cpp's `parse_special`; user-defined tokens
    /// are always matched. Adds BOS first when `add_bos` is set and the model has one.
    pub fn encode(&self, text: &str, add_bos: bool, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        if add_bos {
            if let Some(b) = self.bos {
                out.push(b);
            }
        }
        enum Frag<'a> {
            Raw(&'a str),
            Tok(u32),
        }
        let mut frags = vec![Frag::Raw(text)];
        for &sp in &self.specials {
            let ty = self.types[sp as usize];
            if !parse_special && matches!(ty, TokenType::Control | TokenType::Unknown) {
                continue;
            }
            let pat = self.tokens[sp as usize].as_str();
            let mut next = Vec::with_capacity(frags.len());
            for f in frags {
                match f {
                    Frag::Raw(s) if s.contains(pat) => {
                        let mut rest = s;
                        while let Some(i) = rest.find(pat) {
                            if i > 0 {
                                next.push(Frag::Raw(&rest[..i]));
                            }
                            next.push(Frag::Tok(sp));
                            rest = &rest[i + pat.len()..];
                        }
                        if !rest.is_empty() {
                            next.push(Frag::Raw(rest));
                        }
                    }
                    other => next.push(other),
                }
            }
            frags = next;
        }
        // SentencePiece puts a space before text that starts the input or follows a special
        // token, where the model asks for it (llama.cpp's `is_prev_special`).
        let mut prev_special = true;
        for f in frags {
            match f {
                Frag::Tok(t) => {
                    out.push(t);
                    prev_special = true;
                }
                Frag::Raw(s) if self.kind == Kind::Spm => {
                    let prefix = if self.add_space_prefix && prev_special { SPM_SPACE } else { "" };
                    self.spm(&format!("{prefix}{}", s.replace(' ', SPM_SPACE)), &mut out)?;
                    prev_special = false;
                }
                Frag::Raw(s) => self.encode_raw(s, &mut out)?,
            }
        }
        Ok(out)
    }

    fn encode_raw(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let mut pieces = vec![text];
        for &sp in self.splits {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for p in pieces {
                pretok::split(sp, p, &mut next);
            }
            pieces = next;
        }
        for word in pieces {
            // Only short words are cached: they repeat; a long one would pin its bytes (and
            // a hostile text could fill the cache with megabytes).
            let cacheable = word.len() <= MAX_CACHED_WORD;
            if cacheable {
                if let Some(ids) = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(word) {
                    out.extend_from_slice(ids);
                    continue;
                }
            }
            let start = out.len();
            self.bpe(word, out)?;
            if cacheable {
                let mut cache = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if cache.len() < 1 << 16 {
                    cache.insert(word.to_string(), out[start..].to_vec());
                }
            }
        }
        Ok(())
    }

    /// Byte-level BPE of one word: the pair of lowest merge rank is merged first, the leftmost
    /// among equal ranks (GPT-2's rule), until no pair merges. A heap of candidate pairs over
    /// a linked list of symbols makes this O(n log n) in the word's length (rescanning every
    /// pair after each merge, as a plain loop does, is quadratic: 80,000 characters without a
    /// space took 39 s). A popped pair is used only if both of its symbols are still the ones
    /// it was made from.
    fn bpe(&self, word: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        // A word the vocabulary holds whole is that token (no longer than the longest token).
        if word.len() <= self.longest_token {
            let encoded: String = word.bytes().map(|b| self.byte_char[b as usize]).collect();
            if let Some(&id) = self.token_to_id.get(&encoded) {
                out.push(id);
                return Ok(());
            }
        }
        let n = word.len();
        if n > u32::MAX as usize {
            return Err(TokenizerError::NoToken(format!("a word of {n} bytes (at most 4 GiB)")));
        }
        let mut sym: Vec<u32> = Vec::with_capacity(n);
        for b in word.bytes() {
            sym.push(self.byte_to_token[b as usize].ok_or_else(|| TokenizerError::NoToken(word.chars().take(64).collect()))?);
        }
        // Doubly linked list over positions; `NONE` ends it; a merged-away symbol is `DEAD`.
        const NONE: usize = usize::MAX;
        const DEAD: u32 = u32::MAX;
        let mut prev: Vec<usize> = (0..n).map(|i| if i == 0 { NONE } else { i - 1 }).collect();
        let mut next: Vec<usize> = (0..n).map(|i| if i + 1 == n { NONE } else { i + 1 }).collect();
        // (rank, left position, left symbol, right symbol): the smallest first.
        let rank = |a: u32, b: u32| self.merges.get(&(a, b)).map(|&(r, _)| r);
        // Heap keys: rank above, left position below — smallest first is lowest rank, then
        // leftmost. A popped key is stale when its left symbol was merged away or its pair has
        // changed; ranks are unique per pair, so an equal rank at the position is the same pair.
        let key = |r: u32, l: usize| Reverse((u64::from(r) << 32) | l as u64);
        let mut heap: BinaryHeap<Reverse<u64>> =
            (0..n.saturating_sub(1)).filter_map(|i| rank(sym[i], sym[i + 1]).map(|r| key(r, i))).collect();
        while let Some(Reverse(k)) = heap.pop() {
            let (want, l) = ((k >> 32) as u32, (k & 0xffff_ffff) as usize);
            let r = next[l];
            if r == NONE || sym[l] == DEAD || sym[r] == DEAD {
                continue;
            }
            let Some(&(got, merged)) = self.merges.get(&(sym[l], sym[r])) else { continue };
            if got != want {
                continue;
            }
            sym[l] = merged;
            sym[r] = DEAD;
            let rr = next[r];
            next[l] = rr;
            if rr != NONE {
                prev[rr] = l;
                if let Some(rk) = rank(merged, sym[rr]) {
                    heap.push(key(rk, l));
                }
            }
            if prev[l] != NONE {
                if let Some(rk) = rank(sym[prev[l]], merged) {
                    heap.push(key(rk, prev[l]));
                }
            }
        }
        let mut i = 0;
        while i != NONE && i < n {
            out.push(sym[i]);
            i = next[i];
        }
        Ok(())
    }

    /// SentencePiece over one fragment (spaces already `▁`): every character starts as a
    /// symbol; the adjacent pair whose concatenation is the highest-scored piece merges first
    /// (the leftmost among equal scores), until no pair makes a piece; a final symbol that is
    /// not a piece (a character the vocabulary lacks) is written as its bytes' tokens. A heap
    /// over a linked list, as in [`Self::bpe`]: O(n log n). Symbols stay contiguous slices of
    /// `text`, so a candidate is looked up without building a string.
    fn spm(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        const NONE: usize = usize::MAX;
        // Symbols: start offset and length in bytes (0 = merged away), and the list links.
        let mut start: Vec<usize> = Vec::new();
        let mut len: Vec<usize> = Vec::new();
        for (i, c) in text.char_indices() {
            start.push(i);
            len.push(c.len_utf8());
        }
        let n = start.len();
        let mut prev: Vec<usize> = (0..n).map(|i| if i == 0 { NONE } else { i - 1 }).collect();
        let mut next: Vec<usize> = (0..n).map(|i| if i + 1 == n { NONE } else { i + 1 }).collect();
        // Heap entries: (score, leftmost first, the pair's byte length to tell stale ones).
        #[derive(PartialEq)]
        struct Bigram {
            score: f32,
            left: usize,
            size: usize,
        }
        impl Eq for Bigram {}
        impl Ord for Bigram {
            fn cmp(&self, o: &Self) -> std::cmp::Ordering {
                self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
            }
        }
        impl PartialOrd for Bigram {
            fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(o))
            }
        }
        let mut heap = BinaryHeap::new();
        let candidate = |l: usize, r: usize, start: &[usize], len: &[usize]| -> Option<Bigram> {
            if l == NONE || r == NONE {
                return None;
            }
            let size = len[l] + len[r];
            let id = *self.token_to_id.get(&text[start[l]..start[l] + size])?;
            Some(Bigram { score: self.scores[id as usize], left: l, size })
        };
        for i in 1..n {
            heap.extend(candidate(i - 1, i, &start, &len));
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (b.left, next[b.left]);
            // Stale: the left symbol was merged away or grew, or its right neighbour changed.
            if len[l] == 0 || r == NONE || len[r] == 0 || len[l] + len[r] != b.size {
                continue;
            }
            len[l] += len[r];
            len[r] = 0;
            next[l] = next[r];
            if next[r] != NONE {
                prev[next[r]] = l;
            }
            heap.extend(candidate(prev[l], l, &start, &len));
            heap.extend(candidate(l, next[l], &start, &len));
        }
        let mut i = if n == 0 { NONE } else { 0 };
        while i != NONE {
            let piece = &text[start[i]..start[i] + len[i]];
            match self.token_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for b in piece.bytes() {
                        out.push(self.byte_to_token[b as usize].ok_or_else(|| TokenizerError::NoToken(piece.to_string()))?);
                    }
                }
            }
            i = next[i];
        }
        Ok(())
    }

    /// The bytes a token stands for. Control tokens render as their text only with
    /// `render_special` (llama.cpp's `special` flag).
    pub fn token_bytes(&self, id: u32, render_special: bool, out: &mut Vec<u8>) {
        let Some(text) = self.tokens.get(id as usize) else { return };
        match self.types[id as usize] {
            TokenType::Control | TokenType::Unknown | TokenType::Unused => {
                if render_special {
                    out.extend_from_slice(text.as_bytes());
                }
            }
            TokenType::UserDefined => out.extend_from_slice(text.as_bytes()),
            TokenType::Byte if self.kind == Kind::Spm => {
                out.extend(text.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')).and_then(|h| u8::from_str_radix(h, 16).ok()));
            }
            _ if self.kind == Kind::Spm => out.extend_from_slice(text.replace(SPM_SPACE, " ").as_bytes()),
            _ => {
                for c in text.chars() {
                    match self.char_to_byte.get(&c) {
                        Some(&b) => out.push(b),
                        None => {
                            let mut buf = [0u8; 4];
                            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                        }
                    }
                }
            }
        }
    }

    /// Detokenizes to bytes (exact: a token sequence from `encode` gives back the text).
    pub fn decode(&self, ids: &[u32], render_special: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for &id in ids {
            self.token_bytes(id, render_special, &mut out);
        }
        out
    }
}

/// Turns a stream of token bytes into UTF-8 text, holding back an incomplete character until
/// its remaining bytes arrive (a token may end in the middle of a multi-byte character).
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        match std::str::from_utf8(&self.pending) {
            Ok(s) => {
                let s = s.to_string();
                self.pending.clear();
                s
            }
            Err(e) => {
                let valid = e.valid_up_to();
                // An invalid sequence (not merely incomplete) is emitted lossily so it cannot
                // block the stream forever.
                let cut = if e.error_len().is_some() { self.pending.len() } else { valid };
                let s = String::from_utf8_lossy(&self.pending[..cut]).into_owned();
                self.pending.drain(..cut);
                s
            }
        }
    }
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;

    /// The default model's tokenizer (the GGUF's metadata only; no weights are read).
    fn tk() -> &'static Tokenizer {
        static T: OnceLock<Tokenizer> = OnceLock::new();
        T.get_or_init(|| {
            let f = GgufFile::open(&llms_tests::model_path()).expect("the default model (make model)");
            Tokenizer::from_gguf(&f).expect("its tokenizer")
        })
    }

    /// The scalar reference of [`Tokenizer::bpe`] (its code before the heap): a word the
    /// vocabulary holds whole is that token; else rescan every pair, merge the lowest rank
    /// (leftmost among equals), repeat — quadratic, obviously right.
    fn bpe_reference(t: &Tokenizer, word: &str) -> Vec<u32> {
        let encoded: String = word.bytes().map(|b| t.byte_char[b as usize]).collect();
        if let Some(&id) = t.token_to_id.get(&encoded) {
            return vec![id];
        }
        let mut syms: Vec<u32> = word.bytes().map(|b| t.byte_to_token[b as usize].unwrap()).collect();
        loop {
            let mut best: Option<(u32, usize, u32)> = None;
            for i in 0..syms.len().saturating_sub(1) {
                if let Some(&(rank, merged)) = t.merges.get(&(syms[i], syms[i + 1])) {
                    if best.is_none_or(|(r, _, _)| rank < r) {
                        best = Some((rank, i, merged));
                    }
                }
            }
            let Some((_, i, merged)) = best else { break };
            syms[i] = merged;
            syms.remove(i + 1);
        }
        syms
    }

    fn bpe(t: &Tokenizer, word: &str) -> Vec<u32> {
        let mut v = Vec::new();
        t.bpe(word, &mut v).unwrap();
        v
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]
        /// Words from letters that merge a lot (and repeated pairs, where leftmost-first decides).
        #[test]
        fn heap_bpe_equals_the_reference(w in "[aestnrl ]{1,60}|[a-z]{1,200}|(ab){1,50}|a{1,300}") {
            let t = tk();
            prop_assert_eq!(bpe(t, &w), bpe_reference(t, &w));
        }
    }

    /// Text no pre-tokenizer split: one word of 1 MB, runs of one character, every code point
    /// below 256 and multi-byte characters — no panic, no stack overflow, and the ids spell the
    /// text back exactly. (Invalid UTF-8 never reaches `encode`: it takes `&str`; the protocol
    /// decoders refuse it, client/tests/proto_hostile.rs.)
    #[test]
    fn hostile_text_tokenizes_and_round_trips() {
        let t = tk();
        let word: String = "abcdefghij".repeat(100_000);
        let runs = ["a".repeat(300_000), " ".repeat(300_000), "\n".repeat(100_000), "é".repeat(100_000), "🦀".repeat(50_000)];
        // Every code point below 256 whose bytes the vocabulary has (SmolLM2's lacks a few
        // control bytes: a text holding one is refused with an error, as llama.cpp refuses it).
        let has = |c: &char| c.to_string().bytes().all(|b| t.byte_to_token[b as usize].is_some());
        let bytes: String = (0u32..256).filter_map(char::from_u32).filter(has).collect::<String>().repeat(100);
        if let Some(c) = (0u32..256).filter_map(char::from_u32).find(|c| !has(c)) {
            let text = format!("{}{c}", "x".repeat(100_000));
            assert!(matches!(t.encode(&text, false, false), Err(TokenizerError::NoToken(_))));
        }
        let digits = "1234567890".repeat(50_000);
        let specials = "<|im_start|>".repeat(20_000);
        for text in [&word, &bytes, &digits, &specials].into_iter().chain(runs.iter()) {
            for special in [false, true] {
                let ids = t.encode(text, false, special).unwrap();
                assert!(!ids.is_empty());
                assert_eq!(t.decode(&ids, true), text.as_bytes(), "round trip of {}...", &text[..text.floor_char_boundary(16)]);
            }
        }
    }

    /// Long words are not kept in the cache (a hostile text could fill it with megabytes).
    #[test]
    fn the_cache_keeps_only_short_words() {
        let t = tk();
        let long = "q".repeat(10_000);
        t.encode(&long, false, false).unwrap();
        let cache = t.cache.lock().unwrap();
        assert!(cache.keys().all(|k| k.len() <= MAX_CACHED_WORD));
    }
}

//! GPT-2 style byte-level BPE from GGUF metadata, splitting text the way llama.cpp does:
//! special tokens first (when asked), then the pre-tokenizer regexes of the model's `pre` type
//! applied in sequence, then byte-level BPE merges by rank.

use std::collections::HashMap;
use std::sync::Mutex;

use fancy_regex::Regex;

use crate::gguf::{GgufFile, Value};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer metadata {key}: {what}")]
    Metadata { key: &'static str, what: String },
    #[error("tokenizer model {0:?} is not supported (only gpt2-style BPE)")]
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

#[derive(Debug)]
pub struct Tokenizer {
    tokens: Vec<String>,
    types: Vec<TokenType>,
    token_to_id: HashMap<String, u32>,
    /// (left, right) -> (rank, merged id)
    merges: HashMap<(u32, u32), (u32, u32)>,
    byte_to_token: [Option<u32>; 256],
    char_to_byte: HashMap<char, u8>,
    byte_char: [char; 256],
    regexes: Vec<Regex>,
    /// Special tokens matched in text, longest first (llama.cpp's order).
    specials: Vec<u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub add_bos: bool,
    cache: Mutex<HashMap<String, Vec<u32>>>,
}

fn pre_regexes(pre: &str) -> Result<Vec<&'static str>, TokenizerError> {
    const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
    Ok(match pre {
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => vec![r"\p{N}", GPT2],
        "gpt-2" | "gpt2" | "mpt" | "olmo" | "jais" => vec![GPT2],
        "llama-bpe" | "llama3" | "falcon3" | "pixtral" => vec![
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
        "default" => vec![r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
        other => return Err(TokenizerError::Pre(other.to_string())),
    })
}

impl Tokenizer {
    pub fn from_gguf(f: &GgufFile) -> Result<Self, TokenizerError> {
        let meta = |key: &'static str| f.get(key).ok_or(TokenizerError::Metadata { key, what: "missing".into() });
        let model = meta("tokenizer.ggml.model")?.as_str().unwrap_or("").to_string();
        if model != "gpt2" {
            return Err(TokenizerError::Model(model));
        }
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
        let mut merges = HashMap::new();
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
        let byte_char = byte_to_char_table();
        let mut byte_to_token = [None; 256];
        let mut char_to_byte = HashMap::new();
        for (b, &c) in byte_char.iter().enumerate() {
            let b8 = u8::try_from(b).expect("< 256");
            char_to_byte.insert(c, b8);
            byte_to_token[b] = token_to_id.get(c.to_string().as_str()).copied();
        }
        let regexes = pre_regexes(pre)?.into_iter().map(|r| Regex::new(r).expect("built-in pre-tokenizer regex compiles")).collect();
        let mut specials: Vec<u32> = (0..tokens.len())
            .filter(|&i| matches!(types[i], TokenType::Control | TokenType::UserDefined | TokenType::Unknown) && !tokens[i].is_empty())
            .map(|i| u32::try_from(i).expect("bounded"))
            .collect();
        specials.sort_by_key(|&i| std::cmp::Reverse(tokens[i as usize].len()));
        let id =
            |key: &str| f.get(key).and_then(Value::as_u64).and_then(|v| u32::try_from(v).ok()).filter(|&v| (v as usize) < tokens.len());
        let eot = token_to_id.get("<|im_end|>").or_else(|| token_to_id.get("<|eot_id|>")).copied();
        Ok(Self {
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
            regexes,
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
        for f in frags {
            match f {
                Frag::Tok(t) => out.push(t),
                Frag::Raw(s) => self.encode_raw(s, &mut out)?,
            }
        }
        Ok(out)
    }

    fn encode_raw(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let mut pieces = vec![text];
        for re in &self.regexes {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for p in pieces {
                let mut last = 0;
                for m in re.find_iter(p) {
                    let m = m.expect("pre-tokenizer regex cannot fail on valid UTF-8 within its backtrack limit");
                    if m.start() > last {
                        next.push(&p[last..m.start()]);
                    }
                    if m.end() > m.start() {
                        next.push(&p[m.start()..m.end()]);
                    }
                    last = m.end();
                }
                if last < p.len() {
                    next.push(&p[last..]);
                }
            }
            pieces = next;
        }
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        for word in pieces {
            if let Some(ids) = cache.get(word) {
                out.extend_from_slice(ids);
                continue;
            }
            let ids = self.bpe(word)?;
            out.extend_from_slice(&ids);
            if cache.len() < 1 << 16 {
                cache.insert(word.to_string(), ids);
            }
        }
        Ok(())
    }

    fn bpe(&self, word: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoded: String = word.bytes().map(|b| self.byte_char[b as usize]).collect();
        if let Some(&id) = self.token_to_id.get(&encoded) {
            return Ok(vec![id]);
        }
        let mut syms: Vec<u32> = Vec::with_capacity(word.len());
        for b in word.bytes() {
            syms.push(self.byte_to_token[b as usize].ok_or_else(|| TokenizerError::NoToken(word.to_string()))?);
        }
        loop {
            let mut best: Option<(u32, usize, u32)> = None;
            for i in 0..syms.len().saturating_sub(1) {
                if let Some(&(rank, merged)) = self.merges.get(&(syms[i], syms[i + 1])) {
                    if best.is_none_or(|(r, _, _)| rank < r) {
                        best = Some((rank, i, merged));
                    }
                }
            }
            let Some((_, i, merged)) = best else { break };
            syms[i] = merged;
            syms.remove(i + 1);
        }
        Ok(syms)
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

//! A GGUF model file read as far as the forward pass needs before any weight is touched: the
//! architecture and hyper-parameters checked, the tokenizer, the small tensors (norms, biases)
//! dequantized, and every large matrix located and its shape checked. [`crate::model`] builds a
//! `Model` from this; [`crate::weights`] lays out a weight image from it.
#![allow(clippy::cast_possible_truncation)]

use std::path::Path;

use crate::gguf::{GgufError, GgufFile, TensorInfo, Value};
use crate::kernels::{self, ActKind};
use crate::quant::{self, GgmlType};
use crate::tokenizer::{Tokenizer, TokenizerError};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("architecture {0:?} is not supported (supported: llama — also Llama 2/3, Mistral and SmolLM files —, qwen2, gemma3)")]
    Arch(String),
    #[error("model metadata {key}: {what}")]
    Metadata { key: String, what: String },
    #[error("tensor {name}: {what}")]
    Tensor { name: String, what: String },
    #[error("context full: {needed} positions needed, the session holds {capacity}")]
    ContextFull { needed: usize, capacity: usize },
    #[error(transparent)]
    Kv(#[from] crate::kvcache::KvError),
    #[error("token id {0} is outside the vocabulary")]
    BadToken(u32),
    #[error("batch: {0}")]
    Batch(&'static str),
    #[error("position {pos} attends to positions the sliding window dropped (the first {dead} chunks keep only their global layers)")]
    WindowDropped { pos: usize, dead: usize },
}

pub type Result<T> = std::result::Result<T, ModelError>;

/// Hyper-parameters read from the GGUF metadata.
#[derive(Debug, Clone)]
pub struct Config {
    pub arch: String,
    pub n_layers: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub ctx_len: usize,
    pub rope_base: f32,
    pub rope_dims: usize,
    /// RoPE rotates the pairs `(i, i + dims/2)` (llama.cpp's "neox" mode: qwen2) instead of
    /// adjacent channels (llama).
    pub rope_neox: bool,
    /// Linear RoPE scaling: positions are multiplied by this (`1 / rope.scaling.factor`).
    pub rope_freq_scale: f32,
    /// Llama 3's per-pair frequency divisors (`rope_freqs.weight`), `rope_dims / 2` of them.
    pub rope_factors: Option<Vec<f32>>,
    pub norm_eps: f32,
    /// Token embeddings are multiplied by this (Gemma: `sqrt(dim)`).
    pub embd_scale: Option<f32>,
    /// The gated feed-forward's activation: GELU (tanh form, Gemma) instead of SiLU.
    pub ffn_gelu: bool,
    /// Interleaved sliding-window attention (Gemma 3): which layers see only the last
    /// `window` positions, and the RoPE base they use.
    pub swa: Option<SlidingWindow>,
}

/// Gemma 3's local layers: every layer but each `every`-th attends to the last `window`
/// positions (itself included), with RoPE base `rope_base`; the others are global.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlidingWindow {
    pub window: usize,
    pub every: usize,
    pub rope_base: f32,
}

impl Config {
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// The query heads' width: `dim` for Llama, wider for Gemma 3 (4 heads of 256 over 640).
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// The positions layer `layer` attends to before a query at `pos`: the first visible one.
    pub fn window_start(&self, layer: usize, pos: usize) -> usize {
        match self.swa {
            Some(w) if self.is_local(layer) => (pos + 1).saturating_sub(w.window),
            _ => 0,
        }
    }

    /// Whether `layer` is a sliding-window (local) layer.
    pub fn is_local(&self, layer: usize) -> bool {
        self.swa.is_some_and(|w| !(layer + 1).is_multiple_of(w.every))
    }

    /// Where each layer's K/V lies in a chunk of the cache: the global layers first, then the
    /// local ones, each in layer order (the identity without a sliding window). Once every
    /// token of a chunk has left the window, only the global layers are ever read again, and
    /// they are then the chunk's first bytes: a memory manager keeps that prefix and gives the
    /// rest back ([`Config::dead_chunks`]).
    pub fn kv_slots(&self) -> Vec<usize> {
        let globals: Vec<usize> = (0..self.n_layers).filter(|&l| !self.is_local(l)).collect();
        let locals = (0..self.n_layers).filter(|&l| self.is_local(l));
        let order: Vec<usize> = globals.iter().copied().chain(locals).collect();
        let mut slot = vec![0; self.n_layers];
        for (s, &l) in order.iter().enumerate() {
            slot[l] = s;
        }
        slot
    }

    /// Layers a chunk keeps once it is dead: the global ones (all layers without a window).
    pub fn kept_layers(&self) -> usize {
        (0..self.n_layers).filter(|&l| !self.is_local(l)).count()
    }

    /// Leading chunks of `chunk_tokens` tokens that no local layer reads again once the cache
    /// holds `tokens` positions: every position of theirs is before the window of the next
    /// query (at `tokens`) and so of every later one. Zero without a sliding window.
    pub fn dead_chunks(&self, tokens: usize, chunk_tokens: usize) -> usize {
        match self.swa {
            Some(w) if self.kept_layers() < self.n_layers => dead_chunks(w.window, tokens, chunk_tokens),
            _ => 0,
        }
    }
}

/// Leading chunks of `chunk_tokens` tokens wholly before a `window`-token window at the next
/// query, `tokens`: every position `p` of theirs has `p < tokens + 1 - window`.
pub fn dead_chunks(window: usize, tokens: usize, chunk_tokens: usize) -> usize {
    (tokens + 1).saturating_sub(window) / chunk_tokens.max(1)
}

/// A weight tensor: its type, shape, and where its bytes are (`offset` into the GGUF file, or
/// into the weight image when `in_image`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct W {
    pub(crate) ty: GgmlType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) offset: usize,
    pub(crate) len: usize,
    pub(crate) in_image: bool,
}

fn meta_u(f: &GgufFile, key: &str) -> Result<usize> {
    f.get(key)
        .and_then(Value::as_u64)
        .and_then(|v| usize::try_from(v).ok())
        .filter(|&v| v > 0 && v < 1 << 24)
        .ok_or_else(|| ModelError::Metadata { key: key.into(), what: "missing or not a sane positive integer".into() })
}

/// Linear RoPE scaling as llama.cpp reads it (`rope.scaling.factor`, or the older
/// `rope.scale_linear`; 0 or absent: none). YaRN and LongRoPE are refused: they change more
/// than the frequencies, and a model run without them would answer wrongly, not fail.
fn rope_freq_scale(f: &GgufFile, arch: &str) -> Result<f32> {
    let ty_key = format!("{arch}.rope.scaling.type");
    match f.get(&ty_key).map(|v| v.as_str().unwrap_or("?")) {
        None | Some("none" | "linear") => {}
        Some(other) => {
            return Err(ModelError::Metadata { key: ty_key, what: format!("RoPE scaling {other:?} is not supported (none, linear)") })
        }
    }
    let key = [format!("{arch}.rope.scaling.factor"), format!("{arch}.rope.scale_linear")].into_iter().find(|k| f.get(k).is_some());
    let Some(key) = key else { return Ok(1.0) };
    match f.get(&key).and_then(Value::as_f32) {
        Some(0.0) => Ok(1.0),
        Some(x) if x.is_finite() && x > 0.0 => Ok(1.0 / x),
        v => Err(ModelError::Metadata { key, what: format!("{v:?} is not a positive number") }),
    }
}

/// The small tensors of a layer (always resident) and where its matrices are in the file.
#[derive(Debug)]
pub(crate) struct RawLayer {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) bq: Option<Vec<f32>>,
    pub(crate) bk: Option<Vec<f32>>,
    pub(crate) bv: Option<Vec<f32>>,
    /// Gemma 3: RMS norms of each query and key head, and of the attention's and the
    /// feed-forward's outputs before they are added to the residual.
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    pub(crate) post_attn_norm: Option<Vec<f32>>,
    pub(crate) post_ffn_norm: Option<Vec<f32>>,
    /// q, k, v, o, gate, up, down: the order of [`MATRIX_NAMES`].
    pub(crate) mats: [W; 7],
}

/// The matrices of a layer, in the order the forward pass reads them.
pub(crate) const MATRIX_NAMES: [&str; 7] = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"];

/// A GGUF file checked and read up to its large matrices, which are only located.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub(crate) file: GgufFile,
    pub(crate) config: Config,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) layers: Vec<RawLayer>,
    pub(crate) tok_embd: W,
    pub(crate) output: W,
    pub(crate) output_norm: Vec<f32>,
}

impl Parsed {
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let mut file = GgufFile::open(path)?;
        let arch = file.get("general.architecture").and_then(Value::as_str).unwrap_or("").to_string();
        if !matches!(arch.as_str(), "llama" | "qwen2" | "gemma3") {
            return Err(ModelError::Arch(arch));
        }
        let gemma = arch == "gemma3";
        let k = |s: &str| format!("{arch}.{s}");
        let dim = meta_u(&file, &k("embedding_length"))?;
        let n_heads = meta_u(&file, &k("attention.head_count"))?;
        let n_kv_heads = file.get(&k("attention.head_count_kv")).map_or(Ok(n_heads), |_| meta_u(&file, &k("attention.head_count_kv")))?;
        // A head's width is the key length where the file says it (Gemma's heads are wider
        // than dim / heads), else dim / heads; values as wide as keys are all we run.
        let head_dim = match file.get(&k("attention.key_length")) {
            Some(_) => meta_u(&file, &k("attention.key_length"))?,
            None if dim % n_heads == 0 => dim / n_heads,
            None => 0,
        };
        if head_dim == 0 || n_heads % n_kv_heads != 0 {
            return Err(ModelError::Metadata {
                key: k("attention.head_count"),
                what: format!("{dim} dims, {n_heads} heads, {n_kv_heads} kv heads do not divide"),
            });
        }
        if let Some(v) = file.get(&k("attention.value_length")) {
            if v.as_u64() != Some(head_dim as u64) {
                return Err(ModelError::Metadata {
                    key: k("attention.value_length"),
                    what: format!("{v:?}: values narrower or wider than keys ({head_dim}) are not supported"),
                });
            }
        }
        // What the Gemma family may carry that this forward pass does not do: refused by name
        // rather than run wrongly.
        for (key, what) in [
            ("final_logit_softcapping", "logit soft-capping"),
            ("attn_logit_softcapping", "attention soft-capping"),
            ("attention.scale", "an attention scale other than 1/sqrt(head width)"),
        ] {
            if file.get(&k(key)).and_then(Value::as_f32).is_some_and(|x| x != 0.0) {
                return Err(ModelError::Metadata { key: k(key), what: format!("{what} is not supported") });
            }
        }
        // Gemma 3's pattern and local base are llama.cpp's constants for the architecture (five
        // local layers, then a global one); other architectures' windows are not applied by
        // llama.cpp either (Mistral's llama files).
        let swa = if gemma {
            Some(SlidingWindow { window: meta_u(&file, &k("attention.sliding_window"))?, every: 6, rope_base: 10_000.0 })
        } else {
            None
        };
        let tokenizer = Tokenizer::from_gguf(&file)?;
        // The vocabulary now lives in the tokenizer; the parsed arrays are ~10 MiB of copies.
        for key in ["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"] {
            file.header.metadata.remove(key);
        }
        let config = Config {
            n_layers: meta_u(&file, &k("block_count"))?,
            ffn_dim: meta_u(&file, &k("feed_forward_length"))?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab: tokenizer.vocab_size(),
            ctx_len: meta_u(&file, &k("context_length"))?,
            rope_base: file.get(&k("rope.freq_base")).and_then(Value::as_f32).unwrap_or(10000.0),
            rope_dims: file
                .get(&k("rope.dimension_count"))
                .map_or(Ok(head_dim), |_| meta_u(&file, &k("rope.dimension_count")))?
                .min(head_dim),
            rope_neox: arch == "qwen2" || gemma,
            rope_freq_scale: rope_freq_scale(&file, &arch)?,
            rope_factors: None,
            norm_eps: file.get(&k("attention.layer_norm_rms_epsilon")).and_then(Value::as_f32).unwrap_or(1e-5),
            embd_scale: gemma.then(|| (dim as f32).sqrt()),
            ffn_gelu: gemma,
            swa,
            dim,
            arch,
        };
        let c = &config;
        let get = |name: &str, cols: usize, rows: usize| -> Result<W> {
            let t = file.tensor(name).ok_or_else(|| ModelError::Tensor { name: name.into(), what: "missing".into() })?;
            check_shape(t, cols, rows)?;
            Ok(W { ty: t.ty, rows, cols, offset: (file.header.data_offset + t.offset) as usize, len: t.size as usize, in_image: false })
        };
        let vec = |name: &str, n: usize| -> Result<Vec<f32>> {
            let t = file.tensor(name).ok_or_else(|| ModelError::Tensor { name: name.into(), what: "missing".into() })?;
            check_shape(t, n, 1)?;
            let mut v = vec![0.0; n];
            quant::dequantize_row(t.ty, file.tensor_data(t), &mut v);
            Ok(v)
        };
        let opt_vec = |name: &str, n: usize| -> Result<Option<Vec<f32>>> { file.tensor(name).map(|_| vec(name, n)).transpose() };
        let kv = c.kv_dim();
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let p = |s: &str| format!("blk.{i}.{s}");
            let qd = c.q_dim();
            let shapes = [(c.dim, qd), (c.dim, kv), (c.dim, kv), (qd, c.dim), (c.dim, c.ffn_dim), (c.dim, c.ffn_dim), (c.ffn_dim, c.dim)];
            let mut mats = [W { ty: GgmlType::F32, rows: 0, cols: 0, offset: 0, len: 0, in_image: false }; 7];
            for ((m, name), (cols, rows)) in mats.iter_mut().zip(MATRIX_NAMES).zip(shapes) {
                *m = get(&p(&format!("{name}.weight")), cols, rows)?;
            }
            layers.push(RawLayer {
                attn_norm: vec(&p("attn_norm.weight"), c.dim)?,
                ffn_norm: vec(&p("ffn_norm.weight"), c.dim)?,
                bq: opt_vec(&p("attn_q.bias"), qd)?,
                bk: opt_vec(&p("attn_k.bias"), kv)?,
                bv: opt_vec(&p("attn_v.bias"), kv)?,
                // Gemma 3's four extra norms are required of it and refused elsewhere (a
                // llama file carrying them would be another architecture run wrongly).
                q_norm: if gemma { Some(vec(&p("attn_q_norm.weight"), c.head_dim)?) } else { None },
                k_norm: if gemma { Some(vec(&p("attn_k_norm.weight"), c.head_dim)?) } else { None },
                post_attn_norm: if gemma { Some(vec(&p("post_attention_norm.weight"), c.dim)?) } else { None },
                post_ffn_norm: if gemma { Some(vec(&p("post_ffw_norm.weight"), c.dim)?) } else { None },
                mats,
            });
            if !gemma {
                if let Some(n) = ["attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"]
                    .iter()
                    .find(|n| file.tensor(&p(&format!("{n}.weight"))).is_some())
                {
                    return Err(ModelError::Tensor {
                        name: p(&format!("{n}.weight")),
                        what: format!("not part of the {} architecture as we run it", c.arch),
                    });
                }
            }
        }
        let tok_embd = get("token_embd.weight", c.dim, c.vocab)?;
        let output = if file.tensor("output.weight").is_some() { get("output.weight", c.dim, c.vocab)? } else { tok_embd };
        let output_norm = vec("output_norm.weight", c.dim)?;
        for w in layers.iter().flat_map(|l| l.mats.iter()).chain([&output]) {
            if w.cols % w.ty.block_size() != 0 || (kernels::act_kind(w.ty) != ActKind::F32 && w.cols % 32 != 0) {
                return Err(ModelError::Tensor {
                    name: format!("{:?} weight", w.ty),
                    what: format!("row length {} does not fit its blocks", w.cols),
                });
            }
        }
        if config.rope_dims > 512 || !config.rope_dims.is_multiple_of(2) {
            return Err(ModelError::Metadata {
                key: "rope.dimension_count".into(),
                what: format!("{} is not an even number up to 512", config.rope_dims),
            });
        }
        // Llama 3's frequency factors, as llama.cpp reads them for the llama architecture only.
        let mut config = config;
        if config.arch == "llama" {
            config.rope_factors = opt_vec("rope_freqs.weight", config.rope_dims / 2)?;
        }
        if let Some(f) = config.rope_factors.as_ref().and_then(|f| f.iter().find(|x| !(x.is_finite() && **x > 0.0))) {
            return Err(ModelError::Tensor { name: "rope_freqs.weight".into(), what: format!("factor {f} is not a positive number") });
        }
        Ok(Self { file, config, tokenizer, layers, tok_embd, output, output_norm })
    }
}

fn check_shape(t: &TensorInfo, cols: usize, rows: usize) -> Result<()> {
    let (r, c) = t.rows_cols();
    if c as usize != cols || r as usize != rows {
        return Err(ModelError::Tensor { name: t.name.clone(), what: format!("shape {:?}, expected [{cols}, {rows}]", t.dims) });
    }
    Ok(())
}

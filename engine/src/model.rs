//! The Llama-architecture forward pass (also Qwen2's Q/K/V biases when present).
//!
//! `Model` holds the weights (borrowed from the mapped GGUF file) and the hyper-parameters;
//! `Session` holds one context's KV cache and scratch memory and runs batches of tokens through
//! the model. Prefill runs the whole batch through each matmul at once (a GEMM); logits are
//! computed only for the positions that ask for them.
#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::path::Path;
use std::sync::Arc;

use half::f16;

use crate::colmajor::{ActiveSet, ColWeight};
use crate::gguf::{GgufFile, Value};
use crate::kernels::{self, ActKind, Acts, OutPtr, WeightView};
use crate::kv::{KvFormat, KvGeometry};
use crate::kvcache::ChunkedKv;
pub use crate::loader::{Config, ModelError, Result};
use crate::loader::{Parsed, W};
use crate::pool::ThreadPool;
use crate::quant;
use crate::repack::{self, PackedWeight};
use crate::tokenizer::Tokenizer;
use crate::weights::{ImageFormat, Piece, WeightLayout, WeightMemory};

/// A matrix the forward pass multiplies by: where its GGUF bytes are, and its repacked copy
/// when the type has fast packed kernels.
#[derive(Debug)]
struct Mat {
    raw: W,
    packed: Option<PackedWeight>,
    /// Stored by input channel instead (for sparse decoding), when the model was loaded so.
    col: Option<ColWeight>,
    /// Where the matrix's bytes start in the weight image (channel-major images: its layer
    /// group), to name the ranges it reads.
    img_at: usize,
}

impl Mat {
    fn new(raw: W, file: &GgufFile) -> Self {
        let packed = PackedWeight::pack(raw.ty, raw.rows, raw.cols, &file.bytes()[raw.offset..raw.offset + raw.len]);
        if packed.is_some() {
            // The packed copy replaces the file's bytes: let the kernel drop the mapped pages
            // we just read (they stay in the page cache), so resident memory holds one copy of
            // the weights, not two, even while loading.
            file.release_pages(raw.offset, raw.len);
        }
        Self { raw, packed, col: None, img_at: 0 }
    }

    /// The matrix stored channel-major when its type allows (4-bit), packed otherwise.
    fn channel_major(raw: W, file: &GgufFile) -> Self {
        match ColWeight::from_gguf(raw.ty, raw.rows, raw.cols, &file.bytes()[raw.offset..raw.offset + raw.len]) {
            Some(col) => {
                file.release_pages(raw.offset, raw.len);
                Self { raw, packed: None, col: Some(col), img_at: 0 }
            }
            None => Self::new(raw, file),
        }
    }

    /// The matrix as the weight image holds it (`piece`), read in place from `image`.
    fn in_image(raw: W, piece: &Piece, image: &[u8]) -> Result<Self> {
        let bytes = &image[piece.offset..piece.offset + piece.len];
        let bad = || ModelError::Tensor { name: piece.name.clone(), what: "weight image piece has the wrong size or alignment".into() };
        if let Some(at) = piece.col {
            // SAFETY: as below.
            let col = unsafe { ColWeight::borrow_placed(raw.ty, raw.rows, raw.cols, bytes, at) }.ok_or_else(bad)?;
            return Ok(Self { raw, packed: None, col: Some(col), img_at: piece.offset });
        }
        if !piece.packed {
            return Ok(Self { raw: W { offset: piece.offset, in_image: true, ..raw }, packed: None, col: None, img_at: piece.offset });
        }
        // SAFETY: the image outlives the model's matrices (the model holds its Arc) and is
        // read-only.
        let packed = unsafe { PackedWeight::borrow(raw.ty, raw.rows, raw.cols, bytes) }.ok_or_else(bad)?;
        Ok(Self { raw, packed: Some(packed), col: None, img_at: piece.offset })
    }

    /// The bytes of a weight image this matrix reads whole (packed or GGUF-stored).
    fn image_range(&self) -> (usize, usize) {
        (self.img_at, self.packed.as_ref().map_or(self.raw.len, |p| p.as_bytes().len()))
    }

    fn act_kind(&self) -> ActKind {
        // Packed or not, a matrix takes its type's activations (Q8_K for the K-quants).
        kernels::act_kind(self.raw.ty)
    }
}

#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    wq: Mat,
    wk: Mat,
    wv: Mat,
    wo: Mat,
    w_gate: Mat,
    w_up: Mat,
    w_down: Mat,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
}

impl Layer {
    /// Matrix `i` in load order (q, k, v, o, gate, up, down).
    fn mat(&self, i: usize) -> &Mat {
        [&self.wq, &self.wk, &self.wv, &self.wo, &self.w_gate, &self.w_up, &self.w_down][i]
    }
}

/// A loaded model: the mapped file, its hyper-parameters, tokenizer and weights.
#[derive(Debug)]
pub struct Model {
    pub config: Config,
    pub tokenizer: Tokenizer,
    pub file: GgufFile,
    layers: Vec<Layer>,
    tok_embd: W,
    /// The output projection; in a weight image it is cut by rows into parts (groups), so a
    /// pager can stream it like the layers.
    output: Vec<Mat>,
    output_norm: Vec<f32>,
    rope: Rope,
    /// The weight image the matrices are read from, when they are not packed on the heap.
    image: Option<Arc<dyn WeightMemory>>,
    /// A channel-major image's layer groups (0: none, or a packed image): the forward pass
    /// names the bytes it reads ([`WeightMemory::need`]) and predicts the next `span` layers.
    image_span: usize,
}

impl Parsed {
    /// Builds the model, its matrices made by `mat` from their file locations.
    fn into_model(
        self,
        image: Option<Arc<dyn WeightMemory>>,
        mat: &mut dyn FnMut(&GgufFile, W) -> Result<Mat>,
        split_head: bool,
    ) -> Result<Model> {
        let Parsed { file, config, tokenizer, layers: raw, tok_embd, output, output_norm } = self;
        let mut layers = Vec::with_capacity(raw.len());
        for l in raw {
            let [wq, wk, wv, wo, w_gate, w_up, w_down] = l.mats;
            layers.push(Layer {
                attn_norm: l.attn_norm,
                ffn_norm: l.ffn_norm,
                wq: mat(&file, wq)?,
                wk: mat(&file, wk)?,
                wv: mat(&file, wv)?,
                wo: mat(&file, wo)?,
                w_gate: mat(&file, w_gate)?,
                w_up: mat(&file, w_up)?,
                w_down: mat(&file, w_down)?,
                bq: l.bq,
                bk: l.bk,
                bv: l.bv,
            });
        }
        let output = if split_head {
            crate::weights::head_parts(output).into_iter().map(|w| mat(&file, w)).collect::<Result<Vec<Mat>>>()?
        } else {
            vec![mat(&file, output)?]
        };
        let rope = Rope::new(&config);
        Ok(Model { config, tokenizer, file, layers, tok_embd, output, output_norm, rope, image, image_span: 0 })
    }
}

impl Model {
    /// Loads a model with its matrices packed on the heap (fully resident).
    pub fn load(path: &Path) -> Result<Self> {
        Self::load_as(path, WeightFormat::Packed)
    }

    /// Loads a model with its matrices on the heap in `format`.
    pub fn load_as(path: &Path, format: WeightFormat) -> Result<Self> {
        let parsed = Parsed::open(path)?;
        let (layers, mut n) = (parsed.layers.len(), 0);
        parsed.into_model(
            None,
            &mut |file, w| {
                // Matrices come in load order: the layers' 7 each, then the head, which every
                // token reads whole and so stays packed.
                n += 1;
                Ok(match format {
                    WeightFormat::ChannelMajor if n <= 7 * layers => Mat::channel_major(w, file),
                    _ => Mat::new(w, file),
                })
            },
            false,
        )
    }

    /// The layers' matrices are stored channel-major (sparse decoding reads only active inputs).
    pub fn is_channel_major(&self) -> bool {
        self.layers.first().is_some_and(|l| l.wq.col.is_some())
    }

    /// Layers per group of the channel-major weight image this model reads (0: none).
    pub fn image_span(&self) -> usize {
        self.image_span
    }

    /// Loads a model whose matrices and embedding table are read in place from `image`, a
    /// weight image of this file laid out by [`WeightLayout::for_file`] with `align` (see
    /// [`crate::weights`]). Only the metadata, tokenizer and norms are read from the file.
    pub fn load_with_image(path: &Path, image: Arc<dyn WeightMemory>, align: usize, format: ImageFormat) -> Result<Self> {
        let parsed = Parsed::open(path)?;
        let layout = WeightLayout::of(&parsed, align, format);
        if image.bytes().len() < layout.total {
            return Err(ModelError::Tensor {
                name: "weight image".into(),
                what: format!("{} bytes, the layout needs {}", image.bytes().len(), layout.total),
            });
        }
        let bytes = image.bytes();
        let mut pieces = layout.pieces.iter();
        let mut model = parsed.into_model(
            Some(Arc::clone(&image)),
            &mut |_, w| {
                let piece = pieces.next().expect("one piece per matrix, in load order");
                Mat::in_image(w, piece, bytes)
            },
            true,
        )?;
        let emb = layout.pieces.last().expect("the embedding piece");
        model.tok_embd = W { offset: emb.offset, in_image: true, ..model.tok_embd };
        if let ImageFormat::ChannelMajor { span } = format {
            model.image_span = span.max(1);
        }
        // Nothing else is read from the mapped file's tensor data: drop its pages from this
        // process (metadata lookups fault the header back in).
        model.file.release_pages(0, model.file.bytes().len());
        Ok(model)
    }

    fn view(&self, w: &W) -> WeightView<'_> {
        let src = match (&self.image, w.in_image) {
            (Some(img), true) => img.bytes(),
            _ => self.file.bytes(),
        };
        WeightView { ty: w.ty, rows: w.rows, cols: w.cols, data: &src[w.offset..w.offset + w.len] }
    }

    /// Whether the matrices are read from a weight image rather than packed on the heap.
    pub fn uses_image(&self) -> bool {
        self.image.is_some()
    }

    /// Bytes of the model file (weights dominate).
    pub fn file_bytes(&self) -> usize {
        self.file.bytes().len()
    }

    /// Renders a chat with the model's template (see `chat`).
    pub fn chat_template(&self) -> Option<&str> {
        self.file.get("tokenizer.chat_template").and_then(Value::as_str)
    }

    /// Renders `messages` with this model's chat template and its BOS/EOS texts;
    /// `add_generation_prompt` opens the assistant's turn at the end.
    pub fn render_chat(
        &self,
        messages: &[crate::chat::Message],
        add_generation_prompt: bool,
    ) -> std::result::Result<String, minijinja::Error> {
        let tk = &self.tokenizer;
        let name = |id: Option<u32>| id.and_then(|i| tk.token_text(i)).unwrap_or("").to_string();
        crate::chat::render_with(self.chat_template(), messages, &name(tk.bos), &name(tk.eos), add_generation_prompt)
    }
}

/// How a model holds its layers' matrices in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// Repacked 8-row blocks: the fastest dense kernels (prefill and decode).
    #[default]
    Packed,
    /// By input channel ([`crate::colmajor`]), 4-bit types only: a token reads only the weight
    /// columns of its non-zero inputs, so Top-K activation sparsity saves reads and time.
    ChannelMajor,
}

/// Which positions of a batch need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
}

/// A session's working memory (activations, logits): a service holding many idle sessions
/// lends one `Scratch` to whichever session runs ([`Session::take_scratch`]).
#[derive(Debug, Default)]
pub struct Scratch {
    x: Vec<f32>,
    xb: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    ffn: Vec<f32>,
    logits: Vec<f32>,
    acts: Acts,
    /// Byte ranges of a channel-major weight image named to its memory.
    ranges: Ranges,
}

impl Scratch {
    /// The logits of the last pass run with this scratch ([`Session::step_batch`]'s, row-major).
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }
}

/// Session settings.
#[derive(Debug, Clone, Copy)]
pub struct SessionOptions {
    /// Positions the session can hold.
    pub capacity: usize,
    /// Tokens per KV chunk.
    pub chunk_tokens: usize,
    /// Format of new chunks (f16 or int8).
    pub base: KvFormat,
    /// Accumulate the attention each cached token receives (LLMS eq. 1).
    pub observe_attention: bool,
    /// When the context is full: `Some(sink)` drops the oldest chunks after the first `sink`
    /// tokens (rounded up to whole chunks) instead of failing.
    pub sliding_window: Option<usize>,
}

impl SessionOptions {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, chunk_tokens: 16, base: KvFormat::F16, observe_attention: false, sliding_window: None }
    }
}

/// Attention received per position: the sum of probabilities over (row, head, layer) and the
/// number of (row, head, layer) triples that could see the position.
#[derive(Debug, Default, Clone)]
pub struct AttentionStats {
    pub sum: Vec<f64>,
    pub count: Vec<u64>,
}

impl AttentionStats {
    /// Adds attention rows (`probs[i * ld ..][..limits[i]]`, one row per query of one head
    /// of one layer): every position a row can see gets its probability and one count.
    pub fn add_rows(&mut self, probs: &[f32], ld: usize, limits: &[usize]) {
        for (i, &lim) in limits.iter().enumerate() {
            if self.sum.len() < lim {
                self.sum.resize(lim, 0.0);
                self.count.resize(lim, 0);
            }
            for (p, &a) in probs[i * ld..i * ld + lim].iter().enumerate() {
                self.sum[p] += f64::from(a);
                self.count[p] += 1;
            }
        }
    }

    /// Information density of a range of positions (LLMS eq. 1): each token's received
    /// attention averaged over the rows that see it, the heads and the layers; then averaged
    /// over the tokens of the range.
    #[allow(clippy::cast_precision_loss)]
    pub fn density(&self, range: std::ops::Range<usize>) -> f64 {
        let toks: Vec<f64> =
            range.filter(|&p| p < self.count.len() && self.count[p] > 0).map(|p| self.sum[p] / self.count[p] as f64).collect();
        if toks.is_empty() {
            0.0
        } else {
            toks.iter().sum::<f64>() / toks.len() as f64
        }
    }
}

/// One context: its tokens, chunked KV cache and scratch memory.
#[derive(Debug)]
pub struct Session {
    pub model: Arc<Model>,
    pub pool: Arc<ThreadPool>,
    pub kv: ChunkedKv,
    /// Tokens whose K/V are in the cache, in position order.
    pub tokens: Vec<u32>,
    /// Filled when `observe_attention` is on.
    pub attention: Option<AttentionStats>,
    sliding_window: Option<usize>,
    scratch: Scratch,
    /// Top-K activation sparsity applied to the projections' inputs.
    sparsity: Option<Arc<crate::sparsity::Sparsity>>,
    /// Collects input magnitudes for calibrating sparsity.
    pub(crate) calibrator: Option<crate::sparsity::Calibrator>,
    /// Counts active input channels (for sizing a hot-channel cache).
    channel_use: Option<crate::sparsity::ChannelUse>,
}

impl Session {
    /// A session holding up to `capacity` positions in f16 chunks of 16 tokens.
    pub fn new(model: Arc<Model>, pool: Arc<ThreadPool>, capacity: usize) -> Self {
        Self::with_options(model, pool, SessionOptions::new(capacity))
    }

    pub fn with_options(model: Arc<Model>, pool: Arc<ThreadPool>, opts: SessionOptions) -> Self {
        let capacity = opts.capacity.clamp(1, model.config.ctx_len);
        let c = &model.config;
        let geom =
            KvGeometry { n_layers: c.n_layers, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim, chunk_tokens: opts.chunk_tokens.max(1) };
        let kv = ChunkedKv::new(geom, capacity, opts.base);
        let attention = opts.observe_attention.then(AttentionStats::default);
        Self {
            model,
            pool,
            kv,
            tokens: Vec::new(),
            attention,
            sliding_window: opts.sliding_window,
            scratch: Scratch::default(),
            sparsity: None,
            calibrator: None,
            channel_use: None,
        }
    }

    pub fn n_past(&self) -> usize {
        self.tokens.len()
    }

    /// Computes with Top-K activation sparsity (or dense again with `None`). The thresholds
    /// must be calibrated for this model's layer count.
    pub fn set_sparsity(&mut self, sparsity: Option<Arc<crate::sparsity::Sparsity>>) -> Result<()> {
        if let Some(sp) = &sparsity {
            if sp.thresholds.len() != self.model.config.n_layers {
                return Err(ModelError::Metadata {
                    key: "sparsity".into(),
                    what: format!("{} layers of thresholds for a {}-layer model", sp.thresholds.len(), self.model.config.n_layers),
                });
            }
        }
        self.sparsity = sparsity;
        Ok(())
    }

    /// Collects the magnitudes of the projections' inputs in the forward passes that follow
    /// (for calibrating sparsity).
    pub fn set_calibrator(&mut self, c: Option<crate::sparsity::Calibrator>) {
        self.calibrator = c;
    }

    pub fn take_calibrator(&mut self) -> Option<crate::sparsity::Calibrator> {
        self.calibrator.take()
    }

    /// Counts how often each input channel is active in the forward passes from now on.
    pub fn set_channel_use(&mut self, u: Option<crate::sparsity::ChannelUse>) {
        self.channel_use = u;
    }
    pub fn take_channel_use(&mut self) -> Option<crate::sparsity::ChannelUse> {
        self.channel_use.take()
    }

    /// Takes the session's working memory out (it gets an empty one, which grows on use).
    pub fn take_scratch(&mut self) -> Scratch {
        std::mem::take(&mut self.scratch)
    }

    /// Gives the session working memory to use (e.g. one taken from another session).
    pub fn set_scratch(&mut self, s: Scratch) {
        self.scratch = s;
    }

    pub fn capacity(&self) -> usize {
        self.kv.capacity()
    }

    /// Forgets every position from `n` on (the cache keeps its memory).
    pub fn truncate(&mut self, n: usize) {
        self.tokens.truncate(n);
        self.kv.truncate(n);
        if let Some(a) = &mut self.attention {
            a.sum.truncate(n);
            a.count.truncate(n);
        }
    }

    /// Runs `tokens` at the next positions and returns the logits asked for, row-major
    /// (`[n][vocab]` for `All`, `[vocab]` for `Last`). Long batches are split.
    pub fn eval(&mut self, tokens: &[u32], logits: Logits) -> Result<&[f32]> {
        const MAX_BATCH: usize = 512;
        let needed = self.n_past() + tokens.len();
        if needed > self.kv.capacity() {
            match self.sliding_window {
                Some(sink) => self.slide(sink, needed - self.kv.capacity())?,
                None => return Err(ModelError::ContextFull { needed, capacity: self.kv.capacity() }),
            }
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.model.config.vocab) {
            return Err(ModelError::BadToken(bad));
        }
        let vocab = self.model.config.vocab;
        let mut all = Vec::new();
        let n_chunks = tokens.len().div_ceil(MAX_BATCH);
        for (i, chunk) in tokens.chunks(MAX_BATCH).enumerate() {
            let want = match logits {
                Logits::All => Logits::All,
                Logits::Last if i + 1 == n_chunks => Logits::Last,
                _ => Logits::None,
            };
            let pos0 = self.n_past();
            let positions: Vec<usize> = (pos0..pos0 + chunk.len()).collect();
            self.kv.ensure(pos0 + chunk.len())?;
            self.tokens.extend_from_slice(chunk);
            self.forward(chunk, &positions, want, &mut |_| {});
            if logits == Logits::All {
                all.extend_from_slice(&self.scratch.logits[..chunk.len() * vocab]);
            }
        }
        if logits == Logits::All {
            self.scratch.logits = all;
        }
        Ok(match logits {
            Logits::None => &[],
            Logits::Last => &self.scratch.logits[..vocab],
            Logits::All => &self.scratch.logits[..tokens.len() * vocab],
        })
    }

    /// One decode step for several sessions at once: `tokens[i]` is appended to `sessions[i]`
    /// and the logits of each session's new position are returned, `[i][vocab]`, in `scratch`.
    /// [`Session::step_batch`] with one token per session.
    pub fn decode_batch<'s>(sessions: &mut [&mut Session], tokens: &[u32], scratch: &'s mut Scratch) -> Result<&'s [f32]> {
        if sessions.len() != tokens.len() {
            return Err(ModelError::Batch("one token per session"));
        }
        let pieces: Vec<&[u32]> = tokens.chunks(1).collect();
        Session::step_batch(sessions, &pieces, scratch)
    }

    /// One forward pass for several sessions: `tokens[i]` (one token or more: a decode step or
    /// a piece of a prefill) is appended to `sessions[i]`, and the logits of each session's
    /// last new position are returned, `[i][vocab]`, in `scratch`. The weights are read once
    /// for all the rows (the matrix products run over them together); each session writes its
    /// own cache and attends over its own context. A row's arithmetic does not depend on the
    /// other rows, so each session's logits and cache are bit for bit those its own
    /// [`Session::eval`] of the same tokens would give. The sessions must share the model and
    /// its sparsity, hold no calibrator or channel counter, and have room for their tokens (a
    /// batch does not slide a window); on an error no session has changed.
    pub fn step_batch<'s>(sessions: &mut [&mut Session], tokens: &[&[u32]], scratch: &'s mut Scratch) -> Result<&'s [f32]> {
        if sessions.len() != tokens.len() {
            return Err(ModelError::Batch("one token list per session"));
        }
        let Some(first) = sessions.first() else { return Ok(&[]) };
        let (model, pool, sparsity) = (Arc::clone(&first.model), Arc::clone(&first.pool), first.sparsity.clone());
        let vocab = model.config.vocab;
        for (s, t) in sessions.iter().zip(tokens) {
            if !Arc::ptr_eq(&s.model, &model) {
                return Err(ModelError::Batch("the sessions must share one model"));
            }
            let same = match (&s.sparsity, &sparsity) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            };
            if !same || s.calibrator.is_some() || s.channel_use.is_some() {
                return Err(ModelError::Batch("the sessions must share one sparsity and collect no statistics"));
            }
            if t.is_empty() {
                return Err(ModelError::Batch("every session needs a token"));
            }
            if s.n_past() + t.len() > s.kv.capacity() {
                return Err(ModelError::ContextFull { needed: s.n_past() + t.len(), capacity: s.kv.capacity() });
            }
            if let Some(&bad) = t.iter().find(|&&t| t as usize >= vocab) {
                return Err(ModelError::BadToken(bad));
            }
        }
        for (s, t) in sessions.iter_mut().zip(tokens) {
            s.kv.ensure(s.n_past() + t.len())?;
        }
        let n: usize = tokens.iter().map(|t| t.len()).sum();
        let (mut rows, mut positions, mut spans, mut last) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::new(), Vec::new());
        for (s, t) in sessions.iter_mut().zip(tokens) {
            let pos0 = s.n_past();
            spans.push(rows.len()..rows.len() + t.len());
            rows.extend_from_slice(t);
            positions.extend(pos0..pos0 + t.len());
            last.push(rows.len() - 1);
            s.tokens.extend_from_slice(t);
            if let Some(a) = &mut s.attention {
                let end = (pos0 + t.len()).max(a.sum.len());
                a.sum.resize(end, 0.0);
                a.count.resize(end, 0);
            }
        }
        let mut sp = Sparse { sparsity: sparsity.as_deref(), calibrator: None, channel_use: None };
        let mut caches = ManyCaches { sessions, spans };
        forward_rows(&model, &pool, scratch, &mut sp, &mut caches, &rows, &positions, &last, &mut |_| {});
        Ok(&scratch.logits[..last.len() * vocab])
    }

    /// Drops at least `drop` positions, whole chunks right after the first `sink` tokens
    /// (rounded up to chunks), re-rotating the K of the chunks that move down so their RoPE
    /// positions match their new places (as llama.cpp's context shift does).
    pub fn slide(&mut self, sink: usize, drop: usize) -> Result<()> {
        let ct = self.kv.geom.chunk_tokens;
        let keep = sink.div_ceil(ct);
        let n_drop = drop.div_ceil(ct);
        let full = self.n_past() / ct;
        if keep + n_drop > full {
            return Err(ModelError::ContextFull { needed: self.n_past() + drop, capacity: self.kv.capacity() });
        }
        let delta = n_drop * ct;
        let (hd, rope) = (self.model.config.head_dim, &self.model.rope);
        // A rotation by -delta positions: angles -delta * theta_i, built like the forward's.
        let rotate = move |x: &mut [f32]| rope.apply(x, hd, -(delta as f32));
        self.kv.remove_chunks(keep..keep + n_drop, &rotate);
        self.tokens.drain(keep * ct..keep * ct + delta);
        if let Some(a) = &mut self.attention {
            let end = (keep * ct + delta).min(a.sum.len());
            a.sum.drain(keep * ct..end);
            a.count.drain(keep * ct..end);
        }
        Ok(())
    }

    /// Recomputes the K/V of the given positions (already in `tokens`, e.g. chunks whose
    /// memory was dropped) from their tokens: they get their global positions in RoPE, attend
    /// to every present position before them, and write K/V into their own chunks, layer by
    /// layer (LLMS §3.3). `before_layer(l)` runs before layer `l` is computed, so a caller can
    /// overlap reading layer `l` of other chunks with this work. The chunks written must be in
    /// a base format. Exact: the result equals the original computation bit for bit.
    pub fn recompute(&mut self, positions: &[usize], before_layer: &mut dyn FnMut(usize)) -> Result<()> {
        if let Some(&p) = positions.iter().find(|&&p| p >= self.n_past()) {
            return Err(ModelError::ContextFull { needed: p + 1, capacity: self.n_past() });
        }
        if positions.windows(2).any(|w| w[0] >= w[1]) {
            return Err(ModelError::Metadata { key: "recompute".into(), what: "positions must be strictly increasing".into() });
        }
        for &p in positions {
            let c = p / self.kv.geom.chunk_tokens;
            if !self.kv.format(c).is_base() {
                return Err(ModelError::Metadata {
                    key: "recompute".into(),
                    what: format!("chunk {c} is {}; recompute writes base formats", self.kv.format(c).name()),
                });
            }
        }
        let toks: Vec<u32> = positions.iter().map(|&p| self.tokens[p]).collect();
        // `tokens` is the caller's to set (a restored context): checked here as `eval` checks
        // its input, so a bad id is an error, never an out-of-range embedding row.
        if let Some(&bad) = toks.iter().find(|&&t| t as usize >= self.model.config.vocab) {
            return Err(ModelError::BadToken(bad));
        }
        for (b, pb) in toks.chunks(512).zip(positions.chunks(512)) {
            self.forward(b, pb, Logits::None, before_layer);
        }
        Ok(())
    }

    fn forward(&mut self, tokens: &[u32], positions: &[usize], want: Logits, before_layer: &mut dyn FnMut(usize)) {
        if let Some(a) = &mut self.attention {
            let end = positions.iter().copied().max().map_or(0, |p| p + 1).max(a.sum.len());
            a.sum.resize(end, 0.0);
            a.count.resize(end, 0);
        }
        let mut sp =
            Sparse { sparsity: self.sparsity.as_deref(), calibrator: self.calibrator.as_mut(), channel_use: self.channel_use.as_mut() };
        let mut caches = OneCache { kv: &mut self.kv, observer: self.attention.as_mut() };
        let rows: Vec<usize> = match want {
            Logits::None => Vec::new(),
            Logits::Last => vec![tokens.len() - 1],
            Logits::All => (0..tokens.len()).collect(),
        };
        forward_rows(&self.model, &self.pool, &mut self.scratch, &mut sp, &mut caches, tokens, positions, &rows, before_layer);
    }
}

/// The caches a forward pass writes K/V into and attends over: one session's (every row is
/// one of its positions), or several sessions' (row `t` is session `t`'s next position).
trait Caches {
    fn write(&mut self, layer: usize, row: usize, pos: usize, k: &[f32], v: &[f32]);
    #[allow(clippy::too_many_arguments)]
    fn attend(&mut self, pool: &ThreadPool, c: &Config, layer: usize, qkv: &[f32], ld: usize, positions: &[usize], out: &mut [f32]);
}

struct OneCache<'a> {
    kv: &'a mut ChunkedKv,
    observer: Option<&'a mut AttentionStats>,
}

impl Caches for OneCache<'_> {
    fn write(&mut self, layer: usize, _row: usize, pos: usize, k: &[f32], v: &[f32]) {
        self.kv.write(layer, pos, k, v);
    }
    fn attend(&mut self, pool: &ThreadPool, c: &Config, layer: usize, qkv: &[f32], ld: usize, positions: &[usize], out: &mut [f32]) {
        attention(pool, c, self.kv, layer, qkv, ld, positions, out, self.observer.as_deref_mut());
    }
}

/// Rows `spans[i]` belong to `sessions[i]`: their K/V go to its cache, and they attend over
/// its context as its own forward pass would.
struct ManyCaches<'a, 'b> {
    sessions: &'a mut [&'b mut Session],
    spans: Vec<std::ops::Range<usize>>,
}

impl Caches for ManyCaches<'_, '_> {
    fn write(&mut self, layer: usize, row: usize, pos: usize, k: &[f32], v: &[f32]) {
        // The spans are in row order: a binary search finds the row's session.
        let i = self.spans.partition_point(|r| r.end <= row);
        self.sessions[i].kv.write(layer, pos, k, v);
    }
    fn attend(&mut self, pool: &ThreadPool, c: &Config, layer: usize, qkv: &[f32], ld: usize, positions: &[usize], out: &mut [f32]) {
        // Sessions with one tile of rows (decoding) attend together, in the same few pool
        // operations; longer pieces of prompts tile their own.
        let mut decoding = Vec::new();
        let mut observers: Vec<Option<std::sync::Mutex<&mut AttentionStats>>> = Vec::new();
        let mut longer = Vec::new();
        let mut rest = out;
        for (s, r) in self.sessions.iter_mut().zip(&self.spans) {
            let (o, tail) = std::mem::take(&mut rest).split_at_mut(r.len() * c.dim);
            rest = tail;
            let s = &mut **s;
            if r.len() <= TILE {
                decoding.push((&s.kv, r.clone(), o));
                observers.push(s.attention.as_mut().map(std::sync::Mutex::new));
            } else {
                longer.push((s, r.clone(), o));
            }
        }
        let mut ctxs: Vec<Decoding> = decoding
            .into_iter()
            .zip(&observers)
            .map(|((kv, r, out), obs)| Decoding {
                kv,
                qkv: &qkv[r.start * ld..r.end * ld],
                positions: &positions[r],
                out,
                obs: obs.as_ref(),
            })
            .collect();
        if !ctxs.is_empty() {
            attend_spans(pool, c, layer, ld, &mut ctxs);
        }
        for (s, r, out) in longer {
            attention(pool, c, &s.kv, layer, &qkv[r.start * ld..r.end * ld], ld, &positions[r], out, s.attention.as_mut());
        }
    }
}

/// Top-K sparsity and its statistics, as a forward pass applies them.
struct Sparse<'a> {
    sparsity: Option<&'a crate::sparsity::Sparsity>,
    calibrator: Option<&'a mut crate::sparsity::Calibrator>,
    channel_use: Option<&'a mut crate::sparsity::ChannelUse>,
}

/// The forward pass over `tokens` at `positions`: embeddings, every layer (K/V written to and
/// attention read from `caches`), and the logits asked for, into `s.logits`. A row's arithmetic
/// does not depend on the other rows (activations are quantized per row, the kernels compute
/// each output from its own row), so a row gives the same result alone or in a batch.
#[allow(clippy::too_many_arguments, clippy::too_many_lines)]
fn forward_rows(
    model: &Arc<Model>,
    pool: &Arc<ThreadPool>,
    s: &mut Scratch,
    sp: &mut Sparse,
    caches: &mut dyn Caches,
    tokens: &[u32],
    positions: &[usize],
    logit_rows: &[usize],
    before_layer: &mut dyn FnMut(usize),
) {
    let c = &model.config;
    let n = tokens.len();
    let (dim, kvd, hd) = (c.dim, c.kv_dim(), c.head_dim);
    s.x.resize(n * dim, 0.0);
    s.xb.resize(n * dim, 0.0);
    s.qkv.resize(n * (dim + 2 * kvd), 0.0);
    s.att.resize(n * dim, 0.0);
    s.ffn.resize(n * 2 * c.ffn_dim, 0.0);

    let emb = model.view(&model.tok_embd);
    for (t, &tok) in tokens.iter().enumerate() {
        quant::dequantize_row(emb.ty, emb.row(tok as usize), &mut s.x[t * dim..(t + 1) * dim]);
    }

    for (li, l) in model.layers.iter().enumerate() {
        before_layer(li);
        // Attention block.
        rmsnorm_rows(&s.x, &l.attn_norm, c.norm_eps, &mut s.xb, dim);
        sparsify(sp.sparsity, sp.calibrator.as_deref_mut(), sp.channel_use.as_deref_mut(), li, 0, &mut s.xb[..n * dim]);
        announce(model, pool, li, 0, &s.xb[..n * dim], n, &mut s.ranges);
        matmul_multi(pool, model, &[&l.wq, &l.wk, &l.wv], &s.xb, n, &mut s.acts, &mut s.qkv);
        let ld = dim + 2 * kvd;
        for (t, &pos) in positions.iter().enumerate() {
            let row = &mut s.qkv[t * ld..(t + 1) * ld];
            for (b, off) in [(&l.bq, 0), (&l.bk, dim), (&l.bv, dim + kvd)] {
                if let Some(b) = b {
                    row[off..off + b.len()].iter_mut().zip(b).for_each(|(x, y)| *x += y);
                }
            }
            let (q, rest) = row.split_at_mut(dim);
            model.rope.apply(q, hd, pos as f32);
            model.rope.apply(&mut rest[..kvd], hd, pos as f32);
            caches.write(li, t, pos, &rest[..kvd], &rest[kvd..2 * kvd]);
        }
        caches.attend(pool, c, li, &s.qkv, ld, positions, &mut s.att);
        sparsify(sp.sparsity, sp.calibrator.as_deref_mut(), sp.channel_use.as_deref_mut(), li, 1, &mut s.att[..n * dim]);
        announce(model, pool, li, 1, &s.att[..n * dim], n, &mut s.ranges);
        matmul_multi(pool, model, &[&l.wo], &s.att, n, &mut s.acts, &mut s.xb);
        s.x.iter_mut().zip(&s.xb).for_each(|(x, o)| *x += o);

        // Feed-forward block.
        rmsnorm_rows(&s.x, &l.ffn_norm, c.norm_eps, &mut s.xb, dim);
        sparsify(sp.sparsity, sp.calibrator.as_deref_mut(), sp.channel_use.as_deref_mut(), li, 2, &mut s.xb[..n * dim]);
        announce(model, pool, li, 2, &s.xb[..n * dim], n, &mut s.ranges);
        matmul_multi(pool, model, &[&l.w_gate, &l.w_up], &s.xb, n, &mut s.acts, &mut s.ffn);
        let f = c.ffn_dim;
        let swiglu = |rows: &mut [f32]| {
            for row in rows.chunks_exact_mut(2 * f) {
                let (g, u) = row.split_at_mut(f);
                for (gv, uv) in g.iter_mut().zip(u.iter()) {
                    *gv = *gv / (1.0 + (-*gv).exp()) * uv;
                }
            }
        };
        // A prompt's gates are n x ffn exponentials a layer (a fifth of a 512-token prefill
        // on one thread): spread over the threads in pieces of 16 tokens. Element-wise, so
        // the same bits however split.
        if n >= 32 {
            pool.scatter("swiglu", s.ffn[..n * 2 * f].chunks_mut(16 * 2 * f).collect(), &|rows| swiglu(rows));
        } else {
            swiglu(&mut s.ffn[..n * 2 * f]);
        }
        // Compact the gated halves into [n][f] for the down projection.
        for t in 0..n {
            s.ffn.copy_within(t * 2 * f..t * 2 * f + f, t * f);
        }
        sparsify(sp.sparsity, sp.calibrator.as_deref_mut(), sp.channel_use.as_deref_mut(), li, 3, &mut s.ffn[..n * f]);
        announce(model, pool, li, 3, &s.ffn[..n * f], n, &mut s.ranges);
        matmul_multi(pool, model, &[&l.w_down], &s.ffn[..n * f], n, &mut s.acts, &mut s.xb);
        s.x.iter_mut().zip(&s.xb).for_each(|(x, o)| *x += o);
    }

    if logit_rows.is_empty() {
        return;
    }
    let rows = logit_rows;
    let m = rows.len();
    let mut xn = vec![0.0; m * dim];
    for (i, &r) in rows.iter().enumerate() {
        rmsnorm(&s.x[r * dim..(r + 1) * dim], &model.output_norm, c.norm_eps, &mut xn[i * dim..(i + 1) * dim]);
    }
    s.logits.resize(m * c.vocab, 0.0);
    let mut col0 = 0;
    for (part, head) in model.output.iter().enumerate() {
        if let Some(img) = &model.image {
            if model.image_span > 0 {
                if let Some(next) = model.output.get(part + 1) {
                    img.prefetch(&[next.image_range()]);
                }
                img.need(&[head.image_range()], &|| pool.rest());
            } else {
                advise(img.as_ref(), pool, crate::weights::packed_group(model.layers.len(), part));
            }
        }
        matmul_cols(pool, model, &[head], &xn, m, &mut s.acts, &mut s.logits, c.vocab, col0);
        col0 += head.raw.rows;
    }
}

/// Byte ranges being named to a weight memory, merged as they are added in increasing order.
#[derive(Debug, Default)]
struct Ranges {
    need: Vec<(usize, usize)>,
    ahead: Vec<(usize, usize)>,
    active: Vec<u16>,
}

fn push_range(v: &mut Vec<(usize, usize)>, at: usize, len: usize) {
    match v.last_mut() {
        Some((a, l)) if at >= *a && at <= *a + *l => *l = (*l).max(at + len - *a),
        _ => v.push((at, len)),
    }
}

/// Packed weight image: group `g` is about to be read; if it is not in yet, the workers sleep
/// while the provider loads it.
fn advise(img: &dyn crate::weights::WeightMemory, pool: &ThreadPool, g: usize) {
    if !img.advise(g) {
        pool.rest();
        img.wait(g);
    }
}

/// Packed weight image: announces site `site` of layer `li` (see [`advise`]). Channel-major
/// weight image: names the bytes site `site` of layer `li` will read for the
/// inputs `x` (`n` rows) — the active channels' columns and their blocks' scales — and asks
/// for the same channels of the next `image_span` layers ahead of time: the current layer's
/// activations predict the next layers' (ActiveFlow §3, cross-layer similarity). The image
/// keeps a channel's columns of a layer group together, so those ranges merge into one run
/// per channel and group. A wrong prediction costs a read when the layer names its own.
fn announce(model: &Model, pool: &ThreadPool, li: usize, site: usize, x: &[f32], n: usize, r: &mut Ranges) {
    let Some(img) = model.image.as_deref() else { return };
    if model.image_span == 0 {
        // Packed: the site's matrices are one group, read whole.
        advise(img, pool, crate::weights::packed_group(li, site));
        return;
    }
    let site_mats = crate::weights::SITE_MATRICES[site];
    let cols = x.len() / n.max(1);
    r.active.clear();
    for c in 0..cols {
        if (0..n).any(|t| x[t * cols + c] != 0.0) {
            r.active.push(c as u16);
        }
    }
    // Layers `a..b` of one group (contiguous in the image), in increasing offset order: the
    // blocks' scales, layer by layer, then each active channel's run.
    let name = |out: &mut Vec<(usize, usize)>, a: usize, b: usize, active: &[u16]| {
        for l in &model.layers[a..b] {
            for m in site_mats.iter().map(|&i| l.mat(i)) {
                let Some(w) = &m.col else {
                    let (at, len) = m.image_range();
                    push_range(out, at, len);
                    continue;
                };
                let mut last = usize::MAX;
                for &c in active {
                    let blk = usize::from(c) / crate::quant::QK;
                    if blk != last {
                        let (at, len) = w.scales_range(blk);
                        push_range(out, m.img_at + at, len);
                        last = blk;
                    }
                }
            }
        }
        for &c in active {
            for l in &model.layers[a..b] {
                for m in site_mats.iter().map(|&i| l.mat(i)) {
                    if let Some(w) = &m.col {
                        let (at, len) = w.column_range(usize::from(c));
                        push_range(out, m.img_at + at, len);
                    }
                }
            }
        }
    };
    let span = model.image_span;
    let end = (li + 1 + span).min(model.layers.len());
    r.ahead.clear();
    let mut a = li + 1;
    while a < end {
        let b = end.min((a / span + 1) * span);
        name(&mut r.ahead, a, b, &r.active);
        a = b;
    }
    if !r.ahead.is_empty() {
        img.prefetch(&r.ahead);
    }
    r.need.clear();
    name(&mut r.need, li, li + 1, &r.active);
    img.need(&r.need, &|| pool.rest());
}

/// Multiplies the same input rows by several weights at once (Q, K and V; gate and up), writing
/// each token's outputs side by side: `out[t] = [W0 x_t, W1 x_t, ...]`. One quantization of the
/// input, one parallel dispatch; work is handed out in units of 8 rows (a packed group).
#[allow(clippy::too_many_arguments)]
fn matmul_multi(pool: &ThreadPool, model: &Model, ms: &[&Mat], x: &[f32], n: usize, acts: &mut Acts, out: &mut [f32]) {
    let ldo: usize = ms.iter().map(|m| m.raw.rows).sum();
    matmul_cols(pool, model, ms, x, n, acts, out, ldo, 0);
}

/// As [`matmul_multi`], writing the outputs from column `col0` of rows `ldo` long (one part of
/// a matrix cut by rows).
#[allow(clippy::too_many_arguments)]
fn matmul_cols(
    pool: &ThreadPool,
    model: &Model,
    ms: &[&Mat],
    x: &[f32],
    n: usize,
    acts: &mut Acts,
    out: &mut [f32],
    ldo: usize,
    col0: usize,
) {
    let cols = ms[0].raw.cols;
    if ms.iter().all(|m| m.col.is_some()) {
        return matmul_channel_major(pool, ms, x, n, &mut acts.active, out, ldo, col0);
    }
    let kinds: Vec<ActKind> = ms.iter().map(|m| m.act_kind()).collect();
    acts.prepare(x, n, cols, &kinds, pool);
    let outp = OutPtr::new(&mut out[..n * ldo]).offset(col0);
    let acts = &*acts;
    let mut starts = Vec::with_capacity(ms.len());
    let (mut units, mut rows) = (0, 0);
    for m in ms {
        starts.push((units, rows));
        units += m.raw.rows.div_ceil(repack::ROWS);
        rows += m.raw.rows;
    }
    // Decode (one token, or a batch of contexts' next tokens) has little work per row, so
    // larger chunks keep the shared counter quiet; with 2-group chunks a batch of two ran
    // at the cost of two single decodes (`llms bench-batch`: 1.02x -> 1.42x aggregate). But
    // never fewer than ~4 tasks a thread when the matrix allows: with 8-group chunks a
    // 576-row matrix was 9 tasks, so at 16 threads 7 of them had nothing to do
    // (`llms bench --pool-report` shows tasks per call). On 2 threads this changes nothing.
    let most = if n <= 8 { 8 } else { 2 };
    let chunk = (units / (4 * pool.threads())).clamp(1, most);
    pool.for_chunks("matmul", units, chunk, &|a, b| {
        for (m, &(u0, r0)) in ms.iter().zip(&starts) {
            let groups = m.raw.rows.div_ceil(repack::ROWS);
            let (lo, hi) = (a.max(u0), b.min(u0 + groups));
            if lo >= hi {
                continue;
            }
            let o = outp.offset(r0);
            match &m.packed {
                Some(p) => kernels::matmul_packed(p, acts, o, ldo, lo - u0, hi - u0),
                None => {
                    let rows = ((lo - u0) * repack::ROWS, ((hi - u0) * repack::ROWS).min(m.raw.rows));
                    kernels::matmul_rows(&model.view(&m.raw), acts, o, ldo, rows.0, rows.1);
                }
            }
        }
    });
}

/// [`matmul_cols`] over channel-major matrices: the non-zero inputs are found once, then each
/// thread reads only their columns. A batch is split by tiles of 64 rows (each tile's codes
/// serve every token); one token by a share of the rows per thread, each reading its part of
/// the columns in order. Both sum each row as the packed kernels do: the same bits.
#[allow(clippy::too_many_arguments)]
fn matmul_channel_major(
    pool: &ThreadPool,
    ms: &[&Mat],
    x: &[f32],
    n: usize,
    active: &mut ActiveSet,
    out: &mut [f32],
    ldo: usize,
    col0: usize,
) {
    active.prepare(x, n, ms[0].raw.cols);
    let cws: Vec<&ColWeight> = ms.iter().filter_map(|m| m.col.as_ref()).collect();
    let mut starts = Vec::with_capacity(ms.len());
    let mut rows = 0;
    for w in &cws {
        starts.push(rows);
        rows += w.rows;
    }
    if n == 1 {
        // Each thread takes a share of each matrix's rows, reading that part of every active
        // column in order (see `matvec_tiles`).
        let parts = pool.threads();
        let outp = OutPtr::new(&mut out[col0..col0 + rows]);
        let active = &*active;
        pool.for_chunks("matvec channel-major", cws.len() * parts, 1, &|a, b| {
            for u in a..b {
                let (w, r0) = (cws[u / parts], starts[u / parts]);
                let (p, tiles) = (u % parts, w.tiles());
                crate::kernels::colmajor::matvec_tiles(w, active, 0, p * tiles / parts, (p + 1) * tiles / parts, outp.offset(r0));
            }
        });
        return;
    }
    let outp = OutPtr::new(&mut out[..n * ldo]).offset(col0);
    let active = &*active;
    let mut units = Vec::with_capacity(cws.len());
    let mut total = 0;
    for w in &cws {
        units.push(total);
        total += w.tiles();
    }
    pool.for_chunks("matmul channel-major", total, 1, &|a, b| {
        for ((w, &u0), &r0) in cws.iter().zip(&units).zip(&starts) {
            let (lo, hi) = (a.max(u0), b.min(u0 + w.tiles()));
            if lo < hi {
                crate::kernels::colmajor::matmul_col(w, active, outp.offset(r0), ldo, lo - u0, hi - u0);
            }
        }
    });
}

/// Top-K sparsity at one site of a layer: records the input's magnitudes when calibrating,
/// zeroes its small entries when sparsity is on.
fn sparsify(
    sp: Option<&crate::sparsity::Sparsity>,
    cal: Option<&mut crate::sparsity::Calibrator>,
    uses: Option<&mut crate::sparsity::ChannelUse>,
    layer: usize,
    site: usize,
    x: &mut [f32],
) {
    if let Some(c) = cal {
        c.add(layer, site, x);
    }
    if let Some(sp) = sp {
        sp.apply(layer, site, x);
    }
    if let Some(u) = uses {
        u.add(layer, site, x);
    }
}

fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    // Sum of squares in f64, as llama.cpp does.
    let ss = x.iter().map(|&v| f64::from(v * v)).sum::<f64>() / x.len() as f64;
    let scale = 1.0 / ((ss as f32) + eps).sqrt();
    for ((o, &xv), &wv) in out.iter_mut().zip(x).zip(w) {
        *o = xv * scale * wv;
    }
}

fn rmsnorm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32], dim: usize) {
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        rmsnorm(xr, w, eps, or);
    }
}

/// RoPE as llama.cpp's CPU backend applies it: pair `i` of each head's first `dims` channels
/// rotates by `pos * base^(-2i/dims)`, divided by the pair's frequency factor (Llama 3's
/// `rope_freqs`) and times the linear scaling's `freq_scale`. The pairs are adjacent channels
/// `(2i, 2i+1)` for llama ("normal" mode: the GGUF converter permuted Q and K so this matches
/// the original rotate-half form) and `(i, i + dims/2)` for qwen2 ("neox" mode).
#[derive(Debug, Clone)]
struct Rope {
    dims: usize,
    /// `base^(-2/dims)`, the ratio between successive pair frequencies.
    theta_scale: f32,
    neox: bool,
    freq_scale: f32,
    factors: Option<Vec<f32>>,
}

impl Rope {
    fn new(c: &Config) -> Self {
        Rope {
            dims: c.rope_dims,
            theta_scale: c.rope_base.powf(-2.0 / c.rope_dims as f32),
            neox: c.rope_neox,
            freq_scale: c.rope_freq_scale,
            factors: c.rope_factors.clone(),
        }
    }

    /// Rotates each head of `x` by `pos` positions (any real `pos`, negative to undo).
    fn apply(&self, x: &mut [f32], head_dim: usize, pos: f32) {
        // theta_i = pos * theta_scale^i, built by repeated multiplication in f32 and then
        // divided and scaled in llama.cpp's order, so the rotations agree bit for bit (a
        // factor and scale of 1 leave theta's bits as they are).
        let half = self.dims / 2;
        let mut cs = [(0.0f32, 0.0f32); 256];
        let mut theta = pos;
        for (i, c) in cs.iter_mut().take(half).enumerate() {
            let ff = self.factors.as_ref().map_or(1.0, |f| f[i]);
            let t = self.freq_scale * (theta / ff);
            *c = (t.cos(), t.sin());
            theta *= self.theta_scale;
        }
        let (step, off) = if self.neox { (1, half) } else { (2, 1) };
        for head in x.chunks_exact_mut(head_dim) {
            for (i, &(cos, sin)) in cs.iter().enumerate().take(half) {
                let (a, b) = (head[step * i], head[step * i + off]);
                head[step * i] = a * cos - b * sin;
                head[step * i + off] = a * sin + b * cos;
            }
        }
    }
}

/// Where a reduced chunk's blocks are decoded to.
enum Dst<'a> {
    Int8(&'a mut [u8]),
    F32(&'a mut [f32]),
}

/// Attention computes queries in tiles of this many tokens; a pass with at most one tile per
/// context (decoding) runs [`attend_spans`].
const TILE: usize = 8;

/// Whether chunks of format `f` are decoded before attention's jobs start: the reduced levels
/// that are not read in place, except Q4/Q2 when each job decodes the blocks it reads
/// (`in_job`).
fn up_front(f: KvFormat, in_job: bool, hd: usize) -> bool {
    !(f.is_base() || f.split() || in_job && crate::kv::decodes_to_int8(f, hd))
}

/// Decodes the chunks of layer `layer` that attention over `positions` reads and cannot read
/// in place ([`up_front`]) into `dec8` (int8 blocks) and `dec32` (f32), spread over the pool;
/// returns each chunk's slot in them (empty when there is none).
#[allow(clippy::too_many_arguments)]
fn decode_up_front(
    pool: &ThreadPool,
    c: &Config,
    kv: &ChunkedKv,
    layer: usize,
    positions: &[usize],
    in_job: bool,
    dec8: &mut Vec<u8>,
    dec32: &mut Vec<f32>,
) -> Vec<usize> {
    let (hd, ct) = (c.head_dim, kv.geom.chunk_tokens);
    let seen = positions.iter().copied().max().map_or(0, |p| p + 1);
    let last = seen.div_ceil(ct);
    let reduced = |ch: &usize| up_front(kv.format(*ch), in_job, hd);
    if !(0..last).any(|ch| reduced(&ch)) {
        return Vec::new();
    }
    let blk8 = kv.geom.head_block_bytes(KvFormat::Int8, 0);
    let blocks = 2 * c.n_kv_heads;
    let to8 = |ch: &usize| crate::kv::decodes_to_int8(kv.format(*ch), hd);
    let mut slot_of = vec![usize::MAX; last];
    let (mut n8, mut n32) = (0, 0);
    for (ch, slot) in slot_of.iter_mut().enumerate().filter(|(ch, _)| reduced(ch)) {
        if to8(&ch) {
            (*slot, n8) = (n8, n8 + 1);
        } else {
            (*slot, n32) = (n32, n32 + 1);
        }
    }
    dec8.resize(n8 * blocks * blk8, 0);
    dec32.resize(n32 * blocks * ct * hd, 0.0);
    let items8 = (0..last).filter(reduced).filter(to8).zip(dec8.chunks_exact_mut(blocks * blk8).map(Dst::Int8));
    let items32 = (0..last).filter(reduced).filter(|ch| !to8(ch)).zip(dec32.chunks_exact_mut(blocks * ct * hd).map(Dst::F32));
    pool.scatter("kv decode", items8.chain(items32).collect(), &|(ch, mut dst)| {
        let f = kv.format(ch);
        let n_c = ct.min(seen - ch * ct);
        for b in 0..blocks {
            let kvsel = b / c.n_kv_heads;
            let off = kv.geom.block_offset(f, layer, kvsel, b % c.n_kv_heads);
            let src = &kv.chunk(ch)[off..off + kv.geom.head_block_bytes(f, kvsel)];
            match &mut dst {
                Dst::Int8(d) => {
                    crate::kv::decode_block_to_int8(f, src, ct, hd, n_c, &mut d[b * blk8..(b + 1) * blk8]);
                }
                Dst::F32(d) => crate::kv::read_block_f32(f, kvsel, src, ct, hd, n_c, &mut d[b * ct * hd..(b + 1) * ct * hd]),
            }
        }
    });
    slot_of
}

/// Decoding attention splits the context into spans of this many tokens (rounded to whole
/// chunks): a job is one KV head's whole GQA group over one span. A fixed length, not a
/// share of the threads, so the bits do not depend on the thread count.
const SPAN_TOKENS: usize = 128;

/// How one layer's chunks are read by attention: base-format and split-level blocks in place,
/// Q4/Q2 decoded to int8 by the job that reads them (`in_job`) or up front, rotated levels
/// decoded up front to f32 (`slot_of` indexes `dec8` / `dec32` in blocks of [kvsel][kv head]).
struct LayerBlocks<'a> {
    kv: &'a ChunkedKv,
    layer: usize,
    hd: usize,
    n_kv_heads: usize,
    in_job: bool,
    slot_of: &'a [usize],
    dec8: &'a [u8],
    dec32: &'a [f32],
}

/// A job's buffers for [`LayerBlocks::rows`]: a Q4/Q2 block decoded to int8, a split K
/// block's channel zero points and steps, a split V block's token scales.
#[derive(Default)]
struct BlockScratch {
    own8: Vec<u8>,
    zero: Vec<f32>,
    step: Vec<f32>,
    scales: Vec<f32>,
}

impl BlockScratch {
    fn new(b: &LayerBlocks) -> Self {
        let mut s = Self::default();
        s.fit(b);
        s
    }
    fn fit(&mut self, b: &LayerBlocks) {
        let blk8 = if b.in_job { b.kv.geom.head_block_bytes(KvFormat::Int8, 0) } else { 0 };
        self.own8.resize(blk8, 0);
        self.zero.resize(b.hd, 0.0);
        self.step.resize(b.hd, 0.0);
        self.scales.resize(b.kv.geom.chunk_tokens, 0.0);
    }
}

thread_local! {
    /// Each thread's buffers for decoding attention's jobs (a decoded token runs ~100 jobs a
    /// layer at 4k: allocating them per job showed), and the calling thread's scores and span
    /// outputs.
    static SPAN_JOB: std::cell::RefCell<(BlockScratch, Vec<usize>)> = std::cell::RefCell::default();
    static SPAN_BUFS: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Runs `f` with this thread's job buffers, fitted to `lb` and `nq` queries.
fn with_span_job<R>(lb: &LayerBlocks, nq: usize, f: impl FnOnce(&mut BlockScratch, &mut [usize]) -> R) -> R {
    SPAN_JOB.with(|cell| {
        let g = &mut *cell.borrow_mut();
        g.0.fit(lb);
        g.1.resize(nq, 0);
        f(&mut g.0, &mut g.1)
    })
}

impl<'a> LayerBlocks<'a> {
    /// Whether chunks of format `f` are decoded before the jobs start.
    fn up_front(&self, f: KvFormat) -> bool {
        up_front(f, self.in_job, self.hd)
    }

    /// The rows of chunk `ch`'s K (`kvsel` 0) or V (1) block of KV head `kvh`, of which the
    /// first `n_c` tokens are read.
    fn rows<'b>(&'b self, ch: usize, kvsel: usize, kvh: usize, n_c: usize, s: &'b mut BlockScratch) -> kernels::KvRows<'b>
    where
        'a: 'b,
    {
        let (kv, hd, ct) = (self.kv, self.hd, self.kv.geom.chunk_tokens);
        let f = kv.format(ch);
        let off = kv.geom.block_offset(f, self.layer, kvsel, kvh);
        let bytes = &kv.chunk(ch)[off..off + kv.geom.head_block_bytes(f, kvsel)];
        match f {
            KvFormat::F16 => kernels::KvRows::F16(bytes),
            KvFormat::Int8 => kernels::KvRows::Int8 { blk: bytes, t_cap: ct },
            f if f.split() && kvsel == 0 => {
                let (outliers, codes) = crate::kernels::split_k_params(bytes, ct, hd, &mut s.zero, &mut s.step);
                kernels::KvRows::Channel { codes, bits: f.bits(), zero: &s.zero, step: &s.step, outliers }
            }
            f if f.split() => {
                let codes = crate::kv::split_v_params(bytes, f.v_bits(), ct, &mut s.scales);
                kernels::KvRows::Token { codes, scales: &s.scales, bits: f.v_bits(), levels: crate::kv::split_v_levels(f.v_bits()) }
            }
            f if !self.up_front(f) => {
                crate::kv::decode_block_to_int8(f, bytes, ct, hd, n_c, &mut s.own8);
                kernels::KvRows::Int8 { blk: &s.own8, t_cap: ct }
            }
            f => {
                let blocks = 2 * self.n_kv_heads;
                let b = self.slot_of.get(ch).copied().expect("reduced chunks are decoded above") * blocks + kvsel * self.n_kv_heads + kvh;
                if crate::kv::decodes_to_int8(f, hd) {
                    let blk8 = kv.geom.head_block_bytes(KvFormat::Int8, 0);
                    kernels::KvRows::Int8 { blk: &self.dec8[b * blk8..(b + 1) * blk8], t_cap: ct }
                } else {
                    kernels::KvRows::F32(&self.dec32[b * ct * hd..(b + 1) * ct * hd])
                }
            }
        }
    }
}

/// Causal grouped-query attention of the batch's queries (at `positions`) over the chunked
/// cache. Base-format and split-level blocks are read in place (a split level's V in the
/// rotated domain, its share of the output rotated back once per query). Other reduced ones
/// are decoded — Q4/Q2 to int8 blocks, Q4R/Q2R to f32 — by each job into an L1 buffer when one
/// tile is computed, and otherwise once for the layer before the jobs start (a 128-token
/// prefill has 16 tiles, and decoding per job made attention over Q4 chunks twice as slow as
/// over int8).
///
/// Many tokens (prefill): a job is a tile of up to 8 tokens and a set of query heads sharing
/// one KV head; each chunk's K (then V) block is read once per job and reused by every query in
/// it; with enough jobs a set is the whole GQA group. One tile (decoding): [`attend_spans`].
#[allow(clippy::too_many_arguments)]
fn attention(
    pool: &ThreadPool,
    c: &Config,
    kv: &ChunkedKv,
    layer: usize,
    qkv: &[f32],
    ld: usize,
    positions: &[usize],
    out: &mut [f32],
    observer: Option<&mut AttentionStats>,
) {
    let n = positions.len();
    let obs = observer.map(std::sync::Mutex::new);
    if n <= TILE {
        attend_spans(pool, c, layer, ld, &mut [Decoding { kv, qkv, positions, out, obs: obs.as_ref() }]);
        return;
    }
    let (hd, nh) = (c.head_dim, c.n_heads);
    let group = c.n_heads / c.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let ct = kv.geom.chunk_tokens;
    let tiles = n.div_ceil(TILE);
    let per_job = if c.n_kv_heads * tiles >= 2 * pool.threads() { group } else { 1 };
    let sets = nh / per_job;
    // Reduced chunks decoded up front, once for the layer (per job, a block was decoded by
    // every tile and every head set that reads it: 16x for a 128-token prefill). Q4/Q2 blocks
    // become int8 blocks (exact: they hold int8 codes), read by the int8 kernel; rotated
    // levels become f32. Every reduced chunk of the context is decoded again at each token, so
    // the decoded bytes are the cost: int8 writes and reads a quarter of f32's. The buffers are
    // kept per thread, so decoding a token does not map fresh pages every layer.
    thread_local! {
        static DECODED: std::cell::RefCell<(Vec<u8>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }
    let (mut dec8, mut dec32) = DECODED.with(|d| std::mem::take(&mut *d.borrow_mut()));
    let slot_of = decode_up_front(pool, c, kv, layer, positions, false, &mut dec8, &mut dec32);
    let lb = LayerBlocks { kv, layer, hd, n_kv_heads: c.n_kv_heads, in_job: false, slot_of: &slot_of, dec8: &dec8, dec32: &dec32 };
    let outp = OutPtr::new(out);
    pool.for_chunks("attention tiles", sets * tiles, 1, &|a, b| {
        let mut scores = Vec::new();
        let mut q = vec![0.0f32; TILE * per_job * hd];
        let mut o = vec![0.0f32; TILE * per_job * hd];
        let mut limits = vec![0usize; TILE * per_job];
        let mut visible = vec![0usize; TILE * per_job];
        let mut scratch = BlockScratch::new(&lb);
        // Split-level V rows are summed apart, in the rotated domain, and rotated back once
        // per query (H is linear). Each span's share is summed apart (`po`, `pr`) and added in
        // span order, as decoding does (`attend_spans`): a position gets the same bits whether
        // it was prefilled or decoded, so recomputing a decoded token is exact.
        let mut o_rot = vec![0.0f32; TILE * per_job * hd];
        let (mut po, mut pr) = (vec![0.0f32; TILE * per_job * hd], vec![0.0f32; TILE * per_job * hd]);
        let span = (SPAN_TOKENS / ct).max(1);
        for job in a..b {
            let (set, tile) = (job % sets, job / sets);
            let (t0, t1) = (tile * TILE, ((tile + 1) * TILE).min(n));
            let h0 = set * per_job;
            let kvh = h0 / group;
            let nq = (t1 - t0) * per_job;
            for t in t0..t1 {
                for j in 0..per_job {
                    let qi = (t - t0) * per_job + j;
                    round_query(&qkv[t * ld + (h0 + j) * hd..][..hd], &mut q[qi * hd..(qi + 1) * hd]);
                    limits[qi] = positions[t] + 1;
                }
            }
            let p_max = limits[..nq].iter().copied().max().unwrap_or(0);
            scores.clear();
            scores.resize(nq * p_max, 0.0);
            let n_chunks = p_max.div_ceil(ct);
            for kvsel in [0usize, 1] {
                if kvsel == 1 {
                    for (i, &lim) in limits[..nq].iter().enumerate() {
                        kernels::softmax_f16(&mut scores[i * p_max..i * p_max + lim]);
                    }
                    po[..nq * hd].fill(0.0);
                    pr[..nq * hd].fill(0.0);
                }
                let mut rotated = false;
                for ch in 0..n_chunks {
                    let col0 = ch * ct;
                    let n_c = ct.min(p_max - col0);
                    for (v, &lim) in visible[..nq].iter_mut().zip(&limits[..nq]) {
                        *v = lim.saturating_sub(col0).min(n_c);
                    }
                    let rows = lb.rows(ch, kvsel, kvh, n_c, &mut scratch);
                    if kvsel == 0 {
                        kernels::chunk_scores(&q, hd, rows, &visible[..nq], scale, &mut scores, p_max, col0);
                    } else {
                        rotated |= matches!(rows, kernels::KvRows::Token { .. });
                        let acc = if matches!(rows, kernels::KvRows::Token { .. }) { &mut pr } else { &mut po };
                        kernels::chunk_values(&scores, p_max, col0, rows, &visible[..nq], hd, acc);
                        if (ch + 1) % span == 0 || ch + 1 == n_chunks {
                            for (total, part) in [(&mut o, &mut po), (&mut o_rot, &mut pr)] {
                                if ch < span {
                                    total[..nq * hd].copy_from_slice(&part[..nq * hd]);
                                } else {
                                    total[..nq * hd].iter_mut().zip(&part[..nq * hd]).for_each(|(a, &b)| *a += b);
                                }
                                part[..nq * hd].fill(0.0);
                            }
                        }
                    }
                }
                if rotated {
                    for (oq, rq) in o[..nq * hd].chunks_exact_mut(hd).zip(o_rot.chunks_exact_mut(hd)) {
                        add_rotated_back(oq, rq);
                    }
                }
            }
            if let Some(obs) = &obs {
                obs.lock().unwrap_or_else(|e| e.into_inner()).add_rows(&scores, p_max, &limits[..nq]);
            }
            for t in t0..t1 {
                for j in 0..per_job {
                    let (h, qi) = (h0 + j, (t - t0) * per_job + j);
                    for (i, &v) in o[qi * hd..(qi + 1) * hd].iter().enumerate() {
                        outp.write(t * nh * hd + h * hd + i, v);
                    }
                }
            }
        }
    });
    DECODED.with(|d| *d.borrow_mut() = (dec8, dec32));
}

/// A query rounded to f16, as llama.cpp does before its f16 K·Q product.
fn round_query(src: &[f32], dst: &mut [f32]) {
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(v).to_f32();
    }
}

/// `o += H r`: a split level's share of the output, summed in the rotated domain, rotated back.
fn add_rotated_back(o: &mut [f32], r: &mut [f32]) {
    crate::kv::fwht(r);
    for (a, &b) in o.iter_mut().zip(r.iter()) {
        *a += b;
    }
}

/// One context's share of a pass that computes at most one tile ([`TILE`]) of its tokens: a
/// decode step's token, or a short piece of a prompt. `qkv` and `out` are its rows.
struct Decoding<'a, 'o> {
    kv: &'a ChunkedKv,
    qkv: &'a [f32],
    positions: &'a [usize],
    out: &'a mut [f32],
    obs: Option<&'a std::sync::Mutex<&'o mut AttentionStats>>,
}

/// How [`attend_spans`] lays out one context: its queries, spans, and where its pieces of the
/// shared buffers start.
struct SpanPlan {
    /// Queries of one KV head (tokens x the GQA group), their longest row, chunks and spans.
    nq: usize,
    p_max: usize,
    n_chunks: usize,
    spans: usize,
    /// Tokens in a chunk, chunks in a span, tokens in a span.
    ct: usize,
    span: usize,
    st: usize,
    rotated: bool,
    /// Offsets in the queries, limits, scores and span outputs.
    q0: usize,
    l0: usize,
    sc0: usize,
    pa0: usize,
}

/// Attention for passes of at most one tile per context (decode steps, alone or batched):
/// split-K over each context, as flash-decoding does. A job is one KV head's whole GQA group
/// over one span of [`SPAN_TOKENS`] of one context: each K and V row is unpacked once for all
/// the group's query heads (one head a job read every row three times on this model, and a
/// split level's unpacking and step table three times), and a long context gives every thread
/// work. Three passes: the scores of each span; each query's softmax over its whole row
/// (gathered from the spans, so it is the one softmax of every other path); each span's share
/// of the output, which are then added in span order (the only arithmetic that differs from
/// one job over the whole context, and only past the first span). A context of one span runs
/// all three in one job (the same operations on the same rows, so the same bits).
///
/// Every context of a batch runs in the same three pool operations (or one, when each has one
/// span): with a pass per context, a batch of four 150-token contexts was twelve operations
/// of 3-6 jobs a layer, each a barrier with an idle thread at its end.
fn attend_spans(pool: &ThreadPool, c: &Config, layer: usize, ld: usize, ctxs: &mut [Decoding]) {
    let (hd, nh, nkv) = (c.head_dim, c.n_heads, c.n_kv_heads);
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    // Chunks read neither in place nor by the job (rotated legacy levels): decoded first.
    let decoded: Vec<(Vec<usize>, Vec<u8>, Vec<f32>)> = ctxs
        .iter()
        .map(|d| {
            let (mut d8, mut d32) = (Vec::new(), Vec::new());
            let slot_of = decode_up_front(pool, c, d.kv, layer, d.positions, true, &mut d8, &mut d32);
            (slot_of, d8, d32)
        })
        .collect();
    let lbs: Vec<LayerBlocks> = ctxs
        .iter()
        .zip(&decoded)
        .map(|(d, (slot_of, d8, d32))| LayerBlocks { kv: d.kv, layer, hd, n_kv_heads: nkv, in_job: true, slot_of, dec8: d8, dec32: d32 })
        .collect();
    let (mut nq_all, mut sc_all, mut pa_all) = (0, 0, 0);
    let plans: Vec<SpanPlan> = ctxs
        .iter()
        .map(|d| {
            // A KV head's queries, token-major: query `qi` is token `qi / group`, head
            // `qi % group` of the group.
            let nq = d.positions.len() * group;
            let ct = d.kv.geom.chunk_tokens;
            let p_max = d.positions.iter().copied().max().map_or(0, |p| p + 1);
            let n_chunks = p_max.div_ceil(ct);
            let span = (SPAN_TOKENS / ct).max(1);
            let spans = n_chunks.div_ceil(span);
            let st = span * ct;
            let rotated = (0..n_chunks).any(|ch| d.kv.format(ch).split());
            let p =
                SpanPlan { nq, p_max, n_chunks, spans, ct, span, st, rotated, q0: nq_all * nkv * hd, l0: nq_all, sc0: sc_all, pa0: pa_all };
            nq_all += nq;
            sc_all += nkv * spans * nq * st;
            pa_all += nkv * spans * 2 * nq * hd;
            p
        })
        .collect();
    let mut q = vec![0.0f32; nq_all * nkv * hd];
    let mut limits = vec![0usize; nq_all];
    for (d, p) in ctxs.iter().zip(&plans) {
        for (qi, dst) in q[p.q0..p.q0 + nkv * p.nq * hd].chunks_exact_mut(hd).enumerate() {
            let (kvh, qi) = (qi / p.nq, qi % p.nq);
            let (t, h) = (qi / group, kvh * group + qi % group);
            round_query(&d.qkv[t * ld + h * hd..][..hd], dst);
        }
        for (qi, l) in limits[p.l0..p.l0 + p.nq].iter_mut().enumerate() {
            *l = d.positions[qi / group] + 1;
        }
    }
    // Scores and span outputs in job order ([context][kv head][span]), one disjoint piece a
    // job. Every score read is written first (each span's chunks cover its columns up to
    // every query's limit); the outputs are sums, so they start at zero.
    let (mut scores, mut parts) = SPAN_BUFS.with(|b| std::mem::take(&mut *b.borrow_mut()));
    scores.resize(sc_all, 0.0);
    parts.clear();
    parts.resize(pa_all, 0.0);
    // The chunks of span `s` of context `i`: (chunk, its tokens up to `p_max`, its first
    // column in the span).
    let span_chunks = |i: usize, s: usize| {
        let p = &plans[i];
        (s * p.span..((s + 1) * p.span).min(p.n_chunks)).map(move |ch| (ch, p.ct.min(p.p_max - ch * p.ct), ch * p.ct - s * p.st))
    };
    // How many of chunk `ch`'s `n_c` tokens each query of context `i` sees.
    let see = |i: usize, ch: usize, n_c: usize, visible: &mut [usize]| {
        let p = &plans[i];
        for (v, &lim) in visible.iter_mut().zip(&limits[p.l0..p.l0 + p.nq]) {
            *v = lim.saturating_sub(ch * p.ct).min(n_c);
        }
    };
    let job_scores = |i: usize, kvh: usize, s: usize, sc: &mut [f32]| {
        let (p, lb) = (&plans[i], &lbs[i]);
        with_span_job(lb, p.nq, |scratch, visible| {
            for (ch, n_c, col0) in span_chunks(i, s) {
                see(i, ch, n_c, visible);
                let rows = lb.rows(ch, 0, kvh, n_c, scratch);
                let q = &q[p.q0 + kvh * p.nq * hd..p.q0 + (kvh + 1) * p.nq * hd];
                kernels::chunk_scores(q, hd, rows, visible, scale, sc, p.st, col0);
            }
        });
    };
    let job_values = |i: usize, kvh: usize, s: usize, probs: &[f32], part: &mut [f32]| {
        let (p, lb) = (&plans[i], &lbs[i]);
        let (o, o_rot) = part.split_at_mut(p.nq * hd);
        with_span_job(lb, p.nq, |scratch, visible| {
            for (ch, n_c, col0) in span_chunks(i, s) {
                see(i, ch, n_c, visible);
                let rows = lb.rows(ch, 1, kvh, n_c, scratch);
                let acc = if matches!(rows, kernels::KvRows::Token { .. }) { &mut *o_rot } else { &mut *o };
                kernels::chunk_values(probs, p.st, col0, rows, visible, hd, acc);
            }
        });
    };
    let observe = |i: usize, probs: &[f32], lim: usize| {
        if let Some(obs) = ctxs[i].obs {
            obs.lock().unwrap_or_else(|e| e.into_inner()).add_rows(probs, lim, &[lim]);
        }
    };
    {
        // Pass 1: every span's scores; a one-span context's whole job.
        let mut items = Vec::new();
        let (mut sc_rest, mut pa_rest) = (&mut scores[..], &mut parts[..]);
        for (i, p) in plans.iter().enumerate() {
            for kvh in 0..nkv {
                for s in 0..p.spans {
                    let (sc, r) = std::mem::take(&mut sc_rest).split_at_mut(p.nq * p.st);
                    sc_rest = r;
                    let (pa, r) = std::mem::take(&mut pa_rest).split_at_mut(2 * p.nq * hd);
                    pa_rest = r;
                    items.push((i, kvh, s, sc, pa));
                }
            }
        }
        pool.scatter("attention span scores", items, &|(i, kvh, s, sc, part)| {
            job_scores(i, kvh, s, sc);
            let p = &plans[i];
            if p.spans > 1 {
                return;
            }
            for (qi, &lim) in limits[p.l0..p.l0 + p.nq].iter().enumerate() {
                let row = &mut sc[qi * p.st..qi * p.st + lim];
                kernels::softmax_f16(row);
                observe(i, row, lim);
            }
            job_values(i, kvh, 0, sc, part);
            if p.rotated {
                let (o, o_rot) = part.split_at_mut(p.nq * hd);
                for (oq, rq) in o.chunks_exact_mut(hd).zip(o_rot.chunks_exact_mut(hd)) {
                    add_rotated_back(oq, rq);
                }
            }
        });
    }
    if plans.iter().any(|p| p.spans > 1) {
        // Pass 2: each query's softmax over its whole row, gathered from its spans.
        let mut items = Vec::new();
        let mut sc_rest = &mut scores[..];
        for (i, p) in plans.iter().enumerate() {
            for _ in 0..nkv {
                let (sc, r) = std::mem::take(&mut sc_rest).split_at_mut(p.spans * p.nq * p.st);
                sc_rest = r;
                if p.spans > 1 {
                    items.push((i, sc));
                }
            }
        }
        pool.scatter("attention softmax", items, &|(i, sc)| {
            let p = &plans[i];
            let (nq, st) = (p.nq, p.st);
            let mut row = vec![0.0f32; p.p_max];
            for (qi, &lim) in limits[p.l0..p.l0 + nq].iter().enumerate() {
                let piece = |s: usize| (s * st, ((s + 1) * st).min(lim), (s * nq + qi) * st);
                for (lo, hi, at) in (0..p.spans).map(piece).take_while(|x| x.0 < x.1) {
                    row[lo..hi].copy_from_slice(&sc[at..at + hi - lo]);
                }
                kernels::softmax_f16(&mut row[..lim]);
                for (lo, hi, at) in (0..p.spans).map(piece).take_while(|x| x.0 < x.1) {
                    sc[at..at + hi - lo].copy_from_slice(&row[lo..hi]);
                }
                observe(i, &row[..lim], lim);
            }
        });
        // Pass 3: every span's share of the output.
        let probs_all = &scores;
        let mut items = Vec::new();
        let mut pa_rest = &mut parts[..];
        for (i, p) in plans.iter().enumerate() {
            for kvh in 0..nkv {
                for s in 0..p.spans {
                    let (pa, r) = std::mem::take(&mut pa_rest).split_at_mut(2 * p.nq * hd);
                    pa_rest = r;
                    if p.spans > 1 {
                        items.push((i, kvh, s, pa));
                    }
                }
            }
        }
        pool.scatter("attention span values", items, &|(i, kvh, s, part)| {
            let p = &plans[i];
            let at = p.sc0 + ((kvh * p.spans + s) * p.nq) * p.st;
            job_values(i, kvh, s, &probs_all[at..at + p.nq * p.st], part);
        });
    }
    // The spans' shares added in span order, rotated back, into each context's output.
    let (mut o, mut o_rot) = (vec![0.0f32; hd], vec![0.0f32; hd]);
    for (d, p) in ctxs.iter_mut().zip(&plans) {
        let parts = &parts[p.pa0..p.pa0 + nkv * p.spans * 2 * p.nq * hd];
        for kvh in 0..nkv {
            for qi in 0..p.nq {
                let (t, h) = (qi / group, kvh * group + qi % group);
                let dst = &mut d.out[t * nh * hd + h * hd..][..hd];
                let mut spans = parts[kvh * p.spans * 2 * p.nq * hd..].chunks_exact(2 * p.nq * hd).take(p.spans);
                if p.spans == 1 {
                    // Summed and rotated back by its job.
                    dst.copy_from_slice(&spans.next().expect("one span")[qi * hd..(qi + 1) * hd]);
                    continue;
                }
                for (s, part) in spans.enumerate() {
                    let (po, pr) = (&part[qi * hd..(qi + 1) * hd], &part[(p.nq + qi) * hd..(p.nq + qi + 1) * hd]);
                    if s == 0 {
                        o.copy_from_slice(po);
                        o_rot.copy_from_slice(pr);
                    } else {
                        o.iter_mut().zip(po).for_each(|(a, &b)| *a += b);
                        o_rot.iter_mut().zip(pr).for_each(|(a, &b)| *a += b);
                    }
                }
                if p.rotated {
                    add_rotated_back(&mut o, &mut o_rot);
                }
                dst.copy_from_slice(&o);
            }
        }
    }
    SPAN_BUFS.with(|b| *b.borrow_mut() = (scores, parts));
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Attention over chunks in every format equals a plain f32 attention over their
    /// dequantized values (same f16 rounding of Q and of the probabilities).
    #[test]
    fn attention_over_mixed_formats_equals_dequantized_reference() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(21);
        let c = Config {
            arch: "llama".into(),
            n_layers: 2,
            dim: 6 * 64,
            ffn_dim: 8,
            n_heads: 6,
            n_kv_heads: 2,
            head_dim: 64,
            vocab: 8,
            ctx_len: 512,
            rope_base: 10000.0,
            rope_dims: 64,
            rope_neox: false,
            rope_freq_scale: 1.0,
            rope_factors: None,
            norm_eps: 1e-5,
        };
        // 300 tokens: decoding attention's spans (SPAN_TOKENS) cover them in three pieces.
        let (kvd, n) = (c.kv_dim(), 300);
        let geom = KvGeometry { n_layers: 2, n_kv_heads: 2, head_dim: 64, chunk_tokens: 16 };
        let mut kv = ChunkedKv::new(geom, 512, KvFormat::Int8);
        kv.ensure(n).unwrap();
        for layer in 0..2 {
            for pos in 0..n {
                let k: Vec<f32> = (0..kvd).map(|_| rng.gen_range(-2.0..2.0)).collect();
                let v: Vec<f32> = (0..kvd).map(|_| rng.gen_range(-2.0..2.0)).collect();
                kv.write(layer, pos, &k, &v);
            }
        }
        // Every span mixes formats; the last chunk stays int8 (partial); the split levels are
        // read in place, V rotated back.
        let formats = [
            KvFormat::Q4,
            KvFormat::F16,
            KvFormat::K4V4,
            KvFormat::Q2,
            KvFormat::K3V3,
            KvFormat::Q4R,
            KvFormat::Int8,
            KvFormat::K2V2,
            KvFormat::K4V3,
        ];
        for i in 0..n / 16 {
            kv.set_format(i, formats[i % formats.len()]).unwrap();
        }
        // Two tiles (reduced chunks decoded once for the layer); one token and a tile of
        // scattered positions (split over spans, Q4/Q2 decoded by each job); one token and a
        // tile within the first span (its three passes run as one job).
        for positions in [(n - 9..n).collect::<Vec<usize>>(), vec![n - 1], vec![5, 130, 131, 299, 200], vec![100], vec![3, 60, 127]] {
            let ld = c.dim + 2 * kvd;
            let qkv: Vec<f32> = (0..positions.len() * ld).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let mut out = vec![0.0; positions.len() * c.dim];
            let mut stats = AttentionStats::default();
            attention(&ThreadPool::new(2), &c, &kv, 1, &qkv, ld, &positions, &mut out, Some(&mut stats));
            // Reference: dequantize every chunk, then textbook attention.
            let deq = |kvsel: usize, pos: usize, h: usize| -> Vec<f32> {
                let ch = pos / 16;
                let f = kv.format(ch);
                let mut blk = vec![0.0; 16 * 64];
                let off = geom.block_offset(f, 1, kvsel, h);
                crate::kv::read_block_f32(f, kvsel, &kv.chunk(ch)[off..], 16, 64, 16, &mut blk);
                blk[(pos % 16) * 64..(pos % 16 + 1) * 64].to_vec()
            };
            for (t, &pos) in positions.iter().enumerate() {
                for h in 0..c.n_heads {
                    let q: Vec<f32> = qkv[t * ld + h * 64..t * ld + (h + 1) * 64].iter().map(|&x| f16::from_f32(x).to_f32()).collect();
                    let mut sc: Vec<f32> =
                        (0..=pos).map(|p| deq(0, p, h / 3).iter().zip(&q).map(|(a, b)| a * b).sum::<f32>() / 8.0).collect();
                    kernels::softmax_f16(&mut sc);
                    let mut want = vec![0.0f32; 64];
                    for (p, &w) in sc.iter().enumerate() {
                        for (o, x) in want.iter_mut().zip(deq(1, p, h / 3)) {
                            *o += w * x;
                        }
                    }
                    for (d, &w) in want.iter().enumerate() {
                        let got = out[t * c.dim + h * 64 + d];
                        assert!((got - w).abs() < 1e-4, "pos {pos} head {h} dim {d}: {got} vs {w}");
                    }
                }
            }
            for p in [0, 6, 131, 132, 299] {
                let rows = positions.iter().filter(|&&q| q >= p).count() as u64 * 6;
                let got = stats.count.get(p).copied().unwrap_or(0);
                assert_eq!(got, rows, "position {p}: every query row of every head that sees it");
            }
        }
    }
}

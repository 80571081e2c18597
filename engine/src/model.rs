//! The Llama-architecture forward pass (also Qwen2's Q/K/V biases when present, and Gemma 3:
//! scaled embeddings, per-head Q/K norms, norms after attention and the feed-forward, GELU,
//! local layers over a sliding window with their own RoPE base).
//!
//! `Model` holds the weights (borrowed from the mapped GGUF file) and the hyper-parameters;
//! `Session` holds one context's KV cache and scratch memory and runs batches of tokens through
//! the model. Prefill runs the whole batch through each matmul at once (a GEMM); logits are
//! computed only for the positions that ask for them.
#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::path::Path;
use std::sync::Arc;

pub use crate::attention::AttentionStats;
use crate::attention::{attend_spans, attention, Decoding, TILE};
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
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    post_attn_norm: Option<Vec<f32>>,
    post_ffn_norm: Option<Vec<f32>>,
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
    /// Local (sliding-window) layers' RoPE, when their base differs (Gemma 3).
    rope_local: Option<Rope>,
    /// The weight image the matrices are read from, when they are not packed on the heap.
    image: Option<Arc<dyn WeightMemory>>,
    /// A channel-major image's layer groups (0: none, or a packed image): the forward pass
    /// names the bytes it reads ([`WeightMemory::need`]) and predicts the next `span` layers.
    image_span: usize,
    /// Where the matrices live when they are resident ([`crate::arena`]): declared after every
    /// matrix, so it is unmapped after them (they only point into it).
    arena: Option<crate::arena::Arena>,
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
                q_norm: l.q_norm,
                k_norm: l.k_norm,
                post_attn_norm: l.post_attn_norm,
                post_ffn_norm: l.post_ffn_norm,
            });
        }
        let output = if split_head {
            crate::weights::head_parts(output).into_iter().map(|w| mat(&file, w)).collect::<Result<Vec<Mat>>>()?
        } else {
            vec![mat(&file, output)?]
        };
        let rope = Rope::new(&config, config.rope_base);
        let rope_local = config.swa.map(|w| Rope::new(&config, w.rope_base));
        Ok(Model { config, tokenizer, file, layers, tok_embd, output, output_norm, rope, rope_local, image, image_span: 0, arena: None })
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
        // The matrices go side by side into one arena on huge pages (crate::arena): its size
        // is theirs, each rounded to the arena's alignment (a layer's matrix stored either way
        // counts the larger of its two forms; space left over is never touched).
        let room = |len: usize| len.next_multiple_of(crate::arena::PIECE_ALIGN);
        let packed_len = |w: &W| PackedWeight::packed_len(w.ty, w.rows, w.cols).map_or(0, room);
        let packed = parsed
            .layers
            .iter()
            .flat_map(|l| l.mats.iter())
            .map(|w| match format {
                WeightFormat::Packed => packed_len(w),
                WeightFormat::ChannelMajor => packed_len(w).max(ColWeight::len_for(w.ty, w.rows, w.cols).map_or(0, room)),
            })
            .sum::<usize>()
            + packed_len(&parsed.output);
        // Without the mapping (address space refused) the matrices stay on the heap: the same
        // bits, on 4 KiB pages.
        let mut arena = (packed > 0).then(|| crate::arena::ArenaBuilder::new(packed).ok()).flatten();
        let mut model = parsed.into_model(
            None,
            &mut |file, w| {
                // Matrices come in load order: the layers' 7 each, then the head, which every
                // token reads whole and so stays packed.
                n += 1;
                let mut m = match format {
                    WeightFormat::ChannelMajor if n <= 7 * layers => Mat::channel_major(w, file),
                    _ => Mat::new(w, file),
                };
                if let Some(a) = arena.as_mut() {
                    // SAFETY: the arena becomes the model's (below), which it outlives.
                    m.packed = m.packed.take().map(|p| unsafe { p.into_arena(a) });
                    // SAFETY: as above.
                    m.col = m.col.take().map(|c| unsafe { c.into_arena(a) });
                }
                Ok(m)
            },
            false,
        )?;
        model.arena = arena
            .map(crate::arena::ArenaBuilder::finish)
            .transpose()
            .map_err(|e| ModelError::Tensor { name: "weight arena".into(), what: e.to_string() })?;
        Ok(model)
    }

    /// Bytes of the resident matrices in their arena and the share of those on huge pages now
    /// ([`crate::arena`]); `None` for a model that reads a weight image.
    pub fn huge_page_share(&self) -> Option<(usize, f64)> {
        let a = self.arena.as_ref()?;
        #[allow(clippy::cast_precision_loss)]
        a.huge_bytes().map(|h| (a.used(), (h as f64 / a.used().max(1) as f64).min(1.0)))
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

    /// The RoPE layer `layer` uses.
    fn rope_of(&self, layer: usize) -> &Rope {
        match &self.rope_local {
            Some(r) if self.config.is_local(layer) => r,
            _ => &self.rope,
        }
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

    /// Bytes of weights one decoded token reads: every tensor of the file but the token
    /// embeddings, of which it reads one row — unless the output projection is that table
    /// (tied), which it reads whole. The memory floor of decoding is these bytes over the
    /// machine's read bandwidth.
    pub fn decode_bytes(&self) -> u64 {
        let tensors = &self.file.header.tensors;
        let all: u64 = tensors.iter().map(|t| t.size).sum();
        match self.file.tensor("token_embd.weight") {
            Some(e) if self.file.tensor("output.weight").is_some() => {
                let (rows, _) = e.rows_cols();
                all - e.size + e.size / rows.max(1)
            }
            _ => all,
        }
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
        // Without a template the default is ChatML; a vocabulary without its markup tokens is
        // a base model (Gemma 3 270M): its markup would be plain text, so there is no chat.
        if self.chat_template().is_none() && tk.token_id("<|im_start|>").is_none() {
            return Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, NO_CHAT));
        }
        let name = |id: Option<u32>| id.and_then(|i| tk.token_text(i)).unwrap_or("").to_string();
        crate::chat::render_with(self.chat_template(), messages, &name(tk.bos), &name(tk.eos), add_generation_prompt)
    }
}

/// Why a model has no chat ([`Model::render_chat`]'s error for a base model).
pub const NO_CHAT: &str = "this model file has no chat template (a base model): use raw completions";

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
    /// Each row's RoPE angles (cos, sin) for the pass, by the model's global RoPE and by its
    /// local one where it has one ([`Rope::angles`]).
    angles: [Vec<(f32, f32)>; 2],
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
        let mut kv = ChunkedKv::new(geom, capacity, opts.base);
        if c.kept_layers() < c.n_layers {
            kv.set_layer_order(c.kv_slots(), c.kept_layers()).expect("a permutation of the layers, on an empty cache");
        }
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

    /// Queries from position `pos` on must not reach a dead chunk (the cache was truncated
    /// below where its window had passed).
    fn check_window(&self, pos: usize) -> Result<()> {
        let dead = self.kv.dead();
        if dead > self.model.config.dead_chunks(pos, self.kv.geom.chunk_tokens) {
            return Err(ModelError::WindowDropped { pos, dead });
        }
        Ok(())
    }

    /// Declares dead the chunks no local layer reads again at the current length
    /// ([`Config::dead_chunks`]): their local layers' bytes are dropped (heap chunks shrink;
    /// a memory manager gives attached memory back itself). Returns the dead chunks. Nothing
    /// to do without a sliding window. Truncating below a dead chunk's window afterwards
    /// makes the next pass fail ([`ModelError::WindowDropped`]).
    pub fn drop_dead_kv(&mut self) -> Result<usize> {
        let n = self.model.config.dead_chunks(self.n_past(), self.kv.geom.chunk_tokens).max(self.kv.dead());
        if n > self.kv.dead() {
            self.kv.set_dead(n)?;
        }
        Ok(n)
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
        self.check_window(self.n_past())?;
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
        let Some(first) = sessions.first() else { return Ok(&[]) };
        let pool = Arc::clone(&first.pool);
        Self::step_batch_on(&pool, sessions, tokens, scratch)
    }

    /// [`Session::step_batch`] on `pool`'s threads instead of the sessions' own: a caller can
    /// run two passes at once on disjoint sessions, each on a pool of its own (a prompt
    /// prefilled on one core while other contexts decode on the other). The same bits on any
    /// pool.
    pub fn step_batch_on<'s>(
        pool: &Arc<ThreadPool>,
        sessions: &mut [&mut Session],
        tokens: &[&[u32]],
        scratch: &'s mut Scratch,
    ) -> Result<&'s [f32]> {
        if sessions.len() != tokens.len() {
            return Err(ModelError::Batch("one token list per session"));
        }
        let Some(first) = sessions.first() else { return Ok(&[]) };
        let (model, pool, sparsity) = (Arc::clone(&first.model), Arc::clone(pool), first.sparsity.clone());
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
            s.check_window(s.n_past())?;
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
        let (hd, model) = (self.model.config.head_dim, &self.model);
        // A rotation by -delta positions: angles -delta * theta_i, built like the forward's,
        // with each layer's RoPE.
        let rotate = move |layer: usize, x: &mut [f32]| model.rope_of(layer).apply(&mut [x], hd, -(delta as f32));
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
        if let Some(&p) = positions.first() {
            self.check_window(p)?;
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
    /// Asks for the cache lines that [`Self::write`] will write for the rows of decoding
    /// contexts (at most [`TILE`] rows of one cache), so they arrive while the layer's
    /// products run (see `prefetch_writes`).
    fn prefetch_writes(&self, layer: usize, positions: &[usize]);
    /// Whether an observer records the attention of these rows (then every row attends).
    fn observed(&self) -> bool;
    /// From now on the pass holds only rows `rows` (ascending) of those it had, in that order.
    fn keep_rows(&mut self, rows: &[usize]);
    #[allow(clippy::too_many_arguments)]
    fn attend(&mut self, pool: &ThreadPool, c: &Config, layer: usize, qkv: &[f32], ld: usize, positions: &[usize], out: &mut [f32]);
}

struct OneCache<'a> {
    kv: &'a mut ChunkedKv,
    observer: Option<&'a mut AttentionStats>,
}

impl Caches for OneCache<'_> {
    fn write(&mut self, layer: usize, _row: usize, pos: usize, k: &[f32], v: &[f32]) {
        self.kv.write_with(layer, pos, k, v, kernels::int8_codes);
    }
    fn prefetch_writes(&self, layer: usize, positions: &[usize]) {
        if positions.len() <= TILE {
            for &pos in positions {
                self.kv.row_ranges(layer, pos, kernels::prefetch);
            }
        }
    }
    fn observed(&self) -> bool {
        self.observer.is_some()
    }
    fn keep_rows(&mut self, _rows: &[usize]) {}
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
        self.sessions[i].kv.write_with(layer, pos, k, v, kernels::int8_codes);
    }
    fn prefetch_writes(&self, layer: usize, positions: &[usize]) {
        for (s, r) in self.sessions.iter().zip(&self.spans).filter(|(_, r)| r.len() <= TILE) {
            for &pos in &positions[r.clone()] {
                s.kv.row_ranges(layer, pos, kernels::prefetch);
            }
        }
    }
    fn observed(&self) -> bool {
        self.sessions.iter().any(|s| s.attention.is_some())
    }
    fn keep_rows(&mut self, rows: &[usize]) {
        for r in &mut self.spans {
            *r = rows.partition_point(|&x| x < r.start)..rows.partition_point(|&x| x < r.end);
        }
    }
    fn attend(&mut self, pool: &ThreadPool, c: &Config, layer: usize, qkv: &[f32], ld: usize, positions: &[usize], out: &mut [f32]) {
        // Sessions with one tile of rows (decoding) attend together, in the same few pool
        // operations; longer pieces of prompts tile their own.
        let mut decoding = Vec::new();
        let mut observers: Vec<Option<std::sync::Mutex<&mut AttentionStats>>> = Vec::new();
        let mut longer = Vec::new();
        let mut rest = out;
        for (s, r) in self.sessions.iter_mut().zip(&self.spans) {
            let (o, tail) = std::mem::take(&mut rest).split_at_mut(r.len() * c.q_dim());
            rest = tail;
            let s = &mut **s;
            if r.is_empty() {
                continue;
            }
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
    let mut n = tokens.len();
    let (dim, kvd, hd, qd) = (c.dim, c.kv_dim(), c.head_dim, c.q_dim());
    debug_assert!(logit_rows.windows(2).all(|w| w[0] < w[1]) && logit_rows.iter().all(|&r| r < n));
    // After the last layer's K/V are written, only the rows asked for logits are needed: the
    // rest of that layer (its attention where nothing observes it, the output projection,
    // the feed-forward block) runs for those rows alone, as llama.cpp's graph does (its
    // `inp_out_ids`). A prompt's piece beside decoding calls keeps 1 of its 16 rows there, a
    // recompute none. Not while statistics of the activations are collected (a calibration
    // counts every row). A row's arithmetic is its own, so the kept rows' bits are unchanged.
    let trim = logit_rows.len() < n && sp.calibrator.is_none() && sp.channel_use.is_none();
    let last_layer = model.layers.len().saturating_sub(1);
    s.x.resize(n * dim, 0.0);
    s.xb.resize(n * dim, 0.0);
    s.qkv.resize(n * (qd + 2 * kvd), 0.0);
    s.att.resize(n * qd, 0.0);
    s.ffn.resize(n * 2 * c.ffn_dim, 0.0);

    let emb = model.view(&model.tok_embd);
    for (t, &tok) in tokens.iter().enumerate() {
        let x = &mut s.x[t * dim..(t + 1) * dim];
        quant::dequantize_row(emb.ty, emb.row(tok as usize), x);
        if let Some(k) = c.embd_scale {
            x.iter_mut().for_each(|v| *v *= k);
        }
    }

    // Each row's rotation angles, once a pass for each RoPE the layers use: every layer
    // computed the same 32 cosines and sines a row (7,680 of each in a decode step of 8
    // contexts, on one thread). A stride of at least 1: a model may rotate no channels.
    let half = (model.rope.dims / 2).max(1);
    for (table, rope) in s.angles.iter_mut().zip([Some(&model.rope), model.rope_local.as_ref()]) {
        table.clear();
        if let Some(rope) = rope {
            table.resize(n * half, (0.0, 0.0));
            for (cs, &pos) in table.chunks_exact_mut(half).zip(positions) {
                rope.angles(pos as f32, cs);
            }
        }
    }

    for (li, l) in model.layers.iter().enumerate() {
        before_layer(li);
        // The lines this layer's K/V rows go to, asked for before its products: a decoding
        // context's row lands in its chunk's blocks, which the rest of the step has evicted,
        // and written on this thread after the products each write waited a miss (12 lines a
        // context and layer on the default model; 8 contexts 64 deep spent ~0.25 ms of a step
        // in the writes, section timer). Steps alternating with and without it in one process
        // (200 steps, 3 runs): 0.987-0.989x the time at 8 contexts, 0.983-0.992x at 1.
        caches.prefetch_writes(li, positions);
        // Attention block.
        rmsnorm_rows(pool, &s.x[..n * dim], &l.attn_norm, c.norm_eps, &mut s.xb, dim);
        sparsify(sp.sparsity, sp.calibrator.as_deref_mut(), sp.channel_use.as_deref_mut(), li, 0, &mut s.xb[..n * dim]);
        announce(model, pool, li, 0, &s.xb[..n * dim], n, &mut s.ranges);
        matmul_multi(pool, model, &[&l.wq, &l.wk, &l.wv], &s.xb, n, &mut s.acts, &mut s.qkv);
        let ld = qd + 2 * kvd;
        let rope = model.rope_of(li);
        let angles = &s.angles[usize::from(!std::ptr::eq(rope, &model.rope))];
        // Each token's biases, head norms and rotation, spread over the pool for a prompt (on
        // one thread they were a few percent of a short prefill, the other threads waiting).
        let prepare = |t0: usize, rows: &mut [f32]| {
            for (row, cs) in rows.chunks_exact_mut(ld).zip(angles[t0 * half..].chunks_exact(half)) {
                for (b, off) in [(&l.bq, 0), (&l.bk, qd), (&l.bv, qd + kvd)] {
                    if let Some(b) = b {
                        row[off..off + b.len()].iter_mut().zip(b).for_each(|(x, y)| *x += y);
                    }
                }
                let (q, rest) = row.split_at_mut(qd);
                // Gemma 3 normalizes each query and key head before RoPE.
                for (x, w) in [(&mut *q, &l.q_norm), (&mut rest[..kvd], &l.k_norm)] {
                    if let Some(w) = w {
                        for head in x.chunks_exact_mut(hd) {
                            rmsnorm_in_place(head, w, c.norm_eps);
                        }
                    }
                }
                rope.rotate(&mut [q, &mut rest[..kvd]], hd, cs);
            }
        };
        if n >= 2 * ROW_PIECE {
            let pieces: Vec<_> = s.qkv[..n * ld].chunks_mut(ROW_PIECE * ld).enumerate().collect();
            pool.scatter("qkv rope", pieces, &|(i, rows)| prepare(i * ROW_PIECE, rows));
        } else {
            prepare(0, &mut s.qkv[..n * ld]);
        }
        for (t, &pos) in positions.iter().enumerate() {
            let kv = &s.qkv[t * ld + qd..(t + 1) * ld];
            caches.write(li, t, pos, &kv[..kvd], &kv[kvd..]);
        }
        let kept: Vec<usize>;
        let mut positions = positions;
        if trim && li == last_layer {
            let m = logit_rows.len();
            if caches.observed() {
                caches.attend(pool, c, li, &s.qkv, ld, positions, &mut s.att);
                keep_rows(&mut s.att, qd, logit_rows);
            } else if m > 0 {
                keep_rows(&mut s.qkv, ld, logit_rows);
                kept = logit_rows.iter().map(|&r| positions[r]).collect();
                positions = &kept;
                caches.keep_rows(logit_rows);
                caches.attend(pool, c, li, &s.qkv, ld, positions, &mut s.att);
            }
            keep_rows(&mut s.x, dim, logit_rows);
            n = m;
            if n == 0 {
                break;
            }
        } else {
            caches.attend(pool, c, li, &s.qkv, ld, positions, &mut s.att);
        }
        sparsify(sp.sparsity, sp.calibrator.as_deref_mut(), sp.channel_use.as_deref_mut(), li, 1, &mut s.att[..n * qd]);
        announce(model, pool, li, 1, &s.att[..n * qd], n, &mut s.ranges);
        matmul_multi(pool, model, &[&l.wo], &s.att[..n * qd], n, &mut s.acts, &mut s.xb);
        add_residual(&mut s.x, &mut s.xb[..n * dim], l.post_attn_norm.as_deref(), c.norm_eps, dim);

        // Feed-forward block.
        rmsnorm_rows(pool, &s.x[..n * dim], &l.ffn_norm, c.norm_eps, &mut s.xb, dim);
        sparsify(sp.sparsity, sp.calibrator.as_deref_mut(), sp.channel_use.as_deref_mut(), li, 2, &mut s.xb[..n * dim]);
        announce(model, pool, li, 2, &s.xb[..n * dim], n, &mut s.ranges);
        matmul_multi(pool, model, &[&l.w_gate, &l.w_up], &s.xb, n, &mut s.acts, &mut s.ffn);
        let f = c.ffn_dim;
        let gelu = c.ffn_gelu;
        let swiglu = |rows: &mut [f32]| {
            for row in rows.chunks_exact_mut(2 * f) {
                let (g, u) = row.split_at_mut(f);
                if gelu {
                    for (gv, uv) in g.iter_mut().zip(u.iter()) {
                        *gv = gelu_table(*gv) * uv;
                    }
                } else {
                    kernels::silu_mul(g, u);
                }
            }
        };
        // A prompt's gates are n x ffn exponentials a layer (a fifth of a 512-token prefill
        // on one thread when they took libm's exp one at a time; far less on vectors):
        // spread over the threads in pieces of at most 16 tokens. From 16 rows (a prompt's
        // piece beside decoding calls: the other thread waited for them); 8 decoding rows
        // lost more to the split than they gained (a step 1.01-1.03x the time). Element-wise,
        // so the same bits however split.
        if n >= 16 && pool.threads() > 1 {
            let per = n.div_ceil(pool.threads()).min(16);
            pool.scatter("swiglu", s.ffn[..n * 2 * f].chunks_mut(per * 2 * f).collect(), &|rows| swiglu(rows));
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
        add_residual(&mut s.x, &mut s.xb[..n * dim], l.post_ffn_norm.as_deref(), c.norm_eps, dim);
    }

    if logit_rows.is_empty() {
        return;
    }
    let kept: Vec<usize>;
    let rows = if trim {
        kept = (0..logit_rows.len()).collect();
        &kept
    } else {
        logit_rows
    };
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
    // A few prompt tokens (a piece beside decoding calls: 16 here) make short groups too: at
    // 2 groups a chunk a 16-token piece's products were ~10,000 claims a pass, ~4% of it in
    // the claims (perf of `llms bench --pp 16 --depth 320 --kv int8`); the chunks grow back to
    // decode's 8 groups as the tokens shrink to 16.
    let most = if n <= 8 { 8 } else { (128 / n).clamp(2, 8) };
    // Each thread's groups in one forward stream (`for_runs`): decode reads the weights at the
    // prefetchers' pace. An even count: the 512-bit kernels take groups in pairs, and a chunk
    // of 5 left a group a chunk to the 256-bit tile (24 tokens: 0.94x the pass).
    let chunk = (units / (4 * pool.threads())).clamp(1, most);
    let chunk = if chunk > 1 { chunk & !1 } else { chunk };
    let product = || {
        pool.for_runs("matmul", units, chunk, &|a, b| {
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
        })
    };
    // Decode's products stream the weights from memory: their prefetch distance is tuned on
    // them (`kernels::ahead`). A prompt's tiles are bound by arithmetic and run as they are.
    // A few tokens' (a batched step's) tile, 256-bit or pairs, is tuned on them as well
    // (`kernels::pairs`); the matrices of one product are of one family in the models met.
    let packed: Option<usize> = ms.iter().map(|m| m.packed.as_ref().map(PackedWeight::bytes)).sum();
    match packed {
        Some(bytes) if n <= 8 => {
            let family = ms[0].packed.as_ref().and_then(kernels::pairs::Family::of);
            kernels::ahead::tuned(bytes, n, || kernels::pairs::tuned(family, bytes, n, product))
        }
        _ => product(),
    }
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

/// GELU as llama.cpp's CPU backend computes it in a gated feed-forward: the input rounded to
/// f16 and looked up in a table of the tanh form's values (each stored as f16), 0 below -10
/// and the input itself above 10.
fn gelu_table(x: f32) -> f32 {
    static TABLE: std::sync::LazyLock<Vec<half::f16>> = std::sync::LazyLock::new(|| {
        (0..=u16::MAX)
            .map(|bits| {
                let v = half::f16::from_bits(bits).to_f32();
                // ggml's constant, written out: a shorter literal can round to another f32.
                #[allow(clippy::excessive_precision)]
                const SQRT_2_OVER_PI: f32 = 0.797_884_560_802_865_355_879_892_119_868_76;
                half::f16::from_f32(0.5 * v * (1.0 + (SQRT_2_OVER_PI * v * (1.0 + 0.044_715 * v * v)).tanh()))
            })
            .collect()
    });
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        TABLE[usize::from(half::f16::from_f32(x).to_bits())].to_f32()
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

/// [`rmsnorm`] of `R` consecutive rows of `dim` values at once, each row's f64 sum of squares
/// added in the same order as alone (the same bits), the rows' sums side by side: one row's
/// sum is a chain of dependent f64 additions (~4 cycles each, 61 rows' worth a decode step),
/// which for a batch of 8 decoding contexts took 0.33 of a 9.7 ms step on one thread while the
/// others waited; 8 independent chains go at the adder's throughput instead.
fn rmsnorm_group<const R: usize>(x: &[f32], w: &[f32], eps: f32, out: &mut [f32], dim: usize) {
    let rows: [&[f32]; R] = std::array::from_fn(|r| &x[r * dim..(r + 1) * dim]);
    let mut ss = [0.0f64; R];
    for i in 0..dim {
        for (acc, row) in ss.iter_mut().zip(&rows) {
            let v = row[i];
            *acc += f64::from(v * v);
        }
    }
    for ((acc, xr), or) in ss.iter().zip(rows).zip(out.chunks_exact_mut(dim)) {
        let scale = 1.0 / (((acc / dim as f64) as f32) + eps).sqrt();
        for ((o, &xv), &wv) in or.iter_mut().zip(xr).zip(w) {
            *o = xv * scale * wv;
        }
    }
}

/// [`rmsnorm`] of `x` into itself (llama.cpp's norm, then its multiply by the weight).
fn rmsnorm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let ss = x.iter().map(|&v| f64::from(v * v)).sum::<f64>() / x.len() as f64;
    let scale = 1.0 / ((ss as f32) + eps).sqrt();
    for (o, &wv) in x.iter_mut().zip(w) {
        *o = *o * scale * wv;
    }
}

/// `x += out` row by row, with `out` normalized first where the model does (Gemma 3's norms
/// after attention and after the feed-forward).
/// Moves row `keep[i]` of `buf` (rows of `width` values; `keep` ascending) to row `i`.
fn keep_rows(buf: &mut [f32], width: usize, keep: &[usize]) {
    for (i, &r) in keep.iter().enumerate() {
        if r != i {
            buf.copy_within(r * width..(r + 1) * width, i * width);
        }
    }
}

fn add_residual(x: &mut [f32], out: &mut [f32], post_norm: Option<&[f32]>, eps: f32, dim: usize) {
    if let Some(w) = post_norm {
        for row in out.chunks_exact_mut(dim) {
            rmsnorm_in_place(row, w, eps);
        }
    }
    x.iter_mut().zip(out.iter()).for_each(|(x, o)| *x += o);
}

/// Rows a job of the per-row operations of a prompt takes (norms, biases, rotations): each
/// row's arithmetic is its own, so the bits do not depend on the split.
const ROW_PIECE: usize = 8;

/// [`rmsnorm`] of each row, spread over the pool for a prompt: a row's sum of squares is one
/// chain of f64 additions (llama.cpp's order), and on one thread the norms were ~5% of a
/// 50-token prefill while the other threads waited.
fn rmsnorm_rows(pool: &ThreadPool, x: &[f32], w: &[f32], eps: f32, out: &mut [f32], dim: usize) {
    let rows = |x: &[f32], out: &mut [f32]| {
        let (mut x, mut out) = (x, out);
        while x.len() >= 8 * dim {
            let (xs, rest) = x.split_at(8 * dim);
            let (os, orest) = out.split_at_mut(8 * dim);
            rmsnorm_group::<8>(xs, w, eps, os, dim);
            (x, out) = (rest, orest);
        }
        while x.len() >= 4 * dim {
            let (xs, rest) = x.split_at(4 * dim);
            let (os, orest) = out.split_at_mut(4 * dim);
            rmsnorm_group::<4>(xs, w, eps, os, dim);
            (x, out) = (rest, orest);
        }
        for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
            rmsnorm(xr, w, eps, or);
        }
    };
    if x.len() >= 2 * ROW_PIECE * dim {
        let pieces: Vec<_> = x.chunks(ROW_PIECE * dim).zip(out.chunks_mut(ROW_PIECE * dim)).collect();
        pool.scatter("rmsnorm", pieces, &|(x, o)| rows(x, o));
    } else {
        rows(x, out);
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
    fn new(c: &Config, base: f32) -> Self {
        Rope {
            dims: c.rope_dims,
            theta_scale: base.powf(-2.0 / c.rope_dims as f32),
            neox: c.rope_neox,
            freq_scale: c.rope_freq_scale,
            factors: c.rope_factors.clone(),
        }
    }

    /// Rotates each head of each of `xs` by `pos` positions (any real `pos`, negative to
    /// undo): a token's queries and keys share one table of angles.
    fn apply(&self, xs: &mut [&mut [f32]], head_dim: usize, pos: f32) {
        let mut cs = [(0.0f32, 0.0f32); 256];
        let cs = &mut cs[..self.dims / 2];
        self.angles(pos, cs);
        self.rotate(xs, head_dim, cs);
    }

    /// The (cos, sin) of each pair's angle at `pos`, `dims / 2` of them into `cs`.
    fn angles(&self, pos: f32, cs: &mut [(f32, f32)]) {
        // theta_i = pos * theta_scale^i, built by repeated multiplication in f32 and then
        // divided and scaled in llama.cpp's order, so the rotations agree bit for bit (a
        // factor and scale of 1 leave theta's bits as they are).
        let mut theta = pos;
        for (i, c) in cs.iter_mut().take(self.dims / 2).enumerate() {
            let ff = self.factors.as_ref().map_or(1.0, |f| f[i]);
            let t = self.freq_scale * (theta / ff);
            *c = (t.cos(), t.sin());
            theta *= self.theta_scale;
        }
    }

    /// Rotates each head of each of `xs` by the angles `cs` ([`Rope::angles`]).
    fn rotate(&self, xs: &mut [&mut [f32]], head_dim: usize, cs: &[(f32, f32)]) {
        let half = self.dims / 2;
        let (step, off) = if self.neox { (1, half) } else { (2, 1) };
        for head in xs.iter_mut().flat_map(|x| x.chunks_exact_mut(head_dim)) {
            for (i, &(cos, sin)) in cs.iter().enumerate().take(half) {
                let (a, b) = (head[step * i], head[step * i + off]);
                head[step * i] = a * cos - b * sin;
                head[step * i + off] = a * sin + b * cos;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows normalized together (8 and 4 at a time, the rest alone) give each row the bits it
    /// gets alone, for every count of rows up to two groups and a remainder.
    #[test]
    fn rows_normalized_together_equal_each_alone() {
        let dim = 96;
        let pool = ThreadPool::new(1);
        // Values over many magnitudes, and a row holding a NaN (which must stay in its row).
        let x: Vec<f32> = (0..21 * dim).map(|i| ((i as f32) * 0.731).sin() * 10f32.powi((i % 13) as i32 - 6)).collect();
        let w: Vec<f32> = (0..dim).map(|i| 0.5 + (i as f32) * 0.01).collect();
        let mut x_nan = x.clone();
        x_nan[5 * dim + 3] = f32::NAN;
        for x in [&x, &x_nan] {
            for n in 1..=21 {
                let mut got = vec![0.0f32; n * dim];
                rmsnorm_rows(&pool, &x[..n * dim], &w, 1e-5, &mut got, dim);
                for r in 0..n {
                    let mut want = vec![0.0f32; dim];
                    rmsnorm(&x[r * dim..(r + 1) * dim], &w, 1e-5, &mut want);
                    let (g, e): (Vec<u32>, Vec<u32>) =
                        (got[r * dim..(r + 1) * dim].iter().map(|v| v.to_bits()).collect(), want.iter().map(|v| v.to_bits()).collect());
                    assert_eq!(g, e, "{n} rows, row {r}");
                }
            }
        }
    }
}

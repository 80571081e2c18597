//! The engine side of `mm`'s traits: chunk formats of the engine's KV cache as mm format
//! codes, and an engine `Session` as an mm `KvContext`.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::AtomicPtr;
use std::sync::{Arc, Mutex};

use engine::kv::{KvFormat, KvGeometry};
use engine::model::{Model, Session, SessionOptions};
use engine::{Logits, ThreadPool};
use mm::{Codec, EngineError, Format, KvContext};

/// mm's code for an engine format (its index in `KvFormat::ALL`).
pub fn code(f: KvFormat) -> Format {
    match f {
        KvFormat::F16 => 0,
        KvFormat::Int8 => 1,
        KvFormat::Q4 => 2,
        KvFormat::Q2 => 3,
        KvFormat::Q4R => 4,
        KvFormat::Q2R => 5,
        KvFormat::K4V4 => 6,
        KvFormat::K3V3 => 7,
        KvFormat::K2V2 => 8,
        KvFormat::K4V3 => 9,
    }
}

/// The engine format of an mm code (unknown codes, which mm never makes, read as int8).
pub fn format(c: Format) -> KvFormat {
    KvFormat::ALL.get(c as usize).copied().unwrap_or(KvFormat::Int8)
}

/// The tolerance-aware level choice (mm's eq. 2-3) over `levels` (the base first) at `ratio` x
/// int8 bytes, as a function of chunk densities: what `engine::eval::perplexity_kv` calls for a
/// mix.
pub fn mix_chooser(model: &Model, chunk_tokens: usize, ratio: f64, levels: &[KvFormat]) -> impl Fn(&[f64], &[KvFormat]) -> Vec<KvFormat> {
    let codec = EngineCodec::new(model, chunk_tokens);
    let levels = levels.to_vec();
    #[allow(clippy::cast_precision_loss)]
    let sizes: Vec<f64> = levels.iter().map(|&f| codec.geom.chunk_bytes(f) as f64).collect();
    let losses: Vec<f64> = levels.iter().map(|&f| mm::levels::loss_of_bits(mm::Codec::bits(&codec, code(f)))).collect();
    move |d: &[f64], held: &[KvFormat]| {
        // A format outside the levels (the f16 base) counts as the heaviest.
        let held: Vec<usize> = held.iter().map(|f| levels.iter().position(|l| l == f).unwrap_or(0)).collect();
        mm::levels::choose_levels_held(d, &held, &sizes, &losses, ratio).into_iter().map(|l| levels[l]).collect()
    }
}

/// Chunk sizes of a model's KV cache.
#[derive(Debug, Clone, Copy)]
pub struct EngineCodec {
    pub geom: KvGeometry,
    fingerprint: u64,
    /// Layers a dead chunk keeps, and the window that kills chunks (0: none), from the model
    /// (`Config::kept_layers`, `Config::dead_chunks`).
    kept: usize,
    window: usize,
}

impl EngineCodec {
    pub fn new(model: &Model, chunk_tokens: usize) -> Self {
        let c = &model.config;
        let geom = KvGeometry { n_layers: c.n_layers, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim, chunk_tokens };
        // What makes two models' KV records incompatible: the weights (file size and shape
        // stand in for them) and the chunk layout. Bump LAYOUT when kv.rs's layout changes;
        // every format's block sizes are hashed too, so a change of size cannot be missed
        // (one was: layout 3's smaller split headers first shipped under layout 2's number);
        // layout 4: the split levels' 4-bit V codes refine the 3-bit ones, at the same sizes;
        // layout 5: the same bytes, V decoded times its level's gain (kv.rs `V_GAIN`);
        // layout 6: the same bytes, K's zero points in quarter steps and its steps 2^(-e/6);
        // layout 7: the same bytes, the K reference's lowest bit choosing 2^(-e/6) or 2^(-e/3).
        const LAYOUT: u64 = 7;
        let sizes = KvFormat::ALL.iter().flat_map(|&f| [geom.head_block_bytes(f, 0) as u64, geom.head_block_bytes(f, 1) as u64]);
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for v in [
            LAYOUT,
            model.file_bytes() as u64,
            c.n_layers as u64,
            c.n_kv_heads as u64,
            c.head_dim as u64,
            c.vocab as u64,
            c.dim as u64,
            chunk_tokens as u64,
        ]
        .into_iter()
        .chain(sizes)
        // A sliding-window model lays its global layers first in a chunk (`Config::kv_slots`):
        // its records say so. (Nothing is added without a window: older stores stay valid.)
        .chain((c.kept_layers() < c.n_layers).then(|| c.kv_slots().into_iter().map(|s| s as u64)).into_iter().flatten())
        {
            for b in v.to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        let window = c.swa.map_or(0, |w| w.window);
        Self { geom, fingerprint: h, kept: c.kept_layers(), window }
    }

    /// The swap store's geometry for this model's chunks.
    pub fn store_geometry(&self) -> mm::StoreGeometry {
        mm::StoreGeometry { n_layers: self.geom.n_layers, max_layer_bytes: self.geom.layer_bytes(KvFormat::F16), kept_layers: self.kept }
    }
}

impl Codec for EngineCodec {
    fn n_layers(&self) -> usize {
        self.geom.n_layers
    }
    fn layer_bytes(&self, f: Format) -> usize {
        self.geom.layer_bytes(format(f))
    }
    fn chunk_tokens(&self) -> usize {
        self.geom.chunk_tokens
    }
    fn bits(&self, f: Format) -> f64 {
        format(f).mean_bits()
    }
    fn name(&self, f: Format) -> &'static str {
        format(f).name()
    }
    fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
    fn kept_layers(&self) -> usize {
        self.kept
    }
    fn convert(&self, from: Format, src: &[u8], to: Format, dst: &mut [u8], tokens: usize, layers: usize) -> Result<(), EngineError> {
        let g = KvGeometry { n_layers: layers, ..self.geom };
        let (from, to) = (format(from), format(to));
        if to.rotated() && !engine::kv::rotation_fits(g.head_dim) {
            return Err(EngineError::new(format!("{} needs a power-of-two head of at most 256 channels, not {}", to.name(), g.head_dim)));
        }
        if src.len() < g.chunk_bytes(from) || dst.len() < g.chunk_bytes(to) || tokens > g.chunk_tokens {
            return Err(EngineError::new(format!(
                "a chunk of {} bytes ({}) to {} bytes ({}), {tokens} tokens: the sizes do not match the geometry",
                src.len(),
                from.name(),
                dst.len(),
                to.name()
            )));
        }
        engine::kv::convert_chunk(&g, from, src, to, dst, tokens);
        Ok(())
    }
    fn dead_chunks(&self, tokens: usize) -> usize {
        if self.window == 0 || self.kept == self.geom.n_layers {
            0
        } else {
            engine::loader::dead_chunks(self.window, tokens, self.geom.chunk_tokens)
        }
    }
}

/// A session's KV cache seen by mm.
#[derive(Debug)]
pub struct SessionKv<'a>(pub &'a mut Session);

impl KvContext for SessionKv<'_> {
    fn base(&self) -> Format {
        code(self.0.kv.base())
    }
    fn tokens(&self) -> &[u32] {
        &self.0.tokens
    }
    fn n_chunks(&self) -> usize {
        self.0.kv.n_chunks()
    }
    fn format(&self, chunk: usize) -> Format {
        code(self.0.kv.format(chunk))
    }
    unsafe fn attach(&mut self, chunk: usize, ptr: NonNull<u8>, len: usize, f: Format) -> Result<(), EngineError> {
        // SAFETY: the caller's contract is attach_as's.
        unsafe { self.0.kv.attach_as(chunk, ptr, len, format(f)) }.map_err(EngineError::new)
    }
    unsafe fn attach_moving(&mut self, chunk: usize, at: Arc<AtomicPtr<u8>>, len: usize, f: Format) -> Result<(), EngineError> {
        // SAFETY: the caller's contract is attach_moving's.
        unsafe { self.0.kv.attach_moving(chunk, at, len, format(f)) }.map_err(EngineError::new)
    }
    unsafe fn adopt(&mut self, chunk: usize, ptr: NonNull<u8>, len: usize) -> Result<(), EngineError> {
        // SAFETY: as attach.
        unsafe { self.0.kv.attach(chunk, ptr, len) }.map_err(EngineError::new)
    }
    unsafe fn push_chunk(&mut self, ptr: NonNull<u8>, len: usize) -> Result<(), EngineError> {
        // SAFETY: as attach.
        unsafe { self.0.kv.push_external(ptr, len) }.map_err(EngineError::new)
    }
    fn convert(&mut self, chunk: usize, to: Format) -> Result<(), EngineError> {
        self.0.kv.set_format(chunk, format(to)).map_err(EngineError::new)
    }
    fn set_dead(&mut self, n: usize) -> Result<(), EngineError> {
        self.0.kv.set_dead(n).map_err(EngineError::new)
    }
    fn revive_all(&mut self) {
        self.0.kv.revive_all();
    }
    fn recompute(&mut self, chunks: &[usize], before_layer: &mut dyn FnMut(usize)) -> Result<(), EngineError> {
        let ct = self.0.kv.geom.chunk_tokens;
        let n = self.0.tokens.len();
        let positions: Vec<usize> = chunks.iter().flat_map(|&c| c * ct..((c + 1) * ct).min(n)).collect();
        // mm reads records in the chunk's layer order; computing layer l needs every place up
        // to the furthest one a layer so far lies in (they differ with a sliding window).
        let slots: Vec<usize> = (0..self.0.kv.geom.n_layers).map(|l| self.0.kv.slot(l)).collect();
        let mut upto = 0;
        let mut in_order = |l: usize| {
            upto = upto.max(slots[l]);
            before_layer(upto);
        };
        self.0.recompute(&positions, &mut in_order).map_err(EngineError::new)
    }
    fn densities(&self) -> Option<Vec<f64>> {
        let a = self.0.attention.as_ref()?;
        let ct = self.0.kv.geom.chunk_tokens;
        Some((0..self.0.kv.n_chunks()).map(|c| a.density(c * ct..(c + 1) * ct)).collect())
    }
    fn before_wait(&self) {
        self.0.pool.rest();
    }
}

/// The fault path's recompute (mm's [`mm::FaultRecompute`]): a chunk with no valid record is
/// rebuilt from the context's tokens by running its whole prefix in a private session, on a
/// pool of its own (the faulting thread may be one of the main pool's, blocked in the fault).
/// Slow — the prefix is recomputed — but only the safety net: loads go through `mm.begin`.
pub struct EngineRecompute {
    model: Arc<Model>,
    pool: Arc<ThreadPool>,
    chunk_tokens: usize,
    base: KvFormat,
    /// The sparsity the context was computed with: a recomputed chunk must be the same K/V.
    sparsity: Option<Arc<engine::sparsity::Sparsity>>,
    tokens: Mutex<HashMap<u64, Arc<Vec<u32>>>>,
}

impl std::fmt::Debug for EngineRecompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineRecompute").field("chunk_tokens", &self.chunk_tokens).finish_non_exhaustive()
    }
}

impl EngineRecompute {
    pub fn new(model: Arc<Model>, chunk_tokens: usize, base: KvFormat) -> Self {
        Self { model, pool: Arc::new(ThreadPool::new(1)), chunk_tokens, base, sparsity: None, tokens: Mutex::default() }
    }

    /// Recomputes with Top-K `sparsity`, as the sessions whose chunks it rebuilds compute.
    #[must_use]
    pub fn with_sparsity(mut self, sparsity: Option<Arc<engine::sparsity::Sparsity>>) -> Self {
        self.sparsity = sparsity;
        self
    }

    /// The tokens of context `ctx` as its chunks hold them (after each call).
    pub fn set_tokens(&self, ctx: u64, tokens: &[u32]) {
        self.tokens.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(ctx, Arc::new(tokens.to_vec()));
    }

    pub fn forget(&self, ctx: u64) {
        self.tokens.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&ctx);
    }
}

impl mm::FaultRecompute for EngineRecompute {
    fn recompute(&self, want: &mm::RecordMeta, out: &mut [u8]) -> Result<usize, EngineError> {
        let toks = self.tokens.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&want.context).cloned();
        let toks = toks.ok_or_else(|| EngineError::new(format!("context {} has no tokens to recompute from", want.context)))?;
        let c = want.chunk as usize;
        let end = c * self.chunk_tokens + want.tokens as usize;
        if want.tokens == 0 || end > toks.len() {
            return Err(EngineError::new(format!("chunk {c} ({} tokens) is past the context's {} tokens", want.tokens, toks.len())));
        }
        // The chunk's K/V depend on every token before it: recompute only what it names.
        if mm::prefix_hashes(&toks[..end], self.chunk_tokens).get(c) != Some(&want.prefix_hash) {
            return Err(EngineError::new(format!("chunk {c}: the context's tokens are not the ones it was computed from")));
        }
        let opts = SessionOptions {
            capacity: end,
            chunk_tokens: self.chunk_tokens,
            base: self.base,
            observe_attention: false,
            sliding_window: None,
        };
        let mut s = Session::with_options(Arc::clone(&self.model), Arc::clone(&self.pool), opts);
        s.set_sparsity(self.sparsity.clone()).map_err(EngineError::new)?;
        s.eval(&toks[..end], Logits::None).map_err(EngineError::new)?;
        let f = format(want.format);
        if f != self.base {
            s.kv.set_format(c, f).map_err(EngineError::new)?;
        }
        // A dead chunk's record holds its kept layers, the chunk's first bytes.
        let bytes = s.kv.chunk(c);
        let bytes = &bytes[..(s.kv.geom.layer_bytes(f) * want.layers as usize).min(bytes.len())];
        let dst =
            out.get_mut(..bytes.len()).ok_or_else(|| EngineError::new(format!("chunk {c}: {} bytes do not fit the slot", bytes.len())))?;
        dst.copy_from_slice(bytes);
        Ok(bytes.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records and configs name formats by these codes: each is the format's index in
    /// `KvFormat::ALL` and reads back as the same format.
    #[test]
    fn format_codes_are_stable_indices() {
        for (i, f) in KvFormat::ALL.into_iter().enumerate() {
            assert_eq!(code(f) as usize, i, "{f:?}");
            assert_eq!(format(code(f)), f);
        }
    }

    /// The leveller converts a chunk a layer at a time (`mm::LevelWork::encode_layers`): each
    /// layer's conversion alone gives the bytes of the whole chunk's, for every lowering.
    #[test]
    fn a_chunk_converts_layer_by_layer_to_the_same_bytes() {
        use rand::{Rng, SeedableRng};
        let geom = KvGeometry { n_layers: 3, n_kv_heads: 2, head_dim: 64, chunk_tokens: 16 };
        let codec = EngineCodec { geom, fingerprint: 0, kept: 3, window: 0 };
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut src = vec![0u8; geom.chunk_bytes(KvFormat::Int8)];
        for layer in 0..geom.n_layers {
            for kv in 0..2 {
                for h in 0..geom.n_kv_heads {
                    let blk = &mut src[geom.block_offset(KvFormat::Int8, layer, kv, h)..][..geom.head_block_bytes(KvFormat::Int8, kv)];
                    for t in 0..geom.chunk_tokens {
                        // An outlier channel, as K has.
                        let x: Vec<f32> =
                            (0..geom.head_dim).map(|c| rng.gen_range(-1.0f32..1.0) * if c == 5 { 20.0 } else { 1.0 }).collect();
                        engine::kv::write_token(KvFormat::Int8, blk, t, geom.chunk_tokens, &x);
                    }
                }
            }
        }
        let (from, lb) = (code(KvFormat::Int8), geom.layer_bytes(KvFormat::Int8));
        for to in KvFormat::ALL.into_iter().filter(|f| !f.is_base()) {
            for tokens in [geom.chunk_tokens, 9] {
                let mut whole = vec![0u8; geom.chunk_bytes(to)];
                codec.convert(from, &src, code(to), &mut whole, tokens, geom.n_layers).unwrap();
                let mut layers = vec![0u8; geom.chunk_bytes(to)];
                for (s, d) in src.chunks_exact(lb).zip(layers.chunks_exact_mut(geom.layer_bytes(to))) {
                    codec.convert(from, s, code(to), d, tokens, 1).unwrap();
                }
                assert!(whole == layers, "{} at {tokens} tokens", to.name());
            }
        }
    }
}

//! The engine side of `mm`'s traits: chunk formats of the engine's KV cache as mm format
//! codes, and an engine `Session` as an mm `KvContext`.

use std::ptr::NonNull;

use engine::kv::{KvFormat, KvGeometry};
use engine::model::{Model, Session};
use mm::{Codec, Format, KvContext};

/// mm's code for an engine format (its index in `KvFormat::ALL`).
pub fn code(f: KvFormat) -> Format {
    match f {
        KvFormat::F16 => 0,
        KvFormat::Int8 => 1,
        KvFormat::Q4 => 2,
        KvFormat::Q2 => 3,
    }
}

/// The engine format of an mm code (unknown codes, which mm never makes, read as int8).
pub fn format(c: Format) -> KvFormat {
    KvFormat::ALL.get(c as usize).copied().unwrap_or(KvFormat::Int8)
}

/// Chunk sizes of a model's KV cache.
#[derive(Debug, Clone, Copy)]
pub struct EngineCodec {
    pub geom: KvGeometry,
    fingerprint: u64,
}

impl EngineCodec {
    pub fn new(model: &Model, chunk_tokens: usize) -> Self {
        let c = &model.config;
        let geom = KvGeometry { n_layers: c.n_layers, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim, chunk_tokens };
        // What makes two models' KV records incompatible: the weights (file size and shape
        // stand in for them) and the chunk layout. Bump LAYOUT when kv.rs's layout changes.
        const LAYOUT: u64 = 1;
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
        ] {
            for b in v.to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        Self { geom, fingerprint: h }
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
    fn bits(&self, f: Format) -> u32 {
        u32::try_from(format(f).bits()).unwrap_or(16)
    }
    fn name(&self, f: Format) -> &'static str {
        format(f).name()
    }
    fn fingerprint(&self) -> u64 {
        self.fingerprint
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
    unsafe fn attach(&mut self, chunk: usize, ptr: NonNull<u8>, len: usize, f: Format) -> Result<(), String> {
        // SAFETY: the caller's contract is attach_as's.
        unsafe { self.0.kv.attach_as(chunk, ptr, len, format(f)) }.map_err(|e| e.to_string())
    }
    unsafe fn adopt(&mut self, chunk: usize, ptr: NonNull<u8>, len: usize) -> Result<(), String> {
        // SAFETY: as attach.
        unsafe { self.0.kv.attach(chunk, ptr, len) }.map_err(|e| e.to_string())
    }
    unsafe fn push_chunk(&mut self, ptr: NonNull<u8>, len: usize) -> Result<(), String> {
        // SAFETY: as attach.
        unsafe { self.0.kv.push_external(ptr, len) }.map_err(|e| e.to_string())
    }
    fn convert(&mut self, chunk: usize, to: Format) -> Result<(), String> {
        self.0.kv.set_format(chunk, format(to)).map_err(|e| e.to_string())
    }
    fn recompute(&mut self, chunks: &[usize], before_layer: &mut dyn FnMut(usize)) -> Result<(), String> {
        let ct = self.0.kv.geom.chunk_tokens;
        let n = self.0.tokens.len();
        let positions: Vec<usize> = chunks.iter().flat_map(|&c| c * ct..((c + 1) * ct).min(n)).collect();
        self.0.recompute(&positions, before_layer).map_err(|e| e.to_string())
    }
    fn densities(&self) -> Option<Vec<f64>> {
        let a = self.0.attention.as_ref()?;
        let ct = self.0.kv.geom.chunk_tokens;
        Some((0..self.0.kv.n_chunks()).map(|c| a.density(c * ct..(c + 1) * ct)).collect())
    }
}

//! What mm needs from the inference engine, as traits: mm stays model-agnostic (the engine
//! adapter lives in `tools`).

use std::ptr::NonNull;
use std::sync::atomic::AtomicPtr;
use std::sync::Arc;

/// A chunk format code, the codec's (mm only compares and sizes them).
pub type Format = u32;

/// Sizes of the chunk formats of one model.
pub trait Codec: Send + Sync {
    fn n_layers(&self) -> usize;
    /// Bytes of one layer of one chunk in format `f`.
    fn layer_bytes(&self, f: Format) -> usize;
    /// Bytes of a chunk in format `f` (its layers, contiguous).
    fn chunk_bytes(&self, f: Format) -> usize {
        self.n_layers() * self.layer_bytes(f)
    }
    fn chunk_tokens(&self) -> usize;
    /// Bits per value of `f`, over K and V (the compression level's weight in eq. 3).
    fn bits(&self, f: Format) -> f64;
    fn name(&self, f: Format) -> &'static str;
    /// A fingerprint of the model and codec: records of another model are never read.
    fn fingerprint(&self) -> u64;
    /// Layers a dead chunk keeps, first in the chunk (a sliding-window model's global
    /// layers); all of them for a model without a window.
    fn kept_layers(&self) -> usize {
        self.n_layers()
    }
    /// Leading chunks that are dead once a context holds `tokens` positions: no layer past the
    /// kept ones reads them again, at this length or any longer one. 0 without a window.
    fn dead_chunks(&self, _tokens: usize) -> usize {
        0
    }
    /// Re-encodes a chunk from format `from` (`src`, its first `tokens` positions, `layers`
    /// layers: all, or a dead chunk's kept ones) to `to` in `dst` (`layers` layers of `to`):
    /// the engine's conversion without its session, so that a chunk can be lowered on another
    /// thread than the call's ([`crate::Manager::set_background_levels`]). Each layer converts
    /// on its own (the background encoder converts a layer at a time: a chunk's conversion is
    /// its layers' conversions side by side). The default cannot.
    fn convert(&self, from: Format, _src: &[u8], to: Format, _dst: &mut [u8], _tokens: usize, _layers: usize) -> Result<(), EngineError> {
        Err(EngineError::new(format!("this codec cannot convert {} to {} by itself", self.name(from), self.name(to))))
    }
    /// Bytes of a chunk in format `f`, of its kept layers when it is dead.
    fn live_bytes(&self, f: Format, dead: bool) -> usize {
        if dead {
            self.kept_layers() * self.layer_bytes(f)
        } else {
            self.chunk_bytes(f)
        }
    }
}

/// What the engine side of mm's traits reports when it cannot do what mm asked (a chunk it
/// cannot take, a recompute that failed): the engine's own error, its causes kept.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct EngineError(Box<dyn std::error::Error + Send + Sync>);

impl EngineError {
    pub fn new(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self(e.into())
    }
}

/// One context's KV cache as the engine holds it, for the duration of a call into mm.
pub trait KvContext {
    /// The format new chunks are written in.
    fn base(&self) -> Format;
    /// The tokens whose K/V the cache holds (or will hold once loaded), in position order.
    fn tokens(&self) -> &[u32];
    /// Chunks the cache has.
    fn n_chunks(&self) -> usize;
    fn format(&self, chunk: usize) -> Format;
    /// Points `chunk` at memory holding its data in `format` (nothing is copied).
    ///
    /// # Safety
    /// `ptr` is valid for `len` bytes for as long as it is attached and nothing else writes
    /// it meanwhile.
    unsafe fn attach(&mut self, chunk: usize, ptr: NonNull<u8>, len: usize, format: Format) -> Result<(), EngineError>;
    /// [`KvContext::attach`] for a shared chunk mm may move: `chunk` is read at the address
    /// `at` holds when the engine reads it. mm changes `at` only between the engine's passes,
    /// after moving the bytes there (so a chunk many contexts share can stay where it was made
    /// until it must move, without mm holding every sharer's cache).
    ///
    /// # Safety
    /// As [`KvContext::attach`], for whatever address `at` holds whenever the cache is read.
    unsafe fn attach_moving(&mut self, chunk: usize, at: Arc<AtomicPtr<u8>>, len: usize, format: Format) -> Result<(), EngineError>;
    /// Copies `chunk` into memory the caller manages (used for chunks the engine created on
    /// its own heap).
    ///
    /// # Safety
    /// As [`KvContext::attach`].
    unsafe fn adopt(&mut self, chunk: usize, ptr: NonNull<u8>, len: usize) -> Result<(), EngineError>;
    /// Appends an empty chunk in the base format backed by `ptr`.
    ///
    /// # Safety
    /// As [`KvContext::attach`].
    unsafe fn push_chunk(&mut self, ptr: NonNull<u8>, len: usize) -> Result<(), EngineError>;
    /// Declares the first `n` chunks dead ([`Codec::dead_chunks`]): only their kept layers are
    /// read or written from now on (mm gives the rest of their memory back).
    fn set_dead(&mut self, n: usize) -> Result<(), EngineError> {
        if n == 0 {
            Ok(())
        } else {
            Err(EngineError::new("this engine keeps every layer of every chunk"))
        }
    }
    /// Brings dead chunks back to life for a recompute of the whole context (mm attaches
    /// full-size memory to them first).
    fn revive_all(&mut self) {}
    /// Converts `chunk` to `to` in its memory.
    fn convert(&mut self, chunk: usize, to: Format) -> Result<(), EngineError>;
    /// Recomputes the K/V of the given chunks (attached, in the base format) from their
    /// tokens, layer by layer; `before_layer(l)` runs before layer `l`.
    fn recompute(&mut self, chunks: &[usize], before_layer: &mut dyn FnMut(usize)) -> Result<(), EngineError>;
    /// Information density of each chunk (LLMS eq. 1), if the engine observes attention.
    fn densities(&self) -> Option<Vec<f64>>;
    /// mm is about to wait for the disk with nothing for the engine to do: threads the engine
    /// keeps spinning for its next job should park now, not spin on the cores the load's lanes
    /// check and copy on (docs/mm.md "Small loads").
    fn before_wait(&self) {}
}

/// The fault path's last resort: produces a chunk's bytes when the store has no valid record
/// for it (its write still pending, its record corrupt), so a fault always yields the right
/// data, never zeros. The engine side recomputes it from the context's tokens.
pub trait FaultRecompute: Send + Sync {
    /// Writes the chunk `want` names (context, chunk, format, tokens, prefix hash) into `out`
    /// and returns its length; an error when it cannot (the slot is then poisoned).
    fn recompute(&self, want: &crate::RecordMeta, out: &mut [u8]) -> Result<usize, EngineError>;
}

/// FNV-1a over token ids: the hash of a chunk's prefix names the tokens its K/V came from.
pub fn prefix_hashes(tokens: &[u32], chunk_tokens: usize) -> Vec<u64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut out = Vec::with_capacity(tokens.len().div_ceil(chunk_tokens.max(1)));
    for (i, &t) in tokens.iter().enumerate() {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        if (i + 1) % chunk_tokens.max(1) == 0 || i + 1 == tokens.len() {
            out.push(h);
        }
    }
    out
}

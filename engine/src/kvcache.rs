//! A context's chunked KV cache: the chunks, their formats, and the memory they live in.
//!
//! By default each chunk is a heap buffer sized for its format. A caller that manages memory
//! itself (LLMS's `mm`, with userfaultfd slots) attaches external memory per chunk instead;
//! the engine then reads and writes that memory as plain bytes and never learns where it
//! lives.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Arc;

use crate::kv::{self, KvFormat, KvGeometry};

#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("context full: {needed} positions needed, the cache holds {capacity}")]
    Full { needed: usize, capacity: usize },
    #[error("chunk {chunk} is {format}; tokens are only written to f16 or int8 chunks")]
    NotBase { chunk: usize, format: &'static str },
    #[error("chunk {chunk} memory is {len} bytes, {format} needs {need}")]
    TooSmall { chunk: usize, len: usize, need: usize, format: &'static str },
    #[error("{format} rotates head vectors by a Walsh-Hadamard transform: head_dim {head_dim} is not a power of two up to 256")]
    NoRotation { format: &'static str, head_dim: usize },
    #[error("{dead} chunks are dead (their local layers dropped), {want} asked: a chunk never comes back to life, and there are {have}")]
    Dead { dead: usize, want: usize, have: usize },
    #[error("layer order: {0}")]
    Order(&'static str),
}

#[derive(Debug)]
enum Mem {
    Owned(Vec<u8>),
    /// Memory the caller owns (see [`ChunkedKv::attach`]).
    External {
        ptr: NonNull<u8>,
        len: usize,
    },
    /// Memory the caller owns and may move between passes: read at the address in `at`
    /// (see [`ChunkedKv::attach_moving`]).
    Moving {
        at: Arc<AtomicPtr<u8>>,
        len: usize,
    },
}

#[derive(Debug)]
struct Chunk {
    mem: Mem,
    format: KvFormat,
}

impl Chunk {
    fn bytes(&self) -> &[u8] {
        match &self.mem {
            Mem::Owned(v) => v,
            // SAFETY: the attach contract keeps ptr valid for len bytes while attached.
            Mem::External { ptr, len } => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), *len) },
            // SAFETY: the attach_moving contract: `at` holds a valid address for len bytes
            // whenever the cache is read.
            Mem::Moving { at, len } => unsafe { std::slice::from_raw_parts(at.load(Ordering::Acquire), *len) },
        }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.mem {
            Mem::Owned(v) => v,
            // SAFETY: as above, and the contract gives us exclusive write access.
            Mem::External { ptr, len } => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), *len) },
            // SAFETY: as above.
            Mem::Moving { at, len } => unsafe { std::slice::from_raw_parts_mut(at.load(Ordering::Acquire), *len) },
        }
    }
}

/// The chunked KV cache of one context.
#[derive(Debug)]
pub struct ChunkedKv {
    pub geom: KvGeometry,
    chunks: Vec<Chunk>,
    capacity: usize,
    base: KvFormat,
    len: usize,
    /// The place of each layer in a chunk (`slot[layer]`; the identity unless the model has
    /// a sliding window, see [`crate::Config::kv_slots`]).
    slot: Vec<usize>,
    /// Layers a dead chunk keeps: the first `kept` places.
    kept: usize,
    /// Leading chunks that are dead: only their first `kept` layers exist.
    dead: usize,
}

// SAFETY: external chunk memory is, by the attach contract, exclusively ours to read and write
// from whichever thread owns the ChunkedKv.
unsafe impl Send for ChunkedKv {}
// SAFETY: shared access only reads.
unsafe impl Sync for ChunkedKv {}

impl ChunkedKv {
    pub fn new(geom: KvGeometry, capacity: usize, base: KvFormat) -> Self {
        assert!(base.is_base(), "new chunks are written token by token: f16 or int8");
        Self { geom, chunks: Vec::new(), capacity, base, len: 0, slot: (0..geom.n_layers).collect(), kept: geom.n_layers, dead: 0 }
    }

    /// Lays each chunk out with layer `l` in place `slot[l]` and lets a dead chunk keep only
    /// its first `kept` places (the global layers of a sliding-window model). Only before the
    /// cache holds a chunk.
    pub fn set_layer_order(&mut self, slot: Vec<usize>, kept: usize) -> Result<(), KvError> {
        let n = self.geom.n_layers;
        let mut seen = vec![false; n];
        if !self.chunks.is_empty() {
            return Err(KvError::Order("set before the cache holds chunks"));
        }
        if slot.len() != n || kept == 0 || kept > n || slot.iter().any(|&s| s >= n || std::mem::replace(&mut seen[s], true)) {
            return Err(KvError::Order("not a permutation of the layers, or no layer kept"));
        }
        (self.slot, self.kept) = (slot, kept);
        Ok(())
    }

    /// Where layer `layer` lies in a chunk.
    pub fn slot(&self, layer: usize) -> usize {
        self.slot[layer]
    }

    /// Offset of a (layer, K=0/V=1, head) block in a chunk.
    pub fn block_offset(&self, f: KvFormat, layer: usize, kv: usize, head: usize) -> usize {
        self.geom.block_offset(f, self.slot[layer], kv, head)
    }

    /// Layers a dead chunk keeps.
    pub fn kept_layers(&self) -> usize {
        self.kept
    }

    /// Leading chunks that are dead.
    pub fn dead(&self) -> usize {
        self.dead
    }

    /// Bytes of chunk `i` in format `f`: the kept layers only when it is dead.
    pub fn live_bytes(&self, i: usize, f: KvFormat) -> usize {
        if i < self.dead {
            self.kept * self.geom.layer_bytes(f)
        } else {
            self.geom.chunk_bytes(f)
        }
    }

    /// The geometry of chunk `i`'s bytes: a dead chunk is, byte for byte, a chunk of its kept
    /// layers.
    fn geom_of(&self, i: usize) -> KvGeometry {
        KvGeometry { n_layers: if i < self.dead { self.kept } else { self.geom.n_layers }, ..self.geom }
    }

    /// Declares the first `n` chunks dead: their local layers are never read or written again
    /// (attention skips what lies before a local layer's window), so only their kept layers
    /// remain; chunks on the engine's own heap shrink to them. Dead chunks stay dead.
    pub fn set_dead(&mut self, n: usize) -> Result<(), KvError> {
        if n < self.dead || n > self.chunks.len() || (n > 0 && self.kept == self.geom.n_layers) {
            return Err(KvError::Dead { dead: self.dead, want: n, have: self.chunks.len() });
        }
        for i in self.dead..n {
            let keep = self.kept * self.geom.layer_bytes(self.chunks[i].format);
            if let Mem::Owned(v) = &mut self.chunks[i].mem {
                v.truncate(keep);
                v.shrink_to_fit();
            }
        }
        self.dead = n;
        Ok(())
    }

    /// Brings every chunk back to life, for a caller that recomputes them all from their
    /// tokens: their memory is (re)attached at full size before anything reads it.
    pub fn revive_all(&mut self) {
        for i in 0..self.dead {
            let full = self.geom.chunk_bytes(self.chunks[i].format);
            if let Mem::Owned(v) = &mut self.chunks[i].mem {
                v.resize(full, 0);
            }
        }
        self.dead = 0;
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn base(&self) -> KvFormat {
        self.base
    }
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn n_chunks(&self) -> usize {
        self.chunks.len()
    }
    /// Tokens of chunk `i` that hold data.
    pub fn chunk_len(&self, i: usize) -> usize {
        self.len.saturating_sub(i * self.geom.chunk_tokens).min(self.geom.chunk_tokens)
    }
    pub fn format(&self, i: usize) -> KvFormat {
        self.chunks[i].format
    }
    /// The bytes of chunk `i` in its format (a dead chunk's kept layers).
    pub fn chunk(&self, i: usize) -> &[u8] {
        &self.chunks[i].bytes()[..self.live_bytes(i, self.chunks[i].format)]
    }
    /// Bytes in use by every chunk in its current format.
    pub fn bytes(&self) -> usize {
        self.chunks.iter().enumerate().map(|(i, c)| self.live_bytes(i, c.format)).sum()
    }

    /// Makes room for positions `0..n` (new chunks in the base format).
    pub fn ensure(&mut self, n: usize) -> Result<(), KvError> {
        if n > self.capacity {
            return Err(KvError::Full { needed: n, capacity: self.capacity });
        }
        let ct = self.geom.chunk_tokens;
        while self.chunks.len() * ct < n {
            let f = self.base;
            self.chunks.push(Chunk { mem: Mem::Owned(vec![0; self.geom.chunk_bytes(f)]), format: f });
        }
        if let Some(i) = (self.len < n).then(|| self.len / ct).filter(|&i| i < self.chunks.len()) {
            if !self.chunks[i].format.is_base() {
                return Err(KvError::NotBase { chunk: i, format: self.chunks[i].format.name() });
            }
        }
        self.len = self.len.max(n);
        Ok(())
    }

    /// Declares positions `0..n` held, their chunks already attached (a context restored from
    /// a store: the caller loads or recomputes the chunks before they are read).
    pub fn set_len(&mut self, n: usize) -> Result<(), KvError> {
        let have = (self.chunks.len() * self.geom.chunk_tokens).min(self.capacity);
        if n > have {
            return Err(KvError::Full { needed: n, capacity: have });
        }
        self.len = n;
        Ok(())
    }

    /// Forgets positions from `n` on. A partly kept chunk in a reduced format is brought back
    /// to the base format (exactly, through int8) so tokens can be appended to it again.
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
        let ct = self.geom.chunk_tokens;
        let keep = n.div_ceil(ct);
        for i in keep..self.chunks.len() {
            if (self.chunks[i].format != self.base || i < self.dead) && matches!(self.chunks[i].mem, Mem::Owned(_)) {
                self.chunks[i] = Chunk { mem: Mem::Owned(vec![0; self.geom.chunk_bytes(self.base)]), format: self.base };
            }
        }
        // Chunks emptied here are written again from scratch; dead ones below stay dead (a
        // query that would read them is refused by the model).
        self.dead = self.dead.min(keep);
        if !n.is_multiple_of(ct) && keep > 0 && !self.chunks[keep - 1].format.is_base() {
            let _ = self.set_format(keep - 1, self.base);
        }
    }

    /// Writes one position's K and V (`[kv_head][head_dim]` each) for a layer.
    pub fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        self.write_with(layer, pos, k, v, kv::int8_codes_ref);
    }

    /// [`Self::write`], an int8 chunk's codes computed by `codes` (the model's vector kernel).
    pub fn write_with(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32], codes: kv::Int8Codes) {
        let g = self.geom;
        let (ci, t) = (pos / g.chunk_tokens, pos % g.chunk_tokens);
        assert!(ci >= self.dead, "position {pos}: chunk {ci} is dead");
        let slot = self.slot[layer];
        let c = &mut self.chunks[ci];
        assert!(c.format.is_base(), "position {pos}: chunk {ci} is {}, not a base format", c.format.name());
        let f = c.format;
        let hd = g.head_dim;
        let bytes = c.bytes_mut();
        for (kvsel, src) in [(0, k), (1, v)] {
            for h in 0..g.n_kv_heads {
                let off = g.block_offset(f, slot, kvsel, h);
                kv::write_token_with(
                    f,
                    &mut bytes[off..off + g.head_block_bytes(f, kvsel)],
                    t,
                    g.chunk_tokens,
                    &src[h * hd..(h + 1) * hd],
                    codes,
                );
            }
        }
    }

    /// The bytes [`Self::write`] will write for position `pos` of `layer`, each range to `f`
    /// (a K or V row, and an int8 row's scale), for a prefetch hint ahead of the write; nothing
    /// for a position whose chunk is not there yet or not in a base format. Only addresses:
    /// nothing is read.
    pub fn row_ranges(&self, layer: usize, pos: usize, mut f: impl FnMut(&[u8])) {
        let g = self.geom;
        let (ci, t) = (pos / g.chunk_tokens, pos % g.chunk_tokens);
        let Some(c) = self.chunks.get(ci).filter(|c| ci >= self.dead && c.format.is_base()) else {
            return;
        };
        let (fmt, hd, slot) = (c.format, g.head_dim, self.slot[layer]);
        let bytes = c.bytes();
        for kvsel in [0, 1] {
            for h in 0..g.n_kv_heads {
                let blk = &bytes[g.block_offset(fmt, slot, kvsel, h)..][..g.head_block_bytes(fmt, kvsel)];
                if fmt == KvFormat::F16 {
                    f(&blk[2 * t * hd..2 * (t + 1) * hd]);
                } else {
                    f(&blk[2 * t..2 * t + 2]);
                    f(&blk[2 * g.chunk_tokens + t * hd..][..hd]);
                }
            }
        }
    }

    /// Converts chunk `i` to format `to` (its valid tokens), in place for owned memory.
    /// External memory must be large enough for the new format.
    pub fn set_format(&mut self, i: usize, to: KvFormat) -> Result<(), KvError> {
        let from = self.chunks[i].format;
        if from == to {
            return Ok(());
        }
        let g = self.geom_of(i);
        if to.rotated() && !kv::rotation_fits(g.head_dim) {
            return Err(KvError::NoRotation { format: to.name(), head_dim: g.head_dim });
        }
        let n = self.chunk_len(i);
        let mut out = vec![0u8; g.chunk_bytes(to)];
        kv::convert_chunk(&g, from, self.chunk(i), to, &mut out, n);
        let c = &mut self.chunks[i];
        match &mut c.mem {
            Mem::Owned(v) => *v = out,
            Mem::External { len, .. } | Mem::Moving { len, .. } => {
                if *len < out.len() {
                    return Err(KvError::TooSmall { chunk: i, len: *len, need: out.len(), format: to.name() });
                }
                c.bytes_mut()[..out.len()].copy_from_slice(&out);
            }
        }
        c.format = to;
        Ok(())
    }

    /// Removes chunks `range` (their positions disappear; later chunks move down) and applies
    /// `rotate_k(layer_independent token vector)` to every K head vector of the chunks that
    /// moved, so RoPE positions stay consistent (the sliding window). Moved chunks in a
    /// reduced format are re-encoded as int8 (their values are int8 codes, so nothing is lost
    /// but the rotation's rounding) and lowered back to their level.
    pub fn remove_chunks(&mut self, range: std::ops::Range<usize>, rotate_k: &dyn Fn(usize, &mut [f32])) {
        let ct = self.geom.chunk_tokens;
        let removed = range.len();
        let start = range.start;
        let dead_removed = range.end.min(self.dead).saturating_sub(start);
        self.chunks.drain(range);
        self.dead -= dead_removed;
        self.len = self.len.saturating_sub(removed * ct);
        let (g, hd) = (self.geom, self.geom.head_dim);
        let mut vals = vec![0.0f32; ct * hd];
        for i in start..self.chunks.len() {
            let level = self.chunks[i].format;
            let work = if level.is_base() { level } else { KvFormat::Int8 };
            if work != level {
                let _ = self.set_format(i, work);
            }
            let n = self.chunk_len(i);
            let live = self.geom_of(i).n_layers;
            let slots = self.slot.clone();
            let bytes = self.chunks[i].bytes_mut();
            for (layer, &slot) in slots.iter().enumerate().filter(|&(_, &s)| s < live) {
                for h in 0..g.n_kv_heads {
                    let off = g.block_offset(work, slot, 0, h);
                    let blk = &mut bytes[off..off + g.head_block_bytes(work, 0)];
                    kv::read_block_f32(work, 0, blk, ct, hd, n, &mut vals);
                    for t in 0..n {
                        rotate_k(layer, &mut vals[t * hd..(t + 1) * hd]);
                        kv::write_token(work, blk, t, ct, &vals[t * hd..(t + 1) * hd]);
                    }
                }
            }
            if work != level {
                let _ = self.set_format(i, level);
            }
        }
    }

    /// Zeroes chunk `i` (for tests and callers that drop a chunk's data before recomputing
    /// it; the format is kept).
    pub fn wipe(&mut self, i: usize) {
        let n = self.live_bytes(i, self.chunks[i].format);
        self.chunks[i].bytes_mut()[..n].fill(0);
    }

    /// Places chunk `i` in memory the caller manages, copying its current bytes there.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, must not be accessed by
    /// anything else while attached (the engine reads and writes it from its threads), and must
    /// stay valid until the chunk is detached or the cache dropped. Memory that a userfaultfd
    /// region serves may block on a fault when read: that is allowed, the engine just waits.
    pub unsafe fn attach(&mut self, i: usize, ptr: NonNull<u8>, len: usize) -> Result<(), KvError> {
        let need = self.live_bytes(i, self.chunks[i].format);
        if len < need {
            return Err(KvError::TooSmall { chunk: i, len, need, format: self.chunks[i].format.name() });
        }
        let old = std::mem::replace(&mut self.chunks[i].mem, Mem::External { ptr, len });
        if let Mem::Owned(v) = old {
            self.chunks[i].bytes_mut()[..need].copy_from_slice(&v[..need]);
        }
        Ok(())
    }

    /// Appends a chunk (in the base format, no positions yet) backed by caller memory that
    /// already holds zeros or will be written before it is read.
    ///
    /// # Safety
    /// As [`ChunkedKv::attach`].
    pub unsafe fn push_external(&mut self, ptr: NonNull<u8>, len: usize) -> Result<(), KvError> {
        let need = self.geom.chunk_bytes(self.base);
        if len < need {
            return Err(KvError::TooSmall { chunk: self.chunks.len(), len, need, format: self.base.name() });
        }
        self.chunks.push(Chunk { mem: Mem::External { ptr, len }, format: self.base });
        Ok(())
    }

    /// Points chunk `i` at caller memory that holds (or, before a recompute, will hold) its
    /// data in `format`. Nothing is copied: the caller placed the bytes there.
    ///
    /// # Safety
    /// As [`ChunkedKv::attach`].
    pub unsafe fn attach_as(&mut self, i: usize, ptr: NonNull<u8>, len: usize, format: KvFormat) -> Result<(), KvError> {
        let need = self.live_bytes(i, format);
        if len < need {
            return Err(KvError::TooSmall { chunk: i, len, need, format: format.name() });
        }
        self.chunks[i] = Chunk { mem: Mem::External { ptr, len }, format };
        Ok(())
    }

    /// [`ChunkedKv::attach_as`] for memory the caller may move while the chunk is attached:
    /// the chunk is read at the address `at` holds when it is read (a pass reads it once per
    /// use), so the caller can move the bytes between passes and store the new address — a
    /// chunk many caches share, which stays where it was made until it must move, without
    /// the caller holding every cache that points at it.
    ///
    /// # Safety
    /// As [`ChunkedKv::attach`], for whatever address `at` holds whenever the cache is read;
    /// `at` is changed only while no pass reads this cache.
    pub unsafe fn attach_moving(&mut self, i: usize, at: Arc<AtomicPtr<u8>>, len: usize, format: KvFormat) -> Result<(), KvError> {
        let need = self.live_bytes(i, format);
        if len < need {
            return Err(KvError::TooSmall { chunk: i, len, need, format: format.name() });
        }
        self.chunks[i] = Chunk { mem: Mem::Moving { at, len }, format };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `row_ranges` names exactly the bytes a write changes, no more and no fewer, in both
    /// base formats, under a layer order of the cache's own, for positions across chunks; and
    /// nothing for a position whose chunk is not there.
    #[test]
    fn row_ranges_are_the_bytes_a_write_changes() {
        let geom = KvGeometry { n_layers: 3, n_kv_heads: 2, head_dim: 64, chunk_tokens: 16 };
        for base in [KvFormat::F16, KvFormat::Int8] {
            let mut kv = ChunkedKv::new(geom, 64, base);
            kv.set_layer_order(vec![2, 0, 1], 3).unwrap();
            kv.ensure(40).unwrap();
            for (layer, pos) in [(0, 0), (1, 17), (2, 31), (0, 39)] {
                let ci = pos / 16;
                let before = kv.chunk(ci).to_vec();
                let start = kv.chunk(ci).as_ptr() as usize;
                let mut named = vec![false; before.len()];
                kv.row_ranges(layer, pos, |r| {
                    let at = r.as_ptr() as usize - start;
                    named[at..at + r.len()].iter_mut().for_each(|b| *b = true);
                });
                // Values that leave no byte as it was (zero): f16s 1 + m/1024 with m % 256 != 0
                // (both bytes nonzero), int8 codes far from 0.
                let k: Vec<f32> = (0..128).map(|i| 1.0 + (1 + i % 200) as f32 / 1024.0).collect();
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                kv.write(layer, pos, &k, &v);
                let changed: Vec<bool> = kv.chunk(ci).iter().zip(&before).map(|(a, b)| a != b).collect();
                assert_eq!(changed, named, "{base:?}: layer {layer}, position {pos}");
            }
            let mut calls = 0;
            kv.row_ranges(0, 48, |_| calls += 1);
            assert_eq!(calls, 0, "{base:?}: a position past the chunks names nothing");
        }
    }
}

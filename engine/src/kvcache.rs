//! A context's chunked KV cache: the chunks, their formats, and the memory they live in.
//!
//! By default each chunk is a heap buffer sized for its format. A caller that manages memory
//! itself (LLMS's `mm`, with userfaultfd slots) attaches external memory per chunk instead;
//! the engine then reads and writes that memory as plain bytes and never learns where it
//! lives.

use std::ptr::NonNull;

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
}

#[derive(Debug)]
enum Mem {
    Owned(Vec<u8>),
    /// Memory the caller owns (see [`ChunkedKv::attach`]).
    External {
        ptr: NonNull<u8>,
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
        }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.mem {
            Mem::Owned(v) => v,
            // SAFETY: as above, and the contract gives us exclusive write access.
            Mem::External { ptr, len } => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), *len) },
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
}

// SAFETY: external chunk memory is, by the attach contract, exclusively ours to read and write
// from whichever thread owns the ChunkedKv.
unsafe impl Send for ChunkedKv {}
// SAFETY: shared access only reads.
unsafe impl Sync for ChunkedKv {}

impl ChunkedKv {
    pub fn new(geom: KvGeometry, capacity: usize, base: KvFormat) -> Self {
        assert!(base.is_base(), "new chunks are written token by token: f16 or int8");
        Self { geom, chunks: Vec::new(), capacity, base, len: 0 }
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
    /// The bytes of chunk `i` in its format.
    pub fn chunk(&self, i: usize) -> &[u8] {
        &self.chunks[i].bytes()[..self.geom.chunk_bytes(self.chunks[i].format)]
    }
    /// Bytes in use by every chunk in its current format.
    pub fn bytes(&self) -> usize {
        self.chunks.iter().map(|c| self.geom.chunk_bytes(c.format)).sum()
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
            if self.chunks[i].format != self.base && matches!(self.chunks[i].mem, Mem::Owned(_)) {
                self.chunks[i] = Chunk { mem: Mem::Owned(vec![0; self.geom.chunk_bytes(self.base)]), format: self.base };
            }
        }
        if !n.is_multiple_of(ct) && keep > 0 && !self.chunks[keep - 1].format.is_base() {
            let _ = self.set_format(keep - 1, self.base);
        }
    }

    /// Writes one position's K and V (`[kv_head][head_dim]` each) for a layer.
    pub fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let g = self.geom;
        let (ci, t) = (pos / g.chunk_tokens, pos % g.chunk_tokens);
        let c = &mut self.chunks[ci];
        assert!(c.format.is_base(), "position {pos}: chunk {ci} is {}, not a base format", c.format.name());
        let f = c.format;
        let hd = g.head_dim;
        let bytes = c.bytes_mut();
        for (kvsel, src) in [(0, k), (1, v)] {
            for h in 0..g.n_kv_heads {
                let off = g.block_offset(f, layer, kvsel, h);
                kv::write_token(f, &mut bytes[off..off + g.head_block_bytes(f, kvsel)], t, g.chunk_tokens, &src[h * hd..(h + 1) * hd]);
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
        let g = self.geom;
        if to.rotated() && !kv::rotation_fits(g.head_dim) {
            return Err(KvError::NoRotation { format: to.name(), head_dim: g.head_dim });
        }
        let n = self.chunk_len(i);
        let mut out = vec![0u8; g.chunk_bytes(to)];
        kv::convert_chunk(&g, from, self.chunk(i), to, &mut out, n);
        let c = &mut self.chunks[i];
        match &mut c.mem {
            Mem::Owned(v) => *v = out,
            Mem::External { len, .. } => {
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
        self.chunks.drain(range);
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
            let bytes = self.chunks[i].bytes_mut();
            for layer in 0..g.n_layers {
                for h in 0..g.n_kv_heads {
                    let off = g.block_offset(work, layer, 0, h);
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
        let n = self.geom.chunk_bytes(self.chunks[i].format);
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
        let need = self.geom.chunk_bytes(self.chunks[i].format);
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
        let need = self.geom.chunk_bytes(format);
        if len < need {
            return Err(KvError::TooSmall { chunk: i, len, need, format: format.name() });
        }
        self.chunks[i] = Chunk { mem: Mem::External { ptr, len }, format };
        Ok(())
    }
}

//! Load-time repacking of 4- and 8-bit weights into groups of 8 interleaved rows.
//!
//! In a packed block, the scales of 8 rows sit side by side (one `vcvtph2ps` converts them all)
//! and the quantized values are interleaved 4 bytes per row, so that one 32-byte load holds the
//! same 4 (or 8 nibbles) columns of 8 rows. Multiplying it by those 4 activation bytes broadcast
//! to every lane gives each row's partial dot product in its own lane: 8 rows advance together
//! with no horizontal sums, and the 8 results land in one vector ready to store, since outputs
//! are laid out `[token][row]`. This is the layout llama.cpp uses for its Q4_0x8 kernels,
//! applied here to Q4_0, Q4_1 and Q8_0 (the default model's types), and to Q5_0/Q5_1 with
//! their fifth bits in a plane beside the nibbles.
#![allow(clippy::cast_possible_truncation)]

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::quant::{blocks, BlockQ8_0, GgmlType, KBlock, QK, QK_K};

/// Rows per packed group.
pub const ROWS: usize = 8;

/// 8 rows x 32 columns of 4-bit weights with an offset (Q4_1: `w = q * d + m`).
/// `qs[32k + 4r + j]` holds columns `4k + j` (low nibble) and `16 + 4k + j` (high nibble) of row
/// `r`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4x8 {
    pub d: [f16; ROWS],
    pub m: [f16; ROWS],
    pub qs: [u8; QK * ROWS / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4x8>() == 160);

/// 8 rows x 32 columns of Q4_0 (`w = (q - 8) d`), laid out as [`BlockQ4x8`] without the
/// offsets: 4.5 bits a weight, as in the file. (Packing Q4_0 as Q4_1 with `m = -8 d` read 11%
/// more bytes per decoded token, and decode is bound by those bytes; the offset comes off the
/// integer sum instead, as `8 sum(x)`: llama.cpp's own arithmetic for Q4_0.)
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4Sx8 {
    pub d: [f16; ROWS],
    pub qs: [u8; QK * ROWS / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4Sx8>() == 144);

/// 8 rows x 32 columns of 8-bit weights, `w = q * d`. `qs[32k + 4r + j]` is column `4k + j` of
/// row `r`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ8x8 {
    pub d: [f16; ROWS],
    pub qs: [i8; QK * ROWS],
}
const _: () = assert!(std::mem::size_of::<BlockQ8x8>() == 272);

/// 8 rows x 32 columns of 5-bit codes (Q5_0: `w = (q - 16) d`): the low 4 bits as in
/// [`BlockQ4x8`] and the fifth bits in `qh`, one byte per position of a 32-byte `qs` load:
/// bit `2k` of `qh[4r + j]` is the fifth bit of the low nibble of `qs[32k + 4r + j]` (column
/// `4k + j` of row `r`), bit `2k + 1` that of its high nibble (column `16 + 4k + j`). So the
/// fifth bits of load `k` are a shift and a mask of the one `qh` vector away (or one
/// `vptestmb`), with no table. 5.5 bits a weight, as in the file.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5x8 {
    pub d: [f16; ROWS],
    pub qh: [u8; QK],
    pub qs: [u8; QK * ROWS / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5x8>() == 176);

/// 8 rows x 32 columns of 5-bit codes with an offset (Q5_1: `w = q d + m`), laid out as
/// [`BlockQ5x8`]. 6 bits a weight, as in the file.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5Mx8 {
    pub d: [f16; ROWS],
    pub m: [f16; ROWS],
    pub qh: [u8; QK],
    pub qs: [u8; QK * ROWS / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5Mx8>() == 192);

/// 8 rows x 256 columns of Q4_K (llama.cpp's super-block: `w = d sc_j q - dmin m_j` over 8
/// sub-blocks `j` of 32), interleaved as [`BlockQ4x8`] sub-block by sub-block: `qs[128 j ..]`
/// is sub-block `j` laid out as a `BlockQ4x8`'s `qs`. The 6-bit scales and mins are unpacked
/// to bytes: `scales[8 j + r]` is row `r`'s scale of sub-block `j`; `mins[16 q + 2 r + i]` row
/// `r`'s min of sub-block `2 q + i` (pairs, as one `madd` against two activation sums takes
/// them). 4.625 bits a weight (the file's 4.5).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4Kx8 {
    pub d: [f16; ROWS],
    pub dmin: [f16; ROWS],
    pub scales: [u8; 64],
    pub mins: [u8; 64],
    pub qs: [u8; QK_K * ROWS / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4Kx8>() == 1184);

/// 8 rows x 256 columns of Q5_K: [`BlockQ4Kx8`] with each sub-block's fifth bits laid out as
/// a [`BlockQ5x8`]'s `qh` right after its nibbles: sub-block `j` is `q[160 j ..]`, 128 bytes
/// of nibbles then 32 of fifth bits (one forward stream, as decode reads it best; see
/// [`BlockQ6Kx8`]). 5.625 bits a weight (the file's 5.5).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5Kx8 {
    pub d: [f16; ROWS],
    pub dmin: [f16; ROWS],
    pub scales: [u8; 64],
    pub mins: [u8; 64],
    pub q: [u8; 160 * 8],
}
const _: () = assert!(std::mem::size_of::<BlockQ5Kx8>() == 1440);

/// 8 rows x 256 columns of Q6_K (`w = d sc_s (q - 32)`, 16 sub-blocks `s` of 16, 6-bit codes):
/// per 32 columns `j`, 192 bytes at `q[192 j ..]`: the low 4 bits as a [`BlockQ4x8`]'s `qs`
/// (the low nibbles are sub-block `2 j`, the high ones `2 j + 1`), then the top 2 bits at
/// `128 + 32 (k / 2) + p`: bits `2 c, 2 c + 1` with `c = 2 (k % 2) + h` belong to byte `p` of
/// load `k`'s low (`h = 0`) or high nibbles. One forward stream: with the top bits in a plane
/// of their own, decode read at two thirds of the bandwidth. `scales[8 s + r]` is row `r`'s
/// scale of sub-block `s`. 6.5625 bits a weight, as in the file.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ6Kx8 {
    pub d: [f16; ROWS],
    pub scales: [i8; 128],
    pub q: [u8; QK_K * ROWS * 3 / 4],
}
const _: () = assert!(std::mem::size_of::<BlockQ6Kx8>() == 1680);

/// The 6-bit code (0..64) of column `c` (0..256) of row `lane` in a packed Q6_K block.
pub fn q6k_code(blk: &BlockQ6Kx8, lane: usize, c: usize) -> u8 {
    let (j, half, k, i) = (c / 32, (c % 32) / 16, (c % 16) / 4, c % 4);
    let q = blk.q[192 * j + 32 * k + 4 * lane + i];
    let low = if half == 0 { q & 0xF } else { q >> 4 };
    let sh = 2 * (2 * (k % 2) + half);
    low | ((blk.q[192 * j + 128 + 32 * (k / 2) + 4 * lane + i] >> sh) & 3) << 4
}

/// Row `lane` of a K-quant block (`KBlock`) into the packed fields of an 8-row block: sub-block
/// `j`'s nibbles at `q[stride j ..]`, and with a stride of 160 its fifth bits after them.
#[allow(clippy::too_many_arguments)]
fn put_k<B: KBlock>(
    blk: &B,
    lane: usize,
    d: &mut [f16; ROWS],
    dmin: &mut [f16; ROWS],
    scales: &mut [u8; 64],
    mins: &mut [u8; 64],
    q: &mut [u8],
    stride: usize,
) {
    d[lane] = blk.d();
    dmin[lane] = blk.dmin();
    for j in 0..8 {
        let (sc, m) = crate::quant::scale_min_k4(j, blk.scales());
        scales[8 * j + lane] = sc;
        mins[16 * (j / 2) + 2 * lane + j % 2] = m;
        let codes: [u8; QK] = std::array::from_fn(|l| blk.code(j / 2, j % 2, l));
        let sub_qs: &mut [u8; QK * ROWS / 2] = (&mut q[stride * j..stride * j + 128]).try_into().expect("128 bytes");
        let mut sub_qh = [0u8; QK];
        put_q5(&mut sub_qh, sub_qs, lane, &codes);
        if stride > 128 {
            for (o, h) in q[stride * j + 128..stride * j + 160].iter_mut().zip(sub_qh) {
                *o |= h;
            }
        }
    }
}

/// Puts the 32 five-bit `codes` of one block row into lane `lane` of a packed Q5 block.
/// Row `lane`'s bytes of one block into a packed group's: 4 bytes of each row in turn
/// (`dst[32 k + 4 lane + j] = src[4 k + j]`).
fn interleave<T: Copy>(dst: &mut [T], lane: usize, src: &[T]) {
    for (k, four) in src.chunks_exact(4).enumerate() {
        dst[32 * k + 4 * lane..32 * k + 4 * lane + 4].copy_from_slice(four);
    }
}

fn put_q5(qh: &mut [u8; QK], qs: &mut [u8; QK * ROWS / 2], lane: usize, codes: &[u8; QK]) {
    for k in 0..4 {
        for j in 0..4 {
            let (lo, hi) = (codes[4 * k + j], codes[16 + 4 * k + j]);
            qs[32 * k + 4 * lane + j] = (lo & 0xF) | (hi & 0xF) << 4;
            qh[4 * lane + j] |= (lo >> 4) << (2 * k) | (hi >> 4) << (2 * k + 1);
        }
    }
}

/// The five-bit code of column `c` (0..32) of row `lane` in a packed Q5 block.
pub fn q5_code(qh: &[u8; QK], qs: &[u8; QK * ROWS / 2], lane: usize, c: usize) -> u8 {
    let (half, k, j) = (c / 16, (c % 16) / 4, c % 4);
    let q = qs[32 * k + 4 * lane + j];
    let low = if half == 0 { q & 0xF } else { q >> 4 };
    low | ((qh[4 * lane + j] >> (2 * k + half)) & 1) << 4
}

/// A weight matrix repacked by groups of 8 rows; blocks are stored group-major
/// (`[group][block]`). Rows past `rows` in the last group are zero (scale 0).
#[derive(Debug)]
pub enum Packed {
    Q4(Blocks<BlockQ4x8>),
    /// Q4_0: codes 0..16 less 8.
    Q4S(Blocks<BlockQ4Sx8>),
    Q5(Blocks<BlockQ5x8>),
    Q5M(Blocks<BlockQ5Mx8>),
    Q8(Blocks<BlockQ8x8>),
    /// Super-blocks of 256 columns (activations: Q8_K).
    Q4K(Blocks<BlockQ4Kx8>),
    Q5K(Blocks<BlockQ5Kx8>),
    Q6K(Blocks<BlockQ6Kx8>),
}

/// Where packed blocks live: the heap (packed at load), or memory someone else owns, such as
/// a weight image mapped into a paged region (see `model::WeightMemory`), which the model
/// keeps alive as long as the blocks.
pub enum Blocks<T> {
    Owned(Vec<T>),
    Borrowed { ptr: *const T, len: usize },
}

// SAFETY: the borrowed form points at read-only memory the model keeps alive (an
// `Arc<dyn WeightMemory>`, itself Send + Sync); nothing writes through it.
unsafe impl<T: Send> Send for Blocks<T> {}
// SAFETY: see Send.
unsafe impl<T: Sync> Sync for Blocks<T> {}

impl<T> std::ops::Deref for Blocks<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Blocks::Owned(v) => v,
            // SAFETY: `ptr` is aligned and valid for `len` elements while the owner lives
            // (checked when borrowed, see `PackedWeight::borrow`).
            Blocks::Borrowed { ptr, len } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

impl<T> std::fmt::Debug for Blocks<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if matches!(self, Blocks::Owned(_)) { "owned" } else { "borrowed" };
        write!(f, "Blocks({kind}, {} blocks)", self.len())
    }
}

#[derive(Debug)]
pub struct PackedWeight {
    pub rows: usize,
    pub cols: usize,
    pub data: Packed,
}

impl PackedWeight {
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(ROWS)
    }
    /// Whether the blocks are K-quant super-blocks (Q8_K activations) rather than 32 columns.
    pub fn is_k_quant(&self) -> bool {
        matches!(self.data, Packed::Q4K(_) | Packed::Q5K(_) | Packed::Q6K(_))
    }
    /// Blocks per row: of 32 columns, or of 256 for the K-quants.
    pub fn blocks_per_row(&self) -> usize {
        self.cols / if self.is_k_quant() { QK_K } else { QK }
    }
    pub fn bytes(&self) -> usize {
        self.as_bytes().len()
    }

    /// The packed blocks as bytes (what a weight image stores).
    pub fn as_bytes(&self) -> &[u8] {
        match &self.data {
            Packed::Q4(v) => bytemuck::cast_slice(v),
            Packed::Q4S(v) => bytemuck::cast_slice(v),
            Packed::Q5(v) => bytemuck::cast_slice(v),
            Packed::Q5M(v) => bytemuck::cast_slice(v),
            Packed::Q8(v) => bytemuck::cast_slice(v),
            Packed::Q4K(v) => bytemuck::cast_slice(v),
            Packed::Q5K(v) => bytemuck::cast_slice(v),
            Packed::Q6K(v) => bytemuck::cast_slice(v),
        }
    }

    /// Bytes a packed `ty` matrix of this shape takes; `None` for types that are not packed.
    pub fn packed_len(ty: GgmlType, rows: usize, cols: usize) -> Option<usize> {
        let blocks = rows.div_ceil(ROWS) * (cols / QK);
        match ty {
            GgmlType::Q4_0 => Some(blocks * std::mem::size_of::<BlockQ4Sx8>()),
            GgmlType::Q4_1 => Some(blocks * std::mem::size_of::<BlockQ4x8>()),
            GgmlType::Q5_0 => Some(blocks * std::mem::size_of::<BlockQ5x8>()),
            GgmlType::Q5_1 => Some(blocks * std::mem::size_of::<BlockQ5Mx8>()),
            GgmlType::Q8_0 => Some(blocks * std::mem::size_of::<BlockQ8x8>()),
            GgmlType::Q4K => Some(rows.div_ceil(ROWS) * (cols / QK_K) * std::mem::size_of::<BlockQ4Kx8>()),
            GgmlType::Q5K => Some(rows.div_ceil(ROWS) * (cols / QK_K) * std::mem::size_of::<BlockQ5Kx8>()),
            GgmlType::Q6K => Some(rows.div_ceil(ROWS) * (cols / QK_K) * std::mem::size_of::<BlockQ6Kx8>()),
            _ => None,
        }
    }

    /// A packed matrix over bytes produced by [`PackedWeight::as_bytes`] for the same type and
    /// shape, without copying them; `None` if the type is not packed or the length or
    /// alignment is wrong.
    ///
    /// # Safety
    /// `bytes` must stay valid and unchanged for as long as the returned value is used.
    pub unsafe fn borrow(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        if Self::packed_len(ty, rows, cols)? != bytes.len() {
            return None;
        }
        fn cast<T: Pod>(b: &[u8]) -> Option<Blocks<T>> {
            let s: &[T] = bytemuck::try_cast_slice(b).ok()?;
            Some(Blocks::Borrowed { ptr: s.as_ptr(), len: s.len() })
        }
        let data = match ty {
            GgmlType::Q4_0 => Packed::Q4S(cast(bytes)?),
            GgmlType::Q4_1 => Packed::Q4(cast(bytes)?),
            GgmlType::Q5_0 => Packed::Q5(cast(bytes)?),
            GgmlType::Q5_1 => Packed::Q5M(cast(bytes)?),
            GgmlType::Q4K => Packed::Q4K(cast(bytes)?),
            GgmlType::Q5K => Packed::Q5K(cast(bytes)?),
            GgmlType::Q6K => Packed::Q6K(cast(bytes)?),
            _ => Packed::Q8(cast(bytes)?),
        };
        Some(Self { rows, cols, data })
    }

    /// This matrix moved into `arena` and read in place from there, or itself, unchanged,
    /// when it does not fit (see [`crate::arena`] for why weights live there).
    ///
    /// # Safety
    /// The arena's mapping must outlive the returned matrix: whoever keeps the matrix keeps the
    /// [`crate::arena::Arena`] that `arena` becomes.
    pub unsafe fn into_arena(self, arena: &mut crate::arena::ArenaBuilder) -> Self {
        let bytes = self.as_bytes();
        let Some(at) = arena.push(bytes) else { return self };
        // SAFETY: `push` copied `bytes.len()` bytes to `at`, 64-byte aligned (every block type's
        // alignment divides 64), and nothing writes there again; the caller keeps the mapping.
        let placed = unsafe { std::slice::from_raw_parts(at.as_ptr(), bytes.len()) };
        fn cast<T: Pod>(b: &[u8]) -> Blocks<T> {
            let s: &[T] = bytemuck::cast_slice(b);
            Blocks::Borrowed { ptr: s.as_ptr(), len: s.len() }
        }
        let data = match &self.data {
            Packed::Q4(_) => Packed::Q4(cast(placed)),
            Packed::Q4S(_) => Packed::Q4S(cast(placed)),
            Packed::Q5(_) => Packed::Q5(cast(placed)),
            Packed::Q5M(_) => Packed::Q5M(cast(placed)),
            Packed::Q8(_) => Packed::Q8(cast(placed)),
            Packed::Q4K(_) => Packed::Q4K(cast(placed)),
            Packed::Q5K(_) => Packed::Q5K(cast(placed)),
            Packed::Q6K(_) => Packed::Q6K(cast(placed)),
        };
        Self { rows: self.rows, cols: self.cols, data }
    }

    /// Repacks a row-major weight of a supported type; `None` for other types.
    pub fn pack(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Option<Self> {
        let nb = cols / QK;
        let groups = rows.div_ceil(ROWS);
        let row_bytes = ty.row_bytes(cols);
        let packed = match ty {
            GgmlType::Q4_0 => {
                let mut out = vec![BlockQ4Sx8::zeroed(); groups * nb];
                for r in 0..rows {
                    let row = &data[r * row_bytes..(r + 1) * row_bytes];
                    let (g, lane) = (r / ROWS, r % ROWS);
                    for (b, blk) in blocks::<crate::quant::BlockQ4_0>(row).iter().enumerate() {
                        let o = &mut out[g * nb + b];
                        o.d[lane] = blk.d;
                        interleave(&mut o.qs, lane, &blk.qs);
                    }
                }
                Packed::Q4S(Blocks::Owned(out))
            }
            GgmlType::Q4_1 => {
                let mut out = vec![BlockQ4x8::zeroed(); groups * nb];
                for r in 0..rows {
                    let row = &data[r * row_bytes..(r + 1) * row_bytes];
                    let (g, lane) = (r / ROWS, r % ROWS);
                    for (b, blk) in blocks::<crate::quant::BlockQ4_1>(row).iter().enumerate() {
                        let o = &mut out[g * nb + b];
                        o.d[lane] = blk.d;
                        o.m[lane] = blk.m;
                        interleave(&mut o.qs, lane, &blk.qs);
                    }
                }
                Packed::Q4(Blocks::Owned(out))
            }
            GgmlType::Q8_0 => {
                let mut out = vec![BlockQ8x8::zeroed(); groups * nb];
                for r in 0..rows {
                    let row = &data[r * row_bytes..(r + 1) * row_bytes];
                    let (g, lane) = (r / ROWS, r % ROWS);
                    for (b, blk) in blocks::<BlockQ8_0>(row).iter().enumerate() {
                        let o = &mut out[g * nb + b];
                        o.d[lane] = blk.d;
                        interleave(&mut o.qs, lane, &blk.qs);
                    }
                }
                Packed::Q8(Blocks::Owned(out))
            }
            GgmlType::Q5_0 => {
                let mut out = vec![BlockQ5x8::zeroed(); groups * nb];
                for r in 0..rows {
                    let row = &data[r * row_bytes..(r + 1) * row_bytes];
                    let (g, lane) = (r / ROWS, r % ROWS);
                    for (b, blk) in blocks::<crate::quant::BlockQ5_0>(row).iter().enumerate() {
                        let o = &mut out[g * nb + b];
                        o.d[lane] = blk.d;
                        put_q5(&mut o.qh, &mut o.qs, lane, &crate::quant::q5_codes(blk.qh, &blk.qs));
                    }
                }
                Packed::Q5(Blocks::Owned(out))
            }
            GgmlType::Q5_1 => {
                let mut out = vec![BlockQ5Mx8::zeroed(); groups * nb];
                for r in 0..rows {
                    let row = &data[r * row_bytes..(r + 1) * row_bytes];
                    let (g, lane) = (r / ROWS, r % ROWS);
                    for (b, blk) in blocks::<crate::quant::BlockQ5_1>(row).iter().enumerate() {
                        let o = &mut out[g * nb + b];
                        o.d[lane] = blk.d;
                        o.m[lane] = blk.m;
                        put_q5(&mut o.qh, &mut o.qs, lane, &crate::quant::q5_codes(blk.qh, &blk.qs));
                    }
                }
                Packed::Q5M(Blocks::Owned(out))
            }
            GgmlType::Q4K => {
                let nk = cols / QK_K;
                let mut out = vec![BlockQ4Kx8::zeroed(); groups * nk];
                for r in 0..rows {
                    let row = &data[r * row_bytes..(r + 1) * row_bytes];
                    let (g, lane) = (r / ROWS, r % ROWS);
                    for (b, blk) in blocks::<crate::quant::BlockQ4K>(row).iter().enumerate() {
                        let o = &mut out[g * nk + b];
                        put_k(blk, lane, &mut o.d, &mut o.dmin, &mut o.scales, &mut o.mins, &mut o.qs, 128);
                    }
                }
                Packed::Q4K(Blocks::Owned(out))
            }
            GgmlType::Q5K => {
                let nk = cols / QK_K;
                let mut out = vec![BlockQ5Kx8::zeroed(); groups * nk];
                for r in 0..rows {
                    let row = &data[r * row_bytes..(r + 1) * row_bytes];
                    let (g, lane) = (r / ROWS, r % ROWS);
                    for (b, blk) in blocks::<crate::quant::BlockQ5K>(row).iter().enumerate() {
                        let o = &mut out[g * nk + b];
                        put_k(blk, lane, &mut o.d, &mut o.dmin, &mut o.scales, &mut o.mins, &mut o.q, 160);
                    }
                }
                Packed::Q5K(Blocks::Owned(out))
            }
            GgmlType::Q6K => {
                let nk = cols / QK_K;
                let mut out = vec![BlockQ6Kx8::zeroed(); groups * nk];
                for r in 0..rows {
                    let row = &data[r * row_bytes..(r + 1) * row_bytes];
                    let (g, lane) = (r / ROWS, r % ROWS);
                    for (b, blk) in blocks::<crate::quant::BlockQ6K>(row).iter().enumerate() {
                        let o = &mut out[g * nk + b];
                        o.d[lane] = blk.d;
                        for s in 0..16 {
                            o.scales[8 * s + lane] = blk.scales[s];
                        }
                        for c in 0..QK_K {
                            let q = crate::quant::q6k_code(blk, c);
                            let (j, half, k, i) = (c / 32, (c % 32) / 16, (c % 16) / 4, c % 4);
                            o.q[192 * j + 32 * k + 4 * lane + i] |= (q & 0xF) << (4 * half);
                            o.q[192 * j + 128 + 32 * (k / 2) + 4 * lane + i] |= (q >> 4) << (2 * (2 * (k % 2) + half));
                        }
                    }
                }
                Packed::Q6K(Blocks::Owned(out))
            }
            _ => return None,
        };
        Some(Self { rows, cols, data: packed })
    }
}

//! Channel-major 4-bit weights, for decoding with sparse activations (ActiveFlow §4, TEAL).
//!
//! With Top-K activation sparsity most input channels of a projection are zero for a token, so
//! their weight columns need not be read at all. Row-major blocks mix 32 input channels in
//! every block, so a sparse reader would still touch every byte; here the matrix is stored by
//! input channel instead. It stays the GGUF block quantization, unchanged (lossless): for each
//! block `b` of 32 input channels, the `d` and `m` scales of every row (`Rp` f16 each, `Rp` the
//! rows rounded up to [`TILE`]), then the 32 columns, each `Rp / 2` bytes of the rows' 4-bit
//! codes. A column is cut in tiles of 64 rows, 32 bytes each: byte `k` holds row `k` of the tile
//! in its low nibble and row `32 + k` in its high one, so one 32-byte load feeds 64 rows.
//!
//! `y_r = Σ_b d_rb Σ_{j∈b} q_rj x_j + m_rb Σ_{j∈b} x_j`. As in the row-major kernels, each
//! block of inputs is quantized to 8 bits (`x_j ≈ s_b x8_j`); the active columns are taken two
//! at a time, their codes interleaved byte by byte with the two inputs broadcast alongside, so
//! one `vpmaddubsw` gives `q_rj x8_j + q_rk x8_k` for 16 rows. A channel whose input is zero
//! contributes exactly nothing and its column is never read; a block with no active channel
//! does not read its scales either.
#![allow(clippy::cast_possible_truncation)]

use half::f16;

use crate::quant::{q4_block, GgmlType, QK};
use crate::repack::Blocks;

/// Rows per tile: the unit of work handed to a thread, and the rows one column load covers.
pub const TILE: usize = 64;

/// A 4-bit matrix stored channel-major (see the module docs).
#[derive(Debug)]
pub struct ColWeight {
    pub rows: usize,
    pub cols: usize,
    /// Rows rounded up to a whole tile; padding rows have zero codes and scales.
    pub(crate) rows_p: usize,
    pub(crate) at: Placement,
    pub(crate) data: Blocks<u8>,
}

/// Where a channel-major matrix's parts lie in its bytes: block `b`'s scales (`d` of every
/// row, then `m`) at `scales + b * scale_stride`, and column `c = 32 b + j` at
/// `codes + b * block_stride + j * col_stride`. The plain layout (see the module docs) puts
/// each block's columns right after its scales; a weight image may interleave the columns of
/// several matrices and layers so that one input channel's columns lie together on flash
/// (ActiveFlow's cross-layer groups, [`crate::weights`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub scales: usize,
    pub scale_stride: usize,
    pub codes: usize,
    pub block_stride: usize,
    pub col_stride: usize,
}

impl Placement {
    /// The plain layout of a matrix with `rows_p` (padded) rows.
    pub fn plain(rows_p: usize) -> Self {
        let bb = ColWeight::block_bytes_for(rows_p);
        Self { scales: 0, scale_stride: bb, codes: 4 * rows_p, block_stride: bb, col_stride: rows_p / 2 }
    }
    /// One past the last byte a matrix of `rows_p` rows and `nb` blocks placed so reads.
    fn end(&self, rows_p: usize, nb: usize) -> Option<usize> {
        let last = nb.checked_sub(1)?;
        let s = self.scales.checked_add(last.checked_mul(self.scale_stride)?)?.checked_add(4 * rows_p)?;
        let c = self.codes.checked_add(last.checked_mul(self.block_stride)?)?.checked_add((QK - 1).checked_mul(self.col_stride)?)?;
        Some(s.max(c.checked_add(rows_p / 2)?))
    }
}

impl ColWeight {
    /// Bytes a channel-major `ty` matrix of this shape takes; `None` for other types.
    pub fn len_for(ty: GgmlType, rows: usize, cols: usize) -> Option<usize> {
        if !matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1) || !cols.is_multiple_of(QK) {
            return None;
        }
        Some(cols / QK * Self::block_bytes_for(rows.next_multiple_of(TILE)))
    }
    fn block_bytes_for(rows_p: usize) -> usize {
        // Two f16 scales per row, then 32 columns of rows_p nibbles.
        4 * rows_p + QK * rows_p / 2
    }
    /// Rows rounded up to a whole tile (a column is `rows_p / 2` bytes).
    pub fn rows_padded(rows: usize) -> usize {
        rows.next_multiple_of(TILE)
    }
    /// Where block `b`'s scales live: `(offset, len)` in [`Self::as_bytes`].
    pub fn scales_range(&self, b: usize) -> (usize, usize) {
        (self.at.scales + b * self.at.scale_stride, 4 * self.rows_p)
    }
    pub fn tiles(&self) -> usize {
        self.rows_p / TILE
    }
    pub fn as_bytes(&self) -> &[u8] {
        &self.data
    }
    /// Where column (input channel) `c` lives in [`Self::as_bytes`]: `(offset, len)`.
    pub fn column_range(&self, c: usize) -> (usize, usize) {
        let (b, j) = (c / QK, c % QK);
        (self.at.codes + b * self.at.block_stride + j * self.at.col_stride, self.rows_p / 2)
    }

    /// Transposes a row-major GGUF Q4_0/Q4_1 matrix; `None` for other types or shapes.
    pub fn from_gguf(ty: GgmlType, rows: usize, cols: usize, src: &[u8]) -> Option<Self> {
        let len = Self::len_for(ty, rows, cols)?;
        let row_bytes = ty.row_bytes(cols);
        if src.len() < rows * row_bytes {
            return None;
        }
        let rows_p = rows.next_multiple_of(TILE);
        let bb = Self::block_bytes_for(rows_p);
        let mut out = vec![0u8; len];
        for r in 0..rows {
            let row = &src[r * row_bytes..(r + 1) * row_bytes];
            let (tile, within) = (r / TILE, r % TILE);
            for b in 0..cols / QK {
                let (d, m, qs) = q4_block(ty, row, b);
                let base = b * bb;
                out[base + 2 * r..base + 2 * r + 2].copy_from_slice(&d.to_le_bytes());
                out[base + 2 * rows_p + 2 * r..base + 2 * rows_p + 2 * r + 2].copy_from_slice(&m.to_le_bytes());
                for j in 0..QK {
                    // GGUF: byte k holds element k (low nibble) and element 16 + k (high).
                    let q = if j < QK / 2 { qs[j] & 0x0F } else { qs[j - QK / 2] >> 4 };
                    let at = base + 4 * rows_p + j * rows_p / 2 + tile * TILE / 2 + within % (TILE / 2);
                    out[at] |= if within < TILE / 2 { q } else { q << 4 };
                }
            }
        }
        Some(Self { rows, cols, rows_p, at: Placement::plain(rows_p), data: Blocks::Owned(out) })
    }

    /// This matrix moved into `arena` and read in place from there, or itself, unchanged, when
    /// it does not fit (as [`crate::repack::PackedWeight::into_arena`]).
    ///
    /// # Safety
    /// The arena's mapping must outlive the returned matrix.
    pub unsafe fn into_arena(self, arena: &mut crate::arena::ArenaBuilder) -> Self {
        let Some(at) = arena.push(&self.data) else { return self };
        // `push` copied the matrix's bytes to `at` (its placement is relative to them), nothing
        // writes there again, and the caller keeps the mapping (this function's contract).
        let data = Blocks::Borrowed { ptr: at.as_ptr(), len: self.data.len() };
        Self { data, ..self }
    }

    /// A channel-major matrix over bytes produced by [`Self::as_bytes`] for the same type and
    /// shape, without copying them; `None` if the length is wrong.
    ///
    /// # Safety
    /// `bytes` must stay valid and unchanged for as long as the returned value is used.
    pub unsafe fn borrow(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        if Self::len_for(ty, rows, cols)? != bytes.len() {
            return None;
        }
        // SAFETY: as the caller promised.
        unsafe { Self::borrow_placed(ty, rows, cols, bytes, Placement::plain(rows.next_multiple_of(TILE))) }
    }

    /// As [`Self::borrow`], with the parts placed as `at` says within `bytes`; `None` if a
    /// part would lie outside them.
    ///
    /// # Safety
    /// `bytes` must stay valid and unchanged for as long as the returned value is used.
    pub unsafe fn borrow_placed(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8], at: Placement) -> Option<Self> {
        Self::len_for(ty, rows, cols)?;
        let rows_p = rows.next_multiple_of(TILE);
        if at.end(rows_p, cols / QK)? > bytes.len() {
            return None;
        }
        Some(Self { rows, cols, rows_p, at, data: Blocks::Borrowed { ptr: bytes.as_ptr(), len: bytes.len() } })
    }

    /// Copies this matrix into `dst` with its parts placed as `at` says (the bytes between
    /// are left as they are). `None` if a part would fall outside `dst`.
    pub fn place_into(&self, dst: &mut [u8], at: Placement) -> Option<()> {
        let nb = self.cols / QK;
        if at.end(self.rows_p, nb)? > dst.len() {
            return None;
        }
        for b in 0..nb {
            let ((from, len), to) = (self.scales_range(b), at.scales + b * at.scale_stride);
            dst[to..to + len].copy_from_slice(&self.data[from..from + len]);
        }
        for c in 0..self.cols {
            let (from, len) = self.column_range(c);
            let to = at.codes + c / QK * at.block_stride + c % QK * at.col_stride;
            dst[to..to + len].copy_from_slice(&self.data[from..from + len]);
        }
        Some(())
    }

    /// The weight at (`r`, `c`), dequantized.
    pub fn get(&self, r: usize, c: usize) -> f32 {
        let (d, m) = self.scales(c / QK, r);
        d * f32::from(self.code(r, c)) + m
    }
    fn scales(&self, b: usize, r: usize) -> (f32, f32) {
        let base = self.scales_range(b).0;
        let f = |at: usize| f16::from_le_bytes([self.data[at], self.data[at + 1]]).to_f32();
        (f(base + 2 * r), f(base + 2 * self.rows_p + 2 * r))
    }
    fn code(&self, r: usize, c: usize) -> u8 {
        let (off, _) = self.column_range(c);
        let (tile, within) = (r / TILE, r % TILE);
        let byte = self.data[off + tile * TILE / 2 + within % (TILE / 2)];
        if within < TILE / 2 {
            byte & 0x0F
        } else {
            byte >> 4
        }
    }
}

/// The non-zero inputs of a matmul, found once and shared by every matrix that reads them:
/// per token and block of 32 channels, the active channels and the block's input sum.
#[derive(Debug, Default)]
pub struct ActiveSet {
    pub(crate) n: usize,
    pub(crate) nb: usize,
    /// Active channel numbers within their block, token-major then block-major.
    idx: Vec<u8>,
    /// `idx[start[t * nb + b]..start[t * nb + b + 1]]` are token `t`'s active channels of block `b`.
    start: Vec<u32>,
    /// Σ x over each (token, block).
    pub(crate) sums: Vec<f32>,
    /// Each (token, block)'s scale: `x ≈ scale * x8`.
    pub(crate) scales: Vec<f32>,
    /// The inputs quantized to 8 bits per block, token-major.
    pub(crate) x8: Vec<i8>,
}

impl ActiveSet {
    /// Finds the non-zero entries of `n` rows of `cols` inputs.
    pub fn prepare(&mut self, x: &[f32], n: usize, cols: usize) {
        assert!(cols.is_multiple_of(QK) && x.len() >= n * cols, "inputs come in whole blocks");
        let nb = cols / QK;
        self.n = n;
        self.nb = nb;
        self.idx.clear();
        self.start.clear();
        self.sums.clear();
        self.scales.clear();
        self.x8.clear();
        for blk in x[..n * cols].chunks_exact(QK) {
            self.start.push(self.idx.len() as u32);
            // The row-major kernels' quantization (Q8_0 codes, f16 scale, the codes' sum as
            // Q8_1 keeps it: with Q4_1 `m Σx` cancels most of `d Σ q x`, as m ≈ -8d, which
            // only holds if both terms see the same x), so both layouts compute alike.
            let mut q = [0i8; QK];
            let (scale, sum, _) = crate::quant::quantize_block_q8(blk, &mut q);
            self.x8.extend_from_slice(&q);
            // Zero (sparsified) inputs are skipped.
            self.idx.extend((0..QK as u8).filter(|&j| blk[usize::from(j)] != 0.0));
            self.sums.push(sum);
            self.scales.push(scale);
        }
        self.start.push(self.idx.len() as u32);
    }
    /// Active channels in all, over every token.
    pub fn active(&self) -> usize {
        self.idx.len()
    }
    pub(crate) fn block(&self, t: usize, b: usize) -> &[u8] {
        let i = t * self.nb + b;
        &self.idx[self.start[i] as usize..self.start[i + 1] as usize]
    }
}

/// Portable version of one tile, the reference for the vector kernels: their float operations
/// in their order, so all give the same bits.
pub fn tile_ref(w: &ColWeight, a: &ActiveSet, t: usize, tile: usize, y: &mut [f32; TILE]) {
    for b in 0..a.nb {
        let act = a.block(t, b);
        if act.is_empty() {
            continue;
        }
        let mut acc = [0i32; TILE];
        for &j in act {
            let c = b * QK + usize::from(j);
            let xv = i32::from(a.x8[t * w.cols + c]);
            for (i, s) in acc.iter_mut().enumerate() {
                *s += i32::from(w.code(tile * TILE + i, c)) * xv;
            }
        }
        let (sum, scale) = (a.sums[t * a.nb + b], a.scales[t * a.nb + b]);
        for (i, yv) in y.iter_mut().enumerate() {
            let (d, m) = w.scales(b, tile * TILE + i);
            #[allow(clippy::cast_precision_loss)]
            let dot = acc[i] as f32;
            // The vector kernels' operations: `m sum + (d scale dot + y)`, both fused.
            *yv = m.mul_add(sum, (d * scale).mul_add(dot, *yv));
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::kernels::colmajor::{matmul_col, matvec_tiles};
    use crate::pool::OutPtr;
    use crate::quant::dequantize_row;

    fn random_q4(ty: GgmlType, rows: usize, cols: usize, rng: &mut StdRng) -> Vec<u8> {
        let rb = ty.row_bytes(cols);
        let mut v = vec![0u8; rows * rb];
        let bs = if ty == GgmlType::Q4_1 { 20 } else { 18 };
        for blk in v.chunks_exact_mut(bs) {
            blk[..2].copy_from_slice(&f16::from_f32(rng.gen_range(0.001..0.05)).to_le_bytes());
            if ty == GgmlType::Q4_1 {
                blk[2..4].copy_from_slice(&f16::from_f32(rng.gen_range(-0.4..0.0)).to_le_bytes());
            }
            let q0 = bs - 16;
            blk[q0..].iter_mut().for_each(|b| *b = rng.gen());
        }
        v
    }

    #[test]
    fn transposing_is_lossless() {
        let mut rng = StdRng::seed_from_u64(1);
        for (ty, rows, cols) in [(GgmlType::Q4_1, 100, 96), (GgmlType::Q4_0, 64, 64), (GgmlType::Q4_1, 192, 32)] {
            let src = random_q4(ty, rows, cols, &mut rng);
            let w = ColWeight::from_gguf(ty, rows, cols, &src).unwrap();
            assert_eq!(w.as_bytes().len(), ColWeight::len_for(ty, rows, cols).unwrap());
            let mut row = vec![0.0; cols];
            let rb = ty.row_bytes(cols);
            for r in 0..rows {
                dequantize_row(ty, &src[r * rb..(r + 1) * rb], &mut row);
                for (c, &v) in row.iter().enumerate() {
                    assert_eq!(w.get(r, c), v, "{ty:?} ({r}, {c})");
                }
            }
        }
        assert!(ColWeight::from_gguf(GgmlType::Q8_0, 8, 32, &[0; 34 * 8]).is_none());
        assert!(ColWeight::from_gguf(GgmlType::Q4_1, 8, 32, &[0; 20 * 7]).is_none(), "short input");
    }

    /// The kernels against an f64 product of the dequantized matrix, with half the inputs zero
    /// and one block entirely zero.
    #[test]
    fn sparse_products_match_the_dense_reference() {
        let mut rng = StdRng::seed_from_u64(2);
        let (rows, cols, n) = (136, 128, 3);
        let src = random_q4(GgmlType::Q4_1, rows, cols, &mut rng);
        let w = ColWeight::from_gguf(GgmlType::Q4_1, rows, cols, &src).unwrap();
        let mut x: Vec<f32> = (0..n * cols).map(|_| if rng.gen_bool(0.5) { rng.gen_range(-2.0..2.0) } else { 0.0 }).collect();
        x[cols + 32..cols + 64].iter_mut().for_each(|v| *v = 0.0);
        // The last token dense: whole blocks of 32 active channels (two groups of 8 pairs).
        x[2 * cols..].iter_mut().for_each(|v| *v = rng.gen_range(0.5..2.0));
        let mut a = ActiveSet::default();
        a.prepare(&x, n, cols);
        assert_eq!(a.active(), x.iter().filter(|v| **v != 0.0).count());
        let ldo = rows + 5;
        let mut out = vec![f32::NAN; n * ldo];
        let o = OutPtr::new(&mut out);
        matmul_col(&w, &a, o, ldo, 0, 1);
        matmul_col(&w, &a, o, ldo, 1, w.tiles());
        for t in 0..n {
            for r in 0..rows {
                // The inputs as the kernels see them: 8-bit codes times the block's scale.
                let want: f64 = (0..a.nb)
                    .map(|b| {
                        let (d, m) = w.scales(b, r);
                        let dot: f64 = (b * QK..(b + 1) * QK).map(|c| f64::from(w.code(r, c)) * f64::from(a.x8[t * cols + c])).sum();
                        f64::from(d) * f64::from(a.scales[t * a.nb + b]) * dot + f64::from(m) * f64::from(a.sums[t * a.nb + b])
                    })
                    .sum();
                let exact: f64 = (0..cols).map(|c| f64::from(w.get(r, c)) * f64::from(x[t * cols + c])).sum();
                let got = f64::from(out[t * ldo + r]);
                assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "t{t} r{r}: {got} vs {want}");
                assert!((got - exact).abs() <= 0.02 * (1.0 + exact.abs()), "t{t} r{r}: {got} vs exact {exact}");
                let mut y = [0.0; TILE];
                tile_ref(&w, &a, t, r / TILE, &mut y);
                assert_eq!(y[r % TILE].to_bits(), out[t * ldo + r].to_bits(), "t{t} r{r}: the reference's bits");
            }
            assert!(out[t * ldo + rows..(t + 1) * ldo].iter().all(|v| v.is_nan()), "padding rows are not written");
            // Split by rows, in two parts, as one token's decode does: the same bits.
            let mut y = vec![f32::NAN; rows + 1];
            matvec_tiles(&w, &a, t, 0, 1, OutPtr::new(&mut y));
            matvec_tiles(&w, &a, t, 1, w.tiles(), OutPtr::new(&mut y));
            assert_eq!(&y[..rows], &out[t * ldo..t * ldo + rows], "token {t}");
            assert!(y[rows].is_nan(), "padding rows are not written");
        }
    }

    /// Two matrices interleaved column by column in one buffer (as a weight image groups an
    /// input channel's columns across matrices and layers) compute what their plain copies do.
    #[test]
    fn placed_matrices_compute_like_plain_ones() {
        let mut rng = StdRng::seed_from_u64(4);
        let (cols, n) = (96, 2);
        let shapes = [(GgmlType::Q4_1, 136), (GgmlType::Q4_0, 64)];
        let plain: Vec<ColWeight> =
            shapes.iter().map(|&(ty, rows)| ColWeight::from_gguf(ty, rows, cols, &random_q4(ty, rows, cols, &mut rng)).unwrap()).collect();
        let rp: Vec<usize> = shapes.iter().map(|&(_, r)| ColWeight::rows_padded(r)).collect();
        let nb = cols / QK;
        let scales: usize = rp.iter().map(|r| 4 * r * nb).sum();
        let run: usize = rp.iter().map(|r| r / 2).sum::<usize>() + 7; // odd padding: unaligned runs
        let mut buf = vec![0u8; scales + cols * run + 64];
        let (mut s0, mut c0) = (0, scales);
        let mut placed = Vec::new();
        for (w, &r) in plain.iter().zip(&rp) {
            let at = Placement { scales: s0, scale_stride: 4 * r, codes: c0, block_stride: QK * run, col_stride: run };
            w.place_into(&mut buf, at).unwrap();
            placed.push(at);
            s0 += 4 * r * nb;
            c0 += r / 2;
        }
        assert!(plain[0].place_into(&mut buf[..scales], placed[0]).is_none(), "a part outside the buffer is refused");
        let x: Vec<f32> = (0..n * cols).map(|_| if rng.gen_bool(0.4) { rng.gen_range(-2.0..2.0) } else { 0.0 }).collect();
        let mut a = ActiveSet::default();
        a.prepare(&x, n, cols);
        for ((w, at), &(ty, rows)) in plain.iter().zip(placed).zip(&shapes) {
            // SAFETY: `buf` outlives `p` and is not changed meanwhile.
            let p = unsafe { ColWeight::borrow_placed(ty, rows, cols, &buf, at) }.unwrap();
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(p.get(r, c), w.get(r, c));
                }
            }
            let (mut want, mut got) = (vec![0.0; n * rows], vec![0.0; n * rows]);
            matmul_col(w, &a, OutPtr::new(&mut want), rows, 0, w.tiles());
            matmul_col(&p, &a, OutPtr::new(&mut got), rows, 0, p.tiles());
            assert_eq!(got, want);
            let mut y = vec![0.0; rows];
            matvec_tiles(&p, &a, 1, 0, p.tiles(), OutPtr::new(&mut y));
            assert_eq!(y, want[rows..]);
            // SAFETY: as above.
            assert!(unsafe { ColWeight::borrow_placed(ty, rows, cols, &buf[..scales], at) }.is_none(), "parts out of bounds");
        }
    }

    /// Inactive channels' columns are never read: they sit on pages with no access at all.
    #[test]
    fn inactive_columns_are_not_touched() {
        let mut rng = StdRng::seed_from_u64(3);
        // 8192 rows: each column is exactly one 4 KiB page, the scales 8 pages.
        let (rows, cols) = (8192, 64);
        let src = random_q4(GgmlType::Q4_1, rows, cols, &mut rng);
        let w = ColWeight::from_gguf(GgmlType::Q4_1, rows, cols, &src).unwrap();
        let len = w.as_bytes().len();
        let page = 4096;
        // SAFETY: a fresh private anonymous mapping, ours alone, unmapped at the end.
        let map = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        assert_ne!(map, libc::MAP_FAILED);
        // SAFETY: the mapping is `len` bytes and readable and writable.
        let mem = unsafe { std::slice::from_raw_parts_mut(map.cast::<u8>(), len) };
        mem.copy_from_slice(w.as_bytes());
        let mut x = vec![0.0f32; cols];
        for (c, xc) in x.iter_mut().enumerate() {
            let (off, clen) = w.column_range(c);
            assert_eq!((off % page, clen), (0, page));
            if c % 3 == 0 {
                *xc = rng.gen_range(-1.0..1.0);
            } else {
                // SAFETY: a page-aligned page inside our mapping.
                assert_eq!(unsafe { libc::mprotect(map.byte_add(off), page, libc::PROT_NONE) }, 0);
            }
        }
        // SAFETY: `mem` stays mapped and unchanged while `paged` is used.
        let paged = unsafe { ColWeight::borrow(GgmlType::Q4_1, rows, cols, mem) }.unwrap();
        let mut a = ActiveSet::default();
        a.prepare(&x, 1, cols);
        let mut out = vec![0.0; rows];
        matmul_col(&paged, &a, OutPtr::new(&mut out), rows, 0, paged.tiles());
        let mut want = vec![0.0; rows];
        matmul_col(&w, &a, OutPtr::new(&mut want), rows, 0, w.tiles());
        assert_eq!(out, want);
        let mut y = vec![0.0; rows];
        matvec_tiles(&paged, &a, 0, 0, paged.tiles(), OutPtr::new(&mut y));
        assert_eq!(y, want);
        drop((paged, w));
        // SAFETY: nothing borrows the mapping any more.
        assert_eq!(unsafe { libc::munmap(map, len) }, 0);
    }
}

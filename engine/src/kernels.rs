//! Matrix kernels: weight rows (any supported type) times activation rows.
//!
//! One entry point, [`matmul_rows`], computes `out[t * ldo + r] = W[r] · a[t]` for a range of
//! weight rows and every activation row. It walks the rows in tiles of several weight rows by
//! several tokens so that each weight block is unpacked once and reused across tokens (prefill
//! is a real GEMM) and each activation block is reused across rows. The AVX2 tiles are chosen
//! at run time; every one has a scalar reference in `quant` and a test comparing the two.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use std::sync::LazyLock;

use half::f16;

use crate::pool::ThreadPool;
use crate::quant::{self, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ6K, BlockQ8_0, GgmlType, Q8Acts, Q8KActs};
use crate::repack::{Packed, PackedWeight, ROWS};

static HAS_AVX2: LazyLock<bool> = LazyLock::new(|| {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
});

/// Whether the CPU has AVX2, FMA and F16C (checked once).
#[inline]
pub fn has_avx2() -> bool {
    *HAS_AVX2
}

/// Whether the AVX2+FMA+F16C kernels are in use (reported by `llms bench`).
pub fn simd_name() -> &'static str {
    if *HAS_AVX2 {
        "avx2"
    } else {
        "scalar"
    }
}

/// A weight matrix: `rows` rows of `cols` elements in `ty`, row-major.
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl WeightView<'_> {
    pub fn row(&self, r: usize) -> &[u8] {
        let rb = self.ty.row_bytes(self.cols);
        &self.data[r * rb..(r + 1) * rb]
    }
    pub fn act_kind(&self) -> ActKind {
        act_kind(self.ty)
    }
}

/// Which activation format a weight type multiplies with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActKind {
    Q8,
    Q8K,
    F32,
}

pub fn act_kind(ty: GgmlType) -> ActKind {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => ActKind::Q8,
        GgmlType::Q4K | GgmlType::Q6K => ActKind::Q8K,
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => ActKind::F32,
    }
}

/// Activations prepared once per matmul input and shared by every weight that reads it.
#[derive(Debug, Default)]
pub struct Acts {
    pub q8: Q8Acts,
    pub q8k: Q8KActs,
    pub f32: Vec<f32>,
    /// The non-zero inputs, for channel-major weights.
    pub active: crate::colmajor::ActiveSet,
    pub cols: usize,
    pub rows: usize,
}

impl Acts {
    /// Prepares `rows` rows of `cols` values in the formats the given kinds need.
    pub fn prepare(&mut self, x: &[f32], rows: usize, cols: usize, kinds: &[ActKind], pool: &ThreadPool) {
        self.rows = rows;
        self.cols = cols;
        if kinds.contains(&ActKind::Q8) {
            self.q8.quantize(x, rows, cols, pool);
        }
        if kinds.contains(&ActKind::Q8K) {
            self.q8k.quantize(x, rows, cols);
        }
        if kinds.contains(&ActKind::F32) {
            self.f32.clear();
            self.f32.extend_from_slice(&x[..rows * cols]);
        }
    }
}

/// Raw output pointer shared by the threads of one matmul; each thread writes a disjoint set
/// of `(token, row)` cells.
#[derive(Debug, Clone, Copy)]
pub struct OutPtr {
    pub ptr: *mut f32,
    pub len: usize,
}
// SAFETY: an OutPtr is only used by matmul_rows, whose callers give each thread a disjoint row
// range, so no two threads write the same element.
unsafe impl Send for OutPtr {}
// SAFETY: see Send.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    pub fn new(out: &mut [f32]) -> Self {
        Self { ptr: out.as_mut_ptr(), len: out.len() }
    }
    /// The same buffer seen from element `by` on.
    pub fn offset(self, by: usize) -> Self {
        Self { ptr: self.ptr.wrapping_add(by), len: self.len.saturating_sub(by) }
    }
    #[inline]
    pub fn write(&self, idx: usize, v: f32) {
        assert!(idx < self.len, "matmul output index {idx} out of {}", self.len);
        // SAFETY: idx is in bounds (checked above); the buffer outlives the matmul; threads
        // write disjoint indices (contract of matmul_rows).
        unsafe { *self.ptr.add(idx) = v };
    }
}

/// Computes `out[t * ldo + r] = W[r] · a[t]` for `r` in `r0..r1` and every activation row `t`.
///
/// Threads may call this concurrently on the same `out` with disjoint row ranges.
pub fn matmul_rows(w: &WeightView, a: &Acts, out: OutPtr, ldo: usize, r0: usize, r1: usize) {
    debug_assert_eq!(a.cols, w.cols);
    debug_assert!(r1 <= w.rows);
    // Types with fast kernels are repacked at load and go through `matmul_packed`; the rest
    // (K-quants, float weights) take the reference path.
    matmul_rows_ref(w, a, out, ldo, r0, r1, a.rows);
}

/// Computes `out[t * ldo + r] = W[r] · a[t]` for the rows of packed groups `g0..g1` (rows past
/// the matrix in the last group are not written). Threads may run disjoint group ranges at once.
pub fn matmul_packed(w: &PackedWeight, a: &Q8Acts, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
    assert_eq!(w.blocks_per_row(), a.nb, "activation width does not match the weight");
    #[cfg(target_arch = "x86_64")]
    if *HAS_AVX2 {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked at run time).
        unsafe { avx2::matmul_packed(w, a, out, ldo, g0, g1) };
        return;
    }
    matmul_packed_ref(w, a, out, ldo, g0, g1);
}

/// Scalar reference for [`matmul_packed`], reading the packed layout directly.
pub fn matmul_packed_ref(w: &PackedWeight, a: &Q8Acts, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
    let nb = w.blocks_per_row();
    for g in g0..g1 {
        for lane in 0..ROWS {
            let r = g * ROWS + lane;
            if r >= w.rows {
                break;
            }
            for t in 0..a.rows {
                let mut sum = 0.0f32;
                for b in 0..nb {
                    let k8 = t * nb + b;
                    let xq = &a.qs[k8];
                    match &w.data {
                        Packed::Q4(v) => {
                            let blk = &v[g * nb + b];
                            let mut s = 0i32;
                            for k in 0..4 {
                                for j in 0..4 {
                                    let q = blk.qs[32 * k + 4 * lane + j];
                                    s += i32::from(q & 0xF) * i32::from(xq[4 * k + j]) + i32::from(q >> 4) * i32::from(xq[16 + 4 * k + j]);
                                }
                            }
                            sum += blk.d[lane].to_f32() * a.d[k8] * s as f32 + blk.m[lane].to_f32() * a.s[k8];
                        }
                        Packed::Q8(v) => {
                            let blk = &v[g * nb + b];
                            let mut s = 0i32;
                            for k in 0..8 {
                                for j in 0..4 {
                                    s += i32::from(blk.qs[32 * k + 4 * lane + j]) * i32::from(xq[4 * k + j]);
                                }
                            }
                            sum += blk.d[lane].to_f32() * a.d[k8] * s as f32;
                        }
                    }
                }
                out.write(t * ldo + r, sum);
            }
        }
    }
}

/// The scalar reference for every weight type.
pub fn matmul_rows_ref(w: &WeightView, a: &Acts, out: OutPtr, ldo: usize, r0: usize, r1: usize, n_tok: usize) {
    let mut tmp = Vec::new();
    for r in r0..r1 {
        let row = w.row(r);
        for t in 0..n_tok {
            let v = match w.ty {
                GgmlType::Q4_0 => quant::dot_q4_0_ref(quant::blocks::<BlockQ4_0>(row), &a.q8, t),
                GgmlType::Q4_1 => quant::dot_q4_1_ref(quant::blocks::<BlockQ4_1>(row), &a.q8, t),
                GgmlType::Q8_0 => quant::dot_q8_0_ref(quant::blocks::<BlockQ8_0>(row), &a.q8, t),
                GgmlType::Q4K => quant::dot_q4k_ref(quant::blocks::<BlockQ4K>(row), &a.q8k, t),
                GgmlType::Q6K => quant::dot_q6k_ref(quant::blocks::<BlockQ6K>(row), &a.q8k, t),
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                    tmp.resize(w.cols, 0.0);
                    quant::dequantize_row(w.ty, row, &mut tmp);
                    let x = &a.f32[t * w.cols..(t + 1) * w.cols];
                    tmp.iter().zip(x).map(|(p, q)| p * q).sum()
                }
            };
            out.write(t * ldo + r, v);
        }
    }
}

/// K or V rows of one chunk's head block, as attention reads them: the base formats
/// directly from the chunk's bytes (no decode pass), anything else decoded to f32 first.
#[derive(Debug, Clone, Copy)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    F16(&'a [u8]),
    /// An int8 head block: `t_cap` f16 scales, then the codes.
    Int8 {
        blk: &'a [u8],
        t_cap: usize,
    },
}

impl KvRows<'_> {
    /// Row `t` as f32 (reference path).
    fn row(&self, t: usize, hd: usize, out: &mut [f32]) {
        match *self {
            KvRows::F32(v) => out[..hd].copy_from_slice(&v[t * hd..(t + 1) * hd]),
            KvRows::F16(b) => {
                for (i, o) in out[..hd].iter_mut().enumerate() {
                    let j = 2 * (t * hd + i);
                    *o = f16::from_le_bytes([b[j], b[j + 1]]).to_f32();
                }
            }
            KvRows::Int8 { blk, t_cap } => {
                let s = f16::from_le_bytes([blk[2 * t], blk[2 * t + 1]]).to_f32();
                for (i, o) in out[..hd].iter_mut().enumerate() {
                    *o = s * f32::from(blk[t_cap * 2 + t * hd + i] as i8);
                }
            }
        }
    }
    /// Whether `n` rows of `hd` fit.
    fn holds(&self, n: usize, hd: usize) -> bool {
        match *self {
            KvRows::F32(v) => v.len() >= n * hd,
            KvRows::F16(b) => b.len() >= n * hd * 2,
            KvRows::Int8 { blk, t_cap } => n <= t_cap && blk.len() >= t_cap * 2 + n * hd,
        }
    }
}

/// Attention scores of a tile of queries against one chunk's K rows:
/// `scores[i * ld + col0 + t] = scale * q_i · k_t` for `t < visible[i]`.
#[allow(clippy::too_many_arguments)]
pub fn chunk_scores(q: &[f32], hd: usize, k: KvRows, visible: &[usize], scale: f32, scores: &mut [f32], ld: usize, col0: usize) {
    let n = visible.iter().copied().max().unwrap_or(0);
    assert!(q.len() >= visible.len() * hd && k.holds(n, hd), "attention rows out of range");
    assert!(visible.iter().enumerate().all(|(i, &v)| v == 0 || i * ld + col0 + v <= scores.len()));
    #[cfg(target_arch = "x86_64")]
    if *HAS_AVX2 && hd.is_multiple_of(8) && hd <= 256 {
        // SAFETY: features checked; every index used is bounded by the asserts above.
        unsafe { avx2::chunk_scores(q, hd, k, visible, scale, scores, ld, col0) };
        return;
    }
    let mut row = vec![0.0f32; hd];
    for t in 0..n {
        k.row(t, hd, &mut row);
        for (i, &vis) in visible.iter().enumerate() {
            if t < vis {
                scores[i * ld + col0 + t] = row.iter().zip(&q[i * hd..(i + 1) * hd]).map(|(a, b)| a * b).sum::<f32>() * scale;
            }
        }
    }
}

/// Attention output of a tile of queries from one chunk's V rows:
/// `out_i += sum_t probs[i * ld + col0 + t] * v_t` for `t < visible[i]`.
pub fn chunk_values(probs: &[f32], ld: usize, col0: usize, v: KvRows, visible: &[usize], hd: usize, out: &mut [f32]) {
    let n = visible.iter().copied().max().unwrap_or(0);
    assert!(v.holds(n, hd) && out.len() >= visible.len() * hd, "attention rows out of range");
    assert!(visible.iter().enumerate().all(|(i, &vis)| vis == 0 || i * ld + col0 + vis <= probs.len()));
    #[cfg(target_arch = "x86_64")]
    if *HAS_AVX2 && hd.is_multiple_of(8) && hd <= 256 {
        // SAFETY: features checked; indices bounded by the asserts above.
        unsafe { avx2::chunk_values(probs, ld, col0, v, visible, hd, out) };
        return;
    }
    let mut row = vec![0.0f32; hd];
    for t in 0..n {
        v.row(t, hd, &mut row);
        for (i, &vis) in visible.iter().enumerate() {
            if t < vis {
                axpy_f32(probs[i * ld + col0 + t], &row, &mut out[i * hd..(i + 1) * hd]);
            }
        }
    }
}

/// `out += a * x`.
#[inline]
pub fn axpy_f32(a: f32, x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o += a * v;
    }
}

/// In-place softmax whose results are rounded to f16 precision (llama.cpp's f16 V·P product);
/// the sum is taken in f64 as llama.cpp does.
pub fn softmax_f16(row: &mut [f32]) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    #[cfg(target_arch = "x86_64")]
    if *HAS_AVX2 {
        // SAFETY: the CPU has AVX2/FMA/F16C.
        unsafe { avx2::softmax_f16(row, max) };
        return;
    }
    let mut sum = 0.0f64;
    for x in row.iter_mut() {
        *x = (*x - max).exp();
        sum += f64::from(*x);
    }
    #[allow(clippy::cast_possible_truncation)]
    let inv = (1.0 / sum) as f32;
    for x in row.iter_mut() {
        *x = f16::from_f32(*x * inv).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    // Every function here is an AVX2/FMA/F16C kernel whose one precondition is that the CPU
    // has those features; the dispatchers above check that once (HAS_AVX2) before calling in.
    // Marking each intrinsic call `unsafe` again would hide the few real memory contracts,
    // which are commented where they are (pointer loads).
    #![allow(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
    use std::arch::x86_64::*;

    use half::f16;

    use super::{KvRows, OutPtr};
    use crate::quant::Q8Acts;
    use crate::repack::{Packed, PackedWeight, ROWS};

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// Needs AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn matmul_packed(w: &PackedWeight, a: &Q8Acts, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
        let n_tok = a.rows;
        for g in g0..g1 {
            let mut t = 0;
            while t + 4 <= n_tok {
                packed_tile::<4>(w, a, g, t, out, ldo);
                t += 4;
            }
            while t < n_tok {
                packed_tile::<1>(w, a, g, t, out, ldo);
                t += 1;
            }
        }
    }

    /// Four activation bytes starting at `p`, broadcast to every 32-bit lane.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn bcast4(p: *const i8) -> __m256i {
        // SAFETY (callers): p points at 4 readable bytes inside an activation block.
        _mm256_set1_epi32(std::ptr::read_unaligned(p.cast::<i32>()))
    }

    /// One group of 8 rows against `T` tokens starting at `t0`, over every block.
    #[allow(clippy::needless_range_loop)] // `t` indexes several per-token arrays in step
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn packed_tile<const T: usize>(w: &PackedWeight, a: &Q8Acts, g: usize, t0: usize, out: OutPtr, ldo: usize) {
        let nb = w.blocks_per_row();
        let ones = _mm256_set1_epi16(1);
        let mask = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); T];
        let xrow: [usize; T] = std::array::from_fn(|t| (t0 + t) * nb);
        match &w.data {
            Packed::Q4(v) => {
                let blks = &v[g * nb..(g + 1) * nb];
                for (b, blk) in blks.iter().enumerate() {
                    let mut p = [_mm256_setzero_si256(); T];
                    for k in 0..4 {
                        let wv = _mm256_loadu_si256(blk.qs.as_ptr().add(32 * k).cast());
                        let lo = _mm256_and_si256(wv, mask);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), mask);
                        for t in 0..T {
                            let xq = a.qs[xrow[t] + b].as_ptr();
                            // |sum| <= 8 * 2 * 15 * 127 < 2^15: the i16 adds cannot overflow.
                            let pl = _mm256_maddubs_epi16(lo, bcast4(xq.add(4 * k)));
                            let ph = _mm256_maddubs_epi16(hi, bcast4(xq.add(16 + 4 * k)));
                            p[t] = _mm256_add_epi16(p[t], _mm256_add_epi16(pl, ph));
                        }
                    }
                    let dv = _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().cast()));
                    let mv = _mm256_cvtph_ps(_mm_loadu_si128(blk.m.as_ptr().cast()));
                    for t in 0..T {
                        let k8 = xrow[t] + b;
                        let pf = _mm256_cvtepi32_ps(_mm256_madd_epi16(p[t], ones));
                        acc[t] = _mm256_fmadd_ps(pf, _mm256_mul_ps(dv, _mm256_set1_ps(a.d[k8])), acc[t]);
                        acc[t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.s[k8]), acc[t]);
                    }
                }
            }
            Packed::Q8(v) => {
                let blks = &v[g * nb..(g + 1) * nb];
                for (b, blk) in blks.iter().enumerate() {
                    let mut p = [_mm256_setzero_si256(); T];
                    for k in 0..8 {
                        let wv = _mm256_loadu_si256(blk.qs.as_ptr().add(32 * k).cast());
                        let aw = _mm256_sign_epi8(wv, wv);
                        for t in 0..T {
                            let x = bcast4(a.qs[xrow[t] + b].as_ptr().add(4 * k));
                            let pr = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, wv));
                            p[t] = _mm256_add_epi32(p[t], _mm256_madd_epi16(pr, ones));
                        }
                    }
                    let dv = _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().cast()));
                    for t in 0..T {
                        let pf = _mm256_cvtepi32_ps(p[t]);
                        acc[t] = _mm256_fmadd_ps(pf, _mm256_mul_ps(dv, _mm256_set1_ps(a.d[xrow[t] + b])), acc[t]);
                    }
                }
            }
        }
        let r0 = g * ROWS;
        let valid = (w.rows - r0).min(ROWS);
        for t in 0..T {
            let idx = (t0 + t) * ldo + r0;
            if valid == ROWS {
                assert!(idx + ROWS <= out.len, "packed matmul output out of range");
                // SAFETY: idx + 8 <= len (checked); this thread owns rows r0..r0+8.
                _mm256_storeu_ps(out.ptr.add(idx), acc[t]);
            } else {
                let mut tmp = [0.0f32; ROWS];
                _mm256_storeu_ps(tmp.as_mut_ptr(), acc[t]);
                for (r, &v) in tmp.iter().enumerate().take(valid) {
                    out.write(idx + r, v);
                }
            }
        }
    }

    /// How a kernel loads row `t` of a chunk into `lanes` vectors of 8 floats; one
    /// implementation per format so each kernel instantiation inlines its own loads.
    trait RowLoad {
        /// # Safety
        /// AVX2/F16C present; row `t` inside the block (checked by the caller).
        unsafe fn load(&self, t: usize, hd: usize, lanes: usize, out: &mut [__m256; 32]);
    }
    struct F32Rows(*const f32);
    struct F16Rows(*const u8);
    struct I8Rows(*const u8, usize);

    impl RowLoad for F32Rows {
        #[inline(always)]
        unsafe fn load(&self, t: usize, hd: usize, lanes: usize, out: &mut [__m256; 32]) {
            let p = self.0.add(t * hd);
            for (c, slot) in out.iter_mut().enumerate().take(lanes) {
                *slot = _mm256_loadu_ps(p.add(8 * c));
            }
        }
    }
    impl RowLoad for F16Rows {
        #[inline(always)]
        unsafe fn load(&self, t: usize, hd: usize, lanes: usize, out: &mut [__m256; 32]) {
            let p = self.0.add(2 * t * hd);
            for (c, slot) in out.iter_mut().enumerate().take(lanes) {
                *slot = _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * c).cast()));
            }
        }
    }
    impl RowLoad for I8Rows {
        #[inline(always)]
        unsafe fn load(&self, t: usize, hd: usize, lanes: usize, out: &mut [__m256; 32]) {
            let sb = self.0.add(2 * t);
            let s = _mm256_set1_ps(f16::from_le_bytes([*sb, *sb.add(1)]).to_f32());
            let p = self.0.add(self.1 * 2 + t * hd);
            for (c, slot) in out.iter_mut().enumerate().take(lanes) {
                let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8 * c).cast()));
                *slot = _mm256_mul_ps(s, _mm256_cvtepi32_ps(q));
            }
        }
    }

    /// # Safety
    /// Needs AVX2/FMA; `hd` a multiple of 8 up to 256; indices bounded (checked by the caller).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn chunk_scores(
        q: &[f32],
        hd: usize,
        k: KvRows,
        visible: &[usize],
        scale: f32,
        scores: &mut [f32],
        ld: usize,
        col0: usize,
    ) {
        match k {
            KvRows::F32(v) => scores_with(&F32Rows(v.as_ptr()), q, hd, visible, scale, scores, ld, col0),
            KvRows::F16(b) => scores_with(&F16Rows(b.as_ptr()), q, hd, visible, scale, scores, ld, col0),
            KvRows::Int8 { blk, t_cap } => scores_with(&I8Rows(blk.as_ptr(), t_cap), q, hd, visible, scale, scores, ld, col0),
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores_with<L: RowLoad>(
        k: &L,
        q: &[f32],
        hd: usize,
        visible: &[usize],
        scale: f32,
        scores: &mut [f32],
        ld: usize,
        col0: usize,
    ) {
        let lanes = hd / 8;
        let n = visible.iter().copied().max().unwrap_or(0);
        let mut kv = [_mm256_setzero_ps(); 32];
        for t in 0..n {
            k.load(t, hd, lanes, &mut kv);
            for (i, &vis) in visible.iter().enumerate() {
                if t >= vis {
                    continue;
                }
                let qp = q.as_ptr().add(i * hd);
                let mut acc = _mm256_setzero_ps();
                for (c, kc) in kv.iter().enumerate().take(lanes) {
                    acc = _mm256_fmadd_ps(*kc, _mm256_loadu_ps(qp.add(8 * c)), acc);
                }
                *scores.get_unchecked_mut(i * ld + col0 + t) = hsum(acc) * scale;
            }
        }
    }

    /// # Safety
    /// Needs AVX2/FMA; `hd` a multiple of 8 up to 256; indices bounded (checked by the caller).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn chunk_values(probs: &[f32], ld: usize, col0: usize, v: KvRows, visible: &[usize], hd: usize, out: &mut [f32]) {
        match v {
            KvRows::F32(r) => values_with(&F32Rows(r.as_ptr()), probs, ld, col0, visible, hd, out),
            KvRows::F16(b) => values_with(&F16Rows(b.as_ptr()), probs, ld, col0, visible, hd, out),
            KvRows::Int8 { blk, t_cap } => values_with(&I8Rows(blk.as_ptr(), t_cap), probs, ld, col0, visible, hd, out),
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values_with<L: RowLoad>(v: &L, probs: &[f32], ld: usize, col0: usize, visible: &[usize], hd: usize, out: &mut [f32]) {
        let lanes = hd / 8;
        let n = visible.iter().copied().max().unwrap_or(0);
        let mut vv = [_mm256_setzero_ps(); 32];
        for t in 0..n {
            v.load(t, hd, lanes, &mut vv);
            for (i, &vis) in visible.iter().enumerate() {
                if t >= vis {
                    continue;
                }
                let w = _mm256_set1_ps(*probs.get_unchecked(i * ld + col0 + t));
                let o = out.as_mut_ptr().add(i * hd);
                for (c, vc) in vv.iter().enumerate().take(lanes) {
                    let d = o.add(8 * c);
                    _mm256_storeu_ps(d, _mm256_fmadd_ps(w, *vc, _mm256_loadu_ps(d)));
                }
            }
        }
    }

    /// `e^x` for 8 lanes (x <= 0 after max subtraction; large negatives flush to 0): Cody-Waite
    /// range reduction and a degree-6 polynomial, within 2 ulp of libm.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn exp8(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
        let n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.398_199_9e-3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.333_452e-3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166_579_6e-2));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.666_666_5e-1));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
        p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let pow2n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
        let y = _mm256_mul_ps(p, pow2n);
        // Below -87 the true value is under f32's normal range: return 0.
        _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0), _CMP_GT_OQ))
    }

    /// # Safety
    /// Needs AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn softmax_f16(row: &mut [f32], max: f32) {
        let n = row.len();
        let m = _mm256_set1_ps(max);
        let mut sum = 0.0f64;
        let mut i = 0;
        let ptr = row.as_mut_ptr();
        while i + 8 <= n {
            // SAFETY: i + 8 <= n.
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(ptr.add(i)), m));
            _mm256_storeu_ps(ptr.add(i), e);
            let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(e));
            let hi = _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1));
            let s2 = _mm256_add_pd(lo, hi);
            let s1 = _mm_add_pd(_mm256_castpd256_pd128(s2), _mm256_extractf128_pd(s2, 1));
            sum += _mm_cvtsd_f64(_mm_add_sd(s1, _mm_unpackhi_pd(s1, s1)));
            i += 8;
        }
        for x in &mut row[i..] {
            *x = (*x - max).exp();
            sum += f64::from(*x);
        }
        #[allow(clippy::cast_possible_truncation)]
        let inv = _mm256_set1_ps((1.0 / sum) as f32);
        let mut i = 0;
        while i + 8 <= n {
            // Round through f16 and back, 8 at a time.
            let y = _mm256_mul_ps(_mm256_loadu_ps(ptr.add(i)), inv);
            _mm256_storeu_ps(ptr.add(i), _mm256_cvtph_ps(_mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT)));
            i += 8;
        }
        #[allow(clippy::cast_possible_truncation)]
        let inv = (1.0 / sum) as f32;
        for x in &mut row[i..] {
            *x = f16::from_f32(*x * inv).to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repack::PackedWeight;
    use rand::{Rng, SeedableRng};

    fn random_weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut impl Rng) -> Vec<u8> {
        let n = rows * ty.row_bytes(cols);
        let mut data: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
        // Keep the f16 scales finite and small so sums stay comparable.
        let bs = ty.type_size();
        for blk in data.chunks_exact_mut(bs) {
            let put = |b: &mut [u8], at: usize, v: f32| b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
            match ty {
                GgmlType::Q4_0 | GgmlType::Q8_0 => put(blk, 0, rng.gen_range(0.001..0.05)),
                GgmlType::Q4_1 => {
                    put(blk, 0, rng.gen_range(0.001..0.05));
                    put(blk, 2, rng.gen_range(-0.2..0.2));
                }
                GgmlType::Q4K => {
                    put(blk, 0, rng.gen_range(0.001..0.05));
                    put(blk, 2, rng.gen_range(0.001..0.05));
                }
                GgmlType::Q6K => put(blk, 208, rng.gen_range(0.001..0.05)),
                _ => {}
            }
        }
        data
    }

    #[test]
    fn packed_kernels_match_row_major_reference() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            for &(rows, cols, toks) in &[(8, 32, 1), (13, 64, 6), (40, 576, 9), (3, 96, 4)] {
                let data = random_weights(ty, rows, cols, &mut rng);
                let w = WeightView { ty, rows, cols, data: &data };
                let p = PackedWeight::pack(ty, rows, cols, &data).expect("packable type");
                let x: Vec<f32> = (0..toks * cols).map(|_| rng.gen_range(-2.0..2.0)).collect();
                let mut a = Acts::default();
                a.prepare(&x, toks, cols, &[ActKind::Q8], &ThreadPool::new(2));
                let mut want = vec![f32::NAN; toks * rows];
                matmul_rows_ref(&w, &a, OutPtr::new(&mut want), rows, 0, rows, toks);
                for scalar in [false, true] {
                    let mut got = vec![f32::NAN; toks * rows];
                    if scalar {
                        matmul_packed_ref(&p, &a.q8, OutPtr::new(&mut got), rows, 0, p.groups());
                    } else {
                        matmul_packed(&p, &a.q8, OutPtr::new(&mut got), rows, 0, p.groups());
                    }
                    for (i, (g, s)) in got.iter().zip(&want).enumerate() {
                        assert!((g - s).abs() <= 1e-4 * (1.0 + s.abs()), "{ty:?} {rows}x{cols}x{toks} scalar={scalar} at {i}: {g} vs {s}");
                    }
                }
            }
        }
    }

    /// The quantized dot products agree with a plain f32 dot of the dequantized weights, within
    /// the error of quantizing the activations.
    #[test]
    fn quantized_dots_match_dequantized_f32() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K] {
            let (rows, cols) = (6, 512);
            let data = random_weights(ty, rows, cols, &mut rng);
            let w = WeightView { ty, rows, cols, data: &data };
            let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let mut a = Acts::default();
            a.prepare(&x, 1, cols, &[w.act_kind()], &ThreadPool::new(1));
            let mut got = vec![0.0; rows];
            matmul_rows(&w, &a, OutPtr::new(&mut got), rows, 0, rows);
            for (r, &got) in got.iter().enumerate() {
                let mut deq = vec![0.0; cols];
                quant::dequantize_row(ty, w.row(r), &mut deq);
                let exact: f32 = deq.iter().zip(&x).map(|(p, q)| p * q).sum();
                let scale: f32 = deq.iter().zip(&x).map(|(p, q)| (p * q).abs()).sum();
                assert!((got - exact).abs() <= 0.02 * scale + 1e-4, "{ty:?} row {r}: {got} vs {exact} (scale {scale})");
            }
        }
    }

    #[test]
    fn chunk_scores_and_values_match_the_reference() {
        use crate::kv::{self, KvFormat, KvGeometry};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let g = KvGeometry { n_layers: 1, n_kv_heads: 1, head_dim: 64, chunk_tokens: 16 };
        let vals: Vec<f32> = (0..16 * 64).map(|_| rng.gen_range(-2.0..2.0)).collect();
        let q: Vec<f32> = (0..3 * 64).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let visible = [16, 0, 5];
        let (mut a, mut b) = (vec![-9.0; 3 * 40], vec![-9.0; 3 * 40]);
        chunk_scores(&q, 64, KvRows::F32(&vals), &visible, 0.125, &mut a, 40, 16);
        for (i, &vis) in visible.iter().enumerate() {
            for t in 0..vis {
                b[i * 40 + 16 + t] = vals[t * 64..(t + 1) * 64].iter().zip(&q[i * 64..]).map(|(x, y)| x * y).sum::<f32>() * 0.125;
            }
        }
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
        // Reading f16/int8 blocks directly equals reading their decoded rows.
        for f in [KvFormat::F16, KvFormat::Int8] {
            let mut blk = vec![0u8; g.head_block_bytes(f)];
            for t in 0..16 {
                kv::write_token(f, &mut blk, t, 16, &vals[t * 64..(t + 1) * 64]);
            }
            let mut dec = vec![0.0; 16 * 64];
            kv::read_block_f32(f, &blk, 16, 64, 16, &mut dec);
            let raw = if f == KvFormat::F16 { KvRows::F16(&blk) } else { KvRows::Int8 { blk: &blk, t_cap: 16 } };
            let (mut x, mut y) = (vec![0.0; 3 * 40], vec![0.0; 3 * 40]);
            chunk_scores(&q, 64, raw, &visible, 0.125, &mut x, 40, 16);
            chunk_scores(&q, 64, KvRows::F32(&dec), &visible, 0.125, &mut y, 40, 16);
            assert_eq!(x, y, "{f:?} scores");
            let (mut ox, mut oy) = (vec![0.0; 3 * 64], vec![0.0; 3 * 64]);
            chunk_values(&x, 40, 16, raw, &visible, 64, &mut ox);
            chunk_values(&x, 40, 16, KvRows::F32(&dec), &visible, 64, &mut oy);
            assert_eq!(ox, oy, "{f:?} values");
        }
    }

    #[test]
    fn vector_softmax_matches_scalar() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
        for n in [1, 7, 8, 33, 300] {
            let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-30.0..10.0)).collect();
            let mut fast = x.clone();
            softmax_f16(&mut fast);
            let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let sum: f64 = x.iter().map(|&v| f64::from((v - max).exp())).sum();
            for (i, (&f, &v)) in fast.iter().zip(&x).enumerate() {
                let want = (f64::from((v - max).exp()) / sum) as f32;
                assert!((f - want).abs() <= 1e-3 * want + 1e-7, "n={n} i={i}: {f} vs {want}");
            }
            assert!((fast.iter().sum::<f32>() - 1.0).abs() < 1e-2);
        }
    }
}

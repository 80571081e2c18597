//! Matrix kernels: weight rows (any supported type) times activation rows.
//!
//! One entry point, [`matmul_rows`], computes `out[t * ldo + r] = W[r] · a[t]` for a range of
//! weight rows and every activation row. It walks the rows in tiles of several weight rows by
//! several tokens so that each weight block is unpacked once and reused across tokens (prefill
//! is a real GEMM) and each activation block is reused across rows. The AVX2 tiles are chosen
//! at run time; every one has a scalar reference in `quant` and a test comparing the two.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use half::f16;

pub use crate::pool::OutPtr;
use crate::pool::ThreadPool;
use crate::quant::{self, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0, GgmlType, Q8Acts, Q8KActs};
use crate::repack::{Packed, PackedWeight, ROWS};
pub use crate::simd::{has_avx2, simd_name};

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
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => ActKind::Q8,
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => ActKind::Q8K,
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
            self.q8k.quantize(x, rows, cols, pool);
        }
        if kinds.contains(&ActKind::F32) {
            self.f32.clear();
            self.f32.extend_from_slice(&x[..rows * cols]);
        }
    }
}

/// Computes `out[t * ldo + r] = W[r] · a[t]` for `r` in `r0..r1` and every activation row `t`.
///
/// Threads may call this concurrently on the same `out` with disjoint row ranges.
pub fn matmul_rows(w: &WeightView, a: &Acts, out: OutPtr, ldo: usize, r0: usize, r1: usize) {
    debug_assert_eq!(a.cols, w.cols);
    debug_assert!(r1 <= w.rows);
    // Quantized types are repacked at load and go through `matmul_packed` (here they run the
    // scalar reference); float weights have row kernels taking 4 tokens a
    // pass (weights converted once for the 4).
    match w.ty {
        #[cfg(target_arch = "x86_64")]
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 if has_avx2() => {
            let (ty, cols, x) = (w.ty, w.cols, &a.f32[..]);
            // SAFETY: has_avx2 checked AVX2/FMA/F16C; every row holds `cols` elements of `ty`
            // and `float_rows` asks only for tokens inside `x`.
            return float_rows::<3>(
                w,
                a.rows,
                out,
                ldo,
                r0,
                r1,
                |rows, t| unsafe { avx2::dot_float_rx4::<3>(ty, rows, x, cols, t) },
                |row, t| unsafe { avx2::dot_float_rx4::<1>(ty, [row], x, cols, t)[0] },
                |row, t| unsafe { avx2::dot_float(ty, row, x, cols, t) },
            );
        }
        #[cfg(target_arch = "aarch64")]
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 if crate::simd::has_neon() => {
            let (ty, cols, x) = (w.ty, w.cols, &a.f32[..]);
            // SAFETY: NEON is in use; every row holds `cols` elements of `ty` and `float_rows`
            // asks only for tokens inside `x`.
            return float_rows::<2>(
                w,
                a.rows,
                out,
                ldo,
                r0,
                r1,
                |rows, t| unsafe { neon::dot_float::<2, 4>(ty, rows, x, cols, t) },
                |row, t| unsafe { neon::dot_float::<1, 4>(ty, [row], x, cols, t)[0] },
                |row, t| unsafe { neon::dot_float::<1, 1>(ty, [row], x, cols, t)[0][0] },
            );
        }
        _ => {}
    }
    matmul_rows_ref(w, a, out, ldo, r0, r1, a.rows);
}

/// Tokens per tile of the float row kernels (a multiple of their 4 tokens a pass): 64 tokens
/// of a 576-wide row are 144 KiB of f32 activations (in L2), where all 512 of a pp512 are
/// ~1 MiB. Measured on the F16 requantization's pp512: tiles of 16 and 64 gave
/// 454 and 451 tok/s one after the other; with the earlier one-row kernel, tiles of 32 against
/// none moved nothing beyond noise (290 vs 282-300). Kept for the cache footprint, not a
/// measured gain.
const TOKEN_TILE: usize = 64;

/// Element `i` of a float weight row (F32/F16/BF16), exactly as `quant::dequantize_row` gives
/// it: the vector kernels' tails.
#[allow(dead_code)]
fn float_elem(ty: GgmlType, row: &[u8], i: usize) -> f32 {
    match ty {
        GgmlType::F32 => f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]]),
        GgmlType::F16 => f16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32(),
        _ => f32::from_bits(u32::from(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])) << 16),
    }
}

/// Float weights (F32/F16/BF16): rows in blocks of `R` against tokens in fours (`block`:
/// `R` x 4 sums a pass, `R` = 3 on AVX2's 16 registers, 2 on NEON), in tiles of
/// [`TOKEN_TILE`] tokens, every row over one tile before the next (a tile's activations stay
/// in cache while the rows stream past: all 512 tokens of f32 activations are ~1 MiB, which
/// every row would otherwise stream again); the rows left over (a thread's share of rows comes
/// in eights, not in multiples of `R`) a row against four tokens (`row4`: four chains, where one chain per
/// row and token waited on each multiply-add's latency — a tenth of an F16 prefill), the
/// tokens left over one at a time (`one`). Every output is [`dot_lanes`]'s, as the
/// reference computes it.
#[allow(clippy::too_many_arguments, dead_code)]
fn float_rows<const R: usize>(
    w: &WeightView,
    n_tok: usize,
    out: OutPtr,
    ldo: usize,
    r0: usize,
    r1: usize,
    block: impl Fn([&[u8]; R], usize) -> [[f32; 4]; R],
    row4: impl Fn(&[u8], usize) -> [f32; 4],
    one: impl Fn(&[u8], usize) -> f32,
) {
    for t0 in (0..n_tok).step_by(TOKEN_TILE) {
        let t1 = (t0 + TOKEN_TILE).min(n_tok);
        let mut r = r0;
        while r + R <= r1 {
            let rows: [&[u8]; R] = std::array::from_fn(|i| w.row(r + i));
            let mut t = t0;
            while t + 4 <= t1 {
                for (i, vi) in block(rows, t).iter().enumerate() {
                    for (j, &y) in vi.iter().enumerate() {
                        out.write((t + j) * ldo + r + i, y);
                    }
                }
                t += 4;
            }
            for t in t..t1 {
                for (i, row) in rows.iter().enumerate() {
                    out.write(t * ldo + r + i, one(row, t));
                }
            }
            r += R;
        }
        for r in r..r1 {
            let row = w.row(r);
            let mut t = t0;
            while t + 4 <= t1 {
                for (j, &y) in row4(row, t).iter().enumerate() {
                    out.write((t + j) * ldo + r, y);
                }
                t += 4;
            }
            for t in t..t1 {
                out.write(t * ldo + r, one(row, t));
            }
        }
    }
}

/// Computes `out[t * ldo + r] = W[r] · a[t]` for the rows of packed groups `g0..g1` (rows past
/// the matrix in the last group are not written), against the activations the format takes
/// (Q8; Q8_K for the K-quants). Threads may run disjoint group ranges at once.
pub fn matmul_packed(w: &PackedWeight, a: &Acts, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
    let k = w.is_k_quant();
    assert_eq!(w.blocks_per_row(), if k { a.q8k.nb } else { a.q8.nb }, "activation width does not match the weight");
    // One choice of kernel set for both families: `$q8` takes Q8 activations, `$k` Q8_K ones.
    macro_rules! run {
        ($q8:path, $k:path) => {{
            if k {
                $k(w, &a.q8k, out, ldo, g0, g1)
            } else {
                $q8(w, &a.q8, out, ldo, g0, g1)
            }
            return;
        }};
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_vnni() {
        // SAFETY: the CPU has AVX2, FMA, F16C, AVX512-VNNI, -VL and -BW (checked at run time).
        unsafe { run!(avx2::matmul_packed_vnni, avx2::matmul_packed_k_vnni) }
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked at run time).
        unsafe { run!(avx2::matmul_packed, avx2::matmul_packed_k) }
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_dotprod() {
        // SAFETY: the CPU has NEON and the dot-product extension (checked at run time).
        unsafe { run!(neon::matmul_packed_sdot, neon::matmul_packed_k_sdot) }
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() {
        // SAFETY: NEON is in use (checked at run time).
        unsafe { run!(neon::matmul_packed, neon::matmul_packed_k) }
    }
    run!(matmul_packed_ref, matmul_packed_k_ref)
}

/// Scalar reference for [`matmul_packed`], reading the packed layout directly. It does the
/// vector kernels' float operations in their order (per block: the integer sum times
/// `d * d_x` fused into the row's sum, then `m * s_x` fused), so every kernel — scalar, AVX2,
/// VNNI, NEON — gives the same bits, and a model runs to the same logits on any of them.
pub fn matmul_packed_ref(w: &PackedWeight, a: &Q8Acts, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
    let nb = w.blocks_per_row();
    each_packed_output(w, a.rows, out, ldo, g0, g1, |g, lane, t| {
        let mut sum = 0.0f32;
        for b in 0..nb {
            let k8 = t * nb + b;
            let xq = &a.qs[k8];
            let (s, d, m) = match &w.data {
                Packed::Q4(v) => {
                    let blk = &v[g * nb + b];
                    (q4_lane_sum(&blk.qs, lane, xq), blk.d[lane], Some(blk.m[lane]))
                }
                Packed::Q4S(v) => {
                    let blk = &v[g * nb + b];
                    (q4_lane_sum(&blk.qs, lane, xq) - 8 * a.isum[k8], blk.d[lane], None)
                }
                Packed::Q8(v) => {
                    let blk = &v[g * nb + b];
                    (q8_lane_sum(&blk.qs, lane, xq), blk.d[lane], None)
                }
                Packed::Q5(v) => {
                    let blk = &v[g * nb + b];
                    (q5_lane_sum(&blk.qh, &blk.qs, lane, xq, 16), blk.d[lane], None)
                }
                Packed::Q5M(v) => {
                    let blk = &v[g * nb + b];
                    (q5_lane_sum(&blk.qh, &blk.qs, lane, xq, 0), blk.d[lane], Some(blk.m[lane]))
                }
                Packed::Q4K(_) | Packed::Q5K(_) | Packed::Q6K(_) => {
                    unreachable!("K-quant groups take Q8_K activations (matmul_packed_k_ref)")
                }
            };
            sum = (s as f32).mul_add(d.to_f32() * a.d[k8], sum);
            if let Some(m) = m {
                sum = m.to_f32().mul_add(a.s[k8], sum);
            }
        }
        sum
    });
}

/// Writes `dot(group, lane, token)` for every row of groups `g0..g1` (the last group may be
/// partial) and each of `n_tok` tokens: the scalar references' walk of the packed layout.
fn each_packed_output(
    w: &PackedWeight,
    n_tok: usize,
    out: OutPtr,
    ldo: usize,
    g0: usize,
    g1: usize,
    dot: impl Fn(usize, usize, usize) -> f32,
) {
    for g in g0..g1 {
        for lane in (0..ROWS).take_while(|lane| g * ROWS + lane < w.rows) {
            for t in 0..n_tok {
                out.write(t * ldo + g * ROWS + lane, dot(g, lane, t));
            }
        }
    }
}

/// One row's integer sum `sum q x` in an 8-row block of 4-bit codes (0..16).
fn q4_lane_sum(qs: &[u8; 4 * 32], lane: usize, xq: &[i8; 32]) -> i32 {
    let mut s = 0i32;
    for k in 0..4 {
        for j in 0..4 {
            let q = qs[32 * k + 4 * lane + j];
            s += i32::from(q & 0xF) * i32::from(xq[4 * k + j]) + i32::from(q >> 4) * i32::from(xq[16 + 4 * k + j]);
        }
    }
    s
}

/// One row's integer sum in an 8-row block of byte codes (4 bytes of each row in turn).
fn q8_lane_sum(qs: &[i8; 8 * 32], lane: usize, xq: &[i8; 32]) -> i32 {
    let mut s = 0i32;
    for k in 0..8 {
        for j in 0..4 {
            s += i32::from(qs[32 * k + 4 * lane + j]) * i32::from(xq[4 * k + j]);
        }
    }
    s
}

/// Scalar reference for [`matmul_packed`] over the K-quants, reading the packed layout: per
/// row and block the integer sums of [`quant::dot_k4_ref`] / [`quant::dot_q6k_ref`] and their
/// float operations, so the packed kernels give the row-major references' bits.
pub fn matmul_packed_k_ref(w: &PackedWeight, a: &Q8KActs, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
    let nb = w.blocks_per_row();
    each_packed_output(w, a.rows, out, ldo, g0, g1, |g, lane, t| {
        let mut sum = 0.0f32;
        for b in 0..nb {
            let k = t * nb + b;
            if let Packed::Q6K(v) = &w.data {
                // As `quant::dot_q6k_ref`: per 16-value sub-block the sum of
                // `(q - 32) x`, times its scale; then `d d_x` times the integer.
                let x = &v[g * nb + b];
                let mut sumi = 0i32;
                for s in 0..16 {
                    let sub: i32 =
                        (16 * s..16 * (s + 1)).map(|c| (i32::from(crate::repack::q6k_code(x, lane, c)) - 32) * i32::from(a.qs[k][c])).sum();
                    sumi += i32::from(x.scales[8 * s + lane]) * sub;
                }
                sum += x.d[lane].to_f32() * a.d[k] * sumi as f32;
                continue;
            }
            let (d, dmin, scales, mins, q, stride) = match &w.data {
                Packed::Q4K(v) => {
                    let x = &v[g * nb + b];
                    (x.d[lane], x.dmin[lane], &x.scales, &x.mins, &x.qs[..], 128)
                }
                Packed::Q5K(v) => {
                    let x = &v[g * nb + b];
                    (x.d[lane], x.dmin[lane], &x.scales, &x.mins, &x.q[..], 160)
                }
                _ => unreachable!("32-column groups take Q8 activations (matmul_packed)"),
            };
            let (mut sumi, mut sumi_mins) = (0i32, 0i32);
            for j in 0..8 {
                let sub_qs: &[u8; 128] = q[stride * j..stride * j + 128].try_into().expect("128 bytes");
                let sub_qh: [u8; 32] =
                    if stride > 128 { q[stride * j + 128..stride * j + 160].try_into().expect("32 bytes") } else { [0; 32] };
                let xq: &[i8; 32] = a.qs[k][32 * j..32 * (j + 1)].try_into().expect("32 bytes");
                sumi += i32::from(scales[8 * j + lane]) * q5_lane_sum(&sub_qh, sub_qs, lane, xq, 0);
                let m = mins[16 * (j / 2) + 2 * lane + j % 2];
                sumi_mins += i32::from(m) * (i32::from(a.bsums[k][2 * j]) + i32::from(a.bsums[k][2 * j + 1]));
            }
            sum += a.d[k] * (d.to_f32() * sumi as f32 - dmin.to_f32() * sumi_mins as f32);
        }
        sum
    });
}

/// One row's integer sum `sum (q - offset) x` in a packed Q5 block.
fn q5_lane_sum(qh: &[u8; 32], qs: &[u8; 128], lane: usize, xq: &[i8; 32], offset: i32) -> i32 {
    (0..32).map(|c| (i32::from(crate::repack::q5_code(qh, qs, lane, c)) - offset) * i32::from(xq[c])).sum()
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
                GgmlType::Q5_0 => quant::dot_q5_0_ref(quant::blocks::<BlockQ5_0>(row), &a.q8, t),
                GgmlType::Q5_1 => quant::dot_q5_1_ref(quant::blocks::<BlockQ5_1>(row), &a.q8, t),
                GgmlType::Q8_0 => quant::dot_q8_0_ref(quant::blocks::<BlockQ8_0>(row), &a.q8, t),
                GgmlType::Q4K => quant::dot_k4_ref(quant::blocks::<BlockQ4K>(row), &a.q8k, t),
                GgmlType::Q5K => quant::dot_k4_ref(quant::blocks::<BlockQ5K>(row), &a.q8k, t),
                GgmlType::Q6K => quant::dot_q6k_ref(quant::blocks::<BlockQ6K>(row), &a.q8k, t),
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                    if t == 0 {
                        tmp.resize(w.cols, 0.0);
                        quant::dequantize_row(w.ty, row, &mut tmp);
                    }
                    dot_lanes(&tmp, &a.f32[t * w.cols..(t + 1) * w.cols])
                }
            };
            out.write(t * ldo + r, v);
        }
    }
}

/// K or V rows of one chunk's head block, as attention reads them: the base formats and the
/// split levels directly from the chunk's bytes (no decode pass), anything else decoded first.
#[derive(Debug, Clone, Copy)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    F16(&'a [u8]),
    /// An int8 head block: `t_cap` f16 scales, then the codes.
    Int8 {
        blk: &'a [u8],
        t_cap: usize,
    },
    /// Channel-wise codes (a split level's K, `kv::split_k_params`): channel `c` of a row is
    /// `(code - zero[c]) * step[c]`, codes `bits` (2-4) wide, low bits first, `[token][hd]`,
    /// plus the corrections of the block's outliers (`kv::k_outlier_at`).
    Channel {
        codes: &'a [u8],
        bits: usize,
        zero: &'a [f32],
        step: &'a [f32],
        outliers: &'a [u8],
    },
    /// Token-wise codebook codes (a split level's V, `kv::split_v_params`,
    /// `kv::split_v_levels`): channel `c` of row `t` is `scales[t] * levels[code]`, codes as in
    /// `Channel`. These are rotated rows: the caller rotates what it accumulates back.
    Token {
        codes: &'a [u8],
        scales: &'a [f32],
        bits: usize,
        levels: &'a [f32],
    },
}

/// Codes `i..i + out.len()` of a `bits`-wide packed array, as floats.
fn codes_f32(data: &[u8], i: usize, bits: usize, out: &mut [f32]) {
    for (k, o) in out.iter_mut().enumerate() {
        *o = f32::from(crate::kv::get_code(data, i + k, bits));
    }
}

impl KvRows<'_> {
    /// Row `t` as f32 (reference path), without a channel-wise block's outliers (added apart,
    /// after the rows: [`add_outlier_scores`], [`add_outlier_values`]).
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
            KvRows::Channel { codes, bits, zero, step, .. } => {
                codes_f32(codes, t * hd, bits, &mut out[..hd]);
                for ((o, &z), &st) in out[..hd].iter_mut().zip(zero).zip(step) {
                    *o = (*o - z) * st;
                }
            }
            KvRows::Token { codes, scales, bits, levels } => {
                let s = scales[t];
                codes_f32(codes, t * hd, bits, &mut out[..hd]);
                for o in &mut out[..hd] {
                    *o = s * levels[*o as usize];
                }
            }
        }
    }
    /// Whether `n` rows of `hd` fit (and a codebook holds every code).
    fn holds(&self, n: usize, hd: usize) -> bool {
        match *self {
            KvRows::F32(v) => v.len() >= n * hd,
            KvRows::F16(b) => b.len() >= n * hd * 2,
            KvRows::Int8 { blk, t_cap } => n <= t_cap && blk.len() >= t_cap * 2 + n * hd,
            KvRows::Channel { codes, bits, zero, step, outliers } => {
                (2..=4).contains(&bits)
                    && codes.len() * 8 >= n * hd * bits
                    && zero.len() >= hd
                    && step.len() >= hd
                    && outliers.len().is_multiple_of(crate::kv::OUTLIER_BYTES)
            }
            KvRows::Token { codes, scales, bits, levels } => {
                (2..=4).contains(&bits) && n <= scales.len() && codes.len() * 8 >= n * hd * bits && levels.len() >= 1 << bits
            }
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
    if has_avx2() && hd.is_multiple_of(8) && hd <= 256 {
        // SAFETY: features checked; every index used is bounded by the asserts above.
        unsafe { avx2::chunk_scores(q, hd, k, visible, scale, scores, ld, col0) };
        add_outlier_scores(q, hd, k, visible, scale, scores, ld, col0);
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() && hd.is_multiple_of(8) && hd <= 256 {
        // SAFETY: NEON in use; every index used is bounded by the asserts above.
        unsafe { neon::chunk_scores(q, hd, k, visible, scale, scores, ld, col0) };
        add_outlier_scores(q, hd, k, visible, scale, scores, ld, col0);
        return;
    }
    chunk_scores_ref(q, hd, k, visible, scale, scores, ld, col0);
}

/// A channel-wise block's outliers as (token, channel, correction), unused entries left out.
/// Their corrections are added in scalar code after every kernel set alike, so AVX2, NEON and
/// the reference keep one another's bits (a block has a few: 8 in a 16-token chunk of
/// 64-channel heads).
fn outliers<'a>(k: &KvRows<'a>, hd: usize) -> impl Iterator<Item = (usize, usize, f32)> + 'a {
    let bytes: &[u8] = if let KvRows::Channel { outliers, .. } = *k { outliers } else { &[] };
    (0..bytes.len() / crate::kv::OUTLIER_BYTES)
        .map(move |i| crate::kv::k_outlier_at(bytes, i))
        .filter(|&(_, corr)| corr != 0.0)
        .map(move |(pos, corr)| (pos / hd, pos % hd, corr))
}

/// Adds `q_c x corr x scale` to the score of each outlier's token `t` (for the queries that see it).
#[allow(clippy::too_many_arguments)]
fn add_outlier_scores(q: &[f32], hd: usize, k: KvRows, visible: &[usize], scale: f32, scores: &mut [f32], ld: usize, col0: usize) {
    for (t, c, corr) in outliers(&k, hd) {
        for (j, &vis) in visible.iter().enumerate() {
            if t < vis {
                scores[j * ld + col0 + t] += q[j * hd + c] * corr * scale;
            }
        }
    }
}

/// Adds `p_t x corr` to output channel `c` of each query that sees the outlier's token `t`.
fn add_outlier_values(probs: &[f32], ld: usize, col0: usize, v: KvRows, visible: &[usize], hd: usize, out: &mut [f32]) {
    for (t, c, corr) in outliers(&v, hd) {
        for (j, &vis) in visible.iter().enumerate() {
            if t < vis {
                out[j * hd + c] = probs[j * ld + col0 + t].mul_add(corr, out[j * hd + c]);
            }
        }
    }
}

/// The scalar reference for [`chunk_scores`] (the same bits: see [`dot_lanes`]).
///
/// Channel-wise rows are not dequantized: each query is scaled by the channels' steps once
/// (`q'_c = q_c * step_c`), and a score is `(q' . code - q' . zero) * scale`, so a row costs
/// an unpack and a multiply-add per channel, as an int8 row does.
#[allow(clippy::too_many_arguments)]
pub fn chunk_scores_ref(q: &[f32], hd: usize, k: KvRows, visible: &[usize], scale: f32, scores: &mut [f32], ld: usize, col0: usize) {
    let n = visible.iter().copied().max().unwrap_or(0);
    let mut row = vec![0.0f32; hd];
    if let KvRows::Channel { codes, bits, zero, step, .. } = k {
        let mut scaled = vec![0.0f32; hd];
        for (i, &vis) in visible.iter().enumerate() {
            for ((s, &x), &st) in scaled.iter_mut().zip(&q[i * hd..(i + 1) * hd]).zip(step) {
                *s = x * st;
            }
            let offset = dot_lanes(&scaled, &zero[..hd]);
            for t in 0..vis {
                codes_f32(codes, t * hd, bits, &mut row);
                scores[i * ld + col0 + t] = (dot_lanes(&row, &scaled) - offset) * scale;
            }
        }
        add_outlier_scores(q, hd, k, visible, scale, scores, ld, col0);
        return;
    }
    for t in 0..n {
        k.row(t, hd, &mut row);
        for (i, &vis) in visible.iter().enumerate() {
            if t < vis {
                scores[i * ld + col0 + t] = dot_lanes(&row, &q[i * hd..(i + 1) * hd]) * scale;
            }
        }
    }
}

/// Asks the CPU to bring `bytes`' cache lines into L2 (a hint: nothing is read, and an
/// address that is not mapped or not resident is dropped, never faulted in). Its callers ask
/// for K/V blocks a few KiB at a time, 2 chunks ahead of the attention kernels and a layer's
/// K/V rows before its products: into L1 (`_MM_HINT_T0`) each line held one of the core's few
/// L1 fill buffers until it arrived, and a block's 32 asks stalled on them (`perf`: the
/// `prefetcht0`s 13.8% of an 8-context step's samples, more than the attention kernels).
/// Into L2 a step of 8 contexts 200 deep is ~1.5% shorter and one context's unchanged: with
/// steps in ABBA order in one process (200 steps, medians of paired ratios, 3 runs), L1 took
/// 1.011-1.016x and 0.994-1.000x the time, where the same patch with both settings equal gave
/// 0.993-1.000x (Intel Xeon guest; hand runs, docs/notes/engine.md, which also has the first,
/// off-on measurement and its bias). The kernels' first touch of a line then hits L2.
#[inline]
pub fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        // Every line the bytes touch: from the line of the first (a range that starts inside
        // a line and runs into the next, as an int8 K/V row does, needs both).
        let skip = bytes.as_ptr() as usize % 64;
        for off in (0..bytes.len() + skip).step_by(64) {
            // SAFETY: a prefetch reads nothing and never faults; the address is within the
            // line of `bytes`' first byte or inside `bytes`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(bytes.as_ptr().wrapping_sub(skip).wrapping_add(off).cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// The wrapping sum of `words`, read front to back asking for each cache line `ahead` bytes
/// before it is read (into L1) and again [`ahead::BEYOND`] further (into L2), as the packed
/// tiles of the legacy types ask for their weights (`prefetch_ahead`), or with `l2_first`
/// into L2 at `ahead` and into L1 [`ahead::BEYOND`] behind it, as the K-quant tiles do
/// (`prefetch_ahead_part`); `ahead` 0 asks for nothing. For the memory
/// floor of `llms bench --floor`: the floor's read takes the best of these and of a plain
/// read, since at a slow hour of this shared host's memory the tiles' own asks outran a plain
/// streaming read (a 1.7B Q4_K_M decode at 1.09-1.14 of a "floor" of 18.9 GB/s, 6 Dec 2026):
/// a floor the kernels beat is not one.
pub fn stream_sum(words: &[u64], ahead: usize, l2_first: bool) -> u64 {
    let mut acc = [0u64; 4];
    for line in words.chunks(8) {
        #[cfg(target_arch = "x86_64")]
        if ahead > 0 {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
            let at = line.as_ptr().cast::<i8>().wrapping_add(ahead);
            let (l1, l2) = if l2_first { (at.wrapping_sub(ahead::BEYOND), at) } else { (at, at.wrapping_add(ahead::BEYOND)) };
            // SAFETY: a prefetch reads nothing and never faults, wherever it points.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(l1);
                _mm_prefetch::<_MM_HINT_T1>(l2);
            }
        }
        // Four sums, so the loads do not wait behind one chain of additions.
        for (i, &w) in line.iter().enumerate() {
            acc[i % 4] = acc[i % 4].wrapping_add(w);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (ahead, l2_first);
    acc.iter().fold(0, |a, &b| a.wrapping_add(b))
}

/// [`stream_sum`] with one 64-byte vector load a cache line (two 32-byte ones without 512-bit
/// vectors), as the kernels read their weights. Eight word loads a line hold eight of the
/// core's load-queue entries where a vector load holds one, so fewer lines are in flight: on
/// the AMD EPYC (Zen 5) guest of 6 Dec 2026 the word reads' best was ~35 GB/s while decode
/// read 56-61 GB/s of its weights (`tools/bench/sizes`, 1.7B and 7B: "1.6-1.8x the floor",
/// llama.cpp's decode too above it).
#[cfg(target_arch = "x86_64")]
fn stream_sum_wide(words: &[u64], ahead: usize) -> u64 {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
    let lines = words.len() / 8;
    let ask = |p: *const u64| {
        if ahead > 0 {
            let at = p.cast::<i8>().wrapping_add(ahead);
            // SAFETY: a prefetch reads nothing and never faults, wherever it points.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(at);
                _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(ahead::BEYOND));
            }
        }
    };
    let sum = if crate::simd::has_zmm() {
        // SAFETY: AVX-512F checked; every line read lies in `words`.
        unsafe { avx2::wide_zmm(words.as_ptr(), lines, &ask) }
    } else if has_avx2() {
        // SAFETY: AVX2 checked; as above.
        unsafe { avx2::wide_ymm(words.as_ptr(), lines, &ask) }
    } else {
        return stream_sum(words, ahead, false);
    };
    words[lines * 8..].iter().fold(sum, |a, &w| a.wrapping_add(w))
}

/// Streaming-read bandwidth of `words` by `pool`'s threads, bytes/s: the best of `passes`
/// whole reads in each of several ways, so that the memory floor (`llms bench --floor`, the
/// `matvec_rate` example's "read") comes as near as we know how to the best read this machine
/// gives at the hour (decode still reads faster at some slow hours: docs/notes/engine.md, "A
/// floor the kernels beat"): 1 MiB pieces dealt to the threads as they come, read
/// plainly (until 6 Dec 2026 the only way); and each thread reading its own run front to back
/// as decode's products do (`for_runs`), a word at a time asking for the lines ahead at several
/// distances or at none ([`stream_sum`]), or a vector load a line (`stream_sum_wide`, since
/// the evening of 6 Dec 2026). At a slow hour of this shared host (6 Dec 2026, 1.7B Q4_K_M, each
/// way's best of 12 reads) the plain read gave 9.9 GB/s, the runs without asks 9.9, and with
/// asks at 2-16 KiB 18.5-20.1, while the decode itself read ~18: against the plain read alone
/// it ran at "1.8x the floor".
pub fn floor_read(pool: &ThreadPool, words: &[u64], passes: usize) -> f64 {
    const PIECE: usize = (1 << 20) / 8;
    /// How a thread reads: 1 MiB pieces dealt as they come, read plainly; its own run front
    /// to back a word at a time, asking `ahead` bytes on (0: no asks) in either order of
    /// [`stream_sum`]; or its run a vector a line ([`stream_sum_wide`]).
    #[derive(Clone, Copy)]
    enum Way {
        Dealt,
        Words { ahead: usize, l2_first: bool },
        Wide { ahead: usize },
    }
    const WAYS: [Way; 11] = [
        Way::Dealt,
        Way::Words { ahead: 0, l2_first: false },
        Way::Words { ahead: 2048, l2_first: false },
        Way::Words { ahead: 4096, l2_first: false },
        Way::Words { ahead: 8192, l2_first: false },
        Way::Words { ahead: 4096, l2_first: true },
        Way::Words { ahead: 8192, l2_first: true },
        Way::Words { ahead: 16384, l2_first: true },
        Way::Wide { ahead: 0 },
        Way::Wide { ahead: 2048 },
        Way::Wide { ahead: 8192 },
    ];
    let sink = std::sync::atomic::AtomicU64::new(0);
    let mut best = 0.0f64;
    for _ in 0..passes {
        for way in WAYS {
            let read = |a: usize, b: usize| {
                let w = &words[a..b];
                let sum = match way {
                    Way::Dealt => stream_sum(w, 0, false),
                    Way::Words { ahead, l2_first } => stream_sum(w, ahead, l2_first),
                    #[cfg(target_arch = "x86_64")]
                    Way::Wide { ahead } => stream_sum_wide(w, ahead),
                    #[cfg(not(target_arch = "x86_64"))]
                    Way::Wide { ahead } => stream_sum(w, ahead, false),
                };
                sink.fetch_add(sum, std::sync::atomic::Ordering::Relaxed);
            };
            let t = std::time::Instant::now();
            match way {
                Way::Dealt => pool.for_chunks("read-floor", words.len(), PIECE, &read),
                _ => pool.for_runs("read-floor", words.len(), PIECE, &read),
            }
            #[allow(clippy::cast_precision_loss)]
            let bw = (words.len() * 8) as f64 / t.elapsed().as_secs_f64();
            best = best.max(bw);
        }
    }
    std::hint::black_box(sink.load(std::sync::atomic::Ordering::Relaxed));
    best
}

/// A dot product as the vector kernels take it: element `j` fused into lane `j % 8`, then the
/// lanes added as a tree (`(l0 + l4) + (l2 + l6)` plus `(l1 + l5) + (l3 + l7)`), so the
/// scalar path gives the AVX2 and NEON kernels' bits.
#[inline]
pub fn dot_lanes(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (xc, yc) in x.chunks(8).zip(y.chunks(8)) {
        for ((a, &p), &q) in acc.iter_mut().zip(xc).zip(yc) {
            *a = p.mul_add(q, *a);
        }
    }
    let s: [f32; 4] = std::array::from_fn(|l| acc[l] + acc[l + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
}

/// Attention output of a tile of queries from one chunk's V rows:
/// `out_i += sum_t probs[i * ld + col0 + t] * v_t` for `t < visible[i]`.
pub fn chunk_values(probs: &[f32], ld: usize, col0: usize, v: KvRows, visible: &[usize], hd: usize, out: &mut [f32]) {
    let n = visible.iter().copied().max().unwrap_or(0);
    assert!(v.holds(n, hd) && out.len() >= visible.len() * hd, "attention rows out of range");
    assert!(visible.iter().enumerate().all(|(i, &vis)| vis == 0 || i * ld + col0 + vis <= probs.len()));
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && hd.is_multiple_of(8) && hd <= 256 {
        // SAFETY: features checked; indices bounded by the asserts above.
        unsafe { avx2::chunk_values(probs, ld, col0, v, visible, hd, out) };
        add_outlier_values(probs, ld, col0, v, visible, hd, out);
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() && hd.is_multiple_of(8) && hd <= 256 {
        // SAFETY: NEON in use; indices bounded by the asserts above.
        unsafe { neon::chunk_values(probs, ld, col0, v, visible, hd, out) };
        add_outlier_values(probs, ld, col0, v, visible, hd, out);
        return;
    }
    chunk_values_ref(probs, ld, col0, v, visible, hd, out);
}

/// The scalar reference for [`chunk_values`] (the same bits: each element fused).
pub fn chunk_values_ref(probs: &[f32], ld: usize, col0: usize, v: KvRows, visible: &[usize], hd: usize, out: &mut [f32]) {
    let n = visible.iter().copied().max().unwrap_or(0);
    let mut row = vec![0.0f32; hd];
    for t in 0..n {
        v.row(t, hd, &mut row);
        for (i, &vis) in visible.iter().enumerate() {
            if t < vis {
                axpy_f32(probs[i * ld + col0 + t], &row, &mut out[i * hd..(i + 1) * hd]);
            }
        }
    }
    add_outlier_values(probs, ld, col0, v, visible, hd, out);
}

/// `out += a * x`, each element fused (as the vector kernels do).
#[inline]
fn axpy_f32(a: f32, x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = a.mul_add(v, *o);
    }
}

/// In-place softmax whose results are rounded to f16 precision (llama.cpp's f16 V·P product);
/// the sum is taken in f64 as llama.cpp does. Every path computes `e^x` with `exp_lane`'s
/// polynomial and sums eight values at a time in the same tree, so they agree bit for bit.
pub fn softmax_f16(row: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        if crate::simd::has_zmm() && row.len() >= 16 {
            // SAFETY: the CPU has AVX512F, AVX2/FMA/F16C.
            unsafe { avx2::softmax_f16_zmm(row, avx2::row_max_zmm(row)) };
            return;
        }
        // SAFETY: the CPU has AVX2/FMA/F16C.
        unsafe { avx2::softmax_f16(row, avx2::row_max(row)) };
        return;
    }
    let max = row_max_ref(row);
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() {
        // SAFETY: NEON in use.
        unsafe { neon::softmax_f16(row, max) };
        return;
    }
    softmax_f16_ref(row, max);
}

/// `out[i] = round(x[i] * inv)` clamped to ±127, NaN to 0, rounding half away from zero (libm's
/// `roundf`), as bytes: an int8 K/V row's codes ([`crate::kv::write_token`]). A prompt's rows
/// are written on the calling thread between the pool's operations, and the scalar loop was
/// ~0.4 ms of an ~11 ms pass with a 16-token piece (perf). Bit for bit
/// [`crate::kv::int8_codes_ref`]; the model hands it to the cache's writes
/// ([`crate::kvcache::ChunkedKv::write_with`]), which sit below this module.
pub fn int8_codes(x: &[f32], inv: f32, out: &mut [u8]) {
    assert_eq!(x.len(), out.len(), "int8_codes' rows");
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2; the lengths are equal (asserted).
        unsafe { avx2::int8_codes(x, inv, out) };
        return;
    }
    crate::kv::int8_codes_ref(x, inv, out);
}

/// SwiGLU's gate in place: `g = g / (1 + e^-g) * u` (SiLU of the gate times the up row). Every
/// path takes `e^-g` with `exp_lane`'s polynomial (its argument capped at 88) and
/// divides exactly, so they agree bit for bit — and across architectures, where libm's `expf`
/// need not. llama.cpp computes this gate with its own vector `exp` too (`ggml_v_silu`).
pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len(), "silu_mul's rows");
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2/FMA; the lengths are equal (asserted).
        unsafe { avx2::silu_mul(g, u) };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() {
        // SAFETY: NEON in use; the lengths are equal (asserted).
        unsafe { neon::silu_mul(g, u) };
        return;
    }
    silu_mul_ref(g, u);
}

/// The scalar reference for [`silu_mul`].
pub fn silu_mul_ref(g: &mut [f32], u: &[f32]) {
    for (gv, &uv) in g.iter_mut().zip(u) {
        *gv = *gv / (1.0 + exp_lane((-*gv).min(EXP_MAX))) * uv;
    }
}

/// The largest of `row`'s values that is not NaN (-inf when none is): softmax's kernels, for
/// any row (greedy sampling's argmax over the vocabulary).
pub fn row_max(row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        if crate::simd::has_zmm() && row.len() >= 16 {
            // SAFETY: the CPU has AVX512F.
            return unsafe { avx2::row_max_zmm(row) };
        }
        // SAFETY: the CPU has AVX2.
        return unsafe { avx2::row_max(row) };
    }
    row_max_ref(row)
}

/// The largest of `row`'s values that is not NaN (-inf when none is): a vector kernel takes
/// the same maximum in any order.
pub fn row_max_ref(row: &[f32]) -> f32 {
    row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// `src` rounded to f16 precision (to nearest, ties to even) into `dst`, as
/// `f16::from_f32(v).to_f32()` takes each value (F16C's conversion on x86-64).
pub fn round_f16(src: &[f32], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "round_f16's rows");
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has F16C; the lengths are equal (asserted).
        unsafe { avx2::round_f16(src, dst) };
        return;
    }
    round_f16_ref(src, dst);
}

/// The scalar reference for [`round_f16`].
pub fn round_f16_ref(src: &[f32], dst: &mut [f32]) {
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(v).to_f32();
    }
}

/// The scalar reference for [`softmax_f16`], given the row's maximum.
pub fn softmax_f16_ref(row: &mut [f32], max: f32) {
    let mut sum = 0.0f64;
    for part in row.chunks_mut(8) {
        let mut e = [0.0f32; 8];
        for (v, x) in e.iter_mut().zip(part.iter_mut()) {
            *x = exp_lane(*x - max);
            *v = *x;
        }
        sum += sum8(&e);
    }
    #[allow(clippy::cast_possible_truncation)]
    let inv = (1.0 / sum) as f32;
    for x in row.iter_mut() {
        *x = f16::from_f32(*x * inv).to_f32();
    }
}

/// Eight exponentials summed in f64 as the vector kernels add their lanes:
/// `((e0 + e4) + (e2 + e6)) + ((e1 + e5) + (e3 + e7))`.
#[inline]
pub(crate) fn sum8(e: &[f32; 8]) -> f64 {
    let s: [f64; 4] = std::array::from_fn(|l| f64::from(e[l]) + f64::from(e[l + 4]));
    (s[0] + s[2]) + (s[1] + s[3])
}

/// `e^x` for `x <= 88` (after the max is taken off, `x <= 0`; below -87, and NaN, give 0): Cody-Waite
/// range reduction and a degree-6 polynomial, within 2 ulp of libm. The scalar form of the
/// vector kernels' `exp`, operation for operation.
#[inline]
pub(crate) fn exp_lane(x: f32) -> f32 {
    let x = x.max(EXP_MIN);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(EXP_C[0], x);
    let r = (-n).mul_add(EXP_C[1], r);
    let mut p = EXP_P[0];
    for &c in &EXP_P[1..] {
        p = p.mul_add(r, c);
    }
    let p = p.mul_add(r * r, r + 1.0);
    #[allow(clippy::cast_possible_truncation)]
    let pow2n = f32::from_bits(((n as i32 + 127) << 23).cast_unsigned());
    if x > EXP_MIN {
        p * pow2n
    } else {
        0.0
    }
}

/// Where `exp` flushes to zero (the true value is below f32's normal range).
pub(crate) const EXP_MIN: f32 = -87.0;
/// The largest argument [`silu_mul`] gives `exp` (`e^88` is below f32's largest; past it the
/// gate is 0 to within f32's precision either way, where libm's `exp` would give infinity).
pub(crate) const EXP_MAX: f32 = 88.0;
/// ln 2 split in two for the range reduction.
pub(crate) const EXP_C: [f32; 2] = [0.693_359_4, -2.121_944_4e-4];
/// The polynomial's coefficients, highest degree first (then `r^2 p + r + 1`).
pub(crate) const EXP_P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];

/// Runs a packed kernel's tile `$tile::<[$gen,] T>(w, a, g, t, out, ldo)` over groups `g0..g1`:
/// the tokens four at a time, the rest (1-3) in one more pass over the group's weights (a
/// batch of 2 or 3 decoding contexts reads each group once, not once per token; a token's
/// arithmetic is the same in any tile). Shared by every vector kernel set.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! each_tile {
    ($tile:ident $(<$gen:ty>)?, $w:expr, $a:expr, $out:expr, $ldo:expr, $g0:expr, $g1:expr) => {{
        let n_tok = $a.rows;
        for g in $g0..$g1 {
            let mut t = 0;
            while t + 4 <= n_tok {
                $tile::<$($gen,)? 4>($w, $a, g, t, $out, $ldo);
                t += 4;
            }
            match n_tok - t {
                3 => $tile::<$($gen,)? 3>($w, $a, g, t, $out, $ldo),
                2 => $tile::<$($gen,)? 2>($w, $a, g, t, $out, $ldo),
                1 => $tile::<$($gen,)? 1>($w, $a, g, t, $out, $ldo),
                _ => {}
            }
        }
    }};
}

/// Runs `$body` with `$rows` bound to the row loader of `$k` (one instantiation per format
/// and code width): shared by the vector kernel sets, each with its own `F32Rows`, `F16Rows`,
/// `I8Rows`, `ChannelRows<B>` and `TokenRows<B>` in scope where it expands.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! with_rows {
    ($k:expr, $rows:ident => $body:expr) => {
        match $k {
            KvRows::F32(v) => {
                let $rows = &F32Rows(v.as_ptr());
                $body
            }
            KvRows::F16(b) => {
                let $rows = &F16Rows(b.as_ptr());
                $body
            }
            KvRows::Int8 { blk, t_cap } => {
                let $rows = &I8Rows(blk.as_ptr(), t_cap);
                $body
            }
            KvRows::Channel { codes, bits, zero, step, .. } => {
                let (codes, zero, step) = (codes.as_ptr(), zero.as_ptr(), step.as_ptr());
                match bits {
                    2 => {
                        let $rows = &ChannelRows::<2> { codes, zero, step };
                        $body
                    }
                    3 => {
                        let $rows = &ChannelRows::<3> { codes, zero, step };
                        $body
                    }
                    _ => {
                        let $rows = &ChannelRows::<4> { codes, zero, step };
                        $body
                    }
                }
            }
            KvRows::Token { codes, scales, bits, levels } => {
                let (codes, scales) = (codes.as_ptr(), scales.as_ptr());
                match bits {
                    2 => {
                        let $rows = &TokenRows::<2>::new(codes, scales, levels);
                        $body
                    }
                    3 => {
                        let $rows = &TokenRows::<3>::new(codes, scales, levels);
                        $body
                    }
                    _ => {
                        let $rows = &TokenRows::<4>::new(codes, scales, levels);
                        $body
                    }
                }
            }
        }
    };
}

/// A split-level K block's zero points and steps, outliers and codes, as
/// [`crate::kv::split_k_params`] gives them (the same floats), 8 channels at a time where the
/// CPU has AVX2: attention derives them for every K block it reads.
pub fn split_k_params<'a>(blk: &'a [u8], t_cap: usize, hd: usize, zero: &mut [f32], step: &mut [f32]) -> (&'a [u8], &'a [u8]) {
    let f = crate::kv::split_k_fields(blk, t_cap, hd);
    let (zero, step) = (&mut zero[..hd], &mut step[..hd]);
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(8) && crate::simd::has_avx2() {
        // SAFETY: AVX2 checked; `zeros` holds `hd` bytes, `exps` `hd / 2`, `zero` and `step`
        // `hd` floats.
        unsafe { avx2::k_params(f.reference, f.zeros, f.zero_unit, f.exps, f.table, zero, step) };
        return (f.outliers, f.codes);
    }
    crate::kv::k_params(f.reference, f.zeros, f.zero_unit, f.exps, f.table, zero, step);
    (f.outliers, f.codes)
}

pub mod ahead;
pub mod colmajor;
pub mod pairs;

/// A Q4/Q2 head block decoded into an int8 one, as [`crate::kv::decode_block_to_int8`] does it
/// (the same bytes), 32 channels at a time where the CPU has AVX2.
pub fn decode_block_to_int8(f: crate::kv::KvFormat, blk: &[u8], t_cap: usize, hd: usize, n: usize, out: &mut [u8]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2() && hd.is_multiple_of(32) && crate::kv::decodes_to_int8(f, hd) && n <= t_cap {
        // SAFETY: the CPU has AVX2; hd is a multiple of 32; the block's sizes are asserted.
        unsafe {
            if f.bits() == 4 {
                avx2::decode_rows_to_int8::<4>(blk, t_cap, hd, n, out);
            } else {
                avx2::decode_rows_to_int8::<2>(blk, t_cap, hd, n, out);
            }
        }
        return true;
    }
    crate::kv::decode_block_to_int8(f, blk, t_cap, hd, n, out)
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "aarch64")]
mod neon;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repack::PackedWeight;
    use rand::{Rng, SeedableRng};

    #[test]
    fn stream_sums_are_the_wrapping_sum_however_they_read() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        // Lengths that end inside a line, and words near the top so the sums wrap.
        for n in [0, 1, 7, 8, 9, 1000, 4099] {
            let words: Vec<u64> = (0..n).map(|_| rng.gen::<u64>() | (1 << 63)).collect();
            let want = words.iter().fold(0u64, |a, &b| a.wrapping_add(b));
            for ahead in [0, 64, 2048, 16384] {
                for l2_first in [false, true] {
                    assert_eq!(stream_sum(&words, ahead, l2_first), want, "n {n}, ahead {ahead}, l2_first {l2_first}");
                }
                // The vector reads: the CPU's widest, and the 256-bit one wherever it runs.
                #[cfg(target_arch = "x86_64")]
                {
                    assert_eq!(stream_sum_wide(&words, ahead), want, "wide, n {n}, ahead {ahead}");
                    if has_avx2() {
                        let lines = n / 8;
                        let tail = words[lines * 8..].iter().fold(0u64, |a, &b| a.wrapping_add(b));
                        // SAFETY: AVX2 checked; `lines` whole lines lie in `words`.
                        let ymm = unsafe { avx2::wide_ymm(words.as_ptr(), lines, &|_| {}) };
                        assert_eq!(ymm.wrapping_add(tail), want, "256-bit, n {n}");
                    }
                }
            }
        }
    }

    fn random_weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut impl Rng) -> Vec<u8> {
        let n = rows * ty.row_bytes(cols);
        let mut data: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
        // Keep the f16 scales finite and small so sums stay comparable.
        let bs = ty.type_size();
        for blk in data.chunks_exact_mut(bs) {
            let put = |b: &mut [u8], at: usize, v: f32| b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
            match ty {
                GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => put(blk, 0, rng.gen_range(0.001..0.05)),
                GgmlType::Q4_1 | GgmlType::Q5_1 => {
                    put(blk, 0, rng.gen_range(0.001..0.05));
                    put(blk, 2, rng.gen_range(-0.2..0.2));
                }
                GgmlType::Q4K | GgmlType::Q5K => {
                    put(blk, 0, rng.gen_range(0.001..0.05));
                    put(blk, 2, rng.gen_range(0.001..0.05));
                }
                GgmlType::Q6K => put(blk, 208, rng.gen_range(0.001..0.05)),
                _ => {}
            }
        }
        data
    }

    /// The int8 K/V rows' codes eight lanes at a time give the scalar reference's bytes (itself
    /// checked against libm's `roundf` in kv's tests): halves, the clamp, NaN, infinities and
    /// random bits, at scales that move values across them, ragged lengths.
    #[test]
    fn int8_codes_equal_the_scalar_reference() {
        let mut ys: Vec<f32> = (-600..=600).map(|i| i as f32 * 0.5).collect();
        ys.extend([0.0, -0.0, 0.499_999_97, -0.499_999_97, 126.5, -126.5, 127.499_99, 127.5, -127.5, 1e30, -1e30]);
        ys.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::MIN_POSITIVE, f32::EPSILON]);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        ys.extend((0..200_000).map(|_| f32::from_bits(rng.gen::<u32>())));
        ys.extend((0..200_000).map(|_| rng.gen_range(-130.0f32..130.0)));
        for inv in [1.0f32, 0.5, 3.0, 1.0 / 0.37, 1e-3] {
            for len in [ys.len(), 61, 8, 3] {
                for x in [&ys[..len], &ys[ys.len() - len..]] {
                    let (mut got, mut want) = (vec![0u8; len], vec![0u8; len]);
                    int8_codes(x, inv, &mut got);
                    crate::kv::int8_codes_ref(x, inv, &mut want);
                    assert_eq!(got, want, "scale {inv}, {len} values");
                }
            }
        }
    }

    #[test]
    fn packed_kernels_match_row_major_reference() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0] {
            for &(rows, cols, toks) in &[(8, 32, 1), (13, 64, 6), (40, 576, 9), (3, 96, 4), (24, 64, 2), (24, 64, 15), (16, 96, 20)] {
                let data = random_weights(ty, rows, cols, &mut rng);
                let w = WeightView { ty, rows, cols, data: &data };
                let p = PackedWeight::pack(ty, rows, cols, &data).expect("packable type");
                let x: Vec<f32> = (0..toks * cols).map(|_| rng.gen_range(-2.0..2.0)).collect();
                let mut a = Acts::default();
                a.prepare(&x, toks, cols, &[ActKind::Q8], &ThreadPool::new(2));
                let mut want = vec![f32::NAN; toks * rows];
                matmul_rows_ref(&w, &a, OutPtr::new(&mut want), rows, 0, rows, toks);
                #[cfg(target_arch = "x86_64")]
                if crate::simd::has_vnni() {
                    // The VNNI and AVX2 kernels compute the same integers: equal bit for bit.
                    let (mut v, mut x) = (vec![f32::NAN; toks * rows], vec![f32::NAN; toks * rows]);
                    // SAFETY: has_vnni implies AVX2/FMA/F16C and AVX512-VNNI/VL/BW.
                    unsafe {
                        avx2::matmul_packed_vnni(&p, &a.q8, OutPtr::new(&mut v), rows, 0, p.groups());
                        avx2::matmul_packed(&p, &a.q8, OutPtr::new(&mut x), rows, 0, p.groups());
                    }
                    assert!(
                        v.iter().zip(&x).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ty:?} {rows}x{cols}x{toks}: VNNI differs from AVX2"
                    );
                }
                let (mut fast, mut slow) = (vec![f32::NAN; toks * rows], vec![f32::NAN; toks * rows]);
                matmul_packed(&p, &a, OutPtr::new(&mut fast), rows, 0, p.groups());
                matmul_packed_ref(&p, &a.q8, OutPtr::new(&mut slow), rows, 0, p.groups());
                // The kernel in use (AVX2, VNNI, NEON or the scalar one) gives the reference's bits.
                assert!(
                    fast.iter().zip(&slow).all(|(f, s)| f.to_bits() == s.to_bits()),
                    "{ty:?} {rows}x{cols}x{toks} ({}): {fast:?} vs {slow:?}",
                    simd_name()
                );
                // The packed layout computes what GGUF's row-major blocks do (other rounding).
                for (i, (g, s)) in fast.iter().zip(&want).enumerate() {
                    assert!((g - s).abs() <= 1e-4 * (1.0 + s.abs()), "{ty:?} {rows}x{cols}x{toks} at {i}: {g} vs {s}");
                }
            }
        }
    }

    /// Q8_0 at the integer extremes, where the pair tile's unsigned activations (codes plus 128)
    /// and its weight-sum correction are furthest from zero: weight codes of -128, 127 and 0,
    /// activations quantized to +-127, in 8-token tiles and fewer. The kernel in use gives the
    /// packed reference's bits.
    #[test]
    fn q8_0_products_at_the_extremes_equal_the_reference() {
        let (rows, cols) = (32, 256);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(21);
        let mut data = random_weights(GgmlType::Q8_0, rows, cols, &mut rng);
        for (i, blk) in data.chunks_exact_mut(GgmlType::Q8_0.type_size()).enumerate() {
            for (j, c) in blk[2..].iter_mut().enumerate() {
                *c = match (i + j / 8) % 4 {
                    0 | 1 => 0x80,
                    2 => 0x7F,
                    _ => [0x80, 0x7F, 0][j % 3],
                };
            }
        }
        let p = PackedWeight::pack(GgmlType::Q8_0, rows, cols, &data).expect("packable type");
        for toks in [1, 5, 8, 13] {
            let x: Vec<f32> = (0..toks * cols).map(|i| if (i / 3 + i / 32) % 2 == 0 { 2.0 } else { -2.0 }).collect();
            let mut a = Acts::default();
            a.prepare(&x, toks, cols, &[ActKind::Q8], &ThreadPool::new(2));
            assert!(a.q8.qs.iter().flatten().all(|&c| c.abs() == 127));
            let (mut fast, mut slow) = (vec![f32::NAN; toks * rows], vec![f32::NAN; toks * rows]);
            matmul_packed(&p, &a, OutPtr::new(&mut fast), rows, 0, p.groups());
            matmul_packed_ref(&p, &a.q8, OutPtr::new(&mut slow), rows, 0, p.groups());
            assert!(
                fast.iter().zip(&slow).all(|(f, s)| f.to_bits() == s.to_bits()),
                "{toks} tokens ({}): {fast:?} vs {slow:?}",
                simd_name()
            );
        }
    }

    /// The K-quants packed in groups of 8 rows give the row-major scalar references' results
    /// (llama.cpp's arithmetic, `quant::dot_k4_ref` / `dot_q6k_ref`) bit for bit: from the kernel
    /// in use, the packed layout's own reference, and (where both run) VNNI and AVX2 alike; over
    /// partial groups, groups in pairs (the 512-bit tiles) and alone, and 1, 2, 3, 9, 15 and 20 tokens
    /// (tiles of 8, of 4 and the rest).
    #[test]
    fn k_quant_kernels_equal_the_references() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
        for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
            for &(rows, cols, toks) in
                &[(5, 256, 1), (9, 768, 3), (4, 512, 9), (16, 256, 4), (17, 512, 9), (16, 256, 2), (16, 256, 15), (24, 512, 20)]
            {
                let data = random_weights(ty, rows, cols, &mut rng);
                let w = WeightView { ty, rows, cols, data: &data };
                let x: Vec<f32> = (0..toks * cols).map(|_| rng.gen_range(-2.0..2.0)).collect();
                let mut a = Acts::default();
                a.prepare(&x, toks, cols, &[w.act_kind()], &ThreadPool::new(1));
                let mut slow = vec![f32::NAN; toks * rows];
                matmul_rows_ref(&w, &a, OutPtr::new(&mut slow), rows, 0, rows, toks);
                {
                    let p = PackedWeight::pack(ty, rows, cols, &data).expect("K-quants pack");
                    let mut outs = vec![vec![f32::NAN; toks * rows]; 2];
                    matmul_packed(&p, &a, OutPtr::new(&mut outs[0]), rows, 0, p.groups());
                    matmul_packed_k_ref(&p, &a.q8k, OutPtr::new(&mut outs[1]), rows, 0, p.groups());
                    #[cfg(target_arch = "x86_64")]
                    if crate::simd::has_vnni() {
                        let mut x = vec![f32::NAN; toks * rows];
                        // SAFETY: has_vnni implies AVX2/FMA/F16C.
                        unsafe { avx2::matmul_packed_k(&p, &a.q8k, OutPtr::new(&mut x), rows, 0, p.groups()) };
                        outs.push(x);
                    }
                    for (i, o) in outs.iter().enumerate() {
                        assert!(
                            o.iter().zip(&slow).all(|(f, s)| f.to_bits() == s.to_bits()),
                            "{ty:?} {rows}x{cols}x{toks} packed ({i}): {o:?} vs {slow:?}"
                        );
                    }
                }
            }
        }
    }

    /// The float row kernels (F32, F16, BF16; 4 tokens a pass and 1) give the scalar
    /// reference's bits, whole 8-wide steps or not, and the dot product within rounding.
    #[test]
    fn float_kernels_equal_the_reference() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
            for &(rows, cols, toks) in &[(5, 37, 1), (9, 576, 3), (4, 64, 9), (3, 8, 5), (2, 3, 4), (5, 576, 8), (7, 44, 6)] {
                let vals: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let data: Vec<u8> = match ty {
                    GgmlType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    GgmlType::F16 => vals.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect(),
                    _ => vals.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(),
                };
                let w = WeightView { ty, rows, cols, data: &data };
                let x: Vec<f32> = (0..toks * cols).map(|_| rng.gen_range(-2.0..2.0)).collect();
                let mut a = Acts::default();
                a.prepare(&x, toks, cols, &[w.act_kind()], &ThreadPool::new(1));
                let (mut fast, mut slow) = (vec![f32::NAN; toks * rows], vec![f32::NAN; toks * rows]);
                matmul_rows(&w, &a, OutPtr::new(&mut fast), rows, 0, rows);
                matmul_rows_ref(&w, &a, OutPtr::new(&mut slow), rows, 0, rows, toks);
                assert!(
                    fast.iter().zip(&slow).all(|(f, s)| f.to_bits() == s.to_bits()),
                    "{ty:?} {rows}x{cols}x{toks} ({}): {fast:?} vs {slow:?}",
                    simd_name()
                );
                for t in 0..toks {
                    for r in 0..rows {
                        let mut deq = vec![0.0; cols];
                        quant::dequantize_row(ty, w.row(r), &mut deq);
                        let exact: f64 = deq.iter().zip(&x[t * cols..]).map(|(p, q)| f64::from(*p) * f64::from(*q)).sum();
                        let got = f64::from(fast[t * rows + r]);
                        assert!((got - exact).abs() <= 1e-5 * cols as f64, "{ty:?} row {r} token {t}: {got} vs {exact}");
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
        for ty in
            [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K]
        {
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
            let mut blk = vec![0u8; g.head_block_bytes(f, 0)];
            for t in 0..16 {
                kv::write_token(f, &mut blk, t, 16, &vals[t * 64..(t + 1) * 64]);
            }
            let mut dec = vec![0.0; 16 * 64];
            kv::read_block_f32(f, 0, &blk, 16, 64, 16, &mut dec);
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
        // The split levels in place: K scores are the decoded rows' (the steps applied to the
        // query instead), V rows the rotated values, whose weighted sum rotated back is the
        // decoded rows' (within rounding).
        for f in [KvFormat::K4V4, KvFormat::K3V3, KvFormat::K2V2] {
            let (mut kb, mut vb) = (vec![0u8; g.head_block_bytes(f, 0)], vec![0u8; g.head_block_bytes(f, 1)]);
            kv::write_block_f32(f, 0, &mut kb, 16, 64, 16, &vals);
            kv::write_block_f32(f, 1, &mut vb, 16, 64, 16, &vals);
            let (mut dk, mut dv) = (vec![0.0; 16 * 64], vec![0.0; 16 * 64]);
            kv::read_block_f32(f, 0, &kb, 16, 64, 16, &mut dk);
            kv::read_block_f32(f, 1, &vb, 16, 64, 16, &mut dv);
            let (mut zero, mut step) = (vec![0.0; 64], vec![0.0; 64]);
            let (outliers, codes) = kv::split_k_params(&kb, 16, 64, &mut zero, &mut step);
            let k_rows = KvRows::Channel { codes, bits: f.bits(), zero: &zero, step: &step, outliers };
            let (mut x, mut y) = (vec![0.0; 3 * 40], vec![0.0; 3 * 40]);
            chunk_scores(&q, 64, k_rows, &visible, 0.125, &mut x, 40, 16);
            chunk_scores(&q, 64, KvRows::F32(&dk), &visible, 0.125, &mut y, 40, 16);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{f:?} scores: {a} vs {b}");
            }
            let mut scales = vec![0.0; 16];
            let vcodes = kv::split_v_params(&vb, f.bits(), 16, &mut scales);
            let v_rows = KvRows::Token { codes: vcodes, scales: &scales, bits: f.bits(), levels: kv::split_v_levels(f.bits()) };
            let (mut ox, mut oy) = (vec![0.0; 3 * 64], vec![0.0; 3 * 64]);
            chunk_values(&x, 40, 16, v_rows, &visible, 64, &mut ox);
            chunk_values(&x, 40, 16, KvRows::F32(&dv), &visible, 64, &mut oy);
            for (i, (rx, ry)) in ox.chunks_exact_mut(64).zip(oy.chunks_exact(64)).enumerate() {
                kv::fwht(rx);
                for (a, b) in rx.iter().zip(ry) {
                    assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{f:?} query {i}: {a} vs {b}");
                }
            }
        }
    }

    /// Every format's vector attention kernels give the scalar references' bits, at every
    /// head size they take (and the fallback sizes they do not).
    #[test]
    fn attention_kernels_equal_the_references_bit_for_bit() {
        use crate::kv::{self, KvFormat, KvGeometry};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(21);
        // Head widths of 1 to 32 lanes (the values kernel's tiles: 3 lanes and narrower).
        for hd in [8, 24, 48, 64, 128, 256, 12] {
            let g = KvGeometry { n_layers: 1, n_kv_heads: 1, head_dim: hd, chunk_tokens: 16 };
            let vals: Vec<f32> = (0..16 * hd).map(|_| rng.gen_range(-3.0..3.0)).collect();
            let q: Vec<f32> = (0..4 * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let visible = [16, 3, 0, 11];
            let blocks: Vec<(KvFormat, Vec<u8>)> = [KvFormat::F16, KvFormat::Int8]
                .into_iter()
                .map(|f| {
                    let mut blk = vec![0u8; g.head_block_bytes(f, 0)];
                    for t in 0..16 {
                        kv::write_token(f, &mut blk, t, 16, &vals[t * hd..(t + 1) * hd]);
                    }
                    (f, blk)
                })
                .collect();
            let mut rows = vec![KvRows::F32(&vals)];
            for (f, blk) in &blocks {
                rows.push(if *f == KvFormat::F16 { KvRows::F16(blk) } else { KvRows::Int8 { blk, t_cap: 16 } });
            }
            // Split-level rows at every code width, from random codes, zero points, steps
            // and scales (the kernels take any head width the vector path takes).
            let zero: Vec<f32> = (0..hd).map(|_| f32::from(rng.gen_range(-20i8..20))).collect();
            let step: Vec<f32> = (0..hd).map(|_| rng.gen_range(0.001..0.5)).collect();
            // Integer levels (the split levels' 4-bit codebook: a byte-shuffle path) and others.
            let levels: Vec<f32> = (0..16).map(|_| f32::from(rng.gen_range(-127i8..=127))).collect();
            let odd: Vec<f32> = levels.iter().map(|l| l + 0.25).collect();
            let mut coded = vec![0u8; 16 * hd];
            // K outliers at random positions (the last entry unused, as an encoder leaves one).
            let mut outl = vec![0u8; kv::OUTLIER_BYTES * 8];
            for o in outl.chunks_exact_mut(kv::OUTLIER_BYTES).take(7) {
                let pos = rng.gen_range(0..16 * hd as u32);
                let corr = u32::from(f16::from_f32(rng.gen_range(-2.0..2.0)).to_bits() >> 4);
                o.copy_from_slice(&(pos | corr << 12).to_le_bytes()[..3]);
            }
            rng.fill(&mut coded[..]);
            let scales: Vec<f32> = (0..16).map(|_| rng.gen_range(0.0..0.1)).collect();
            for bits in 2..=4 {
                rows.push(KvRows::Channel { codes: &coded, bits, zero: &zero, step: &step, outliers: &outl });
                rows.push(KvRows::Token { codes: &coded, scales: &scales, bits, levels: &levels[..1 << bits] });
                rows.push(KvRows::Token { codes: &coded, scales: &scales, bits, levels: &odd[..1 << bits] });
                // More queries than the channel-wise kernel scales at once.
                let many: Vec<usize> = (0..11).map(|i| (i * 5) % 17).collect();
                let q11: Vec<f32> = (0..11 * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let k = KvRows::Channel { codes: &coded, bits, zero: &zero, step: &step, outliers: &outl };
                let (mut x, mut y) = (vec![-9.0; 11 * 20], vec![-9.0; 11 * 20]);
                chunk_scores(&q11, hd, k, &many, 0.125, &mut x, 20, 3);
                chunk_scores_ref(&q11, hd, k, &many, 0.125, &mut y, 20, 3);
                assert!(x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()), "hd {hd} {bits} bits, 11 queries");
                // And values over them: tiles of 3, 3, 3 and 2 queries.
                let v = KvRows::Token { codes: &coded, scales: &scales, bits, levels: &odd[..1 << bits] };
                let (mut ox, mut oy) = (vec![0.5; 11 * hd], vec![0.5; 11 * hd]);
                chunk_values(&x, 20, 3, v, &many, hd, &mut ox);
                chunk_values_ref(&x, 20, 3, v, &many, hd, &mut oy);
                assert!(ox.iter().zip(&oy).all(|(a, b)| a.to_bits() == b.to_bits()), "hd {hd} {bits} bits, 11 queries' values");
            }
            // A decoding step's group, four queries, and a prefill job's many (512-bit tiles
            // of 4, 4 and 3 queries where the CPU has them), each seeing a different count;
            // and groups of 1 to 3 queries whose rows end inside a block of 8 at odd and even
            // counts (the 512-bit decode tiles pair rows: an odd last row goes alone).
            let many: Vec<usize> = (0..11).map(|i| (i * 7 + 2) % 17).collect();
            let q11: Vec<f32> = (0..11 * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let (one, two, three) = ([7usize], [10usize, 2], [13usize, 5, 1]);
            for k in rows {
                for (q, visible) in [
                    (&q[..3 * hd], &visible[..3]),
                    (&q[..], &visible[..]),
                    (&q11[..], &many[..]),
                    (&q[..hd], &one[..]),
                    (&q[..2 * hd], &two[..]),
                    (&q[..3 * hd], &three[..]),
                ] {
                    let nq = visible.len();
                    let (mut x, mut y) = (vec![-9.0; nq * 20], vec![-9.0; nq * 20]);
                    chunk_scores(q, hd, k, visible, 0.125, &mut x, 20, 3);
                    chunk_scores_ref(q, hd, k, visible, 0.125, &mut y, 20, 3);
                    assert!(x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()), "hd {hd} {k:?} {nq} queries' scores");
                    let (mut ox, mut oy) = (vec![0.5; nq * hd], vec![0.5; nq * hd]);
                    chunk_values(&x, 20, 3, k, visible, hd, &mut ox);
                    chunk_values_ref(&x, 20, 3, k, visible, hd, &mut oy);
                    assert!(ox.iter().zip(&oy).all(|(a, b)| a.to_bits() == b.to_bits()), "hd {hd} {k:?} {nq} queries' values");
                }
            }
        }
    }

    /// A prefill job's scores against int8 and f16 blocks of any chunk length (the 512-bit
    /// kernels turn 16 tokens at a time: whole and partial blocks, a block's count below and
    /// at the chunk's) give the reference's bits.
    #[test]
    fn many_queries_score_any_chunk_length_as_the_reference() {
        use crate::kv::{self, KvFormat, KvGeometry};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(33);
        for (hd, ct) in [(64, 8), (64, 32), (24, 48), (128, 20), (256, 16), (8, 40)] {
            let g = KvGeometry { n_layers: 1, n_kv_heads: 1, head_dim: hd, chunk_tokens: ct };
            let vals: Vec<f32> = (0..ct * hd).map(|_| rng.gen_range(-3.0..3.0)).collect();
            for f in [KvFormat::Int8, KvFormat::F16] {
                let mut blk = vec![0u8; g.head_block_bytes(f, 0)];
                for t in 0..ct {
                    kv::write_token(f, &mut blk, t, ct, &vals[t * hd..(t + 1) * hd]);
                }
                let k = if f == KvFormat::F16 { KvRows::F16(&blk) } else { KvRows::Int8 { blk: &blk, t_cap: ct } };
                // Every count up to the chunk's as the largest, and queries seeing fewer.
                for top in 1..=ct {
                    // Ten queries: turned tiles of 3, 3, 3 and 1.
                    let visible: Vec<usize> = (0..10).map(|i| if i == 2 { top } else { (i * 5 + top) % (top + 1) }).collect();
                    let q: Vec<f32> = (0..10 * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
                    let ld = ct + 5;
                    let (mut x, mut y) = (vec![-9.0; 10 * ld], vec![-9.0; 10 * ld]);
                    chunk_scores(&q, hd, k, &visible, 0.125, &mut x, ld, 2);
                    chunk_scores_ref(&q, hd, k, &visible, 0.125, &mut y, ld, 2);
                    assert!(x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()), "{f:?} hd {hd} chunk {ct} top {top}");
                }
            }
        }
    }

    /// The softmax in use gives the scalar reference's bits, and the shared `exp` is within
    /// 2 ulp of libm over the range attention uses.
    #[test]
    fn softmax_kernel_equals_the_reference_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        for n in [1, 7, 8, 9, 15, 16, 17, 24, 31, 33, 47, 300, 671] {
            let mut x: Vec<f32> = (0..n).map(|_| rng.gen_range(-40.0..10.0)).collect();
            x[0] = f32::NEG_INFINITY; // a masked score
            let mut fast = x.clone();
            softmax_f16(&mut fast);
            let mut slow = x.clone();
            let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            softmax_f16_ref(&mut slow, max);
            assert!(fast.iter().zip(&slow).all(|(a, b)| a.to_bits() == b.to_bits()), "n={n}: {fast:?} vs {slow:?}");
        }
        for i in 0..20_000 {
            let x = -87.0 * f64::from(i) / 20_000.0;
            #[allow(clippy::cast_possible_truncation)]
            let (got, want) = (exp_lane(x as f32), (x as f32).exp());
            let ulp = (got.to_bits().cast_signed() - want.to_bits().cast_signed()).abs();
            assert!(ulp <= 2, "exp({x}) = {got}, libm {want}");
        }
        assert_eq!(exp_lane(-87.0), 0.0);
        assert_eq!(exp_lane(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_lane(f32::NAN), 0.0);
    }

    /// The gate in use gives the scalar reference's bits (NaN, infinities and values past
    /// `exp`'s cap too), and is within 4 ulp (exp's 2, then the add and divide) of the gate computed with libm's `exp`.
    #[test]
    fn silu_gate_equals_the_reference_and_libm() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(23);
        for n in [1, 7, 8, 9, 33, 1536] {
            let mut g: Vec<f32> = (0..n).map(|_| rng.gen_range(-120.0..120.0)).collect();
            let u: Vec<f32> = (0..n).map(|_| rng.gen_range(-3.0..3.0)).collect();
            for (i, v) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -88.5, 0.0, -0.0].into_iter().enumerate() {
                if i < n {
                    g[i] = v;
                }
            }
            let mut fast = g.clone();
            silu_mul(&mut fast, &u);
            let mut slow = g.clone();
            silu_mul_ref(&mut slow, &u);
            assert!(fast.iter().zip(&slow).all(|(a, b)| a.to_bits() == b.to_bits()), "n={n}: {fast:?} vs {slow:?}");
        }
        let mut worst = 0;
        for i in 0..=40_000 {
            #[allow(clippy::cast_possible_truncation)]
            let x = (-100.0 + 200.0 * f64::from(i) / 40_000.0) as f32;
            let mut got = [x];
            silu_mul_ref(&mut got, &[1.0]);
            let want = x / (1.0 + (-x).exp());
            let ulp = (got[0].to_bits().cast_signed() - want.to_bits().cast_signed()).abs();
            // Past the cap the reference's gate is a subnormal where libm's is -0.
            if x > -88.0 {
                assert!(ulp <= 4, "silu({x}) = {}, with libm {want}", got[0]);
                worst = worst.max(ulp);
            } else {
                assert!(got[0] <= 0.0 && got[0] > -1e-36, "silu({x}) = {}", got[0]);
            }
        }
        assert!(worst > 0, "the polynomial differs from libm somewhere: the test would notice a swap");
    }

    #[test]
    fn row_max_and_f16_rounding_equal_their_references() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(23);
        for n in [0, 1, 7, 8, 9, 17, 64, 301] {
            // Changed below on x86_64 only.
            #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
            let mut x: Vec<f32> = (0..n).map(|_| rng.gen_range(-50.0..50.0)).collect();
            let mut fast = vec![0.0; n];
            let mut slow = vec![0.0; n];
            round_f16(&x, &mut fast);
            round_f16_ref(&x, &mut slow);
            assert!(fast.iter().zip(&slow).all(|(a, b)| a.to_bits() == b.to_bits()), "n={n}: {fast:?} vs {slow:?}");
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                // The maximum anywhere, behind NaNs and masked scores, and in the tail.
                for (i, v) in x.iter_mut().enumerate() {
                    match i % 5 {
                        1 => *v = f32::NAN,
                        3 => *v = f32::NEG_INFINITY,
                        _ => {}
                    }
                }
                // SAFETY: the CPU has AVX2.
                let got = unsafe { avx2::row_max(&x) };
                assert_eq!(got.to_bits(), row_max_ref(&x).to_bits(), "n={n}");
                if let Some(last) = x.last_mut() {
                    *last = 1e9;
                    // SAFETY: as above.
                    assert_eq!(unsafe { avx2::row_max(&x) }, 1e9, "n={n}: the last value");
                }
            }
        }
        // Every f16 case: subnormals, the largest value, overflow, ties to even, zeros.
        let edge = [6.0e-8, 3.0e-5, 6.1e-5, 65504.0, 65519.0, 65520.0, 1e6, -0.0, 0.0, 1.0 + 1.0 / 2048.0, 1.0 + 3.0 / 2048.0, -2.5e-6];
        let (mut fast, mut slow) = ([0.0f32; 12], [0.0f32; 12]);
        round_f16(&edge, &mut fast);
        round_f16_ref(&edge, &mut slow);
        assert!(fast.iter().zip(&slow).all(|(a, b)| a.to_bits() == b.to_bits()), "{fast:?} vs {slow:?}");
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

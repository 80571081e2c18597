//! The channel-major 4-bit matrices' AVX2 kernels ([`crate::colmajor`] has the layout and
//! [`crate::colmajor::tile_ref`], the reference they equal bit for bit).
#![allow(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
use std::arch::x86_64::*;

use crate::colmajor::{ActiveSet, ColWeight, TILE};
use crate::quant::QK;

/// Adds `s16` (4 vectors of i16 row sums as [`pair`] leaves them) to the i32 sums of a
/// tile's 64 rows at `acc`, in row order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn flush(s16: &[__m256i; 4], acc: *mut i32) {
    // s16[0]: rows 0..8 | 16..24, s16[1]: 8..16 | 24..32, s16[2..4] the same + 32.
    for (h, s) in s16.iter().enumerate() {
        let (lo, hi) = (_mm256_castsi256_si128(*s), _mm256_extracti128_si256(*s, 1));
        for (half, r) in [(lo, 4 * (h / 2) + h % 2), (hi, 4 * (h / 2) + h % 2 + 2)] {
            let p = acc.add(8 * r).cast::<__m256i>();
            _mm256_storeu_si256(p, _mm256_add_epi32(_mm256_loadu_si256(p), _mm256_cvtepi16_epi32(half)));
        }
    }
}

/// One pair of columns at `pj`, `pk` (a tile's 32 bytes each) times their inputs `xs`,
/// added to `s16`: per 128-bit lane, unpacklo takes rows 0..8 (16..24 in the upper lane)
/// of the tile's 32, unpackhi rows 8..16 (24..32); low nibbles then high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pair(pj: *const u8, pk: *const u8, xs: __m256i, s16: &mut [__m256i; 4]) {
    let mask = _mm256_set1_epi8(0x0F);
    let vj = _mm256_loadu_si256(pj.cast());
    let vk = _mm256_loadu_si256(pk.cast());
    let (lj, lk) = (_mm256_and_si256(vj, mask), _mm256_and_si256(vk, mask));
    let hj = _mm256_and_si256(_mm256_srli_epi16(vj, 4), mask);
    let hk = _mm256_and_si256(_mm256_srli_epi16(vk, 4), mask);
    let parts = [_mm256_unpacklo_epi8(lj, lk), _mm256_unpackhi_epi8(lj, lk), _mm256_unpacklo_epi8(hj, hk), _mm256_unpackhi_epi8(hj, hk)];
    for (s, p) in s16.iter_mut().zip(parts) {
        *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(p, xs));
    }
}

/// Both inputs of a pair broadcast as byte pairs; a lone last channel pairs with itself
/// times zero.
#[inline]
unsafe fn pair_inputs(xb: *const i8, pair: &[u8]) -> (usize, usize, __m256i) {
    let j = usize::from(pair[0]);
    let (k, xk) = match pair.get(1) {
        Some(&k) => (usize::from(k), *xb.add(usize::from(k))),
        None => (j, 0),
    };
    (j, k, _mm256_set1_epi16(i16::from_le_bytes([(*xb.add(j)).cast_unsigned(), xk.cast_unsigned()])))
}

/// Blocks fetched ahead: a block of 576 rows is 11.5 KB, two cover memory latency.
const AHEAD: usize = 2;

/// [`super::matvec_tiles`]: for each block and each group of up to 16 active columns,
/// the tiles in order, so each column is read front to back and only 16 are in flight.
/// `y` and `acc` hold the rows of tiles `t0..t1`.
///
/// # Safety
/// Needs AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tiles(w: &ColWeight, a: &ActiveSet, t: usize, t0: usize, t1: usize, y: &mut [f32], acc: &mut [i32]) {
    let (at, rp) = (w.at, w.rows_p);
    let (r0, r1) = (t0 * TILE, t1 * TILE);
    let data = w.data.as_ptr();
    let x8 = a.x8.as_ptr().add(t * w.cols);
    let nb = a.nb;
    let fetch = |b: usize| {
        // The columns are many short runs, which the hardware prefetchers do not follow:
        // fetch a later active block's lines while this one computes.
        if b < nb && !a.block(t, b).is_empty() {
            let base = at.scales + b * at.scale_stride;
            for (start, len) in [(base + 2 * r0, 2 * (r1 - r0)), (base + 2 * rp + 2 * r0, 2 * (r1 - r0))] {
                for off in (start & !63..start + len).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(data.add(off).cast());
                }
            }
            for &j in a.block(t, b) {
                let col = at.codes + b * at.block_stride + usize::from(j) * at.col_stride + r0 / 2;
                for off in (col & !63..col + (r1 - r0) / 2).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(data.add(off).cast());
                }
            }
        }
    };
    for b in 0..AHEAD.min(nb) {
        fetch(b);
    }
    for b in 0..nb {
        fetch(b + AHEAD);
        let act = a.block(t, b);
        if act.is_empty() {
            continue;
        }
        acc.fill(0);
        let base = data.add(at.scales + b * at.scale_stride);
        let cols = data.add(at.codes + b * at.block_stride);
        let xb = x8.add(b * QK);
        // i16 sums hold at most 8 pairs: 8 * 2 * 15 * 127 < 2^15.
        for group in act.chunks(16) {
            let mut pairs = [(std::ptr::null::<u8>(), std::ptr::null::<u8>(), _mm256_setzero_si256()); 8];
            for (p, pr) in pairs.iter_mut().zip(group.chunks(2)) {
                let (j, k, xs) = pair_inputs(xb, pr);
                *p = (cols.add(j * at.col_stride), cols.add(k * at.col_stride), xs);
            }
            let pairs = &pairs[..group.len().div_ceil(2)];
            for tile in t0..t1 {
                let mut s16 = [_mm256_setzero_si256(); 4];
                for &(pj, pk, xs) in pairs {
                    pair(pj.add(tile * TILE / 2), pk.add(tile * TILE / 2), xs, &mut s16);
                }
                flush(&s16, acc.as_mut_ptr().add((tile - t0) * TILE));
            }
        }
        let sum = _mm256_set1_ps(a.sums[t * a.nb + b]);
        let scale = _mm256_set1_ps(a.scales[t * a.nb + b]);
        let (ds, ms) = (base.add(2 * r0), base.add(2 * rp + 2 * r0));
        for r in (0..r1 - r0).step_by(8) {
            let d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(ds.add(2 * r).cast())), scale);
            let m = _mm256_cvtph_ps(_mm_loadu_si128(ms.add(2 * r).cast()));
            let yp = y.as_mut_ptr().add(r);
            let dot = _mm256_cvtepi32_ps(_mm256_loadu_si256(acc.as_ptr().add(r).cast()));
            _mm256_storeu_ps(yp, _mm256_fmadd_ps(m, sum, _mm256_fmadd_ps(d, dot, _mm256_loadu_ps(yp))));
        }
    }
}

/// # Safety
/// Needs AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile(w: &ColWeight, a: &ActiveSet, t: usize, tile: usize, y: &mut [f32; TILE]) {
    let (at, rp) = (w.at, w.rows_p);
    let data = w.data.as_ptr();
    let x8 = a.x8.as_ptr().add(t * w.cols);
    let mut yv = [_mm256_setzero_ps(); 8];
    let mut acc = [0i32; TILE];
    for b in 0..a.nb {
        let act = a.block(t, b);
        if act.is_empty() {
            continue;
        }
        acc.fill(0);
        let base = data.add(at.scales + b * at.scale_stride);
        let cols = data.add(at.codes + b * at.block_stride + tile * TILE / 2);
        let xb = x8.add(b * QK);
        for group in act.chunks(16) {
            let mut s16 = [_mm256_setzero_si256(); 4];
            for pr in group.chunks(2) {
                let (j, k, xs) = pair_inputs(xb, pr);
                pair(cols.add(j * at.col_stride), cols.add(k * at.col_stride), xs, &mut s16);
            }
            flush(&s16, acc.as_mut_ptr());
        }
        let sum = _mm256_set1_ps(a.sums[t * a.nb + b]);
        let scale = _mm256_set1_ps(a.scales[t * a.nb + b]);
        let ds = base.add(2 * tile * TILE);
        let ms = base.add(2 * rp + 2 * tile * TILE);
        for (k, yk) in yv.iter_mut().enumerate() {
            let d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(ds.add(16 * k).cast())), scale);
            let m = _mm256_cvtph_ps(_mm_loadu_si128(ms.add(16 * k).cast()));
            let dot = _mm256_cvtepi32_ps(_mm256_loadu_si256(acc.as_ptr().add(8 * k).cast()));
            *yk = _mm256_fmadd_ps(m, sum, _mm256_fmadd_ps(d, dot, *yk));
        }
    }
    for (k, v) in yv.iter().enumerate() {
        _mm256_storeu_ps(y.as_mut_ptr().add(8 * k), *v);
    }
}

//! The NEON kernels behind [`super`]'s dispatch: aarch64 only, chosen at run time, with the
//! dot-product extension's `sdot` where the CPU has it and base NEON (`smull` + pairwise adds)
//! where it does not. Each kernel does the AVX2 kernel's float operations in the same order
//! (a 256-bit vector is two 128-bit halves here), so every kernel set gives the scalar
//! references' bits; the integer dot products are exact in any grouping.
// Every function here needs NEON (part of every AArch64 CPU; the dispatchers check it is not
// turned off) and, for the `sdot` ones, the dot-product extension, checked once before calling
// in (`crate::simd::has_dotprod`). The memory contracts are commented where they are.
#![allow(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
use std::arch::aarch64::*;
use std::arch::asm;

use super::{KvRows, OutPtr};
use crate::quant::{Q8Acts, Q8KActs};
use crate::repack::{Packed, PackedWeight, ROWS};

pub(crate) mod colmajor;

/// How four-byte dot products accumulate into i32 lanes: lane `i` of the result adds
/// `sum_j w[4i + j] * x[4i + j]`.
trait Dot {
    /// # Safety
    /// The CPU has what the implementation uses.
    unsafe fn dot(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t;
}

/// Base NEON: products widened to i16 (`|w x| <= 128 * 127`, pairs < 2^15), then pairwise
/// added into the i32 lanes.
struct Mull;
impl Dot for Mull {
    #[inline(always)]
    unsafe fn dot(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
        let lo = vmull_s8(vget_low_s8(w), vget_low_s8(x));
        let hi = vmull_high_s8(w, x);
        vpadalq_s16(acc, vpaddq_s16(lo, hi))
    }
}

/// The dot-product extension: `sdot` does the four products and the add in one instruction.
/// Written as inline assembly because its intrinsic (`vdotq_s32`) is not stable Rust yet.
struct Sdot;
impl Dot for Sdot {
    #[inline(always)]
    unsafe fn dot(mut acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
        asm!(
            ".arch_extension dotprod",
            "sdot {acc:v}.4s, {w:v}.16b, {x:v}.16b",
            acc = inout(vreg) acc,
            w = in(vreg) w,
            x = in(vreg) x,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    }
}

/// Four activation bytes starting at `p`, repeated in every 32-bit lane.
#[inline(always)]
unsafe fn bcast4(p: *const i8) -> int8x16_t {
    // SAFETY (callers): p points at 4 readable bytes inside an activation block.
    vreinterpretq_s8_s32(vdupq_n_s32(std::ptr::read_unaligned(p.cast::<i32>())))
}

/// Four f16 values at `p` as f32.
#[inline(always)]
unsafe fn f16x4(p: *const half::f16) -> float32x4_t {
    // SAFETY (callers): 4 readable f16 at p.
    vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p.cast())))
}

/// # Safety
/// Needs NEON.
pub(super) unsafe fn matmul_packed(w: &PackedWeight, a: &Q8Acts, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
    packed_all::<Mull>(w, a, out, ldo, g0, g1);
}

/// # Safety
/// Needs NEON and the dot-product extension.
#[target_feature(enable = "dotprod")]
pub(super) unsafe fn matmul_packed_sdot(w: &PackedWeight, a: &Q8Acts, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
    packed_all::<Sdot>(w, a, out, ldo, g0, g1);
}

#[inline(always)]
unsafe fn packed_all<D: Dot>(w: &PackedWeight, a: &Q8Acts, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
    each_tile!(packed_tile<D>, w, a, out, ldo, g0, g1);
}

/// One group of 8 rows (two halves of 4: `.0` rows 0-3, `.1` rows 4-7) against `T` tokens
/// from `t0`, over every block: the AVX2 tile's operations, half by half.
#[allow(clippy::needless_range_loop)] // `t` indexes several per-token arrays in step
#[inline(always)]
unsafe fn packed_tile<D: Dot, const T: usize>(w: &PackedWeight, a: &Q8Acts, g: usize, t0: usize, out: OutPtr, ldo: usize) {
    let nb = w.blocks_per_row();
    let mut acc = [(vdupq_n_f32(0.0), vdupq_n_f32(0.0)); T];
    let xrow: [usize; T] = std::array::from_fn(|t| (t0 + t) * nb);
    // Per block: the rows' integer sums in `p`, then `acc += p (d d_x)`, `acc += m s_x` (fused).
    let combine = |acc: &mut (float32x4_t, float32x4_t), p: (int32x4_t, int32x4_t), d: (float32x4_t, float32x4_t), dx: f32| {
        let dx = vdupq_n_f32(dx);
        acc.0 = vfmaq_f32(acc.0, vcvtq_f32_s32(p.0), vmulq_f32(d.0, dx));
        acc.1 = vfmaq_f32(acc.1, vcvtq_f32_s32(p.1), vmulq_f32(d.1, dx));
    };
    let offset = |acc: &mut (float32x4_t, float32x4_t), m: (float32x4_t, float32x4_t), sx: f32| {
        let sx = vdupq_n_f32(sx);
        acc.0 = vfmaq_f32(acc.0, m.0, sx);
        acc.1 = vfmaq_f32(acc.1, m.1, sx);
    };
    match &w.data {
        Packed::Q4(v) => {
            for (b, blk) in v[g * nb..(g + 1) * nb].iter().enumerate() {
                let p = q4_sums::<D, T, 0>(&blk.qs, a, &xrow, b);
                let d = (f16x4(blk.d.as_ptr()), f16x4(blk.d.as_ptr().add(4)));
                let m = (f16x4(blk.m.as_ptr()), f16x4(blk.m.as_ptr().add(4)));
                for t in 0..T {
                    let k8 = xrow[t] + b;
                    combine(&mut acc[t], p[t], d, a.d[k8]);
                    offset(&mut acc[t], m, a.s[k8]);
                }
            }
        }
        Packed::Q4S(v) => {
            // The codes less 8 are signed bytes: `sum((q - 8) x)` directly.
            for (b, blk) in v[g * nb..(g + 1) * nb].iter().enumerate() {
                let p = q4_sums::<D, T, 8>(&blk.qs, a, &xrow, b);
                let d = (f16x4(blk.d.as_ptr()), f16x4(blk.d.as_ptr().add(4)));
                for t in 0..T {
                    combine(&mut acc[t], p[t], d, a.d[xrow[t] + b]);
                }
            }
        }
        Packed::Q8(v) => {
            for (b, blk) in v[g * nb..(g + 1) * nb].iter().enumerate() {
                let p = q8_sums::<D, T>(&blk.qs, a, &xrow, b);
                let d = (f16x4(blk.d.as_ptr()), f16x4(blk.d.as_ptr().add(4)));
                for t in 0..T {
                    combine(&mut acc[t], p[t], d, a.d[xrow[t] + b]);
                }
            }
        }
        Packed::Q4K(_) | Packed::Q5K(_) | Packed::Q6K(_) => {
            unreachable!("K-quant groups take Q8_K activations: matmul_packed sends them to the K kernels")
        }
        Packed::Q5(v) => {
            // The codes less 16 are signed bytes: `sum((q - 16) x)` directly.
            for (b, blk) in v[g * nb..(g + 1) * nb].iter().enumerate() {
                let p = q5_sums::<D, T, 32>(&blk.qh, &blk.qs, 16, &a.qs, &xrow, b, 0);
                let d = (f16x4(blk.d.as_ptr()), f16x4(blk.d.as_ptr().add(4)));
                for t in 0..T {
                    combine(&mut acc[t], p[t], d, a.d[xrow[t] + b]);
                }
            }
        }
        Packed::Q5M(v) => {
            for (b, blk) in v[g * nb..(g + 1) * nb].iter().enumerate() {
                let p = q5_sums::<D, T, 32>(&blk.qh, &blk.qs, 0, &a.qs, &xrow, b, 0);
                let d = (f16x4(blk.d.as_ptr()), f16x4(blk.d.as_ptr().add(4)));
                let m = (f16x4(blk.m.as_ptr()), f16x4(blk.m.as_ptr().add(4)));
                for t in 0..T {
                    let k8 = xrow[t] + b;
                    combine(&mut acc[t], p[t], d, a.d[k8]);
                    offset(&mut acc[t], m, a.s[k8]);
                }
            }
        }
    }
    store_group(&acc, w.rows, g, t0, out, ldo);
}

/// # Safety
/// Needs NEON.
pub(super) unsafe fn matmul_packed_k(w: &PackedWeight, a: &Q8KActs, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
    packed_k_all::<Mull>(w, a, out, ldo, g0, g1);
}

/// # Safety
/// Needs NEON and the dot-product extension.
#[target_feature(enable = "dotprod")]
pub(super) unsafe fn matmul_packed_k_sdot(w: &PackedWeight, a: &Q8KActs, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
    packed_k_all::<Sdot>(w, a, out, ldo, g0, g1);
}

#[inline(always)]
unsafe fn packed_k_all<D: Dot>(w: &PackedWeight, a: &Q8KActs, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
    each_tile!(packed_k_tile<D>, w, a, out, ldo, g0, g1);
}

/// One group of 8 packed K-quant rows against `T` tokens: per sub-block the rows' exact
/// integer sums (`D::dot`), times each row's scale; the mins against Q8_K's 32-value sums;
/// then the AVX2 kernel's float operations, half by half.
#[allow(clippy::needless_range_loop)] // `t` indexes several per-token arrays in step
#[inline(always)]
unsafe fn packed_k_tile<D: Dot, const T: usize>(w: &PackedWeight, a: &Q8KActs, g: usize, t0: usize, out: OutPtr, ldo: usize) {
    let nb = w.blocks_per_row();
    let zero = vdupq_n_s32(0);
    let mut acc = [(vdupq_n_f32(0.0), vdupq_n_f32(0.0)); T];
    let xrow: [usize; T] = std::array::from_fn(|t| (t0 + t) * nb);
    for b in 0..nb {
        if let Packed::Q6K(v) = &w.data {
            packed_q6k_block::<D, T>(&v[g * nb + b], a, &xrow, b, &mut acc);
            continue;
        }
        let (d, dmin, scales, mins, q, stride) = match &w.data {
            Packed::Q4K(v) => {
                let x = &v[g * nb + b];
                (&x.d, &x.dmin, &x.scales, &x.mins, &x.qs[..], 128)
            }
            Packed::Q5K(v) => {
                let x = &v[g * nb + b];
                (&x.d, &x.dmin, &x.scales, &x.mins, &x.q[..], 160)
            }
            _ => unreachable!("32-column groups take Q8 activations (matmul_packed)"),
        };
        let mut isum = [(zero, zero); T];
        for j in 0..8 {
            let sub_qh: [u8; 32] = if stride > 128 { q[stride * j + 128..stride * j + 160].try_into().expect("32 bytes") } else { [0; 32] };
            let sub_qs: &[u8; 128] = q[stride * j..stride * j + 128].try_into().expect("128 bytes");
            let p = q5_sums::<D, T, 256>(&sub_qh, sub_qs, 0, &a.qs, &xrow, b, 32 * j);
            let sc = |r: usize| i32::from(scales[8 * j + r]);
            let sc = (vld1q_s32([sc(0), sc(1), sc(2), sc(3)].as_ptr()), vld1q_s32([sc(4), sc(5), sc(6), sc(7)].as_ptr()));
            for t in 0..T {
                isum[t].0 = vmlaq_s32(isum[t].0, p[t].0, sc.0);
                isum[t].1 = vmlaq_s32(isum[t].1, p[t].1, sc.1);
            }
        }
        let m = |j: usize, r: usize| i32::from(mins[16 * (j / 2) + 2 * r + j % 2]);
        let mv: [(int32x4_t, int32x4_t); 8] = std::array::from_fn(|j| {
            (vld1q_s32([m(j, 0), m(j, 1), m(j, 2), m(j, 3)].as_ptr()), vld1q_s32([m(j, 4), m(j, 5), m(j, 6), m(j, 7)].as_ptr()))
        });
        let dv = (f16x4(d.as_ptr()), f16x4(d.as_ptr().add(4)));
        let dmv = (f16x4(dmin.as_ptr()), f16x4(dmin.as_ptr().add(4)));
        for t in 0..T {
            let k8 = xrow[t] + b;
            let bs = &a.bsums[k8];
            let mut ms = (zero, zero);
            for (j, mj) in mv.iter().enumerate() {
                let bj = i32::from(bs[2 * j]) + i32::from(bs[2 * j + 1]);
                ms.0 = vmlaq_n_s32(ms.0, mj.0, bj);
                ms.1 = vmlaq_n_s32(ms.1, mj.1, bj);
            }
            let dx = vdupq_n_f32(a.d[k8]);
            let x0 = vsubq_f32(vmulq_f32(dv.0, vcvtq_f32_s32(isum[t].0)), vmulq_f32(dmv.0, vcvtq_f32_s32(ms.0)));
            let x1 = vsubq_f32(vmulq_f32(dv.1, vcvtq_f32_s32(isum[t].1)), vmulq_f32(dmv.1, vcvtq_f32_s32(ms.1)));
            acc[t].0 = vaddq_f32(acc[t].0, vmulq_f32(dx, x0));
            acc[t].1 = vaddq_f32(acc[t].1, vmulq_f32(dx, x1));
        }
    }
    store_group(&acc, w.rows, g, t0, out, ldo);
}

/// One packed Q6_K block of 8 rows against `T` tokens, added into `acc`: the codes less 32
/// as signed bytes, per 16-value sub-block the rows' exact sums times their scales, then
/// `d d_x` times the integer (the AVX2 kernel's float operations).
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn packed_q6k_block<D: Dot, const T: usize>(
    x: &crate::repack::BlockQ6Kx8,
    a: &Q8KActs,
    xrow: &[usize; T],
    b: usize,
    acc: &mut [(float32x4_t, float32x4_t); T],
) {
    let zero = vdupq_n_s32(0);
    let (m4, m32) = (vdupq_n_u8(0x0F), vdupq_n_s8(32));
    let mut isum = [(zero, zero); T];
    for j in 0..8 {
        let sc = |s: usize| {
            let v = |r: usize| i32::from(x.scales[8 * s + r]);
            (vld1q_s32([v(0), v(1), v(2), v(3)].as_ptr()), vld1q_s32([v(4), v(5), v(6), v(7)].as_ptr()))
        };
        let (sc_lo, sc_hi) = (sc(2 * j), sc(2 * j + 1));
        for k in 0..4 {
            let q = x.q.as_ptr().add(192 * j + 32 * k);
            let hp = x.q.as_ptr().add(192 * j + 128 + 32 * (k / 2));
            let c = 2 * (k % 2);
            let code = |nib: uint8x16_t, h: uint8x16_t, c: usize| {
                let top = vandq_u8(vshlq_u8(h, vdupq_n_s8(4 - 2 * c as i8)), vdupq_n_u8(0x30));
                vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(nib, top)), m32)
            };
            let (w0, w1) = (vld1q_u8(q), vld1q_u8(q.add(16)));
            let (h0, h1) = (vld1q_u8(hp), vld1q_u8(hp.add(16)));
            let lo = (code(vandq_u8(w0, m4), h0, c), code(vandq_u8(w1, m4), h1, c));
            let hi = (code(vshrq_n_u8(w0, 4), h0, c + 1), code(vshrq_n_u8(w1, 4), h1, c + 1));
            for t in 0..T {
                let xq = a.qs[xrow[t] + b].as_ptr().add(32 * j);
                let (xl, xh) = (bcast4(xq.add(4 * k)), bcast4(xq.add(16 + 4 * k)));
                let pl = (D::dot(zero, lo.0, xl), D::dot(zero, lo.1, xl));
                let ph = (D::dot(zero, hi.0, xh), D::dot(zero, hi.1, xh));
                isum[t].0 = vmlaq_s32(vmlaq_s32(isum[t].0, pl.0, sc_lo.0), ph.0, sc_hi.0);
                isum[t].1 = vmlaq_s32(vmlaq_s32(isum[t].1, pl.1, sc_lo.1), ph.1, sc_hi.1);
            }
        }
    }
    let dv = (f16x4(x.d.as_ptr()), f16x4(x.d.as_ptr().add(4)));
    for t in 0..T {
        let dx = vdupq_n_f32(a.d[xrow[t] + b]);
        acc[t].0 = vaddq_f32(acc[t].0, vmulq_f32(vmulq_f32(dv.0, dx), vcvtq_f32_s32(isum[t].0)));
        acc[t].1 = vaddq_f32(acc[t].1, vmulq_f32(vmulq_f32(dv.1, dx), vcvtq_f32_s32(isum[t].1)));
    }
}

/// The 8 rows' integer sums `sum (q - OFF) x` of one packed 4-bit block (codes 0..16) against
/// `T` tokens (`.0` rows 0-3, `.1` rows 4-7).
#[inline(always)]
unsafe fn q4_sums<D: Dot, const T: usize, const OFF: u8>(
    qs: &[u8; 128],
    a: &Q8Acts,
    xrow: &[usize; T],
    b: usize,
) -> [(int32x4_t, int32x4_t); T] {
    let zero = vdupq_n_s32(0);
    let mask = vdupq_n_u8(0x0F);
    let codes = |v: uint8x16_t| vreinterpretq_s8_u8(if OFF == 0 { v } else { vsubq_u8(v, vdupq_n_u8(OFF)) });
    let mut p = [(zero, zero); T];
    for k in 0..4 {
        let q = qs.as_ptr().add(32 * k);
        let (w0, w1) = (vld1q_u8(q), vld1q_u8(q.add(16)));
        let lo = (codes(vandq_u8(w0, mask)), codes(vandq_u8(w1, mask)));
        let hi = (codes(vshrq_n_u8(w0, 4)), codes(vshrq_n_u8(w1, 4)));
        for (t, pt) in p.iter_mut().enumerate() {
            let xq = a.qs[xrow[t] + b].as_ptr();
            let (xl, xh) = (bcast4(xq.add(4 * k)), bcast4(xq.add(16 + 4 * k)));
            pt.0 = D::dot(D::dot(pt.0, lo.0, xl), hi.0, xh);
            pt.1 = D::dot(D::dot(pt.1, lo.1, xl), hi.1, xh);
        }
    }
    p
}

/// The 8 rows' integer sums `sum (q - offset) x` of one packed Q5 block against `T` tokens:
/// each 16-byte half of a load gets its fifth bits from the matching half of `qh`
/// (`vtst` + bit select: bit `b` of `qh`'s byte set means 16 is added).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q5_sums<D: Dot, const T: usize, const N: usize>(
    qh: &[u8; 32],
    qs: &[u8; 128],
    offset: u8,
    x: &[[i8; N]],
    xrow: &[usize; T],
    b: usize,
    col: usize,
) -> [(int32x4_t, int32x4_t); T] {
    let zero = vdupq_n_s32(0);
    let (mask, sixteen, off) = (vdupq_n_u8(0x0F), vdupq_n_u8(0x10), vdupq_n_u8(offset));
    let h = (vld1q_u8(qh.as_ptr()), vld1q_u8(qh.as_ptr().add(16)));
    let codes = |nib: uint8x16_t, h: uint8x16_t, bit: u8| {
        let set = vtstq_u8(h, vdupq_n_u8(1 << bit));
        vreinterpretq_s8_u8(vsubq_u8(vorrq_u8(nib, vandq_u8(set, sixteen)), off))
    };
    let mut p = [(zero, zero); T];
    for k in 0..4 {
        let q = qs.as_ptr().add(32 * k);
        let (w0, w1) = (vld1q_u8(q), vld1q_u8(q.add(16)));
        let bit = 2 * k as u8;
        let lo = (codes(vandq_u8(w0, mask), h.0, bit), codes(vandq_u8(w1, mask), h.1, bit));
        let hi = (codes(vshrq_n_u8(w0, 4), h.0, bit + 1), codes(vshrq_n_u8(w1, 4), h.1, bit + 1));
        for (t, pt) in p.iter_mut().enumerate() {
            let xq = x[xrow[t] + b].as_ptr().add(col);
            let (xl, xh) = (bcast4(xq.add(4 * k)), bcast4(xq.add(16 + 4 * k)));
            pt.0 = D::dot(D::dot(pt.0, lo.0, xl), hi.0, xh);
            pt.1 = D::dot(D::dot(pt.1, lo.1, xl), hi.1, xh);
        }
    }
    p
}

/// Stores a packed tile's sums: token `t0 + t`'s 8 rows of group `g` (those inside the
/// matrix's `rows`) at `out[(t0 + t) * ldo + 8 g ..]`.
#[inline(always)]
unsafe fn store_group<const T: usize>(acc: &[(float32x4_t, float32x4_t); T], rows: usize, g: usize, t0: usize, out: OutPtr, ldo: usize) {
    let r0 = g * ROWS;
    let valid = (rows - r0).min(ROWS);
    for (t, v) in acc.iter().enumerate() {
        let idx = (t0 + t) * ldo + r0;
        if valid == ROWS {
            assert!(idx + ROWS <= out.len, "packed matmul output out of range");
            // SAFETY: idx + 8 <= len (checked); this thread owns rows r0..r0+8.
            vst1q_f32(out.ptr.add(idx), v.0);
            vst1q_f32(out.ptr.add(idx + 4), v.1);
        } else {
            let mut tmp = [0.0f32; ROWS];
            vst1q_f32(tmp.as_mut_ptr(), v.0);
            vst1q_f32(tmp.as_mut_ptr().add(4), v.1);
            for (r, &x) in tmp.iter().enumerate().take(valid) {
                out.write(idx + r, x);
            }
        }
    }
}

/// The 8 rows' integer sums of one 8-bit block against `T` tokens' activations.
#[inline(always)]
unsafe fn q8_sums<D: Dot, const T: usize>(qs: &[i8; 256], a: &Q8Acts, xrow: &[usize; T], b: usize) -> [(int32x4_t, int32x4_t); T] {
    let zero = vdupq_n_s32(0);
    let mut p = [(zero, zero); T];
    for k in 0..8 {
        let (w0, w1) = (vld1q_s8(qs.as_ptr().add(32 * k)), vld1q_s8(qs.as_ptr().add(32 * k + 16)));
        for (t, pt) in p.iter_mut().enumerate() {
            let x = bcast4(a.qs[xrow[t] + b].as_ptr().add(4 * k));
            pt.0 = D::dot(pt.0, w0, x);
            pt.1 = D::dot(pt.1, w1, x);
        }
    }
    p
}

/// How a kernel loads row `t` of a chunk into `lanes` pairs of 4-float vectors (one pair is
/// an AVX2 vector of 8); one implementation per format so each kernel inlines its own loads.
trait RowLoad {
    /// Lanes of 8 channels `c0..c0 + out.len() / 2` of row `t`, two vectors a lane.
    ///
    /// # Safety
    /// Row `t` inside the block and the lanes inside `hd` (checked by the caller).
    unsafe fn load_lanes(&self, t: usize, hd: usize, c0: usize, out: &mut [float32x4_t]);
    /// # Safety
    /// As [`RowLoad::load_lanes`].
    #[inline(always)]
    unsafe fn load(&self, t: usize, hd: usize, lanes: usize, out: &mut [float32x4_t; 64]) {
        self.load_lanes(t, hd, 0, &mut out[..2 * lanes]);
    }
}
struct F32Rows(*const f32);
struct F16Rows(*const u8);
struct I8Rows(*const u8, usize);

impl RowLoad for F32Rows {
    #[inline(always)]
    unsafe fn load_lanes(&self, t: usize, hd: usize, c0: usize, out: &mut [float32x4_t]) {
        let p = self.0.add(t * hd + 8 * c0);
        for (c, slot) in out.iter_mut().enumerate() {
            *slot = vld1q_f32(p.add(4 * c));
        }
    }
}
impl RowLoad for F16Rows {
    #[inline(always)]
    unsafe fn load_lanes(&self, t: usize, hd: usize, c0: usize, out: &mut [float32x4_t]) {
        let p = self.0.add(2 * (t * hd + 8 * c0));
        for (c, slot) in out.iter_mut().enumerate() {
            *slot = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p.add(8 * c).cast())));
        }
    }
}
impl RowLoad for I8Rows {
    #[inline(always)]
    unsafe fn load_lanes(&self, t: usize, hd: usize, c0: usize, out: &mut [float32x4_t]) {
        let sb = self.0.add(2 * t);
        let s = vdupq_n_f32(half::f16::from_le_bytes([*sb, *sb.add(1)]).to_f32());
        let p = self.0.add(self.1 * 2 + t * hd + 8 * c0);
        for c in 0..out.len() / 2 {
            let q = vmovl_s8(vld1_s8(p.add(8 * c).cast()));
            out[2 * c] = vmulq_f32(s, vcvtq_f32_s32(vmovl_s16(vget_low_s16(q))));
            out[2 * c + 1] = vmulq_f32(s, vcvtq_f32_s32(vmovl_high_s16(q)));
        }
    }
}

/// Eight `B`-bit codes (channel order, low bits first) from the `B` bytes at `p`, as two
/// vectors of four u32s: the bytes in every lane, shifted right by each code's offset, masked.
#[inline(always)]
unsafe fn unpack8<const B: usize>(p: *const u8) -> (uint32x4_t, uint32x4_t) {
    // Whole loads, not bytes copied into a stack word and read back (a store-forwarding stall).
    let word = vdupq_n_u32(match B {
        2 => u32::from(p.cast::<u16>().read_unaligned()),
        3 => u32::from(p.cast::<u16>().read_unaligned()) | u32::from(*p.add(2)) << 16,
        _ => p.cast::<u32>().read_unaligned(),
    });
    let b = B as i32;
    let (s0, s1) = ([0, -b, -2 * b, -3 * b], [-4 * b, -5 * b, -6 * b, -7 * b]);
    let mask = vdupq_n_u32((1 << B) - 1);
    (vandq_u32(vshlq_u32(word, vld1q_s32(s0.as_ptr())), mask), vandq_u32(vshlq_u32(word, vld1q_s32(s1.as_ptr())), mask))
}

/// [`KvRows::Channel`]: `(code - zero) * step`, the reference's operations.
struct ChannelRows<const B: usize> {
    codes: *const u8,
    zero: *const f32,
    step: *const f32,
}
/// [`KvRows::Token`]: `scale * levels[code]`.
struct TokenRows<const B: usize> {
    codes: *const u8,
    scales: *const f32,
    levels: [f32; 16],
}

impl<const B: usize> RowLoad for ChannelRows<B> {
    #[inline(always)]
    unsafe fn load_lanes(&self, t: usize, hd: usize, c0: usize, out: &mut [float32x4_t]) {
        let p = self.codes.add((t * hd + 8 * c0) * B / 8);
        for c in 0..out.len() / 2 {
            let (lo, hi) = unpack8::<B>(p.add(c * B));
            for (h, code) in [lo, hi].into_iter().enumerate() {
                let at = 8 * (c0 + c) + 4 * h;
                let v = vsubq_f32(vcvtq_f32_u32(code), vld1q_f32(self.zero.add(at)));
                out[2 * c + h] = vmulq_f32(v, vld1q_f32(self.step.add(at)));
            }
        }
    }
}
impl<const B: usize> TokenRows<B> {
    fn new(codes: *const u8, scales: *const f32, levels: &[f32]) -> Self {
        let mut table = [0.0f32; 16];
        table[..1 << B].copy_from_slice(&levels[..1 << B]);
        Self { codes, scales, levels: table }
    }
}
impl<const B: usize> RowLoad for TokenRows<B> {
    #[inline(always)]
    unsafe fn load_lanes(&self, t: usize, hd: usize, c0: usize, out: &mut [float32x4_t]) {
        let s = vdupq_n_f32(*self.scales.add(t));
        let p = self.codes.add((t * hd + 8 * c0) * B / 8);
        for c in 0..out.len() / 2 {
            let (lo, hi) = unpack8::<B>(p.add(c * B));
            for (h, code) in [lo, hi].into_iter().enumerate() {
                let mut idx = [0u32; 4];
                vst1q_u32(idx.as_mut_ptr(), code);
                let level = idx.map(|i| *self.levels.get_unchecked(i as usize));
                out[2 * c + h] = vmulq_f32(s, vld1q_f32(level.as_ptr()));
            }
        }
    }
}

/// # Safety
/// Needs NEON; `hd` a multiple of 8 up to 256; indices bounded (checked by the caller).
#[allow(clippy::too_many_arguments)]
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
    if let KvRows::Channel { codes, bits, zero, step, .. } = k {
        let args = (codes.as_ptr(), zero.as_ptr(), step.as_ptr());
        match bits {
            2 => scores_channel::<2>(args, q, hd, visible, scale, scores, ld, col0),
            3 => scores_channel::<3>(args, q, hd, visible, scale, scores, ld, col0),
            _ => scores_channel::<4>(args, q, hd, visible, scale, scores, ld, col0),
        }
        return;
    }
    with_rows!(k, rows => scores_with(rows, q, hd, visible, scale, scores, ld, col0));
}

/// The lanes of `lo` and `hi` (an AVX2 vector's halves) added as `super::dot_lanes` does.
#[inline(always)]
unsafe fn hsum_pair(lo: float32x4_t, hi: float32x4_t) -> f32 {
    let s = vaddq_f32(lo, hi);
    let h = vadd_f32(vget_low_f32(s), vget_high_f32(s));
    vget_lane_f32::<0>(h) + vget_lane_f32::<1>(h)
}

/// Scores against channel-wise rows as the reference takes them (AVX2's `scores_channel`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn scores_channel<const B: usize>(
    (codes, zero, step): (*const u8, *const f32, *const f32),
    q: &[f32],
    hd: usize,
    visible: &[usize],
    scale: f32,
    scores: &mut [f32],
    ld: usize,
    col0: usize,
) {
    let lanes = hd / 8;
    // Eight scaled queries (8 KiB), written before they are read (not zeroed each call).
    let mut scaled = std::mem::MaybeUninit::<[float32x4_t; 8 * 64]>::uninit();
    let sp = scaled.as_mut_ptr().cast::<float32x4_t>();
    let mut offset = [0.0f32; 8];
    let mut kv = [vdupq_n_f32(0.0); 64];
    for g0 in (0..visible.len()).step_by(8) {
        let group = &visible[g0..(g0 + 8).min(visible.len())];
        for (j, off) in offset.iter_mut().enumerate().take(group.len()) {
            let qp = q.as_ptr().add((g0 + j) * hd);
            let (mut lo, mut hi) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
            for c in 0..lanes {
                let s0 = vmulq_f32(vld1q_f32(qp.add(8 * c)), vld1q_f32(step.add(8 * c)));
                let s1 = vmulq_f32(vld1q_f32(qp.add(8 * c + 4)), vld1q_f32(step.add(8 * c + 4)));
                sp.add(64 * j + 2 * c).write(s0);
                sp.add(64 * j + 2 * c + 1).write(s1);
                lo = vfmaq_f32(lo, s0, vld1q_f32(zero.add(8 * c)));
                hi = vfmaq_f32(hi, s1, vld1q_f32(zero.add(8 * c + 4)));
            }
            *off = hsum_pair(lo, hi);
        }
        let n = group.iter().copied().max().unwrap_or(0);
        for t in 0..n {
            let p = codes.add(t * hd * B / 8);
            for c in 0..lanes {
                let (lo, hi) = unpack8::<B>(p.add(c * B));
                kv[2 * c] = vcvtq_f32_u32(lo);
                kv[2 * c + 1] = vcvtq_f32_u32(hi);
            }
            for (j, &vis) in group.iter().enumerate() {
                if t >= vis {
                    continue;
                }
                let (mut lo, mut hi) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
                for c in 0..lanes {
                    lo = vfmaq_f32(lo, kv[2 * c], sp.add(64 * j + 2 * c).read());
                    hi = vfmaq_f32(hi, kv[2 * c + 1], sp.add(64 * j + 2 * c + 1).read());
                }
                *scores.get_unchecked_mut((g0 + j) * ld + col0 + t) = (hsum_pair(lo, hi) - offset[j]) * scale;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn scores_with<L: RowLoad>(k: &L, q: &[f32], hd: usize, visible: &[usize], scale: f32, scores: &mut [f32], ld: usize, col0: usize) {
    let lanes = hd / 8;
    let n = visible.iter().copied().max().unwrap_or(0);
    let mut kv = [vdupq_n_f32(0.0); 64];
    for t in 0..n {
        k.load(t, hd, lanes, &mut kv);
        for (i, &vis) in visible.iter().enumerate() {
            if t >= vis {
                continue;
            }
            let qp = q.as_ptr().add(i * hd);
            let (mut lo, mut hi) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
            for c in 0..lanes {
                lo = vfmaq_f32(lo, kv[2 * c], vld1q_f32(qp.add(8 * c)));
                hi = vfmaq_f32(hi, kv[2 * c + 1], vld1q_f32(qp.add(8 * c + 4)));
            }
            // The lanes added as `super::dot_lanes` (and AVX2's) tree.
            let s = vaddq_f32(lo, hi);
            let h = vadd_f32(vget_low_f32(s), vget_high_f32(s));
            *scores.get_unchecked_mut(i * ld + col0 + t) = (vget_lane_f32::<0>(h) + vget_lane_f32::<1>(h)) * scale;
        }
    }
}

/// # Safety
/// Needs NEON; `hd` a multiple of 8 up to 256; indices bounded (checked by the caller).
pub(super) unsafe fn chunk_values(probs: &[f32], ld: usize, col0: usize, v: KvRows, visible: &[usize], hd: usize, out: &mut [f32]) {
    with_rows!(v, rows => values_with(rows, probs, ld, col0, visible, hd, out));
}

#[inline(always)]
unsafe fn values_with<L: RowLoad>(v: &L, probs: &[f32], ld: usize, col0: usize, visible: &[usize], hd: usize, out: &mut [f32]) {
    // Tiles of up to 3 queries by 2 lanes (16 channels) kept in registers over the chunk's
    // tokens, as the AVX2 kernel does (there: why).
    let lanes = hd / 8;
    for q0 in (0..visible.len()).step_by(3) {
        let vis = &visible[q0..(q0 + 3).min(visible.len())];
        let (o, col) = (out.as_mut_ptr().add(q0 * hd), q0 * ld + col0);
        for c0 in (0..lanes).step_by(2) {
            let tile = (v, probs, ld, col, vis, hd, o, c0);
            match (vis.len(), lanes - c0) {
                (3, 2..) => values_tile::<L, 3, 4>(tile),
                (2, 2..) => values_tile::<L, 2, 4>(tile),
                (_, 2..) => values_tile::<L, 1, 4>(tile),
                (3, _) => values_tile::<L, 3, 2>(tile),
                (2, _) => values_tile::<L, 2, 2>(tile),
                (_, _) => values_tile::<L, 1, 2>(tile),
            }
        }
    }
}

/// Rows, probabilities, their stride, the tile's first probability column, its queries'
/// visible counts, `hd`, its first output, its first lane.
type ValuesTile<'a, L> = (&'a L, &'a [f32], usize, usize, &'a [usize], usize, *mut f32, usize);

/// `Q` queries by `N` vectors (`N / 2` lanes) of [`values_with`], accumulated in registers in
/// token order (the reference's order, so the same bits).
#[inline(always)]
unsafe fn values_tile<L: RowLoad, const Q: usize, const N: usize>((v, probs, ld, col, vis, hd, o, c0): ValuesTile<L>) {
    let mut acc = [[vdupq_n_f32(0.0); N]; Q];
    for (i, a) in acc.iter_mut().enumerate() {
        for (c, slot) in a.iter_mut().enumerate() {
            *slot = vld1q_f32(o.add(i * hd + 8 * c0 + 4 * c));
        }
    }
    let n = vis.iter().copied().max().unwrap_or(0);
    let mut row = [vdupq_n_f32(0.0); N];
    for t in 0..n {
        v.load_lanes(t, hd, c0, &mut row);
        for (i, a) in acc.iter_mut().enumerate() {
            if t >= *vis.get_unchecked(i) {
                continue;
            }
            let w = vdupq_n_f32(*probs.get_unchecked(col + i * ld + t));
            for (slot, r) in a.iter_mut().zip(&row) {
                *slot = vfmaq_f32(*slot, w, *r);
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        for (c, slot) in a.iter().enumerate() {
            vst1q_f32(o.add(i * hd + 8 * c0 + 4 * c), *slot);
        }
    }
}

/// [`super::exp_lane`] for 4 lanes, operation for operation (`fmaxnm` is Rust's `f32::max`:
/// a NaN gives the other operand).
#[inline(always)]
unsafe fn exp4(x: float32x4_t) -> float32x4_t {
    use super::{EXP_C, EXP_MIN, EXP_P};
    let x = vmaxnmq_f32(x, vdupq_n_f32(EXP_MIN));
    let n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(std::f32::consts::LOG2_E)));
    let r = vfmsq_f32(x, n, vdupq_n_f32(EXP_C[0]));
    let r = vfmsq_f32(r, n, vdupq_n_f32(EXP_C[1]));
    let mut p = vdupq_n_f32(EXP_P[0]);
    for &c in &EXP_P[1..] {
        p = vfmaq_f32(vdupq_n_f32(c), p, r);
    }
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0)), p, vmulq_f32(r, r));
    let pow2n = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23));
    let y = vmulq_f32(p, pow2n);
    vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(y), vcgtq_f32(x, vdupq_n_f32(EXP_MIN))))
}

/// [`super::silu_mul_ref`] four lanes at a time (`fminnm` is Rust's `f32::min`).
///
/// # Safety
/// Needs NEON; `g` and `u` of one length.
pub(super) unsafe fn silu_mul(g: &mut [f32], u: &[f32]) {
    let n = g.len();
    debug_assert_eq!(n, u.len());
    let (gp, up) = (g.as_mut_ptr(), u.as_ptr());
    let (cap, one) = (vdupq_n_f32(super::EXP_MAX), vdupq_n_f32(1.0));
    let mut i = 0;
    while i + 4 <= n {
        // SAFETY: i + 4 <= n, both rows n long.
        let x = vld1q_f32(gp.add(i));
        let e = exp4(vminnmq_f32(vnegq_f32(x), cap));
        vst1q_f32(gp.add(i), vmulq_f32(vdivq_f32(x, vaddq_f32(one, e)), vld1q_f32(up.add(i))));
        i += 4;
    }
    super::silu_mul_ref(&mut g[i..], &u[i..]);
}

/// # Safety
/// Needs NEON.
pub(super) unsafe fn softmax_f16(row: &mut [f32], max: f32) {
    let m = vdupq_n_f32(max);
    let mut sum = 0.0f64;
    for part in row.chunks_mut(8) {
        // A short last part is padded with -inf (its exp is 0), as every path does.
        let mut e = [f32::NEG_INFINITY; 8];
        e[..part.len()].copy_from_slice(part);
        let lo = exp4(vsubq_f32(vld1q_f32(e.as_ptr()), m));
        let hi = exp4(vsubq_f32(vld1q_f32(e.as_ptr().add(4)), m));
        vst1q_f32(e.as_mut_ptr(), lo);
        vst1q_f32(e.as_mut_ptr().add(4), hi);
        sum += super::sum8(&e);
        part.copy_from_slice(&e[..part.len()]);
    }
    #[allow(clippy::cast_possible_truncation)]
    let inv = (1.0 / sum) as f32;
    let vinv = vdupq_n_f32(inv);
    let mut parts = row.chunks_exact_mut(4);
    for part in &mut parts {
        // Round through f16 and back, 4 at a time (round to nearest even, as `half` does).
        let y = vmulq_f32(vld1q_f32(part.as_ptr()), vinv);
        vst1q_f32(part.as_mut_ptr(), vcvt_f32_f16(vcvt_f16_f32(y)));
    }
    for x in parts.into_remainder() {
        *x = half::f16::from_f32(*x * inv).to_f32();
    }
}

/// Four weights of a float row (F32, F16 or BF16) as f32s: exact conversions, as
/// `quant::dequantize_row` makes them.
trait FloatLoad {
    /// # Safety
    /// Elements `4 * c .. 4 * c + 4` inside the row at `p`.
    unsafe fn at(p: *const u8, c: usize) -> float32x4_t;
    /// The type, for the tail's elements ([`super::float_elem`]).
    const TY: crate::quant::GgmlType;
}
struct F32W;
struct F16W;
struct Bf16W;
impl FloatLoad for F32W {
    const TY: crate::quant::GgmlType = crate::quant::GgmlType::F32;
    #[inline(always)]
    unsafe fn at(p: *const u8, c: usize) -> float32x4_t {
        vld1q_f32(p.add(16 * c).cast())
    }
}
impl FloatLoad for F16W {
    const TY: crate::quant::GgmlType = crate::quant::GgmlType::F16;
    #[inline(always)]
    unsafe fn at(p: *const u8, c: usize) -> float32x4_t {
        f16x4(p.add(8 * c).cast())
    }
}
impl FloatLoad for Bf16W {
    const TY: crate::quant::GgmlType = crate::quant::GgmlType::BF16;
    #[inline(always)]
    unsafe fn at(p: *const u8, c: usize) -> float32x4_t {
        // bf16 is the top half of an f32: widen and shift.
        vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p.add(8 * c).cast())))
    }
}

/// `R` float weight rows (F32/F16/BF16 by `ty`) · `T` f32 activation rows from `t0` (`x`
/// holds rows of `cols`): each sum is [`super::dot_lanes`]'s — element `j` fused into lane
/// `j % 8` in order (lanes 0-3 and 4-7 as two vectors, AVX2's halves), the lanes added as its
/// tree — so every result is the scalar reference's bits. `out[i][t]` is row `i` · token `t0 + t`.
///
/// # Safety
/// Each row holds `cols` elements of `ty`; rows `t0..t0 + T` exist in `x`.
pub(super) unsafe fn dot_float<const R: usize, const T: usize>(
    ty: crate::quant::GgmlType,
    rows: [&[u8]; R],
    x: &[f32],
    cols: usize,
    t0: usize,
) -> [[f32; T]; R] {
    use crate::quant::GgmlType;
    match ty {
        GgmlType::F32 => dot_float_as::<F32W, R, T>(rows, x, cols, t0),
        GgmlType::F16 => dot_float_as::<F16W, R, T>(rows, x, cols, t0),
        _ => dot_float_as::<Bf16W, R, T>(rows, x, cols, t0),
    }
}

#[inline(always)]
#[allow(clippy::needless_range_loop)] // i and t index the accumulators and the activations
unsafe fn dot_float_as<L: FloatLoad, const R: usize, const T: usize>(rows: [&[u8]; R], x: &[f32], cols: usize, t0: usize) -> [[f32; T]; R] {
    let mut acc = [[(vdupq_n_f32(0.0), vdupq_n_f32(0.0)); T]; R];
    let n8 = cols / 8;
    let xp = x.as_ptr().add(t0 * cols);
    for c in 0..n8 {
        let w: [(float32x4_t, float32x4_t); R] =
            std::array::from_fn(|i| (L::at(rows[i].as_ptr(), 2 * c), L::at(rows[i].as_ptr(), 2 * c + 1)));
        for t in 0..T {
            let p = xp.add(t * cols + 8 * c);
            let (xl, xh) = (vld1q_f32(p), vld1q_f32(p.add(4)));
            for i in 0..R {
                acc[i][t] = (vfmaq_f32(acc[i][t].0, w[i].0, xl), vfmaq_f32(acc[i][t].1, w[i].1, xh));
            }
        }
    }
    std::array::from_fn(|i| {
        std::array::from_fn(|t| {
            let mut lanes = [0.0f32; 8];
            vst1q_f32(lanes.as_mut_ptr(), acc[i][t].0);
            vst1q_f32(lanes.as_mut_ptr().add(4), acc[i][t].1);
            for (j, lane) in lanes.iter_mut().enumerate().take(cols - 8 * n8) {
                let e = 8 * n8 + j;
                *lane = super::float_elem(L::TY, rows[i], e).mul_add(x[(t0 + t) * cols + e], *lane);
            }
            let s: [f32; 4] = std::array::from_fn(|l| lanes[l] + lanes[l + 4]);
            (s[0] + s[2]) + (s[1] + s[3])
        })
    })
}

//! The channel-major 4-bit matrices' NEON kernels ([`crate::colmajor`] has the layout and
//! [`crate::colmajor::tile_ref`], the reference they equal bit for bit).
// Needs NEON (checked by the dispatcher); memory contracts where the pointers are read.
#![allow(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
use std::arch::aarch64::*;

use crate::colmajor::{ActiveSet, ColWeight, TILE};
use crate::quant::QK;

/// One tile of 64 rows for token `t`: each active column's 32 bytes widened to i16 codes
/// (rows 0-15, 16-31 from the low nibbles, 32-63 from the high ones), multiplied by the
/// column's input and added in i16 for up to 16 columns (16 * 15 * 127 < 2^15), then in
/// i32; the floats combine as the reference's do.
///
/// # Safety
/// Needs NEON.
pub(crate) unsafe fn tile(w: &ColWeight, a: &ActiveSet, t: usize, tile: usize, y: &mut [f32; TILE]) {
    let (at, rp) = (w.at, w.rows_p);
    let data = w.data.as_ptr();
    let x8 = a.x8.as_ptr().add(t * w.cols);
    let mask = vdupq_n_u8(0x0F);
    let mut yv = [vdupq_n_f32(0.0); TILE / 4];
    for b in 0..a.nb {
        let act = a.block(t, b);
        if act.is_empty() {
            continue;
        }
        let mut acc = [vdupq_n_s32(0); TILE / 4];
        let base = data.add(at.scales + b * at.scale_stride);
        let cols = data.add(at.codes + b * at.block_stride + tile * TILE / 2);
        let xb = x8.add(b * QK);
        for group in act.chunks(16) {
            let mut s16 = [vdupq_n_s16(0); TILE / 8];
            for &j in group {
                let x = i16::from(*xb.add(usize::from(j)));
                // SAFETY: column j's run holds this tile's 32 bytes (ColWeight's layout).
                let p = cols.add(usize::from(j) * at.col_stride);
                let (v0, v1) = (vld1q_u8(p), vld1q_u8(p.add(16)));
                let q = [vandq_u8(v0, mask), vandq_u8(v1, mask), vshrq_n_u8(v0, 4), vshrq_n_u8(v1, 4)];
                for (k, qk) in q.iter().enumerate() {
                    let lo = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(*qk)));
                    let hi = vreinterpretq_s16_u16(vmovl_high_u8(*qk));
                    s16[2 * k] = vmlaq_n_s16(s16[2 * k], lo, x);
                    s16[2 * k + 1] = vmlaq_n_s16(s16[2 * k + 1], hi, x);
                }
            }
            for (k, s) in s16.iter().enumerate() {
                acc[2 * k] = vaddw_s16(acc[2 * k], vget_low_s16(*s));
                acc[2 * k + 1] = vaddw_high_s16(acc[2 * k + 1], *s);
            }
        }
        let sum = vdupq_n_f32(a.sums[t * a.nb + b]);
        let scale = vdupq_n_f32(a.scales[t * a.nb + b]);
        let (ds, ms) = (base.add(2 * tile * TILE).cast::<u16>(), base.add(2 * rp + 2 * tile * TILE).cast::<u16>());
        for (c, yc) in yv.iter_mut().enumerate() {
            // SAFETY: the block's scales hold every padded row's d and m.
            let d = vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(ds.add(4 * c)))), scale);
            let m = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(ms.add(4 * c))));
            *yc = vfmaq_f32(vfmaq_f32(*yc, d, vcvtq_f32_s32(acc[c])), m, sum);
        }
    }
    for (c, v) in yv.iter().enumerate() {
        vst1q_f32(y.as_mut_ptr().add(4 * c), *v);
    }
}

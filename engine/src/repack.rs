//! Load-time repacking of 4- and 8-bit weights into groups of 8 interleaved rows.
//!
//! In a packed block, the scales of 8 rows sit side by side (one `vcvtph2ps` converts them all)
//! and the quantized values are interleaved 4 bytes per row, so that one 32-byte load holds the
//! same 4 (or 8 nibbles) columns of 8 rows. Multiplying it by those 4 activation bytes broadcast
//! to every lane gives each row's partial dot product in its own lane: 8 rows advance together
//! with no horizontal sums, and the 8 results land in one vector ready to store, since outputs
//! are laid out `[token][row]`. This is the layout llama.cpp uses for its Q4_0x8 kernels,
//! applied here to Q4_0, Q4_1 and Q8_0 (the default model's types).
#![allow(clippy::cast_possible_truncation)]

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::quant::{blocks, BlockQ4_0, BlockQ4_1, BlockQ8_0, GgmlType, QK};

/// Rows per packed group.
pub const ROWS: usize = 8;

/// 8 rows x 32 columns of 4-bit weights, `w = q * d + m` (Q4_0 packs with `m = -8 d`, exact in
/// f16). `qs[32k + 4r + j]` holds columns `4k + j` (low nibble) and `16 + 4k + j` (high nibble)
/// of row `r`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4x8 {
    pub d: [f16; ROWS],
    pub m: [f16; ROWS],
    pub qs: [u8; QK * ROWS / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4x8>() == 160);

/// 8 rows x 32 columns of 8-bit weights, `w = q * d`. `qs[32k + 4r + j]` is column `4k + j` of
/// row `r`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ8x8 {
    pub d: [f16; ROWS],
    pub qs: [i8; QK * ROWS],
}
const _: () = assert!(std::mem::size_of::<BlockQ8x8>() == 272);

/// A weight matrix repacked by groups of 8 rows; blocks are stored group-major
/// (`[group][block]`). Rows past `rows` in the last group are zero (scale 0).
#[derive(Debug)]
pub enum Packed {
    Q4(Vec<BlockQ4x8>),
    Q8(Vec<BlockQ8x8>),
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
    pub fn blocks_per_row(&self) -> usize {
        self.cols / QK
    }
    pub fn bytes(&self) -> usize {
        match &self.data {
            Packed::Q4(v) => std::mem::size_of_val(v.as_slice()),
            Packed::Q8(v) => std::mem::size_of_val(v.as_slice()),
        }
    }

    /// Repacks a row-major weight of a supported type; `None` for other types.
    pub fn pack(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Option<Self> {
        let nb = cols / QK;
        let groups = rows.div_ceil(ROWS);
        let row_bytes = ty.row_bytes(cols);
        let packed = match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let mut out = vec![BlockQ4x8::zeroed(); groups * nb];
                for r in 0..rows {
                    let row = &data[r * row_bytes..(r + 1) * row_bytes];
                    let (g, lane) = (r / ROWS, r % ROWS);
                    for b in 0..nb {
                        let (d, m, qs) = if ty == GgmlType::Q4_1 {
                            let blk = &blocks::<BlockQ4_1>(row)[b];
                            (blk.d, blk.m, blk.qs)
                        } else {
                            let blk = &blocks::<BlockQ4_0>(row)[b];
                            (blk.d, f16::from_f32(-8.0 * blk.d.to_f32()), blk.qs)
                        };
                        let o = &mut out[g * nb + b];
                        o.d[lane] = d;
                        o.m[lane] = m;
                        for k in 0..4 {
                            o.qs[32 * k + 4 * lane..32 * k + 4 * lane + 4].copy_from_slice(&qs[4 * k..4 * k + 4]);
                        }
                    }
                }
                Packed::Q4(out)
            }
            GgmlType::Q8_0 => {
                let mut out = vec![BlockQ8x8::zeroed(); groups * nb];
                for r in 0..rows {
                    let row = &data[r * row_bytes..(r + 1) * row_bytes];
                    let (g, lane) = (r / ROWS, r % ROWS);
                    for (b, blk) in blocks::<BlockQ8_0>(row).iter().enumerate() {
                        let o = &mut out[g * nb + b];
                        o.d[lane] = blk.d;
                        for k in 0..8 {
                            o.qs[32 * k + 4 * lane..32 * k + 4 * lane + 4].copy_from_slice(&blk.qs[4 * k..4 * k + 4]);
                        }
                    }
                }
                Packed::Q8(out)
            }
            _ => return None,
        };
        Some(Self { rows, cols, data: packed })
    }
}

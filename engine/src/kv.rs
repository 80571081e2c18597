//! The chunked KV cache: formats, layout, conversion.
//!
//! A context's KV cache is a sequence of chunks of `chunk_tokens` tokens covering all layers.
//! Inside a chunk the data is layer-major, so one layer of a chunk is one contiguous byte range
//! (the recompute pipeline reads flash layer by layer):
//!
//! ```text
//! chunk = [layer 0][layer 1]...      layer = [K head 0][K head 1]..[V head 0][V head 1]..
//! head block (F16)  = values [token][head_dim] f16
//! head block (Int8) = scales [token] f16, codes [token][head_dim] i8      (x = s_t * q)
//! head block (Q4/Q2)= scales [token] f16, per-channel (min i8, step u8) [head_dim],
//!                     codes [token][head_dim] at 4 or 2 bits             (x = s_t * (min_c + code * step_c))
//! head block (Q4R/Q2R) = per token (step f16, min f16), codes [token][head_dim] at 4 or 2 bits,
//!                     of the head vector rotated by H (x = H (min_t + code * step_t))
//! K block (KbVb)    = reference step f16 (negative: whole-step zero points), zero point i8
//!                     [head_dim] (quarter steps), step exponent u4 [head_dim], outliers,
//!                     codes [token][head_dim] at b bits  (x = (code - z_c/4) * ref * 2^(-e_c/6))
//! V block (KbVb)    = scales [token] f16, codes [token][head_dim] at b bits, of the head vector
//!                     rotated by H                           (x = H (s_t * level[code]))
//! ```
//!
//! Int8 is the default base: per-token, per-head symmetric quantization, which can be written
//! one token at a time. Q4 and Q2 are LLMS's lower levels: channel-wise linear quantization of
//! the int8 codes over the chunk's tokens (each channel gets its own offset and step, which
//! tames the outlier channels of K). They exist only for full chunks; converting back to Int8
//! is exact (the reduced values are int8 codes).
//!
//! Q4R and Q2R quantize the values themselves (the f32 the engine computed, or the int8 a
//! chunk holds, dequantized), not int8 codes, after an orthogonal rotation of each head vector:
//! the normalized Walsh-Hadamard transform H over `head_dim` (a power of two), as QuaRot-style
//! KV quantization does. H spreads an outlier channel's energy over every channel, so one
//! step and offset per token (4 bytes) serve the whole vector: q4r costs 0.55x int8's bytes at
//! 16-token chunks where q4 costs 0.64x. Reading decodes and rotates back (H is its own
//! inverse), so attention sees plain K/V rows; the format code says the rotation.
//!
//! The split levels K4V4, K3V3, K2V2 and K4V3 (issue #27) quantize values too, K and V each the way
//! it holds: K channel-wise over the chunk's tokens (its outlier channels keep their range from
//! token to token, KIVI's finding), with parameters small enough for 16-token chunks (12 bits
//! a channel: an i8 zero point in quarter steps and a 4-bit exponent below one f16 reference
//! step); V per token after the rotation, on a Gaussian codebook (the rotated entries are
//! near-Gaussian). K and V
//! blocks differ in size, so a block's size and offset take K=0/V=1. k4v4 is 0.549x int8's
//! bytes on the default model, k4v3 (K at 4 bits, V at 3: V loses less per bit taken) 0.489x,
//! k3v3 0.428x, k2v2 0.307x. k4v4 and k4v3 share their K block: lowering one to the other
//! copies it.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use half::f16;
use half::slice::HalfFloatSliceExt;

/// How a chunk's K/V are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvFormat {
    F16,
    Int8,
    Q4,
    Q2,
    Q4R,
    Q2R,
    K4V4,
    K3V3,
    K2V2,
    /// K at 4 bits, V at 3: V is the half that loses less per bit taken (docs/kv.md).
    K4V3,
}

impl KvFormat {
    /// Every format, in the order of their stored codes (never reorder: records name them).
    pub const ALL: [Self; 10] =
        [Self::F16, Self::Int8, Self::Q4, Self::Q2, Self::Q4R, Self::Q2R, Self::K4V4, Self::K3V3, Self::K2V2, Self::K4V3];

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "f16" => Self::F16,
            "int8" | "q8" => Self::Int8,
            "q4" => Self::Q4,
            "q2" => Self::Q2,
            "q4r" => Self::Q4R,
            "q2r" => Self::Q2R,
            "k4v4" => Self::K4V4,
            "k3v3" => Self::K3V3,
            "k2v2" => Self::K2V2,
            "k4v3" => Self::K4V3,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::F16 => "f16",
            Self::Int8 => "int8",
            Self::Q4 => "q4",
            Self::Q2 => "q2",
            Self::Q4R => "q4r",
            Self::Q2R => "q2r",
            Self::K4V4 => "k4v4",
            Self::K3V3 => "k3v3",
            Self::K2V2 => "k2v2",
            Self::K4V3 => "k4v3",
        }
    }
    /// Whether head vectors (all, or V's for the split levels) are stored rotated by the
    /// Walsh-Hadamard transform.
    pub fn rotated(self) -> bool {
        matches!(self, Self::Q4R | Self::Q2R) || self.split()
    }
    /// The split levels: K channel-wise, V rotated token-wise, each quantized from values.
    pub fn split(self) -> bool {
        matches!(self, Self::K4V4 | Self::K3V3 | Self::K2V2 | Self::K4V3)
    }
    /// Formats tokens can be appended to one at a time.
    pub fn is_base(self) -> bool {
        matches!(self, Self::F16 | Self::Int8)
    }
    /// Bits per value of its K blocks (of its V blocks: [`Self::v_bits`]; they differ in K4V3
    /// only).
    pub fn bits(self) -> usize {
        match self {
            Self::F16 => 16,
            Self::Int8 => 8,
            Self::Q4 | Self::Q4R | Self::K4V4 | Self::K4V3 => 4,
            Self::K3V3 => 3,
            Self::Q2 | Self::Q2R | Self::K2V2 => 2,
        }
    }
    /// Bits per value of its V blocks.
    pub fn v_bits(self) -> usize {
        match self {
            Self::K4V3 => 3,
            f => f.bits(),
        }
    }
    /// Bits per value of its K (`kv` 0) or V (1) blocks.
    pub fn bits_of(self, kv: usize) -> usize {
        if kv == 0 {
            self.bits()
        } else {
            self.v_bits()
        }
    }
    /// Bits per value over K and V.
    #[allow(clippy::cast_precision_loss)]
    pub fn mean_bits(self) -> f64 {
        (self.bits() + self.v_bits()) as f64 / 2.0
    }
    /// Largest code of a reduced level.
    fn levels(self) -> i32 {
        match self {
            Self::Q4 | Self::Q4R => 15,
            Self::Q2 | Self::Q2R => 3,
            _ => 0,
        }
    }
}

/// The shape of every chunk of a model's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub chunk_tokens: usize,
}

impl KvGeometry {
    /// Bytes of one (layer, K=0/V=1, head) block (K and V blocks differ in the split levels).
    pub fn head_block_bytes(&self, f: KvFormat, kv: usize) -> usize {
        let (t, hd) = (self.chunk_tokens, self.head_dim);
        let codes = (t * hd * f.bits_of(kv)).div_ceil(8);
        match f {
            _ if f.split() && kv == 0 => split_k_header(t, hd) + codes,
            _ if f.split() => split_v_header(t) + codes,
            KvFormat::F16 => t * hd * 2,
            KvFormat::Int8 => t * 2 + t * hd,
            KvFormat::Q4 | KvFormat::Q2 => t * 2 + hd * 2 + codes,
            _ => t * 4 + codes,
        }
    }
    pub fn layer_bytes(&self, f: KvFormat) -> usize {
        self.n_kv_heads * (self.head_block_bytes(f, 0) + self.head_block_bytes(f, 1))
    }
    /// Bytes of a whole chunk in a format: a lower level takes proportionally fewer pages.
    pub fn chunk_bytes(&self, f: KvFormat) -> usize {
        self.n_layers * self.layer_bytes(f)
    }
    /// Byte range of one layer inside a chunk.
    pub fn layer_range(&self, f: KvFormat, layer: usize) -> std::ops::Range<usize> {
        let b = self.layer_bytes(f);
        layer * b..(layer + 1) * b
    }
    /// Offset of a (layer, K=0/V=1, head) block.
    pub fn block_offset(&self, f: KvFormat, layer: usize, kv: usize, head: usize) -> usize {
        layer * self.layer_bytes(f) + kv * self.n_kv_heads * self.head_block_bytes(f, 0) + head * self.head_block_bytes(f, kv)
    }
    /// The largest chunk over every format (what a slot must hold).
    pub fn max_chunk_bytes(&self) -> usize {
        self.chunk_bytes(KvFormat::F16).max(self.chunk_bytes(KvFormat::Int8))
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()
}

fn put_f16(b: &mut [u8], i: usize, v: f32) {
    b[2 * i..2 * i + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// An int8 row's codes: `out[i] = round(x[i] * inv)`, clamped to ±127, NaN to 0, halves away
/// from zero. The cache's writers take one ([`write_token_with`]): the model hands in the
/// vector kernel (`kernels::int8_codes`, the same bytes), which sits above this module.
pub type Int8Codes = fn(&[f32], f32, &mut [u8]);

/// The scalar [`Int8Codes`].
pub fn int8_codes_ref(x: &[f32], inv: f32, out: &mut [u8]) {
    for (c, &v) in out.iter_mut().zip(x) {
        *c = round_i8(v * inv) as u8;
    }
}

/// Writes one token's head vector into a base-format head block.
pub fn write_token(f: KvFormat, blk: &mut [u8], t: usize, t_cap: usize, x: &[f32]) {
    write_token_with(f, blk, t, t_cap, x, int8_codes_ref);
}

/// [`write_token`], an int8 row's codes computed by `codes`.
pub fn write_token_with(f: KvFormat, blk: &mut [u8], t: usize, t_cap: usize, x: &[f32], codes: Int8Codes) {
    let hd = x.len();
    match f {
        KvFormat::F16 => {
            let row = &mut blk[2 * t * hd..2 * (t + 1) * hd];
            // The row in one conversion (F16C where the CPU has it): a checked store per value
            // was ~1% of a 1.7B model's decode, on the one thread between its products. The
            // same rounding either way.
            match bytemuck::try_cast_slice_mut::<u8, f16>(row) {
                Ok(h) if cfg!(target_endian = "little") => h.convert_from_f32_slice(x),
                _ => {
                    for (i, &v) in x.iter().enumerate() {
                        put_f16(row, i, v);
                    }
                }
            }
        }
        KvFormat::Int8 => {
            // The largest magnitude eight lanes at a time (one chain of `max` was a dependent
            // instruction per value); `max` is exact and ignores NaN, so any order gives it.
            let mut lanes = [0.0f32; 8];
            let mut chunks = x.chunks_exact(8);
            for c in &mut chunks {
                for (m, v) in lanes.iter_mut().zip(c) {
                    *m = m.max(v.abs());
                }
            }
            let amax = chunks.remainder().iter().chain(&lanes).fold(0.0f32, |m, v| m.max(v.abs()));
            // The stored (f16) scale is the one the codes are computed with, so decoding
            // reproduces exactly what attention and recompute see.
            let s = f16::from_f32(amax / 127.0).to_f32();
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            put_f16(blk, t, s);
            codes(x, inv, &mut blk[t_cap * 2 + t * hd..t_cap * 2 + (t + 1) * hd]);
        }
        _ => {
            panic!("tokens are appended only to base-format chunks (f16, int8)")
        }
    }
}

/// The normalized fast Walsh-Hadamard transform of `x` in place (`x.len()` a power of two):
/// orthogonal and symmetric, so it is its own inverse and keeps dot products.
pub fn fwht(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    #[allow(clippy::cast_precision_loss)]
    let norm = 1.0 / (n as f32).sqrt();
    for v in x.iter_mut() {
        *v *= norm;
    }
}

/// Whether a rotated format can hold heads of `hd` channels.
pub fn rotation_fits(hd: usize) -> bool {
    hd.is_power_of_two() && hd <= MAX_FAST_HD
}

/// Decodes `n` tokens of a Q4R/Q2R block: codes to rotated values, then rotated back.
fn read_rotated(f: KvFormat, blk: &[u8], t_cap: usize, hd: usize, n: usize, out: &mut [f32]) {
    let bits = f.bits();
    let data = &blk[t_cap * 4..];
    let mask = (1u8 << bits) - 1;
    for (t, o) in out[..n * hd].chunks_exact_mut(hd).enumerate() {
        let (step, lo) = (f16_at(blk, 2 * t), f16_at(blk, 2 * t + 1));
        for (c, v) in o.iter_mut().enumerate() {
            let idx = (t * hd + c) * bits;
            let code = (data[idx / 8] >> (idx % 8)) & mask;
            *v = lo + f32::from(code) * step;
        }
        fwht(o);
    }
}

/// Encodes `n` tokens' values into a Q4R/Q2R block: each head vector rotated, then quantized
/// with its own step and offset (both rounded to f16 first, so decoding sees the same ones).
fn write_rotated(f: KvFormat, blk: &mut [u8], t_cap: usize, hd: usize, n: usize, vals: &[f32]) {
    let bits = f.bits();
    #[allow(clippy::cast_precision_loss)]
    let levels = f.levels() as f32;
    let (params, data) = blk.split_at_mut(t_cap * 4);
    data[..(t_cap * hd * bits).div_ceil(8)].fill(0);
    let mut r = vec![0.0f32; hd];
    for t in 0..n {
        r.copy_from_slice(&vals[t * hd..(t + 1) * hd]);
        fwht(&mut r);
        let (lo, hi) = r.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| (a.min(v), b.max(v)));
        let lo = f16::from_f32(lo).to_f32();
        let step = f16::from_f32((hi - lo) / levels).to_f32();
        put_f16(params, 2 * t, step);
        put_f16(params, 2 * t + 1, lo);
        let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
        for (c, &v) in r.iter().enumerate() {
            let code = ((v - lo) * inv).round().clamp(0.0, levels) as u8;
            let idx = (t * hd + c) * bits;
            data[idx / 8] |= code << (idx % 8);
        }
    }
}

/// Encodes `n` tokens' values `[token][head_dim]` into a head block of any format (Q4/Q2 go
/// through int8 codes, as they are defined).
pub fn write_block_f32(f: KvFormat, kv: usize, blk: &mut [u8], t_cap: usize, hd: usize, n: usize, vals: &[f32]) {
    match f {
        _ if f.split() && kv == 0 => write_split_k(f.bits(), blk, t_cap, hd, n, vals),
        _ if f.split() => write_split_v(f.v_bits(), blk, t_cap, hd, n, vals),
        KvFormat::F16 | KvFormat::Int8 => {
            for t in 0..n {
                write_token(f, blk, t, t_cap, &vals[t * hd..(t + 1) * hd]);
            }
        }
        KvFormat::Q4R | KvFormat::Q2R => write_rotated(f, blk, t_cap, hd, n, vals),
        _ => {
            let mut tmp = vec![0u8; t_cap * 2 + t_cap * hd];
            for t in 0..n {
                write_token(KvFormat::Int8, &mut tmp, t, t_cap, &vals[t * hd..(t + 1) * hd]);
            }
            let (mut scales, mut codes) = (vec![0.0f32; t_cap], vec![0i8; t_cap * hd]);
            read_block_i8(KvFormat::Int8, kv, &tmp, t_cap, hd, n, &mut scales, &mut codes);
            write_block_i8(f, kv, blk, t_cap, hd, n, &scales, &codes);
        }
    }
}

/// Decodes `n` tokens of a head block to f32 `[token][head_dim]`: `scale x code`, bit for bit
/// what [`read_block_i8`] gives. This is on attention's path for every reduced chunk of every
/// tile of every prefill, so it decodes in place, without allocating, whole bytes at a time.
pub fn read_block_f32(f: KvFormat, kv: usize, blk: &[u8], t_cap: usize, hd: usize, n: usize, out: &mut [f32]) {
    match f {
        _ if f.split() && kv == 0 => read_split_k(f.bits(), blk, t_cap, hd, n, out),
        _ if f.split() => read_split_v(f.v_bits(), blk, t_cap, hd, n, out),
        KvFormat::F16 => {
            for (i, o) in out[..n * hd].iter_mut().enumerate() {
                *o = f16_at(blk, i);
            }
        }
        KvFormat::Int8 => {
            let codes = &blk[t_cap * 2..t_cap * 2 + n * hd];
            for (t, (o, c)) in out[..n * hd].chunks_exact_mut(hd).zip(codes.chunks_exact(hd)).enumerate() {
                let s = f16_at(blk, t);
                for (o, &b) in o.iter_mut().zip(c) {
                    *o = s * f32::from(b as i8);
                }
            }
        }
        KvFormat::Q4R | KvFormat::Q2R => read_rotated(f, blk, t_cap, hd, n, out),
        _ => {
            let bits = f.bits();
            let per_byte = 8 / bits;
            if !hd.is_multiple_of(per_byte) || hd > MAX_FAST_HD {
                // Rows that do not start on a byte (or unusually wide heads): the general path.
                let (mut codes, mut scales) = (vec![0i8; n * hd], vec![0.0f32; n]);
                read_block_i8(f, kv, blk, t_cap, hd, n, &mut scales, &mut codes);
                for (i, o) in out[..n * hd].iter_mut().enumerate() {
                    *o = scales[i / hd] * f32::from(codes[i]);
                }
                return;
            }
            // Per channel: value(code) = clamp(lo + code * step, ±127); all small integers, so
            // exact in f32.
            let params = &blk[t_cap * 2..t_cap * 2 + hd * 2];
            let (mut lo, mut step) = ([0.0f32; MAX_FAST_HD], [0.0f32; MAX_FAST_HD]);
            for c in 0..hd {
                lo[c] = f32::from(params[2 * c] as i8);
                step[c] = f32::from(params[2 * c + 1]);
            }
            let data = &blk[t_cap * 2 + hd * 2..];
            if bits == 4 {
                decode_rows::<4>(data, blk, &lo[..hd], &step[..hd], n, out);
            } else {
                decode_rows::<2>(data, blk, &lo[..hd], &step[..hd], n, out);
            }
        }
    }
}

/// A byte's codes as floats (low bits first), looked up: one copy per byte instead of a
/// shift, mask and conversion per code.
const fn code_table(bits: u32) -> [[f32; 4]; 256] {
    let mut t = [[0.0f32; 4]; 256];
    let mask = (1u32 << bits) - 1;
    let mut b = 0;
    while b < 256 {
        let mut k = 0;
        while k < 8 / bits {
            t[b][k as usize] = ((b as u32 >> (k * bits)) & mask) as f32;
            k += 1;
        }
        b += 1;
    }
    t
}

static CODES4: [[f32; 4]; 256] = code_table(4);
static CODES2: [[f32; 4]; 256] = code_table(2);

/// The Q4/Q2 rows of a block: codes unpacked to a row of floats first, then one pass of
/// element-wise arithmetic the compiler turns into vector instructions (attention decodes
/// every reduced block of a context at each token, so this loop is on the decode path). The
/// operations and their order are the scalar formula's: the same bits.
fn decode_rows<const BITS: usize>(data: &[u8], blk: &[u8], lo: &[f32], step: &[f32], n: usize, out: &mut [f32]) {
    let hd = lo.len();
    let per_byte = 8 / BITS;
    let row = hd / per_byte;
    let table = if BITS == 4 { &CODES4 } else { &CODES2 };
    let mut codes = [0.0f32; MAX_FAST_HD];
    for (t, o) in out[..n * hd].chunks_exact_mut(hd).enumerate() {
        let s = f16_at(blk, t);
        for (dst, &b) in codes[..hd].chunks_exact_mut(per_byte).zip(&data[t * row..(t + 1) * row]) {
            dst.copy_from_slice(&table[usize::from(b)][..per_byte]);
        }
        for (((o, &c), &l), &st) in o.iter_mut().zip(&codes[..hd]).zip(lo).zip(step) {
            let v = l + c * st;
            *o = s * v.clamp(-127.0, 127.0);
        }
    }
}

/// The rows of [`decode_block_to_int8`]. Channel `PER * j + k` is code `k` of byte `j`, so the
/// parameters are laid out by `k` once per block, and each output word (the `PER` channels of
/// one byte) is `PER` shifts, multiply-adds in i16 and clamps (`lo` in [-128, 127],
/// `code * step` <= 15 x 255: the sum fits) packed little-endian. x86_64 with AVX2 runs
/// [`decode_rows_to_int8_avx2`] instead (this loop took ~4x its share of a q4 decode profile
/// there, perf); elsewhere (aarch64) it is what runs, its speed not measured on ARM.
pub(crate) fn decode_rows_to_int8<const BITS: usize, const PER: usize>(blk: &[u8], t_cap: usize, hd: usize, n: usize, out: &mut [u8]) {
    const MAXB: usize = MAX_FAST_HD / 2;
    let row = hd / PER;
    let params = &blk[t_cap * 2..t_cap * 2 + hd * 2];
    let (mut lo, mut step) = ([[0i16; MAXB]; PER], [[0i16; MAXB]; PER]);
    for c in 0..hd {
        lo[c % PER][c / PER] = i16::from(params[2 * c] as i8);
        step[c % PER][c / PER] = i16::from(params[2 * c + 1]);
    }
    out[..n * 2].copy_from_slice(&blk[..n * 2]);
    let data = &blk[t_cap * 2 + hd * 2..];
    let mask = (1u8 << BITS) - 1;
    let rows = data[..n * row].chunks_exact(row).zip(out[t_cap * 2..t_cap * 2 + n * hd].chunks_exact_mut(hd));
    // One output word per byte, built in a register and stored whole (u16 for two channels a
    // byte, u32 for four), so no byte is interleaved by hand.
    let val = |k: usize, j: usize, b: u8| {
        let code = i16::from((b >> (k * BITS)) & mask);
        (lo[k][j] + code * step[k][j]).clamp(-127, 127) as i8 as u8
    };
    if PER == 2 {
        for (bytes, dst) in rows {
            for (j, (d, &b)) in dst.chunks_exact_mut(2).zip(bytes).enumerate() {
                d.copy_from_slice(&u16::from_le_bytes([val(0, j, b), val(1, j, b)]).to_le_bytes());
            }
        }
    } else {
        for (bytes, dst) in rows {
            for (j, (d, &b)) in dst.chunks_exact_mut(4).zip(bytes).enumerate() {
                d.copy_from_slice(&u32::from_le_bytes([val(0, j, b), val(1, j, b), val(2, j, b), val(3, j, b)]).to_le_bytes());
            }
        }
    }
}

/// Whether [`decode_block_to_int8`] takes blocks of this format and head width.
pub fn decodes_to_int8(f: KvFormat, hd: usize) -> bool {
    matches!(f, KvFormat::Q4 | KvFormat::Q2) && hd.is_multiple_of(8 / f.bits()) && hd <= MAX_FAST_HD
}

/// Decodes the first `n` tokens of a Q4/Q2 head block into an Int8 head block of the same
/// `t_cap` (the per-token f16 scales copied, each channel's `clamp(lo + code * step, ±127)` as
/// the code): exact, since the reduced levels hold int8 codes. Attention then reads the result
/// with the int8 kernel, giving the bits [`read_block_f32`] would (`scale x code` either way)
/// from a quarter of the bytes an f32 decode writes and reads: the decoded blocks of a whole
/// context are made again at every token, so their size is the cost. Returns `false` (nothing
/// written) for another format or a head the byte-at-a-time path does not take. The scalar
/// reference; attention decodes with `kernels::decode_block_to_int8`, the same bytes.
pub fn decode_block_to_int8(f: KvFormat, blk: &[u8], t_cap: usize, hd: usize, n: usize, out: &mut [u8]) -> bool {
    if !decodes_to_int8(f, hd) || n > t_cap {
        return false;
    }
    if f.bits() == 4 {
        decode_rows_to_int8::<4, 2>(blk, t_cap, hd, n, out);
    } else {
        decode_rows_to_int8::<2, 4>(blk, t_cap, hd, n, out);
    }
    true
}

/// Widest head the byte-at-a-time decoder handles with its stack tables (Llama-family heads are
/// 64-128 wide).
pub(crate) const MAX_FAST_HD: usize = 256;

/// Decodes `n` tokens of an Int8/Q4/Q2 head block to per-token scales and int8 codes (a
/// Q4R/Q2R block is decoded and quantized to int8 per token).
#[allow(clippy::too_many_arguments)]
pub fn read_block_i8(f: KvFormat, kv: usize, blk: &[u8], t_cap: usize, hd: usize, n: usize, scales: &mut [f32], codes: &mut [i8]) {
    if f.rotated() {
        let mut vals = vec![0.0f32; n * hd];
        read_block_f32(f, kv, blk, t_cap, hd, n, &mut vals);
        let mut tmp = vec![0u8; t_cap * 2 + t_cap * hd];
        write_block_f32(KvFormat::Int8, kv, &mut tmp, t_cap, hd, n, &vals);
        return read_block_i8(KvFormat::Int8, kv, &tmp, t_cap, hd, n, scales, codes);
    }
    for (t, s) in scales[..n].iter_mut().enumerate() {
        *s = f16_at(blk, t);
    }
    match f {
        KvFormat::Int8 => {
            for (c, &b) in codes[..n * hd].iter_mut().zip(&blk[t_cap * 2..t_cap * 2 + n * hd]) {
                *c = b as i8;
            }
        }
        KvFormat::Q4 | KvFormat::Q2 => {
            let params = &blk[t_cap * 2..t_cap * 2 + hd * 2];
            let data = &blk[t_cap * 2 + hd * 2..];
            let bits = f.bits();
            let mask = (1u8 << bits) - 1;
            for t in 0..n {
                for c in 0..hd {
                    let idx = (t * hd + c) * bits;
                    let code = (data[idx / 8] >> (idx % 8)) & mask;
                    let v = i32::from(params[2 * c] as i8) + i32::from(code) * i32::from(params[2 * c + 1]);
                    codes[t * hd + c] = v.clamp(-127, 127) as i8;
                }
            }
        }
        KvFormat::F16 => panic!("read_block_i8 on an f16 block"),
        _ => unreachable!("decoded above"),
    }
}

/// Encodes per-token scales and int8 codes of `n` tokens into an Int8/Q4/Q2 head block.
#[allow(clippy::too_many_arguments)]
pub fn write_block_i8(f: KvFormat, kv: usize, blk: &mut [u8], t_cap: usize, hd: usize, n: usize, scales: &[f32], codes: &[i8]) {
    if f.rotated() {
        let vals: Vec<f32> = (0..n * hd).map(|i| scales[i / hd] * f32::from(codes[i])).collect();
        return write_block_f32(f, kv, blk, t_cap, hd, n, &vals);
    }
    for (t, &s) in scales[..n].iter().enumerate() {
        put_f16(blk, t, s);
    }
    match f {
        KvFormat::Int8 => {
            for (b, &c) in blk[t_cap * 2..t_cap * 2 + n * hd].iter_mut().zip(codes) {
                *b = c as u8;
            }
        }
        KvFormat::Q4 | KvFormat::Q2 => {
            let levels = f.levels();
            let bits = f.bits();
            let (params, data) = blk[t_cap * 2..].split_at_mut(hd * 2);
            data[..(t_cap * hd * bits).div_ceil(8)].fill(0);
            for c in 0..hd {
                let (mut lo, mut hi) = (127i32, -127i32);
                for t in 0..n {
                    let v = i32::from(codes[t * hd + c]);
                    lo = lo.min(v);
                    hi = hi.max(v);
                }
                if n == 0 {
                    (lo, hi) = (0, 0);
                }
                // The smallest step whose `levels` steps span the channel's range.
                let step = ((hi - lo) + levels - 1) / levels;
                let step = step.clamp(1, 255);
                params[2 * c] = lo as i8 as u8;
                params[2 * c + 1] = step as u8;
                for t in 0..n {
                    let v = i32::from(codes[t * hd + c]);
                    let code = ((v - lo) as f32 / step as f32).round().clamp(0.0, levels as f32) as u8;
                    let idx = (t * hd + c) * bits;
                    data[idx / 8] |= code << (idx % 8);
                }
            }
        }
        KvFormat::F16 => panic!("write_block_i8 into an f16 block"),
        _ => unreachable!("encoded above"),
    }
}

/// Converts the first `n` tokens of a whole chunk from one format to another, block by block.
/// Lowering to Q4/Q2 quantizes the int8 codes per channel; F16 goes through int8 when lowered.
/// To and from Q4R/Q2R the values go through f32 (the int8 a chunk holds, dequantized).
/// Between split levels whose K has the same bits (k4v4 to k4v3) the K blocks are copied.
pub fn convert_chunk(g: &KvGeometry, from: KvFormat, src: &[u8], to: KvFormat, dst: &mut [u8], n: usize) {
    let (t_cap, hd) = (g.chunk_tokens, g.head_dim);
    let mut vals = vec![0.0f32; t_cap * hd];
    let mut scales = vec![0.0f32; t_cap];
    let mut codes = vec![0i8; t_cap * hd];
    for layer in 0..g.n_layers {
        for kv in 0..2 {
            for h in 0..g.n_kv_heads {
                let s = &src[g.block_offset(from, layer, kv, h)..][..g.head_block_bytes(from, kv)];
                let d = &mut dst[g.block_offset(to, layer, kv, h)..][..g.head_block_bytes(to, kv)];
                match (from, to) {
                    // K (or V) blocks of two split levels with its bits alike are the same block.
                    _ if from.split() && to.split() && from.bits_of(kv) == to.bits_of(kv) => d.copy_from_slice(s),
                    // 4-bit V codes refine 3-bit ones: lowered, they keep their scales and drop a bit.
                    _ if kv == 1 && from.split() && to.split() && (from.v_bits(), to.v_bits()) == (4, 3) => lower_split_v(s, d, t_cap, hd),
                    _ if from.rotated() || to.rotated() => {
                        read_block_f32(from, kv, s, t_cap, hd, n, &mut vals);
                        write_block_f32(to, kv, d, t_cap, hd, n, &vals);
                    }
                    (_, KvFormat::F16) => {
                        read_block_f32(from, kv, s, t_cap, hd, n, &mut vals);
                        for (i, &v) in vals[..n * hd].iter().enumerate() {
                            put_f16(d, i, v);
                        }
                    }
                    (KvFormat::F16, _) => {
                        read_block_f32(from, kv, s, t_cap, hd, n, &mut vals);
                        let mut tmp = vec![0u8; g.head_block_bytes(KvFormat::Int8, kv)];
                        for t in 0..n {
                            write_token(KvFormat::Int8, &mut tmp, t, t_cap, &vals[t * hd..(t + 1) * hd]);
                        }
                        read_block_i8(KvFormat::Int8, kv, &tmp, t_cap, hd, n, &mut scales, &mut codes);
                        write_block_i8(to, kv, d, t_cap, hd, n, &scales, &codes);
                    }
                    _ => {
                        read_block_i8(from, kv, s, t_cap, hd, n, &mut scales, &mut codes);
                        write_block_i8(to, kv, d, t_cap, hd, n, &scales, &codes);
                    }
                }
            }
        }
    }
}

// ---- The split levels (K4V4, K3V3, K2V2, K4V3): K channel-wise, V rotated token-wise ----
// Their heads are at most MAX_FAST_HD wide and a power of two (`rotation_fits`, which
// `ChunkedKv::set_format` checks before making one).

/// 2^(-e/6) for e in 0..6; larger exponents scale by powers of two (exact), so the step of
/// every exponent is the same f32 on every CPU.
const SIXTH_POW: [f32; 6] = [1.0, 0.890_898_7, 0.793_700_5, 0.707_106_77, 0.629_960_54, 0.561_231];

/// A K channel's step: the block's reference step scaled by its table's entry for `e` in
/// 0..16. The fine table, 2^(-e/6) (5.66x below the reference at most): steps 12% apart over
/// 2.5 octaves spend the exponent's 4 bits where channels need them — at 2^(-e/4) (19% apart,
/// 3.75 octaves) K alone lost 12% more (docs/kv.md, "K's parameters at the same 12 bits").
fn k_step(table: &[f32; 16], reference: f32, e: u8) -> f32 {
    reference * table[usize::from(e & 0xF)]
}

/// 2^(-e/6 x `sixths`) for every exponent: `SIXTH_POW` over a power of two, exact, so a step
/// is one multiplication (attention derives every K block's steps when it reads the block).
const fn k_step_table(sixths: usize) -> [f32; 16] {
    let mut t = [0.0f32; 16];
    let mut e = 0;
    while e < 16 {
        t[e] = SIXTH_POW[(sixths * e) % 6] / (1u32 << (sixths * e / 6)) as f32;
        e += 1;
    }
    t
}

/// The fine table, 2^(-e/6). (Statics, not consts: a block's table is one of two addresses.)
static K_STEP_SCALE: [f32; 16] = k_step_table(1);
/// The wide table: for a block whose channels' ranges lie further apart than
/// the fine table reaches (Gemma 3's one KV head of 256 channels: a third of its channels
/// asked for steps 4-128x below the block's widest, where the fine table stops at 5.66x).
/// 2^(-e/3): steps 26% apart over 5 octaves; 2^(-e/2) (7.5 octaves) lost more on Gemma's
/// texts (docs/notes/kv.md, "A wide step table").
static K_STEP_WIDE: [f32; 16] = k_step_table(2);

/// A K channel's zero point is an i8 in units of its step: a quarter step (`x = (code - z/4) x
/// step`), so a channel's grid can sit a quarter step off zero where whole steps made its range
/// take up to a step more than it spans — unless the block's reference is stored negative:
/// then whole steps, for a block with a channel whose middle lies too far from zero for a
/// quarter-step zero point (+-32 steps) to reach with the steps the others need
/// ([`write_split_k`] keeps whichever codes the block with less error).
const K_ZERO_QUARTER: f32 = 0.25;

/// How far (in steps) an i8 zero point in `unit` steps reaches.
fn k_zero_reach(unit: f32) -> f32 {
    127.0 * unit
}

/// A stored K reference (an f16's bits): (the reference step, the zero points' unit, the step
/// table). Its sign says the unit, the lowest bit of its mantissa the table (the encoder
/// rounds the reference up to the f16 whose lowest bit says the table it chose).
fn k_reference(bits: u16) -> (f32, f32, &'static [f32; 16]) {
    let table = if bits & 1 == 1 { &K_STEP_WIDE } else { &K_STEP_SCALE };
    let stored = f16::from_bits(bits).to_f32();
    if stored.is_sign_negative() {
        (-stored, 1.0, table)
    } else {
        (stored, K_ZERO_QUARTER, table)
    }
}

/// The f16 bits of a K reference: `reference` rounded up to the f16 whose lowest mantissa bit
/// says the table (`wide`), negative for whole-step zero points.
fn k_reference_bits(reference: f32, wide: bool, whole: bool) -> u16 {
    let mut bits = f16::from_f32(f16_up(reference)).to_bits();
    if (bits & 1 == 1) != wide {
        bits += 1;
    }
    if whole {
        bits |= 0x8000;
    }
    bits
}

/// The V codebooks, in units of a token's scale. 3 and 2 bits: the quantiles of a unit
/// Gaussian (what a Walsh-Hadamard-rotated head vector's entries look like) at the middles of
/// 2^bits equal-probability bins (NF4-style); measured beside Lloyd-Max's levels for a
/// Gaussian (docs/kv.md), these lost as little or less in every pairing but one.
///
/// 4 bits refine 3: code `2j + r` is 3-bit code `j` (the nearest 3-bit level) and `r` the
/// nearer of the two levels inside that level's cell, so a 4-bit block lowered to 3 bits (the
/// mix lowers k4v4 to k4v3 as a context grows) keeps its scales and drops a bit: each 3-bit
/// code is the level nearest the value itself, not the level nearest its 4-bit decoding.
/// Lowered by decoding and quantizing again, V was quantized twice (relative squared error over
/// the model's V 0.03190 against 0.02963 quantized once; [`v_scale_cost`] for what the shared
/// scales cost each level). The refining levels are the mean of each half cell over the
/// model's V (`llms perplexity --kv k4v4`, GPL-3 and heapq.py, 8 windows each: the same to
/// 0.05 on both), in a unit that makes them integers up to 127 (attention looks 4-bit codes up
/// by a byte shuffle); the 3-bit levels are NF3's in that unit.
const V_LEVELS4_I8: [i8; 16] = [-127, -100, -75, -58, -43, -30, -17, -6, 6, 17, 30, 43, 58, 75, 100, 127];
/// NF3's unit in the 4-bit one: the outermost half cell's mean (the outermost 4-bit level)
/// measured 142.9 in NF3's unit.
const NF3_UNIT: f32 = 127.0 / 142.9;
const NF3: [i8; 8] = [-127, -73, -40, -13, 13, 40, 73, 127];
const NF2: [i8; 4] = [-127, -35, 35, 127];

const fn levels_f32<const N: usize>(l: [i8; N], unit: f32) -> [f32; N] {
    let mut out = [0.0f32; N];
    let mut i = 0;
    while i < N {
        out[i] = l[i] as f32 * unit;
        i += 1;
    }
    out
}
static V_LEVELS4: [f32; 16] = levels_f32(V_LEVELS4_I8, 1.0);
static V_LEVELS3: [f32; 8] = levels_f32(NF3, NF3_UNIT);
static V_LEVELS2: [f32; 4] = levels_f32(NF2, 1.0);

/// The codebook of a split level's V blocks as floats: channel `c` of token `t`'s rotated
/// head vector is `scale_t x levels[code]`, the scales and codes as [`split_v_params`] reads
/// them. Attention reads V blocks in place with it and rotates its output back once (H is
/// linear).
pub fn split_v_levels(bits: usize) -> &'static [f32] {
    match bits {
        4 => &V_LEVELS4,
        3 => &V_LEVELS3,
        _ => &V_LEVELS2,
    }
}

/// The codebook a V block of `bits` chooses its tokens' scales and coarse codes on: 4-bit codes
/// refine 3-bit ones ([`V_LEVELS4_I8`]).
fn v_search_levels(bits: usize) -> &'static [f32] {
    split_v_levels(if bits == 4 { 3 } else { bits })
}

/// A value's code at `bits` on scale-relative `u`: the nearest level, or for 4 bits the nearer
/// of the two levels refining the nearest 3-bit level.
fn v_code(bits: usize, u: f32) -> u8 {
    let j = nearest(v_search_levels(bits), u);
    (if bits == 4 { refine(j, u) } else { j }) as u8
}

/// The 4-bit code refining 3-bit code `j` for `u`: the nearer of the two levels in its cell.
fn refine(j: usize, u: f32) -> usize {
    let (lo, hi) = (V_LEVELS4[2 * j], V_LEVELS4[2 * j + 1]);
    2 * j + usize::from(u - lo > hi - u)
}

/// Outliers a split-level K block of `t_cap` tokens of `hd` channels keeps exactly: one per 128
/// values (8 in a 16-token chunk of 64-channel heads). An outlier widens its channel's range
/// for every token of the block (and the block's reference step for every channel); taken out,
/// k4v3 loses +0.57% / +1.20% instead of +1.34% / +1.69% on the KV accuracy texts, k3v3 +2.09% /
/// +3.13% instead of +3.26% / +6.07% (docs/kv.md, "K outliers"), for 3 bytes each.
pub fn k_outliers(t_cap: usize, hd: usize) -> usize {
    // Positions are 12 bits.
    if t_cap * hd > 1 << OUTLIER_POS_BITS {
        return 0;
    }
    t_cap * hd / 128
}

/// Bytes of one K outlier: a 12-bit position `t x hd + c` and a 12-bit correction (an f16 with
/// its 4 lowest mantissa bits rounded off: within 1/128 of itself), little-endian in 24 bits.
pub const OUTLIER_BYTES: usize = 3;
const OUTLIER_POS_BITS: u32 = 12;

/// Bytes of a split-level K block before its codes: the f16 reference step, a zero point a
/// channel, an exponent nibble a channel, and the outliers.
fn split_k_header(t_cap: usize, hd: usize) -> usize {
    split_k_outliers_at(hd) + OUTLIER_BYTES * k_outliers(t_cap, hd)
}

/// Where a split-level K block's outliers start: after the reference, zero points and exponents.
fn split_k_outliers_at(hd: usize) -> usize {
    2 + hd + hd.div_ceil(2)
}

/// A split-level K block's fields: its reference step, the zero points' unit, the zero points
/// (`hd` bytes), the exponents (`hd / 2` bytes, two channels a byte, low nibble first), the
/// outliers and the codes (`bits` wide, low bits first, `[token][head_dim]`).
#[derive(Debug)]
pub struct SplitK<'a> {
    pub reference: f32,
    pub zero_unit: f32,
    /// The step table the block chose: the fine one, 2^(-e/6), or the wide one, 2^(-e/3).
    pub table: &'static [f32; 16],
    pub zeros: &'a [u8],
    pub exps: &'a [u8],
    pub outliers: &'a [u8],
    pub codes: &'a [u8],
}

/// A split-level K block's fields, read in place.
pub fn split_k_fields(blk: &[u8], t_cap: usize, hd: usize) -> SplitK<'_> {
    let (reference, zero_unit, table) = k_reference(u16::from_le_bytes([blk[0], blk[1]]));
    let at = split_k_outliers_at(hd);
    let (zeros, exps) = blk[2..at].split_at(hd);
    let end = split_k_header(t_cap, hd);
    SplitK { reference, zero_unit, table, zeros, exps, outliers: &blk[at..end], codes: &blk[end..] }
}

/// A split-level K block's per-channel zero points and steps (`head_dim` each), its outliers
/// and its codes: channel `c` of token `t` is `(code - zero[c]) x step[c]`, plus the
/// correction of an outlier at `t x hd + c` ([`k_outlier_at`]). The scalar reference;
/// attention reads K blocks in place with `kernels::split_k_params`, the same floats.
pub fn split_k_params<'a>(blk: &'a [u8], t_cap: usize, hd: usize, zero: &mut [f32], step: &mut [f32]) -> (&'a [u8], &'a [u8]) {
    let f = split_k_fields(blk, t_cap, hd);
    k_params(f.reference, f.zeros, f.zero_unit, f.exps, f.table, &mut zero[..hd], &mut step[..hd]);
    (f.outliers, f.codes)
}

/// [`split_k_params`]'s zero points and steps (it runs for every K block attention reads where
/// no vector kernel does: straight-line loops, no per-channel branch or bounds check).
pub fn k_params(reference: f32, zeros: &[u8], unit: f32, exps: &[u8], table: &[f32; 16], zero: &mut [f32], step: &mut [f32]) {
    for (z, &b) in zero.iter_mut().zip(zeros) {
        *z = f32::from(b as i8) * unit;
    }
    // Two channels' exponents a byte, low nibble first.
    let (pairs, odd) = step.split_at_mut(step.len() & !1);
    for (pair, &b) in pairs.chunks_exact_mut(2).zip(exps) {
        pair[0] = k_step(table, reference, b & 0xF);
        pair[1] = k_step(table, reference, b >> 4);
    }
    if let (Some(s), Some(&b)) = (odd.first_mut(), exps.last()) {
        *s = k_step(table, reference, b & 0xF);
    }
}

/// Outlier `i` of a K block's outlier bytes: (position `t x hd + c`, correction to add to the
/// decoded value). An unused entry has correction 0.
#[inline]
pub fn k_outlier_at(outliers: &[u8], i: usize) -> (usize, f32) {
    let b = &outliers[OUTLIER_BYTES * i..OUTLIER_BYTES * (i + 1)];
    let word = u32::from(b[0]) | u32::from(b[1]) << 8 | u32::from(b[2]) << 16;
    let pos = word & ((1 << OUTLIER_POS_BITS) - 1);
    let corr = f16::from_bits(((word >> OUTLIER_POS_BITS) << 4) as u16).to_f32();
    (pos as usize, corr)
}

/// A correction's 12 bits: an f16's top 12, rounded half up on the magnitude (sign-magnitude:
/// a mantissa carry rounds the exponent up, as a float does); past f16's largest finite value,
/// the largest.
fn k_correction_bits(corr: f32) -> u32 {
    let h = u32::from(f16::from_f32(corr).to_bits());
    let c = (h + 8) >> 4;
    if c & 0x7C0 == 0x7C0 {
        (h >> 4 & 0x800) | 0x7BF
    } else {
        c
    }
}

/// What a correction reads back as.
fn round_k_correction(corr: f32) -> f32 {
    f16::from_bits((k_correction_bits(corr) << 4) as u16).to_f32()
}

/// Outlier `i`'s 3 bytes: `pos` and `corr` rounded to 12 bits ([`round_k_correction`]).
fn put_k_outlier(outliers: &mut [u8], i: usize, pos: usize, corr: f32) {
    let word = (pos as u32 & ((1 << OUTLIER_POS_BITS) - 1)) | k_correction_bits(corr) << OUTLIER_POS_BITS;
    outliers[OUTLIER_BYTES * i..OUTLIER_BYTES * (i + 1)].copy_from_slice(&word.to_le_bytes()[..3]);
}

/// `y.round().clamp(0.0, top)` for a whole `top` below 2^31, without a call to libm's
/// `roundf` (the split K encoder's search rounds 12 candidates' codes for every value; the call
/// was a third of its time): the same value, but 0 where that gives NaN or -0 (both write code 0).
#[inline]
fn round_code(y: f32, top: f32) -> f32 {
    let y = y.clamp(0.0, top);
    // Within [0, top] truncation is exact and so is `y - t`: halves round up, as `round` does
    // away from zero. (NaN casts to 0.)
    let t = (y as i32) as f32;
    if y - t >= 0.5 {
        t + 1.0
    } else {
        t
    }
}

/// `y.round().clamp(-127.0, 127.0) as i8` (halves away from zero, NaN to 0) without a call to
/// libm's `roundf`: a prefill writes every token's K and V a value at a time, on the calling
/// thread, and the call per value was ~3% of a 50-token pass.
#[inline]
fn round_i8(y: f32) -> i8 {
    // Clamping first gives what clamping the rounded value gives (a value past ±127 rounds to
    // at least ±127 either way); within ±127 truncation and `y - t` are exact.
    let y = y.clamp(-127.0, 127.0);
    let y = if y.is_nan() { 0.0 } else { y };
    // SAFETY: `y` is finite and within ±127.
    let t = unsafe { y.to_int_unchecked::<i32>() } as f32;
    let f = y - t;
    let r = if f >= 0.5 {
        t + 1.0
    } else if f <= -0.5 {
        t - 1.0
    } else {
        t
    };
    r as i8
}

/// The nearest level's index (levels ascending).
fn nearest(levels: &[f32], x: f32) -> usize {
    // A count, not a binary search: the levels are at most 16, and a search's branches follow
    // the data (the V encoder's scale search calls this ten times per value).
    let mut i = levels.iter().filter(|&&l| l < x).count();
    if i == levels.len() || i > 0 && x - levels[i - 1] <= levels[i] - x {
        i -= 1;
    }
    i
}

/// Code `i` of a bit-packed array (codes laid low bits first, possibly across bytes).
pub(crate) fn get_code(data: &[u8], i: usize, bits: usize) -> u8 {
    let at = i * bits;
    let word = u16::from(data[at / 8]) | data.get(at / 8 + 1).map_or(0, |&b| u16::from(b) << 8);
    ((word >> (at % 8)) & ((1 << bits) - 1)) as u8
}

/// Sets code `i` of a bit-packed array, whatever it held.
fn set_code(data: &mut [u8], i: usize, bits: usize, code: u8) {
    let at = i * bits;
    let mask = ((1u16 << bits) - 1) << (at % 8);
    let word = u16::from(code) << (at % 8);
    data[at / 8] = data[at / 8] & !(mask as u8) | word as u8;
    if mask > 0xFF {
        data[at / 8 + 1] = data[at / 8 + 1] & !((mask >> 8) as u8) | (word >> 8) as u8;
    }
}

fn put_code(data: &mut [u8], i: usize, bits: usize, code: u8) {
    let at = i * bits;
    let word = u16::from(code) << (at % 8);
    data[at / 8] |= word as u8;
    if word > 0xFF {
        data[at / 8 + 1] |= (word >> 8) as u8;
    }
}

/// The f16 at or just above `v` (a stored reference step must never be below the one wanted).
fn f16_up(v: f32) -> f32 {
    let h = f16::from_f32(v);
    if h.to_f32() >= v {
        h.to_f32()
    } else {
        f16::from_bits(h.to_bits() + 1).to_f32()
    }
}

/// Encodes a K block of a split level: per channel over the block's tokens, an i8 zero point
/// (quarter steps, or whole ones: [`K_ZERO_QUARTER`]) and a 4-bit step exponent below the
/// block's f16 reference step; `x = (code - z_c/4) x step_c`.
/// Each channel's (exponent, zero point) is the one of its few candidates around the range's
/// fit with the least squared error over the block (lowering is done once per chunk): at 2 and
/// 3 bits a finer step that clips an extreme loses far less than one that spans the range
/// (k2v2's perplexity +20% against +97%), at 4 bits the two are even (docs/kv.md).
fn write_split_k(bits: usize, blk: &mut [u8], t_cap: usize, hd: usize, n: usize, exact: &[f32]) {
    let top = ((1u32 << bits) - 1) as f32;
    let (head, data) = blk.split_at_mut(split_k_header(t_cap, hd));
    data.fill(0);
    head.fill(0);
    let mut inner = exact[..n * hd].to_vec();
    let outliers = take_k_outliers(&mut inner, hd, n, k_outliers(t_cap, hd));
    let vals = &inner[..];
    // Each channel's [lo, hi] over the block's tokens: the reference, the zero points' unit and
    // each channel's candidates all start from it.
    let ranges: Vec<(f32, f32)> = (0..hd)
        .map(|c| {
            if n == 0 {
                return (0.0, 0.0);
            }
            (0..n).map(|t| vals[t * hd + c]).fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)))
        })
        .collect();
    // The reference for zero points in `unit` steps: the coarsest step any channel needs,
    // either to span its range or to reach its middle with its zero point.
    let needed = |unit: f32| ranges.iter().fold(0.0f32, |r, &(lo, hi)| r.max(k_step_needed(lo, hi, top, unit)));
    head[..2].copy_from_slice(&k_reference_bits(needed(K_ZERO_QUARTER), false, false).to_le_bytes());
    let (quarter, _, _) = k_reference(u16::from_le_bytes([head[0], head[1]]));
    if !quarter.is_finite() {
        return;
    }
    if quarter > 0.0 {
        let mut err = k_channels(bits, head, data, hd, vals, &ranges);
        let finest = quarter * K_STEP_SCALE[15];
        // A channel whose middle is too far from zero for a quarter-step zero point to reach
        // with the step its range needs (or the finest there is): whole steps too. A channel
        // whose range needs a step finer than the fine table's finest: the wide table too.
        // The block keeps whichever codes it with the least squared error.
        let far = ranges.iter().any(|&(lo, hi)| k_step_needed(lo, hi, top, K_ZERO_QUARTER) > ((hi - lo) / top).max(finest));
        let clamped = ranges.iter().any(|&(lo, hi)| hi - lo < top * finest);
        let (mut h2, mut d2) = (vec![0u8; head.len()], vec![0u8; data.len()]);
        for (whole, wide) in [(false, true), (true, false), (true, true)] {
            if (whole && !far) || (wide && !clamped) {
                continue;
            }
            let unit = if whole { 1.0 } else { K_ZERO_QUARTER };
            h2.fill(0);
            d2.fill(0);
            h2[..2].copy_from_slice(&k_reference_bits(needed(unit), wide, whole).to_le_bytes());
            let e2 = k_channels(bits, &mut h2, &mut d2, hd, vals, &ranges);
            if e2 < err {
                err = e2;
                head.copy_from_slice(&h2);
                data.copy_from_slice(&d2);
            }
        }
    }
    // Each outlier's correction from what its code decodes to (the reader's arithmetic).
    let (mut zero, mut step) = ([0.0f32; MAX_FAST_HD], [0.0f32; MAX_FAST_HD]);
    let (_, codes) = split_k_params(head, t_cap, hd, &mut zero, &mut step);
    debug_assert!(codes.is_empty());
    let at = split_k_outliers_at(hd);
    for (i, &(pos, x)) in outliers.iter().enumerate() {
        // The code under an outlier decodes nothing else: of them all, the one whose
        // correction rounds to 12 bits with the least error (its rounding is 1/128 of a
        // correction many steps long; one of 2^bits codes a step apart lands nearer).
        let c = pos % hd;
        let (mut best, mut best_err) = (0u8, f32::INFINITY);
        for code in 0..=top as u8 {
            let corr = x - (f32::from(code) - zero[c]) * step[c];
            let err = (corr - round_k_correction(corr)).abs();
            if err < best_err {
                (best, best_err) = (code, err);
            }
        }
        set_code(data, pos, bits, best);
        put_k_outlier(&mut head[at..], i, pos, x - (f32::from(best) - zero[c]) * step[c]);
    }
}

/// Takes the `count` values of a K block (`n` tokens of `hd` channels) whose removal shrinks the
/// channels' ranges most (summed squares, what the steps' error goes with), one at a time,
/// each the highest or lowest value left in its channel (two always stay): each is replaced in
/// `vals` by the middle of what remains in its channel and returned with its position and value.
fn take_k_outliers(vals: &mut [f32], hd: usize, n: usize, count: usize) -> Vec<(usize, f32)> {
    if n < 3 || count == 0 {
        return Vec::new();
    }
    // Each channel's tokens in value order (channel `c`'s at `c * n..`), and the span [lo, hi]
    // of them still in.
    let mut order: Vec<usize> = Vec::with_capacity(hd * n);
    for c in 0..hd {
        let at = order.len();
        order.extend(0..n);
        order[at..].sort_by(|&a, &b| vals[a * hd + c].total_cmp(&vals[b * hd + c]));
    }
    let order = |c: usize, k: usize| order[c * n + k];
    let mut span: Vec<(usize, usize)> = vec![(0, n - 1); hd];
    let mut taken = Vec::with_capacity(count);
    for _ in 0..count {
        let mut best: Option<(f32, usize, bool)> = None;
        for c in 0..hd {
            let (lo, hi) = span[c];
            if hi - lo < 2 {
                continue;
            }
            let v = |k: usize| vals[order(c, k) * hd + c];
            let r = v(hi) - v(lo);
            for (at_top, r2) in [(false, v(hi) - v(lo + 1)), (true, v(hi - 1) - v(lo))] {
                let gain = r * r - r2 * r2;
                if gain > best.map_or(0.0, |b| b.0) {
                    best = Some((gain, c, at_top));
                }
            }
        }
        let Some((_, c, at_top)) = best else { break };
        let (lo, hi) = &mut span[c];
        let t = order(c, if at_top { *hi } else { *lo });
        if at_top {
            *hi -= 1;
        } else {
            *lo += 1;
        }
        taken.push((t * hd + c, vals[t * hd + c]));
    }
    // Only now, each taken value replaced by the middle of what stays in its channel (a value
    // put in earlier could fall outside a range shrunk from its other end since).
    for &(pos, _) in &taken {
        let c = pos % hd;
        let (lo, hi) = span[c];
        vals[pos] = 0.5 * (vals[order(c, lo) * hd + c] + vals[order(c, hi) * hd + c]);
    }
    taken
}

/// The step a K channel spanning `[lo, hi]` needs at the least: one that spans it in `top`
/// steps and reaches its middle with a zero point in `unit` steps (the reference is the
/// largest of these over the block's channels, so its own exponent, 0, fits every channel).
fn k_step_needed(lo: f32, hi: f32, top: f32, unit: f32) -> f32 {
    ((hi - lo) / top).max((0.5 * (lo + hi)).abs() / (k_zero_reach(unit) - 0.5 * top))
}

/// Encodes the channels of a K block (`vals`, `[token][hd]`; each channel's `ranges`) whose
/// reference step is `reference` (finite, positive) with zero points in `unit` steps; returns
/// the codes' squared error (outliers aside).
#[allow(clippy::too_many_arguments)]
fn k_channels(bits: usize, head: &mut [u8], data: &mut [u8], hd: usize, vals: &[f32], ranges: &[(f32, f32)]) -> f32 {
    let (reference, unit, table) = k_reference(u16::from_le_bytes([head[0], head[1]]));
    let top = ((1u32 << bits) - 1) as f32;
    let n = vals.len() / hd;
    // A channel's values side by side, and their squared errors (summed in token order after,
    // as before they were side by side: the sums decide between candidates, so their rounding
    // is part of the format).
    let (mut col, mut sq) = (vec![0.0f32; n], vec![0.0f32; n]);
    // `zq` is the zero point in `unit` steps (what is stored).
    let mut sse = |col: &[f32], step: f32, zq: f32| -> f32 {
        let (inv, z) = (1.0 / step, zq * unit);
        for (s, &x) in sq.iter_mut().zip(col) {
            let d = x - (round_code(x * inv + z, top) - z) * step;
            *s = d * d;
        }
        sq.iter().sum()
    };
    let reach = |zq: f32| (-128.0..=127.0).contains(&zq);
    // The zero point (in units) that puts the middle of `[lo, hi]` at the middle code.
    let centred = |mid: f32, step: f32| ((0.5 * top - mid / step) / unit).round();
    let mut total = 0.0;
    for (c, &(lo, hi)) in ranges.iter().enumerate() {
        for (t, x) in col.iter_mut().enumerate() {
            *x = vals[t * hd + c];
        }
        let mid = 0.5 * (lo + hi);
        let fits = |e: u8| {
            let step = k_step(table, reference, e);
            step * top >= hi - lo && reach(centred(mid, step))
        };
        // The finest step that spans the range with its zero point in reach (e = 0 always
        // does); around it, a step coarser and two finer (that clip an extreme), each with
        // the centred zero point and a unit either side.
        let e0 = (0..16u8).rev().find(|&e| fits(e)).unwrap_or(0);
        let mut best = (f32::INFINITY, 0u8, 0i8);
        for e in e0.saturating_sub(1)..=(e0 + 2).min(15) {
            let step = k_step(table, reference, e);
            let zc = centred(mid, step);
            for zq in [zc - 1.0, zc, zc + 1.0] {
                if !reach(zq) {
                    continue;
                }
                let err = sse(&col, step, zq);
                if err < best.0 {
                    best = (err, e, zq as i8);
                }
            }
        }
        let (err, e, zq) = best;
        total += err;
        head[2 + c] = zq as u8;
        head[2 + hd + c / 2] |= e << (4 * (c % 2));
        let (inv, z) = (1.0 / k_step(table, reference, e), f32::from(zq) * unit);
        for (t, &x) in col.iter().enumerate() {
            put_code(data, t * hd + c, bits, round_code(x * inv + z, top) as u8);
        }
    }
    total
}

fn read_split_k(bits: usize, blk: &[u8], t_cap: usize, hd: usize, n: usize, out: &mut [f32]) {
    let (mut zero, mut step) = ([0.0f32; MAX_FAST_HD], [0.0f32; MAX_FAST_HD]);
    let (outliers, data) = split_k_params(blk, t_cap, hd, &mut zero, &mut step);
    for (t, o) in out[..n * hd].chunks_exact_mut(hd).enumerate() {
        for (c, v) in o.iter_mut().enumerate() {
            *v = (f32::from(get_code(data, t * hd + c, bits)) - zero[c]) * step[c];
        }
    }
    for i in 0..outliers.len() / OUTLIER_BYTES {
        let (pos, corr) = k_outlier_at(outliers, i);
        // Positions past the tokens held are not the encoder's (it writes only those).
        if pos < n * hd {
            out[pos] += corr;
        }
    }
}

/// Bits of a split V block's per-token scale exponent: token `t`'s scale is the block's f16
/// reference times 2^(-e_t/8), `e_t` in 0..63 (a step of 9% over 214x below the reference);
/// `V_ZERO_SCALE` is a zero scale (an all-zero token). 12 bytes for 16 tokens where f16 scales
/// took 32: the V block's scale search picks among these steps as it picked among six
/// fractions of the token's largest entry before (docs/kv.md, "Smaller headers").
const V_EXP_BITS: usize = 6;
const V_ZERO_SCALE: u8 = 63;

/// 2^(-e/8) for every exponent below [`V_ZERO_SCALE`] (eighth powers over a power of two, so
/// every scale is the same f32 on every CPU), 0 for it.
const V_SCALE_OF: [f32; 64] = {
    const EIGHTH_POW: [f32; 8] = [1.0, 0.917_004_05, 0.840_896_4, 0.771_105_4, 0.707_106_77, 0.648_419_8, 0.594_603_54, 0.545_253_9];
    let mut t = [0.0f32; 64];
    let mut e = 0;
    while e < V_ZERO_SCALE as usize {
        t[e] = EIGHTH_POW[e % 8] / (1u32 << (e / 8)) as f32;
        e += 1;
    }
    t
};

/// Bytes of a split-level V block before its codes: the f16 reference and the tokens' exponents.
fn split_v_header(t_cap: usize) -> usize {
    2 + (t_cap * V_EXP_BITS).div_ceil(8)
}

/// What a split V block of `bits` (index) decodes its levels times: `1 / (1 - e)`, `e` the
/// codes' relative squared error over the model's V (`llms perplexity --kv k4v4` on the KV
/// accuracy texts, 8 windows each, with a throwaway build that summed it: 4 bits 0.00742, 3 bits
/// 0.02962, 2 bits 0.1115; the same to 0.0002 on both texts). The scale search minimizes each
/// token's squared error, and its decoding is right on average (least-squares gain 1.000 over
/// those values) but short of the value's energy by that error; attention sums many tokens'
/// decodings, whose errors would cancel while the shortfall would not (the likely reason, not
/// measured apart). Multiplied back, the KL divergence from int8 of V at 3 bits (K at int8)
/// fell from 0.0169 / 0.0168 to 0.0142 / 0.0142 on heapq.py / GPL-3's first 8 windows, at 2
/// bits from 0.067 / 0.072 to 0.041 / 0.040; gains of 1.015 and 1.05 at 3 bits did less
/// (docs/kv.md, "V decoded to its energy"). Encoding does not see it: the codes and scales are
/// those of least squares.
const V_GAIN: [f32; 5] = [1.0, 1.0, 1.125_49, 1.030_53, 1.007_47];

/// A split-level V block's per-token scales (`t_cap` of them) and its codes (`bits` wide, low
/// bits first, `[token][head_dim]`): channel `c` of token `t`'s rotated head vector is
/// `scale[t] x levels[code]` ([`split_v_levels`]), the scales including the level's gain
/// (`V_GAIN`). Attention reads V blocks in place with these.
pub fn split_v_params<'a>(blk: &'a [u8], bits: usize, t_cap: usize, scales: &mut [f32]) -> &'a [u8] {
    let reference = f16_at(blk, 0) * V_GAIN[bits.min(4)];
    let (exps, codes) = blk[2..].split_at(split_v_header(t_cap) - 2);
    // Four exponents every 3 bytes (this runs for every V block attention reads: whole groups
    // in straight-line code, then a partial one).
    let scale = |word: u32, k: usize| reference * V_SCALE_OF[(word >> (V_EXP_BITS * k) & 63) as usize];
    let mut fours = scales[..t_cap].chunks_exact_mut(4);
    for (four, b) in (&mut fours).zip(exps.chunks_exact(3)) {
        let word = u32::from(b[0]) | u32::from(b[1]) << 8 | u32::from(b[2]) << 16;
        for (k, s) in four.iter_mut().enumerate() {
            *s = scale(word, k);
        }
    }
    let rest = fours.into_remainder();
    if !rest.is_empty() {
        let b = &exps[t_cap / 4 * 3..];
        let byte = |i: usize| u32::from(b.get(i).copied().unwrap_or(0));
        let word = byte(0) | byte(1) << 8 | byte(2) << 16;
        for (k, s) in rest.iter_mut().enumerate() {
            *s = scale(word, k);
        }
    }
    codes
}

/// Encodes a V block of a split level: each head vector rotated by H, then a scale per token
/// (the block's reference step scaled by a power of 2^(1/8)) and a codebook level per channel;
/// the scale is the one of the steps from the token's largest entry down to about half of it
/// with the least squared error (clipping the tail pays at 2 and 3 bits; for 4 bits,
/// [`v_scale_cost`]).
fn write_split_v(bits: usize, blk: &mut [u8], t_cap: usize, hd: usize, n: usize, vals: &[f32]) {
    let levels = v_search_levels(bits);
    let top = levels[levels.len() - 1];
    blk.fill(0);
    let (head, data) = blk.split_at_mut(split_v_header(t_cap));
    let mut rot = vals[..n * hd].to_vec();
    let mut amax = vec![0.0f32; n];
    for (r, a) in rot.chunks_exact_mut(hd).zip(&mut amax) {
        fwht(r);
        *a = r.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    }
    // Past f16's range the reference is its largest value: such values clip, never zero.
    let reference = f16_up(amax.iter().fold(0.0f32, |m, &a| m.max(a)) / top).min(f16::MAX.to_f32());
    put_f16(head, 0, reference);
    let exps = &mut head[2..];
    for t in n..t_cap {
        put_code(exps, t, V_EXP_BITS, V_ZERO_SCALE);
    }
    for (t, (r, &a)) in rot.chunks_exact(hd).zip(&amax).enumerate() {
        let want = a / top;
        if want <= 0.0 {
            // All zeros (NaNs fold out of the largest): the level nearest zero, times a zero scale.
            put_code(exps, t, V_EXP_BITS, V_ZERO_SCALE);
            for c in 0..hd {
                put_code(data, t * hd + c, bits, v_code(bits, 0.0));
            }
            continue;
        }
        // The finest step that still spans the largest entry, then up to 9 finer ones (to
        // under half of it).
        let e0 = (0..V_ZERO_SCALE).rev().find(|&e| reference * V_SCALE_OF[usize::from(e)] >= want).unwrap_or(0);
        let mut best = (f32::INFINITY, e0);
        for e in e0..(e0 + 10).min(V_ZERO_SCALE) {
            let s = reference * V_SCALE_OF[usize::from(e)];
            let err: f32 = r.iter().map(|&x| v_scale_cost(bits, s, x)).sum();
            if err < best.0 {
                best = (err, e);
            }
        }
        put_code(exps, t, V_EXP_BITS, best.1);
        let s = reference * V_SCALE_OF[usize::from(best.1)];
        for (c, &x) in r.iter().enumerate() {
            put_code(data, t * hd + c, bits, v_code(bits, x / s));
        }
    }
}

/// What a token's scale `s` costs for value `x` in a V block of `bits`: the squared error, and
/// for 4 bits a quarter of the 3-bit code's as well. A 4-bit block is also the 3-bit block it
/// will be lowered to; over the model's V (relative squared error, `llms perplexity --kv k4v3`
/// on heapq.py, 8 windows; the refining levels as first fitted, to the 3-bit scale) the 4-bit
/// scale alone gave 4 bits 0.00750 and 3 bits 0.03124, the 3-bit scale 0.00835 and 0.02963, this
/// blend 0.00758 and 0.03044 (0.00757 and 0.03039 with the levels fitted again to it) — below
/// both of the codes before the 4-bit levels refined the 3-bit ones (0.00761, and 0.03190
/// lowered).
fn v_scale_cost(bits: usize, s: f32, x: f32) -> f32 {
    let coarse = v_search_levels(bits);
    let j = nearest(coarse, x / s);
    let d3 = x - s * coarse[j];
    if bits != 4 {
        return d3 * d3;
    }
    let d4 = x - s * V_LEVELS4[refine(j, x / s)];
    d4 * d4 + 0.25 * d3 * d3
}

/// A 4-bit split V block lowered to 3 bits: the same header, each code's refinement bit
/// dropped ([`V_LEVELS4_I8`]).
fn lower_split_v(src: &[u8], dst: &mut [u8], t_cap: usize, hd: usize) {
    let at = split_v_header(t_cap);
    dst[..at].copy_from_slice(&src[..at]);
    let (from, to) = (&src[at..], &mut dst[at..]);
    to.fill(0);
    for i in 0..t_cap * hd {
        put_code(to, i, 3, get_code(from, i, 4) >> 1);
    }
}

fn read_split_v(bits: usize, blk: &[u8], t_cap: usize, hd: usize, n: usize, out: &mut [f32]) {
    let levels = split_v_levels(bits);
    let mut scales = vec![0.0f32; t_cap];
    let data = split_v_params(blk, bits, t_cap, &mut scales);
    for (t, o) in out[..n * hd].chunks_exact_mut(hd).enumerate() {
        let s = scales[t];
        for (c, v) in o.iter_mut().enumerate() {
            *v = s * levels[usize::from(get_code(data, t * hd + c, bits))];
        }
        fwht(o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    const G: KvGeometry = KvGeometry { n_layers: 2, n_kv_heads: 3, head_dim: 64, chunk_tokens: 16 };

    /// `KvFormat::ALL` is in declared order: `f as usize` indexes tables built from it
    /// (attention's per-format block offsets).
    #[test]
    fn every_format_is_listed_in_declared_order() {
        assert!(KvFormat::ALL.iter().enumerate().all(|(i, &f)| f as usize == i));
    }

    /// The int8 writer's rounding is libm's `round` then the clamp, for every input: halves of
    /// either sign (away from zero), the clamp's edges, values far past it, infinities, NaN,
    /// -0 and random bit patterns.
    #[test]
    fn int8_codes_round_as_libm_does() {
        let libm = |y: f32| y.round().clamp(-127.0, 127.0) as i8;
        let mut ys: Vec<f32> = (-600..=600).map(|i| i as f32 * 0.5).collect();
        ys.extend([0.0, -0.0, 0.49999997, -0.49999997, 126.5, -126.5, 127.49999, 127.5, -127.5, 1e30, -1e30]);
        ys.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::MIN_POSITIVE, f32::EPSILON]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        ys.extend((0..200_000).map(|_| f32::from_bits(rng.gen::<u32>())));
        ys.extend((0..200_000).map(|_| rng.gen_range(-130.0f32..130.0)));
        for y in ys {
            assert_eq!(round_i8(y), libm(y), "{y:e} ({:#x})", y.to_bits());
        }
    }

    fn random_chunk(rng: &mut impl Rng) -> (Vec<f32>, Vec<u8>) {
        // Per (layer, kv, head): 16 tokens x 64 channels; a few outlier channels as in K.
        let n = G.n_layers * 2 * G.n_kv_heads * 16 * 64;
        let vals: Vec<f32> = (0..n).map(|i| rng.gen_range(-1.0..1.0) * if i % 64 == 5 { 8.0 } else { 1.0 }).collect();
        let mut chunk = vec![0u8; G.chunk_bytes(KvFormat::F16)];
        for l in 0..G.n_layers {
            for kv in 0..2 {
                for h in 0..G.n_kv_heads {
                    let base = ((l * 2 + kv) * G.n_kv_heads + h) * 16 * 64;
                    let off = G.block_offset(KvFormat::F16, l, kv, h);
                    for t in 0..16 {
                        write_token(KvFormat::F16, &mut chunk[off..], t, 16, &vals[base + t * 64..base + (t + 1) * 64]);
                    }
                }
            }
        }
        (vals, chunk)
    }

    fn decode_all(f: KvFormat, chunk: &[u8]) -> Vec<f32> {
        let mut out = Vec::new();
        let mut blk = vec![0.0; 16 * 64];
        for l in 0..G.n_layers {
            for kv in 0..2 {
                for h in 0..G.n_kv_heads {
                    read_block_f32(f, kv, &chunk[G.block_offset(f, l, kv, h)..], 16, 64, 16, &mut blk);
                    out.extend_from_slice(&blk);
                }
            }
        }
        out
    }

    /// Lowering a split level to another whose K has the same bits (k4v4 to k4v3, as the mix
    /// does when a chunk's budget shrinks) keeps the K blocks bit for bit: decoded and encoded
    /// again they would move to a grid fitted to their own rounded values (measured: mix:0.5
    /// +1.21% -> +0.94% on heapq.py). V's 4-bit codes refine 3-bit ones, so V lowered keeps its
    /// scales and drops a bit: each 3-bit code is the level nearest the value itself at those
    /// scales (not the level nearest its 4-bit decoding), and the error is about that of V
    /// lowered straight to 3 bits.
    #[test]
    fn lowering_between_split_levels_keeps_k_and_drops_a_bit_of_v() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let (_, f16) = random_chunk(&mut rng);
        let mut int8 = vec![0u8; G.chunk_bytes(KvFormat::Int8)];
        convert_chunk(&G, KvFormat::F16, &f16, KvFormat::Int8, &mut int8, 16);
        let mut k4v4 = vec![0u8; G.chunk_bytes(KvFormat::K4V4)];
        convert_chunk(&G, KvFormat::Int8, &int8, KvFormat::K4V4, &mut k4v4, 16);
        let mut k4v3 = vec![0u8; G.chunk_bytes(KvFormat::K4V3)];
        convert_chunk(&G, KvFormat::K4V4, &k4v4, KvFormat::K4V3, &mut k4v3, 16);
        let (via, exact) = (decode_all(KvFormat::K4V3, &k4v3), decode_all(KvFormat::Int8, &int8));
        let mut from_int8 = vec![0u8; G.chunk_bytes(KvFormat::K4V3)];
        convert_chunk(&G, KvFormat::Int8, &int8, KvFormat::K4V3, &mut from_int8, 16);
        let direct_v3 = decode_all(KvFormat::K4V3, &from_int8);
        let per = 16 * 64;
        for l in 0..G.n_layers {
            for h in 0..G.n_kv_heads {
                let k = |f: KvFormat, c: &[u8]| c[G.block_offset(f, l, 0, h)..][..G.head_block_bytes(f, 0)].to_vec();
                assert_eq!(k(KvFormat::K4V4, &k4v4), k(KvFormat::K4V3, &k4v3), "layer {l} head {h}");
                assert_eq!(k(KvFormat::K4V3, &k4v3), k(KvFormat::K4V3, &from_int8));
                let v = |f: KvFormat, c: &[u8]| c[G.block_offset(f, l, 1, h)..][..G.head_block_bytes(f, 1)].to_vec();
                let (v4, v3) = (v(KvFormat::K4V4, &k4v4), v(KvFormat::K4V3, &k4v3));
                let codes4 = split_v_params(&v4, 4, 16, &mut [0.0f32; 16]).to_vec();
                let codes3 = split_v_params(&v3, 3, 16, &mut [0.0f32; 16]).to_vec();
                // The encoder's scales (the decoder's, before the level's gain).
                let scales: Vec<f32> = (0..16).map(|t| stored_v_scale(&v4, t, 1.0)).collect();
                assert_eq!(v4[..split_v_header(16)], v3[..split_v_header(16)], "the scales are kept");
                let at = ((l * 2 + 1) * G.n_kv_heads + h) * per;
                for t in 0..16 {
                    let mut r = exact[at + t * 64..at + (t + 1) * 64].to_vec();
                    fwht(&mut r);
                    for (c, &x) in r.iter().enumerate() {
                        let i = t * 64 + c;
                        assert_eq!(get_code(&codes3, i, 3), get_code(&codes4, i, 4) >> 1);
                        assert_eq!(usize::from(get_code(&codes3, i, 3)), nearest(&V_LEVELS3, x / scales[t]), "token {t} channel {c}");
                    }
                }
                let err = |a: &[f32]| a[at..at + per].iter().zip(&exact[at..at + per]).map(|(x, y)| (x - y).powi(2)).sum::<f32>();
                assert!(err(&via) < 1.1 * err(&direct_v3) + 1e-6, "{} vs {}", err(&via), err(&direct_v3));
            }
        }
    }

    /// The in-place decoder gives, bit for bit, each token's scale times the codes of the
    /// general decoder, for every format and for head widths that do and do not fill whole
    /// bytes (the fast and the general path).
    #[test]
    fn fast_decoding_equals_scale_times_codes() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for hd in [64, 62, 60, 8] {
            for f in [KvFormat::Int8, KvFormat::Q4, KvFormat::Q2] {
                let (t_cap, n) = (16, 13);
                let mut blk: Vec<u8> = (0..t_cap * 2 + hd * 2 + t_cap * hd).map(|_| rng.gen()).collect();
                for t in 0..t_cap {
                    put_f16(&mut blk, t, rng.gen_range(-0.5..0.5));
                }
                let (mut scales, mut codes) = (vec![0.0f32; n], vec![0i8; n * hd]);
                read_block_i8(f, 0, &blk, t_cap, hd, n, &mut scales, &mut codes);
                let mut out = vec![f32::NAN; n * hd];
                read_block_f32(f, 0, &blk, t_cap, hd, n, &mut out);
                for (i, &o) in out.iter().enumerate() {
                    let want = scales[i / hd] * f32::from(codes[i]);
                    assert_eq!(o.to_bits(), want.to_bits(), "{f:?} hd {hd}: value {i}");
                }
            }
        }
    }

    /// Q4/Q2 decoded into an int8 block read as int8 gives, bit for bit, what the f32 decoder
    /// gives (the attention path relies on it), for full and partial chunks; other formats and
    /// heads that do not fill whole bytes are declined.
    #[test]
    fn decoding_to_int8_equals_the_f32_decoder() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for hd in [64, 128, 96, 8, 36] {
            for f in [KvFormat::Q4, KvFormat::Q2] {
                for n in [16, 13, 1] {
                    let t_cap = 16;
                    let mut blk: Vec<u8> = (0..t_cap * 2 + hd * 2 + t_cap * hd).map(|_| rng.gen()).collect();
                    for t in 0..t_cap {
                        put_f16(&mut blk, t, rng.gen_range(-0.5..0.5));
                    }
                    let mut int8 = vec![0u8; t_cap * 2 + t_cap * hd];
                    assert!(decode_block_to_int8(f, &blk, t_cap, hd, n, &mut int8));
                    // Attention's vector path writes the same bytes.
                    let mut fast = vec![0u8; int8.len()];
                    assert!(crate::kernels::decode_block_to_int8(f, &blk, t_cap, hd, n, &mut fast));
                    assert_eq!(fast[..t_cap * 2 + n * hd], int8[..t_cap * 2 + n * hd], "{f:?} hd {hd} n {n}");
                    let (mut a, mut b) = (vec![f32::NAN; n * hd], vec![f32::NAN; n * hd]);
                    read_block_f32(f, 0, &blk, t_cap, hd, n, &mut a);
                    read_block_f32(KvFormat::Int8, 0, &int8, t_cap, hd, n, &mut b);
                    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                        assert_eq!(x.to_bits(), y.to_bits(), "{f:?} hd {hd} n {n}: value {i}");
                    }
                }
            }
        }
        let mut out = vec![0u8; 16 * 2 + 16 * 62];
        assert!(!decode_block_to_int8(KvFormat::Q4R, &[0; 4096], 16, 64, 16, &mut out));
        assert!(!decode_block_to_int8(KvFormat::Q2, &[0; 4096], 16, 62, 16, &mut out), "62 channels do not fill 2-bit bytes");
    }

    #[test]
    fn sizes_shrink_with_the_level() {
        let g = KvGeometry { n_layers: 30, n_kv_heads: 3, head_dim: 64, chunk_tokens: 16 };
        assert_eq!(g.chunk_bytes(KvFormat::F16), 368_640, "the 368 KiB chunk of the default model");
        let (i8b, q4, q2) = (g.chunk_bytes(KvFormat::Int8), g.chunk_bytes(KvFormat::Q4), g.chunk_bytes(KvFormat::Q2));
        assert!(i8b < 368_640 / 2 + 8_000 && q4 < i8b * 2 / 3 && q2 < i8b * 2 / 5, "{i8b} {q4} {q2}");
    }

    /// H is orthogonal and symmetric: H H = I, q.k = Hq.Hk, and an outlier is spread.
    #[test]
    fn the_rotation_is_its_own_inverse_and_keeps_dot_products() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for n in [8usize, 64, 128] {
            let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-4.0..4.0)).collect();
            let q: Vec<f32> = (0..n).map(|_| rng.gen_range(-4.0..4.0)).collect();
            let (mut hx, mut hq) = (x.clone(), q.clone());
            fwht(&mut hx);
            fwht(&mut hq);
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(u, v)| f64::from(*u) * f64::from(*v)).sum::<f64>();
            assert!((dot(&x, &q) - dot(&hx, &hq)).abs() < 1e-3 * n as f64, "q.k unchanged by rotating both");
            assert!((dot(&x, &x) - dot(&hx, &hx)).abs() < 1e-3 * n as f64, "norm kept");
            let mut back = hx.clone();
            fwht(&mut back);
            assert!(back.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-5), "H H = I");
            // An outlier channel is spread over every channel.
            let mut spike = vec![0.0f32; n];
            spike[5] = 8.0;
            fwht(&mut spike);
            assert!(spike.iter().all(|v| (v.abs() - 8.0 / (n as f32).sqrt()).abs() < 1e-5));
        }
        assert!(rotation_fits(64) && rotation_fits(128) && !rotation_fits(96) && !rotation_fits(512));
    }

    /// Q4R/Q2R: per token within half a step of the rotated vector's range (its error norm,
    /// which rotating back keeps). On channels that are independent across tokens (this test's
    /// data, one outlier channel) they lose less than Q4/Q2 of the same bits, in fewer bytes;
    /// on the model's K they lose more (docs/kv.md): the test pins the mechanism, not the choice.
    #[test]
    fn rotated_levels_round_trip_within_their_bounds() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
        let (vals, f16c) = random_chunk(&mut rng);
        let max_abs = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        let mut int8 = vec![0u8; G.chunk_bytes(KvFormat::Int8)];
        convert_chunk(&G, KvFormat::F16, &f16c, KvFormat::Int8, &mut int8, 16);
        let d8 = decode_all(KvFormat::Int8, &int8);
        for (f, levels) in [(KvFormat::Q4R, 15.0f32), (KvFormat::Q2R, 3.0)] {
            let mut q = vec![0u8; G.chunk_bytes(f)];
            convert_chunk(&G, KvFormat::Int8, &int8, f, &mut q, 16);
            let dq = decode_all(f, &q);
            // Per token: the rotated vector's range r over `levels` steps, half a step of error
            // per rotated channel; rotating back keeps the error's norm, so no channel is off by
            // more than half a step times sqrt(head_dim).
            for (t, (a, b)) in dq.chunks(64).zip(d8.chunks(64)).enumerate() {
                let mut r = b.to_vec();
                fwht(&mut r);
                let range = r.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) - r.iter().fold(f32::INFINITY, |m, &v| m.min(v));
                let half = range / levels / 2.0 * 1.01 + 1e-3;
                let err: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f32>().sqrt();
                assert!(err <= half * 8.0, "{f:?} token row {t}: error norm {err} over {}", half * 8.0);
            }
            // On independent channels the rotated level beats the channel-wise one.
            let plain = if f == KvFormat::Q4R { KvFormat::Q4 } else { KvFormat::Q2 };
            let mut p = vec![0u8; G.chunk_bytes(plain)];
            convert_chunk(&G, KvFormat::Int8, &int8, plain, &mut p, 16);
            let mse = |x: &[f32]| x.iter().zip(&d8).map(|(a, b)| f64::from(a - b).powi(2)).sum::<f64>();
            assert!(mse(&dq) < mse(&decode_all(plain, &p)), "{f:?} loses less than {plain:?}");
            assert!(G.chunk_bytes(f) < G.chunk_bytes(plain));
            // Back to int8 and to f16: decoded values, quantized again (int8: within a step).
            let mut back = vec![0u8; G.chunk_bytes(KvFormat::Int8)];
            convert_chunk(&G, f, &q, KvFormat::Int8, &mut back, 16);
            assert!(max_abs(&decode_all(KvFormat::Int8, &back), &dq) <= 8.0 / 127.0);
            let mut h = vec![0u8; G.chunk_bytes(KvFormat::F16)];
            convert_chunk(&G, f, &q, KvFormat::F16, &mut h, 16);
            assert!(max_abs(&decode_all(KvFormat::F16, &h), &dq) <= 8.0 * 1e-3);
        }
        let _ = vals;
    }

    /// Every format round-trips within its documented bound: int8 within half a step of each
    /// token's scale; Q4/Q2 within half a channel step (in int8 codes) on top of that.
    #[test]
    fn formats_round_trip_within_their_bounds() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let (vals, f16c) = random_chunk(&mut rng);
        let max_abs = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(max_abs(&decode_all(KvFormat::F16, &f16c), &vals) < 8.0 * 1e-3);
        let mut int8 = vec![0u8; G.chunk_bytes(KvFormat::Int8)];
        convert_chunk(&G, KvFormat::F16, &f16c, KvFormat::Int8, &mut int8, 16);
        let d8 = decode_all(KvFormat::Int8, &int8);
        // |x| <= 8 on the outlier channel: step 8/127, error <= half a step (+ f16 rounding).
        assert!(max_abs(&d8, &vals) <= 8.0 / 127.0 * 0.51 + 0.01);
        for (f, levels) in [(KvFormat::Q4, 15.0), (KvFormat::Q2, 3.0)] {
            let mut q = vec![0u8; G.chunk_bytes(f)];
            convert_chunk(&G, KvFormat::Int8, &int8, f, &mut q, 16);
            let dq = decode_all(f, &q);
            // Channel range <= 254 codes; step <= ceil(254/levels); error <= step/2 codes.
            let bound = (254.0f32 / levels).ceil() / 2.0 * 8.0 / 127.0 + 1e-3;
            assert!(max_abs(&dq, &d8) <= bound, "{f:?}: {} > {bound}", max_abs(&dq, &d8));
            // Back to int8 is exact: the reduced values are int8 codes.
            let mut back = vec![0u8; G.chunk_bytes(KvFormat::Int8)];
            convert_chunk(&G, f, &q, KvFormat::Int8, &mut back, 16);
            assert_eq!(decode_all(KvFormat::Int8, &back), dq);
        }
    }

    /// The split levels (K channel-wise from values, V rotated with a codebook): each K
    /// channel within its step of the value (the finest step of the exponent grid that spans
    /// the channel's range and reaches its middle with a zero point in reach), each V token's error
    /// norm within half the codebook's widest gap per rotated channel; 3-bit codes that cross
    /// bytes included. A channel far from zero (a bias, as some K channels have) is coded
    /// about its middle, not from zero.
    #[test]
    fn split_levels_round_trip_within_their_bounds() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let (hd, t) = (64, 16);
        let mut vals: Vec<f32> = (0..t * hd).map(|i| rng.gen_range(-1.0..1.0) * if i % hd == 5 { 8.0 } else { 1.0 }).collect();
        for tok in 0..t {
            vals[tok * hd + 9] = 20.0 + rng.gen_range(-0.1..0.1);
        }
        for f in [KvFormat::K4V4, KvFormat::K3V3, KvFormat::K2V2, KvFormat::K4V3] {
            let g = KvGeometry { n_layers: 1, n_kv_heads: 1, head_dim: hd, chunk_tokens: t };
            let top = ((1u32 << f.bits()) - 1) as f32;
            // K
            let mut blk = vec![0u8; g.head_block_bytes(f, 0)];
            write_block_f32(f, 0, &mut blk, t, hd, t, &vals);
            let mut out = vec![0.0f32; t * hd];
            read_block_f32(f, 0, &blk, t, hd, t, &mut out);
            let (reference, unit, table) = k_reference(u16::from_le_bytes([blk[0], blk[1]]));
            let need = |c: usize| {
                let (lo, hi) = (0..t).map(|k| vals[k * hd + c]).fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
                k_step_needed(lo, hi, top, unit).max(reference * table[15])
            };
            for c in 0..hd {
                let bound = need(c) * table[0] / table[1] * 1.001;
                let rms = ((0..t).map(|k| (out[k * hd + c] - vals[k * hd + c]).powi(2)).sum::<f32>() / t as f32).sqrt();
                assert!(rms <= bound, "{f:?} K channel {c}: rms {rms} > {bound}");
            }
            // Within half of a step that reaches it (coded from zero, its 20 would need steps
            // of 20 / top: 1.3 at 4 bits, 6.7 at 2).
            assert!(
                (0..t).all(|k| (out[k * hd + 9] - vals[k * hd + 9]).abs() <= 0.6 * need(9) && need(9) < 0.9),
                "{f:?}: the biased channel is coded about its middle"
            );
            // V
            let mut blk = vec![0u8; g.head_block_bytes(f, 1)];
            write_block_f32(f, 1, &mut blk, t, hd, t, &vals);
            read_block_f32(f, 1, &blk, t, hd, t, &mut out);
            // Half the widest gap of the levels the scale is searched on, in units of the
            // token's largest entry over the outermost level; for 4 bits, the farthest a value
            // inside the range lies from the nearer refining level of its 3-bit cell, with a
            // quarter of the 3-bit error that the scale search weighs too.
            let coarse = v_search_levels(f.v_bits());
            let half = |l: &[f32]| l.windows(2).map(|w| w[1] - w[0]).fold(0.0f32, f32::max) / 2.0;
            let h3 = half(coarse);
            let per_value = if f.v_bits() == 4 {
                let bounds: Vec<f32> = coarse.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
                let h4 = (0..coarse.len())
                    .map(|j| {
                        let (lo, hi) = (V_LEVELS4[2 * j], V_LEVELS4[2 * j + 1]);
                        let below = if j == 0 { 0.0 } else { lo - bounds[j - 1] };
                        let above = if j + 1 == coarse.len() { 0.0 } else { bounds[j] - hi };
                        below.max(above).max((hi - lo) / 2.0)
                    })
                    .fold(0.0f32, f32::max);
                (h4 * h4 + 0.25 * h3 * h3).sqrt()
            } else {
                h3
            };
            let top = coarse[coarse.len() - 1];
            for k in 0..t {
                let mut r = vals[k * hd..(k + 1) * hd].to_vec();
                fwht(&mut r);
                let amax = r.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let bound = (hd as f32).sqrt() * per_value / top * amax * 1.01 + 1e-4;
                let err = (0..hd).map(|c| (out[k * hd + c] - vals[k * hd + c]).powi(2)).sum::<f32>().sqrt();
                assert!(err <= bound, "{f:?} V token {k}: error norm {err} > {bound}");
            }
        }
    }

    /// A split K block keeps its outliers: the values that stretch their channels most come back
    /// to f16 precision, and their channels are coded over what is left (without them, a
    /// channel stretched to 60 would be coded in steps of 4 at 4 bits, or 8.6 at 3).
    #[test]
    fn split_k_blocks_keep_their_outliers() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let (hd, t) = (64, 16);
        let g = KvGeometry { n_layers: 1, n_kv_heads: 1, head_dim: hd, chunk_tokens: t };
        assert_eq!(k_outliers(t, hd), 8);
        let mut vals: Vec<f32> = (0..t * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let spikes = [(3 * hd + 7, 40.0), (10 * hd + 7, -25.0), (5 * hd + 20, 60.0), (15 * hd + 63, -33.3)];
        for &(p, v) in &spikes {
            vals[p] = v;
        }
        for f in [KvFormat::K4V4, KvFormat::K3V3, KvFormat::K2V2, KvFormat::K4V3] {
            let mut blk = vec![0u8; g.head_block_bytes(f, 0)];
            write_block_f32(f, 0, &mut blk, t, hd, t, &vals);
            let mut out = vec![0.0f32; t * hd];
            read_block_f32(f, 0, &blk, t, hd, t, &mut out);
            for &(p, v) in &spikes {
                // The correction (about the spike) is kept to 1/128 of itself.
                assert!((out[p] - v).abs() <= (v.abs() + 1.0) / 128.0, "{f:?}: outlier {v} read as {}", out[p]);
            }
            // Every other value within a step fit to [-1, 1] (the clipping search may pick a
            // step one exponent finer, 2^(1/4) x, and clip the extreme by a step).
            let step = 2.0 / ((1u32 << f.bits()) - 1) as f32;
            for (i, (&o, &x)) in out.iter().zip(&vals).enumerate() {
                if !spikes.iter().any(|&(p, _)| p == i) {
                    assert!((o - x).abs() <= 1.5 * step, "{f:?}: value {i}: {x} read as {o}");
                }
            }
            // A block of fewer tokens, or one with nothing to take, decodes as well.
            write_block_f32(f, 0, &mut blk, t, hd, 2, &vals);
            read_block_f32(f, 0, &blk, t, hd, 2, &mut out);
            assert!(out[..2 * hd].iter().zip(&vals).all(|(o, x)| (o - x).abs() <= 1.5 * step));
        }
    }

    /// A K block with a channel far from zero and every other channel narrow codes its zero
    /// points in whole steps (a quarter-step zero point reaching that channel would make every
    /// step 5x coarser than the narrow ones need); a block without one, in quarter steps.
    #[test]
    fn k_zero_points_take_whole_steps_only_where_a_middle_is_far() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(12);
        let (hd, t) = (64, 16);
        for far in [false, true] {
            let vals: Vec<f32> = (0..t * hd).map(|i| if far && i % hd == 9 { 20.0 } else { 0.0 } + rng.gen_range(-0.1..0.1)).collect();
            for f in [KvFormat::K4V4, KvFormat::K3V3, KvFormat::K2V2] {
                let mut blk = vec![0u8; KvGeometry { n_layers: 1, n_kv_heads: 1, head_dim: hd, chunk_tokens: t }.head_block_bytes(f, 0)];
                write_block_f32(f, 0, &mut blk, t, hd, t, &vals);
                let (_, unit, table) = k_reference(u16::from_le_bytes([blk[0], blk[1]]));
                assert_eq!(unit, if far { 1.0 } else { K_ZERO_QUARTER }, "{f:?} far {far}");
                // Alike channels keep the fine table (a far one's whole steps may need the wide).
                assert!(far || std::ptr::eq(table, &K_STEP_SCALE), "{f:?}: the channels are alike, the fine table serves");
                let mut out = vec![0.0f32; t * hd];
                read_block_f32(f, 0, &blk, t, hd, t, &mut out);
                // Whole steps reach 20 with steps of 20 / 120 or finer; quarter ones would need 0.8.
                let worst = out.iter().zip(&vals).map(|(o, v)| (o - v).abs()).fold(0.0f32, f32::max);
                assert!(worst < 0.1, "{f:?} far {far}: worst error {worst}");
            }
        }
    }

    /// A K block whose channels' ranges spread over 8 octaves (as Gemma 3's one head of 256
    /// channels does) takes the wide step table, and its narrow channels get steps their ranges
    /// need where the fine table would stop 5.66x below the widest; channels within the fine
    /// table's reach keep it (the test above).
    #[test]
    fn k_channels_spread_wide_take_the_wide_table() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
        let (hd, t) = (256, 16);
        let width = |c: usize| 2f32.powf(-((c % 64) as f32) / 8.0);
        let vals: Vec<f32> = (0..t * hd).map(|i| width(i % hd) * rng.gen_range(-1.0..1.0)).collect();
        let g = KvGeometry { n_layers: 1, n_kv_heads: 1, head_dim: hd, chunk_tokens: t };
        for f in [KvFormat::K4V4, KvFormat::K3V3, KvFormat::K2V2] {
            let mut blk = vec![0u8; g.head_block_bytes(f, 0)];
            write_block_f32(f, 0, &mut blk, t, hd, t, &vals);
            let (reference, _, table) = k_reference(u16::from_le_bytes([blk[0], blk[1]]));
            assert!(std::ptr::eq(table, &K_STEP_WIDE), "{f:?}: the fine table was kept");
            let mut out = vec![0.0f32; t * hd];
            read_block_f32(f, 0, &blk, t, hd, t, &mut out);
            let rms = |c: usize| ((0..t).map(|k| (out[k * hd + c] - vals[k * hd + c]).powi(2)).sum::<f32>() / t as f32).sqrt();
            // Channel 20 is 5.7x narrower than the widest, channel 40 32x: the fine table's
            // finest step (the reference / 5.66) is about channel 20's need, so channel 40
            // would be coded with 2-3 of its bits; the wide table's steps reach both.
            let top = ((1u32 << f.bits()) - 1) as f32;
            for c in [20, 40] {
                assert!(
                    rms(c) <= 2.0 * width(c) / top * table[0] / table[1],
                    "{f:?} channel {c}: rms {} (step of the fine table {})",
                    rms(c),
                    reference * K_STEP_SCALE[15]
                );
            }
        }
    }

    /// Token `t`'s scale in a split V block read field by field: the f16 reference times `gain`,
    /// times the token's exponent's step (the decoder's order of multiplication).
    fn stored_v_scale(blk: &[u8], t: usize, gain: f32) -> f32 {
        f16_at(blk, 0) * gain * V_SCALE_OF[usize::from(get_code(&blk[2..], t, V_EXP_BITS))]
    }

    /// The block parsers attention runs for every block read each field where the layout puts
    /// it, for every token count and head width (odd ones and partial exponent groups included):
    /// checked against the codes read one at a time.
    #[test]
    fn split_block_parameters_are_read_field_by_field() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        for (t_cap, bits) in (1..=17).flat_map(|t| [(t, 2), (t, 3), (t, 4)]) {
            let hdr = split_v_header(t_cap);
            let blk: Vec<u8> = (0..hdr + 8).map(|_| rng.gen()).collect();
            let mut scales = vec![f32::NAN; t_cap + 1];
            let codes = split_v_params(&blk, bits, t_cap, &mut scales);
            assert_eq!(codes.len(), 8);
            for (t, &s) in scales[..t_cap].iter().enumerate() {
                let want = stored_v_scale(&blk, t, V_GAIN[bits]);
                assert_eq!(s.to_bits(), want.to_bits(), "t_cap {t_cap} bits {bits} token {t}");
            }
            assert!(scales[t_cap].is_nan(), "written past t_cap");
        }
        // A negative reference says whole-step zero points, an odd one the wide step table.
        let quarter = f16::from_f32(0.25).to_bits();
        let cases = [
            (quarter, 0.25f32, &K_STEP_SCALE),
            (quarter | 0x8000, 1.0, &K_STEP_SCALE),
            (quarter | 1, 0.25, &K_STEP_WIDE),
            (quarter | 0x8001, 1.0, &K_STEP_WIDE),
        ];
        for (hd, stored, unit, table) in [1, 5, 8, 63, 64].into_iter().flat_map(|hd| cases.map(|(s, u, t)| (hd, s, u, t))) {
            let t_cap = 4;
            let hdr = split_k_header(t_cap, hd);
            let mut blk: Vec<u8> = (0..hdr + 8).map(|_| rng.gen()).collect();
            blk[..2].copy_from_slice(&stored.to_le_bytes());
            let reference = f16::from_bits(stored & 0x7FFF).to_f32();
            let (mut zero, mut step) = (vec![f32::NAN; hd + 1], vec![f32::NAN; hd + 1]);
            let (outliers, codes) = split_k_params(&blk, t_cap, hd, &mut zero, &mut step);
            assert_eq!((outliers.len(), codes.len()), (OUTLIER_BYTES * k_outliers(t_cap, hd), 8));
            for c in 0..hd {
                assert_eq!(zero[c], f32::from(blk[2 + c] as i8) * unit, "hd {hd} zero {c}");
                let e = get_code(&blk[2 + hd..], c, 4);
                assert_eq!(step[c].to_bits(), k_step(table, reference, e).to_bits(), "hd {hd} step {c}");
            }
            assert!(zero[hd].is_nan() && step[hd].is_nan(), "written past hd");
            // Attention's vector path gives the same bits.
            let (mut vz, mut vs) = (vec![f32::NAN; hd + 1], vec![f32::NAN; hd + 1]);
            assert_eq!(crate::kernels::split_k_params(&blk, t_cap, hd, &mut vz, &mut vs), (outliers, codes));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&vz), bits(&zero), "hd {hd}");
            assert_eq!(bits(&vs), bits(&step), "hd {hd}");
        }
    }

    /// Each V gain is 1 / (1 - e) for its codes' relative squared error e on Gaussian rotated
    /// rows (what a rotated head vector's entries look like; [`V_GAIN`] was measured on the
    /// model's V), so a codebook or scale search changed without its gain fails here; and a
    /// block decodes to the least-squares decoding times the gain.
    #[test]
    fn v_gains_follow_the_codes_error() {
        let (hd, t) = (64, 16);
        let g = KvGeometry { n_layers: 1, n_kv_heads: 1, head_dim: hd, chunk_tokens: t };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(31);
        for (f, bits) in [(KvFormat::K4V4, 4), (KvFormat::K3V3, 3), (KvFormat::K2V2, 2)] {
            let (mut err, mut energy, mut cross, mut dec2) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
            for _ in 0..200 {
                // Gaussian entries (Box-Muller), rotated back so the block's rotation makes them
                // Gaussian again.
                let mut vals: Vec<f32> = (0..t * hd)
                    .map(|_| {
                        let (u, v): (f32, f32) = (rng.gen_range(1e-7..1.0), rng.gen());
                        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
                    })
                    .collect();
                vals.chunks_exact_mut(hd).for_each(fwht);
                let mut blk = vec![0u8; g.head_block_bytes(f, 1)];
                write_block_f32(f, 1, &mut blk, t, hd, t, &vals);
                let mut out = vec![0.0f32; t * hd];
                read_block_f32(f, 1, &blk, t, hd, t, &mut out);
                for (&x, &y) in vals.iter().zip(&out) {
                    let q = f64::from(y) / f64::from(V_GAIN[bits]);
                    err += (f64::from(x) - q).powi(2);
                    energy += f64::from(x).powi(2);
                    cross += f64::from(x) * q;
                    dec2 += q * q;
                }
            }
            let e = err / energy;
            let want = 1.0 / (1.0 - e);
            assert!(
                (f64::from(V_GAIN[bits]) / want - 1.0).abs() < 0.004,
                "{bits} bits: gain {} for error {e} (1 / (1 - e) = {want})",
                V_GAIN[bits]
            );
            // Least squares' decoding is right on average: its gain onto the values is 1.
            assert!((cross / dec2 - 1.0).abs() < 0.01, "{bits} bits: least-squares gain {}", cross / dec2);
        }
    }

    /// A split V block's token scales: a zero token and tokens far below the block's largest
    /// decode within their own step (not the largest token's), a zero block decodes to zeros,
    /// and every exponent a hostile record can hold decodes to a finite scale. A K outlier's
    /// correction keeps its sign and 1/128 of its size up to f16's largest value.
    #[test]
    fn split_v_scales_follow_each_token_and_outliers_round_to_twelve_bits() {
        let (hd, t) = (64, 16);
        let g = KvGeometry { n_layers: 1, n_kv_heads: 1, head_dim: hd, chunk_tokens: t };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        // Token t's values scaled by 2^-(t/2): token 15 is 181x below token 0; token 3 is zero.
        let mut vals: Vec<f32> = (0..t * hd).map(|i| rng.gen_range(-1.0..1.0) * (-((i / hd) as f32) / 2.0).exp2()).collect();
        vals[3 * hd..4 * hd].fill(0.0);
        for f in [KvFormat::K4V4, KvFormat::K4V3, KvFormat::K2V2] {
            let mut blk = vec![0u8; g.head_block_bytes(f, 1)];
            write_block_f32(f, 1, &mut blk, t, hd, t, &vals);
            let mut out = vec![0.0f32; t * hd];
            read_block_f32(f, 1, &blk, t, hd, t, &mut out);
            assert!(out[3 * hd..4 * hd].iter().all(|&v| v == 0.0), "{f:?}: a zero token");
            for tok in (0..t).filter(|&k| k != 3) {
                let rms = |v: &[f32]| (v.iter().map(|x| x * x).sum::<f32>() / hd as f32).sqrt();
                let x = &vals[tok * hd..(tok + 1) * hd];
                let err: Vec<f32> = x.iter().zip(&out[tok * hd..(tok + 1) * hd]).map(|(a, b)| a - b).collect();
                // 2 bits: a Gaussian codebook of 4 levels loses about a third of the RMS.
                let bound = if f.v_bits() == 2 { 0.5 } else { 0.25 };
                assert!(rms(&err) <= bound * rms(x), "{f:?} token {tok}: error {} of {}", rms(&err), rms(x));
            }
            let mut zeros = vec![0u8; g.head_block_bytes(f, 1)];
            write_block_f32(f, 1, &mut zeros, t, hd, t, &vec![0.0; t * hd]);
            read_block_f32(f, 1, &zeros, t, hd, t, &mut out);
            assert!(out.iter().all(|&v| v == 0.0));
        }
        assert!(V_SCALE_OF.iter().all(|s| s.is_finite() && (0.0..=1.0).contains(s)));
        // Values past what an f16 reference spans clip to the largest; they never read as zero.
        let huge: Vec<f32> = vals.iter().map(|v| v * 1e9).collect();
        let mut blk = vec![0u8; g.head_block_bytes(KvFormat::K4V4, 1)];
        write_block_f32(KvFormat::K4V4, 1, &mut blk, t, hd, t, &huge);
        let mut out = vec![0.0f32; t * hd];
        read_block_f32(KvFormat::K4V4, 1, &blk, t, hd, t, &mut out);
        assert!(out[..hd].iter().all(|v| v.is_finite()) && out[..hd].iter().any(|v| v.abs() > 1e5));
        let mut o = [0u8; OUTLIER_BYTES];
        for corr in [0.0f32, 1.0, -1.0, 0.3, -17.25, 1e-6, 6.5e4, -6.55e4, 1e9] {
            put_k_outlier(&mut o, 0, 4095, corr);
            let kept = round_k_correction(corr);
            let (pos, read) = k_outlier_at(&o, 0);
            assert_eq!((pos, read.to_bits()), (4095, kept.to_bits()));
            let want = corr.clamp(-65504.0, 65504.0);
            assert!(read.is_finite() && (read - want).abs() <= want.abs() / 128.0 + 1e-7, "{corr} kept as {read}");
        }
    }

    /// On K-like data (an outlier channel that keeps its range over the chunk's tokens) the split
    /// 4-bit level loses less on K than both earlier 4-bit levels, at 0.55x int8's bytes on the
    /// default model's geometry (smaller than q4: 0.546x without K outliers, 0.562x with them
    /// at 4 bytes each and f16 V scales, 0.549x at 3 bytes and 6-bit V scale exponents,
    /// docs/kv.md); converting a split level to int8 keeps the decoded values within half an
    /// int8 step.
    #[test]
    fn the_split_four_bit_level_beats_the_earlier_ones_on_k_like_data() {
        let g = KvGeometry { n_layers: 30, n_kv_heads: 3, head_dim: 64, chunk_tokens: 16 };
        let (i8b, k4) = (g.chunk_bytes(KvFormat::Int8) as f64, g.chunk_bytes(KvFormat::K4V4) as f64);
        assert!(k4 <= 0.55 * i8b, "{}", k4 / i8b);
        assert!(g.chunk_bytes(KvFormat::K4V4) < g.chunk_bytes(KvFormat::Q4));
        assert!(
            g.chunk_bytes(KvFormat::K2V2) < g.chunk_bytes(KvFormat::K3V3) && g.chunk_bytes(KvFormat::K3V3) < g.chunk_bytes(KvFormat::K4V3)
        );
        // K4V3: K's block as k4v4's, V's as k3v3's (0.489x int8 here).
        assert_eq!(g.head_block_bytes(KvFormat::K4V3, 0), g.head_block_bytes(KvFormat::K4V4, 0));
        assert_eq!(g.head_block_bytes(KvFormat::K4V3, 1), g.head_block_bytes(KvFormat::K3V3, 1));
        assert!((g.chunk_bytes(KvFormat::K4V3) as f64) < 0.49 * i8b && g.chunk_bytes(KvFormat::K4V3) < g.chunk_bytes(KvFormat::K4V4));
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
        let (_, f16c) = random_chunk(&mut rng);
        let mut int8 = vec![0u8; G.chunk_bytes(KvFormat::Int8)];
        convert_chunk(&G, KvFormat::F16, &f16c, KvFormat::Int8, &mut int8, 16);
        let d8 = decode_all(KvFormat::Int8, &int8);
        // decode_all's blocks are (layer, K/V, head) in order: keep the K ones.
        let k_only = |d: &[f32]| -> Vec<f32> {
            d.chunks(16 * 64).enumerate().filter(|(i, _)| (i / G.n_kv_heads).is_multiple_of(2)).flat_map(|(_, b)| b.to_vec()).collect()
        };
        let mse = |f: KvFormat| {
            let mut q = vec![0u8; G.chunk_bytes(f)];
            convert_chunk(&G, KvFormat::Int8, &int8, f, &mut q, 16);
            let (a, b) = (k_only(&decode_all(f, &q)), k_only(&d8));
            a.iter().zip(&b).map(|(x, y)| f64::from(x - y).powi(2)).sum::<f64>()
        };
        let (s, q4, q4r) = (mse(KvFormat::K4V4), mse(KvFormat::Q4), mse(KvFormat::Q4R));
        assert!(s < q4 && s < q4r, "k4v4 {s} q4 {q4} q4r {q4r}");
        for f in [KvFormat::K4V4, KvFormat::K3V3, KvFormat::K2V2, KvFormat::K4V3] {
            let mut q = vec![0u8; G.chunk_bytes(f)];
            convert_chunk(&G, KvFormat::Int8, &int8, f, &mut q, 16);
            let dq = decode_all(f, &q);
            let mut back = vec![0u8; G.chunk_bytes(KvFormat::Int8)];
            convert_chunk(&G, f, &q, KvFormat::Int8, &mut back, 16);
            let db = decode_all(KvFormat::Int8, &back);
            for (a, b) in db.chunks(64).zip(dq.chunks(64)) {
                let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                assert!(a.iter().zip(b).all(|(x, y)| (x - y).abs() <= amax / 127.0 * 0.51 + 1e-4), "{f:?} to int8");
            }
            assert!(KvFormat::parse(f.name()) == Some(f) && f.rotated() && f.split() && !f.is_base());
        }
    }

    /// The split levels' encoders are searches whose output is what records on flash and every
    /// measured perplexity hold: a faster encoder must write the same bytes. A digest of what
    /// they write for blocks of many shapes (wide and narrow heads, full and partial blocks,
    /// outlier and off-centre channels, tiny, huge, zero and non-finite values), fixed when the
    /// encoders were last changed on purpose (change it only with the layout number in
    /// llmsd's `EngineCodec`).
    #[test]
    fn split_encoders_write_the_same_bytes() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5EED);
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for case in 0..96 {
            let hd = [64, 256, 32][case % 3];
            let n = [16, 7, 1, 16][case % 4];
            let scale = [1.0f32, 1e-3, 40.0, 1e-6][case / 4 % 4];
            let offset = [0.0f32, 3.0, -50.0][case / 16 % 3];
            let mut vals: Vec<f32> = (0..16 * hd)
                .map(|i| {
                    let c = i % hd;
                    let v = rng.gen_range(-1.0f32..1.0) * scale;
                    let v = if c % 11 == 3 { v * 9.0 } else { v };
                    if c % 5 == 1 {
                        v + offset * scale
                    } else {
                        v
                    }
                })
                .collect();
            if case % 7 == 0 {
                vals[..hd].fill(0.0);
            }
            if case == 90 {
                vals[hd + 2] = f32::INFINITY;
            }
            if case == 91 {
                vals[5] = f32::NAN;
            }
            if case == 92 {
                vals.iter_mut().for_each(|v| *v = 0.0);
            }
            for f in [KvFormat::K4V4, KvFormat::K3V3, KvFormat::K2V2, KvFormat::K4V3] {
                let g = KvGeometry { n_layers: 1, n_kv_heads: 1, head_dim: hd, chunk_tokens: 16 };
                for kv in 0..2 {
                    let mut blk = vec![0u8; g.head_block_bytes(f, kv)];
                    write_block_f32(f, kv, &mut blk, 16, hd, n, &vals);
                    for b in blk {
                        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
                    }
                }
            }
        }
        assert_eq!(h, 0x3ed5_f71a_236e_3bbc, "split encoders' digest");
    }

    /// A token's f16 row is the same bytes through the slice conversion (an aligned block)
    /// and through the value-by-value store (a block at an odd address, where the bytes
    /// cannot be viewed as f16s), including the values where rounding to f16 is delicate.
    #[test]
    fn f16_rows_write_the_same_bytes_aligned_or_not() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(23);
        let hd = 64;
        let mut x: Vec<f32> = (0..hd).map(|_| rng.gen_range(-70_000.0..70_000.0) * rng.gen_range(0.0f32..1.0).powi(8)).collect();
        let specials = [0.0, -0.0, 65_504.0, 65_520.0, -1e6, 6e-8, 3e-8, 1.0 + 1.0 / 2048.0, f32::INFINITY, f32::NEG_INFINITY];
        x[..specials.len()].copy_from_slice(&specials);
        let want: Vec<u8> = x.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect();
        // The same backing store at an even and at an odd offset: t = 1 of a 2-token block.
        let mut store = vec![0u16; 2 * hd + 1];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut store);
        for off in [0, 1] {
            let blk = &mut bytes[off..off + 4 * hd];
            blk.fill(0xAA);
            write_token(KvFormat::F16, blk, 1, 2, &x);
            assert_eq!(&blk[2 * hd..], &want[..], "offset {off}");
            assert!(blk[..2 * hd].iter().all(|&b| b == 0xAA), "offset {off}: token 0 untouched");
        }
    }
}

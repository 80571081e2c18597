//! ggml tensor types, their block layouts, and the scalar reference code for each: dequantize,
//! quantize activations, and block dot products. The SIMD kernels in `kernels` are checked
//! against these.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // quantization narrows on purpose

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::pool::ThreadPool;

/// A tensor element type as numbered in ggml.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl GgmlType {
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            30 => Self::BF16,
            _ => return None,
        })
    }
    /// ggml's number for the type (the inverse of [`Self::from_u32`]).
    pub fn as_u32(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::BF16 => 30,
        }
    }
    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K => QK_K,
        }
    }
    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => std::mem::size_of::<BlockQ4_0>(),
            Self::Q4_1 => std::mem::size_of::<BlockQ4_1>(),
            Self::Q5_0 => std::mem::size_of::<BlockQ5_0>(),
            Self::Q5_1 => std::mem::size_of::<BlockQ5_1>(),
            Self::Q8_0 => std::mem::size_of::<BlockQ8_0>(),
            Self::Q4K => std::mem::size_of::<BlockQ4K>(),
            Self::Q5K => std::mem::size_of::<BlockQ5K>(),
            Self::Q6K => std::mem::size_of::<BlockQ6K>(),
        }
    }
    /// Bytes of one row of `cols` elements (`cols` a multiple of the block size).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_size() * self.type_size()
    }
}

pub const QK: usize = 32;
pub const QK_K: usize = 256;

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);

/// 32 weights at 5 bits, `w = (q - 16) d`: low nibbles as Q4_0's, the fifth bits in `qh`
/// (bit `j` for element `j`, bit `16 + j` for element `16 + j`; little-endian).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);

/// 32 weights at 5 bits, `w = q d + m`, laid out as [`BlockQ5_0`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);

/// The 5-bit codes (0..32) of a Q5 block: element `j` and `16 + j` for `j < 16`.
#[inline]
pub fn q5_codes(qh: [u8; 4], qs: &[u8; QK / 2]) -> [u8; QK] {
    let h = u32::from_le_bytes(qh);
    let mut out = [0u8; QK];
    for j in 0..QK / 2 {
        out[j] = (qs[j] & 0xF) | ((((h >> j) & 1) as u8) << 4);
        out[j + QK / 2] = (qs[j] >> 4) | ((((h >> (j + 16)) & 1) as u8) << 4);
    }
    out
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);

/// Q4_K with a fifth bit: bit `2j + h` of `qh[l]` is the fifth bit of value `64 j + 32 h + l`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);

/// Q4_K and Q5_K, which differ only in Q5_K's fifth bits: one reference and one kernel each
/// per instruction set serve both.
pub trait KBlock: Pod {
    fn d(&self) -> f16;
    fn dmin(&self) -> f16;
    fn scales(&self) -> &[u8; 12];
    /// The low nibbles: byte `32 j + l` holds values `64 j + l` (low) and `64 j + 32 + l` (high).
    fn qs(&self) -> &[u8; QK_K / 2];
    /// Q5_K's fifth bits.
    fn qh(&self) -> Option<&[u8; QK_K / 8]>;
    /// Value `64 j + 32 h + l`'s code.
    #[inline(always)]
    fn code(&self, j: usize, h: usize, l: usize) -> u8 {
        let q = self.qs()[32 * j + l];
        let low = if h == 0 { q & 0xF } else { q >> 4 };
        low | self.qh().map_or(0, |qh| ((qh[l] >> (2 * j + h)) & 1) << 4)
    }
}

impl KBlock for BlockQ4K {
    fn d(&self) -> f16 {
        self.d
    }
    fn dmin(&self) -> f16 {
        self.dmin
    }
    fn scales(&self) -> &[u8; 12] {
        &self.scales
    }
    fn qs(&self) -> &[u8; QK_K / 2] {
        &self.qs
    }
    fn qh(&self) -> Option<&[u8; QK_K / 8]> {
        None
    }
}

impl KBlock for BlockQ5K {
    fn d(&self) -> f16 {
        self.d
    }
    fn dmin(&self) -> f16 {
        self.dmin
    }
    fn scales(&self) -> &[u8; 12] {
        &self.scales
    }
    fn qs(&self) -> &[u8; QK_K / 2] {
        &self.qs
    }
    fn qh(&self) -> Option<&[u8; QK_K / 8]> {
        Some(&self.qh)
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);

/// Reinterprets tensor bytes as blocks. GGUF aligns tensor data to at least 32 bytes, so the
/// 2-byte alignment of the block types always holds for real files; a misaligned slice is a
/// caller bug and panics with a message.
pub fn blocks<T: Pod>(bytes: &[u8]) -> &[T] {
    bytemuck::try_cast_slice(bytes).unwrap_or_else(|e| panic!("tensor bytes are not {}-blocks: {e:?}", std::any::type_name::<T>()))
}

/// Block `b` of a Q4_0 or Q4_1 row as `(d, m, codes)` with `w = q * d + m`: Q4_0's `q - 8`
/// becomes `m = -8d`, exact in f16 (a power-of-two multiple). Codes as in GGUF: byte `k` holds
/// element `k` (low nibble) and `16 + k` (high).
pub fn q4_block(ty: GgmlType, row: &[u8], b: usize) -> (f16, f16, [u8; QK / 2]) {
    if ty == GgmlType::Q4_1 {
        let blk = &blocks::<BlockQ4_1>(row)[b];
        (blk.d, blk.m, blk.qs)
    } else {
        let blk = &blocks::<BlockQ4_0>(row)[b];
        (blk.d, f16::from_f32(-8.0 * blk.d.to_f32()), blk.qs)
    }
}

/// Activations quantized to 8 bits in blocks of 32 (llama.cpp's Q8_0/Q8_1), one row per token.
/// `d` is the block scale and `s = d * sum(qs)` (used by formats with an offset). Both are
/// rounded through f16 as llama.cpp stores them, so results track llama.cpp's closely.
/// `isum` is `sum(qs)` exactly: Q5_0's kernels take its code offset of 16 off through it.
#[derive(Debug, Default, Clone)]
pub struct Q8Acts {
    pub qs: Vec<[i8; QK]>,
    /// The codes plus 128, as unsigned bytes (`qs ^ 0x80`; codes are within -127..=127, so
    /// 1..=255): VNNI's `dpbusd` multiplies unsigned by signed bytes, and with the activations
    /// unsigned a Q8_0 product needs no per-token sign flips (see the pair tile's Q8_0 arm).
    pub qu: Vec<[u8; QK]>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub isum: Vec<i32>,
    /// Blocks per row.
    pub nb: usize,
    pub rows: usize,
}

/// Rows a job of a parallel quantization takes, or None to quantize on the calling thread:
/// from 4096 values (8 rows of the default model's 576: a 16-token prompt piece beside
/// three decoding calls spent ~0.7 ms of its ~11 ms pass quantizing its 19 rows on one
/// thread while the other waited, perf), in as many jobs as threads, at most 16 rows each
/// (a long prompt's many jobs even out a thread slowed by the host). Each block is quantized
/// alone: the same bits.
fn rows_per_job(rows: usize, cols: usize, threads: usize) -> Option<usize> {
    const MAX_ROWS_PER_JOB: usize = 16;
    const MIN_VALUES: usize = 4096;
    (threads > 1 && rows >= 2 && rows * cols >= MIN_VALUES).then(|| rows.div_ceil(threads).min(MAX_ROWS_PER_JOB))
}

impl Q8Acts {
    /// Quantizes `rows` rows of `cols` values each (`cols` a multiple of 32), spreading many
    /// rows over the pool.
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize, pool: &ThreadPool) {
        debug_assert_eq!(cols % QK, 0);
        debug_assert!(x.len() >= rows * cols);
        let nb = cols / QK;
        self.nb = nb;
        self.rows = rows;
        let n = rows * nb;
        self.qs.resize(n, [0; QK]);
        self.qu.resize(n, [0; QK]);
        self.d.resize(n, 0.0);
        self.s.resize(n, 0.0);
        self.isum.resize(n, 0);
        let Some(per_job) = rows_per_job(rows, cols, pool.threads()) else {
            quantize_blocks_q8(&x[..n * QK], &mut self.qs, &mut self.qu, &mut self.d, &mut self.s, &mut self.isum);
            return;
        };
        let step = per_job * nb;
        let jobs: Vec<_> = x[..n * QK]
            .chunks(step * QK)
            .zip(self.qs.chunks_mut(step).zip(self.qu.chunks_mut(step)))
            .zip(self.d.chunks_mut(step).zip(self.s.chunks_mut(step)))
            .zip(self.isum.chunks_mut(step))
            .map(|(((x, q), (d, s)), i)| (x, q, d, s, i))
            .collect();
        pool.scatter("quantize activations", jobs, &|(x, (q, u), d, s, i)| quantize_blocks_q8(x, q, u, d, s, i));
    }
}

/// Quantizes consecutive blocks of 32 values (see [`quantize_block_q8`]), with AVX2 where
/// present. Every matrix product's input goes through here (serially on the calling thread
/// in a decode step); the compiler's vectorization of [`quantize_block_q8`] packed the codes
/// a byte at a time (`vpextrb`/`vpinsrb`, ~3 cycles a value), so the AVX2 path is written out.
pub fn quantize_blocks_q8(x: &[f32], qs: &mut [[i8; QK]], qu: &mut [[u8; QK]], d: &mut [f32], s: &mut [f32], isum: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2() {
        let n = qs.len().min(qu.len()).min(d.len()).min(s.len()).min(isum.len()).min(x.len() / QK);
        for (b, xb) in x.chunks_exact(QK).take(n).enumerate() {
            // SAFETY: the CPU has the features (checked just above); `xb` holds 32 values.
            (d[b], s[b], isum[b]) = unsafe { quantize_block_q8_avx2(xb.try_into().expect("32 values"), &mut qs[b], &mut qu[b]) };
        }
        return;
    }
    quantize_blocks_body(x, qs, qu, d, s, isum);
}

/// [`quantize_block_q8`] on AVX2, operation for operation the scalar code's (the same
/// maximum, the same product rounded to nearest even, NaN to 0, the same clamp; F16C's
/// rounding to f16 is `f16::from_f32`'s), so the same bits.
///
/// # Safety
/// Needs AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_block_q8_avx2(x: &[f32; QK], out: &mut [i8; QK], unsigned: &mut [u8; QK]) -> (f32, f32, i32) {
    use std::arch::x86_64::*;
    // SAFETY: four loads of 8 values inside the block's 32.
    let v: [__m256; 4] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x[8 * i..].as_ptr()) });
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    // `max_ps(a, b)` gives `b` when either is NaN: a NaN value leaves the maximum as it was,
    // as `f32::max` does in the scalar fold.
    let mut m = _mm256_setzero_ps();
    for &vi in &v {
        m = _mm256_max_ps(_mm256_and_ps(vi, abs), m);
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: 8 values into 8.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
    let amax = lanes.iter().fold(0.0f32, |a, &l| a.max(l));
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let codes: [__m256i; 4] = std::array::from_fn(|i| {
        let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v[i], id));
        // NaN to +0 (the ordered compare is false only for NaN), then the clamp.
        let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
        _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
    });
    let t = _mm256_add_epi32(_mm256_add_epi32(codes[0], codes[1]), _mm256_add_epi32(codes[2], codes[3]));
    let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
    let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b01_00_11_10>(t));
    let sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32::<0b10_11_00_01>(t)));
    // Packing works within 128-bit halves: bytes come out as 4-value groups
    // [0 1 2 3 | 8 9 10 11 | 16.. | 24.. ] [4 5 6 7 | 12.. | 20.. | 28..]; a permute puts them back in order.
    let b = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]), _mm256_packs_epi32(codes[2], codes[3]));
    let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: 32 bytes into 32.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), b) };
    // SAFETY: 32 bytes into 32.
    unsafe { _mm256_storeu_si256(unsigned.as_mut_ptr().cast(), _mm256_xor_si256(b, _mm256_set1_epi8(i8::MIN))) };
    // The scale and the scaled sum rounded through f16 side by side (a call into `half` each
    // was a fifth of the block's time).
    let h = _mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_setr_ps(d, d * sum as f32, 0.0, 0.0)));
    let mut ds = [0.0f32; 4];
    // SAFETY: 4 values into 4.
    unsafe { _mm_storeu_ps(ds.as_mut_ptr(), h) };
    (ds[0], ds[1], sum)
}

#[inline(always)]
fn quantize_blocks_body(x: &[f32], qs: &mut [[i8; QK]], qu: &mut [[u8; QK]], d: &mut [f32], s: &mut [f32], isum: &mut [i32]) {
    for (((((xb, q), u), d), s), i) in
        x.chunks_exact(QK).zip(qs.iter_mut()).zip(qu.iter_mut()).zip(d.iter_mut()).zip(s.iter_mut()).zip(isum.iter_mut())
    {
        (*d, *s, *i) = quantize_block_q8(xb, q);
        *u = q.map(|c| c.cast_unsigned() ^ 0x80);
    }
}

/// Quantizes 32 values to i8 with scale `amax/127`, rounding half to even (as llama.cpp's AVX2
/// path does); returns the f16-rounded scale, `d * sum(q)` f16-rounded, and `sum(q)`.
#[inline(always)]
pub fn quantize_block_q8(x: &[f32], out: &mut [i8; QK]) -> (f32, f32, i32) {
    // The largest magnitude, eight lanes at a time: a fold in one chain compiled to 32 scalar
    // maxes (a tenth of a batched decode step went to quantizing activations). `max` ignores
    // NaN either way and is exact, so the result is the fold's.
    let mut lanes = [0.0f32; 8];
    for c in x.chunks_exact(8) {
        for (m, v) in lanes.iter_mut().zip(c) {
            *m = m.max(v.abs());
        }
    }
    let amax = lanes.iter().fold(0.0f32, |m, &v| m.max(v));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in out.iter_mut().zip(x) {
        // Clamped as a float (NaN to 0, as `as i32` would): Rust's saturating float-to-int
        // cast compiled to compares and branches per value here, the clamped one to a
        // vector conversion. The same codes for every input.
        let r = (v * id).round_ties_even();
        let r = if r.is_nan() { 0.0 } else { r.clamp(-127.0, 127.0) };
        // SAFETY: `r` is finite and within -127..=127.
        *q = unsafe { r.to_int_unchecked::<i32>() } as i8;
        sum += i32::from(*q);
    }
    let d16 = f16::from_f32(d).to_f32();
    (d16, f16::from_f32(d * sum as f32).to_f32(), sum)
}

/// Activations quantized for K-quant dot products (llama.cpp's Q8_K): blocks of 256 with an f32
/// scale and sums of each 16 values.
#[derive(Debug, Default, Clone)]
pub struct Q8KActs {
    pub qs: Vec<[i8; QK_K]>,
    pub d: Vec<f32>,
    pub bsums: Vec<[i16; QK_K / 16]>,
    pub nb: usize,
    pub rows: usize,
}

impl Q8KActs {
    /// Quantizes `rows` rows of `cols` values each (`cols` a multiple of 256), spreading many
    /// rows over the pool (a prompt's activations: serial, they were a tenth of a K-quant
    /// model's prefill).
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize, pool: &ThreadPool) {
        debug_assert_eq!(cols % QK_K, 0);
        debug_assert!(x.len() >= rows * cols);
        let nb = cols / QK_K;
        self.nb = nb;
        self.rows = rows;
        let n = rows * nb;
        self.qs.resize(n, [0; QK_K]);
        self.d.resize(n, 0.0);
        self.bsums.resize(n, [0; QK_K / 16]);
        let Some(per_job) = rows_per_job(rows, cols, pool.threads()) else {
            quantize_blocks_q8k(&x[..n * QK_K], &mut self.qs, &mut self.d, &mut self.bsums);
            return;
        };
        let step = per_job * nb;
        let jobs: Vec<_> = x[..n * QK_K]
            .chunks(step * QK_K)
            .zip(self.qs.chunks_mut(step))
            .zip(self.d.chunks_mut(step).zip(self.bsums.chunks_mut(step)))
            .map(|((x, q), (d, b))| (x, q, d, b))
            .collect();
        pool.scatter("quantize activations", jobs, &|(x, q, d, b)| quantize_blocks_q8k(x, q, d, b));
    }
}

/// Quantizes consecutive blocks of 256 values as llama.cpp's Q8_K (scale `-max/128` of the
/// value of largest magnitude, rounding half to even, sums of each 16 codes), with AVX2 where
/// present: the rounding then compiles to `vroundps` instead of a libm call per value.
pub fn quantize_blocks_q8k(x: &[f32], qs: &mut [[i8; QK_K]], d: &mut [f32], bsums: &mut [[i16; QK_K / 16]]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2() {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn run(x: &[f32], qs: &mut [[i8; QK_K]], d: &mut [f32], bsums: &mut [[i16; QK_K / 16]]) {
            quantize_blocks_q8k_body(x, qs, d, bsums);
        }
        // SAFETY: the CPU has the features (checked just above).
        unsafe { run(x, qs, d, bsums) };
        return;
    }
    quantize_blocks_q8k_body(x, qs, d, bsums);
}

#[inline(always)]
fn quantize_blocks_q8k_body(x: &[f32], qs: &mut [[i8; QK_K]], d: &mut [f32], bsums: &mut [[i16; QK_K / 16]]) {
    for (((xb, qs), d), bsums) in x.chunks_exact(QK_K).zip(qs.iter_mut()).zip(d.iter_mut()).zip(bsums.iter_mut()) {
        (*d, *bsums) = quantize_block_q8k(xb.try_into().expect("256 values"), qs);
    }
}

/// One block of [`quantize_blocks_q8k`]: the codes into `qs`; returns the scale and the sums.
/// Written so that it vectorizes (decode quantizes every matrix product's input, serially):
/// the reference's scan for the first value of largest magnitude was a branch per value.
#[inline(always)]
fn quantize_block_q8k(xb: &[f32; QK_K], qs: &mut [i8; QK_K]) -> (f32, [i16; QK_K / 16]) {
    // The largest value and the largest negated one, eight lanes at a time. `gt` ignores NaN,
    // as the reference's `>` does, and is `vmaxps` itself (`f32::max` added a NaN test and a
    // blend per vector). The reference takes the first value of largest magnitude: when both
    // signs reach it, which comes first is looked up.
    let gt = |m: f32, v: f32| if v > m { v } else { m };
    let (mut hi, mut lo) = ([0.0f32; 8], [0.0f32; 8]);
    for c in xb.chunks_exact(8) {
        for ((h, l), &v) in hi.iter_mut().zip(lo.iter_mut()).zip(c) {
            *h = gt(*h, v);
            *l = gt(*l, -v);
        }
    }
    let hi = hi.iter().fold(0.0f32, |m, &v| gt(m, v));
    let lo = lo.iter().fold(0.0f32, |m, &v| gt(m, v));
    let max = match hi.partial_cmp(&lo) {
        Some(std::cmp::Ordering::Greater) => hi,
        Some(std::cmp::Ordering::Less) => -lo,
        _ => xb.iter().copied().find(|v| v.abs() == hi).unwrap_or(0.0),
    };
    if max == 0.0 {
        qs.fill(0);
        return (0.0, [0; QK_K / 16]);
    }
    let iscale = -128.0 / max;
    let mut bsums = [0i16; QK_K / 16];
    for ((qc, xc), s) in qs.chunks_exact_mut(16).zip(xb.chunks_exact(16)).zip(bsums.iter_mut()) {
        let mut sum = 0i32;
        for (q, &v) in qc.iter_mut().zip(xc) {
            // |iscale v| <= 128 (|v| <= |max|), so clamping as a float gives the reference's
            // `(r as i32).min(127)` (NaN to 0 as `as` does) and compiles to a vector conversion.
            let r = (iscale * v).round_ties_even();
            let r = if r.is_nan() { 0.0 } else { r.clamp(-128.0, 127.0) };
            // SAFETY: `r` is finite and within -128..=127.
            let c = unsafe { r.to_int_unchecked::<i32>() };
            *q = c as i8;
            sum += c;
        }
        // 16 codes of at most 128 in magnitude: the sum fits.
        *s = sum as i16;
    }
    (1.0 / iscale, bsums)
}

/// llama.cpp's Q8_K quantization of one block as it is written (`quantize_row_q8_K_ref`): the
/// reference [`quantize_block_q8k`] is held to, bit for bit.
#[cfg(test)]
fn quantize_block_q8k_ref(xb: &[f32; QK_K], qs: &mut [i8; QK_K]) -> (f32, [i16; QK_K / 16]) {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in xb {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        qs.fill(0);
        return (0.0, [0; QK_K / 16]);
    }
    let iscale = -128.0 / max;
    for (q, &v) in qs.iter_mut().zip(xb) {
        *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
    }
    let mut bsums = [0i16; QK_K / 16];
    for (j, s) in bsums.iter_mut().enumerate() {
        *s = qs[j * 16..(j + 1) * 16].iter().map(|&q| i16::from(q)).sum();
    }
    (1.0 / iscale, bsums)
}

// ---------------------------------------------------------------------------------------------
// Dequantization (reference; also used for embedding rows).

pub fn dequantize_row(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes(c.try_into().expect("4 bytes"));
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q4_0 => {
            for (b, o) in blocks::<BlockQ4_0>(src).iter().zip(out.chunks_exact_mut(QK)) {
                let d = b.d.to_f32();
                for j in 0..QK / 2 {
                    o[j] = (f32::from(b.qs[j] & 0xF) - 8.0) * d;
                    o[j + QK / 2] = (f32::from(b.qs[j] >> 4) - 8.0) * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (b, o) in blocks::<BlockQ4_1>(src).iter().zip(out.chunks_exact_mut(QK)) {
                let (d, m) = (b.d.to_f32(), b.m.to_f32());
                for j in 0..QK / 2 {
                    o[j] = f32::from(b.qs[j] & 0xF) * d + m;
                    o[j + QK / 2] = f32::from(b.qs[j] >> 4) * d + m;
                }
            }
        }
        GgmlType::Q5_0 => {
            for (b, o) in blocks::<BlockQ5_0>(src).iter().zip(out.chunks_exact_mut(QK)) {
                let d = b.d.to_f32();
                for (o, &q) in o.iter_mut().zip(&q5_codes(b.qh, &b.qs)) {
                    *o = (f32::from(q) - 16.0) * d;
                }
            }
        }
        GgmlType::Q5_1 => {
            for (b, o) in blocks::<BlockQ5_1>(src).iter().zip(out.chunks_exact_mut(QK)) {
                let (d, m) = (b.d.to_f32(), b.m.to_f32());
                for (o, &q) in o.iter_mut().zip(&q5_codes(b.qh, &b.qs)) {
                    *o = f32::from(q) * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (b, o) in blocks::<BlockQ8_0>(src).iter().zip(out.chunks_exact_mut(QK)) {
                let d = b.d.to_f32();
                for (o, &q) in o.iter_mut().zip(&b.qs) {
                    *o = f32::from(q) * d;
                }
            }
        }
        GgmlType::Q4K => dequantize_k4(blocks::<BlockQ4K>(src), out),
        GgmlType::Q5K => dequantize_k4(blocks::<BlockQ5K>(src), out),
        GgmlType::Q6K => {
            for (b, o) in blocks::<BlockQ6K>(src).iter().zip(out.chunks_exact_mut(QK_K)) {
                let d = b.d.to_f32();
                for n in 0..2 {
                    let ql = &b.ql[n * 64..];
                    let qh = &b.qh[n * 32..];
                    let sc = &b.scales[n * 8..];
                    let y = &mut o[n * 128..];
                    for l in 0..32 {
                        let is = l / 16;
                        let q = q6_values(ql, qh, l);
                        y[l] = d * f32::from(sc[is]) * f32::from(q[0]);
                        y[l + 32] = d * f32::from(sc[is + 2]) * f32::from(q[1]);
                        y[l + 64] = d * f32::from(sc[is + 4]) * f32::from(q[2]);
                        y[l + 96] = d * f32::from(sc[is + 6]) * f32::from(q[3]);
                    }
                }
            }
        }
    }
}

/// The four 6-bit values (minus 32) at position `l` of a 128-value half of a Q6_K block.
#[inline]
/// The 6-bit code (0..64, before the offset of 32) of value `v` of a Q6_K block.
pub fn q6k_code(b: &BlockQ6K, v: usize) -> u8 {
    let (n, g, l) = (v / 128, (v % 128) / 32, v % 32);
    (q6_values(&b.ql[64 * n..], &b.qh[32 * n..], l)[g] + 32) as u8
}

fn q6_values(ql: &[u8], qh: &[u8], l: usize) -> [i8; 4] {
    let h = qh[l];
    [
        ((ql[l] & 0xF) | ((h & 3) << 4)) as i8 - 32,
        ((ql[l + 32] & 0xF) | (((h >> 2) & 3) << 4)) as i8 - 32,
        ((ql[l] >> 4) | (((h >> 4) & 3) << 4)) as i8 - 32,
        ((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) as i8 - 32,
    ]
}

/// Scale and min of sub-block `j` of a Q4_K block (6 bits each, packed in 12 bytes).
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

// ---------------------------------------------------------------------------------------------
// Scalar reference dot products: one weight row against one activation row.

/// As llama.cpp's `ggml_vec_dot_q4_0_q8_0`: the integer sum of `(q - 8) x`, then both scales.
pub fn dot_q4_0_ref(w: &[BlockQ4_0], a: &Q8Acts, row: usize) -> f32 {
    let mut sum = 0.0f32;
    for (i, b) in w.iter().enumerate() {
        let k = row * a.nb + i;
        let q = &a.qs[k];
        let mut s = 0i32;
        for j in 0..QK / 2 {
            s += (i32::from(b.qs[j] & 0xF) - 8) * i32::from(q[j]) + (i32::from(b.qs[j] >> 4) - 8) * i32::from(q[j + 16]);
        }
        sum += b.d.to_f32() * a.d[k] * s as f32;
    }
    sum
}

pub fn dot_q4_1_ref(w: &[BlockQ4_1], a: &Q8Acts, row: usize) -> f32 {
    let mut sum = 0.0f32;
    for (i, b) in w.iter().enumerate() {
        let k = row * a.nb + i;
        let q = &a.qs[k];
        let mut s = 0i32;
        for j in 0..QK / 2 {
            s += i32::from(b.qs[j] & 0xF) * i32::from(q[j]) + i32::from(b.qs[j] >> 4) * i32::from(q[j + 16]);
        }
        sum += b.d.to_f32() * a.d[k] * s as f32 + b.m.to_f32() * a.s[k];
    }
    sum
}

/// As llama.cpp's `ggml_vec_dot_q5_0_q8_0`: the integer sum of `(q - 16) x`, then both scales.
pub fn dot_q5_0_ref(w: &[BlockQ5_0], a: &Q8Acts, row: usize) -> f32 {
    let mut sum = 0.0f32;
    for (i, b) in w.iter().enumerate() {
        let k = row * a.nb + i;
        let s: i32 = q5_codes(b.qh, &b.qs).iter().zip(&a.qs[k]).map(|(&c, &x)| (i32::from(c) - 16) * i32::from(x)).sum();
        sum += b.d.to_f32() * a.d[k] * s as f32;
    }
    sum
}

/// As llama.cpp's `ggml_vec_dot_q5_1_q8_1`: `d d_x sum(q x) + m s_x`.
pub fn dot_q5_1_ref(w: &[BlockQ5_1], a: &Q8Acts, row: usize) -> f32 {
    let mut sum = 0.0f32;
    for (i, b) in w.iter().enumerate() {
        let k = row * a.nb + i;
        let s: i32 = q5_codes(b.qh, &b.qs).iter().zip(&a.qs[k]).map(|(&c, &x)| i32::from(c) * i32::from(x)).sum();
        sum += b.d.to_f32() * a.d[k] * s as f32 + b.m.to_f32() * a.s[k];
    }
    sum
}

pub fn dot_q8_0_ref(w: &[BlockQ8_0], a: &Q8Acts, row: usize) -> f32 {
    let mut sum = 0.0f32;
    for (i, b) in w.iter().enumerate() {
        let k = row * a.nb + i;
        let s: i32 = b.qs.iter().zip(&a.qs[k]).map(|(&x, &y)| i32::from(x) * i32::from(y)).sum();
        sum += b.d.to_f32() * a.d[k] * s as f32;
    }
    sum
}

/// As llama.cpp's `ggml_vec_dot_q4_K_q8_K` / `_q5_K_`: per block the integer sums of code x
/// activation times the 6-bit scales, and the mins times Q8_K's 16-value sums, then
/// `d_x (d sumi - dmin summins)`.
pub fn dot_k4_ref<B: KBlock>(w: &[B], a: &Q8KActs, row: usize) -> f32 {
    let mut sum = 0.0f32;
    for (i, b) in w.iter().enumerate() {
        let k = row * a.nb + i;
        let q8 = &a.qs[k];
        let mut sumi = 0i32;
        let mut sumi_mins = 0i32;
        for j in 0..QK_K / 64 {
            for h in 0..2 {
                let sub = 2 * j + h;
                let (sc, m) = scale_min_k4(sub, b.scales());
                let mut s = 0i32;
                for l in 0..32 {
                    s += i32::from(b.code(j, h, l)) * i32::from(q8[sub * 32 + l]);
                }
                sumi += i32::from(sc) * s;
                sumi_mins += i32::from(m) * (i32::from(a.bsums[k][2 * sub]) + i32::from(a.bsums[k][2 * sub + 1]));
            }
        }
        sum += a.d[k] * (b.d().to_f32() * sumi as f32 - b.dmin().to_f32() * sumi_mins as f32);
    }
    sum
}

/// Q4_K / Q5_K blocks to f32, as llama.cpp's `dequantize_row_q4_K` / `_q5_K`.
fn dequantize_k4<B: KBlock>(w: &[B], out: &mut [f32]) {
    for (b, o) in w.iter().zip(out.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (b.d().to_f32(), b.dmin().to_f32());
        for j in 0..QK_K / 64 {
            for h in 0..2 {
                let (sc, m) = scale_min_k4(2 * j + h, b.scales());
                for l in 0..32 {
                    o[64 * j + 32 * h + l] = d * f32::from(sc) * f32::from(b.code(j, h, l)) - dmin * f32::from(m);
                }
            }
        }
    }
}

pub fn dot_q6k_ref(w: &[BlockQ6K], a: &Q8KActs, row: usize) -> f32 {
    let mut sum = 0.0f32;
    for (i, b) in w.iter().enumerate() {
        let k = row * a.nb + i;
        let q8 = &a.qs[k];
        let mut sumi = 0i32;
        for n in 0..2 {
            let ql = &b.ql[n * 64..];
            let qh = &b.qh[n * 32..];
            let mut sub = [0i32; 8];
            for l in 0..32 {
                let q = q6_values(ql, qh, l);
                let is = l / 16;
                for (g, &qv) in q.iter().enumerate() {
                    sub[is + 2 * g] += i32::from(qv) * i32::from(q8[n * 128 + g * 32 + l]);
                }
            }
            for (g, s) in sub.iter().enumerate() {
                sumi += i32::from(b.scales[n * 8 + g]) * s;
            }
        }
        sum += b.d.to_f32() * a.d[k] * sumi as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A xorshift64 stream: the quantizers' test inputs, the same on every run.
    fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        }
    }

    /// The vectorizable quantizer gives the codes, scale and sums of the plain formula (a
    /// sequential fold for the maximum, the saturating cast, then the clamp) for every input:
    /// random blocks, exact ties, zeros, infinities and NaN.
    #[test]
    fn q8_blocks_quantize_as_the_plain_formula() {
        fn plain(x: &[f32], out: &mut [i8; QK]) -> (f32, f32, i32) {
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in out.iter_mut().zip(x) {
                *q = ((v * id).round_ties_even() as i32).clamp(-127, 127) as i8;
                sum += i32::from(*q);
            }
            (f16::from_f32(d).to_f32(), f16::from_f32(d * sum as f32).to_f32(), sum)
        }
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15u64);
        let specials = [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 0.5, -0.5, 127.0, -254.0, 1e-30];
        for case in 0..2000 {
            let mut x = [0.0f32; QK];
            for v in &mut x {
                let r = next();
                *v = match case % 4 {
                    // Values on a grid of halves of the step: rounding ties.
                    0 => (r % 509) as f32 * 0.5 - 127.0,
                    1 => f32::from_bits(r as u32 & 0xBF7F_FFFF),
                    _ => ((r % 20_001) as f32 - 10_000.0) / 1000.0,
                };
                if case % 3 == 0 && r.is_multiple_of(7) {
                    *v = specials[(r >> 8) as usize % specials.len()];
                }
            }
            let (mut a, mut b) = ([0i8; QK], [0i8; QK]);
            let got = quantize_block_q8(&x, &mut a);
            let want = plain(&x, &mut b);
            assert_eq!(a, b, "codes of {x:?}");
            assert_eq!(got.0.to_bits(), want.0.to_bits(), "scale of {x:?}");
            assert_eq!(got.1.to_bits(), want.1.to_bits(), "scaled sum of {x:?}");
            assert_eq!(got.2, want.2, "sum of {x:?}");
            // The blocks' quantizer (AVX2 where present) as well.
            let (mut q, mut u, mut d, mut s, mut i) = ([[0i8; QK]; 1], [[0u8; QK]; 1], [0.0f32; 1], [0.0f32; 1], [0i32; 1]);
            quantize_blocks_q8(&x, &mut q, &mut u, &mut d, &mut s, &mut i);
            assert_eq!(q[0], b, "codes of {x:?} (blocks)");
            assert_eq!(u[0].map(|c| i32::from(c) - 128), b.map(i32::from), "unsigned codes of {x:?} (blocks)");
            assert_eq!(
                (d[0].to_bits(), s[0].to_bits(), i[0]),
                (want.0.to_bits(), want.1.to_bits(), want.2),
                "scales and sum of {x:?} (blocks)"
            );
        }
    }

    /// The vectorizable Q8_K quantizer (and the AVX2 build of it that decode runs) gives
    /// llama.cpp's codes, scale and sums for every input: random blocks, blocks where both
    /// signs reach the largest magnitude (which comes first decides the scale's sign), zeros,
    /// infinities and NaN.
    #[test]
    fn q8k_blocks_quantize_as_llama_cpp_does() {
        let mut next = xorshift(0x2545_F491_4F6C_DD1Du64);
        let specials = [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 0.5, -0.5, 3.0, -3.0, 1e-30];
        let (mut ties, mut cases) = (0, Vec::new());
        for case in 0..3000 {
            let mut x = [0.0f32; QK_K];
            for v in &mut x {
                let r = next();
                *v = match case % 5 {
                    // Small integers: both signs often reach the largest magnitude.
                    0 => (r % 7) as f32 - 3.0,
                    1 => f32::from_bits(r as u32 & 0xBF7F_FFFF),
                    2 => 0.0,
                    _ => ((r % 20_001) as f32 - 10_000.0) / 1000.0,
                };
                if case % 3 == 0 && r.is_multiple_of(11) {
                    *v = specials[(r >> 8) as usize % specials.len()];
                }
            }
            let (hi, lo) = (x.iter().fold(0.0f32, |m, &v| m.max(v)), x.iter().fold(0.0f32, |m, &v| m.max(-v)));
            ties += usize::from(hi == lo && hi > 0.0);
            cases.extend_from_slice(&x);
        }
        assert!(ties > 100, "the cases include blocks whose extremes tie ({ties})");
        let n = cases.len() / QK_K;
        let (mut qs, mut d, mut bsums) = (vec![[0i8; QK_K]; n], vec![0f32; n], vec![[0i16; QK_K / 16]; n]);
        quantize_blocks_q8k(&cases, &mut qs, &mut d, &mut bsums);
        for (i, x) in cases.chunks_exact(QK_K).enumerate() {
            let x: &[f32; QK_K] = x.try_into().unwrap();
            let mut want = [0i8; QK_K];
            let (wd, wsums) = quantize_block_q8k_ref(x, &mut want);
            assert_eq!(qs[i], want, "codes of {x:?}");
            assert_eq!(d[i].to_bits(), wd.to_bits(), "scale of {x:?}");
            assert_eq!(bsums[i], wsums, "sums of {x:?}");
        }
    }

    /// Q5 codes as ggml defines them: low nibbles as Q4's, fifth bits from `qh` (bit j for
    /// element j, bit 16 + j for element 16 + j); Q5_0 is `(q - 16) d`, Q5_1 `q d + m`.
    #[test]
    fn q5_blocks_decode_as_ggml_defines_them() {
        let mut qs = [0u8; QK / 2];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = (j as u8 & 0xF) | ((15 - j as u8) << 4);
        }
        // Fifth bit set for elements 0, 3 and 16 + 2.
        let qh = (1u32 | 1 << 3 | 1 << 18).to_le_bytes();
        let c = q5_codes(qh, &qs);
        assert_eq!(&c[..4], &[16, 1, 2, 19]);
        assert_eq!(&c[16..19], &[15, 14, 13 + 16]);
        let b0 = BlockQ5_0 { d: f16::from_f32(0.5), qh, qs };
        let mut out = [0.0f32; QK];
        dequantize_row(GgmlType::Q5_0, bytemuck::bytes_of(&b0), &mut out);
        assert_eq!(&out[..4], &[0.0, -7.5, -7.0, 1.5]);
        let b1 = BlockQ5_1 { d: f16::from_f32(0.25), m: f16::from_f32(-1.0), qh, qs };
        dequantize_row(GgmlType::Q5_1, bytemuck::bytes_of(&b1), &mut out);
        assert_eq!(&out[..4], &[3.0, -0.75, -0.5, 3.75]);
        assert_eq!(GgmlType::from_u32(6), Some(GgmlType::Q5_0));
        for v in 0..40 {
            if let Some(t) = GgmlType::from_u32(v) {
                assert_eq!(t.as_u32(), v);
            }
        }
        assert_eq!(GgmlType::from_u32(7), Some(GgmlType::Q5_1));
        assert_eq!(GgmlType::Q5_1.row_bytes(64), 48);
    }

    /// Q5_K as ggml's `dequantize_row_q5_K` walks it: 64 values at a time, the fifth bit of
    /// value `l` (`32 + l`) of each 64 under mask `u1` (`u2`), both shifted left by 2 per 64.
    #[test]
    fn q5_k_blocks_decode_as_ggml_walks_them() {
        let mut b = BlockQ5K::zeroed();
        b.d = f16::from_f32(0.5);
        b.dmin = f16::from_f32(0.25);
        for (i, s) in b.scales.iter_mut().enumerate() {
            *s = (i as u8).wrapping_mul(37).wrapping_add(5) ^ 0x5A;
        }
        for (i, q) in b.qs.iter_mut().enumerate() {
            *q = (i as u8).wrapping_mul(29) ^ 0x3C;
        }
        for (i, h) in b.qh.iter_mut().enumerate() {
            *h = (i as u8).wrapping_mul(73) ^ 0xA5;
        }
        let mut want = [0.0f32; QK_K];
        let (mut u1, mut u2, mut y) = (1u8, 2u8, 0);
        for j in 0..4 {
            let (sc1, m1) = scale_min_k4(2 * j, &b.scales);
            let (sc2, m2) = scale_min_k4(2 * j + 1, &b.scales);
            let (d1, d2) = (0.5 * f32::from(sc1), 0.5 * f32::from(sc2));
            let (n1, n2) = (0.25 * f32::from(m1), 0.25 * f32::from(m2));
            for l in 0..32 {
                want[y] = d1 * f32::from((b.qs[32 * j + l] & 0xF) + if b.qh[l] & u1 != 0 { 16 } else { 0 }) - n1;
                want[y + 32] = d2 * f32::from((b.qs[32 * j + l] >> 4) + if b.qh[l] & u2 != 0 { 16 } else { 0 }) - n2;
                y += 1;
            }
            y += 32;
            u1 <<= 2;
            u2 <<= 2;
        }
        let mut out = [0.0f32; QK_K];
        dequantize_row(GgmlType::Q5K, bytemuck::bytes_of(&b), &mut out);
        assert_eq!(out, want);
        assert_eq!(GgmlType::from_u32(13), Some(GgmlType::Q5K));
        assert_eq!(GgmlType::Q5K.row_bytes(512), 352);
    }

    /// Q8_K as llama.cpp quantizes: `d = -max/128` of the value of largest magnitude, codes
    /// rounded half to even and capped at 127, sums of each 16; the same blocks whether the
    /// rows go through the pool or not (and through AVX2's `vroundps` or the portable loop).
    #[test]
    fn q8k_activations_quantize_as_llama_cpp_and_the_same_split_or_not() {
        let (rows, cols) = (40, 2 * QK_K);
        let mut x: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 1001) as f32 / 100.0 - 5.0).collect();
        // Row 0, block 0: the largest magnitude first at 20 (scale -128/20), then -20 (128,
        // capped), -10 (64) and a value 2.5 steps from 0 (to even: 2).
        x[3..7].copy_from_slice(&[20.0, -20.0, -10.0, -20.0 * 2.5 / 128.0]);
        x[cols..cols + QK_K].fill(0.0); // row 1, block 0: all zero
        let pool = ThreadPool::new(2);
        let mut a = Q8KActs::default();
        a.quantize(&x, rows, cols, &pool);
        let mut b = Q8KActs::default();
        b.quantize(&x, 1, rows * cols, &ThreadPool::new(1));
        assert_eq!(a.nb, 2);
        assert_eq!((a.qs.as_slice(), a.d.as_slice(), a.bsums.as_slice()), (b.qs.as_slice(), b.d.as_slice(), b.bsums.as_slice()));
        assert_eq!(a.d[0], -20.0 / 128.0);
        assert_eq!(a.qs[0][3..7], [-128, 127, 64, 2]);
        assert_eq!((a.d[2], a.qs[2], a.bsums[2]), (0.0, [0; QK_K], [0; QK_K / 16]));
        for (q, s) in a.qs.iter().zip(&a.bsums) {
            for j in 0..QK_K / 16 {
                assert_eq!(s[j], q[16 * j..16 * j + 16].iter().map(|&v| i16::from(v)).sum::<i16>());
            }
        }
    }
}

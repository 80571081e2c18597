//! The AVX2/FMA/F16C kernels behind [`super`]'s dispatch: x86_64 only, chosen at run time.
// Every function here is an AVX2/FMA/F16C kernel whose one precondition is that the CPU
// has those features; the dispatchers above check that once (`crate::simd::has_avx2`) before calling in.
// Marking each intrinsic call `unsafe` again would hide the few real memory contracts,
// which are commented where they are (pointer loads).
#![allow(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
use std::arch::x86_64::*;

use half::f16;

use super::{KvRows, OutPtr};
use crate::quant::{GgmlType, Q8Acts, Q8KActs};
use crate::repack::{Packed, PackedWeight, ROWS};

pub(crate) mod colmajor;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Four activation bytes starting at `p`, broadcast to every 32-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bcast4(p: *const i8) -> __m256i {
    // SAFETY (callers): p points at 4 readable bytes inside an activation block.
    _mm256_set1_epi32(std::ptr::read_unaligned(p.cast::<i32>()))
}

/// Asks for every cache line of the block [`super::ahead::distance`] bytes past `blk` into L1,
/// and for the same lines [`super::ahead::BEYOND`] bytes further into L2; nothing at distance
/// 0 (the hardware prefetchers alone). No fault: a prefetch past the matrix's end is dropped
/// by the CPU, and the address is only computed, never read. Decode's products stream the
/// weights and want the lines early; prefill's 4-token tiles reuse each block and are bound by
/// arithmetic: the prefetch neither helps nor costs them (tools/bench/ab, pp512 0.99x), so
/// every tile asks.
#[inline(always)]
unsafe fn prefetch_ahead<B>(blk: *const B) {
    let d = super::ahead::distance();
    if d == 0 {
        return;
    }
    let near = blk.cast::<i8>().wrapping_add(d);
    let far = near.wrapping_add(super::ahead::BEYOND);
    let mut off = 0;
    while off < std::mem::size_of::<B>() {
        _mm_prefetch::<_MM_HINT_T0>(near.wrapping_add(off));
        _mm_prefetch::<_MM_HINT_T1>(far.wrapping_add(off));
        off += 64;
    }
}

/// Part `i` of `n` of [`prefetch_ahead`]'s lines, for a block whose loop runs in `n` steps:
/// the K-quant single-stream tile over a decode step's rows ([`SPREAD_ROWS`]) asks for a
/// step's share of the block ahead at each of its 8 sub-blocks. An 8-row block of Q4_K is 18 lines and of Q6_K 27, and asked for all at once at
/// the block's start the burst outran the core's outstanding misses: on the AMD EPYC guest
/// Q6_K's stream went from 0.80-0.97 to 0.94-1.11 of the read, Q4_K's within the noise
/// (`matvec_rate distances`, docs/notes/engine.md). The 512-bit pair tiles ask for both
/// groups' blocks so when they stream (a batched decode step's [`SPREAD_ROWS`] rows or fewer):
/// 8 rows of Q4_K from memory 0.80x the time, of Q6_K 0.85x (`matvec_rate rows`). Q4_0's
/// blocks are 3 lines: asked at once.
///
/// Each line is asked for twice, as in [`prefetch_ahead`], but here the distance is the L2
/// ask's and the L1 ask is [`super::ahead::BEYOND`] behind it. Asked the other way round (L1
/// at the distance, L2 further) the 1.7B Q4_K_M decode gained nothing on the Intel Xeon guest
/// (tg64 22.2-23.2 tok/s either way); this way, with the distance fixed at 4 KiB, 24.6-25.7
/// against 22.7-23.5 with one ask at 2 KiB; the tuner chose 4-8 KiB (docs/notes/engine.md).
/// At a distance under `BEYOND` the L1 ask falls on lines already read: the tuner's
/// candidates there are the L2 ask alone.
#[inline(always)]
unsafe fn prefetch_ahead_part<B>(blk: *const B, i: usize, n: usize) {
    let d = super::ahead::distance();
    if d == 0 {
        return;
    }
    // Step `i`'s own share of the block, asked from its first byte: the same count of asks at
    // every step (a loop the compiler unrolls). The block's lines split as `lines * i / n`
    // made a loop of 2 or 3 turns by step, and cost the tile a quarter of its rate where the
    // weights sit in L2 (Q4_K, one thread: 26-27 GB/s, 38-39 this way; Q6_K 26-29 and 37;
    // from DRAM, many matrices on 2 threads, Q4_K 0.75-0.86 of the read, 0.90-0.96 this way,
    // Q6_K 0.79-0.83 and 0.86-0.93: `matvec_rate`, Intel Xeon guest); decode, 1.7B Q4_K_M:
    // tools/bench/ab tg128 1.05x (docs/results/ab-prefetch-share-1.7b-q4_k_m.json). No
    // hardware counters on that guest to say whether the varying loop's exit was
    // mispredicted. A share's last line, if partly the next share's, is asked by that share;
    // rounded up, the shares reach the block's end whatever its size (Q4_K's 1184 bytes and
    // Q6_K's 1680 split into 8 evenly: 148 and 210).
    let share = std::mem::size_of::<B>().div_ceil(n);
    let far = blk.cast::<i8>().wrapping_add(share * i + d);
    let near = far.wrapping_sub(super::ahead::BEYOND);
    for l in 0..share.div_ceil(64) {
        _mm_prefetch::<_MM_HINT_T1>(far.wrapping_add(64 * l));
        _mm_prefetch::<_MM_HINT_T0>(near.wrapping_add(64 * l));
    }
}

/// The packed matrix kernels, stamped out once per instruction set: `$q4`/`$q4_end`/`$q8` are
/// how 4-byte dot products accumulate. Every variant computes the same integers (the sums
/// never overflow), so they agree bit for bit.
macro_rules! packed_kernels {
    ($all:ident, $tile:ident, $q4sums:ident, $q5sums:ident, $feat:literal, $q4:ident, $q4_end:ident, $q8:ident, $q5:ident, $q5codes:ident) => {
        /// # Safety
        /// Needs AVX2, FMA and F16C.
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn $all(w: &PackedWeight, a: &Q8Acts, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
            each_tile!($tile, w, a, out, ldo, g0, g1);
        }

        /// One group of 8 rows against `T` tokens starting at `t0`, over every block.
        #[allow(clippy::needless_range_loop)] // `t` indexes several per-token arrays in step
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn $tile<const T: usize>(w: &PackedWeight, a: &Q8Acts, g: usize, t0: usize, out: OutPtr, ldo: usize) {
            let nb = w.blocks_per_row();
            let mut acc = [_mm256_setzero_ps(); T];
            // The tile reads blocks `0..nb` of each token: the activations must have as many.
            assert_eq!(a.nb, nb, "activations of another width");
            let x = TokenBlocks::<T>::new(a, t0);
            match &w.data {
                Packed::Q4(v) => {
                    let blks = &v[g * nb..(g + 1) * nb];
                    for (b, blk) in blks.iter().enumerate() {
                        prefetch_ahead(blk);
                        let p = $q4sums::<T>(&blk.qs, &x, b);
                        let dv = _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().cast()));
                        let mv = _mm256_cvtph_ps(_mm_loadu_si128(blk.m.as_ptr().cast()));
                        for t in 0..T {
                            let pf = _mm256_cvtepi32_ps(p[t]);
                            acc[t] = _mm256_fmadd_ps(pf, _mm256_mul_ps(dv, _mm256_set1_ps(x.d(t, b))), acc[t]);
                            acc[t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x.s(t, b)), acc[t]);
                        }
                    }
                }
                Packed::Q4S(v) => {
                    // Codes 0..16: the offset of 8 comes off the integer sum as `8 sum(x)`.
                    let blks = &v[g * nb..(g + 1) * nb];
                    for (b, blk) in blks.iter().enumerate() {
                        prefetch_ahead(blk);
                        let p = $q4sums::<T>(&blk.qs, &x, b);
                        let dv = _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().cast()));
                        for t in 0..T {
                            let pf = _mm256_cvtepi32_ps(_mm256_sub_epi32(p[t], _mm256_set1_epi32(8 * x.isum(t, b))));
                            acc[t] = _mm256_fmadd_ps(pf, _mm256_mul_ps(dv, _mm256_set1_ps(x.d(t, b))), acc[t]);
                        }
                    }
                }
                Packed::Q8(v) => {
                    let blks = &v[g * nb..(g + 1) * nb];
                    for (b, blk) in blks.iter().enumerate() {
                        prefetch_ahead(blk);
                        let mut p = [_mm256_setzero_si256(); T];
                        for k in 0..8 {
                            let wv = _mm256_loadu_si256(blk.qs.as_ptr().add(32 * k).cast());
                            let aw = _mm256_sign_epi8(wv, wv);
                            for t in 0..T {
                                let xv = bcast4(x.qs(t, b).add(4 * k));
                                p[t] = $q8(p[t], aw, _mm256_sign_epi8(xv, wv));
                            }
                        }
                        let dv = _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().cast()));
                        for t in 0..T {
                            let pf = _mm256_cvtepi32_ps(p[t]);
                            acc[t] = _mm256_fmadd_ps(pf, _mm256_mul_ps(dv, _mm256_set1_ps(x.d(t, b))), acc[t]);
                        }
                    }
                }
                Packed::Q5(v) => {
                    // Codes 0..32: the offset of 16 comes off the integer sum through the
                    // activations' exact sums (`16 sum(x)`), as `sum((q - 16) x)` would.
                    let blks = &v[g * nb..(g + 1) * nb];
                    for (b, blk) in blks.iter().enumerate() {
                        prefetch_ahead(blk);
                        let p = $q5sums::<T>(&blk.qh, &blk.qs, &x, b);
                        let dv = _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().cast()));
                        for t in 0..T {
                            let pf = _mm256_cvtepi32_ps(_mm256_sub_epi32(p[t], _mm256_set1_epi32(16 * x.isum(t, b))));
                            acc[t] = _mm256_fmadd_ps(pf, _mm256_mul_ps(dv, _mm256_set1_ps(x.d(t, b))), acc[t]);
                        }
                    }
                }
                Packed::Q4K(_) | Packed::Q5K(_) | Packed::Q6K(_) => {
                    unreachable!("K-quant groups take Q8_K activations: matmul_packed sends them to the K kernels")
                }
                Packed::Q5M(v) => {
                    // Codes 0..32 (Q5_1) with Q4_1's offset term `m * s_x`.
                    let blks = &v[g * nb..(g + 1) * nb];
                    for (b, blk) in blks.iter().enumerate() {
                        prefetch_ahead(blk);
                        let p = $q5sums::<T>(&blk.qh, &blk.qs, &x, b);
                        let dv = _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().cast()));
                        let mv = _mm256_cvtph_ps(_mm_loadu_si128(blk.m.as_ptr().cast()));
                        for t in 0..T {
                            let pf = _mm256_cvtepi32_ps(p[t]);
                            acc[t] = _mm256_fmadd_ps(pf, _mm256_mul_ps(dv, _mm256_set1_ps(x.d(t, b))), acc[t]);
                            acc[t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x.s(t, b)), acc[t]);
                        }
                    }
                }
            }
            store_group(&acc, w.rows, g, t0, out, ldo);
        }

        /// The 8 rows' integer sums `sum q x` (codes 0..16) of one packed 4-bit block against `T`
        /// tokens, in i32 lanes.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn $q4sums<const T: usize>(qs: &[u8; 128], x: &TokenBlocks<T>, b: usize) -> [__m256i; T] {
            let mask = _mm256_set1_epi8(0x0F);
            let mut p = [_mm256_setzero_si256(); T];
            for k in 0..4 {
                let wv = _mm256_loadu_si256(qs.as_ptr().add(32 * k).cast());
                let lo = _mm256_and_si256(wv, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), mask);
                for (t, pt) in p.iter_mut().enumerate() {
                    let xq = x.qs(t, b);
                    *pt = $q4(*pt, lo, hi, bcast4(xq.add(4 * k)), bcast4(xq.add(16 + 4 * k)));
                }
            }
            p.map(|x| $q4_end(x))
        }

        /// The 8 rows' integer sums `sum q x` (codes 0..32) of one packed Q5 block against `T`
        /// tokens: each 32-byte load's nibbles get their fifth bits from the block's `qh`.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn $q5sums<const T: usize>(qh: &[u8; 32], qs: &[u8; 128], x: &TokenBlocks<T>, b: usize) -> [__m256i; T] {
            let mask = _mm256_set1_epi8(0x0F);
            let h = _mm256_loadu_si256(qh.as_ptr().cast());
            let mut p = [_mm256_setzero_si256(); T];
            for k in 0..4 {
                let wv = _mm256_loadu_si256(qs.as_ptr().add(32 * k).cast());
                let lo = $q5codes(_mm256_and_si256(wv, mask), h, 2 * k as i32);
                let hi = $q5codes(_mm256_and_si256(_mm256_srli_epi16(wv, 4), mask), h, 2 * k as i32 + 1);
                for (t, pt) in p.iter_mut().enumerate() {
                    let xq = x.qs(t, b);
                    *pt = $q5(*pt, lo, hi, bcast4(xq.add(4 * k)), bcast4(xq.add(16 + 4 * k)));
                }
            }
            p
        }
    };
}

packed_kernels!(
    matmul_packed,
    packed_tile,
    q4_sums,
    q5_sums,
    "avx2,fma,f16c",
    q4_maddubs,
    q4_end_maddubs,
    q8_maddubs,
    q5_maddubs,
    q5_codes
);
packed_kernels!(
    matmul_packed_vnni256,
    packed_tile_vnni,
    q4_sums_vnni,
    q5_sums_vnni,
    "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw",
    q4_dpbusd,
    q4_end_dpbusd,
    q8_dpbusd,
    q4_dpbusd,
    q5_codes_bw
);

/// Groups `g0..g1` of a packed product two at a time through the pair tile `$pair` (tiles of 8
/// tokens, then of 4, then the rest), and an odd last group through `$single`, the 256-bit
/// kernel for a range of groups. A tile unpacks the pair's codes once for all its tokens, and
/// 8 tokens' accumulators still fit the 32 vector registers: against two tiles of 4, a product
/// of 8 rows from L2 took 0.87-0.89x the time in Q4_K and Q6_K (`matvec_rate rows`) and pp512
/// of the default model (Q4_1) ran 1.06x (`tools/bench/ab`, 4 pairs; docs/notes/engine.md).
macro_rules! each_pair_tile {
    ($pair:ident, $single:ident, $w:expr, $a:expr, $out:expr, $ldo:expr, $g0:expr, $g1:expr) => {{
        let n_tok = $a.rows;
        let mut g = $g0;
        while g + 2 <= $g1 {
            let mut t = 0;
            while t + 8 <= n_tok {
                $pair::<8>($w, $a, g, t, $out, $ldo);
                t += 8;
            }
            while t + 4 <= n_tok {
                $pair::<4>($w, $a, g, t, $out, $ldo);
                t += 4;
            }
            match n_tok - t {
                3 => $pair::<3>($w, $a, g, t, $out, $ldo),
                2 => $pair::<2>($w, $a, g, t, $out, $ldo),
                1 => $pair::<1>($w, $a, g, t, $out, $ldo),
                _ => {}
            }
            g += 2;
        }
        if g < $g1 {
            $single($w, $a, $out, $ldo, g, $g1);
        }
    }};
}

/// A K tile over activations of this many rows or fewer streams its weights (a decode
/// step's), and asks ahead a sub-block's share at a time ([`prefetch_ahead_part`]); over more
/// (a prompt's), its blocks come again from the caches for every tile of tokens, and the asks
/// spread into its loop cost it: `tools/bench/ab`, pp512 at the 1.7B Q4_K_M shape 0.85x (4
/// pairs 0.81-0.97), so a prompt's tiles ask at each block's start as before.
const SPREAD_ROWS: usize = 8;

/// The VNNI kernel set's packed products. Where a CPU with VNNI has 512-bit vectors, Q4_0's,
/// Q4_1's and Q8_0's groups go two at a time for [`super::pairs::FROM`] tokens or more: group `g`'s 8
/// rows in the low half of each vector and `g + 1`'s in the high half, against the same
/// broadcast activations. Every lane does the 256-bit kernel's integer and float operations in
/// the same order, so the bits are the same; the instructions per row halve, which prefill
/// (bound by them, not by memory) gains from where the CPU executes 512-bit vectors at full
/// width: pp512 1.50x at the 1.7B shape in Q4_0 and 1.36x in Q4_K_M on a Zen 5 host
/// (`tools/bench/ab`). Fewer tokens (decode, one context or a few together) are bound by
/// memory, and two streams a thread read it slower than one on some hosts (tg128 0.79x in
/// Q4_K_M on the Zen 5 host): one token stays on the 256-bit tile, and 2-4 take the tile the
/// host's tuner chose ([`super::pairs`]).
///
/// # Safety
/// Needs AVX2, FMA, F16C, AVX512-VNNI, -VL and -BW; and AVX512F for the pairs ([`crate::simd`]).
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw")]
pub(super) unsafe fn matmul_packed_vnni(w: &PackedWeight, a: &Q8Acts, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
    if !(matches!(w.data, Packed::Q4S(_) | Packed::Q4(_) | Packed::Q8(_))
        && super::pairs::pairs(super::pairs::Family::Legacy, a.rows)
        && crate::simd::has_zmm())
    {
        return matmul_packed_vnni256(w, a, out, ldo, g0, g1);
    }
    each_pair_tile!(pair_tile, matmul_packed_vnni256, w, a, out, ldo, g0, g1);
}

/// Where each of tokens `t0..t0 + T`'s rows of `nb` elements starts in `v`, all of them checked
/// to lie within it here (so the tile's loop reads them without a check a block).
#[inline(always)]
fn token_rows<E, const T: usize>(v: &[E], t0: usize, nb: usize) -> [*const E; T] {
    assert!((t0 + T) * nb <= v.len(), "tokens past the activations");
    std::array::from_fn(|t| v[(t0 + t) * nb..].as_ptr())
}

/// Tokens `t0..t0 + T` of a [`Q8Acts`] as raw pointers to their first block's codes, scale,
/// minimum term and code sum, bounds checked once per tile: indexing the four arrays for each
/// token at every block put a compare and branch beside each load in the hot loop (about a
/// fifth of a 4-token tile's instructions).
struct TokenBlocks<const T: usize> {
    qs: [*const [i8; 32]; T],
    qu: [*const [u8; 32]; T],
    d: [*const f32; T],
    s: [*const f32; T],
    isum: [*const i32; T],
}

impl<const T: usize> TokenBlocks<T> {
    #[inline(always)]
    fn new(a: &Q8Acts, t0: usize) -> Self {
        Self {
            qs: token_rows(&a.qs, t0, a.nb),
            qu: token_rows(&a.qu, t0, a.nb),
            d: token_rows(&a.d, t0, a.nb),
            s: token_rows(&a.s, t0, a.nb),
            isum: token_rows(&a.isum, t0, a.nb),
        }
    }
    /// Token `t`'s block `b`'s codes. Safety: `b` < the activations' blocks per row.
    #[inline(always)]
    unsafe fn qs(&self, t: usize, b: usize) -> *const i8 {
        self.qs[t].add(b).cast()
    }
    /// Token `t`'s block `b`'s codes plus 128 ([`Q8Acts::qu`]). Safety: as [`Self::qs`].
    #[inline(always)]
    unsafe fn qu(&self, t: usize, b: usize) -> *const u8 {
        self.qu[t].add(b).cast()
    }
    #[inline(always)]
    unsafe fn d(&self, t: usize, b: usize) -> f32 {
        *self.d[t].add(b)
    }
    #[inline(always)]
    unsafe fn s(&self, t: usize, b: usize) -> f32 {
        *self.s[t].add(b)
    }
    #[inline(always)]
    unsafe fn isum(&self, t: usize, b: usize) -> i32 {
        *self.isum[t].add(b)
    }
}

/// [`TokenBlocks`] for [`Q8KActs`]: tokens `t0..t0 + T`'s first super-block's codes, scale and
/// 16-value sums as raw pointers, bounds checked once per tile.
struct KTokenBlocks<const T: usize> {
    qs: [*const [i8; 256]; T],
    d: [*const f32; T],
    bsums: [*const [i16; 16]; T],
}

impl<const T: usize> KTokenBlocks<T> {
    #[inline(always)]
    fn new(a: &Q8KActs, t0: usize) -> Self {
        Self { qs: token_rows(&a.qs, t0, a.nb), d: token_rows(&a.d, t0, a.nb), bsums: token_rows(&a.bsums, t0, a.nb) }
    }
    /// Token `t`'s super-block `b`'s codes. Safety: `b` < the activations' blocks per row.
    #[inline(always)]
    unsafe fn qs(&self, t: usize, b: usize) -> *const i8 {
        self.qs[t].add(b).cast()
    }
    #[inline(always)]
    unsafe fn d(&self, t: usize, b: usize) -> f32 {
        *self.d[t].add(b)
    }
    #[inline(always)]
    unsafe fn bsums(&self, t: usize, b: usize) -> *const i16 {
        self.bsums[t].add(b).cast()
    }
}

/// Groups `g` and `g + 1` of a Q4_0, Q4_1 or Q8_0 matrix against `T` tokens from `t0` (see
/// [`matmul_packed_vnni`]): the 256-bit tile's arm for the type, lane for lane.
#[allow(clippy::needless_range_loop)] // `t` indexes several per-token arrays in step
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni,avx512vl,avx512bw")]
unsafe fn pair_tile<const T: usize>(w: &PackedWeight, a: &Q8Acts, g: usize, t0: usize, out: OutPtr, ldo: usize) {
    let nb = w.blocks_per_row();
    let mask = _mm512_set1_epi8(0x0F);
    let x4 = |p: *const i8| _mm512_set1_epi32(std::ptr::read_unaligned(p.cast::<i32>()));
    // The tile reads blocks `0..nb` of each token: the activations must have as many.
    assert_eq!(a.nb, nb, "activations of another width");
    let x = TokenBlocks::<T>::new(a, t0);
    // The 4-bit codes' integer sums (as `q4_sums`): `qs` of both groups' blocks.
    let q4 = |q0: &[u8; 128], q1: &[u8; 128], b: usize| {
        let mut p = [_mm512_setzero_si512(); T];
        for k in 0..4 {
            let wv = pair(_mm256_loadu_si256(q0.as_ptr().add(32 * k).cast()), _mm256_loadu_si256(q1.as_ptr().add(32 * k).cast()));
            let lo = _mm512_and_si512(wv, mask);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(wv), mask);
            for (t, pt) in p.iter_mut().enumerate() {
                let xq = x.qs(t, b);
                *pt = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(*pt, lo, x4(xq.add(4 * k))), hi, x4(xq.add(16 + 4 * k)));
            }
        }
        p
    };
    let mut acc = [_mm512_setzero_ps(); T];
    match &w.data {
        Packed::Q4S(v) => {
            let (v0, v1) = (&v[g * nb..(g + 1) * nb], &v[(g + 1) * nb..(g + 2) * nb]);
            for b in 0..nb {
                let (x0, x1) = (&v0[b], &v1[b]);
                prefetch_ahead(x0);
                prefetch_ahead(x1);
                let p = q4(&x0.qs, &x1.qs, b);
                let dv = f16x16(&x0.d, &x1.d);
                for t in 0..T {
                    let pf = _mm512_cvtepi32_ps(_mm512_sub_epi32(p[t], _mm512_set1_epi32(8 * x.isum(t, b))));
                    acc[t] = _mm512_fmadd_ps(pf, _mm512_mul_ps(dv, _mm512_set1_ps(x.d(t, b))), acc[t]);
                }
            }
        }
        Packed::Q4(v) => {
            let (v0, v1) = (&v[g * nb..(g + 1) * nb], &v[(g + 1) * nb..(g + 2) * nb]);
            for b in 0..nb {
                let (x0, x1) = (&v0[b], &v1[b]);
                prefetch_ahead(x0);
                prefetch_ahead(x1);
                let p = q4(&x0.qs, &x1.qs, b);
                let (dv, mv) = (f16x16(&x0.d, &x1.d), f16x16(&x0.m, &x1.m));
                for t in 0..T {
                    let pf = _mm512_cvtepi32_ps(p[t]);
                    acc[t] = _mm512_fmadd_ps(pf, _mm512_mul_ps(dv, _mm512_set1_ps(x.d(t, b))), acc[t]);
                    acc[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.s(t, b)), acc[t]);
                }
            }
        }
        Packed::Q8(v) => {
            let (v0, v1) = (&v[g * nb..(g + 1) * nb], &v[(g + 1) * nb..(g + 2) * nb]);
            for b in 0..nb {
                let (x0, x1) = (&v0[b], &v1[b]);
                prefetch_ahead(x0);
                prefetch_ahead(x1);
                // The products of the activations plus 128 (unsigned, `Q8Acts::qu`) and the
                // signed weights, less 128 times each row's weight sum (`dpbusd` of 0x80 bytes
                // and the weights, once a block for every token): sum((x + 128) w) - 128 sum(w)
                // = sum(x w), the same integer as the 256-bit tile's |w| * sign(x, w), with
                // no sign flip a token (a mask and a masked subtract each, per 4 columns).
                let mut p = [_mm512_setzero_si512(); T];
                let mut bias = _mm512_setzero_si512();
                for k in 0..8 {
                    let wv =
                        pair(_mm256_loadu_si256(x0.qs.as_ptr().add(32 * k).cast()), _mm256_loadu_si256(x1.qs.as_ptr().add(32 * k).cast()));
                    bias = _mm512_dpbusd_epi32(bias, _mm512_set1_epi8(i8::MIN), wv);
                    for t in 0..T {
                        p[t] = _mm512_dpbusd_epi32(p[t], x4(x.qu(t, b).add(4 * k).cast()), wv);
                    }
                }
                let dv = f16x16(&x0.d, &x1.d);
                for t in 0..T {
                    let pf = _mm512_cvtepi32_ps(_mm512_sub_epi32(p[t], bias));
                    acc[t] = _mm512_fmadd_ps(pf, _mm512_mul_ps(dv, _mm512_set1_ps(x.d(t, b))), acc[t]);
                }
            }
        }
        _ => unreachable!("matmul_packed_vnni sends only Q4_0, Q4_1 and Q8_0 here"),
    }
    store_pair(&acc, w.rows, g, t0, out, ldo);
}

/// Q6_K groups `g` and `g + 1` against `T` tokens from `t0`: the 256-bit K tile's Q6_K block
/// (`packed_k_kernels!`'s `$q6k`), lane for lane, group `g` in the low halves.
#[allow(clippy::needless_range_loop)] // `t` indexes several per-token arrays in step
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni,avx512vl,avx512bw")]
unsafe fn q6k_pair_tile<const T: usize>(
    v: &[crate::repack::BlockQ6Kx8],
    w: &PackedWeight,
    a: &Q8KActs,
    g: usize,
    t0: usize,
    out: OutPtr,
    ldo: usize,
) {
    use crate::repack::BlockQ6Kx8;
    let nb = w.blocks_per_row();
    let m4 = _mm512_set1_epi8(0x0F);
    // Bits 2c, 2c + 1 of h moved to bits 4-5 (masked first: nothing crosses a byte).
    let top = |h: __m512i, c: i32| {
        let v = _mm512_and_si512(h, _mm512_set1_epi8(3 << (2 * c)));
        match c {
            0 => _mm512_slli_epi16::<4>(v),
            1 => _mm512_slli_epi16::<2>(v),
            2 => v,
            _ => _mm512_srli_epi16::<2>(v),
        }
    };
    let mut acc = [_mm512_setzero_ps(); T];
    // The tile reads blocks `0..nb` of each token: the activations must have as many.
    assert_eq!(a.nb, nb, "activations of another width");
    let xa = KTokenBlocks::<T>::new(a, t0);
    let spread = a.rows <= SPREAD_ROWS;
    for b in 0..nb {
        let (x0, x1) = (&v[g * nb + b], &v[(g + 1) * nb + b]);
        if !spread {
            prefetch_ahead(x0);
            prefetch_ahead(x1);
        }
        let sc8 = |x: &BlockQ6Kx8, s: usize| _mm_loadl_epi64(x.scales.as_ptr().add(8 * s).cast());
        // Row r's scale of sub-block s in both i16 of i32 lane r, both groups.
        let sc = |s: usize| {
            pair(
                _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8(x0, s), sc8(x0, s))),
                _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8(x1, s), sc8(x1, s))),
            )
        };
        let load = |o: usize| pair(_mm256_loadu_si256(x0.q.as_ptr().add(o).cast()), _mm256_loadu_si256(x1.q.as_ptr().add(o).cast()));
        let mut isum = [_mm512_setzero_si512(); T];
        for j in 0..8 {
            if spread {
                prefetch_ahead_part(x0, j, 8);
                prefetch_ahead_part(x1, j, 8);
            }
            let (sc_lo, sc_hi) = (sc(2 * j), sc(2 * j + 1));
            let h = [load(192 * j + 128), load(192 * j + 160)];
            let mut lo = [_mm512_setzero_si512(); 4];
            let mut hi = [_mm512_setzero_si512(); 4];
            for k in 0..4 {
                let wv = load(192 * j + 32 * k);
                let c = 2 * (k as i32 % 2);
                lo[k] = _mm512_or_si512(_mm512_and_si512(wv, m4), top(h[k / 2], c));
                hi[k] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(wv), m4), top(h[k / 2], c + 1));
            }
            for t in 0..T {
                let xq = xa.qs(t, b).add(32 * j);
                let x4 = |o: usize| _mm512_set1_epi32(std::ptr::read_unaligned(xq.add(o).cast::<i32>()));
                let two = |v: &[__m512i; 4], k: usize, at: usize| {
                    _mm512_add_epi16(_mm512_maddubs_epi16(v[k], x4(at + 4 * k)), _mm512_maddubs_epi16(v[k + 1], x4(at + 4 * k + 4)))
                };
                isum[t] = _mm512_dpwssd_epi32(isum[t], two(&lo, 0, 0), sc_lo);
                isum[t] = _mm512_dpwssd_epi32(isum[t], two(&lo, 2, 0), sc_lo);
                isum[t] = _mm512_dpwssd_epi32(isum[t], two(&hi, 0, 16), sc_hi);
                isum[t] = _mm512_dpwssd_epi32(isum[t], two(&hi, 2, 16), sc_hi);
            }
        }
        let scp: [__m512i; 8] = std::array::from_fn(|q| {
            let one = |x: &BlockQ6Kx8| _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8(x, 2 * q), sc8(x, 2 * q + 1)));
            pair(one(x0), one(x1))
        });
        let dv = f16x16(&x0.d, &x1.d);
        for t in 0..T {
            // The 16-value sums as 8 (s, s + 1) pairs, one per i32 lane.
            let bs = _mm256_loadu_si256(xa.bsums(t, b).cast());
            let mut off = _mm512_setzero_si512();
            for (q, &sp) in scp.iter().enumerate() {
                off = _mm512_add_epi32(
                    off,
                    _mm512_madd_epi16(sp, _mm512_broadcast_i64x4(_mm256_permutevar8x32_epi32(bs, _mm256_set1_epi32(q as i32)))),
                );
            }
            let p = _mm512_sub_epi32(isum[t], _mm512_slli_epi32::<5>(off));
            acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(dv, _mm512_set1_ps(xa.d(t, b))), _mm512_cvtepi32_ps(p)));
        }
    }
    store_pair(&acc, w.rows, g, t0, out, ldo);
}

/// Two 256-bit halves as one 512-bit vector: `lo` (group `g`'s) in the low half.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn pair(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// Two groups' 8 f16 scales each as 16 f32s, group `g`'s in the low half.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f")]
unsafe fn f16x16(lo: &[f16; 8], hi: &[f16; 8]) -> __m512 {
    _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(
        _mm256_castsi128_si256(_mm_loadu_si128(lo.as_ptr().cast())),
        _mm_loadu_si128(hi.as_ptr().cast()),
    ))
}

/// Stores a pair tile's sums: the low halves as group `g`'s, the high halves as `g + 1`'s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn store_pair<const T: usize>(acc: &[__m512; T], rows: usize, g: usize, t0: usize, out: OutPtr, ldo: usize) {
    let lo: [__m256; T] = std::array::from_fn(|t| _mm512_castps512_ps256(acc[t]));
    let hi: [__m256; T] = std::array::from_fn(|t| _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc[t]))));
    store_group(&lo, rows, g, t0, out, ldo);
    store_group(&hi, rows, g + 1, t0, out, ldo);
}

/// The packed K-quant kernels (Q4_K, Q5_K in groups of 8 rows against Q8_K activations),
/// stamped out per instruction set: `$madd` multiplies i16 pairs by the scales into the i32
/// accumulator, `$q5codes` puts in the fifth bits. Per sub-block of 32 columns each row's
/// code x activation sums stay in i16 (Q8_K's codes reach -128; 16 products of a 4-bit code:
/// <= 16 * 15 * 128 < 2^15; a 5-bit one, 8: <= 8 * 31 * 128) and one `madd` applies the row's scale; the mins take four
/// `madd`s a block against pairs of Q8_K's 32-value sums. The same integers as
/// `quant::dot_k4_ref`, the same float operations lane by lane: the row kernels' bits.
macro_rules! packed_k_kernels {
    ($all:ident, $tile:ident, $q6k:ident, $feat:literal, $madd:ident, $q5codes:ident) => {
        /// # Safety
        /// Needs the kernel's features.
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn $all(w: &PackedWeight, a: &Q8KActs, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
            each_tile!($tile, w, a, out, ldo, g0, g1);
        }

        #[allow(clippy::needless_range_loop)] // `t` indexes several per-token arrays in step
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn $tile<const T: usize>(w: &PackedWeight, a: &Q8KActs, g: usize, t0: usize, out: OutPtr, ldo: usize) {
            let nb = w.blocks_per_row();
            let mask = _mm256_set1_epi8(0x0F);
            let mut acc = [_mm256_setzero_ps(); T];
            // The tile reads blocks `0..nb` of each token: the activations must have as many.
            assert_eq!(a.nb, nb, "activations of another width");
            let xa = KTokenBlocks::<T>::new(a, t0);
            // Decode's rows stream the weights: the asks spread over the sub-blocks.
            let spread = a.rows <= SPREAD_ROWS;
            for b in 0..nb {
                if let Packed::Q6K(v) = &w.data {
                    if !spread {
                        prefetch_ahead(&v[g * nb + b]);
                    }
                    $q6k(&v[g * nb + b], &xa, b, spread, &mut acc);
                    continue;
                }
                let mut spread_q4k = None;
                let (d, dmin, scales, mins, q, stride) = match &w.data {
                    Packed::Q4K(v) => {
                        let x = &v[g * nb + b];
                        if spread {
                            spread_q4k = Some(x);
                        } else {
                            prefetch_ahead(x);
                        }
                        (&x.d, &x.dmin, &x.scales, &x.mins, &x.qs[..], 128)
                    }
                    Packed::Q5K(v) => {
                        let x = &v[g * nb + b];
                        prefetch_ahead(x);
                        (&x.d, &x.dmin, &x.scales, &x.mins, &x.q[..], 160)
                    }
                    _ => unreachable!("32-column groups take Q8 activations (matmul_packed)"),
                };
                let mut isum = [_mm256_setzero_si256(); T];
                for j in 0..8 {
                    if let Some(x) = spread_q4k {
                        prefetch_ahead_part(x, j, 8);
                    }
                    // Row r's scale in both i16 of i32 lane r.
                    let sc8 = _mm_loadl_epi64(scales.as_ptr().add(8 * j).cast());
                    let sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8));
                    let h = (stride > 128).then(|| _mm256_loadu_si256(q.as_ptr().add(stride * j + 128).cast()));
                    let mut lo = [_mm256_setzero_si256(); 4];
                    let mut hi = [_mm256_setzero_si256(); 4];
                    for k in 0..4 {
                        let wv = _mm256_loadu_si256(q.as_ptr().add(stride * j + 32 * k).cast());
                        lo[k] = _mm256_and_si256(wv, mask);
                        hi[k] = _mm256_and_si256(_mm256_srli_epi16(wv, 4), mask);
                        if let Some(h) = h {
                            lo[k] = $q5codes(lo[k], h, 2 * k as i32);
                            hi[k] = $q5codes(hi[k], h, 2 * k as i32 + 1);
                        }
                    }
                    for t in 0..T {
                        let xq = xa.qs(t, b).add(32 * j);
                        let part = |k: usize| {
                            _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo[k], bcast4(xq.add(4 * k))),
                                _mm256_maddubs_epi16(hi[k], bcast4(xq.add(16 + 4 * k))),
                            )
                        };
                        if h.is_none() {
                            let p = _mm256_add_epi16(_mm256_add_epi16(part(0), part(1)), _mm256_add_epi16(part(2), part(3)));
                            isum[t] = $madd(isum[t], p, sc);
                        } else {
                            isum[t] = $madd(isum[t], _mm256_add_epi16(part(0), part(1)), sc);
                            isum[t] = $madd(isum[t], _mm256_add_epi16(part(2), part(3)), sc);
                        }
                    }
                }
                // Mins: row r's (m_2q, m_2q+1) pair in i32 lane r, against (b_2q, b_2q+1), the
                // 32-value sums of sub-blocks 2q and 2q+1 (each <= 32 * 128 in magnitude).
                let mq: [__m256i; 4] = std::array::from_fn(|q| _mm256_cvtepu8_epi16(_mm_loadu_si128(mins.as_ptr().add(16 * q).cast())));
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().cast()));
                let mv = _mm256_cvtph_ps(_mm_loadu_si128(dmin.as_ptr().cast()));
                for t in 0..T {
                    // [b0 b1 b2 b3 0 0 0 0 | b4 b5 b6 b7 0 0 0 0] as i16: pair (b0, b1) is i32 0.
                    let pairs = _mm256_hadd_epi16(_mm256_loadu_si256(xa.bsums(t, b).cast()), _mm256_setzero_si256());
                    let pick = |i: i32| _mm256_permutevar8x32_epi32(pairs, _mm256_set1_epi32(i));
                    let m = _mm256_add_epi32(
                        _mm256_add_epi32(_mm256_madd_epi16(mq[0], pick(0)), _mm256_madd_epi16(mq[1], pick(1))),
                        _mm256_add_epi32(_mm256_madd_epi16(mq[2], pick(4)), _mm256_madd_epi16(mq[3], pick(5))),
                    );
                    let x = _mm256_sub_ps(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(isum[t])), _mm256_mul_ps(mv, _mm256_cvtepi32_ps(m)));
                    acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_set1_ps(xa.d(t, b)), x));
                }
            }
            store_group(&acc, w.rows, g, t0, out, ldo);
        }

        /// One packed Q6_K block of 8 rows against `T` tokens, added into `acc`: per 16-value
        /// sub-block the rows' sums of code x activation (codes 0..64: two loads' products
        /// <= 4 * 63 * 128 < 2^15 in i16) times their scales in a `madd`; the codes' offset of 32
        /// off once a block as 32 x the scales times Q8_K's 16-value sums (as the row kernel).
        #[allow(clippy::needless_range_loop)]
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn $q6k<const T: usize>(x: &crate::repack::BlockQ6Kx8, xa: &KTokenBlocks<T>, b: usize, spread: bool, acc: &mut [__m256; T]) {
            let m4 = _mm256_set1_epi8(0x0F);
            // Row r's scale of sub-block s in both i16 of i32 lane r; and (s, s + 1) pairs.
            let sc8: [__m128i; 16] = std::array::from_fn(|s| _mm_loadl_epi64(x.scales.as_ptr().add(8 * s).cast()));
            let mut isum = [_mm256_setzero_si256(); T];
            for j in 0..8 {
                if spread {
                    prefetch_ahead_part(x, j, 8);
                }
                let sc_lo = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8[2 * j], sc8[2 * j]));
                let sc_hi = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8[2 * j + 1], sc8[2 * j + 1]));
                let h = [
                    _mm256_loadu_si256(x.q.as_ptr().add(192 * j + 128).cast()),
                    _mm256_loadu_si256(x.q.as_ptr().add(192 * j + 160).cast()),
                ];
                // Bits 2c, 2c + 1 of h moved to bits 4-5 (masked first: nothing crosses a byte).
                let top = |h: __m256i, c: i32| {
                    let v = _mm256_and_si256(h, _mm256_set1_epi8(3 << (2 * c)));
                    match c {
                        0 => _mm256_slli_epi16(v, 4),
                        1 => _mm256_slli_epi16(v, 2),
                        2 => v,
                        _ => _mm256_srli_epi16(v, 2),
                    }
                };
                let mut lo = [_mm256_setzero_si256(); 4];
                let mut hi = [_mm256_setzero_si256(); 4];
                for k in 0..4 {
                    let wv = _mm256_loadu_si256(x.q.as_ptr().add(192 * j + 32 * k).cast());
                    let c = 2 * (k as i32 % 2);
                    lo[k] = _mm256_or_si256(_mm256_and_si256(wv, m4), top(h[k / 2], c));
                    hi[k] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(wv, 4), m4), top(h[k / 2], c + 1));
                }
                for t in 0..T {
                    let xq = xa.qs(t, b).add(32 * j);
                    let two = |v: &[__m256i; 4], k: usize, at: usize| {
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(v[k], bcast4(xq.add(at + 4 * k))),
                            _mm256_maddubs_epi16(v[k + 1], bcast4(xq.add(at + 4 * k + 4))),
                        )
                    };
                    isum[t] = $madd(isum[t], two(&lo, 0, 0), sc_lo);
                    isum[t] = $madd(isum[t], two(&lo, 2, 0), sc_lo);
                    isum[t] = $madd(isum[t], two(&hi, 0, 16), sc_hi);
                    isum[t] = $madd(isum[t], two(&hi, 2, 16), sc_hi);
                }
            }
            let scp: [__m256i; 8] = std::array::from_fn(|q| _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8[2 * q], sc8[2 * q + 1])));
            let dv = _mm256_cvtph_ps(_mm_loadu_si128(x.d.as_ptr().cast()));
            for t in 0..T {
                // The 16-value sums as 8 (s, s + 1) pairs, one per i32 lane.
                let bs = _mm256_loadu_si256(xa.bsums(t, b).cast());
                let mut off = _mm256_setzero_si256();
                for (q, &sp) in scp.iter().enumerate() {
                    off = _mm256_add_epi32(off, _mm256_madd_epi16(sp, _mm256_permutevar8x32_epi32(bs, _mm256_set1_epi32(q as i32))));
                }
                let p = _mm256_sub_epi32(isum[t], _mm256_slli_epi32(off, 5));
                acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(dv, _mm256_set1_ps(xa.d(t, b))), _mm256_cvtepi32_ps(p)));
            }
        }
    };
}

packed_k_kernels!(matmul_packed_k, packed_k_tile, packed_q6k_block, "avx2,fma,f16c", madd_add, q5_codes);
packed_k_kernels!(
    matmul_packed_k_vnni256,
    packed_k_tile_vnni,
    packed_q6k_block_vnni,
    "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw",
    madd_dpwssd,
    q5_codes_bw
);

/// The VNNI set's K-quant products: Q4_K's and Q6_K's groups in pairs on 512-bit vectors for
/// [`super::pairs::FROM`] tokens or more (and 2-4 where the host's tuner chose them), as Q4_0's ([`matmul_packed_vnni`]); Q5_K as it was.
///
/// # Safety
/// As [`matmul_packed_vnni`].
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw")]
pub(super) unsafe fn matmul_packed_k_vnni(w: &PackedWeight, a: &Q8KActs, out: OutPtr, ldo: usize, g0: usize, g1: usize) {
    if !(matches!(w.data, Packed::Q4K(_) | Packed::Q6K(_))
        && super::pairs::pairs(super::pairs::Family::K, a.rows)
        && crate::simd::has_zmm())
    {
        return matmul_packed_k_vnni256(w, a, out, ldo, g0, g1);
    }
    each_pair_tile!(k_pair_tile, matmul_packed_k_vnni256, w, a, out, ldo, g0, g1);
}

/// Q4_K (or, through [`q6k_pair_tile`], Q6_K) groups `g` and `g + 1` against `T` tokens from
/// `t0`: the 256-bit K tile's path for the type (`packed_k_kernels!`), lane for lane, group `g`
/// in the low halves.
#[allow(clippy::needless_range_loop)] // `t` indexes several per-token arrays in step
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni,avx512vl,avx512bw")]
unsafe fn k_pair_tile<const T: usize>(w: &PackedWeight, a: &Q8KActs, g: usize, t0: usize, out: OutPtr, ldo: usize) {
    if let Packed::Q6K(v) = &w.data {
        return q6k_pair_tile::<T>(v, w, a, g, t0, out, ldo);
    }
    let Packed::Q4K(v) = &w.data else { unreachable!("matmul_packed_k_vnni sends only Q4_K and Q6_K here") };
    let nb = w.blocks_per_row();
    let mask = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); T];
    // The tile reads blocks `0..nb` of each token: the activations must have as many.
    assert_eq!(a.nb, nb, "activations of another width");
    let xa = KTokenBlocks::<T>::new(a, t0);
    let spread = a.rows <= SPREAD_ROWS;
    for b in 0..nb {
        let (x0, x1) = (&v[g * nb + b], &v[(g + 1) * nb + b]);
        if !spread {
            prefetch_ahead(x0);
            prefetch_ahead(x1);
        }
        let mut isum = [_mm512_setzero_si512(); T];
        for j in 0..8 {
            if spread {
                prefetch_ahead_part(x0, j, 8);
                prefetch_ahead_part(x1, j, 8);
            }
            // Row r's scale in both i16 of i32 lane r.
            let sc_of = |x: &crate::repack::BlockQ4Kx8| {
                let sc8 = _mm_loadl_epi64(x.scales.as_ptr().add(8 * j).cast());
                _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8))
            };
            let sc = pair(sc_of(x0), sc_of(x1));
            let mut lo = [_mm512_setzero_si512(); 4];
            let mut hi = [_mm512_setzero_si512(); 4];
            for k in 0..4 {
                let wv = pair(
                    _mm256_loadu_si256(x0.qs.as_ptr().add(128 * j + 32 * k).cast()),
                    _mm256_loadu_si256(x1.qs.as_ptr().add(128 * j + 32 * k).cast()),
                );
                lo[k] = _mm512_and_si512(wv, mask);
                hi[k] = _mm512_and_si512(_mm512_srli_epi16::<4>(wv), mask);
            }
            for t in 0..T {
                let xq = xa.qs(t, b).add(32 * j);
                let x4 = |o: usize| _mm512_set1_epi32(std::ptr::read_unaligned(xq.add(o).cast::<i32>()));
                let part = |k: usize| _mm512_add_epi16(_mm512_maddubs_epi16(lo[k], x4(4 * k)), _mm512_maddubs_epi16(hi[k], x4(16 + 4 * k)));
                let p = _mm512_add_epi16(_mm512_add_epi16(part(0), part(1)), _mm512_add_epi16(part(2), part(3)));
                isum[t] = _mm512_dpwssd_epi32(isum[t], p, sc);
            }
        }
        let mq: [__m512i; 4] = std::array::from_fn(|q| {
            let m = |x: &crate::repack::BlockQ4Kx8| _mm256_cvtepu8_epi16(_mm_loadu_si128(x.mins.as_ptr().add(16 * q).cast()));
            pair(m(x0), m(x1))
        });
        let dv = f16x16(&x0.d, &x1.d);
        let mv = f16x16(&x0.dmin, &x1.dmin);
        for t in 0..T {
            let pairs = _mm256_hadd_epi16(_mm256_loadu_si256(xa.bsums(t, b).cast()), _mm256_setzero_si256());
            let pick = |i: i32| _mm512_broadcast_i64x4(_mm256_permutevar8x32_epi32(pairs, _mm256_set1_epi32(i)));
            let m = _mm512_add_epi32(
                _mm512_add_epi32(_mm512_madd_epi16(mq[0], pick(0)), _mm512_madd_epi16(mq[1], pick(1))),
                _mm512_add_epi32(_mm512_madd_epi16(mq[2], pick(4)), _mm512_madd_epi16(mq[3], pick(5))),
            );
            let x = _mm512_sub_ps(_mm512_mul_ps(dv, _mm512_cvtepi32_ps(isum[t])), _mm512_mul_ps(mv, _mm512_cvtepi32_ps(m)));
            acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_set1_ps(xa.d(t, b)), x));
        }
    }
    store_pair(&acc, w.rows, g, t0, out, ldo);
}

/// Stores a packed tile's sums: token `t0 + t`'s 8 rows of group `g` (those inside the
/// matrix's `rows`) at `out[(t0 + t) * ldo + 8 g ..]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_group<const T: usize>(acc: &[__m256; T], rows: usize, g: usize, t0: usize, out: OutPtr, ldo: usize) {
    let r0 = g * ROWS;
    let valid = (rows - r0).min(ROWS);
    for (t, &v) in acc.iter().enumerate() {
        let idx = (t0 + t) * ldo + r0;
        if valid == ROWS {
            assert!(idx + ROWS <= out.len, "packed matmul output out of range");
            // SAFETY: idx + 8 <= len (checked); this thread owns rows r0..r0+8.
            _mm256_storeu_ps(out.ptr.add(idx), v);
        } else {
            let mut tmp = [0.0f32; ROWS];
            _mm256_storeu_ps(tmp.as_mut_ptr(), v);
            for (r, &x) in tmp.iter().enumerate().take(valid) {
                out.write(idx + r, x);
            }
        }
    }
}

/// Q5 codes (0..32) against 4 activation bytes each: |sum| <= 4 * 31 * 127 < 2^15 per i16
/// lane and load, so each load's pairs go to i32 at once (over a whole block they would not fit).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_maddubs(p: __m256i, lo: __m256i, hi: __m256i, xl: __m256i, xh: __m256i) -> __m256i {
    let s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
    _mm256_add_epi32(p, _mm256_madd_epi16(s, _mm256_set1_epi16(1)))
}

/// Nibbles `nib` with their fifth bits, bit `b` of each byte of `h`, moved in as 16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_codes(nib: __m256i, h: __m256i, b: i32) -> __m256i {
    // One bit per byte, moved at most 4 places: it cannot cross into the next byte.
    let bit = _mm256_and_si256(h, _mm256_set1_epi8(1 << b));
    let bit = if b < 4 { _mm256_sll_epi16(bit, _mm_cvtsi32_si128(4 - b)) } else { _mm256_srl_epi16(bit, _mm_cvtsi32_si128(b - 4)) };
    _mm256_or_si256(nib, bit)
}

/// The same with AVX512-BW: `vptestmb` picks the bytes whose bit `b` is set, a masked add puts 16 in.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw")]
unsafe fn q5_codes_bw(nib: __m256i, h: __m256i, b: i32) -> __m256i {
    let set = _mm256_test_epi8_mask(h, _mm256_set1_epi8(1 << b));
    _mm256_mask_add_epi8(nib, set, nib, _mm256_set1_epi8(16))
}

/// Q4 codes (`lo`, `hi`: unsigned nibbles) against 4 activation bytes each, into i16 lanes:
/// |sum| <= 8 * 2 * 15 * 127 < 2^15 per block, so the i16 adds cannot overflow.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_maddubs(p: __m256i, lo: __m256i, hi: __m256i, xl: __m256i, xh: __m256i) -> __m256i {
    _mm256_add_epi16(p, _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)))
}

/// The i16 pairs summed into the i32 lanes (one per row).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_end_maddubs(p: __m256i) -> __m256i {
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

/// Q8: |w| against x with w's sign, pairs into i16 (|sum| <= 2 * 127 * 127 < 2^15), then i32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_maddubs(p: __m256i, aw: __m256i, sx: __m256i) -> __m256i {
    _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)))
}

/// VNNI: four u8 x i8 products and the accumulator in one instruction, straight into i32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw")]
unsafe fn q4_dpbusd(p: __m256i, lo: __m256i, hi: __m256i, xl: __m256i, xh: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(p, lo, xl), hi, xh)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw")]
unsafe fn q4_end_dpbusd(p: __m256i) -> __m256i {
    p
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw")]
unsafe fn q8_dpbusd(p: __m256i, aw: __m256i, sx: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(p, aw, sx)
}

/// How a kernel loads lanes of row `t` of a chunk as vectors of 8 floats; one implementation
/// per format so each kernel instantiation inlines its own loads.
trait RowLoad {
    /// Lanes `c0..c0 + n` of row `t` (lane `c`: channels `8c..8c + 8`) written to `out[..n]`
    /// (a raw pointer: scoring writes them into a block it has not initialized).
    ///
    /// # Safety
    /// AVX2/F16C present; row `t` inside the block, the lanes inside `hd` (checked by the
    /// caller), `out` valid for `n` writes.
    unsafe fn load_lanes(&self, t: usize, hd: usize, c0: usize, out: *mut __m256, n: usize);
}
struct F32Rows(*const f32);
struct F16Rows(*const u8);
struct I8Rows(*const u8, usize);

// The plain formats load lanes through [`RowLanes`]: one decode each, for both the block
// kernels and the in-register ones.
macro_rules! row_load_by_lanes {
    ($($t:ty),*) => {$(
        impl RowLoad for $t {
            #[inline(always)]
            unsafe fn load_lanes(&self, t: usize, hd: usize, c0: usize, out: *mut __m256, n: usize) {
                let row = self.row(t, hd);
                for c in 0..n {
                    out.add(c).write(<$t as RowLanes>::lane(row, c0 + c));
                }
            }
        }
    )*};
}
row_load_by_lanes!(F32Rows, F16Rows, I8Rows);

/// Eight `B`-bit codes (channel order, low bits first) from the `B` bytes at `p`, as i32s:
/// the bytes broadcast to every lane, each lane shifted by its code's offset and masked.
#[inline(always)]
unsafe fn unpack8<const B: usize>(p: *const u8) -> __m256i {
    // The word is assembled from whole loads (a 2-byte and a 1-byte one for 3-bit codes):
    // bytes copied into a stack word and read back as one stall the store forwarding.
    let word = match B {
        2 => i32::from(p.cast::<u16>().read_unaligned()),
        3 => i32::from(p.cast::<u16>().read_unaligned()) | i32::from(*p.add(2)) << 16,
        _ => p.cast::<i32>().read_unaligned(),
    };
    let b = B as i32;
    let shifts = _mm256_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b);
    let word = _mm256_set1_epi32(word);
    _mm256_and_si256(_mm256_srlv_epi32(word, shifts), _mm256_set1_epi32((1 << B) - 1))
}

/// [`KvRows::Channel`]: `(code - zero) * step`, the reference's operations.
struct ChannelRows<const B: usize> {
    codes: *const u8,
    zero: *const f32,
    step: *const f32,
}
/// [`KvRows::Token`]: `scale * levels[code]`, the codebook looked up in registers (16 levels:
/// two 8-entry permutes, picked by the code's top bit; 4-bit codes into a codebook of small
/// integers, as the split levels' is: one byte shuffle for 16 codes).
struct TokenRows<const B: usize> {
    codes: *const u8,
    scales: *const f32,
    levels: [f32; 16],
    /// The codebook as bytes, when every level is an integer in i8 (then `level as f32` is
    /// the same float).
    bytes: Option<[i8; 16]>,
}

impl<const B: usize> TokenRows<B> {
    fn new(codes: *const u8, scales: *const f32, levels: &[f32]) -> Self {
        let mut table = [0.0f32; 16];
        table[..1 << B].copy_from_slice(&levels[..1 << B]);
        #[allow(clippy::cast_possible_truncation)]
        let bytes = table.iter().all(|&l| l.fract() == 0.0 && (-128.0..=127.0).contains(&l)).then(|| table.map(|l| l as i8));
        Self { codes, scales, levels: table, bytes }
    }
}

/// 32 4-bit codes (16 bytes, low nibble first) as bytes in channel order, in two halves.
#[inline(always)]
unsafe fn nibbles32(p: *const u8) -> (__m128i, __m128i) {
    let b = _mm_loadu_si128(p.cast());
    let m = _mm_set1_epi8(0x0F);
    let (lo, hi) = (_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
    (_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi))
}

/// The four vectors of 8 i32s in two halves of 16 bytes (`signed`: sign-extended).
#[inline(always)]
unsafe fn widen32<const SIGNED: bool>((a, b): (__m128i, __m128i)) -> [__m256i; 4] {
    let w = |x: __m128i| if SIGNED { _mm256_cvtepi8_epi32(x) } else { _mm256_cvtepu8_epi32(x) };
    [w(a), w(_mm_unpackhi_epi64(a, a)), w(b), w(_mm_unpackhi_epi64(b, b))]
}

/// A split-level K block's zero points and steps (`kernels::split_k_params`), 8 channels at a time:
/// each zero point an i8 converted and times `zero_unit` (a power of two: exact), each step
/// `reference x table[e]` for its exponent nibble — the same conversions and multiplications
/// as the scalar loop, so the same floats.
///
/// # Safety
/// Needs AVX2; `zero.len() == step.len()` a multiple of 8, `zeros` at least that many bytes and
/// `exps` at least half as many.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn k_params(
    reference: f32,
    zeros: &[u8],
    zero_unit: f32,
    exps: &[u8],
    table: &[f32; 16],
    zero: &mut [f32],
    step: &mut [f32],
) {
    let hd = zero.len();
    debug_assert!(hd.is_multiple_of(8) && step.len() == hd && zeros.len() >= hd && exps.len() >= hd / 2);
    let (lo, hi) = (_mm256_loadu_ps(table.as_ptr()), _mm256_loadu_ps(table.as_ptr().add(8)));
    let (r, zu) = (_mm256_set1_ps(reference), _mm256_set1_ps(zero_unit));
    // Channel 2i's exponent is byte i's low nibble, 2i+1's its high one: in a little-endian
    // word of 4 bytes, channel k's is at bit 4k.
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    for c in (0..hd).step_by(8) {
        let z = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(zeros.as_ptr().add(c).cast())));
        _mm256_storeu_ps(zero.as_mut_ptr().add(c), _mm256_mul_ps(z, zu));
        let word = exps.as_ptr().add(c / 2).cast::<i32>().read_unaligned();
        let e = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), _mm256_set1_epi32(15));
        let top = _mm256_castsi256_ps(_mm256_slli_epi32(e, 28));
        let t = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, e), _mm256_permutevar8x32_ps(hi, e), top);
        _mm256_storeu_ps(step.as_mut_ptr().add(c), _mm256_mul_ps(r, t));
    }
}

/// The `B`-bit codes of `n` lanes at `p` as i32s, lane by lane to `put(c, codes)`: 4-bit
/// codes 32 at a time, other widths 8 at a time.
#[inline(always)]
unsafe fn code_lanes<const B: usize>(p: *const u8, n: usize, mut put: impl FnMut(usize, __m256i)) {
    let mut c = 0;
    if B == 4 {
        while c + 4 <= n {
            for (k, code) in widen32::<false>(nibbles32(p.add(4 * c))).into_iter().enumerate() {
                put(c + k, code);
            }
            c += 4;
        }
    }
    for c in c..n {
        put(c, unpack8::<B>(p.add(c * B)));
    }
}

impl<const B: usize> RowLoad for ChannelRows<B> {
    #[inline(always)]
    unsafe fn load_lanes(&self, t: usize, hd: usize, c0: usize, out: *mut __m256, n: usize) {
        let (zero, step) = (self.zero.add(8 * c0), self.step.add(8 * c0));
        code_lanes::<B>(self.codes.add((t * hd + 8 * c0) * B / 8), n, |c, code| {
            let v = _mm256_sub_ps(_mm256_cvtepi32_ps(code), _mm256_loadu_ps(zero.add(8 * c)));
            out.add(c).write(_mm256_mul_ps(v, _mm256_loadu_ps(step.add(8 * c))));
        });
    }
}
impl<const B: usize> RowLoad for TokenRows<B> {
    #[inline(always)]
    unsafe fn load_lanes(&self, t: usize, hd: usize, c0: usize, out: *mut __m256, n: usize) {
        let s = _mm256_set1_ps(*self.scales.add(t));
        let p = self.codes.add((t * hd + 8 * c0) * B / 8);
        let mut c = 0;
        if let (4, Some(bytes)) = (B, self.bytes) {
            let table = _mm_loadu_si128(bytes.as_ptr().cast());
            while c + 4 <= n {
                let (a, b) = nibbles32(p.add(4 * c));
                let levels = (_mm_shuffle_epi8(table, a), _mm_shuffle_epi8(table, b));
                for (k, level) in widen32::<true>(levels).into_iter().enumerate() {
                    out.add(c + k).write(_mm256_mul_ps(s, _mm256_cvtepi32_ps(level)));
                }
                c += 4;
            }
        }
        let low = _mm256_loadu_ps(self.levels.as_ptr());
        let high = _mm256_loadu_ps(self.levels.as_ptr().add(8));
        for c in c..n {
            let code = unpack8::<B>(p.add(c * B));
            let mut level = _mm256_permutevar8x32_ps(low, code);
            if B == 4 {
                let top = _mm256_castsi256_ps(_mm256_slli_epi32(code, 28));
                level = _mm256_blendv_ps(level, _mm256_permutevar8x32_ps(high, code), top);
            }
            out.add(c).write(_mm256_mul_ps(s, level));
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
    if let KvRows::Channel { codes, bits, zero, step, .. } = k {
        let args = (codes.as_ptr(), zero.as_ptr(), step.as_ptr());
        match bits {
            2 => scores_channel::<2>(args, q, hd, visible, scale, scores, ld, col0),
            3 => scores_channel::<3>(args, q, hd, visible, scale, scores, ld, col0),
            _ => scores_channel::<4>(args, q, hd, visible, scale, scores, ld, col0),
        }
        return;
    }
    if visible.len() > 3 && crate::simd::has_zmm() {
        if let (KvRows::Int8 { .. } | KvRows::F16(_), TURN_FROM..) = (k, visible.len()) {
            scores_turned(k, q, hd, visible, scale, scores, ld, col0);
            return;
        }
        with_rows!(k, rows => scores_zmm(rows, q, hd, visible, scale, scores, ld, col0));
        return;
    }
    match k {
        KvRows::Int8 { blk, t_cap } if visible.len() <= 3 && crate::simd::has_zmm() => {
            scores_pairs(&I8Rows(blk.as_ptr(), t_cap), q, hd, visible, scale, scores, ld, col0)
        }
        KvRows::F16(b) if visible.len() <= 3 && crate::simd::has_zmm() => {
            scores_pairs(&F16Rows(b.as_ptr()), q, hd, visible, scale, scores, ld, col0)
        }
        KvRows::Int8 { blk, t_cap } if visible.len() <= 3 => {
            scores_inline(&I8Rows(blk.as_ptr(), t_cap), q, hd, visible, scale, scores, ld, col0)
        }
        KvRows::F16(b) if visible.len() <= 3 => scores_inline(&F16Rows(b.as_ptr()), q, hd, visible, scale, scores, ld, col0),
        KvRows::F32(v) if visible.len() <= 3 => scores_inline(&F32Rows(v.as_ptr()), q, hd, visible, scale, scores, ld, col0),
        _ => with_rows!(k, rows => scores_with(rows, q, hd, visible, scale, scores, ld, col0)),
    }
}

/// A row's lanes as registers: `row` once a row (an int8 row's scale widened there), `lane`
/// for each 8 channels. The score tiles ([`dots`]) read rows through it, from the chunk
/// itself ([`scores_inline`]) or from a block of rows decoded before ([`BlockRows`]).
trait RowLanes {
    type Row: Copy;
    /// # Safety
    /// As [`RowLoad::load_lanes`]: row `t` inside the block.
    unsafe fn row(&self, t: usize, hd: usize) -> Self::Row;
    /// # Safety
    /// Lane `c` inside the row.
    unsafe fn lane(row: Self::Row, c: usize) -> __m256;
}
impl RowLanes for I8Rows {
    type Row = (*const u8, __m256);
    #[inline(always)]
    unsafe fn row(&self, t: usize, hd: usize) -> Self::Row {
        let bits = self.0.add(2 * t).cast::<i16>().read_unaligned();
        (self.0.add(self.1 * 2 + t * hd), _mm256_cvtph_ps(_mm_set1_epi16(bits)))
    }
    #[inline(always)]
    unsafe fn lane((p, s): Self::Row, c: usize) -> __m256 {
        _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8 * c).cast()))))
    }
}
impl RowLanes for F32Rows {
    type Row = *const f32;
    #[inline(always)]
    unsafe fn row(&self, t: usize, hd: usize) -> Self::Row {
        self.0.add(t * hd)
    }
    #[inline(always)]
    unsafe fn lane(p: Self::Row, c: usize) -> __m256 {
        _mm256_loadu_ps(p.add(8 * c))
    }
}
/// A [`RowBlock`]'s rows, already decoded (`t` the row in the block).
struct BlockRows(*const [__m256; 32]);
impl RowLanes for BlockRows {
    type Row = *const __m256;
    #[inline(always)]
    unsafe fn row(&self, t: usize, _hd: usize) -> Self::Row {
        self.0.add(t).cast()
    }
    #[inline(always)]
    unsafe fn lane(p: Self::Row, c: usize) -> __m256 {
        p.add(c).read()
    }
}
impl RowLanes for F16Rows {
    type Row = *const u8;
    #[inline(always)]
    unsafe fn row(&self, t: usize, hd: usize) -> Self::Row {
        self.0.add(2 * t * hd)
    }
    #[inline(always)]
    unsafe fn lane(p: Self::Row, c: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * c).cast()))
    }
}

/// [`scores_with`] for a decoding step's group (up to 3 queries): each row lane decoded where
/// the group's multiply-adds use it, in registers, instead of written to a block of rows and
/// read back (the same operations on the same values: the same bits). A 16-token int8 chunk's
/// scores for 3 queries: 129.5-130.0 ns against 154.4-157.3 through the block (`cargo run
/// --release -p engine --example attention_kernels`, 4 runs alternating).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_inline<L: RowLanes>(
    k: &L,
    q: &[f32],
    hd: usize,
    visible: &[usize],
    scale: f32,
    scores: &mut [f32],
    ld: usize,
    col0: usize,
) {
    let n = visible.iter().copied().max().unwrap_or(0);
    let sc = _mm256_set1_ps(scale);
    for t0 in (0..n).step_by(8) {
        let m = (n - t0).min(8);
        let query = |i: usize, c: usize| _mm256_loadu_ps(q.as_ptr().add(i * hd + 8 * c));
        score_block(k, t0, m, hd, visible, t0, scores.as_mut_ptr(), ld, col0, query, |_, sum| _mm256_mul_ps(sum, sc));
    }
}

/// Two rows' lanes side by side in one 512-bit vector: lane `c` of row `a` in the low half,
/// of row `b` in the high half, each decoded as [`RowLanes::lane`] decodes it.
trait PairLanes: RowLanes {
    type Pair: Copy;
    /// # Safety
    /// Needs AVX-512F.
    unsafe fn pair(a: Self::Row, b: Self::Row) -> Self::Pair;
    /// # Safety
    /// Lane `c` inside both rows.
    unsafe fn pair_lane(p: Self::Pair, c: usize) -> __m512;
}
impl PairLanes for I8Rows {
    type Pair = (*const u8, *const u8, __m512);
    #[inline(always)]
    unsafe fn pair((a, sa): Self::Row, (b, sb): Self::Row) -> Self::Pair {
        (a, b, pair_ps(sa, sb))
    }
    #[inline(always)]
    unsafe fn pair_lane((a, b, s): Self::Pair, c: usize) -> __m512 {
        let lo = _mm_loadl_epi64(a.add(8 * c).cast());
        let codes = _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(lo), b.add(8 * c).cast()));
        _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)))
    }
}
impl PairLanes for F16Rows {
    type Pair = (*const u8, *const u8);
    #[inline(always)]
    unsafe fn pair(a: Self::Row, b: Self::Row) -> Self::Pair {
        (a, b)
    }
    #[inline(always)]
    unsafe fn pair_lane((a, b): Self::Pair, c: usize) -> __m512 {
        let lo = _mm256_castsi128_si256(_mm_loadu_si128(a.add(16 * c).cast()));
        _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(lo, _mm_loadu_si128(b.add(16 * c).cast())))
    }
}

/// [`scores_inline`] on 512-bit vectors: a block's rows two to a vector, decoded in registers
/// ([`PairLanes`]), against each query's lane broadcast to both halves. Each half runs the
/// 256-bit tile's chain for its row (one chain a dot, in channel order) and its lane sums go
/// through the same [`store_scores`], so the bits are the same, with half the conversions and
/// multiply-adds (docs/notes/engine.md, "Decode's values on 512-bit vectors").
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn scores_pairs<L: PairLanes>(
    k: &L,
    q: &[f32],
    hd: usize,
    visible: &[usize],
    scale: f32,
    scores: &mut [f32],
    ld: usize,
    col0: usize,
) {
    let n = visible.iter().copied().max().unwrap_or(0);
    let sc = _mm256_set1_ps(scale);
    let mut part = std::mem::MaybeUninit::<[__m256; 8 * 3]>::uninit();
    let pp = part.as_mut_ptr().cast::<__m256>();
    for t0 in (0..n).step_by(8) {
        let m = (n - t0).min(8);
        for g0 in (0..visible.len()).step_by(3) {
            let group = &visible[g0..(g0 + 3).min(visible.len())];
            if group.iter().all(|&v| v <= t0) {
                continue;
            }
            let qp = q.as_ptr().add(g0 * hd);
            match (group.len(), m.div_ceil(2)) {
                (3, 4) => pair_dots_inline::<L, 3, 4>(k, t0, m, hd, qp, pp),
                (3, p) => pair_dots_few::<L, 3>(k, t0, m, hd, qp, pp, p),
                (2, 4) => pair_dots_inline::<L, 2, 4>(k, t0, m, hd, qp, pp),
                (2, p) => pair_dots_few::<L, 2>(k, t0, m, hd, qp, pp, p),
                (_, 4) => pair_dots_inline::<L, 1, 4>(k, t0, m, hd, qp, pp),
                (_, p) => pair_dots_few::<L, 1>(k, t0, m, hd, qp, pp, p),
            }
            store_scores(pp, group, t0, scores.as_mut_ptr().add(g0 * ld), ld, col0, |_, sum| _mm256_mul_ps(sum, sc));
        }
    }
}

#[inline(always)]
unsafe fn pair_dots_few<L: PairLanes, const Q: usize>(
    k: &L,
    t0: usize,
    m: usize,
    hd: usize,
    q: *const f32,
    part: *mut __m256,
    pairs: usize,
) {
    match pairs {
        3 => pair_dots_inline::<L, Q, 3>(k, t0, m, hd, q, part),
        2 => pair_dots_inline::<L, Q, 2>(k, t0, m, hd, q, part),
        _ => pair_dots_inline::<L, Q, 1>(k, t0, m, hd, q, part),
    }
}

/// The dot products of `Q` queries with rows `t0..t0 + m` (`P` pairs; an odd last row paired
/// with itself, its copy's sums never stored) into `part[8 * i + j]` as 8 lane sums, as
/// [`dots`] writes them.
#[inline(always)]
unsafe fn pair_dots_inline<L: PairLanes, const Q: usize, const P: usize>(
    k: &L,
    t0: usize,
    m: usize,
    hd: usize,
    q: *const f32,
    part: *mut __m256,
) {
    // (Loops, not `array::from_fn`: a closure does not take the function's target features.)
    let first = k.row(t0, hd);
    let mut rows = [L::pair(first, first); P];
    for (p, r) in rows.iter_mut().enumerate() {
        let a = t0 + 2 * p;
        *r = L::pair(k.row(a, hd), k.row((a + 1).min(t0 + m - 1), hd));
    }
    let mut acc = [[_mm512_setzero_ps(); P]; Q];
    for c in 0..hd / 8 {
        let mut x = [_mm512_setzero_ps(); P];
        for (xp, &r) in x.iter_mut().zip(&rows) {
            *xp = L::pair_lane(r, c);
        }
        for (i, a) in acc.iter_mut().enumerate() {
            let qc = both_halves(q.add(i * hd + 8 * c));
            for (slot, xp) in a.iter_mut().zip(&x) {
                *slot = _mm512_fmadd_ps(*xp, qc, *slot);
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        for (p, v) in a.iter().enumerate() {
            part.add(8 * i + 2 * p).write(_mm512_castps512_ps256(*v));
            part.add(8 * i + 2 * p + 1).write(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*v))));
        }
    }
}

/// Eight [`hsum`]s at once: lane `j` of the result is `hsum(a[j])`, the same additions in the
/// same order (`(l0 + l4) + (l2 + l6)` plus `(l1 + l5) + (l3 + l7)`), so the same bits.
#[inline(always)]
unsafe fn hsum8(a: &[__m256; 8]) -> __m256 {
    // Halves added: b04 holds a0's four pair sums in its low half, a4's in its high half.
    let halves = |x: __m256, y: __m256| _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    let (b04, b15, b26, b37) = (halves(a[0], a[4]), halves(a[1], a[5]), halves(a[2], a[6]), halves(a[3], a[7]));
    // Pair sums 0 + 2 and 1 + 3, interleaved: [x0_0, x1_0, x0_1, x1_1] a half.
    let c01 = _mm256_add_ps(_mm256_unpacklo_ps(b04, b15), _mm256_unpackhi_ps(b04, b15));
    let c23 = _mm256_add_ps(_mm256_unpacklo_ps(b26, b37), _mm256_unpackhi_ps(b26, b37));
    _mm256_add_ps(_mm256_shuffle_ps(c01, c23, 0b01_00_01_00), _mm256_shuffle_ps(c01, c23, 0b11_10_11_10))
}

/// Rows of a block of 8 tokens as vectors of 8 channels, `[token][lane]`: written for the
/// block's rows and lanes only, so read through raw pointers (never as a whole).
type RowBlock = [[__m256; 32]; 8];

/// The dot products of `Q` queries with the `m` (<= 8) rows of `rows`, written to
/// `part[8 * i + j]` as 8 lane sums (query `i`, row `j`): three rows at a time against every
/// query, 3Q independent chains of fused multiply-adds (one chain a dot, in channel order as
/// the reference takes it). One dot at a time left the multiply-add's latency exposed; two
/// rows (six chains for a GQA group of 3) still waited on it.
#[inline(always)]
unsafe fn dots<L: RowLanes, const Q: usize>(
    rows: &L,
    first: usize,
    m: usize,
    hd: usize,
    query: impl Fn(usize, usize) -> __m256,
    part: *mut __m256,
) {
    let mut j = 0;
    while j < m {
        let k = (m - j).min(3);
        match k {
            3 => dots_rows::<L, Q, 3>(rows, first, j, hd, &query, part),
            2 => dots_rows::<L, Q, 2>(rows, first, j, hd, &query, part),
            _ => dots_rows::<L, Q, 1>(rows, first, j, hd, &query, part),
        }
        j += k;
    }
}

/// [`dots`] for rows `first + j..first + j + R` of `rows`, into `part`'s rows `j..j + R`.
#[inline(always)]
unsafe fn dots_rows<L: RowLanes, const Q: usize, const R: usize>(
    rows: &L,
    first: usize,
    j: usize,
    hd: usize,
    query: &impl Fn(usize, usize) -> __m256,
    part: *mut __m256,
) {
    // (Loops, not `array::from_fn`: a closure does not take the function's target features,
    // and an int8 row's scale widened in one cost the in-register tile a fifth of its speed.)
    let mut p = [rows.row(first + j, hd); R];
    for (r, row) in p.iter_mut().enumerate().skip(1) {
        *row = rows.row(first + j + r, hd);
    }
    let mut acc = [[_mm256_setzero_ps(); R]; Q];
    for c in 0..hd / 8 {
        let mut x = [_mm256_setzero_ps(); R];
        for (xr, &row) in x.iter_mut().zip(&p) {
            *xr = L::lane(row, c);
        }
        for (i, a) in acc.iter_mut().enumerate() {
            let qc = query(i, c);
            for (slot, xr) in a.iter_mut().zip(&x) {
                *slot = _mm256_fmadd_ps(*xr, qc, *slot);
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        for (r, v) in a.iter().enumerate() {
            part.add(8 * i + j + r).write(*v);
        }
    }
}

/// Writes the scores of rows `t0..t0 + 8` (at most) for a query group from their lane sums
/// (`part[8 * i + j]`, set for every row below the block's count), `finish(i, sum)` turning
/// sums into scores: eight at a time where the query sees all eight, else one at a time.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn store_scores(
    part: *const __m256,
    group: &[usize],
    t0: usize,
    scores: *mut f32,
    ld: usize,
    col0: usize,
    finish: impl Fn(usize, __m256) -> __m256,
) {
    for (i, &vis) in group.iter().enumerate() {
        let dst = scores.add(i * ld + col0 + t0);
        let p = part.add(8 * i);
        match vis.saturating_sub(t0) {
            0 => {}
            8.. => _mm256_storeu_ps(dst, finish(i, hsum8(&*p.cast::<[__m256; 8]>()))),
            m => {
                for j in 0..m {
                    *dst.add(j) = _mm256_cvtss_f32(finish(i, _mm256_set1_ps(hsum(p.add(j).read()))));
                }
            }
        }
    }
}

/// The scores of a block of up to 8 rows for every query, in groups of up to 3 (the GQA group
/// of a decoding step is one): [`dots`] over rows `first..first + m` of `rows`, then
/// [`store_scores`] (token `t0` the block's first).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn score_block<L: RowLanes>(
    rows: &L,
    first: usize,
    m: usize,
    hd: usize,
    visible: &[usize],
    t0: usize,
    scores: *mut f32,
    ld: usize,
    col0: usize,
    query: impl Fn(usize, usize) -> __m256,
    finish: impl Fn(usize, __m256) -> __m256,
) {
    let mut part = std::mem::MaybeUninit::<[__m256; 8 * 3]>::uninit();
    let pp = part.as_mut_ptr().cast::<__m256>();
    for g0 in (0..visible.len()).step_by(3) {
        let group = &visible[g0..(g0 + 3).min(visible.len())];
        if group.iter().all(|&v| v <= t0) {
            continue;
        }
        let q = |i: usize, c: usize| query(g0 + i, c);
        match group.len() {
            3 => dots::<L, 3>(rows, first, m, hd, q, pp),
            2 => dots::<L, 2>(rows, first, m, hd, q, pp),
            _ => dots::<L, 1>(rows, first, m, hd, q, pp),
        }
        store_scores(pp, group, t0, scores.add(g0 * ld), ld, col0, |i, sum| finish(g0 + i, sum));
    }
}

/// Scores against channel-wise rows as the reference takes them: the queries scaled by the
/// steps once (on the stack), then the rows' codes unpacked 8 rows at a time and multiplied
/// into the scaled queries, the zero points' share subtracted at the end.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
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
    // Eight scaled queries (8 KiB) and a block of rows (8 KiB) are written before they are
    // read: not zeroed each call, which cost as much as scoring a 16-token chunk for one query.
    let mut scaled = std::mem::MaybeUninit::<[__m256; 8 * 32]>::uninit();
    let sp = scaled.as_mut_ptr().cast::<__m256>();
    let mut rows = std::mem::MaybeUninit::<RowBlock>::uninit();
    let rp = rows.as_mut_ptr().cast::<[__m256; 32]>();
    let mut offset = [0.0f32; 8];
    let sc = _mm256_set1_ps(scale);
    for g0 in (0..visible.len()).step_by(8) {
        let group = &visible[g0..(g0 + 8).min(visible.len())];
        for (j, off) in offset.iter_mut().enumerate().take(group.len()) {
            let qp = q.as_ptr().add((g0 + j) * hd);
            let mut acc = _mm256_setzero_ps();
            for c in 0..lanes {
                let s = _mm256_mul_ps(_mm256_loadu_ps(qp.add(8 * c)), _mm256_loadu_ps(step.add(8 * c)));
                sp.add(32 * j + c).write(s);
                acc = _mm256_fmadd_ps(s, _mm256_loadu_ps(zero.add(8 * c)), acc);
            }
            *off = hsum(acc);
        }
        let n = group.iter().copied().max().unwrap_or(0);
        for t0 in (0..n).step_by(8) {
            let m = (n - t0).min(8);
            for j in 0..m {
                let kv = rp.add(j).cast::<__m256>();
                code_lanes::<B>(codes.add((t0 + j) * hd * B / 8), lanes, |c, code| kv.add(c).write(_mm256_cvtepi32_ps(code)));
            }
            let query = |i: usize, c: usize| sp.add(32 * i + c).read();
            let finish = |i: usize, sum: __m256| _mm256_mul_ps(_mm256_sub_ps(sum, _mm256_set1_ps(offset[i])), sc);
            score_block(&BlockRows(rp), 0, m, hd, group, t0, scores.as_mut_ptr().add(g0 * ld), ld, col0, query, finish);
        }
    }
}

/// Scores 8 rows at a time: each row loaded once for all queries ([`score_block`]).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_with<L: RowLoad>(k: &L, q: &[f32], hd: usize, visible: &[usize], scale: f32, scores: &mut [f32], ld: usize, col0: usize) {
    let lanes = hd / 8;
    let n = visible.iter().copied().max().unwrap_or(0);
    let mut rows = std::mem::MaybeUninit::<RowBlock>::uninit();
    let rp = rows.as_mut_ptr().cast::<[__m256; 32]>();
    let sc = _mm256_set1_ps(scale);
    for t0 in (0..n).step_by(8) {
        let m = (n - t0).min(8);
        for j in 0..m {
            k.load_lanes(t0 + j, hd, 0, rp.add(j).cast(), lanes);
        }
        let query = |i: usize, c: usize| _mm256_loadu_ps(q.as_ptr().add(i * hd + 8 * c));
        score_block(&BlockRows(rp), 0, m, hd, visible, t0, scores.as_mut_ptr(), ld, col0, query, |_, sum| _mm256_mul_ps(sum, sc));
    }
}

/// Queries a 512-bit score tile takes at once ([`scores_zmm`]): by the block's 8 rows in 4
/// pairs, 16 accumulators.
const ZQ: usize = 4;

/// `lo` and `hi` as one vector, `lo` in the low half.
#[inline(always)]
unsafe fn pair_ps(lo: __m256, hi: __m256) -> __m512 {
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi)))
}

/// The 8 floats at `p` in both halves of a vector (one load).
#[inline(always)]
unsafe fn both_halves(p: *const f32) -> __m512 {
    _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(p.cast())))
}

/// [`scores_with`] on 512-bit vectors, for more queries than a decoding step's group (a
/// prefill job's): a block's rows go two to a vector (row `2p` in the low half, `2p + 1` in
/// the high half), each query's 8 channels broadcast to both halves. Each half does the
/// 256-bit kernel's multiply-adds in its order (one chain a dot, in channel order) and its
/// lane sums go through the same [`hsum8`], so the bits are the same with half the
/// multiply-add instructions.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn scores_zmm<L: RowLoad>(k: &L, q: &[f32], hd: usize, visible: &[usize], scale: f32, scores: &mut [f32], ld: usize, col0: usize) {
    let lanes = hd / 8;
    let n = visible.iter().copied().max().unwrap_or(0);
    let mut rows = std::mem::MaybeUninit::<RowBlock>::uninit();
    let rp = rows.as_mut_ptr().cast::<[__m256; 32]>();
    let mut pairs = std::mem::MaybeUninit::<[[__m512; 32]; 4]>::uninit();
    let pp = pairs.as_mut_ptr().cast::<__m512>();
    let mut part = std::mem::MaybeUninit::<[__m256; 8 * ZQ]>::uninit();
    let part = part.as_mut_ptr().cast::<__m256>();
    let sc = _mm256_set1_ps(scale);
    for t0 in (0..n).step_by(8) {
        let m = (n - t0).min(8);
        for j in 0..m {
            k.load_lanes(t0 + j, hd, 0, rp.add(j).cast(), lanes);
        }
        // Rows past the block's count: zeros, scored and never stored.
        for j in m..8 {
            for c in 0..lanes {
                rp.add(j).cast::<__m256>().add(c).write(_mm256_setzero_ps());
            }
        }
        for p in 0..4 {
            let (lo, hi) = (rp.add(2 * p).cast::<__m256>(), rp.add(2 * p + 1).cast::<__m256>());
            for c in 0..lanes {
                pp.add(32 * p + c).write(pair_ps(lo.add(c).read(), hi.add(c).read()));
            }
        }
        for g0 in (0..visible.len()).step_by(ZQ) {
            let group = &visible[g0..(g0 + ZQ).min(visible.len())];
            if group.iter().all(|&v| v <= t0) {
                continue;
            }
            let qp = q.as_ptr().add(g0 * hd);
            match group.len() {
                4 => pair_dots::<4>(pp, lanes, qp, hd, part),
                3 => pair_dots::<3>(pp, lanes, qp, hd, part),
                2 => pair_dots::<2>(pp, lanes, qp, hd, part),
                _ => pair_dots::<1>(pp, lanes, qp, hd, part),
            }
            store_scores(part, group, t0, scores.as_mut_ptr().add(g0 * ld), ld, col0, |_, sum| _mm256_mul_ps(sum, sc));
        }
    }
}

/// `r` transposed as a 16 x 16 matrix of 32-bit words: lane `i` of `out[j]` is lane `j` of
/// `r[i]` (interleaves of words, then of pairs, then two rounds of 128-bit lane shuffles).
#[inline(always)]
unsafe fn transpose16(r: &[__m512i; 16]) -> [__m512i; 16] {
    // Per 128-bit lane L (words 4L..4L + 3), rows 4g..4g + 3: u[g][k] holds word 4L + k of the
    // four rows in lane L.
    // (Loops, not `array::from_fn`: a closure does not take the function's target features,
    // and its intrinsics were left as calls.)
    let mut u = [[_mm512_setzero_si512(); 4]; 4];
    for (g, ug) in u.iter_mut().enumerate() {
        let (a, b, c, d) = (r[4 * g], r[4 * g + 1], r[4 * g + 2], r[4 * g + 3]);
        let (t0, t1) = (_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
        let (t2, t3) = (_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
        *ug = [_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2), _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)];
    }
    let mut out = [_mm512_setzero_si512(); 16];
    for k in 0..4 {
        // Words k and 8 + k (0x88: lanes 0, 2 of each), 4 + k and 12 + k (0xdd: lanes 1, 3).
        let v = _mm512_shuffle_i32x4::<0x88>(u[0][k], u[1][k]);
        let v2 = _mm512_shuffle_i32x4::<0xdd>(u[0][k], u[1][k]);
        let w = _mm512_shuffle_i32x4::<0x88>(u[2][k], u[3][k]);
        let w2 = _mm512_shuffle_i32x4::<0xdd>(u[2][k], u[3][k]);
        out[k] = _mm512_shuffle_i32x4::<0x88>(v, w);
        out[8 + k] = _mm512_shuffle_i32x4::<0xdd>(v, w);
        out[4 + k] = _mm512_shuffle_i32x4::<0x88>(v2, w2);
        out[12 + k] = _mm512_shuffle_i32x4::<0xdd>(v2, w2);
    }
    out
}

/// Byte `B` of each 32-bit lane of `w`, sign-extended, as floats.
#[inline(always)]
unsafe fn byte_lanes<const B: u32>(w: __m512i) -> __m512 {
    let x = match B {
        0 => _mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(w)),
        1 => _mm512_srai_epi32::<24>(_mm512_slli_epi32::<16>(w)),
        2 => _mm512_srai_epi32::<24>(_mm512_slli_epi32::<8>(w)),
        _ => _mm512_srai_epi32::<24>(w),
    };
    _mm512_cvtepi32_ps(x)
}

/// The fewest queries [`scores_turned`] takes (a prefill job's: 8 tokens by the GQA group).
/// Fewer, turning a block costs about what it saves: a decoding step's group of 4 (Gemma 3's,
/// head_dim 256) scored a 16-token int8 chunk in 664-670 ns turned against 626-685 by the
/// row-pair tiles; 32 queries 2638-2673 against 2818-2829 (`attention_kernels` with those
/// shapes).
const TURN_FROM: usize = 8;

/// Queries a turned score tile takes at once ([`scores_turned`]): 8 lane sums each, 24
/// accumulators, beside a channel's row vector and a query's broadcast channel.
const TQ: usize = 3;

/// [`chunk_scores`] of a prefill job's many queries against an int8 or f16 block, with the
/// block turned: a vector holds one channel of 16 tokens (`kt[c]`, lane `t`: the reference's
/// row value, an int8 token's scale times its code or an f16 value widened), built once a
/// block of 16 tokens for every query, so a query's 16 scores are 8 chains of multiply-adds,
/// chain `l` over channels `l, l + 8, ...`, and the chains added as [`super::dot_lanes`] adds
/// its lanes: the same bits. The row-wise 512-bit tiles ([`scores_zmm`]) spent as many
/// instructions again on pairing rows and on horizontal sums: a 16-token chunk's scores for 24
/// queries took 694-734 ns there and 565-572 here in int8, 687-695 and 591-593 in f16, on the
/// AMD host (`cargo run --release -p engine --example attention_kernels`), whose 512-bit
/// multiply-adds run one a cycle. Not for a decoding step's 3 queries: turning a block costs
/// about what their scores do (int8 156 ns against 158).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn scores_turned(k: KvRows, q: &[f32], hd: usize, visible: &[usize], scale: f32, scores: &mut [f32], ld: usize, col0: usize) {
    let n = visible.iter().copied().max().unwrap_or(0);
    // Up to 256 channels by 16 tokens (16 KiB): every channel below `hd` written before read.
    let mut turned = std::mem::MaybeUninit::<[__m512; 256]>::uninit();
    let kt = turned.as_mut_ptr().cast::<__m512>();
    let sc = _mm512_set1_ps(scale);
    for t0 in (0..n).step_by(16) {
        let m = (n - t0).min(16);
        match k {
            KvRows::Int8 { blk, t_cap } => turn_int8(blk, t_cap, t0, m, hd, kt),
            KvRows::F16(b) => turn_f16(b, t0, m, hd, kt),
            _ => unreachable!("only int8 and f16 rows are turned"),
        }
        for g0 in (0..visible.len()).step_by(TQ) {
            let group = &visible[g0..(g0 + TQ).min(visible.len())];
            if group.iter().all(|&v| v <= t0) {
                continue;
            }
            let (qp, out) = (q.as_ptr().add(g0 * hd), scores.as_mut_ptr().add(g0 * ld + col0 + t0));
            match group.len() {
                3 => turned_dots::<3>(kt, hd, qp, group, t0, sc, out, ld),
                2 => turned_dots::<2>(kt, hd, qp, group, t0, sc, out, ld),
                _ => turned_dots::<1>(kt, hd, qp, group, t0, sc, out, ld),
            }
        }
    }
}

/// Words `w0..w0 + d` (32-bit, `d` <= 16) of rows `t0..t0 + m` (`m` <= 16) at `rows`, `stride`
/// bytes apart, turned ([`transpose16`]): lane `t` of `out[j]` is word `w0 + j` of row
/// `t0 + t`, zero for rows past `m`.
#[inline(always)]
unsafe fn turn_words(rows: *const u8, stride: usize, t0: usize, m: usize, w0: usize, d: usize) -> [__m512i; 16] {
    let mask: __mmask16 = ((1u32 << d) - 1) as __mmask16;
    let mut r = [_mm512_setzero_si512(); 16];
    for (j, row) in r.iter_mut().enumerate().take(m) {
        *row = _mm512_maskz_loadu_epi32(mask, rows.add((t0 + j) * stride + 4 * w0).cast());
    }
    transpose16(&r)
}

/// An int8 block's tokens `t0..t0 + m` turned into `kt` (channel `c` at `kt[c]`).
#[inline(always)]
unsafe fn turn_int8(blk: &[u8], t_cap: usize, t0: usize, m: usize, hd: usize, kt: *mut __m512) {
    let s = if m == 16 {
        _mm512_cvtph_ps(_mm256_loadu_si256(blk.as_ptr().add(2 * t0).cast()))
    } else {
        let mut h = [0u16; 16];
        for (j, x) in h.iter_mut().enumerate().take(m) {
            *x = u16::from_le_bytes([blk[2 * (t0 + j)], blk[2 * (t0 + j) + 1]]);
        }
        _mm512_cvtph_ps(_mm256_loadu_si256(h.as_ptr().cast()))
    };
    let words = hd / 4;
    for w0 in (0..words).step_by(16) {
        let d = (words - w0).min(16);
        let cols = turn_words(blk.as_ptr().add(2 * t_cap), hd, t0, m, w0, d);
        for (j, &w) in cols.iter().enumerate().take(d) {
            let c = kt.add(4 * (w0 + j));
            c.write(_mm512_mul_ps(s, byte_lanes::<0>(w)));
            c.add(1).write(_mm512_mul_ps(s, byte_lanes::<1>(w)));
            c.add(2).write(_mm512_mul_ps(s, byte_lanes::<2>(w)));
            c.add(3).write(_mm512_mul_ps(s, byte_lanes::<3>(w)));
        }
    }
}

/// An f16 block's tokens `t0..t0 + m` turned into `kt` (each value widened exactly).
#[inline(always)]
unsafe fn turn_f16(b: &[u8], t0: usize, m: usize, hd: usize, kt: *mut __m512) {
    let words = hd / 2;
    for w0 in (0..words).step_by(16) {
        let d = (words - w0).min(16);
        let cols = turn_words(b.as_ptr(), 2 * hd, t0, m, w0, d);
        for (j, &w) in cols.iter().enumerate().take(d) {
            let c = kt.add(2 * (w0 + j));
            c.write(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(w)));
            c.add(1).write(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(w))));
        }
    }
}

/// The scores of `Q` queries (at `q`, stride `hd`) against a turned block (`kt`), lane `t` of
/// query `i` stored at `out[i * ld + t]` where the query sees token `t0 + t`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn turned_dots<const Q: usize>(
    kt: *const __m512,
    hd: usize,
    q: *const f32,
    group: &[usize],
    t0: usize,
    sc: __m512,
    out: *mut f32,
    ld: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); 8]; Q];
    for c0 in (0..hd).step_by(8) {
        for l in 0..8 {
            let k = kt.add(c0 + l).read();
            for (i, a) in acc.iter_mut().enumerate() {
                a[l] = _mm512_fmadd_ps(k, _mm512_set1_ps(*q.add(i * hd + c0 + l)), a[l]);
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        let cnt = group[i].saturating_sub(t0).min(16);
        if cnt == 0 {
            continue;
        }
        let even = _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6]));
        let odd = _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7]));
        let sum = _mm512_mul_ps(_mm512_add_ps(even, odd), sc);
        _mm512_mask_storeu_ps(out.add(i * ld), ((1u32 << cnt) - 1) as __mmask16, sum);
    }
}

/// The dots of `Q` queries (at `q`, stride `hd`) with a block's 8 rows in 4 pairs (`pairs[32
/// * p + c]`: lane `c` of rows `2p` and `2p + 1`), written to `part[8 * i + j]` as the 256-bit
/// [`dots`] write them: 4Q chains of multiply-adds, two dots each.
#[inline(always)]
unsafe fn pair_dots<const Q: usize>(pairs: *const __m512, lanes: usize, q: *const f32, hd: usize, part: *mut __m256) {
    let mut acc = [[_mm512_setzero_ps(); 4]; Q];
    for c in 0..lanes {
        let x: [__m512; 4] = std::array::from_fn(|p| pairs.add(32 * p + c).read());
        for (i, a) in acc.iter_mut().enumerate() {
            let qc = both_halves(q.add(i * hd + 8 * c));
            for (slot, xp) in a.iter_mut().zip(&x) {
                *slot = _mm512_fmadd_ps(*xp, qc, *slot);
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        for (p, v) in a.iter().enumerate() {
            part.add(8 * i + 2 * p).write(_mm512_castps512_ps256(*v));
            part.add(8 * i + 2 * p + 1).write(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*v))));
        }
    }
}

/// # Safety
/// Needs AVX2/FMA; `hd` a multiple of 8 up to 256; indices bounded (checked by the caller).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn chunk_values(probs: &[f32], ld: usize, col0: usize, v: KvRows, visible: &[usize], hd: usize, out: &mut [f32]) {
    let zmm = visible.len() > 3 && hd.is_multiple_of(16) && crate::simd::has_zmm();
    if let (true, KvRows::F32(rows)) = (zmm, v) {
        values_zmm::<_, 4>(&F32Rows(rows.as_ptr()), probs, ld, col0, visible, hd, out);
        return;
    }
    if visible.len() <= 3 || matches!(v, KvRows::F32(_)) {
        if hd.is_multiple_of(16) && crate::simd::has_zmm() {
            match v {
                KvRows::Int8 { blk, t_cap } => return values_zmm::<_, 3>(&I8Rows(blk.as_ptr(), t_cap), probs, ld, col0, visible, hd, out),
                KvRows::F16(b) => return values_zmm::<_, 3>(&F16Rows(b.as_ptr()), probs, ld, col0, visible, hd, out),
                _ => {}
            }
        }
        with_rows!(v, rows => values_inline(rows, probs, ld, col0, visible, hd, out));
        return;
    }
    with_rows!(v, rows => values_buffered(rows, probs, ld, col0, visible, hd, out, zmm));
}

/// Rows [`values_buffered`] decodes at a time.
const VALUES_BLOCK: usize = 16;

/// [`chunk_values`] for more queries than one tile (a prefill job's) over rows that are not
/// f32: decoded [`VALUES_BLOCK`] at a time into a buffer on the stack and read from there by
/// every tile of [`values_inline`], or of [`values_zmm`] when `zmm` (each output still adds
/// its rows in token order: the same bits). A prefill job's 24 queries read the decoded rows
/// 8 times from L1 instead of decoding them 8 times: 711-751 ns a 16-token int8 chunk before, 495-519 after.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values_buffered<L: RowLoad>(
    v: &L,
    probs: &[f32],
    ld: usize,
    col0: usize,
    visible: &[usize],
    hd: usize,
    out: &mut [f32],
    zmm: bool,
) {
    let lanes = hd / 8;
    let n = visible.iter().copied().max().unwrap_or(0);
    let mut rows = std::mem::MaybeUninit::<[__m256; VALUES_BLOCK * 32]>::uninit();
    let rp = rows.as_mut_ptr().cast::<__m256>();
    let mut vis = [0usize; 64];
    for t0 in (0..n).step_by(VALUES_BLOCK) {
        let m = (n - t0).min(VALUES_BLOCK);
        for j in 0..m {
            v.load_lanes(t0 + j, hd, 0, rp.add(j * lanes), lanes);
        }
        for q0 in (0..visible.len()).step_by(64) {
            let part = &visible[q0..(q0 + 64).min(visible.len())];
            for (d, &s) in vis.iter_mut().zip(part) {
                *d = s.saturating_sub(t0).min(m);
            }
            // The block's rows at stride `hd`: only rows below `m` are read.
            let (probs, vis, out) = (&probs[q0 * ld..], &vis[..part.len()], &mut out[q0 * hd..]);
            if zmm {
                values_zmm::<_, 4>(&F32Rows(rp.cast::<f32>()), probs, ld, col0 + t0, vis, hd, out);
            } else {
                values_inline(&F32Rows(rp.cast::<f32>()), probs, ld, col0 + t0, vis, hd, out);
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values_inline<L: RowLoad>(v: &L, probs: &[f32], ld: usize, col0: usize, visible: &[usize], hd: usize, out: &mut [f32]) {
    // [`chunk_values`] for a decode step's GQA group (up to 3 queries: one tile, each row
    // decoded once, where it is used) and for f32 rows (decoded up front, or by
    // [`values_buffered`]). Tiles of up to 3 queries by 3 lanes: 9 accumulators
    // and 3 row vectors in the 16 registers, each output loaded and stored once a chunk
    // instead of once a token. With 4 lanes (12 accumulators and 4 rows) three accumulators
    // lived on the stack and their store-to-load chains bounded the loop; 3 lanes took an
    // int8 chunk's values from 105-110 to 76-83 ns (`cargo run --release -p engine --example
    // attention_kernels`).
    let lanes = hd / 8;
    for q0 in (0..visible.len()).step_by(3) {
        let vis = &visible[q0..(q0 + 3).min(visible.len())];
        let (o, col) = (out.as_mut_ptr().add(q0 * hd), q0 * ld + col0);
        for c0 in (0..lanes).step_by(3) {
            let tile = (v, probs, ld, col, vis, hd, o, c0);
            match (vis.len(), lanes - c0) {
                (3, 3..) => values_tile::<L, 3, 3>(tile),
                (2, 3..) => values_tile::<L, 2, 3>(tile),
                (_, 3..) => values_tile::<L, 1, 3>(tile),
                (3, w) => values_tile_narrow::<L, 3>(tile, w),
                (2, w) => values_tile_narrow::<L, 2>(tile, w),
                (_, w) => values_tile_narrow::<L, 1>(tile, w),
            }
        }
    }
}

/// Rows, probabilities, their stride, the tile's first probability column, its queries'
/// visible counts, `hd`, its first output, its first lane.
type ValuesTile<'a, L> = (&'a L, &'a [f32], usize, usize, &'a [usize], usize, *mut f32, usize);

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values_tile_narrow<L: RowLoad, const Q: usize>(tile: ValuesTile<L>, width: usize) {
    match width {
        2 => values_tile::<L, Q, 2>(tile),
        _ => values_tile::<L, Q, 1>(tile),
    }
}

/// `Q` queries by `N` lanes of [`values_inline`], accumulated in registers in token order (the
/// reference's order, so the same bits).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values_tile<L: RowLoad, const Q: usize, const N: usize>((v, probs, ld, col, vis, hd, o, c0): ValuesTile<L>) {
    let mut acc = [[_mm256_setzero_ps(); N]; Q];
    for (i, a) in acc.iter_mut().enumerate() {
        for (c, slot) in a.iter_mut().enumerate() {
            *slot = _mm256_loadu_ps(o.add(i * hd + 8 * (c0 + c)));
        }
    }
    let n = vis.iter().copied().max().unwrap_or(0);
    let mut row = [_mm256_setzero_ps(); N];
    for t in 0..n {
        v.load_lanes(t, hd, c0, row.as_mut_ptr(), N);
        for (i, a) in acc.iter_mut().enumerate() {
            if t >= *vis.get_unchecked(i) {
                continue;
            }
            let w = _mm256_set1_ps(*probs.get_unchecked(col + i * ld + t));
            for (slot, r) in a.iter_mut().zip(&row) {
                *slot = _mm256_fmadd_ps(w, *r, *slot);
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        for (c, slot) in a.iter().enumerate() {
            _mm256_storeu_ps(o.add(i * hd + 8 * (c0 + c)), *slot);
        }
    }
}

/// 16 channels of a row as one 512-bit vector: the 256-bit [`RowLanes`] decode of two lanes
/// side by side (the same conversion and, for int8, the same multiplication by the row's
/// scale, lane for lane: the same floats).
trait ZmmRowLanes {
    type Row: Copy;
    /// # Safety
    /// As [`RowLanes::row`].
    unsafe fn zrow(&self, t: usize, hd: usize) -> Self::Row;
    /// Channels `16v..16v + 16` of the row.
    ///
    /// # Safety
    /// Inside the row.
    unsafe fn zvec(row: Self::Row, v: usize) -> __m512;
}
impl ZmmRowLanes for I8Rows {
    type Row = (*const u8, __m512);
    #[inline(always)]
    unsafe fn zrow(&self, t: usize, hd: usize) -> Self::Row {
        let bits = self.0.add(2 * t).cast::<i16>().read_unaligned();
        (self.0.add(self.1 * 2 + t * hd), _mm512_cvtph_ps(_mm256_set1_epi16(bits)))
    }
    #[inline(always)]
    unsafe fn zvec((p, s): Self::Row, v: usize) -> __m512 {
        _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(16 * v).cast()))))
    }
}
impl ZmmRowLanes for F32Rows {
    type Row = *const f32;
    #[inline(always)]
    unsafe fn zrow(&self, t: usize, hd: usize) -> Self::Row {
        self.0.add(t * hd)
    }
    #[inline(always)]
    unsafe fn zvec(p: Self::Row, v: usize) -> __m512 {
        _mm512_loadu_ps(p.add(16 * v))
    }
}
impl ZmmRowLanes for F16Rows {
    type Row = *const u8;
    #[inline(always)]
    unsafe fn zrow(&self, t: usize, hd: usize) -> Self::Row {
        self.0.add(2 * t * hd)
    }
    #[inline(always)]
    unsafe fn zvec(p: Self::Row, v: usize) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.add(32 * v).cast()))
    }
}

/// [`values_inline`] on 512-bit vectors: tiles of up to `G` queries by 64 channels, each
/// row's 16-channel vectors decoded in registers where the tile's multiply-adds use them.
/// Each output channel adds its rows in token order, one multiply-add each, as the 256-bit
/// tiles do: the same bits. A decoding step's group (`G` = 3) over int8 or f16 rows does half
/// the conversions and multiply-adds of the 256-bit tiles, which all wait there for the two
/// ports that multiply (docs/notes/engine.md, "Decode's values on 512-bit vectors"); f32 rows
/// (decoded before, `G` = 4) only load.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn values_zmm<L: ZmmRowLanes, const G: usize>(
    v: &L,
    probs: &[f32],
    ld: usize,
    col0: usize,
    visible: &[usize],
    hd: usize,
    out: &mut [f32],
) {
    let vecs = hd / 16;
    for q0 in (0..visible.len()).step_by(G) {
        let vis = &visible[q0..(q0 + G).min(visible.len())];
        let (o, col) = (out.as_mut_ptr().add(q0 * hd), q0 * ld + col0);
        for v0 in (0..vecs).step_by(4) {
            let tile = (v, probs, ld, col, vis, hd, o, v0);
            match vis.len() {
                4 => values_zmm_q::<L, 4>(tile, vecs - v0),
                3 => values_zmm_q::<L, 3>(tile, vecs - v0),
                2 => values_zmm_q::<L, 2>(tile, vecs - v0),
                _ => values_zmm_q::<L, 1>(tile, vecs - v0),
            }
        }
    }
}

/// A [`values_zmm`] tile: rows, probabilities, their stride, the tile's first probability
/// column, its queries' visible counts, `hd`, its first output, its first 16-channel vector.
type ZmmTile<'a, L> = (&'a L, &'a [f32], usize, usize, &'a [usize], usize, *mut f32, usize);

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn values_zmm_q<L: ZmmRowLanes, const Q: usize>(tile: ZmmTile<L>, width: usize) {
    match width {
        4.. => values_zmm_tile::<L, Q, 4>(tile),
        3 => values_zmm_tile::<L, Q, 3>(tile),
        2 => values_zmm_tile::<L, Q, 2>(tile),
        _ => values_zmm_tile::<L, Q, 1>(tile),
    }
}

/// `Q` queries by `N` 16-channel vectors of [`values_zmm`], accumulated in registers in token
/// order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn values_zmm_tile<L: ZmmRowLanes, const Q: usize, const N: usize>((v, probs, ld, col, vis, hd, o, v0): ZmmTile<L>) {
    let mut acc = [[_mm512_setzero_ps(); N]; Q];
    for (i, a) in acc.iter_mut().enumerate() {
        for (c, slot) in a.iter_mut().enumerate() {
            *slot = _mm512_loadu_ps(o.add(i * hd + 16 * (v0 + c)));
        }
    }
    let n = vis.iter().copied().max().unwrap_or(0);
    let mut row = [_mm512_setzero_ps(); N];
    for t in 0..n {
        let r = v.zrow(t, hd);
        for (c, x) in row.iter_mut().enumerate() {
            *x = L::zvec(r, v0 + c);
        }
        for (i, a) in acc.iter_mut().enumerate() {
            if t >= *vis.get_unchecked(i) {
                continue;
            }
            let w = _mm512_set1_ps(*probs.get_unchecked(col + i * ld + t));
            for (slot, x) in a.iter_mut().zip(&row) {
                *slot = _mm512_fmadd_ps(w, *x, *slot);
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        for (c, slot) in a.iter().enumerate() {
            _mm512_storeu_ps(o.add(i * hd + 16 * (v0 + c)), *slot);
        }
    }
}

/// [`super::exp_lane`] for 8 lanes, operation for operation.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exp8(x: __m256) -> __m256 {
    use super::{EXP_C, EXP_MIN, EXP_P};
    let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
    let n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C[0]), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C[1]), r);
    let mut p = _mm256_set1_ps(EXP_P[0]);
    for &c in &EXP_P[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
    let pow2n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    let y = _mm256_mul_ps(p, pow2n);
    _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(EXP_MIN), _CMP_GT_OQ))
}

/// [`super::row_max_ref`] eight lanes at a time: `max(x, m)` keeps `m` when `x` is NaN, as
/// `f32::max` does, and a maximum does not depend on the order it is taken in.
///
/// # Safety
/// Needs AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn row_max(row: &[f32]) -> f32 {
    let (n, p) = (row.len(), row.as_ptr());
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 8 <= n {
        m = _mm256_max_ps(_mm256_loadu_ps(p.add(i)), m);
        i += 8;
    }
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    lanes.iter().chain(&row[i..]).fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// [`super::round_f16_ref`] eight at a time (F16C rounds to nearest, ties to even, as
/// `f16::from_f32`).
///
/// # Safety
/// Needs F16C; `src` and `dst` of one length.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn round_f16(src: &[f32], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        let h = _mm256_cvtps_ph(_mm256_loadu_ps(src.as_ptr().add(i)), _MM_FROUND_TO_NEAREST_INT);
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        i += 8;
    }
    super::round_f16_ref(&src[i..n], &mut dst[i..n]);
}

/// [`super::silu_mul_ref`] eight lanes at a time: `min(x, c)` gives `c` for a NaN `x`, as
/// `f32::min` does.
///
/// # Safety
/// Needs AVX2 and FMA; `g` and `u` of one length.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn silu_mul(g: &mut [f32], u: &[f32]) {
    let n = g.len();
    debug_assert_eq!(n, u.len());
    let (gp, up) = (g.as_mut_ptr(), u.as_ptr());
    let (sign, cap, one) = (_mm256_set1_ps(-0.0), _mm256_set1_ps(super::EXP_MAX), _mm256_set1_ps(1.0));
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n, both rows n long.
        let x = _mm256_loadu_ps(gp.add(i));
        let e = exp8(_mm256_min_ps(_mm256_xor_ps(x, sign), cap));
        _mm256_storeu_ps(gp.add(i), _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(up.add(i))));
        i += 8;
    }
    super::silu_mul_ref(&mut g[i..], &u[i..]);
}

/// [`exp8`] for 16 lanes, operation for operation (so [`super::exp_lane`]'s bits).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn exp16(x: __m512) -> __m512 {
    use super::{EXP_C, EXP_MIN, EXP_P};
    // `max_ps` gives its second operand for a NaN, as the 256-bit one does.
    let x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_C[0]), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_C[1]), r);
    let mut p = _mm512_set1_ps(EXP_P[0]);
    for &c in &EXP_P[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0)));
    let pow2n = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127))));
    _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(EXP_MIN)), _mm512_mul_ps(p, pow2n))
}

/// [`row_max`] sixteen lanes at a time (the same maximum: it does not depend on the order).
///
/// # Safety
/// Needs AVX512F.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
pub(super) unsafe fn row_max_zmm(row: &[f32]) -> f32 {
    let (n, p) = (row.len(), row.as_ptr());
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 16 <= n {
        m = _mm512_max_ps(_mm512_loadu_ps(p.add(i)), m);
        i += 16;
    }
    if i < n {
        // The rest as one masked vector, the lanes past the row -inf (a row of attention is
        // a few dozen to a few hundred scores: a scalar tail and fold were a chain of ~30
        // dependent maxes a row).
        let k = tail_mask(n - i);
        m = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), k, p.add(i)), m);
    }
    // No lane of `m` is NaN (`max_ps` gives its second operand, `m`, for a NaN value), and
    // max is exact, so the reduction's order gives the fold's value.
    _mm512_reduce_max_ps(m)
}

/// Each half of `e` summed in f64 in [`super::sum8`]'s order: (low eight, high eight).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn sum8_halves(e: __m512) -> (f64, f64) {
    let (a, b) =
        (_mm512_cvtps_pd(_mm512_castps512_ps256(e)), _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(e)))));
    // [a0..a3 | b0..b3] + [a4..a7 | b4..b7], then pairs (0, 2) and (1, 3), then the two.
    let s2 = _mm512_add_pd(_mm512_shuffle_f64x2::<0b01_00_01_00>(a, b), _mm512_shuffle_f64x2::<0b11_10_11_10>(a, b));
    let s1 = _mm512_add_pd(s2, _mm512_permutex_pd::<0b01_00_11_10>(s2));
    let s0 = _mm512_add_pd(s1, _mm512_permutex_pd::<0b10_11_00_01>(s1));
    (_mm512_cvtsd_f64(s0), _mm256_cvtsd_f64(_mm512_extractf64x4_pd::<1>(s0)))
}

/// The low `k` lanes of 16 (`k` < 16).
#[inline(always)]
fn tail_mask(k: usize) -> __mmask16 {
    debug_assert!(k < 16);
    ((1u32 << k) - 1) as __mmask16
}

/// [`softmax_f16`] sixteen lanes at a time: each half's eight exponentials summed in f64 in
/// [`super::sum8`]'s order and added to the row's sum low half first, as two 8-lane steps
/// would; so the same bits. (Attention's softmax was ~6% of a short prefill at depth.)
///
/// # Safety
/// Needs AVX512F, AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
pub(super) unsafe fn softmax_f16_zmm(row: &mut [f32], max: f32) {
    let n = row.len();
    let ptr = row.as_mut_ptr();
    let m = _mm512_set1_ps(max);
    let mut sum = 0.0f64;
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n.
        let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(ptr.add(i)), m));
        _mm512_storeu_ps(ptr.add(i), e);
        let (lo, hi) = sum8_halves(e);
        sum += lo;
        sum += hi;
        i += 16;
    }
    if i < n {
        // The rest as one masked vector, the lanes past the row -inf (exp 0): its halves'
        // sums added as the 8-lane kernel adds the rest's eights, and an empty high half adds
        // +0.0 to a sum that is not -0.0: the same bits.
        let k = tail_mask(n - i);
        let e = exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), k, ptr.add(i)), m));
        _mm512_mask_storeu_ps(ptr.add(i), k, e);
        let (lo, hi) = sum8_halves(e);
        sum += lo;
        sum += hi;
    }
    #[allow(clippy::cast_possible_truncation)]
    let inv = (1.0 / sum) as f32;
    let v = _mm512_set1_ps(inv);
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n.
        let y = _mm512_mul_ps(_mm512_loadu_ps(ptr.add(i)), v);
        _mm512_storeu_ps(ptr.add(i), _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(y)));
        i += 16;
    }
    if i < n {
        let k = tail_mask(n - i);
        let y = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, ptr.add(i)), v);
        _mm512_mask_storeu_ps(ptr.add(i), k, _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(y)));
    }
}

/// # Safety
/// Needs AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn softmax_f16(row: &mut [f32], max: f32) {
    let sum = softmax_exp_rest(row, max, 0.0);
    #[allow(clippy::cast_possible_truncation)]
    let inv = (1.0 / sum) as f32;
    softmax_scale_rest(row, inv);
}

/// The exponentials of `row` (less `max`) in place, eight at a time, added to `sum` as
/// [`super::sum8`] adds each eight; returns the sum.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn softmax_exp_rest(row: &mut [f32], max: f32, mut sum: f64) -> f64 {
    let m = _mm256_set1_ps(max);
    /// Eight exponentials at `p`, stored back and summed (as [`super::sum8`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn exp_sum(p: *mut f32, m: __m256) -> f64 {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p), m));
        _mm256_storeu_ps(p, e);
        let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(e));
        let hi = _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1));
        let s2 = _mm256_add_pd(lo, hi);
        let s1 = _mm_add_pd(_mm256_castpd256_pd128(s2), _mm256_extractf128_pd(s2, 1));
        _mm_cvtsd_f64(_mm_add_sd(s1, _mm_unpackhi_pd(s1, s1)))
    }
    let n = row.len();
    let ptr = row.as_mut_ptr();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n.
        sum += exp_sum(ptr.add(i), m);
        i += 8;
    }
    if i < n {
        // The short last part through a padded copy (the padding's exp is 0).
        let mut buf = [f32::NEG_INFINITY; 8];
        buf[..n - i].copy_from_slice(&row[i..]);
        sum += exp_sum(buf.as_mut_ptr(), m);
        row[i..].copy_from_slice(&buf[..n - i]);
    }
    sum
}

/// `row` times `inv`, rounded through f16, eight at a time.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn softmax_scale_rest(row: &mut [f32], inv: f32) {
    let n = row.len();
    let ptr = row.as_mut_ptr();
    let v = _mm256_set1_ps(inv);
    let mut i = 0;
    while i + 8 <= n {
        // Round through f16 and back, 8 at a time.
        // SAFETY: i + 8 <= n.
        let y = _mm256_mul_ps(_mm256_loadu_ps(ptr.add(i)), v);
        _mm256_storeu_ps(ptr.add(i), _mm256_cvtph_ps(_mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT)));
        i += 8;
    }
    for x in &mut row[i..] {
        *x = f16::from_f32(*x * inv).to_f32();
    }
}

/// `acc + madd(p, s)`: i16 pairs times i16 scales, summed in pairs into the i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn madd_add(acc: __m256i, p: __m256i, s: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(p, s))
}

/// The same in one VNNI instruction.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw")]
unsafe fn madd_dpwssd(acc: __m256i, p: __m256i, s: __m256i) -> __m256i {
    _mm256_dpwssd_epi32(acc, p, s)
}

/// Eight weights of a float row (F32, F16 or BF16) as f32s: exact conversions, so a row gives
/// the values `quant::dequantize_row` gives.
trait FloatLoad {
    /// # Safety
    /// AVX2/F16C present; elements `8 * c .. 8 * c + 8` inside the row.
    unsafe fn at(p: *const u8, c: usize) -> __m256;
    /// The type, for the tail's elements ([`super::float_elem`]).
    const TY: crate::quant::GgmlType;
}
struct F32W;
struct F16W;
struct Bf16W;
impl FloatLoad for F32W {
    const TY: crate::quant::GgmlType = crate::quant::GgmlType::F32;
    #[inline(always)]
    unsafe fn at(p: *const u8, c: usize) -> __m256 {
        _mm256_loadu_ps(p.add(32 * c).cast())
    }
}
impl FloatLoad for F16W {
    const TY: crate::quant::GgmlType = crate::quant::GgmlType::F16;
    #[inline(always)]
    unsafe fn at(p: *const u8, c: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * c).cast()))
    }
}
impl FloatLoad for Bf16W {
    const TY: crate::quant::GgmlType = crate::quant::GgmlType::BF16;
    #[inline(always)]
    unsafe fn at(p: *const u8, c: usize) -> __m256 {
        // bf16 is the top half of an f32: widen and shift.
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(16 * c).cast())), 16))
    }
}

/// A float weight row (F32/F16/BF16 by `ty`) · f32 activation row `t` (`x` holds rows of
/// `cols`): [`super::dot_lanes`]'s sum — element `j` fused into lane `j % 8` in order, the
/// lanes added as a tree — so the result is bit for bit the scalar reference's.
///
/// # Safety
/// Needs AVX2/FMA/F16C; `row` holds `cols` elements of `ty`; row `t` exists in `x`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_float(ty: GgmlType, row: &[u8], x: &[f32], cols: usize, t: usize) -> f32 {
    match ty {
        GgmlType::F32 => dot_float_as::<F32W>(row, x, cols, t),
        GgmlType::F16 => dot_float_as::<F16W>(row, x, cols, t),
        _ => dot_float_as::<Bf16W>(row, x, cols, t),
    }
}

/// `R` (1 to 3) float weight rows · 4 f32 activation rows from `t0`: `R` x 4 sums at once (at
/// 3 rows, 12 accumulators, 3 weight vectors and 1 activation vector fill the 16 registers),
/// each weight vector used for 4 tokens and each activation vector for `R` rows, so a step
/// loads 7 vectors for 12 fused multiply-adds. Every sum is [`super::dot_lanes`]'s, as in
/// [`dot_float`]: `out[i][t]` is row `i` · token `t0 + t`.
///
/// # Safety
/// Needs AVX2/FMA/F16C; each row holds `cols` elements of `ty`; rows `t0..t0 + 4` exist in `x`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_float_rx4<const R: usize>(ty: GgmlType, rows: [&[u8]; R], x: &[f32], cols: usize, t0: usize) -> [[f32; 4]; R] {
    match ty {
        GgmlType::F32 => dot_float_rx4_as::<F32W, R>(rows, x, cols, t0),
        GgmlType::F16 => dot_float_rx4_as::<F16W, R>(rows, x, cols, t0),
        _ => dot_float_rx4_as::<Bf16W, R>(rows, x, cols, t0),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // t and i index the accumulators and the activations
unsafe fn dot_float_rx4_as<L: FloatLoad, const R: usize>(rows: [&[u8]; R], x: &[f32], cols: usize, t0: usize) -> [[f32; 4]; R] {
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let n8 = cols / 8;
    let xp = x.as_ptr().add(t0 * cols);
    for c in 0..n8 {
        let w: [__m256; R] = std::array::from_fn(|i| L::at(rows[i].as_ptr(), c));
        for t in 0..4 {
            let xv = _mm256_loadu_ps(xp.add(t * cols + 8 * c));
            for i in 0..R {
                acc[i][t] = _mm256_fmadd_ps(w[i], xv, acc[i][t]);
            }
        }
    }
    if cols == 8 * n8 {
        // No tail: each row's four sums reduced together, in registers.
        return std::array::from_fn(|i| lanes_tree_x4(acc[i]));
    }
    std::array::from_fn(|i| std::array::from_fn(|t| finish_lanes::<L>(acc[i][t], rows[i], x, cols, n8, t0 + t)))
}

/// Four 8-lane sums at once, each added as [`super::dot_lanes`]'s tree: `h = lanes 0-3 +
/// lanes 4-7` (its `l + (l + 4)` pairs), then a 4x4 transpose so that
/// `(h0 + h2) + (h1 + h3)` is one vector operation for the four (a store and seven scalar
/// additions each was a tenth of an F16 prefill).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lanes_tree_x4(a: [__m256; 4]) -> [f32; 4] {
    let h = a.map(|v| _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
    let lo01 = _mm_unpacklo_ps(h[0], h[1]); // h0[0] h1[0] h0[1] h1[1]
    let lo23 = _mm_unpacklo_ps(h[2], h[3]);
    let hi01 = _mm_unpackhi_ps(h[0], h[1]); // h0[2] h1[2] h0[3] h1[3]
    let hi23 = _mm_unpackhi_ps(h[2], h[3]);
    let c0 = _mm_movelh_ps(lo01, lo23); // lane 0 of h0..h3
    let c1 = _mm_movehl_ps(lo23, lo01); // lane 1
    let c2 = _mm_movelh_ps(hi01, hi23); // lane 2
    let c3 = _mm_movehl_ps(hi23, hi01); // lane 3
    let r = _mm_add_ps(_mm_add_ps(c0, c2), _mm_add_ps(c1, c3));
    let mut out = [0.0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), r);
    out
}

/// A float dot product's 8 lanes after the whole 8-wide steps: the tail elements fused into
/// their lanes, then the lanes added as [`super::dot_lanes`]'s tree.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn finish_lanes<L: FloatLoad>(acc: __m256, row: &[u8], x: &[f32], cols: usize, n8: usize, t: usize) -> f32 {
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    for (j, lane) in lanes.iter_mut().enumerate().take(cols - 8 * n8) {
        let i = 8 * n8 + j;
        *lane = super::float_elem(L::TY, row, i).mul_add(x[t * cols + i], *lane);
    }
    let s: [f32; 4] = std::array::from_fn(|l| lanes[l] + lanes[l + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_float_as<L: FloatLoad>(row: &[u8], x: &[f32], cols: usize, t: usize) -> f32 {
    // Two accumulators taking alternate 8-wide steps would change the order; one chain keeps
    // the reference's. (Decode runs many rows at once, so the latency overlaps across rows.)
    let mut acc = _mm256_setzero_ps();
    let n8 = cols / 8;
    for c in 0..n8 {
        acc = _mm256_fmadd_ps(L::at(row.as_ptr(), c), _mm256_loadu_ps(x.as_ptr().add(t * cols + 8 * c)), acc);
    }
    finish_lanes::<L>(acc, row, x, cols, n8, t)
}

/// `kv::decode_rows_to_int8` in AVX2, 32 channels at a time (16 bytes of 4-bit codes or 8 of
/// 2-bit ones): the codes unpacked in channel order, widened to i16, `lo + code * step`, then
/// packed back to bytes with saturation and clamped to -127. Integer arithmetic: the same
/// bytes as the portable loop (tested).
///
/// # Safety
/// The CPU must have AVX2; `hd` is a multiple of 32 and the block holds `n` rows.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn decode_rows_to_int8<const BITS: usize>(blk: &[u8], t_cap: usize, hd: usize, n: usize, out: &mut [u8]) {
    let params = &blk[t_cap * 2..t_cap * 2 + hd * 2];
    let (mut lo, mut step) = ([0i16; crate::kv::MAX_FAST_HD], [0i16; crate::kv::MAX_FAST_HD]);
    for c in 0..hd {
        lo[c] = i16::from(params[2 * c] as i8);
        step[c] = i16::from(params[2 * c + 1]);
    }
    out[..n * 2].copy_from_slice(&blk[..n * 2]);
    let data = &blk[t_cap * 2 + hd * 2..];
    let row = hd * BITS / 8;
    assert!(hd.is_multiple_of(32) && data.len() >= n * row && out.len() >= t_cap * 2 + n * hd);
    let low = _mm_set1_epi8(if BITS == 4 { 0x0F } else { 0x03 });
    let floor = _mm256_set1_epi8(-127);
    // SAFETY: every pointer below stays inside `data`, `out`, `lo` and `step`, as the assert
    // above bounds them (row t's 16- or 8-byte groups end at (t + 1) * row; its 32-channel
    // stores at t_cap * 2 + (t + 1) * hd; a parameter group at hd <= crate::kv::MAX_FAST_HD).
    unsafe {
        for t in 0..n {
            let src = data.as_ptr().add(t * row);
            let dst = out.as_mut_ptr().add(t_cap * 2 + t * hd);
            for g in 0..hd / 32 {
                // Channels 32g..32g+16 and 32g+16..32g+32 as bytes in channel order.
                let (c0, c1) = if BITS == 4 {
                    let b = _mm_loadu_si128(src.add(g * 16).cast());
                    let l = _mm_and_si128(b, low);
                    let h = _mm_and_si128(_mm_srli_epi16(b, 4), low);
                    (_mm_unpacklo_epi8(l, h), _mm_unpackhi_epi8(l, h))
                } else {
                    let b = _mm_loadl_epi64(src.add(g * 8).cast());
                    let k0 = _mm_and_si128(b, low);
                    let k1 = _mm_and_si128(_mm_srli_epi16(b, 2), low);
                    let k2 = _mm_and_si128(_mm_srli_epi16(b, 4), low);
                    let k3 = _mm_and_si128(_mm_srli_epi16(b, 6), low);
                    let (p01, p23) = (_mm_unpacklo_epi8(k0, k1), _mm_unpacklo_epi8(k2, k3));
                    (_mm_unpacklo_epi16(p01, p23), _mm_unpackhi_epi16(p01, p23))
                };
                let at = g * 32;
                let v = |c: __m128i, off: usize| {
                    let code = _mm256_cvtepu8_epi16(c);
                    let s = _mm256_loadu_si256(step.as_ptr().add(at + off).cast());
                    let l = _mm256_loadu_si256(lo.as_ptr().add(at + off).cast());
                    _mm256_add_epi16(l, _mm256_mullo_epi16(code, s))
                };
                // packs works per 128-bit lane ([a0..7 b0..7 | a8..15 b8..15]): reorder quarters.
                let packed = _mm256_permute4x64_epi64(_mm256_packs_epi16(v(c0, 0), v(c1, 16)), 0b11_01_10_00);
                _mm256_storeu_si256(dst.add(at).cast(), _mm256_max_epi8(packed, floor));
            }
        }
    }
}

/// [`super::int8_codes`] eight values at a time: the scalar code's clamp, NaN to 0, truncation,
/// and a step away from zero where the cut-off part is at least a half (all exact in f32 within
/// ±127), so the same bytes.
///
/// # Safety
/// Needs AVX2; `x` and `out` of equal length.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn int8_codes(x: &[f32], inv: f32, out: &mut [u8]) {
    let n = x.len().min(out.len());
    let (v_inv, lo, hi) = (_mm256_set1_ps(inv), _mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let (half, neg_half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(-0.5), _mm256_set1_ps(1.0));
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n.
        let y = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i)), v_inv);
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(y, y);
        // `max` takes its second operand for a NaN; the NaN lanes are zeroed just after.
        let y = _mm256_andnot_ps(nan, _mm256_min_ps(_mm256_max_ps(y, lo), hi));
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
        let f = _mm256_sub_ps(y, t);
        let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(f, half), one);
        let down = _mm256_and_ps(_mm256_cmp_ps::<_CMP_LE_OQ>(f, neg_half), one);
        let q = _mm256_cvtps_epi32(_mm256_sub_ps(_mm256_add_ps(t, up), down));
        let w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
        _mm_storel_epi64(out.as_mut_ptr().add(i).cast(), _mm_packs_epi16(w, w));
        i += 8;
    }
    crate::kv::int8_codes_ref(&x[i..n], inv, &mut out[i..n]);
}

/// The wrapping sum of `lines` whole lines at `p`, a 512-bit load each, in four sums.
///
/// # Safety
/// AVX-512F; `p` valid for `lines * 8` words.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn wide_zmm(p: *const u64, lines: usize, ask: &dyn Fn(*const u64)) -> u64 {
    let mut acc = [_mm512_setzero_si512(); 4];
    for l in 0..lines {
        let at = p.add(8 * l);
        ask(at);
        acc[l % 4] = _mm512_add_epi64(acc[l % 4], _mm512_loadu_si512(at.cast()));
    }
    let s = _mm512_add_epi64(_mm512_add_epi64(acc[0], acc[1]), _mm512_add_epi64(acc[2], acc[3]));
    _mm512_reduce_add_epi64(s).cast_unsigned()
}

/// [`wide_zmm`] with two 256-bit loads a line.
///
/// # Safety
/// AVX2; `p` valid for `lines * 8` words.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn wide_ymm(p: *const u64, lines: usize, ask: &dyn Fn(*const u64)) -> u64 {
    let mut acc = [_mm256_setzero_si256(); 4];
    for l in 0..lines {
        let at = p.add(8 * l);
        ask(at);
        acc[2 * (l % 2)] = _mm256_add_epi64(acc[2 * (l % 2)], _mm256_loadu_si256(at.cast()));
        acc[2 * (l % 2) + 1] = _mm256_add_epi64(acc[2 * (l % 2) + 1], _mm256_loadu_si256(at.add(4).cast()));
    }
    let s = _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]), _mm256_add_epi64(acc[2], acc[3]));
    let mut out = [0u64; 4];
    _mm256_storeu_si256(out.as_mut_ptr().cast(), s);
    out.iter().fold(0, |a, &b| a.wrapping_add(b))
}

//! Would Intel AMX make a decode step of 8 contexts cheaper? A Q4_1-shaped product (1536 rows
//! of 576, the default model's gate or up matrix) against 8 tokens, from L2, on one thread,
//! three ways: the VNNI pair tile's arithmetic (two groups of 8 rows a 512-bit vector, as
//! `kernels::avx2::pair_tile`), the same with each block's integer sums made by an AMX tile
//! product (`tdpbssd`, 8 tokens x 32 codes against 32 codes x 16 rows, two blocks in flight),
//! and that AMX version with its tile instructions left out (what the unpacking and the float
//! work around them cost by themselves). The tile results are checked bit for bit against the
//! VNNI ones first.
//!
//! Why tiles cannot take a block-quantized product's work: each 32-code block has its own
//! scales, so a tile product covers one block's 32 columns, and the float work a block and
//! token (convert, scale, two fused multiply-adds, in the reference's order) stays on the
//! vector units whatever makes the integer sums. On the Intel Xeon guest of 5 Dec 2026 (Linux
//! 6.18; the tiles run once the process asks for them, `arch_prctl(ARCH_REQ_XCOMP_PERM)`):
//! VNNI 35.3-36.1 us, AMX 36.5-37.9 us, AMX without its tile instructions 13.2-14.8 us (three
//! runs, medians of 41 rounds of 20 each): the tile loads, product and store of a block cost
//! more than the 64 `vpdpbusd` they replace, and the float work that stays is most of the
//! VNNI tile's time not spent in them (docs/notes/engine.md, "AMX and the 8-context step").
//!
//! `cargo run --release -p engine --example amx_q4_block`
//!
//! A benchmark, not a test: it asserts only that the two products agree.

#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::hint::black_box;
    use std::time::Instant;

    /// Tokens, blocks a row (576 columns), 16-row group pairs (1536 rows).
    const T: usize = 8;
    const NB: usize = 18;
    const G: usize = 96;

    #[repr(C, align(64))]
    struct Aligned<const N: usize>([u8; N]);

    /// A product's operands: nibbles as the pair tile reads them (per pair and block, four
    /// 64-byte vectors: 16 rows x 4 bytes, low nibbles columns 4k.., high ones 16 + 4k..), the
    /// rows' scales and minima per block, the tokens' codes, scales and code-sum terms.
    struct Operands {
        w: Vec<u8>,
        d: Vec<f32>,
        m: Vec<f32>,
        xq: Vec<i8>,
        xd: Vec<f32>,
        xs: Vec<f32>,
    }

    /// The pair tile's Q4_1 arm, lane for lane.
    ///
    /// # Safety
    /// Needs AVX512F, -BW and -VNNI; `out` holds `T * G * 16` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn vnni(o: &Operands, out: &mut [f32]) {
        // SAFETY: the weights hold G * NB * 4 vectors of 64 bytes and the codes T * NB blocks of 32, which the loops stay within; the stores are of checked 16-float ranges.
        unsafe {
            let mask = _mm512_set1_epi8(0x0F);
            for g in 0..G {
                let mut acc = [_mm512_setzero_ps(); T];
                for b in 0..NB {
                    let mut p = [_mm512_setzero_si512(); T];
                    for k in 0..4 {
                        let wv = _mm512_loadu_si512(o.w.as_ptr().add(((g * NB + b) * 4 + k) * 64).cast());
                        let lo = _mm512_and_si512(wv, mask);
                        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(wv), mask);
                        for (t, pt) in p.iter_mut().enumerate() {
                            let x = o.xq.as_ptr().add((t * NB + b) * 32);
                            let x4 = |c: usize| _mm512_set1_epi32(x.add(c).cast::<i32>().read_unaligned());
                            *pt = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(*pt, lo, x4(4 * k)), hi, x4(16 + 4 * k));
                        }
                    }
                    epilogue(o, g, b, &p, &mut acc);
                }
                for (t, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(out[t * G * 16 + g * 16..][..16].as_mut_ptr(), *a);
                }
            }
        }
    }

    /// A block's float work, as the pair tile's: per token, convert, scale, two fused adds.
    ///
    /// # Safety
    /// Needs AVX512F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn epilogue(o: &Operands, g: usize, b: usize, p: &[__m512i; T], acc: &mut [__m512; T]) {
        // SAFETY: loads of checked 16-float ranges of the slices.
        unsafe {
            let dv = _mm512_loadu_ps(o.d[(g * NB + b) * 16..][..16].as_ptr());
            let mv = _mm512_loadu_ps(o.m[(g * NB + b) * 16..][..16].as_ptr());
            for t in 0..T {
                let pf = _mm512_cvtepi32_ps(p[t]);
                acc[t] = _mm512_fmadd_ps(pf, _mm512_mul_ps(dv, _mm512_set1_ps(o.xd[t * NB + b])), acc[t]);
                acc[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(o.xs[t * NB + b]), acc[t]);
            }
        }
    }

    /// The same product with each block's sums from a tile product: the nibbles unpacked into
    /// the B tile's layout (which is the pair tile's: 4 bytes of a row a 32-bit lane), the
    /// tokens' codes read as the A tile in place, two blocks' tiles in flight.
    ///
    /// # Safety
    /// As [`vnni`], and the tile configuration of [`run`] loaded on this thread.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn tiles(o: &Operands, out: &mut [f32], with_tiles: bool) {
        // SAFETY: loads as in `vnni`; stores and loads of the aligned buffers' 64-byte rows.
        unsafe {
            let mask = _mm512_set1_epi8(0x0F);
            let mut bbuf = Aligned::<1024>([0; 1024]);
            let mut cbuf = Aligned::<1024>([0; 1024]);
            for g in 0..G {
                let mut acc = [_mm512_setzero_ps(); T];
                for b2 in (0..NB).step_by(2) {
                    for h in 0..2 {
                        for k in 0..4 {
                            let wv = _mm512_loadu_si512(o.w.as_ptr().add(((g * NB + b2 + h) * 4 + k) * 64).cast());
                            let lo = _mm512_and_si512(wv, mask);
                            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(wv), mask);
                            _mm512_store_si512(bbuf.0[h * 512 + 64 * k..].as_mut_ptr().cast(), lo);
                            _mm512_store_si512(bbuf.0[h * 512 + 64 * (4 + k)..].as_mut_ptr().cast(), hi);
                        }
                    }
                    if with_tiles {
                        let (bp, cp, xp) = (bbuf.0.as_ptr(), cbuf.0.as_mut_ptr(), o.xq[b2 * 32..].as_ptr());
                        // SAFETY: the configuration has tiles 0-1 (C) 8 rows of 64 bytes, 2-3 (A) 8
                        // of 32, 4-5 (B) 8 of 64: every load reads 8 rows of the buffers or of the
                        // tokens' codes (stride NB * 32, 8 tokens, blocks b2 and b2 + 1 < NB), every
                        // store writes 8 rows of 64 bytes into `cbuf`'s halves.
                        asm!(
                            "tileloadd tmm4, [{b} + {s64}*1]",
                            "tileloadd tmm5, [{b} + {s64}*1 + 512]",
                            "tileloadd tmm2, [{a} + {sa}*1]",
                            "tileloadd tmm3, [{a} + {sa}*1 + 32]",
                            "tilezero tmm0",
                            "tilezero tmm1",
                            "tdpbssd tmm0, tmm2, tmm4",
                            "tdpbssd tmm1, tmm3, tmm5",
                            "tilestored [{c} + {s64}*1], tmm0",
                            "tilestored [{c} + {s64}*1 + 512], tmm1",
                            b = in(reg) bp, a = in(reg) xp, c = in(reg) cp, s64 = in(reg) 64usize, sa = in(reg) NB * 32,
                        );
                    }
                    for h in 0..2 {
                        let p: [__m512i; T] = std::array::from_fn(|t| _mm512_load_si512(cbuf.0[h * 512 + 64 * t..].as_ptr().cast()));
                        epilogue(o, g, b2 + h, &p, &mut acc);
                    }
                }
                for (t, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(out[t * G * 16 + g * 16..][..16].as_mut_ptr(), *a);
                }
            }
        }
    }

    /// Median microseconds of 41 rounds of 20 calls.
    fn time(mut f: impl FnMut()) -> f64 {
        let mut v: Vec<f64> = (0..41)
            .map(|_| {
                let t0 = Instant::now();
                for _ in 0..20 {
                    f();
                }
                t0.elapsed().as_secs_f64() / 20.0 * 1e6
            })
            .collect();
        v.sort_by(f64::total_cmp);
        v[20]
    }

    pub fn run() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vnni")) {
            println!("no AVX512-VNNI here: nothing to compare");
            return;
        }
        let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        if !flags.split_whitespace().any(|f| f == "amx_int8") {
            println!("no AMX here (amx_int8 not in /proc/cpuinfo)");
            return;
        }
        // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) only sets a permission.
        let granted = unsafe { libc::syscall(libc::SYS_arch_prctl, 0x1023, 18) } == 0;
        if !granted {
            println!("the kernel does not grant the tile state: {}", std::io::Error::last_os_error());
            return;
        }
        let mut cfg = Aligned::<64>([0; 64]);
        cfg.0[0] = 1;
        for (i, rows, colsb) in [(0, 8u8, 64u16), (1, 8, 64), (2, 8, 32), (3, 8, 32), (4, 8, 64), (5, 8, 64)] {
            cfg.0[16 + 2 * i..18 + 2 * i].copy_from_slice(&colsb.to_le_bytes());
            cfg.0[48 + i] = rows;
        }
        // SAFETY: a valid palette-1 configuration, 64 bytes, with the permission granted.
        unsafe { asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr()) };
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut rnd = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut small = |n: usize, scale: f32| -> Vec<f32> { (0..n).map(|_| (rnd() % 1000) as f32 * scale).collect() };
        let (d, m, xd, xs) = (small(G * NB * 16, 1e-4), small(G * NB * 16, 1e-4), small(T * NB, 1e-3), small(T * NB, 1e-3));
        let o = Operands {
            w: (0..G * NB * 256).map(|_| rnd() as u8).collect(),
            d,
            m,
            xq: (0..T * NB * 32).map(|_| rnd() as i8).collect(),
            xd,
            xs,
        };
        let (mut a, mut b) = (vec![0f32; T * G * 16], vec![0f32; T * G * 16]);
        // SAFETY: the features were detected above and the configuration loaded; the outputs
        // hold T * G * 16 values.
        unsafe {
            vnni(&o, &mut a);
            tiles(&o, &mut b, true);
        }
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "the tile product's bits differ from the VNNI one's");
        // SAFETY: as above (each closure runs on this thread, whose tiles are configured).
        let (tv, ta, tn) = unsafe {
            (
                time(|| vnni(black_box(&o), &mut a)),
                time(|| tiles(black_box(&o), &mut b, true)),
                time(|| tiles(black_box(&o), &mut b, false)),
            )
        };
        // SAFETY: releases this thread's tile state.
        unsafe { asm!("tilerelease") };
        println!("Q4_1 product 1536 x 576 against {T} tokens, from L2, one thread (us, medians of 41 rounds of 20; the same bits):");
        println!("  VNNI pair tile {tv:.1}   AMX tile sums {ta:.1}   AMX without its tile instructions {tn:.1}");
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    amx::run();
    #[cfg(not(target_arch = "x86_64"))]
    println!("AMX is x86-64's");
}

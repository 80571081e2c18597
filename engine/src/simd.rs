//! Which instruction sets the CPU offers, detected once. Every fast kernel (in [`crate::kernels`]
//! and the format modules below it) asks here before it runs; nothing here knows a format.
//!
//! Every vector kernel computes its scalar reference's float operations in the same order, so
//! the choice changes speed, never results: `LLMS_SIMD=scalar` (or [`use_set`]) runs the
//! references, and a model gives the same logits, bit for bit, on x86 and ARM.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::LazyLock;

/// The vector extensions in use, after `LLMS_SIMD` has had its say.
#[derive(Debug, Clone, Copy, Default)]
#[allow(clippy::struct_excessive_bools)]
struct Isa {
    avx2: bool,
    vnni: bool,
    /// 512-bit vectors (AVX512F) beside VNNI: the VNNI set's pair tiles.
    zmm: bool,
    neon: bool,
    dotprod: bool,
}

static ISA: LazyLock<Isa> = LazyLock::new(|| {
    // `LLMS_SIMD=scalar` turns the vector kernels off, so the scalar references can be run and
    // compared (and an ISA's kernels tested both ways) on any machine; `avx2` / `neon` keep
    // the base vector kernels without VNNI / the dot-product extension (to compare the two).
    let want = std::env::var("LLMS_SIMD").unwrap_or_default();
    if want == "scalar" {
        return Isa::default();
    }
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let avx2 = has!("avx2") && has!("fma") && has!("f16c");
        let vnni = avx2 && want != "avx2" && has!("avx512vnni") && has!("avx512vl") && has!("avx512bw");
        let zmm = vnni && has!("avx512f");
        Isa { avx2, vnni, zmm, ..Isa::default() }
    }
    #[cfg(target_arch = "aarch64")]
    {
        use std::arch::is_aarch64_feature_detected as has;
        // NEON is part of every AArch64 CPU; the half-precision conversions the kernels use
        // are base NEON too. `sdot` (the dot-product extension) is optional.
        let neon = has!("neon");
        let dotprod = neon && want != "neon" && has!("dotprod");
        Isa { neon, dotprod, ..Isa::default() }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        Isa::default()
    }
});

/// A set of kernels: the scalar references, an ISA's base vector kernels, or those with its
/// optional dot-product extension (VNNI on x86_64, `sdot` on aarch64).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelSet {
    Scalar,
    Avx2,
    Vnni,
    Neon,
    NeonDot,
}

impl KernelSet {
    pub const ALL: [Self; 5] = [Self::Scalar, Self::Avx2, Self::Vnni, Self::Neon, Self::NeonDot];

    /// Its name, as `simd_name` reports it and `LLMS_KERNEL_SETS` asks for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::Vnni => "avx2+vnni",
            Self::Neon => "neon",
            Self::NeonDot => "neon+dotprod",
        }
    }

    /// What it caps the detected ISA to: 0 none, 1 the base vectors, 2 everything.
    fn cap(self) -> u8 {
        match self {
            Self::Scalar => 0,
            Self::Avx2 | Self::Neon => 1,
            Self::Vnni | Self::NeonDot => 2,
        }
    }
}

/// The sets this CPU runs (after `LLMS_SIMD`), the scalar references first.
pub fn offered() -> Vec<KernelSet> {
    let i = *ISA;
    let mut v = vec![KernelSet::Scalar];
    if i.avx2 {
        v.push(KernelSet::Avx2);
    }
    if i.vnni {
        v.push(KernelSet::Vnni);
    }
    if i.neon {
        v.push(KernelSet::Neon);
    }
    if i.dotprod {
        v.push(KernelSet::NeonDot);
    }
    v
}

/// The cap [`use_set`] put on the detected ISA (2: none).
static CAP: AtomicU8 = AtomicU8::new(2);

/// Runs `set`'s kernels for the whole process (one of [`offered`]), for comparing the kernel
/// sets in one run (tests, benchmarks). Not for use while other threads compute.
pub fn use_set(set: KernelSet) {
    assert!(offered().contains(&set), "kernel set {} is not offered here", set.name());
    CAP.store(set.cap(), Ordering::Relaxed);
}

#[inline]
fn isa() -> Isa {
    match CAP.load(Ordering::Relaxed) {
        0 => Isa::default(),
        1 => Isa { vnni: false, zmm: false, dotprod: false, ..*ISA },
        _ => *ISA,
    }
}

/// Whether the CPU has AVX2, FMA and F16C (checked once).
#[inline]
pub fn has_avx2() -> bool {
    isa().avx2
}

/// Whether the CPU also has VNNI's byte dot product on 256-bit vectors (AVX512-VNNI + VL), with
/// AVX512-BW's byte masks (every CPU with the first two has it; the Q5 kernels use it).
#[inline]
pub fn has_vnni() -> bool {
    isa().vnni
}

/// Whether the VNNI kernels may use 512-bit vectors (AVX512F too: every CPU with VNNI has it,
/// but the OS must enable the 512-bit state, which the detection checks).
#[inline]
pub fn has_zmm() -> bool {
    isa().zmm
}

/// Whether the NEON kernels run (every AArch64 CPU, unless turned off).
#[inline]
pub fn has_neon() -> bool {
    isa().neon
}

/// Whether the CPU also has the dot-product extension (`sdot`, Armv8.2+ optional, v8.4 on).
#[inline]
pub fn has_dotprod() -> bool {
    isa().dotprod
}

/// Which vector kernels are in use (reported by `llms bench` and `llms doctor`).
pub fn simd_name() -> &'static str {
    let i = isa();
    match (i.avx2, i.vnni, i.neon, i.dotprod) {
        (true, true, ..) => "avx2+vnni",
        (true, false, ..) => "avx2",
        (_, _, true, true) => "neon+dotprod",
        (_, _, true, false) => "neon",
        _ => "scalar",
    }
}

//! Which instruction sets the CPU offers, detected once. Every fast kernel (in [`crate::kernels`]
//! and the format modules below it) asks here before it runs; nothing here knows a format.

use std::sync::LazyLock;

static HAS_AVX2: LazyLock<bool> = LazyLock::new(|| {
    // `LLMS_SIMD=scalar` turns the vector kernels off, so the scalar references can be run and
    // compared (and an ISA's kernels tested both ways) on any machine.
    if std::env::var_os("LLMS_SIMD").is_some_and(|v| v == "scalar") {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
});

static HAS_VNNI: LazyLock<bool> = LazyLock::new(|| {
    // `LLMS_SIMD=avx2` keeps the AVX2 kernels without VNNI (to compare the two).
    if !*HAS_AVX2 || std::env::var_os("LLMS_SIMD").is_some_and(|v| v == "avx2") {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
});

/// Whether the CPU has AVX2, FMA and F16C (checked once).
#[inline]
pub fn has_avx2() -> bool {
    *HAS_AVX2
}

/// Whether the CPU also has VNNI's byte dot product on 256-bit vectors (AVX512-VNNI + VL).
#[inline]
pub fn has_vnni() -> bool {
    *HAS_VNNI
}

/// Which vector kernels are in use (reported by `llms bench`).
pub fn simd_name() -> &'static str {
    match (*HAS_AVX2, *HAS_VNNI) {
        (true, true) => "avx2+vnni",
        (true, false) => "avx2",
        _ => "scalar",
    }
}

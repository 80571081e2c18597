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

/// Whether the CPU has AVX2, FMA and F16C (checked once).
#[inline]
pub fn has_avx2() -> bool {
    *HAS_AVX2
}

/// Whether the AVX2+FMA+F16C kernels are in use (reported by `llms bench`).
pub fn simd_name() -> &'static str {
    if *HAS_AVX2 {
        "avx2"
    } else {
        "scalar"
    }
}

//! The kernel sets agree: the model computes the same logits, bit for bit, with the CPU's
//! vector kernels (AVX2, VNNI, NEON with or without `sdot`) as with the scalar references —
//! over f16 and int8 contexts, chunks lowered to every reduced level, prefill and decode. So a context
//! saved on one machine continues identically on another, whatever its instruction set
//! (`make test-arm64` checks x86_64 against aarch64 with the digest this test can write).

use std::sync::Arc;

use engine::kv::KvFormat;
use engine::model::SessionOptions;
use engine::{Logits, Model, Session, ThreadPool};
use llms_tests::{fixture, model_path};

/// Every logit the runs below produce, in order.
fn run(m: &Arc<Model>, pool: &Arc<ThreadPool>, toks: &[u32]) -> Vec<f32> {
    let mut all = Vec::new();
    for base in [KvFormat::F16, KvFormat::Int8] {
        let opts = SessionOptions { capacity: 128, chunk_tokens: 16, base, observe_attention: false, sliding_window: None };
        let mut s = Session::with_options(Arc::clone(m), Arc::clone(pool), opts);
        all.extend_from_slice(s.eval(&toks[..40], Logits::All).unwrap());
        if base == KvFormat::Int8 {
            s.kv.set_format(0, KvFormat::Q4).unwrap();
            s.kv.set_format(1, KvFormat::Q2).unwrap();
        }
        for &t in &toks[40..46] {
            all.extend_from_slice(s.eval(&[t], Logits::Last).unwrap());
        }
    }
    // Past one span of decoding attention (128 tokens), over every reduced level: the split
    // levels read in place, each span's share of the output added in order.
    let opts = SessionOptions { capacity: 160, chunk_tokens: 16, base: KvFormat::Int8, observe_attention: false, sliding_window: None };
    let mut s = Session::with_options(Arc::clone(m), Arc::clone(pool), opts);
    all.extend_from_slice(s.eval(&toks[46..176], Logits::Last).unwrap());
    let levels = [KvFormat::K4V4, KvFormat::K3V3, KvFormat::K2V2, KvFormat::Q4, KvFormat::Q2, KvFormat::Q4R, KvFormat::Q2R, KvFormat::K4V4];
    for (ch, f) in levels.into_iter().enumerate() {
        s.kv.set_format(ch, f).unwrap();
    }
    for &t in &toks[176..179] {
        all.extend_from_slice(s.eval(&[t], Logits::Last).unwrap());
    }
    all
}

/// Every kernel set the CPU offers gives the scalar references' logits. `LLMS_KERNEL_SETS`
/// (comma-separated names: avx2, avx2+vnni, neon, neon+dotprod) lists sets the run must cover:
/// one the CPU lacks is a skip, and under `LLMS_REQUIRE_KERNEL=1` a failure (`make test` asks
/// for avx2 on x86_64, `make test-arm64-ci` for neon and neon+dotprod under qemu).
#[test]
fn logits_are_the_same_bits_with_vector_and_scalar_kernels() {
    use engine::simd::{offered, use_set, KernelSet};
    let offered = offered();
    let asked = std::env::var("LLMS_KERNEL_SETS").unwrap_or_default();
    for name in asked.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let set = KernelSet::ALL.iter().find(|s| s.name() == name);
        assert!(set.is_some(), "LLMS_KERNEL_SETS: unknown kernel set {name:?}");
        let why = format!("this CPU (with LLMS_SIMD={:?}) offers {:?}", std::env::var("LLMS_SIMD").unwrap_or_default(), offered);
        llms_tests::require_kernel(&format!("kernel set {name}"), if offered.contains(set.unwrap()) { Ok(()) } else { Err(why) });
    }
    let m = Arc::new(Model::load(&model_path()).unwrap());
    let pool = Arc::new(ThreadPool::new(2));
    let text = std::fs::read_to_string(fixture("gpl-3.txt")).unwrap();
    let toks = m.tokenizer.encode(&text, false, false).unwrap()[..179].to_vec();
    // Process-wide: no other test in this binary computes meanwhile.
    use_set(KernelSet::Scalar);
    let scalar = run(&m, &pool, &toks);
    let mut vector = scalar.clone();
    for &set in &offered[1..] {
        use_set(set);
        assert_eq!(engine::simd::simd_name(), set.name());
        vector = run(&m, &pool, &toks);
        assert_eq!(vector.len(), scalar.len());
        let differ = vector.iter().zip(&scalar).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        let worst = vector.iter().zip(&scalar).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert_eq!(differ, 0, "{} vs scalar: {differ} of {} logits differ (by up to {worst})", set.name(), vector.len());
        eprintln!("{} and scalar kernels: {} logits, all the same bits", set.name(), vector.len());
    }
    // `make test-arm64` compares this digest of the run on x86_64 with the one under
    // emulated aarch64: the same bits across architectures too.
    if let Some(path) = std::env::var_os("LLMS_LOGITS_DIGEST") {
        let digest = vector.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| (h ^ u64::from(x.to_bits())).wrapping_mul(0x0100_0000_01b3));
        std::fs::write(path, format!("{} logits, FNV-1a {digest:016x}\n", vector.len())).unwrap();
    }
}

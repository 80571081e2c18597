//! Each architecture the engine runs, against llama.cpp on the same random-weight files
//! (`llms synth`; fixtures from tools/oracle/synth_fixtures.py, `make fixtures`): GQA ratios
//! 1-8, llama's and qwen2's RoPE modes, Llama 3's frequency factors, linear RoPE scaling,
//! Q/K/V biases, tied and separate outputs, f32/f16/q8_0/q4_0 and the q4_k_m and q5_k_m mixes.
//!
//! The files are rewritten here from the recorded shape and seed, and must hash to what
//! llama.cpp ran: the generator is deterministic, so a different hash means it changed and
//! the fixtures must be made again. Tolerances: the synthetic models' logits spread ~3 (a
//! real model's ~10) and both engines round activations the same way per type, so rounding
//! noise stays a few hundredths; a wrong RoPE mode, factor, bias or head grouping moves
//! logits by whole units and flips the top token (checked by breaking each on purpose).
#![allow(clippy::cast_possible_truncation)]

use std::sync::Arc;

use engine::{Logits, Model, Session, ThreadPool};
use llms_tests::{fixture, ids, model_path, sha256_file};
use serde_json::Value;
use tools::synth::{Shape, WType};

/// Largest allowed |ours - llama.cpp| over llama.cpp's top-10 logits of any prompt, by the
/// type of the matrices. Float weights: the two engines differ only in summation order (and
/// f16's activations, which llama.cpp rounds to f16); measured 0.0013-0.0021 (f32) and 0.013
/// (f16). Quantized weights: both round activations to 8 bits, so a last-bit difference
/// before a rounding flips a code now and then; measured 0.04-0.10 (q8_0, q4_0) and 0.17
/// (q4_k_m) on logits of magnitude ~10.
fn tolerance(ty: WType) -> f32 {
    match ty {
        WType::F32 => 0.01,
        WType::F16 => 0.05,
        WType::Q8_0 | WType::Q4_0 | WType::Q4KM | WType::Q5KM => 0.3,
    }
}

#[test]
fn every_architecture_matches_llama_cpp_on_random_weights() {
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(fixture("synth.json")).expect("read fixture")).expect("JSON");
    let cases = fx["cases"].as_array().expect("cases");
    assert!(cases.len() >= 8, "the fixture covers every architecture case");
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(ThreadPool::new(2));
    let mut report = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let shape: Shape = serde_json::from_value(case["shape"].clone()).unwrap();
        let ty: WType = serde_json::from_value(case["type"].clone()).unwrap();
        let path = dir.path().join(format!("{name}.gguf"));
        tools::synth::write(&shape, ty, case["seed"].as_u64().unwrap(), &model_path(), &path).unwrap();
        assert_eq!(
            sha256_file(&path),
            case["sha256"].as_str().unwrap(),
            "{name}: llms synth no longer writes the file llama.cpp ran (run `make fixtures`)"
        );
        let m = Arc::new(Model::load(&path).unwrap());
        let mut worst = 0.0f32;
        for p in case["prompts"].as_array().unwrap() {
            let prompt = p["prompt"].as_str().unwrap();
            let toks = ids(&p["tokens"]);
            assert_eq!(m.tokenizer.encode(prompt, false, true).unwrap(), toks, "{name}: tokens of {prompt:?}");
            let mut s = Session::new(Arc::clone(&m), Arc::clone(&pool), toks.len());
            let logits = s.eval(&toks, Logits::Last).unwrap();
            let top = p["top"].as_array().unwrap();
            let best = top[0]["id"].as_u64().unwrap() as u32;
            assert_eq!(engine::sampler::argmax(logits), best, "{name}: top-1 of {:?}...", prompt.chars().take(40).collect::<String>());
            for e in top {
                let (id, want) = (e["id"].as_u64().unwrap() as usize, e["logit"].as_f64().unwrap() as f32);
                let d = (logits[id] - want).abs();
                worst = worst.max(d);
                let short: String = prompt.chars().take(40).collect();
                assert!(d <= tolerance(ty), "{name}: {short:?}... token {id}: ours {} vs llama.cpp {want}", logits[id]);
            }
        }
        report.push(format!("{name} {worst:.4}"));
    }
    eprintln!("largest |Δlogit| per case: {}", report.join(", "));
}

/// A copy of the GGUF file at `src` with its metadata and tensors edited.
fn rewrite(
    src: &std::path::Path,
    dst: &std::path::Path,
    meta: impl Fn(&mut Vec<(String, engine::Value)>),
    tensor: impl Fn(&str, &mut Vec<u8>),
) {
    let f = engine::GgufFile::open(src).unwrap();
    let mut m: Vec<(String, engine::Value)> = f.header.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    meta(&mut m);
    let specs: Vec<engine::gguf::TensorSpec> =
        f.header.tensors.iter().map(|t| engine::gguf::TensorSpec { name: t.name.clone(), dims: t.dims.clone(), ty: t.ty }).collect();
    let mut w = engine::gguf::Writer::new(std::fs::File::create(dst).unwrap(), &m, &specs).unwrap();
    for t in &f.header.tensors {
        let mut bytes = f.tensor_data(t).to_vec();
        tensor(&t.name, &mut bytes);
        w.tensor(&bytes).unwrap();
    }
    w.finish().unwrap();
}

/// What the engine cannot run as llama.cpp would is refused with the reason, not run wrongly.
#[test]
fn architectures_and_rope_settings_it_cannot_run_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.gguf");
    let shape =
        Shape { layers: 1, dim: 64, heads: 2, kv_heads: 1, ffn: 64, llama3_rope: true, ..tools::synth::preset("llama3-8b").unwrap() };
    tools::synth::write(&shape, WType::F32, 1, &model_path(), &base).unwrap();
    Model::load(&base).expect("the unedited file loads");
    let set = |k: &'static str, v: engine::Value| {
        move |m: &mut Vec<(String, engine::Value)>| {
            m.retain(|(x, _)| x != k);
            m.push((k.to_string(), v.clone()));
        }
    };
    let keep = |_: &str, _: &mut Vec<u8>| {};
    type Edit<'a> = Box<dyn Fn(&std::path::Path) + 'a>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "phi3",
            Box::new(|p| rewrite(&base, p, set("general.architecture", engine::Value::String("phi3".into())), keep)),
            "architecture \"phi3\" is not supported",
        ),
        (
            "yarn",
            Box::new(|p| rewrite(&base, p, set("llama.rope.scaling.type", engine::Value::String("yarn".into())), keep)),
            "RoPE scaling \"yarn\" is not supported",
        ),
        (
            "nan factor",
            Box::new(|p| rewrite(&base, p, set("llama.rope.scaling.factor", engine::Value::F32(f32::NAN)), keep)),
            "llama.rope.scaling.factor",
        ),
        (
            "zero frequency factor",
            Box::new(|p| {
                rewrite(
                    &base,
                    p,
                    |_| {},
                    |name, b| {
                        if name == "rope_freqs.weight" {
                            b[4..8].copy_from_slice(&0f32.to_le_bytes());
                        }
                    },
                )
            }),
            "rope_freqs.weight: factor 0 is not a positive number",
        ),
    ];
    for (what, make, want) in cases {
        let p = dir.path().join("edited.gguf");
        make(&p);
        let err = Model::load(&p).map(|_| ()).expect_err(what).to_string();
        assert!(err.contains(want), "{what}: {err}");
    }
}

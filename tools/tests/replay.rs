//! Trace replay end to end: a short synthetic trace through the real service (in process, over
//! its socket) for every policy, under a budget that forces eviction.

use std::path::PathBuf;

use llms_tests::{fixture, model_path, require_kernel};
use llmsd::config::Config;
use llmsd::service::Local;
use tools::trace::{generate, GenParams, Pattern};

#[test]
fn a_short_trace_replays_under_every_policy() {
    if require_kernel("userfaultfd", uffd_handler::Pager::new()).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let p = GenParams {
        contexts: 6,
        apps: 3,
        calls: 14,
        pattern: Pattern::Markov,
        rate: 1.0,
        seed: 3,
        scale: 0.06,
        markov_decay: 0.5,
        corpus: vec![fixture("gpl-3.txt")],
        system_tokens: 0,
    };
    let (h, recs) = generate(&p).unwrap();
    let path = dir.path().join("trace.jsonl");
    tools::trace::write(&path, &h, &recs).unwrap();
    let (h, recs) = tools::trace::read(&path).unwrap();
    let mut outputs: Vec<Vec<String>> = Vec::new();
    for policy in ["llms", "vllm-sq", "vllm-s", "swap", "lmk"] {
        let state = dir.path().join(policy);
        let cfg = Config {
            model: model_path(),
            socket: state.join("s.sock"),
            state_dir: state.clone(),
            budget: "2MiB".into(),
            policy: policy.into(),
            levels: if policy == "llms" { vec!["int8".into(), "q4".into(), "q2".into()] } else { vec!["int8".into()] },
            ratio: if policy == "llms" { 0.5 } else { 1.0 },
            load_profile: false,
            pressure: false,
            threads: 2,
            ..Config::default()
        };
        let local = Local::start(cfg).unwrap();
        let results = tools::replay::replay(&local.socket, &h, &recs, &mut |_| {}).unwrap();
        local.stop().unwrap();
        assert_eq!(results.len(), recs.len());
        // The results serialize as JSON lines with every documented field.
        for r in &results {
            let v: serde_json::Value = serde_json::to_value(r).unwrap();
            for k in ["switch_ms", "queue_ms", "ttft_ms", "decode_tok_s", "resident_bytes", "faults", "pressure"] {
                assert!(v.get(k).is_some(), "{k}");
            }
            assert!(r.output_tokens > 0, "{policy}: call {} produced nothing", r.i);
            assert!(r.resident_bytes <= (2 << 20) + 64 * 200 * 1024);
        }
        let s = tools::replay::summarize(&results, 1.0);
        let back = s.read_chunks + s.recomputed_chunks;
        assert!(back > 0, "{policy}: the 2 MiB budget made contexts come back: {s:?}");
        if policy == "lmk" {
            assert_eq!(s.read_chunks, 0, "lmk recomputes killed contexts");
        } else {
            assert!(s.read_chunks > 0, "{policy} reads swapped chunks back");
        }
        outputs.push(results.into_iter().map(|r| r.output).collect());
        assert!(!PathBuf::from(&state).join("s.sock").exists());
    }
    // Uncompressed policies hold the same KV: the same greedy outputs.
    for (i, o) in outputs.iter().enumerate().skip(2) {
        assert_eq!(*o, outputs[1], "policy #{i} differs from vllm-sq");
    }
}

/// A trace whose contexts open with their app's system prompt: with prefix sharing the later
/// contexts of an app take the prompt's whole chunks (`cached_tokens`), without it none, and
/// with one KV level the answers are the same either way.
#[test]
fn system_prompts_are_shared_by_an_apps_contexts() {
    if require_kernel("userfaultfd", uffd_handler::Pager::new()).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let p = GenParams {
        contexts: 4,
        apps: 2,
        calls: 6,
        pattern: Pattern::Random,
        rate: 1.0,
        seed: 5,
        scale: 0.05,
        markov_decay: 0.5,
        corpus: vec![fixture("gpl-3.txt")],
        system_tokens: 80,
    };
    let (h, recs) = generate(&p).unwrap();
    let mut runs = Vec::new();
    for policy in ["llms", "llms-noshare"] {
        let state = dir.path().join(policy);
        let base = Config {
            model: model_path(),
            socket: state.join("s.sock"),
            state_dir: state.clone(),
            budget: "64MiB".into(),
            levels: vec!["int8".into()],
            ratio: 1.0,
            load_profile: false,
            pressure: false,
            threads: 2,
            ..Config::default()
        };
        let local = Local::start(tools::experiment::policy_config(&base, policy)).unwrap();
        let results = tools::replay::replay(&local.socket, &h, &recs, &mut |_| {}).unwrap();
        local.stop().unwrap();
        runs.push(results);
    }
    let cached = |rs: &[tools::replay::CallResult]| rs.iter().map(|r| r.cached_tokens).sum::<u32>();
    // Contexts 2 and 3 are their apps' second: each takes the whole chunks of its prompt's
    // system part (80 tokens of words and the turn markup: at least 3 chunks of 16).
    assert!(cached(&runs[0]) >= 2 * 48, "shared: {} tokens", cached(&runs[0]));
    assert!(runs[0].iter().take(2).all(|r| r.cached_tokens == 0), "an app's first context has nothing to take");
    assert_eq!(cached(&runs[1]), 0, "prefix_sharing = false takes nothing");
    let out = |rs: &[tools::replay::CallResult]| rs.iter().map(|r| r.output.clone()).collect::<Vec<_>>();
    assert_eq!(out(&runs[0]), out(&runs[1]), "the same answers with and without sharing");
}

#[test]
fn a_tiny_experiment_writes_its_table_and_plots() {
    if require_kernel("userfaultfd", uffd_handler::Pager::new()).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = tools::experiment::SwitchVsContexts {
        contexts: vec![2, 3],
        // llms at the base's ratio and at a fixed one (a second llms row).
        policies: vec!["llms".into(), "llms@0.5".into(), "lmk".into()],
        patterns: vec!["markov".into()],
        calls_per_context: 2,
        budget: "1MiB".into(),
        scale: 0.05,
        seed: 1,
        corpus: vec![fixture("gpl-3.txt")],
        llms_levels: vec!["int8".into(), "q4".into(), "q2".into()],
        llms_ratio: 0.7,
        llms_ratio_by: "a fixed ratio".into(),
    };
    let base = Config { model: model_path(), threads: 2, load_profile: false, ratio: 0.7, ..Config::default() };
    let mut seen = 0;
    let pts = tools::experiment::switch_vs_contexts(&base, &s, &dir.path().join("work"), dir.path(), &mut |_| seen += 1).unwrap();
    assert_eq!(pts.len(), 6);
    assert_eq!(seen, 6);
    assert!(pts.iter().all(|p| p.switch_mean_ms > 0.0));
    let files = tools::experiment::write_switch_vs_contexts(&dir.path().join("out"), "fig", &s, &pts).unwrap();
    for f in &files {
        assert!(std::fs::metadata(f).unwrap().len() > 100, "{} is empty", f.display());
    }
    let md = std::fs::read_to_string(&files[0]).unwrap();
    assert!(md.contains("| llms |") && md.contains("| llms@0.5 |") && md.contains("| lmk |") && md.contains("**markov pattern**"), "{md}");
    assert!(md.contains("llms over int8,q4,q2 at 0.70 of int8's bytes (a fixed ratio)"), "the caption states llms's quality setting: {md}");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&files[1]).unwrap()).unwrap();
    assert_eq!(json["rows"].as_array().unwrap().len(), 6);
    assert_eq!(json["settings"]["llms_ratio"], 0.7);
    assert!(std::fs::read_to_string(&files[2]).unwrap().starts_with("<svg"));
    assert_eq!(&std::fs::read(&files[3]).unwrap()[1..4], b"PNG");
}

#[test]
fn the_accuracy_experiment_compares_plans_with_int8() {
    let model = std::sync::Arc::new(engine::Model::load(&model_path()).unwrap());
    let pool = std::sync::Arc::new(engine::ThreadPool::new(2));
    let s = tools::experiment::AccuracyVsMemory {
        plans: vec!["q2".into(), "mix:0.75".into()],
        ctx: 128,
        // 8 windows: over one (63 scored tokens) whether q2 scores worse than int8 is a draw of
        // the 8-bit activations' rounding (an ulp-level change of the SwiGLU gate reversed it).
        windows: 8,
        chunk_tokens: 16,
        corpus: vec![fixture("gpl-3.txt")],
        generate: 24,
        levels: vec!["int8".into(), "q4".into(), "q2".into()],
        peer: None,
        peer_texts: Vec::new(),
    };
    let rows = tools::experiment::accuracy_vs_memory(&model, &pool, &s).unwrap();
    assert_eq!(rows.iter().map(|r| r.plan.as_str()).collect::<Vec<_>>(), ["int8", "q2", "mix:0.75"]);
    assert!((rows[0].top1_agreement - 1.0).abs() < 1e-12 && rows[0].ppl_vs_int8_pct.abs() < 1e-9);
    assert!(rows[0].greedy_agreement == 1.0 && rows[0].greedy_prefix == 1.0, "int8 agrees with itself when free-running");
    assert!(rows[1].greedy_prefix < 1.0, "2-bit KV changes what the model generates: {:?}", rows[1]);
    assert!(rows[1].greedy_prefix <= rows[1].greedy_agreement);
    assert!(rows[1].bytes_vs_int8 < rows[2].bytes_vs_int8 && rows[2].bytes_vs_int8 < 1.0);
    assert!(rows[1].ppl > rows[0].ppl, "2-bit KV costs perplexity");
    let dir = tempfile::tempdir().unwrap();
    for f in tools::experiment::write_accuracy(dir.path(), "acc", &s, &rows, &[]).unwrap() {
        assert!(std::fs::metadata(&f).unwrap().len() > 100, "{}", f.display());
    }
}

/// Fig. 12's llama.cpp comparison: our plans run on the windows llama.cpp's entries name and
/// sit beside them, each against its own f16; entries that are not the same windows, lack the
/// f16 to measure against, or are not JSON are refused with what is wrong.
#[test]
fn the_accuracy_experiment_sets_plans_beside_llama_cpp_on_the_same_windows() {
    let model = std::sync::Arc::new(engine::Model::load(&model_path()).unwrap());
    let pool = std::sync::Arc::new(engine::ThreadPool::new(2));
    let dir = tempfile::tempdir().unwrap();
    let peer = dir.path().join("peer.json");
    // A window of 128 tokens scores its second half but the last position: 63; 8 windows
    // (over one, whether q2 scores worse than int8 is a draw of the 8-bit activations' rounding).
    let entry = |kv: &str, ppl: f64, scored: usize| serde_json::json!({"text": "gpl-3.txt", "ctx": 128, "windows": 8, "kv": kv, "ppl": ppl, "scored": scored, "flash_attn": true});
    let write = |entries: Vec<serde_json::Value>| std::fs::write(&peer, serde_json::json!({"kv_perplexity": entries}).to_string()).unwrap();
    write(vec![entry("f16", 20.0, 504), entry("q4_0", 21.0, 504), entry("tq1_0", 30.0, 504)]);
    let mut s = tools::experiment::AccuracyVsMemory {
        plans: vec!["int8".into(), "q2".into()],
        ctx: 128,
        windows: 8,
        chunk_tokens: 16,
        corpus: vec![fixture("gpl-3.txt")],
        generate: 0,
        levels: vec!["int8".into(), "q4".into(), "q2".into()],
        peer: Some(peer.clone()),
        peer_texts: vec![fixture("gpl-3.txt")],
    };
    let texts = tools::experiment::peer_comparison(&model, &pool, &s).unwrap();
    assert_eq!(texts.len(), 1);
    let t = &texts[0];
    assert_eq!((t.text.as_str(), t.ctx, t.windows, t.scored), ("gpl-3.txt", 128, 8, 504));
    let names: Vec<(&str, &str)> = t.rows.iter().map(|r| (r.engine.as_str(), r.kv.as_str())).collect();
    assert_eq!(
        names,
        [("llms", "f16"), ("llms", "int8"), ("llms", "q2"), ("llama.cpp", "f16"), ("llama.cpp", "q4_0"), ("llama.cpp", "tq1_0")]
    );
    let (ours_f16, int8, q2) = (&t.rows[0], &t.rows[1], &t.rows[2]);
    assert!(ours_f16.vs_f16_pct.abs() < 1e-9 && int8.vs_int8_pct.unwrap().abs() < 1e-9);
    assert!((int8.bytes_vs_int8.unwrap() - 1.0).abs() < 1e-9 && q2.bytes_vs_int8.unwrap() < 0.5);
    assert!(q2.ppl > int8.ppl && q2.vs_int8_pct.unwrap() > 0.0, "2-bit KV costs perplexity: {q2:?}");
    // llama.cpp's rows are its own figures, against its own f16; q4_0 is 18 bytes a 32 values.
    let q4_0 = &t.rows[4];
    assert!((q4_0.vs_f16_pct - 5.0).abs() < 1e-9 && q4_0.vs_int8_pct.is_none());
    assert!((q4_0.bytes_vs_int8.unwrap() - (18.0 / 32.0) / (1.0 + 2.0 / 64.0)).abs() < 1e-9);
    assert!(t.rows[5].bytes_vs_int8.is_none(), "a type whose size this table does not know says so");
    tools::experiment::write_accuracy(dir.path(), "acc", &s, &[], &texts).unwrap();
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("acc.json")).unwrap()).unwrap();
    assert!(json["measured"].as_str().is_some_and(|m| m.contains("cores")), "Fig. 12 records where and when: {json}");
    assert_eq!(json["peer"][0]["rows"].as_array().unwrap().len(), 6);
    let md = std::fs::read_to_string(dir.path().join("acc.md")).unwrap();
    assert!(md.contains("| gpl-3.txt (8 of 128) | llama.cpp | q4_0 | 0.545 | 21.000 | +5.00% | — |"), "{md}");
    assert!(md.contains("mix:R chooses among int8, q4, q2 for R x int8's bytes"), "the caption names the mix's levels: {md}");

    let refused =
        |s: &tools::experiment::AccuracyVsMemory| format!("{:#}", tools::experiment::peer_comparison(&model, &pool, s).unwrap_err());
    write(vec![entry("f16", 20.0, 505)]);
    assert!(refused(&s).contains("not the same windows"), "{}", refused(&s));
    write(vec![entry("q4_0", 21.0, 504)]);
    assert!(refused(&s).contains("no f16 entry"), "{}", refused(&s));
    write(vec![entry("f16", f64::NAN, 504)]);
    assert!(refused(&s).contains("lacks") || refused(&s).contains("out of range"), "{}", refused(&s));
    std::fs::write(&peer, b"{\"kv_perplexity\": [").unwrap();
    assert!(refused(&s).contains("not JSON"), "{}", refused(&s));
    write(vec![entry("f16", 20.0, 504)]);
    s.peer_texts = vec![fixture("heapq.py.txt")];
    assert!(refused(&s).contains("no kv_perplexity entry for heapq.py.txt"), "{}", refused(&s));
}

#[test]
fn agreement_of_generated_sequences() {
    let (a, p) = tools::experiment::sequence_agreement(&[vec![1, 2, 3, 4], vec![5, 6]], &[vec![1, 2, 9, 4], vec![5, 6]]);
    assert!((a - 5.0 / 6.0).abs() < 1e-12, "{a}");
    assert!((p - (0.5 + 1.0) / 2.0).abs() < 1e-12, "{p}");
}

#[test]
fn the_latency_bound_crossing_is_interpolated() {
    use tools::experiment::crossing;
    assert_eq!(crossing(&[(2, 1.0), (4, 5.0), (8, 15.0)], 10.0), (6.0, false));
    assert_eq!(crossing(&[(2, 1.0), (4, 5.0)], 10.0), (4.0, true), "never over: the largest count, a lower bound");
    assert_eq!(crossing(&[(2, 20.0)], 10.0), (1.5, false), "over at once: between one context (no switch) and two");
}

/// Every other experiment, tiny: it runs against real services and writes its figure.
#[test]
fn the_other_experiments_run_and_write_their_figures() {
    use tools::experiment as ex;
    if require_kernel("userfaultfd", uffd_handler::Pager::new()).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (work, out) = (dir.path().join("work"), dir.path().join("out"));
    let corpus = vec![fixture("gpl-3.txt")];
    let base = Config { model: model_path(), threads: 2, load_profile: false, ..Config::default() };
    let check = |files: Vec<PathBuf>, want: &[&str]| {
        assert_eq!(files.len(), 4);
        for f in &files {
            assert!(std::fs::metadata(f).unwrap().len() > 100, "{} is empty", f.display());
        }
        let md = std::fs::read_to_string(&files[0]).unwrap();
        for w in want {
            assert!(md.contains(w), "{w} not in {md}");
        }
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&files[1]).unwrap()).unwrap();
        assert!(json["command"].is_string() && json["settings"].is_object(), "{json}");
    };

    let s = ex::Ablation {
        variants: vec!["llms".into(), "no-aot".into(), "no-lctru".into()],
        contexts: vec![3],
        pattern: "markov".into(),
        calls_per_context: 2,
        budget: "1MiB".into(),
        scale: 0.05,
        seed: 1,
        corpus: corpus.clone(),
    };
    assert!(ex::variant_config(&base, "no-such").is_err() && ex::variant_config(&base, "no-lctru").is_ok());
    let runs = ex::ablation(&base, &s, &work, dir.path(), &mut |_| {}).unwrap();
    assert_eq!(runs.len(), 3);
    assert!(runs.iter().all(|r| r.summary.calls == 3 && r.summary.switch_mean_ms > 0.0), "{runs:?}");
    check(ex::write_ablation(&out, "ablation", &s, &runs).unwrap(), &["| no-aot |", "| no-lctru |"]);

    let s = ex::ChunkSize {
        chunk_tokens: vec![8, 32],
        policies: vec!["vllm-sq".into()],
        contexts: 3,
        pattern: "random".into(),
        calls_per_context: 2,
        budget: "1MiB".into(),
        scale: 0.05,
        seed: 1,
        corpus: corpus.clone(),
    };
    let runs = ex::chunk_size(&base, &s, &work, dir.path(), &mut |_| {}).unwrap();
    assert_eq!(runs.iter().map(|r| r.x).collect::<Vec<_>>(), [8.0, 32.0]);
    check(ex::write_chunk_size(&out, "chunk", &s, &runs).unwrap(), &["| vllm-sq |", " 32 |"]);

    // Real-time pacing: at 4 calls/s the replay takes about as long as the trace says.
    let s = ex::CallRate {
        rates: vec![4.0],
        policies: vec!["llms".into()],
        contexts: 2,
        pattern: "random".into(),
        calls_per_context: 3,
        budget: "1MiB".into(),
        scale: 0.05,
        seed: 1,
        corpus: corpus.clone(),
    };
    let runs = ex::call_rate(&base, &s, &work, dir.path(), &mut |_| {}).unwrap();
    let (h, recs) = generate(&GenParams {
        contexts: 2,
        apps: 2,
        calls: 6,
        pattern: Pattern::Random,
        rate: 4.0,
        seed: 1,
        scale: 0.05,
        markov_decay: 0.5,
        corpus: corpus.clone(),
        system_tokens: 0,
    })
    .unwrap();
    assert_eq!(h.generator.rate, 4.0);
    let span = recs.last().unwrap().t - recs[0].t;
    assert!(runs[0].summary.seconds >= span, "paced: {} s for a trace of {span} s", runs[0].summary.seconds);
    check(ex::write_call_rate(&out, "rate", &s, &runs).unwrap(), &["| llms |"]);

    let s = ex::MaxContexts {
        budgets: vec!["1MiB".into()],
        lengths: vec![256, 512],
        bounds_ms: vec![1e-6],
        contexts: vec![2, 3],
        policies: vec!["lmk".into(), "llms-noshare".into()],
        pattern: "random".into(),
        calls_per_context: 2,
        scale: 0.05,
        scale_with_length: true,
        seed: 1,
        corpus,
        system_tokens: 64,
        apps: 4,
    };
    assert!((s.scale_at(256) - 0.025).abs() < 1e-12 && (s.scale_at(512) - 0.05).abs() < 1e-12);
    assert_eq!((s.system_tokens_at(256), s.system_tokens_at(512)), (32, 64), "the system prompt scales with the deltas");
    let (runs, rows) = ex::max_contexts(&base, &s, &work, dir.path(), &mut |_| {}).unwrap();
    assert_eq!(runs.len(), 4, "a bound of 1 ns is passed at once: one run per length and policy");
    assert!(rows.iter().all(|r| !r.at_least && r.max_contexts < 2.0), "{rows:?}");
    check(
        ex::write_max_contexts(&out, "maxctx", &s, &runs, &rows).unwrap(),
        &["under 0.000001 ms", " 512 |", "system prompt of 64 tokens", "| llms-noshare |"],
    );

    let model = std::sync::Arc::new(engine::Model::load(&model_path()).unwrap());
    let pool = std::sync::Arc::new(engine::ThreadPool::new(2));
    let s = ex::Inference { lengths: vec![40], decode: 6, reps: 2, chunk_tokens: 16 };
    let rows = ex::inference(&model, &pool, &s, dir.path(), &mut |_| {}).unwrap();
    assert_eq!(rows.iter().map(|r| r.memory.as_str()).collect::<Vec<_>>(), ["engine", "llms"]);
    assert!(rows.iter().all(|r| r.prefill_tok_s > 0.0 && r.decode_tok_s > 0.0));
    check(ex::write_inference(&out, "inference", &s, &rows).unwrap(), &["| engine |", "| llms |", "**decode**"]);
}

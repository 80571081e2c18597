//! Trace replay end to end: a short synthetic trace through the real service (in process, over
//! its socket) for every policy, under a budget that forces eviction.

use std::path::PathBuf;

use llms_tests::{fixture, model_path, require_kernel};
use tools::config::Config;
use tools::service::Local;
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

#[test]
fn a_tiny_experiment_writes_its_table_and_plots() {
    if require_kernel("userfaultfd", uffd_handler::Pager::new()).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = tools::experiment::SwitchVsContexts {
        contexts: vec![2, 3],
        policies: vec!["llms".into(), "lmk".into()],
        patterns: vec!["markov".into()],
        calls_per_context: 2,
        budget: "1MiB".into(),
        scale: 0.05,
        seed: 1,
        corpus: vec![fixture("gpl-3.txt")],
    };
    let base = Config { model: model_path(), threads: 2, load_profile: false, ..Config::default() };
    let mut seen = 0;
    let pts = tools::experiment::switch_vs_contexts(&base, &s, &dir.path().join("work"), dir.path(), &mut |_| seen += 1).unwrap();
    assert_eq!(pts.len(), 4);
    assert_eq!(seen, 4);
    assert!(pts.iter().all(|p| p.switch_mean_ms > 0.0));
    let files = tools::experiment::write_switch_vs_contexts(&dir.path().join("out"), "fig", &s, &pts).unwrap();
    for f in &files {
        assert!(std::fs::metadata(f).unwrap().len() > 100, "{} is empty", f.display());
    }
    let md = std::fs::read_to_string(&files[0]).unwrap();
    assert!(md.contains("| llms |") && md.contains("| lmk |") && md.contains("**markov**"), "{md}");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&files[1]).unwrap()).unwrap();
    assert_eq!(json["points"].as_array().unwrap().len(), 4);
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
        windows: 1,
        chunk_tokens: 16,
        corpus: vec![fixture("gpl-3.txt")],
    };
    let rows = tools::experiment::accuracy_vs_memory(&model, &pool, &s).unwrap();
    assert_eq!(rows.iter().map(|r| r.plan.as_str()).collect::<Vec<_>>(), ["int8", "q2", "mix:0.75"]);
    assert!((rows[0].top1_agreement - 1.0).abs() < 1e-12 && rows[0].ppl_vs_int8_pct.abs() < 1e-9);
    assert!(rows[1].bytes_vs_int8 < rows[2].bytes_vs_int8 && rows[2].bytes_vs_int8 < 1.0);
    assert!(rows[1].ppl > rows[0].ppl, "2-bit KV costs perplexity");
    let dir = tempfile::tempdir().unwrap();
    for f in tools::experiment::write_accuracy(dir.path(), "acc", &s, &rows).unwrap() {
        assert!(std::fs::metadata(&f).unwrap().len() > 100, "{}", f.display());
    }
}

//! Every benchmark command runs, at its smallest, and prints the JSON its stored results are
//! made of: a figure in docs/ comes from a command that works at HEAD. (Speed is not asserted:
//! the benchmarks report it; tests assert behaviour.)

use std::process::Command;

use llms_tests::{model_path, require_kernel};
use serde_json::Value;

fn llms(args: &[&str], state: &std::path::Path) -> Value {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_llms"));
    cmd.args(args).env("LLMS_STATE_DIR", state);
    if args[0] != "bench-uffd" {
        cmd.arg("--model").arg(model_path());
    }
    let out = cmd.output().expect("llms runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "llms {args:?} failed: {err}");
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("llms {args:?}: not JSON ({e}): {text}"));
    assert!(v.as_array().map_or_else(|| v.as_object().is_some_and(|o| !o.is_empty()), |a| !a.is_empty()), "llms {args:?}: empty: {v}");
    v
}

#[test]
fn every_bench_command_runs_at_its_smallest() {
    if require_kernel("userfaultfd", uffd_handler::Pager::new()).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    // The load profile first (the service benches plan with it; measured once, about a minute).
    llms(&["profile", "--json", "--state-dir", state.to_str().unwrap()], state);
    let s = state.to_str().unwrap();
    let runs: [(&str, &[&str]); 9] = [
        ("bench-load", &["--tokens", "64", "--reps", "1", "--state-dir", s]),
        ("bench-switch", &["--tokens", "160", "--reps", "1", "--state-dir", s]),
        ("bench-http", &["--turns", "2", "--user-tokens", "8", "--reply-tokens", "4", "--reps", "1", "--state-dir", s]),
        ("bench-batch", &["--sizes", "1", "2", "--depth", "16", "--tokens", "4", "--reps", "1", "--piece", "4", "--sessions", "service"]),
        ("bench-tokenize", &["--bytes", "4096", "--reps", "1"]),
        ("bench-doors", &["--chars", "2000", "--reps", "1", "--state-dir", s]),
        ("bench-serve", &["--clients", "2", "--calls", "1", "--prompt-tokens", "8", "--max-tokens", "4", "--vs-solo", "--state-dir", s]),
        ("bench-weights", &["--budgets", "50", "--tg", "4", "--reps", "1"]),
        ("bench-uffd", &["--reps", "3"]),
    ];
    for (cmd, args) in runs {
        let mut a = vec![cmd, "--json"];
        a.extend_from_slice(args);
        let v = llms(&a, state);
        if cmd == "bench-batch" {
            // --piece: each size's three pass times, beside its decode figures.
            for row in v.as_array().unwrap() {
                let t = &row["piece"]["times"];
                for k in ["step_ms", "mixed_ms", "alone_ms"] {
                    assert!(t[k].as_f64().is_some_and(|ms| ms > 0.0), "bench-batch --piece: {k} in {row}");
                }
            }
        }
        if cmd == "bench-batch" {
            // --sessions service: the rows say which sessions they timed.
            assert!(v.as_array().unwrap().iter().all(|r| r["sessions"] == "service"), "bench-batch --sessions service: {v}");
        }
        if cmd == "bench-serve" {
            // --vs-solo: the engine's own step for the clients' contexts and the gaps' mean,
            // each against the lone client's p99 (the floors docs/llmsd.md reads the bound by).
            for k in ["engine_batch_gain", "engine_batch_step_ms", "engine_step_vs_solo_itl_p99", "itl_mean_vs_solo_p99", "itl_ms_mean"] {
                assert!(v[k].as_f64().is_some_and(|x| x > 0.0), "bench-serve --vs-solo: {k} in {v}");
            }
        }
        eprintln!("{cmd}: {}", v.to_string().chars().take(200).collect::<String>());
    }
}

//! The `llms` command-line contract (docs/CLI.md): JSON shapes, determinism, and clear errors.
#![allow(clippy::cast_possible_truncation)]

use std::path::Path;
use std::process::{Command, Output};

use llms_tests::{fixture, model_path};
use serde_json::Value;

fn llms(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_llms")).args(args).env("LLMS_MODEL", model_path()).output().expect("run llms")
}

fn json_ok(args: &[&str]) -> Value {
    let out = llms(args);
    assert!(out.status.success(), "llms {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("llms {args:?} printed no JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// A file with `contents` in a directory of its own, removed when the guard goes.
fn temp_file(name: &str, contents: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join(name);
    std::fs::write(&p, contents).unwrap();
    (dir, p)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn tokenize_prints_the_ids_and_parses_special_tokens() {
    let (_dir, f) = temp_file("tok.txt", "<|im_start|>user\nHello world<|im_end|>");
    let ids = json_ok(&["tokenize", "--text-file", s(&f)]);
    let ids: Vec<u64> = ids.as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(ids.first(), Some(&1), "<|im_start|> is token 1");
    assert_eq!(ids.last(), Some(&2), "<|im_end|> is token 2");
    let plain = json_ok(&["tokenize", "--text-file", s(&f), "--no-special"]);
    assert!(plain.as_array().unwrap().len() > ids.len(), "without special parsing the markup is plain text");
}

#[test]
fn logits_lists_the_top_n_highest_first() {
    let (_dir, f) = temp_file("p.txt", "The capital of France is");
    let v = json_ok(&["logits", "--prompt-file", s(&f), "--top", "7"]);
    assert_eq!(v["tokens"].as_array().unwrap().len(), 5);
    let top = v["top"].as_array().unwrap();
    assert_eq!(top.len(), 7);
    let l: Vec<f64> = top.iter().map(|e| e["logit"].as_f64().unwrap()).collect();
    assert!(l.windows(2).all(|w| w[0] >= w[1]), "sorted highest first: {l:?}");
    assert_eq!(top[0]["id"], 7042, "' Paris'");
}

#[test]
fn generate_json_is_deterministic_for_a_seed_and_stops_at_max_tokens() {
    let args = ["generate", "--prompt", "Once upon a time", "--max-tokens", "12", "--temperature", "0.8", "--seed", "7", "--json"];
    let a = json_ok(&args);
    let b = json_ok(&args);
    assert_eq!(a, b);
    let toks = a["tokens"].as_array().unwrap();
    assert!(!toks.is_empty() && toks.len() <= 12);
    assert!(!a["text"].as_str().unwrap().is_empty());
    let greedy = json_ok(&["generate", "--prompt", "The capital of France is", "--max-tokens", "3", "--json"]);
    assert_eq!(greedy["text"].as_str().unwrap().split_whitespace().next(), Some("Paris."));
}

#[test]
fn generate_streams_text_without_json() {
    let out = llms(&["generate", "--prompt", "1, 2, 3, 4,", "--max-tokens", "8"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains('5'), "{text:?}");
}

#[test]
fn perplexity_json_scores_half_of_each_window() {
    let v = json_ok(&["perplexity", "--text-file", s(&fixture("gpl-3.txt")), "--ctx", "64", "--chunks", "2", "--json"]);
    assert_eq!(v["scored"], 2 * 31);
    let ppl = v["ppl"].as_f64().unwrap();
    assert!(ppl > 1.0 && ppl < 200.0, "{ppl}");
}

#[test]
fn bench_json_reports_both_rates() {
    let v = json_ok(&["bench", "--pp", "16", "--tg", "4", "--reps", "1", "--json"]);
    assert!(v["pp16_tok_s"].as_f64().unwrap() > 0.0);
    assert!(v["tg4_tok_s"].as_f64().unwrap() > 0.0);
    assert_eq!(v["threads"].as_u64().unwrap() as usize, std::thread::available_parallelism().unwrap().get());
    assert!(v["pool"].is_null(), "no pool statistics unless asked");
    // Resident weights sit in the arena, a share of it on huge pages (none where THP is off).
    let share = v["huge_page_share"].as_f64().expect("resident weights report their huge pages");
    assert!((0.0..=1.0).contains(&share), "{share}");
    // The floor reads a buffer of the weights' size, placed as they are, once a repetition;
    // each repetition's tg is held to its own read.
    let v = json_ok(&["bench", "--pp", "16", "--tg", "4", "--reps", "1", "--floor", "--json"]);
    let f = &v["floor"];
    assert!(f["read_gb_s"].as_f64().unwrap() > 0.0);
    assert_eq!(f["reps_read_gb_s"].as_array().map(Vec::len), Some(1), "one read a repetition: {f}");
    let (tg, floor) = (v["tg4_tok_s"].as_f64().unwrap(), f["tg_tok_s"].as_f64().unwrap());
    let ratio = f["tg_vs_floor"].as_f64().unwrap();
    assert!((ratio - tg / floor).abs() <= 1e-9 * ratio, "one repetition: its tg over its read's floor: {f}");
    let v = json_ok(&["bench", "--pp", "16", "--tg", "4", "--reps", "3", "--floor", "--json"]);
    assert_eq!(v["floor"]["reps_read_gb_s"].as_array().map(Vec::len), Some(3), "{}", v["floor"]);
}

/// `--pool-report`: every parallel operation of a prefill and of a decode, counted per token.
#[test]
fn bench_pool_report_counts_the_operations() {
    let v = json_ok(&["bench", "--pp", "64", "--tg", "4", "--reps", "1", "--threads", "2", "--pool-report", "--json"]);
    let ops = |phase: &str| -> Vec<(String, f64, f64)> {
        v["pool"][phase]["ops"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| (o["op"].as_str().unwrap().to_string(), o["calls_per_token"].as_f64().unwrap(), o["imbalance"].as_f64().unwrap()))
            .collect()
    };
    // Decode: q/k/v, o, gate/up, down in each of the 30 layers, and the output head.
    let tg = ops("tg");
    let matmul = tg.iter().find(|o| o.0 == "matmul").expect("decode runs matmuls");
    assert_eq!(matmul.1, 121.0, "{tg:?}");
    assert!(tg.iter().any(|o| o.0.starts_with("attention")), "{tg:?}");
    // Prefill: one pass of 64 tokens, the gates spread over the threads in every layer but
    // the last, where they are the one row's that gives the logits (on the calling thread).
    let pp = ops("pp");
    assert!(pp.iter().any(|o| o.0 == "swiglu" && (o.1 * 64.0 - 29.0).abs() < 1e-9), "{pp:?}");
    for (name, _, imb) in tg.iter().chain(&pp) {
        assert!((1.0..=2.0 + 1e-9).contains(imb), "{name}: imbalance {imb} outside [1, threads]");
    }
    assert_eq!(v["pool"]["tg"]["threads"], 2);
    // At depth the statistics are the timed tokens' only, not the context's prefill.
    let v = json_ok(&["bench", "--pp", "16", "--tg", "4", "-d", "64", "--reps", "1", "--pool-report", "--json"]);
    let tg = &v["pool"]["tg"]["ops"];
    let matmul = tg.as_array().unwrap().iter().find(|o| o["op"] == "matmul").expect("decode runs matmuls");
    assert_eq!(matmul["calls_per_token"].as_f64(), Some(121.0), "{tg}");
    assert!(v["pool"]["tg"]["in_operations_share"].as_f64().unwrap() <= 1.0, "{}", v["pool"]["tg"]);
}

#[test]
fn errors_are_clear_and_exit_nonzero() {
    let out = Command::new(env!("CARGO_BIN_EXE_llms"))
        .args(["tokenize", "--text-file", "/nonexistent", "--model", "/nonexistent.gguf"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
    let (_dir, junk) = temp_file("junk.gguf", "this is not a model");
    let out = Command::new(env!("CARGO_BIN_EXE_llms")).args(["generate", "--prompt", "x", "--model", s(&junk)]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad magic"), "{err}");
    let out = llms(&["generate"]);
    assert!(!out.status.success());
}

#[test]
fn perplexity_with_a_compressed_kv_reports_its_size() {
    let f = fixture("gpl-3.txt");
    // 8 windows: over 2 (256 tokens) which of int8 and q2 scores better is a draw of the
    // 8-bit activations' rounding (q2 came out 8% better after an ulp-level change of the
    // SwiGLU gate's exp); over 8, q2 is 11% worse with either gate.
    let ppl = |kv: &str| json_ok(&["perplexity", "--text-file", s(&f), "--ctx", "128", "--chunks", "8", "--kv", kv, "--json"]);
    let (int8, q2, mix) = (ppl("int8"), ppl("q2"), ppl("mix:0.6"));
    assert_eq!(int8["kv_bytes_vs_int8"].as_f64(), Some(1.0));
    assert!(q2["kv_bytes_vs_int8"].as_f64().unwrap() < 0.5);
    assert!(mix["kv_bytes_vs_int8"].as_f64().unwrap() <= 0.6 + 1e-9);
    assert!(q2["ppl"].as_f64().unwrap() > int8["ppl"].as_f64().unwrap(), "2-bit KV costs accuracy");
    let out = llms(&["perplexity", "--text-file", s(&f), "--kv", "q3"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--kv"));
}

#[test]
fn perplexity_kl_against_int8_orders_the_levels() {
    let f = fixture("gpl-3.txt");
    let kl = |kv: &str| json_ok(&["perplexity", "--text-file", s(&f), "--ctx", "128", "--chunks", "2", "--kv", kv, "--kl", "--json"]);
    let (int8, k4, k3) = (kl("int8"), kl("k4v4"), kl("k3v3"));
    // The same cache as the reference: the same distributions, so nothing diverges.
    assert_eq!(int8["kl_vs_int8"].as_f64(), Some(0.0), "{int8}");
    assert_eq!(int8["ppl"], int8["int8_ppl"]);
    assert_eq!(k4["int8_ppl"], int8["int8_ppl"], "the reference is int8 on the same windows");
    let (d4, d3) = (k4["kl_vs_int8"].as_f64().unwrap(), k3["kl_vs_int8"].as_f64().unwrap());
    assert!(0.0 < d4 && d4 < d3, "fewer bits diverge more: k4v4 {d4}, k3v3 {d3}");
    let out = llms(&["perplexity", "--text-file", s(&f), "--kl"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--kv"));
}

#[test]
fn bench_at_depth_with_an_int8_cache() {
    let v = json_ok(&["bench", "--kv", "int8", "-d", "64", "--pp", "8", "--tg", "2", "--reps", "1", "--json"]);
    assert_eq!(v["kv"], "int8");
    assert_eq!(v["depth"], 64);
    assert_eq!((v["weight_format"].as_str(), v["sparsity"].is_null()), (Some("packed"), true));
    assert!(v["tg2_tok_s"].as_f64().unwrap() > 0.0);
    let v = json_ok(&["bench", "--kv", "q4", "-d", "64", "--pp", "8", "--tg", "2", "--reps", "1", "--json"]);
    assert_eq!(v["kv"], "q4", "a compressed context at depth");
    assert!(v["pp8_tok_s"].as_f64().unwrap() > 0.0);
    let out = llms(&["bench", "--kv", "q3", "--reps", "1"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--kv"));
    // Several formats in one run: one object each, in order, the later ones paired with the first.
    let v = json_ok(&["bench", "--kv", "int8,k4v3", "-d", "64", "--pp", "8", "--tg", "2", "--reps", "2", "--json"]);
    let rows = v.as_array().expect("an array for several formats");
    assert_eq!(rows.iter().map(|r| r["kv"].as_str().unwrap()).collect::<Vec<_>>(), ["int8", "k4v3"]);
    assert!(rows[0]["vs"].is_null());
    assert_eq!(rows[1]["vs"]["kv"], "int8");
    assert!(rows[1]["vs"]["tg"].as_f64().unwrap() > 0.0 && rows[1]["vs"]["pp"].as_f64().unwrap() > 0.0);
    let out = llms(&["bench", "--kv", "int8,q3", "--reps", "1"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("q3"));
}

#[test]
fn doctor_reports_userfaultfd() {
    let v = json_ok(&["doctor", "--json"]);
    let uffd = v.as_array().unwrap().iter().find(|c| c["facility"] == "userfaultfd").expect("a userfaultfd line");
    if llms_tests::kernel_required() {
        assert_eq!(uffd["ok"], true, "{uffd}");
    }
    assert!(!uffd["detail"].as_str().unwrap().is_empty());
}

#[test]
fn pressure_watch_record_and_replay() {
    let out = llms(&["pressure", "watch", "--json", "--count", "2", "--interval-ms", "50"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<Value> = String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2);
    assert!(lines[1]["event"]["t_ms"].as_u64() > lines[0]["event"]["t_ms"].as_u64());
    assert!(lines[0]["sample"]["mem"]["total"].as_u64().unwrap() > 0);
    let rec = std::env::temp_dir().join(format!("llms-rec-{}.jsonl", std::process::id()));
    let out = llms(&["pressure", "record", s(&rec), "--count", "3", "--interval-ms", "20"]);
    assert!(out.status.success());
    let out = llms(&["pressure", "replay", s(&rec)]);
    assert!(out.status.success());
    let events: Vec<Value> = String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(events.len(), 3);
    assert!(events.iter().all(|e| e["budget"].as_u64().unwrap() <= 1 << 30));
    // A damaged recording is an error naming the line.
    std::fs::write(&rec, "{\"t_ms\":1}\nnot json\n").unwrap();
    let out = llms(&["pressure", "replay", s(&rec)]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains(":1: not a sample"));
    let _ = std::fs::remove_file(rec);
}

/// Channel-major weights generate what packed ones do (the kernels agree bit for bit),
/// resident or paged by channel under a budget; the sparsity flags go only where a session
/// uses them.
#[test]
fn weight_formats_generate_alike_and_misplaced_flags_are_refused() {
    let args = ["generate", "--prompt", "Once upon a time", "--max-tokens", "12", "--json"];
    let packed = json_ok(&args);
    let cm = json_ok(&[&args[..], &["--weight-format", "channel-major"]].concat());
    assert_eq!(packed["tokens"], cm["tokens"]);
    if llms_tests::require_kernel("userfaultfd", uffd_handler::Pager::new()).is_some() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("cm.img");
        let paged = [&args[..], &["--weight-format", "channel-major", "--weights-budget", "60%", "--weights-image", img.to_str().unwrap()]];
        assert_eq!(json_ok(&paged.concat())["tokens"], packed["tokens"]);
        // A weight plan held to dense weights picks the layout (the packed image streamed, or
        // a channel-major one and its group size) and still computes the packed model's
        // tokens; it says what it chose.
        let img = dir.path().join("planned.img");
        let planned =
            [&args[..], &["--weights-plan", "--max-sparsity", "0", "--weights-budget", "60%", "--weights-image", img.to_str().unwrap()]];
        let out = llms(&planned.concat());
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("weight plan: sparsity 0, "));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["tokens"], packed["tokens"]);
    }
    for (bad, why) in [
        (&["generate", "--prompt", "x", "--weights-plan", "--sparsity", "0.5"][..], "--weights-plan chooses the sparsity"),
        (&["tokenize", "--text-file", "/dev/null", "--weights-plan"][..], "--weights-plan go with"),
        (&["generate", "--prompt", "x", "--max-sparsity", "0.5"][..], "--max-sparsity goes with --weights-plan"),
        (&["plan-weights", "--budgets", "0"][..], "not a percentage"),
        (&["tokenize", "--text-file", "/dev/null", "--sparsity", "0.5"][..], "--sparsity, --calib-text and --weights-plan go with"),
        (&["generate", "--prompt", "x", "--calib-text", "/dev/null"][..], "--calib-text goes with --sparsity"),
        (&["generate", "--prompt", "x", "--no-preload"][..], "go with --weights paged"),
    ] {
        let out = llms(bad);
        assert_eq!(out.status.code(), Some(1), "{bad:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(why), "{bad:?}: {err}");
    }
}

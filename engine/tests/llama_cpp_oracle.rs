//! The engine against llama.cpp on the real models (fixtures from tools/oracle/make_fixtures.py):
//! the default SmolLM2 and Gemma 3 270M, each test once per model.
//!
//! Tolerances: both engines quantize activations to 8 bits before each matmul, so a difference
//! in float summation order far below 1e-6 flips a few roundings, and that noise reaches the
//! logits at the level of a few tenths (llama.cpp itself is ~0.4 away from an f64 reference on
//! these prompts). A real bug (a wrong RoPE, mask or scale) moves logits by whole units.
#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::sync::Arc;

use engine::{Logits, Model, Session, ThreadPool};
use llms_tests::{checked_fixture, fixture, gemma3_oracle, gemma3_path, ids, model_path, oracle};
use serde_json::Value;

/// Largest allowed |ours - llama.cpp| for any of llama.cpp's top-10 logits.
const LOGIT_TOL: f32 = 0.75;
/// Largest allowed mean |ours - llama.cpp| over all those logits.
const MEAN_LOGIT_TOL: f32 = 0.3;

/// A model under test, its llama.cpp values and how close its perplexity must be.
struct Case {
    model: Arc<Model>,
    oracle: &'static Value,
    ppl_tol: f64,
    /// The f64 reference's fixture (tools/oracle/f64_reference.py) and the model file it is of.
    f64: (&'static str, std::path::PathBuf),
}

fn smollm2() -> Case {
    let path = model_path();
    Case { model: Arc::new(Model::load(&path).expect("load model")), oracle: oracle(), ppl_tol: 0.01, f64: ("f64_smollm2.json", path) }
}

fn gemma3() -> Case {
    let path = gemma3_path();
    Case {
        model: Arc::new(Model::load(&path).expect("load Gemma 3")),
        oracle: gemma3_oracle(),
        ppl_tol: 0.005,
        f64: ("f64_gemma3.json", path),
    }
}

/// Checks run for a model: `mod NAME (CASE): check, ...`.
macro_rules! checks {
    ($name:ident ($case:ident): $($check:ident),*) => {
        mod $name {
            $(#[test] fn $check() { super::$check(&super::$case()) })*
        }
    };
}

checks!(smollm2 (smollm2):
    tokenization_matches_llama_cpp,
    last_position_logits_match_llama_cpp,
    greedy_continuations_match_llama_cpp,
    perplexity_matches_llama_cpp,
    batched_prefill_equals_incremental_decode,
    as_close_to_f64_as_llama_cpp
);
// Gemma 3's prompts start with BOS, as the model adds one (without it the model is far from
// anything it was trained on and the two engines' rounding differences grow to whole logits;
// with it they are within SmolLM2's tolerances, the 900-token prompt past the 512-token
// window included). Its perplexity must be within 0.5% (issue #55).
checks!(gemma3 (gemma3):
    tokenization_matches_llama_cpp,
    last_position_logits_match_llama_cpp,
    greedy_continuations_match_llama_cpp,
    perplexity_matches_llama_cpp,
    batched_prefill_equals_incremental_decode,
    as_close_to_f64_as_llama_cpp
);

fn tokenization_matches_llama_cpp(c: &Case) {
    let m = &c.model;
    for case in c.oracle["tokenize"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let got = m.tokenizer.encode(text, false, true).unwrap();
        assert_eq!(got, ids(&case["ids"]), "tokens of {text:?}");
        // Exact, but for SentencePiece's `▁`, which is how it writes a space (it comes back one).
        let want = if m.tokenizer.token_id("\u{2581}").is_some() { text.replace('\u{2581}', " ") } else { text.to_string() };
        assert_eq!(String::from_utf8(m.tokenizer.decode(&got, true)).unwrap(), want, "detokenization of {text:?} is exact");
    }
}

fn last_position_logits_match_llama_cpp(c: &Case) {
    let m = &c.model;
    let pool = Arc::new(ThreadPool::new(2));
    let (mut sum, mut n, mut worst) = (0.0f32, 0, 0.0f32);
    for case in c.oracle["logits"].as_array().unwrap() {
        let toks = ids(&case["tokens"]);
        let mut s = Session::new(Arc::clone(m), Arc::clone(&pool), toks.len());
        let logits = s.eval(&toks, Logits::Last).unwrap();
        let top = case["top"].as_array().unwrap();
        let best = top[0]["id"].as_u64().unwrap() as u32;
        assert_eq!(engine::sampler::argmax(logits), best, "top-1 of {:?}", case["prompt"]);
        for e in top {
            let (id, want) = (e["id"].as_u64().unwrap() as usize, e["logit"].as_f64().unwrap() as f32);
            let d = (logits[id] - want).abs();
            assert!(d <= LOGIT_TOL, "prompt {:?} token {id}: ours {} vs llama.cpp {want}", case["prompt"], logits[id]);
            sum += d;
            worst = worst.max(d);
            n += 1;
        }
    }
    eprintln!("largest |Δlogit| {worst}, mean {} over {n} logits", sum / n as f32);
    assert!(sum / n as f32 <= MEAN_LOGIT_TOL, "mean |Δlogit| {} over {n} logits", sum / n as f32);
}

/// Greedy continuations agree token for token until the first step where the two engines'
/// best candidates are a near-tie in our own logits (then either choice is right).
fn greedy_continuations_match_llama_cpp(c: &Case) {
    let m = &c.model;
    let pool = Arc::new(ThreadPool::new(2));
    let (mut agreed, mut total) = (0, 0);
    for (lc, g) in c.oracle["logits"].as_array().unwrap().iter().zip(c.oracle["greedy"].as_array().unwrap()) {
        let prompt = ids(&lc["tokens"]);
        let want = ids(&g["tokens"]);
        let mut s = Session::new(Arc::clone(m), Arc::clone(&pool), prompt.len() + want.len() + 1);
        let mut logits = s.eval(&prompt, Logits::Last).unwrap().to_vec();
        total += want.len();
        for (i, &w) in want.iter().enumerate() {
            let ours = engine::sampler::argmax(&logits);
            if ours != w {
                let margin = logits[ours as usize] - logits[w as usize];
                assert!(
                    margin < LOGIT_TOL,
                    "prompt {:?} step {i}: we chose {ours}, llama.cpp {w}, margin {margin} is no tie",
                    lc["prompt"]
                );
                break;
            }
            agreed += 1;
            logits = s.eval(&[w], Logits::Last).unwrap().to_vec();
        }
    }
    assert!(agreed * 2 >= total, "only {agreed} of {total} greedy tokens agree before a tie");
}

fn perplexity_matches_llama_cpp(c: &Case) {
    let m = &c.model;
    let p = &c.oracle["perplexity"];
    let text = std::fs::read_to_string(fixture("gpl-3.txt")).unwrap();
    let toks = m.tokenizer.encode(&text, false, false).unwrap();
    let (ctx, chunks) = (p["ctx"].as_u64().unwrap() as usize, p["chunks"].as_u64().unwrap() as usize);
    let r = engine::eval::perplexity(m, Arc::new(ThreadPool::new(2)), &toks, ctx, chunks).unwrap();
    let want = p["ppl"].as_f64().unwrap();
    assert_eq!(r.scored as u64, p["scored"].as_u64().unwrap());
    assert!((r.ppl / want - 1.0).abs() < c.ppl_tol, "perplexity {} vs llama.cpp {want} (tolerance {})", r.ppl, c.ppl_tol);
}

/// Prefill as one batch and token-by-token decode reach the same state.
fn batched_prefill_equals_incremental_decode(c: &Case) {
    let m = &c.model;
    let pool = Arc::new(ThreadPool::new(2));
    let toks = m.tokenizer.encode("The service keeps many contexts alive in a small memory budget.", false, true).unwrap();
    let mut a = Session::new(Arc::clone(m), Arc::clone(&pool), toks.len());
    let batched = a.eval(&toks, Logits::Last).unwrap().to_vec();
    let mut b = Session::new(Arc::clone(m), Arc::clone(&pool), toks.len());
    let mut last = Vec::new();
    for &t in &toks {
        last = b.eval(&[t], Logits::Last).unwrap().to_vec();
    }
    assert_eq!(engine::sampler::argmax(&batched), engine::sampler::argmax(&last));
    let max_d = batched.iter().zip(&last).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(max_d < LOGIT_TOL, "batched vs incremental differ by {max_d}");
}

/// Both engines round activations to 8 bits before each matmul, so neither is the model the file
/// defines; an exact f64 forward pass is (tools/oracle/f64_reference.py, `make fixtures`). Over
/// f64's top-10 logits at ~320 positions (7 prompts' last and every position of two texts), our
/// root-mean-square distance from f64 is at most llama.cpp's, or within the spread that
/// llama.cpp's own rounding scheme shows when only the float summation order changes (the
/// fixture's `jitter_rms`: the same scheme emulated in f64 with ~1 ulp of jitter before each
/// rounding). A kernel that rounds coarser than llama.cpp's, or drops precision anywhere, fails.
fn as_close_to_f64_as_llama_cpp(c: &Case) {
    let m = &c.model;
    let f64 = checked_fixture(c.f64.0, &c.f64.1);
    let pool = Arc::new(ThreadPool::new(2));
    let (mut sq, mut n, mut top1, mut positions) = (0.0f64, 0usize, 0usize, 0usize);
    let vocab = m.config.vocab;
    for case in f64["cases"].as_array().unwrap() {
        let toks = ids(&case["tokens"]);
        let mut s = Session::new(Arc::clone(m), Arc::clone(&pool), toks.len());
        let logits = s.eval(&toks, Logits::All).unwrap();
        for p in case["scored"].as_array().unwrap() {
            let row = &logits[p["pos"].as_u64().unwrap() as usize * vocab..][..vocab];
            let want = p["f64"].as_array().unwrap();
            for (id, f) in p["ids"].as_array().unwrap().iter().zip(want) {
                let d = f64::from(row[id.as_u64().unwrap() as usize]) - f.as_f64().unwrap();
                sq += d * d;
                n += 1;
            }
            top1 += usize::from(engine::sampler::argmax(row) as u64 == p["ids"][0].as_u64().unwrap());
            positions += 1;
        }
    }
    let rms = (sq / n as f64).sqrt();
    let s = &f64["summary"]["llama_cpp"];
    let (cpp, spread) = (s["rms"].as_f64().unwrap(), f64["jitter_rms"]["max"].as_f64().unwrap());
    eprintln!(
        "top-10 logit RMS vs f64 over {positions} positions: ours {rms:.4} (top-1 equal {top1}), llama.cpp {cpp:.4} (top-1 equal {}), same-scheme spread up to {spread:.4}",
        s["top1_equal"]
    );
    assert!(positions >= 300, "the fixture scores {positions} positions");
    assert!(rms <= cpp.max(spread), "ours {rms:.4} from f64; llama.cpp {cpp:.4}, its rounding scheme up to {spread:.4}");
}

/// Gemma 3's SentencePiece tokenizer on 400 generated strings (tools/oracle/tokenizer_fixtures.py:
/// words, whitespace runs, scripts, emoji, control characters, `▁`, spelled special tokens),
/// special tokens parsed and not: every id equal to llama.cpp's, and the text given back.
#[test]
fn gemma3_tokenizer_matches_llama_cpp_on_generated_text() {
    let v = llms_tests::checked_fixture("gemma3_tokenize.json", &gemma3_path());
    let file = engine::gguf::GgufFile::open(&gemma3_path()).unwrap();
    let tk = engine::tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let cases = v["cases"].as_array().unwrap();
    assert!(cases.len() >= 400, "{} cases", cases.len());
    let mut bad = Vec::new();
    for case in cases {
        let (text, special) = (case["text"].as_str().unwrap(), case["special"].as_bool().unwrap());
        let got = tk.encode(text, false, special).unwrap();
        if got != ids(&case["ids"]) {
            bad.push(format!("{text:?} (special {special}): ours {got:?}, llama.cpp {:?}", ids(&case["ids"])));
        } else if !special {
            // SentencePiece writes spaces as `▁`, so a `▁` in the text comes back a space (as
            // llama.cpp's detokenizer gives it); everything else comes back as it was.
            assert_eq!(String::from_utf8_lossy(&tk.decode(&got, true)), text.replace('\u{2581}', " "), "detokenization of {text:?}");
        }
    }
    assert!(bad.is_empty(), "{} of {} differ:\n{}", bad.len(), cases.len(), bad.iter().take(10).cloned().collect::<Vec<_>>().join("\n"));
}

/// Gemma 3's tokenizer on 1 MB hostile inputs: each is tokenized (the merge loop is
/// O(n log n): a quadratic one does not finish) and comes back as it was.
#[test]
fn gemma3_tokenizer_takes_hostile_megabytes() {
    let file = engine::gguf::GgufFile::open(&gemma3_path()).unwrap();
    let tk = engine::tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let inputs = [
        "abcdefghij".repeat(100_000),
        "a".repeat(1 << 20),
        " ".repeat(1 << 20),
        "\n".repeat(1 << 20),
        "é".repeat(1 << 19),
        "🦀".repeat(1 << 18),
        "<start_of_turn>".repeat(70_000),
        (0u32..0x3000).filter_map(char::from_u32).filter(|c| *c != '\u{2581}').collect::<String>().repeat(30),
    ];
    for text in &inputs {
        for special in [false, true] {
            let ids = tk.encode(text, false, special).unwrap();
            assert!(!ids.is_empty());
            if !special {
                assert_eq!(tk.decode(&ids, true), text.as_bytes(), "round trip of {}...", &text[..text.floor_char_boundary(16)]);
            }
        }
    }
}

/// Gemma 3 270M is a base model: no template and no ChatML tokens, so rendering a chat is an
/// error naming why (llmsd then serves raw completions only), never ChatML spelled as text.
#[test]
fn gemma3_has_no_chat_template() {
    let m = Model::load(&gemma3_path()).unwrap();
    assert!(m.chat_template().is_none());
    let e = m.render_chat(&[engine::chat::Message::new("user", "hi")], true).unwrap_err();
    assert!(e.to_string().contains(engine::model::NO_CHAT), "{e}");
    assert_eq!(m.tokenizer.token_text(m.tokenizer.eot.unwrap()), Some("<end_of_turn>"));
}

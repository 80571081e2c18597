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
use llms_tests::{fixture, gemma3_oracle, gemma3_path, ids, model_path, oracle};
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
}

fn smollm2() -> Case {
    Case { model: Arc::new(Model::load(&model_path()).expect("load model")), oracle: oracle(), ppl_tol: 0.01 }
}

fn gemma3() -> Case {
    Case { model: Arc::new(Model::load(&gemma3_path()).expect("load Gemma 3")), oracle: gemma3_oracle(), ppl_tol: 0.005 }
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
    batched_prefill_equals_incremental_decode
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
    batched_prefill_equals_incremental_decode
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

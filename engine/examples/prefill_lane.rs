//! #56's service latencies: what a prompt joining three decoding calls costs them, in the
//! service's schedule and in another one, the engine's parts only (no HTTP, no sampling).
//!
//! - **mixed** (llmsd today): one pool of all threads; the prompt goes in 16-token pieces,
//!   each in a pass beside the three calls' decoding rows. Their gap between tokens is a
//!   piece's pass; the prompt's time is its passes.
//! - **lane**: the prompt on its own one-thread pool on another thread, while the three
//!   calls decode on a one-thread pool: their gap is a 3-row step on one thread; the prompt's
//!   time is its prefill on one thread, beside them.
//! - **solo**: one call decoding on all threads, and the prompt alone on all threads — what a
//!   lone client's gap and first token are measured against.
//!
//! Each round runs all three in turn on fresh int8 sessions (attention observed, as the
//! service's) `--depth` tokens deep; medians over the rounds, ms. The last line is JSON (for
//! `llms record`). A benchmark, not a test: it asserts nothing.
//!
//! `cargo run --release -p engine --example prefill_lane [-- ROUNDS [DEPTH [PROMPT]]]`

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use engine::kv::KvFormat;
use engine::model::{Scratch, SessionOptions};
use engine::{Logits, Model, Session, ThreadPool};
use llms_tests::{fixture, model_path};

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let arg = |i: usize, d: usize| std::env::args().nth(i).map_or(d, |s| s.parse().expect("a number"));
    let (rounds, depth, prompt_len) = (arg(1, 15), arg(2, 208), arg(3, 32));
    let m = Arc::new(Model::load(&model_path()).expect("the model"));
    let text = std::fs::read_to_string(fixture("gpl-3.txt")).expect("the fixture");
    let toks = m.tokenizer.encode(&text, false, false).expect("text");
    assert!(toks.len() >= 600 + depth + prompt_len, "the fixture is too short for that depth");
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let (all, decode_pool, lane_pool) = (Arc::new(ThreadPool::new(threads)), Arc::new(ThreadPool::new(1)), Arc::new(ThreadPool::new(1)));
    let session = |pool: &Arc<ThreadPool>, at: usize| {
        let opts = SessionOptions { capacity: 1024, chunk_tokens: 16, base: KvFormat::Int8, observe_attention: true, sliding_window: None };
        let mut s = Session::with_options(Arc::clone(&m), Arc::clone(pool), opts);
        s.eval(&toks[at..at + depth], Logits::None).expect("a context");
        s
    };
    let prompt = &toks[600 + depth..600 + depth + prompt_len];
    let (mut solo_step, mut solo_prompt) = (Vec::new(), Vec::new());
    let (mut mixed_gap, mut mixed_prompt, mut lane_gap, mut lane_worst, mut lane_prompt) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let mut s = session(&all, 0);
        let t = Instant::now();
        s.eval(&[5], Logits::Last).expect("a step");
        solo_step.push(ms(t));
        let mut q = session(&all, 600);
        let t = Instant::now();
        q.eval(prompt, Logits::Last).expect("a prompt");
        solo_prompt.push(ms(t));

        let mut three: Vec<Session> = (0..3).map(|i| session(&all, 7 * i)).collect();
        let mut q = session(&all, 600);
        let mut scratch = Scratch::default();
        let t0 = Instant::now();
        for piece in prompt.chunks(16) {
            let t = Instant::now();
            let mut batch: Vec<&mut Session> = three.iter_mut().chain(std::iter::once(&mut q)).collect();
            Session::step_batch(&mut batch, &[&[5], &[6], &[7], piece], &mut scratch).expect("a pass");
            mixed_gap.push(ms(t));
        }
        mixed_prompt.push(ms(t0));

        let mut three: Vec<Session> = (0..3).map(|i| session(&decode_pool, 7 * i)).collect();
        let mut q = session(&lane_pool, 600);
        let done = AtomicBool::new(false);
        let mut gaps = Vec::new();
        std::thread::scope(|sc| {
            let lane = sc.spawn(|| {
                let t = Instant::now();
                q.eval(prompt, Logits::Last).expect("a prompt");
                done.store(true, Ordering::Release);
                ms(t)
            });
            let mut scratch = Scratch::default();
            while !done.load(Ordering::Acquire) {
                let t = Instant::now();
                let mut batch: Vec<&mut Session> = three.iter_mut().collect();
                Session::step_batch(&mut batch, &[&[5], &[6], &[7]], &mut scratch).expect("a step");
                gaps.push(ms(t));
            }
            lane_prompt.push(lane.join().expect("the lane"));
        });
        lane_worst.push(gaps.iter().copied().fold(0.0, f64::max));
        lane_gap.extend(gaps);
    }
    let (ss, sp) = (median(solo_step), median(solo_prompt));
    let (mg, mp, lg, lw, lp) = (median(mixed_gap), median(mixed_prompt), median(lane_gap), median(lane_worst), median(lane_prompt));
    println!("{threads} threads, 3 calls decoding {depth} deep, a {prompt_len}-token prompt joining; medians of {rounds} rounds, ms");
    println!("solo:  a step {ss:.2}, the prompt alone {sp:.2}");
    println!("mixed: a pass (their gap) {mg:.2} = {:.2}x solo's step; the prompt in {mp:.2} = {:.2}x alone", mg / ss, mp / sp);
    println!(
        "lane:  a step (their gap) {lg:.2} = {:.2}x, a round's longest {lw:.2} = {:.2}x; the prompt in {lp:.2} = {:.2}x alone",
        lg / ss,
        lw / ss,
        lp / sp
    );
    println!(
        "{}",
        serde_json::json!({
            "threads": threads, "depth": depth, "prompt_tokens": prompt_len, "rounds": rounds,
            "solo_step_ms": ss, "solo_prompt_ms": sp,
            "mixed_gap_ms": mg, "mixed_prompt_ms": mp, "mixed_gap_vs_solo_step": mg / ss, "mixed_prompt_vs_alone": mp / sp,
            "lane_gap_ms": lg, "lane_worst_gap_ms": lw, "lane_prompt_ms": lp,
            "lane_gap_vs_solo_step": lg / ss, "lane_worst_vs_solo_step": lw / ss, "lane_prompt_vs_alone": lp / sp,
        })
    );
}

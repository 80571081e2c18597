//! Shared prefixes end to end (#59): the real daemon and model. Contexts of one app that open
//! with the same system prompt take its chunks from the first instead of computing them, and
//! answer exactly as without sharing; another app never finds them; under a budget that
//! evicts the shared chunks the answers stay the same.

mod common;

use common::{kernel_ok, Daemon};
use llmsd::client::Client;
use llmsd::proto::{Call, CallStats};

/// A system prompt of several chunks (~150 tokens of the default model).
fn system_prompt() -> String {
    let line = "You answer questions about the weather in the mountains, briefly and with care. ";
    line.repeat(8)
}

const QUESTIONS: [&str; 4] = ["Will it snow tomorrow?", "Is it windy on the ridge?", "Should I bring a coat?", "How cold is it at night?"];

fn call(c: &mut Client, ctx: &str, prompt: &str) -> (String, CallStats) {
    let call =
        Call { ctx: ctx.into(), prompt: prompt.into(), max_tokens: 10, temperature: 0.0, seed: 0, stop: vec![], raw: false, top_p: None };
    c.call(&call, &mut |_| {}).expect("call")
}

/// Each of `n` contexts of app `app` opens with the system prompt and gets its question, then
/// a second turn; the answers and each first call's stats.
fn conversations(c: &mut Client, n: usize) -> (Vec<String>, Vec<CallStats>) {
    let sys = system_prompt();
    let mut texts = Vec::new();
    let mut firsts = Vec::new();
    for k in 0..n {
        let id = c.new_ctx(Some(&sys)).expect("new_ctx");
        let (t, st) = call(c, &id, QUESTIONS[k % QUESTIONS.len()]);
        texts.push(t);
        firsts.push(st);
        texts.push(call(c, &id, "And the day after?").0);
    }
    (texts, firsts)
}

#[test]
fn contexts_with_one_system_prompt_share_it_and_answer_as_without() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // One KV level: a shared chunk is then exactly the chunk each context would compute.
    let exact = "levels = [\"int8\"]\nratio = 1.0\n";
    let run = |name: &str, settings: &str| {
        let d = Daemon::start(dir.path(), name, &dir.path().join(name), &format!("{exact}{settings}"));
        let mut a = d.client("weather");
        let out = conversations(&mut a, 3);
        let mut b = d.client("other-app");
        let other = conversations(&mut b, 1);
        let st = a.stats().unwrap();
        d.stop();
        (out, other, st)
    };
    let ((plain, plain_st), _, _) = run("plain", "prefix_sharing = false\nbudget = \"1GiB\"\n");
    assert!(plain_st.iter().all(|s| s.cached_tokens == 0), "nothing is shared with prefix_sharing = false");
    for (name, budget) in [("shared", "\"1GiB\""), ("shared-tight", "\"2MiB\"")] {
        let ((texts, firsts), (_, other), st) = run(name, &format!("budget = {budget}\n"));
        assert_eq!(texts, plain, "{name}: every answer is the one computed without sharing");
        assert_eq!(firsts[0].cached_tokens, 0, "{name}: the first context computes its prompt");
        for (k, f) in firsts.iter().enumerate().skip(1) {
            // The system prompt's whole chunks (BOS, the system turn), at least 128 tokens.
            assert!(f.cached_tokens >= 128, "{name}: context {k} took the shared prefix: {f:?}");
            assert!(f.cached_tokens < f.prompt_tokens);
        }
        assert_eq!(other[0].cached_tokens, 0, "{name}: another app never finds this app's prefix");
        if name == "shared-tight" {
            assert!(st.evicted_chunks > 0, "the budget evicted chunks: {st:?}");
        }
    }
}

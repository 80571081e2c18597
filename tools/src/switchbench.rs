//! `llms bench-switch`: the service's switch latency (call received → context ready) and
//! time to first token, for a context that is resident, partly evicted, fully evicted, and
//! under `lmk` (recomputed whole) — the whole service in process, over a real socket.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use llmsd::client::Client;
use llmsd::config::Config;
use llmsd::proto::{Call, CallStats};
use llmsd::service::Local;
use llmsd::stats::median;

/// One scenario's medians.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub tokens: usize,
    pub scenario: &'static str,
    pub switch_ms: f64,
    pub ttft_ms: f64,
    pub missing_chunks: f64,
    pub read_chunks: f64,
    pub recomputed_chunks: f64,
    /// KV bytes read from flash per switch.
    pub read_bytes: f64,
    /// The context as built (before the scenarios): KV bytes resident and on flash, and what
    /// every layer of its chunks would take at their levels (more than either when a
    /// sliding-window model's old chunks kept only their global layers).
    pub resident_bytes: u64,
    pub flash_bytes: u64,
    pub every_layer_bytes: u64,
}

/// A budget nothing here reaches: the machine's memory, the most llmsd accepts (a larger one is
/// refused since budgets are checked against it).
fn unlimited() -> usize {
    llmsd::config::physical_memory().map_or(1 << 34, |b| usize::try_from(b).unwrap_or(usize::MAX))
}

fn call(c: &mut Client, ctx: &str, prompt: &str) -> Result<CallStats> {
    let call =
        Call { ctx: ctx.into(), prompt: prompt.into(), max_tokens: 1, temperature: 0.0, seed: 0, stop: vec![], raw: true, top_p: None };
    Ok(c.call(&call, &mut |_| {})?.1)
}

/// Text of about `n` tokens of this model (plain English, varied so chunks differ).
fn text_of(model_path: &Path, n: usize) -> Result<String> {
    let model = engine::Model::load(model_path)?;
    let words = ["memory", "service", "context", "flash", "kernel", "budget", "switch", "chunk", "device", "model"];
    let mut s = String::new();
    let mut i = 0usize;
    while model.tokenizer.encode(&s, false, false)?.len() < n {
        for _ in 0..64 {
            s.push_str(words[(i * 7 + i / 10) % words.len()]);
            s.push(if i % 13 == 12 { '.' } else { ' ' });
            i += 1;
        }
    }
    Ok(s)
}

/// Runs every scenario for contexts of each size in `tokens`; `base` gives the model, threads,
/// levels and ratio; the state directory is a fresh one under `work` (the load profile is
/// copied in from `profile_dir` when there is one, else measured).
pub fn run(base: &Config, tokens: &[usize], reps: usize, work: &Path, profile_dir: &Path) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &n in tokens {
        let state = work.join(format!("switch-{n}"));
        crate::loadbench::fresh_state(&state, profile_dir)?;
        let cfg = |budget: usize, policy: &str| Config {
            socket: work.join("bench.sock"),
            state_dir: state.clone(),
            budget: budget.to_string(),
            policy: policy.into(),
            pressure: false,
            max_context_tokens: (n + 256).next_power_of_two().max(base.max_context_tokens),
            ..base.clone()
        };
        // Two contexts of n tokens, built with memory to spare.
        let text = text_of(&base.model, n)?;
        let r = Local::start(cfg(unlimited(), "llms"))?;
        let mut c = Client::connect(&r.socket, "bench")?;
        let ids = [c.new_ctx(None)?, c.new_ctx(None)?];
        for id in &ids {
            call(&mut c, id, &text)?;
        }
        let built = c.stats()?.mine.into_iter().max_by_key(|x| x.resident_bytes).context("no contexts")?;
        let size = usize::try_from(built.resident_bytes).unwrap_or(usize::MAX);
        drop(c);
        r.stop()?;
        // The eviction scenarios' budgets are a context and a share of one: llmsd takes none
        // under its floor.
        let floor = llmsd::config::MIN_BUDGET;
        if size + size / 8 < floor {
            bail!(
                "--tokens {n}: a context of {} KiB is too small to evict from (a budget is at least {} KiB); use more tokens",
                size >> 10,
                floor >> 10
            );
        }
        // Each scenario restarts the service over the same store with its budget and
        // alternates calls between the two contexts: each switch finds the other context's
        // memory gone (fully), half gone (partly), or still there (resident).
        let scenarios: [(&'static str, usize, &str); 4] = [
            ("resident", unlimited(), "llms"),
            ("partly evicted", size + size / 2, "llms"),
            ("fully evicted", size + size / 8, "llms"),
            ("recompute all (lmk)", size + size / 8, "lmk"),
        ];
        let mut flash_bytes = None;
        for (name, budget, policy) in scenarios {
            let r = Local::start(cfg(budget, policy))?;
            let mut c = Client::connect(&r.socket, "bench")?;
            // What the built contexts left on flash (every write is done once the service
            // that built them stopped).
            if flash_bytes.is_none() {
                flash_bytes = c.stats()?.mine.iter().map(|x| x.flash_bytes).max();
            }
            // The first round brings both in after the restart; then measure.
            for id in &ids {
                call(&mut c, id, " ok")?;
            }
            let mut st = Vec::new();
            for _ in 0..reps {
                for id in &ids {
                    st.push(call(&mut c, id, " ok")?);
                }
            }
            drop(c);
            r.stop()?;
            let med = |f: &dyn Fn(&CallStats) -> f64| median(st.iter().map(f).collect());
            rows.push(Row {
                tokens: n,
                scenario: name,
                switch_ms: med(&|s| s.switch_ms),
                ttft_ms: med(&|s| s.ttft_ms),
                missing_chunks: med(&|s| f64::from(s.missing_chunks)),
                read_chunks: med(&|s| f64::from(s.read_chunks)),
                recomputed_chunks: med(&|s| f64::from(s.recomputed_chunks)),
                read_bytes: med(&|s| s.read_bytes as f64),
                resident_bytes: built.resident_bytes,
                flash_bytes: flash_bytes.unwrap_or(0),
                every_layer_bytes: built.every_layer_bytes,
            });
        }
        let _ = std::fs::remove_dir_all(&state);
    }
    Ok(rows)
}

//! `llms bench-prefix`: shared prefixes (#59), each figure beside the same run with
//! `prefix_sharing = false` on the same machine. The service runs in process.
//!
//! - **Conversations**: N conversations of one app open with the same system prompt of about
//!   S tokens, then each asks its own question and a second turn. Reported: the KV bytes the
//!   service holds after them (resident + allocated in the swap store, once the leveller and the
//!   AoT writer are done), the time to first token of the first conversation and the median of
//!   the others, the tokens the others took from the first, and whether every answer is the one
//!   computed without sharing.
//! - **Fork**: a context of F tokens forked R times (each fork deleted after): the round trip of
//!   `fork` as the client sees it (the service's work, the context file's fsync, the socket),
//!   the service's time in mm and on the file beside the floor of making an empty file durable
//!   on the same disk (timed after each fork), and the resident bytes it added.
//! - **Branch**: a conversation of T turns through the OpenAI front, then the same history with
//!   the last user message edited: the front branches, and its time to first token and
//!   `cached_tokens` are measured against the same request without sharing.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use serde::Serialize;
use serde_json::{json, Value};

use llmsd::client::Client;
use llmsd::config::Config;
use llmsd::proto::Call;
use llmsd::service::Local;
use llmsd::stats::median;

use crate::httpbench::{message, Http};

/// What the benchmark runs.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Shape {
    pub conversations: usize,
    pub system_tokens: usize,
    pub max_tokens: usize,
    pub fork_tokens: usize,
    pub fork_reps: usize,
    pub branch_turns: usize,
    pub branch_reps: usize,
}

/// One side's conversations.
#[derive(Debug, Clone, Serialize)]
pub struct Conversations {
    pub resident_bytes: u64,
    pub stored_bytes: u64,
    pub kv_bytes: u64,
    pub ttft_first_ms: f64,
    /// The median over conversations 2..N.
    pub ttft_rest_ms: f64,
    pub cached_tokens_rest: u64,
    pub prompt_tokens_first: u64,
    /// Another app then opens a conversation with the same system prompt and first question:
    /// its TTFT and the tokens it took (none: it never sees the first app's chunks).
    pub other_app_ttft_ms: f64,
    pub other_app_cached_tokens: u64,
    #[serde(skip)]
    pub answers: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Fork {
    pub tokens: u64,
    /// The first fork of the context: its full chunks become pool chunks then (promoted in
    /// place: bookkeeping per chunk, their records queued for the AoT writer under the pool's
    /// name), so this one costs more. `first_own_ms` as `own_ms_p50`, for this fork.
    pub first_round_trip_ms: f64,
    pub first_mm_ms: f64,
    pub first_own_ms: f64,
    /// The medians over the forks after the first (the chunks already in the pool).
    pub round_trip_ms_p50: f64,
    pub round_trip_ms_max: f64,
    /// Of the service's time, the median in mm (chunks shared, the partial one copied) and
    /// writing the new context's file (fsynced before the answer).
    pub mm_ms_p50: f64,
    pub file_ms_p50: f64,
    /// The floor under the file: an empty file made durable beside the state directory the
    /// same way (written, fsynced, renamed into place, its directory fsynced), timed after
    /// each fork (the median): what any acknowledged context's file costs on this disk.
    pub file_floor_ms_p50: f64,
    /// The service's own part: mm's time and the file's time above its floor (medians).
    pub own_ms_p50: f64,
    /// Resident KV bytes one fork added (the median).
    pub resident_added_bytes: u64,
    /// A chunk of this model at the base level, for scale.
    pub chunk_bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Branch {
    pub turns: usize,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub ttft_shared_ms: f64,
    pub ttft_plain_ms: f64,
    /// The median of the reps' paired ratios, plain over shared (each pair run back to back,
    /// both services up; since this build, before it the ratio of the medians of each side's
    /// reps run minutes apart).
    pub speedup: f64,
    /// The engine alone, same run, the service stopped: one forward pass of the prompt tokens
    /// that were not cached, after the cached ones, its KV in the service's base level
    /// (median of 5; runs up to 68712b5's timed it in f16, ~4% slower than the default int8
    /// here: `llms bench --kv f16,int8 -d 647 --pp 50`). Any TTFT of the branch
    /// includes it; what the service adds is `ttft_shared_ms` above it.
    pub engine_floor_ms: f64,
    /// `ttft_plain_ms / engine_floor_ms`: the most a branch sharing these cached tokens can
    /// gain (the edited turn's own tokens and the chunk tail are prefilled in any case).
    pub speedup_floor: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    #[serde(flatten)]
    pub shape: Shape,
    pub levels: Vec<String>,
    pub shared: Conversations,
    pub plain: Conversations,
    /// KV bytes with sharing over without.
    pub kv_bytes_vs_plain: f64,
    /// Conversations 2..N's TTFT over the first's, with sharing.
    pub ttft_rest_vs_first: f64,
    /// Another app's TTFT for the first conversation's prompt over the first's, with sharing
    /// (about 1: what the first app holds does not show in another's timing).
    pub other_app_vs_first: f64,
    /// Answers identical to the run without sharing, of all.
    pub identical_answers: usize,
    pub answers: usize,
    pub fork: Fork,
    pub branch: Branch,
}

/// One side's figures: its conversations, its fork (with sharing), its branches.
type Side = (Conversations, Option<Fork>);

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A system prompt of about `n` tokens of `text` (whole words, cut at a token boundary).
fn system_prompt(model: &engine::Model, text: &str, n: usize) -> Result<String> {
    let ids = model.tokenizer.encode(text, false, false)?;
    if ids.len() < n {
        bail!("the text holds {} tokens, fewer than --system-tokens {n}", ids.len());
    }
    Ok(String::from_utf8_lossy(&model.tokenizer.decode(&ids[..n], false)).into_owned())
}

const QUESTIONS: [&str; 8] = [
    "Summarize the first paragraph in one sentence.",
    "What is the most important obligation described?",
    "Who does this apply to?",
    "Name one thing that is not allowed.",
    "What happens when a condition is broken?",
    "Explain one defined term.",
    "Is there a warranty?",
    "What should a reader do first?",
];

fn run_conversations(l: &Local, shape: &Shape, sys: &str) -> Result<Conversations> {
    let mut c = Client::connect(&l.socket, "bench-prefix")?;
    let call = |c: &mut Client, ctx: &str, prompt: &str| -> Result<(String, llmsd::proto::CallStats)> {
        let call = Call {
            ctx: ctx.into(),
            prompt: prompt.into(),
            max_tokens: u32::try_from(shape.max_tokens)?,
            temperature: 0.0,
            seed: 0,
            stop: vec![],
            raw: false,
            top_p: None,
        };
        Ok(c.call(&call, &mut |_| {})?)
    };
    let (mut answers, mut ttft, mut cached, mut prompt_first) = (Vec::new(), Vec::new(), Vec::new(), 0);
    for k in 0..shape.conversations {
        let id = c.new_ctx(Some(sys))?;
        let (t, st) = call(&mut c, &id, QUESTIONS[k % QUESTIONS.len()])?;
        if k == 0 {
            prompt_first = u64::from(st.prompt_tokens);
        }
        ttft.push(st.ttft_ms);
        cached.push(f64::from(st.cached_tokens));
        answers.push(t);
        answers.push(call(&mut c, &id, "Say more about that.")?.0);
    }
    let (resident, stored) = l.svc.kv_footprint(Duration::from_secs(60));
    let mut other = Client::connect(&l.socket, "bench-prefix-other")?;
    let id = other.new_ctx(Some(sys))?;
    let (_, ost) = call(&mut other, &id, QUESTIONS[0])?;
    Ok(Conversations {
        resident_bytes: resident,
        stored_bytes: stored,
        kv_bytes: resident + stored,
        ttft_first_ms: ttft[0],
        ttft_rest_ms: median(ttft[1..].to_vec()),
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        cached_tokens_rest: median(cached[1..].to_vec()) as u64,
        prompt_tokens_first: prompt_first,
        other_app_ttft_ms: ost.ttft_ms,
        other_app_cached_tokens: u64::from(ost.cached_tokens),
        answers,
    })
}

/// An empty file made durable in `dir` as the service makes a context's file (a temporary
/// file fsynced, renamed into place, the directory fsynced): the floor of any such save.
fn durable_empty_file_ms(dir: &Path) -> Result<f64> {
    let (tmp, to) = (dir.join("floor.tmp"), dir.join("floor"));
    let t0 = Instant::now();
    std::fs::File::create(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, &to)?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(ms(t0.elapsed()))
}

fn run_fork(l: &Local, shape: &Shape, chunk_bytes: u64, floor_dir: &Path) -> Result<Fork> {
    let mut c = Client::connect(&l.socket, "bench-fork")?;
    let src = c.new_ctx(None)?;
    let mut k = 0;
    while c.list()?.iter().find(|x| x.ctx == src).map_or(0, |x| x.tokens as usize) < shape.fork_tokens {
        let call = Call {
            ctx: src.clone(),
            prompt: message(k, 400),
            max_tokens: 1,
            temperature: 0.0,
            seed: 0,
            stop: vec![],
            raw: true,
            top_p: None,
        };
        c.call(&call, &mut |_| {})?;
        k += 1;
    }
    let tokens = u64::from(c.list()?.iter().find(|x| x.ctx == src).map_or(0, |x| x.tokens));
    let (mut rt, mut added, mut in_mm, mut file) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut floor, mut own) = (Vec::new(), Vec::new());
    std::fs::create_dir_all(floor_dir)?;
    for _ in 0..shape.fork_reps {
        let (before, _) = l.svc.kv_footprint(Duration::ZERO);
        let t0 = Instant::now();
        let id = c.fork(&src)?;
        rt.push(ms(t0.elapsed()));
        let (m, f) = l.svc.last_fork_ms();
        in_mm.push(m);
        file.push(f);
        let fl = durable_empty_file_ms(floor_dir)?;
        floor.push(fl);
        own.push(m + (f - fl).max(0.0));
        let (after, _) = l.svc.kv_footprint(Duration::ZERO);
        #[allow(clippy::cast_precision_loss)]
        added.push(after.saturating_sub(before) as f64);
        c.del_ctx(&id)?;
    }
    let (first_rt, first_mm, first_own) = (rt[0], in_mm[0], own[0]);
    if rt.len() > 1 {
        rt.remove(0);
        in_mm.remove(0);
        file.remove(0);
        floor.remove(0);
        own.remove(0);
        added.remove(0);
    }
    let max = rt.iter().copied().fold(0.0, f64::max);
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    Ok(Fork {
        tokens,
        first_round_trip_ms: first_rt,
        first_mm_ms: first_mm,
        first_own_ms: first_own,
        round_trip_ms_p50: median(rt),
        round_trip_ms_max: max,
        mm_ms_p50: median(in_mm),
        file_ms_p50: median(file),
        file_floor_ms_p50: median(floor),
        own_ms_p50: median(own),
        resident_added_bytes: median(added) as u64,
        chunk_bytes,
    })
}

/// One branched request's (TTFT, usage): a conversation of `branch_turns` turns in its own app,
/// then its last user message edited.
fn branch_rep(h: &mut Http, shape: &Shape, tag: &str, r: usize) -> Result<(Duration, Value)> {
    let app = format!("bench-branch-{tag}{r}");
    let mut msgs = vec![json!({"role": "system", "content": "You are a helpful assistant. Answer briefly."})];
    for k in 0..shape.branch_turns {
        msgs.push(json!({"role": "user", "content": message(k + r, 40)}));
        let (reply, _, _) = h.turn(&app, &msgs, 16)?;
        msgs.push(json!({"role": "assistant", "content": reply}));
    }
    // The last user message edited: the front branches at it.
    msgs.pop();
    let last = msgs.len() - 1;
    msgs[last] = json!({"role": "user", "content": message(1000 + r, 40)});
    let (_, ttft, usage) = h.turn(&app, &msgs, 16)?;
    Ok((ttft, usage))
}

/// Runs both sides; `base` gives the model, threads and levels.
pub fn run(base: &Config, shape: Shape, work: &Path, profile_dir: &Path, text: &str) -> Result<Report> {
    let model = engine::Model::load(&base.model).with_context(|| format!("loading {}", base.model.display()))?;
    let sys = system_prompt(&model, text, shape.system_tokens)?;
    let codec = llmsd::kvmm::EngineCodec::new(&model, base.chunk_tokens);
    let chunk_bytes = codec.geom.chunk_bytes(base.level_formats()?[0]) as u64;
    drop(model);
    // A side's service, in state directory `name` (fresh) with its own sockets.
    let config = |sharing: bool, name: &str| -> Result<Config> {
        let state = work.join(name);
        crate::loadbench::fresh_state(&state, profile_dir)?;
        let cfg = Config {
            socket: work.join(format!("{name}.sock")),
            state_dir: state.clone(),
            budget: "1GiB".into(),
            pressure: false,
            prefix_sharing: sharing,
            max_contexts_per_app: 64,
            max_context_tokens: (shape.fork_tokens + 512).max(shape.system_tokens + 512).next_power_of_two(),
            ..base.clone()
        };
        cfg.validate()?;
        Ok(cfg)
    };
    let side = |sharing: bool| -> Result<Side> {
        let name = if sharing { "shared" } else { "plain" };
        let cfg = config(sharing, name)?;
        let l = Local::start(cfg)?;
        let r = (|| {
            let conv = run_conversations(&l, &shape, &sys)?;
            // The floor's directory on the state directory's file system, beside it.
            let fork = if sharing { Some(run_fork(&l, &shape, chunk_bytes, &work.join("fsync-floor"))?) } else { None };
            Ok((conv, fork))
        })();
        l.stop()?;
        let _ = std::fs::remove_dir_all(work.join(name));
        r
    };
    let (plain, _) = side(false)?;
    let (shared, fork) = side(true)?;
    let fork = fork.context("the fork ran")?;
    // The branch: both services up at once and their reps alternated, the order flipped each
    // rep, so a drift of this shared host's speed falls on both sides alike (one side's reps
    // after the other's put minutes between them: 8.7-10.0x between runs of one build).
    let (pb, sb) = {
        let (lp, ls) = (Local::start(config(false, "plain-branch")?)?, Local::start(config(true, "shared-branch")?)?);
        let r = (|| {
            let mut hp = Http::new(&lp.svc.config().http_socket_path().context("an HTTP socket")?)?;
            let mut hs = Http::new(&ls.svc.config().http_socket_path().context("an HTTP socket")?)?;
            let (mut pb, mut sb) = (Vec::new(), Vec::new());
            for r in 0..shape.branch_reps {
                if r % 2 == 0 {
                    pb.push(branch_rep(&mut hp, &shape, "p", r)?);
                    sb.push(branch_rep(&mut hs, &shape, "s", r)?);
                } else {
                    sb.push(branch_rep(&mut hs, &shape, "s", r)?);
                    pb.push(branch_rep(&mut hp, &shape, "p", r)?);
                }
            }
            Ok::<_, anyhow::Error>((pb, sb))
        })();
        let stopped = (lp.stop(), ls.stop());
        let _ = std::fs::remove_dir_all(work.join("plain-branch"));
        let _ = std::fs::remove_dir_all(work.join("shared-branch"));
        stopped.0?;
        stopped.1?;
        r?
    };
    let cached = |u: &Value| u.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64).unwrap_or(0);
    if let Some((_, u)) = pb.iter().find(|(_, u)| cached(u) > 0) {
        bail!("a branch without sharing took cached tokens: {u}");
    }
    let (ts, tp) = (median(sb.iter().map(|x| ms(x.0)).collect()), median(pb.iter().map(|x| ms(x.0)).collect()));
    let speedup = median(pb.iter().zip(&sb).map(|(p, s)| ms(p.0) / ms(s.0)).collect());
    let u0 = &sb[0].1;
    let (prompt_tokens, cached_tokens) = (u0["prompt_tokens"].as_u64().unwrap_or(0), cached(u0));
    let engine_floor_ms = {
        let model = Arc::new(engine::Model::load(&base.model)?);
        let pool = Arc::new(engine::ThreadPool::new(base.pool_threads()));
        let ids = model.tokenizer.encode(text, false, false)?;
        let (depth, rest) = (usize::try_from(cached_tokens)?, usize::try_from(prompt_tokens.saturating_sub(cached_tokens))?.max(1));
        if ids.len() < depth + rest {
            bail!("the text holds {} tokens, fewer than the branch's {}", ids.len(), depth + rest);
        }
        crate::servebench::batch_prefill(&model, &pool, &ids, 1, depth, rest, 5, base.level_formats()?[0])?
    };
    let branch = Branch {
        turns: shape.branch_turns,
        prompt_tokens,
        cached_tokens,
        ttft_shared_ms: ts,
        ttft_plain_ms: tp,
        speedup,
        engine_floor_ms,
        speedup_floor: tp / engine_floor_ms,
    };
    let identical = plain.answers.iter().zip(&shared.answers).filter(|(a, b)| a == b).count();
    #[allow(clippy::cast_precision_loss)]
    Ok(Report {
        shape,
        levels: base.levels.clone(),
        kv_bytes_vs_plain: shared.kv_bytes as f64 / plain.kv_bytes as f64,
        ttft_rest_vs_first: shared.ttft_rest_ms / shared.ttft_first_ms,
        other_app_vs_first: shared.other_app_ttft_ms / shared.ttft_first_ms,
        identical_answers: identical,
        answers: plain.answers.len(),
        shared,
        plain,
        fork,
        branch,
    })
}

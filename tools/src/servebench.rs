//! `llms bench-serve`: many apps calling llmsd at once. N clients, each on its own connection
//! and context, make M calls each (a raw prompt of about P tokens of text, then T tokens
//! generated greedily) at the same time; the run reports the aggregate decode rate and, from
//! the streamed events as the clients saw them, time to first token and inter-token latency
//! percentiles. The service runs in process with `max_batch` (1: batching off), or is reached
//! at `--socket`.
//!
//! With `--long-prefill L`, one more client sends calls of an L-token prompt on fresh contexts
//! (one token each) all through the run: the others' inter-token latency then shows what a long
//! prefill arriving during their decoding costs them.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Instant;

use anyhow::{anyhow, bail, Context as _, Result};
use serde::Serialize;

use llmsd::client::Client;
use llmsd::config::Config;
use llmsd::proto::Call;
use llmsd::service::Local;
use llmsd::stats::{median, percentile};

/// What the clients do.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Load {
    pub clients: usize,
    pub calls: usize,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    /// Tokens of the interfering prompts (0: none).
    pub long_prefill: usize,
}

/// The run's figures: rates in tokens/s, latencies in ms (percentiles over every token of every
/// call but the interfering ones).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    #[serde(flatten)]
    pub load: Load,
    /// The service's `max_batch` (0: an outside service, not known).
    pub max_batch: usize,
    pub aggregate_tok_s: f64,
    pub ttft_ms_p50: f64,
    pub ttft_ms_p99: f64,
    pub itl_ms_p50: f64,
    pub itl_ms_p99: f64,
    /// The gaps' mean: with every client waiting for its tokens, about the clients over the
    /// aggregate rate (what the cores' share a client gets allows, whatever the schedule).
    pub itl_ms_mean: f64,
    pub output_tokens: u64,
    /// Calls whose answers came with more than one call in a pass at some step.
    pub batched_calls: u64,
    pub long_prefill_calls: u64,
    pub seconds: f64,
    /// The worker's time while calls decoded, by what it did (`--trace`; in-process only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker: Option<WorkerTime>,
}

/// Where the worker's time went over the steps in which some call decoded (each such step is
/// one inter-token gap for the calls in it): ms in total and per step at the median and p99,
/// and the slowest steps whole.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerTime {
    pub steps: usize,
    pub admit_ms: f64,
    pub pass_ms: f64,
    /// Around the passes: before (tokens into contexts, pieces cut) and after (sampling).
    pub prep_ms: f64,
    pub sample_ms: f64,
    pub finish_ms: f64,
    pub step_ms_p50: f64,
    pub step_ms_p99: f64,
    pub slowest: Vec<llmsd::service::StepTrace>,
    /// From the end of the pass that made a token to its client's receipt (every token but
    /// a call's first, which a call on the prefill lane takes there), ms.
    pub delivery_ms_p50: f64,
    pub delivery_ms_p99: f64,
    /// The longest gaps the clients saw, each beside the steps that made it.
    pub slowest_gaps: Vec<Gap>,
}

/// A gap in a call's stream as its client saw it, set beside the worker's steps: which
/// step's pass made the later token, how many passes ended inside the gap, and the token's
/// way from that pass to the client.
#[derive(Debug, Clone, Serialize)]
pub struct Gap {
    pub ms: f64,
    pub client: usize,
    pub call: usize,
    /// The later token's place in the call's stream (1: the gap after its first token).
    pub token: usize,
    /// The call's prompt ran on the prefill lane, where its first token was sampled.
    pub lane: bool,
    /// Worker passes that ended inside the gap (1: the gap is one step).
    pub passes: usize,
    /// The step whose pass made the later token (the last pass to end before it arrived).
    pub step: Option<llmsd::service::StepTrace>,
    /// From that pass's end to the client's receipt, ms (none: no pass had ended).
    pub delivery_ms: Option<f64>,
}

/// One call's tokens as its client received them, ms from the trace's start (`--trace`).
#[derive(Debug, Clone, Serialize)]
pub struct CallTokens {
    pub client: usize,
    pub call: usize,
    pub lane: bool,
    pub at_ms: Vec<f64>,
}

/// When a step's pass ended, ms from the trace's start.
fn pass_end(s: &llmsd::service::StepTrace) -> f64 {
    s.at_ms + s.admit_ms + s.prep_ms + s.pass_ms
}

/// Every gap of every call beside the steps (`steps` in the order they ran, so their pass
/// ends increase).
fn gaps_beside(steps: &[llmsd::service::StepTrace], calls: &[CallTokens]) -> Vec<Gap> {
    let ends: Vec<f64> = steps.iter().map(pass_end).collect();
    let mut gaps = Vec::new();
    for c in calls {
        for (k, w) in c.at_ms.windows(2).enumerate() {
            // Passes that ended after the earlier token arrived and before the later one.
            let (lo, hi) = (ends.partition_point(|&e| e <= w[0]), ends.partition_point(|&e| e <= w[1]));
            let step = hi.checked_sub(1).map(|i| steps[i]);
            gaps.push(Gap {
                ms: w[1] - w[0],
                client: c.client,
                call: c.call,
                token: k + 1,
                lane: c.lane,
                passes: hi.saturating_sub(lo),
                delivery_ms: step.map(|s| w[1] - pass_end(&s)),
                step,
            });
        }
    }
    gaps
}

impl WorkerTime {
    fn of(steps: &[llmsd::service::StepTrace], calls: &[CallTokens]) -> Self {
        let decoding: Vec<_> = steps.iter().filter(|s| s.decode_rows > 0).copied().collect();
        let total = |f: fn(&llmsd::service::StepTrace) -> f64| decoding.iter().map(f).sum();
        let len = |s: &llmsd::service::StepTrace| s.admit_ms + s.prep_ms + s.pass_ms + s.sample_ms + s.finish_ms;
        let mut lens: Vec<f64> = decoding.iter().map(len).collect();
        let mut slowest = decoding.clone();
        slowest.sort_by(|a, b| len(b).total_cmp(&len(a)));
        slowest.truncate(5);
        let mut gaps = gaps_beside(steps, calls);
        let mut delivery: Vec<f64> = gaps.iter().filter_map(|g| g.delivery_ms).collect();
        gaps.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        gaps.truncate(5);
        Self {
            steps: decoding.len(),
            admit_ms: total(|s| s.admit_ms),
            pass_ms: total(|s| s.pass_ms),
            prep_ms: total(|s| s.prep_ms),
            sample_ms: total(|s| s.sample_ms),
            finish_ms: total(|s| s.finish_ms),
            step_ms_p50: percentile(&mut lens, 0.5),
            step_ms_p99: percentile(&mut lens, 0.99),
            slowest,
            delivery_ms_p50: percentile(&mut delivery, 0.5),
            delivery_ms_p99: percentile(&mut delivery, 0.99),
            slowest_gaps: gaps,
        }
    }
}

/// `n` tokens of the text from token `at` (wrapping), as text: distinct prompts per client and
/// call, real prose.
fn prompt(tk: &engine::Tokenizer, ids: &[u32], at: usize, n: usize) -> String {
    let piece: Vec<u32> = (0..n).map(|k| ids[(at + k) % ids.len()]).collect();
    String::from_utf8_lossy(&tk.decode(&piece, false)).into_owned()
}

/// A raw greedy call: the prompt's text continued.
fn call(ctx: &str, prompt: String, max_tokens: u32) -> Call {
    Call { ctx: ctx.into(), prompt, max_tokens, temperature: 0.0, seed: 0, stop: Vec::new(), raw: true, top_p: None }
}

/// Starts the service in process under `work` (unless `socket` names one) and runs the load;
/// `trace`: record the worker's steps, summarized in the report and written whole to the file.
pub fn run(
    base: &Config,
    load: Load,
    socket: Option<&Path>,
    work: &Path,
    profile_dir: &Path,
    text: &str,
    trace: Option<&Path>,
) -> Result<Report> {
    let model = engine::Model::load(&base.model).with_context(|| format!("loading {}", base.model.display()))?;
    let ids = model.tokenizer.encode(text, false, false)?;
    if ids.len() < 2 * load.prompt_tokens.max(load.long_prefill) {
        bail!("the text is too short for {} prompt tokens", load.prompt_tokens.max(load.long_prefill));
    }
    let tk = &model.tokenizer;
    let prompts: Vec<Vec<String>> = (0..load.clients)
        .map(|c| (0..load.calls).map(|k| prompt(tk, &ids, (c * 7919 + k * 104_729) % ids.len(), load.prompt_tokens)).collect())
        .collect();
    let long = prompt(tk, &ids, ids.len() / 2, load.long_prefill);
    drop(model);
    let (local, sock) = match socket {
        Some(s) => (None, s.to_path_buf()),
        None => {
            let state = work.join("serve");
            crate::loadbench::fresh_state(&state, profile_dir)?;
            let cfg = Config {
                socket: work.join("bench.sock"),
                state_dir: state,
                pressure: false,
                http_socket: Some(PathBuf::new()),
                ..base.clone()
            };
            let l = Local::start(cfg)?;
            let s = l.socket.clone();
            (Some(l), s)
        }
    };
    let since = local.as_ref().and_then(|l| l.svc.set_trace(trace.is_some()));
    let r = drive(prompts, long, load, &sock, since);
    let steps = local.as_ref().map(|l| l.svc.take_trace()).unwrap_or_default();
    if let Some(l) = local {
        l.stop()?;
    }
    let (mut r, calls) = r?;
    if let Some(path) = trace {
        if socket.is_some() {
            bail!("--trace needs the service in process (not --socket)");
        }
        let file = serde_json::json!({ "steps": steps, "tokens": calls });
        std::fs::write(path, serde_json::to_string(&file)?).with_context(|| format!("writing {}", path.display()))?;
        r.worker = Some(WorkerTime::of(&steps, &calls));
    }
    r.max_batch = if socket.is_some() { 0 } else { base.max_batch };
    Ok(r)
}

/// Per call: time to first token, the gaps between tokens, tokens, the most calls in a pass,
/// and its tokens against the trace's clock (with `since`).
type CallFigures = (f64, Vec<f64>, u64, u32, Option<CallTokens>);

/// `since`: the instant the worker's trace counts from (`--trace`): the clients then stamp
/// each token against it too.
fn drive(prompts: Vec<Vec<String>>, long: String, load: Load, sock: &Path, since: Option<Instant>) -> Result<(Report, Vec<CallTokens>)> {
    let Load { clients, max_tokens, long_prefill, .. } = load;
    let start = Arc::new(Barrier::new(clients + 1 + usize::from(long_prefill > 0)));
    let done = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    let max_tokens = u32::try_from(max_tokens)?;
    for (c, prompts) in prompts.into_iter().enumerate() {
        let (start, sock) = (Arc::clone(&start), sock.to_path_buf());
        threads.push(std::thread::spawn(move || -> Result<Vec<CallFigures>> {
            let mut cl = Client::connect(&sock, &format!("bench-serve{c}"))?;
            let ctx = cl.new_ctx(None)?;
            start.wait();
            let mut out = Vec::new();
            for (k, p) in prompts.into_iter().enumerate() {
                let call = call(&ctx, p, max_tokens);
                let t0 = Instant::now();
                let mut stamps = Vec::new();
                let (_, st) = cl.call(&call, &mut |_| stamps.push(t0.elapsed().as_secs_f64() * 1e3))?;
                let Some(&first) = stamps.first() else { continue };
                let gaps = stamps.windows(2).map(|w| w[1] - w[0]).collect();
                // The same stamps on the trace's clock: shifted by where the call began on it.
                let tokens = since.map(|s| {
                    let off = t0.saturating_duration_since(s).as_secs_f64() * 1e3;
                    CallTokens { client: c, call: k, lane: st.lane_tokens > 0, at_ms: stamps.iter().map(|t| t + off).collect() }
                });
                out.push((first, gaps, u64::from(st.output_tokens), st.batch_max, tokens));
            }
            let _ = cl.del_ctx(&ctx);
            Ok(out)
        }));
    }
    let intruder = (long_prefill > 0).then(|| {
        let (start, done, sock) = (Arc::clone(&start), Arc::clone(&done), sock.to_path_buf());
        std::thread::spawn(move || -> Result<u64> {
            let mut cl = Client::connect(&sock, "bench-serve-long")?;
            start.wait();
            let mut n = 0;
            while !done.load(Ordering::SeqCst) {
                let ctx = cl.new_ctx(None)?;
                cl.call(&call(&ctx, long.clone(), 1), &mut |_| {})?;
                cl.del_ctx(&ctx)?;
                n += 1;
            }
            Ok(n)
        })
    });
    start.wait();
    let t0 = Instant::now();
    let mut figures = Vec::new();
    let mut failed = None;
    for t in threads {
        match t.join().map_err(|_| anyhow!("a client panicked")).and_then(|r| r) {
            Ok(f) => figures.extend(f),
            Err(e) => failed = failed.or(Some(e)),
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    done.store(true, Ordering::SeqCst);
    let long_prefill_calls = match intruder {
        Some(t) => t.join().map_err(|_| anyhow!("the long-prefill client panicked"))??,
        None => 0,
    };
    if let Some(e) = failed {
        return Err(e);
    }
    let mut ttft: Vec<f64> = figures.iter().map(|f| f.0).collect();
    let mut itl: Vec<f64> = figures.iter().flat_map(|f| f.1.iter().copied()).collect();
    let output_tokens: u64 = figures.iter().map(|f| f.2).sum();
    let calls = figures.iter_mut().filter_map(|f| f.4.take()).collect();
    #[allow(clippy::cast_precision_loss)]
    let report = Report {
        load,
        max_batch: 0,
        aggregate_tok_s: output_tokens as f64 / seconds,
        ttft_ms_p50: percentile(&mut ttft, 0.5),
        ttft_ms_p99: percentile(&mut ttft, 0.99),
        itl_ms_p50: percentile(&mut itl, 0.5),
        itl_ms_p99: percentile(&mut itl, 0.99),
        itl_ms_mean: itl.iter().sum::<f64>() / itl.len().max(1) as f64,
        output_tokens,
        batched_calls: figures.iter().filter(|f| f.3 > 1).count() as u64,
        long_prefill_calls,
        seconds,
        worker: None,
    };
    Ok((report, calls))
}

/// The mean depth, over `calls` calls that continue one context, at which a call's prompt is
/// prefilled and at which its tokens are decoded: call `k` starts `k * (prompt + max_tokens)`
/// tokens deep (a raw call adds its prompt and what it generates, `max_tokens` at most), but
/// never deeper than leaves the call room in `max_context` (the service shifts a context that
/// would outgrow it back under it).
pub fn call_depths(calls: usize, prompt: usize, max_tokens: usize, max_context: usize) -> (usize, usize) {
    let cap = max_context.saturating_sub(prompt + max_tokens);
    let starts: usize = (0..calls).map(|k| (k * (prompt + max_tokens)).min(cap)).sum();
    let before = starts / calls.max(1);
    (before, before + prompt + max_tokens / 2)
}

/// `ids` repeated to at least `n` tokens: the engine's speed at a depth does not depend on
/// which tokens fill it, and a calibration text may be shorter than the depths measured.
pub fn text_of_length(ids: &[u32], n: usize) -> Result<Vec<u32>> {
    if ids.is_empty() {
        bail!("no tokens to fill a context with");
    }
    Ok(ids.iter().copied().cycle().take(n.max(ids.len())).collect())
}

/// Errors unless `ids` holds `b` contexts of `depth + extra` tokens at offsets of 7.
fn check_tokens(ids: &[u32], b: usize, depth: usize, extra: usize) -> Result<()> {
    let need = 7 * b.saturating_sub(1) + depth + extra;
    if ids.len() < need {
        bail!("{b} contexts {depth} tokens deep need {need} tokens of text, {} given", ids.len());
    }
    Ok(())
}

/// B contexts of `depth` tokens of `ids` (each from its own offset), then `tokens` decode steps
/// with `Session::decode_batch` (one forward pass per step for all B), timed: the median over
/// `reps` of the aggregate tokens/s and of the step time (ms). `ids` holds at least
/// `depth + 7 b` tokens. The sessions keep their K/V in `base` and, with `observe`, accumulate
/// the attention each token receives (llmsd's: its base level, observed when it picks levels).
#[allow(clippy::too_many_arguments)]
pub fn batch_decode(
    model: &Arc<::engine::Model>,
    pool: &Arc<::engine::ThreadPool>,
    ids: &[u32],
    b: usize,
    depth: usize,
    tokens: usize,
    reps: usize,
    profile: bool,
    base: ::engine::kv::KvFormat,
    observe: bool,
) -> Result<(f64, f64)> {
    use ::engine::model::{Scratch, SessionOptions};
    use ::engine::{Logits, Session};
    check_tokens(ids, b, depth, 0)?;
    let opts = SessionOptions { base, observe_attention: observe, ..SessionOptions::new(depth + tokens + 1) };
    let (mut rates, mut steps) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let mut sessions: Vec<Session> = (0..b).map(|_| Session::with_options(Arc::clone(model), Arc::clone(pool), opts)).collect();
        let mut next = Vec::with_capacity(b);
        for (i, s) in sessions.iter_mut().enumerate() {
            next.push(::engine::sampler::argmax(s.eval(&ids[i * 7..i * 7 + depth], Logits::Last)?));
        }
        let mut scratch = Scratch::default();
        // The pool's statistics, when asked, cover the timed steps only (not the prefills).
        if profile {
            pool.take_profile();
            pool.set_profiling(true);
        }
        let t0 = std::time::Instant::now();
        for _ in 0..tokens {
            let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
            let logits = Session::decode_batch(&mut refs, &next, &mut scratch)?;
            for (n, row) in next.iter_mut().zip(logits.chunks_exact(model.config.vocab)) {
                *n = ::engine::sampler::argmax(row);
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        pool.set_profiling(false);
        #[allow(clippy::cast_precision_loss)]
        rates.push((b * tokens) as f64 / secs);
        #[allow(clippy::cast_precision_loss)]
        steps.push(secs * 1000.0 / tokens as f64);
    }
    Ok((median(rates), median(steps)))
}

/// A prompt piece beside decoding calls, as the service's passes carry it (`llms bench-batch
/// --piece`): each a median over `rounds`, in ms.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PieceTimes {
    /// The decoding contexts' step alone.
    pub step_ms: f64,
    /// The same step with the piece in the pass.
    pub mixed_ms: f64,
    /// The piece alone in a pass.
    pub alone_ms: f64,
    /// What the piece adds to the step, over what it costs alone (the median of the rounds'
    /// own ratios): below 1, the pass shares work between them (the weights' reads).
    pub beside_vs_alone: f64,
}

/// `b` contexts `depth` tokens deep decoding while one more, as deep, takes a `piece`-token
/// piece of a prompt, with the service's sessions (its base level `base`, attention observed).
/// Each round times three passes one after the other, so the host's drift falls on all alike:
/// the `b` contexts' step, the step with the piece beside it, and the piece alone; the piece's
/// context is cut back after each piece, so every piece runs `depth` deep (the decoding
/// contexts go two tokens deeper a round).
#[allow(clippy::too_many_arguments)]
pub fn batch_piece(
    model: &Arc<::engine::Model>,
    pool: &Arc<::engine::ThreadPool>,
    ids: &[u32],
    b: usize,
    depth: usize,
    piece: usize,
    rounds: usize,
    base: ::engine::kv::KvFormat,
) -> Result<PieceTimes> {
    use ::engine::model::{Scratch, SessionOptions};
    use ::engine::{Logits, Session};
    check_tokens(ids, b + 1, depth, piece)?;
    let cap = depth + 2 * rounds + piece + 1;
    let opts = SessionOptions { capacity: cap, base, observe_attention: true, ..SessionOptions::new(cap) };
    let mut sessions: Vec<Session> = (0..=b).map(|_| Session::with_options(Arc::clone(model), Arc::clone(pool), opts)).collect();
    let mut next = Vec::with_capacity(b);
    for (i, s) in sessions.iter_mut().enumerate() {
        let logits = s.eval(&ids[i * 7..i * 7 + depth], Logits::Last)?;
        if i < b {
            next.push(::engine::sampler::argmax(logits));
        }
    }
    let prompt = &ids[b * 7 + depth..b * 7 + depth + piece];
    let mut scratch = Scratch::default();
    let (mut step, mut mixed, mut alone, mut ratio) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut pass = |sessions: &mut [Session], with_decode: bool, with_piece: bool, next: &mut Vec<u32>| -> Result<f64> {
        let (dec, rest) = sessions.split_at_mut(b);
        let mut refs: Vec<&mut Session> = Vec::new();
        let mut toks: Vec<&[u32]> = Vec::new();
        let now: Vec<u32> = next.clone();
        if with_decode {
            refs.extend(dec.iter_mut());
            toks.extend(now.chunks(1));
        }
        if with_piece {
            refs.push(&mut rest[0]);
            toks.push(prompt);
        }
        let t0 = Instant::now();
        let logits = Session::step_batch(&mut refs, &toks, &mut scratch)?;
        let ms = t0.elapsed().as_secs_f64() * 1000.0;
        if with_decode {
            for (n, row) in next.iter_mut().zip(logits.chunks_exact(model.config.vocab)) {
                *n = ::engine::sampler::argmax(row);
            }
        }
        if with_piece {
            rest[0].truncate(depth);
        }
        Ok(ms)
    };
    for _ in 0..rounds {
        let s = pass(&mut sessions, true, false, &mut next)?;
        let m = pass(&mut sessions, true, true, &mut next)?;
        let a = pass(&mut sessions, false, true, &mut next)?;
        ratio.push((m - s) / a);
        step.push(s);
        mixed.push(m);
        alone.push(a);
    }
    Ok(PieceTimes { step_ms: median(step), mixed_ms: median(mixed), alone_ms: median(alone), beside_vs_alone: median(ratio) })
}

/// One forward pass of `b` contexts at `depth` tokens each taking a `prompt`-token piece
/// (several calls' prompts prefilled together, as the service does when they start together):
/// the pass's ms, median of `reps`. `base`: the KV format new chunks take, the service's base
/// level (what its passes write and read).
#[allow(clippy::too_many_arguments)]
pub fn batch_prefill(
    model: &Arc<::engine::Model>,
    pool: &Arc<::engine::ThreadPool>,
    ids: &[u32],
    b: usize,
    depth: usize,
    prompt: usize,
    reps: usize,
    base: ::engine::kv::KvFormat,
) -> Result<f64> {
    use ::engine::model::{Scratch, SessionOptions};
    use ::engine::{Logits, Session};
    check_tokens(ids, b, depth, prompt)?;
    let opts = SessionOptions { capacity: depth + prompt + 1, base, ..SessionOptions::new(depth + prompt + 1) };
    let mut times = Vec::new();
    for _ in 0..reps {
        let mut sessions: Vec<Session> = (0..b).map(|_| Session::with_options(Arc::clone(model), Arc::clone(pool), opts)).collect();
        for (i, s) in sessions.iter_mut().enumerate() {
            if depth > 0 {
                s.eval(&ids[i * 7..i * 7 + depth], Logits::Last)?;
            }
        }
        let pieces: Vec<&[u32]> = (0..b).map(|i| &ids[i * 7 + depth..i * 7 + depth + prompt]).collect();
        let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
        let mut scratch = Scratch::default();
        let t0 = std::time::Instant::now();
        Session::step_batch(&mut refs, &pieces, &mut scratch)?;
        times.push(t0.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(median(times))
}

#[cfg(test)]
mod tests {
    use super::{call_depths, check_tokens, gaps_beside, text_of_length, CallTokens};
    use llmsd::service::StepTrace;

    #[test]
    fn each_gap_is_set_beside_the_passes_that_ended_in_it() {
        // Passes ending at 10, 20 (a call back from the lane) and 30 ms.
        let step = |at_ms: f64, lane_ms: f64| StepTrace { at_ms, prep_ms: 1.0, pass_ms: 9.0, lane_ms, ..StepTrace::default() };
        let steps = [step(0.0, 0.0), step(10.0, 40.0), step(20.0, 0.0)];
        // A lane call's first token at 15 ms (sampled on the lane), the next two after the
        // passes ending at 20 and 30; a second call's token before any pass ended.
        let calls = [
            CallTokens { client: 1, call: 2, lane: true, at_ms: vec![15.0, 20.5, 30.25] },
            CallTokens { client: 0, call: 0, lane: false, at_ms: vec![1.0, 2.0] },
        ];
        let gaps = gaps_beside(&steps, &calls);
        assert_eq!(gaps.len(), 3);
        let g = &gaps[0];
        assert_eq!((g.client, g.call, g.token, g.lane, g.passes), (1, 2, 1, true, 1));
        assert!((g.ms - 5.5).abs() < 1e-9 && g.delivery_ms.is_some_and(|d| (d - 0.5).abs() < 1e-9), "{g:?}");
        assert_eq!(g.step.map(|s| s.lane_ms), Some(40.0), "made by the pass ending at 20 ms");
        assert_eq!((gaps[1].token, gaps[1].passes), (2, 1));
        assert!(gaps[1].delivery_ms.is_some_and(|d| (d - 0.25).abs() < 1e-9), "{:?}", gaps[1]);
        // No pass had ended: no step, no delivery time, and a gap spanning none.
        assert!(gaps[2].step.is_none() && gaps[2].delivery_ms.is_none() && gaps[2].passes == 0, "{:?}", gaps[2]);
    }

    #[test]
    fn call_depths_follow_a_context_through_its_calls() {
        // One call: its prompt at the start, its tokens decoded half way through them.
        assert_eq!(call_depths(1, 32, 64, 2048), (0, 64));
        // Four calls of 32 + 64 tokens: they start 0, 96, 192 and 288 tokens deep.
        assert_eq!(call_depths(4, 32, 64, 2048), (144, 208));
        assert_eq!(call_depths(0, 32, 64, 2048), (0, 64));
        // A 512-token context: calls start at most 416 deep (0, 96, ..., 384, 416, 416).
        assert_eq!(call_depths(7, 32, 64, 512), (256, 320));
    }

    #[test]
    fn short_texts_are_repeated_and_short_contexts_refused() {
        let ids = text_of_length(&[1, 2, 3], 7).unwrap();
        assert_eq!(ids, [1, 2, 3, 1, 2, 3, 1]);
        assert_eq!(text_of_length(&[1, 2, 3], 2).unwrap(), [1, 2, 3]);
        assert!(text_of_length(&[], 5).is_err());
        assert!(check_tokens(&ids, 1, 7, 0).is_ok());
        assert!(check_tokens(&ids, 1, 7, 1).is_err());
        assert!(check_tokens(&ids, 2, 1, 0).is_err(), "the second context starts 7 tokens in");
    }
}

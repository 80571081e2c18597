//! `llms trace replay`: drives llmsd through a trace and records, per call, what an app saw
//! (switch latency, queue, TTFT, decode speed) and what the service held (resident and flash
//! bytes, faults, pressure level).
//!
//! Idle gaps are compressed: calls go out back to back in trace order, but before each one the
//! replayer waits until the service's AoT writer is idle — the write-out a real gap would have
//! hidden still happens, off the measured path, as it would on a device.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::trace::{Header, Record};
use llmsd::client::Client;
use llmsd::proto::Call;
use llmsd::stats::percentile;

/// What one call of the trace saw.
#[derive(Debug, Clone, Serialize)]
pub struct CallResult {
    pub i: usize,
    pub t: f64,
    pub ctx: usize,
    pub app: String,
    pub switch_ms: f64,
    pub queue_ms: f64,
    pub ttft_ms: f64,
    pub decode_tok_s: f64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub context_tokens: u32,
    /// Positions the sliding window dropped before this call (the context was rebuilt from
    /// its start and its most recent tokens: its prefill, not its switch, pays for that).
    pub slid_tokens: u32,
    /// Prompt tokens taken from chunks the app's other contexts hold (prefix sharing).
    pub cached_tokens: u32,
    pub missing_chunks: u32,
    pub read_chunks: u32,
    pub recomputed_chunks: u32,
    pub resident_bytes: u64,
    pub flash_bytes: u64,
    pub budget_bytes: u64,
    pub faults: u64,
    pub pressure: String,
    pub output: String,
}

/// Averages over a replay.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub calls: usize,
    pub contexts: usize,
    pub switch_mean_ms: f64,
    pub switch_p50_ms: f64,
    pub switch_p90_ms: f64,
    pub switch_p99_ms: f64,
    pub ttft_mean_ms: f64,
    pub decode_tok_s: f64,
    pub read_chunks: u64,
    pub recomputed_chunks: u64,
    /// Calls whose context slid (was rebuilt) before them.
    pub slid_calls: usize,
    /// Prompt tokens taken from shared chunks instead of prefilled.
    pub cached_tokens: u64,
    pub max_resident_bytes: u64,
    pub seconds: f64,
}

#[allow(clippy::cast_precision_loss)]
pub fn summarize(rs: &[CallResult], seconds: f64) -> Summary {
    let mut sw: Vec<f64> = rs.iter().map(|r| r.switch_ms).collect();
    let n = rs.len().max(1) as f64;
    let mut ctxs: Vec<usize> = rs.iter().map(|r| r.ctx).collect();
    ctxs.sort_unstable();
    ctxs.dedup();
    let dec: Vec<f64> = rs.iter().filter(|r| r.decode_tok_s > 0.0).map(|r| r.decode_tok_s).collect();
    Summary {
        calls: rs.len(),
        contexts: ctxs.len(),
        switch_mean_ms: sw.iter().sum::<f64>() / n,
        switch_p50_ms: percentile(&mut sw, 0.5),
        switch_p90_ms: percentile(&mut sw, 0.9),
        switch_p99_ms: percentile(&mut sw, 0.99),
        ttft_mean_ms: rs.iter().map(|r| r.ttft_ms).sum::<f64>() / n,
        decode_tok_s: if dec.is_empty() { 0.0 } else { dec.iter().sum::<f64>() / dec.len() as f64 },
        read_chunks: rs.iter().map(|r| u64::from(r.read_chunks)).sum(),
        recomputed_chunks: rs.iter().map(|r| u64::from(r.recomputed_chunks)).sum(),
        slid_calls: rs.iter().filter(|r| r.slid_tokens > 0).count(),
        cached_tokens: rs.iter().map(|r| u64::from(r.cached_tokens)).sum(),
        max_resident_bytes: rs.iter().map(|r| r.resident_bytes).max().unwrap_or(0),
        seconds,
    }
}

/// How the replayer spaces the calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// Back to back, each call once the leveller and the AoT writer are idle (the gap's work
    /// done, its time not waited).
    Compressed,
    /// At the trace's times (a call that comes due while the last one runs goes as soon as it
    /// returns, as from one app thread): the AoT writer races the next call.
    Realtime,
}

/// Replays `recs` against the service at `socket`, compressing idle gaps; `each` sees every
/// result as it comes. The trace's contexts are created on first use (one connection per app)
/// and deleted at the end.
pub fn replay(socket: &Path, h: &Header, recs: &[Record], each: &mut dyn FnMut(&CallResult)) -> Result<Vec<CallResult>> {
    replay_paced(socket, h, recs, Pace::Compressed, each)
}

/// [`replay`] with a choice of pacing.
pub fn replay_paced(socket: &Path, h: &Header, recs: &[Record], pace: Pace, each: &mut dyn FnMut(&CallResult)) -> Result<Vec<CallResult>> {
    let start = Instant::now();
    let t0 = recs.first().map_or(0.0, |r| r.t);
    let mut clients: HashMap<String, Client> = HashMap::new();
    let mut ids: HashMap<usize, (String, String)> = HashMap::new();
    let mut out = Vec::with_capacity(recs.len());
    let mut faults_before = 0;
    let result = (|| -> Result<()> {
        for (i, r) in recs.iter().enumerate() {
            if r.ctx >= h.generator.contexts {
                bail!("record {i}: context {} out of range", r.ctx);
            }
            if !clients.contains_key(&r.app) {
                clients.insert(r.app.clone(), Client::connect(socket, &r.app)?);
            }
            let c = clients.get_mut(&r.app).expect("inserted");
            let id = match ids.get(&r.ctx) {
                Some((app, id)) if *app == r.app => id.clone(),
                Some(_) => bail!("record {i}: context {} changes app", r.ctx),
                None => {
                    let id = c.new_ctx(r.system.as_deref())?;
                    ids.insert(r.ctx, (r.app.clone(), id.clone()));
                    id
                }
            };
            match pace {
                // The gap: let the leveller and the AoT writer finish what the last call left
                // (a lowering is written once done, so both must be idle at once).
                Pace::Compressed => {
                    let t = Instant::now();
                    while c.stats().map(|s| s.aot_pending + s.level_pending)? > 0 {
                        if t.elapsed() > Duration::from_secs(60) {
                            bail!("the service's leveller and AoT writer did not go idle in 60 s");
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                Pace::Realtime => {
                    let due = Duration::try_from_secs_f64((r.t - t0).max(0.0)).unwrap_or(Duration::MAX);
                    if let Some(wait) = due.checked_sub(start.elapsed()) {
                        std::thread::sleep(wait);
                    }
                }
            }
            let call = Call {
                ctx: id.clone(),
                prompt: r.prompt.clone(),
                max_tokens: r.max_tokens,
                temperature: 0.0,
                seed: 0,
                stop: vec![],
                raw: false,
                top_p: None,
            };
            let (text, st) = c.call(&call, &mut |_| {}).with_context(|| format!("record {i} (context {})", r.ctx))?;
            let s = c.stats()?;
            let mine = s.mine.iter().find(|x| x.ctx == id);
            let res = CallResult {
                i,
                t: r.t,
                ctx: r.ctx,
                app: r.app.clone(),
                switch_ms: st.switch_ms,
                queue_ms: st.queue_ms,
                ttft_ms: st.ttft_ms,
                decode_tok_s: if st.decode_ms > 0.0 { f64::from(st.output_tokens) / (st.decode_ms / 1000.0) } else { 0.0 },
                prompt_tokens: st.prompt_tokens,
                output_tokens: st.output_tokens,
                context_tokens: st.context_tokens,
                slid_tokens: st.slid_tokens,
                cached_tokens: st.cached_tokens,
                missing_chunks: st.missing_chunks,
                read_chunks: st.read_chunks,
                recomputed_chunks: st.recomputed_chunks,
                resident_bytes: s.resident_bytes,
                flash_bytes: mine.map_or(0, |m| m.flash_bytes),
                budget_bytes: s.budget_bytes,
                faults: s.faults.saturating_sub(faults_before),
                pressure: s.pressure.clone(),
                output: text,
            };
            faults_before = s.faults;
            each(&res);
            out.push(res);
        }
        Ok(())
    })();
    for (app, id) in ids.values() {
        if let Some(c) = clients.get_mut(app) {
            let _ = c.del_ctx(id);
        }
    }
    result?;
    Ok(out)
}

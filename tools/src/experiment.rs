//! Experiments over traces (issue #7, the paper's §5): each runs the real service on
//! synthetic traces (or the engine on real text) and writes a table (Markdown and JSON) and a
//! plot (SVG and PNG) through [`crate::figure`]; `llms report` gathers them into
//! docs/RESULTS.md.
//!
//! - `switch-vs-contexts` (Fig. 9): average switch latency against active contexts, per
//!   policy and switching pattern.
//! - `contexts-vs-budget`, `contexts-vs-length` (Fig. 10, 11): the most active contexts each
//!   policy keeps under an average switch latency bound, against the budget or the maximum
//!   context length.
//! - `accuracy-vs-memory` (Fig. 12): perplexity and greedy agreement against KV bytes.
//! - `ablation` (Fig. 13): the llms policy with one technique switched off at a time.
//! - `chunk-size` (Fig. 14): switch latency against tokens per chunk.
//! - `inference` (Fig. 15a): prefill and decode speed with the KV cache in mm's userfaultfd
//!   regions against the engine's own memory.
//! - `call-rate` (Fig. 15b): switch latency against the call rate, calls paced in real time.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Serialize;

use crate::figure::{ensure_font, Figure, Panel, Series, COLORS};
use crate::replay::{replay_paced, summarize, Pace, Summary};
use crate::trace::{generate, GenParams, Pattern};
use llmsd::config::Config;
use llmsd::service::Local;
use llmsd::stats::median;

/// Each baseline's own best configuration on this engine (same store, budget and trace):
/// `llms` with the base configuration's levels and global ratio (the experiments set them:
/// the paper's {8,4,2}/8 bits at 50% by default, or the ratio chosen by quality,
/// [`ratio_by_quality`]); `vllm-sq` int8 chunks; `vllm-s` chunks as the engine computes
/// them, f16; `swap` and `lmk` int8 (the cheaper format is only to their advantage).
/// `llms@R` is llms at the fixed global ratio R (a second llms row beside the chosen one:
/// the paper's 0.5 next to the ratio found by quality).
/// The llms policy with `prefix_sharing = false`: what sharing a prefix buys, beside `llms`.
pub const NOSHARE: &str = "llms-noshare";

pub fn policy_config(base: &Config, policy: &str) -> Config {
    if policy == NOSHARE {
        return Config { prefix_sharing: false, ..policy_config(base, "llms") };
    }
    let (name, levels, ratio): (&str, Vec<String>, f64) = match (policy, policy.strip_prefix("llms@").and_then(parse_ratio)) {
        (_, Some(r)) => ("llms", base.levels.clone(), r),
        ("llms", None) => ("llms", base.levels.clone(), base.ratio),
        ("vllm-s", None) => (policy, vec!["f16".into()], 1.0),
        _ => (policy, vec!["int8".into()], 1.0),
    };
    Config { policy: name.into(), levels, ratio, ..base.clone() }
}

/// A global ratio as the experiments take one: a number in (0, 1].
pub fn parse_ratio(s: &str) -> Option<f64> {
    s.parse().ok().filter(|r: &f64| *r > 0.0 && *r <= 1.0)
}

/// Checks an experiment's policy name: one of [`mm::Policy`]'s, or `llms@R`.
pub fn check_policy(p: &str) -> Result<()> {
    if mm::Policy::parse(p).is_some() || p.strip_prefix("llms@").and_then(parse_ratio).is_some() || p == NOSHARE {
        return Ok(());
    }
    bail!("policy {p:?}: llms, llms@R (R a ratio in (0, 1]), {NOSHARE}, vllm-sq, vllm-s, swap or lmk")
}

/// One ratio tried by [`ratio_by_quality`]: its perplexity on each text and the change from
/// the base level's, in percent.
#[derive(Debug, Clone, Serialize)]
pub struct QualityStep {
    pub ratio: f64,
    pub ppl: Vec<f64>,
    pub vs_base_pct: Vec<f64>,
    pub within: bool,
}

/// The ratios [`ratio_by_quality`] tries, least compressed first.
pub const QUALITY_RATIOS: [f64; 14] = [1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35];

/// The most compressed of `ratios` (least compressed first) whose perplexity on every text is
/// within `tolerance_pct` of `base` (the base level's), trying them in order and stopping at
/// the first that is not: compression only grows along the list, and a ratio past a failing
/// one that passed again would be noise. `score(r)` gives the perplexity per text at ratio
/// r. `None` when even the first is not within.
pub fn most_compressed_within(
    ratios: &[f64],
    base: &[f64],
    tolerance_pct: f64,
    mut score: impl FnMut(f64) -> Result<Vec<f64>>,
) -> Result<(Option<f64>, Vec<QualityStep>)> {
    let (mut best, mut steps) = (None, Vec::new());
    for &ratio in ratios {
        let ppl = score(ratio)?;
        let vs_base_pct: Vec<f64> = ppl.iter().zip(base).map(|(p, b)| (p / b - 1.0) * 100.0).collect();
        let within = vs_base_pct.iter().all(|&d| d <= tolerance_pct);
        steps.push(QualityStep { ratio, ppl, vs_base_pct, within });
        if !within {
            break;
        }
        best = Some(ratio);
    }
    Ok((best, steps))
}

/// The ratios between `within` (passed) and `failed` (the next coarser step, which did not)
/// at 0.01 apart, least compressed first: where the search looks again to place the ratio
/// within a hundredth (the switch latency moves steeply with it, docs/kv.md).
pub fn finer_ratios(within: f64, failed: f64) -> Vec<f64> {
    #[allow(clippy::cast_possible_truncation)]
    let (hi, lo) = ((within * 100.0).round() as i64, (failed * 100.0).round() as i64);
    #[allow(clippy::cast_precision_loss)]
    (lo + 1..hi).rev().map(|c| c as f64 / 100.0).collect()
}

fn level_names(levels: &[engine::kv::KvFormat]) -> String {
    levels.iter().map(|f| f.name()).collect::<Vec<_>>().join(",")
}

/// The llms ratio chosen by quality (issue #27): the most compressed global ratio of the mix
/// over `levels` (the base first) whose perplexity on every one of `texts` (ctx 512, the
/// first `windows` windows of each, each chunk lowered as it fills, as `llms perplexity --kv
/// mix:R`) is within `tolerance_pct` of the base level's: by steps of 0.05, then by hundredths
/// between the last within and the first not ([`finer_ratios`]). Prints each ratio tried. Falls back
/// to 1.0 (every chunk at the base) when no ratio below it is within.
pub fn ratio_by_quality(
    model: &Arc<engine::Model>,
    pool: &Arc<engine::ThreadPool>,
    levels: &[engine::kv::KvFormat],
    texts: &[PathBuf],
    windows: usize,
    tolerance_pct: f64,
) -> Result<(f64, Vec<QualityStep>)> {
    const CTX: usize = 512;
    const CHUNK: usize = 16;
    let mut ids = Vec::new();
    for t in texts {
        let text = std::fs::read_to_string(t).with_context(|| format!("accuracy text {}", t.display()))?;
        ids.push(model.tokenizer.encode(&text, false, false)?);
    }
    let base_level = *levels.first().context("no levels")?;
    let ppl = |plan: engine::eval::KvPlan, ratio: f64| -> Result<Vec<f64>> {
        let choose = llmsd::kvmm::mix_chooser(model, CHUNK, ratio, levels);
        let run = engine::eval::KvRun { plan, chunk_tokens: CHUNK, choose: &choose };
        ids.iter()
            .map(|ids| {
                let (p, _) = engine::eval::perplexity_kv(model, Arc::clone(pool), ids, CTX, windows, run, None)?;
                Ok(p.ppl)
            })
            .collect()
    };
    let base = ppl(engine::eval::KvPlan::Uniform(base_level), 1.0)?;
    let names: Vec<String> =
        texts.iter().map(|t| t.file_name().map_or_else(|| t.display().to_string(), |n| n.to_string_lossy().into_owned())).collect();
    println!(
        "llms ratio by quality over {}: perplexity of {names:?} at the base level {}: {base:.3?}",
        level_names(levels),
        base_level.name()
    );
    let mut score = |r: f64| {
        let p = ppl(engine::eval::KvPlan::Mix(r), r)?;
        let pct: Vec<String> = p.iter().zip(&base).map(|(p, b)| format!("{:+.2}%", (p / b - 1.0) * 100.0)).collect();
        println!("  mix:{r:.2}: perplexity {p:.3?} ({})", pct.join(", "));
        Ok(p)
    };
    let (mut best, mut steps) = most_compressed_within(&QUALITY_RATIOS[1..], &base, tolerance_pct, &mut score)?;
    // Between the last step within and the first that was not, by hundredths.
    if let (Some(within), Some(failed)) = (best, steps.last().filter(|s| !s.within).map(|s| s.ratio)) {
        let (fine, fine_steps) = most_compressed_within(&finer_ratios(within, failed), &base, tolerance_pct, &mut score)?;
        best = fine.or(best);
        steps.extend(fine_steps);
    }
    let ratio = best.unwrap_or(1.0);
    println!("llms ratio by quality: {ratio:.2} (the most compressed within {tolerance_pct}% of {} on every text)", base_level.name());
    Ok((ratio, steps))
}

/// Settings of `switch-vs-contexts`.
#[derive(Debug, Clone, Serialize)]
pub struct SwitchVsContexts {
    pub contexts: Vec<usize>,
    pub policies: Vec<String>,
    pub patterns: Vec<String>,
    pub calls_per_context: usize,
    pub budget: String,
    pub scale: f64,
    pub seed: u64,
    pub corpus: Vec<PathBuf>,
    /// The llms policy's levels and global ratio, and how the ratio was chosen.
    pub llms_levels: Vec<String>,
    pub llms_ratio: f64,
    pub llms_ratio_by: String,
}

/// One point of the figure.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    pub pattern: String,
    pub policy: String,
    pub contexts: usize,
    pub switch_mean_ms: f64,
    pub switch_p90_ms: f64,
    pub ttft_mean_ms: f64,
    pub read_chunks: u64,
    pub recomputed_chunks: u64,
}

/// The trace of `n` contexts with `calls_per_context` calls each.
fn trace_params(
    n: usize,
    calls_per_context: usize,
    pattern: &str,
    rate: f64,
    scale: f64,
    seed: u64,
    corpus: &[PathBuf],
) -> Result<GenParams> {
    let pattern = Pattern::parse(pattern).with_context(|| format!("pattern {pattern:?}: random, markov or gaussian"))?;
    Ok(GenParams {
        contexts: n,
        apps: n.min(4),
        calls: n * calls_per_context,
        pattern,
        rate,
        seed,
        scale,
        markov_decay: 0.5,
        corpus: corpus.to_vec(),
        system_tokens: 0,
    })
}

/// Replays the trace of `p` against a fresh service run with `cfg` (its socket and state
/// directory go under `work`, seeded with the load profiles in `profiles`) and summarizes the
/// switches back to a context: the first call of each context has nothing to switch in.
pub fn run_trace(cfg: &Config, p: &GenParams, pace: Pace, work: &Path, profiles: &Path) -> Result<Summary> {
    static RUN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let (h, recs) = generate(p)?;
    let state = work.join(format!("run-{}", RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    crate::loadbench::fresh_state(&state, profiles)?;
    let cfg = Config { socket: state.join("llmsd.sock"), state_dir: state.clone(), pressure: false, ..cfg.clone() };
    let local = Local::start(cfg)?;
    let t = Instant::now();
    let r = replay_paced(&local.socket, &h, &recs, pace, &mut |_| {});
    let secs = t.elapsed().as_secs_f64();
    local.stop()?;
    let _ = std::fs::remove_dir_all(&state);
    let mut seen = std::collections::HashSet::new();
    let back: Vec<_> = r?.into_iter().filter(|x| !seen.insert(x.ctx)).collect();
    Ok(summarize(&back, secs))
}

/// Runs it; `base` gives the model, threads, chunk size and maximum context length; every run
/// gets a fresh store under `work` seeded with the profiles in `profiles`.
pub fn switch_vs_contexts(
    base: &Config,
    s: &SwitchVsContexts,
    work: &Path,
    profiles: &Path,
    log: &mut dyn FnMut(&Point),
) -> Result<Vec<Point>> {
    let mut out = Vec::new();
    for pattern in &s.patterns {
        for &n in &s.contexts {
            let p = trace_params(n, s.calls_per_context, pattern, 1.0, s.scale, s.seed, &s.corpus)?;
            for policy in &s.policies {
                let cfg = Config { budget: s.budget.clone(), ..policy_config(base, policy) };
                let sum = run_trace(&cfg, &p, Pace::Compressed, work, profiles)?;
                let pt = Point {
                    pattern: pattern.clone(),
                    policy: policy.clone(),
                    contexts: n,
                    switch_mean_ms: sum.switch_mean_ms,
                    switch_p90_ms: sum.switch_p90_ms,
                    ttft_mean_ms: sum.ttft_mean_ms,
                    read_chunks: sum.read_chunks,
                    recomputed_chunks: sum.recomputed_chunks,
                };
                log(&pt);
                out.push(pt);
            }
        }
    }
    Ok(out)
}

/// Series of `rows` grouped by `label`, x and y picked by `xy`, in first-seen order.
fn series<T>(rows: &[T], label: impl Fn(&T) -> String, xy: impl Fn(&T) -> (f64, f64)) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    for r in rows {
        let l = label(r);
        let pt = xy(r);
        match out.iter_mut().find(|s| s.label == l) {
            Some(s) => s.points.push(pt),
            None => out.push(Series { label: l, points: vec![pt] }),
        }
    }
    out
}

#[allow(clippy::cast_precision_loss)]
fn x_of(n: usize) -> f64 {
    n as f64
}

/// Writes the figure of `switch-vs-contexts`: a panel per pattern.
pub fn write_switch_vs_contexts(dir: &Path, name: &str, s: &SwitchVsContexts, points: &[Point]) -> Result<Vec<PathBuf>> {
    let fig = Figure {
        caption: format!(
            "Average switch latency (ms) vs active contexts; budget {}, {} calls per context, delta scale {}, seed {}; llms over {} at {:.2} of {}'s bytes ({}).",
            s.budget,
            s.calls_per_context,
            s.scale,
            s.seed,
            s.llms_levels.join(","),
            s.llms_ratio,
            s.llms_levels.first().map_or("the base", String::as_str),
            s.llms_ratio_by
        ),
        x_desc: "active contexts".into(),
        log_x: false,
        log_y: true,
        decimals: 2,
        panels: s
            .patterns
            .iter()
            .map(|pat| Panel {
                title: format!("{pat} pattern"),
                y_desc: "avg switch latency (ms)".into(),
                series: series(
                    &points.iter().filter(|p| &p.pattern == pat).collect::<Vec<_>>(),
                    |p| p.policy.clone(),
                    |p| (x_of(p.contexts), p.switch_mean_ms),
                ),
            })
            .collect(),
    };
    fig.write(dir, name, s, &points)
}

/// Settings of `contexts-vs-budget` and `contexts-vs-length` (Fig. 10, 11): for every budget
/// and maximum context length, each policy runs traces of a growing number of active contexts
/// until its average switch latency passes the largest bound.
#[derive(Debug, Clone, Serialize)]
pub struct MaxContexts {
    pub budgets: Vec<String>,
    pub lengths: Vec<usize>,
    pub bounds_ms: Vec<f64>,
    /// Active contexts tried, ascending.
    pub contexts: Vec<usize>,
    pub policies: Vec<String>,
    pub pattern: String,
    pub calls_per_context: usize,
    pub scale: f64,
    /// The delta scale is `scale` at the largest length and proportional to the length below
    /// it: contexts fill the same share of every window. (With one scale, short windows are
    /// overrun on nearly every call and the sliding window rebuilds the context: the figure
    /// would time rebuilds, not switches.)
    pub scale_with_length: bool,
    pub seed: u64,
    pub corpus: Vec<PathBuf>,
    /// Tokens of each app's system prompt (at the largest length, scaled as the deltas are).
    pub system_tokens: usize,
    /// Apps the contexts belong to (context k to app k mod apps; at most one per context).
    pub apps: usize,
}

impl MaxContexts {
    /// The system prompt's tokens at `length` (scaled with the deltas).
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    pub fn system_tokens_at(&self, length: usize) -> usize {
        (self.system_tokens as f64 * self.scale_at(length) / self.scale).round() as usize
    }

    /// The delta scale of the traces for maximum context length `length`.
    #[allow(clippy::cast_precision_loss)]
    pub fn scale_at(&self, length: usize) -> f64 {
        let top = self.lengths.iter().copied().max().unwrap_or(length).max(1);
        if self.scale_with_length {
            self.scale * length as f64 / top as f64
        } else {
            self.scale
        }
    }
}

/// One run of `MaxContexts`.
#[derive(Debug, Clone, Serialize)]
pub struct MaxRun {
    pub budget: String,
    pub length: usize,
    pub policy: String,
    pub contexts: usize,
    pub scale: f64,
    pub switch_mean_ms: f64,
    /// Calls whose context had to slide (see `CallResult::slid_tokens`).
    pub slid_calls: usize,
    /// Chunks the switches read from flash and recomputed, over the run.
    pub read_chunks: u64,
    pub recomputed_chunks: u64,
}

/// The most contexts under one bound, for one (budget, length, policy).
#[derive(Debug, Clone, Serialize)]
pub struct MaxRow {
    pub budget: String,
    pub length: usize,
    pub policy: String,
    pub bound_ms: f64,
    /// Interpolated between the last count under the bound and the first over it.
    pub max_contexts: f64,
    /// The bound was never passed: `max_contexts` is the largest count tried, a lower bound.
    pub at_least: bool,
}

/// The active-context count at which the mean latency crosses `bound`, interpolated linearly
/// between measured counts (one context never switches: (1, 0) starts the curve). Returns the
/// count and whether the bound was never crossed.
pub fn crossing(runs: &[(usize, f64)], bound: f64) -> (f64, bool) {
    let mut prev = (1.0, 0.0);
    for &(n, y) in runs {
        let x = x_of(n);
        if y > bound {
            let f = if y > prev.1 { (bound - prev.1) / (y - prev.1) } else { 0.0 };
            return (prev.0 + f.clamp(0.0, 1.0) * (x - prev.0), false);
        }
        prev = (x, y);
    }
    (prev.0, true)
}

/// Runs it (see [`MaxContexts`]).
pub fn max_contexts(
    base: &Config,
    s: &MaxContexts,
    work: &Path,
    profiles: &Path,
    log: &mut dyn FnMut(&MaxRun),
) -> Result<(Vec<MaxRun>, Vec<MaxRow>)> {
    let top = s.bounds_ms.iter().copied().fold(0.0, f64::max);
    let (mut runs, mut rows) = (Vec::new(), Vec::new());
    for budget in &s.budgets {
        for &length in &s.lengths {
            for policy in &s.policies {
                let cfg = Config { budget: budget.clone(), max_context_tokens: length, ..policy_config(base, policy) };
                cfg.validate()?;
                let mut curve = Vec::new();
                for &n in &s.contexts {
                    let scale = s.scale_at(length);
                    let p = GenParams {
                        system_tokens: s.system_tokens_at(length),
                        apps: n.min(s.apps.max(1)),
                        ..trace_params(n, s.calls_per_context, &s.pattern, 1.0, scale, s.seed, &s.corpus)?
                    };
                    let sum = run_trace(&cfg, &p, Pace::Compressed, work, profiles)?;
                    let r = MaxRun {
                        budget: budget.clone(),
                        length,
                        policy: policy.clone(),
                        contexts: n,
                        scale,
                        switch_mean_ms: sum.switch_mean_ms,
                        slid_calls: sum.slid_calls,
                        read_chunks: sum.read_chunks,
                        recomputed_chunks: sum.recomputed_chunks,
                    };
                    log(&r);
                    curve.push((n, r.switch_mean_ms));
                    runs.push(r);
                    if sum.switch_mean_ms > top {
                        break;
                    }
                }
                for &b in &s.bounds_ms {
                    let (max_contexts, at_least) = crossing(&curve, b);
                    rows.push(MaxRow { budget: budget.clone(), length, policy: policy.clone(), bound_ms: b, max_contexts, at_least });
                }
            }
        }
    }
    Ok((runs, rows))
}

/// Writes the figure of a `MaxContexts` run: a panel per bound; x is the maximum context
/// length when only it varies, else the budget (MiB).
pub fn write_max_contexts(dir: &Path, name: &str, s: &MaxContexts, runs: &[MaxRun], rows: &[MaxRow]) -> Result<Vec<PathBuf>> {
    let by_length = s.budgets.len() == 1 && s.lengths.len() > 1;
    let x = |r: &MaxRow| -> f64 {
        if by_length {
            x_of(r.length)
        } else {
            #[allow(clippy::cast_precision_loss)]
            llmsd::size::parse_bytes(&r.budget).map_or(0.0, |b| b as f64 / f64::from(1 << 20))
        }
    };
    let fixed = if by_length {
        format!("budget {}", s.budgets.join(","))
    } else {
        format!("max context {} tokens", s.lengths.iter().map(ToString::to_string).collect::<Vec<_>>().join(","))
    };
    let caption = format!(
        "Most active contexts under an average switch latency bound ({} pattern, {} calls per context, delta scale {}{}, seed {}; {fixed}), interpolated between the counts tried ({}).",
        s.pattern,
        s.calls_per_context,
        s.scale,
        if s.scale_with_length { " at the largest length, proportional to the length below it" } else { "" },
        s.seed,
        s.contexts.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
    ) + &if s.system_tokens > 0 {
        format!(" Every context opens with its app's system prompt of {} tokens ({} apps){}.", s.system_tokens, s.apps, if by_length { " at the largest length, proportional below" } else { "" })
    } else {
        String::new()
    };
    let fig = Figure {
        caption,
        x_desc: if by_length { "max context length (tokens)".into() } else { "budget (MiB)".into() },
        log_x: false,
        log_y: false,
        decimals: 1,
        panels: s
            .bounds_ms
            .iter()
            .map(|&b| Panel {
                title: format!("under {b} ms"),
                y_desc: "max active contexts".into(),
                series: series(
                    &rows.iter().filter(|r| r.bound_ms == b).collect::<Vec<_>>(),
                    |r| r.policy.clone(),
                    |r| (x(r), r.max_contexts),
                ),
            })
            .collect(),
    };
    let files = fig.write(dir, name, s, &serde_json::json!({"runs": runs, "max": rows}))?;
    // Say which values are lower bounds (the bound was never passed).
    let starred: Vec<String> = rows
        .iter()
        .filter(|r| r.at_least)
        .map(|r| format!("{} ({}, {} tokens, {} ms)", r.policy, r.budget, r.length, r.bound_ms))
        .collect();
    if !starred.is_empty() {
        let mut md = fig.markdown();
        md.push_str(&format!("\nNever over the bound up to the largest count tried (a lower bound): {}.\n", starred.join("; ")));
        std::fs::write(&files[0], md)?;
    }
    Ok(files)
}

/// Settings of `ablation` (Fig. 13): the llms policy with each technique switched off in turn
/// (`Config::ablate`), on one trace per context count.
#[derive(Debug, Clone, Serialize)]
pub struct Ablation {
    /// `llms`, `no-<part>` for a part of `Config::ablate`, or a baseline policy.
    pub variants: Vec<String>,
    pub contexts: Vec<usize>,
    pub pattern: String,
    pub calls_per_context: usize,
    pub budget: String,
    pub scale: f64,
    pub seed: u64,
    pub corpus: Vec<PathBuf>,
}

/// One run of a sweep: a line's label, the x it was run at, what the replay saw.
#[derive(Debug, Clone, Serialize)]
pub struct SweepRun {
    pub label: String,
    pub x: f64,
    pub summary: Summary,
}

/// The service configuration of an ablation variant.
pub fn variant_config(base: &Config, v: &str) -> Result<Config> {
    if let Some(part) = v.strip_prefix("no-") {
        let c = Config { ablate: vec![part.to_string()], ..policy_config(base, "llms") };
        c.ablations()?;
        return Ok(c);
    }
    mm::Policy::parse(v).with_context(|| format!("variant {v:?}: llms, no-lctru, no-compression, no-pipeline, no-aot or a policy"))?;
    Ok(policy_config(base, v))
}

/// Runs it.
pub fn ablation(base: &Config, s: &Ablation, work: &Path, profiles: &Path, log: &mut dyn FnMut(&SweepRun)) -> Result<Vec<SweepRun>> {
    let mut out = Vec::new();
    for &n in &s.contexts {
        let p = trace_params(n, s.calls_per_context, &s.pattern, 1.0, s.scale, s.seed, &s.corpus)?;
        for v in &s.variants {
            let cfg = Config { budget: s.budget.clone(), ..variant_config(base, v)? };
            let r = SweepRun { label: v.clone(), x: x_of(n), summary: run_trace(&cfg, &p, Pace::Compressed, work, profiles)? };
            log(&r);
            out.push(r);
        }
    }
    Ok(out)
}

/// A one-panel figure of average switch latency from sweep runs.
fn sweep_figure(caption: String, x_desc: &str, log_x: bool, runs: &[SweepRun]) -> Figure {
    Figure {
        caption,
        x_desc: x_desc.into(),
        log_x,
        log_y: true,
        decimals: 2,
        panels: vec![Panel {
            title: "average switch latency".into(),
            y_desc: "avg switch latency (ms)".into(),
            series: series(runs, |r| r.label.clone(), |r| (r.x, r.summary.switch_mean_ms)),
        }],
    }
}

pub fn write_ablation(dir: &Path, name: &str, s: &Ablation, runs: &[SweepRun]) -> Result<Vec<PathBuf>> {
    let caption = format!(
        "Ablation: average switch latency (ms) of the llms policy with one technique off ({} pattern, budget {}, {} calls per context, delta scale {}, seed {}).",
        s.pattern, s.budget, s.calls_per_context, s.scale, s.seed
    );
    sweep_figure(caption, "active contexts", false, runs).write(dir, name, s, &runs)
}

/// Settings of `chunk-size` (Fig. 14).
#[derive(Debug, Clone, Serialize)]
pub struct ChunkSize {
    pub chunk_tokens: Vec<usize>,
    pub policies: Vec<String>,
    pub contexts: usize,
    pub pattern: String,
    pub calls_per_context: usize,
    pub budget: String,
    pub scale: f64,
    pub seed: u64,
    pub corpus: Vec<PathBuf>,
}

/// Runs it: the llms policy's load profile is measured for every chunk size first (saved in
/// `profiles`, as the service would at its first start).
pub fn chunk_size(base: &Config, s: &ChunkSize, work: &Path, profiles: &Path, log: &mut dyn FnMut(&SweepRun)) -> Result<Vec<SweepRun>> {
    if s.policies.iter().any(|p| policy_config(base, p).policy == "llms") && base.load_profile {
        let model = Arc::new(engine::Model::load(&base.model).with_context(|| format!("loading {}", base.model.display()))?);
        let pool = Arc::new(engine::ThreadPool::new(base.pool_threads()));
        for &ct in &s.chunk_tokens {
            llmsd::profile::load_or_measure(profiles, &model, &pool, ct, false)?;
        }
    }
    let p = trace_params(s.contexts, s.calls_per_context, &s.pattern, 1.0, s.scale, s.seed, &s.corpus)?;
    let mut out = Vec::new();
    for &ct in &s.chunk_tokens {
        for policy in &s.policies {
            let cfg = Config { budget: s.budget.clone(), chunk_tokens: ct, ..policy_config(base, policy) };
            cfg.validate()?;
            let r = SweepRun { label: policy.clone(), x: x_of(ct), summary: run_trace(&cfg, &p, Pace::Compressed, work, profiles)? };
            log(&r);
            out.push(r);
        }
    }
    Ok(out)
}

pub fn write_chunk_size(dir: &Path, name: &str, s: &ChunkSize, runs: &[SweepRun]) -> Result<Vec<PathBuf>> {
    let caption = format!(
        "Average switch latency (ms) vs tokens per chunk ({} active contexts, {} pattern, budget {}, {} calls per context, delta scale {}, seed {}).",
        s.contexts, s.pattern, s.budget, s.calls_per_context, s.scale, s.seed
    );
    sweep_figure(caption, "tokens per chunk", true, runs).write(dir, name, s, &runs)
}

/// Settings of `call-rate` (Fig. 15b).
#[derive(Debug, Clone, Serialize)]
pub struct CallRate {
    /// Calls per second (Poisson arrivals), replayed in real time.
    pub rates: Vec<f64>,
    pub policies: Vec<String>,
    pub contexts: usize,
    pub pattern: String,
    pub calls_per_context: usize,
    pub budget: String,
    pub scale: f64,
    pub seed: u64,
    pub corpus: Vec<PathBuf>,
}

/// Runs it: the same seed at every rate, so the calls are the same and only the gaps change.
pub fn call_rate(base: &Config, s: &CallRate, work: &Path, profiles: &Path, log: &mut dyn FnMut(&SweepRun)) -> Result<Vec<SweepRun>> {
    let mut out = Vec::new();
    for &rate in &s.rates {
        let p = trace_params(s.contexts, s.calls_per_context, &s.pattern, rate, s.scale, s.seed, &s.corpus)?;
        for policy in &s.policies {
            let cfg = Config { budget: s.budget.clone(), ..policy_config(base, policy) };
            let r = SweepRun { label: policy.clone(), x: rate, summary: run_trace(&cfg, &p, Pace::Realtime, work, profiles)? };
            log(&r);
            out.push(r);
        }
    }
    Ok(out)
}

pub fn write_call_rate(dir: &Path, name: &str, s: &CallRate, runs: &[SweepRun]) -> Result<Vec<PathBuf>> {
    let caption = format!(
        "Average switch latency (ms) vs call rate, calls replayed at their trace times ({} active contexts, {} pattern, budget {}, {} calls per context, delta scale {}, seed {}).",
        s.contexts, s.pattern, s.budget, s.calls_per_context, s.scale, s.seed
    );
    sweep_figure(caption, "calls per second", true, runs).write(dir, name, s, &runs)
}

/// Settings of `inference` (Fig. 15a).
#[derive(Debug, Clone, Serialize)]
pub struct Inference {
    /// Context lengths (prompt tokens) measured.
    pub lengths: Vec<usize>,
    /// Tokens decoded after each prompt.
    pub decode: usize,
    pub reps: usize,
    pub chunk_tokens: usize,
}

/// Speeds of one way of holding the KV cache at one length (medians over the repetitions).
#[derive(Debug, Clone, Serialize)]
pub struct InferenceRow {
    /// `engine` (the session's own memory) or `llms` (mm's userfaultfd regions).
    pub memory: String,
    pub length: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
}

/// Runs it: the same token ids through a session whose KV cache is its own memory and through
/// one whose chunks live in mm's slots (llms policy, int8 chunks, a budget that holds them, so
/// what differs is where the memory is and mm's per-call work), alternating, in one process;
/// the two must generate the same tokens (an error otherwise). mm's stores go under `dir`.
pub fn inference(
    model: &Arc<engine::Model>,
    pool: &Arc<engine::ThreadPool>,
    s: &Inference,
    dir: &Path,
    log: &mut dyn FnMut(&InferenceRow),
) -> Result<Vec<InferenceRow>> {
    use engine::kv::KvFormat;
    use engine::model::SessionOptions;
    use engine::{Logits, Session};
    use llmsd::kvmm::SessionKv;
    let ct = s.chunk_tokens;
    if s.reps == 0 || s.decode == 0 || ct == 0 {
        bail!("reps, decode and chunk_tokens must be at least 1");
    }
    let mut out = Vec::new();
    for &len in &s.lengths {
        let toks = llmsd::profile::synthetic_tokens(model, len);
        let cap = len + s.decode + ct;
        if len == 0 || cap > model.config.ctx_len {
            bail!("length {len} + {} decoded tokens must fit the model's context length {}", s.decode, model.config.ctx_len);
        }
        let opts = SessionOptions { capacity: cap, chunk_tokens: ct, base: KvFormat::Int8, observe_attention: false, sliding_window: None };
        let run = dir.join(format!("inference-{}-{len}", std::process::id()));
        let cfg = llmsd::profile::mm_config(mm::Policy::Llms, &[KvFormat::Int8], 1.0, cap.div_ceil(ct) + 1);
        let mut mgr = llmsd::profile::manager(&run, model, ct, cfg, None)?;
        let mut times: [(Vec<f64>, Vec<f64>); 2] = Default::default();
        let mut outputs: [Vec<u32>; 2] = Default::default();
        for rep in 0..s.reps {
            // Alternate which goes first: neither always runs on a warmer machine.
            for which in [rep % 2, 1 - rep % 2] {
                let mut sess = Session::with_options(Arc::clone(model), Arc::clone(pool), opts);
                let id = u64::try_from(rep).unwrap_or(0);
                if which == 1 {
                    mgr.create(id)?;
                    mgr.prepare(id, &mut SessionKv(&mut sess), cap)?;
                    mgr.begin(id, &mut SessionKv(&mut sess), mm::Strategy::Planned)?;
                }
                let t = Instant::now();
                let mut next = engine::sampler::argmax(sess.eval(&toks, Logits::Last)?);
                let pre = t.elapsed().as_secs_f64();
                let mut got = Vec::with_capacity(s.decode);
                let t = Instant::now();
                for _ in 0..s.decode {
                    got.push(next);
                    next = engine::sampler::argmax(sess.eval(&[next], Logits::Last)?);
                }
                let dec = t.elapsed().as_secs_f64();
                // Where the memory lives must not change what is computed.
                if !outputs[1 - which].is_empty() && outputs[1 - which] != got {
                    bail!("length {len}: greedy output with the KV cache in mm's regions differs from the engine's own memory");
                }
                outputs[which] = got;
                if which == 1 {
                    mgr.end(id, &mut SessionKv(&mut sess))?;
                    mgr.flush();
                    mgr.delete(id)?;
                }
                #[allow(clippy::cast_precision_loss)]
                {
                    times[which].0.push(len as f64 / pre.max(1e-9));
                    times[which].1.push(s.decode as f64 / dec.max(1e-9));
                }
            }
        }
        drop(mgr);
        let _ = std::fs::remove_dir_all(&run);
        for (which, (p, d)) in times.into_iter().enumerate() {
            let r = InferenceRow {
                memory: if which == 0 { "engine" } else { "llms" }.into(),
                length: len,
                prefill_tok_s: median(p),
                decode_tok_s: median(d),
            };
            log(&r);
            out.push(r);
        }
    }
    Ok(out)
}

pub fn write_inference(dir: &Path, name: &str, s: &Inference, rows: &[InferenceRow]) -> Result<Vec<PathBuf>> {
    let caption = format!(
        "Inference speed (tokens/s) with the KV cache in the engine's own memory (w/o LLMS) and in mm's userfaultfd regions (w/ LLMS); medians of {} repetitions, {} tokens decoded, chunks of {} tokens.",
        s.reps, s.decode, s.chunk_tokens
    );
    let panel = |title: &str, f: fn(&InferenceRow) -> f64| Panel {
        title: title.into(),
        y_desc: "tokens/s".into(),
        series: series(rows, |r| r.memory.clone(), |r| (x_of(r.length), f(r))),
    };
    let fig = Figure {
        caption,
        x_desc: "context tokens".into(),
        log_x: false,
        log_y: false,
        decimals: 1,
        panels: vec![panel("prefill", |r| r.prefill_tok_s), panel("decode", |r| r.decode_tok_s)],
    };
    fig.write(dir, name, s, &rows)
}

/// Settings of `accuracy-vs-memory` (Fig. 12).
#[derive(Debug, Clone, Serialize)]
pub struct AccuracyVsMemory {
    /// KV plans: int8 (the reference), uniform q4/q2, mix:R (tolerance-aware at R x int8).
    pub plans: Vec<String>,
    pub ctx: usize,
    pub windows: usize,
    pub chunk_tokens: usize,
    pub corpus: Vec<PathBuf>,
    /// Free-running greedy generation: tokens generated after a prompt of `ctx / 2` tokens,
    /// in each window (0: skip).
    pub generate: usize,
    /// The levels the mix plans choose from, the base (int8) first (docs/kv.md).
    pub levels: Vec<String>,
    /// llama.cpp's perplexities with its own KV cache types (`kv_perplexity` in the JSON that
    /// `make fixtures` writes, tests/fixtures/llama_cpp.json): the plans run again on each of
    /// `peer_texts` with the windows the peer ran, beside them (issue #27's peer column).
    pub peer: Option<PathBuf>,
    pub peer_texts: Vec<PathBuf>,
}

/// The plans and llama.cpp's KV types on one text, on the same windows ([`peer_comparison`]).
#[derive(Debug, Clone, Serialize)]
pub struct PeerText {
    /// The text's file name, as the peer's entries name it.
    pub text: String,
    pub ctx: usize,
    pub windows: usize,
    /// Positions scored (ours, equal to the peer's: the same windows).
    pub scored: usize,
    pub rows: Vec<PeerRow>,
}

/// One KV cache's perplexity on a [`PeerText`]: ours (f16, int8 and every plan) or llama.cpp's.
#[derive(Debug, Clone, Serialize)]
pub struct PeerRow {
    /// `llms` or `llama.cpp`.
    pub engine: String,
    /// A plan (ours) or a llama.cpp KV type (`type_k` = `type_v`).
    pub kv: String,
    /// KV bytes a value relative to our int8's (llama.cpp's types by their block sizes; `None`
    /// for a type this table does not know).
    pub bytes_vs_int8: Option<f64>,
    pub ppl: f64,
    /// Against the same engine's f16 KV on the same windows, percent.
    pub vs_f16_pct: f64,
    /// Against our int8 on the same windows, percent (ours only).
    pub vs_int8_pct: Option<f64>,
}

/// Bytes a value of a llama.cpp KV cache type (`type_k`/`type_v` by name), from the engine's
/// GGML block sizes; `None` for a type the engine does not know.
fn ggml_kv_bytes_per_value(kv: &str) -> Option<f64> {
    use engine::GgmlType as T;
    let ty = match kv {
        "f32" => T::F32,
        "f16" => T::F16,
        "bf16" => T::BF16,
        "q8_0" => T::Q8_0,
        "q5_1" => T::Q5_1,
        "q5_0" => T::Q5_0,
        "q4_1" => T::Q4_1,
        "q4_0" => T::Q4_0,
        _ => return None,
    };
    #[allow(clippy::cast_precision_loss)]
    Some(ty.type_size() as f64 / ty.block_size() as f64)
}

/// One of llama.cpp's `kv_perplexity` entries.
struct PeerEntry {
    kv: String,
    ppl: f64,
    ctx: usize,
    windows: usize,
    scored: usize,
}

/// llama.cpp's `kv_perplexity` entries for one text, checked: all on the same windows, one at f16.
fn peer_entries(json: &serde_json::Value, path: &Path, text: &str) -> Result<Vec<PeerEntry>> {
    let entries = json["kv_perplexity"]
        .as_array()
        .with_context(|| format!("{}: no kv_perplexity list (`make fixtures` writes one)", path.display()))?;
    let mut out = Vec::new();
    for e in entries.iter().filter(|e| e["text"].as_str() == Some(text)) {
        let num = |k: &str| e[k].as_u64().and_then(|v| usize::try_from(v).ok());
        let (Some(kv), Some(ppl), Some(ctx), Some(windows), Some(scored)) =
            (e["kv"].as_str(), e["ppl"].as_f64(), num("ctx"), num("windows"), num("scored"))
        else {
            bail!("{}: a kv_perplexity entry for {text} lacks kv, ppl, ctx, windows or scored: {e}", path.display());
        };
        if !(ppl.is_finite() && ppl >= 1.0 && (8..=4096).contains(&ctx) && (1..=10_000).contains(&windows)) {
            bail!("{}: a kv_perplexity entry for {text} is out of range: {e}", path.display());
        }
        out.push(PeerEntry { kv: kv.to_string(), ppl, ctx, windows, scored });
    }
    let Some(first) = out.first() else { bail!("{}: no kv_perplexity entry for {text}", path.display()) };
    if out.iter().any(|e| (e.ctx, e.windows, e.scored) != (first.ctx, first.windows, first.scored)) {
        bail!("{}: the entries for {text} ran on different windows", path.display());
    }
    if !out.iter().any(|e| e.kv == "f16") {
        bail!("{}: no f16 entry for {text}, which the others are measured against", path.display());
    }
    Ok(out)
}

/// Our plans (with f16 and int8) on each of `s.peer_texts` with the windows llama.cpp's entries
/// ran on, beside llama.cpp's KV types; refused when our windows score a different number of
/// positions than the peer's (not the same windows).
pub fn peer_comparison(model: &Arc<engine::Model>, pool: &Arc<engine::ThreadPool>, s: &AccuracyVsMemory) -> Result<Vec<PeerText>> {
    use engine::kv::KvFormat;
    let Some(path) = &s.peer else { return Ok(Vec::new()) };
    let raw = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let json: serde_json::Value = serde_json::from_slice(&raw).with_context(|| format!("{}: not JSON", path.display()))?;
    let levels: Vec<KvFormat> =
        s.levels.iter().map(|l| KvFormat::parse(l).with_context(|| format!("levels: {l:?}"))).collect::<Result<_>>()?;
    let mut plans = vec!["f16".to_string(), "int8".to_string()];
    plans.extend(s.plans.iter().filter(|p| !plans.contains(p)).cloned().collect::<Vec<_>>());
    let hd = model.config.head_dim.max(1);
    #[allow(clippy::cast_precision_loss)]
    let int8_per_value = 1.0 + 2.0 / hd as f64;
    // Every text's entries are checked before the first (long) run.
    let mut texts = Vec::new();
    for t in &s.peer_texts {
        let name = t.file_name().map(|n| n.to_string_lossy().into_owned()).with_context(|| format!("{}: no file name", t.display()))?;
        let entries = peer_entries(&json, path, &name)?;
        let text = std::fs::read_to_string(t).with_context(|| format!("reading {}", t.display()))?;
        texts.push((name, entries, model.tokenizer.encode(&text, false, false)?));
    }
    let mut out = Vec::new();
    for (name, entries, ids) in texts {
        let (ctx, windows, scored) = (entries[0].ctx, entries[0].windows, entries[0].scored);
        let mut rows: Vec<PeerRow> = Vec::new();
        let (mut f16, mut int8) = (0.0, 0.0);
        for plan_name in &plans {
            let plan = engine::eval::KvPlan::parse(plan_name).with_context(|| format!("plan {plan_name:?}"))?;
            let ratio = if let engine::eval::KvPlan::Mix(r) = plan { r } else { 1.0 };
            let choose = llmsd::kvmm::mix_chooser(model, s.chunk_tokens, ratio, &levels);
            let run = engine::eval::KvRun { plan, chunk_tokens: s.chunk_tokens, choose: &choose };
            let (p, bytes) = engine::eval::perplexity_kv(model, Arc::clone(pool), &ids, ctx, windows, run, None)?;
            if p.scored != scored {
                bail!("{name}: our windows score {} positions, llama.cpp's {scored}: not the same windows", p.scored);
            }
            match plan_name.as_str() {
                "f16" => f16 = p.ppl,
                "int8" => int8 = p.ppl,
                _ => {}
            }
            let bytes = if plan_name == "f16" { 2.0 / int8_per_value } else { bytes };
            rows.push(PeerRow {
                engine: "llms".into(),
                kv: plan_name.clone(),
                bytes_vs_int8: Some(bytes),
                ppl: p.ppl,
                vs_f16_pct: (p.ppl / f16 - 1.0) * 100.0,
                vs_int8_pct: (int8 > 0.0).then(|| (p.ppl / int8 - 1.0) * 100.0),
            });
        }
        let peer_f16 = entries.iter().find(|e| e.kv == "f16").map_or(f64::NAN, |e| e.ppl);
        for e in entries {
            rows.push(PeerRow {
                engine: "llama.cpp".into(),
                bytes_vs_int8: ggml_kv_bytes_per_value(&e.kv).map(|b| b / int8_per_value),
                kv: e.kv,
                ppl: e.ppl,
                vs_f16_pct: (e.ppl / peer_f16 - 1.0) * 100.0,
                vs_int8_pct: None,
            });
        }
        out.push(PeerText { text: name, ctx, windows, scored, rows });
    }
    Ok(out)
}

/// One plan's quality.
#[derive(Debug, Clone, Serialize)]
pub struct Accuracy {
    pub plan: String,
    /// KV bytes of full chunks relative to int8.
    pub bytes_vs_int8: f64,
    pub ppl: f64,
    /// Perplexity change relative to int8, percent.
    pub ppl_vs_int8_pct: f64,
    /// Scored positions where the most likely token equals int8's (teacher-forced greedy
    /// agreement).
    pub top1_agreement: f64,
    /// Free-running greedy generation: the share of generated tokens equal to int8's at the
    /// same position, and the mean share generated before the first difference.
    pub greedy_agreement: f64,
    pub greedy_prefix: f64,
}

/// Perplexity (llama.cpp's method, KV compressed chunk by chunk as the plan says) and greedy
/// agreement with int8, per plan, on the corpus text.
pub fn accuracy_vs_memory(
    model: &std::sync::Arc<engine::Model>,
    pool: &std::sync::Arc<engine::ThreadPool>,
    s: &AccuracyVsMemory,
) -> Result<Vec<Accuracy>> {
    let mut text = String::new();
    for f in &s.corpus {
        text.push_str(&String::from_utf8_lossy(&std::fs::read(f).with_context(|| format!("reading {}", f.display()))?));
        text.push('\n');
    }
    let ids = model.tokenizer.encode(&text, false, false)?;
    if ids.len() < s.ctx {
        anyhow::bail!("the corpus has {} tokens, fewer than one window of {}", ids.len(), s.ctx);
    }
    use engine::kv::KvFormat;
    let levels: Vec<KvFormat> =
        s.levels.iter().map(|l| KvFormat::parse(l).with_context(|| format!("levels: {l:?} is not a KV format"))).collect::<Result<_>>()?;
    if levels.first() != Some(&KvFormat::Int8) {
        anyhow::bail!("levels: the base level int8 comes first");
    }
    let mut plans = vec!["int8".to_string()];
    plans.extend(s.plans.iter().filter(|p| p.as_str() != "int8").cloned());
    let mut out = Vec::new();
    let mut reference: Vec<u32> = Vec::new();
    let mut greedy_ref: Vec<Vec<u32>> = Vec::new();
    let mut ref_ppl = 0.0;
    for name in &plans {
        let plan = engine::eval::KvPlan::parse(name)
            .with_context(|| format!("plan {name:?}: a KV format (f16, int8, q4, q2, q4r, q2r, k4v4, k3v3, k2v2, k4v3) or mix:R"))?;
        let ratio = if let engine::eval::KvPlan::Mix(r) = plan { r } else { 1.0 };
        let choose = llmsd::kvmm::mix_chooser(model, s.chunk_tokens, ratio, &levels);
        let mut top = Vec::new();
        let run = engine::eval::KvRun { plan, chunk_tokens: s.chunk_tokens, choose: &choose };
        let (p, bytes) = engine::eval::perplexity_kv(model, Arc::clone(pool), &ids, s.ctx, s.windows, run, Some(&mut top))?;
        if reference.is_empty() {
            reference.clone_from(&top);
            ref_ppl = p.ppl;
        }
        #[allow(clippy::cast_precision_loss)]
        let agree = top.iter().zip(&reference).filter(|(a, b)| a == b).count() as f64 / reference.len().max(1) as f64;
        let (mut greedy_agreement, mut greedy_prefix) = (1.0, 1.0);
        if s.generate > 0 {
            let runs = engine::eval::greedy_kv(model, Arc::clone(pool), &ids, s.ctx / 2, s.generate, s.windows, run)?;
            if greedy_ref.is_empty() {
                greedy_ref.clone_from(&runs);
            }
            (greedy_agreement, greedy_prefix) = sequence_agreement(&runs, &greedy_ref);
        }
        out.push(Accuracy {
            plan: name.clone(),
            bytes_vs_int8: bytes,
            ppl: p.ppl,
            ppl_vs_int8_pct: (p.ppl / ref_ppl - 1.0) * 100.0,
            top1_agreement: agree,
            greedy_agreement,
            greedy_prefix,
        });
    }
    Ok(out)
}

/// Agreement of generated sequences with reference ones: the share of equal tokens at equal
/// positions, and the mean share of each sequence before its first difference.
#[allow(clippy::cast_precision_loss)]
pub fn sequence_agreement(runs: &[Vec<u32>], reference: &[Vec<u32>]) -> (f64, f64) {
    let (mut same, mut total, mut prefix) = (0usize, 0usize, 0.0);
    for (a, b) in runs.iter().zip(reference) {
        let n = a.len().min(b.len());
        same += a.iter().zip(b).filter(|(x, y)| x == y).count();
        total += n;
        prefix += a.iter().zip(b).take_while(|(x, y)| x == y).count() as f64 / n.max(1) as f64;
    }
    (same as f64 / total.max(1) as f64, prefix / reference.len().max(1) as f64)
}

/// Writes `<dir>/<name>.md`, `.json`, `.svg`, `.png`: the table and perplexity vs KV bytes.
pub fn write_accuracy(dir: &Path, name: &str, s: &AccuracyVsMemory, rows: &[Accuracy], peer: &[PeerText]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut md = format!(
        "KV compression vs quality: perplexity (llama.cpp's method, ctx {}, {} windows, chunks of {} tokens, KV lowered chunk by chunk), teacher-forced greedy agreement with int8 (share of scored positions with int8's most likely token) and free-running greedy agreement ({} tokens generated after a {}-token prompt per window: equal tokens at equal positions, and the share before the first difference); mix:R chooses among {} for R x int8's bytes.\n\n| plan | KV bytes vs int8 | perplexity | vs int8 | teacher-forced agreement | free-running agreement | before first difference |\n|---|---|---|---|---|---|---|\n",
        s.ctx,
        s.windows,
        s.chunk_tokens,
        s.generate,
        s.ctx / 2,
        s.levels.join(", ")
    );
    for r in rows {
        md.push_str(&format!(
            "| {} | {:.3} | {:.4} | {:+.2}% | {:.1}% | {:.1}% | {:.1}% |\n",
            r.plan,
            r.bytes_vs_int8,
            r.ppl,
            r.ppl_vs_int8_pct,
            r.top1_agreement * 100.0,
            r.greedy_agreement * 100.0,
            r.greedy_prefix * 100.0
        ));
    }
    md.push_str(&peer_table(peer));
    let md_path = dir.join(format!("{name}.md"));
    std::fs::write(&md_path, md)?;
    let json_path = dir.join(format!("{name}.json"));
    let json = serde_json::json!({"command": crate::figure::command_line(), "measured": crate::figure::measured(), "settings": s, "rows": rows, "peer": peer});
    std::fs::write(&json_path, serde_json::to_string_pretty(&json)?)?;
    let svg = dir.join(format!("{name}.svg"));
    let png = dir.join(format!("{name}.png"));
    ensure_font()?;
    accuracy_chart(SVGBackend::new(&svg, (560, 400)).into_drawing_area(), rows)?;
    accuracy_chart(BitMapBackend::new(&png, (560, 400)).into_drawing_area(), rows)?;
    Ok(vec![md_path, json_path, svg, png])
}

/// The peer comparison as a markdown table (empty without one).
pub fn peer_table(peer: &[PeerText]) -> String {
    if peer.is_empty() {
        return String::new();
    }
    let mut md = String::from(
        "\nOn the KV accuracy texts, beside llama.cpp's own KV cache types (`type_k` = `type_v`, flash attention on, through llama-cpp-python: `make fixtures`), on the same windows; each engine against its own f16:\n\n| text (windows of ctx) | engine | KV | bytes vs int8 | perplexity | vs its f16 | vs int8 |\n|---|---|---|---|---|---|---|\n",
    );
    for t in peer {
        for r in &t.rows {
            let bytes = r.bytes_vs_int8.map_or_else(|| "?".into(), |b| format!("{b:.3}"));
            let vs_int8 = r.vs_int8_pct.map_or_else(|| "—".into(), |v| format!("{v:+.2}%"));
            md.push_str(&format!(
                "| {} ({} of {}) | {} | {} | {bytes} | {:.3} | {:+.2}% | {vs_int8} |\n",
                t.text, t.windows, t.ctx, r.engine, r.kv, r.ppl, r.vs_f16_pct
            ));
        }
    }
    md
}

fn accuracy_chart<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, rows: &[Accuracy]) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("plotting: {x:?}");
    root.fill(&WHITE).map_err(e)?;
    let ymin = rows.iter().map(|r| r.ppl).fold(f64::MAX, f64::min) * 0.95;
    let ymax = rows.iter().map(|r| r.ppl).fold(0.0, f64::max) * 1.05;
    let mut ch = ChartBuilder::on(&root)
        .caption("perplexity vs KV memory", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(34)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0f64..1.1, ymin..ymax)
        .map_err(e)?;
    ch.configure_mesh().x_desc("KV bytes relative to int8").y_desc("perplexity").draw().map_err(e)?;
    for (r, color) in rows.iter().map(|r| (r, if r.plan.starts_with("mix") { COLORS[0] } else { COLORS[1] })) {
        ch.draw_series(std::iter::once(Circle::new((r.bytes_vs_int8, r.ppl), 4, color.filled()))).map_err(e)?;
        ch.draw_series(std::iter::once(Text::new(r.plan.clone(), (r.bytes_vs_int8 + 0.015, r.ppl), ("sans-serif", 13)))).map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chosen ratio is the last one within the tolerance on every text, the search stops at
    /// the first one that is not (a later one passing again is not taken), and none within
    /// gives `None`.
    #[test]
    fn llms_at_a_fixed_ratio_is_a_policy_of_its_own() {
        let base = Config { ratio: 0.55, levels: vec!["int8".into(), "k4v3".into()], ..Config::default() };
        let fixed = policy_config(&base, "llms@0.5");
        assert_eq!((fixed.policy.as_str(), fixed.ratio, &fixed.levels), ("llms", 0.5, &base.levels));
        let chosen = policy_config(&base, "llms");
        assert_eq!((chosen.policy.as_str(), chosen.ratio), ("llms", 0.55));
        assert_eq!(policy_config(&base, "vllm-sq").levels, ["int8"]);
        for ok in ["llms", "llms@0.5", "llms@1", "vllm-sq", "lmk"] {
            check_policy(ok).unwrap();
        }
        for bad in ["llms@0", "llms@1.5", "llms@", "llms@x", "llms@NaN", "llms@-0.5", "LLMS", "vllm-sq@0.5", ""] {
            assert!(check_policy(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn the_ratio_by_quality_is_the_most_compressed_within_on_every_text() {
        let base = [10.0, 20.0];
        // Text 0 loses 0.2% per 0.1 of compression and bumps by 1% at 0.7 (noise), text 1 0.1%.
        let score = |r: f64| -> Result<Vec<f64>> {
            let c = 1.0 - r;
            let bump = if (r - 0.7).abs() < 1e-9 { 0.01 } else { 0.0 };
            Ok(vec![10.0 * (1.0 + 0.02 * c + bump), 20.0 * (1.0 + 0.01 * c)])
        };
        let ratios = &QUALITY_RATIOS[1..];
        let (best, steps) = most_compressed_within(ratios, &base, 1.0, score).unwrap();
        // 0.65 would be within again (0.7%), but the search stopped at 0.7.
        assert_eq!(best, Some(0.75), "{steps:?}");
        assert_eq!(steps.len(), 6);
        assert!(steps.last().is_some_and(|s| !s.within && (s.ratio - 0.7).abs() < 1e-9));
        assert!(steps[..5].iter().all(|s| s.within));
        let (best, steps) = most_compressed_within(ratios, &base, 0.45, score).unwrap();
        assert_eq!(best, Some(0.8));
        assert_eq!(steps.len(), 5);
        let (none, _) = most_compressed_within(&[0.9, 0.8], &base, 0.1, score).unwrap();
        assert_eq!(none, None);
        // Between a step within and the next that failed, hundredths, least compressed first.
        assert_eq!(finer_ratios(0.55, 0.5), vec![0.54, 0.53, 0.52, 0.51]);
        assert!(finer_ratios(0.55, 0.54).is_empty());
        // A failing score stops the search with its error.
        assert!(most_compressed_within(&[0.9], &base, 1.0, |_| Err(anyhow!("no text"))).is_err());
    }
}

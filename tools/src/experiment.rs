//! Experiments over traces (issue #7, the paper's §5): each runs the real service on
//! synthetic traces and writes a table (Markdown and JSON) and a plot (SVG and PNG).
//!
//! `switch-vs-contexts` (Fig. 9): average switch latency against the number of active contexts
//! for each policy and switching pattern, at one memory budget.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Serialize;

use crate::config::Config;
use crate::replay::{replay, summarize};
use crate::service::Local;
use crate::trace::{generate, GenParams, Pattern};

/// Each baseline's own best configuration on this engine (same store, budget and trace):
/// `llms` with the paper's levels {8,4,2}/8 bits at a 50% global ratio; `vllm-sq` int8
/// chunks; `vllm-s` chunks as the engine computes them, f16; `swap` and `lmk` int8 (the
/// cheaper format is only to their advantage).
pub fn policy_config(base: &Config, policy: &str) -> Config {
    let (levels, ratio): (&[&str], f64) = match policy {
        "llms" => (&["int8", "q4", "q2"], 0.5),
        "vllm-s" => (&["f16"], 1.0),
        _ => (&["int8"], 1.0),
    };
    Config { policy: policy.into(), levels: levels.iter().map(|s| (*s).to_string()).collect(), ratio, ..base.clone() }
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
        let pat = Pattern::parse(pattern).with_context(|| format!("pattern {pattern:?}"))?;
        for &n in &s.contexts {
            let p = GenParams {
                contexts: n,
                apps: n.min(4),
                calls: n * s.calls_per_context,
                pattern: pat,
                rate: 1.0,
                seed: s.seed,
                scale: s.scale,
                markov_decay: 0.5,
                corpus: s.corpus.clone(),
            };
            let (h, recs) = generate(&p)?;
            for policy in &s.policies {
                let state = work.join(format!("{pattern}-{n}-{policy}"));
                crate::loadbench::fresh_state(&state, profiles)?;
                let cfg = Config {
                    socket: state.join("llmsd.sock"),
                    state_dir: state.clone(),
                    budget: s.budget.clone(),
                    pressure: false,
                    ..policy_config(base, policy)
                };
                let local = Local::start(cfg)?;
                let r = replay(&local.socket, &h, &recs, &mut |_| {});
                local.stop()?;
                let _ = std::fs::remove_dir_all(&state);
                let results = r?;
                // The first call of each context has nothing to switch in: the figure is
                // about switches back to a context.
                let mut seen = std::collections::HashSet::new();
                let back: Vec<_> = results.into_iter().filter(|x| !seen.insert(x.ctx)).collect();
                let sum = summarize(&back, 0.0);
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

/// Writes `<dir>/<name>.md`, `.json`, `.svg` and `.png`: the table and one chart per pattern.
pub fn write_switch_vs_contexts(dir: &Path, name: &str, s: &SwitchVsContexts, points: &[Point]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut md = format!(
        "Average switch latency (ms) vs active contexts; budget {}, {} calls per context, delta scale {}, seed {}.\n",
        s.budget, s.calls_per_context, s.scale, s.seed
    );
    for pattern in &s.patterns {
        md.push_str(&format!("\n**{pattern}**\n\n| policy |"));
        for n in &s.contexts {
            md.push_str(&format!(" {n} |"));
        }
        md.push_str("\n|---|");
        md.push_str(&"---|".repeat(s.contexts.len()));
        md.push('\n');
        for policy in &s.policies {
            md.push_str(&format!("| {policy} |"));
            for &n in &s.contexts {
                match points.iter().find(|p| &p.pattern == pattern && &p.policy == policy && p.contexts == n) {
                    Some(p) => md.push_str(&format!(" {:.2} |", p.switch_mean_ms)),
                    None => md.push_str(" - |"),
                }
            }
            md.push('\n');
        }
    }
    let md_path = dir.join(format!("{name}.md"));
    std::fs::write(&md_path, md)?;
    let json_path = dir.join(format!("{name}.json"));
    std::fs::write(&json_path, serde_json::to_string_pretty(&serde_json::json!({"settings": s, "points": points}))?)?;
    let svg = dir.join(format!("{name}.svg"));
    let png = dir.join(format!("{name}.png"));
    ensure_font()?;
    let w = 420 * u32::try_from(s.patterns.len().max(1)).unwrap_or(1);
    chart(SVGBackend::new(&svg, (w, 360)).into_drawing_area(), s, points)?;
    chart(BitMapBackend::new(&png, (w, 360)).into_drawing_area(), s, points)?;
    Ok(vec![md_path, json_path, svg, png])
}

/// The plots' font: DejaVu Sans (Debian's fonts-dejavu-core, which `make` installs).
fn ensure_font() -> Result<()> {
    static DONE: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let path = ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/dejavu/DejaVuSans.ttf"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .ok_or("no DejaVuSans.ttf: install fonts-dejavu-core (make does)")?;
        let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
        plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
            .map_err(|_| format!("{path} is not a usable font"))
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

const COLORS: [RGBColor; 5] =
    [RGBColor(214, 39, 40), RGBColor(31, 119, 180), RGBColor(44, 160, 44), RGBColor(255, 127, 14), RGBColor(148, 103, 189)];

fn chart<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, s: &SwitchVsContexts, points: &[Point]) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("plotting: {x:?}");
    root.fill(&WHITE).map_err(e)?;
    let panels = root.split_evenly((1, s.patterns.len().max(1)));
    let xmax = s.contexts.iter().copied().max().unwrap_or(1) as f64 + 1.0;
    let ymax = points.iter().map(|p| p.switch_mean_ms).fold(1.0, f64::max) * 2.0;
    let ymin = points.iter().map(|p| p.switch_mean_ms).filter(|&v| v > 0.0).fold(ymax, f64::min).max(1e-3) / 2.0;
    for (panel, pattern) in panels.iter().zip(&s.patterns) {
        let mut ch = ChartBuilder::on(panel)
            .caption(format!("{pattern} pattern"), ("sans-serif", 18))
            .margin(8)
            .x_label_area_size(32)
            .y_label_area_size(56)
            .build_cartesian_2d(0f64..xmax, (ymin..ymax).log_scale())
            .map_err(e)?;
        ch.configure_mesh().x_desc("active contexts").y_desc("avg switch latency (ms)").draw().map_err(e)?;
        for (k, policy) in s.policies.iter().enumerate() {
            let c = COLORS[k % COLORS.len()];
            #[allow(clippy::cast_precision_loss)]
            let pts: Vec<(f64, f64)> = points
                .iter()
                .filter(|p| &p.pattern == pattern && &p.policy == policy)
                .map(|p| (p.contexts as f64, p.switch_mean_ms.max(ymin)))
                .collect();
            ch.draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(e)?
                .label(policy.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
            ch.draw_series(pts.into_iter().map(|(x, y)| Circle::new((x, y), 3, c.filled()))).map_err(e)?;
        }
        ch.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(())
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
    let mut plans = vec!["int8".to_string()];
    plans.extend(s.plans.iter().filter(|p| p.as_str() != "int8").cloned());
    let mut out = Vec::new();
    let mut reference: Vec<u32> = Vec::new();
    let mut ref_ppl = 0.0;
    for name in &plans {
        let plan = engine::eval::KvPlan::parse(name).with_context(|| format!("plan {name:?}: f16, int8, q4, q2 or mix:R"))?;
        let ratio = if let engine::eval::KvPlan::Mix(r) = plan { r } else { 1.0 };
        let choose = crate::kvmm::mix_chooser(model, s.chunk_tokens, ratio);
        let mut top = Vec::new();
        let (p, bytes) = engine::eval::perplexity_kv(
            model,
            std::sync::Arc::clone(pool),
            &ids,
            s.ctx,
            s.windows,
            plan,
            s.chunk_tokens,
            &choose,
            Some(&mut top),
        )?;
        if reference.is_empty() {
            reference.clone_from(&top);
            ref_ppl = p.ppl;
        }
        #[allow(clippy::cast_precision_loss)]
        let agree = top.iter().zip(&reference).filter(|(a, b)| a == b).count() as f64 / reference.len().max(1) as f64;
        out.push(Accuracy {
            plan: name.clone(),
            bytes_vs_int8: bytes,
            ppl: p.ppl,
            ppl_vs_int8_pct: (p.ppl / ref_ppl - 1.0) * 100.0,
            top1_agreement: agree,
        });
    }
    Ok(out)
}

/// Writes `<dir>/<name>.md`, `.json`, `.svg`, `.png`: the table and perplexity vs KV bytes.
pub fn write_accuracy(dir: &Path, name: &str, s: &AccuracyVsMemory, rows: &[Accuracy]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut md = format!(
        "KV compression vs quality: perplexity (llama.cpp's method, ctx {}, {} windows, chunks of {} tokens, KV lowered chunk by chunk) and teacher-forced greedy agreement with int8.\n\n| plan | KV bytes vs int8 | perplexity | vs int8 | greedy agreement |\n|---|---|---|---|---|\n",
        s.ctx, s.windows, s.chunk_tokens
    );
    for r in rows {
        md.push_str(&format!(
            "| {} | {:.3} | {:.4} | {:+.2}% | {:.1}% |\n",
            r.plan,
            r.bytes_vs_int8,
            r.ppl,
            r.ppl_vs_int8_pct,
            r.top1_agreement * 100.0
        ));
    }
    let md_path = dir.join(format!("{name}.md"));
    std::fs::write(&md_path, md)?;
    let json_path = dir.join(format!("{name}.json"));
    std::fs::write(&json_path, serde_json::to_string_pretty(&serde_json::json!({"settings": s, "rows": rows}))?)?;
    let svg = dir.join(format!("{name}.svg"));
    let png = dir.join(format!("{name}.png"));
    ensure_font()?;
    accuracy_chart(SVGBackend::new(&svg, (560, 400)).into_drawing_area(), rows)?;
    accuracy_chart(BitMapBackend::new(&png, (560, 400)).into_drawing_area(), rows)?;
    Ok(vec![md_path, json_path, svg, png])
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

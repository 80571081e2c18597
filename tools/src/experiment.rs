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

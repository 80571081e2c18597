//! Paged weights from the command line: `bench-weights` (decode speed resident and paged)
//! and `plan-weights` (ActiveFlow's cost model, per budget).

use std::path::PathBuf;
use std::sync::Arc;

use ::engine::{Model, ThreadPool};
use anyhow::{bail, Result};
use clap::Args;
use serde_json::json;

use super::*;

/// `llms bench-weights`.
#[derive(Args, Debug)]
pub struct BenchWeightsArgs {
    /// Budgets in percent of the weight bytes.
    #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [100.0f64, 75.0, 50.0, 25.0])]
    pub budgets: Vec<f64>,
    #[arg(long, default_value_t = 32)]
    pub tg: usize,
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Also run each budget below 100% without read-ahead.
    #[arg(long)]
    pub no_preload_too: bool,
    /// Top-K sparsity levels (e.g. 0,0.5,0.7): with any above 0, paged weights are read by
    /// active channel from a channel-major image, and each level also runs resident
    /// channel-major [default: 0, the packed image]. Calibrated on --calib-text.
    #[arg(long = "levels", value_delimiter = ',', num_args = 1..)]
    pub levels: Vec<f32>,
    /// Score perplexity (windows of 512 tokens) on this text with each configuration.
    #[arg(long)]
    pub ppl_text: Option<PathBuf>,
    #[arg(long, default_value_t = 2)]
    pub ppl_windows: usize,
    /// One paged case per budget as the weight plan chooses it (sparsity from
    /// --plan-levels up to --max-sparsity, group size), next to what the plan predicted.
    #[arg(long)]
    pub plan: bool,
    /// Sparsity levels a plan chooses from.
    #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = PLAN_LEVELS)]
    pub plan_levels: Vec<f32>,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub m: ModelArgs,
}

impl BenchWeightsArgs {
    pub fn run(self) -> Result<()> {
        let Self { budgets, tg, reps, no_preload_too, levels, ppl_text, ppl_windows, plan, plan_levels, json, m } = self;
        let plan_levels = plan.then_some(plan_levels);
        bench_weights(&m, budgets, tg, reps, no_preload_too, &levels, ppl_text, ppl_windows, plan_levels.as_deref(), json)?;
        Ok(())
    }
}

/// `llms plan-weights`.
#[derive(Args, Debug)]
pub struct PlanWeightsArgs {
    /// Budgets in percent of the weight bytes.
    #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [100.0f64, 75.0, 50.0, 25.0])]
    pub budgets: Vec<f64>,
    /// Sparsity levels to choose from (each calibrated on --calib-text once).
    #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = PLAN_LEVELS)]
    pub levels: Vec<f32>,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub m: ModelArgs,
}

impl PlanWeightsArgs {
    pub fn run(self) -> Result<()> {
        let Self { budgets, levels, json, m } = self;
        plan_weights(&m, &budgets, &levels, json)?;
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn bench_weights(
    m: &ModelArgs,
    budgets: Vec<f64>,
    tg: usize,
    reps: usize,
    no_preload_too: bool,
    levels: &[f32],
    ppl_text: Option<PathBuf>,
    ppl_windows: usize,
    plan_levels: Option<&[f32]>,
    json: bool,
) -> Result<()> {
    let path = model_path(m);
    let threads = threads_of(m);
    let ppl_text = ppl_text.map(|p| read_text(&p).map(|t| (t, ppl_windows))).transpose()?;
    if let Some(&s) = levels.iter().find(|s| !(0.0..1.0).contains(*s)) {
        bail!("--levels: {s} is not a sparsity in [0, 1)");
    }
    let mut sparsity = Vec::new();
    if levels.iter().any(|&s| s > 0.0) {
        let (model, pool) = (Arc::new(Model::load(&path)?), Arc::new(ThreadPool::new(threads)));
        let text = m.calib_text.clone().unwrap_or_else(|| PathBuf::from(CALIB_TEXT));
        for &s in levels {
            let sp = (s > 0.0)
                .then(|| llmsd::weights::sparsity::calibrated(&model, &pool, &path, &llmsd::profile::state_dir(), s, &text))
                .transpose()?;
            sparsity.push((s, sp));
        }
    }
    let mut plans = Vec::new();
    if let Some(pl) = plan_levels {
        let (inputs, thresholds) = plan_inputs(m, pl)?;
        for &b in &budgets {
            let plan = inputs.plan(llmsd::weights::plan::budget_bytes(llmsd::weights::Budget::Percent(b), &inputs))?;
            let sp = thresholds.iter().find(|(l, _)| *l == plan.sparsity).and_then(|(_, sp)| sp.clone());
            plans.push((llmsd::weights::PlanState { inputs: inputs.clone(), plan }, sp));
        }
    }
    let o = crate::weightbench::BenchOptions {
        budgets,
        tg,
        reps,
        threads,
        image: m.weights_image.clone(),
        no_preload_too,
        ppl_text,
        sparsity,
        plans,
    };
    let rows = crate::weightbench::run(&path, &o)?;
    if json {
        println!("{}", serde_json::to_string(&rows)?);
        return Ok(());
    }
    println!("model {} | threads {threads} | tg{tg}, median of {reps}", path.display());
    println!(
        "{:<9} {:<13} {:>2} {:>5} {:>8} {:>7} {:>8} {:>7} {:>10} {:>10} {:>6} {:>8} {:>9} {:>9} {:>9} {:>8} {:>12} {:>12}",
        "weights",
        "layout",
        "N",
        "S",
        "budget",
        "preload",
        "tg tok/s",
        "vs res",
        "MiB read/t",
        "LRU MiB/t",
        "vs LRU",
        "hit",
        "precision",
        "faults/t",
        "floor t/s",
        "ppl",
        "plan t/s,MiB",
        "demand t/s,MiB"
    );
    for r in &rows {
        println!(
            "{:<9} {:<13} {:>2} {:>5.2} {:>8.1} {:>7} {:>8.1} {:>7.3} {:>10.2} {:>10} {:>6} {:>7.1}% {:>9} {:>9.1} {:>9} {:>8} {:>12} {:>12}",
            r.weights,
            r.layout,
            if r.span > 0 { r.span.to_string() } else { "-".into() },
            r.sparsity,
            r.budget_mib,
            if r.preload { "yes" } else { "no" },
            r.tg_tok_s,
            r.vs_resident,
            r.read_mib_per_token,
            r.lru_read_mib_per_token.map_or("-".into(), |m| format!("{m:.2}")),
            r.vs_lru.map_or("-".into(), |v| format!("{v:.3}")),
            100.0 * r.hit_rate,
            r.preload_precision.map_or("-".into(), |p| format!("{:.1}%", 100.0 * p)),
            r.faults_per_token,
            r.floor_tok_s.map_or("-".into(), |f| format!("{f:.1}")),
            r.ppl.map_or("-".into(), |p| format!("{p:.4}")),
            r.planned_tok_s.zip(r.planned_read_mib).map_or("-".into(), |(t, m)| format!("{t:.1},{m:.1}")),
            r.planned_demand_tok_s.zip(r.planned_demand_read_mib).map_or("-".into(), |(t, m)| format!("{t:.1},{m:.1}")),
        );
    }
    Ok(())
}

/// `llms plan-weights`: the inputs, then the plan for each budget.
#[allow(clippy::cast_precision_loss)]
fn plan_weights(m: &ModelArgs, budgets: &[f64], levels: &[f32], json: bool) -> Result<()> {
    if let Some(&b) = budgets.iter().find(|&&b| !(b > 0.0 && b <= 100.0)) {
        bail!("--budgets: {b} is not a percentage in (0, 100]");
    }
    let (inputs, _) = plan_inputs(m, levels)?;
    let plans: Vec<_> = budgets
        .iter()
        .map(|&b| inputs.plan(llmsd::weights::plan::budget_bytes(llmsd::weights::Budget::Percent(b), &inputs)))
        .collect::<Result<_, _>>()?;
    if json {
        println!("{}", json!({"bandwidths": inputs.bw, "levels": inputs.levels, "plans": plans}));
        return Ok(());
    }
    let mib = |b: f64| b / f64::from(1 << 20);
    let sh = &inputs.shape;
    println!(
        "model {}: {} layers of {:.2} MiB, head {:.1} MiB, a channel's column {} bytes; weight bytes {:.1} MiB",
        model_path(m).display(),
        sh.n_layers,
        mib(sh.layer_bytes as f64),
        mib(sh.head_bytes as f64),
        sh.column_bytes,
        mib(sh.weight_bytes() as f64)
    );
    let flash: Vec<String> = inputs.bw.flash.iter().map(|&(n, b)| format!("{} KiB {:.0}", n >> 10, b / 1e6)).collect();
    println!(
        "bandwidth MB/s: computing (the engine over its weights, or memory if lower) {:.0}, packed kernels {:.0}; installing pages {:.0}; flash reads of {}",
        inputs.bw.mem / 1e6,
        inputs.packed_mem / 1e6,
        inputs.bw.install / 1e6,
        flash.join(", ")
    );
    println!("{:>5} {:>10} {:>15} {:>15} {:>13}", "S", "read/token", "predicted 1/4/8", "hit at 25/50%", "");
    for l in &inputs.levels {
        println!(
            "{:>5.2} {:>9.1}% {:>4.0}%/{:>3.0}%/{:>3.0}% {:>6.1}%/{:>5.1}%",
            l.sparsity,
            100.0 * l.read_share,
            100.0 * l.similarity[0],
            100.0 * l.group_similarity(4),
            100.0 * l.group_similarity(8),
            100.0 * l.hit_rate(0.25),
            100.0 * l.hit_rate(0.5)
        );
    }
    println!(
        "{:>7} {:>9} {:>5} {:>3} {:>9} {:>9} {:>9} {:>6} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "budget",
        "MiB",
        "S",
        "N",
        "group MiB",
        "cache MiB",
        "room MiB",
        "hit",
        "MiB read/t",
        "preload",
        "comp",
        "onload",
        "tok/s",
        "on demand",
        "demand MiB"
    );
    for (b, p) in budgets.iter().zip(&plans) {
        let ms = |t: f64| format!("{:.2}ms", 1e3 * t);
        println!(
            "{:>6}% {:>9.1} {:>5.2} {:>3} {:>9.2} {:>9.1} {:>9.1} {:>5.1}% {:>10.1} {:>9} {:>9} {:>9} {:>9.1} {:>9.1} {:>10.1}",
            b,
            mib(p.budget as f64),
            p.sparsity,
            if p.packed { "pk".to_string() } else { p.span.to_string() },
            mib(p.group_bytes as f64),
            mib(p.cache_bytes as f64),
            mib(p.preload_room as f64),
            100.0 * p.hit_rate,
            mib(p.read_bytes),
            ms(p.times.preload),
            ms(p.times.comp),
            ms(p.times.onload),
            p.tok_s(),
            p.demand_tok_s(),
            mib(p.demand_read_bytes)
        );
    }
    Ok(())
}

//! `llms bench-weights`: decode speed, flash bytes read and hit rate with the weights resident
//! and paged at each budget (or as each plan chose), runs interleaved.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Result};
use engine::weights::ImageFormat;
use engine::Model;

use llmsd::weights::{load_paged, Budget, PagedOptions, PagedWeights, PlanState, DEFAULT_SPAN};

/// One row of `llms bench-weights`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchRow {
    /// "resident", or the budget as a share of the weight bytes.
    pub weights: String,
    /// How the layer matrices are stored: "packed" or "channel-major".
    pub layout: String,
    pub sparsity: f32,
    pub budget_mib: f64,
    pub preload: bool,
    /// Median decode speed, and its ratio to resident weights measured in the same rounds.
    pub tg_tok_s: f64,
    pub vs_resident: f64,
    pub read_mib_per_token: f64,
    pub hit_rate: f64,
    /// Share of preloaded slots the reader then used (none preloaded: `None`).
    pub preload_precision: Option<f64>,
    pub faults_per_token: f64,
    /// What an LRU page cache of the same budget would read per token on the same accesses
    /// (simulated over the recorded slot sequence: `mmap` under the same limit), and our
    /// reads as a share of it. Packed images only.
    pub lru_read_mib_per_token: Option<f64>,
    pub vs_lru: Option<f64>,
    /// Decode speed if every byte read came at the image's sequential read bandwidth and
    /// computing were free (the flash floor); resident weights have none.
    pub floor_tok_s: Option<f64>,
    pub ppl: Option<f64>,
    /// Layers per group of a channel-major image (0: none).
    pub span: usize,
    /// What the weight plan predicted for this case (`bench-weights --plan`): with
    /// ActiveFlow's preloading pipeline, and read on demand only (what our pager does once
    /// its cache fills the budget).
    pub planned_tok_s: Option<f64>,
    pub planned_read_mib: Option<f64>,
    pub planned_demand_tok_s: Option<f64>,
    pub planned_demand_read_mib: Option<f64>,
}

/// Sequential O_DIRECT read bandwidth of `path` in bytes/s (median of 3 passes).
pub fn read_bandwidth(path: &Path) -> Result<f64> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path)?;
    let len = usize::try_from(f.metadata()?.len())?;
    let mut buf = mm::store::AlignedBuf::new(4 << 20);
    let mut rates = Vec::new();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let mut off = 0;
        while off + buf.len() <= len {
            std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, off as u64)?;
            off += buf.len();
        }
        #[allow(clippy::cast_precision_loss)]
        rates.push(off as f64 / t.elapsed().as_secs_f64());
    }
    rates.sort_by(f64::total_cmp);
    Ok(rates[1])
}

/// Settings of `llms bench-weights`.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub budgets: Vec<f64>,
    pub tg: usize,
    pub reps: usize,
    pub threads: usize,
    pub image: Option<PathBuf>,
    /// Also without read-ahead at each budget below 100%.
    pub no_preload_too: bool,
    /// Perplexity windows of 512 tokens to score on this text (0: skip).
    pub ppl_text: Option<(String, usize)>,
    /// Top-K sparsity levels with their calibrated thresholds. Only `0` (the default): the
    /// packed image, read whole. Else every paged case reads a channel-major image by active
    /// channel, and each level above 0 also runs resident channel-major.
    pub sparsity: Vec<(f32, Option<Arc<engine::sparsity::Sparsity>>)>,
    /// Instead of budgets x levels: one paged case per plan (its budget, level, group size
    /// and preload room), reported next to what the plan predicted; with `no_preload_too`
    /// also read on demand only.
    pub plans: Vec<(PlanState, Option<Arc<engine::sparsity::Sparsity>>)>,
}

/// Decode speed, flash reads and hit rate with weights resident and paged at each budget,
/// the runs interleaved round by round so every ratio compares like with like.
#[allow(clippy::cast_precision_loss)]
pub fn run(model_path: &Path, o: &BenchOptions) -> Result<Vec<BenchRow>> {
    use engine::{Logits, Session, ThreadPool};
    if o.tg == 0 || o.reps == 0 || (o.plans.is_empty() && o.budgets.iter().any(|&b| !(b > 0.0 && b <= 100.0))) {
        bail!("--tg and --reps must be positive and budgets in (0, 100]");
    }
    let pool = Arc::new(ThreadPool::new(o.threads));
    let resident = Arc::new(Model::load(model_path)?);
    type Sp = Option<Arc<engine::sparsity::Sparsity>>;
    // (label, preload, model, its paged weights, sparsity, plan)
    type Case = (String, bool, Arc<Model>, Option<Arc<PagedWeights>>, f32, Sp, Option<mm::weightplan::Plan>);
    let mut cases: Vec<Case> = vec![("resident".into(), true, resident, None, 0.0, None, None)];
    let mut levels = if o.sparsity.is_empty() { vec![(0.0, None)] } else { o.sparsity.clone() };
    for (st, sp) in &o.plans {
        if !levels.iter().any(|(s, _)| *s == st.plan.sparsity) {
            levels.push((st.plan.sparsity, sp.clone()));
        }
    }
    let by_channel = levels.iter().any(|(s, _)| *s > 0.0) || !o.plans.is_empty();
    let format = if by_channel { ImageFormat::ChannelMajor { span: DEFAULT_SPAN } } else { ImageFormat::Packed };
    if by_channel {
        let cm = Arc::new(Model::load_as(model_path, engine::WeightFormat::ChannelMajor)?);
        for (s, sp) in levels.iter().filter(|(s, _)| *s > 0.0) {
            cases.push(("resident".into(), true, Arc::clone(&cm), None, *s, sp.clone(), None));
        }
    }
    #[allow(clippy::cast_precision_loss)]
    for (st, sp) in &o.plans {
        let p = &st.plan;
        for preload in [true, false].into_iter().filter(|&pre| pre || (o.no_preload_too && p.budget < st.inputs.all_weight_bytes())) {
            let opts = PagedOptions {
                budget: Budget::Bytes(p.budget),
                image: o.image.clone(),
                preload,
                format: llmsd::weights::plan::image_format(p),
            };
            let (m, pw) = load_paged(model_path, &opts)?;
            pw.set_plan(st.clone());
            let label = format!("{:.0}%", 100.0 * p.budget as f64 / st.inputs.all_weight_bytes() as f64);
            cases.push((label, preload, m, Some(pw), p.sparsity, sp.clone(), Some(p.clone())));
        }
    }
    for &b in o.budgets.iter().filter(|_| o.plans.is_empty()) {
        let mut modes = vec![true];
        if o.no_preload_too && b < 100.0 {
            modes.push(false);
        }
        for preload in modes {
            let opts = PagedOptions { budget: Budget::Percent(b), image: o.image.clone(), preload, format };
            for (s, sp) in &levels {
                // A fresh pager per sparsity: each starts cold, counts its own reads.
                let (m, pw) = load_paged(model_path, &opts)?;
                cases.push((format!("{b}%"), preload, m, Some(pw), *s, sp.clone(), None));
            }
        }
    }
    let vocab = u32::try_from(cases[0].2.config.vocab)?;
    let prompt: Vec<u32> = (0..8u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) % vocab).collect();
    let mut rates = vec![Vec::new(); cases.len()];
    let mut reads = vec![(0u64, 0u64, 0u64, 0u64, 0usize, 0u64, 0u64); cases.len()];
    let mut lru: Vec<_> = cases.iter().map(|c| c.3.as_ref().and_then(|p| p.lru_baseline())).collect();
    let mut lru_read = vec![0u64; cases.len()];
    for rep in 0..=o.reps {
        for (i, (_, _, model, pw, _, sp, _)) in cases.iter().enumerate() {
            let mut s = Session::new(Arc::clone(model), Arc::clone(&pool), prompt.len() + o.tg + 1);
            s.set_sparsity(sp.clone())?;
            s.eval(&prompt, Logits::Last)?;
            // The page cache sees the prompt too, uncounted, as our reads before `before`.
            if let Some(l) = &mut lru[i] {
                l.feed(false);
            }
            let before = pw.as_ref().map(|p| p.stats());
            let mut tok = prompt[0];
            let t = std::time::Instant::now();
            for _ in 0..o.tg {
                tok = engine::sampler::argmax(s.eval(&[tok], Logits::Last)?);
            }
            let secs = t.elapsed().as_secs_f64();
            let lru_bytes = lru[i].as_mut().map(|l| l.feed(rep > 0));
            if rep == 0 {
                continue; // warm-up: the first pass fills the hot set
            }
            lru_read[i] += lru_bytes.unwrap_or(0);
            rates[i].push(o.tg as f64 / secs);
            if let (Some(b), Some(p)) = (before, pw) {
                let a = p.stats();
                let r = &mut reads[i];
                r.0 += a.bytes_read - b.bytes_read;
                r.1 += a.advised_slots - b.advised_slots;
                r.2 += a.advised_resident - b.advised_resident;
                r.3 += a.fault_slots - b.fault_slots;
                r.4 += o.tg;
                r.5 += a.preload_slots - b.preload_slots;
                r.6 += a.prefetch_used - b.prefetch_used;
            }
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = med(&mut rates[0].clone());
    let bw = cases.iter().find_map(|c| c.3.as_ref()).map(|p| read_bandwidth(&p.image)).transpose()?;
    let ppl_ids = match &o.ppl_text {
        Some((text, windows)) if *windows > 0 => Some((cases[0].2.tokenizer.encode(text, false, false)?, *windows)),
        _ => None,
    };
    let mut rows = Vec::new();
    for (i, (label, preload, model, pw, sparsity, sp, plan)) in cases.iter().enumerate() {
        let tg = med(&mut rates[i]);
        let r = reads[i];
        let per_tok = r.0 as f64 / r.4.max(1) as f64;
        let lru_per_tok = lru[i].as_ref().map(|_| lru_read[i] as f64 / r.4.max(1) as f64);
        let ppl = match &ppl_ids {
            Some((ids, w)) if ids.len() >= 512 => {
                Some(engine::eval::perplexity_sparse(model, Arc::clone(&pool), ids, 512, *w, sp.clone())?.ppl)
            }
            _ => None,
        };
        rows.push(BenchRow {
            weights: label.clone(),
            layout: if model.is_channel_major() { "channel-major" } else { "packed" }.into(),
            sparsity: *sparsity,
            budget_mib: pw.as_ref().map_or(0.0, |p| p.stats().budget as f64 / f64::from(1 << 20)),
            preload: *preload,
            tg_tok_s: tg,
            vs_resident: tg / base,
            read_mib_per_token: per_tok / f64::from(1 << 20),
            hit_rate: if r.1 == 0 { 1.0 } else { r.2 as f64 / r.1 as f64 },
            preload_precision: pw.as_ref().and_then(|p| p.preload_precision(r.5, r.6)),
            faults_per_token: r.3 as f64 / r.4.max(1) as f64,
            lru_read_mib_per_token: lru_per_tok.map(|b| b / f64::from(1 << 20)),
            vs_lru: lru_per_tok.filter(|&b| b > 0.0).map(|b| per_tok / b),
            floor_tok_s: pw.as_ref().and(bw).filter(|_| per_tok > 0.0).map(|bw| bw / per_tok),
            ppl,
            span: model.image_span(),
            planned_tok_s: plan.as_ref().map(mm::weightplan::Plan::tok_s),
            planned_read_mib: plan.as_ref().map(|p| p.read_bytes / f64::from(1 << 20)),
            planned_demand_tok_s: plan.as_ref().map(mm::weightplan::Plan::demand_tok_s),
            planned_demand_read_mib: plan.as_ref().map(|p| p.demand_read_bytes / f64::from(1 << 20)),
        });
    }
    Ok(rows)
}

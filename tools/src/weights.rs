//! Paged weights, wired: the engine's weight image (engine::weights) built next to the model
//! once, served by mm's weight pager (mm::weights) under a budget, and handed to the engine as
//! plain memory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use engine::weights::{build_image, GroupKind, ImageFormat, WeightLayout, WeightMemory};
use engine::Model;
use mm::weights::{Fingerprint, ImageWriter, SparseOptions, SparsePager, WeightError, WeightOptions, WeightPager, WeightStats};

/// Slot (and group alignment) of packed weight images: 64 KiB reads are large enough for
/// flash to stream and small enough that a touched embedding row costs little.
pub const SLOT: usize = 64 << 10;
/// Slot of channel-major images: a page, the unit a sparse reader skips. A channel's run in
/// a group of [`DEFAULT_SPAN`] layers is about one (attention input: 4 x 480 bytes;
/// feed-forward input: 4 x 1536).
pub const SPARSE_SLOT: usize = 4 << 10;
/// Layers per group of a channel-major image (ActiveFlow finds 4 enough to overlap loading
/// with computing; `--weights-span`).
pub const DEFAULT_SPAN: usize = 4;

/// The slot size (and group alignment) of images in `format`.
pub fn slot_for(format: ImageFormat) -> usize {
    match format {
        ImageFormat::Packed => SLOT,
        ImageFormat::ChannelMajor { .. } => SPARSE_SLOT,
    }
}

/// A weight budget: bytes, or a share of the model's streamed weight bytes (layers + head).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    Bytes(usize),
    Percent(f64),
}

impl std::str::FromStr for Budget {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        if let Some(p) = s.trim().strip_suffix('%') {
            let v: f64 = p.trim().parse().with_context(|| format!("{s:?} is not a percentage"))?;
            if !(v > 0.0 && v <= 100.0) {
                bail!("{s:?}: a weight budget percentage is in (0, 100]");
            }
            return Ok(Self::Percent(v));
        }
        Ok(Self::Bytes(crate::config::parse_bytes(s)?))
    }
}

/// How to page weights.
#[derive(Debug, Clone)]
pub struct PagedOptions {
    pub budget: Budget,
    /// Image path (default: next to the model, `<model>.llms-weights`).
    pub image: Option<PathBuf>,
    pub preload: bool,
    /// Packed (read whole, streamed by layer) or channel-major (read by active channel).
    pub format: ImageFormat,
}

/// A plan in force, with what it was made from (to re-plan when the budget changes).
#[derive(Debug, Clone)]
pub struct PlanState {
    pub inputs: mm::weightplan::PlanInputs,
    pub plan: mm::weightplan::Plan,
}

#[derive(Debug)]
enum Paging {
    Cycle(WeightPager),
    Sparse(Box<SparsePager>),
}

impl Paging {
    fn info(&self) -> &mm::weights::ImageInfo {
        match self {
            Paging::Cycle(p) => p.info(),
            Paging::Sparse(p) => p.info(),
        }
    }
}

/// The engine's view of a paged weight image.
#[derive(Debug)]
pub struct PagedWeights {
    pager: Paging,
    /// Bytes of the groups read every pass (layers and head): what "100%" means.
    pub weight_bytes: usize,
    pub image: PathBuf,
    /// The weight plan the image and budget were chosen by, if any.
    plan: std::sync::Mutex<Option<PlanState>>,
}

impl WeightMemory for PagedWeights {
    fn bytes(&self) -> &[u8] {
        match &self.pager {
            Paging::Cycle(p) => p.bytes(),
            Paging::Sparse(p) => p.bytes(),
        }
    }
    fn advise(&self, group: usize) -> bool {
        match &self.pager {
            Paging::Cycle(p) => p.advise(group),
            Paging::Sparse(_) => true,
        }
    }
    fn wait(&self, group: usize) {
        if let Paging::Cycle(p) = &self.pager {
            p.wait(group);
        }
    }
    fn need(&self, ranges: &[(usize, usize)], before_wait: &dyn Fn()) {
        if let Paging::Sparse(p) = &self.pager {
            p.need(ranges, before_wait);
        }
    }
    fn prefetch(&self, ranges: &[(usize, usize)]) {
        if let Paging::Sparse(p) = &self.pager {
            p.prefetch(ranges);
        }
    }
}

impl PagedWeights {
    pub fn stats(&self) -> WeightStats {
        match &self.pager {
            Paging::Cycle(p) => p.stats(),
            Paging::Sparse(p) => p.stats(),
        }
    }
    /// Changes the budget (pressure). Under a plan, re-plans first (same sparsity and
    /// group, the cache re-sized: ActiveFlow §4.1 online); a budget the plan cannot hold one
    /// group in is refused and the old budget stays.
    pub fn set_budget(&self, budget: usize) -> Result<(), WeightError> {
        let mut plan = self.plan.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let replanned = match plan.as_ref() {
            Some(st) => Some(st.inputs.replan(&st.plan, budget).map_err(|e| WeightError::Budget(e.to_string()))?),
            None => None,
        };
        match &self.pager {
            Paging::Cycle(p) => p.set_budget(budget)?,
            Paging::Sparse(p) => p.set_budget(budget)?,
        }
        if let (Some(st), Some(p)) = (plan.as_mut(), replanned) {
            tracing::info!(budget, cache = p.cache_bytes, tok_s = p.tok_s(), "weights re-planned");
            self.reserve_for(&p);
            st.plan = p;
        }
        Ok(())
    }

    /// Puts `plan` in force (it chose this image's group size and the budget).
    pub fn set_plan(&self, plan: PlanState) {
        self.reserve_for(&plan.plan);
        *self.plan.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(plan);
    }

    /// The room the plan sets aside beside its cache is the preloads' (ActiveFlow's `M_cl`).
    fn reserve_for(&self, plan: &mm::weightplan::Plan) {
        if let Paging::Sparse(p) = &self.pager {
            p.set_reserve(plan.preload_room);
        }
    }

    /// The plan in force, if any.
    pub fn plan(&self) -> Option<mm::weightplan::Plan> {
        self.plan.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref().map(|s| s.plan.clone())
    }
    pub fn resident_bytes(&self) -> usize {
        match &self.pager {
            Paging::Cycle(p) => p.resident_bytes(),
            Paging::Sparse(p) => p.resident_bytes(),
        }
    }
    /// Bytes read from the image so far, counted before they are installed: a sampler
    /// that reads it before and after measuring Rss knows how many bytes may have arrived
    /// meanwhile.
    pub fn bytes_read(&self) -> u64 {
        match &self.pager {
            Paging::Cycle(p) => p.bytes_read(),
            Paging::Sparse(p) => p.bytes_read(),
        }
    }
    /// Share of `preloaded` slots the reader then used: only where preloads are predictions
    /// (the sparse pager; the streaming pager reads ahead by layer order, every slot of which
    /// the reader takes) and something was preloaded.
    pub fn preload_precision(&self, preloaded: u64, used: u64) -> Option<f64> {
        #[allow(clippy::cast_precision_loss)]
        (self.is_sparse() && preloaded > 0).then(|| used as f64 / preloaded as f64)
    }
    /// The image's trailer: slot size, groups, checksums.
    pub fn info(&self) -> &mm::weights::ImageInfo {
        self.pager.info()
    }
    /// Channel-major (read by active channel) rather than packed.
    pub fn is_sparse(&self) -> bool {
        matches!(self.pager, Paging::Sparse(_))
    }
}

pub fn default_image_path(model: &Path, format: ImageFormat) -> PathBuf {
    let mut s = model.as_os_str().to_owned();
    match format {
        ImageFormat::Packed => s.push(".llms-weights"),
        ImageFormat::ChannelMajor { span } => s.push(format!(".llms-weights-cm{span}")),
    }
    PathBuf::from(s)
}

/// Writes the weight image of `model` (fingerprint `fp`) to `image`.
pub fn build(model: &Path, image: &Path, fp: Fingerprint, format: ImageFormat) -> Result<WeightLayout> {
    let slot = slot_for(format);
    let mut w = ImageWriter::create(image, slot, fp)?;
    let layout = build_image(model, slot, format, &mut |g, bytes| w.group(g.offset, bytes).map_err(std::io::Error::other))
        .with_context(|| format!("building the weight image {}", image.display()))?;
    w.finish()?;
    Ok(layout)
}

/// Loads `model` with its weights paged from its image under `opts.budget`, building the image
/// first when it is missing, stale (the model file changed) or damaged.
/// The groups a budget covers (layers and head; the embedding table is read by row) and their
/// bytes in whole slots of `slot`: what "100%" of an image's weights means.
pub fn weight_groups(layout: &WeightLayout, slot: usize) -> (Vec<usize>, usize) {
    let cycle: Vec<usize> = layout.groups.iter().enumerate().filter(|(_, g)| g.kind != GroupKind::Embedding).map(|(i, _)| i).collect();
    let bytes = cycle.iter().map(|&i| layout.groups[i].len.next_multiple_of(slot)).sum();
    (cycle, bytes)
}

pub fn load_paged(model: &Path, opts: &PagedOptions) -> Result<(Arc<Model>, Arc<PagedWeights>)> {
    let fp = Fingerprint::of(model)?;
    let slot = slot_for(opts.format);
    let layout = WeightLayout::for_file(model, slot, opts.format).with_context(|| format!("loading {}", model.display()))?;
    let (cycle, weight_bytes) = weight_groups(&layout, slot);
    let budget = match opts.budget {
        Budget::Bytes(b) => b,
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
        Budget::Percent(p) => (weight_bytes as f64 * p / 100.0) as usize,
    };
    let image = opts.image.clone().unwrap_or_else(|| default_image_path(model, opts.format));
    let same_layout = |info: &mm::weights::ImageInfo| {
        let g = &info.groups;
        info.slot_size == slot
            && g.len() == layout.groups.len()
            && g.iter().zip(&layout.groups).all(|(a, b)| a.offset == b.offset as u64 && a.len == b.len as u64)
    };
    let open = || -> Result<Paging, WeightError> {
        Ok(match opts.format {
            ImageFormat::Packed => {
                Paging::Cycle(WeightPager::open(&image, fp, WeightOptions { budget, cycle: cycle.clone(), preload: opts.preload })?)
            }
            ImageFormat::ChannelMajor { span } => {
                // Announcements: four per layer and one per head part; a prediction covers
                // `span` layers ahead; use counts halve every 16 tokens.
                let per_token =
                    4 * layout.groups.iter().map(|g| if let GroupKind::Layers { count, .. } = g.kind { count } else { 0 }).sum::<usize>()
                        + layout.groups.iter().filter(|g| matches!(g.kind, GroupKind::Head(_))).count();
                let horizon = u32::try_from(4 * (span + 1) + 2).unwrap_or(u32::MAX);
                let decay = u32::try_from(16 * per_token).unwrap_or(u32::MAX);
                // Predictions fill free budget until a plan sets room aside for them.
                Paging::Sparse(Box::new(SparsePager::open(
                    &image,
                    fp,
                    &SparseOptions { budget, preload: opts.preload, horizon, decay, reserve: 0 },
                )?))
            }
        })
    };
    let pager = match open() {
        Ok(p) if same_layout(p.info()) => p,
        Ok(_) | Err(WeightError::Stale { .. } | WeightError::Format { .. } | WeightError::Io { .. }) => {
            tracing::info!(image = %image.display(), "building the weight image (missing, stale or damaged)");
            build(model, &image, fp, opts.format)?;
            let p = open()?;
            if !same_layout(p.info()) {
                bail!("weight image {}: layout differs from the model's right after building it", image.display());
            }
            p
        }
        Err(e) => return Err(e.into()),
    };
    let paged = Arc::new(PagedWeights { pager, weight_bytes, image, plan: std::sync::Mutex::new(None) });
    let model = Model::load_with_image(model, Arc::clone(&paged) as Arc<dyn WeightMemory>, slot, opts.format)
        .with_context(|| format!("loading {}", model.display()))?;
    Ok((Arc::new(model), paged))
}

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
pub fn bench(model_path: &Path, o: &BenchOptions) -> Result<Vec<BenchRow>> {
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
                format: crate::weightplan::image_format(p),
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
    for rep in 0..=o.reps {
        for (i, (_, _, model, pw, _, sp, _)) in cases.iter().enumerate() {
            let mut s = Session::new(Arc::clone(model), Arc::clone(&pool), prompt.len() + o.tg + 1);
            s.set_sparsity(sp.clone())?;
            s.eval(&prompt, Logits::Last)?;
            let before = pw.as_ref().map(|p| p.stats());
            let mut tok = prompt[0];
            let t = std::time::Instant::now();
            for _ in 0..o.tg {
                tok = engine::sampler::argmax(s.eval(&[tok], Logits::Last)?);
            }
            let secs = t.elapsed().as_secs_f64();
            if rep == 0 {
                continue; // warm-up: the first pass fills the hot set
            }
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

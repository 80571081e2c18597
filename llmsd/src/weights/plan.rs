//! The weight planner, wired: mm's cost model (`mm::weightplan`, ActiveFlow §4.1) fed with
//! this model's shape, this machine's measured bandwidths and each sparsity level's measured
//! reads (share read, cross-layer similarity, hit curve of a frequency cache).
//!
//! A level's profile runs the model over the calibration text (a few seconds per level, after
//! the level's calibration), so it is saved in the state directory next to the calibration,
//! keyed by the model file, the text and the level, and reused.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use engine::sparsity::{ChannelUse, Sparsity, MAX_AHEAD};
use engine::weights::{GroupKind, ImageFormat, WeightLayout};
use engine::{Model, ThreadPool, WeightFormat};
use mm::weightplan::{Bandwidths, LevelProfile, PlanInputs, Shape, MAX_SPAN};

/// Sparsity levels a weight plan chooses from by default (up to its maximum).
pub const PLAN_LEVELS: [f32; 4] = [0.0, 0.3, 0.5, 0.7];
/// Group sizes the planner chooses from (images are built for the one chosen).
pub const SPANS: [usize; 4] = [1, 2, 4, 8];
/// Read sizes the flash bandwidth is measured at (ActiveFlow Fig. 7).
pub const READ_SIZES: [usize; 6] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];
/// Points of a level's hit curve (cache shares 0, 5%, ..., 100%).
const HIT_POINTS: usize = 21;
/// Calibration windows of 512 tokens a level's profile is measured on.
const PROFILE_WINDOWS: usize = 2;

/// A sparsity level and its calibrated thresholds (`None`: dense).
pub type Level = (f32, Option<Arc<Sparsity>>);

/// What to plan with.
#[derive(Debug, Clone)]
pub struct PlanSetup {
    /// Sparsity levels to choose from (0 is always among them).
    pub levels: Vec<f32>,
    pub max_sparsity: f32,
    pub calib_text: PathBuf,
    pub state_dir: PathBuf,
    pub threads: usize,
}

/// The model's weights (`c`: its config) as the sparse pager reads them.
pub fn shape(model_path: &Path, c: &engine::Config) -> Result<Shape> {
    let layout = WeightLayout::for_file(model_path, super::SPARSE_SLOT, ImageFormat::ChannelMajor { span: 1 })
        .with_context(|| format!("loading {}", model_path.display()))?;
    let (mut layers, mut head) = (0, 0);
    for g in &layout.groups {
        match g.kind {
            GroupKind::Layers { .. } | GroupKind::Site { .. } => layers += g.len,
            GroupKind::Head(_) => head += g.len,
            GroupKind::Embedding => {}
        }
    }
    if c.n_layers == 0 || layers == 0 {
        bail!("{}: no layers to page", model_path.display());
    }
    let layer_bytes = layers / c.n_layers;
    // A channel's column at each site: its rows at the layer's bytes per weight, weighted by
    // the site's share of the bytes.
    let rows = ChannelUse::new(c).rows;
    let channels = [c.dim, c.dim, c.dim, c.ffn_dim];
    let weights: f64 = rows.iter().zip(channels).map(|(r, ch)| (r * ch) as f64).sum();
    let per_weight = layer_bytes as f64 / weights;
    let column = rows.iter().zip(channels).map(|(&r, ch)| (r * ch) as f64 * r as f64 * per_weight).sum::<f64>() / weights;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    Ok(Shape {
        n_layers: c.n_layers,
        layer_bytes,
        head_bytes: head,
        column_bytes: (column.round() as usize).max(1),
        page: super::SPARSE_SLOT,
    })
}

fn profile_path(dir: &Path, fp: &mm::weights::Fingerprint, text: &str, level: f32) -> PathBuf {
    dir.join(format!("wprofile-{:08x}-{}-{:08x}-{level:.4}.json", fp.crc, fp.len, crc32c::crc32c(text.as_bytes())))
}

/// The profile of `level` (calibrated thresholds `sp`; `None` for dense), measured or saved.
fn level_profile(
    model: &Arc<Model>,
    pool: &Arc<ThreadPool>,
    model_path: &Path,
    s: &PlanSetup,
    level: f32,
    sp: Option<Arc<Sparsity>>,
) -> Result<LevelProfile> {
    if sp.is_none() {
        return Ok(LevelProfile::dense());
    }
    let text = std::fs::read_to_string(&s.calib_text).with_context(|| format!("reading {}", s.calib_text.display()))?;
    let fp = mm::weights::Fingerprint::of(model_path)?;
    let path = profile_path(&s.state_dir, &fp, &text, level);
    let saved = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice::<LevelProfile>(&b).ok());
    if let Some(p) = saved.filter(|p| p.sparsity == level && p.similarity.len() == MAX_SPAN.min(MAX_AHEAD) && p.hit.len() == HIT_POINTS) {
        return Ok(p);
    }
    let ids = model.tokenizer.encode(&text, false, false)?;
    let (_, use_) = engine::eval::perplexity_channel_use(model, Arc::clone(pool), &ids, 512, PROFILE_WINDOWS, sp)
        .with_context(|| format!("measuring sparsity {level} on {}", s.calib_text.display()))?;
    #[allow(clippy::cast_precision_loss)]
    let p = LevelProfile {
        sparsity: level,
        read_share: use_.read_share(),
        similarity: (1..=MAX_SPAN.min(MAX_AHEAD)).map(|d| use_.similarity(d)).collect(),
        hit: (0..HIT_POINTS).map(|k| use_.hit_rate(k as f64 / (HIT_POINTS - 1) as f64)).collect(),
    };
    super::sparsity::save(&s.state_dir, &path, &serde_json::to_vec(&p)?, "weight profile");
    Ok(p)
}

/// The planner's inputs for `model_path`, and each level's calibrated thresholds (to run
/// the level the plan picks). Runs the model resident when a level is not profiled yet.
pub fn inputs(model_path: &Path, s: &PlanSetup) -> Result<(PlanInputs, Vec<Level>)> {
    if !(0.0..1.0).contains(&s.max_sparsity) || s.levels.iter().any(|l| !(0.0..1.0).contains(l)) {
        bail!("sparsity levels and --max-sparsity lie in [0, 1)");
    }
    let mut levels: Vec<f32> = s.levels.iter().copied().filter(|&l| l <= s.max_sparsity).chain([0.0]).collect();
    levels.sort_by(f32::total_cmp);
    levels.dedup();
    let model = Arc::new(Model::load(model_path).with_context(|| format!("loading {}", model_path.display()))?);
    let pool = Arc::new(ThreadPool::new(s.threads));
    let mut profiles = Vec::new();
    let mut thresholds = Vec::new();
    for &l in &levels {
        let sp = (l > 0.0).then(|| super::sparsity::calibrated(&model, &pool, model_path, &s.state_dir, l, &s.calib_text)).transpose()?;
        profiles.push(level_profile(&model, &pool, model_path, s, l, sp.clone())?);
        thresholds.push((l, sp));
    }
    let shape = shape(model_path, &model.config)?;
    drop(model);
    let mut bw = Bandwidths::measure(model_path, &READ_SIZES).context("measuring bandwidths for the weight plan")?;
    // T_comp (eq. 4) at the rate the engine computes over channel-major weights, which is
    // well below what memory delivers to a plain sum (docs/weights.md "Planner"); the packed
    // kernels' rate weighs streaming the packed image instead.
    bw.mem = bw.mem.min(compute_rate(model_path, &pool, shape.weight_bytes(), WeightFormat::ChannelMajor)?);
    let slot = super::slot_for(ImageFormat::Packed);
    let packed = WeightLayout::for_file(model_path, slot, ImageFormat::Packed)?;
    let (cycle, packed_bytes) = super::weight_groups(&packed, slot);
    let sizes: Vec<usize> = cycle.iter().map(|&g| packed.groups[g].len.next_multiple_of(slot)).collect();
    let packed_mem = compute_rate(model_path, &pool, packed_bytes, WeightFormat::Packed)?;
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let inputs = PlanInputs {
        shape,
        bw,
        levels: profiles,
        spans: SPANS.to_vec(),
        max_sparsity: s.max_sparsity,
        kv_bytes: 0,
        packed_mem,
        packed_bytes,
        packed_groups: sizes,
        packed_slot: slot,
        spare_core: s.threads < cores,
    };
    Ok((inputs, thresholds))
}

/// Bytes/s the engine computes over when decoding with every weight resident in `format`,
/// dense: `weight_bytes` per token over the median time of a token (3 runs of 16).
fn compute_rate(model_path: &Path, pool: &Arc<ThreadPool>, weight_bytes: usize, format: WeightFormat) -> Result<f64> {
    use engine::{Logits, Session};
    let cm = Arc::new(Model::load_as(model_path, format)?);
    let mut s = Session::new(Arc::clone(&cm), Arc::clone(pool), 64);
    let mut tok = engine::sampler::argmax(s.eval(&[1, 2, 3, 4], Logits::Last)?);
    let mut secs = Vec::new();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        for _ in 0..16 {
            tok = engine::sampler::argmax(s.eval(&[tok], Logits::Last)?);
        }
        secs.push(t.elapsed().as_secs_f64() / 16.0);
    }
    secs.sort_by(f64::total_cmp);
    #[allow(clippy::cast_precision_loss)]
    Ok(weight_bytes as f64 / secs[1])
}

/// `budget` in bytes: a share of the weight bytes (layers and head, of the larger image: 100%
/// holds all of either) or bytes as given.
pub fn budget_bytes(budget: super::Budget, inputs: &PlanInputs) -> usize {
    match budget {
        super::Budget::Bytes(b) => b,
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
        super::Budget::Percent(p) => (inputs.all_weight_bytes() as f64 * p / 100.0) as usize,
    }
}

/// The calibration text used when none is given: a license text every Debian-based system
/// ships (real prose, and the same bytes on every machine, so saved calibrations are reused).
pub const DEFAULT_CALIB_TEXT: &str = "/usr/share/common-licenses/Apache-2.0";

/// A model whose weights are paged as a plan chose: the sparsity (its calibrated thresholds,
/// `None` for dense), the image's group size, the cache and the preload room.
#[derive(Debug)]
pub struct Planned {
    pub model: Arc<Model>,
    pub weights: Arc<super::PagedWeights>,
    /// What sessions over `model` must compute with (the plan counted on its reads).
    pub sparsity: Option<Arc<Sparsity>>,
    pub plan: mm::weightplan::Plan,
}

/// Plans the paged weights of `model_path` for `budget` (sparsity from `setup.levels` up to
/// `setup.max_sparsity`) and loads the model over the plan's channel-major image (`image`,
/// else next to the model; built when missing), the plan in force so a budget change
/// re-plans it.
pub fn load_planned(model_path: &Path, budget: super::Budget, image: Option<PathBuf>, preload: bool, setup: &PlanSetup) -> Result<Planned> {
    let (inputs, levels) = inputs(model_path, setup)?;
    let budget = budget_bytes(budget, &inputs);
    let plan = inputs.plan(budget)?;
    let opts = super::PagedOptions { budget: super::Budget::Bytes(budget), image, preload, format: image_format(&plan) };
    let (model, weights) = super::load_paged(model_path, &opts)?;
    let sparsity = levels.into_iter().find(|(l, _)| *l == plan.sparsity).and_then(|(_, sp)| sp);
    weights.set_plan(super::PlanState { inputs, plan: plan.clone() });
    Ok(Planned { model, weights, sparsity, plan })
}

/// The image a plan pages: the packed one streamed by layer, or a channel-major one in groups
/// of the plan's layers.
pub fn image_format(plan: &mm::weightplan::Plan) -> ImageFormat {
    if plan.packed {
        ImageFormat::Packed
    } else {
        ImageFormat::ChannelMajor { span: plan.span }
    }
}

/// One line describing a plan.
#[allow(clippy::cast_precision_loss)]
pub fn describe(p: &mm::weightplan::Plan) -> String {
    let mib = |b: f64| b / f64::from(1 << 20);
    if p.packed {
        return format!(
            "weight plan: sparsity 0, the packed image streamed by layer, hot set {:.1} MiB; predicted {:.1} tok/s reading {:.1} MiB/token",
            mib(p.cache_bytes as f64),
            p.tok_s(),
            mib(p.read_bytes)
        );
    }
    format!(
        "weight plan: sparsity {}, groups of {} layers, group {:.1} MiB, {}; predicted {:.1} tok/s reading {:.1} MiB/token with preloading, {:.1} tok/s reading {:.1} MiB/token on demand",
        p.sparsity,
        p.span,
        mib(p.group_bytes as f64),
        if p.preload_room > 0 {
            format!("cache {:.1} MiB and {:.1} MiB for preloads (hit {:.1}%)", mib(p.cache_bytes as f64), mib(p.preload_room as f64), 100.0 * p.hit_rate)
        } else {
            "on demand (preloads only into free budget)".to_string()
        },
        p.tok_s(),
        mib(p.read_bytes),
        p.demand_tok_s(),
        mib(p.demand_read_bytes)
    )
}

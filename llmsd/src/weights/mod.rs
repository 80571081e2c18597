//! Paged weights, wired: the engine's weight image (engine::weights) built next to the model
//! once, served by mm's weight pager (mm::weights) under a budget, and handed to the engine as
//! plain memory. The rooms: [`plan`] feeds mm's planner (`mm::weightplan`, ActiveFlow's cost
//! model) with this model and machine, [`sparsity`] keeps calibrated Top-K thresholds between
//! runs (`llms bench-weights`, in the tools crate, measures decode speed resident and paged).

pub mod plan;
pub mod sparsity;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use engine::weights::{build_image, GroupKind, ImageFormat, WeightLayout, WeightMemory};
use engine::Model;
use mm::weights::{Fingerprint, ImageWriter, SparseOptions, SparsePager, WeightError, WeightOptions, WeightPager, WeightStats};

/// Slot (and group alignment) of packed weight images: 16 KiB, so aligning the 4 groups of a
/// layer (one per site) pads little (with 64 KiB the default model's image grew 5%); the
/// preloader reads runs of slots 1 MiB at a time whatever their size, and a touched embedding
/// row costs 16 KiB. Faulting slot by slot (no preload) is slower for it.
pub const SLOT: usize = 16 << 10;
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
        Ok(Self::Bytes(crate::size::parse_bytes(s)?))
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
    /// A page cache's view of this run (packed images only): an LRU cache of the budget's
    /// slots, fed the accesses recorded from now on ([`LruBaseline::feed`]).
    pub fn lru_baseline(&self) -> Option<LruBaseline<'_>> {
        let Paging::Cycle(p) = &self.pager else { return None };
        p.record_accesses(true);
        let slot = p.info().slot_size;
        Some(LruBaseline {
            pager: p,
            slot,
            sim: mm::pagecache::LruSim::new(usize::try_from(p.stats().budget).unwrap_or(usize::MAX) / slot),
        })
    }

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

/// What an LRU page cache of the pager's budget reads on the reader's recorded accesses.
#[derive(Debug)]
pub struct LruBaseline<'a> {
    pager: &'a WeightPager,
    slot: usize,
    sim: mm::pagecache::LruSim,
}

impl Drop for LruBaseline<'_> {
    /// Nobody replays the log any more: stop it growing.
    fn drop(&mut self) {
        self.pager.record_accesses(false);
        self.pager.take_accesses();
    }
}

impl LruBaseline<'_> {
    /// Replays the accesses recorded since the last call; returns the bytes the cache read
    /// for them (`count`), or just warms it (not `count`: e.g. a prompt or a warm-up pass).
    pub fn feed(&mut self, count: bool) -> u64 {
        let misses = self.sim.access_ranges(&self.pager.take_accesses());
        if count {
            misses * self.slot as u64
        } else {
            0
        }
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

/// The groups a budget covers (layers and head; the embedding table is read by row) and their
/// bytes in whole slots of `slot`: what "100%" of an image's weights means.
pub fn weight_groups(layout: &WeightLayout, slot: usize) -> (Vec<usize>, usize) {
    let cycle: Vec<usize> = layout.groups.iter().enumerate().filter(|(_, g)| g.kind != GroupKind::Embedding).map(|(i, _)| i).collect();
    let bytes = cycle.iter().map(|&i| layout.groups[i].len.next_multiple_of(slot)).sum();
    (cycle, bytes)
}

/// Whether an image's trailer describes `layout` cut in slots of `slot` bytes.
fn same_layout(info: &mm::weights::ImageInfo, layout: &WeightLayout, slot: usize) -> bool {
    let g = &info.groups;
    info.slot_size == slot
        && g.len() == layout.groups.len()
        && g.iter().zip(&layout.groups).all(|(a, b)| a.offset == b.offset as u64 && a.len == b.len as u64)
}

/// Loads `model` with its weights paged from its image under `opts.budget`, building the image
/// first when it is missing, stale (the model file changed) or damaged.
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
    let same_layout = |info: &mm::weights::ImageInfo| same_layout(info, &layout, slot);
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

/// A packed weight image mapped from its file as it is (`mmap`, read-only, shared): the kernel's
/// page cache pages it, under whatever memory limit the process runs in. The baseline paged
/// weights are measured against on a real kernel (docs/lab.md, the `weights` scenario): the
/// same bytes in the same layout, read by the same forward pass.
#[derive(Debug)]
pub struct MappedWeights {
    map: memmap2::Mmap,
    /// Bytes of group data at the start of the file (the trailer follows).
    data_len: usize,
    /// Bytes of the groups read every pass (layers and head).
    pub weight_bytes: usize,
    pub image: PathBuf,
}

impl WeightMemory for MappedWeights {
    fn bytes(&self) -> &[u8] {
        &self.map[..self.data_len]
    }
}

/// The model over its packed weight image mapped by the kernel (built first when missing or
/// stale, as [`load_paged`] does).
pub fn load_mapped(model: &Path, image: Option<PathBuf>) -> Result<(Arc<Model>, Arc<MappedWeights>)> {
    let format = ImageFormat::Packed;
    let fp = Fingerprint::of(model)?;
    let slot = slot_for(format);
    let layout = WeightLayout::for_file(model, slot, format).with_context(|| format!("loading {}", model.display()))?;
    let (_, weight_bytes) = weight_groups(&layout, slot);
    let image = image.unwrap_or_else(|| default_image_path(model, format));
    let fits = |info: &mm::weights::ImageInfo| info.source == fp && same_layout(info, &layout, slot);
    let info = match mm::weights::ImageInfo::read(&image) {
        Ok(i) if fits(&i) => i,
        _ => {
            tracing::info!(image = %image.display(), "building the weight image (missing, stale or damaged)");
            build(model, &image, fp, format)?;
            let i = mm::weights::ImageInfo::read(&image)?;
            if !fits(&i) {
                bail!("weight image {}: layout differs from the model's right after building it", image.display());
            }
            i
        }
    };
    let file = std::fs::File::open(&image).with_context(|| format!("opening {}", image.display()))?;
    // Every slot checked against its CRC once (the pagers check each slot as they read it; a
    // mapping reads behind our back), then dropped from the page cache: the runs start cold.
    let mut buf = vec![0u8; info.slot_size];
    for (i, &want) in info.slot_crc.iter().enumerate() {
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut buf, (i * info.slot_size) as u64)
            .with_context(|| format!("reading {}", image.display()))?;
        if crc32c::crc32c(&buf) != want {
            bail!("weight image {}: slot {i}: checksum mismatch (the image was modified); delete it to rebuild", image.display());
        }
    }
    // SAFETY: advisory call on our own open file.
    unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&file), 0, 0, libc::POSIX_FADV_DONTNEED) };
    // SAFETY: a read-only shared mapping of a file this process does not write, checked just
    // above. Were it truncated or rewritten under us, reads would fault or change: the same
    // contract as any mmapped model file (llama.cpp's default).
    let map =
        unsafe { memmap2::MmapOptions::new().len(info.data_len).map(&file) }.with_context(|| format!("mapping {}", image.display()))?;
    let mapped = Arc::new(MappedWeights { map, data_len: info.data_len, weight_bytes, image });
    let model = Model::load_with_image(model, Arc::clone(&mapped) as Arc<dyn WeightMemory>, slot, format)
        .with_context(|| format!("loading {}", model.display()))?;
    Ok((Arc::new(model), mapped))
}

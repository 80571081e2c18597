//! Choosing how to page weights under a budget: ActiveFlow's cost model (§4.1, eq. 1-9) fed
//! by bandwidths measured on this machine and by the model's measured activation statistics.
//!
//! Given the memory budget, the planner picks the Top-K sparsity level, the layers per
//! cross-layer group `N` (the image's span) and the cache size, and predicts the decode time
//! of a token. When the budget changes (pressure) it re-plans with the same sparsity and
//! group — those are fixed by the image and the calibrated thresholds — and re-sizes the
//! cache, as ActiveFlow does online.
//!
//! How we read the equations for our pager (docs/weights.md, "Planner"):
//! - Eq. 9, `M_cl = S_l (1 - sp) N`: we use the level's **measured** share of a layer's bytes a
//!   token reads for `1 - sp` (the calibrated levels differ per site, so the byte share is
//!   not exactly `1 - sp`).
//! - Eq. 8, `M = M_cl + M_cache + M_kv`: what the reader needs beyond the cache's hits is
//!   read into room beside it — but one **layer's** misses, not a group's: the preload thread
//!   need only run a layer or so ahead of the reader to hide its reads, and room for a whole
//!   group's misses cost more cache than overlapping saved (measured, docs/weights.md). So
//!   the cache is `M - M_kv - S_l a (1 - hr)`, solved by fixed-point iteration with the hit
//!   rate it gives (at 100% the misses vanish and everything is cache, as measured); the
//!   room beside it is the preloads' (`Plan::preload_room`) unless reading on demand is
//!   predicted faster.
//! - The cache holds the output head first (it is read whole every token, so the LFU ranks it
//!   first), then the most used columns; `hr` of the layers is the level's measured hit
//!   curve at the cache's share of the layer bytes.
//! - Eq. 6 (on-demand loads) uses one layer's bytes `S_l`; we count the whole group's
//!   mispredicted bytes `M_cl (1 - hr)(1 - si)`, where `si` is the measured share of a layer's
//!   reads that the activations `1..N` layers before predicted (the mean over the group).
//! - `BW_small` and `BW_large` are one measured curve of read bandwidth against read size
//!   (ActiveFlow Fig. 7): on-demand reads are runs within one layer, preloads are runs of a
//!   channel across the group's `N` layers (the image keeps them together), so a larger
//!   group reads in larger pieces. Active channels are independent with probability `a`, so
//!   consecutive ones form runs of `1 / (1 - a)` channels on average; runs are whole pages.
//! - Eq. 1 over `G = ceil(L / N)` groups: `T_load + (G - 1) T_overlap + T_comp`, plus the
//!   output head: its missing bytes at the large-read bandwidth, then its computing.
//! - Every byte read also costs page work on the reading thread (UFFDIO_COPY into the region,
//!   dropping evicted pages): `Bandwidths::install`, measured, is added to each read's time
//!   (`read_install_at`). ActiveFlow's loads have no such term; on this VM it is a third to a
//!   half of a large read's time.
//! - Dense, the packed image streamed layer by layer (`cost_packed`) is weighed against the
//!   channel-major plans: it reads more bytes but in large pieces, and its kernels are faster;
//!   the faster prediction wins.
//! - The greedy search (§4.1): `sp = 1 - M_max / S_m`, rounded up to a calibrated level no
//!   higher than the caller allows; then `N` grows while the per-layer preload time falls by at
//!   least 5%, stopping once preloading hides under computing. (Per layer: `T_preload` and
//!   `T_comp` of a group both grow with `N`; a larger group only helps through larger reads.)
//!   We also stop where the predicted decode time would rise: a longer group is predicted
//!   from further back, and its mispredictions are read on demand (eq. 6).

// A cost model: byte counts become f64 seconds and back; the values are far inside both ranges.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss, clippy::cast_possible_wrap)]

use std::path::Path;

use crate::ring::{Op, Ring};
use crate::store::AlignedBuf;

/// Most layers ahead a level's similarity is measured for.
pub const MAX_SPAN: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("weight plan: {0}")]
    Input(String),
    #[error("a weight budget of {budget} bytes cannot hold one layer group ({group} bytes) and the KV cache ({kv} bytes)")]
    TooSmall { budget: usize, group: usize, kv: usize },
    #[error("measuring bandwidth on {path}: {source}")]
    Io { path: String, source: std::io::Error },
}

/// Bandwidths of this machine: memory, and flash reads by size.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Bandwidths {
    /// Bytes/s the CPUs read from memory (`T_comp`, eq. 4); a caller that can measure the
    /// engine computing over its weights passes that rate when it is lower.
    pub mem: f64,
    /// (read size in bytes, bytes/s) of O_DIRECT reads issued in batches, sizes increasing.
    pub flash: Vec<(usize, f64)>,
    /// Bytes/s the pager puts read pages into a userfaultfd region and drops them again
    /// (UFFDIO_COPY by runs, batched MADV_DONTNEED): kernel page work every byte read from
    /// flash also costs, on the reading thread. Infinite: not counted.
    pub install: f64,
}

impl Bandwidths {
    /// Bytes/s of reading pieces of `bytes` and installing them: flash and page work one
    /// after the other on the reading thread.
    pub fn read_install_at(&self, bytes: f64) -> f64 {
        1.0 / (1.0 / self.flash_at(bytes) + 1.0 / self.install)
    }

    /// Flash bandwidth of reads of `bytes`: interpolated in log-size between the measured
    /// sizes, flat beyond them.
    pub fn flash_at(&self, bytes: f64) -> f64 {
        let f = &self.flash;
        let Some(&(s0, b0)) = f.first() else { return f64::NAN };
        if bytes <= s0 as f64 {
            return b0;
        }
        for w in f.windows(2) {
            let ((sa, ba), (sb, bb)) = (w[0], w[1]);
            if bytes <= sb as f64 {
                let t = (bytes.ln() - (sa as f64).ln()) / ((sb as f64).ln() - (sa as f64).ln());
                return ba + t * (bb - ba);
            }
        }
        f[f.len() - 1].1
    }

    /// Measures flash read bandwidth on `path` (a file on the device that holds the weights,
    /// at least a few MiB) at each read size of `sizes` — random aligned offsets, O_DIRECT so
    /// the page cache plays no part, 64 reads in flight like the pager's batches — and memory
    /// read bandwidth with every CPU reading its share of a buffer. Each figure is the median
    /// of three passes.
    pub fn measure(path: &Path, sizes: &[usize]) -> Result<Self, PlanError> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        let io = |source| PlanError::Io { path: path.display().to_string(), source };
        let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).map_err(io)?;
        let len = usize::try_from(file.metadata().map_err(io)?.len()).unwrap_or(usize::MAX);
        let mut sizes = sizes.to_vec();
        sizes.sort_unstable();
        if sizes.is_empty() || sizes[0] < 4096 || sizes.iter().any(|s| s % 4096 != 0) || len < 4 * sizes[sizes.len() - 1] {
            return Err(PlanError::Input(format!(
                "read sizes must be whole 4 KiB pages and the file ({len} bytes) at least 4 times the largest"
            )));
        }
        const DEPTH: usize = 64;
        let mut ring = Ring::new(DEPTH as u32).map_err(io)?;
        let mut flash = Vec::new();
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for &size in &sizes {
            let mut buf = AlignedBuf::new(size * DEPTH);
            // 16 MiB per pass (at least one batch), from random whole-size offsets.
            let reads = ((16usize << 20) / size).max(DEPTH);
            let slots = len / size;
            let mut rates = Vec::new();
            for _ in 0..3 {
                let t = std::time::Instant::now();
                let mut done = 0;
                while done < reads {
                    let n = (reads - done).min(DEPTH);
                    let base = buf.as_ptr();
                    let ops: Vec<Op> = (0..n)
                        .map(|i| {
                            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                            let slot = usize::try_from(seed >> 33).unwrap_or(0) % slots;
                            // SAFETY: inside `buf` (DEPTH pieces of `size`).
                            let at = unsafe { base.add(i * size) };
                            Op { fd: file.as_raw_fd(), offset: (slot * size) as u64, buf: at, len: size as u32, write: false }
                        })
                        .collect();
                    // SAFETY: `buf` outlives the wait and nothing else touches it.
                    unsafe { ring.submit(0, &ops) }.map_err(io)?;
                    ring.wait(0).map_err(io)?;
                    done += n;
                }
                rates.push((reads * size) as f64 / t.elapsed().as_secs_f64());
            }
            flash.push((size, median(&mut rates)));
        }
        Ok(Self { mem: memory_bandwidth(), flash, install: install_rate()? })
    }
}

/// Bytes/s of installing pages into a userfaultfd region in runs of 16 (64 KiB) and dropping
/// them in one batch, as the weight pagers do (median of 3 passes over 16 MiB).
fn install_rate() -> Result<f64, PlanError> {
    use uffd_handler::{Pager, PagerOptions, RegionId, SlotSource, SourceError};
    /// Nothing touches the region: every slot is installed before it could fault.
    struct Untouched;
    impl SlotSource for Untouched {
        fn fill(&self, _: RegionId, slot: usize, _: &mut [u8]) -> Result<usize, SourceError> {
            Err(format!("slot {slot} of the install measurement was touched").into())
        }
    }
    const PAGE: usize = 4096;
    const RUN: usize = 16;
    const SLOTS: usize = 4096;
    let err =
        |e: uffd_handler::UffdError| PlanError::Io { path: "a userfaultfd region".into(), source: std::io::Error::other(e.to_string()) };
    let pager = Pager::with_options(PagerOptions { allow_move: false }).map_err(err)?;
    let region = pager.region_with(PAGE, SLOTS, std::sync::Arc::new(Untouched), false).map_err(err)?;
    // Written, as a read lands in staging: the copy reads present pages.
    let mut src = AlignedBuf::new(RUN * PAGE);
    src.fill(0xA5);
    let all: Vec<usize> = (0..SLOTS).collect();
    let (mut out, mut rates) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let t = std::time::Instant::now();
        for first in (0..SLOTS).step_by(RUN) {
            out.clear();
            region.copy_run(first, &src[..], &mut out).map_err(err)?;
        }
        out.clear();
        region.evict_many(&all, &mut out).map_err(err)?;
        rates.push((SLOTS * PAGE) as f64 / t.elapsed().as_secs_f64());
    }
    Ok(median(&mut rates))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Bytes/s read from memory by every CPU summing its share of a 256 MiB buffer (median of 3).
fn memory_bandwidth() -> f64 {
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let words = (256usize << 20) / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let mut rates = Vec::new();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        std::thread::scope(|sc| {
            for part in buf.chunks(words.div_ceil(threads)) {
                sc.spawn(move || std::hint::black_box(part.iter().fold(0u64, |a, &x| a.wrapping_add(x))));
            }
        });
        rates.push((words * 8) as f64 / t.elapsed().as_secs_f64());
    }
    median(&mut rates)
}

/// What a sparsity level does to the reads, measured by running the model over a text
/// (`engine::sparsity::ChannelUse`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LevelProfile {
    /// The calibrated Top-K sparsity target (0: dense).
    pub sparsity: f32,
    /// Share of the layers' bytes a token reads.
    pub read_share: f64,
    /// `similarity[d - 1]`: share of a layer's reads that were active `d` layers before.
    pub similarity: Vec<f64>,
    /// Hit rate of a cache of the most used columns at shares `k / (len - 1)` of the layer
    /// bytes, `k = 0..len` (increasing from 0 to 1).
    pub hit: Vec<f64>,
}

impl LevelProfile {
    /// A dense reader: reads every column every token, so a cache of a share of the
    /// columns serves exactly that share, and a layer predicts the next perfectly.
    pub fn dense() -> Self {
        Self { sparsity: 0.0, read_share: 1.0, similarity: vec![1.0; MAX_SPAN], hit: vec![0.0, 1.0] }
    }

    /// The hit rate of a cache holding `share` of the layer bytes (linear between points).
    pub fn hit_rate(&self, share: f64) -> f64 {
        let h = &self.hit;
        if h.len() < 2 {
            return share.clamp(0.0, 1.0);
        }
        let x = share.clamp(0.0, 1.0) * (h.len() - 1) as f64;
        let i = (x.floor() as usize).min(h.len() - 2);
        h[i] + (x - i as f64) * (h[i + 1] - h[i])
    }

    /// Mean share of a group's reads predicted from the layer before it: layers 1..=span ahead.
    pub fn group_similarity(&self, span: usize) -> f64 {
        let n = span.clamp(1, self.similarity.len().max(1));
        if self.similarity.is_empty() {
            return 1.0;
        }
        self.similarity[..n].iter().sum::<f64>() / n as f64
    }

    fn check(&self) -> Result<(), PlanError> {
        let unit = |x: f64| (0.0..=1.0).contains(&x);
        if !(0.0..1.0).contains(&self.sparsity)
            || !unit(self.read_share)
            || self.read_share == 0.0
            || self.similarity.is_empty()
            || !self.similarity.iter().all(|&x| unit(x))
            || self.hit.len() < 2
            || !self.hit.iter().all(|&x| unit(x))
            || !self.hit.windows(2).all(|w| w[0] <= w[1])
        {
            return Err(PlanError::Input(format!("level {}: shares must lie in [0, 1] and the hit curve rise", self.sparsity)));
        }
        Ok(())
    }
}

/// The model's weights as the pager sees them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    pub n_layers: usize,
    /// Bytes of one layer's matrices (`S_l`).
    pub layer_bytes: usize,
    /// Bytes of the output head, read whole every token.
    pub head_bytes: usize,
    /// Mean bytes of one input channel's column in one layer (weighted by bytes).
    pub column_bytes: usize,
    /// Read unit (the image's slot).
    pub page: usize,
}

impl Shape {
    /// `S_m`: the bytes read every pass when dense (layers and head).
    pub fn weight_bytes(&self) -> usize {
        self.n_layers * self.layer_bytes + self.head_bytes
    }
}

/// Everything the planner weighs.
#[derive(Debug, Clone)]
pub struct PlanInputs {
    pub shape: Shape,
    pub bw: Bandwidths,
    /// The sparsity levels to choose from (a dense one included).
    pub levels: Vec<LevelProfile>,
    /// Group sizes the image can be built with, to choose from.
    pub spans: Vec<usize>,
    /// Highest sparsity the caller accepts (sparsity costs quality).
    pub max_sparsity: f32,
    /// Bytes of the budget the KV cache takes (`M_kv`).
    pub kv_bytes: usize,
    /// Bytes/s the packed (dense) kernels compute over, to weigh streaming the packed image
    /// against reading a channel-major one ([`PlanInputs::cost_packed`]); 0: not offered.
    pub packed_mem: f64,
    /// Bytes of the packed image's layers and head (its groups are aligned more coarsely
    /// than the channel-major image's); 0: as `shape.weight_bytes()`.
    pub packed_bytes: usize,
    /// The packed image's streamed cycle: its groups' bytes (whole slots, in cycle order) and
    /// the slot size, from which the pager's window at a budget follows
    /// ([`crate::weights::stream_split`]); empty: a window of two layers.
    pub packed_groups: Vec<usize>,
    pub packed_slot: usize,
    /// Whether the preload thread has a core of its own (the engine computes on fewer
    /// threads than there are cores). Without one, its reads and page work take turns with
    /// the computing instead of overlapping it (measured on 2 cores: preloading ran at
    /// 0.90-0.94x of reading on demand), so eq. 5 adds them.
    pub spare_core: bool,
}

impl PlanInputs {
    /// What "all of the weights" holds, whichever image: a budget at or above it reads nothing.
    pub fn all_weight_bytes(&self) -> usize {
        self.shape.weight_bytes().max(self.packed_bytes)
    }
}

/// Predicted times of one token (seconds), as in eq. 1-7.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Times {
    pub load: f64,
    pub onload: f64,
    pub preload: f64,
    pub comp: f64,
    pub overlap: f64,
    pub head: f64,
    pub decode: f64,
}

/// A choice of sparsity, group size and cache size for a budget, and what it predicts.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Plan {
    pub budget: usize,
    pub sparsity: f32,
    pub span: usize,
    /// `M_cl`: the active bytes of one group.
    pub group_bytes: usize,
    /// `M_cache`: bytes kept resident across tokens (head first, then hot columns).
    pub cache_bytes: usize,
    /// Hit rate of the layers' reads in the cache, and the group's predicted share.
    pub hit_rate: f64,
    pub similarity: f64,
    /// Bytes read from flash per token.
    pub read_bytes: f64,
    pub times: Times,
    /// The same budget read only on demand (no room set aside for preloading, so a cache
    /// larger by about a group's misses): seconds per token and bytes read.
    pub demand_decode: f64,
    pub demand_read_bytes: f64,
    /// Bytes set aside for preloads (ActiveFlow's `M_cl` beside the cache): the pipeline's
    /// when it is predicted faster than reading on demand, else 0.
    pub preload_room: usize,
    /// Dense only: the packed image streamed layer by layer (a hot set, the rest read whole
    /// each token in large reads) instead of a channel-major one read by channel. `span` is
    /// then 1 and `cache_bytes` the hot set.
    pub packed: bool,
}

impl Plan {
    pub fn tok_s(&self) -> f64 {
        1.0 / self.times.decode
    }

    /// Predicted decode speed when every miss is read on demand.
    pub fn demand_tok_s(&self) -> f64 {
        1.0 / self.demand_decode
    }

    /// Seconds per token of the way the plan pages (preloading or on demand).
    pub fn best_decode(&self) -> f64 {
        self.times.decode.min(self.demand_decode)
    }
}

impl PlanInputs {
    fn check(&self) -> Result<(), PlanError> {
        let s = &self.shape;
        if s.n_layers == 0 || s.layer_bytes == 0 || s.column_bytes == 0 || s.page == 0 {
            return Err(PlanError::Input("the model shape has an empty part".into()));
        }
        if self.bw.mem.is_nan()
            || self.bw.mem <= 0.0
            || self.bw.flash.is_empty()
            || !self.bw.flash.iter().all(|&(n, b)| n > 0 && b > 0.0 && b.is_finite())
            || self.bw.install.is_nan()
            || self.bw.install <= 0.0
        {
            return Err(PlanError::Input("bandwidths must be positive".into()));
        }
        if self.levels.is_empty() || self.spans.is_empty() || self.spans.iter().any(|&n| n == 0 || n > MAX_SPAN) {
            return Err(PlanError::Input(format!("need a level and spans in 1..={MAX_SPAN}")));
        }
        self.levels.iter().try_for_each(LevelProfile::check)
    }

    /// Eq. 1-9 for one choice; `None` if one group and the KV cache do not fit the budget.
    pub fn cost(&self, level: &LevelProfile, span: usize, budget: usize) -> Option<Plan> {
        let s = &self.shape;
        let (bw, page) = (&self.bw, s.page as f64);
        let a = level.read_share;
        let layer_active = s.layer_bytes as f64 * a;
        let group = layer_active * span.min(s.n_layers) as f64; // eq. 9
        let room = budget as f64 - self.kv_bytes as f64;
        if group + s.column_bytes as f64 > room {
            return None;
        }
        let layers_all = (s.n_layers * s.layer_bytes) as f64;
        let head = s.head_bytes as f64;
        // Eq. 8 with the misses in flight taking room from the cache: one layer's (module doc).
        let (mut hr, mut cache) = (0.0, 0.0);
        for _ in 0..32 {
            cache = (room - layer_active * (1.0 - hr)).max(0.0);
            let next = level.hit_rate((cache - head).max(0.0) / layers_all);
            if (next - hr).abs() < 1e-9 {
                break;
            }
            hr = next;
        }
        let si = level.group_similarity(span);
        // Mean run of consecutive active channels within one layer's site; a run of `u`
        // useful bytes reads about `u + page` (whole pages, unaligned), so reads of short
        // runs pay twice: a slower read size and bytes nobody asked for.
        let run = if a >= 1.0 { f64::INFINITY } else { 1.0 / (1.0 - a) };
        let useful = |layers: f64| (s.column_bytes as f64 * layers * run).min(s.layer_bytes as f64 * layers / 4.0);
        let read_of = |u: f64| if u >= s.layer_bytes as f64 / 4.0 { u } else { u + page };
        let eff = |u: f64| bw.read_install_at(read_of(u)) * u / read_of(u);
        let (u_on, u_pre) = (useful(1.0), useful(span as f64));
        let miss = group * (1.0 - hr);
        let load = miss / eff(u_on); // eq. 3
        let comp = group / bw.mem; // eq. 4
        let onload = miss * (1.0 - si) / eff(u_on); // eq. 6 (the group's mispredictions)
        let preload = miss / eff(u_pre); // eq. 7
                                         // Eq. 5; without a spare core the preload thread takes turns with the computing.
        let overlap = onload + if self.spare_core { preload.max(comp) } else { preload + comp };
        let groups = s.n_layers.div_ceil(span) as f64;
        let head_miss = (head - cache).max(0.0);
        let head_t = head_miss / bw.read_install_at(f64::INFINITY) + head / bw.mem;
        // Flash bytes: the first group on demand, each later one preloaded plus its
        // mispredictions, the head's misses.
        let read_bytes =
            miss * read_of(u_on) / u_on + (groups - 1.0) * miss * (read_of(u_pre) / u_pre + (1.0 - si) * read_of(u_on) / u_on) + head_miss;
        // On demand only: each group's misses read at one layer's run size, then computed.
        let demand_decode = groups * (miss / eff(u_on) + comp) + head_t;
        let demand_read_bytes = groups * miss * read_of(u_on) / u_on + head_miss;
        let decode = load + (groups - 1.0) * overlap + comp + head_t; // eq. 1

        // The room beside the cache is the preloads' where they pay (mispredictions read
        // twice can cost more than overlapping saves): predicted at least 1% faster, so a
        // tie (no spare core, nothing mispredicted) is not decided by rounding.
        let preload_room = if decode < 0.99 * demand_decode { (room - cache).max(0.0) } else { 0.0 };
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Some(Plan {
            budget,
            sparsity: level.sparsity,
            span,
            group_bytes: group as usize,
            cache_bytes: cache as usize,
            hit_rate: hr,
            similarity: si,
            read_bytes,
            times: Times { load, onload, preload, comp, overlap, head: head_t, decode },
            demand_decode,
            demand_read_bytes,
            preload_room: preload_room as usize,
            packed: false,
        })
    }

    /// The dense model from the packed image, as `weights::WeightPager` streams it: within
    /// the budget a hot set of `budget - window` (all of it when everything fits), the
    /// rest read each token a group at a time in large reads, then computed at the packed
    /// kernels' rate. Measured on 2 cores, the preload thread's reads and the compute add up
    /// rather than overlap (both need a core), so the model adds them. `None` without a packed
    /// rate or when the window does not fit.
    pub fn cost_packed(&self, budget: usize) -> Option<Plan> {
        let s = &self.shape;
        let room = budget as f64 - self.kv_bytes as f64;
        let layer = s.layer_bytes as f64;
        let all = if self.packed_bytes > 0 { self.packed_bytes } else { s.weight_bytes() } as f64;
        if self.packed_mem.is_nan() || self.packed_mem <= 0.0 || room < 0.0 {
            return None;
        }
        let hot = if room >= all {
            all
        } else {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let window = self.packed_window(room as usize)? as f64;
            room - window
        };
        let read = all - hot;
        let load = read / self.bw.read_install_at(layer);
        let comp = all / self.packed_mem;
        let decode = load + comp;
        Some(Plan {
            budget,
            sparsity: 0.0,
            span: 1,
            group_bytes: s.layer_bytes,
            cache_bytes: hot as usize,
            hit_rate: hot / all,
            similarity: 1.0,
            read_bytes: read,
            times: Times { load, onload: 0.0, preload: load, comp, overlap: 0.0, head: 0.0, decode },
            demand_decode: decode,
            demand_read_bytes: read,
            preload_room: 0,
            packed: true,
        })
    }

    /// Bytes the packed pager streams through within `room` bytes, as it splits the cycle
    /// (`packed_groups`): each group's head hot, its capped tail streamed through the window;
    /// `None` when no split fits.
    fn packed_window(&self, room: usize) -> Option<usize> {
        if self.packed_groups.is_empty() {
            let w = 2 * self.shape.layer_bytes;
            (room >= w).then_some(w)
        } else {
            crate::weights::stream_split(&self.packed_groups, self.packed_slot, room).map(|(w, _)| w)
        }
    }

    /// The least the packed pager streams through (its whole largest consecutive groups),
    /// what a budget refused as too small is told it needed at most.
    fn packed_window_bound(&self) -> usize {
        if self.packed_groups.is_empty() {
            2 * self.shape.layer_bytes
        } else {
            crate::weights::stream_window(&self.packed_groups, self.packed_slot)
        }
    }

    /// The sparsity level eq. "sp = 1 - M_max / S_m" asks for: the lowest calibrated level at
    /// or above it, within `max_sparsity` (the highest allowed if none reaches it).
    pub fn choose_level(&self, budget: usize) -> Result<&LevelProfile, PlanError> {
        self.check()?;
        #[allow(clippy::cast_possible_truncation)]
        let want = (1.0 - budget as f64 / self.shape.weight_bytes() as f64).max(0.0) as f32;
        let mut allowed: Vec<&LevelProfile> = self.levels.iter().filter(|l| l.sparsity <= self.max_sparsity + 1e-6).collect();
        allowed.sort_by(|a, b| a.sparsity.total_cmp(&b.sparsity));
        let Some(&top) = allowed.last() else {
            return Err(PlanError::Input(format!("no level at or below the maximum sparsity {}", self.max_sparsity)));
        };
        Ok(allowed.into_iter().find(|l| l.sparsity + 1e-6 >= want).unwrap_or(top))
    }

    /// ActiveFlow's greedy search for `budget`: the level first, then the group size.
    pub fn plan(&self, budget: usize) -> Result<Plan, PlanError> {
        let level = self.choose_level(budget)?;
        let mut spans = self.spans.clone();
        spans.sort_unstable();
        spans.dedup();
        let mut best: Option<Plan> = None;
        for &n in &spans {
            let Some(p) = self.cost(level, n, budget) else { break };
            let per_layer = |p: &Plan| p.times.preload / p.span as f64;
            if let Some(b) = &best {
                // A larger group no longer reads meaningfully faster, or its mispredictions
                // (eq. 6) cost more than its larger reads save: keep the smaller one.
                if per_layer(&p) > 0.95 * per_layer(b) || p.best_decode() > b.best_decode() {
                    break;
                }
            }
            let hidden = p.times.preload <= p.times.comp;
            best = Some(p);
            if hidden {
                break;
            }
        }
        // A dense level may stream the packed image instead, where that is predicted faster.
        if level.sparsity == 0.0 {
            if let Some(p) = self.cost_packed(budget) {
                if best.as_ref().is_none_or(|b| p.best_decode() < b.best_decode()) {
                    best = Some(p);
                }
            }
        }
        best.ok_or(PlanError::TooSmall {
            budget,
            group: (self.shape.layer_bytes as f64 * level.read_share * spans[0] as f64) as usize,
            kv: self.kv_bytes,
        })
    }

    /// The budget changed: the same level and group (the image and thresholds in use), the
    /// cache re-sized to the new budget.
    pub fn replan(&self, plan: &Plan, budget: usize) -> Result<Plan, PlanError> {
        self.check()?;
        if plan.packed {
            return self.cost_packed(budget).ok_or(PlanError::TooSmall { budget, group: self.packed_window_bound(), kv: self.kv_bytes });
        }
        let level = self
            .levels
            .iter()
            .find(|l| l.sparsity == plan.sparsity)
            .ok_or_else(|| PlanError::Input(format!("no level {} to re-plan", plan.sparsity)))?;
        self.cost(level, plan.span, budget).ok_or(PlanError::TooSmall { budget, group: plan.group_bytes, kv: self.kv_bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    /// A model like the default one: 30 layers of 2.2 MB, a 30 MiB head.
    fn inputs(flash: Vec<(usize, f64)>) -> PlanInputs {
        let level = |sp: f32, a: f64, si: f64| LevelProfile {
            sparsity: sp,
            read_share: a,
            similarity: (0..MAX_SPAN).map(|d| si.powi(d as i32 + 1)).collect(),
            hit: (0..=10).map(|k| f64::from(k) / 10.0).collect(),
        };
        PlanInputs {
            shape: Shape { n_layers: 30, layer_bytes: 2_200_000, head_bytes: 30 * MIB, column_bytes: 600, page: 4096 },
            bw: Bandwidths { mem: 10e9, flash, install: f64::INFINITY },
            levels: vec![LevelProfile::dense(), level(0.3, 0.68, 0.9), level(0.5, 0.47, 0.85), level(0.7, 0.2, 0.8)],
            spans: vec![1, 2, 4, 8],
            max_sparsity: 0.5,
            kv_bytes: 0,
            packed_mem: 0.0,
            packed_bytes: 0,
            packed_groups: Vec::new(),
            packed_slot: 0,
            spare_core: true,
        }
    }

    fn steep() -> Vec<(usize, f64)> {
        vec![(4096, 100e6), (16384, 300e6), (65536, 900e6), (262_144, 2e9), (1 << 20, 2.5e9)]
    }

    #[test]
    fn flash_bandwidth_interpolates_in_log_size_and_is_flat_outside() {
        let bw = Bandwidths { mem: 1.0, flash: vec![(4096, 100.0), (65536, 500.0)], install: f64::INFINITY };
        assert_eq!(bw.flash_at(1000.0), 100.0);
        assert_eq!(bw.flash_at(1e9), 500.0);
        assert!((bw.flash_at(16384.0) - 300.0).abs() < 1e-9, "halfway in log size");
    }

    /// The equations, by hand, for one case: dense, span 2, a budget leaving half of the
    /// layers cached after the head and one layer's misses.
    #[test]
    fn cost_follows_the_equations() {
        let mut p = inputs(vec![(4096, 1e8), (65536, 1e9)]);
        p.shape = Shape { n_layers: 4, layer_bytes: 1000 * 4096, head_bytes: 500 * 4096, column_bytes: 4096, page: 4096 };
        let level = LevelProfile::dense();
        let budget = 3000 * 4096;
        let c = p.cost(&level, 2, budget).unwrap();
        let (sl, head, layers) = (4096e3, 500.0 * 4096.0, 4.0 * 4096e3);
        let group = 2.0 * sl; // eq. 9, a = 1
                              // Fixed point of cache = M - S_l (1 - hr), hr = (cache - head) / layers.
        let m = f64::from(3000 * 4096);
        let hr = (m - sl - head) / (layers - sl);
        assert!((c.hit_rate - hr).abs() < 1e-6, "{} vs {hr}", c.hit_rate);
        assert!((hr - 0.5).abs() < 1e-9);
        // Dense: runs cover a quarter of a layer (or a group), reads at the largest measured size.
        let miss = group * (1.0 - hr);
        let t = c.times;
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs();
        assert!(close(t.load, miss / 1e9), "{c:?} {miss}");
        assert!(close(t.comp, group / 10e9));
        assert_eq!(t.onload, 0.0, "a dense layer predicts the next perfectly");
        assert!(close(t.overlap, (miss / 1e9).max(group / 10e9)));
        assert!(close(t.head, head / 10e9), "the head fits the cache");
        assert!(close(t.decode, t.load + t.overlap + t.comp + t.head), "two groups");
        assert!(close(c.read_bytes, 2.0 * miss), "dense runs read no extra pages");
        assert!(close(c.demand_decode, 2.0 * (miss / 1e9 + group / 10e9) + t.head), "on demand: read, then compute");
        assert!(close(c.demand_read_bytes, c.read_bytes));
        // Overlapping wins: the room beside the cache (one layer's misses) is the preloads'.
        assert!(t.decode < c.demand_decode);
        assert!((c.preload_room as f64 - sl * (1.0 - hr)).abs() < 2.0, "{c:?}");
        assert_eq!(c.best_decode(), t.decode);
        // Without a spare core the preload thread takes turns with the computing: preloading
        // is then never predicted faster than reading on demand, and gets no room.
        let mut busy = p.clone();
        busy.spare_core = false;
        let b = busy.cost(&level, 2, budget).unwrap();
        assert!(close(b.times.overlap, miss / 1e9 + group / 10e9), "{b:?}");
        assert!(close(b.times.decode, b.demand_decode) && b.preload_room == 0, "{b:?}");
        // A level whose layers predict nothing reads its misses twice when preloading:
        // reading on demand wins and no room is set aside.
        let blind = LevelProfile { similarity: vec![0.0; MAX_SPAN], ..LevelProfile::dense() };
        let c = p.cost(&blind, 2, budget).unwrap();
        assert!(c.demand_decode < c.times.decode, "{c:?}");
        assert_eq!(c.preload_room, 0);
        assert_eq!(c.best_decode(), c.demand_decode);
    }

    #[test]
    fn sparsity_follows_the_budget_within_the_allowed_levels() {
        let p = inputs(steep());
        let wb = p.shape.weight_bytes();
        let pick = |share: f64| p.choose_level((wb as f64 * share) as usize).unwrap().sparsity;
        assert_eq!(pick(1.0), 0.0);
        assert_eq!(pick(0.75), 0.3, "sp = 0.25: the next level up");
        assert_eq!(pick(0.5), 0.5);
        assert_eq!(pick(0.25), 0.5, "0.75 wanted, 0.5 allowed");
        let mut q = p.clone();
        q.max_sparsity = 0.7;
        assert_eq!(q.choose_level(wb / 4).unwrap().sparsity, 0.7);
    }

    /// With small reads much slower than large ones a sparse reader's group grows until
    /// preloading hides under computing or stops getting faster.
    #[test]
    fn group_size_grows_while_reads_get_faster() {
        let p = inputs(steep());
        let budget = p.shape.weight_bytes() / 2;
        let mut dense = p.clone();
        dense.max_sparsity = 0.0;
        let per_layer = |q: &Plan| q.times.preload / q.span as f64;
        for inp in [&p, &dense] {
            let plan = inp.plan(budget).unwrap();
            let level = inp.choose_level(budget).unwrap();
            // Each step up to the chosen group read at least 5% faster per layer...
            let mut n = 1;
            while n < plan.span {
                let (a, b) = (inp.cost(level, n, budget).unwrap(), inp.cost(level, 2 * n, budget).unwrap());
                assert!(per_layer(&b) <= 0.95 * per_layer(&a) && b.times.decode <= a.times.decode, "{a:?} {b:?}");
                n *= 2;
            }
            // ...and the next one would not, or preloading already hides under computing.
            // ...and the next one would not (or would be slower overall, or is not offered), or
            // preloading already hides under computing.
            let next = inp.spans.contains(&(2 * plan.span)).then(|| inp.cost(level, 2 * plan.span, budget)).flatten();
            let stop = |q: &Plan| per_layer(q) > 0.95 * per_layer(&plan) || q.times.decode > plan.times.decode;
            assert!(plan.times.preload <= plan.times.comp || next.is_none_or(|q| stop(&q)), "{plan:?}");
        }
        // Short runs of sparse channels need longer groups than a dense reader's pieces.
        assert!(p.plan(budget).unwrap().span > dense.plan(budget).unwrap().span);
        // Every plan keeps within the budget.
        for share in [1.0, 0.75, 0.5, 0.25, 0.1] {
            let b = (p.shape.weight_bytes() as f64 * share) as usize;
            let q = p.plan(b).unwrap();
            assert!(q.group_bytes + q.cache_bytes <= b + q.group_bytes, "{q:?}");
            assert!(q.cache_bytes <= b);
        }
    }

    /// Streaming the packed image: a hot set of the budget less the window (two layers unless
    /// the image says), the rest read a group at a time (flash, then page work) and the whole model computed at the packed
    /// rate; chosen for a dense level only, and only where predicted faster.
    #[test]
    fn packed_streaming_is_weighed_for_dense_levels() {
        let mut p = inputs(steep());
        p.bw.install = 4e9;
        let (wb, layer) = (p.shape.weight_bytes() as f64, p.shape.layer_bytes as f64);
        assert!(p.cost_packed(wb as usize).is_none(), "no packed rate: not offered");
        p.packed_mem = 5e9;
        let budget = wb as usize / 2;
        let c = p.cost_packed(budget).unwrap();
        let read = wb - (budget as f64 - 2.0 * layer);
        let rate = 1.0 / (1.0 / p.bw.flash_at(layer) + 1.0 / 4e9);
        assert!((p.bw.read_install_at(layer) - rate).abs() < 1e-6 * rate);
        assert!((c.read_bytes - read).abs() < 1.0 && (c.times.decode - (read / rate + wb / 5e9)).abs() < 1e-12, "{c:?}");
        assert!(c.packed && c.preload_room == 0 && c.cache_bytes <= budget);
        let full = p.cost_packed(wb as usize).unwrap();
        assert!(full.read_bytes == 0.0 && (full.times.decode - wb / 5e9).abs() < 1e-12, "{full:?}");
        assert!(p.cost_packed(layer as usize).is_none(), "two layers must fit");
        // The pager's window when the image says its groups (four a layer): the split's two
        // capped tails and 4 slots, below the two whole groups the pager once streamed.
        let slot = 4096;
        p.packed_groups = vec![(layer as usize / 4).next_multiple_of(slot); 4 * p.shape.n_layers];
        let (window, _) = crate::weights::stream_split(&p.packed_groups, slot, budget).unwrap();
        p.packed_slot = slot;
        assert!(window < crate::weights::stream_window(&p.packed_groups, slot));
        let c = p.cost_packed(budget).unwrap();
        assert!((c.read_bytes - (wb - (budget - window) as f64)).abs() < 1.0, "{c:?}");
        assert!(p.cost_packed(layer as usize).is_some());
        // Dense: whichever is predicted faster. The packed kernels at the channel-major rate
        // (10e9 here) win at full budget (nothing read either way, same compute).
        let mut dense = p.clone();
        dense.max_sparsity = 0.0;
        dense.packed_mem = 10e9;
        let full = dense.plan(wb as usize).unwrap();
        assert!(full.packed, "{full:?}");
        assert_eq!(dense.replan(&full, budget).unwrap(), dense.cost_packed(budget).unwrap(), "re-planned as streamed");
        dense.packed_mem = 1e6;
        assert!(!dense.plan(wb as usize).unwrap().packed, "packed kernels far slower: channel-major");
        // A sparse level reads by channel: never packed.
        p.packed_mem = 1e15;
        assert!(!p.plan(budget).unwrap().packed);
    }

    #[test]
    fn a_budget_below_one_group_is_refused() {
        let mut p = inputs(steep());
        p.max_sparsity = 0.0;
        assert!(matches!(p.plan(MIB), Err(PlanError::TooSmall { .. })));
        p.kv_bytes = 200 * MIB;
        assert!(matches!(p.plan(150 * MIB), Err(PlanError::TooSmall { .. })));
    }

    #[test]
    fn full_budget_reads_nothing_and_less_budget_reads_more() {
        let p = inputs(steep());
        let wb = p.shape.weight_bytes();
        let full = p.plan(wb).unwrap();
        assert!(full.read_bytes < 1.0 && full.hit_rate > 0.999, "{full:?}");
        // Re-planning keeps the level and the group, and shrinks the cache with the budget.
        let mut last = full.clone();
        for share in [0.9, 0.75, 0.5, 0.3] {
            let q = p.replan(&full, (wb as f64 * share) as usize).unwrap();
            assert_eq!((q.sparsity, q.span), (full.sparsity, full.span));
            assert!(q.cache_bytes < last.cache_bytes && q.read_bytes > last.read_bytes && q.times.decode > last.times.decode);
            last = q;
        }
    }

    #[test]
    fn bad_inputs_are_refused() {
        let mut p = inputs(steep());
        p.levels[1].hit = vec![0.0, 0.6, 0.5];
        assert!(matches!(p.plan(50 * MIB), Err(PlanError::Input(_))));
        let mut p = inputs(steep());
        p.spans = vec![0];
        assert!(matches!(p.plan(50 * MIB), Err(PlanError::Input(_))));
        let mut p = inputs(steep());
        p.bw.mem = f64::NAN;
        assert!(matches!(p.plan(50 * MIB), Err(PlanError::Input(_))));
    }

    /// Measured on a real file and a real region: every figure positive, reads of 1 MiB no slower than of 4 KiB
    /// by more than noise would allow (the point of large reads).
    #[test]
    fn bandwidths_measure_a_real_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 8 * MIB]).unwrap();
        // The page-install rate needs a userfaultfd region.
        let Some(bw) = llms_tests::require_kernel("userfaultfd", Bandwidths::measure(&path, &[4096, 1 << 20])) else { return };
        assert!(bw.mem > 0.0 && bw.flash.iter().all(|&(_, b)| b > 0.0), "{bw:?}");
        assert!(bw.install > 0.0 && bw.install.is_finite(), "{bw:?}");
        assert_eq!(bw.flash.iter().map(|f| f.0).collect::<Vec<_>>(), [4096, 1 << 20]);
        assert!(Bandwidths::measure(&path, &[4 << 20]).is_err(), "file smaller than 4 reads");
        assert!(Bandwidths::measure(&path, &[1000]).is_err(), "not whole pages");
    }
}

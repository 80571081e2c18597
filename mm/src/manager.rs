//! The context memory manager: the chunk table of every context, the budget, reclaim through
//! the LCTRU queue, ahead-of-time swap-out, and loading a context back (the swap-recompute
//! pipeline). One call into a context is `prepare` (room for new tokens), `begin` (load and
//! lock), the engine's work, `end` (re-level, unlock, write out, reclaim).

use std::collections::{HashMap, HashSet, VecDeque};
use std::ptr::NonNull;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use uffd_handler::{Pager, Region, RegionId, SlotSource, SlotState, SourceError, Staging, PAGE};

use crate::context::{prefix_hashes, Codec, FaultRecompute, Format, KvContext};
use crate::gate::PassGate;
use crate::lctru::{ChunkId, Lctru};
use crate::levels::{choose_levels_held, loss_of_bits};
use crate::planner::{plan_forced, Plan};
use crate::profile::Profile;
use crate::ring::{Op, Ring};
use crate::store::{Entry, RecordMeta, Store, StoreError};
use crate::IdMap;

mod share;
use share::Unshare;
pub use share::{shared_names, SharedName, SharingStats, POOL_CTX, PUBLIC_SCOPE};

/// How contexts are kept: LLMS and the baselines it is compared with, over the same store
/// and engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Tolerance-aware levels, LCTRU, AoT swap-out, the swap-recompute pipeline.
    Llms,
    /// Chunks, every chunk int8, swapped out at reclaim, LRU, loads read everything.
    VllmSq,
    /// Chunks in the base format, swapped out at reclaim, LRU, loads read everything.
    VllmS,
    /// Whole contexts swapped out and in.
    Swap,
    /// Whole contexts dropped under pressure and recomputed when called.
    Lmk,
}

impl Policy {
    pub const ALL: [Self; 5] = [Self::Llms, Self::VllmSq, Self::VllmS, Self::Swap, Self::Lmk];
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::Llms => "llms",
            Self::VllmSq => "vllm-sq",
            Self::VllmS => "vllm-s",
            Self::Swap => "swap",
            Self::Lmk => "lmk",
        }
    }
}

/// Configuration of the manager.
#[derive(Debug, Clone)]
pub struct MmConfig {
    pub policy: Policy,
    /// Bytes of resident chunk memory allowed (pinned working sets may exceed it).
    pub budget: usize,
    /// Average chunk size as a fraction of the heaviest level (the `llms` policy's global
    /// compression ratio, eq. 3).
    pub ratio: f64,
    /// The compression levels of the `llms` policy, heaviest first (format codes).
    pub levels: Vec<Format>,
    /// Chunks per context (its slots).
    pub max_chunks: usize,
    /// Parts of the `llms` policy that can be switched off for ablation studies.
    pub features: Features,
}

/// Parts of the `llms` policy, all on by default; switching one off measures what it brings
/// (the paper's Fig. 13). Compression and the recompute pipeline are switched off by the
/// caller: one level, and no profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    /// Reclaim by LCTRU (heaviest level first); off: one LRU queue over all levels.
    pub lctru: bool,
    /// Write modified chunks when a call returns (AoT); off: write them when reclaimed.
    pub aot: bool,
}

impl Default for Features {
    fn default() -> Self {
        Self { lctru: true, aot: true }
    }
}

/// Errors of the manager.
#[derive(Debug, thiserror::Error)]
pub enum MmError {
    #[error(transparent)]
    Uffd(#[from] uffd_handler::UffdError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("engine: {0}")]
    Engine(#[from] crate::EngineError),
    #[error("no context {0}")]
    NoContext(u64),
    #[error("context {0} already exists")]
    Exists(u64),
    #[error("context {ctx}: {need} chunks needed, a context has at most {max}")]
    TooLong { ctx: u64, need: usize, max: usize },
    #[error("swap store i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("configuration: {0}")]
    Config(String),
}

pub type Result<T> = std::result::Result<T, MmError>;

/// A mixed plan must beat reading everything by this fraction of the predicted time.
const PLAN_MARGIN: f64 = 0.1;

/// How to load the missing chunks of a context (the planner's choice, or a forced one for
/// measurements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Planned,
    AllRead,
    AllRecompute,
}

/// What a load did.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    pub missing: usize,
    pub read: usize,
    pub recomputed: usize,
    /// Chunks whose record was missing, stale or failed its checksum (recomputed instead).
    pub unreadable: usize,
    pub read_bytes: u64,
    /// The planner's prediction, if it ran.
    pub plan: Option<Plan>,
    /// Seconds: the whole load, and the time the pipeline waited on reads.
    pub seconds: f64,
    pub io_wait: f64,
}

#[derive(Debug, Clone, Copy)]
struct ChunkMeta {
    level: Format,
    tokens: u32,
    prefix_hash: u64,
    density: f64,
    /// Only the kept layers exist ([`Codec::dead_chunks`]).
    dead: bool,
    /// The pool chunk it is (shared with other contexts); its own slot is then empty.
    shared: Option<u32>,
}

#[derive(Debug)]
struct Ctx {
    region: Arc<Region>,
    chunks: Vec<ChunkMeta>,
    in_call: bool,
    /// Its tokens as of its last call (kept only while it may share: to check a chunk against
    /// the tokens it holds before another context takes it).
    tokens: Vec<u32>,
    /// Changes whenever the chunk table may have changed under a queued lowering (a call
    /// began, the context was made again): such a lowering is dropped (see [`LevelJob`]).
    epoch: u64,
}

/// A full chunk `end` chose a lower level for, left for a background leveller: lowering a
/// call's chunks on the call's thread held every other call's next token for as long as the
/// encoders took (~15 ms a chunk of the default model: #56). Valid while its context's epoch
/// is unchanged and the chunk still resident at `from`; a dropped job is done again by the
/// context's next `end`, or its chunk was evicted (and written) at `from` meanwhile.
#[derive(Debug, Clone, Copy)]
struct LevelJob {
    ctx: u64,
    chunk: usize,
    from: Format,
    to: Format,
    epoch: u64,
}

/// A chunk to lower, taken by [`Manager::take_level_work`]: a copy of its bytes, encoded
/// outside the manager's lock ([`LevelWork::encode`]) and handed back to
/// [`Manager::finish_level_work`].
#[derive(Debug)]
pub struct LevelWork {
    job: LevelJob,
    dead: bool,
    tokens: usize,
    src: Vec<u8>,
}

impl LevelWork {
    /// The chunk's bytes at its new level (the codec's conversion; no lock is held).
    pub fn encode(&self, codec: &dyn Codec) -> std::result::Result<Vec<u8>, crate::EngineError> {
        self.encode_layers(codec, || {})
    }

    /// [`LevelWork::encode`] a layer at a time, calling `before` ahead of each: a background
    /// encoder waits there for a gap between the caller's passes ([`PassGate::wait_gap`]), so
    /// that it holds a core a layer at most when a pass begins (~0.5 ms on the default model)
    /// rather than a whole chunk (~15 ms). A chunk is layer-major and each layer converts on
    /// its own, so the bytes are those of the whole chunk's conversion.
    pub fn encode_layers(&self, codec: &dyn Codec, mut before: impl FnMut()) -> std::result::Result<Vec<u8>, crate::EngineError> {
        let j = &self.job;
        let layers = if self.dead { codec.kept_layers() } else { codec.n_layers() };
        let (from_bytes, to_bytes) = (codec.layer_bytes(j.from), codec.layer_bytes(j.to));
        if from_bytes == 0 || to_bytes == 0 || self.src.len() < layers * from_bytes {
            return Err(crate::EngineError::new(format!("a chunk copy of {} bytes holds fewer than {layers} layers", self.src.len())));
        }
        let mut dst = vec![0u8; codec.live_bytes(j.to, self.dead)];
        for (src, dst) in self.src.chunks_exact(from_bytes).zip(dst.chunks_exact_mut(to_bytes)).take(layers) {
            before();
            codec.convert(j.from, src, j.to, dst, self.tokens, 1)?;
        }
        Ok(dst)
    }
}

/// One row of the chunk table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChunkInfo {
    pub state: SlotState,
    pub format: Format,
    pub tokens: u32,
    pub density: f64,
    /// The store holds this exact version (format, tokens, prefix).
    pub on_flash: bool,
    /// Held in the pool, one copy for every context that shares it.
    pub shared: bool,
}

/// Counters of the manager's work.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct MmStats {
    pub evicted_chunks: u64,
    pub evicted_bytes: u64,
    pub written_sync: u64,
    pub written_aot: u64,
    /// Chunks evicted without a record because writing one failed: recomputed at their
    /// next load.
    pub dropped_unsaved: u64,
    pub releveled: u64,
    pub killed_contexts: u64,
}

type Expected = Arc<Mutex<IdMap<ChunkId, RecordMeta>>>;

type Fallback = Arc<std::sync::RwLock<Option<Arc<dyn FaultRecompute>>>>;

/// Serves a faulting slot: the safety net when something reads a chunk mm did not load. The
/// chunk comes from the swap store, else from the fault recompute (when one is set); a chunk
/// neither can produce is poisoned, so the reader gets SIGBUS rather than zeros.
struct StoreSource {
    store: Arc<Store>,
    expected: Expected,
    fallback: Fallback,
    context: u64,
}

impl SlotSource for StoreSource {
    fn fill(&self, _region: RegionId, slot: usize, buf: &mut [u8]) -> std::result::Result<usize, SourceError> {
        let chunk = u32::try_from(slot)?;
        let want = self.expected.lock().unwrap_or_else(|e| e.into_inner()).get(&(self.context, chunk)).copied();
        let want = want.ok_or_else(|| format!("context {} chunk {chunk} has no data", self.context))?;
        match self.store.read(&want, buf) {
            Ok(n) => Ok(n),
            Err(e) => {
                let fb = self.fallback.read().unwrap_or_else(|e| e.into_inner()).clone();
                let Some(fb) = fb else { return Err(e.into()) };
                eprintln!("llms: context {} chunk {chunk}: {e}; recomputing it for a fault", self.context);
                Ok(fb.recompute(&want, buf)?)
            }
        }
    }
}

struct WriteJob {
    region: Arc<Region>,
    /// The slot of `region` holding the chunk (its chunk index, except a pool chunk still at
    /// home in a context's slot).
    slot: usize,
    meta: RecordMeta,
    len: usize,
    /// A record this one replaces, given back once this one is written (a promoted chunk's
    /// own record: the chunk keeps a record on flash at every moment, and the hole punching
    /// is off the caller's path).
    replaces: Option<ChunkId>,
}

/// Longest the AoT writer holds a batch back while the caller's passes run
/// ([`Manager::passes_running`]).
const WRITER_HOLD: Duration = Duration::from_millis(100);

/// The AoT writer: a thread that writes chunks modified by a call right after it returns.
struct Writer {
    /// Jobs go in batches: a fork's first promotions queue 270 at once (one send, one
    /// wake-up of the writer, instead of 270).
    tx: Option<Sender<Vec<WriteJob>>>,
    /// Whether the caller runs a forward pass: the writer waits for a gap (at most
    /// [`WRITER_HOLD`]) before it copies and writes a batch, unless a caller waits for a
    /// write ([`Writer::wait_while`]).
    passes: Arc<PassGate>,
    /// Chunks queued and not yet written, with how many jobs each (a chunk a call wrote
    /// again before the writer took its last job has two, and two pins).
    pending: Arc<(Mutex<IdMap<ChunkId, u32>>, std::sync::Condvar)>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    fn spawn(store: Arc<Store>, failures: &WriteFailures) -> Self {
        let (tx, rx) = mpsc::channel::<Vec<WriteJob>>();
        let pending: Arc<(Mutex<IdMap<ChunkId, u32>>, std::sync::Condvar)> = Arc::default();
        let passes = Arc::new(PassGate::default());
        let (p, f, gate) = (Arc::clone(&pending), Arc::clone(failures), Arc::clone(&passes));
        let handle = std::thread::Builder::new()
            .name("llms-aot-writer".into())
            .spawn(move || writer_loop(&store, &rx, &p, &f, &gate))
            .expect("spawn the AoT writer");
        Self { tx: Some(tx), passes, pending, handle: Some(handle) }
    }

    fn is_pending(&self, c: ChunkId) -> bool {
        self.pending.0.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&c)
    }

    /// Waits until no chunk of `ctx` is being written (a call must not convert or shrink a
    /// chunk the writer is still copying).
    fn wait_context(&self, ctx: u64) {
        self.wait_while(|g| g.keys().any(|c| c.0 == ctx));
    }

    /// Waits until no chunk `from..` of `ctx` is being written.
    fn wait_chunks(&self, ctx: u64, from: usize) {
        self.wait_while(|g| g.keys().any(|c| c.0 == ctx && c.1 as usize >= from));
    }

    /// Waits until chunk `c` is not being written.
    fn wait_chunk(&self, c: ChunkId) {
        self.wait_while(|g| g.contains_key(&c));
    }

    fn wait_idle(&self) {
        self.wait_while(|g| !g.is_empty());
    }

    /// Waits while `busy(pending)`. The writer does not hold its batches back for passes
    /// meanwhile: a caller waiting on it under mm's lock (a delete from a connection thread,
    /// say) would otherwise wait out the hold while another call's passes run.
    fn wait_while(&self, busy: impl Fn(&IdMap<ChunkId, u32>) -> bool) {
        let (m, cv) = &*self.pending;
        let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
        if !busy(&g) {
            return;
        }
        let _urgent = self.passes.urgent();
        while busy(&g) {
            g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn writer_loop(
    store: &Store,
    rx: &Receiver<Vec<WriteJob>>,
    pending: &(Mutex<IdMap<ChunkId, u32>>, std::sync::Condvar),
    failures: &Mutex<(u64, String)>,
    passes: &PassGate,
) {
    let Ok(mut ring) = Ring::new(64) else {
        eprintln!("llms: the AoT writer cannot create an io_uring; chunks will be written at reclaim");
        // Drain jobs, releasing their pins, so nothing waits on us.
        for job in rx.iter().flatten() {
            let _ = job.region.unpin(job.slot);
            finish(pending, &[(job.meta.context, job.meta.chunk)]);
        }
        return;
    };
    let mut queue: VecDeque<WriteJob> = VecDeque::new();
    loop {
        if queue.is_empty() {
            match rx.recv() {
                Ok(b) => queue.extend(b),
                Err(_) => break,
            }
        }
        // Ahead of time means in the gaps between passes: copying, checksumming and writing a
        // batch beside a pass took a core (and the slots' write protection) from it. A
        // branch promotes its cached chunks, and writing their pool records (7.6 MB at 647
        // tokens) during its one prefill pass put its first token at 68-73 ms, against 57 ms
        // with the writer switched off (`llms bench-prefix`, ablate = ["aot"]). A caller that
        // waits for the writer runs no pass meanwhile.
        let until = Instant::now() + WRITER_HOLD;
        let hold = || passes.wait_gap(until.saturating_duration_since(Instant::now()));
        while queue.len() < 32 {
            match rx.try_recv() {
                Ok(b) => queue.extend(b),
                Err(_) => break,
            }
        }
        let jobs: Vec<WriteJob> = queue.drain(..queue.len().min(32)).collect();
        let mut copies = Vec::with_capacity(jobs.len());
        for j in &jobs {
            // A pass may have begun since the last chunk (jobs come as a call ends, or a
            // branch promotes its chunks just before its pass).
            hold();
            let slot = j.slot;
            // The slot is pinned (by `end`): clean first, so a write after the copy is seen.
            let _ = j.region.clean(slot);
            let mut buf = vec![0u8; j.len];
            // SAFETY: the slot is resident and pinned; len is within its data.
            buf.copy_from_slice(unsafe { std::slice::from_raw_parts(j.region.slot_ptr(slot), j.len) });
            copies.push(buf);
        }
        // Duplicates (a chunk written twice before we got here): keep the last.
        let mut batch: Vec<(RecordMeta, &[u8])> = Vec::new();
        for (j, b) in jobs.iter().zip(&copies).rev() {
            if !batch.iter().any(|(m, _)| (m.context, m.chunk) == (j.meta.context, j.meta.chunk)) {
                batch.push((j.meta, b));
            }
        }
        hold();
        if let Err(e) = store.write_batch(&mut ring, &batch) {
            eprintln!("llms: AoT write of {} chunk(s) failed: {e}; they will be written at reclaim", batch.len());
            note_failure(failures, &e);
        } else {
            // Unless a later job of the batch wrote it anew (the chunk became its context's own
            // again); an earlier one (its own write, queued before the promotion) is replaced.
            for (r, j) in jobs.iter().enumerate() {
                let Some((c, k)) = j.replaces else { continue };
                if !jobs[r + 1..].iter().any(|x| (x.meta.context, x.meta.chunk) == (c, k)) {
                    store.discard(c, k);
                }
            }
        }
        for j in &jobs {
            let _ = j.region.unpin(j.slot);
        }
        let ids: Vec<ChunkId> = jobs.iter().map(|j| (j.meta.context, j.meta.chunk)).collect();
        finish(pending, &ids);
    }
}

/// Chunk write batches that failed (a full disk, say) and the last error. An AoT batch's
/// chunks stay dirty in memory and are written at reclaim; a chunk reclaim cannot write is
/// dropped and recomputed from its tokens (see [`Manager::save_and_evict_as`]).
type WriteFailures = Arc<Mutex<(u64, String)>>;

fn note_failure(failures: &Mutex<(u64, String)>, e: &StoreError) {
    let mut f = failures.lock().unwrap_or_else(|e| e.into_inner());
    f.0 += 1;
    f.1 = e.to_string();
}

/// One job each of `ids` is done.
fn finish(pending: &(Mutex<IdMap<ChunkId, u32>>, std::sync::Condvar), ids: &[ChunkId]) {
    let mut g = pending.0.lock().unwrap_or_else(|e| e.into_inner());
    for id in ids {
        if let Some(n) = g.get_mut(id) {
            *n -= 1;
            if *n == 0 {
                g.remove(id);
            }
        }
    }
    pending.1.notify_all();
}

/// The memory manager of a set of contexts.
pub struct Manager {
    cfg: MmConfig,
    codec: Arc<dyn Codec>,
    pager: Pager,
    store: Arc<Store>,
    profile: Option<Profile>,
    ctxs: IdMap<u64, Ctx>,
    lctru: Lctru,
    expected: Expected,
    fallback: Fallback,
    writer: Option<Writer>,
    /// Jobs for the writer kept back while set ([`Manager::hold_aot`]).
    held_jobs: Option<Vec<WriteJob>>,
    write_failures: WriteFailures,
    ring: Ring,
    slot_size: usize,
    /// Zeroed slot-sized buffers a new chunk's slot takes its pages from (MOVE): `zero` the
    /// ready ones, `zero_spent` those whose pages went to a slot. Giving a buffer its pages
    /// back faults them in (~0.1 ms a chunk, several ms at a busy host's slow moments: a
    /// branch's 3 new chunks took 0.3-4.6 ms before its prefill could start), so `end` does
    /// it after a call and `prepare` takes ready ones. At most [`zero_spares`] are kept ready.
    zero: Vec<Staging>,
    zero_spent: Vec<Staging>,
    /// Load staging kept between loads, on huge pages with its pages present (see
    /// [`Staging::huge`]): slot-sized buffers that reads land in and that are copied into
    /// the slots. Faulting fresh staging in at an O_DIRECT submission (~1.4 ms for 3 MB) and
    /// reading into scattered 4 KiB pages (reads complete in waves of five on this VM's disk)
    /// would both sit on the switch path. Memory the service holds beyond the KV budget.
    arena: Staging,
    /// The load lanes' rings and the thread that runs the second lane (see [`Lanes`]).
    lanes: Lanes,
    /// Lower chunks' levels on another thread ([`Manager::set_background_levels`]), and the
    /// lowerings waiting for it.
    background_levels: bool,
    levelling: VecDeque<LevelJob>,
    /// Lowerings taken and not yet finished (encoding outside the lock).
    levelling_taken: usize,
    epochs: u64,
    /// Chunks shared between contexts, when on ([`Manager::enable_sharing`]).
    pool: Option<share::Pool>,
    /// Each context's sharing scope (the service's (uid, app)).
    scopes: IdMap<u64, u64>,
    /// Token sequences the integrator declared shared by every scope ([`Manager::set_public_prefixes`]).
    public: Vec<Vec<u32>>,
    /// Sharing's counters, per scope (an app's figures say nothing of another's).
    share_stats: IdMap<u64, SharingStats>,
    pub stats: MmStats,
}

/// What the two lanes of an all-read load ([`Manager::read_all`]) keep between loads: an
/// io_uring each, sized for the arena's buffers, and a parked helper thread for the second
/// lane. Set up per load they sat on every switch: `io_uring_setup` and its mappings took
/// 30-130 us a lane and spawning the helper 50-100 us on this project's VM, against ~150 us
/// for the disk to deliver one 100 KB chunk (docs/mm.md "Speed").
struct Lanes {
    rings: [Ring; 2],
    helper: rayon::ThreadPool,
}

impl Lanes {
    /// Lanes for an arena of `n_buf` buffers (a lone lane may have them all in flight).
    fn new(n_buf: usize) -> Result<Self> {
        let entries = u32::try_from(n_buf + 1).unwrap_or(u32::MAX);
        let helper = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .thread_name(|_| "llms-load".into())
            .build()
            .map_err(|e| MmError::Io(std::io::Error::other(format!("the load helper thread: {e}"))))?;
        Ok(Self { rings: [Ring::new(entries)?, Ring::new(entries)?], helper })
    }
}

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager").field("policy", &self.cfg.policy).field("contexts", &self.ctxs.len()).finish_non_exhaustive()
    }
}

fn engine(e: crate::EngineError) -> MmError {
    MmError::Engine(e)
}

impl Manager {
    /// A manager over `store`, with chunk sizes from `codec`. `profile` enables the planner
    /// (without it the `llms` policy reads every chunk it can).
    pub fn new(cfg: MmConfig, codec: Arc<dyn Codec>, store: Arc<Store>, profile: Option<Profile>) -> Result<Self> {
        let pager = Pager::new()?;
        let max = cfg.levels.iter().map(|&f| codec.chunk_bytes(f)).max().unwrap_or(0);
        let slot_size = max.max(1).div_ceil(PAGE) * PAGE;
        let n_levels = if cfg.policy == Policy::Llms && cfg.features.lctru { cfg.levels.len() } else { 1 };
        let write_failures = WriteFailures::default();
        let writer = (cfg.policy == Policy::Llms && cfg.features.aot).then(|| Writer::spawn(Arc::clone(&store), &write_failures));
        let arena = Staging::huge((ARENA_BYTES / slot_size.max(1)).max(1) * slot_size)?;
        Ok(Self {
            lctru: Lctru::new(n_levels),
            cfg,
            codec,
            pager,
            store,
            profile,
            ctxs: IdMap::default(),
            expected: Arc::default(),
            fallback: Arc::default(),
            writer,
            held_jobs: None,
            write_failures,
            ring: Ring::new(256)?,
            slot_size,
            zero: Vec::new(),
            zero_spent: Vec::new(),
            lanes: Lanes::new(arena.len() / slot_size)?,
            arena,
            background_levels: false,
            levelling: VecDeque::new(),
            levelling_taken: 0,
            epochs: 0,
            pool: None,
            scopes: IdMap::default(),
            public: Vec::new(),
            share_stats: IdMap::default(),
            stats: MmStats::default(),
        })
    }

    pub fn config(&self) -> &MmConfig {
        &self.cfg
    }
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }
    pub fn codec(&self) -> &Arc<dyn Codec> {
        &self.codec
    }
    /// Sizes the load staging arena (see `Manager::arena`; default 8 MiB), in whole slots, at
    /// least one. A larger arena keeps more reads in flight during an all-read load; with the
    /// two load lanes, 8 to 64 MiB measured alike on this project's VM (docs/mm.md). It is
    /// memory held beyond the KV budget.
    pub fn set_load_staging(&mut self, bytes: usize) -> Result<()> {
        if bytes > MAX_ARENA_BYTES {
            return Err(MmError::Config(format!("load staging of {bytes} bytes: at most {MAX_ARENA_BYTES}")));
        }
        let ss = self.slot_size.max(1);
        let n_buf = (bytes / ss).max(1);
        // Rings first: on an error the manager keeps its old arena and lanes, which match.
        let lanes = Lanes::new(n_buf)?;
        self.arena = Staging::huge(n_buf * ss)?;
        self.lanes = lanes;
        Ok(())
    }

    /// Bytes of the load staging arena.
    pub fn load_staging(&self) -> usize {
        self.arena.len()
    }

    pub fn set_budget(&mut self, bytes: usize) -> Result<usize> {
        self.cfg.budget = bytes;
        self.reclaim()
    }
    pub fn set_profile(&mut self, p: Option<Profile>) {
        self.profile = p;
    }

    /// What the kernel's userfaultfd offers the manager's regions (UFFDIO_MOVE: a promoted
    /// chunk's pages change hands instead of being copied).
    pub fn pager_capabilities(&self) -> uffd_handler::Capabilities {
        self.pager.capabilities()
    }

    /// Bytes of chunk memory resident now (populated pages of every context's slots).
    pub fn resident_bytes(&self) -> usize {
        self.ctxs.values().map(|c| c.region.resident_bytes()).sum::<usize>() + self.pool.as_ref().map_or(0, |p| p.region.resident_bytes())
    }

    /// Bytes resident for one context: its own chunks and the shared ones it holds (which
    /// other contexts count too).
    pub fn context_bytes(&self, ctx: u64) -> usize {
        self.ctxs.get(&ctx).map_or(0, |c| c.region.resident_bytes() + self.shared_bytes(ctx, c))
    }

    /// Resident bytes of the shared chunks a context holds (those at home in its own slots
    /// are in its region's count already).
    fn shared_bytes(&self, ctx: u64, c: &Ctx) -> usize {
        let Some(pool) = &self.pool else { return 0 };
        let elsewhere = |p: &u32| pool.get(*p).is_some_and(|e| e.home.as_ref().is_none_or(|h| h.ctx != ctx));
        c.chunks.iter().filter_map(|m| m.shared).filter(elsewhere).map(|p| pool.resident_bytes(p)).sum()
    }

    /// Bytes pinned by the contexts in a call: reclaim cannot take them, so while they run
    /// the budget holds only what is left beside them.
    pub fn pinned_bytes(&self) -> usize {
        let own: usize = self.ctxs.values().filter(|c| c.in_call).map(|c| c.region.resident_bytes()).sum();
        let shared: usize = self.pool.as_ref().map_or(0, |pool| {
            // (One at home in a context in a call is in that context's count.)
            let home_busy = |e: &share::Entry| e.home.as_ref().is_some_and(|h| self.ctxs.get(&h.ctx).is_some_and(|c| c.in_call));
            let busy = pool.entries.iter().enumerate().filter(|(_, e)| e.as_ref().is_some_and(|e| e.calls > 0 && !home_busy(e)));
            busy.map(|(p, _)| pool.resident_bytes(chunk_u32(p))).sum()
        });
        own + shared
    }

    /// What a call on `ctx` keeps resident while it runs: every chunk it holds, at its level
    /// (`begin` loads and pins them all), and new chunks in the base format until it holds
    /// `positions` positions. With [`Manager::pinned_bytes`], whether a call fits beside the
    /// ones running; a context mm does not hold needs only its new chunks.
    pub fn call_bytes(&self, ctx: u64, positions: usize) -> usize {
        let held = self.ctxs.get(&ctx).map_or(0, |c| c.chunks.len());
        let now: usize = (0..held).map(|i| self.chunk_len(ctx, i)).sum();
        let more = positions.div_ceil(self.codec.chunk_tokens()).saturating_sub(held);
        let base = self.cfg.levels.first().map_or(0, |&f| self.codec.chunk_bytes(f));
        now + more * base
    }

    /// The budget of resident chunk memory in force.
    pub fn budget(&self) -> usize {
        self.cfg.budget
    }

    /// The address range of a context's slots (for tests and metrics).
    pub fn region_range(&self, ctx: u64) -> Option<(usize, usize)> {
        self.ctxs.get(&ctx).map(|c| (c.region.slot_ptr(0) as usize, c.region.slot_size() * c.region.n_slots()))
    }

    /// A chunk's row of the table.
    pub fn chunk_info(&self, ctx: u64, chunk: usize) -> Option<ChunkInfo> {
        let c = self.ctxs.get(&ctx)?;
        let m = c.chunks.get(chunk)?;
        let (state, meta) = match (m.shared, &self.pool) {
            (Some(p), Some(pool)) => (pool.state(p).ok()?, self.pool_meta(p)?),
            _ => (c.region.state(chunk).ok()?, self.meta(ctx, chunk, m)),
        };
        Some(ChunkInfo {
            state,
            format: m.level,
            tokens: m.tokens,
            density: m.density,
            on_flash: m.tokens > 0 && self.store.matches(&meta),
            shared: m.shared.is_some(),
        })
    }

    /// Sets what the fault path falls back to when a faulting chunk has no valid record.
    pub fn set_fault_recompute(&mut self, r: Option<Arc<dyn FaultRecompute>>) {
        *self.fallback.write().unwrap_or_else(|e| e.into_inner()) = r;
    }

    /// The userfaultfd statistics of a context's region (faults served, fills, evictions).
    pub fn region_stats(&self, ctx: u64) -> Option<uffd_handler::StatsSnapshot> {
        self.ctxs.get(&ctx).map(|c| c.region.stats())
    }

    /// Chunks mm knows for a context.
    pub fn n_chunks(&self, ctx: u64) -> usize {
        self.ctxs.get(&ctx).map_or(0, |c| c.chunks.len())
    }

    pub fn contexts(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.ctxs.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Registers a context with no chunks.
    pub fn create(&mut self, ctx: u64) -> Result<()> {
        if self.ctxs.contains_key(&ctx) {
            return Err(MmError::Exists(ctx));
        }
        let src = Arc::new(StoreSource {
            store: Arc::clone(&self.store),
            expected: Arc::clone(&self.expected),
            fallback: Arc::clone(&self.fallback),
            context: ctx,
        });
        let region = self.pager.region_with(self.slot_size, self.cfg.max_chunks.max(1), src, true)?;
        self.epochs += 1;
        self.ctxs.insert(ctx, Ctx { region: Arc::new(region), chunks: Vec::new(), in_call: false, tokens: Vec::new(), epoch: self.epochs });
        Ok(())
    }

    /// Registers a context the store holds (after a restart). `kv` holds the context's tokens
    /// and no chunks; every chunk gets its slot, not resident, in the format of its record when
    /// the record is of exactly these tokens, else in the base format. The next `begin` loads
    /// them (reading or recomputing, as for any evicted chunk). With sharing on, a full chunk
    /// that a context of the same scope holds with the same tokens before it is shared instead
    /// (a fork, a prompt starting with a cached prefix, a restart). `ctx` may be a context
    /// made by `create` that holds no chunk yet. Returns the chunks with a usable record or a
    /// shared copy.
    pub fn restore(&mut self, ctx: u64, kv: &mut dyn KvContext) -> Result<usize> {
        self.restore_from(ctx, kv, None)
    }

    /// [`Manager::restore`], with `from` a context of the same tokens (a fork's source), not
    /// in a call: its pool chunks are taken as they are, and its chunks' prefix hashes, instead
    /// of finding each chunk by hashing and comparing its tokens (a 4k-token fork's 270
    /// lookups); its chunks past them are the new context's own.
    pub(super) fn restore_from(&mut self, ctx: u64, kv: &mut dyn KvContext, from: Option<u64>) -> Result<usize> {
        let ct = self.codec.chunk_tokens();
        let n_tok = kv.tokens().len();
        let n = n_tok.div_ceil(ct);
        if n > self.cfg.max_chunks.max(1) {
            return Err(MmError::TooLong { ctx, need: n, max: self.cfg.max_chunks.max(1) });
        }
        if kv.n_chunks() != 0 {
            return Err(engine(crate::EngineError::new(format!(
                "context {ctx}: restore wants a cache without chunks, it has {}",
                kv.n_chunks()
            ))));
        }
        match self.ctxs.get(&ctx) {
            Some(c) if c.chunks.is_empty() && !c.in_call => {}
            Some(_) => return Err(MmError::Exists(ctx)),
            None => self.create(ctx)?,
        }
        let region = Arc::clone(&self.ctx(ctx)?.region);
        let toks = kv.tokens().to_vec();
        let known = from.and_then(|f| self.ctxs.get(&f)).filter(|c| !c.in_call && c.chunks.len() == n && c.tokens == toks).map(|c| {
            (c.chunks.iter().map(|m| m.prefix_hash).collect::<Vec<u64>>(), c.chunks.iter().map_while(|m| m.shared).collect::<Vec<u32>>())
        });
        let searched = known.is_none();
        let (hashes, known) = known.unwrap_or_else(|| (prefix_hashes(&toks, ct), Vec::new()));
        let base = kv.base();
        self.ctxs.get_mut(&ctx).ok_or_else(|| MmError::NoContext(ctx))?.chunks.reserve(n);
        let dead = self.codec.dead_chunks(n_tok).min(n);
        let scope = self.pool.as_ref().and(self.scopes.get(&ctx).copied());
        let mut usable = 0;
        let mut prev = None;
        for (i, &prefix_hash) in hashes.iter().enumerate() {
            let tokens = u32::try_from(n_tok.saturating_sub(i * ct).min(ct)).unwrap_or(u32::MAX);
            // A full chunk after shared ones: someone may hold it already (whole: a chunk dead
            // here reads its kept layers from the pool's copy).
            let shared = if let Some(&p) = known.get(i) {
                Some(p)
            } else if searched && tokens as usize == ct && (i == 0 || prev.is_some()) {
                self.find_shared(scope, prev, i, prefix_hash, &toks[i * ct..(i + 1) * ct])?
            } else {
                None
            };
            prev = shared;
            if let Some(p) = shared {
                let ptr = NonNull::new(region.slot_ptr(i)).expect("mapped");
                // SAFETY: as below; attach_shared points it at the pool's slot at once.
                unsafe { kv.push_chunk(ptr, self.slot_size) }.map_err(engine)?;
                let level = self.attach_shared(ctx, i, p, kv)?;
                let m = ChunkMeta { level, tokens, prefix_hash, density: 0.0, dead: i < dead, shared: Some(p) };
                self.ctxs.get_mut(&ctx).ok_or_else(|| MmError::NoContext(ctx))?.chunks.push(m);
                usable += 1;
                continue;
            }
            let layers = self.layers(i < dead);
            let want = |f: Format| RecordMeta { context: ctx, chunk: chunk_u32(i), format: f, tokens, prefix_hash, layers };
            let level = self
                .store
                .entry(ctx, chunk_u32(i))
                .map(|e| e.meta.format)
                .filter(|&f| (f == base || self.cfg.levels.contains(&f)) && self.store.matches(&want(f)));
            usable += usize::from(level.is_some());
            let level = level.unwrap_or(base);
            let ptr = NonNull::new(region.slot_ptr(i)).expect("mapped");
            // SAFETY: the slot belongs to this context for as long as the context lives; it is
            // not resident, and `begin` loads it before the engine reads it.
            unsafe { kv.push_chunk(ptr, self.slot_size) }.map_err(engine)?;
            if level != base {
                // SAFETY: as above.
                unsafe { kv.attach(i, ptr, self.slot_size, level) }.map_err(engine)?;
            }
            let m = ChunkMeta { level, tokens, prefix_hash, density: 0.0, dead: i < dead, shared: None };
            self.ctxs.get_mut(&ctx).ok_or_else(|| MmError::NoContext(ctx))?.chunks.push(m);
            self.expected.lock().unwrap_or_else(|e| e.into_inner()).insert((ctx, chunk_u32(i)), want(level));
        }
        kv.set_dead(dead).map_err(engine)?;
        self.index_own(ctx, &toks);
        // A chunk promoted from another context's record is resident in the pool now.
        self.reclaim()?;
        Ok(usable)
    }

    /// Deletes a context: its memory and its records.
    pub fn delete(&mut self, ctx: u64) -> Result<()> {
        self.close(ctx)?;
        self.scopes.remove(&ctx);
        self.store.remove_context(ctx)?;
        Ok(())
    }

    /// Forgets a context's memory and keeps its records, which [`Manager::restore`] can
    /// reopen: how a failed call is rolled back to the context as it was saved (records
    /// written for tokens it no longer holds do not match their hashes and are recomputed).
    pub fn close(&mut self, ctx: u64) -> Result<()> {
        // Its hold on shared chunks goes (last first: children before parents); a chunk no
        // other context holds goes with it.
        self.unindex_own(ctx);
        let in_call = self.ctx(ctx)?.in_call;
        let shared: Vec<(usize, u32)> = self.ctx(ctx)?.chunks.iter().enumerate().filter_map(|(i, m)| m.shared.map(|p| (i, p))).collect();
        // Chunks others share that are still at home in this context's slots move to their
        // pool slots first (copied, the home kept mapped until their calls end, when a sharer
        // is in a call: this may run beside its passes).
        let homed: Vec<u32> = shared
            .iter()
            .filter_map(|&(_, p)| {
                let e = self.pool.as_ref()?.get(p)?;
                (e.home.as_ref().is_some_and(|h| h.ctx == ctx) && e.sharers.len() > 1).then_some(p)
            })
            .collect();
        let mut kept = Vec::new();
        for p in homed {
            kept.extend(self.unhome(p, true)?);
        }
        for &(i, p) in shared.iter().rev() {
            self.release(ctx, i, p, in_call);
        }
        let c = self.ctxs.remove(&ctx).ok_or_else(|| MmError::NoContext(ctx))?;
        // Only this context's writes must finish before its records go; other contexts'
        // AoT writes carry on (a sliding window deletes on the switch path).
        if let Some(w) = &self.writer {
            w.wait_context(ctx);
        }
        if !kept.is_empty() {
            // The region outlives this context until those sharers' calls end: its other
            // slots' pages go now, as the budget no longer counts them (a slot still pinned
            // by this context's own failed call goes with the region).
            for i in (0..c.chunks.len()).filter(|i| !kept.contains(i)) {
                let _ = c.region.discard(i);
            }
        }
        for i in 0..c.chunks.len() {
            self.lctru.remove((ctx, chunk_u32(i)));
        }
        self.levelling.retain(|j| j.ctx != ctx);
        self.expected.lock().unwrap_or_else(|e| e.into_inner()).retain(|k, _| k.0 != ctx);
        // The region's pages go back to the kernel on the reaper's thread: unmapping a long
        // context takes milliseconds. Its bytes left the budget's accounting with `ctxs`.
        self.store.reaper().release(Box::new(c));
        Ok(())
    }

    fn ctx(&self, ctx: u64) -> Result<&Ctx> {
        self.ctxs.get(&ctx).ok_or_else(|| MmError::NoContext(ctx))
    }

    fn level_index(&self, f: Format) -> usize {
        if self.cfg.policy == Policy::Llms {
            self.cfg.levels.iter().position(|&l| l == f).unwrap_or(0)
        } else {
            0
        }
    }

    fn meta(&self, ctx: u64, i: usize, m: &ChunkMeta) -> RecordMeta {
        RecordMeta {
            context: ctx,
            chunk: chunk_u32(i),
            format: m.level,
            tokens: m.tokens,
            prefix_hash: m.prefix_hash,
            layers: self.layers(m.dead),
        }
    }

    /// Layers a chunk holds: the kept ones when it is dead.
    fn layers(&self, dead: bool) -> u32 {
        u32::try_from(if dead { self.codec.kept_layers() } else { self.codec.n_layers() }).unwrap_or(u32::MAX)
    }

    /// Declares the first `dead` chunks of `ctx` dead (a sliding-window model: their tokens all
    /// left the window, [`Codec::dead_chunks`]): the pages of their other layers go back to
    /// the kernel, their records give the space of those layers back, and from now on only the
    /// kept layers are read, written or counted against the budget.
    fn kill(&mut self, ctx: u64, region: &Region, kv: &mut dyn KvContext, dead: usize) -> Result<()> {
        let newly: Vec<usize> = self.ctx(ctx)?.chunks.iter().take(dead).enumerate().filter(|(_, m)| !m.dead).map(|(i, _)| i).collect();
        for &i in &newly {
            let m = &mut self.ctxs.get_mut(&ctx).ok_or_else(|| MmError::NoContext(ctx))?.chunks[i];
            m.dead = true;
            let m = *m;
            if m.shared.is_some() {
                // Others may still read every layer: the pool keeps it whole, and this context
                // reads its kept layers (first in the chunk) from there.
                continue;
            }
            if region.state(i)? == SlotState::Resident {
                if let Some(w) = &self.writer {
                    w.wait_chunk((ctx, chunk_u32(i)));
                }
                region.shrink(i, self.codec.live_bytes(m.level, true))?;
            }
            self.store.shrink(ctx, chunk_u32(i))?;
            let meta = self.meta(ctx, i, &m);
            if let Some(e) = self.expected.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&(ctx, chunk_u32(i))) {
                *e = meta;
            }
        }
        kv.set_dead(dead).map_err(engine)
    }

    /// Loads every chunk of `ctx` that is not resident and pins them all for the call.
    pub fn begin(&mut self, ctx: u64, kv: &mut dyn KvContext, strategy: Strategy) -> Result<LoadReport> {
        let t0 = Instant::now();
        let ct = self.codec.chunk_tokens();
        if let Some(w) = &self.writer {
            // Only the slots past the context's tokens (a call claims them afresh). Waiting
            // for every chunk its last call wrote held this call (and, on the service's
            // worker, every other call's next token) for as long as the disk took: 4-21 ms
            // after a 1k-token call. The chunks it holds keep their bytes through a call: the
            // engine only appends rows to the last one (the writer's record of it names the
            // rows it had, and a write after the writer's copy marks the slot dirty again),
            // and what rewrites a chunk (a rollback, a lowering, a window's shrink, a whole
            // recompute) waits for the chunks it rewrites.
            w.wait_chunks(ctx, kv.tokens().len().div_ceil(ct));
        }
        let hashes = prefix_hashes(kv.tokens(), ct);
        let n_tok = kv.tokens().len();
        let region = Arc::clone(&self.ctx(ctx)?.region);
        let n = kv.n_chunks();
        if n > region.n_slots() {
            return Err(MmError::TooLong { ctx, need: n, max: region.n_slots() });
        }
        if self.pool.is_some() {
            // In a call its own chunks may change: they are not offered to others until `end`.
            self.unindex_own(ctx);
            // A shared chunk it no longer holds whole, or of other tokens (its tokens changed
            // without `truncate`), becomes its own again and is recomputed.
            let pool = self.pool.as_ref().expect("checked");
            let stale = self.ctx(ctx)?.chunks.iter().enumerate().take(n).find(|(i, m)| {
                m.shared.is_some_and(|p| n_tok < (i + 1) * ct || pool.get(p).is_none_or(|e| Some(&e.prefix_hash) != hashes.get(*i)))
            });
            if let Some((i, _)) = stale {
                self.unshare_from(ctx, kv, i, Unshare::Missing, false)?;
            }
        }
        // The table follows the engine: chunks the engine has that mm has not seen yet are
        // adopted in `end`; here every known chunk is checked for residency.
        let mut missing = Vec::new();
        let mut shared = Vec::new();
        {
            self.epochs += 1;
            let c = self.ctxs.get_mut(&ctx).ok_or_else(|| MmError::NoContext(ctx))?;
            c.in_call = true;
            c.epoch = self.epochs;
            for i in 0..n.min(c.chunks.len()) {
                let tokens = n_tok.saturating_sub(i * ct).min(ct);
                c.chunks[i].tokens = u32::try_from(tokens).unwrap_or(u32::MAX);
                c.chunks[i].prefix_hash = hashes.get(i).copied().unwrap_or(0);
                if let Some(p) = c.chunks[i].shared {
                    shared.push((i, p));
                } else if region.state(i)? != SlotState::Resident {
                    missing.push(i);
                }
            }
        }
        // Its shared chunks count as in a call from now on: reclaim passes them by, and their
        // level stays as it is until every sharer has ended its call.
        let mut need_shared = 0;
        if let Some(pool) = self.pool.as_mut() {
            for &(_, p) in &shared {
                let resident = pool.state(p)? == SlotState::Resident;
                let e = pool.get_mut(p).expect("a live pool chunk");
                e.calls += 1;
                e.epoch = self.epochs;
                if !resident {
                    need_shared += self.codec.live_bytes(e.level, false);
                }
            }
        }
        let need: usize = missing.iter().map(|&i| self.chunk_len(ctx, i)).sum();
        self.reclaim_for(need + need_shared)?;
        // Shared chunks first: the context's own chunks may be recomputed, attending to them.
        if let Some(lost) = self.load_shared(&shared)? {
            eprintln!("llms: context {ctx}: shared chunk {lost} has no readable record; this context recomputes it and what follows");
            for &(i, p) in shared.iter().filter(|(i, _)| *i >= lost) {
                let e = self.pool.as_mut().and_then(|pl| pl.get_mut(p)).expect("a live pool chunk");
                e.calls = e.calls.saturating_sub(1);
                missing.push(i);
            }
            self.unshare_from(ctx, kv, lost, Unshare::Missing, false)?;
            missing.sort_unstable();
        }
        // The engine reads each shared chunk at the pool's slot before anything is loaded: a
        // recompute below attends to them, and an engine whose view of a shared chunk is still
        // its own slot (a session made anew, say after lmk ended the context) would read that
        // empty slot — a fault no record answers, so a SIGBUS.
        for i in 0..n.min(self.ctx(ctx)?.chunks.len()) {
            let m = self.ctx(ctx)?.chunks[i];
            if let (Some(p), Some(pool)) = (m.shared, &self.pool) {
                // Where the pool chunk is (resident and pinned by `load_shared`), at its level:
                // it may have been lowered, or this chunk promoted, since the last call.
                let e = pool.get(p).expect("a live pool chunk");
                let (level, at) = (e.level, Arc::clone(&e.at));
                self.ctxs.get_mut(&ctx).ok_or_else(|| MmError::NoContext(ctx))?.chunks[i].level = level;
                // SAFETY: resident and pinned for the call; nothing writes a shared chunk, and
                // `at` changes only with the bytes moved there ([`Manager::unhome`], eviction).
                unsafe { kv.attach_moving(i, at, self.slot_size, level) }.map_err(engine)?;
            } else if kv.format(i) != m.level && missing.binary_search(&i).is_err() {
                // (`missing` is in chunk order: built so, and sorted after a lost pool chunk.)
                // A resident chunk lowered in the background since the last call: the engine
                // learns its level before the load, whose recompute attends to it. Read in
                // the old format it would be wrong bytes, and past the lowered length pages
                // that are gone (a fault served from the lowered record, or a SIGBUS when the
                // store has none). A loaded chunk is attached at its level by the load.
                let ptr = NonNull::new(region.slot_ptr(i)).expect("mapped");
                // SAFETY: resident (not missing) and in a call: reclaim passes it by.
                unsafe { kv.attach(i, ptr, self.slot_size, m.level) }.map_err(engine)?;
            }
        }
        let mut report = LoadReport { missing: missing.len(), ..LoadReport::default() };
        if !missing.is_empty() {
            self.load(ctx, kv, &region, &missing, strategy, &mut report)?;
        }
        for i in 0..n.min(self.ctx(ctx)?.chunks.len()) {
            if self.ctx(ctx)?.chunks[i].shared.is_none() {
                region.pin(i)?;
            }
        }
        report.seconds = t0.elapsed().as_secs_f64();
        Ok(report)
    }

    /// Makes the pool chunks of `shared` (a context's, in order) resident and pins them for
    /// the call: each is read from its record. Returns the first chunk (context index) whose
    /// record is missing or damaged; it and those after it are not pinned.
    fn load_shared(&mut self, shared: &[(usize, u32)]) -> Result<Option<usize>> {
        let Some(pool_region) = self.pool.as_ref().map(|p| Arc::clone(&p.region)) else { return Ok(None) };
        // The missing ones are read together, as a context's chunks are (two lanes, reads in
        // flight), not one blocking read after another: up to the first without a record.
        let mut lost = None;
        let (mut want, mut lens, mut at) = (Vec::new(), Vec::new(), Vec::new());
        for &(i, p) in shared {
            if self.pool.as_ref().expect("sharing").state(p)? == SlotState::Resident {
                continue;
            }
            match self.pool_meta(p).map(|m| self.store.expect(&m).map(|e| (m, e))) {
                Some(Ok((m, e))) => {
                    want.push((p as usize, e));
                    lens.push(self.codec.live_bytes(m.format, false));
                    at.push((i, p, m.format));
                }
                _ => {
                    lost = Some(i);
                    break;
                }
            }
        }
        let (ok, _) = self.read_records(POOL_CTX, &pool_region, &want, &lens)?;
        for (&(i, p, format), good) in at.iter().zip(ok) {
            if good {
                // Reclaim may take it once no sharer is in a call (LCTRU skips it until then).
                self.lctru.touch((POOL_CTX, p), self.level_index(format));
            } else {
                lost = Some(lost.map_or(i, |l: usize| l.min(i)));
            }
        }
        let pool = self.pool.as_ref().expect("sharing");
        for &(i, p) in shared {
            if lost.is_some_and(|l| i >= l) {
                break;
            }
            let (region, slot) = pool.loc(p);
            region.pin(slot)?;
        }
        Ok(lost)
    }

    fn chunk_len(&self, ctx: u64, i: usize) -> usize {
        let Some(m) = self.ctxs.get(&ctx).and_then(|c| c.chunks.get(i)) else { return 0 };
        match m.shared {
            // A pool chunk is whole (another sharer may read every layer), at the pool's level.
            Some(p) => self.pool.as_ref().and_then(|pl| pl.get(p)).map_or(0, |e| self.codec.live_bytes(e.level, false)),
            None => self.codec.live_bytes(m.level, m.dead),
        }
    }

    /// The swap-recompute pipeline over the missing chunks.
    #[allow(clippy::too_many_lines)]
    fn load(
        &mut self,
        ctx: u64,
        kv: &mut dyn KvContext,
        region: &Arc<Region>,
        missing: &[usize],
        strategy: Strategy,
        report: &mut LoadReport,
    ) -> Result<()> {
        let nl = self.codec.n_layers();
        let base = kv.base();
        // Dead chunks (a sliding-window context): recomputing a chunk needs the K/V of the
        // window before it at every layer, which dead chunks no longer have. So the planner
        // reads them all, and a chunk that must be recomputed (no valid record) brings the
        // whole context back to life and recomputes it from its tokens, after which the dead
        // chunks are dropped again.
        let dead = self.ctx(ctx)?.chunks.iter().take_while(|m| m.dead).count();
        let mut strategy = strategy;
        let whole: Vec<usize>;
        let missing = if dead > 0 {
            let unreadable = |m: &ChunkMeta, i: usize| m.tokens > 0 && self.store.expect(&self.meta(ctx, i, m)).is_err();
            let c = self.ctx(ctx)?;
            let forced = self.cfg.policy == Policy::Lmk || missing.iter().any(|&i| unreadable(&c.chunks[i], i));
            if forced || strategy == Strategy::AllRecompute {
                // A whole recompute writes every chunk: shared ones become its own first.
                self.unshare_from(ctx, kv, 0, Unshare::Missing, true)?;
                // The pool chunks it loaded for the call may go again (others hold them).
                self.reclaim()?;
                if let Some(w) = &self.writer {
                    // Every chunk is recomputed: none may still be in the writer's hands.
                    w.wait_context(ctx);
                }
                let n = self.ctx(ctx)?.chunks.len();
                for i in 0..n {
                    if region.state(i)? == SlotState::Resident {
                        region.discard(i)?;
                    }
                    self.ctxs.get_mut(&ctx).ok_or_else(|| MmError::NoContext(ctx))?.chunks[i].dead = false;
                }
                kv.revive_all();
                strategy = Strategy::AllRecompute;
                whole = (0..n).collect();
                report.missing = n;
                &whole[..]
            } else {
                strategy = Strategy::AllRead;
                missing
            }
        } else {
            missing
        };
        let metas: Vec<(usize, RecordMeta)> = {
            let c = self.ctx(ctx)?;
            missing.iter().map(|&i| (i, self.meta(ctx, i, &c.chunks[i]))).collect()
        };
        // Which chunks can be read: a record that matches exactly (format, tokens, prefix).
        let mut readable: Vec<(usize, Entry)> = Vec::new();
        let mut forced: Vec<usize> = Vec::new();
        for (i, m) in &metas {
            if m.tokens == 0 {
                continue; // an empty chunk: zeros
            }
            match (self.cfg.policy, self.store.expect(m)) {
                (Policy::Lmk, _) | (_, Err(_)) => forced.push(*i),
                (_, Ok(e)) => readable.push((*i, e)),
            }
        }
        report.unreadable = if self.cfg.policy == Policy::Lmk { 0 } else { forced.len() };
        // The split (eq. 4): which readable chunks to recompute instead.
        let mut recompute = forced.clone();
        match strategy {
            Strategy::AllRecompute => recompute.extend(readable.drain(..).map(|(i, _)| i)),
            Strategy::AllRead => {}
            Strategy::Planned => {
                if let (Policy::Llms, Some(p)) = (self.cfg.policy, &self.profile) {
                    let sizes: Vec<u64> = readable.iter().map(|(_, e)| u64::from(e.layer_len) * u64::from(e.meta.layers)).collect();
                    let mut pl = plan_forced(&sizes, forced.len(), p.recompute, p.io);
                    // A mixed load runs recompute and reads side by side, which costs some
                    // interference the linear profiles do not see: take it only when it is
                    // predicted clearly (PLAN_MARGIN) better than reading everything readable.
                    let all_read = p.io.at(sizes.iter().sum()).max(p.recompute.at(forced.len() as u64));
                    if !pl.recompute.is_empty() && pl.t_total > (1.0 - PLAN_MARGIN) * all_read {
                        pl = plan_forced(&[], forced.len(), p.recompute, p.io);
                        pl.read_bytes = sizes.iter().sum();
                        pl.t_io = p.io.at(pl.read_bytes);
                        pl.t_total = all_read;
                    }
                    let chosen: HashSet<usize> = pl.recompute.iter().copied().collect();
                    let mut keep = Vec::new();
                    for (k, (i, e)) in readable.into_iter().enumerate() {
                        if chosen.contains(&k) {
                            recompute.push(i);
                        } else {
                            keep.push((i, e));
                        }
                    }
                    readable = keep;
                    report.plan = Some(pl);
                }
            }
        }
        recompute.sort_unstable();
        report.read = readable.len();
        report.recomputed = recompute.len();

        let levels: HashMap<usize, Format> = metas.iter().map(|(i, m)| (*i, m.format)).collect();
        let mut bad = Vec::new();
        let mut installed = HashSet::new();
        if recompute.is_empty() {
            let (b, io_wait) = self.read_all(ctx, kv, region, &readable, &levels)?;
            installed.extend(readable.iter().map(|(i, _)| *i).filter(|i| !b.contains(i)));
            (bad, report.io_wait) = (b, io_wait);
        }

        // The rest is staged where the engine sees it during the load: chunks to recompute
        // (and the reads they attend to, in a mixed load), empty chunks, and records that
        // failed their checksum. Afterwards each staged chunk goes into its slot.
        let rest: Vec<usize> = missing.iter().copied().filter(|i| !installed.contains(i)).collect();
        let mut staging = self.stage(&rest)?;
        for &i in &rest {
            let f = if recompute.contains(&i) || bad.contains(&i) { base } else { levels[&i] };
            let (ptr, len) = self.stage_buf(staging.get_mut(&i).expect("staged"));
            // SAFETY: the staging buffer lives until the chunk is re-attached to its slot below.
            unsafe { kv.attach(i, ptr, len, f) }.map_err(engine)?;
        }
        if !recompute.is_empty() {
            // Reads in pieces of layers, so a recompute can start on layer l while later
            // layers are in flight.
            let bufs: Vec<*mut u8> = readable.iter().map(|(i, _)| self.stage_buf(staging.get_mut(i).expect("staged")).0.as_ptr()).collect();
            let mut reader = LayerReader::new(&self.store, ctx, &readable, &bufs, nl, PIECES)?;
            kv.recompute(&recompute, &mut |l| reader.step(l)).map_err(engine)?;
            let (ok, io_wait) = reader.finish()?;
            report.io_wait = io_wait;
            bad = readable.iter().zip(&ok).filter(|(_, ok)| !**ok).map(|((i, _), _)| *i).collect();
        }
        report.read_bytes = readable.iter().map(|(_, e)| u64::from(e.layer_len) * u64::from(e.meta.layers)).sum();

        // A read that failed its checksum is recomputed now, with every recomputed chunk
        // after it (they attended to the bad bytes).
        if let Some(&first) = bad.iter().min() {
            eprintln!("llms: context {ctx}: {} chunk record(s) failed their checksum; recomputing", bad.len());
            let mut redo: Vec<usize> = bad.iter().copied().chain(recompute.iter().copied().filter(|&i| i > first)).collect();
            redo.sort_unstable();
            redo.dedup();
            for &i in &redo {
                let (ptr, len) = self.stage_buf(staging.get_mut(&i).expect("staged"));
                // SAFETY: as above.
                unsafe { kv.attach(i, ptr, len, base) }.map_err(engine)?;
                self.store.invalidate(ctx, chunk_u32(i));
            }
            kv.recompute(&redo, &mut |_| {}).map_err(engine)?;
            report.unreadable += bad.len();
            report.read -= bad.len();
            report.recomputed += bad.len();
            recompute = redo;
        }
        // Recomputed chunks come back in the base format: lower them to their level.
        for &i in &recompute {
            if levels[&i] != base {
                kv.convert(i, levels[&i]).map_err(engine)?;
            }
        }
        for &i in &rest {
            let len = self.chunk_len(ctx, i);
            self.install(region, kv, staging.get_mut(&i).expect("staged"), i, levels[&i], len)?;
        }
        if dead > 0 && strategy == Strategy::AllRecompute {
            self.kill(ctx, region, kv, dead)?;
        }
        Ok(())
    }

    /// All-read: the records stream through the arena. Up to one arena of reads is in flight,
    /// each straight into a buffer (O_DIRECT: a record's payload is laid out as the chunk is
    /// in memory); as each lands its checksum is checked and it is copied into its slot while
    /// the later reads are in flight, and its buffer takes the next record. So a load of any
    /// size needs no more staging than the arena. Checking and copying cost ~85 us per
    /// 190 KB chunk (CRC32C ~15, UFFDIO_COPY into fresh pages ~70), about what the disk takes
    /// to deliver it: two lanes share the chunks (docs/mm.md "Speed"). Returns the chunks whose
    /// record failed its checksum (not installed) and the time spent waiting for reads.
    fn read_all(
        &mut self,
        ctx: u64,
        kv: &mut dyn KvContext,
        region: &Region,
        readable: &[(usize, Entry)],
        levels: &HashMap<usize, Format>,
    ) -> Result<(Vec<usize>, f64)> {
        if readable.is_empty() {
            return Ok((Vec::new(), 0.0));
        }
        let lens: Vec<usize> = readable.iter().map(|(i, _)| self.chunk_len(ctx, *i)).collect();
        kv.before_wait();
        let (ok, wait) = self.read_records(ctx, region, readable, &lens)?;
        let mut bad = Vec::new();
        for ((i, _), ok) in readable.iter().zip(ok) {
            if ok {
                let ptr = NonNull::new(region.slot_ptr(*i)).expect("mapped");
                // SAFETY: the slot is resident and stays so while pinned (begin pins it next).
                unsafe { kv.attach(*i, ptr, self.slot_size, levels[i]) }.map_err(engine)?;
            } else {
                bad.push(*i);
            }
        }
        Ok((bad, wait))
    }

    /// [`Manager::read_all`]'s reads: each record of `readable` (slot of `region`, its entry in
    /// `ctx`'s file: a context's, or the pool's, [`POOL_CTX`]) read, checked and copied into its
    /// slot (`lens` bytes), in two lanes. Whether each one was good, and the time this thread
    /// waited for the disk.
    fn read_records(&mut self, ctx: u64, region: &Region, readable: &[(usize, Entry)], lens: &[usize]) -> Result<(Vec<bool>, f64)> {
        let n = readable.len();
        if n == 0 {
            return Ok((Vec::new(), 0.0));
        }
        let ss = self.slot_size;
        let n_buf = self.arena.len() / ss;
        let store = &*self.store;
        let file = store.file(ctx)?;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&*file);
        let arena = SendPtr(self.arena.as_mut_slice().as_mut_ptr());
        // Two lanes (this thread and a helper), each with its own ring and its own half of the
        // arena, each taking every other chunk: read, wait, check, copy into the slot, and the
        // buffer takes the lane's next read at once. Lanes share nothing, so a buffer is never
        // left idle waiting for the other thread to notice it is free (one ring fed by both
        // threads resubmitted the helper's buffers late and ran at half the disk's speed).
        let n_lanes = if n > 1 && n_buf > 1 { 2 } else { 1 };
        let per_lane = n_buf / n_lanes;
        let lane = |l: usize, ring: &mut Ring| -> Result<LaneOut> {
            let mine: Vec<usize> = (l..n).step_by(n_lanes).collect();
            // The lane's j-th chunk lands in the lane's buffer j % per_lane.
            let buf_of = |j: usize| arena.at((l + n_lanes * (j % per_lane)) * ss);
            let read = |j: usize| {
                let (offset, len) = store.body_extent(&readable[mine[j]].1);
                (tag(j), Op { fd, offset, buf: buf_of(j), len: u32::try_from(len).unwrap_or(u32::MAX), write: false })
            };
            let in_flight = per_lane.min(mine.len());
            let first: Vec<(u32, Op)> = (0..in_flight).map(read).collect();
            // SAFETY: a buffer is touched only by this lane, not before its read is waited for,
            // and is given a new read only once its chunk was copied out; the arena outlives
            // the ring.
            unsafe { ring.submit_each(&first) }?;
            let (mut out, mut wait) = (Vec::with_capacity(mine.len()), 0.0);
            for (j, &k) in mine.iter().enumerate() {
                let t = Instant::now();
                ring.wait(tag(j)).map_err(MmError::Io)?;
                wait += t.elapsed().as_secs_f64();
                let (i, e) = &readable[k];
                let (_, body) = store.body_extent(e);
                // The slot takes whole pages; past the body the buffer holds an earlier chunk's
                // bytes, which `payload_ok` clears with the record's aligned tail.
                let end = body.max(lens[k].next_multiple_of(uffd_handler::PAGE)).min(ss);
                // SAFETY: the read into this buffer was waited for; only this lane uses it.
                let buf = unsafe { std::slice::from_raw_parts_mut(buf_of(j), end) };
                let good = payload_ok(buf, e.meta.layers as usize * e.layer_len as usize, e.payload_crc);
                if good {
                    region.copy_from(*i, buf, lens[k])?;
                }
                out.push((k, good));
                if j + per_lane < mine.len() {
                    // SAFETY: as above; chunk k was copied out of this buffer.
                    unsafe { ring.submit_each(&[read(j + per_lane)]) }?;
                }
            }
            Ok((out, wait))
        };
        let mut ok = vec![false; n];
        let mut wait = 0.0;
        let Lanes { rings: [r0, r1], helper } = &mut self.lanes;
        // Every way out of a lane, the ring waits for what is still in flight (an error or a
        // panic can leave reads queued): no read lands in the arena after this returns, and the
        // ring starts the next load empty.
        let run = |l: usize, ring: &mut Ring| {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lane(l, ring)))
                .unwrap_or_else(|_| Err(MmError::Engine(crate::EngineError::new("a load lane panicked"))));
            ring.drain();
            r
        };
        let lanes: Vec<Result<LaneOut>> = if n_lanes == 1 {
            vec![run(0, r0)]
        } else {
            let mut second = None;
            let first = helper.in_place_scope(|sc| {
                sc.spawn(|_| second = Some(run(1, r1)));
                run(0, r0)
            });
            vec![first, second.unwrap_or_else(|| Err(MmError::Engine(crate::EngineError::new("the load helper did not run"))))]
        };
        for (l, r) in lanes.into_iter().enumerate() {
            let (out, w) = r?;
            // This thread's lane: the time the caller itself sat waiting for the disk.
            if l == 0 {
                wait = w;
            }
            for (k, good) in out {
                ok[k] = good;
            }
        }
        Ok((ok, wait))
    }

    /// Staging for `chunks`, zeroed (an empty chunk is staged as zeros; a recomputed one
    /// leaves the positions past its tokens untouched): the arena's buffers first, then
    /// buffers of their own.
    fn stage(&mut self, chunks: &[usize]) -> Result<HashMap<usize, Stage>> {
        let ss = self.slot_size;
        let n_buf = self.arena.len() / ss;
        let mut out = HashMap::with_capacity(chunks.len());
        for (k, &i) in chunks.iter().enumerate() {
            let s = if k < n_buf {
                self.arena.as_mut_slice()[k * ss..(k + 1) * ss].fill(0);
                Stage::Arena(k * ss)
            } else {
                Stage::Own(Staging::new(ss)?)
            };
            out.insert(i, s);
        }
        Ok(out)
    }

    fn stage_buf(&mut self, s: &mut Stage) -> (NonNull<u8>, usize) {
        let buf = match s {
            Stage::Arena(off) => &mut self.arena.as_mut_slice()[*off..*off + self.slot_size],
            Stage::Own(s) => s.as_mut_slice(),
        };
        (NonNull::new(buf.as_mut_ptr()).expect("mapped"), buf.len())
    }

    /// Install: the staged chunk goes into its slot (copied from the arena, whose pages stay;
    /// moved from a buffer of its own), and the engine reads the slot.
    fn install(&mut self, region: &Region, kv: &mut dyn KvContext, staged: &mut Stage, i: usize, level: Format, len: usize) -> Result<()> {
        match staged {
            Stage::Arena(off) => region.copy_from(i, &self.arena.as_mut_slice()[*off..*off + self.slot_size], len)?,
            Stage::Own(s) => region.populate_from(i, s, len)?,
        }
        let ptr = NonNull::new(region.slot_ptr(i)).expect("mapped");
        // SAFETY: the slot is resident and stays so while pinned (begin pins it next).
        unsafe { kv.attach(i, ptr, self.slot_size, level) }.map_err(engine)
    }

    /// Makes room for `positions` positions: new chunks get slots (claimed from the budget,
    /// zero-filled, in the base format) and are attached to the engine's cache. Call it
    /// before `begin`, or during a call before the engine writes more positions.
    pub fn prepare(&mut self, ctx: u64, kv: &mut dyn KvContext, positions: usize) -> Result<()> {
        let ct = self.codec.chunk_tokens();
        let want = positions.div_ceil(ct);
        let region = Arc::clone(&self.ctx(ctx)?.region);
        if want > region.n_slots() {
            return Err(MmError::TooLong { ctx, need: want, max: region.n_slots() });
        }
        let base = kv.base();
        let len = self.codec.chunk_bytes(base);
        while kv.n_chunks() < want {
            let i = kv.n_chunks();
            self.reclaim_for(len)?;
            self.claim(&region, i, len)?;
            let ptr = NonNull::new(region.slot_ptr(i)).expect("mapped");
            // SAFETY: the slot is resident and pinned for the call.
            unsafe { kv.push_chunk(ptr, self.slot_size) }.map_err(engine)?;
            let c = self.ctxs.get_mut(&ctx).ok_or_else(|| MmError::NoContext(ctx))?;
            // Inside a call the new chunk joins the pinned working set (`end` unpins it);
            // before one, `begin` pins it with the rest. New chunks are not in LCTRU until
            // `end`, so reclaim cannot take them meanwhile.
            if c.in_call {
                region.pin(i)?;
            }
            c.chunks.push(ChunkMeta { level: base, tokens: 0, prefix_hash: 0, density: 0.0, dead: false, shared: None });
        }
        Ok(())
    }

    /// Populates a slot with zeros, from a ready zero buffer when there is one.
    fn claim(&mut self, region: &Region, i: usize, len: usize) -> Result<()> {
        if region.state(i)? == SlotState::Resident {
            region.discard(i)?;
        }
        let mut z = match self.zero.pop() {
            Some(z) => z,
            None => self.zero_buffer()?,
        };
        let r = region.populate_from(i, &mut z, len);
        // MOVE took its pages (COPY left them, zero): given back by `refill_zero`.
        self.zero_spent.push(z);
        Ok(r?)
    }

    /// Readies zero buffers for the next chunks' claims, up to [`zero_spares`].
    fn refill_zero(&mut self) -> Result<()> {
        while self.zero.len() < zero_spares(self.slot_size) {
            let z = self.zero_buffer()?;
            self.zero.push(z);
        }
        self.zero_spent.clear();
        Ok(())
    }

    /// A spent zero buffer (or a new one) with its pages in: zeros a MOVE can take.
    fn zero_buffer(&mut self) -> Result<Staging> {
        let mut z = match self.zero_spent.pop() {
            Some(z) => z,
            None => Staging::new(self.slot_size)?,
        };
        z.repopulate();
        Ok(z)
    }

    /// After a call: take over chunks the engine created, re-pick levels, unlock, write what
    /// changed (AoT), and bring memory back within the budget.
    pub fn end(&mut self, ctx: u64, kv: &mut dyn KvContext) -> Result<()> {
        let ct = self.codec.chunk_tokens();
        let region = Arc::clone(&self.ctx(ctx)?.region);
        let n = kv.n_chunks();
        if n > region.n_slots() {
            return Err(MmError::TooLong { ctx, need: n, max: region.n_slots() });
        }
        // Chunks the engine allocated itself (more tokens than prepared): copy into slots.
        let known = self.ctx(ctx)?.chunks.len();
        for i in known..n {
            let len = self.codec.chunk_bytes(kv.format(i));
            self.claim(&region, i, len)?;
            region.pin(i)?;
            let ptr = NonNull::new(region.slot_ptr(i)).expect("mapped");
            // SAFETY: resident and pinned.
            unsafe { kv.adopt(i, ptr, self.slot_size) }.map_err(engine)?;
            let f = kv.format(i);
            self.ctxs.get_mut(&ctx).ok_or_else(|| MmError::NoContext(ctx))?.chunks.push(ChunkMeta {
                level: f,
                tokens: 0,
                prefix_hash: 0,
                density: 0.0,
                dead: false,
                shared: None,
            });
        }
        let hashes = prefix_hashes(kv.tokens(), ct);
        let n_tok = kv.tokens().len();
        // What the call moved out of the window is given back now, before the chunks are
        // re-levelled and written: a chunk that died unwritten is written with its kept
        // layers only. (A call's own truncations are done by now; a context rolled back to
        // fewer tokens after this finds its revived chunks' records short and recomputes.)
        // Chunks that died stay dead when the context is cut back (a rollback of a few
        // tokens): their other layers are gone, and the engine keeps them dead too.
        let already = self.ctx(ctx)?.chunks.iter().take_while(|m| m.dead).count();
        let dead = self.codec.dead_chunks(n_tok).min(n).max(already);
        self.kill(ctx, &region, kv, dead)?;
        let dens = kv.densities();
        // Re-level (eq. 2-3) the full chunks; only changed, resident chunks are re-encoded.
        let mut targets: Vec<Option<Format>> = vec![None; n];
        if self.cfg.policy == Policy::Llms && self.cfg.levels.len() > 1 {
            if let Some(d) = &dens {
                let full = (n_tok / ct).min(n);
                let sizes: Vec<f64> = self.cfg.levels.iter().map(|&f| self.codec.chunk_bytes(f) as f64).collect();
                let losses: Vec<f64> = self.cfg.levels.iter().map(|&f| loss_of_bits(self.codec.bits(f))).collect();
                // Per layer group: dead chunks (their kept layers) and live ones (every layer)
                // are levelled apart, each at the ratio, so the bytes meet it whatever the mix
                // of the two (a dead chunk's bytes are a fraction of a live one's).
                for group in [0..dead.min(full), dead.min(full)..full] {
                    let dd: Vec<f64> = group.clone().map(|i| d.get(i).copied().unwrap_or(0.0)).collect();
                    // Levels only go down (below): the choice spends no budget on raising a chunk.
                    let held: Vec<usize> =
                        group.clone().map(|i| self.cfg.levels.iter().position(|&f| f == kv.format(i)).unwrap_or(0)).collect();
                    for (i, l) in group.zip(choose_levels_held(&dd, &held, &sizes, &losses, self.cfg.ratio)) {
                        targets[i] = Some(self.cfg.levels[l]);
                    }
                }
            }
        } else if self.cfg.policy == Policy::VllmSq {
            let full = (n_tok / ct).min(n);
            for t in targets.iter_mut().take(full) {
                *t = self.cfg.levels.first().copied();
            }
        }
        let mut writes = Vec::new();
        let epoch = self.ctx(ctx)?.epoch;
        self.levelling.retain(|j| j.ctx != ctx);
        // Its shared chunks leave the call first: a level they may take now needs every
        // sharer out of its call.
        let shared: Vec<(usize, u32)> = self.ctx(ctx)?.chunks.iter().enumerate().filter_map(|(i, m)| m.shared.map(|p| (i, p))).collect();
        for &(_, p) in &shared {
            self.leave_call(p)?;
        }
        for (i, target) in targets.iter().enumerate() {
            if let Some(&(_, p)) = shared.iter().find(|(j, _)| *j == i) {
                self.end_shared(ctx, kv, i, p, *target, dens.as_ref().and_then(|d| d.get(i).copied()), i < dead)?;
                continue;
            }
            let cur = kv.format(i);
            let mut queued = false;
            if let Some(t) = *target {
                // Levels only go down: a lowered chunk has lost its bits, raising it would
                // cost pages and bring nothing back.
                if self.codec.chunk_bytes(t) < self.codec.chunk_bytes(cur) && region.state(i)? == SlotState::Resident {
                    if self.background_levels {
                        // Written once it is lowered (`finish_level_work`), not twice.
                        self.levelling.push_back(LevelJob { ctx, chunk: i, from: cur, to: t, epoch });
                        queued = true;
                    } else {
                        if let Some(w) = &self.writer {
                            w.wait_chunk((ctx, chunk_u32(i)));
                        }
                        kv.convert(i, t).map_err(engine)?;
                        region.shrink(i, self.codec.live_bytes(t, i < dead))?;
                        self.stats.releveled += 1;
                    }
                }
            }
            let level = kv.format(i);
            let tokens = u32::try_from(n_tok.saturating_sub(i * ct).min(ct)).unwrap_or(u32::MAX);
            let m = ChunkMeta {
                level,
                tokens,
                prefix_hash: hashes.get(i).copied().unwrap_or(0),
                density: dens.as_ref().and_then(|d| d.get(i).copied()).unwrap_or(0.0),
                dead: i < dead,
                shared: None,
            };
            self.ctxs.get_mut(&ctx).ok_or_else(|| MmError::NoContext(ctx))?.chunks[i] = m;
            let meta = self.meta(ctx, i, &m);
            self.expected.lock().unwrap_or_else(|e| e.into_inner()).insert((ctx, chunk_u32(i)), meta);
            if m.tokens > 0 && !queued && !self.store.matches(&meta) && region.state(i)? == SlotState::Resident {
                writes.push((i, meta));
            }
        }
        // AoT swap-out: the writer pins what it writes; the call's pins go now.
        for (i, meta) in &writes {
            self.write_aot(ctx, &region, *i, meta)?;
        }
        for i in 0..n {
            if shared.iter().any(|(j, _)| *j == i) {
                continue;
            }
            region.unpin(i)?;
            if region.state(i)? == SlotState::Resident {
                let lvl = self.level_index(kv.format(i));
                self.lctru.touch((ctx, chunk_u32(i)), lvl);
            }
        }
        self.ctxs.get_mut(&ctx).ok_or_else(|| MmError::NoContext(ctx))?.in_call = false;
        self.index_own(ctx, kv.tokens());
        self.reclaim()?;
        self.refill_zero()
    }

    /// Hands an AoT write of chunk `i` (resident, `meta` its version) to the writer, which pins
    /// it until written; nothing without a writer.
    fn write_aot(&mut self, ctx: u64, region: &Arc<Region>, i: usize, meta: &RecordMeta) -> Result<()> {
        let len = self.chunk_len(ctx, i);
        self.write_aot_len(ctx, region, i, meta, len)
    }

    /// [`Manager::write_aot`] of `len` bytes of slot `i` of `region` (a context's or the pool's).
    fn write_aot_len(&mut self, ctx: u64, region: &Arc<Region>, i: usize, meta: &RecordMeta, len: usize) -> Result<()> {
        self.write_aot_replacing(ctx, region, i, meta, len, None)
    }

    /// [`Manager::write_aot_len`], and once written the record `replaces` names is discarded
    /// (at once when there is no writer).
    fn write_aot_replacing(
        &mut self,
        ctx: u64,
        region: &Arc<Region>,
        i: usize,
        meta: &RecordMeta,
        len: usize,
        replaces: Option<ChunkId>,
    ) -> Result<()> {
        let Some(w) = &self.writer else {
            if let Some((c, k)) = replaces {
                self.store.discard(c, k);
            }
            return Ok(());
        };
        region.pin(i)?;
        let job = WriteJob { region: Arc::clone(region), slot: i, meta: *meta, len, replaces };
        match &mut self.held_jobs {
            // Counted pending when released, all under one lock.
            Some(held) => held.push(job),
            None => {
                *w.pending.0.lock().unwrap_or_else(|e| e.into_inner()).entry((ctx, meta.chunk)).or_insert(0) += 1;
                self.send_aot(vec![job]);
            }
        }
        Ok(())
    }

    /// Sends jobs (counted pending) to the writer: unpins them and counts them done if it
    /// is gone.
    fn send_aot(&mut self, jobs: Vec<WriteJob>) {
        let Some(w) = &self.writer else { return };
        let n = jobs.len() as u64;
        let sent = match &w.tx {
            Some(tx) => tx.send(jobs),
            None => Err(mpsc::SendError(jobs)),
        };
        if let Err(mpsc::SendError(jobs)) = sent {
            for j in &jobs {
                let _ = j.region.unpin(j.slot);
            }
            let ids: Vec<ChunkId> = jobs.iter().map(|j| (j.meta.context, j.meta.chunk)).collect();
            finish(&w.pending, &ids);
        } else {
            self.stats.written_aot += n;
        }
    }

    /// While on, chunks queued for the AoT writer (pinned) are not sent to it; turning it
    /// off counts them pending and sends them. Nothing may wait for the writer, or ask
    /// whether a chunk is pending, meanwhile (a fork's promotions, under mm's lock).
    pub(crate) fn hold_aot(&mut self, hold: bool) {
        if hold {
            self.held_jobs.get_or_insert_with(Vec::new);
            return;
        }
        let jobs = self.held_jobs.take().unwrap_or_default();
        let Some(w) = &self.writer else { return };
        {
            let mut g = w.pending.0.lock().unwrap_or_else(|e| e.into_inner());
            for j in &jobs {
                *g.entry((j.meta.context, j.meta.chunk)).or_insert(0) += 1;
            }
        }
        if !jobs.is_empty() {
            self.send_aot(jobs);
        }
    }

    /// Lowers chunks' levels on another thread than the calls': `end` queues each lowering it
    /// chooses instead of encoding it, and a leveller takes them ([`Manager::take_level_work`],
    /// [`LevelWork::encode`] outside the lock, [`Manager::finish_level_work`]); until then the
    /// chunk stays at its level, resident, and is written once lowered. Needs a codec that
    /// converts by itself ([`Codec::convert`]).
    pub fn set_background_levels(&mut self, on: bool) {
        self.background_levels = on;
        if !on {
            self.levelling.clear();
        }
    }

    /// Lowerings queued for the leveller (some may turn out stale) or being encoded by it.
    pub fn level_jobs(&self) -> usize {
        self.levelling.len() + self.levelling_taken
    }

    /// The next queued lowering still valid, with a copy of its chunk's bytes.
    pub fn take_level_work(&mut self) -> Option<LevelWork> {
        while let Some(job) = self.levelling.pop_front() {
            if let Some(w) = self.take_job(job) {
                self.levelling_taken += 1;
                return Some(w);
            }
        }
        None
    }

    /// `job` with a copy of its chunk's bytes, if it is still valid.
    fn take_job(&self, job: LevelJob) -> Option<LevelWork> {
        let (m, region, slot) = self.valid(&job)?;
        let len = self.codec.live_bytes(job.from, m.dead);
        // SAFETY: resident (checked), not in a call: nothing writes it while we copy.
        let src = unsafe { std::slice::from_raw_parts(region.slot_ptr(slot), len) }.to_vec();
        Some(LevelWork { job, dead: m.dead, tokens: m.tokens as usize, src })
    }

    /// The chunk a queued lowering is for, its region and slot, if it is still the chunk the
    /// job saw: same context and epoch, not in a call, resident, at `from`. A pool chunk's job
    /// ([`POOL_CTX`]): no sharer in a call since it was queued (its slot may be its home's).
    fn valid(&self, job: &LevelJob) -> Option<(ChunkMeta, &Arc<Region>, usize)> {
        let (m, region, slot) = if job.ctx == POOL_CTX {
            let pool = self.pool.as_ref()?;
            let p = chunk_u32(job.chunk);
            let e = pool.get(p).filter(|e| e.epoch == job.epoch && e.calls == 0)?;
            let tokens = chunk_u32(self.codec.chunk_tokens());
            let m = ChunkMeta { level: e.level, tokens, prefix_hash: e.prefix_hash, density: e.density, dead: false, shared: None };
            let (region, slot) = pool.loc(p);
            (m, region, slot)
        } else {
            let c = self.ctxs.get(&job.ctx).filter(|c| c.epoch == job.epoch && !c.in_call)?;
            (c.chunks.get(job.chunk).copied().filter(|m| m.shared.is_none())?, &c.region, job.chunk)
        };
        let busy = self.writer.as_ref().is_some_and(|w| w.is_pending((job.ctx, chunk_u32(job.chunk))));
        (m.level == job.from && region.state(slot).ok()? == SlotState::Resident && !busy).then_some((m, region, slot))
    }

    /// Installs a lowering encoded from [`Manager::take_level_work`]'s copy (`lowered`: what
    /// the encoder made, or why it failed), if its chunk is still the one copied: the bytes go
    /// into the slot, its tail pages back to the kernel, and the chunk is written (AoT).
    /// False when it was stale (nothing changed) or the encoder failed (the chunk is written
    /// at its level and stays there).
    pub fn finish_level_work(&mut self, w: LevelWork, lowered: std::result::Result<Vec<u8>, crate::EngineError>) -> Result<bool> {
        let job = w.job;
        self.levelling_taken = self.levelling_taken.saturating_sub(1);
        let Some((mut m, region, slot)) = self.valid(&job).filter(|(m, _, _)| m.dead == w.dead) else { return Ok(false) };
        let region = Arc::clone(region);
        let len = self.codec.live_bytes(job.to, m.dead);
        let done = match lowered {
            Ok(bytes) if bytes.len() == len => {
                // SAFETY: the slot is resident and not in a call (checked under this lock,
                // which every call path takes); `len` is within the slot.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), region.slot_ptr(slot), len) };
                region.shrink(slot, len)?;
                m.level = job.to;
                if job.ctx == POOL_CTX {
                    // Its sharers' engines learn the level at their next `begin`.
                    self.pool.as_mut().and_then(|p| p.get_mut(chunk_u32(job.chunk))).expect("valid").level = job.to;
                } else {
                    self.ctxs.get_mut(&job.ctx).ok_or_else(|| MmError::NoContext(job.ctx))?.chunks[job.chunk] = m;
                }
                self.lctru.set_level((job.ctx, chunk_u32(job.chunk)), self.level_index(job.to));
                self.stats.releveled += 1;
                true
            }
            Ok(bytes) => {
                eprintln!(
                    "llms: context {} chunk {}: the encoder made {} bytes, not {len}; the chunk stays at its level",
                    job.ctx,
                    job.chunk,
                    bytes.len()
                );
                false
            }
            Err(e) => {
                eprintln!("llms: context {} chunk {}: lowering failed ({e}); the chunk stays at its level", job.ctx, job.chunk);
                false
            }
        };
        let meta =
            if job.ctx == POOL_CTX { self.pool_meta(chunk_u32(job.chunk)).expect("valid") } else { self.meta(job.ctx, job.chunk, &m) };
        self.expected.lock().unwrap_or_else(|e| e.into_inner()).insert((job.ctx, chunk_u32(job.chunk)), meta);
        if m.tokens > 0 && !self.store.matches(&meta) {
            self.write_aot_len(job.ctx, &region, slot, &meta, self.codec.live_bytes(m.level, m.dead))?;
        }
        Ok(done)
    }

    /// Does every queued lowering now, on this thread (a service stopping: its chunks are
    /// then written at their levels).
    pub fn finish_levelling(&mut self) -> Result<()> {
        while let Some(w) = self.take_level_work() {
            let lowered = w.encode(&*self.codec);
            self.finish_level_work(w, lowered)?;
        }
        Ok(())
    }

    /// Chunks the AoT writer has yet to write.
    pub fn pending_writes(&self) -> usize {
        self.writer.as_ref().map_or(0, |w| w.pending.0.lock().unwrap_or_else(|e| e.into_inner()).len())
    }

    /// Chunk write batches (AoT, or one chunk at reclaim) that failed so far, and the last
    /// error (empty when none did).
    pub fn write_failures(&self) -> (u64, String) {
        self.write_failures.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A gate the caller marks while it runs a forward pass ([`PassGate::pass`]): the AoT
    /// writer holds its next copy or write until the pass ends (at most 100 ms a batch), so
    /// its work falls between passes. None without a writer.
    pub fn passes_running(&self) -> Option<Arc<PassGate>> {
        self.writer.as_ref().map(|w| Arc::clone(&w.passes))
    }

    /// Waits until every AoT write is on flash (or failed: see [`Manager::write_failures`]).
    pub fn flush(&self) {
        if let Some(w) = &self.writer {
            w.wait_idle();
        }
    }

    /// Brings resident memory within the budget; returns the bytes freed.
    pub fn reclaim(&mut self) -> Result<usize> {
        self.reclaim_for(0)
    }

    /// Frees memory until `extra` more bytes fit in the budget (pinned chunks and chunks
    /// being written are skipped; if only those are left, the budget is exceeded by them).
    fn reclaim_for(&mut self, extra: usize) -> Result<usize> {
        let mut freed = 0;
        let mut waited = false;
        while self.resident_bytes() + extra > self.cfg.budget {
            // A lowering the leveller has yet to do frees memory with no write and no read
            // later: do it here first. Evicting instead (as when the leveller lagged behind
            // back-to-back calls) took chunks that were about to shrink, and the next switches
            // read them back: Fig. 9's llms read 162 chunks where lowering in `end` read 31.
            // Not for a switch-in (`extra`): the encoder on the switch path costs more than
            // the reads it saves there (22 ms a switch against 0.6).
            if let Some(w) = if extra == 0 { self.take_level_work() } else { None } {
                let lowered = w.encode(&*self.codec);
                self.finish_level_work(w, lowered)?;
                continue;
            }
            let ctxs = &self.ctxs;
            let writer = &self.writer;
            let pool = &self.pool;
            let busy = |c: ChunkId| match c.0 {
                // A pool chunk is pinned while any of its sharers is in a call.
                POOL_CTX => pool.as_ref().and_then(|p| p.get(c.1)).is_none_or(|e| e.calls > 0),
                _ => ctxs.get(&c.0).is_none_or(|x| x.in_call),
            };
            let pinned = |c: ChunkId| busy(c) || writer.as_ref().is_some_and(|w| w.is_pending(c));
            match self.lctru.pop_victim(&pinned) {
                Some(v) => freed += self.evict(v)?,
                None if !waited
                    && self.writer.as_ref().is_some_and(|w| !w.pending.0.lock().unwrap_or_else(|e| e.into_inner()).is_empty()) =>
                {
                    self.flush();
                    waited = true;
                }
                None => break,
            }
        }
        Ok(freed)
    }

    /// Evicts a victim as the policy says; returns the bytes freed.
    fn evict(&mut self, v: ChunkId) -> Result<usize> {
        let (ctx, _) = v;
        if ctx == POOL_CTX {
            let pool = self.pool.as_ref().expect("pool chunks come from the pool");
            let (region, slot) = pool.loc(v.1);
            let (region, slot) = (Arc::clone(region), slot);
            let before = region.resident_bytes();
            let meta = self.pool_meta(v.1).expect("a live pool chunk");
            self.save_and_evict_as(&region, slot, &meta, self.codec.live_bytes(meta.format, false))?;
            let freed = before.saturating_sub(region.resident_bytes());
            self.stats.evicted_bytes += freed as u64;
            let _ = self.left_home(v.1);
            return Ok(freed);
        }
        let region = Arc::clone(&self.ctx(ctx)?.region);
        let before = region.resident_bytes();
        match self.cfg.policy {
            Policy::Lmk => {
                let n = self.ctx(ctx)?.chunks.len();
                for i in 0..n {
                    if self.ctx(ctx)?.chunks[i].shared.is_some() {
                        // The pool's (others may hold it, and it may be at home in this slot).
                        continue;
                    }
                    region.discard(i)?;
                    self.lctru.remove((ctx, chunk_u32(i)));
                }
                self.stats.killed_contexts += 1;
            }
            Policy::Swap => {
                let n = self.ctx(ctx)?.chunks.len();
                for i in 0..n {
                    if region.state(i)? == SlotState::Resident {
                        self.save_and_evict(ctx, &region, i)?;
                    }
                    self.lctru.remove((ctx, chunk_u32(i)));
                }
            }
            _ => self.save_and_evict(ctx, &region, v.1 as usize)?,
        }
        let freed = before.saturating_sub(region.resident_bytes());
        self.stats.evicted_bytes += freed as u64;
        Ok(freed)
    }

    /// Writes a chunk out if the store lacks this version, then drops its pages.
    fn save_and_evict(&mut self, ctx: u64, region: &Region, i: usize) -> Result<()> {
        let m = self.ctx(ctx)?.chunks[i];
        if m.shared.is_some() {
            // The pool's: its own slot holds nothing.
            return Ok(());
        }
        let meta = self.meta(ctx, i, &m);
        self.save_and_evict_as(region, i, &meta, self.codec.live_bytes(m.level, m.dead))
    }

    /// [`Manager::save_and_evict`] of slot `i` of `region` holding the chunk `meta` names
    /// (`len` bytes).
    fn save_and_evict_as(&mut self, region: &Region, i: usize, meta: &RecordMeta, len: usize) -> Result<()> {
        let meta = *meta;
        if meta.tokens > 0 && !self.store.matches(&meta) {
            region.clean(i)?;
            // SAFETY: resident (checked by the caller) and not in a call: nothing writes it.
            let bytes = unsafe { std::slice::from_raw_parts(region.slot_ptr(i), len) };
            match self.store.write_batch(&mut self.ring, &[(meta, bytes)]) {
                Ok(()) => self.stats.written_sync += 1,
                // The store cannot take it (a full disk, a failing device): the chunk goes
                // anyway and its next load recomputes it from its context's tokens (no record
                // matches it). Holding it instead would let a full disk push the service past
                // its budget — the integrator's bound, and memory the pressure monitor may be
                // giving back to the system — and fail every call that needs room.
                Err(e) => {
                    note_failure(&self.write_failures, &e);
                    self.stats.dropped_unsaved += 1;
                }
            }
        } else {
            region.clean(i)?;
        }
        region.evict(i)?;
        self.stats.evicted_chunks += 1;
        Ok(())
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        // The writer holds regions: stop it before they go.
        self.writer.take();
    }
}

fn chunk_u32(i: usize) -> u32 {
    u32::try_from(i).expect("chunk index fits u32")
}

/// A mixed load's reads: the read set straight into its staging buffers (O_DIRECT: the
/// record payload is laid out as the chunk is in memory and staging is page-aligned), each
/// record in `PIECES` aligned pieces, every piece in flight from the start; before layer `l`
/// is computed, the pieces holding layer `l` of every chunk must be in.
struct LayerReader {
    ring: Ring,
    /// Per read chunk: its payload length, layer length and CRC.
    payload: Vec<(usize, usize, u32)>,
    /// Per read chunk, the end (payload-relative byte) of each piece.
    ends: Vec<Vec<usize>>,
    stage: Vec<*mut u8>,
    /// Pieces waited for (all chunks' piece j share tag j).
    waited: usize,
    n_pieces: usize,
    nl: usize,
    next: usize,
    io_wait: f64,
    error: Option<std::io::Error>,
}

const PIECES: usize = 6;

/// Zero buffers kept ready for new chunks (`Manager::zero`): four (a 64-token turn's chunks)
/// within 4 MiB, at least one (a slot of Llama 2 7B's shape is 8 MiB in f16). Memory the
/// service holds beyond the KV budget, as the arena.
fn zero_spares(slot_size: usize) -> usize {
    ((4 << 20) / slot_size.max(1)).clamp(1, 4)
}

/// The load staging arena (see `Manager::arena`): 42 chunks of the default model at int8.
const ARENA_BYTES: usize = 8 << 20;
/// The largest arena [`Manager::set_load_staging`] takes.
const MAX_ARENA_BYTES: usize = 1 << 30;

impl LayerReader {
    /// Submits the reads of `readable`, chunk k into `bufs[k]` (a slot-sized buffer each).
    fn new(store: &Store, ctx: u64, readable: &[(usize, Entry)], bufs: &[*mut u8], nl: usize, pieces: usize) -> Result<Self> {
        let file = if readable.is_empty() { None } else { Some(store.file(ctx)?) };
        let fd = file.as_ref().map_or(-1, |f| std::os::fd::AsRawFd::as_raw_fd(&**f));
        let align = store.align();
        let n_pieces = pieces.min(nl).max(1);
        let mut ring = Ring::new(u32::try_from(n_pieces * readable.len() + 8).unwrap_or(u32::MAX))?;
        let mut ends = Vec::with_capacity(readable.len());
        let mut per_piece: Vec<Vec<Op>> = vec![Vec::new(); n_pieces];
        for ((_, e), &dst) in readable.iter().zip(bufs) {
            let (off, body) = store.body_extent(e);
            let mut cuts: Vec<usize> = (0..=n_pieces).map(|j| (body * j / n_pieces) / align * align).collect();
            cuts[n_pieces] = body;
            for j in 0..n_pieces {
                let (a, b) = (cuts[j], cuts[j + 1]);
                if b > a {
                    // SAFETY: b <= the aligned payload length <= the staging buffer (a slot).
                    let buf = unsafe { dst.add(a) };
                    per_piece[j].push(Op { fd, offset: off + a as u64, buf, len: u32::try_from(b - a).unwrap_or(u32::MAX), write: false });
                }
            }
            ends.push(cuts[1..].to_vec());
        }
        for (j, ops) in per_piece.iter().enumerate().filter(|(_, o)| !o.is_empty()) {
            // SAFETY: the staging buffers are not touched by us until their piece is waited
            // for, and outlive the reader.
            unsafe { ring.submit(tag(j), ops) }?;
        }
        Ok(Self {
            ring,
            payload: readable
                .iter()
                .map(|(_, e)| (e.meta.layers as usize * e.layer_len as usize, e.layer_len as usize, e.payload_crc))
                .collect(),
            ends,
            stage: bufs.to_vec(),
            waited: 0,
            n_pieces,
            nl,
            next: if readable.is_empty() { nl } else { 0 },
            io_wait: 0.0,
            error: None,
        })
    }

    /// Before layer `l` is computed: its bytes must be in. Repeated calls (the engine runs
    /// the layers again for a second batch of positions) are no-ops.
    fn step(&mut self, l: usize) {
        if l != self.next || self.next >= self.nl || self.error.is_some() {
            return;
        }
        // The last piece any chunk needs for layer l.
        let need = self
            .payload
            .iter()
            .zip(&self.ends)
            .map(|(&(_, ll, _), ends)| ends.iter().position(|&end| end >= (l + 1) * ll).unwrap_or(self.n_pieces - 1))
            .max()
            .unwrap_or(0);
        let t = Instant::now();
        while self.waited <= need && self.error.is_none() {
            if let Err(e) = self.ring.wait(tag(self.waited)) {
                self.error = Some(e);
            }
            self.waited += 1;
        }
        self.io_wait += t.elapsed().as_secs_f64();
        self.next += 1;
    }

    /// Waits for the rest; returns whether each chunk's payload holds its CRC, and the wait.
    fn finish(mut self) -> Result<(Vec<bool>, f64)> {
        while self.next < self.nl && self.error.is_none() {
            self.step(self.next);
        }
        while self.waited < self.n_pieces {
            if let Err(e) = self.ring.wait(tag(self.waited)) {
                self.error.get_or_insert(e);
            }
            self.waited += 1;
        }
        if let Some(e) = self.error.take() {
            return Err(MmError::Io(e));
        }
        let ok = (0..self.payload.len())
            .map(|k| {
                let (len, _, crc) = self.payload[k];
                let end = *self.ends[k].last().unwrap_or(&len);
                // SAFETY: the staging buffer holds the read payload (and its aligned tail), all
                // waited for, and nothing else uses it until the chunk is installed.
                payload_ok(unsafe { std::slice::from_raw_parts_mut(self.stage[k], end) }, len, crc)
            })
            .collect();
        Ok((ok, self.io_wait))
    }
}

/// Whether a record body read into `body` holds its CRC over the first `len` bytes; clears
/// the aligned tail past them (whatever followed the record on disk).
fn payload_ok(body: &mut [u8], len: usize, crc: u32) -> bool {
    let len = len.min(body.len());
    body[len..].fill(0);
    crc32c::crc32c(&body[..len]) == crc
}

/// What a load lane did: each of its chunks with whether it checked out, and how long the
/// lane waited for the disk.
type LaneOut = (Vec<(usize, bool)>, f64);

/// The arena's base, shared by the load lanes (each touches only its own buffers).
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
impl SendPtr {
    /// The address `off` bytes in (a method, so closures capture the whole `Send` value).
    fn at(self, off: usize) -> *mut u8 {
        self.0.wrapping_add(off)
    }
}
// SAFETY: see `Manager::read_all`: each buffer is used by one thread at a time.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

/// Where a chunk is staged during a load: a buffer of the arena (copied into its slot) or,
/// past the arena, a buffer of its own (its pages moved into the slot).
enum Stage {
    Arena(usize),
    Own(Staging),
}

fn tag(l: usize) -> u32 {
    u32::try_from(l).expect("layer index fits u32")
}

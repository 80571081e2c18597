//! llmsd: the LLM system service. One model, many persistent contexts owned by apps, their KV
//! caches held by mm under a memory budget that follows the kernel's pressure signals.
//!
//! Threads: one per connection (frames in, events out), one inference worker (a scheduler:
//! the calls it admits, FIFO, share each forward pass of the shared model), the pressure monitor and its budget follower, and mm's
//! own (AoT writer, userfaultfd handler). Locks: the context registry, then mm — never the other
//! way round; neither is held while the model computes.
//!
//! The rooms: `call.rs` the call path (queue, worker, load -> infer -> end), `registry.rs` the
//! contexts and their persistence, `conn.rs` the native protocol's connections, `pressure.rs` the
//! budget following the pressure monitor, `turns.rs` the chat template's turn pieces. This file
//! holds the service's state, its start and its stop. A future front door (HTTP) is another
//! room beside `conn` that ends in the same `Service::submit`: `http/` (the OpenAI-compatible
//! API and `/metrics`), with `history.rs` choosing the context a stateless client continues
//! and `metrics.rs` what Prometheus scrapes.

mod call;
mod conn;
mod ctxfile;
mod history;
mod http;
mod leveller;
mod metrics;
mod pressure;
mod registry;
mod slots;
mod state_dir;
mod syncer;
mod turns;

use std::collections::{HashMap, VecDeque};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use engine::kv::KvFormat;
use engine::model::SessionOptions;
use engine::{Model, Session, ThreadPool};
use mm::{Manager, Policy};
use serde::{Deserialize, Serialize};
use tracing::info;

use crate::config::Config;
use crate::kvmm::EngineRecompute;
use crate::proto::{ErrorCode, Event};
use call::Job;
pub use call::StepTrace;
pub use ctxfile::{check_context_file, check_shared, check_state_dir, ContextCheck, SharedCheck};
pub use http::{Listeners as HttpListeners, NETWORK_UID};
use registry::CtxEntry;
use turns::Turns;

/// Who owns a context: the kernel's uid of the peer and the app name it bound with.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Owner {
    pub uid: u32,
    pub app: String,
}

impl Owner {
    /// The owner's sharing scope in mm ([`Service::scope`] keeps it once computed).
    pub(crate) fn scope(&self) -> u64 {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(b"llms-scope\0");
        h.update(self.uid.to_le_bytes());
        h.update(self.app.as_bytes());
        // Never mm's PUBLIC_SCOPE (0), the scope of the integrator's public prefixes.
        u64::from_le_bytes(h.finalize()[..8].try_into().expect("8 bytes")).max(1)
    }

    /// Whether `other` counts in the same per-uid limits as this owner (contexts, text, disk,
    /// queue places, batch share): the same uid — and on TCP, where every peer is
    /// [`NETWORK_UID`], the same app too (one token's app must not use up another's).
    pub(crate) fn shares_quota(&self, other: &Owner) -> bool {
        self.uid == other.uid && (self.uid != NETWORK_UID || self.app == other.app)
    }

    /// Who the per-uid limits name in a refusal.
    pub(crate) fn quota_name(&self) -> String {
        if self.uid == NETWORK_UID {
            format!("app {} (TCP)", crate::proto::quote(&self.app))
        } else {
            format!("uid {}", self.uid)
        }
    }
}

/// An error for the client: a code and a message.
#[derive(Debug)]
struct Refusal(ErrorCode, String);

impl From<Refusal> for Event {
    fn from(r: Refusal) -> Self {
        Event::error(r.0, r.1)
    }
}

fn refuse(code: ErrorCode, msg: impl Into<String>) -> Refusal {
    Refusal(code, msg.into())
}

impl Service {
    /// The chat turns, or the refusal a base model gives a chat call.
    fn turns(&self) -> Result<&Turns, Refusal> {
        self.turns.as_ref().map_err(|why| refuse(ErrorCode::BadRequest, why.clone()))
    }
}

fn not_found(ctx: &str) -> Refusal {
    refuse(ErrorCode::NotFound, format!("no context {} for this app", crate::proto::quote(ctx)))
}

#[derive(Default)]
struct Metrics {
    calls: u64,
    /// Times the first call in line waited for memory (see `call.rs`, `admit`).
    memory_waits: u64,
    /// Calls the prefill lane started beside a pass in flight (call.rs, `LaneGate`).
    lane_starts: u64,
    /// Recent switch latencies, ms.
    switch_ms: VecDeque<f64>,
    /// The last fork's time in mm (sharing its chunks) and writing its context file, ms.
    last_fork_ms: (f64, f64),
}

/// The running service.
pub struct Service {
    cfg: Config,
    model: Arc<Model>,
    pool: Arc<ThreadPool>,
    /// `prefill_lane`: the pools a step splits the threads into, the decoding calls' and a
    /// joining prompt's (call.rs, `Service::step`).
    lanes: Option<call::Lanes>,
    /// The chat template's turn pieces; `Err` (why) for a base model, which serves raw
    /// completions only.
    turns: std::result::Result<Turns, String>,
    mm: Mutex<Manager>,
    /// Marked by the worker while it runs a forward pass: mm's AoT writer waits for the gaps
    /// (`mm::Manager::passes_running`; none without the writer).
    passes: Option<Arc<mm::gate::PassGate>>,
    /// Where the worker hands answers that wait for their context file's sync (syncer.rs).
    sync: syncer::Syncer,
    /// The worker's per-step timeline, while tracing is on ([`Service::set_trace`]).
    trace: Mutex<Option<call::Trace>>,
    /// Set (and signalled) when a call's end may have queued chunk lowerings (`leveller.rs`).
    leveller: (Mutex<bool>, Condvar),
    /// The fault path's recompute: it learns each context's tokens after every call.
    refill: Arc<EngineRecompute>,
    registry: Mutex<HashMap<String, CtxEntry>>,
    /// Each owner's sharing scope in mm (see [`Service::scope`]), computed once.
    scopes: Mutex<HashMap<Owner, u64>>,
    queue: Mutex<VecDeque<Job>>,
    queued: Condvar,
    stopping: AtomicBool,
    /// Open connections per holder (a uid, or an app on TCP).
    connections: Mutex<HashMap<slots::Holder, usize>>,
    metrics: Mutex<Metrics>,
    /// What Prometheus scrapes (`GET /metrics`).
    prom: metrics::Prom,
    pressure: Mutex<String>,
    budget: usize,
    /// Paged weights and their share of `budget` as configured (the rest is mm's).
    weights: Option<Arc<crate::weights::PagedWeights>>,
    weights_share: usize,
    /// Top-K sparsity every session computes with (a weight plan chose it), if any.
    sparsity: Option<Arc<engine::sparsity::Sparsity>>,
    ctx_dir: PathBuf,
    /// The state directory's lock ([`state_dir::claim`]), held until `serve` returns: a
    /// service stopped in a process that goes on (the benches restart one over the same
    /// state) gives the directory up then, whoever still holds an `Arc` of it.
    state_lock: Mutex<Option<std::fs::File>>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").field("socket", &self.cfg.socket).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl Service {
    /// Loads the model, opens the store and restores the contexts it holds.
    pub fn open(mut cfg: Config) -> Result<Arc<Self>> {
        cfg.validate()?;
        cfg.model = crate::model_file(&cfg.model);
        if cfg.model.is_dir() {
            bail!("model {} is a directory, not a GGUF file", cfg.model.display());
        }
        if !cfg.model.exists() {
            bail!(
                "model {} not found (run `make model`, or `make model-gemma3` for gemma3, or set `model` in the configuration)",
                cfg.model.display()
            );
        }
        // Before anything in the state directory is read or written (a weight plan's profiles
        // included): it must be ours, and only one service may use it.
        let state_lock = state_dir::claim(&cfg.state_dir)?;
        let total = cfg.budget_bytes()?;
        let threads = cfg.pool_threads();
        let (model, weights, sparsity) = match cfg.weights_budget()? {
            None => (Arc::new(Model::load(&cfg.model).with_context(|| format!("loading {}", cfg.model.display()))?), None, None),
            Some(wb) if cfg.weights_plan => {
                let setup = crate::weights::plan::PlanSetup {
                    levels: crate::weights::plan::PLAN_LEVELS.to_vec(),
                    max_sparsity: cfg.weights_max_sparsity,
                    calib_text: cfg.weights_calib_text.clone().unwrap_or_else(|| crate::weights::plan::DEFAULT_CALIB_TEXT.into()),
                    state_dir: cfg.state_dir.clone(),
                    threads,
                };
                let p = crate::weights::plan::load_planned(&cfg.model, wb, cfg.weights_image.clone(), true, &setup)?;
                let w = usize::try_from(p.weights.stats().budget).unwrap_or(usize::MAX);
                if w >= total {
                    bail!("weights_budget ({w} bytes) leaves nothing of budget ({total} bytes) for KV chunks");
                }
                info!(weights = w, kv = total - w, image = %p.weights.image.display(), "weights paged under the budget; {}", crate::weights::plan::describe(&p.plan));
                (p.model, Some(p.weights), p.sparsity)
            }
            Some(wb) => {
                let opts = crate::weights::PagedOptions {
                    budget: wb,
                    image: cfg.weights_image.clone(),
                    preload: true,
                    format: engine::weights::ImageFormat::Packed,
                };
                let (m, pw) = crate::weights::load_paged(&cfg.model, &opts)?;
                let w = usize::try_from(pw.stats().budget).unwrap_or(usize::MAX);
                if w >= total {
                    bail!("weights_budget ({w} bytes) leaves nothing of budget ({total} bytes) for KV chunks");
                }
                info!(weights = w, kv = total - w, image = %pw.image.display(), "weights paged under the budget");
                (m, Some(pw), None)
            }
        };
        if cfg.max_context_tokens > model.config.ctx_len {
            bail!("max_context_tokens {} is over the model's context length {}", cfg.max_context_tokens, model.config.ctx_len);
        }
        // Its threads and the worker's take long CPU slices: the threads that stream tokens (and
        // the apps waiting for them) preempt the passes when they wake (crate::sched).
        let pool = Arc::new(ThreadPool::with_start(threads, crate::sched::long_slice_or_warn));
        let lanes = (cfg.prefill_lane && threads >= 2)
            .then(|| call::Lanes::new(Arc::new(ThreadPool::with_start(threads / 2, crate::sched::long_slice_or_warn))));
        // A base model (no template, no ChatML tokens) serves raw completions; a template
        // llmsd cannot continue is still an error at start.
        let turns = match Turns::new(&model) {
            Ok(t) => Ok(t),
            Err(e) if model.chat_template().is_none() => {
                info!("{e:#}: chat calls are refused, raw completions served");
                Err(engine::model::NO_CHAT.to_string())
            }
            Err(e) => return Err(e),
        };
        let policy = cfg.policy()?;
        let levels = cfg.level_formats()?;
        let hd = model.config.head_dim;
        if let Some(f) = levels.iter().find(|f| f.rotated() && !engine::kv::rotation_fits(hd)) {
            bail!(
                "levels: {} rotates head vectors, which this model's heads of {hd} channels cannot be (a power of two up to 256 is needed); set levels = [\"int8\", \"q4\", \"q2\"]",
                f.name()
            );
        }
        let profile = if policy == Policy::Llms && cfg.load_profile && !cfg.ablations()?.pipeline {
            Some(crate::profile::load_or_measure(&cfg.state_dir, &model, &pool, cfg.chunk_tokens, false)?)
        } else {
            None
        };
        let max_chunks = cfg.max_context_tokens.div_ceil(cfg.chunk_tokens) + 1;
        let store_dir = cfg.state_dir.join("store");
        let mut mm =
            crate::profile::manager_with(&store_dir, &model, cfg.chunk_tokens, cfg.mm_config(max_chunks)?, profile, cfg.durability()?)?;
        let budget = total;
        let weights_share = weights.as_ref().map_or(0, |w| usize::try_from(w.stats().budget).unwrap_or(usize::MAX));
        mm.set_budget(budget - weights_share)?;
        let refill = Arc::new(EngineRecompute::new(Arc::clone(&model), cfg.chunk_tokens, levels[0]).with_sparsity(sparsity.clone()));
        mm.set_fault_recompute(Some(Arc::clone(&refill) as Arc<dyn mm::FaultRecompute>));
        mm.set_background_levels(true);
        if cfg.prefix_sharing {
            // Room for every chunk of every context to be shared (address space only).
            mm.enable_sharing(max_chunks * cfg.max_contexts)?;
        }
        let ctx_dir = cfg.state_dir.join("contexts");
        std::fs::create_dir_all(&ctx_dir).with_context(|| format!("creating {}", ctx_dir.display()))?;
        let svc = Self {
            cfg,
            model,
            pool,
            lanes,
            turns,
            passes: mm.passes_running(),
            mm: Mutex::new(mm),
            leveller: (Mutex::new(false), Condvar::new()),
            sync: syncer::Syncer::default(),
            trace: Mutex::new(None),
            refill,
            registry: Mutex::new(HashMap::new()),
            scopes: Mutex::new(HashMap::new()),
            queue: Mutex::new(VecDeque::new()),
            queued: Condvar::new(),
            stopping: AtomicBool::new(false),
            connections: Mutex::new(HashMap::new()),
            metrics: Mutex::new(Metrics::default()),
            prom: metrics::Prom::default(),
            pressure: Mutex::new("unknown".into()),
            budget,
            weights,
            weights_share,
            sparsity,
            ctx_dir,
            state_lock: Mutex::new(Some(state_lock)),
        };
        svc.declare_public()?;
        svc.restore()?;
        Ok(Arc::new(svc))
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Starts (or stops) recording what the worker does in each step (`llms bench-serve
    /// --trace`): what held the running calls' tokens. Returns the instant the steps' `at_ms`
    /// count from, for setting what clients saw beside them.
    pub fn set_trace(&self, on: bool) -> Option<std::time::Instant> {
        let since = std::time::Instant::now();
        *lock(&self.trace) = on.then(|| call::Trace { since, steps: Vec::new() });
        on.then_some(since)
    }

    /// The steps recorded since tracing was switched on (tracing goes on).
    pub fn take_trace(&self) -> Vec<StepTrace> {
        lock(&self.trace).as_mut().map(|t| std::mem::take(&mut t.steps)).unwrap_or_default()
    }

    /// The mm sharing scope of `owner`'s contexts: the first 8 bytes of SHA-256 over the
    /// owner, the same at every start (shared chunks outlive restarts, named by scope). A
    /// cryptographic hash, so no app can pick a name whose scope is another's (finding a
    /// second preimage of 64 bits is out of reach; FNV, say, would be a few lines of algebra).
    fn scope(&self, owner: &Owner) -> u64 {
        *lock(&self.scopes).entry(owner.clone()).or_insert_with(|| owner.scope())
    }

    fn session(&self) -> Session {
        let levels = self.cfg.level_formats().unwrap_or_else(|_| vec![KvFormat::Int8]);
        let opts = SessionOptions {
            capacity: self.cfg.max_context_tokens,
            chunk_tokens: self.cfg.chunk_tokens,
            base: levels[0],
            // Densities are only needed to pick compression levels.
            observe_attention: self.cfg.observes_attention(),
            sliding_window: None,
        };
        let mut s = Session::with_options(Arc::clone(&self.model), Arc::clone(&self.pool), opts);
        // Thresholds calibrated for this model: only a layer-count mismatch fails, never here.
        let _ = s.set_sparsity(self.sparsity.clone());
        s
    }

    /// Serves until `stop` is called: accepts connections, runs the worker and the pressure
    /// follower. Returns after the worker finished and every AoT write is on flash.
    pub fn serve(self: &Arc<Self>, listener: UnixListener, http: HttpListeners) -> Result<()> {
        let http_socket = self.cfg.http_socket_path();
        let front = self.start_http(http)?;
        // Before the worker: its first answers go through it.
        let syncer = {
            let (svc, rx) = (Arc::clone(self), self.sync.open());
            std::thread::Builder::new().name("llmsd-syncer".into()).spawn(move || svc.syncer(&rx))?
        };
        let worker = {
            let svc = Arc::clone(self);
            std::thread::Builder::new().name("llmsd-worker".into()).spawn(move || svc.worker())?
        };
        let leveller = {
            let svc = Arc::clone(self);
            std::thread::Builder::new().name("llmsd-leveller".into()).spawn(move || svc.leveller())?
        };
        if self.cfg.pressure {
            self.spawn_pressure_follower()?;
        }
        self.accept(listener);
        self.wake_worker();
        if let Some(f) = front {
            f.stop();
            if let Some(p) = http_socket {
                let _ = std::fs::remove_file(p);
            }
        }
        let _ = worker.join();
        // Every answer the worker deferred is sent (its file synced) before serve returns.
        self.sync.close();
        let _ = syncer.join();
        self.wake_leveller();
        let _ = leveller.join();
        let mut mm = lock(&self.mm);
        // What the leveller had not lowered yet is lowered here, then written with the rest.
        if let Err(e) = mm.finish_levelling() {
            tracing::warn!("lowering the last chunks at stop: {e}");
        }
        mm.flush();
        // Say what is true: a chunk whose write failed (a full disk) is not on flash; its
        // context's tokens are (every acknowledged call saved its context file), so it is
        // recomputed from them at the next start.
        match mm.write_failures() {
            (0, _) => info!("stopped; every context is on flash"),
            (n, last) => tracing::warn!(
                failed_batches = n,
                "stopped; {n} chunk write batch(es) failed (last: {last}): those chunks are not on flash and will be recomputed \
                 from their contexts' tokens at the next start; every acknowledged call is on flash"
            ),
        }
        drop(mm);
        // Nothing writes the state any more (requests are refused once stopping; a registry
        // change under way finishes first): the directory is free for the next service.
        let registry = lock(&self.registry);
        lock(&self.state_lock).take();
        drop(registry);
        Ok(())
    }

    /// Wakes the worker if it waits for calls. The queue's lock is taken first: a worker that
    /// saw no call and no stop still holds it until it waits, so it cannot miss the signal
    /// between its checks and its wait (stop's signal was lost that way once, and the service
    /// never stopped: llmsd/tests/batching.rs under load).
    fn wake_worker(&self) {
        drop(lock(&self.queue));
        self.queued.notify_all();
    }

    /// KV bytes the service holds now: resident in memory, and allocated on flash by the swap
    /// store (every context's records and the shared chunks', each counted once), after the
    /// leveller and the AoT writer are done (`timeout` at most), for benchmarks in process.
    pub fn kv_footprint(&self, timeout: std::time::Duration) -> (u64, u64) {
        let t0 = std::time::Instant::now();
        loop {
            let mm = lock(&self.mm);
            if mm.level_jobs() == 0 || t0.elapsed() > timeout {
                mm.flush();
                return (mm.resident_bytes() as u64, mm.store().disk_bytes());
            }
            drop(mm);
            self.wake_leveller();
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// The last `fork`'s time, ms: in mm (its chunks shared, the partial one copied) and
    /// writing the new context's file (fsynced before the answer), for benchmarks in process.
    pub fn last_fork_ms(&self) -> (f64, f64) {
        lock(&self.metrics).last_fork_ms
    }

    /// Asks the service to stop (the accept loop is woken by connecting to it).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.wake_worker();
        self.wake_leveller();
        let _ = UnixStream::connect(&self.cfg.socket);
    }
}

/// Fault injection for tests, in debug builds only: with `LLMS_FAULT_PANIC_AT=<stage>`, a
/// request whose `trigger` (its app, or its text) contains `FAULT` panics at that stage of its
/// handling (`native-request`, `native-stream`, `enqueue`, `begin` (on the worker, after a
/// stateless call's context was chosen or made), `save` (the syncer, writing a finished call's context file), `sync` (the syncer, making it durable), `http-auth`, `http-tokenize`, `http-answer`), standing for a bug anywhere a connection is handled; other requests pass
/// (llmsd/tests/doors.rs checks that every such panic gives back what it held).
///
/// With `LLMS_FAULT_HOLD_AT=<stage>` and `LLMS_FAULT_HOLD_FILE=<path>`, such a request waits
/// at that stage instead, standing for a write or a lock that waits: it creates `<path>.held`,
/// waits until `<path>` exists (two minutes at most), then removes `<path>.held` and goes on
/// (llmsd/tests/batching.rs checks that a held save holds no other call).
#[cfg(debug_assertions)]
fn fault_point(stage: &str, trigger: &str) {
    static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    static HOLD: std::sync::OnceLock<Option<(String, std::path::PathBuf)>> = std::sync::OnceLock::new();
    if !trigger.contains("FAULT") {
        return;
    }
    if AT.get_or_init(|| std::env::var("LLMS_FAULT_PANIC_AT").ok()).as_deref() == Some(stage) {
        panic!("injected fault at {stage}");
    }
    let hold = HOLD.get_or_init(|| Some((std::env::var("LLMS_FAULT_HOLD_AT").ok()?, std::env::var_os("LLMS_FAULT_HOLD_FILE")?.into())));
    if let Some((_, release)) = hold.as_ref().filter(|(at, _)| at == stage) {
        let held = release.with_extension("held");
        let _ = std::fs::write(&held, stage);
        let t0 = std::time::Instant::now();
        while !release.exists() && t0.elapsed() < std::time::Duration::from_secs(120) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let _ = std::fs::remove_file(held);
    }
}

#[cfg(not(debug_assertions))]
fn fault_point(_: &str, _: &str) {}

/// A service running in this process (benchmarks, trace replay), over a real socket.
#[derive(Debug)]
pub struct Local {
    pub svc: Arc<Service>,
    pub socket: PathBuf,
    thread: std::thread::JoinHandle<Result<()>>,
}

impl Local {
    pub fn start(cfg: Config) -> Result<Self> {
        let socket = cfg.socket.clone();
        let mode = cfg.socket_mode_bits()?;
        let svc = Service::open(cfg)?;
        let http = HttpListeners::bind(svc.config())?;
        let listener = bind_socket(&socket, mode)?;
        let s = Arc::clone(&svc);
        let thread = std::thread::spawn(move || s.serve(listener, http));
        Ok(Self { svc, socket, thread })
    }

    /// Stops it cleanly (as SIGTERM would) and waits.
    pub fn stop(self) -> Result<()> {
        self.svc.stop();
        self.thread.join().map_err(|_| anyhow!("the service thread panicked"))??;
        let _ = std::fs::remove_file(&self.socket);
        Ok(())
    }
}

/// Creates the socket's directory (0755 when we create it) and binds the socket with `mode`,
/// replacing a stale socket but never a live service's, and never anything that is not a socket.
pub fn bind_socket(path: &Path, mode: u32) -> Result<UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_socket() => {
            bail!("{} exists and is not a socket: refusing to replace it (choose another --socket)", path.display());
        }
        Ok(_) => {
            if UnixStream::connect(path).is_ok() {
                bail!("another llmsd is listening on {}", path.display());
            }
            std::fs::remove_file(path).with_context(|| format!("removing the stale socket {}", path.display()))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("socket {}", path.display())),
    }
    let l = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::call::{floor_boundary, held_back};
    use super::conn::valid_app;
    use super::ctxfile::{new_ctx_id, valid_ctx_id};

    #[test]
    fn stop_strings_hold_back_only_their_prefixes() {
        assert_eq!(held_back("hello wor", "world"), 3);
        assert_eq!(held_back("hello", "world"), 0);
        assert_eq!(held_back("w", "world"), 1);
        assert_eq!(held_back("", "world"), 0);
        assert_eq!(floor_boundary("aé", 2), 1);
        assert_eq!(floor_boundary("aé", 3), 3);
        assert!(valid_ctx_id(&new_ctx_id().unwrap().0));
        assert!(!valid_ctx_id("../../etc/passwd"));
        assert!(valid_app("com.example-app_1") && !valid_app("") && !valid_app("a/b"));
    }
}

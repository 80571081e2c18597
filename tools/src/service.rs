//! llmsd: the LLM system service. One model, many persistent contexts owned by apps, their KV
//! caches held by mm under a memory budget that follows the kernel's pressure signals.
//!
//! Threads: one per connection (frames in, events out), one inference worker (calls run one at
//! a time, FIFO, on the shared model), the pressure monitor and its budget follower, and mm's
//! own (AoT writer, userfaultfd handler). Locks: the context registry, then mm — never the other
//! way round; neither is held while the model computes.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use engine::chat::Message;
use engine::kv::KvFormat;
use engine::model::{AttentionStats, Scratch, SessionOptions};
use engine::{Logits, Model, Sampler, SamplerConfig, Session, ThreadPool, Utf8Stream};
use mm::{Manager, Policy, Strategy};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::config::Config;
use crate::kvmm::{EngineRecompute, SessionKv};
use crate::proto::{self, Call, CallStats, CtxInfo, ErrorCode, Event, FrameError, Request, ServiceStats};

/// Who owns a context: the kernel's uid of the peer and the app name it bound with.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Owner {
    pub uid: u32,
    pub app: String,
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

/// What a context keeps on disk besides its KV records: enough to continue it after a restart.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Saved {
    version: u32,
    ctx: String,
    mm_id: u64,
    owner: Owner,
    tokens: Vec<u32>,
    /// Text not yet run (a system prompt waits for the first call).
    pending: String,
    /// The last call was a chat turn whose end-of-turn text is not in the cache yet.
    open_turn: bool,
    /// Tokens at the start kept when the context slides.
    keep: usize,
    calls: u64,
    attention_sum: Vec<f64>,
    attention_count: Vec<u64>,
}

struct CtxEntry {
    saved: Saved,
    /// `None` while the context is in a call.
    session: Option<Session>,
}

/// How a chat turn is written, from the model's own template (see [`Turns::new`]).
#[derive(Debug, Clone)]
struct Turns {
    /// Before the first user message of a context without a system prompt (the template may
    /// add its default system prompt here).
    first_open: String,
    /// Before a user message.
    open: String,
    /// After a user message: opens the assistant's turn.
    close_user: String,
    /// After an assistant message.
    close_assistant: String,
}

impl Turns {
    /// Renders probe conversations with the template and cuts the turn markup out of them:
    /// appending turn by turn must give the same text as rendering the whole conversation.
    fn new(model: &Model) -> Result<Self> {
        const MARK: &str = "\u{1}LLMS\u{1}";
        let r = |m: &[Message], g: bool| model.render_chat(m, g).map_err(|e| anyhow!("chat template: {e}"));
        let sys = Message::new("system", "S");
        let split = |s: &str| -> Result<(String, String)> {
            let (a, b) = s.split_once(MARK).context("chat template drops message content")?;
            Ok((a.to_string(), b.to_string()))
        };
        let (first_open, close_user) = split(&r(&[Message::new("user", MARK)], true)?)?;
        let head = r(std::slice::from_ref(&sys), false)?;
        let full = r(&[sys.clone(), Message::new("user", MARK)], true)?;
        let rest = full.strip_prefix(&head).context("chat template is not incremental (a turn changes earlier text)")?;
        let (open, close_user2) = split(rest)?;
        let u = Message::new("user", "u");
        let before = r(&[sys.clone(), u.clone()], true)?;
        let after = r(&[sys, u, Message::new("assistant", MARK)], false)?;
        let rest = after.strip_prefix(&before).context("chat template is not incremental (the assistant turn)")?;
        let (lead, close_assistant) = split(rest)?;
        if !lead.is_empty() || close_user2 != close_user {
            bail!("chat template writes turns in a way llmsd cannot continue");
        }
        Ok(Self { first_open, open, close_user, close_assistant })
    }

    fn system(model: &Model, text: &str) -> Result<String> {
        model.render_chat(&[Message::new("system", text)], false).map_err(|e| anyhow!("chat template: {e}"))
    }
}

struct Job {
    owner: Owner,
    call: Call,
    received: Instant,
    events: Sender<Event>,
    cancel: Arc<AtomicBool>,
}

#[derive(Default)]
struct Metrics {
    calls: u64,
    /// Recent switch latencies, ms.
    switch_ms: VecDeque<f64>,
}

/// The running service.
pub struct Service {
    cfg: Config,
    model: Arc<Model>,
    pool: Arc<ThreadPool>,
    turns: Turns,
    mm: Mutex<Manager>,
    /// The fault path's recompute: it learns each context's tokens after every call.
    refill: Arc<EngineRecompute>,
    registry: Mutex<HashMap<String, CtxEntry>>,
    queue: Mutex<VecDeque<Job>>,
    queued: Condvar,
    stopping: AtomicBool,
    connections: AtomicUsize,
    metrics: Mutex<Metrics>,
    pressure: Mutex<String>,
    budget: usize,
    /// Paged weights and their share of `budget` as configured (the rest is mm's).
    weights: Option<Arc<crate::weights::PagedWeights>>,
    weights_share: usize,
    /// Top-K sparsity every session computes with (a weight plan chose it), if any.
    sparsity: Option<Arc<engine::sparsity::Sparsity>>,
    ctx_dir: PathBuf,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").field("socket", &self.cfg.socket).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A new unguessable context id: 128 bits from the kernel's random source.
fn new_ctx_id() -> Result<(String, u64)> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).context("reading /dev/urandom")?;
    let id: String = b.iter().map(|x| format!("{x:02x}")).collect();
    let mm_id = u64::from_le_bytes(b[..8].try_into().expect("8 bytes")) | 1;
    Ok((id, mm_id))
}

fn valid_ctx_id(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

fn valid_app(s: &str) -> bool {
    (1..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

impl Service {
    /// Loads the model, opens the store and restores the contexts it holds.
    pub fn open(cfg: Config) -> Result<Arc<Self>> {
        cfg.validate()?;
        if !cfg.model.exists() {
            bail!("model {} not found (run `make model`, or set `model` in the configuration)", cfg.model.display());
        }
        let total = cfg.budget_bytes()?;
        let threads = if cfg.threads == 0 { std::thread::available_parallelism().map_or(1, std::num::NonZero::get) } else { cfg.threads };
        let (model, weights, sparsity) = match cfg.weights_budget()? {
            None => (Arc::new(Model::load(&cfg.model).with_context(|| format!("loading {}", cfg.model.display()))?), None, None),
            Some(wb) if cfg.weights_plan => {
                let setup = crate::weightplan::PlanSetup {
                    levels: crate::weightplan::PLAN_LEVELS.to_vec(),
                    max_sparsity: cfg.weights_max_sparsity,
                    calib_text: cfg.weights_calib_text.clone().unwrap_or_else(|| crate::weightplan::DEFAULT_CALIB_TEXT.into()),
                    state_dir: cfg.state_dir.clone(),
                    threads,
                };
                let p = crate::weightplan::load_planned(&cfg.model, wb, cfg.weights_image.clone(), true, &setup)?;
                let w = usize::try_from(p.weights.stats().budget).unwrap_or(usize::MAX);
                if w >= total {
                    bail!("weights_budget ({w} bytes) leaves nothing of budget ({total} bytes) for KV chunks");
                }
                info!(weights = w, kv = total - w, image = %p.weights.image.display(), "weights paged under the budget; {}", crate::weightplan::describe(&p.plan));
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
        let pool = Arc::new(ThreadPool::new(threads));
        let turns = Turns::new(&model)?;
        std::fs::create_dir_all(&cfg.state_dir).with_context(|| format!("creating {}", cfg.state_dir.display()))?;
        let policy = cfg.policy()?;
        let levels = cfg.level_formats()?;
        let profile = if policy == Policy::Llms && cfg.load_profile && !cfg.ablations()?.pipeline {
            Some(crate::loadbench::load_or_measure(&cfg.state_dir, &model, &pool, cfg.chunk_tokens, false)?)
        } else {
            None
        };
        let max_chunks = cfg.max_context_tokens.div_ceil(cfg.chunk_tokens) + 1;
        let store_dir = cfg.state_dir.join("store");
        let mut mm = crate::loadbench::manager(&store_dir, &model, cfg.chunk_tokens, cfg.mm_config(max_chunks)?, profile)?;
        let budget = total;
        let weights_share = weights.as_ref().map_or(0, |w| usize::try_from(w.stats().budget).unwrap_or(usize::MAX));
        mm.set_budget(budget - weights_share)?;
        let refill = Arc::new(EngineRecompute::new(Arc::clone(&model), cfg.chunk_tokens, levels[0]).with_sparsity(sparsity.clone()));
        mm.set_fault_recompute(Some(Arc::clone(&refill) as Arc<dyn mm::FaultRecompute>));
        let ctx_dir = cfg.state_dir.join("contexts");
        std::fs::create_dir_all(&ctx_dir).with_context(|| format!("creating {}", ctx_dir.display()))?;
        std::fs::set_permissions(&cfg.state_dir, std::fs::Permissions::from_mode(0o700)).ok();
        let svc = Self {
            cfg,
            model,
            pool,
            turns,
            mm: Mutex::new(mm),
            refill,
            registry: Mutex::new(HashMap::new()),
            queue: Mutex::new(VecDeque::new()),
            queued: Condvar::new(),
            stopping: AtomicBool::new(false),
            connections: AtomicUsize::new(0),
            metrics: Mutex::new(Metrics::default()),
            pressure: Mutex::new("unknown".into()),
            budget,
            weights,
            weights_share,
            sparsity,
            ctx_dir,
        };
        svc.restore()?;
        Ok(Arc::new(svc))
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    fn session(&self) -> Session {
        let policy = self.cfg.policy().unwrap_or(Policy::Llms);
        let levels = self.cfg.level_formats().unwrap_or_else(|_| vec![KvFormat::Int8]);
        let opts = SessionOptions {
            capacity: self.cfg.max_context_tokens,
            chunk_tokens: self.cfg.chunk_tokens,
            base: levels[0],
            // Densities are only needed to pick compression levels.
            observe_attention: policy == Policy::Llms && levels.len() > 1 && !self.cfg.ablations().is_ok_and(|a| a.compression),
            sliding_window: None,
        };
        let mut s = Session::with_options(Arc::clone(&self.model), Arc::clone(&self.pool), opts);
        // Thresholds calibrated for this model: only a layer-count mismatch fails, never here.
        let _ = s.set_sparsity(self.sparsity.clone());
        s
    }

    /// Reopens every saved context (its KV comes back from the store at its first call);
    /// store data no saved context names is removed.
    fn restore(&self) -> Result<()> {
        let mut reg = lock(&self.registry);
        let mut mm = lock(&self.mm);
        for e in std::fs::read_dir(&self.ctx_dir)? {
            let path = e?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.ends_with(".tmp") {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let Some(id) = name.strip_suffix(".json").filter(|s| valid_ctx_id(s)) else { continue };
            let saved: Saved = match std::fs::read(&path).map_err(anyhow::Error::from).and_then(|b| Ok(serde_json::from_slice(&b)?)) {
                Ok(s) => s,
                Err(e) => {
                    warn!(file = %path.display(), "context file unreadable, left as it is: {e}");
                    continue;
                }
            };
            if saved.ctx != id || saved.version != 1 || saved.tokens.len() > self.cfg.max_context_tokens {
                warn!(file = %path.display(), "context file does not fit this service's settings, left as it is");
                continue;
            }
            let mut s = self.session();
            s.tokens.clone_from(&saved.tokens);
            let usable = mm.restore(saved.mm_id, &mut SessionKv(&mut s))?;
            s.kv.set_len(saved.tokens.len())?;
            if let Some(a) = &mut s.attention {
                if saved.attention_sum.len() == saved.attention_count.len() && saved.attention_sum.len() <= saved.tokens.len() {
                    *a = AttentionStats { sum: saved.attention_sum.clone(), count: saved.attention_count.clone() };
                }
            }
            self.refill.set_tokens(saved.mm_id, &saved.tokens);
            info!(ctx = %id, app = %saved.owner.app, uid = saved.owner.uid, tokens = saved.tokens.len(), records = usable, "context restored");
            reg.insert(id.to_string(), CtxEntry { saved, session: Some(s) });
        }
        let known: Vec<u64> = reg.values().map(|e| e.saved.mm_id).collect();
        for c in mm.store().contexts() {
            if !known.contains(&c) {
                mm.store().remove_context(c)?;
                info!(mm_id = c, "removed store data of a context that no longer exists");
            }
        }
        Ok(())
    }

    fn save(&self, saved: &Saved) -> Result<()> {
        let path = self.ctx_dir.join(format!("{}.json", saved.ctx));
        let tmp = self.ctx_dir.join(format!("{}.json.tmp", saved.ctx));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec(saved)?)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(&self.ctx_dir)?.sync_all()?;
        Ok(())
    }

    fn new_ctx(&self, owner: &Owner, system_prompt: Option<&str>) -> Result<String, Refusal> {
        let fail = |e: anyhow::Error| refuse(ErrorCode::Failed, format!("{e:#}"));
        let pending = match system_prompt {
            Some(p) => Turns::system(&self.model, p).map_err(fail)?,
            None => String::new(),
        };
        let mut reg = lock(&self.registry);
        if reg.len() >= self.cfg.max_contexts {
            return Err(refuse(ErrorCode::TooMany, format!("the service holds its maximum of {} contexts", self.cfg.max_contexts)));
        }
        let mine = reg.values().filter(|e| e.saved.owner == *owner).count();
        if mine >= self.cfg.max_contexts_per_app {
            return Err(refuse(ErrorCode::TooMany, format!("app {} holds its maximum of {mine} contexts", owner.app)));
        }
        let (id, mm_id) = new_ctx_id().map_err(fail)?;
        if reg.values().any(|e| e.saved.mm_id == mm_id) {
            return Err(refuse(ErrorCode::Failed, "context id collision; try again"));
        }
        lock(&self.mm).create(mm_id).map_err(|e| fail(e.into()))?;
        let saved = Saved {
            version: 1,
            ctx: id.clone(),
            mm_id,
            owner: owner.clone(),
            tokens: Vec::new(),
            pending,
            open_turn: false,
            keep: 0,
            calls: 0,
            attention_sum: Vec::new(),
            attention_count: Vec::new(),
        };
        if let Err(e) = self.save(&saved) {
            let _ = lock(&self.mm).delete(mm_id);
            return Err(fail(e));
        }
        info!(ctx = %id, app = %owner.app, uid = owner.uid, "context created");
        reg.insert(id.clone(), CtxEntry { saved, session: Some(self.session()) });
        Ok(id)
    }

    fn del_ctx(&self, owner: &Owner, ctx: &str) -> Result<(), Refusal> {
        let mut reg = lock(&self.registry);
        match reg.get(ctx) {
            Some(e) if e.saved.owner == *owner => {
                if e.session.is_none() {
                    return Err(refuse(ErrorCode::Busy, "the context is in a call"));
                }
            }
            _ => return Err(not_found(ctx)),
        }
        let e = reg.remove(ctx).expect("checked");
        // The saved file goes first: a crash in between leaves store data without a context,
        // which the next start removes.
        let _ = std::fs::remove_file(self.ctx_dir.join(format!("{ctx}.json")));
        drop(e.session);
        self.refill.forget(e.saved.mm_id);
        lock(&self.mm).delete(e.saved.mm_id).map_err(|e| refuse(ErrorCode::Failed, e.to_string()))?;
        info!(ctx, app = %owner.app, "context deleted");
        Ok(())
    }

    fn ctx_info(&self, mm: &Manager, id: &str, e: &CtxEntry) -> CtxInfo {
        let mut levels = std::collections::BTreeMap::new();
        let n = mm.n_chunks(e.saved.mm_id);
        let mut flash = 0u64;
        for i in 0..n {
            if let Some(c) = mm.chunk_info(e.saved.mm_id, i) {
                *levels.entry(crate::kvmm::format(c.format).name().to_string()).or_insert(0) += 1;
            }
            if let Some(r) = u32::try_from(i).ok().and_then(|i| mm.store().entry(e.saved.mm_id, i)) {
                flash += u64::from(r.layer_len) * self.model.config.n_layers as u64;
            }
        }
        CtxInfo {
            ctx: id.to_string(),
            tokens: u32::try_from(e.saved.tokens.len()).unwrap_or(u32::MAX),
            chunks: u32::try_from(n).unwrap_or(u32::MAX),
            resident_bytes: mm.context_bytes(e.saved.mm_id) as u64,
            flash_bytes: flash,
            levels,
            calls: e.saved.calls,
            busy: e.session.is_none(),
        }
    }

    fn list(&self, owner: &Owner) -> Vec<CtxInfo> {
        let reg = lock(&self.registry);
        let mm = lock(&self.mm);
        let mut v: Vec<CtxInfo> = reg.iter().filter(|(_, e)| e.saved.owner == *owner).map(|(id, e)| self.ctx_info(&mm, id, e)).collect();
        v.sort_by(|a, b| a.ctx.cmp(&b.ctx));
        v
    }

    /// The service's figures, with the caller's contexts in detail.
    fn stats(&self, owner: &Owner) -> ServiceStats {
        let mine = self.list(owner);
        let reg = lock(&self.registry);
        let mm = lock(&self.mm);
        let faults = reg.values().filter_map(|e| mm.region_stats(e.saved.mm_id)).map(|s| s.faults).sum();
        let n_ctx = reg.len();
        drop(reg);
        let m = lock(&self.metrics);
        let mut sw: Vec<f64> = m.switch_ms.iter().copied().collect();
        sw.sort_by(f64::total_cmp);
        let pct = |p: f64| {
            if sw.is_empty() {
                0.0
            } else {
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
                let i = ((sw.len() - 1) as f64 * p).round() as usize;
                sw[i]
            }
        };
        ServiceStats {
            policy: mm.config().policy.name().into(),
            budget_bytes: mm.config().budget as u64 + self.weights.as_ref().map_or(0, |w| w.stats().budget),
            configured_budget_bytes: self.budget as u64,
            resident_bytes: mm.resident_bytes() as u64,
            contexts: u32::try_from(n_ctx).unwrap_or(u32::MAX),
            queue: u32::try_from(lock(&self.queue).len()).unwrap_or(u32::MAX),
            calls: m.calls,
            switch_p50_ms: pct(0.5),
            switch_p90_ms: pct(0.9),
            switch_p99_ms: pct(0.99),
            aot_pending: mm.pending_writes() as u64,
            evicted_chunks: mm.stats.evicted_chunks,
            written_aot: mm.stats.written_aot,
            written_sync: mm.stats.written_sync,
            faults,
            weights_budget_bytes: self.weights.as_ref().map_or(0, |w| w.stats().budget),
            weights_resident_bytes: self.weights.as_ref().map_or(0, |w| w.stats().resident_bytes),
            weights_read_bytes: self.weights.as_ref().map_or(0, |w| w.stats().bytes_read),
            weights_plan: self.weights.as_ref().and_then(|w| w.plan()).map(|p| crate::weightplan::describe(&p)).unwrap_or_default(),
            pressure: lock(&self.pressure).clone(),
            mine,
        }
    }

    /// Queues a call; its events arrive on the returned channel.
    fn submit(&self, owner: &Owner, call: Call, cancel: Arc<AtomicBool>) -> Result<Receiver<Event>, Refusal> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(refuse(ErrorCode::ShuttingDown, "the service is stopping"));
        }
        {
            let reg = lock(&self.registry);
            match reg.get(&call.ctx) {
                Some(e) if e.saved.owner == *owner => {}
                _ => return Err(not_found(&call.ctx)),
            }
        }
        if call.max_tokens as usize + 2 > self.cfg.max_context_tokens / 2 {
            return Err(refuse(ErrorCode::BadRequest, format!("max_tokens must be under {}", self.cfg.max_context_tokens / 2 - 2)));
        }
        if !(call.temperature.is_finite() && (0.0..=10.0).contains(&call.temperature)) {
            return Err(refuse(ErrorCode::BadRequest, "temperature must be between 0 and 10"));
        }
        if call.stop.len() > 16 || call.stop.iter().any(|s| s.is_empty() || s.len() > 256) {
            return Err(refuse(ErrorCode::BadRequest, "stop: at most 16 non-empty strings of at most 256 bytes"));
        }
        let (tx, rx) = mpsc::channel();
        let mut q = lock(&self.queue);
        if q.len() >= self.cfg.max_queue {
            return Err(refuse(ErrorCode::TooMany, format!("{} calls are waiting; try later", q.len())));
        }
        q.push_back(Job { owner: owner.clone(), call, received: Instant::now(), events: tx, cancel });
        self.queued.notify_one();
        Ok(rx)
    }

    /// The inference worker: runs queued calls one at a time until the service stops.
    fn worker(&self) {
        let mut scratch = Scratch::default();
        loop {
            let job = {
                let mut q = lock(&self.queue);
                loop {
                    if self.stopping.load(Ordering::SeqCst) {
                        for j in q.drain(..) {
                            let _ = j.events.send(Event::error(ErrorCode::ShuttingDown, "the service is stopping"));
                        }
                        return;
                    }
                    if let Some(j) = q.pop_front() {
                        break j;
                    }
                    q = self.queued.wait(q).unwrap_or_else(std::sync::PoisonError::into_inner);
                }
            };
            let ev = match self.run(&job, &mut scratch) {
                Ok((text, stats)) => Event::Done { text, stats },
                Err(r) => r.into(),
            };
            let _ = job.events.send(ev);
        }
    }

    /// One call, start to end (see docs/llmsd.md "The call path").
    fn run(&self, job: &Job, scratch: &mut Scratch) -> Result<(String, CallStats), Refusal> {
        let start = Instant::now();
        let c = &job.call;
        let (mut s, mut saved) = {
            let mut reg = lock(&self.registry);
            let e = match reg.get_mut(&c.ctx) {
                Some(e) if e.saved.owner == job.owner => e,
                _ => return Err(not_found(&c.ctx)),
            };
            let s = e.session.take().ok_or_else(|| refuse(ErrorCode::Busy, "the context is in a call"))?;
            (s, e.saved.clone())
        };
        s.set_scratch(std::mem::take(scratch));
        let r = self.run_in(job, &mut s, &mut saved, start);
        *scratch = s.take_scratch();
        // Whatever the cache holds now is the context (a cancelled call keeps what it made).
        saved.tokens.clone_from(&s.tokens);
        if let Some(a) = &s.attention {
            saved.attention_sum.clone_from(&a.sum);
            saved.attention_count.clone_from(&a.count);
        }
        if r.is_ok() {
            saved.calls += 1;
        }
        self.refill.set_tokens(saved.mm_id, &saved.tokens);
        let persisted = self.save(&saved);
        {
            let mut reg = lock(&self.registry);
            if let Some(e) = reg.get_mut(&c.ctx) {
                e.session = Some(s);
                e.saved = saved;
            }
        }
        persisted.map_err(|e| refuse(ErrorCode::Failed, format!("saving the context: {e:#}")))?;
        let (text, mut stats) = r?;
        stats.queue_ms = ms(start.duration_since(job.received));
        stats.ttft_ms += stats.queue_ms;
        let mut m = lock(&self.metrics);
        m.calls += 1;
        m.switch_ms.push_back(stats.switch_ms);
        if m.switch_ms.len() > 4096 {
            m.switch_ms.pop_front();
        }
        Ok((text, stats))
    }

    #[allow(clippy::too_many_lines)]
    fn run_in(&self, job: &Job, s: &mut Session, saved: &mut Saved, start: Instant) -> Result<(String, CallStats), Refusal> {
        let fail = |e: &dyn std::fmt::Display| refuse(ErrorCode::Failed, e.to_string());
        let c = &job.call;
        let tk = &self.model.tokenizer;
        let enc = |t: &str, special: bool| tk.encode(t, false, special).map_err(|e| fail(&e));
        // The new tokens: pending text (a system prompt), the end of the last assistant turn,
        // then the prompt as a user turn (markup parsed for special tokens, the user's text
        // not: an app cannot forge turns) or raw.
        let mut ids = Vec::new();
        if s.n_past() == 0 && tk.add_bos {
            ids.extend(tk.bos);
        }
        if !saved.pending.is_empty() {
            ids.extend(enc(&saved.pending, true)?);
        }
        if saved.open_turn {
            ids.extend(enc(&self.turns.close_assistant, true)?);
        }
        if c.raw {
            ids.extend(enc(&c.prompt, true)?);
        } else {
            let first = s.n_past() == 0 && saved.pending.is_empty();
            ids.extend(enc(if first { &self.turns.first_open } else { &self.turns.open }, true)?);
            ids.extend(enc(&c.prompt, false)?);
            ids.extend(enc(&self.turns.close_user, true)?);
        }
        if s.n_past() == 0 {
            saved.keep = ids.len().min(self.cfg.keep_tokens);
        }
        let mm_id = saved.mm_id;
        let mut stats = CallStats { prompt_tokens: u32::try_from(ids.len()).unwrap_or(u32::MAX), ..CallStats::default() };

        // Sliding window: the context's start and its most recent tokens stay; the cache is
        // rebuilt from them (the dropped middle changes every later position).
        let room = self.cfg.max_context_tokens - c.max_tokens as usize - 1;
        if s.n_past() + ids.len() > room {
            let keep = saved.keep.min(s.n_past());
            if keep + ids.len() > room {
                // The prompt alone is too long: its end is kept.
                let cut = keep + ids.len() - room;
                ids.drain(..cut.min(ids.len()));
            }
            let tail = room.saturating_sub(keep + ids.len()).min(s.n_past() - keep);
            let mut kept: Vec<u32> = s.tokens[..keep].to_vec();
            kept.extend_from_slice(&s.tokens[s.n_past() - tail..]);
            stats.slid_tokens = u32::try_from(s.n_past() - kept.len()).unwrap_or(u32::MAX);
            kept.extend_from_slice(&ids);
            ids = kept;
            let mut mm = lock(&self.mm);
            mm.delete(mm_id).map_err(|e| fail(&e))?;
            mm.create(mm_id).map_err(|e| fail(&e))?;
            let scratch = s.take_scratch();
            *s = self.session();
            s.set_scratch(scratch);
        }

        // Load: the context's chunks come back (read or recomputed as the planner says) and
        // are pinned for the call.
        let report = lock(&self.mm).begin(mm_id, &mut SessionKv(s), Strategy::Planned).map_err(|e| fail(&e))?;
        stats.switch_ms = ms(start.elapsed());
        stats.missing_chunks = u32::try_from(report.missing).unwrap_or(u32::MAX);
        stats.read_chunks = u32::try_from(report.read).unwrap_or(u32::MAX);
        stats.recomputed_chunks = u32::try_from(report.recomputed).unwrap_or(u32::MAX);
        saved.pending.clear();
        saved.open_turn = false;
        let out = self.infer(job, s, mm_id, &ids, &mut stats);
        // Always end the call: unpin, write out what changed, re-level, reclaim.
        let ended = lock(&self.mm).end(mm_id, &mut SessionKv(s));
        let text = out?;
        ended.map_err(|e| fail(&e))?;
        saved.open_turn = !c.raw && stats.finish != "cancelled";
        stats.context_tokens = u32::try_from(s.n_past()).unwrap_or(u32::MAX);
        info!(
            ctx = %c.ctx, app = %job.owner.app, switch_ms = stats.switch_ms, read = stats.read_chunks,
            recomputed = stats.recomputed_chunks, prompt = stats.prompt_tokens, output = stats.output_tokens,
            finish = %stats.finish, "call"
        );
        Ok((text, stats))
    }

    /// Prefill and decode; new chunks get their slots from mm as the context grows.
    fn infer(&self, job: &Job, s: &mut Session, mm_id: u64, ids: &[u32], stats: &mut CallStats) -> Result<String, Refusal> {
        let fail = |e: &dyn std::fmt::Display| refuse(ErrorCode::Failed, e.to_string());
        let c = &job.call;
        let ct = self.cfg.chunk_tokens;
        let grow = |s: &mut Session, n: usize| -> Result<(), Refusal> {
            if n > s.kv.n_chunks() * ct {
                lock(&self.mm).prepare(mm_id, &mut SessionKv(s), n).map_err(|e| fail(&e))?;
            }
            Ok(())
        };
        let t0 = Instant::now();
        grow(s, s.n_past() + ids.len())?;
        let mut sampler = Sampler::new(SamplerConfig { temperature: c.temperature, seed: c.seed, ..SamplerConfig::default() });
        let mut next = sampler.sample(s.eval(ids, Logits::Last).map_err(|e| fail(&e))?);
        stats.prefill_ms = ms(t0.elapsed());
        stats.ttft_ms = ms(job.received.elapsed()) - stats.queue_ms;
        let t1 = Instant::now();
        let tk = &self.model.tokenizer;
        let mut utf8 = Utf8Stream::default();
        let mut text = String::new();
        let mut bytes = Vec::new();
        let mut sent = 0;
        let mut n_out = 0u32;
        stats.finish = "length".into();
        loop {
            if tk.is_eog(next) {
                stats.finish = "eog".into();
                break;
            }
            bytes.clear();
            tk.token_bytes(next, false, &mut bytes);
            let before = text.len();
            text.push_str(&utf8.push(&bytes));
            n_out += 1;
            // The token joins the context whatever happens to the output.
            grow(s, s.n_past() + 1)?;
            let logits = s.eval(&[next], Logits::Last).map_err(|e| fail(&e))?;
            // Only a match ending in the new piece is new: search from one stop string's
            // length before it, not the whole output at every token.
            let from = |p: &String| floor_boundary(&text, before.saturating_sub(p.len()));
            if let Some(at) = c.stop.iter().filter_map(|p| text[from(p)..].find(p.as_str()).map(|i| i + from(p))).min() {
                text.truncate(at);
                stats.finish = "stop".into();
                break;
            }
            // Stream what can no longer become part of a stop string.
            let hold = c.stop.iter().map(|p| held_back(&text, p)).max().unwrap_or(0);
            let safe = text.len() - hold;
            if safe > sent && text.is_char_boundary(safe) {
                if job.events.send(Event::Token { text: text[sent..safe].to_string() }).is_err() {
                    job.cancel.store(true, Ordering::SeqCst);
                }
                sent = safe;
            }
            if job.cancel.load(Ordering::SeqCst) {
                stats.finish = "cancelled".into();
                break;
            }
            if n_out >= c.max_tokens {
                break;
            }
            next = sampler.sample(logits);
        }
        if stats.finish != "stop" {
            text.push_str(&utf8.finish());
        }
        if text.len() > sent && stats.finish != "cancelled" {
            let _ = job.events.send(Event::Token { text: text[sent..].to_string() });
        }
        stats.output_tokens = n_out;
        stats.decode_ms = ms(t1.elapsed());
        Ok(text)
    }

    /// Follows the pressure monitor: its budget target (never above the configured budget)
    /// becomes mm's budget; every reclaim is logged with the bytes freed and why.
    fn follow_pressure(&self, events: &Receiver<cgroup::Event>) {
        let mut last = usize::MAX;
        while let Ok(e) = events.recv() {
            if self.stopping.load(Ordering::SeqCst) {
                return;
            }
            *lock(&self.pressure) = format!("{:?}", e.level).to_lowercase();
            let target = usize::try_from(e.budget).unwrap_or(usize::MAX).min(self.budget);
            if target == last {
                continue;
            }
            last = target;
            // One budget covers both: the weights keep their configured share of it.
            let w = match &self.weights {
                Some(pw) => {
                    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
                    let w = (self.weights_share as f64 * target as f64 / self.budget.max(1) as f64) as usize;
                    if let Err(err) = pw.set_budget(w.max(crate::weights::SLOT)) {
                        warn!("setting the weight budget to {w}: {err}");
                    }
                    // A refused budget (a plan cannot hold one layer group in it) keeps the
                    // old one: the KV chunks get what is left.
                    usize::try_from(pw.stats().budget).unwrap_or(usize::MAX)
                }
                None => 0,
            };
            let target = target.saturating_sub(w);
            match lock(&self.mm).set_budget(target) {
                Ok(freed) if freed > 0 => info!(freed, budget = target, level = ?e.level, need = e.need_to_free, "reclaim under pressure"),
                Ok(_) => info!(budget = target, level = ?e.level, "budget follows pressure"),
                Err(err) => warn!("setting the budget to {target}: {err}"),
            }
        }
    }

    /// Serves until `stop` is called: accepts connections, runs the worker and the pressure
    /// follower. Returns after the worker finished and every AoT write is on flash.
    pub fn serve(self: &Arc<Self>, listener: UnixListener) -> Result<()> {
        let worker = {
            let svc = Arc::clone(self);
            std::thread::Builder::new().name("llmsd-worker".into()).spawn(move || svc.worker())?
        };
        if self.cfg.pressure {
            let probe = cgroup::probe(self.cfg.cgroup.as_deref());
            let opts = cgroup::MonitorOptions { budget_max: self.budget as u64, ..Default::default() };
            let (rx, monitor) = cgroup::spawn(probe, opts);
            let svc = Arc::clone(self);
            std::thread::Builder::new().name("llmsd-pressure".into()).spawn(move || {
                svc.follow_pressure(&rx);
                if !svc.stopping.load(Ordering::SeqCst) {
                    let why = match monitor.join() {
                        Ok(Err(e)) => e.to_string(),
                        _ => "it ended".into(),
                    };
                    warn!("the pressure monitor stopped ({why}); the budget stays at {} bytes", lock(&svc.mm).config().budget);
                    *lock(&svc.pressure) = "unmonitored".into();
                }
            })?;
        }
        for conn in listener.incoming() {
            if self.stopping.load(Ordering::SeqCst) {
                break;
            }
            let stream = match conn {
                Ok(s) => s,
                Err(e) => {
                    warn!("accept: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            };
            if self.connections.fetch_add(1, Ordering::SeqCst) >= self.cfg.max_connections {
                self.connections.fetch_sub(1, Ordering::SeqCst);
                let mut s = stream;
                let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
                let _ = proto::write_frame(&mut s, &proto::encode(&Event::error(ErrorCode::TooMany, "too many connections")));
                continue;
            }
            let svc = Arc::clone(self);
            let spawned = std::thread::Builder::new().name("llmsd-conn".into()).spawn(move || {
                svc.connection(stream);
                svc.connections.fetch_sub(1, Ordering::SeqCst);
            });
            if let Err(e) = spawned {
                self.connections.fetch_sub(1, Ordering::SeqCst);
                warn!("cannot start a connection thread: {e}");
            }
        }
        self.queued.notify_all();
        let _ = worker.join();
        lock(&self.mm).flush();
        info!("stopped; every context is on flash");
        Ok(())
    }

    /// Asks the service to stop (the accept loop is woken by connecting to it).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.queued.notify_all();
        let _ = UnixStream::connect(&self.cfg.socket);
    }

    fn connection(&self, mut stream: UnixStream) {
        let Ok(cred) = nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials) else {
            return;
        };
        let uid = cred.uid();
        let idle = Duration::from_secs(self.cfg.idle_timeout_s.max(1));
        let io = Duration::from_secs(self.cfg.io_timeout_s.max(1));
        let _ = stream.set_write_timeout(Some(io));
        let mut owner: Option<Owner> = None;
        loop {
            // Wait for a request as long as a client may idle; once it starts, the frame must
            // arrive within the I/O timeout (a slow sender cannot hold the thread forever).
            if !readable(&stream, idle) {
                return;
            }
            if self.stopping.load(Ordering::SeqCst) {
                let _ = send(&mut stream, &Event::error(ErrorCode::ShuttingDown, "the service is stopping"));
                return;
            }
            let _ = stream.set_read_timeout(Some(io));
            let body = match proto::read_frame(&mut stream) {
                Ok(b) => b,
                Err(FrameError::TooLarge(n)) => {
                    // The rest of the frame cannot be skipped safely: answer and hang up.
                    let _ =
                        send(&mut stream, &Event::error(ErrorCode::TooLarge, format!("frame of {n} bytes is over {}", proto::MAX_FRAME)));
                    return;
                }
                Err(_) => return,
            };
            let req = match proto::decode_request(&body) {
                Ok(r) => r,
                Err(e) => {
                    if send(&mut stream, &Event::error(ErrorCode::BadRequest, e.to_string())).is_err() {
                        return;
                    }
                    continue;
                }
            };
            let answer = match (req, &owner) {
                (Request::Bind { app, version }, None) => {
                    if version != proto::VERSION {
                        Err(refuse(ErrorCode::Version, format!("this service speaks protocol {}, not {version}", proto::VERSION)))
                    } else if !valid_app(&app) {
                        Err(refuse(ErrorCode::BadRequest, "app: 1-64 characters of A-Z a-z 0-9 . _ -"))
                    } else {
                        let o = Owner { uid, app };
                        let ev = Event::Bound { protocol: proto::VERSION, uid, app: o.app.clone() };
                        owner = Some(o);
                        Ok(ev)
                    }
                }
                (Request::Bind { .. }, Some(_)) => Err(refuse(ErrorCode::NotBound, "this connection is already bound")),
                (_, None) => Err(refuse(ErrorCode::NotBound, "bind first")),
                (Request::NewCtx { system_prompt }, Some(o)) => self.new_ctx(o, system_prompt.as_deref()).map(|ctx| Event::Created { ctx }),
                (Request::DelCtx { ctx }, Some(o)) => self.del_ctx(o, &ctx).map(|()| Event::Deleted { ctx }),
                (Request::List {}, Some(o)) => Ok(Event::List { contexts: self.list(o) }),
                (Request::Stats {}, Some(o)) => Ok(Event::Stats { stats: Box::new(self.stats(o)) }),
                (Request::Call(call), Some(o)) => {
                    let o = o.clone();
                    match self.stream_call(&mut stream, &o, call) {
                        Ok(()) => continue,
                        Err(()) => return,
                    }
                }
            };
            let ev = answer.unwrap_or_else(Event::from);
            if send(&mut stream, &ev).is_err() {
                return;
            }
        }
    }

    /// Runs a call for a connection, streaming its events; `Err` when the client is gone.
    fn stream_call(&self, stream: &mut UnixStream, owner: &Owner, call: Call) -> Result<(), ()> {
        let cancel = Arc::new(AtomicBool::new(false));
        let rx = match self.submit(owner, call, Arc::clone(&cancel)) {
            Ok(rx) => rx,
            Err(r) => return send(stream, &r.into()).map_err(|_| ()),
        };
        loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(ev) => {
                    let last = matches!(ev, Event::Done { .. } | Event::Error { .. });
                    if send(stream, &ev).is_err() {
                        // The client is gone: the call stops at its next token; what it made
                        // stays in the context and is written out.
                        cancel.store(true, Ordering::SeqCst);
                        return Err(());
                    }
                    if last {
                        return Ok(());
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    if peer_gone(stream) {
                        cancel.store(true, Ordering::SeqCst);
                        return Err(());
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return Err(()),
            }
        }
    }
}

fn not_found(ctx: &str) -> Refusal {
    refuse(ErrorCode::NotFound, format!("no context {ctx:?} for this app"))
}

fn send(stream: &mut UnixStream, ev: &Event) -> Result<(), FrameError> {
    proto::write_frame(stream, &proto::encode(ev))
}

/// Waits until the socket has data (or the peer hung up: the read that follows sees it);
/// false on timeout.
fn readable(stream: &UnixStream, timeout: Duration) -> bool {
    let mut p = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    loop {
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&raw mut p, 1, ms) };
        if n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return n > 0;
        }
    }
}

/// Whether the peer hung up (without reading from the socket).
fn peer_gone(stream: &UnixStream) -> bool {
    let mut p = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&raw mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// The largest char boundary of `s` at or before `i`.
fn floor_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Bytes at the end of `text` that are the start of `stop` (they may yet become it).
fn held_back(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1)).rev().find(|&k| text.as_bytes().ends_with(&stop.as_bytes()[..k])).unwrap_or(0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

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
        let listener = bind_socket(&socket, mode)?;
        let s = Arc::clone(&svc);
        let thread = std::thread::spawn(move || s.serve(listener));
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
/// replacing a stale socket file but never a live service's.
pub fn bind_socket(path: &Path, mode: u32) -> Result<UnixListener> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
        }
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            bail!("another llmsd is listening on {}", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing the stale socket {}", path.display()))?;
    }
    let l = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;

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

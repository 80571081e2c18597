//! The call path, top to bottom: a call is queued ([`Service::submit`]); the worker, a
//! scheduler, admits it when the batch has room and its chunks fit in the budget beside the
//! running calls' ([`Service::admit`]); [`Service::start`] takes its context out of the
//! registry and brings its chunks back (mm `begin`: read or recompute as planned, then
//! pinned); [`Service::step`] runs one forward pass for every call in the batch (each decoding
//! call's next token, a piece of one prompt); [`Service::finish`] ends a call in mm (unpin,
//! AoT write, re-level, reclaim) and hands its turn to the syncer, which saves its context
//! (syncer.rs). The registry and mm are never locked while the model computes.

use std::any::Any;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use engine::model::Scratch;
use engine::{Sampler, SamplerConfig, Session, ThreadPool, Utf8Stream};
use mm::Strategy;
use tracing::{error, info, warn};

use super::ctxfile::Saved;
use super::history::History;
use super::{lock, ms, not_found, refuse, Owner, Refusal, Service};
use crate::kvmm::{code, SessionKv};
use crate::proto::{Call, CallStats, ErrorCode, Event};

pub(super) struct Job {
    owner: Owner,
    call: Call,
    /// The call's prompt as tokens (special tokens parsed only in a raw prompt), encoded on
    /// the caller's thread when it was queued: not on the worker, between other calls' steps
    /// (empty for a stateless call, whose history is encoded when its context is chosen).
    prompt_ids: Vec<u32>,
    received: Instant,
    /// When it first waited for memory (see `admit`).
    memory_since: Option<Instant>,
    events: Events,
    cancel: Arc<AtomicBool>,
    /// A stateless client's whole history: the worker chooses the context (`call.ctx` is
    /// unused) and prefills only what it lacks (history.rs).
    history: Option<History>,
}

/// Where a call's events go. A native connection's thread blocks on a thread channel; the
/// HTTP front's request task awaits a runtime channel, which the worker's send wakes directly
/// (no thread in between: one had forwarded every event, a wake-up more per token on a core
/// the pool's threads hold, and a blocking-pool thread per request). Neither is bounded: a
/// call sends at most its `max_tokens` events and its end.
#[derive(Clone)]
pub(super) enum Events {
    Thread(Sender<Event>),
    Task(tokio::sync::mpsc::UnboundedSender<Event>),
}

impl Events {
    /// `Err` when the receiver is gone (its client left).
    pub(super) fn send(&self, ev: Event) -> Result<(), ()> {
        match self {
            Self::Thread(tx) => tx.send(ev).map_err(drop),
            Self::Task(tx) => tx.send(ev).map_err(drop),
        }
    }
}

/// A finished call's turn for the syncer (syncer.rs), which saves it (its context file
/// written, [`Service::settle`]), makes the file durable and only then answers.
pub(super) struct SyncJob {
    pub ctx: String,
    /// The calling app (what fault injection keys on).
    pub app: String,
    pub events: Events,
    pub turn: Box<Turn>,
}

/// What [`Service::settle`] needs to save a call's turn, and the answer it gives.
pub(super) struct Turn {
    pub owner: Owner,
    pub made: bool,
    pub s: Session,
    pub before: Saved,
    pub saved: Saved,
    pub text: String,
    pub stats: CallStats,
}

/// The most tokens one forward pass runs (the engine's own split of a long `eval`).
const MAX_PASS: usize = 512;

/// Prompt tokens a pass on the prefill lane takes at most. A prompt on the lane holds it until
/// its pass ends (one prompt at a time), so a long one goes in passes this long and the
/// shortest prompt waiting takes the next: a short prompt waits at most one such pass (~0.1 s
/// on one thread here), where passes of 512 held it ~1 s. Each pass reads every weight once
/// (~6 ms on one thread), a tenth of a 64-token pass.
const LANE_PASS: usize = 64;

/// Steps a trace keeps at most (a few MB): a long run's trace stops growing, it does not fail.
const MAX_TRACE_STEPS: usize = 100_000;

/// What the worker did in one step (`Service::set_trace`): starting calls (loading their
/// contexts), one forward pass, and ending the calls that finished (mm's end, the context saved).
/// A running call's next token waits for all three, so a gap between a client's tokens is the
/// step that held it. Milliseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct StepTrace {
    /// When the step began, from when tracing was switched on.
    pub at_ms: f64,
    pub admit_ms: f64,
    pub started: u32,
    pub pass_ms: f64,
    /// Before the pass: the lane's call taken back or handed out, each decoding call's last
    /// token put in its context (a new chunk from mm every `chunk_tokens`), the pieces cut.
    pub prep_ms: f64,
    /// After the pass: the calls' logits taken (sampling, stop strings, the tokens sent).
    pub sample_ms: f64,
    /// Calls that decoded a token in the pass, and prompt tokens prefilled in it.
    pub decode_rows: u32,
    pub prefill_tokens: u32,
    /// `prefill_lane`: a prompt's pass on the lane that came back in this step (it ran beside
    /// this step's and the ones before), ms.
    pub lane_ms: f64,
    /// `prefill_lane`: the lane started a call put in line during this step's pass (1), its
    /// prompt's pass beside the pass's rest (`LaneGate`).
    pub lane_took: u32,
    pub finish_ms: f64,
    pub ended: u32,
}

/// The worker's pass times as a line over the rows in a pass, `ms = fixed + per_row x rows`
/// (reading the weights, then each row's arithmetic), fitted by least squares over recent
/// passes (older ones weigh less: the machine's speed drifts). Sizes prompt pieces.
#[derive(Debug, Default)]
struct PassCost {
    n: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl PassCost {
    /// Weight of the last pass against the ones before (about the last 50 count).
    const KEEP: f64 = 0.98;

    fn add(&mut self, rows: usize, ms: f64) {
        #[allow(clippy::cast_precision_loss)]
        let x = rows as f64;
        for (v, a) in [(&mut self.n, 1.0), (&mut self.x, x), (&mut self.y, ms), (&mut self.xx, x * x), (&mut self.xy, x * ms)] {
            *v = *v * Self::KEEP + a;
        }
    }

    /// (fixed, per_row) ms; None until passes of different sizes were seen.
    fn line(&self) -> Option<(f64, f64)> {
        let var = self.n * self.xx - self.x * self.x;
        if self.n < 2.0 || var <= 1e-9 * self.n * self.n {
            return None;
        }
        let per_row = (self.n * self.xy - self.x * self.y) / var;
        let fixed = (self.y - per_row * self.x) / self.n;
        (per_row > 0.0).then_some((fixed.max(0.0), per_row))
    }

    /// Prompt tokens a pass with `decoding` rows can carry so that it takes at most `hold`
    /// times a lone call's decode pass, between 1 and `most`.
    ///
    /// A lone call's pass, not the decoding rows' own: what a client feels is its gap between
    /// tokens against what it gets alone, and the rows' pass already grows with them. Held to
    /// twice the rows' pass, a piece beside one decoding call was 4 tokens (a 32-token prompt
    /// took 8 passes) and beside three 6-8, which put the TTFT p50 of 4 clients whose calls
    /// arrive apart at ~3x a lone call's; the same bound over the lone pass gives more tokens
    /// when few calls decode and fewer when many do, where the rows' pass is itself long.
    /// Many rows can take most of that bound by themselves (prompts then went in 1-4 tokens a
    /// pass, the TTFT p50 of 8 clients ~8x a lone call's at a hold of 3), so a pass may always
    /// take half again its rows' pass.
    fn piece(&self, decoding: usize, hold: f64, most: usize) -> usize {
        let Some((fixed, per_row)) = self.line() else { return most };
        #[allow(clippy::cast_precision_loss)]
        let rows = fixed + per_row * decoding as f64;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let fits = (((hold * (fixed + per_row)).max(1.5 * rows) - rows) / per_row).floor().max(0.0) as usize;
        fits.clamp(1, most)
    }
}

/// Prompt tokens the next pass carries: `left[i]` is call i's prompt tokens still to run
/// (None: it decodes), `decoding` the calls that decode, `piece` what fits beside them.
///
/// When no call decodes, only the shortest prompt (up to a pass's 512): prefill is
/// arithmetic that batching does not share (four prompts cost ~3.5x one here), so prompts
/// that arrive together (a convoy: their calls ended together) prefilled in one pass give
/// every caller its first token at ~3.5 prompts' time, and they end together again, round
/// after round. One at a time, the first caller has its token after one prompt's time, the
/// others' prompts go in pieces beside its decoding, and the calls end apart, so the next
/// round's prompts arrive apart and each runs beside the others' decoding.
///
/// Beside decoding calls, a prompt longer than what fits goes in as few passes as that allows,
/// in even pieces ([`even_piece`]).
fn pass_room(left: &[Option<usize>], decoding: usize, piece: impl FnOnce() -> (usize, usize)) -> usize {
    let shortest = left.iter().flatten().min().copied();
    if decoding > 0 {
        let (fits, most) = piece();
        return match shortest {
            Some(n) if n > fits => even_piece(n, fits, most),
            _ => fits,
        };
    }
    shortest.map_or(0, |n| n.clamp(1, MAX_PASS))
}

/// The next piece of a prompt with `left` tokens to go where a pass fits `fits` (at most
/// `most`): the prompt's rest in the fewest passes `fits` allows, the pieces even — or in one
/// pass fewer when that takes pieces at most a tenth over `fits`. A piece's size bounds the
/// others' gap in its pass, and the last piece of a prompt cut to `fits` was often a few
/// tokens (a 32-token prompt beside three decoding calls went 15 + 15 + 2: a whole third pass
/// for the caller's first token and a third long gap for the others, where 16 + 16 holds each
/// pass a few percent longer; cut 12 + 12 + 8, the first two gaps are longer than 11 + 11 + 10).
fn even_piece(left: usize, fits: usize, most: usize) -> usize {
    let fits = fits.max(1);
    if left <= fits {
        return left;
    }
    let passes = left.div_ceil(fits);
    let fewer = left.div_ceil(passes - 1);
    if fewer * 10 <= fits * 11 && fewer <= most {
        fewer
    } else {
        left.div_ceil(passes)
    }
}

/// How many prompt tokens each call feeds in a pass with `room` for them: `left[i]` is call
/// i's prompt tokens still to run (None: it decodes). Shortest first, each as much as is left
/// of the room.
fn prompt_pieces(left: &[Option<usize>], mut room: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..left.len()).filter(|&i| left[i].is_some()).collect();
    order.sort_by_key(|&i| left[i]);
    let mut take = vec![0; left.len()];
    for i in order {
        take[i] = left[i].unwrap_or(0).min(room);
        room -= take[i];
    }
    take
}

/// The steps traced since tracing was switched on.
#[derive(Debug)]
pub(super) struct Trace {
    pub(super) since: Instant,
    pub(super) steps: Vec<StepTrace>,
}

/// A call in the batch: its context out of the registry with its chunks pinned, its prompt
/// being prefilled (`next` is `None`) or its answer being decoded.
struct Active {
    job: Job,
    ctx: String,
    /// Made for this call (a stateless client's new or branched context): a failed call
    /// deletes it.
    made: bool,
    s: Session,
    /// The context as saved before the call (what a failure rolls back to), and as it will
    /// be saved after it.
    before: Saved,
    saved: Saved,
    stats: CallStats,
    /// The prompt's tokens, and how many of them have run.
    ids: Vec<u32>,
    fed: usize,
    sampler: Sampler,
    /// Chunk memory it keeps pinned while it runs (admission's estimate).
    reserved: usize,
    t_prefill: Instant,
    t_decode: Instant,
    /// The token sampled and not yet run.
    next: Option<u32>,
    out: Output,
}

/// A call's answer so far.
#[derive(Default)]
struct Output {
    utf8: Utf8Stream,
    text: String,
    bytes: Vec<u8>,
    /// `text`'s length before the last token's piece.
    before: usize,
    /// Bytes of `text` streamed.
    sent: usize,
    n_out: u32,
    /// The last sampled token completed a stop string (`text` is cut before it): the call
    /// ends once that token has run.
    stopped: bool,
}

/// How a call left the batch.
enum Outcome {
    Done,
    Failed(Refusal),
    /// Its context is quarantined.
    Panicked(String),
}

/// `prefill_lane`: the threads split in two while a prompt joins calls that decode, and
/// what the worker and the lane's thread share.
///
/// The decoding calls' passes beside the lane run on the service's pool with the lane's
/// share of its workers lent ([`ThreadPool::lend`]), not on a pool of their own: the lane's
/// thread gives them back as its pass ends, so the worker's pass in flight takes the whole
/// machine again from its next operation. On a pool of its own (as until 2026-12-06) that
/// pass ran its rest on one thread beside an idle core, and the call back from the lane
/// waited for it and then a whole step for its second token: the longest gaps of 4 clients'
/// streams (docs/notes/llmsd.md, "The lane's call back in the batch").
pub(super) struct Lanes {
    /// The prompt's share of the threads, the lane's own.
    pub(super) prompt: Arc<ThreadPool>,
    gate: LaneGate,
}

impl Lanes {
    pub(super) fn new(prompt: Arc<ThreadPool>) -> Self {
        Self { prompt, gate: LaneGate::default() }
    }
}

/// The lane's thread and the worker meet here: the worker hands it a call's prompt (`job`),
/// and while the worker's pass runs on all the threads with the lane idle, the gate is
/// `open` with the batch that pass holds: a call put in line meanwhile (`poke`) is started
/// by the lane's thread itself, within the batch's limits, and prefilled at once on the
/// lane's share of the threads, the pass in flight giving up those cores
/// ([`ThreadPool::lend`]). A call sent the moment its last one ended (an app's next turn)
/// used to wait in line for the whole pass in flight, ~7 ms of its ~60 ms first token at 4
/// clients (docs/notes/llmsd.md). The worker takes note of the call at the pass's end
/// (`close`); until then no one else starts a call.
#[derive(Default)]
struct LaneGate {
    st: Mutex<GateState>,
    cv: Condvar,
}

#[derive(Default)]
struct GateState {
    job: Option<LaneJob>,
    /// The worker's pass in flight with the lane idle: the batch it holds.
    open: Option<BatchView>,
    /// A call was put in line since the lane last looked.
    poked: bool,
    /// The lane's thread is choosing from the line: `close` waits for it.
    picking: bool,
    /// The call the lane started by itself (context, pinned bytes), for the worker.
    taken: Option<(String, usize)>,
    /// The worker is gone: the lane's thread ends.
    shut: bool,
}

/// What admission needs of the worker's batch (`Service::admit`'s rules, for the lane).
#[derive(Clone)]
struct BatchView {
    ctxs: Vec<String>,
    owners: Vec<Owner>,
    pinned: usize,
    /// The batch has room for one more call (below `max_batch`): without it a call put in
    /// line lends no cores, for the lane could not take it.
    room: bool,
}

/// What the lane's thread does next.
enum LaneWork {
    Job(Box<LaneJob>),
    Pick(BatchView),
}

impl LaneGate {
    /// The worker's pass on all the threads is starting and the lane is idle.
    fn open(&self, view: BatchView, pool: &ThreadPool, lend: usize) {
        let mut g = lock(&self.st);
        let room = view.room;
        g.open = Some(view);
        if g.poked && room && !g.shut {
            pool.lend(lend);
            self.cv.notify_all();
        }
    }

    /// The pass has ended: the call the lane started meanwhile, if it did. Without one, cores
    /// lent for a call put in line go back (the lane's thread may not have woken before the
    /// pass ended: the worker's admission takes that call now).
    fn close(&self, pool: &ThreadPool) -> Option<(String, usize)> {
        let mut g = lock(&self.st);
        g.open = None;
        while g.picking {
            g = self.cv.wait(g).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        g.poked = false;
        let taken = g.taken.take();
        if taken.is_none() {
            pool.lend(0);
        }
        taken
    }

    /// A call was put in line: an open gate lends the pass's cores to the lane at once (the
    /// lane's thread is to run on them) and wakes it.
    fn poke(&self, pool: &ThreadPool, lend: usize) {
        let mut g = lock(&self.st);
        g.poked = true;
        if g.open.as_ref().is_some_and(|v| v.room) && g.taken.is_none() && !g.shut {
            pool.lend(lend);
            self.cv.notify_all();
        }
    }

    fn send(&self, job: LaneJob) {
        lock(&self.st).job = Some(job);
        self.cv.notify_all();
    }

    /// The worker is gone, or the lane's thread (it cannot panic outside its passes' catch,
    /// but if it did, the worker must not wait for its choice nor lend it cores).
    fn shut(&self) {
        let mut g = lock(&self.st);
        g.shut = true;
        g.picking = false;
        self.cv.notify_all();
    }

    fn is_shut(&self) -> bool {
        lock(&self.st).shut
    }

    /// The lane's next work; None once the worker is gone.
    fn next(&self) -> Option<LaneWork> {
        let mut g = lock(&self.st);
        loop {
            if let Some(j) = g.job.take() {
                return Some(LaneWork::Job(Box::new(j)));
            }
            if g.shut {
                return None;
            }
            if g.poked && g.taken.is_none() && g.open.as_ref().is_some_and(|v| v.room) {
                if let Some(view) = g.open.clone() {
                    g.poked = false;
                    g.picking = true;
                    return Some(LaneWork::Pick(view));
                }
            }
            g = self.cv.wait(g).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// The lane's choice: a call it started (it holds `taken` until the worker's `close`), or
    /// none (the lent cores go back).
    fn picked(&self, taken: Option<(String, usize)>, pool: &ThreadPool) {
        let mut g = lock(&self.st);
        g.picking = false;
        if taken.is_none() {
            pool.lend(0);
        }
        g.taken = taken;
        self.cv.notify_all();
    }
}

/// The worker's side of the lane: its call, and the lane thread's answers.
struct Lane<'a> {
    lanes: &'a Lanes,
    done: Receiver<LaneDone>,
    /// The call on the lane: its context and the chunk memory it keeps pinned (admission
    /// counts both as a call in the batch).
    busy: Option<(String, usize)>,
    /// Its thread is gone (cannot happen: it catches its passes' panics); prompts then go in
    /// pieces beside the decoding calls.
    gone: bool,
}

impl Drop for Lane<'_> {
    fn drop(&mut self) {
        self.lanes.gate.shut();
    }
}

struct LaneJob {
    a: Active,
    piece: Vec<u32>,
}

/// The lane's call after its pass, its logits taken (`Service::after_pass`): how it ended, if
/// it did. None: a call the lane started that could not start (answered there).
struct LaneDone {
    a: Option<Active>,
    ended: Option<Outcome>,
    ms: f64,
}

impl Lane<'_> {
    fn calls(&self) -> usize {
        usize::from(self.busy.is_some())
    }
    fn holds(&self, ctx: &str) -> bool {
        self.busy.as_ref().is_some_and(|(c, _)| c == ctx)
    }
    fn reserved(&self) -> usize {
        self.busy.as_ref().map_or(0, |b| b.1)
    }
}

impl Service {
    /// Queues a call; its events arrive on the returned channel.
    pub(super) fn submit(&self, owner: &Owner, call: Call, cancel: Arc<AtomicBool>) -> Result<Receiver<Event>, Refusal> {
        let (tx, rx) = mpsc::channel();
        self.enqueue(owner, call, cancel, None, Events::Thread(tx))?;
        Ok(rx)
    }

    /// Queues a stateless client's call: its history goes to the context that holds the
    /// longest prefix of it, or to a new one; the choice is sent on `history.chosen` before
    /// any event. Its events arrive on the returned channel, for an async task.
    pub(super) fn submit_history(
        &self,
        owner: &Owner,
        call: Call,
        history: History,
        cancel: Arc<AtomicBool>,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<Event>, Refusal> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.enqueue(owner, call, cancel, Some(history), Events::Task(tx))?;
        Ok(rx)
    }

    fn enqueue(&self, owner: &Owner, call: Call, cancel: Arc<AtomicBool>, history: Option<History>, events: Events) -> Result<(), Refusal> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(refuse(ErrorCode::ShuttingDown, "the service is stopping"));
        }
        {
            let reg = lock(&self.registry);
            self.check_disk(&reg, owner)?;
            let pinned = history.as_ref().and_then(|h| h.pin.as_ref());
            let named = if history.is_some() { pinned } else { Some(&call.ctx) };
            if let Some(ctx) = named {
                match reg.get(ctx) {
                    Some(e) if e.saved.owner == *owner => {
                        if let Some(why) = &e.unavailable {
                            return Err(unavailable(ctx, why));
                        }
                        // A stateless client that names a context in a call is told so now
                        // (it has the history; it may retry or drop the pin). A native call
                        // on a busy context waits its turn, as documented.
                        if pinned.is_some() && e.session.is_none() {
                            return Err(refuse(ErrorCode::Busy, format!("context {ctx} is in a call")));
                        }
                    }
                    _ => return Err(not_found(ctx)),
                }
            }
        }
        // A call that may generate nothing would still add its prompt (and, as it was, one
        // sampled token) to the context: a turn without an answer is refused.
        if call.max_tokens == 0 {
            return Err(refuse(ErrorCode::BadRequest, "max_tokens must be at least 1"));
        }
        if call.max_tokens as usize + 2 > self.cfg.max_context_tokens / 2 {
            return Err(refuse(ErrorCode::BadRequest, format!("max_tokens must be at most {}", self.cfg.max_context_tokens / 2 - 2)));
        }
        if !(call.temperature.is_finite() && (0.0..=10.0).contains(&call.temperature)) {
            return Err(refuse(ErrorCode::BadRequest, "temperature must be between 0 and 10"));
        }
        if call.top_p.is_some_and(|p| !(p.is_finite() && p > 0.0 && p <= 1.0)) {
            return Err(refuse(ErrorCode::BadRequest, "top_p must be in (0, 1]"));
        }
        if call.stop.len() > 16 || call.stop.iter().any(|s| s.is_empty() || s.len() > 256) {
            return Err(refuse(ErrorCode::BadRequest, "stop: at most 16 non-empty strings of at most 256 bytes"));
        }
        let prompt_ids = match history {
            Some(_) => Vec::new(),
            None => self.model.tokenizer.encode(&call.prompt, false, call.raw).map_err(|e| refuse(ErrorCode::BadRequest, e.to_string()))?,
        };
        let mut q = lock(&self.queue);
        // Calls whose callers went away hold no place.
        q.retain(|j| !j.cancel.load(Ordering::SeqCst));
        if q.len() >= self.cfg.max_queue {
            return Err(refuse(ErrorCode::TooMany, format!("{} calls are waiting, the maximum (max_queue); try later", q.len())));
        }
        let theirs = q.iter().filter(|j| j.owner.shares_quota(owner)).count();
        if theirs >= self.cfg.max_queued_per_uid {
            return Err(refuse(
                ErrorCode::TooMany,
                format!("{} has {theirs} calls waiting, its maximum (max_queued_per_uid); try later", owner.quota_name()),
            ));
        }
        q.push_back(Job { owner: owner.clone(), call, prompt_ids, received: Instant::now(), memory_since: None, events, cancel, history });
        self.queued.notify_one();
        drop(q);
        if let Some(l) = &self.lanes {
            l.gate.poke(&self.pool, l.prompt.threads());
        }
        super::fault_point("enqueue", &owner.app);
        Ok(())
    }

    /// The inference worker, a scheduler over the shared model: the calls it runs share each
    /// forward pass (up to `max_batch` of them), so the weights are read once per step for all;
    /// a call joins between steps when its chunks fit in the budget beside the running calls'
    /// (it waits otherwise, and says so in its stats); a prompt is prefilled in pieces of
    /// `prefill_piece` tokens inside the others' decode steps (whole when nothing decodes); a
    /// call that ends leaves at once. Runs until the service stops and its calls have ended.
    pub(super) fn worker(&self) {
        // The pool's participant 0: a long slice as its other threads (crate::sched).
        crate::sched::long_slice_or_warn();
        let mut scratch = Scratch::default();
        let mut active: Vec<Active> = Vec::new();
        let mut cost = PassCost::default();
        std::thread::scope(|sc| {
            let mut lane = self.lanes.as_ref().and_then(|lanes| {
                let (done_tx, done) = mpsc::channel::<LaneDone>();
                // Named, so `ps -L`, `perf` and /proc tell it from the worker that spawned it.
                let spawned = std::thread::Builder::new().name("llmsd-lane".into()).spawn_scoped(sc, move || {
                    crate::sched::long_slice_or_warn();
                    // However the thread ends, the gate is shut and the lent cores given back.
                    struct Exit<'a>(&'a Lanes, &'a ThreadPool);
                    impl Drop for Exit<'_> {
                        fn drop(&mut self) {
                            self.0.gate.shut();
                            self.1.lend(0);
                        }
                    }
                    let _exit = Exit(lanes, &self.pool);
                    // The lane's own scratch, between its passes.
                    let mut scratch = Scratch::default();
                    while let Some(work) = lanes.gate.next() {
                        let d = match work {
                            LaneWork::Job(j) => self.lane_pass(lanes, j.a, j.piece, &mut scratch),
                            LaneWork::Pick(view) => match self.lane_start(lanes, &view, &mut scratch) {
                                Some(d) => d,
                                None => continue,
                            },
                        };
                        // The cores lent for the lane (by `lane_out`, or for a call it started)
                        // go back with its pass: the worker's pass in flight takes them at its
                        // next operation (`Lanes`).
                        self.pool.lend(0);
                        if done_tx.send(d).is_err() {
                            break;
                        }
                    }
                });
                match spawned {
                    Ok(_) => Some(Lane { lanes, done, busy: None, gone: false }),
                    Err(e) => {
                        // Without its thread the gate never opens: prompts go in pieces.
                        error!("the prefill lane's thread did not start ({e}); prompts go in pieces beside decoding calls");
                        lanes.gate.shut();
                        None
                    }
                }
            });
            loop {
                let t0 = Instant::now();
                // (A call on the lane is in the batch as much as one in `active`.)
                let in_batch = |active: &Vec<Active>, lane: &Option<Lane>| active.len() + lane.as_ref().map_or(0, Lane::calls);
                let running = in_batch(&active, &lane);
                if !self.admit(&mut active, &mut scratch, lane.as_ref()) {
                    break;
                }
                let admit_ms = ms(t0.elapsed());
                let mut st = self.step(&mut active, &mut scratch, &mut cost, lane.as_mut());
                if let Some(trace) = lock(&self.trace).as_mut() {
                    st.at_ms = ms(t0.duration_since(trace.since));
                    st.admit_ms = admit_ms;
                    st.started = u32::try_from((in_batch(&active, &lane) + st.ended as usize).saturating_sub(running)).unwrap_or(u32::MAX);
                    if trace.steps.len() < MAX_TRACE_STEPS {
                        trace.steps.push(st);
                    }
                }
            }
            // Dropping the lane shuts its gate: its thread ends and the scope joins it.
        });
    }

    /// Starts queued calls while the batch has room and their memory fits; blocks while
    /// nothing runs and nothing waits. False once the service stops with nothing running.
    fn admit(&self, active: &mut Vec<Active>, scratch: &mut Scratch, lane: Option<&Lane>) -> bool {
        // The call on the lane counts as one in the batch.
        let on_lane = lane.map_or(0, Lane::calls);
        loop {
            let (at, mut job) = {
                let mut q = lock(&self.queue);
                loop {
                    if self.stopping.load(Ordering::SeqCst) {
                        for j in q.drain(..) {
                            let _ = j.events.send(Event::error(ErrorCode::ShuttingDown, "the service is stopping"));
                        }
                        return !active.is_empty() || on_lane > 0;
                    }
                    if active.len() + on_lane >= self.cfg.max_batch.max(1) {
                        return true;
                    }
                    // A call whose caller went away before it started is dropped unanswered.
                    q.retain(|j| !j.cancel.load(Ordering::SeqCst));
                    let pick = self.first_startable(
                        &q,
                        |c| active.iter().any(|a| a.ctx == *c) || lane.is_some_and(|l| l.holds(c)),
                        |o| active.iter().filter(|a| a.job.owner.shares_quota(o)).count(),
                    );
                    if let Some(i) = pick {
                        break (i, q.remove(i).expect("in the queue"));
                    }
                    if !active.is_empty() || on_lane > 0 {
                        return true;
                    }
                    q = self.queued.wait(q).unwrap_or_else(std::sync::PoisonError::into_inner);
                }
            };
            // Outside the queue's lock: `stats` takes mm's before the queue's.
            let reserved = self.estimate(&job);
            let pinned: usize = active.iter().map(|a| a.reserved).sum::<usize>() + lane.map_or(0, Lane::reserved);
            if (!active.is_empty() || on_lane > 0) && pinned + reserved > lock(&self.mm).budget() {
                // It waits for memory where it was in line, and the calls behind it with it.
                let first = job.memory_since.is_none();
                job.memory_since.get_or_insert_with(Instant::now);
                let mut q = lock(&self.queue);
                let at = at.min(q.len());
                q.insert(at, job);
                drop(q);
                if first {
                    lock(&self.metrics).memory_waits += 1;
                }
                return true;
            }
            let memory_wait = job.memory_since.map_or(0.0, |t| ms(t.elapsed()));
            if let Some(a) = self.start(job, scratch, reserved, memory_wait) {
                active.push(a);
            }
        }
    }

    /// Where the first call in line that can start is: calls on one context run one after the
    /// other, so a call whose context is in the batch (`in_batch`) waits for it (or its last
    /// answer waits for its file's sync: syncer.rs); and a uid holding half the batch (`held`:
    /// its calls in it) yields to other uids' calls in line: one app's long calls cannot keep
    /// everyone else out of the model.
    fn first_startable(&self, q: &VecDeque<Job>, in_batch: impl Fn(&String) -> bool, held: impl Fn(&Owner) -> usize) -> Option<usize> {
        let waits = |j: &Job| {
            let ctx = match &j.history {
                None => Some(&j.call.ctx),
                Some(h) => h.pin.as_ref(),
            };
            ctx.is_some_and(|c| in_batch(c) || self.sync.waits(c))
        };
        let share = self.cfg.max_batch.max(1).div_ceil(2);
        q.iter().position(|j| !waits(j) && held(&j.owner) < share).or_else(|| q.iter().position(|j| !waits(j)))
    }

    /// The lane's thread takes the call [`Service::admit`] would take next, were the batch of
    /// the pass in flight (`view`) at its end: none while the batch is full, when it would wait
    /// for memory (it does so on the worker, in line), or when it is a stateless client's (its
    /// context is chosen on the worker).
    fn lane_pick(&self, view: &BatchView) -> Option<(Job, usize)> {
        if self.stopping.load(Ordering::SeqCst) || !view.room {
            return None;
        }
        let (at, job) = {
            let mut q = lock(&self.queue);
            q.retain(|j| !j.cancel.load(Ordering::SeqCst));
            let i = self.first_startable(&q, |c| view.ctxs.contains(c), |o| view.owners.iter().filter(|x| x.shares_quota(o)).count())?;
            if q[i].history.is_some() {
                return None;
            }
            (i, q.remove(i)?)
        };
        // Outside the queue's lock, as in `admit`.
        let reserved = self.estimate(&job);
        if view.pinned + reserved > lock(&self.mm).budget() {
            let mut q = lock(&self.queue);
            let at = at.min(q.len());
            q.insert(at, job);
            return None;
        }
        Some((job, reserved))
    }

    /// On the lane's thread, with the gate open: starts the next call in line ([`Service::lane_pick`])
    /// and prefills its prompt's first pass on the lane's threads, the cores lent by the pass
    /// in flight ([`LaneGate`]). None: nothing could start.
    fn lane_start(&self, lanes: &Lanes, view: &BatchView, scratch: &mut Scratch) -> Option<LaneDone> {
        let picked = self.lane_pick(view);
        lanes.gate.picked(picked.as_ref().map(|(j, r)| (j.call.ctx.clone(), *r)), &self.pool);
        let (job, reserved) = picked?;
        // (Lent already when the call was put in line; again, for one that was in line first.)
        // Nothing runs here until the lent workers are out of the pass's job in flight.
        self.pool.lend(lanes.prompt.threads());
        self.pool.wait_lent();
        let Some(a) = self.start(job, scratch, reserved, 0.0) else {
            // Answered where it failed to start.
            return Some(LaneDone { a: None, ended: None, ms: 0.0 });
        };
        lock(&self.metrics).lane_starts += 1;
        match self.lane_piece(&a) {
            Some(piece) => Some(self.lane_pass(lanes, a, piece, scratch)),
            // Nothing to prefill, or what a pass would refuse: the batch takes it (as `lane_out`).
            None => Some(LaneDone { a: Some(a), ended: None, ms: 0.0 }),
        }
    }

    /// The next piece of a call's prompt for the lane (all of it, or [`LANE_PASS`] tokens):
    /// none when it has no prompt left, or a pass would refuse the piece (it stays in the
    /// batch, where the pass fails it).
    fn lane_piece(&self, a: &Active) -> Option<Vec<u32>> {
        let piece = &a.ids[a.fed.min(a.ids.len())..a.ids.len().min(a.fed + LANE_PASS)];
        (a.next.is_none() && !self.refuses(a, piece)).then(|| piece.to_vec())
    }

    /// Whether a pass would refuse `piece` for call `a`: empty, past its context's capacity,
    /// or a token outside the vocabulary.
    fn refuses(&self, a: &Active, piece: &[u32]) -> bool {
        let vocab = self.model.config.vocab;
        piece.is_empty() || a.s.n_past() + piece.len() > a.s.kv.capacity() || piece.iter().any(|&t| t as usize >= vocab)
    }

    /// A prompt's pass on the lane's share of the threads. The call takes its logits here, as a
    /// call of the worker's pass does there: a prompt that is in samples its first token and
    /// streams it now, not once the worker's pass in flight ends (its caller's wait).
    fn lane_pass(&self, lanes: &Lanes, mut a: Active, piece: Vec<u32>, scratch: &mut Scratch) -> LaneDone {
        let from = a.s.n_past();
        let t = Instant::now();
        let run = {
            // A pass for mm's AoT writer as the worker's are (they may overlap).
            let _pass = self.passes.as_deref().map(mm::gate::PassGate::pass);
            catch_unwind(AssertUnwindSafe(|| {
                let refs = [piece.as_slice()];
                let r = Session::step_batch_on(&lanes.prompt, &mut [&mut a.s], &refs, scratch).map(<[f32]>::len);
                injected_fault(&refs);
                r
            }))
        };
        let ms = ms(t.elapsed());
        if matches!(run, Ok(Ok(_))) {
            a.stats.lane_tokens += u32::try_from(piece.len()).unwrap_or(u32::MAX);
        }
        let mut ended = Vec::new();
        self.after_pass(std::slice::from_mut(&mut a), &[0], &[piece], &[from], run, scratch, 1, &mut ended);
        LaneDone { a: Some(a), ended: ended.pop().map(|(_, how)| how), ms }
    }

    /// Bytes of chunk memory a queued call will keep pinned while it runs, at most: its
    /// context's chunks and new ones for its prompt (a token is at least a byte of text) and
    /// answer, within the context window.
    fn estimate(&self, j: &Job) -> usize {
        const MARKUP: usize = 16;
        let (mm_id, positions) = match &j.history {
            Some(h) => (u64::MAX, h.ids.len()),
            None => lock(&self.registry)
                .get(&j.call.ctx)
                .map_or((u64::MAX, 0), |e| (e.saved.mm_id, e.saved.tokens.len() + e.saved.pending.len() + j.call.prompt.len())),
        };
        let positions = (positions + MARKUP + j.call.max_tokens as usize).min(self.cfg.max_context_tokens);
        lock(&self.mm).call_bytes(mm_id, positions)
    }

    /// Takes a call from the queue to the batch: its context is chosen and taken out of the
    /// registry, its chunks loaded and pinned, its prompt encoded. A call that cannot start is
    /// answered here.
    fn start(&self, job: Job, scratch: &mut Scratch, reserved: usize, memory_wait_ms: f64) -> Option<Active> {
        let t0 = Instant::now();
        // The job goes into the call; its answer channel stays here for a call that cannot start.
        let (events, named) = (job.events.clone(), job.call.ctx.clone());
        match catch_unwind(AssertUnwindSafe(|| self.begin_call(job, t0, scratch, reserved))) {
            Ok(Ok(mut a)) => {
                a.stats.memory_wait_ms = memory_wait_ms;
                a.stats.queue_ms = ms(t0.duration_since(a.job.received));
                Some(a)
            }
            Ok(Err(r)) => {
                self.prom.failed();
                let _ = events.send(r.into());
                None
            }
            Err(panic) => {
                let what = panic_message(panic.as_ref());
                error!(ctx = %named, "a call panicked outside the model: {what}");
                *scratch = Scratch::default();
                self.prom.failed();
                // What panicked is for the log, not for a client (nor another app's).
                let _ = events.send(Event::error(ErrorCode::Failed, "the call failed inside the service (its log says why)"));
                None
            }
        }
    }

    /// The call's context, out of the registry and ready: see [`Service::prepare`].
    fn begin_call(&self, job: Job, t0: Instant, scratch: &mut Scratch, reserved: usize) -> Result<Active, Refusal> {
        // A stateless client's call: which context, and what it lacks.
        let (ctx, given, made, chosen) = match &job.history {
            None => (job.call.ctx.clone(), None, false, None),
            Some(h) => {
                let (chosen, ids) = self.resolve(&job.owner, h)?;
                let ctx = chosen.ctx.clone();
                let made = chosen.how != "continued";
                self.prom.cached(chosen.cached_tokens);
                (ctx, Some(ids), made, Some(chosen))
            }
        };
        // A context made for this call goes if anything below unwinds before the call owns it
        // (the paths that return deal with it themselves).
        let guard = Made { svc: self, owner: &job.owner, ctx: made.then(|| ctx.clone()) };
        super::fault_point("begin", &job.owner.app);
        let taken = {
            let mut reg = lock(&self.registry);
            match reg.get_mut(&ctx) {
                Some(e) if e.saved.owner == job.owner => match (&e.unavailable, e.session.take()) {
                    (Some(why), _) => Err(unavailable(&ctx, why)),
                    (None, None) => Err(refuse(ErrorCode::Busy, "the context is in a call")),
                    (None, Some(s)) => Ok((s, e.saved.clone())),
                },
                _ => Err(not_found(&ctx)),
            }
        };
        // On a refusal the guard deletes a context made for the call.
        let (mut s, before) = taken?;
        // The caller learns its context only now that it is out of the registry: told before,
        // it could pin it in a next request that found it idle, and waited in line for this
        // call to end (200 after it) instead of being told it is busy (409).
        if let (Some(h), Some(chosen)) = (&job.history, chosen) {
            let _ = h.chosen.send(chosen);
        }
        guard.disarm();
        let mut saved = before.clone();
        s.set_scratch(std::mem::take(scratch));
        // A panic in the call (a bug, or data that got past validation) must not take the
        // worker with it: the call fails, its context is quarantined as it was before the call
        // (its saved state is not touched), and the service goes on with the others.
        let r = catch_unwind(AssertUnwindSafe(|| self.prepare(&job, given, &mut s, &mut saved, t0)));
        *scratch = s.take_scratch();
        match r {
            Ok(Ok((ids, stats, sampler))) => Ok(Active {
                job,
                ctx,
                made,
                s,
                before,
                saved,
                stats,
                ids,
                fed: 0,
                sampler,
                reserved,
                t_prefill: Instant::now(),
                t_decode: Instant::now(),
                next: None,
                out: Output::default(),
            }),
            Ok(Err(e)) => Err(self.settle(&job.owner, &ctx, made, s, before, saved, Err(e)).expect_err("failed")),
            Err(panic) => {
                let r = self.quarantine(&ctx, Some(s), saved.mm_id, &panic_message(panic.as_ref()));
                if made {
                    let _ = self.del_ctx(&job.owner, &ctx);
                }
                Err(r)
            }
        }
    }

    /// A call's end in the registry. A call is atomic: its turn is in the context once the
    /// context file holding it is on disk, and only then acknowledged (a cancelled call keeps
    /// what it made). A call that failed anywhere (a full disk included) leaves the context as
    /// it was before it; a context made for a failed call goes.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn settle(
        &self,
        owner: &Owner,
        ctx: &str,
        made: bool,
        s: Session,
        before: Saved,
        mut saved: Saved,
        r: Result<(String, CallStats), Refusal>,
    ) -> Result<(String, CallStats), Refusal> {
        let r = r.and_then(|mut out| {
            // Told once, in the first answer after it was restored: the context is right again.
            out.1.notice = std::mem::take(&mut saved.notice);
            saved.tokens.clone_from(&s.tokens);
            if let Some(a) = &s.attention {
                saved.attention_sum.clone_from(&a.sum);
                saved.attention_count.clone_from(&a.count);
            }
            saved.calls += 1;
            saved.last_used = super::history::now_ms();
            // Whole in the page cache once renamed; durable once the syncer is done with it,
            // and only then is the call answered (`finish`, syncer.rs).
            super::ctxfile::write_as(&self.ctx_dir, &saved, false)
                .map_err(|e| refuse(ErrorCode::Failed, format!("saving the context: {}", crate::describe(&e))))?;
            Ok(out)
        });
        let (session, saved, unusable) = match &r {
            Ok(_) => {
                self.refill.set_tokens(saved.mm_id, &saved.tokens);
                (Some(s), saved, None)
            }
            Err(e) => {
                warn!(ctx, "call failed, the context is rolled back to before it: {}", e.1);
                drop(s);
                match self.roll_back(&before) {
                    Ok(s) => (Some(s), before, None),
                    Err(why) => {
                        warn!(ctx, "the context cannot be rolled back: {why}");
                        (None, before, Some(why))
                    }
                }
            }
        };
        let ok = r.is_ok();
        if let Some(e) = lock(&self.registry).get_mut(ctx) {
            e.session = session;
            e.saved = saved;
            e.unavailable = unusable;
        }
        if !ok && made {
            let _ = self.del_ctx(owner, ctx);
        }
        let out = r?;
        let mut m = lock(&self.metrics);
        m.calls += 1;
        m.switch_ms.push_back(out.1.switch_ms);
        if m.switch_ms.len() > 4096 {
            m.switch_ms.pop_front();
        }
        Ok(out)
    }

    /// The context as it was saved before a failed call: mm forgets its memory and reopens
    /// its records for the saved tokens (records the call wrote for other tokens do not match
    /// and are recomputed at the next call).
    fn roll_back(&self, before: &Saved) -> Result<Session, String> {
        let mut mm = lock(&self.mm);
        match mm.close(before.mm_id) {
            Ok(()) | Err(mm::MmError::NoContext(_)) => {}
            Err(e) => return Err(format!("damaged: rolling back a failed call: {e}")),
        }
        self.reopen(&mut mm, before)
    }

    /// After a call panicked: unpins what mm can, marks the context unavailable (its data
    /// kept, its owner told why, deletable) and says so.
    pub(super) fn quarantine(&self, ctx: &str, s: Option<Session>, mm_id: u64, what: &str) -> Refusal {
        // Its memory goes (the session may be half-way through anything); its records stay.
        drop(s);
        let _ = catch_unwind(AssertUnwindSafe(|| lock(&self.mm).close(mm_id)));
        let why = "damaged: a call failed inside the service (its log says why); quarantined — delete it".to_string();
        error!(ctx, "call panicked; the context is quarantined and the service goes on: {what}");
        if let Some(e) = lock(&self.registry).get_mut(ctx) {
            e.unavailable = Some(why.clone());
        }
        unavailable(ctx, &why)
    }

    /// Before a call's first forward pass: its new tokens (a sliding window makes room for
    /// them), its chunks back (read or recomputed as the planner says) and pinned, slots for
    /// its prompt, its sampler. On an error after the load, mm ends the call.
    fn prepare(
        &self,
        job: &Job,
        given: Option<Vec<u32>>,
        s: &mut Session,
        saved: &mut Saved,
        start: Instant,
    ) -> Result<(Vec<u32>, CallStats, Sampler), Refusal> {
        let fail = |e: &dyn std::fmt::Display| refuse(ErrorCode::Failed, e.to_string());
        let c = &job.call;
        let stateless = given.is_some();
        let mut ids = match given {
            Some(ids) => ids,
            None => self.native_ids(job, s, saved)?,
        };
        if ids.is_empty() {
            return Err(refuse(ErrorCode::BadRequest, "the call adds no tokens (an empty raw prompt)"));
        }
        if s.n_past() == 0 {
            saved.keep = ids.len().min(self.cfg.keep_tokens);
        }
        let mm_id = saved.mm_id;
        let mut stats = CallStats { prompt_tokens: u32::try_from(ids.len()).unwrap_or(u32::MAX), ..CallStats::default() };

        // Sliding window: the context's start and its most recent tokens stay; the cache is
        // rebuilt from them (the dropped middle changes every later position). As llama.cpp's
        // context shift, half of what could stay after `keep` is dropped, not just enough for
        // this call: the rebuild is paid once per half window of turns, not at every call.
        let room = self.cfg.max_context_tokens - c.max_tokens as usize - 1;
        if stateless && s.n_past() + ids.len() > room {
            // A stateless client sent the history itself: dropping part of it would answer
            // another conversation than the one it sent.
            return Err(refuse(
                ErrorCode::TooLong,
                format!(
                    "the conversation is {} tokens and max_tokens {}: over this service's max_context_tokens {}",
                    s.n_past() + ids.len(),
                    c.max_tokens,
                    self.cfg.max_context_tokens
                ),
            ));
        }
        if s.n_past() + ids.len() > room {
            let keep = saved.keep.min(s.n_past());
            if keep + ids.len() > room {
                // The prompt alone is too long: its end is kept.
                let cut = keep + ids.len() - room;
                ids.drain(..cut.min(ids.len()));
            }
            let tail = (room.saturating_sub(keep + ids.len()) / 2).min(s.n_past() - keep);
            let mut kept: Vec<u32> = s.tokens[..keep].to_vec();
            kept.extend_from_slice(&s.tokens[s.n_past() - tail..]);
            stats.slid_tokens = u32::try_from(s.n_past() - kept.len()).unwrap_or(u32::MAX);
            kept.extend_from_slice(&ids);
            ids = kept;
            let mut mm = lock(&self.mm);
            mm.delete(mm_id).map_err(|e| fail(&e))?;
            mm.set_scope(mm_id, self.scope(&saved.owner));
            mm.create(mm_id).map_err(|e| fail(&e))?;
            let scratch = s.take_scratch();
            *s = self.session();
            s.set_scratch(scratch);
        }

        // A context that holds nothing yet takes the chunks of its prompt's start that its
        // app already holds (a shared system prompt, a conversation branched): they are not
        // computed again, nor are the rows after them that a context of the app holds in its
        // next chunk (copied: that chunk is each one's own). The last prompt token is always
        // computed (its logits are the call's).
        if s.n_past() == 0 && self.cfg.prefix_sharing {
            let ct = self.cfg.chunk_tokens;
            let scope = self.scope(&saved.owner);
            let head = &ids[..ids.len() - 1];
            let mut mm = lock(&self.mm);
            let full = mm.cached_prefix(scope, head);
            if full > 0 {
                let rows = mm.partial_prefix(scope, head, full, code(s.kv.base()));
                let k = full * ct + rows;
                s.tokens = ids[..k].to_vec();
                let shared = mm.restore(mm_id, &mut SessionKv(s)).map_err(|e| fail(&e))?;
                // Rows not copied (the source went meanwhile) are recomputed by the load.
                let copied = rows > 0 && shared == full && mm.fill_partial(mm_id, &mut SessionKv(s)).map_err(|e| fail(&e))?;
                s.kv.set_len(k).map_err(|e| fail(&e))?;
                ids.drain(..k);
                let cached = shared.min(full) * ct + if copied { rows } else { 0 };
                stats.cached_tokens = u32::try_from(cached).unwrap_or(u32::MAX);
            }
        }

        // Load: the context's chunks come back (read or recomputed as the planner says) and
        // are pinned for the call.
        let report = lock(&self.mm).begin(mm_id, &mut SessionKv(s), Strategy::Planned).map_err(|e| fail(&e))?;
        stats.switch_ms = ms(start.elapsed());
        stats.missing_chunks = u32::try_from(report.missing).unwrap_or(u32::MAX);
        stats.read_chunks = u32::try_from(report.read).unwrap_or(u32::MAX);
        stats.recomputed_chunks = u32::try_from(report.recomputed).unwrap_or(u32::MAX);
        stats.read_bytes = report.read_bytes;
        saved.pending.clear();
        saved.pending_ids.clear();
        saved.open_turn = false;
        if let Err(e) = self.grow(s, mm_id, ids.len()) {
            let _ = lock(&self.mm).end(mm_id, &mut SessionKv(s));
            return Err(e);
        }
        let sampler = Sampler::new(SamplerConfig {
            temperature: c.temperature,
            seed: c.seed,
            top_p: c.top_p.unwrap_or(SamplerConfig::default().top_p),
            ..SamplerConfig::default()
        });
        Ok((ids, stats, sampler))
    }

    /// Slots for `more` positions after the context's (mm claims them from the budget).
    fn grow(&self, s: &mut Session, mm_id: u64, more: usize) -> Result<(), Refusal> {
        let positions = s.n_past() + more;
        if positions > s.kv.n_chunks() * self.cfg.chunk_tokens {
            lock(&self.mm).prepare(mm_id, &mut SessionKv(s), positions).map_err(|e| refuse(ErrorCode::Failed, e.to_string()))?;
        }
        Ok(())
    }

    /// A native call's new tokens: pending text (a system prompt), the end of the last
    /// assistant turn, then the prompt as a user turn (markup parsed for special tokens, the
    /// user's text not: an app cannot forge turns) or raw.
    fn native_ids(&self, job: &Job, s: &Session, saved: &Saved) -> Result<Vec<u32>, Refusal> {
        let tk = &self.model.tokenizer;
        let mut ids = Vec::new();
        if s.n_past() == 0 && tk.add_bos {
            ids.extend(tk.bos);
        }
        if !saved.pending_ids.is_empty() {
            ids.extend_from_slice(&saved.pending_ids);
        } else if !saved.pending.is_empty() {
            // A context file of an older build: its system prompt as it was encoded then.
            ids.extend(tk.encode(&saved.pending, false, true).map_err(|e| refuse(ErrorCode::Failed, e.to_string()))?);
        }
        if saved.open_turn {
            ids.extend_from_slice(&self.turns()?.ids.close_assistant);
        }
        if job.call.raw {
            ids.extend_from_slice(&job.prompt_ids);
        } else {
            let turns = &self.turns()?.ids;
            let first = s.n_past() == 0 && saved.pending.is_empty();
            ids.extend_from_slice(if first { &turns.first_open } else { &turns.open });
            ids.extend_from_slice(&job.prompt_ids);
            ids.extend_from_slice(&turns.close_user);
        }
        Ok(ids)
    }

    /// One forward pass for the running calls: each decoding call's sampled token and pieces
    /// of the shortest prompts still to prefill (as many as fit a pass's 512 tokens when no
    /// call decodes). Then each call takes its logits; the calls that ended leave the batch.
    ///
    /// With `prefill_lane`, while calls decode the shortest prompt goes to the lane whole (up
    /// to [`LANE_PASS`] tokens a pass), where it runs on its own share of the threads beside this and
    /// the next passes, which then decode on the rest (the pool lends the lane its share until
    /// the lane's pass ends: `Lanes`); the other prompts wait for the lane. A call back from
    /// the lane rejoins the batch here.
    fn step(&self, active: &mut Vec<Active>, scratch: &mut Scratch, cost: &mut PassCost, mut lane: Option<&mut Lane>) -> StepTrace {
        let t_prep = Instant::now();
        let mut trace = StepTrace::default();
        if let Some(l) = lane.as_deref_mut() {
            self.lane_back(active, l, &mut trace);
            self.lane_out(active, l);
        }
        let lane_busy = lane.as_ref().is_some_and(|l| l.busy.is_some());
        let mut ended: Vec<(usize, Outcome)> = Vec::new();
        let mut rows: Vec<usize> = Vec::new();
        let mut pieces: Vec<Vec<u32>> = Vec::new();
        let decoding = active.iter().filter(|a| a.next.is_some()).count();
        // The pass's prompt tokens (`pass_room`): the shortest prompt when no call decodes,
        // else what fits `prefill_hold`. They go to the prompts with the fewest tokens left
        // first: a short prompt does not wait behind a long one's pieces (its caller waits
        // for a first token; the long one's caller waits far longer anyway).
        let left: Vec<Option<usize>> = active.iter().map(|a| a.next.is_none().then(|| a.ids.len() - a.fed)).collect();
        let most = self.cfg.prefill_piece.clamp(1, MAX_PASS);
        // Prompts wait for a busy lane while calls decode (beside them on fewer threads they
        // would stretch every pass); with nothing decoding the shortest one runs here.
        let room = if lane_busy && decoding > 0 {
            0
        } else {
            pass_room(&left, decoding, || (cost.piece(decoding, self.cfg.prefill_hold, most), most))
        };
        let piece_of = prompt_pieces(&left, room);
        for (i, a) in active.iter_mut().enumerate() {
            if let Some(t) = a.next {
                match catch_unwind(AssertUnwindSafe(|| self.put_token(a, t))) {
                    Ok(Ok(true)) => {
                        rows.push(i);
                        pieces.push(vec![t]);
                    }
                    Ok(Ok(false)) => ended.push((i, Outcome::Done)),
                    Ok(Err(r)) => ended.push((i, Outcome::Failed(r))),
                    Err(p) => ended.push((i, Outcome::Panicked(panic_message(p.as_ref())))),
                }
            } else if piece_of[i] > 0 || a.fed == a.ids.len() {
                // (An empty piece, which cannot happen, fails the call below: never stuck.)
                rows.push(i);
                pieces.push(a.ids[a.fed..a.fed + piece_of[i]].to_vec());
            }
        }
        // What the pass would refuse for one call fails that call alone, not the whole pass.
        let mut k = 0;
        while k < rows.len() {
            let a = &active[rows[k]];
            let p = &pieces[k];
            if self.refuses(a, p) {
                let why = format!("the call's {} tokens do not fit its context of {}", p.len(), a.s.n_past());
                ended.push((rows.remove(k), Outcome::Failed(refuse(ErrorCode::Failed, why))));
                pieces.remove(k);
            } else {
                k += 1;
            }
        }
        trace.decode_rows = u32::try_from(pieces.iter().zip(&rows).filter(|(_, &i)| active[i].next.is_some()).count()).unwrap_or(u32::MAX);
        trace.prefill_tokens =
            u32::try_from(pieces.iter().zip(&rows).filter(|(_, &i)| active[i].next.is_none()).map(|(p, _)| p.len()).sum::<usize>())
                .unwrap_or(u32::MAX);
        trace.prep_ms = ms(t_prep.elapsed());
        if !rows.is_empty() {
            let t0 = Instant::now();
            let n = rows.len();
            // Where each call's positions start: a pass that panics is undone from here.
            let from: Vec<usize> = rows.iter().map(|&i| active[i].s.n_past()).collect();
            // A pass on all the threads with the lane idle opens its gate: a call put in line
            // meanwhile starts on the lane at once (`LaneGate`).
            let gate = lane.as_ref().filter(|l| !lane_busy && !l.gone && decoding > 0).map(|l| {
                let view = BatchView {
                    ctxs: active.iter().map(|a| a.ctx.clone()).collect(),
                    owners: active.iter().map(|a| a.job.owner.clone()).collect(),
                    pinned: active.iter().map(|a| a.reserved).sum(),
                    room: active.len() < self.cfg.max_batch.max(1),
                };
                l.lanes.gate.open(view, &self.pool, l.lanes.prompt.threads());
                &l.lanes.gate
            });
            let run = {
                // `rows` is increasing: each call's session once, in the pieces' order.
                let mut sessions: Vec<&mut Session> =
                    active.iter_mut().enumerate().filter(|(i, _)| rows.binary_search(i).is_ok()).map(|(_, a)| &mut a.s).collect();
                let refs: Vec<&[u32]> = pieces.iter().map(Vec::as_slice).collect();
                // Marked for mm's AoT writer while it runs (cleared on unwind too).
                let _pass = self.passes.as_deref().map(mm::gate::PassGate::pass);
                catch_unwind(AssertUnwindSafe(|| {
                    // (Beside the lane's pass the pool has lent it the lane's share: `Lanes`.)
                    let r = Session::step_batch(&mut sessions, &refs, scratch);
                    injected_fault(&refs);
                    r.map(<[f32]>::len)
                }))
            };
            if let Some(taken) = gate.and_then(|g| g.close(&self.pool)) {
                trace.lane_took = 1;
                if let Some(l) = lane {
                    l.busy = Some(taken);
                }
            }
            let pass_ms = ms(t0.elapsed());
            trace.pass_ms = pass_ms;
            if !lane_busy {
                // (Passes beside the lane run on fewer threads: not the ones pieces are cut by.)
                cost.add(pieces.iter().map(Vec::len).sum(), pass_ms);
            }
            if decoding > 0 && matches!(run, Ok(Ok(_))) {
                self.prom.step(n, pass_ms);
            }
            let t_after = Instant::now();
            self.after_pass(active, &rows, &pieces, &from, run, scratch, n, &mut ended);
            trace.sample_ms = ms(t_after.elapsed());
        }
        ended.sort_by_key(|e| std::cmp::Reverse(e.0));
        ended.dedup_by_key(|e| e.0);
        let t0 = Instant::now();
        trace.ended = u32::try_from(ended.len()).unwrap_or(u32::MAX);
        for (i, how) in ended {
            let a = active.remove(i);
            self.finish(a, how);
        }
        trace.finish_ms = ms(t0.elapsed());
        trace
    }

    /// The lane's call, if its pass is done (waited for when nothing else would run): back in
    /// the batch with its logits taken on the lane; one whose pass failed ends here.
    fn lane_back(&self, active: &mut Vec<Active>, lane: &mut Lane, trace: &mut StepTrace) {
        if lane.busy.is_none() {
            return;
        }
        let d = if active.is_empty() {
            lane.done.recv().map_err(|_| true)
        } else {
            lane.done.try_recv().map_err(|e| matches!(e, mpsc::TryRecvError::Disconnected))
        };
        let LaneDone { a, ended, ms } = match d {
            Ok(d) => d,
            Err(gone) => {
                if gone {
                    // Cannot happen (the lane catches its pass's panics): its call is lost
                    // with it, and its client's stream ends.
                    error!("the prefill lane stopped with a call on it");
                    lane.busy = None;
                    lane.gone = true;
                }
                return;
            }
        };
        lane.busy = None;
        trace.lane_ms = ms;
        match (a, ended) {
            (Some(a), Some(how)) => self.finish(a, how),
            (Some(a), None) => active.push(a),
            // A call the lane took that could not start: answered there.
            (None, _) => {}
        }
    }

    /// Sends the shortest prompt to a free lane while calls decode: all of it, or
    /// [`LANE_PASS`] tokens of it (a longer one comes back and goes again, unless a shorter
    /// one waits).
    fn lane_out(&self, active: &mut Vec<Active>, lane: &mut Lane) {
        if !lane.gone && lane.lanes.gate.is_shut() {
            // (Its thread cannot panic outside its passes' catch; were it gone, the calls go on.)
            error!("the prefill lane stopped; prompts go in pieces beside decoding calls");
            lane.gone = true;
        }
        if lane.gone || lane.busy.is_some() || !active.iter().any(|a| a.next.is_some()) {
            return;
        }
        let Some(i) = active
            .iter()
            .enumerate()
            // (A cancelled call's prompt too: a cancelled call keeps what it made, as in pieces.)
            .filter(|(_, a)| a.next.is_none() && a.fed < a.ids.len())
            .min_by_key(|(_, a)| a.ids.len() - a.fed)
            .map(|(i, _)| i)
        else {
            return;
        };
        let Some(piece) = self.lane_piece(&active[i]) else {
            return;
        };
        let a = active.remove(i);
        lane.busy = Some((a.ctx.clone(), a.reserved));
        // The lane's share of the cores, until its thread gives them back as its pass ends.
        self.pool.lend(lane.lanes.prompt.threads());
        lane.lanes.gate.send(LaneJob { a, piece });
    }

    /// A pass's outcome for its calls (`rows`, their `pieces`, where their positions were
    /// before it: `from`): each takes its logits from `scratch`; a refused pass fails them
    /// all; a panic fails the call alone if it was alone, else each call's piece runs again
    /// by itself from where the pass started. `batch`: the calls in the step.
    #[allow(clippy::too_many_arguments)]
    fn after_pass(
        &self,
        active: &mut [Active],
        rows: &[usize],
        pieces: &[Vec<u32>],
        from: &[usize],
        run: std::thread::Result<engine::model::Result<usize>>,
        scratch: &mut Scratch,
        batch: usize,
        ended: &mut Vec<(usize, Outcome)>,
    ) {
        match run {
            Ok(Ok(len)) => self.take_rows(active, rows, pieces, &scratch.logits()[..len], batch, ended),
            Ok(Err(e)) => {
                // Checked before any session changed: each call in the pass fails.
                for &i in rows {
                    ended.push((i, Outcome::Failed(refuse(ErrorCode::Failed, e.to_string()))));
                }
            }
            Err(p) if rows.len() == 1 => {
                *scratch = Scratch::default();
                ended.push((rows[0], Outcome::Panicked(panic_message(p.as_ref()))));
            }
            Err(p) => {
                // Which call's data made the model panic is not known: each call's piece
                // runs again alone, its positions rolled back first (the pass wrote only
                // those, and a row's arithmetic does not depend on the others: a call that
                // goes on answers as if the pass had not failed; only the attention observer
                // may have counted part of the failed pass, and densities only guide levels).
                // The one that panics alone is quarantined; the others go on.
                *scratch = Scratch::default();
                warn!(calls = rows.len(), "a forward pass panicked ({}); its calls run again one by one", panic_message(p.as_ref()));
                for (k, &i) in rows.iter().enumerate() {
                    let a = &mut active[i];
                    let s = &mut a.s;
                    // A write never reaches a chunk another context shares (mm copies it first).
                    if let Err(e) = lock(&self.mm).truncate(a.saved.mm_id, &mut SessionKv(s), from[k]) {
                        warn!("rolling back a failed pass: {e}");
                    }
                    s.truncate(from[k]);
                    let piece = [pieces[k].as_slice()];
                    let r = catch_unwind(AssertUnwindSafe(|| {
                        let r = Session::step_batch(&mut [s], &piece, scratch).map(<[f32]>::len);
                        injected_fault(&piece);
                        r
                    }));
                    match r {
                        Ok(Ok(len)) => self.take_rows(active, &[i], &pieces[k..=k], &scratch.logits()[..len], batch, ended),
                        Ok(Err(e)) => ended.push((i, Outcome::Failed(refuse(ErrorCode::Failed, e.to_string())))),
                        Err(p) => {
                            *scratch = Scratch::default();
                            ended.push((i, Outcome::Panicked(panic_message(p.as_ref()))));
                        }
                    }
                }
            }
        }
    }

    /// After a pass: each call in `rows` takes its row of `logits` (a decoding call its next
    /// token; a prefilling one counts its piece, and samples once its prompt is in). `batch`:
    /// the calls in the pass (one that panicked and was run again call by call included).
    #[allow(clippy::too_many_arguments)]
    fn take_rows(
        &self,
        active: &mut [Active],
        rows: &[usize],
        pieces: &[Vec<u32>],
        logits: &[f32],
        batch: usize,
        ended: &mut Vec<(usize, Outcome)>,
    ) {
        let vocab = self.model.config.vocab;
        let n = u32::try_from(batch).unwrap_or(u32::MAX);
        for ((&i, piece), row) in rows.iter().zip(pieces).zip(logits.chunks_exact(vocab)) {
            let a = &mut active[i];
            a.stats.batch_max = a.stats.batch_max.max(n);
            let r = catch_unwind(AssertUnwindSafe(|| {
                if a.next.is_some() {
                    self.take_logits(a, row)
                } else {
                    a.fed += piece.len();
                    if a.fed == a.ids.len() {
                        let t = a.sampler.sample(row);
                        self.sampled(a, t);
                        a.stats.prefill_ms = ms(a.t_prefill.elapsed());
                        // From the call's arrival: its queue wait is in it once.
                        a.stats.ttft_ms = ms(a.job.received.elapsed());
                        a.stats.finish = "length".into();
                        a.t_decode = Instant::now();
                    }
                    true
                }
            }));
            match r {
                Ok(true) => {}
                Ok(false) => ended.push((i, Outcome::Done)),
                Err(p) => ended.push((i, Outcome::Panicked(panic_message(p.as_ref())))),
            }
        }
    }

    /// A decoding call's sampled token goes into its context, unless it ends the generation
    /// (its text went out when it was sampled: [`Service::sampled`]); its slot is made.
    /// False: the call has ended.
    fn put_token(&self, a: &mut Active, t: u32) -> Result<bool, Refusal> {
        if self.model.tokenizer.is_eog(t) {
            a.stats.finish = "eog".into();
            return Ok(false);
        }
        a.out.n_out += 1;
        // The token joins the context whatever happens to the output.
        self.grow(&mut a.s, a.saved.mm_id, 1)?;
        Ok(true)
    }

    /// After a decode pass: a stop string the last token completed, cancellation, the length
    /// limit, and the next token. False: the call has ended.
    fn take_logits(&self, a: &mut Active, logits: &[f32]) -> bool {
        if a.out.stopped {
            a.stats.finish = "stop".into();
            return false;
        }
        if a.job.cancel.load(Ordering::SeqCst) {
            a.stats.finish = "cancelled".into();
            return false;
        }
        if a.out.n_out >= a.job.call.max_tokens {
            return false;
        }
        let t = a.sampler.sample(logits);
        self.sampled(a, t);
        true
    }

    /// A token was sampled: it runs in the next pass, and its text joins the output now and
    /// is streamed as far as no stop string can claim it — a pass sooner than once it has run
    /// (the first token's text does not wait for a decode step). A token that completes a
    /// stop string cuts the output there; the call ends after its pass (the context holds it,
    /// as every sampled token until the end).
    fn sampled(&self, a: &mut Active, t: u32) {
        a.next = Some(t);
        let tk = &self.model.tokenizer;
        if tk.is_eog(t) {
            return;
        }
        let c = &a.job.call;
        let o = &mut a.out;
        o.bytes.clear();
        tk.token_bytes(t, false, &mut o.bytes);
        o.before = o.text.len();
        o.text.push_str(&o.utf8.push(&o.bytes));
        // Only a match ending in the new piece is new: search from one stop string's length
        // before it, not the whole output at every token.
        let text = &o.text;
        let from = |p: &String| floor_boundary(text, o.before.saturating_sub(p.len()));
        if let Some(at) = c.stop.iter().filter_map(|p| text[from(p)..].find(p.as_str()).map(|i| i + from(p))).min() {
            o.text.truncate(at);
            o.stopped = true;
            return;
        }
        // Stream what can no longer become part of a stop string.
        let hold = c.stop.iter().map(|p| held_back(&o.text, p)).max().unwrap_or(0);
        let safe = o.text.len() - hold;
        if safe > o.sent && o.text.is_char_boundary(safe) {
            if a.job.events.send(Event::Token { text: o.text[o.sent..safe].to_string() }).is_err() {
                a.job.cancel.store(true, Ordering::SeqCst);
            }
            o.sent = safe;
        }
    }

    /// A call leaves the batch: the rest of its output, its end in mm (unpin, AoT write,
    /// re-level, reclaim), its context saved (or rolled back, or quarantined after a panic),
    /// and its answer.
    fn finish(&self, mut a: Active, mut how: Outcome) {
        if !matches!(how, Outcome::Panicked(_)) {
            let (o, st) = (&mut a.out, &mut a.stats);
            if st.finish != "stop" {
                o.text.push_str(&o.utf8.finish());
            } else if a.job.history.is_some() {
                // The client never sees the text from the stop string on, and sends back only
                // what it saw: the context keeps the output tokens that lie wholly within that
                // (the next request bridges the rest of a token cut in two), so it continues.
                let n_out = (o.n_out as usize).min(a.s.n_past());
                let first = a.s.n_past() - n_out;
                let kept = kept_tokens(&self.model.tokenizer, &a.s.tokens[first..], o.text.as_bytes());
                match lock(&self.mm).truncate(a.saved.mm_id, &mut SessionKv(&mut a.s), first + kept) {
                    Ok(()) => a.s.truncate(first + kept),
                    Err(e) => how = Outcome::Failed(refuse(ErrorCode::Failed, format!("cutting the output at the stop string: {e}"))),
                }
            }
            if matches!(how, Outcome::Done) && o.text.len() > o.sent && st.finish != "cancelled" {
                let _ = a.job.events.send(Event::Token { text: o.text[o.sent..].to_string() });
            }
            st.output_tokens = o.n_out;
            st.decode_ms = if a.next.is_some() { ms(a.t_decode.elapsed()) } else { 0.0 };
            st.context_tokens = u32::try_from(a.s.n_past()).unwrap_or(u32::MAX);
            // Always end the call in mm: unpin, write out what changed, re-level, reclaim.
            match catch_unwind(AssertUnwindSafe(|| lock(&self.mm).end(a.saved.mm_id, &mut SessionKv(&mut a.s)))) {
                Err(p) => how = Outcome::Panicked(panic_message(p.as_ref())),
                Ok(Err(e)) if matches!(how, Outcome::Done) => how = Outcome::Failed(refuse(ErrorCode::Failed, e.to_string())),
                Ok(_) => {}
            }
            self.wake_leveller();
        }
        let refusal = match how {
            Outcome::Panicked(what) => {
                let r = self.quarantine(&a.ctx, Some(a.s), a.saved.mm_id, &what);
                if a.made {
                    let _ = self.del_ctx(&a.job.owner, &a.ctx);
                }
                r
            }
            Outcome::Failed(r) => self.settle(&a.job.owner, &a.ctx, a.made, a.s, a.before, a.saved, Err(r)).expect_err("failed"),
            Outcome::Done => {
                let c = &a.job.call;
                // A stateless client sends the turn's end itself with its next history.
                a.saved.open_turn = !c.raw && a.job.history.is_none() && a.stats.finish != "cancelled";
                let st = &a.stats;
                info!(
                    ctx = %a.ctx, app = %a.job.owner.app, queue_ms = st.queue_ms, switch_ms = st.switch_ms,
                    prefill_ms = st.prefill_ms, ttft_ms = st.ttft_ms, read = st.read_chunks,
                    recomputed = st.recomputed_chunks, prompt = st.prompt_tokens, cached = st.cached_tokens, output = st.output_tokens,
                    batch = st.batch_max, finish = %st.finish, "call"
                );
                // Saved (its context file written), made durable and answered off the worker
                // (syncer.rs), by this thread if no syncer runs: writing the file, even into
                // the page cache, can wait (on a device under write load, for the dirty
                // pages' writeback), and every other call's next token waited with it.
                let turn = Turn {
                    owner: a.job.owner,
                    made: a.made,
                    s: a.s,
                    before: a.before,
                    saved: a.saved,
                    text: std::mem::take(&mut a.out.text),
                    stats: a.stats,
                };
                let job = SyncJob { ctx: a.ctx, app: turn.owner.app.clone(), events: a.job.events, turn: Box::new(turn) };
                if let Err(job) = self.sync.defer(job) {
                    self.save_and_answer(vec![*job]);
                }
                return;
            }
        };
        self.prom.failed();
        let _ = a.job.events.send(refusal.into());
    }
}

/// Cancels a call when dropped, unless disarmed: held by the caller's thread from before the
/// call is queued until something else watches for the caller going away, so a caller that
/// unwinds (a panic) never leaves its call queued or running for nobody.
pub(super) struct CancelOnDrop(Option<Arc<AtomicBool>>);

impl CancelOnDrop {
    pub(super) fn new(flag: &Arc<AtomicBool>) -> Self {
        Self(Some(Arc::clone(flag)))
    }
    pub(super) fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f.store(true, Ordering::SeqCst);
        }
    }
}

/// Deletes a context made for a call unless disarmed: dropped while unwinding, it keeps a
/// panicking call from leaving an empty context behind.
struct Made<'a> {
    svc: &'a Service,
    owner: &'a Owner,
    ctx: Option<String>,
}

impl Made<'_> {
    fn disarm(mut self) {
        self.ctx = None;
    }
}

impl Drop for Made<'_> {
    fn drop(&mut self) {
        if let Some(ctx) = self.ctx.take() {
            let _ = self.svc.del_ctx(self.owner, &ctx);
        }
    }
}

/// How many of `ids` spell a prefix of `text` whole.
fn kept_tokens(tk: &engine::Tokenizer, ids: &[u32], text: &[u8]) -> usize {
    let mut at = Vec::new();
    for (k, &t) in ids.iter().enumerate() {
        let from = at.len();
        tk.token_bytes(t, false, &mut at);
        if at.len() > text.len() || at[from..] != text[from..at.len()] {
            return k;
        }
    }
    ids.len()
}

/// The largest char boundary of `s` at or before `i`.
pub(super) fn floor_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Bytes at the end of `text` that are the start of `stop` (they may yet become it).
pub(super) fn held_back(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1)).rev().find(|&k| text.as_bytes().ends_with(&stop.as_bytes()[..k])).unwrap_or(0)
}

pub(super) fn unavailable(ctx: &str, why: &str) -> Refusal {
    refuse(ErrorCode::Failed, format!("context {ctx} is unavailable: {why}"))
}

/// What a panic said, for the log and the caller.
pub(super) fn panic_message(p: &(dyn Any + Send)) -> String {
    let m = p.downcast_ref::<&str>().map(|s| (*s).to_string()).or_else(|| p.downcast_ref::<String>().cloned());
    format!("panic: {}", m.unwrap_or_else(|| "unknown".into()))
}

/// Fault injection for tests, in debug builds only: a forward pass that fed the token
/// `LLMS_FAULT_PANIC_TOKEN` panics once it has run — every call's K/V written and positions
/// advanced, so the rollback has something to undo — standing for context data that makes the
/// model panic (llmsd/tests/batching.rs).
#[cfg(debug_assertions)]
fn injected_fault(pieces: &[&[u32]]) {
    static TOKEN: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    let token = *TOKEN.get_or_init(|| std::env::var("LLMS_FAULT_PANIC_TOKEN").ok().and_then(|v| v.parse().ok()));
    if let Some(t) = token.filter(|t| pieces.iter().any(|p| p.contains(t))) {
        panic!("injected fault: token {t} in a forward pass");
    }
}

#[cfg(not(debug_assertions))]
fn injected_fault(_: &[&[u32]]) {}

#[cfg(test)]
mod tests {
    use super::{pass_room, prompt_pieces, PassCost, MAX_PASS};

    #[test]
    fn a_convoy_is_prefilled_one_prompt_a_pass() {
        let never = || unreachable!("no call decodes: no piece beside them");
        // Nothing decodes: of four 40-token prompts that arrived together, one runs.
        let left = [Some(40); 4];
        assert_eq!(prompt_pieces(&left, pass_room(&left, 0, never)), vec![40, 0, 0, 0]);
        // The shortest one, whole.
        let left = [Some(300), Some(12), Some(50)];
        assert_eq!(prompt_pieces(&left, pass_room(&left, 0, never)), vec![0, 12, 0]);
        // A long prompt alone fills a pass of 512 and goes on in the next.
        assert_eq!(pass_room(&[Some(2000)], 0, never), MAX_PASS);
        // Calls decode: what fits beside them, shortest prompt first.
        let left = [None, Some(40), Some(20)];
        assert_eq!(prompt_pieces(&left, pass_room(&left, 1, || (30, 32))), vec![0, 10, 20]);
        // Beside them, a prompt longer than a pass fits: as few passes as fit, even pieces.
        let left = [None, Some(32)];
        assert_eq!(pass_room(&left, 1, || (15, 16)), 16, "16 + 16, a tenth over 15, not 15 + 15 + 2");
        assert_eq!(pass_room(&left, 1, || (12, 16)), 11, "11 + 11 + 10, not 12 + 12 + 8");
        assert_eq!(pass_room(&[None, Some(21)], 1, || (12, 16)), 11);
        assert_eq!(pass_room(&[None, Some(10)], 1, || (12, 16)), 12, "a prompt that fits: the room as it is");
        assert_eq!(pass_room(&left, 1, || (15, 15)), 11, "never over `most`: 11 + 11 + 10");
        // Nothing to prefill.
        assert_eq!(pass_room(&[], 0, never), 0);
    }

    #[test]
    fn a_piece_fits_the_hold_over_a_lone_calls_pass() {
        let mut cost = PassCost::default();
        assert_eq!(cost.piece(3, 4.0, 16), 16, "no line yet: the most");
        // Passes of 2 ms + 0.5 ms a row: a lone call's pass is 2.5 ms, the hold 10.25 ms.
        for rows in [1, 4, 9, 20, 2, 7] {
            cost.add(rows, 2.0 + 0.5 * rows as f64);
        }
        assert_eq!(cost.piece(1, 4.1, 32), 15, "beside one call: 7.75 ms of tokens");
        assert_eq!(cost.piece(3, 4.1, 32), 13);
        assert_eq!(cost.piece(3, 4.1, 8), 8, "at most `most`");
        // 16 rows: 10 ms of the 10.25, but a pass may take half again the rows' 10 ms.
        assert_eq!(cost.piece(16, 4.1, 32), 10, "many rows: half again their pass");
        assert_eq!(cost.piece(1, 1.0, 32), 2, "the tightest hold: half again the rows' pass");
        assert_eq!(cost.piece(1, 1.0, 1), 1);
    }

    #[test]
    fn pieces_go_to_the_shortest_prompts_first() {
        assert_eq!(prompt_pieces(&[Some(40); 4], 512), vec![40; 4]);
        // Room for less: the shortest prompts first, the next one cut, the longest waits.
        assert_eq!(prompt_pieces(&[Some(300), Some(10), None, Some(50)], 40), vec![0, 10, 0, 30]);
        // Decoding calls feed no prompt; no room, no prompt token.
        assert_eq!(prompt_pieces(&[None, Some(5)], 0), vec![0, 0]);
        assert_eq!(prompt_pieces(&[None, None], 16), vec![0, 0]);
    }
}

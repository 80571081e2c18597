//! A small thread pool for the forward pass: one job at a time, the caller taking part.
//!
//! A decode step runs a few hundred short parallel operations, each a few microseconds long,
//! so waking sleeping threads through the kernel for each one would cost as much as the work.
//! Workers therefore spin on the job word for a while after each job and only park (on a
//! condvar) when no job has come for ~a millisecond.
//!
//! These machines are shared: a worker may be descheduled at any moment. So a job is a loop
//! that claims work from a shared counter, and workers *join* a job rather than being waited
//! for: once the caller has run out of work it closes the job, and only workers that joined
//! before that are waited for. A worker that was not running never holds the caller up.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

type Job<'a> = dyn Fn(usize) + Sync + 'a;

/// Points at a job on the caller's stack; valid while the caller waits in `run`.
struct JobRef {
    job: *const Job<'static>,
}

/// The job word: generation in the high 32 bits, a "closed" flag, and the number of workers
/// that joined the job and have not left it.
const CLOSED: u64 = 1 << 31;
const ACTIVE: u64 = CLOSED - 1;

struct Shared {
    state: AtomicU64,
    job: AtomicPtr<JobRef>,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    /// Set by [`ThreadPool::rest`]: idle workers park at once instead of spinning.
    rest: AtomicBool,
    /// Set by [`ThreadPool::lend`]: workers from this index on sit out (they leave a job at
    /// their next chunk, join no new one and park), their cores lent to other threads.
    lent_from: AtomicUsize,
    /// Each worker is inside a job, or about to join one (set before it reads `lent_from`:
    /// [`ThreadPool::wait_lent`] and a worker see each other's store, so a lent worker either
    /// stays out or is waited for).
    inside: Vec<AtomicBool>,
    /// Signalled when a lent worker leaves a job ([`ThreadPool::wait_lent`]).
    left: (Mutex<()>, Condvar),
    lock: Mutex<()>,
    wake: Condvar,
}

/// How long an idle worker spins before parking.
const SPIN: Duration = Duration::from_micros(1500);

/// A pool of `n` threads (the caller plus `n - 1` workers).
pub struct ThreadPool {
    n: usize,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises callers: one job at a time.
    busy: Mutex<()>,
    /// Per-operation statistics, collected while on ([`ThreadPool::set_profiling`]).
    profiling: AtomicBool,
    profile: Mutex<Vec<OpProfile>>,
}

/// What the parallel operations of one name did while profiling was on: how many tasks they
/// were split into and how evenly the threads' work came out. Busy time is time inside the
/// tasks; the rest of `threads x wall` is waiting: for the slowest thread (imbalance), for
/// workers to join, and the operation's synchronisation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OpProfile {
    pub name: &'static str,
    pub calls: u64,
    /// Tasks handed out, over all calls.
    pub tasks: u64,
    /// Wall time of the calls (as the caller saw them), summed.
    pub wall: Duration,
    /// Time the threads spent in tasks, summed over threads and calls.
    pub busy: Duration,
    /// The busiest thread's time, summed over calls.
    pub max_busy: Duration,
    /// Threads of the pool (the caller and the workers).
    pub threads: usize,
}

impl OpProfile {
    /// The busiest thread's work over the mean thread's (1: even; `threads`: one thread did
    /// it all), over all calls.
    pub fn imbalance(&self) -> f64 {
        let mean = self.busy.as_secs_f64() / self.threads as f64;
        if mean > 0.0 {
            self.max_busy.as_secs_f64() / mean
        } else {
            1.0
        }
    }
    /// Share of the threads' time during the calls spent in tasks.
    pub fn utilization(&self) -> f64 {
        let avail = self.wall.as_secs_f64() * self.threads as f64;
        if avail > 0.0 {
            self.busy.as_secs_f64() / avail
        } else {
            0.0
        }
    }
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool").field("threads", &self.n).finish()
    }
}

impl ThreadPool {
    pub fn new(n: usize) -> Self {
        Self::with_start(n, || {})
    }

    /// [`ThreadPool::new`], each worker thread running `start` first (a service sets how the
    /// OS schedules its threads, say; the calling thread, participant 0, is the caller's).
    pub fn with_start(n: usize, start: fn()) -> Self {
        let n = n.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(CLOSED),
            job: AtomicPtr::new(std::ptr::null_mut()),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            rest: AtomicBool::new(false),
            lent_from: AtomicUsize::new(usize::MAX),
            inside: (0..n).map(|_| AtomicBool::new(false)).collect(),
            left: (Mutex::new(()), Condvar::new()),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..n)
            .map(|idx| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("llms-worker-{idx}"))
                    .spawn(move || {
                        start();
                        worker(&s, idx);
                    })
                    .expect("spawn worker thread")
            })
            .collect();
        Self { n, shared, workers, busy: Mutex::new(()), profiling: AtomicBool::new(false), profile: Mutex::new(Vec::new()) }
    }

    pub fn threads(&self) -> usize {
        self.n
    }

    /// Runs `job(i)` on the caller (`i = 0`) and on every worker that joins in time (distinct
    /// `i` in `1..threads()`); returns when all of them have finished. The job must therefore
    /// claim its work from shared state (as `for_chunks` does): it cannot count on every index
    /// running. A panic in any participant is re-raised here.
    fn run(&self, job: &(dyn Fn(usize) + Sync)) {
        if self.n == 1 {
            job(0);
            return;
        }
        let _busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: we erase the job's lifetime to hand it to the workers. It stays valid: a
        // worker reads it only after joining the job, and this function does not return (or
        // unwind: see CloseGuard) before the job is closed and every joined worker has left.
        let job_static: *const Job<'static> = unsafe { std::mem::transmute::<*const Job<'_>, *const Job<'static>>(job) };
        let mut jref = JobRef { job: job_static };
        let s = &*self.shared;
        s.job.store(&mut jref, Ordering::Relaxed);
        let gen = (s.state.load(Ordering::Relaxed) >> 32).wrapping_add(1) & 0xFFFF_FFFF;
        // Open the job (SeqCst pairs with parking workers: either they see the new word or we
        // see them counted as sleepers).
        s.rest.store(false, Ordering::Relaxed);
        s.state.store(gen << 32, Ordering::SeqCst);
        // (With every worker lent there is no one to wake: each job would wake them to park
        // again, on the cores they lent.)
        if s.sleepers.load(Ordering::SeqCst) > 0 && s.lent_from.load(Ordering::SeqCst) > 1 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        struct CloseGuard<'a>(&'a Shared);
        impl Drop for CloseGuard<'_> {
            fn drop(&mut self) {
                let w = self.0.state.fetch_or(CLOSED, Ordering::AcqRel) | CLOSED;
                let mut active = w & ACTIVE;
                let mut spins = 0u32;
                while active != 0 {
                    spins += 1;
                    if spins > 256 {
                        // The joined worker may share our core with something else.
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                    active = self.0.state.load(Ordering::Acquire) & ACTIVE;
                }
            }
        }
        {
            let _close = CloseGuard(s);
            job(0);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a worker thread panicked");
        }
    }

    /// The caller is about to block (on I/O, say): idle workers park now rather than spin out
    /// their spin time on cores the blocking work may need. The next job wakes them.
    pub fn rest(&self) {
        self.shared.rest.store(true, Ordering::Relaxed);
    }

    /// Lends the cores of `n` of the workers to other threads (a pass of another pool, say),
    /// from now until `lend(0)`: they leave the job they are in at their next chunk (its
    /// caller and the other workers take the rest: the chunks, not the threads, fix the
    /// bits), join no new one and park. With every worker lent the caller runs each job
    /// alone. Another thread may call this while a job runs: a service starting a prompt
    /// beside a decode pass in flight takes a core from it within a chunk, not at its end.
    pub fn lend(&self, n: usize) {
        let from = if n == 0 { usize::MAX } else { self.n.saturating_sub(n).max(1) };
        // (Parked lent workers wake with the next job: `run`.)
        self.shared.lent_from.store(from, Ordering::SeqCst);
    }

    /// Waits until no lent worker ([`ThreadPool::lend`]) is inside a job: the thread that
    /// borrows their cores calls this before its work, so it does not take a core from a
    /// worker in the middle of a chunk, which the job's caller would then wait for (a
    /// worker preempted by a thread with a long CPU slice held a decode pass up to that
    /// slice). Sleeps, so a borrower that woke on the worker's core gives it back at once.
    pub fn wait_lent(&self) {
        let s = &*self.shared;
        let lent = |s: &Shared| {
            let from = s.lent_from.load(Ordering::SeqCst);
            s.inside.iter().skip(from.max(1)).any(|b| b.load(Ordering::SeqCst))
        };
        if !lent(s) {
            return;
        }
        let mut g = s.left.0.lock().unwrap_or_else(|e| e.into_inner());
        while lent(s) {
            g = s.left.1.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Turns per-operation statistics on or off (off: one relaxed load per operation).
    pub fn set_profiling(&self, on: bool) {
        self.profiling.store(on, Ordering::Relaxed);
    }

    /// The statistics gathered since the last call, by operation name (first seen first).
    pub fn take_profile(&self) -> Vec<OpProfile> {
        std::mem::take(&mut *self.profile.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Splits `0..n` into chunks of `chunk` and hands them out dynamically (an atomic counter),
    /// so a thread slowed by another process on the machine does not hold up the rest.
    /// `name` is the operation's, for the statistics.
    pub fn for_chunks(&self, name: &'static str, n: usize, chunk: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        self.chunks(name, n, chunk, 1, f);
    }

    /// As [`Self::for_chunks`], but each thread first takes, in order, the chunks of its own
    /// share of `0..n` (one of `threads()` equal runs), and only then helps with the others'
    /// (from where their owners have got to). So each thread reads its part as one forward
    /// stream: a decode product is bound by memory, and the prefetchers (the hardware's, and
    /// the kernels' `prefetch_ahead`) follow a stream, which chunks dealt out alternately
    /// break at every chunk — and each break's prefetch past the chunk's end fetches lines
    /// the other thread has already read. 1.7B Q4_K_M decode: tg128 1.11x the alternate
    /// chunks' (`tools/bench/ab`, 4 pairs), and at an hour of fast memory 0.79-0.81 of the
    /// floor against 0.53-0.59 (`llms bench --floor`; hand runs, docs/notes/engine.md).
    pub fn for_runs(&self, name: &'static str, n: usize, chunk: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        self.chunks(name, n, chunk, self.n, f);
    }

    /// `0..n` in `parts` runs, each handed out in chunks of `chunk`: participant `i` claims
    /// from run `i % parts` until it is done, then from the next runs in turn.
    fn chunks(&self, name: &'static str, n: usize, chunk: usize, parts: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        let chunk = chunk.max(1);
        let profiling = self.profiling.load(Ordering::Relaxed);
        if !profiling && (self.n == 1 || n <= chunk) {
            f(0, n);
            return;
        }
        let start = profiling.then(Instant::now);
        let busy: Vec<AtomicU64> = if profiling { (0..self.n).map(|_| AtomicU64::new(0)).collect() } else { Vec::new() };
        let tasks = AtomicU64::new(0);
        let task = |idx: usize, a: usize, b: usize| {
            if !profiling {
                return f(a, b);
            }
            let t = Instant::now();
            f(a, b);
            busy[idx].fetch_add(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
            tasks.fetch_add(1, Ordering::Relaxed);
        };
        if self.n == 1 || n <= chunk {
            task(0, 0, n);
        } else {
            // What the workers read at every claim (the counters' places, the task, the lent
            // mark) sits on cache lines of its own: on this stack beside the slots the
            // caller's own claim loop writes, every worker's claim missed. A caller's change
            // that moved the frames (the kernels' code the same byte for byte) made 1.7B
            // Q4_K_M decode 0.94x; padded, tg128 1.075x that build's
            // (docs/results/ab-pool-line-1.7b-q4_k_m.json).
            let shared = CachePadded::new((Runs::new(n, chunk, parts.clamp(1, self.n)), task, &self.shared.lent_from));
            let (runs, task, lent) = &*shared;
            self.run(&|idx| {
                let (own, mut from) = (runs.own(idx), 0);
                // (The caller, participant 0, is never lent.)
                while idx < lent.load(Ordering::Relaxed) {
                    let Some((a, b)) = runs.claim(own, &mut from) else { break };
                    task(idx, a, b);
                }
            });
        }
        let Some(start) = start else { return };
        let wall = start.elapsed();
        let ns: Vec<u64> = busy.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        let mut prof = self.profile.lock().unwrap_or_else(|e| e.into_inner());
        let i = prof.iter().position(|p| p.name == name).unwrap_or_else(|| {
            prof.push(OpProfile { name, threads: self.n, ..OpProfile::default() });
            prof.len() - 1
        });
        let p = &mut prof[i];
        p.calls += 1;
        p.tasks += tasks.load(Ordering::Relaxed);
        p.wall += wall;
        p.busy += Duration::from_nanos(ns.iter().sum());
        p.max_busy += Duration::from_nanos(ns.iter().copied().max().unwrap_or(0));
    }

    /// Hands each of `items` (typically disjoint `&mut` pieces of buffers) to one call of `f`,
    /// spread over the threads.
    pub fn scatter<T: Send>(&self, name: &'static str, items: Vec<T>, f: &(dyn Fn(T) + Sync)) {
        let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
        self.for_chunks(name, slots.len(), 1, &|a, b| {
            for slot in &slots[a..b] {
                if let Some(item) = slot.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    f(item);
                }
            }
        });
    }
}

/// A claim counter, kept on a cache line of its own ([`CachePadded`] in [`Runs`]): each thread
/// of [`ThreadPool::for_runs`] bumps its own, and sharing a line would make every claim a
/// transfer between cores. Beside it, where its run ends (computed once: two divisions a claim
/// were a tenth of a claim's cost, and a 16-token prompt piece makes thousands of claims a pass).
struct Cursor {
    next: AtomicUsize,
    end: usize,
}

/// `0..n` cut into `parts` runs with a claim counter each (see [`ThreadPool::chunks`]).
struct Runs {
    chunk: usize,
    cursors: Vec<CachePadded<Cursor>>,
}

impl Runs {
    fn new(n: usize, chunk: usize, parts: usize) -> Self {
        let cursors =
            (0..parts).map(|i| CachePadded::new(Cursor { next: AtomicUsize::new(i * n / parts), end: (i + 1) * n / parts })).collect();
        Self { chunk, cursors }
    }

    /// The run participant `idx` starts from.
    fn own(&self, idx: usize) -> usize {
        idx % self.cursors.len()
    }

    /// The next chunk for the participant whose run is `own` ([`Runs::own`]): from its own run,
    /// then (`from` counts the runs it has found empty) from the runs after it. A counter
    /// overshoots its run's end by at most one chunk per participant, so it cannot wrap.
    fn claim(&self, own: usize, from: &mut usize) -> Option<(usize, usize)> {
        let parts = self.cursors.len();
        while *from < parts {
            // `(own + from) % parts`, without the division (both are below `parts`).
            let i = if own + *from >= parts { own + *from - parts } else { own + *from };
            let c = &self.cursors[i];
            let (a, end) = (c.next.fetch_add(self.chunk, Ordering::Relaxed), c.end);
            if a < end {
                return Some((a, (a + self.chunk).min(end)));
            }
            *from += 1;
        }
        None
    }
}

fn worker(s: &Shared, idx: usize) {
    let mut seen_gen = 0u64;
    loop {
        // Spin, then park, until a job word with a new generation (or shutdown).
        let start = Instant::now();
        let mut spins = 0u32;
        let word = loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let w = s.state.load(Ordering::Acquire);
            if w >> 32 != seen_gen {
                break w;
            }
            std::hint::spin_loop();
            spins += 1;
            let lent = || idx >= s.lent_from.load(Ordering::Relaxed);
            if spins.is_multiple_of(1024) && (start.elapsed() > SPIN || s.rest.load(Ordering::Relaxed) || lent()) {
                let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                // A lent worker sleeps through jobs until its core is given back.
                while (s.state.load(Ordering::SeqCst) >> 32 == seen_gen || idx >= s.lent_from.load(Ordering::SeqCst))
                    && !s.shutdown.load(Ordering::Acquire)
                {
                    g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
            }
        };
        seen_gen = word >> 32;
        // Join unless the job has been closed (or replaced) meanwhile, or this worker's core
        // is lent (it goes back to park: see `lend`).
        let mut w = word;
        s.inside[idx].store(true, Ordering::SeqCst);
        let joined = idx < s.lent_from.load(Ordering::SeqCst)
            && loop {
                if w >> 32 != seen_gen || w & CLOSED != 0 {
                    break false;
                }
                match s.state.compare_exchange_weak(w, w + 1, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => break true,
                    Err(cur) => w = cur,
                }
            };
        if !joined {
            leave(s, idx);
            continue;
        }
        let jref = s.job.load(Ordering::Relaxed);
        // SAFETY: the caller published jref before opening the job (the state word's
        // SeqCst store, which our successful AcqRel CAS read), and keeps it alive until the
        // job is closed and we have left it below.
        let job = unsafe { &*(*jref).job };
        if catch_unwind(AssertUnwindSafe(|| job(idx))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.state.fetch_sub(1, Ordering::AcqRel);
        leave(s, idx);
    }
}

/// Worker `idx` is out of any job; a thread waiting for lent workers to leave learns it.
fn leave(s: &Shared, idx: usize) {
    s.inside[idx].store(false, Ordering::SeqCst);
    if idx >= s.lent_from.load(Ordering::SeqCst) {
        let _g = s.left.0.lock().unwrap_or_else(|e| e.into_inner());
        s.left.1.notify_all();
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Raw output pointer shared by the threads of one matmul; each thread writes a disjoint set
/// of `(token, row)` cells.
#[derive(Debug, Clone, Copy)]
pub struct OutPtr {
    pub ptr: *mut f32,
    pub len: usize,
}
// SAFETY: an OutPtr is only used by matmul_rows, whose callers give each thread a disjoint row
// range, so no two threads write the same element.
unsafe impl Send for OutPtr {}
// SAFETY: see Send.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    pub fn new(out: &mut [f32]) -> Self {
        Self { ptr: out.as_mut_ptr(), len: out.len() }
    }
    /// The same buffer seen from element `by` on.
    pub fn offset(self, by: usize) -> Self {
        Self { ptr: self.ptr.wrapping_add(by), len: self.len.saturating_sub(by) }
    }
    #[inline]
    pub fn write(&self, idx: usize, v: f32) {
        assert!(idx < self.len, "matmul output index {idx} out of {}", self.len);
        // SAFETY: idx is in bounds (checked above); the buffer outlives the matmul; threads
        // write disjoint indices (contract of matmul_rows).
        unsafe { *self.ptr.add(idx) = v };
    }
    /// Writes `vs` from element `idx` on, with one bounds check for the row (a check per
    /// element was a quarter of a prefill attention job's own time, outside its kernels).
    #[inline]
    pub fn write_row(&self, idx: usize, vs: &[f32]) {
        assert!(idx <= self.len && vs.len() <= self.len - idx, "output row {idx}..+{} out of {}", vs.len(), self.len);
        // SAFETY: in bounds (checked above); as `write`, threads write disjoint elements.
        unsafe { std::ptr::copy_nonoverlapping(vs.as_ptr(), self.ptr.add(idx), vs.len()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lent_workers_join_no_job_until_given_back() {
        let pool = ThreadPool::new(3);
        let seen: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        let job = |idx: usize| {
            seen[idx].fetch_add(1, Ordering::Relaxed);
            // Long enough for every running worker to join.
            std::thread::sleep(Duration::from_micros(200));
        };
        pool.lend(1);
        for _ in 0..200 {
            pool.run(&job);
        }
        assert_eq!(seen[2].load(Ordering::Relaxed), 0, "the lent worker (the last) joined a job");
        pool.lend(2);
        let before = seen[1].load(Ordering::Relaxed);
        for _ in 0..200 {
            pool.run(&job);
        }
        assert_eq!(seen[1].load(Ordering::Relaxed), before, "a lent worker joined a job");
        assert_eq!(seen[0].load(Ordering::Relaxed), 400, "the caller runs every job");
        // Given back, they join again (waited for without a time bound on the work: a hang
        // guard of a minute, for a machine too loaded to run them at all).
        pool.lend(0);
        let t = Instant::now();
        while (seen[1].load(Ordering::Relaxed) == before || seen[2].load(Ordering::Relaxed) == 0) && t.elapsed() < Duration::from_secs(60) {
            pool.run(&job);
        }
        assert!(seen[1].load(Ordering::Relaxed) > before && seen[2].load(Ordering::Relaxed) > 0, "given back, the workers never joined");
    }

    #[test]
    fn wait_lent_returns_once_the_lent_worker_is_out_of_its_job() {
        let pool = ThreadPool::new(2);
        for _ in 0..20 {
            let in_job = AtomicBool::new(false);
            let done = AtomicBool::new(false);
            std::thread::scope(|sc| {
                let (p, in_job, done) = (&pool, &in_job, &done);
                sc.spawn(move || {
                    // Once worker 1 is in a long chunk, lend it and wait for it.
                    while !in_job.load(Ordering::SeqCst) && !done.load(Ordering::SeqCst) {
                        std::hint::spin_loop();
                    }
                    p.lend(1);
                    p.wait_lent();
                    assert!(!in_job.load(Ordering::SeqCst), "wait_lent returned while the lent worker was in a chunk");
                });
                pool.for_chunks("test", 64, 1, &|_, _| {
                    if std::thread::current().name().is_some_and(|n| n.starts_with("llms-worker")) {
                        in_job.store(true, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(2));
                        in_job.store(false, Ordering::SeqCst);
                    }
                });
                done.store(true, Ordering::SeqCst);
            });
            pool.lend(0);
        }
    }

    #[test]
    fn a_job_in_flight_gives_up_a_lent_worker_and_still_covers_its_range() {
        let pool = ThreadPool::new(2);
        for round in 0..50 {
            let n = 2000;
            let covered: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            let after_lend = AtomicUsize::new(0);
            let lent = std::sync::atomic::AtomicBool::new(false);
            let on = std::thread::current().id();
            pool.for_runs("test", n, 4, &|a, b| {
                if a >= n / 4 && !lent.swap(true, Ordering::Relaxed) {
                    pool.lend(1);
                }
                if lent.load(Ordering::Relaxed) && std::thread::current().id() != on {
                    after_lend.fetch_add(1, Ordering::Relaxed);
                }
                for c in &covered[a..b] {
                    c.fetch_add(1, Ordering::Relaxed);
                }
            });
            pool.lend(0);
            assert!(covered.iter().all(|c| c.load(Ordering::Relaxed) == 1), "round {round}");
            // The worker leaves at its next chunk: at most the one it was in and one it had
            // claimed as the flag was set.
            assert!(
                after_lend.load(Ordering::Relaxed) <= 2,
                "round {round}: the lent worker ran {} chunks",
                after_lend.load(Ordering::Relaxed)
            );
        }
    }

    #[test]
    fn chunks_cover_the_range_exactly_once() {
        let pool = ThreadPool::new(3);
        for round in 0..300 {
            let n = 1 + round * 7 % 1000;
            let covered: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.for_chunks("test", n, 1 + round % 9, &|a, b| {
                for c in &covered[a..b] {
                    c.fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(covered.iter().all(|c| c.load(Ordering::Relaxed) == 1), "round {round}");
        }
    }

    #[test]
    fn runs_cover_the_range_once_and_each_thread_reads_its_share_in_order() {
        let pool = ThreadPool::new(3);
        for round in 0..300 {
            let n = 1 + round * 7 % 1000;
            let chunk = 1 + round % 9;
            let covered: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            let claims: Vec<Mutex<Vec<(usize, usize)>>> = (0..3).map(|_| Mutex::new(Vec::new())).collect();
            let on = std::thread::current().id();
            pool.for_runs("test", n, chunk, &|a, b| {
                for c in &covered[a..b] {
                    c.fetch_add(1, Ordering::Relaxed);
                }
                // The caller is participant 0; the workers' claims are told apart by their names.
                let me = std::thread::current();
                let idx = if me.id() == on {
                    0
                } else {
                    me.name().and_then(|s| s.strip_prefix("llms-worker-")).map_or(9, |i| i.parse().unwrap())
                };
                claims[idx].lock().unwrap().push((a, b));
            });
            assert!(covered.iter().all(|c| c.load(Ordering::Relaxed) == 1), "round {round}");
            if n <= chunk {
                continue;
            }
            for (idx, c) in claims.iter().enumerate() {
                let c = c.lock().unwrap();
                // A participant's chunks within one run follow each other in order (it may
                // skip what another took from it).
                let run_of = |a: usize| (0..3).find(|&i| a < (i + 1) * n / 3).unwrap();
                for w in c.windows(2) {
                    if run_of(w[0].0) == run_of(w[1].0) {
                        assert!(w[1].0 >= w[0].1, "round {round}: {idx} went back in a run: {c:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_participant_reads_its_own_run_first_then_the_others_in_turn() {
        let runs = Runs::new(30, 4, 3);
        let mut from = 0;
        let claims: Vec<(usize, usize)> = std::iter::from_fn(|| runs.claim(1, &mut from)).collect();
        assert_eq!(claims, [(10, 14), (14, 18), (18, 20), (20, 24), (24, 28), (28, 30), (0, 4), (4, 8), (8, 10)]);
        let runs = Runs::new(30, 4, 3);
        let (mut f0, mut f2) = (0, 0);
        assert_eq!(runs.claim(2, &mut f2), Some((20, 24)));
        assert_eq!(runs.claim(0, &mut f0), Some((0, 4)));
        assert_eq!(runs.claim(2, &mut f2), Some((24, 28)), "each participant in its own run");
    }

    #[test]
    fn workers_take_part_and_jobs_after_parking_still_run() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(SPIN * 3);
        let by: Vec<AtomicUsize> = (0..2).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..50 {
            pool.run(&|i| {
                by[i].fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(200));
            });
        }
        assert_eq!(by[0].load(Ordering::Relaxed), 50, "the caller runs every job");
        assert!(by[1].load(Ordering::Relaxed) > 0, "the worker joined some jobs");
    }

    #[test]
    fn scatter_hands_out_every_item_once() {
        let pool = ThreadPool::new(2);
        let mut data = vec![0u32; 1000];
        let items: Vec<(usize, &mut [u32])> = data.chunks_mut(7).enumerate().collect();
        pool.scatter("test", items, &|(i, c)| c.iter_mut().for_each(|x| *x += 1 + u32::try_from(i).unwrap()));
        for (i, c) in data.chunks(7).enumerate() {
            assert!(c.iter().all(|&x| x == 1 + u32::try_from(i).unwrap()));
        }
    }

    #[test]
    fn a_worker_panic_is_reraised_in_the_caller() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            for _ in 0..1000 {
                pool.for_chunks("test", 64, 1, &|a, _| assert!(a != 63, "boom"));
            }
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.for_chunks("test", 100, 1, &|_, _| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 100);
    }

    #[test]
    fn profiling_counts_calls_and_tasks_per_operation() {
        let pool = ThreadPool::new(2);
        pool.for_chunks("off", 10, 1, &|_, _| {});
        pool.set_profiling(true);
        for _ in 0..2 {
            pool.for_chunks("a", 100, 7, &|_, _| {});
        }
        pool.scatter("b", vec![1u8; 5], &|_| {});
        pool.for_chunks("c", 3, 8, &|_, _| {});
        pool.set_profiling(false);
        pool.for_chunks("a", 100, 7, &|_, _| {});
        let p = pool.take_profile();
        let names: Vec<&str> = p.iter().map(|o| o.name).collect();
        assert_eq!(names, ["a", "b", "c"], "nothing is recorded while off");
        assert_eq!((p[0].calls, p[0].tasks), (2, 30), "100 in chunks of 7: 15 tasks a call");
        assert_eq!((p[1].calls, p[1].tasks), (1, 5));
        assert_eq!((p[2].calls, p[2].tasks), (1, 1), "fewer items than a chunk: one task, on the caller");
        for o in &p {
            assert_eq!(o.threads, 2);
            assert!(o.max_busy <= o.busy && o.busy <= 2 * o.max_busy, "{o:?}");
            assert!((1.0..=2.0).contains(&o.imbalance()) || o.busy.is_zero(), "{o:?}");
        }
        assert!(pool.take_profile().is_empty(), "taking the profile empties it");
    }
}

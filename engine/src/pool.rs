//! A small thread pool for the forward pass: one job at a time, broadcast to every thread, the
//! caller taking part as thread 0.
//!
//! A decode step runs a few hundred short parallel operations, each a few microseconds long,
//! so waking sleeping threads through the kernel for each one would cost as much as the work.
//! Workers therefore spin on a generation counter for a while after each job and only park
//! (on a condvar) when no job has come for ~a millisecond.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job<'a> = dyn Fn(usize) + Sync + 'a;

/// Points at a job on the caller's stack; valid while the caller waits in `run`.
struct JobRef {
    job: *const Job<'static>,
}

struct Shared {
    generation: AtomicU64,
    job: AtomicPtr<JobRef>,
    /// Workers that have not finished the current job.
    pending: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
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
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool").field("threads", &self.n).finish()
    }
}

impl ThreadPool {
    pub fn new(n: usize) -> Self {
        let n = n.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..n)
            .map(|idx| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new().name(format!("llms-worker-{idx}")).spawn(move || worker(&s, idx)).expect("spawn worker thread")
            })
            .collect();
        Self { n, shared, workers }
    }

    pub fn threads(&self) -> usize {
        self.n
    }

    /// Runs `job(i)` for every thread index `i` in `0..threads()`, the caller running index 0,
    /// and returns when all have finished. A panic in any of them is re-raised here.
    pub fn run(&self, job: &(dyn Fn(usize) + Sync)) {
        if self.n == 1 {
            job(0);
            return;
        }
        // SAFETY: we erase the job's lifetime to hand it to the workers; it stays valid because
        // this function does not return (or unwind: see WaitGuard) before every worker has
        // finished with it (pending == 0).
        let job_static: *const Job<'static> = unsafe { std::mem::transmute::<*const Job<'_>, *const Job<'static>>(job) };
        let mut jref = JobRef { job: job_static };
        let s = &*self.shared;
        s.pending.store(self.n - 1, Ordering::Relaxed);
        s.job.store(&mut jref, Ordering::Relaxed);
        // SeqCst pairs with the parking worker's SeqCst sleepers/generation accesses: either it
        // sees the new generation or we see it counted as a sleeper and notify it.
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        struct WaitGuard<'a>(&'a Shared);
        impl Drop for WaitGuard<'_> {
            fn drop(&mut self) {
                while self.0.pending.load(Ordering::Acquire) != 0 {
                    std::hint::spin_loop();
                }
            }
        }
        {
            let _wait = WaitGuard(s);
            job(0);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a worker thread panicked");
        }
    }

    /// Splits `0..n` into chunks of `chunk` and hands them out dynamically (an atomic counter),
    /// so a thread slowed by another process on the machine does not hold up the rest.
    pub fn for_chunks(&self, n: usize, chunk: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        let chunk = chunk.max(1);
        if self.n == 1 || n <= chunk {
            f(0, n);
            return;
        }
        let next = AtomicUsize::new(0);
        self.run(&|_| loop {
            let start = next.fetch_add(chunk, Ordering::Relaxed);
            if start >= n {
                break;
            }
            f(start, (start + chunk).min(n));
        });
    }

    /// Hands each of `items` (typically disjoint `&mut` pieces of buffers) to one call of `f`,
    /// spread over the threads.
    pub fn scatter<T: Send>(&self, items: Vec<T>, f: &(dyn Fn(T) + Sync)) {
        let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
        self.for_chunks(slots.len(), 1, &|a, b| {
            for slot in &slots[a..b] {
                if let Some(item) = slot.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    f(item);
                }
            }
        });
    }
}

fn worker(s: &Shared, idx: usize) {
    let mut seen = 0u64;
    loop {
        // Spin, then park, until a new generation (job) or shutdown.
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            if s.generation.load(Ordering::Acquire) != seen {
                break;
            }
            std::hint::spin_loop();
            spins += 1;
            if spins.is_multiple_of(1024) && start.elapsed() > SPIN {
                let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                while s.generation.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::Acquire) {
                    g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
            }
        }
        seen = s.generation.load(Ordering::Acquire);
        let jref = s.job.load(Ordering::Relaxed);
        // SAFETY: the dispatcher published jref before bumping the generation (Release/Acquire)
        // and keeps it alive until pending reaches 0, which happens only after this use.
        let job = unsafe { &*(*jref).job };
        if catch_unwind(AssertUnwindSafe(|| job(idx))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.pending.fetch_sub(1, Ordering::AcqRel);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_runs_once_per_job_and_chunks_cover_the_range() {
        let pool = ThreadPool::new(3);
        for _ in 0..200 {
            let hits: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
            pool.run(&|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        let covered: Vec<AtomicUsize> = (0..1000).map(|_| AtomicUsize::new(0)).collect();
        pool.for_chunks(1000, 7, &|a, b| {
            for c in &covered[a..b] {
                c.fetch_add(1, Ordering::Relaxed);
            }
        });
        assert!(covered.iter().all(|c| c.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn jobs_after_parking_still_run() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(SPIN * 3);
        let n = AtomicUsize::new(0);
        pool.run(&|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_worker_panic_is_reraised_in_the_caller() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| pool.run(&|i| assert!(i == 0, "boom"))));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(&|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }
}

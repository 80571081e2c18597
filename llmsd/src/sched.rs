//! How the kernel schedules the threads that run the model's passes.
//!
//! A token sampled by the worker reaches its app through threads that do little work and then
//! sleep (the HTTP front's runtime, the native protocol's connection threads) and then through
//! the app's own thread. By the time they wake, the
//! worker has begun the next pass and its pool's threads hold every core of a small device.
//! Under EEVDF (Linux 6.6 on) a waking thread waits until the running one has used up its
//! protected slice; a probe in `llms bench-prefix`'s branch saw the first token wait 3-5 ms
//! between the worker sending it and the front streaming it (docs/notes/llmsd.md, "Tokens
//! behind the pool's slices").
//!
//! Since Linux 6.12 a SCHED_OTHER thread may ask for its own slice (`sched_setattr`'s
//! `sched_runtime`, 0.1-100 ms, no privilege needed), and a thread that wakes with a shorter
//! slice than the running one preempts it at once (the scheduler's PREEMPT_SHORT). So the
//! pool's threads and the worker ask for a long slice: every thread that keeps the default
//! slice, the service's own and every app's alike, preempts a pass when it wakes, without
//! asking anything. Their weight (nice value) is unchanged: the pool takes no more CPU than
//! before, it only yields it sooner. Older kernels ignore the field.

/// The slice the pool's threads ask for: longer than the kernel's default (0.75 ms times
/// 1 + log2 of the CPUs: 3 ms at 8) so that any default thread preempts them. A pass's
/// threads wait for one another at every operation, so a preempted one holds the pass back
/// either way; what the long slice changes is who waits: the pass, a little, rather than a
/// token's delivery (4 clients of `llms bench-serve`: docs/results/serve-ab-slice.json).
pub const POOL_SLICE_NS: u64 = 10_000_000;

/// Asks `ns` of slice for the calling thread, keeping its nice value. An error is the kernel's
/// refusal (a seccomp filter, say); the thread keeps the default slice and works as before.
fn set_slice(ns: u64) -> std::io::Result<()> {
    // SAFETY: an all-zero sched_attr is a valid value (SCHED_OTHER, nice 0, no flags).
    let mut a: libc::sched_attr = unsafe { std::mem::zeroed() };
    a.size = u32::try_from(std::mem::size_of::<libc::sched_attr>()).unwrap_or(u32::MAX);
    a.sched_policy = u32::try_from(libc::SCHED_OTHER).unwrap_or(0);
    // SAFETY: getpriority on this thread's id.
    a.sched_nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid().cast_unsigned()) };
    a.sched_runtime = ns;
    // SAFETY: sched_setattr(2) on this thread (pid 0) with an initialised attribute of the size
    // it states; the kernel reads it and keeps no pointer.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &raw const a, 0u32) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The slice the threads that carry tokens to apps ask for (the native protocol's connection
/// threads, the HTTP front's runtime): the kernel's least. A wake-up preempts the running
/// thread only if the woken one is eligible (it has not run ahead of its share), and a thread
/// that wakes for every token, does a few microseconds of work and sleeps again is not always:
/// `perf sched timehist` over `llms bench-serve --clients 8 --calls 4` showed a connection
/// thread woken onto the prompt lane's core wait 3.7 ms there, until the tick, and the tokens'
/// way from their pass to their clients had a p99 of 1.8-3.2 ms in three runs. With this slice
/// its deadline comes first once it is eligible, and the same runs gave 1.1-1.6 ms
/// (docs/notes/llmsd.md, "Tokens waiting for a core").
pub const DELIVERY_SLICE_NS: u64 = 100_000;

/// Asks `ns` of slice for the calling thread; a refusal is logged once per `warned` (the
/// service works on without it).
fn slice_or_warn(ns: u64, warned: &std::sync::Once, who: &str) {
    if let Err(e) = set_slice(ns) {
        warned.call_once(|| tracing::warn!("{who} keep the default CPU slice: {e}"));
    }
}

/// [`POOL_SLICE_NS`] for the calling thread.
pub fn long_slice_or_warn() {
    static WARNED: std::sync::Once = std::sync::Once::new();
    slice_or_warn(POOL_SLICE_NS, &WARNED, "the model's threads");
}

/// [`DELIVERY_SLICE_NS`] for the calling thread.
pub fn short_slice_or_warn() {
    static WARNED: std::sync::Once = std::sync::Once::new();
    slice_or_warn(DELIVERY_SLICE_NS, &WARNED, "the threads that carry tokens");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's slice as the kernel reports it (`sched_runtime`), in ns: 0 before
    /// Linux 6.12, which has no per-thread slice for SCHED_OTHER.
    pub fn slice_ns() -> std::io::Result<u64> {
        // SAFETY: an all-zero sched_attr is a valid value.
        let mut a: libc::sched_attr = unsafe { std::mem::zeroed() };
        let size = u32::try_from(std::mem::size_of::<libc::sched_attr>()).unwrap_or(u32::MAX);
        // SAFETY: sched_getattr(2) on this thread writes at most `size` bytes into `a`.
        let r = unsafe { libc::syscall(libc::SYS_sched_getattr, 0, &raw mut a, size, 0u32) };
        if r == 0 {
            Ok(a.sched_runtime)
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// The running kernel's (major, minor).
    fn kernel() -> (u32, u32) {
        let r = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut it = r.trim().split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
        (it.next().unwrap_or(0), it.next().unwrap_or(0))
    }

    #[test]
    fn pool_threads_get_the_long_slice_and_keep_their_nice_value() {
        let pool = engine::ThreadPool::with_start(2, || {
            // SAFETY: setpriority on this thread's id (raising nice needs no privilege).
            unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid().cast_unsigned(), 3) };
            long_slice_or_warn();
        });
        // SAFETY: gettid on the calling thread (the pool's participant 0).
        let me = unsafe { libc::gettid().cast_unsigned() };
        let seen = std::sync::Mutex::new(Vec::new());
        // Until the other thread has taken part (chunks are claimed dynamically).
        let mut tries = 0;
        while seen.lock().unwrap().iter().all(|&(tid, _, _)| tid == me) {
            tries += 1;
            assert!(tries < 10_000, "the pool's worker thread never took a chunk");
            seen.lock().unwrap().clear();
            pool.for_chunks("probe", 64, 1, &|_, _| {
                // SAFETY: gettid/getpriority on the calling thread.
                let (tid, nice) =
                    unsafe { (libc::gettid().cast_unsigned(), libc::getpriority(libc::PRIO_PROCESS, libc::gettid().cast_unsigned())) };
                seen.lock().unwrap().push((tid, nice, slice_ns().expect("sched_getattr")));
            });
        }
        let seen = seen.into_inner().unwrap();
        let (_, nice, slice) = *seen.iter().find(|&&(tid, _, _)| tid != me).expect("a worker thread");
        assert_eq!(nice, 3, "the slice was set keeping the thread's nice value");
        let k = kernel();
        let probe = if k >= (6, 12) { Ok(()) } else { Err(format!("kernel {k:?} has none (Linux 6.12); only the call was checked")) };
        if llms_tests::require_kernel("a per-thread CPU slice", probe).is_some() {
            assert_eq!(slice, POOL_SLICE_NS);
        }
    }
}

//! When the caller's forward passes run (or other work an app waits on, such as a fork), so
//! background work (the AoT writer) can fall in the gaps between them instead of taking a
//! core, or the disk, from it.
//!
//! A blocking gate, not a flag polled: the writer first slept 500 µs at a time while a pass
//! ran, and on a 2-core machine whose two pool threads spin through a pass each wake-up
//! preempted one of them — a branch's 50-token prefill (141 ms on an AMD EPYC guest) took
//! 234 involuntary context switches against 4-18 for the conversation's own passes of the same
//! size, and ran ~25% above the engine's floor. Waiting on a condition variable wakes the
//! writer once, when the pass ends.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Whether passes run, and who waits for a gap.
#[derive(Debug, Default)]
pub struct PassGate {
    state: Mutex<State>,
    gap: Condvar,
}

#[derive(Debug, Default)]
struct State {
    /// Passes (and other foreground work) running now, on any thread: a fork on a
    /// connection's thread may overlap the worker's pass, and the gap comes when both end.
    running: usize,
    /// Threads blocked in [`PassGate::wait_gap`] (the end of a pass wakes them only then).
    sleepers: usize,
    /// Callers that wait for the background work itself ([`PassGate::urgent`]): while any
    /// does, nobody holds back for passes (the caller runs none meanwhile, or it would wait
    /// out the hold beside them).
    urgent: usize,
}

impl PassGate {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks a pass running until the guard drops (also on unwind). Guards may overlap.
    pub fn pass(&self) -> Pass<'_> {
        self.lock().running += 1;
        Pass(self)
    }

    /// Blocks while a pass runs and nobody is urgent, at most `most`. Returns at once when
    /// no pass runs.
    pub fn wait_gap(&self, most: Duration) {
        let until = Instant::now() + most;
        let mut g = self.lock();
        while g.running > 0 && g.urgent == 0 {
            let now = Instant::now();
            if now >= until {
                break;
            }
            g.sleepers += 1;
            g = self.gap.wait_timeout(g, until - now).unwrap_or_else(|e| e.into_inner()).0;
            g.sleepers -= 1;
        }
    }

    /// While the returned guard lives, [`PassGate::wait_gap`] does not block.
    pub fn urgent(&self) -> Urgent<'_> {
        let mut g = self.lock();
        g.urgent += 1;
        if g.sleepers > 0 {
            self.gap.notify_all();
        }
        Urgent(self)
    }

    /// Whether a pass runs now.
    pub fn running(&self) -> bool {
        self.lock().running > 0
    }
}

/// A pass running ([`PassGate::pass`]).
#[derive(Debug)]
pub struct Pass<'a>(&'a PassGate);

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        let mut g = self.0.lock();
        g.running -= 1;
        // A wake-up only when someone sleeps: the pass's end costs a lock and no syscall.
        if g.running == 0 && g.sleepers > 0 {
            self.0.gap.notify_all();
        }
    }
}

/// Someone waits for the background work ([`PassGate::urgent`]).
#[derive(Debug)]
pub struct Urgent<'a>(&'a PassGate);

impl Drop for Urgent<'_> {
    fn drop(&mut self) {
        self.0.lock().urgent -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc};

    /// A waiter blocked for the gap comes out when the pass ends, not before; with no pass it
    /// does not block. (The bound of the hold is a wall-clock limit, not asserted here.)
    #[test]
    fn a_gap_waiter_wakes_when_the_pass_ends() {
        let gate = Arc::new(PassGate::default());
        gate.wait_gap(Duration::from_secs(3600));
        let pass = gate.pass();
        assert!(gate.running());
        let (g, out) = (Arc::clone(&gate), Arc::new(AtomicBool::new(false)));
        let o = Arc::clone(&out);
        let (ready_tx, ready) = mpsc::channel();
        let t = std::thread::spawn(move || {
            ready_tx.send(()).unwrap();
            g.wait_gap(Duration::from_secs(3600));
            o.store(true, Ordering::SeqCst);
        });
        ready.recv().unwrap();
        // The waiter sleeps inside wait_gap once it is counted (or came out: a failure).
        while gate.lock().sleepers == 0 && !out.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        assert!(!out.load(Ordering::SeqCst), "the waiter came out while the pass ran");
        drop(pass);
        t.join().unwrap();
        assert!(out.load(Ordering::SeqCst));
        assert!(!gate.running());
    }

    /// Two overlapping passes (a fork beside the worker's pass): the gap comes when both end,
    /// in either order.
    #[test]
    fn the_gap_waits_for_every_overlapping_pass() {
        let gate = Arc::new(PassGate::default());
        let (a, b) = (gate.pass(), gate.pass());
        let g = Arc::clone(&gate);
        let t = std::thread::spawn(move || g.wait_gap(Duration::from_secs(3600)));
        while gate.lock().sleepers == 0 && !t.is_finished() {
            std::thread::yield_now();
        }
        drop(a);
        assert!(gate.running(), "one pass still runs");
        std::thread::sleep(Duration::from_millis(20));
        assert!(!t.is_finished(), "the waiter came out while a pass ran");
        drop(b);
        t.join().unwrap();
        assert!(!gate.running());
    }

    /// Someone waiting for the background work releases a waiter held by a running pass.
    #[test]
    fn an_urgent_caller_releases_the_hold() {
        let gate = Arc::new(PassGate::default());
        let _pass = gate.pass();
        let g = Arc::clone(&gate);
        let t = std::thread::spawn(move || g.wait_gap(Duration::from_secs(3600)));
        while gate.lock().sleepers == 0 && !t.is_finished() {
            std::thread::yield_now();
        }
        assert!(!t.is_finished(), "the waiter came out while the pass ran");
        let u = gate.urgent();
        t.join().unwrap();
        drop(u);
        assert_eq!(gate.lock().urgent, 0);
    }

    /// A pass that unwinds still ends.
    #[test]
    fn a_pass_that_panics_ends() {
        let gate = PassGate::default();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _p = gate.pass();
            panic!("in the pass");
        }));
        assert!(r.is_err());
        assert!(!gate.running());
    }
}

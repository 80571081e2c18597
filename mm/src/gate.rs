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
    /// Passes that have ended (the gaps opened so far), and when the last one did.
    ends: u64,
    last_end: Option<Instant>,
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

    /// One turn of background work a gap: blocks until no pass runs and either a pass has
    /// ended since the caller's last turn (`seen`, updated here), or none has ended for `idle`
    /// (the caller's passes have stopped), or someone is urgent, at most `most`.
    ///
    /// Why not [`PassGate::wait_gap`] for work done on the CPU: between two passes the worker
    /// still samples and starts the next one, on a core the background thread may have taken
    /// when it woke. While it runs there, no pass starts, so `wait_gap` found the gap still
    /// open after each piece of work and let the next one run at once. On a 2-core Intel Xeon
    /// guest the leveller held the worker off its core for 2.4-3.6 ms at a time this way
    /// (`perf record -e sched:sched_switch` of `llms bench-serve --clients 4 --calls 4`),
    /// where one layer's encoding is ~0.5 ms. With a turn a gap, the worker waits at most one
    /// piece before its next pass.
    pub fn wait_turn(&self, seen: &mut u64, idle: Duration, most: Duration) {
        let until = Instant::now() + most;
        let mut g = self.lock();
        loop {
            if g.urgent > 0 {
                break;
            }
            let now = Instant::now();
            // With no pass running: when the foreground counts as quiet (at once if no pass
            // has ever run).
            let quiet = (g.running == 0).then(|| g.last_end.map_or(now, |t| t + idle));
            if quiet.is_some_and(|q| g.ends > *seen || now >= q) || now >= until {
                break;
            }
            // Until the next pass ends (it notifies), or the foreground has been quiet for
            // `idle`, or the hold is over.
            let wake = quiet.map_or(until, |q| q.min(until));
            g.sleepers += 1;
            g = self.gap.wait_timeout(g, wake.saturating_duration_since(now)).unwrap_or_else(|e| e.into_inner()).0;
            g.sleepers -= 1;
        }
        *seen = g.ends;
    }

    /// While the returned guard lives, [`PassGate::wait_gap`] and [`PassGate::wait_turn`] do not
    /// block.
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
        if g.running == 0 {
            g.ends += 1;
            g.last_end = Some(Instant::now());
        }
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

    /// A turn a gap: a waiter that has had its turn in this gap waits, with no pass running,
    /// until the next pass ends; the first turn after a pass, a quiet gate, or an urgent
    /// caller do not block. (The quiet and hold limits are wall-clock: 0 and 1 hour here.)
    #[test]
    fn a_background_turn_is_one_a_gap() {
        const HOUR: Duration = Duration::from_secs(3600);
        let gate = Arc::new(PassGate::default());
        let mut seen = 0;
        // Never a pass: quiet, at once.
        gate.wait_turn(&mut seen, HOUR, HOUR);
        drop(gate.pass());
        // The gap after a pass: this caller's first turn in it.
        gate.wait_turn(&mut seen, HOUR, HOUR);
        assert_eq!(seen, 1);
        // A second turn in the same gap waits for the next pass's end.
        let (g, out) = (Arc::clone(&gate), Arc::new(AtomicBool::new(false)));
        let o = Arc::clone(&out);
        let t = std::thread::spawn(move || {
            let mut s = seen;
            g.wait_turn(&mut s, HOUR, HOUR);
            o.store(true, Ordering::SeqCst);
            s
        });
        while gate.lock().sleepers == 0 && !out.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        assert!(!out.load(Ordering::SeqCst), "a second turn in one gap did not wait");
        let pass = gate.pass();
        assert!(!out.load(Ordering::SeqCst));
        drop(pass);
        assert_eq!(t.join().unwrap(), 2);
        // With no quiet time asked for, the same gap's second turn does not wait.
        gate.wait_turn(&mut seen, Duration::ZERO, HOUR);
        gate.wait_turn(&mut seen, Duration::ZERO, HOUR);
        // A turn held back in a gap it has had comes out when someone turns urgent.
        let (g, out) = (Arc::clone(&gate), Arc::new(AtomicBool::new(false)));
        let o = Arc::clone(&out);
        let t = std::thread::spawn(move || {
            let mut s = seen;
            g.wait_turn(&mut s, HOUR, HOUR);
            o.store(true, Ordering::SeqCst);
        });
        while gate.lock().sleepers == 0 && !out.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        assert!(!out.load(Ordering::SeqCst), "a second turn in one gap did not wait");
        let urgent = gate.urgent();
        t.join().unwrap();
        drop(urgent);
        // And while someone is urgent, a turn does not wait at all.
        let urgent = gate.urgent();
        gate.wait_turn(&mut seen, HOUR, HOUR);
        drop(urgent);
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

//! The leveller: lowers the compression levels `mm.end` chooses for a call's chunks (eq. 2-3)
//! on a thread of its own, at a lower CPU priority than the worker and its pool. On the worker
//! the encoders held every running call's next token: ~15 ms a chunk of the default model,
//! 230-320 ms whenever a call ended (#56). A chunk waits resident at its level meanwhile and
//! is written to flash once lowered (`mm::Manager::set_background_levels`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tracing::warn;

use super::{lock, Service};

/// The leveller's nice value, the lowest priority short of SCHED_IDLE: beside a busy pool it
/// gets ~1.5% of a core (a nice-19 thread weighs 15 against a nice-0 one's 1024), so it
/// rarely takes a core from a pass (each pass waits for its slowest thread), yet it is never
/// starved for good as SCHED_IDLE would be under a steady load; on an idle machine it runs at
/// full speed. (`llms bench-serve --trace`, 4 clients: inter-token p99 48-52 ms at nice 10,
/// 33-34 ms at nice 19, 40-41 ms with no leveller at all: within this host's noise of it.)
const NICE: libc::c_int = 19;

/// Longest the leveller waits for a gap between passes before it encodes a layer anyway: the
/// priority alone did not keep it off the passes. A nice-19 thread's turn on a core is as long
/// in time as any other's, and a pass waits for its slowest thread, so each turn the leveller
/// took beside a pass stalled it: 11-25 ms passes where a 4-client step takes ~5 ms, none with
/// `--levels int8` (no lowering), and SCHED_IDLE did no better (#56). It encodes one layer a gap
/// (`PassGate::wait_turn`), so it holds a core for a layer's encoding (~0.5 ms on the default
/// model) at most when a pass begins. Passes end every few ms under load, so the hold bounds
/// only a pass stream with no gap at all.
const GAP_HOLD: std::time::Duration = std::time::Duration::from_millis(100);

/// How long after the last pass's end the foreground counts as quiet, so the leveller encodes
/// layer after layer without waiting for another gap: longer than the worker's work between
/// two passes (sampling and cutting the next pass: 0.1-0.5 ms under load), short beside a
/// layer's encoding, so an idle service levels at full speed.
const QUIET: std::time::Duration = std::time::Duration::from_millis(2);

impl Service {
    /// Tells the leveller `end` may have queued lowerings.
    pub(super) fn wake_leveller(&self) {
        let (m, cv) = &self.leveller;
        *lock(m) = true;
        cv.notify_one();
    }

    /// Runs until the service stops: each queued lowering's chunk is copied under mm's lock,
    /// encoded without it, and installed under it again (dropped if the chunk changed).
    pub(super) fn leveller(&self) {
        // SAFETY: setpriority on this thread's id (raising the nice value needs no privilege).
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid().cast_unsigned(), NICE) } != 0 {
            warn!("the leveller keeps the worker's priority: {}", std::io::Error::last_os_error());
        }
        let codec = Arc::clone(lock(&self.mm).codec());
        // The passes whose gaps this thread has had its turn in (`PassGate::wait_turn`), kept
        // across wake-ups: a wake-up in a gap already used waits for the next one too.
        let mut seen = 0;
        loop {
            {
                let (m, cv) = &self.leveller;
                let mut woken = lock(m);
                while !*woken && !self.stopping.load(Ordering::SeqCst) {
                    woken = cv.wait(woken).unwrap_or_else(std::sync::PoisonError::into_inner);
                }
                *woken = false;
            }
            if self.stopping.load(Ordering::SeqCst) {
                return;
            }
            loop {
                let Some(work) = lock(&self.mm).take_level_work() else { break };
                // A panic in an encoder (a bug) fails this chunk, not the leveller: the chunk
                // is written at the level it has and stays there.
                // A layer at a time, each in a gap between the worker's passes where it can
                // wait for one (`LevelWork::encode_layers`).
                let before = || {
                    if let Some(g) = &self.passes {
                        g.wait_turn(&mut seen, QUIET, GAP_HOLD);
                    }
                };
                let lowered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work.encode_layers(&*codec, before)))
                    .unwrap_or_else(|p| {
                        Err(mm::EngineError::new(format!("the encoder panicked: {}", super::call::panic_message(p.as_ref()))))
                    });
                if let Err(e) = lock(&self.mm).finish_level_work(work, lowered) {
                    warn!("installing a lowered chunk: {e}");
                }
            }
        }
    }
}

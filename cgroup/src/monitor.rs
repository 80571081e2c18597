//! The live monitor loop: sample, classify, control, publish.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::policy::{BudgetController, Classifier, Event, Level, Thresholds};
use crate::probe::Probe;
use crate::signals::{Sample, SignalError};
use crate::trigger::PsiTrigger;

/// Monitor settings.
#[derive(Debug, Clone, Copy)]
pub struct MonitorOptions {
    pub thresholds: Thresholds,
    /// Budget limits for the memory LLMS manages.
    pub budget_max: u64,
    pub budget_floor: u64,
    /// Sampling interval while calm, and while pressure is near (after an event, above
    /// Normal, or with little headroom).
    pub slow_ms: u64,
    pub fast_ms: u64,
    /// PSI trigger asked for (rounded for unprivileged callers): stall and window in µs.
    pub trigger: Option<(u64, u64)>,
}

impl Default for MonitorOptions {
    fn default() -> Self {
        Self {
            thresholds: Thresholds::default(),
            budget_max: u64::MAX / 2,
            budget_floor: 0,
            slow_ms: 500,
            fast_ms: 50,
            trigger: Some((150_000, 1_000_000)),
        }
    }
}

/// How whoever obeys the budget tells a running monitor that it just freed memory: the next
/// sample's headroom dip is then held off (`Classifier::note_eviction`, docs/pressure.md) until
/// the eviction's effect is measured, instead of escalating on memory already on its way back.
#[derive(Debug, Clone, Default)]
pub struct Evictions(Arc<AtomicBool>);

impl Evictions {
    /// Memory was freed just now.
    pub fn note(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// Whether memory was freed since the last call.
    fn take(&self) -> bool {
        self.0.swap(false, Ordering::AcqRel)
    }
}

/// Runs the monitor until `sink` returns false. Each sample and the event it produced go to
/// `sink`. A PSI trigger (when PSI is there) wakes the loop early; a trigger event that the
/// `total` counter does not confirm (unprivileged triggers can fire once after arming) only
/// causes a sample. If the trigger fails (EPOLLERR) the loop falls back to polling.
pub fn run(probe: &Probe, opts: MonitorOptions, sink: &mut dyn FnMut(&Sample, &Event) -> bool) -> Result<(), SignalError> {
    run_noting(probe, opts, &Evictions::default(), sink)
}

/// [`run`], told of evictions through `evictions`.
pub fn run_noting(
    probe: &Probe,
    opts: MonitorOptions,
    evictions: &Evictions,
    sink: &mut dyn FnMut(&Sample, &Event) -> bool,
) -> Result<(), SignalError> {
    let sources = probe.sources();
    // The cgroup's own pressure file when there is one (it sees the service's stalls
    // without the rest of the system's noise), else the system's.
    let trigger_path = sources.cgroup_psi().or_else(|| probe.psi.as_ref().ok().cloned());
    let mut trigger = match (trigger_path, opts.trigger) {
        (Some(path), Some((stall, window))) => PsiTrigger::register(&path, false, stall, window, probe.cap_sys_resource).ok(),
        _ => None,
    };
    let mut classifier = Classifier::new(opts.thresholds);
    let mut budget = BudgetController::new(opts.budget_max, opts.budget_floor);
    let start = Instant::now();
    let mut fast_until = 0u64;
    let mut last_total = None;
    loop {
        let t_ms = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
        let interval = if t_ms < fast_until || classifier.level() > Level::Normal { opts.fast_ms } else { opts.slow_ms };
        let fired = match &trigger {
            Some(t) => match t.wait(i32::try_from(interval).unwrap_or(i32::MAX)) {
                Ok(f) => f,
                Err(_) => {
                    trigger = None;
                    false
                }
            },
            None => {
                std::thread::sleep(Duration::from_millis(interval));
                false
            }
        };
        let t_ms = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
        let s = sources.sample(t_ms)?;
        let total = s.psi.map(|p| p.some.total_us);
        if fired && total.is_some() && total != last_total {
            // A confirmed stall: watch closely for one trigger window.
            fast_until = t_ms + opts.trigger.map_or(1000, |(_, w)| w / 1000);
        }
        last_total = total;
        if evictions.take() {
            classifier.note_eviction(t_ms);
        }
        let (level, signals) = classifier.update(&s);
        if signals.headroom < opts.thresholds.headroom_enter[0] * 1.5 {
            fast_until = fast_until.max(t_ms + opts.slow_ms);
        }
        let (b, need_to_free) = budget.update(level, &signals, &opts.thresholds, s.headroom_base());
        let ev = Event { t_ms, level, budget: b, need_to_free, signals };
        if !sink(&s, &ev) {
            return Ok(());
        }
    }
}

/// Runs the monitor on its own thread and sends every event on a channel; the thread ends
/// when the receiver is dropped (or a signal file becomes unreadable, reported as the
/// thread's result).
pub fn spawn(probe: Probe, opts: MonitorOptions) -> (std::sync::mpsc::Receiver<Event>, std::thread::JoinHandle<Result<(), SignalError>>) {
    spawn_noting(probe, opts, Evictions::default())
}

/// [`spawn`], told of evictions through `evictions` (keep a clone to [`Evictions::note`] them).
pub fn spawn_noting(
    probe: Probe,
    opts: MonitorOptions,
    evictions: Evictions,
) -> (std::sync::mpsc::Receiver<Event>, std::thread::JoinHandle<Result<(), SignalError>>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::Builder::new()
        .name("llms-pressure".into())
        .spawn(move || run_noting(&probe, opts, &evictions, &mut |_, e| tx.send(*e).is_ok()))
        .expect("spawn the pressure monitor thread");
    (rx, h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_eviction_is_taken_once() {
        let e = Evictions::default();
        let seen_by_monitor = e.clone();
        assert!(!seen_by_monitor.take());
        e.note();
        e.note();
        assert!(seen_by_monitor.take());
        assert!(!seen_by_monitor.take(), "one hold-off per eviction report");
    }
}

//! Following the pressure monitor (crate `cgroup`): its budget target becomes mm's budget (and
//! the paged weights' share of it), so reclaim happens before the kernel or a low-memory killer
//! has to act (docs/pressure.md).

use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

use anyhow::Result;
use tracing::{info, warn};

use super::{lock, Service};

impl Service {
    /// Starts the monitor and the thread that follows it; if the monitor ends early, the
    /// budget stays where it was and `stats` says the service is unmonitored.
    pub(super) fn spawn_pressure_follower(self: &Arc<Self>) -> Result<()> {
        let probe = cgroup::probe(self.cfg.cgroup.as_deref());
        let opts = cgroup::MonitorOptions { budget_max: self.budget as u64, ..Default::default() };
        let evictions = cgroup::Evictions::default();
        let (rx, monitor) = cgroup::spawn_noting(probe, opts, evictions.clone());
        let svc = Arc::clone(self);
        std::thread::Builder::new().name("llmsd-pressure".into()).spawn(move || {
            svc.follow_pressure(&rx, &evictions);
            if !svc.stopping.load(Ordering::SeqCst) {
                let why = match monitor.join() {
                    Ok(Err(e)) => e.to_string(),
                    _ => "it ended".into(),
                };
                warn!("the pressure monitor stopped ({why}); the budget stays at {} bytes", lock(&svc.mm).config().budget);
                *lock(&svc.pressure) = "unmonitored".into();
            }
        })?;
        Ok(())
    }

    /// Follows the pressure monitor: its budget target (never above the configured budget)
    /// becomes mm's budget; every reclaim is logged with the bytes freed and why, and told to
    /// the monitor, which re-measures before acting on a headroom dip again.
    fn follow_pressure(&self, events: &Receiver<cgroup::Event>, evictions: &cgroup::Evictions) {
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
                Ok(freed) if freed > 0 => {
                    evictions.note();
                    info!(freed, budget = target, level = ?e.level, need = e.need_to_free, stall = e.signals.stall, headroom = e.signals.headroom, "reclaim under pressure; the monitor holds off headroom until it is re-measured");
                }
                Ok(_) => {
                    info!(budget = target, level = ?e.level, stall = e.signals.stall, headroom = e.signals.headroom, "budget follows pressure")
                }
                Err(err) => warn!("setting the budget to {target}: {err}"),
            }
        }
    }
}

//! Classification of samples into pressure levels, and the budget controller.
//!
//! Levels use separate enter and exit thresholds (hysteresis), a minimum time per level
//! before stepping down, and a hold-off after each eviction during which a dip in headroom
//! alone does not escalate (the eviction's effect must be re-measured first). Signals work
//! without PSI and without swap: headroom (MemAvailable and the cgroup's room) is always there.

use serde::{Deserialize, Serialize};

use crate::signals::Sample;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Level {
    Normal,
    Elevated,
    Reclaim,
    Critical,
}

impl Level {
    fn from_index(i: usize) -> Self {
        [Self::Normal, Self::Elevated, Self::Reclaim, Self::Critical][i.min(3)]
    }
}

/// Thresholds for Elevated, Reclaim and Critical. Headroom is a fraction of usable memory
/// (lower is worse); stall is the fraction of wall time some task stalled on memory (PSI
/// `some`, measured from the `total` counter between samples; higher is worse).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Thresholds {
    pub headroom_enter: [f64; 3],
    pub headroom_exit: [f64; 3],
    pub stall_enter: [f64; 3],
    pub stall_exit: [f64; 3],
    /// Minimum time in a level before stepping down.
    pub min_level_ms: u64,
    /// After an eviction, headroom alone does not escalate for this long.
    pub hold_off_ms: u64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            headroom_enter: [0.20, 0.10, 0.05],
            headroom_exit: [0.25, 0.13, 0.07],
            stall_enter: [0.02, 0.10, 0.30],
            stall_exit: [0.01, 0.05, 0.15],
            min_level_ms: 1000,
            hold_off_ms: 500,
        }
    }
}

/// The signals a decision was made on (carried by every event).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Signals {
    pub headroom: f64,
    pub headroom_bytes: u64,
    /// PSI `some` stall fraction over the last interval (0 without PSI).
    pub stall: f64,
    /// Pages scanned for reclaim per second over the last interval.
    pub scan_rate: f64,
    /// 0 above the high watermark, 1 below high, 2 below low (kswapd reclaiming), 3 below
    /// min (direct reclaim): the level the zone watermarks alone indicate.
    #[serde(default)]
    pub watermark_level: u8,
}

/// Turns samples into levels.
#[derive(Debug, Clone)]
pub struct Classifier {
    pub th: Thresholds,
    level: Level,
    since_ms: u64,
    last: Option<Sample>,
    hold_until: u64,
}

impl Classifier {
    pub fn new(th: Thresholds) -> Self {
        Self { th, level: Level::Normal, since_ms: 0, last: None, hold_until: 0 }
    }

    pub fn level(&self) -> Level {
        self.level
    }

    /// An eviction just freed memory: re-measure before acting on headroom again.
    pub fn note_eviction(&mut self, t_ms: u64) {
        self.hold_until = t_ms + self.th.hold_off_ms;
    }

    #[allow(clippy::cast_precision_loss)]
    pub fn signals(&self, s: &Sample) -> Signals {
        let (mut stall, mut scan_rate) = (0.0, 0.0);
        if let Some(prev) = &self.last {
            let dt_ms = s.t_ms.saturating_sub(prev.t_ms).max(1) as f64;
            // The system's and the cgroup's own PSI: the worse of the two.
            for (a, b) in [(prev.psi, s.psi), (prev.cgroup_psi, s.cgroup_psi)] {
                if let (Some(a), Some(b)) = (a, b) {
                    stall = f64::max(stall, (b.some.total_us.saturating_sub(a.some.total_us) as f64 / (dt_ms * 1000.0)).min(1.0));
                }
            }
            scan_rate = s.vm.pgscan.saturating_sub(prev.vm.pgscan) as f64 * 1000.0 / dt_ms;
        }
        let watermark_level = s.watermarks.map_or(0, |w| u8::from(w.free < w.high) + u8::from(w.free < w.low) + u8::from(w.free < w.min));
        Signals { headroom: s.headroom(), headroom_bytes: s.headroom_bytes(), stall, scan_rate, watermark_level }
    }

    fn level_for(sig: &Signals, headroom: &[f64; 3], stall: &[f64; 3], use_headroom: bool) -> Level {
        let mut l = 0;
        for i in 0..3 {
            if (use_headroom && sig.headroom < headroom[i]) || sig.stall > stall[i] {
                l = i + 1;
            }
        }
        // Watermarks are headroom in the kernel's own terms (held off like headroom).
        if use_headroom {
            l = l.max(usize::from(sig.watermark_level));
        }
        Level::from_index(l)
    }

    /// Classifies one sample; returns the level and the signals behind it.
    pub fn update(&mut self, s: &Sample) -> (Level, Signals) {
        let sig = self.signals(s);
        self.last = Some(*s);
        let held = s.t_ms < self.hold_until;
        let up = Self::level_for(&sig, &self.th.headroom_enter, &self.th.stall_enter, !held);
        let stay = Self::level_for(&sig, &self.th.headroom_exit, &self.th.stall_exit, true);
        if up > self.level {
            self.level = up;
            self.since_ms = s.t_ms;
        } else if stay < self.level && s.t_ms.saturating_sub(self.since_ms) >= self.th.min_level_ms {
            self.level = stay;
            self.since_ms = s.t_ms;
        }
        (self.level, sig)
    }
}

/// What the monitor publishes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub t_ms: u64,
    pub level: Level,
    /// Target budget in bytes for the memory LLMS manages.
    pub budget: u64,
    /// Bytes to free now (Reclaim/Critical), 0 otherwise.
    pub need_to_free: u64,
    pub signals: Signals,
}

/// Publishes a budget for LLMS's memory between a floor and a configured maximum: in steady
/// state it tightens slowly while memory is merely elevated and grows back fast when calm
/// (Senpai's asymmetry); under Reclaim/Critical it asks at once for the bytes that would bring
/// headroom back above the exit threshold.
#[derive(Debug, Clone)]
pub struct BudgetController {
    pub max: u64,
    pub floor: u64,
    budget: u64,
    /// Fraction of the budget taken away per Elevated sample.
    pub tighten: f64,
    /// Fraction of `max` given back per Normal sample.
    pub grow: f64,
}

impl BudgetController {
    pub fn new(max: u64, floor: u64) -> Self {
        let floor = floor.min(max);
        Self { max, floor, budget: max, tighten: 0.01, grow: 0.10 }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    pub fn update(&mut self, level: Level, sig: &Signals, th: &Thresholds, headroom_base: u64) -> (u64, u64) {
        let need = |exit: f64| ((exit * headroom_base as f64) as u64).saturating_sub(sig.headroom_bytes);
        let mut need_to_free = 0;
        self.budget = match level {
            Level::Normal => self.budget.saturating_add((self.grow * self.max as f64) as u64),
            Level::Elevated => self.budget.saturating_sub((self.tighten * self.budget as f64).ceil() as u64),
            Level::Reclaim => {
                need_to_free = need(th.headroom_exit[1]);
                self.budget.saturating_sub(need_to_free)
            }
            Level::Critical => {
                need_to_free = need(th.headroom_exit[1]);
                self.floor
            }
        }
        .clamp(self.floor, self.max);
        (self.budget, need_to_free)
    }
}

/// Runs samples (recorded or synthetic) through a classifier and controller: the same code
/// path as the live monitor, for experiments and deterministic tests.
pub fn replay(samples: &[Sample], th: Thresholds, max: u64, floor: u64) -> Vec<Event> {
    let mut c = Classifier::new(th);
    let mut b = BudgetController::new(max, floor);
    samples
        .iter()
        .map(|s| {
            let (level, signals) = c.update(s);
            let (budget, need_to_free) = b.update(level, &signals, &th, s.headroom_base());
            Event { t_ms: s.t_ms, level, budget, need_to_free, signals }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signals::{MemInfo, Psi, PsiLine};

    const GIB: u64 = 1 << 30;

    fn sample(t_ms: u64, headroom: f64, stall_total_us: u64) -> Sample {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
        let available = (headroom * (8 * GIB) as f64) as u64;
        Sample {
            t_ms,
            psi: Some(Psi { some: PsiLine { total_us: stall_total_us, ..Default::default() }, full: PsiLine::default() }),
            mem: MemInfo { total: 8 * GIB, available },
            ..Default::default()
        }
    }

    #[test]
    fn levels_follow_headroom_with_hysteresis_and_no_flapping() {
        // Headroom falls through every threshold, then recovers; +-1% noise around each step.
        let plan = [(0.50, 10), (0.15, 10), (0.08, 10), (0.03, 10), (0.30, 40)];
        let mut samples = Vec::new();
        let mut t = 0;
        for (h, n) in plan {
            for i in 0..n {
                let noise = if i % 2 == 0 { 0.01 } else { -0.01 };
                samples.push(sample(t, h + noise, 0));
                t += 100;
            }
        }
        let ev = replay(&samples, Thresholds::default(), 4 * GIB, GIB / 4);
        let mut seq: Vec<Level> = Vec::new();
        for e in &ev {
            if seq.last() != Some(&e.level) {
                seq.push(e.level);
            }
        }
        // Down again only after min_level_ms, and straight to Normal (all exits clear).
        assert_eq!(seq, vec![Level::Normal, Level::Elevated, Level::Reclaim, Level::Critical, Level::Normal]);
        for e in &ev {
            assert!(e.budget <= 4 * GIB && e.budget >= GIB / 4);
        }
        let crit = ev.iter().find(|e| e.level == Level::Critical).unwrap();
        assert_eq!(crit.budget, GIB / 4, "critical drops to the floor");
        assert!(crit.need_to_free > 0);
        // Noise that crosses an enter threshold back and forth does not flap.
        let noisy: Vec<Sample> = (0..100).map(|i| sample(i * 100, if i % 2 == 0 { 0.19 } else { 0.21 }, 0)).collect();
        let ev = replay(&noisy, Thresholds::default(), 4 * GIB, 0);
        let changes = ev.windows(2).filter(|w| w[0].level != w[1].level).count();
        assert_eq!(changes, 0, "entered Elevated once and stayed (0.21 < exit 0.25)");
        assert_eq!(ev[0].level, Level::Elevated);
    }

    #[test]
    fn stall_escalates_and_hold_off_masks_only_headroom() {
        let mut c = Classifier::new(Thresholds::default());
        c.update(&sample(0, 0.5, 0));
        // 20% of the interval stalled: Reclaim (stall 0.10 < 0.20 <= 0.30).
        assert_eq!(c.update(&sample(1000, 0.5, 200_000)).0, Level::Reclaim);
        let mut c = Classifier::new(Thresholds::default());
        c.update(&sample(0, 0.5, 0));
        c.note_eviction(0);
        assert_eq!(c.update(&sample(100, 0.04, 0)).0, Level::Normal, "headroom dip inside the hold-off");
        assert_eq!(c.update(&sample(200, 0.04, 100_000)).0, Level::Critical, "stall is never held off");
        assert_eq!(c.update(&sample(600, 0.04, 100_000)).0, Level::Critical);
    }

    #[test]
    fn the_budget_stays_between_floor_and_max() {
        let th = Thresholds::default();
        let mut b = BudgetController::new(1000, 100);
        let mut x: u64 = 12345;
        for _ in 0..10_000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let level = Level::from_index((x >> 33) as usize % 4);
            let sig = Signals { headroom_bytes: (x >> 20) % 5000, ..Default::default() };
            let (budget, _) = b.update(level, &sig, &th, 10_000);
            assert!((100..=1000).contains(&budget));
        }
        // Elevated tightens slowly (1%), Normal grows back fast (10% of max).
        let mut b = BudgetController::new(1000, 0);
        assert_eq!(b.update(Level::Elevated, &Signals::default(), &th, 1).0, 990);
        assert_eq!(b.update(Level::Normal, &Signals::default(), &th, 1).0, 1000);
    }
}

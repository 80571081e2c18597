//! How far ahead of the block it reads a packed product asks for the weights' cache lines, and
//! the tuner that chooses the distance on the machine it runs on, from decode's own products.
//!
//! Decode reads every weight once, front to back; the hardware prefetchers follow a stream only
//! within a 4 KiB page and need a few misses to start again after each, so the kernels ask for
//! the lines a distance ahead (`kernels/avx2.rs`). The best distance depends on the host: on the
//! AMD EPYC host 6 KiB beat 4 and 8 KiB when its memory ran at 62-69 GB/s and all three tied at
//! ~48 GB/s; on the Intel Xeon host (~26 GB/s by two threads) 3 KiB decoded the 1.7B shapes
//! 1.08-1.21x as fast as 6 KiB (docs/notes/engine.md). One constant suits one host, and a host's
//! memory changes speed from minute to minute, so the distance is chosen while decoding: every
//! so often a few hundred memory-bound products are dealt to the candidates in turn (so a
//! change of the host's speed meets them all alike), each product's weight bytes per second is
//! kept, and the candidate with the best median rate is used until the next round. A round
//! costs at most the gap between the candidates over ~1/40 of the products.
//!
//! The distance never changes a result (a prefetch is a hint; the arithmetic is the same), so
//! the tuner is one per process, shared by every model in it. `LLMS_PREFETCH_AHEAD=<bytes>`
//! fixes the distance and turns the tuner off (for A/B runs and for hosts where it is known).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Instant;

/// The distances tried, in bytes: 1 and 2 KiB were the best on the Intel host and too close on
/// the AMD one; beyond 8 KiB the lines arrived too early at the AMD host's slow hours.
pub const CANDIDATES: [usize; 6] = [1024, 2048, 3072, 4096, 6144, 8192];

/// Products each candidate runs in a round.
const SAMPLES: usize = 24;

/// Products run at the chosen distance between rounds, per product of a round.
const EXPLOIT_PER_SAMPLE: usize = 40;

/// Products smaller than this read from the caches rather than memory, or are dominated by
/// dispatching them: they run at the current distance and are not sampled.
pub const MIN_BYTES: usize = 1 << 20;

/// The distance the kernels use now (read by every packed tile, per block).
static AHEAD: AtomicUsize = AtomicUsize::new(6144);

/// The distance in use, in bytes.
#[inline(always)]
pub fn distance() -> usize {
    AHEAD.load(Ordering::Relaxed)
}

/// Rates of one round, and what the tuner does next.
#[derive(Debug, Clone)]
pub struct Tuner {
    /// Set by `LLMS_PREFETCH_AHEAD`: never sample.
    fixed: Option<usize>,
    /// Weight bytes per second of each candidate's products this round.
    rates: [Vec<f64>; CANDIDATES.len()],
    /// The next product of a round goes to this candidate.
    turn: usize,
    /// Products left to run at the chosen distance before the next round (0: sampling).
    exploit_left: usize,
    /// Index into [`CANDIDATES`] of the distance chosen by the last round.
    chosen: usize,
    /// Rounds completed.
    rounds: u64,
}

impl Tuner {
    /// A tuner that starts sampling at its first product; `fixed` pins the distance instead.
    pub fn new(fixed: Option<usize>) -> Self {
        Self {
            fixed,
            rates: Default::default(),
            turn: 0,
            exploit_left: 0,
            chosen: CANDIDATES.iter().position(|&c| c == 6144).unwrap_or(0),
            rounds: 0,
        }
    }

    /// Takes the distance for the next memory-bound product, and whether its rate is wanted (the
    /// candidate's index for [`Tuner::record`]).
    pub fn take(&mut self) -> (usize, Option<usize>) {
        if let Some(d) = self.fixed {
            return (d, None);
        }
        if self.exploit_left > 0 {
            self.exploit_left -= 1;
            return (CANDIDATES[self.chosen], None);
        }
        let i = self.turn;
        self.turn = (self.turn + 1) % CANDIDATES.len();
        (CANDIDATES[i], Some(i))
    }

    /// A sampled product of candidate `i` read `bytes` in `secs`; once every candidate has
    /// `SAMPLES` the round ends: the best median rate is chosen (ties keep the earlier
    /// choice, so noise between equals does not flap it).
    pub fn record(&mut self, i: usize, bytes: usize, secs: f64) {
        if self.exploit_left > 0 || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        #[allow(clippy::cast_precision_loss)]
        self.rates[i].push(bytes as f64 / secs);
        if self.rates.iter().any(|r| r.len() < SAMPLES) {
            return;
        }
        let medians: Vec<f64> = self.rates.iter_mut().map(|r| median(r)).collect();
        let mut best = self.chosen;
        for (c, &m) in medians.iter().enumerate() {
            if m > medians[best] {
                best = c;
            }
        }
        self.chosen = best;
        self.rates.iter_mut().for_each(Vec::clear);
        self.exploit_left = SAMPLES * CANDIDATES.len() * EXPLOIT_PER_SAMPLE;
        self.rounds += 1;
    }

    /// The distance chosen by the last round (or fixed), and the rounds run so far.
    pub fn chosen(&self) -> (usize, u64) {
        (self.fixed.unwrap_or(CANDIDATES[self.chosen]), self.rounds)
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `LLMS_PREFETCH_AHEAD`, if it names a distance (bytes, a multiple of 64 up to 1 MiB); another
/// value is refused with a message and the tuner runs.
fn fixed_from_env() -> Option<usize> {
    let v = std::env::var("LLMS_PREFETCH_AHEAD").ok()?;
    match v.trim().parse::<usize>() {
        Ok(d) if d.is_multiple_of(64) && d <= 1 << 20 => Some(d),
        _ => {
            eprintln!("LLMS_PREFETCH_AHEAD={v:?} is not a multiple of 64 bytes up to 1048576; the distance is tuned instead");
            None
        }
    }
}

static TUNER: LazyLock<Mutex<Tuner>> = LazyLock::new(|| {
    let t = Tuner::new(fixed_from_env());
    AHEAD.store(t.chosen().0, Ordering::Relaxed);
    Mutex::new(t)
});

/// Runs `product`, a memory-bound product reading `bytes` of weights, at the distance the tuner
/// gives it, and tells the tuner its rate when it was a sample. Products of other models in
/// the process may run at the same time: a sample's rate can then be another's distance's,
/// which costs a round's accuracy, never a result.
pub fn tuned<R>(bytes: usize, product: impl FnOnce() -> R) -> R {
    if bytes < MIN_BYTES {
        return product();
    }
    let (d, sample) = TUNER.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
    // Stored only when it changes: every tile of the product reads the line.
    if distance() != d {
        AHEAD.store(d, Ordering::Relaxed);
    }
    let Some(i) = sample else { return product() };
    let t = Instant::now();
    let r = product();
    let secs = t.elapsed().as_secs_f64();
    let mut tuner = TUNER.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    tuner.record(i, bytes, secs);
    AHEAD.store(tuner.chosen().0, Ordering::Relaxed);
    r
}

/// What the process's tuner has chosen, for reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// The distance in use, in bytes.
    pub bytes: usize,
    /// Rounds run so far (0: none yet, the starting distance).
    pub rounds: u64,
    /// Fixed by `LLMS_PREFETCH_AHEAD`.
    pub fixed: bool,
}

/// The process's prefetch distance and how it was chosen.
pub fn report() -> Choice {
    let t = TUNER.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (bytes, rounds) = t.chosen();
    Choice { bytes, rounds, fixed: t.fixed.is_some() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs rounds of `t` where candidate `i`'s products take `secs(i, k)` for its k-th sample.
    fn round(t: &mut Tuner, secs: impl Fn(usize, usize) -> f64) {
        let mut seen = [0usize; CANDIDATES.len()];
        for _ in 0..SAMPLES * CANDIDATES.len() {
            let (d, s) = t.take();
            let i = s.expect("a round samples every product");
            assert_eq!(d, CANDIDATES[i]);
            t.record(i, 1 << 20, secs(i, seen[i]));
            seen[i] += 1;
        }
    }

    #[test]
    fn a_round_chooses_the_fastest_median_and_then_keeps_it() {
        let mut t = Tuner::new(None);
        assert_eq!(t.chosen(), (6144, 0));
        // 3 KiB fastest, except for a few outliers (a preempted product) that a mean would
        // count and a median does not.
        round(&mut t, |i, k| {
            if CANDIDATES[i] == 3072 {
                if k % 8 == 0 {
                    1.0
                } else {
                    0.001
                }
            } else {
                0.0012
            }
        });
        assert_eq!(t.chosen(), (3072, 1));
        // Between rounds every product runs at the choice, unsampled.
        for _ in 0..SAMPLES * CANDIDATES.len() * EXPLOIT_PER_SAMPLE {
            assert_eq!(t.take(), (3072, None));
        }
        // The host changed: the next round follows it.
        round(&mut t, |i, _| if CANDIDATES[i] == 8192 { 0.0009 } else { 0.001 });
        assert_eq!(t.chosen(), (8192, 2));
    }

    #[test]
    fn ties_keep_the_choice_and_bad_timings_are_ignored() {
        let mut t = Tuner::new(None);
        round(&mut t, |_, _| 0.001);
        assert_eq!(t.chosen(), (6144, 1), "equal rates keep the earlier choice");
        let mut t = Tuner::new(None);
        // A zero or NaN timing (a clock that did not move) is not a rate.
        let (_, s) = t.take();
        t.record(s.unwrap(), 1 << 20, 0.0);
        t.record(s.unwrap(), 1 << 20, f64::NAN);
        assert!(t.rates.iter().all(Vec::is_empty));
    }

    #[test]
    fn a_fixed_distance_is_never_sampled() {
        let mut t = Tuner::new(Some(4096));
        for _ in 0..1000 {
            assert_eq!(t.take(), (4096, None));
        }
        assert_eq!(t.chosen(), (4096, 0));
    }
}

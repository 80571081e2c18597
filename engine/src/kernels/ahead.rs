//! How far ahead of the block it reads a packed product asks for the weights' cache lines, and
//! the tuner that chooses the distance on the machine it runs on, from decode's own products.
//!
//! Decode reads every weight once, front to back; the hardware prefetchers follow a stream only
//! within a 4 KiB page and need a few misses to start again after each, so the kernels ask for
//! the lines a distance ahead (`kernels/avx2.rs`). The best distance depends on the host: on the
//! AMD EPYC host 6 KiB beat 4 and 8 KiB when its memory ran at 62-69 GB/s and all three tied at
//! ~48 GB/s; on the Intel Xeon host (~26 GB/s by two threads) 1-3 KiB decoded the 1.7B shapes
//! 1.08-1.21x as fast as 6 KiB (docs/notes/engine.md). One constant suits one host, and a host's
//! memory changes speed from minute to minute, so the distance is chosen while decoding: every
//! so often a round of memory-bound products is dealt to the candidates, each kind of product
//! (matrix and batch size) in turn of its own (so every candidate meets the same mix, and a
//! change of the host's speed meets them all alike); each product's weight bytes per second is
//! kept, relative to its kind's median, and the candidate with the best median is used until
//! the next round. A round costs at most the gap between the candidates over ~1/40 of the
//! products.
//!
//! The distance never changes a result (a prefetch is a hint; the arithmetic is the same), so
//! the tuner is one per process, shared by every model in it. `LLMS_PREFETCH_AHEAD=<bytes>`
//! fixes the distance and turns the tuner off (for A/B runs and for hosts where it is known).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Instant;

/// The distances tried, in bytes: 1 and 2 KiB were the best on the Intel host and too close on
/// the AMD one; beyond 8 KiB the lines arrived too early at the AMD host's slow hours. 0 asks
/// for nothing and leaves the stream to the hardware prefetchers: on an AMD EPYC guest with
/// AVX-512 (2 Dec 2026) they streamed Q4_K at 0.94 of the read alone and at 0.56-0.64 with
/// any distance from 512 bytes to 4 KiB (`matvec_rate`, docs/notes/engine.md), when the K
/// tiles asked for a block's 18-27 lines in one burst; asked a sub-block's share at a time,
/// every type streamed best at 4-24 KiB alike and 3-10% slower at 0 (`matvec_rate distances`).
pub const CANDIDATES: [usize; 7] = [0, 1024, 2048, 3072, 4096, 6144, 8192];

/// How much further than the distance the block-at-once tiles ask for the same lines again,
/// into L2 (`kernels/avx2.rs`, `prefetch_ahead`). A core keeps only so many misses to L1 in
/// flight; lines already on their way to L2 come back from it sooner, so the L1 asks free
/// their slots sooner and more of the stream is in flight. On the Intel Xeon guest (5 Dec
/// 2026, `matvec_rate distances`, medians of 21 rounds) Q4_0 products at 2 KiB streamed at
/// 0.95-0.97 of the read alone and 0.99-1.04 with the second ask 2 KiB further (3-4 KiB
/// further alike; 1 KiB, or 6-8 KiB from 2 KiB, worse); the 1.7B shape's tg128 1.10x in
/// `tools/bench/ab` (docs/results/ab-prefetch-beyond-1.7b-q4_0.json, docs/notes/engine.md). The K-quant tiles that spread their asks over a block
/// (`prefetch_ahead_part`) gained nothing from it; they ask twice the other way round, the
/// L2 ask at the distance and the L1 ask this much behind it.
pub const BEYOND: usize = 2048;

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

/// Products of different matrices and batch sizes run at different rates whatever the
/// distance, so the rates are compared within a kind of product (its weight bytes and rows):
/// at most this many kinds are sampled in a round, the rest run at the chosen distance.
const MAX_KINDS: usize = 16;

/// A sampled product: which candidate ran it, and its kind's index in the round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    pub candidate: usize,
    kind: usize,
}

/// Rates of one round, and what the tuner does next: a choice among a few values that change
/// a product's speed and never its result (here the distance; [`super::pairs`] the tile).
#[derive(Debug, Clone)]
pub struct Tuner {
    /// The values chosen among.
    candidates: &'static [usize],
    /// Set by `LLMS_PREFETCH_AHEAD`: never sample.
    fixed: Option<usize>,
    /// The kinds of product met this round, each with the candidate its next product goes to:
    /// each kind deals its own products in turn, so every candidate gets the same mix of kinds
    /// (one turn over all products would tie candidates to kinds whenever the number of
    /// candidates and a layer's products share a factor: 6 and 4 gave three distances only
    /// the even products).
    kinds: Vec<(u64, usize)>,
    /// (kind, candidate, weight bytes per second) of this round's products.
    samples: Vec<(usize, usize, f64)>,
    /// Samples this round per candidate.
    count: Vec<usize>,
    /// Products left to run at the chosen distance before the next round (0: sampling).
    exploit_left: usize,
    /// Index into the candidates of the value chosen by the last round.
    chosen: usize,
    /// Rounds completed.
    rounds: u64,
}

impl Tuner {
    /// A distance tuner that starts sampling at its first product; `fixed` pins the distance
    /// instead.
    pub fn new(fixed: Option<usize>) -> Self {
        Self::over(&CANDIDATES, 6144, fixed)
    }

    /// A tuner among `candidates` (at least one), starting from `start` (the first candidate
    /// if it is none of them) until its first round ends; `fixed` pins the value instead.
    pub fn over(candidates: &'static [usize], start: usize, fixed: Option<usize>) -> Self {
        assert!(!candidates.is_empty(), "a tuner needs a candidate");
        Self {
            candidates,
            fixed,
            kinds: Vec::new(),
            samples: Vec::new(),
            count: vec![0; candidates.len()],
            exploit_left: 0,
            chosen: candidates.iter().position(|&c| c == start).unwrap_or(0),
            rounds: 0,
        }
    }

    /// Takes the distance for the next memory-bound product of kind `kind` (any key that tells
    /// products of different matrices or batch sizes apart), and whether its rate is wanted
    /// (the sample to hand [`Tuner::record`]).
    pub fn take(&mut self, kind: u64) -> (usize, Option<Sample>) {
        if let Some(d) = self.fixed {
            return (d, None);
        }
        if self.exploit_left > 0 {
            self.exploit_left -= 1;
            return (self.candidates[self.chosen], None);
        }
        let k = match self.kinds.iter().position(|&(key, _)| key == kind) {
            Some(k) => k,
            None if self.kinds.len() < MAX_KINDS => {
                self.kinds.push((kind, 0));
                self.kinds.len() - 1
            }
            None => return (self.candidates[self.chosen], None),
        };
        let c = self.kinds[k].1;
        self.kinds[k].1 = (c + 1) % self.candidates.len();
        (self.candidates[c], Some(Sample { candidate: c, kind: k }))
    }

    /// A sampled product read `bytes` in `secs`. Once every candidate has `SAMPLES` the round
    /// ends: each rate is taken relative to its kind's median rate over all candidates, and the
    /// candidate whose relative rates have the best median is chosen (a median, so a product
    /// delayed by another process does not count; ties keep the earlier choice, so noise
    /// between equals does not flap it).
    pub fn record(&mut self, s: Sample, bytes: usize, secs: f64) {
        if self.exploit_left > 0 || !secs.is_finite() || secs <= 0.0 || s.kind >= self.kinds.len() {
            return;
        }
        #[allow(clippy::cast_precision_loss)]
        self.samples.push((s.kind, s.candidate, bytes as f64 / secs));
        self.count[s.candidate] += 1;
        if self.count.iter().any(|&n| n < SAMPLES) {
            return;
        }
        let kind_median: Vec<f64> =
            (0..self.kinds.len()).map(|k| median(&mut self.samples.iter().filter(|x| x.0 == k).map(|x| x.2).collect::<Vec<_>>())).collect();
        let score: Vec<f64> = (0..self.candidates.len())
            .map(|c| median(&mut self.samples.iter().filter(|x| x.1 == c).map(|x| x.2 / kind_median[x.0]).collect::<Vec<_>>()))
            .collect();
        let mut best = self.chosen;
        for (c, &m) in score.iter().enumerate() {
            if m > score[best] {
                best = c;
            }
        }
        self.chosen = best;
        self.kinds.clear();
        self.samples.clear();
        self.count.iter_mut().for_each(|n| *n = 0);
        self.exploit_left = SAMPLES * self.candidates.len() * EXPLOIT_PER_SAMPLE;
        self.rounds += 1;
    }

    /// The value chosen by the last round (or fixed), and the rounds run so far.
    pub fn chosen(&self) -> (usize, u64) {
        (self.fixed.unwrap_or(self.candidates[self.chosen]), self.rounds)
    }

    /// Whether the value is pinned (never sampled).
    pub fn is_fixed(&self) -> bool {
        self.fixed.is_some()
    }

    /// Whether the last sample ended a round and the chosen value runs unsampled now.
    pub fn exploiting(&self) -> bool {
        self.exploit_left > 0
    }
}

/// The median of a non-empty `v` (its upper middle), 0 for an empty one.
fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `LLMS_PREFETCH_AHEAD`, if it names a distance (bytes, a multiple of 64 up to 1 MiB); another
/// value is refused with a message and the tuner runs.
fn fixed_from_env() -> Option<usize> {
    fixed_setting("LLMS_PREFETCH_AHEAD", |d| d.is_multiple_of(64) && d <= 1 << 20, "a multiple of 64 bytes up to 1048576", "the distance")
}

/// The value of the environment setting `var` that fixes a tuner's choice, if it is a count
/// `ok` accepts; another value is refused with a message naming `what` it must be, and `tuned`
/// is tuned instead. Set but empty (`VAR= llms ...`, a script's unset variable): as if unset.
pub(super) fn fixed_setting(var: &str, ok: impl Fn(usize) -> bool, what: &str, tuned: &str) -> Option<usize> {
    let v = std::env::var(var).ok().filter(|v| !v.trim().is_empty())?;
    match v.trim().parse::<usize>() {
        Ok(n) if ok(n) => Some(n),
        _ => {
            eprintln!("{var}={v:?} is not {what}; {tuned} is tuned instead");
            None
        }
    }
}

static TUNER: LazyLock<Mutex<Tuner>> = LazyLock::new(|| {
    let t = Tuner::new(fixed_from_env());
    AHEAD.store(t.chosen().0, Ordering::Relaxed);
    Mutex::new(t)
});

/// Runs `product`, a memory-bound product reading `bytes` of weights for `rows` tokens, at the distance the tuner
/// gives it, and tells the tuner its rate when it was a sample. Products of other models in
/// the process may run at the same time: a sample's rate can then be another's distance's,
/// which costs a round's accuracy, never a result.
pub fn tuned<R>(bytes: usize, rows: usize, product: impl FnOnce() -> R) -> R {
    // Only the AVX2 tiles ask ahead (the NEON ones leave it to the hardware prefetchers).
    if bytes < MIN_BYTES || !crate::simd::has_avx2() {
        return product();
    }
    let kind = (bytes as u64) << 8 | (rows as u64 & 0xff);
    let (d, sample) = TUNER.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take(kind);
    // Stored only when it changes: every tile of the product reads the line.
    if distance() != d {
        AHEAD.store(d, Ordering::Relaxed);
    }
    let Some(s) = sample else { return product() };
    let t = Instant::now();
    let r = product();
    let secs = t.elapsed().as_secs_f64();
    let mut tuner = TUNER.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    tuner.record(s, bytes, secs);
    if tuner.exploit_left > 0 {
        AHEAD.store(tuner.chosen().0, Ordering::Relaxed);
    }
    r
}

/// Pins the distance as `LLMS_PREFETCH_AHEAD` does (`Some`), or hands it back to the tuner
/// (`None`, a fresh round next): for benchmarks that compare distances product by product in
/// one process, where the host's memory speed moves alike for all of them.
pub fn pin(d: Option<usize>) {
    let mut t = TUNER.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    *t = Tuner::new(d);
    AHEAD.store(t.chosen().0, Ordering::Relaxed);
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

    /// Runs one round of `t` over products that come as a model's layers do: four kinds in
    /// turn, each its own base time, where candidate `i`'s k-th product of kind `kind` takes
    /// `base[kind] * factor(i, k)` seconds.
    fn round(t: &mut Tuner, factor: impl Fn(usize, usize) -> f64) {
        let base = [0.004, 0.0015, 0.011, 0.006];
        let mut seen = [0usize; CANDIDATES.len()];
        let rounds = t.chosen().1;
        let mut p = 0;
        while t.chosen().1 == rounds {
            let kind = p % 4;
            p += 1;
            let (d, s) = t.take(kind as u64);
            let s = s.expect("a round samples every product");
            assert_eq!(d, CANDIDATES[s.candidate]);
            t.record(s, 1 << 20, base[kind] * factor(s.candidate, seen[s.candidate]));
            seen[s.candidate] += 1;
            assert!(p < 10_000, "the round never ended");
        }
        // Every kind dealt to every candidate alike: the round is as long as the samples asked.
        assert_eq!(p, SAMPLES * CANDIDATES.len());
    }

    fn at(d: usize) -> usize {
        CANDIDATES.iter().position(|&c| c == d).unwrap()
    }

    #[test]
    fn a_round_chooses_the_fastest_within_each_kind_and_then_keeps_it() {
        // The fastest is 4% faster on every kind, except for a few products delayed 100-fold
        // (another process took the core) that a mean would count and a median does not. With
        // one turn over all products, the odd candidates would only ever meet the cheap kinds
        // 1 and 3 and the even ones the expensive kinds: which side the fastest is on would
        // decide. Both sides are tried.
        for fast in [0, 1024, 2048, 8192] {
            let mut t = Tuner::new(None);
            assert_eq!(t.chosen(), (6144, 0));
            round(&mut t, |i, k| {
                if i == at(fast) {
                    if k % 8 == 0 {
                        100.0
                    } else {
                        0.96
                    }
                } else {
                    1.0
                }
            });
            assert_eq!(t.chosen(), (fast, 1));
        }
        let mut t = Tuner::new(None);
        round(&mut t, |i, _| if i == at(2048) { 0.96 } else { 1.0 });
        // Between rounds every product runs at the choice, unsampled.
        for p in 0..SAMPLES * CANDIDATES.len() * EXPLOIT_PER_SAMPLE {
            assert_eq!(t.take(p as u64 % 4), (2048, None));
        }
        // The host changed: the next round follows it.
        round(&mut t, |i, _| if i == at(8192) { 0.97 } else { 1.0 });
        assert_eq!(t.chosen(), (8192, 2));
    }

    #[test]
    fn ties_keep_the_choice_and_bad_timings_are_ignored() {
        let mut t = Tuner::new(None);
        round(&mut t, |_, _| 1.0);
        assert_eq!(t.chosen(), (6144, 1), "equal rates keep the earlier choice");
        let mut t = Tuner::new(None);
        // A zero or NaN timing (a clock that did not move) is not a rate.
        let (_, s) = t.take(0);
        t.record(s.unwrap(), 1 << 20, 0.0);
        t.record(s.unwrap(), 1 << 20, f64::NAN);
        assert!(t.samples.is_empty());
    }

    #[test]
    fn kinds_past_the_cap_run_at_the_choice_unsampled() {
        let mut t = Tuner::new(None);
        for k in 0..MAX_KINDS as u64 {
            assert!(t.take(k).1.is_some());
        }
        assert_eq!(t.take(MAX_KINDS as u64), (6144, None));
        assert!(t.take(3).1.is_some(), "a kind already met is still sampled");
    }

    #[test]
    fn a_fixed_distance_is_never_sampled() {
        let mut t = Tuner::new(Some(4096));
        for p in 0..1000 {
            assert_eq!(t.take(p % 5), (4096, None));
        }
        assert_eq!(t.chosen(), (4096, 0));
    }
}

//! Token sampling: greedy, or temperature with top-k and top-p, from a seeded generator so a
//! run can be repeated exactly.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone)]
pub struct SamplerConfig {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no top-p cut.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self { temperature: 0.0, top_k: 40, top_p: 0.95, seed: 0 }
    }
}

#[derive(Debug)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: ChaCha8Rng,
    cand: Vec<(u32, f32)>,
}

/// Index of the largest logit (the lowest index among equals, as llama.cpp's greedy sampler).
/// The service samples every decoding call's row after each pass on the worker while the pool
/// waits, so not a scan that re-reads the best so far (0.66% of `llms bench-serve`'s CPU
/// samples; 0.22% so): the largest value by the vector kernel, then the first index holding
/// it, which is the scan's index (ties, -0.0 against 0.0, NaN: `argmax_is_the_scalar_scan`).
pub fn argmax(logits: &[f32]) -> u32 {
    // The scan never replaces a leading NaN: nothing compares greater.
    if logits.first().is_none_or(|v| v.is_nan()) {
        return 0;
    }
    // NaN is never the maximum; -0.0 == 0.0, so the first zero of either sign, as the scan;
    // all -inf: index 0.
    let max = crate::kernels::row_max(logits);
    let best = logits.iter().position(|&v| v == max).unwrap_or(0);
    u32::try_from(best).expect("vocabulary fits in u32")
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        Self { rng: ChaCha8Rng::seed_from_u64(cfg.seed), cfg, cand: Vec::new() }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 {
            return argmax(logits);
        }
        self.cand.clear();
        self.cand.extend(logits.iter().enumerate().map(|(i, &l)| (u32::try_from(i).expect("vocab fits"), l)));
        let k = if self.cfg.top_k == 0 { self.cand.len() } else { self.cfg.top_k.min(self.cand.len()) };
        if k < self.cand.len() {
            self.cand.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
            self.cand.truncate(k);
        }
        self.cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        let t = self.cfg.temperature;
        let max = self.cand[0].1;
        let mut sum = 0.0;
        for c in &mut self.cand {
            c.1 = ((c.1 - max) / t).exp();
            sum += c.1;
        }
        let mut cum = 0.0;
        let n = self.cand.len();
        let mut keep = n;
        for (i, c) in self.cand.iter_mut().enumerate() {
            c.1 /= sum;
            cum += c.1;
            if cum >= self.cfg.top_p && keep == n {
                keep = i + 1;
            }
        }
        self.cand.truncate(keep);
        let total: f32 = self.cand.iter().map(|c| c.1).sum();
        let mut r = self.rng.gen::<f32>() * total;
        for c in &self.cand {
            r -= c.1;
            if r <= 0.0 {
                return c.0;
            }
        }
        self.cand.last().expect("at least one candidate").0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scan [`argmax`] replaces, as the reference.
    fn argmax_ref(logits: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &v) in logits.iter().enumerate() {
            if v > logits[best] {
                best = i;
            }
        }
        u32::try_from(best).expect("vocabulary fits in u32")
    }

    proptest::proptest! {
        #[test]
        fn argmax_is_the_scalar_scan(
            mut v in proptest::collection::vec(proptest::prop_oneof![
                -4.0f32..4.0,
                proptest::strategy::Just(0.0f32),
                proptest::strategy::Just(-0.0f32),
                proptest::strategy::Just(f32::NAN),
                proptest::strategy::Just(f32::INFINITY),
                proptest::strategy::Just(f32::NEG_INFINITY),
                proptest::strategy::Just(1.5f32),
            ], 0..80),
            dup in proptest::option::of((0usize..80, 0usize..80)),
        ) {
            // Ties on purpose: a copy of one value elsewhere.
            if let Some((a, b)) = dup {
                if a < v.len() && b < v.len() {
                    v[b] = v[a];
                }
            }
            proptest::prop_assert_eq!(argmax(&v), argmax_ref(&v), "{:?}", v);
        }
    }

    #[test]
    fn argmax_over_a_vocabulary_is_the_scalar_scan() {
        // Long inputs cross the kernels' 8- and 16-wide blocks and the tail: the maximum in each place.
        let mut v: Vec<f32> = (0..49_157u32).map(|i| ((i.wrapping_mul(2_654_435_761) >> 8) as f32).sin()).collect();
        for at in [0, 7, 15, 16, 31, 4_000, 49_140, 49_155, 49_156] {
            let mut w = v.clone();
            w[at] = 3.0;
            assert_eq!(argmax(&w), argmax_ref(&w));
            assert_eq!(argmax(&w) as usize, at);
        }
        v[100] = 1.0;
        v[200] = 1.0;
        assert_eq!(argmax(&v), argmax_ref(&v));
    }

    #[test]
    fn greedy_picks_the_max_and_seeded_sampling_repeats() {
        let logits = [0.1, 3.0, 2.9, -1.0];
        assert_eq!(Sampler::new(SamplerConfig::default()).sample(&logits), 1);
        let cfg = SamplerConfig { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 42 };
        let a: Vec<u32> = {
            let mut s = Sampler::new(cfg.clone());
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(cfg);
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(a.contains(&1) && a.contains(&2), "temperature 1 should visit both likely tokens: {a:?}");
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_cuts_the_tail() {
        let logits = [0.0, 5.0, 4.0, 1.0];
        let mut s = Sampler::new(SamplerConfig { temperature: 2.0, top_k: 1, top_p: 1.0, seed: 1 });
        assert!((0..20).all(|_| s.sample(&logits) == 1));
        let mut s = Sampler::new(SamplerConfig { temperature: 1.0, top_k: 0, top_p: 0.5, seed: 1 });
        assert!((0..20).all(|_| s.sample(&logits) == 1));
    }
}

//! Tolerance-aware compression (LLMS §3.2, eq. 1-3): which level each chunk of a context is
//! held at, given the chunks' information densities and the global average size ratio the OS
//! configured.
//!
//! Eq. 2 assigns levels by thresholds on density: the densest chunks keep the most bits, so
//! a solution is a set of counts `n_0..n_{k-1}` over the density ranking. Eq. 3 chooses the
//! thresholds. Read literally it weights each level's densities by `1/ratio`, which would
//! send the densest chunks to the smallest level; its text means "maximise the information
//! retained under the size constraint". We score a level by the information it *loses*,
//! `weight x error`, with the error of a b-bit level taken as `8^-b` (measured: see
//! [`loss_of_bits`]) and the weight the square root of the density ([`tolerance_weight`]),
//! and minimise the total loss subject to `sum(size) <= ratio * n * size_0`. Scoring retained
//! information as `density x bits` was measured worse (docs/kv.md): it spends the budget on
//! 2-bit chunks to keep a few at 8 bits. The search is exhaustive over the thresholds with
//! prefix sums, the last choice made directly: O(n^(k-2)) for k levels (n for the default three).

/// The loss weight of a level of `bits` bits: `8^-bits`. Measured on the default model
/// (docs/kv.md), each bit taken below 4 costs 4-15x more perplexity than the last (k4v4 +0.2%,
/// k3v3 +3.3%, k2v2 +21% over int8 on GPL-3), far steeper than a quantizer's amplitude (2^-b)
/// or noise power (4^-b) would say. At the same bytes (0.49x int8) `8^-bits` lost
/// +1.5% / +3.8% on GPL-3 / heapq.py against +2.5% / +4.6%, and the mix within 1% of int8 went
/// from 0.85 to 0.60 over the split levels (the default levels: the same perplexity).
pub fn loss_of_bits(bits: f64) -> f64 {
    8f64.powf(-bits)
}

/// How much a chunk's loss counts, from its information density (the attention it received):
/// `sqrt(density)`. A chunk's error reaches the output in proportion to the attention it gets
/// from each query, but the density is the past queries' mean, and it is heavy-tailed (the
/// first chunk, an attention sink, gets tens of times the median): weighted linearly, the plan
/// kept the densest chunks at int8 and pushed others to 3 bits, which lost more than spreading
/// the bytes. Measured at `mix:0.5` over {int8, k4v4, k4v3, k3v3} (docs/kv.md, "Which chunks
/// keep bits"): density +0.74% / +1.67% over int8 on GPL-3 / heapq.py, sqrt +0.52% / +1.21%,
/// equal weights +0.40% / +1.21% — the square root keeps the ranking at the uniform choice's
/// loss.
pub fn tolerance_weight(density: f64) -> f64 {
    density.max(0.0).sqrt()
}

/// Levels (indices into `sizes`/`losses`, 0 = heaviest) for chunks of the given densities:
/// monotone in density, the least total `tolerance_weight(density) x loss`, average size within `ratio` of
/// level 0. With a ratio below what the smallest level reaches, every chunk gets the smallest.
#[allow(clippy::cast_precision_loss)]
pub fn choose_levels(densities: &[f64], sizes: &[f64], losses: &[f64], ratio: f64) -> Vec<usize> {
    let n = densities.len();
    let k = sizes.len().min(losses.len());
    if k == 0 || n == 0 {
        return vec![0; n];
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| densities[b].total_cmp(&densities[a]).then(a.cmp(&b)));
    let mut prefix = vec![0.0; n + 1];
    for (r, &i) in order.iter().enumerate() {
        prefix[r + 1] = prefix[r] + tolerance_weight(densities[i]);
    }
    let budget = ratio * n as f64 * sizes[0] + 1e-9 * sizes[0];
    let mut counts = vec![0usize; k];
    let mut best: Option<(f64, Vec<usize>)> = None;
    search(&prefix, sizes, losses, budget, 0, 0, 0.0, 0.0, &mut counts, &mut best);
    let counts = best.map_or_else(
        || {
            // Levels need not be listed by size: the smallest is whichever it is.
            let smallest = (0..k).min_by(|&a, &b| sizes[a].total_cmp(&sizes[b])).unwrap_or(k - 1);
            let mut all_smallest = vec![0; k];
            all_smallest[smallest] = n;
            all_smallest
        },
        |(_, c)| c,
    );
    let mut out = vec![k - 1; n];
    let mut rank = 0;
    for (level, &c) in counts.iter().enumerate() {
        for &i in &order[rank..rank + c] {
            out[i] = level;
        }
        rank += c;
    }
    out
}

/// [`choose_levels`] for chunks that already hold a level (`held[i]`, an index into `sizes`):
/// levels only go down (a lowered chunk has lost its bits), so a chunk the choice would raise
/// stays where it is, its bytes leave the budget and the others are chosen again over what is
/// left, until no chunk would be raised. Without this, the plan spent budget on raises that
/// never happen: the dense first chunk, lowered while its context was one chunk long, kept
/// "costing" int8 and pushed the chunks after it a level lower for good.
#[allow(clippy::cast_precision_loss)]
pub fn choose_levels_held(densities: &[f64], held: &[usize], sizes: &[f64], losses: &[f64], ratio: f64) -> Vec<usize> {
    let n = densities.len();
    let k = sizes.len().min(losses.len());
    if k == 0 || n == 0 {
        return vec![0; n];
    }
    let held_size = |i: usize| sizes[held.get(i).copied().unwrap_or(0).min(k - 1)];
    let mut out: Vec<Option<usize>> = vec![None; n];
    let total = ratio * n as f64 * sizes[0];
    loop {
        let free: Vec<usize> = (0..n).filter(|&i| out[i].is_none()).collect();
        if free.is_empty() {
            break;
        }
        let kept: f64 = out.iter().flatten().map(|&l| sizes[l]).sum();
        let r = ((total - kept) / (free.len() as f64 * sizes[0])).max(0.0);
        let d: Vec<f64> = free.iter().map(|&i| densities[i]).collect();
        let lv = choose_levels(&d, sizes, losses, r);
        let raised: Vec<usize> = free.iter().zip(&lv).filter(|&(&i, &l)| sizes[l] > held_size(i)).map(|(&i, _)| i).collect();
        if raised.is_empty() {
            for (&i, &l) in free.iter().zip(&lv) {
                out[i] = Some(l);
            }
            break;
        }
        for i in raised {
            out[i] = Some(held.get(i).copied().unwrap_or(0).min(k - 1));
        }
    }
    out.into_iter().map(|l| l.unwrap_or(0)).collect()
}

/// Chooses the count of `level` (the next ranks), then recurses; the last level takes the rest.
#[allow(clippy::too_many_arguments, clippy::cast_precision_loss)]
fn search(
    prefix: &[f64],
    sizes: &[f64],
    losses: &[f64],
    budget: f64,
    level: usize,
    start: usize,
    size: f64,
    loss: f64,
    counts: &mut Vec<usize>,
    best: &mut Option<(f64, Vec<usize>)>,
) {
    let n = prefix.len() - 1;
    let k = counts.len();
    if level + 2 == k {
        // The last choice: `c` chunks at this level, the rest at the last. Both the size and
        // the loss are linear in `c` (the loss through the prefix sum, non-decreasing in `c`),
        // so the best `c` is an end of the feasible interval: the largest when this level
        // loses less than the last, else the smallest. Found directly, this makes the search
        // O(n^(k-2)) instead of O(n^(k-1)) (5 levels over 256 chunks: 0.58 s before).
        let rest = n - start;
        let fits = |c: usize| size + c as f64 * sizes[level] + (rest - c) as f64 * sizes[k - 1] <= budget;
        let (lo, hi) = match (fits(0), fits(rest)) {
            (true, true) => (0, rest),
            (true, false) => (0, last_fitting(&fits, 0, rest)),
            (false, true) => (last_fitting(&fits, rest, 0), rest),
            (false, false) => return,
        };
        let c = if losses[level] <= losses[k - 1] { hi } else { lo };
        let l = loss + losses[level] * (prefix[start + c] - prefix[start]) + losses[k - 1] * (prefix[n] - prefix[start + c]);
        if best.as_ref().is_none_or(|(b, _)| l < *b) {
            counts[level] = c;
            counts[k - 1] = rest - c;
            *best = Some((l, counts.clone()));
            counts[k - 1] = 0;
        }
        counts[level] = 0;
        return;
    }
    let take_all = level + 1 == k;
    let lo = if take_all { n - start } else { 0 };
    // Every chunk left after this level's costs at least the smallest of the levels below.
    let least = sizes[level + 1..k].iter().copied().fold(f64::INFINITY, f64::min);
    for c in lo..=n - start {
        let s = size + c as f64 * sizes[level];
        let left = n - start - c;
        if s + if left == 0 { 0.0 } else { left as f64 * least } > budget {
            // More chunks here only add to that bound when this level is not the smaller.
            if sizes[level] >= least || take_all {
                break;
            }
            continue;
        }
        let l = loss + losses[level] * (prefix[start + c] - prefix[start]);
        counts[level] = c;
        if take_all {
            if best.as_ref().is_none_or(|(b, _)| l < *b) {
                *best = Some((l, counts.clone()));
            }
        } else {
            search(prefix, sizes, losses, budget, level + 1, start + c, s, l, counts, best);
        }
    }
    counts[level] = 0;
}

/// From `a`, which fits, towards `b`, which does not (`fits` is monotone between them: a
/// linear size against the budget), the last count that fits. Bisection on `fits` itself, so
/// float rounding at the boundary decides as it does.
fn last_fitting(fits: &dyn Fn(usize) -> bool, mut a: usize, mut b: usize) -> usize {
    while a.abs_diff(b) > 1 {
        let m = a.min(b) + a.abs_diff(b) / 2;
        if fits(m) {
            a = m;
        } else {
            b = m;
        }
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: &mut u64) -> f64 {
        *seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (*seed >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Equal to brute force over every assignment; monotone in density; within budget and
    /// within one chunk's step of it: for the default levels, the split ones (five, where the
    /// last choice is made directly), and sets whose levels are out of size order (the
    /// feasible counts of the last choice then start above zero).
    #[test]
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    fn optimal_monotone_and_on_target() {
        let default = ([190_080.0, 120_960.0, 74_880.0].to_vec(), [8.0, 4.0, 2.0].map(loss_of_bits).to_vec());
        let split = ([190_080.0, 103_860.0, 92_340.0, 80_820.0, 57_780.0].to_vec(), [8.0, 4.0, 3.5, 3.0, 2.0].map(loss_of_bits).to_vec());
        let odd = ([100.0, 40.0, 60.0, 30.0].to_vec(), [0.0, 0.2, 0.1, 1.0].to_vec());
        // The last level larger than the one before it: the fewest chunks that fit go there.
        let odd_last = ([100.0, 30.0, 60.0].to_vec(), [0.0, 1.0, 0.1].to_vec());
        for (sizes, losses) in [default, split, odd, odd_last] {
            check_against_brute_force(&sizes, &losses);
        }
    }

    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    fn check_against_brute_force(sizes: &[f64], losses: &[f64]) {
        let mut seed = 11;
        let k = sizes.len();
        for _ in 0..200 {
            let n = 1 + (rng(&mut seed) * if k > 3 { 5.0 } else { 7.0 }) as usize;
            let d: Vec<f64> = (0..n).map(|_| rng(&mut seed) + 1e-3).collect();
            let ratio = 0.3 + rng(&mut seed) * 0.75;
            let got = choose_levels(&d, sizes, losses, ratio);
            let size = |v: &[usize]| v.iter().map(|&l| sizes[l]).sum::<f64>();
            let loss = |v: &[usize]| v.iter().zip(&d).map(|(&l, &x)| losses[l] * tolerance_weight(x)).sum::<f64>();
            let budget = ratio * n as f64 * sizes[0];
            let mut best = f64::INFINITY;
            for code in 0..k.pow(n as u32) {
                let v: Vec<usize> = (0..n).map(|i| code / k.pow(i as u32) % k).collect();
                // Monotone assignments only: the solver's space (denser chunks never get fewer
                // bits), which matters where a level is larger than the one above it.
                let mono = (0..n).all(|i| (0..n).all(|j| d[i] <= d[j] || v[i] <= v[j]));
                if mono && size(&v) <= budget + 1e-6 {
                    best = best.min(loss(&v));
                }
            }
            if best.is_infinite() {
                let smallest = (0..k).min_by(|&a, &b| sizes[a].total_cmp(&sizes[b])).unwrap();
                assert!(got.iter().all(|&l| l == smallest), "nothing fits: all at the smallest level");
                continue;
            }
            assert!((loss(&got) - best).abs() < 1e-12, "{sizes:?} {d:?} ratio {ratio}: {got:?}");
            assert!(size(&got) <= budget + 1e-6);
            // On target (levels in decreasing size): one more chunk moved up a level would not fit.
            if sizes.windows(2).all(|w| w[0] > w[1]) {
                let step = sizes.windows(2).map(|w| w[0] - w[1]).fold(0.0, f64::max);
                assert!(budget - size(&got) < step || got.iter().all(|&l| l == 0), "{got:?} leaves budget unused");
            }
            for i in 0..n {
                for j in 0..n {
                    if d[i] > d[j] {
                        assert!(got[i] <= got[j], "a denser chunk got fewer bits");
                    }
                }
            }
        }
    }

    #[test]
    fn extremes() {
        let sizes = [4.0, 2.0, 1.0];
        let losses = [0.1, 0.5, 1.0];
        assert_eq!(choose_levels(&[0.3, 0.9, 0.1], &sizes, &losses, 1.0), vec![0, 0, 0]);
        assert_eq!(choose_levels(&[0.3, 0.9, 0.1], &sizes, &losses, 0.01), vec![2, 2, 2]);
        assert_eq!(choose_levels(&[0.3, 9.0, 0.1], &sizes, &losses, 0.5), vec![2, 0, 2], "4+1+1 beats 2+2+2");
        // Weighted by the square root of density, a chunk three times denser does not pay.
        assert_eq!(choose_levels(&[0.3, 0.9, 0.1], &sizes, &losses, 0.5), vec![1, 1, 1]);
        assert!(choose_levels(&[], &sizes, &losses, 0.5).is_empty());
    }

    /// A chunk already below what the plan would give it stays where it is and the budget it
    /// leaves goes to the others: none is raised, the held ones keep their level, the total
    /// stays within budget, and where nothing is held the choice is `choose_levels`'s. The
    /// case that made it: a dense first chunk lowered early would take int8, and without the
    /// refund the chunk after it went a level lower than the budget needs.
    #[test]
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    fn held_chunks_are_never_raised_and_refund_their_budget() {
        let sizes = [190_080.0, 104_280.0, 92_700.0, 81_360.0];
        let losses = [8.0, 4.0, 3.5, 3.0].map(loss_of_bits);
        let d = [1e4, 1.0, 0.9, 1.1];
        let free = choose_levels(&d, &sizes, &losses, 0.6);
        assert_eq!(free[0], 0, "the dense chunk would take int8: {free:?}");
        let held = [2, 0, 0, 0];
        let got = choose_levels_held(&d, &held, &sizes, &losses, 0.6);
        assert_eq!(got[0], 2);
        let size = |v: &[usize]| v.iter().map(|&l| sizes[l]).sum::<f64>();
        assert!(size(&got) <= 0.6 * 4.0 * sizes[0] + 1e-6);
        assert!(got[1..].iter().zip(&free[1..]).all(|(g, f)| g <= f), "the others gain: {got:?} vs {free:?}");
        assert!(got[1..].iter().zip(&free[1..]).any(|(g, f)| g < f), "the refund is spent: {got:?} vs {free:?}");
        let mut seed = 5;
        for _ in 0..300 {
            let n = 1 + (rng(&mut seed) * 12.0) as usize;
            let d: Vec<f64> = (0..n).map(|_| rng(&mut seed).powi(3) * 50.0).collect();
            let held: Vec<usize> = (0..n).map(|_| (rng(&mut seed) * 4.0) as usize).collect();
            let ratio = 0.4 + rng(&mut seed) * 0.6;
            let got = choose_levels_held(&d, &held, &sizes, &losses, ratio);
            assert!(got.iter().zip(&held).all(|(g, h)| sizes[*g] <= sizes[*h]), "raised: {got:?} held {held:?}");
            let least: f64 = held.iter().map(|&h| sizes[h].min(sizes[3])).sum();
            assert!(size(&got) <= (ratio * n as f64 * sizes[0]).max(least) + 1e-6, "{got:?} over budget");
            assert_eq!(choose_levels_held(&d, &vec![0; n], &sizes, &losses, ratio), choose_levels(&d, &sizes, &losses, ratio));
        }
    }
}

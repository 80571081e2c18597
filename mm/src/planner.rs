//! The swap-recompute planner (LLMS §3.3, eq. 4): which missing chunks to read from flash and
//! which to recompute from their tokens, so the two pipelines finish together.
//!
//! With linear profiles `T_re(x) = a + b x` (recompute x chunks) and `T_io(m) = c + d m`
//! (read m bytes), the load takes `max(T_re(X), T_io(bytes read))`. For a given number X of
//! recomputed chunks, recomputing the X largest chunks leaves the fewest bytes to read, and
//! T_re depends only on X; so trying every X with the largest chunks recomputed is an exact
//! solution of eq. 4, in O(n log n).

use serde::{Deserialize, Serialize};

/// A linear cost model `fixed + per_unit * units`, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Linear {
    pub fixed: f64,
    pub per_unit: f64,
}

impl Linear {
    #[allow(clippy::cast_precision_loss)]
    pub fn at(&self, units: u64) -> f64 {
        if units == 0 {
            0.0
        } else {
            self.fixed + self.per_unit * units as f64
        }
    }

    /// Least-squares fit of `(units, seconds)` points.
    #[allow(clippy::cast_precision_loss)]
    pub fn fit(points: &[(u64, f64)]) -> Option<Self> {
        let n = points.len() as f64;
        if points.len() < 2 {
            return None;
        }
        let (sx, sy) = points.iter().fold((0.0, 0.0), |(a, b), &(x, y)| (a + x as f64, b + y));
        let (mx, my) = (sx / n, sy / n);
        let (sxx, sxy) = points.iter().fold((0.0, 0.0), |(a, b), &(x, y)| (a + (x as f64 - mx).powi(2), b + (x as f64 - mx) * (y - my)));
        if sxx == 0.0 {
            return None;
        }
        let per_unit = sxy / sxx;
        Some(Self { fixed: my - per_unit * mx, per_unit })
    }
}

/// The chosen split.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Indices (into the input) of the chunks to recompute; the rest are read.
    pub recompute: Vec<usize>,
    pub read_bytes: u64,
    /// Predicted times of the two pipelines and of the load.
    pub t_recompute: f64,
    pub t_io: f64,
    pub t_total: f64,
}

/// Plans the load of chunks of the given byte sizes.
pub fn plan(sizes: &[u64], recompute: Linear, io: Linear) -> Plan {
    plan_forced(sizes, 0, recompute, io)
}

/// As [`plan`], with `forced` more chunks that must be recomputed whatever the split (their
/// records are missing): recomputing x of the readable ones costs `T_re(forced + x)`.
pub fn plan_forced(sizes: &[u64], forced: usize, recompute: Linear, io: Linear) -> Plan {
    let forced = forced as u64;
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
    let total: u64 = sizes.iter().sum();
    let mut best: Option<(f64, usize, u64)> = None;
    let mut removed = 0u64;
    for x in 0..=sizes.len() {
        if x > 0 {
            removed += sizes[order[x - 1]];
        }
        let read = total - removed;
        let t = recompute.at(forced + x as u64).max(io.at(read));
        if best.is_none_or(|(b, _, _)| t < b) {
            best = Some((t, x, read));
        }
    }
    let (t_total, x, read_bytes) = best.unwrap_or((0.0, 0, total));
    let mut rec: Vec<usize> = order[..x].to_vec();
    rec.sort_unstable();
    Plan { t_recompute: recompute.at(forced + x as u64), t_io: io.at(read_bytes), recompute: rec, read_bytes, t_total }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan equals brute force over every subset.
    #[test]
    fn plan_is_optimal_against_brute_force() {
        let mut x: u64 = 99;
        let mut next = || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            x >> 33
        };
        for _ in 0..300 {
            let n = (next() % 9) as usize;
            let sizes: Vec<u64> = (0..n).map(|_| [190_080, 120_960, 74_880][(next() % 3) as usize]).collect();
            let re = Linear { fixed: (next() % 100) as f64 * 1e-4, per_unit: (next() % 100 + 1) as f64 * 1e-4 };
            let io = Linear { fixed: (next() % 100) as f64 * 1e-5, per_unit: (next() % 100 + 1) as f64 * 1e-10 };
            let p = plan(&sizes, re, io);
            let mut best = f64::INFINITY;
            for mask in 0u32..(1 << n) {
                let xs = mask.count_ones() as u64;
                let read: u64 = (0..n).filter(|i| mask & (1 << i) == 0).map(|i| sizes[i]).sum();
                best = best.min(re.at(xs).max(io.at(read)));
            }
            assert!((p.t_total - best).abs() < 1e-12, "{sizes:?}: plan {} vs best {best}", p.t_total);
            assert_eq!(p.read_bytes + p.recompute.iter().map(|&i| sizes[i]).sum::<u64>(), sizes.iter().sum::<u64>());
        }
    }

    #[test]
    fn fits_recover_a_line() {
        let l = Linear::fit(&[(1, 3.0), (2, 5.0), (4, 9.0)]).unwrap();
        assert!((l.fixed - 1.0).abs() < 1e-12 && (l.per_unit - 2.0).abs() < 1e-12);
        assert!(Linear::fit(&[(1, 1.0)]).is_none());
    }
}

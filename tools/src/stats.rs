//! Small statistics the benchmarks share.

/// The median of `v` (the upper middle one of an even count; 0 for none): every benchmark here
/// reports medians, the machines being shared and noisy.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

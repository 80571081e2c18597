//! Sizes as people write them in flags and configuration files (`8MiB`, `64M`, `1.5G`, bytes).

use anyhow::{bail, Context, Result};

/// Bytes from `123`, `64k`, `256MiB`, `1.5G` (binary units).
pub fn parse_bytes(s: &str) -> Result<usize> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().with_context(|| format!("{s:?} is not a size"))?;
    let mul = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1u64,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        u => bail!("{s:?}: unknown unit {u:?} (use k, M, G)"),
    };
    #[allow(clippy::cast_precision_loss)]
    let v = n * mul as f64;
    if !v.is_finite() || v < 0.0 || v > (1u64 << 50) as f64 {
        bail!("{s:?} is out of range");
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    Ok(v as usize)
}

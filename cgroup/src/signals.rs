//! Reading the kernel's memory signals: PSI, /proc/meminfo, /proc/vmstat, and the memory files
//! of a cgroup (v2 or v1). Every parser takes text, so it is tested on fixtures as well as on
//! the real files; malformed text is an error naming the file and line, never a panic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum SignalError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: line {line}: {what}")]
    Parse { path: String, line: usize, what: String },
}

type Result<T> = std::result::Result<T, SignalError>;

fn parse_err(path: &str, line: usize, what: impl Into<String>) -> SignalError {
    SignalError::Parse { path: path.into(), line, what: what.into() }
}

pub(crate) fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| SignalError::Read { path: path.to_path_buf(), source })
}

/// One line of a PSI file: averages in percent, total stall time in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PsiLine {
    pub avg10: f64,
    pub avg60: f64,
    pub avg300: f64,
    pub total_us: u64,
}

/// A PSI file (`/proc/pressure/memory` or a cgroup's `memory.pressure`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Psi {
    pub some: PsiLine,
    pub full: PsiLine,
}

pub fn parse_psi(path: &str, text: &str) -> Result<Psi> {
    let mut psi = Psi::default();
    let (mut some, mut full) = (false, false);
    for (i, line) in text.lines().enumerate() {
        let mut words = line.split_whitespace();
        let kind = words.next().unwrap_or("");
        let mut l = PsiLine::default();
        let mut seen = 0;
        for w in words {
            let (k, v) = w.split_once('=').ok_or_else(|| parse_err(path, i + 1, format!("{w:?} is not key=value")))?;
            let bad = |_| parse_err(path, i + 1, format!("bad number in {w:?}"));
            match k {
                "avg10" => l.avg10 = v.parse().map_err(bad)?,
                "avg60" => l.avg60 = v.parse().map_err(bad)?,
                "avg300" => l.avg300 = v.parse().map_err(bad)?,
                "total" => l.total_us = v.parse().map_err(|_| parse_err(path, i + 1, format!("bad number in {w:?}")))?,
                _ => continue,
            }
            seen += 1;
        }
        if seen != 4 {
            return Err(parse_err(path, i + 1, "expected avg10, avg60, avg300 and total"));
        }
        match kind {
            "some" => (psi.some, some) = (l, true),
            "full" => (psi.full, full) = (l, true),
            other => return Err(parse_err(path, i + 1, format!("unknown PSI line {other:?}"))),
        }
    }
    if !some {
        return Err(parse_err(path, 1, "no \"some\" line"));
    }
    let _ = full; // older kernels have no "full" line for some resources
    Ok(psi)
}

/// What the monitor needs from /proc/meminfo, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MemInfo {
    pub total: u64,
    pub available: u64,
}

/// Parses the two fields the monitor needs. (The `procfs` crate's parser was tried: it
/// insists on every field a full kernel prints and reports a missing one as an internal bug,
/// which makes fixtures and odd kernels fail for fields we never read.)
pub fn parse_meminfo(path: &str, text: &str) -> Result<MemInfo> {
    let (mut total, mut available) = (None, None);
    for (i, line) in text.lines().enumerate() {
        let Some((k, v)) = line.split_once(':') else { continue };
        let slot = match k {
            "MemTotal" => &mut total,
            "MemAvailable" => &mut available,
            _ => continue,
        };
        let v = v.trim();
        let kb: u64 = v
            .strip_suffix("kB")
            .unwrap_or(v)
            .trim()
            .parse()
            .map_err(|_| parse_err(path, i + 1, format!("{k}: {v:?} is not a kB count")))?;
        *slot = Some(kb.saturating_mul(1024));
    }
    let total = total.ok_or_else(|| parse_err(path, 0, "no MemTotal"))?;
    let available = available.ok_or_else(|| parse_err(path, 0, "no MemAvailable (kernel older than 3.14)"))?;
    Ok(MemInfo { total, available: available.min(total) })
}

/// `key value` lines (/proc/vmstat, memory.stat, memory.events).
pub fn parse_counters(path: &str, text: &str) -> Result<HashMap<String, u64>> {
    let mut out = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let (k, v) = line.split_once(' ').ok_or_else(|| parse_err(path, i + 1, format!("{line:?} is not \"key value\"")))?;
        let v = v.trim().parse().map_err(|_| parse_err(path, i + 1, format!("value of {k} is not a number")))?;
        out.insert(k.to_string(), v);
    }
    Ok(out)
}

/// Reclaim activity from /proc/vmstat. The `*_proactive` counters are left out: they count
/// reclaim that we (or a proactive agent) asked for, not pressure.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct VmStat {
    pub pgscan: u64,
    pub pgsteal: u64,
    pub workingset_refault: u64,
}

pub fn vmstat_from(c: &HashMap<String, u64>) -> VmStat {
    let sum = |keys: &[&str]| keys.iter().map(|k| c.get(*k).copied().unwrap_or(0)).sum();
    VmStat {
        pgscan: sum(&["pgscan_kswapd", "pgscan_direct", "pgscan_khugepaged"]),
        pgsteal: sum(&["pgsteal_kswapd", "pgsteal_direct", "pgsteal_khugepaged"]),
        workingset_refault: sum(&["workingset_refault_anon", "workingset_refault_file", "workingset_refault"]),
    }
}

/// Zone watermarks summed over every zone, in bytes: below `low` kswapd reclaims, below
/// `min` allocations reclaim directly (the signals lmkd's watermark mode uses).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Watermarks {
    pub free: u64,
    pub min: u64,
    pub low: u64,
    pub high: u64,
}

pub fn parse_zoneinfo(path: &str, text: &str) -> Result<Watermarks> {
    let mut w = Watermarks::default();
    let mut zones = 0;
    for (i, line) in text.lines().enumerate() {
        let mut words = line.split_whitespace();
        let (slot, v) = match (words.next(), words.next(), words.next()) {
            (Some("pages"), Some("free"), Some(v)) => (&mut w.free, v),
            (Some("min"), Some(v), None) => (&mut w.min, v),
            (Some("low"), Some(v), None) => (&mut w.low, v),
            (Some("high"), Some(v), None) => (&mut w.high, v),
            (Some("Node"), ..) => {
                zones += 1;
                continue;
            }
            _ => continue,
        };
        let pages: u64 = v.parse().map_err(|_| parse_err(path, i + 1, format!("{v:?} is not a page count")))?;
        *slot += pages * 4096;
    }
    if zones == 0 {
        return Err(parse_err(path, 0, "no zones"));
    }
    Ok(w)
}

/// A cgroup's memory use and limits, in bytes (None: unlimited or not offered).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CgroupMem {
    pub usage: u64,
    pub max: Option<u64>,
    pub high: Option<u64>,
    pub low: Option<u64>,
    /// memory.events `high`/`max`/`oom` counters (v2) or failcnt (v1, as `max`).
    pub events_high: u64,
    pub events_max: u64,
    pub events_oom: u64,
}

impl CgroupMem {
    /// The limit the group meets first: memory.high (v2: above it the kernel throttles the
    /// group's allocations and reclaims from it — in the lab's guest, a group held at its
    /// memory.high stalled 30-90% of the time while memory.max was unset) or memory.max.
    pub fn limit(&self) -> Option<u64> {
        match (self.max, self.high) {
            (Some(m), Some(h)) => Some(m.min(h)),
            (m, h) => m.or(h),
        }
    }
}

/// Which cgroup files a path holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CgroupKind {
    V2,
    V1,
}

fn read_limit(path: &Path) -> Result<Option<u64>> {
    let t = read(path)?;
    let t = t.trim();
    if t == "max" {
        return Ok(None);
    }
    let v: u64 = t.parse().map_err(|_| parse_err(&path.display().to_string(), 1, format!("{t:?} is not a number or \"max\"")))?;
    // v1 reports "unlimited" as a page-rounded LONG_MAX.
    Ok(if v >= 1 << 62 { None } else { Some(v) })
}

/// Reads a cgroup directory's memory state.
pub fn read_cgroup(dir: &Path, kind: &CgroupKind) -> Result<CgroupMem> {
    let f = |name: &str| dir.join(name);
    match kind {
        CgroupKind::V2 => {
            let usage = read_limit(&f("memory.current"))?.unwrap_or(0);
            let ev = parse_counters(&f("memory.events").display().to_string(), &read(&f("memory.events"))?)?;
            Ok(CgroupMem {
                usage,
                max: read_limit(&f("memory.max"))?,
                high: read_limit(&f("memory.high")).ok().flatten(),
                low: read_limit(&f("memory.low")).ok().flatten().filter(|&v| v > 0),
                events_high: ev.get("high").copied().unwrap_or(0),
                events_max: ev.get("max").copied().unwrap_or(0),
                events_oom: ev.get("oom").copied().unwrap_or(0),
            })
        }
        CgroupKind::V1 => Ok(CgroupMem {
            usage: read_limit(&f("memory.usage_in_bytes"))?.unwrap_or(0),
            max: read_limit(&f("memory.limit_in_bytes"))?,
            // v1's soft limit is no limit: it only orders reclaim under global pressure.
            high: None,
            low: None,
            events_high: 0,
            events_max: read_limit(&f("memory.failcnt")).ok().flatten().unwrap_or(0),
            events_oom: 0,
        }),
    }
}

/// One reading of every available signal.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Milliseconds since the monitor started (or the trace's clock).
    pub t_ms: u64,
    pub psi: Option<Psi>,
    pub mem: MemInfo,
    pub vm: VmStat,
    pub cgroup: Option<CgroupMem>,
    /// The cgroup's own PSI (v2 `memory.pressure`, when the group is not the root).
    #[serde(default)]
    pub cgroup_psi: Option<Psi>,
    #[serde(default)]
    pub watermarks: Option<Watermarks>,
}

impl Sample {
    /// Free memory as a fraction of what this process may use: the tighter of the system's
    /// MemAvailable/MemTotal and the cgroup's room under its limit ([`CgroupMem::limit`]). Works without PSI and
    /// without swap.
    #[allow(clippy::cast_precision_loss)]
    pub fn headroom(&self) -> f64 {
        let sys = if self.mem.total > 0 { self.mem.available as f64 / self.mem.total as f64 } else { 1.0 };
        let cg = self.cgroup.and_then(|c| c.limit().map(|m| m.saturating_sub(c.usage) as f64 / m.max(1) as f64)).unwrap_or(1.0);
        sys.min(cg)
    }
    /// Bytes free before the tighter of the two limits.
    pub fn headroom_bytes(&self) -> u64 {
        let cg = self.cgroup.and_then(|c| c.limit().map(|m| m.saturating_sub(c.usage))).unwrap_or(u64::MAX);
        self.mem.available.min(cg)
    }
    /// The base of [`Sample::headroom`] in bytes.
    pub fn headroom_base(&self) -> u64 {
        self.cgroup.and_then(|c| c.limit()).map_or(self.mem.total, |m| m.min(self.mem.total))
    }
}

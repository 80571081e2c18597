//! Per-region counters and a fault-latency histogram.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Log2 buckets of nanoseconds: bucket i holds latencies in [2^i, 2^(i+1)).
const BUCKETS: usize = 32;

#[derive(Debug, Default)]
pub(crate) struct RegionStats {
    pub faults: AtomicU64,
    pub populates: AtomicU64,
    pub fills: AtomicU64,
    pub evictions: AtomicU64,
    pub bytes_filled: AtomicU64,
    pub bytes_evicted: AtomicU64,
    pub poisoned: AtomicU64,
    fault_started: Mutex<HashMap<usize, Instant>>,
    fault_latency: [AtomicU64; BUCKETS],
}

/// A copy of a region's statistics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Page faults received for the region (each is one message from the kernel).
    pub faults: u64,
    /// Slots made resident by `populate`/`pin`/`copy_run`.
    pub populates: u64,
    /// Slots filled (by a fault or a populate).
    pub fills: u64,
    pub evictions: u64,
    pub bytes_filled: u64,
    pub bytes_evicted: u64,
    /// Ranges poisoned because the source failed or a read went past its data.
    pub poisoned: u64,
    /// Fault latency (message read to slot installed), nanoseconds: median and 99th
    /// percentile as bucket upper bounds (powers of two), 0 when no fault was served.
    pub fault_p50_ns: u64,
    pub fault_p99_ns: u64,
    pub faults_timed: u64,
}

impl RegionStats {
    pub(crate) fn fault_started(&self, slot: usize, at: Instant) {
        self.fault_started.lock().unwrap_or_else(|e| e.into_inner()).insert(slot, at);
    }

    pub(crate) fn filled(&self, slot: usize, bytes: usize) {
        self.fills.fetch_add(1, Ordering::Relaxed);
        self.bytes_filled.fetch_add(bytes as u64, Ordering::Relaxed);
        if let Some(at) = self.fault_started.lock().unwrap_or_else(|e| e.into_inner()).remove(&slot) {
            let ns = u64::try_from(at.elapsed().as_nanos()).unwrap_or(u64::MAX).max(1);
            let b = (63 - ns.leading_zeros() as usize).min(BUCKETS - 1);
            self.fault_latency[b].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn evicted(&self, bytes: usize) {
        self.evictions.fetch_add(1, Ordering::Relaxed);
        self.bytes_evicted.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> StatsSnapshot {
        let hist: Vec<u64> = self.fault_latency.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        let total: u64 = hist.iter().sum();
        let pct = |q: f64| -> u64 {
            if total == 0 {
                return 0;
            }
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
            let want = ((total as f64) * q).ceil().max(1.0) as u64;
            let mut acc = 0;
            for (i, &c) in hist.iter().enumerate() {
                acc += c;
                if acc >= want {
                    return 1u64 << (i + 1);
                }
            }
            1u64 << BUCKETS
        };
        StatsSnapshot {
            faults: self.faults.load(Ordering::Relaxed),
            populates: self.populates.load(Ordering::Relaxed),
            fills: self.fills.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            bytes_filled: self.bytes_filled.load(Ordering::Relaxed),
            bytes_evicted: self.bytes_evicted.load(Ordering::Relaxed),
            poisoned: self.poisoned.load(Ordering::Relaxed),
            fault_p50_ns: pct(0.5),
            fault_p99_ns: pct(0.99),
            faults_timed: total,
        }
    }
}

//! Micro-benchmarks of the mechanism, each next to its floor measured in the same run
//! (`llms bench-uffd` prints them). Speed is reported, never asserted.
#![allow(clippy::cast_precision_loss)]

use std::sync::Arc;
use std::time::Instant;

use crate::pager::{Pager, PagerOptions, RegionId, Result, SlotSource, SourceError, Staging, PAGE};

/// One measured operation: median microseconds over the repetitions.
#[derive(Debug, Clone)]
pub struct BenchRow {
    pub name: &'static str,
    pub bytes: usize,
    pub median_us: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A source that copies a prepared buffer: the cheapest possible source, so a fault measures
/// the mechanism.
struct CopySource(Vec<u8>);

impl SlotSource for CopySource {
    fn fill(&self, _: RegionId, _: usize, buf: &mut [u8]) -> std::result::Result<usize, SourceError> {
        let n = self.0.len().min(buf.len());
        buf[..n].copy_from_slice(&self.0[..n]);
        Ok(n)
    }
    fn is_fast(&self) -> bool {
        true
    }
}

fn time_us(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e6
}

/// Runs every measurement `reps` times (after a warm-up) and returns the medians.
pub fn run(reps: usize) -> Result<Vec<BenchRow>> {
    let reps = reps.max(3);
    let slot = 256 * 1024;
    let chunk = 368 * 1024;
    let mut rows = Vec::new();

    // Floor: memcpy of 256 KiB between warm buffers.
    let src = vec![7u8; slot];
    let mut dst = vec![0u8; slot];
    let v: Vec<f64> = (0..=reps).map(|_| time_us(|| dst.copy_from_slice(std::hint::black_box(&src)))).skip(1).collect();
    rows.push(BenchRow { name: "memcpy 256 KiB", bytes: slot, median_us: median(v) });

    // Floor: kernel anonymous faults, per 4 KiB page.
    let v: Vec<f64> = (0..=reps)
        .map(|_| {
            let mut st = Staging::new(slot).expect("mmap");
            let buf = st.as_mut_slice();
            time_us(|| {
                for p in buf.chunks_mut(PAGE) {
                    p[0] = 1;
                }
            }) / (slot / PAGE) as f64
        })
        .skip(1)
        .collect();
    let anon_fault = median(v);
    rows.push(BenchRow { name: "kernel anonymous fault (per 4 KiB page)", bytes: PAGE, median_us: anon_fault });

    // Installs from a staging buffer: COPY, then MOVE; and the eviction that undoes them.
    for (name, allow_move) in [("populate 256 KiB slot (UFFDIO_COPY)", false), ("populate 256 KiB slot (UFFDIO_MOVE)", true)] {
        let p = Pager::with_options(PagerOptions { allow_move })?;
        if allow_move && !p.capabilities().r#move {
            continue;
        }
        let r = p.region_with(slot, 1, Arc::new(CopySource(src.clone())), false)?;
        let mut st = Staging::new(slot)?;
        let (mut pop, mut evict) = (Vec::new(), Vec::new());
        for i in 0..=reps {
            st.repopulate(); // MOVE took the pages away last time
            let t = time_us(|| r.populate_from(0, &mut st, slot).expect("populate"));
            let e = time_us(|| r.evict(0).expect("evict"));
            if i > 0 {
                pop.push(t);
                evict.push(e);
            }
        }
        rows.push(BenchRow { name, bytes: slot, median_us: median(pop) });
        if allow_move {
            rows.push(BenchRow { name: "evict 256 KiB slot (MADV_DONTNEED)", bytes: slot, median_us: median(evict) });
        }
    }

    // Faults served by the handler: whole 256 KiB slot, 4 KiB slot, a 368 KiB KV chunk.
    let p = Pager::new()?;
    for (name, size) in [
        ("fault on a 256 KiB slot (whole slot served)", slot),
        ("fault on a 4 KiB slot", PAGE),
        ("fault on a 368 KiB KV chunk (whole chunk)", chunk),
    ] {
        let r = p.region_with(size, 1, Arc::new(CopySource(vec![9u8; size])), true)?;
        let v: Vec<f64> = (0..=reps)
            .map(|_| {
                let t = time_us(|| {
                    // SAFETY: reading the first byte of the slot through the pager.
                    std::hint::black_box(unsafe { std::ptr::read_volatile(r.slot_ptr(0)) });
                });
                r.evict(0).expect("evict");
                t
            })
            .skip(1)
            .collect();
        rows.push(BenchRow { name, bytes: size, median_us: median(v) });
    }
    rows.push(BenchRow { name: "92 kernel anonymous faults (368 KiB page by page)", bytes: chunk, median_us: anon_fault * 92.0 });
    Ok(rows)
}

//! Decode's matrix-vector product on one thread and on all of them, by where the weights sit:
//! a matrix that fits in L2, one that fits in L3, one far larger than any cache, and many
//! distinct matrices of a 1.7B model's sizes each in its own dispatch (as decode meets them),
//! in Q4_0, Q4_K and Q6_K; beside a streaming read of the large one by the same threads (the
//! floor of `llms bench --floor`, `engine::kernels::floor_read`: since 6 Dec 2026 the best of a
//! plain read and reads asking ahead as the tiles do; before, a plain read, which the kernels
//! could beat at a slow hour of the host's memory). The large matrix and the many are placed in arenas as the model places
//! its resident matrices (engine::arena: on huge pages where the kernel gives them), and the
//! read reads the large one where it sits. Weight bytes per second, the best of 5 passes. The cache-resident
//! rates say what the kernel's arithmetic allows; the DRAM ones against the read say how near
//! the memory floor the kernel alone gets (#56: tg against the floor), at the prefetch distance
//! decode's tuner chooses on this host. The last line is JSON (for `llms record`).
//!
//! `cargo run --release -p engine --example matvec_rate [-- MiB_of_the_large_matrix]`
//!
//! `... --example matvec_rate -- rows [q4_0|q4_1|q8_0|q4_k|q6_k] [threads]`: instead, the time of one product
//! against 1 to 8 token rows at once (a batched decode step's rows, the 512-bit pair
//! tiles where the CPU has them) over the default model's width (576 columns; 2048 for the
//! K-quants, whose blocks are 256 wide), from L2 and
//! from DRAM, as a multiple of one row's: what a row more costs once the weights are read.
//!
//! The weights are bytes from a fixed recurrence with small f16 scales (the kernels' cost does
//! not depend on the values); a benchmark, not a test: it asserts nothing.

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::hint::black_box;
use std::time::Instant;

use engine::arena::{Arena, ArenaBuilder};
use engine::kernels::{act_kind, ahead, floor_read, matmul_packed, Acts, OutPtr};
use engine::quant::GgmlType;
use engine::repack::PackedWeight;
use engine::ThreadPool;

/// A row-major `ty` matrix of `rows x cols` whose scales are small f16s and codes arbitrary.
fn matrix(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols);
    let mut m: Vec<u8> = (0..rows * rb).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let small = half::f16::from_f32(0.01).to_le_bytes();
    for blk in m.chunks_exact_mut(ts) {
        // Q4_0: d first; Q4_1: d and m; Q4_K: d and dmin first (then its packed 6-bit scales).
        if ty == GgmlType::Q6K {
            // Q6_K: d last (after its codes and 8-bit scales).
            blk[ts - 2..].copy_from_slice(&small);
            continue;
        }
        blk[..2].copy_from_slice(&small);
        if bs == 256 || ty == GgmlType::Q4_1 {
            blk[2..4].copy_from_slice(&small);
        }
    }
    m
}

/// Weight bytes per second of single-token products against each of `mats` in turn by
/// `pool`'s threads, each its own dispatch handed out 8 groups at a time from each thread's
/// own run (`for_runs`) and run at the prefetch distance decode's tuner gives it
/// (`ahead::tuned`), as the model's decode does (the best of `rounds`, each repeating the
/// products until they have read ~256 MiB).
fn rate(pool: &ThreadPool, mats: &[PackedWeight], acts: &Acts, rounds: usize) -> f64 {
    let total: usize = mats.iter().map(PackedWeight::bytes).sum();
    let mut outs: Vec<Vec<f32>> = mats.iter().map(|w| vec![0f32; w.rows]).collect();
    let reps = ((256usize << 20) / total).max(1);
    let mut best = 0.0f64;
    for _ in 0..rounds {
        let t = Instant::now();
        for _ in 0..reps {
            for (w, out) in mats.iter().zip(&mut outs) {
                let o = OutPtr::new(out);
                ahead::tuned(w.bytes(), 1, || pool.for_runs("matvec", w.groups(), 8, &|a, b| matmul_packed(w, acts, o, w.rows, a, b)));
                black_box(&out);
            }
        }
        best = best.max((reps * total) as f64 / t.elapsed().as_secs_f64());
    }
    best
}

/// The memory floor's read of `buf` by `pool`'s threads (`engine::kernels::floor_read`, as
/// `llms bench --floor` reads it: the best of a plain read and runs asking ahead as the tiles
/// do), bytes per second, the best of `passes` rounds of its ways.
fn read_rate(pool: &ThreadPool, buf: &[u8], passes: usize) -> f64 {
    floor_read(pool, bytemuck::cast_slice(&buf[..buf.len() / 8 * 8]), passes)
}

/// `mats` moved into one arena, as the model places its resident matrices (on huge pages where
/// the kernel gives them: engine::arena), with the arena, which must outlive them.
fn in_arena(mats: Vec<PackedWeight>) -> (Vec<PackedWeight>, Arena) {
    let mut b = ArenaBuilder::new(mats.iter().map(|m| m.bytes().next_multiple_of(64)).sum()).expect("an arena");
    // SAFETY: the arena is returned beside the matrices and dropped after them by every caller.
    let mats = mats.into_iter().map(|m| unsafe { m.into_arena(&mut b) }).collect();
    (mats, b.finish().expect("an arena"))
}

/// Runs Q4_0 products over many 2048-column matrices (~64 MiB, a few 1.7B layers' worth) until
/// the tuner has finished a round (at most a few thousand products; none with the distance
/// fixed).
fn warm_tuner(pool: &ThreadPool) {
    let cols = 2048;
    let x: Vec<f32> = (0..cols).map(|i| ((i as f32) * 0.37).sin()).collect();
    let mut acts = Acts::default();
    acts.prepare(&x, 1, cols, &[act_kind(GgmlType::Q4_0)], pool);
    let mats: Vec<PackedWeight> = (0..8)
        .map(|i| {
            let rows = if i % 3 == 2 { 8192 } else { 2048 };
            PackedWeight::pack(GgmlType::Q4_0, rows, cols, &matrix(GgmlType::Q4_0, rows, cols)).expect("a packed type")
        })
        .collect();
    let (mats, arena) = in_arena(mats);
    let mut passes = 0;
    while !ahead::report().fixed && ahead::report().rounds == 0 && passes < 1000 {
        rate(pool, &mats, &acts, 1);
        passes += 1;
    }
    drop((mats, arena));
}

/// The `rows` mode (see the top): seconds per product against `n` rows, the best of 7 rounds,
/// on `threads` (default: every core; one is the service's steps beside its prompt lane).
fn rows_table(ty: GgmlType, threads: Option<usize>) {
    let threads = threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let pool = ThreadPool::new(threads);
    // The default model's width; K-quants' blocks are 256 wide, so theirs is a 1.7B model's.
    let cols = if ty.block_size() == 256 { 2048 } else { 576 };
    println!("{ty:?}, {cols} columns, {threads} threads: time per product, and as a multiple of one row's");
    for (label, rows) in [("L2", 512usize), ("DRAM", 131_072 * 576 / cols)] {
        let w = PackedWeight::pack(ty, rows, cols, &matrix(ty, rows, cols)).expect("a packed type");
        let mut one = 0.0;
        for n in 1usize..=8 {
            let x: Vec<f32> = (0..n * cols).map(|i| ((i as f32) * 0.37).sin()).collect();
            let mut acts = Acts::default();
            acts.prepare(&x, n, cols, &[act_kind(ty)], &pool);
            let mut out = vec![0f32; rows * n];
            let o = OutPtr::new(&mut out);
            let reps = ((256usize << 20) / w.bytes()).max(1);
            let mut best = f64::MAX;
            for _ in 0..7 {
                let t = Instant::now();
                for _ in 0..reps {
                    pool.for_runs("rows", w.groups(), 8, &|a, b| matmul_packed(&w, &acts, o, w.rows, a, b));
                    black_box(&out);
                }
                best = best.min(t.elapsed().as_secs_f64() / reps as f64);
            }
            if n == 1 {
                one = best;
            }
            println!("{label:5} {n} row(s): {:9.1} us  {:5.2}x", best * 1e6, best / one);
        }
    }
}

/// The `distances` mode (see the top): each type's many matrices at every candidate distance
/// and the read, in turn pass by pass, so the host's memory moving between minutes moves them
/// all alike; each pass's rate relative to the read of its round, the median over the rounds.
fn distances_table(rounds: usize, ds: &[usize]) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = ThreadPool::new(threads);
    let cols = 2048;
    println!("{threads} threads, many 2-9M matrices (256 MiB) against the read of the same bytes; median of {rounds} rounds");
    println!("{:6} {}", "type", ds.iter().map(|d| format!("{d:>7}")).collect::<String>());
    let mut out = Vec::new();
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q4K, GgmlType::Q6K] {
        let x: Vec<f32> = (0..cols).map(|i| ((i as f32) * 0.37).sin()).collect();
        let mut acts = Acts::default();
        acts.prepare(&x, 1, cols, &[act_kind(ty)], &pool);
        let mut mats = Vec::new();
        while mats.iter().map(PackedWeight::bytes).sum::<usize>() < 256 << 20 {
            let rows = if mats.len() % 3 == 2 { 8192 } else { 2048 };
            mats.push(PackedWeight::pack(ty, rows, cols, &matrix(ty, rows, cols)).expect("a packed type"));
        }
        let (mats, arena) = in_arena(mats);
        let mut ratios = vec![Vec::new(); ds.len()];
        for r in 0..rounds {
            // The read of all the matrices' bytes, as the floor reads a model's.
            let secs: f64 = mats.iter().map(|w| w.bytes() as f64 / read_rate(&pool, w.as_bytes(), 1)).sum();
            let read = mats.iter().map(PackedWeight::bytes).sum::<usize>() as f64 / secs;
            // Rotated each round, so no distance always follows the read.
            for i in 0..ds.len() {
                let c = (i + r) % ds.len();
                ahead::pin(Some(ds[c]));
                ratios[c].push(rate(&pool, &mats, &acts, 1) / read);
            }
        }
        ahead::pin(None);
        drop((mats, arena));
        let med: Vec<f64> = ratios
            .into_iter()
            .map(|mut v| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            })
            .collect();
        println!("{:6} {}", format!("{ty:?}"), med.iter().map(|m| format!("{m:>7.3}")).collect::<String>());
        out.push(serde_json::json!({ "type": format!("{ty:?}"), "vs_read": med }));
    }
    println!("{}", serde_json::json!({ "distances": ds, "rounds": rounds, "types": out }));
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("distances") {
        let rounds = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(15);
        // Distances in bytes, comma-separated (multiples of 64): the tuner's by default.
        let ds: Vec<usize> = std::env::args()
            .nth(3)
            .map(|a| a.split(',').filter_map(|d| d.trim().parse().ok()).filter(|d: &usize| d.is_multiple_of(64)).collect())
            .filter(|v: &Vec<usize>| !v.is_empty())
            .unwrap_or_else(|| ahead::CANDIDATES.to_vec());
        return distances_table(rounds, &ds);
    }
    if std::env::args().nth(1).as_deref() == Some("rows") {
        let ty = match std::env::args().nth(2).as_deref() {
            Some("q4_0") => GgmlType::Q4_0,
            Some("q8_0") => GgmlType::Q8_0,
            Some("q4_k") => GgmlType::Q4K,
            Some("q6_k") => GgmlType::Q6K,
            _ => GgmlType::Q4_1,
        };
        let threads = std::env::args().nth(3).and_then(|t| t.parse().ok());
        return rows_table(ty, threads);
    }
    let big_mib: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(512);
    // The products run through decode's tuner (`ahead::tuned`): at `LLMS_PREFETCH_AHEAD`'s
    // distance when it is set, else at the one the tuner chooses. Its starting distance is
    // one host's best and can be another's worst (6 KiB on the Intel Xeon guest: 0.65 of the
    // read where 2 KiB gave 0.96, docs/notes/engine.md), so a round of many-matrix products
    // (as decode's) runs first and every rate below is at the distance it chose.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    warm_tuner(&ThreadPool::new(threads));
    let ahead = ahead::report();
    println!(
        "prefetch distance {} bytes{}",
        ahead.bytes,
        if ahead.fixed { " (LLMS_PREFETCH_AHEAD)".to_string() } else { format!(" (tuned, {} rounds)", ahead.rounds) }
    );
    let cols = 2048;
    let gb = |x: f64| (x / 1e8).round() / 10.0;
    let mut runs = Vec::new();
    for n in [1, threads] {
        let pool = ThreadPool::new(n);
        println!("{n} thread(s); weight bytes read per second (GB/s), best of 5 passes");
        println!("{:8} {:>10} {:>10} {:>10} {:>10} {:>10}", "type", "L2 (0.5M)", "L3 (8M)", format!("{big_mib} MiB"), "many 2-9M", "read");
        for ty in [GgmlType::Q4_0, GgmlType::Q4K, GgmlType::Q6K] {
            let x: Vec<f32> = (0..cols).map(|i| ((i as f32) * 0.37).sin()).collect();
            let mut acts = Acts::default();
            acts.prepare(&x, 1, cols, &[act_kind(ty)], &pool);
            let packed = |rows: usize| PackedWeight::pack(ty, rows, cols, &matrix(ty, rows, cols)).expect("a packed type");
            let rows_of = |bytes: usize| (bytes / ty.row_bytes(cols)).div_ceil(8) * 8;
            let l2 = rate(&pool, &[packed(rows_of(n * (512 << 10)))], &acts, 5);
            let l3 = rate(&pool, &[packed(rows_of(8 << 20))], &acts, 5);
            let big = packed(rows_of(big_mib << 20));
            let (big, big_arena) = in_arena(vec![big]);
            let dram = rate(&pool, &big, &acts, 5);
            let read = read_rate(&pool, big[0].as_bytes(), 2);
            drop((big, big_arena));
            // As decode meets them: many distinct matrices of a 1.7B model's sizes (2048 and
            // 8192 rows), 256 MiB in all, each its own dispatch.
            let mut mats = Vec::new();
            while mats.iter().map(PackedWeight::bytes).sum::<usize>() < 256 << 20 {
                mats.push(packed(if mats.len() % 3 == 2 { 8192 } else { 2048 }));
            }
            let (mats, arena) = in_arena(mats);
            let many = rate(&pool, &mats, &acts, 5);
            drop((mats, arena));
            println!(
                "{:8} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
                format!("{ty:?}"),
                l2 / 1e9,
                l3 / 1e9,
                dram / 1e9,
                many / 1e9,
                read / 1e9
            );
            runs.push(serde_json::json!({
                "threads": n, "type": format!("{ty:?}"), "l2_gb_s": gb(l2), "l3_gb_s": gb(l3), "dram_gb_s": gb(dram),
                "many_gb_s": gb(many), "read_gb_s": gb(read), "dram_vs_read": dram / read, "many_vs_read": many / read,
            }));
        }
    }
    // The last line is for `llms record`.
    println!("{}", serde_json::json!({ "big_mib": big_mib, "cols": cols, "prefetch_bytes": ahead.bytes, "runs": runs }));
}

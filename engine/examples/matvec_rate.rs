//! Decode's matrix-vector product on one thread and on all of them, by where the weights sit:
//! a matrix that fits in L2, one that fits in L3, and one far larger than any cache, each in
//! Q4_0 and Q4_K; beside a plain streaming read of the large one. Weight bytes per second, the best of several
//! passes. The gap between the cache-resident rate and the streaming read says whether decode
//! is bound by the kernel's arithmetic or by memory on this machine (#56: tg against the
//! memory floor).
//!
//! `cargo run --release -p engine --example matvec_rate [-- MiB_of_the_large_matrix]`
//!
//! The weights are bytes from a fixed recurrence with small f16 scales (the kernels' cost does
//! not depend on the values); a benchmark, not a test: it asserts nothing.

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::hint::black_box;
use std::time::Instant;

use engine::kernels::{act_kind, matmul_packed, Acts, OutPtr};
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
        // Q4_0: d first; Q4_K: d and dmin first (then its packed 6-bit scales).
        blk[..2].copy_from_slice(&small);
        if bs == 256 {
            blk[2..4].copy_from_slice(&small);
        }
    }
    m
}

/// Weight bytes per second of single-token products against `w` by `pool`'s threads, handed
/// out 8 groups at a time as the model's decode does (the best of `rounds`, each repeating the
/// product until it has read ~256 MiB).
fn rate(pool: &ThreadPool, w: &PackedWeight, acts: &Acts, rounds: usize) -> f64 {
    let mut out = vec![0f32; w.rows];
    let reps = ((256usize << 20) / w.bytes()).max(1);
    let mut best = 0.0f64;
    for _ in 0..rounds {
        let t = Instant::now();
        for _ in 0..reps {
            let o = OutPtr::new(&mut out);
            pool.for_chunks("matvec", w.groups(), 8, &|a, b| matmul_packed(w, acts, o, w.rows, a, b));
            black_box(&out);
        }
        best = best.max((reps * w.bytes()) as f64 / t.elapsed().as_secs_f64());
    }
    best
}

/// A streaming read of `buf` by `pool`'s threads in 1 MiB pieces (as `llms bench --floor`),
/// bytes per second (four sums so the loads are not serialized behind one addition chain), the
/// best of `rounds`.
fn read_rate(pool: &ThreadPool, buf: &[u8], rounds: usize) -> f64 {
    let words: &[u64] = bytemuck::cast_slice(&buf[..buf.len() / 8 * 8]);
    let mut best = 0.0f64;
    for _ in 0..rounds {
        let t = Instant::now();
        pool.for_chunks("read", words.len(), (1 << 20) / 8, &|a, b| {
            let mut acc = [0u64; 4];
            for w in words[a..b].chunks_exact(4) {
                for (s, &x) in acc.iter_mut().zip(w) {
                    *s = s.wrapping_add(x);
                }
            }
            black_box(acc);
        });
        best = best.max((words.len() * 8) as f64 / t.elapsed().as_secs_f64());
    }
    best
}

fn main() {
    let big_mib: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(512);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cols = 2048;
    for n in [1, threads] {
        let pool = ThreadPool::new(n);
        println!("{n} thread(s); weight bytes read per second (GB/s), best of 5 passes");
        println!("{:8} {:>10} {:>10} {:>10} {:>10}", "type", "L2 (0.5M)", "L3 (8M)", format!("{big_mib} MiB"), "read");
        for ty in [GgmlType::Q4_0, GgmlType::Q4K] {
            let row_bytes = ty.row_bytes(cols);
            let x: Vec<f32> = (0..cols).map(|i| ((i as f32) * 0.37).sin()).collect();
            let mut acts = Acts::default();
            acts.prepare(&x, 1, cols, &[act_kind(ty)], &pool);
            let mut line = format!("{:8}", format!("{ty:?}"));
            let mut last = Vec::new();
            for bytes in [n * (512usize << 10), 8 << 20, big_mib << 20] {
                let rows = (bytes / row_bytes).div_ceil(8) * 8;
                let raw = matrix(ty, rows, cols);
                let w = PackedWeight::pack(ty, rows, cols, &raw).expect("a packed type");
                drop(raw);
                line += &format!(" {:>10.1}", rate(&pool, &w, &acts, 5) / 1e9);
                last = w.as_bytes().to_vec();
            }
            line += &format!(" {:>10.1}", read_rate(&pool, &last, 5) / 1e9);
            println!("{line}");
        }
    }
}

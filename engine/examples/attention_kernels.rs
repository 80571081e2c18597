//! Decode attention's work on one 16-token chunk of one KV head for a GQA group of 3 queries
//! (the default model's shape), per format and step: the block's parameters parsed, the K
//! scores, the K outliers' corrections, the V values; and a prefill job's (8 tokens by the
//! group: 24 queries) int8 and f16 scores and values. Prints the fastest of 40 rounds of each
//! (ns), measured in turn so that the machine's noise falls on every format alike, and the
//! multiply-adds a ns of each shape.
//!
//! `cargo run --release -p engine --example attention_kernels`
//!
//! The blocks are random bytes of each format's layout (the kernels' cost does not depend on
//! the values); a benchmark, not a test: it asserts nothing.

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::hint::black_box;
use std::time::Instant;

use engine::kernels::{chunk_scores, chunk_values, KvRows};
use engine::kv::{self, KvFormat, KvGeometry};

const HD: usize = 64;
const T: usize = 16;
const NQ: usize = 3;
/// Queries of a prefill job (8 tokens by a GQA group of 3).
const PQ: usize = 24;
const ROUNDS: usize = 40;
const CALLS: usize = 50_000;

/// Bytes of `n` from a fixed recurrence (any bytes are a valid block), with an f16 reference
/// step of 2^-4 at the front.
fn bytes(n: usize, mul: usize) -> Vec<u8> {
    let mut b: Vec<u8> = (0..n).map(|i| (i * mul % 256) as u8).collect();
    b[..2].copy_from_slice(&half::f16::from_f32(0.0625).to_le_bytes());
    b
}

fn main() {
    let g = KvGeometry { n_layers: 1, n_kv_heads: 1, head_dim: HD, chunk_tokens: T };
    let probs: Vec<f32> = (0..NQ * T).map(|i| (i as f32 * 0.37).sin().abs() / T as f32).collect();
    let q: Vec<f32> = (0..NQ * HD).map(|i| (i as f32 * 0.11).cos()).collect();
    let visible = [T; NQ];
    let (mut scores, mut out) = (vec![0f32; NQ * T], vec![0f32; NQ * HD]);
    let mut i8blk = bytes(g.head_block_bytes(KvFormat::Int8, 0), 37);
    for s in i8blk[..2 * T].chunks_exact_mut(2) {
        s.copy_from_slice(&half::f16::from_f32(0.02).to_le_bytes());
    }
    // f16 values of modest size (any bits would do, but a NaN or an infinity might not run
    // at the speed of a number).
    let f16blk: Vec<u8> = (0..T * HD).flat_map(|i| half::f16::from_f32((i as f32 * 0.013).sin()).to_le_bytes()).collect();
    let kblk = bytes(g.head_block_bytes(KvFormat::K4V3, 0), 91);
    let vblk = bytes(g.head_block_bytes(KvFormat::K4V3, 1), 53);
    let (mut zero, mut step, mut scales) = (vec![0f32; HD], vec![0f32; HD], vec![0f32; T]);

    // A prefill job's shape: a tile of 8 tokens by the group's 3 heads.
    let probs24: Vec<f32> = (0..PQ * T).map(|i| (i as f32 * 0.37).sin().abs() / T as f32).collect();
    let q24: Vec<f32> = (0..PQ * HD).map(|i| (i as f32 * 0.11).cos()).collect();
    let visible24 = [T; PQ];
    let (mut scores24, mut out24) = (vec![0f32; PQ * T], vec![0f32; PQ * HD]);

    let names = [
        "int8 K scores",
        "int8 V values",
        "k4v3 K parse",
        "k4v3 K scores",
        "k4v3 K outliers",
        "k4v3 V parse",
        "k4v3 V values",
        "int8 K scores 24q",
        "int8 V values 24q",
        "f16 K scores 24q",
        "f16 V values 24q",
    ];
    let mut best = [f64::MAX; 11];
    for _ in 0..ROUNDS {
        let mut time = |i: usize, f: &mut dyn FnMut()| {
            let s = Instant::now();
            for _ in 0..CALLS {
                f();
            }
            best[i] = best[i].min(s.elapsed().as_secs_f64() * 1e9 / CALLS as f64);
        };
        let k8 = KvRows::Int8 { blk: &i8blk, t_cap: T };
        time(0, &mut || chunk_scores(&q, HD, k8, &visible, 0.125, &mut scores, T, 0));
        time(1, &mut || chunk_values(&probs, T, 0, k8, &visible, HD, &mut out));
        time(2, &mut || {
            black_box(kv::split_k_params(&kblk, T, HD, &mut zero, &mut step));
        });
        let (outliers, codes) = kv::split_k_params(&kblk, T, HD, &mut zero, &mut step);
        let k4 = |outliers| KvRows::Channel { codes, bits: 4, zero: &zero, step: &step, outliers };
        time(3, &mut || chunk_scores(&q, HD, k4(&[]), &visible, 0.125, &mut scores, T, 0));
        // With the outliers; their share is the difference.
        time(4, &mut || chunk_scores(&q, HD, k4(outliers), &visible, 0.125, &mut scores, T, 0));
        time(5, &mut || {
            black_box(kv::split_v_params(&vblk, 3, T, &mut scales));
        });
        let codes = kv::split_v_params(&vblk, 3, T, &mut scales);
        let v3 = KvRows::Token { codes, scales: &scales, bits: 3, levels: kv::split_v_levels(3) };
        time(6, &mut || chunk_values(&probs, T, 0, v3, &visible, HD, &mut out));
        time(7, &mut || chunk_scores(&q24, HD, k8, &visible24, 0.125, &mut scores24, T, 0));
        time(8, &mut || chunk_values(&probs24, T, 0, k8, &visible24, HD, &mut out24));
        let k16 = KvRows::F16(&f16blk);
        time(9, &mut || chunk_scores(&q24, HD, k16, &visible24, 0.125, &mut scores24, T, 0));
        time(10, &mut || chunk_values(&probs24, T, 0, k16, &visible24, HD, &mut out24));
    }
    best[4] -= best[3];
    println!("one chunk (16 tokens) of one KV head, {NQ} queries, head_dim {HD}: fastest of {ROUNDS} rounds, ns");
    for (n, b) in names.iter().zip(best) {
        println!("  {n:<16} {b:7.1}");
    }
    let (int8, k4v3) = (best[0] + best[1], best[2..7].iter().sum::<f64>());
    // Multiply-adds a call: queries x tokens x head_dim.
    for (n, q, b) in
        [("int8 K+V, 3q", NQ, best[0] + best[1]), ("int8 K+V, 24q", PQ, best[7] + best[8]), ("f16 K+V, 24q", PQ, best[9] + best[10])]
    {
        println!("  {n}: {:.1} multiply-adds a ns", (2 * q * T * HD) as f64 / b);
    }
    println!("  int8 total {int8:.1}, k4v3 total {k4v3:.1}: k4v3 at {:.2}x int8's speed", int8 / k4v3);
    black_box((&scores, &out, &scores24, &out24));
}

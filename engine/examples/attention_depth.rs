//! Decode attention over a deep context as a decode step walks it: one query's GQA group (3
//! queries) against every chunk of every layer and KV head, chunks laid out as the engine's
//! KV cache lays them (each chunk all layers, each head's block a few KiB in it), K scores,
//! softmax, V values. Per storage (f16, int8) it times the walk over chunks in memory
//! (separate heap chunks, as the engine's own cache) with the next blocks asked for 0-4 chunks
//! ahead (as `attention.rs` asks 2), the same walk over one chunk read again and again (in
//! cache: the kernels' arithmetic alone), the walk again after 128 MiB were read (cold: as in
//! a decode step, whose weights pass through the caches between one step's attention and the
//! next's) and the blocks only read, with and without the hints (the access pattern's own
//! cost); rounds of each in turn so the host's noise falls on all alike; prints the median ns
//! per (token, layer).
//!
//! `cargo run --release -p engine --example attention_depth [DEPTH]`
//!
//! A benchmark, not a test: it asserts nothing.

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::hint::black_box;
use std::time::Instant;

use engine::kernels::{chunk_scores, chunk_values, prefetch, softmax_f16, KvRows};
use engine::kv::{KvFormat, KvGeometry};

const HD: usize = 64;
const T: usize = 16;
const NQ: usize = 3;
const LAYERS: usize = 30;
const HEADS: usize = 3;
const ROUNDS: usize = 15;

/// KV head `h`'s K (`kv` 0) or V (1) block of `layer` in chunk `ch`.
fn block<'a>(g: &KvGeometry, f: KvFormat, chunks: &[&'a [u8]], ch: usize, layer: usize, kv: usize, h: usize) -> &'a [u8] {
    let off = g.block_offset(f, layer, kv, h);
    &chunks[ch][off..off + g.head_block_bytes(f, kv)]
}

/// One decode step's attention for one query's group, asking for the blocks `ahead` chunks on.
#[allow(clippy::too_many_arguments)]
fn walk(ahead: usize, g: &KvGeometry, f: KvFormat, chunks: &[&[u8]], depth: usize, q: &[f32], scores: &mut [f32], out: &mut [f32]) {
    let visible_of = |ch: usize| [depth.saturating_sub(ch * T).min(T); NQ];
    let block = |ch, layer, kv, h| block(g, f, chunks, ch, layer, kv, h);
    for layer in 0..LAYERS {
        for h in 0..HEADS {
            for kv in 0..2 {
                for ch in 0..chunks.len() {
                    let from = if ch == 0 { 1 } else { ch + ahead };
                    for next in from..(ch + ahead + 1).min(chunks.len()) {
                        prefetch(block(next, layer, kv, h));
                    }
                    let b = block(ch, layer, kv, h);
                    let blk = if f == KvFormat::F16 { KvRows::F16(b) } else { KvRows::Int8 { blk: b, t_cap: T } };
                    if kv == 0 {
                        chunk_scores(q, HD, blk, &visible_of(ch), 0.125, scores, depth, ch * T);
                    } else {
                        chunk_values(scores, depth, ch * T, blk, &visible_of(ch), HD, out);
                    }
                }
                if kv == 0 {
                    for row in scores.chunks_exact_mut(depth) {
                        softmax_f16(row);
                    }
                }
            }
        }
    }
}

/// The same blocks in the same order, only read (summed as words): the access pattern's own cost.
fn read_only(ahead: usize, g: &KvGeometry, f: KvFormat, chunks: &[&[u8]]) -> u64 {
    let mut acc = 0u64;
    let block = |ch, layer, kv, h| block(g, f, chunks, ch, layer, kv, h);
    for layer in 0..LAYERS {
        for h in 0..HEADS {
            for kv in 0..2 {
                for ch in 0..chunks.len() {
                    for next in ch + 1..(ch + ahead + 1).min(chunks.len()) {
                        prefetch(block(next, layer, kv, h));
                    }
                    let b = block(ch, layer, kv, h);
                    acc = acc
                        .wrapping_add(b.chunks_exact(8).map(|w| u64::from_le_bytes(w.try_into().unwrap())).fold(0u64, u64::wrapping_add));
                }
            }
        }
    }
    acc
}

fn main() {
    let depth: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(512);
    let n = depth.div_ceil(T);
    let g = KvGeometry { n_layers: LAYERS, n_kv_heads: HEADS, head_dim: HD, chunk_tokens: T };
    let q: Vec<f32> = (0..NQ * HD).map(|i| (i as f32 * 0.11).cos() * 0.1).collect();
    let (mut scores, mut out) = (vec![0f32; NQ * depth], vec![0f32; NQ * HD]);
    let fill = |b: &mut [u8], f: KvFormat| {
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 37 % 251) as u8;
        }
        if f == KvFormat::F16 {
            // Small finite halves: 0x2c00 +- a little (about 0.06).
            for p in b.chunks_exact_mut(2) {
                p[1] = 0x2c;
            }
        }
    };
    println!("decode attention, {depth} tokens deep, {LAYERS} layers x {HEADS} KV heads x {HD}, {NQ} queries a head: median of {ROUNDS} rounds, ns per (token, layer)");
    for f in [KvFormat::F16, KvFormat::Int8] {
        let cb = g.chunk_bytes(f);
        let mut heap: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; cb]).collect();
        heap.iter_mut().for_each(|c| fill(c, f));
        let aheads = [0usize, 1, 2, 4];
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); aheads.len() + 4];
        // Read between a round's walks before the cold one: a decode step streams the weights
        // (98 MB for the default model) between one layer's attention and the next step's, so
        // its K/V blocks come from memory, not from the last level cache.
        let evict = vec![1u64; 128 << 17];
        for _ in 0..ROUNDS {
            let set: Vec<&[u8]> = heap.iter().map(|c| &c[..]).collect();
            let hot: Vec<&[u8]> = (0..n).map(|_| &heap[0][..]).collect();
            for (i, &ahead) in aheads.iter().enumerate() {
                let s = Instant::now();
                walk(ahead, &g, f, &set, depth, &q, &mut scores, &mut out);
                times[i].push(s.elapsed().as_secs_f64() * 1e9 / (depth * LAYERS) as f64);
            }
            let s = Instant::now();
            walk(2, &g, f, &hot, depth, &q, &mut scores, &mut out);
            times[aheads.len()].push(s.elapsed().as_secs_f64() * 1e9 / (depth * LAYERS) as f64);
            black_box(evict.iter().fold(0u64, |a, &x| a.wrapping_add(x)));
            let s = Instant::now();
            walk(2, &g, f, &set, depth, &q, &mut scores, &mut out);
            times[aheads.len() + 3].push(s.elapsed().as_secs_f64() * 1e9 / (depth * LAYERS) as f64);
            for (k, a) in [(1, 0usize), (2, 2)] {
                let s = Instant::now();
                black_box(read_only(a, &g, f, &set));
                times[aheads.len() + k].push(s.elapsed().as_secs_f64() * 1e9 / (depth * LAYERS) as f64);
            }
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        print!("  {:<5}", f.name());
        for (i, &a) in aheads.iter().enumerate() {
            print!(" ahead {a}: {:6.1}", med(&mut times[i]));
        }
        println!("  hot {:6.1}  cold, 2 ahead {:6.1}", med(&mut times[aheads.len()]), med(&mut times[aheads.len() + 3]));
        println!(
            "        read only: no prefetch {:6.1}, 2 ahead {:6.1}",
            med(&mut times[aheads.len() + 1]),
            med(&mut times[aheads.len() + 2])
        );
    }
    black_box((&scores, &out));
}

//! What lowering KV to the split levels costs: one block (16 tokens of a 64-channel head) of K
//! and of V per level, then a whole chunk of the default model's shape (30 layers, 3 KV heads)
//! from int8 to each level. The fastest of the rounds, in µs. The encoders are searches (each
//! K channel's step and zero point, each V token's scale); llmsd runs them on its leveller
//! thread, not on the calls' (docs/llmsd.md).
//!
//! `cargo run --release -p engine --example kv_convert`
//!
//! A benchmark, not a test: it asserts nothing (`kv::tests` fixes the bytes they write).

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::time::Instant;

use engine::kv::{self, KvFormat, KvGeometry};

fn best_of(rounds: usize, mut f: impl FnMut()) -> f64 {
    (0..rounds)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let g = KvGeometry { n_layers: 30, n_kv_heads: 3, head_dim: 64, chunk_tokens: 16 };
    // Values from a fixed recurrence, uniform in [-2, 2).
    let mut x: u32 = 1;
    let vals: Vec<f32> = (0..g.chunk_tokens * g.head_dim)
        .map(|_| {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            ((x >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 4.0
        })
        .collect();
    let splits = [KvFormat::K4V4, KvFormat::K4V3, KvFormat::K3V3, KvFormat::K2V2];
    for f in splits {
        let us: Vec<f64> = (0..2)
            .map(|k| {
                let mut blk = vec![0u8; g.head_block_bytes(f, k)];
                best_of(50, || kv::write_block_f32(f, k, &mut blk, 16, 64, 16, &vals))
            })
            .collect();
        println!("{:5} block: K {:6.1} us, V {:6.1} us", f.name(), us[0], us[1]);
    }
    let mut src = vec![0u8; g.chunk_bytes(KvFormat::Int8)];
    for layer in 0..g.n_layers {
        for k in 0..2 {
            for h in 0..g.n_kv_heads {
                let at = g.block_offset(KvFormat::Int8, layer, k, h);
                let blk = &mut src[at..at + g.head_block_bytes(KvFormat::Int8, k)];
                for t in 0..g.chunk_tokens {
                    kv::write_token(KvFormat::Int8, blk, t, g.chunk_tokens, &vals[t * g.head_dim..(t + 1) * g.head_dim]);
                }
            }
        }
    }
    for to in splits.into_iter().chain([KvFormat::Q4]) {
        let mut dst = vec![0u8; g.chunk_bytes(to)];
        let us = best_of(10, || kv::convert_chunk(&g, KvFormat::Int8, &src, to, &mut dst, g.chunk_tokens));
        println!("int8 -> {:5}: {us:8.0} us a chunk", to.name());
    }
}

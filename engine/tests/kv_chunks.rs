//! The chunked KV cache on the real model: exact recompute of any chunks, mixed formats,
//! attention-based density.
#![allow(clippy::cast_precision_loss)]

use std::sync::Arc;

use engine::kv::KvFormat;
use engine::model::{AttentionStats, SessionOptions};
use engine::{Logits, Model, Session, ThreadPool};
use llms_tests::{fixture, model_path};

fn setup() -> (Arc<Model>, Arc<ThreadPool>, Vec<u32>) {
    let m = Arc::new(Model::load(&model_path()).unwrap());
    let text = std::fs::read_to_string(fixture("gpl-3.txt")).unwrap();
    let toks = m.tokenizer.encode(&text, false, false).unwrap()[..170].to_vec();
    (m, Arc::new(ThreadPool::new(2)), toks)
}

fn session(m: &Arc<Model>, p: &Arc<ThreadPool>, base: KvFormat, observe: bool) -> Session {
    Session::with_options(
        Arc::clone(m),
        Arc::clone(p),
        SessionOptions { capacity: 256, chunk_tokens: 16, base, observe_attention: observe, sliding_window: None },
    )
}

/// Wiped chunks recomputed through the interleaved path are bit-identical to the originals,
/// and the next token's logits equal those of a context that was never wiped.
#[test]
fn recompute_of_any_chunks_is_exact() {
    let (m, p, toks) = setup();
    let (ctx, next) = (&toks[..169], toks[169]);
    for base in [KvFormat::F16, KvFormat::Int8] {
        let mut reference = session(&m, &p, base, false);
        reference.eval(ctx, Logits::None).unwrap();
        assert!(reference.kv.n_chunks() >= 10);
        let want_logits = reference.eval(&[next], Logits::Last).unwrap().to_vec();
        for wiped in [vec![2usize, 5], vec![0, 3, 4, 9], vec![10]] {
            let mut s = session(&m, &p, base, false);
            s.eval(ctx, Logits::None).unwrap();
            let saved: Vec<Vec<u8>> = wiped.iter().map(|&c| s.kv.chunk(c).to_vec()).collect();
            for &c in &wiped {
                s.kv.wipe(c);
            }
            let positions: Vec<usize> = wiped.iter().flat_map(|&c| c * 16..((c + 1) * 16).min(ctx.len())).collect();
            let mut layers_seen = Vec::new();
            s.recompute(&positions, &mut |l| layers_seen.push(l)).unwrap();
            assert_eq!(layers_seen, (0..m.config.n_layers).collect::<Vec<_>>(), "the per-layer hook runs before every layer");
            for (&c, want) in wiped.iter().zip(&saved) {
                assert!(s.kv.chunk(c) == want.as_slice(), "{base:?}: chunk {c} differs after recompute of {wiped:?}");
            }
            let got = s.eval(&[next], Logits::Last).unwrap();
            assert!(got == want_logits.as_slice(), "{base:?}: logits after recomputing {wiped:?} differ");
        }
    }
}

/// A context's tokens are the caller's to set (a restored context): a recompute over a token
/// id outside the vocabulary is an error naming it, not an out-of-range read.
#[test]
fn recompute_refuses_a_token_outside_the_vocabulary() {
    let (m, p, toks) = setup();
    let mut s = session(&m, &p, KvFormat::Int8, false);
    s.eval(&toks[..40], Logits::None).unwrap();
    s.kv.wipe(1);
    s.tokens[20] = u32::try_from(m.config.vocab).unwrap() + 7;
    let err = s.recompute(&(16..32).collect::<Vec<_>>(), &mut |_| {}).unwrap_err();
    assert!(matches!(err, engine::ModelError::BadToken(t) if t as usize == m.config.vocab + 7), "{err}");
}

/// Attention over chunks in mixed formats agrees with attention over the same values held
/// dequantized (in f16 chunks).
#[test]
fn mixed_formats_agree_with_their_dequantized_values() {
    let (m, p, toks) = setup();
    let mut mixed = session(&m, &p, KvFormat::Int8, false);
    mixed.eval(&toks[..160], Logits::None).unwrap();
    let plan = [
        KvFormat::Int8,
        KvFormat::Q4,
        KvFormat::Q2,
        KvFormat::Q4,
        KvFormat::Int8,
        KvFormat::Q2,
        KvFormat::Q4,
        KvFormat::Q2,
        KvFormat::Int8,
        KvFormat::Q4,
    ];
    for (c, &f) in plan.iter().enumerate() {
        mixed.kv.set_format(c, f).unwrap();
    }
    let mut deq = session(&m, &p, KvFormat::Int8, false);
    deq.eval(&toks[..160], Logits::None).unwrap();
    for (c, &f) in plan.iter().enumerate() {
        deq.kv.set_format(c, f).unwrap();
        deq.kv.set_format(c, KvFormat::F16).unwrap();
    }
    let a = mixed.eval(&toks[160..165], Logits::Last).unwrap().to_vec();
    let b = deq.eval(&toks[160..165], Logits::Last).unwrap().to_vec();
    // The f16 copies round the dequantized values (relative 2^-11); through 30 layers of
    // 8-bit activation quantization that is noise of a few tenths on the top logits (the same
    // tolerance as against llama.cpp). The exact comparison is the attention-level unit test.
    assert_eq!(engine::sampler::argmax(&a), engine::sampler::argmax(&b));
    let mut top: Vec<usize> = (0..b.len()).collect();
    top.sort_by(|&x, &y| b[y].total_cmp(&b[x]));
    for &i in &top[..10] {
        assert!((a[i] - b[i]).abs() < 0.75, "token {i}: mixed {} vs dequantized {}", a[i], b[i]);
    }
    let g = mixed.kv.geom;
    let want: usize = plan.iter().map(|&f| g.chunk_bytes(f)).sum::<usize>() + g.chunk_bytes(KvFormat::Int8);
    assert_eq!(mixed.kv.bytes(), want, "each chunk costs its own format's bytes");
    assert!(g.chunk_bytes(KvFormat::Q2) < g.chunk_bytes(KvFormat::Q4) && g.chunk_bytes(KvFormat::Q4) < g.chunk_bytes(KvFormat::Int8));
}

/// Figure 6a style: a hand-built lower-triangular attention matrix; density = each column's
/// average over the rows that see it, averaged over the chunk's tokens.
#[test]
fn density_follows_equation_1_on_a_hand_built_matrix() {
    // Rows: 4 tokens; row r sees positions 0..=r.
    let rows: [&[f32]; 4] = [&[1.0], &[0.5, 0.5], &[0.2, 0.5, 0.3], &[0.1, 0.3, 0.5, 0.1]];
    let ld = 4;
    let mut probs = vec![0.0f32; 4 * ld];
    for (r, row) in rows.iter().enumerate() {
        probs[r * ld..r * ld + row.len()].copy_from_slice(row);
    }
    let mut st = AttentionStats::default();
    // Two heads of one layer, the second twice as peaked on column 0.
    st.add_rows(&probs, ld, &[1, 2, 3, 4]);
    let mut probs2 = probs.clone();
    probs2[ld] = 1.0;
    probs2[ld + 1] = 0.0;
    st.add_rows(&probs2, ld, &[1, 2, 3, 4]);
    let col = |c: usize, p: &[f32]| (c..4).map(|r| f64::from(p[r * ld + c])).sum::<f64>() / (4 - c) as f64;
    let tok = |c: usize| (col(c, &probs) + col(c, &probs2)) / 2.0;
    assert!((st.density(1..2) - tok(1)).abs() < 1e-9);
    assert!((st.density(0..2) - (tok(0) + tok(1)) / 2.0).abs() < 1e-9, "chunk density averages its tokens");
    assert!((st.density(2..4) - (tok(2) + tok(3)) / 2.0).abs() < 1e-9);
}

/// On the real model the observer sees every row of every head and layer: each position's
/// count is (rows that see it) x heads x layers, each row's probabilities sum to one, and two
/// runs give the same densities.
#[test]
fn observed_densities_on_the_model_are_complete_and_reproducible() {
    let (m, p, toks) = setup();
    let run = || {
        let mut s = session(&m, &p, KvFormat::Int8, true);
        s.eval(&toks[..100], Logits::None).unwrap();
        s.eval(&toks[100..112], Logits::None).unwrap();
        s.attention.clone().unwrap()
    };
    let a = run();
    let (h, l, n) = (m.config.n_heads as u64, m.config.n_layers as u64, 112u64);
    for (pos, &c) in a.count.iter().enumerate() {
        assert_eq!(c, (n - pos as u64) * h * l, "position {pos}");
    }
    let total: f64 = a.sum.iter().sum();
    let rows = (n * h * l) as f64;
    assert!((total / rows - 1.0).abs() < 1e-2, "rows sum to one: {total} over {rows} rows");
    let b = run();
    let d = |st: &AttentionStats| (0..7).map(|c| st.density(c * 16..(c + 1) * 16)).collect::<Vec<_>>();
    assert_eq!(d(&a), d(&b));
    // The first chunk (attention sink) is the densest, as expected for Llama-family models.
    let da = d(&a);
    assert!(da[0] > da[1..].iter().copied().fold(0.0, f64::max), "{da:?}");
}

/// A full context slides: the oldest chunks after the sink go, the kept chunks move down
/// with their K re-rotated to their new positions and their V untouched, and the session
/// keeps working.
#[test]
fn a_full_context_slides_instead_of_failing() {
    let (m, p, toks) = setup();
    let c = &m.config;
    let geom = |f| (engine::kv::KvGeometry { n_layers: c.n_layers, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim, chunk_tokens: 16 }, f);
    for base in [KvFormat::F16, KvFormat::Int8] {
        let opts = SessionOptions { capacity: 64, chunk_tokens: 16, base, observe_attention: true, sliding_window: Some(4) };
        let mut s = Session::with_options(Arc::clone(&m), Arc::clone(&p), opts);
        s.eval(&toks[..64], Logits::None).unwrap();
        let before = s.kv.chunk(3).to_vec();
        let logits = s.eval(&toks[64..84], Logits::Last).unwrap().to_vec();
        assert!(logits.iter().all(|x| x.is_finite()));
        // 84 > 64: the two chunks after the sink chunk went (positions 16..48).
        let kept: Vec<u32> = toks[..16].iter().chain(&toks[48..84]).copied().collect();
        assert_eq!(s.tokens, kept);
        assert_eq!(s.n_past(), 52);
        assert_eq!(s.attention.as_ref().unwrap().count.len(), 52);
        // Old chunk 3 is now chunk 1: V unchanged, K rotated by -32 positions.
        let (g, f) = geom(base);
        let after = s.kv.chunk(1);
        let (hd, ct) = (c.head_dim, 16);
        let (mut k0, mut k1) = (vec![0.0f32; ct * hd], vec![0.0f32; ct * hd]);
        for layer in [0, c.n_layers - 1] {
            for h in 0..c.n_kv_heads {
                let vo = g.block_offset(f, layer, 1, h);
                let vb = g.head_block_bytes(f, 1);
                assert_eq!(before[vo..vo + vb], after[vo..vo + vb], "V moves unchanged");
                let ko = g.block_offset(f, layer, 0, h);
                engine::kv::read_block_f32(f, 0, &before[ko..], ct, hd, ct, &mut k0);
                engine::kv::read_block_f32(f, 0, &after[ko..], ct, hd, ct, &mut k1);
                for t in 0..ct {
                    for i in 0..hd / 2 {
                        let theta = -32.0 * f64::from(c.rope_base).powf(-2.0 * i as f64 / hd as f64);
                        let (a, b) = (f64::from(k0[t * hd + 2 * i]), f64::from(k0[t * hd + 2 * i + 1]));
                        let want = [a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()];
                        let amax = k0[t * hd..(t + 1) * hd].iter().fold(0.0f32, |m, x| m.max(x.abs()));
                        let tol = if base == KvFormat::F16 { 2e-3 * amax + 1e-3 } else { 1.5 * amax / 127.0 + 1e-3 };
                        for (j, w) in want.iter().enumerate() {
                            let got = f64::from(k1[t * hd + 2 * i + j]);
                            assert!(
                                (got - w).abs() <= f64::from(tol),
                                "{base:?} layer {layer} head {h} token {t} dim {}: {got} vs {w}",
                                2 * i + j
                            );
                        }
                    }
                }
            }
        }
    }
    // Without a window a full context is an error, not a slide.
    let mut s = Session::with_options(Arc::clone(&m), Arc::clone(&p), SessionOptions::new(32));
    s.eval(&toks[..32], Logits::None).unwrap();
    assert!(s.eval(&toks[32..33], Logits::Last).is_err());
}

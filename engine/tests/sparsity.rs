//! Top-K activation sparsity on the real model: at level 0 it is the dense model bit for bit;
//! calibrated thresholds zero about the share asked for on other text; a moderate level costs
//! a little perplexity, not nothing.

use std::sync::Arc;

use engine::sparsity::{Calibrator, Sparsity, SITES};
use engine::{Logits, Model, Session, ThreadPool};
use llms_tests::{fixture, model_path};

fn setup() -> (Arc<Model>, Arc<ThreadPool>, Vec<u32>, Vec<u32>) {
    let model = Arc::new(Model::load(&model_path()).unwrap());
    let eval = model.tokenizer.encode(&std::fs::read_to_string(fixture("gpl-3.txt")).unwrap(), false, false).unwrap();
    let calib = model.tokenizer.encode(&std::fs::read_to_string("/usr/share/common-licenses/Apache-2.0").unwrap(), false, false).unwrap();
    (model, Arc::new(ThreadPool::new(2)), eval, calib)
}

/// Thresholds from one dense pass over `ids` (the magnitude statistics only).
fn thresholds(model: &Arc<Model>, pool: &Arc<ThreadPool>, ids: &[u32], level: f32) -> Arc<Sparsity> {
    let mut s = Session::new(Arc::clone(model), Arc::clone(pool), 512);
    s.set_calibrator(Some(Calibrator::new(model.config.n_layers)));
    s.eval(&ids[..512], Logits::None).unwrap();
    Arc::new(s.take_calibrator().unwrap().thresholds(level, [level; SITES]))
}

#[test]
fn sparsity_zero_is_dense_and_moderate_sparsity_costs_a_little() {
    let (model, pool, eval, calib) = setup();
    let run = |sp: Option<Arc<Sparsity>>| {
        let mut s = Session::new(Arc::clone(&model), Arc::clone(&pool), 256);
        s.set_sparsity(sp).unwrap();
        s.eval(&eval[..200], Logits::All).unwrap().to_vec()
    };
    let dense = run(None);
    let zero = run(Some(thresholds(&model, &pool, &calib, 0.0)));
    assert!(dense.iter().zip(&zero).all(|(a, b)| a.to_bits() == b.to_bits()), "level 0 must be the dense model");

    // Thresholds from one text zero about the asked share of another text's inputs.
    let sp = thresholds(&model, &pool, &calib, 0.5);
    let mut s = Session::new(Arc::clone(&model), Arc::clone(&pool), 512);
    s.set_calibrator(Some(Calibrator::new(model.config.n_layers)));
    s.eval(&eval[..512], Logits::None).unwrap();
    let held_out = s.take_calibrator().unwrap();
    for site in 0..SITES {
        let share = held_out.share_below(site, &sp);
        assert!((0.35..0.65).contains(&share), "site {site}: thresholds zero {share} of held-out inputs, asked 0.5");
    }

    let ppl = |sp: Option<Arc<Sparsity>>| engine::eval::perplexity_sparse(&model, Arc::clone(&pool), &eval, 256, 4, sp).unwrap().ppl;
    let (p0, p3) = (ppl(None), ppl(Some(thresholds(&model, &pool, &calib, 0.3))));
    assert!(p3 > p0 && p3 < p0 * 1.15, "perplexity {p0} dense, {p3} at 30% sparsity");
    assert!(Session::new(Arc::clone(&model), pool, 8)
        .set_sparsity(Some(Arc::new(Sparsity { target: 0.1, levels: [0.1; SITES], thresholds: vec![] })))
        .is_err());
}

/// The channel-major layout computes what the packed one does, bit for bit — a prompt (the
/// batched tile kernel) then tokens one by one (the per-token kernel, rows split between
/// threads) — dense and with sparsity (inactive channels skipped, not multiplied by zero).
#[test]
fn channel_major_matches_packed_dense_and_sparse() {
    let (packed, pool, eval, calib) = setup();
    let cm = Arc::new(Model::load_as(&model_path(), engine::WeightFormat::ChannelMajor).unwrap());
    assert!(cm.is_channel_major() && !packed.is_channel_major());
    let sp = thresholds(&packed, &pool, &calib, 0.5);
    for sparsity in [None, Some(sp)] {
        let run = |model: &Arc<Model>| {
            let mut s = Session::new(Arc::clone(model), Arc::clone(&pool), 128);
            s.set_sparsity(sparsity.clone()).unwrap();
            let mut out = vec![s.eval(&eval[..48], Logits::Last).unwrap().to_vec()];
            for &t in &eval[48..64] {
                out.push(s.eval(&[t], Logits::Last).unwrap().to_vec());
            }
            out
        };
        let (a, b) = (run(&packed), run(&cm));
        for (step, (a, b)) in a.iter().zip(&b).enumerate() {
            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "sparse {}, step {step}", sparsity.is_some());
        }
    }
}

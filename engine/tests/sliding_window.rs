//! Gemma 3's sliding-window KV in the engine's own cache: chunks whose tokens all left the
//! window keep only their global layers (`Session::drop_dead_kv`), attention never reads the
//! rest, and every logit is bit for bit what the whole cache gives.

use std::sync::Arc;

use engine::{Logits, Model, ModelError, Session, ThreadPool};
use llms_tests::gemma3_path;

fn text_ids(model: &Model, n: usize) -> Vec<u32> {
    let text = std::fs::read_to_string("/usr/share/common-licenses/GPL-3").expect("the GPL-3 text");
    let ids = model.tokenizer.encode(&text, true, false).expect("tokenize");
    assert!(ids.len() >= n, "{} tokens of text, {n} wanted", ids.len());
    ids[..n].to_vec()
}

#[test]
fn dead_chunks_are_dropped_never_read_and_change_no_logit() {
    let model = Arc::new(Model::load(&gemma3_path()).expect("load Gemma 3"));
    let pool = Arc::new(ThreadPool::new(2));
    let c = &model.config;
    assert_eq!((c.kept_layers(), c.n_layers), (3, 18), "Gemma 3 270M: every 6th of 18 layers is global");
    let ids = text_ids(&model, 900);
    let (mut whole, mut windowed) = (Session::new(Arc::clone(&model), Arc::clone(&pool), 1024), Session::new(model.clone(), pool, 1024));
    // A prompt past the 512-token window in three pieces, then decoding: after every call the
    // windowed session drops what went dead; the whole one keeps everything.
    let mut dead = 0;
    for piece in [&ids[..300], &ids[300..640], &ids[640..890]] {
        let a = whole.eval(piece, Logits::Last).expect("whole").to_vec();
        let b = windowed.eval(piece, Logits::Last).expect("windowed").to_vec();
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "logits differ after {} tokens", whole.n_past());
        let now = windowed.drop_dead_kv().expect("drop dead chunks");
        assert_eq!(now, c.dead_chunks(windowed.n_past(), 16));
        assert!(now >= dead);
        dead = now;
    }
    for &t in &ids[890..900] {
        let a = whole.eval(&[t], Logits::Last).expect("whole").to_vec();
        let b = windowed.eval(&[t], Logits::Last).expect("windowed").to_vec();
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "logits differ at {}", whole.n_past());
        windowed.drop_dead_kv().expect("drop dead chunks");
    }
    // 900 tokens: the first (901 - 512) / 16 = 24 chunks keep 3 layers of 18.
    assert_eq!(windowed.kv.dead(), 24);
    let layer = whole.kv.geom.layer_bytes(whole.kv.format(0));
    assert_eq!(whole.kv.bytes() - windowed.kv.bytes(), 24 * 15 * layer);
    // Truncated below where the window had passed, the session refuses to go on rather than
    // attend to K/V it no longer has.
    windowed.truncate(600);
    let err = windowed.eval(&ids[600..601], Logits::Last).expect_err("the window's chunks are gone");
    assert!(matches!(err, ModelError::WindowDropped { pos: 600, dead: 24 }), "{err}");
}

#[test]
fn a_model_without_a_window_has_nothing_to_drop() {
    let model = Arc::new(Model::load(&llms_tests::model_path()).expect("load the default model"));
    let mut s = Session::new(Arc::clone(&model), Arc::new(ThreadPool::new(2)), 2048);
    let ids = text_ids(&model, 1100);
    s.eval(&ids, Logits::Last).expect("prefill");
    assert_eq!(s.drop_dead_kv().expect("nothing to drop"), 0);
    assert_eq!(s.kv.dead(), 0);
}

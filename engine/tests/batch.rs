//! One decode step for several sessions (`Session::decode_batch`) on the real model: each
//! session's logits are bit for bit those of its own decode, whatever the batch holds.
#![allow(clippy::needless_range_loop)]

use std::sync::Arc;

use engine::kv::KvFormat;
use engine::model::{Scratch, SessionOptions};
use engine::{Logits, Model, Session, ThreadPool};
use llms_tests::{fixture, model_path};

fn session(m: &Arc<Model>, p: &Arc<ThreadPool>, base: KvFormat, observe: bool) -> Session {
    Session::with_options(
        Arc::clone(m),
        Arc::clone(p),
        SessionOptions { capacity: 256, chunk_tokens: 16, base, observe_attention: observe, sliding_window: None },
    )
}

fn argmax(v: &[f32]) -> u32 {
    engine::sampler::argmax(v)
}

/// Each session decodes `steps` greedy tokens on its own from its next token: every step's logits.
fn decode_alone(sessions: &mut [(Session, u32)], steps: usize) -> Vec<Vec<Vec<f32>>> {
    sessions
        .iter_mut()
        .map(|(s, next)| {
            (0..steps)
                .map(|_| {
                    let l = s.eval(&[*next], Logits::Last).unwrap().to_vec();
                    *next = argmax(&l);
                    l
                })
                .collect()
        })
        .collect()
}

/// Four contexts of different lengths and formats (lowered chunks, a split level read in the
/// rotated domain; one context past decoding attention's first 128-token span, the others
/// within it), decoded 12 steps one at a time and as one batch, then in batches of other
/// sizes: identical logits and tokens.
#[test]
fn batched_decode_equals_each_sessions_own() {
    let m = Arc::new(Model::load(&model_path()).unwrap());
    let p = Arc::new(ThreadPool::new(2));
    let text = std::fs::read_to_string(fixture("gpl-3.txt")).unwrap();
    let toks = m.tokenizer.encode(&text, false, false).unwrap();
    let prompts: [&[u32]; 4] = [&toks[..7], &toks[100..140], &toks[300..301], &toks[500..631]];
    let bases = [KvFormat::Int8, KvFormat::F16, KvFormat::Int8, KvFormat::Int8];
    let build = || -> Vec<(Session, u32)> {
        prompts
            .iter()
            .zip(bases)
            .enumerate()
            .map(|(i, (pr, base))| {
                let mut s = session(&m, &p, base, i == 1);
                let next = argmax(s.eval(pr, Logits::Last).unwrap());
                if i == 3 {
                    // A lowered chunk: attention decodes it; batching must not change that.
                    s.kv.set_format(2, KvFormat::Q4).unwrap();
                    s.kv.set_format(5, KvFormat::K3V3).unwrap();
                }
                if i == 1 {
                    s.kv.set_format(1, KvFormat::K4V4).unwrap();
                }
                (s, next)
            })
            .collect()
    };
    // Reference: each session alone.
    let mut solo = build();
    let want = decode_alone(&mut solo, 12);
    // Batches of 4, then of 1, 2 and 3 over the same steps.
    for sizes in [vec![4usize], vec![1, 2, 1], vec![3, 1], vec![2, 2]] {
        let mut st = build();
        let mut scratch = Scratch::default();
        for step in 0..12 {
            let mut at = 0;
            for &k in &sizes {
                let (sessions, nexts): (Vec<&mut Session>, Vec<u32>) = st[at..at + k].iter_mut().map(|(s, n)| (s, *n)).unzip();
                let mut sessions = sessions;
                let vocab = m.config.vocab;
                let logits = Session::decode_batch(&mut sessions, &nexts, &mut scratch).unwrap().to_vec();
                for (j, row) in logits.chunks_exact(vocab).enumerate() {
                    let i = at + j;
                    assert!(
                        row == want[i][step].as_slice(),
                        "batch {sizes:?}, session {i}, step {step}: logits differ from its own decode"
                    );
                    st[i].1 = argmax(row);
                }
                at += k;
            }
        }
        for (i, (s, _)) in st.iter().enumerate() {
            assert_eq!(s.tokens, solo[i].0.tokens, "session {i}'s tokens");
            assert_eq!(s.attention.is_some(), i == 1);
        }
        assert_eq!(st[1].0.attention.as_ref().unwrap().count, solo[1].0.attention.as_ref().unwrap().count, "attention observed alike");
    }
}

/// Contexts past decoding attention's first 128-token span on every side of a batch (each
/// context and KV head one job, the spans' values still added in order) against each decoded
/// alone (by spans, a job a span): a lowered chunk, a split level read in the rotated domain
/// and an observed context among them; identical logits, tokens and observed attention.
#[test]
fn batched_contexts_past_a_span_equal_each_sessions_own() {
    let m = Arc::new(Model::load(&model_path()).unwrap());
    let p = Arc::new(ThreadPool::new(2));
    let text = std::fs::read_to_string(fixture("gpl-3.txt")).unwrap();
    let toks = m.tokenizer.encode(&text, false, false).unwrap();
    let prompts: [&[u32]; 3] = [&toks[..150], &toks[300..500], &toks[600..830]];
    let build = || -> Vec<(Session, u32)> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, pr)| {
                let mut s = session(&m, &p, KvFormat::Int8, i == 2);
                let next = argmax(s.eval(pr, Logits::Last).unwrap());
                s.kv.set_format(3, if i == 0 { KvFormat::Q4 } else { KvFormat::K3V3 }).unwrap();
                (s, next)
            })
            .collect()
    };
    let mut solo = build();
    let want = decode_alone(&mut solo, 8);
    let mut st = build();
    let mut scratch = Scratch::default();
    let vocab = m.config.vocab;
    for step in 0..8 {
        let (mut sessions, nexts): (Vec<&mut Session>, Vec<u32>) = st.iter_mut().map(|(s, n)| (s, *n)).unzip();
        let logits = Session::decode_batch(&mut sessions, &nexts, &mut scratch).unwrap().to_vec();
        for (i, row) in logits.chunks_exact(vocab).enumerate() {
            assert!(row == want[i][step].as_slice(), "session {i}, step {step}: logits differ from its own decode");
            st[i].1 = argmax(row);
        }
    }
    for (i, (s, _)) in st.iter().enumerate() {
        assert_eq!(s.tokens, solo[i].0.tokens, "session {i}'s tokens");
    }
    let (x, y) = (st[2].0.attention.as_ref().unwrap(), solo[2].0.attention.as_ref().unwrap());
    assert_eq!(x.count, y.count, "attention counted alike");
    assert!(x.sum == y.sum, "attention observed alike");
}

/// A bad batch changes no session: a token outside the vocabulary, a full session, sessions of
/// different models, a token count that does not match.
#[test]
fn a_bad_batch_changes_nothing() {
    let m = Arc::new(Model::load(&model_path()).unwrap());
    let p = Arc::new(ThreadPool::new(2));
    let mut a = session(&m, &p, KvFormat::Int8, false);
    let mut b = Session::with_options(
        Arc::clone(&m),
        Arc::clone(&p),
        SessionOptions { capacity: 4, chunk_tokens: 16, base: KvFormat::Int8, observe_attention: false, sliding_window: None },
    );
    a.eval(&[1, 2, 3], Logits::None).unwrap();
    b.eval(&[1, 2, 3, 4], Logits::None).unwrap();
    let mut scratch = Scratch::default();
    let vocab = u32::try_from(m.config.vocab).unwrap();
    assert!(Session::decode_batch(&mut [&mut a], &[vocab], &mut scratch).is_err());
    assert!(Session::decode_batch(&mut [&mut a, &mut b], &[5, 6], &mut scratch).is_err(), "b is full");
    assert!(Session::decode_batch(&mut [&mut a], &[5, 6], &mut scratch).is_err());
    let other = Arc::new(Model::load(&model_path()).unwrap());
    let mut c = session(&other, &p, KvFormat::Int8, false);
    assert!(Session::decode_batch(&mut [&mut a, &mut c], &[5, 6], &mut scratch).is_err());
    assert_eq!((a.tokens.len(), b.tokens.len(), c.tokens.len()), (3, 4, 0));
    assert!(Session::decode_batch(&mut [], &[], &mut scratch).unwrap().is_empty());
}

/// A prefill split into pieces that share forward passes with other sessions' decode steps
/// (what the service's scheduler does): each session's logits and tokens are bit for bit
/// those of the same pieces run alone, and of the whole prompt run at once.
#[test]
fn prefill_pieces_batched_with_decodes_equal_their_own_runs() {
    let m = Arc::new(Model::load(&model_path()).unwrap());
    let p = Arc::new(ThreadPool::new(2));
    let text = std::fs::read_to_string(fixture("gpl-3.txt")).unwrap();
    let toks = m.tokenizer.encode(&text, false, false).unwrap();
    let vocab = m.config.vocab;
    let long = &toks[200..261];
    // With a's attention observed every row attends in the last layer; with nothing
    // observed only the rows asked for logits do (the batch's rows trimmed there).
    for observe_a in [true, false] {
        // Alone: the long prompt at once, then 4 decode steps; the short one decodes 8 steps.
        let mut a = session(&m, &p, KvFormat::Int8, observe_a);
        let mut want_a = vec![a.eval(long, Logits::Last).unwrap().to_vec()];
        for _ in 0..4 {
            let t = argmax(want_a.last().unwrap());
            want_a.push(a.eval(&[t], Logits::Last).unwrap().to_vec());
        }
        let mut b = session(&m, &p, KvFormat::Int8, false);
        let mut want_b = vec![b.eval(&toks[..20], Logits::Last).unwrap().to_vec()];
        for _ in 0..8 {
            let t = argmax(want_b.last().unwrap());
            want_b.push(b.eval(&[t], Logits::Last).unwrap().to_vec());
        }
        // Batched: the long prompt in pieces of 16 beside b's decode steps, then both decode.
        let mut a2 = session(&m, &p, KvFormat::Int8, observe_a);
        let mut b2 = session(&m, &p, KvFormat::Int8, false);
        b2.eval(&toks[..20], Logits::None).unwrap();
        let mut scratch = Scratch::default();
        let (mut got_a, mut got_b): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (Vec::new(), vec![want_b[0].clone()]);
        let mut rest = long;
        for step in 0..8 {
            let tb = argmax(got_b.last().unwrap());
            let ta: Vec<u32> = if rest.is_empty() {
                vec![argmax(got_a.last().unwrap())]
            } else {
                let (piece, r) = rest.split_at(rest.len().min(16));
                rest = r;
                piece.to_vec()
            };
            let done_prefill = rest.is_empty();
            let logits = Session::step_batch(&mut [&mut a2, &mut b2], &[&ta, &[tb]], &mut scratch).unwrap().to_vec();
            assert_eq!(logits.len(), 2 * vocab, "step {step}: one row of logits per session");
            if done_prefill {
                got_a.push(logits[..vocab].to_vec());
            }
            got_b.push(logits[vocab..].to_vec());
        }
        assert_eq!(got_b.len(), want_b.len());
        for (i, (g, w)) in got_b.iter().zip(&want_b).enumerate() {
            assert!(g == w, "b's step {i} differs from its own decode");
        }
        assert_eq!(got_a.len(), want_a.len(), "a: its prompt in 4 pieces, then 4 decodes");
        for (i, (g, w)) in got_a.iter().zip(&want_a).enumerate() {
            assert!(g == w, "a's row {i} differs from its own run of the whole prompt");
        }
        assert_eq!(a2.tokens, a.tokens);
        if observe_a {
            assert_eq!(a2.attention.as_ref().unwrap().count, a.attention.as_ref().unwrap().count);
            let (x, y) = (a2.attention.as_ref().unwrap(), a.attention.as_ref().unwrap());
            assert!(x.sum == y.sum, "attention observed alike");
            continue;
        }
        // Refused whole: an empty piece.
        let n = a2.tokens.len();
        assert!(Session::step_batch(&mut [&mut a2], &[&[]], &mut scratch).is_err());
        assert_eq!(a2.tokens.len(), n);
    }
}

/// A forward pass computes the last layer past its K/V only for the rows whose logits are
/// asked for (`Logits::Last`, `None`): those logits, the cache every later step reads and the
/// attention observed are what the whole computation (`Logits::All`, every row to the end)
/// gives, bit for bit.
#[test]
fn rows_without_logits_skip_the_last_layer_alike() {
    let m = Arc::new(Model::load(&model_path()).unwrap());
    let p = Arc::new(ThreadPool::new(2));
    let text = std::fs::read_to_string(fixture("gpl-3.txt")).unwrap();
    let toks = m.tokenizer.encode(&text, false, false).unwrap();
    let vocab = m.config.vocab;
    let prompt = &toks[40..77];
    for observe in [false, true] {
        for base in [KvFormat::Int8, KvFormat::F16] {
            let mut whole = session(&m, &p, base, observe);
            let all = whole.eval(prompt, Logits::All).unwrap().to_vec();
            assert_eq!(all.len(), prompt.len() * vocab);
            let last_row = &all[(prompt.len() - 1) * vocab..];
            let mut last = session(&m, &p, base, observe);
            assert!(last.eval(prompt, Logits::Last).unwrap() == last_row, "{base:?} observe {observe}: Last's logits");
            let mut none = session(&m, &p, base, observe);
            assert!(none.eval(prompt, Logits::None).unwrap().is_empty());
            // Three greedy steps on each: the same logits (the last layer's K/V and every
            // other layer's alike).
            let mut next = argmax(last_row);
            for step in 0..3 {
                let w = whole.eval(&[next], Logits::Last).unwrap().to_vec();
                assert!(last.eval(&[next], Logits::Last).unwrap() == &w[..], "{base:?} observe {observe}: step {step} after Last");
                assert!(none.eval(&[next], Logits::Last).unwrap() == &w[..], "{base:?} observe {observe}: step {step} after None");
                next = argmax(&w);
            }
            if observe {
                let (x, y, z) = (whole.attention.as_ref().unwrap(), last.attention.as_ref().unwrap(), none.attention.as_ref().unwrap());
                assert!(x.sum == y.sum && x.sum == z.sum && x.count == y.count && x.count == z.count, "{base:?}: attention observed alike");
            }
        }
    }
}

//! Model quality measures shared by the CLI and the tests, and what is chosen by them: Top-K
//! sparsity levels, calibrated by scoring each site's perplexity ([`calibrate_sparsity`]).
//! This module sits above the model and the sparsity thresholds it runs with.

use std::sync::Arc;

use crate::kv::KvFormat;
use crate::model::{AttentionStats, Logits, Model, ModelError, Session, SessionOptions};
use crate::pool::ThreadPool;
use crate::sparsity::{Calibrator, Sparsity, SITES};

/// Result of [`perplexity`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Perplexity {
    pub ppl: f64,
    /// Tokens whose probability was scored.
    pub scored: usize,
}

/// `-ln p(target)` under the softmax of one row of logits (log-sum-exp in f64).
fn neg_log_prob(row: &[f32], target: u32) -> f64 {
    neg_log_prob_lse(log_sum_exp(row), row, target)
}

/// [`neg_log_prob`] with the row's log-sum-exp already computed (the KL reuses it).
fn neg_log_prob_lse(lse: f64, row: &[f32], target: u32) -> f64 {
    lse - f64::from(row[target as usize])
}

/// The windows llama.cpp's perplexity scores: consecutive non-overlapping runs of `ctx`
/// tokens (at most `max_windows`, 0 = all), the first token replaced by BOS when the model
/// adds one.
fn windows(model: &Model, ids: &[u32], ctx: usize, max_windows: usize) -> Result<Vec<Vec<u32>>, ModelError> {
    let mut n = ids.len() / ctx.max(1);
    if max_windows > 0 {
        n = n.min(max_windows);
    }
    if ctx < 4 || n == 0 {
        return Err(ModelError::ContextFull { needed: ctx.max(4), capacity: ids.len() });
    }
    let tk = &model.tokenizer;
    Ok((0..n)
        .map(|w| {
            let mut win = ids[w * ctx..(w + 1) * ctx].to_vec();
            if let (true, Some(b)) = (tk.add_bos, tk.bos) {
                win[0] = b;
            }
            win
        })
        .collect())
}

/// Perplexity by llama.cpp's method: consecutive non-overlapping windows of `ctx` tokens (the
/// first replaced by BOS when the model adds one); in each window the logits at the positions
/// after the first half predict the next token. `max_windows` = 0 scores every whole window.
#[allow(clippy::cast_precision_loss)]
pub fn perplexity(
    model: &Arc<Model>,
    pool: Arc<ThreadPool>,
    ids: &[u32],
    ctx: usize,
    max_windows: usize,
) -> Result<Perplexity, ModelError> {
    perplexity_sparse(model, pool, ids, ctx, max_windows, None)
}

/// [`perplexity`] computed with Top-K activation sparsity (`None`: dense).
pub fn perplexity_sparse(
    model: &Arc<Model>,
    pool: Arc<ThreadPool>,
    ids: &[u32],
    ctx: usize,
    max_windows: usize,
    sparsity: Option<Arc<crate::sparsity::Sparsity>>,
) -> Result<Perplexity, ModelError> {
    let mut s = Session::new(Arc::clone(model), pool, ctx);
    s.set_sparsity(sparsity)?;
    score_windows(&mut s, ids, ctx, max_windows)
}

/// [`perplexity_sparse`], also counting how often each input channel is active over the
/// scored windows.
pub fn perplexity_channel_use(
    model: &Arc<Model>,
    pool: Arc<ThreadPool>,
    ids: &[u32],
    ctx: usize,
    max_windows: usize,
    sparsity: Option<Arc<crate::sparsity::Sparsity>>,
) -> Result<(Perplexity, crate::sparsity::ChannelUse), ModelError> {
    let mut s = Session::new(Arc::clone(model), pool, ctx);
    s.set_sparsity(sparsity)?;
    s.set_channel_use(Some(crate::sparsity::ChannelUse::new(&model.config)));
    let p = score_windows(&mut s, ids, ctx, max_windows)?;
    Ok((p, s.take_channel_use().expect("set above")))
}

/// llama.cpp's method over the session as configured: windows of `ctx`, the second half scored.
fn score_windows(s: &mut Session, ids: &[u32], ctx: usize, max_windows: usize) -> Result<Perplexity, ModelError> {
    let model = Arc::clone(&s.model);
    let wins = windows(&model, ids, ctx, max_windows)?;
    let vocab = model.config.vocab;
    let (mut nll, mut count) = (0.0f64, 0usize);
    for win in &wins {
        s.truncate(0);
        let logits = s.eval(win, Logits::All)?;
        for i in ctx / 2..ctx - 1 {
            nll += neg_log_prob(&logits[i * vocab..(i + 1) * vocab], win[i + 1]);
            count += 1;
        }
    }
    Ok(Perplexity { ppl: (nll / count as f64).exp(), scored: count })
}

/// How the KV cache is held while measuring quality: every chunk in one format, or the
/// tolerance-aware mix at a global ratio of int8 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvPlan {
    Uniform(KvFormat),
    /// Levels {int8, q4, q2} chosen by density rank for an average size of `ratio` x int8.
    Mix(f64),
}

impl KvPlan {
    pub fn parse(s: &str) -> Option<Self> {
        if let Some(r) = s.strip_prefix("mix:") {
            return r.parse().ok().filter(|r: &f64| *r > 0.0 && *r <= 1.0).map(Self::Mix);
        }
        KvFormat::parse(s).map(Self::Uniform)
    }
}

/// Picks the levels of a context's full chunks from their densities and the levels they hold
/// now (the memory manager's policy, `mm::levels`, passed in by tools: the engine knows none).
pub type LevelChooser = dyn Fn(&[f64], &[KvFormat]) -> Vec<KvFormat>;

/// How a measurement holds its KV cache: `plan`, chunks of `chunk_tokens`, and for the mix the
/// levels `choose` picks (the memory manager's policy, `mm::levels`, passed in by tools).
#[derive(Clone, Copy)]
pub struct KvRun<'a> {
    pub plan: KvPlan,
    pub chunk_tokens: usize,
    pub choose: &'a LevelChooser,
}

impl std::fmt::Debug for KvRun<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvRun").field("plan", &self.plan).field("chunk_tokens", &self.chunk_tokens).finish_non_exhaustive()
    }
}

/// Perplexity (llama.cpp's method, as [`perplexity`]) with the KV cache compressed as `run`'s
/// plan says: each window is fed one chunk at a time, and every full chunk is lowered to its
/// level before the next is computed, so later tokens attend to compressed chunks. For the mix,
/// densities come from the attention observer, `choose(densities, held)` picks the levels of
/// chunks that hold `held` now, and levels only ever go down. Returns the perplexity and the
/// average KV bytes of the full chunks relative to int8.
/// `top1`, when given, receives the most likely token at every scored position (to compare
/// plans' greedy choices).
#[allow(clippy::cast_precision_loss)]
pub fn perplexity_kv(
    model: &Arc<Model>,
    pool: Arc<ThreadPool>,
    ids: &[u32],
    ctx: usize,
    max_windows: usize,
    run: KvRun,
    mut top1: Option<&mut Vec<u32>>,
) -> Result<(Perplexity, f64), ModelError> {
    let wins = windows(model, ids, ctx, max_windows)?;
    let mut s = kv_session(model, pool, ctx, run);
    let (mut nll, mut count, mut bytes) = (0.0f64, 0usize, Bytes::default());
    for win in &wins {
        kv_window(&mut s, win, run, &mut |i, row| {
            nll += neg_log_prob(row, win[i + 1]);
            count += 1;
            if let Some(t) = top1.as_deref_mut() {
                t.push(crate::sampler::argmax(row));
            }
        })?;
        bytes.add(&s);
    }
    Ok((Perplexity { ppl: (nll / count as f64).exp(), scored: count }, bytes.ratio()))
}

/// What [`kl_kv`] measures: the plan's perplexity and the base level's (int8) on the same
/// windows, and the mean KL divergence of the plan's next-token distribution from int8's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvKl {
    pub ppl: Perplexity,
    pub int8: Perplexity,
    /// Mean over scored positions of KL(p_int8 || p_plan), in nats.
    pub kl: f64,
    /// Average KV bytes of the plan's full chunks relative to int8.
    pub bytes: f64,
}

/// [`perplexity_kv`] beside the int8 cache, window by window: the KL divergence of `plan`'s
/// next-token distributions from int8's (llama.cpp's `--kl-divergence`). It sees what a
/// perplexity difference on a few thousand tokens cannot: a perplexity difference is the mean
/// of a signed per-token change whose spread, not the levels, sets it at these sizes
/// (docs/kv.md), while KL is a mean of non-negative terms. Holds one window of int8
/// log-probabilities (scored positions x vocabulary) at a time.
#[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
pub fn kl_kv(
    model: &Arc<Model>,
    pool: Arc<ThreadPool>,
    ids: &[u32],
    ctx: usize,
    max_windows: usize,
    run: KvRun,
) -> Result<KvKl, ModelError> {
    let wins = windows(model, ids, ctx, max_windows)?;
    let base = KvRun { plan: KvPlan::Uniform(KvFormat::Int8), ..run };
    let mut sb = kv_session(model, Arc::clone(&pool), ctx, base);
    let mut s = kv_session(model, pool, ctx, run);
    let vocab = model.config.vocab;
    let mut logp = vec![0.0f32; (ctx - 1 - ctx / 2) * vocab];
    let (mut nll, mut nll_base, mut kl, mut count, mut bytes) = (0.0f64, 0.0f64, 0.0f64, 0usize, Bytes::default());
    for win in &wins {
        kv_window(&mut sb, win, base, &mut |i, row| {
            let lse = log_sum_exp(row);
            for (o, &v) in logp[(i - ctx / 2) * vocab..][..vocab].iter_mut().zip(row) {
                *o = (f64::from(v) - lse) as f32;
            }
            nll_base += neg_log_prob_lse(lse, row, win[i + 1]);
        })?;
        kv_window(&mut s, win, run, &mut |i, row| {
            let lse = log_sum_exp(row);
            nll += neg_log_prob_lse(lse, row, win[i + 1]);
            let p = &logp[(i - ctx / 2) * vocab..][..vocab];
            // Both log-probabilities rounded alike (int8's are kept as f32): equal rows give 0.
            kl += p
                .iter()
                .zip(row)
                .map(|(&lp, &v)| f64::from(lp).exp() * (f64::from(lp) - f64::from((f64::from(v) - lse) as f32)))
                .sum::<f64>();
            count += 1;
        })?;
        bytes.add(&s);
    }
    let n = count.max(1) as f64;
    Ok(KvKl {
        ppl: Perplexity { ppl: (nll / n).exp(), scored: count },
        int8: Perplexity { ppl: (nll_base / n).exp(), scored: count },
        kl: kl / n,
        bytes: bytes.ratio(),
    })
}

/// `ln sum exp(row)` in f64.
fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    row.iter().map(|&v| f64::from(v - max).exp()).sum::<f64>().ln() + f64::from(max)
}

/// A session of `capacity` positions holding its cache as `run` says (f16 for a uniform f16
/// plan, int8 otherwise; the attention observer on for the mix).
fn kv_session(model: &Arc<Model>, pool: Arc<ThreadPool>, capacity: usize, run: KvRun) -> Session {
    let base = match run.plan {
        KvPlan::Uniform(KvFormat::F16) => KvFormat::F16,
        _ => KvFormat::Int8,
    };
    let opts = SessionOptions {
        capacity,
        chunk_tokens: run.chunk_tokens,
        base,
        observe_attention: matches!(run.plan, KvPlan::Mix(_)),
        sliding_window: None,
    };
    Session::with_options(Arc::clone(model), pool, opts)
}

/// Runs one window through `s` a chunk at a time, lowering every full chunk as `plan` says
/// before the next is computed; `row(i, logits)` gets the logits at each scored position `i`
/// (the second half of the window, as llama.cpp scores it).
fn kv_window(s: &mut Session, win: &[u32], run: KvRun, row: &mut dyn FnMut(usize, &[f32])) -> Result<(), ModelError> {
    let (ctx, chunk_tokens) = (win.len(), run.chunk_tokens);
    let vocab = s.model.config.vocab;
    s.truncate(0);
    if let Some(a) = &mut s.attention {
        *a = AttentionStats::default();
    }
    for start in (0..ctx).step_by(chunk_tokens) {
        let end = (start + chunk_tokens).min(ctx);
        let logits = s.eval(&win[start..end], Logits::All)?.to_vec();
        for i in start.max(ctx / 2)..end.min(ctx - 1) {
            row(i, &logits[(i - start) * vocab..(i - start + 1) * vocab]);
        }
        lower(s, run, end / chunk_tokens)?;
    }
    Ok(())
}

/// The average size of full chunks over windows, relative to int8.
#[derive(Default)]
struct Bytes {
    sum: f64,
    n: usize,
}

impl Bytes {
    #[allow(clippy::cast_precision_loss)]
    fn add(&mut self, s: &Session) {
        let g = s.kv.geom;
        let int8 = g.chunk_bytes(KvFormat::Int8) as f64;
        for c in 0..s.kv.n_chunks().min(s.n_past() / g.chunk_tokens) {
            self.sum += g.chunk_bytes(s.kv.format(c)) as f64 / int8;
            self.n += 1;
        }
    }
    #[allow(clippy::cast_precision_loss)]
    fn ratio(&self) -> f64 {
        self.sum / self.n.max(1) as f64
    }
}

/// Lowers the first `full` chunks of `s` as `run` says (levels only go down).
fn lower(s: &mut Session, run: KvRun, full: usize) -> Result<(), ModelError> {
    let chunk_tokens = run.chunk_tokens;
    match run.plan {
        KvPlan::Uniform(f) => {
            for c in 0..full {
                s.kv.set_format(c, f)?;
            }
        }
        KvPlan::Mix(_) => {
            let a = s.attention.as_ref().expect("observer on for the mix");
            let d: Vec<f64> = (0..full).map(|c| a.density(c * chunk_tokens..(c + 1) * chunk_tokens)).collect();
            let held: Vec<KvFormat> = (0..full).map(|c| s.kv.format(c)).collect();
            let lv = (run.choose)(&d, &held);
            for (c, &l) in lv.iter().enumerate() {
                let cur = s.kv.format(c);
                // Only down: fewer bits than the chunk holds now.
                if l.mean_bits() < cur.mean_bits() {
                    s.kv.set_format(c, l)?;
                }
            }
        }
    }
    Ok(())
}

/// Free-running greedy generation with the KV cache compressed as `plan` says (as in
/// [`perplexity_kv`]: the prompt is fed a chunk at a time and every full chunk is lowered
/// before the next is computed; generated tokens fill chunks that are lowered in turn). For
/// each of up to `max_windows` windows of the text, the first `prompt` tokens are the prompt
/// and `gen` tokens are generated; returns the generated ids per window.
pub fn greedy_kv(
    model: &Arc<Model>,
    pool: Arc<ThreadPool>,
    ids: &[u32],
    prompt: usize,
    gen: usize,
    max_windows: usize,
    run: KvRun,
) -> Result<Vec<Vec<u32>>, ModelError> {
    let wins = windows(model, ids, prompt, max_windows)?;
    let chunk_tokens = run.chunk_tokens;
    let mut s = kv_session(model, pool, prompt + gen, run);
    let mut out = Vec::with_capacity(wins.len());
    for win in &wins {
        s.truncate(0);
        if let Some(a) = &mut s.attention {
            *a = AttentionStats::default();
        }
        let mut next = 0;
        for start in (0..prompt).step_by(chunk_tokens) {
            let end = (start + chunk_tokens).min(prompt);
            next = crate::sampler::argmax(s.eval(&win[start..end], Logits::Last)?);
            lower(&mut s, run, end / chunk_tokens)?;
        }
        let mut toks = Vec::with_capacity(gen);
        for _ in 0..gen {
            toks.push(next);
            next = crate::sampler::argmax(s.eval(&[next], Logits::Last)?);
            let n = s.n_past();
            if n.is_multiple_of(chunk_tokens) {
                lower(&mut s, run, n / chunk_tokens)?;
            }
        }
        out.push(toks);
    }
    Ok(out)
}

/// Levels tried per site when allocating.
const LEVELS: [f32; 7] = [0.0, 0.25, 0.4, 0.5, 0.6, 0.7, 0.85];
/// Tokens of calibration text: statistics, then one window to score each site's levels.
const CALIB_TOKENS: usize = 2048;
const CALIB_WINDOW: usize = 512;

/// Weights each site's input selects, per layer (Q+K+V, O, gate+up, down).
fn site_weights(c: &crate::loader::Config) -> [f64; SITES] {
    #[allow(clippy::cast_precision_loss)]
    let f = |x: usize| x as f64;
    [f(c.dim * (c.dim + 2 * c.kv_dim())), f(c.dim * c.dim), f(2 * c.dim * c.ffn_dim), f(c.ffn_dim * c.dim)]
}

/// Calibrates Top-K sparsity for `target` (0 <= target < 1: the share of weight bytes whose
/// input entry is zero) on `ids`. Sites differ in how much they tolerate, so, as TEAL
/// allocates sparsity across a block's projections, each site's level is chosen: every site
/// is scored alone at each of a grid of levels (the perplexity of a calibration window), and
/// the combination with the least summed loss whose byte-weighted average reaches `target`
/// is taken. Thresholds are the magnitude quantiles of each site's inputs over the text.
#[allow(clippy::cast_possible_truncation)]
pub fn calibrate_sparsity(model: &Arc<Model>, pool: Arc<ThreadPool>, ids: &[u32], target: f32) -> Result<Sparsity, ModelError> {
    if !(0.0..1.0).contains(&target) {
        return Err(ModelError::Metadata { key: "sparsity".into(), what: format!("{target} is not in [0, 1)") });
    }
    if ids.len() < CALIB_WINDOW {
        return Err(ModelError::Metadata {
            key: "sparsity".into(),
            what: format!("the calibration text has {} tokens; at least {CALIB_WINDOW} are needed", ids.len()),
        });
    }
    let ids = &ids[..ids.len().min(CALIB_TOKENS)];
    let mut s = Session::new(Arc::clone(model), Arc::clone(&pool), CALIB_WINDOW);
    s.calibrator = Some(Calibrator::new(model.config.n_layers));
    for win in ids.chunks(CALIB_WINDOW) {
        s.truncate(0);
        s.eval(win, Logits::None)?;
    }
    let cal = s.calibrator.take().expect("set above");
    if target == 0.0 {
        return Ok(cal.thresholds(0.0, [0.0; SITES]));
    }
    let score = |levels: [f32; SITES]| -> Result<f64, ModelError> {
        let sp = Arc::new(cal.thresholds(target, levels));
        Ok(perplexity_sparse(model, Arc::clone(&pool), &ids[..CALIB_WINDOW], CALIB_WINDOW, 1, Some(sp))?.ppl.ln())
    };
    let base = score([0.0; SITES])?;
    // loss[site][level]: the calibration window's log-perplexity increase with only that site
    // sparse at that level.
    let mut loss = [[0.0f64; LEVELS.len()]; SITES];
    for (site, row) in loss.iter_mut().enumerate() {
        for (li, &l) in LEVELS.iter().enumerate().skip(1) {
            let mut levels = [0.0; SITES];
            levels[site] = l;
            row[li] = (score(levels)? - base).max(0.0);
        }
    }
    let w = site_weights(&model.config);
    let total: f64 = w.iter().sum();
    let mut best: Option<(f64, [usize; SITES])> = None;
    let n = LEVELS.len();
    for code in 0..n.pow(SITES as u32) {
        let pick: [usize; SITES] = std::array::from_fn(|i| code / n.pow(i as u32) % n);
        let avg: f64 = pick.iter().zip(&w).map(|(&p, &wt)| f64::from(LEVELS[p]) * wt).sum::<f64>() / total;
        if avg + 1e-9 < f64::from(target) {
            continue;
        }
        let l: f64 = pick.iter().enumerate().map(|(s, &p)| loss[s][p]).sum();
        if best.is_none_or(|(b, _)| l < b) {
            best = Some((l, pick));
        }
    }
    let levels = match best {
        Some((_, pick)) => pick.map(|p| LEVELS[p]),
        // Above what the grid reaches: every site at the target.
        None => [target; SITES],
    };
    Ok(cal.thresholds(target, levels))
}

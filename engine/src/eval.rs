//! Model quality measures shared by the CLI and the tests.

use std::sync::Arc;

use crate::model::{Logits, Model, ModelError, Session};
use crate::pool::ThreadPool;

/// Result of [`perplexity`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Perplexity {
    pub ppl: f64,
    /// Tokens whose probability was scored.
    pub scored: usize,
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
    let mut n = ids.len() / ctx.max(1);
    if max_windows > 0 {
        n = n.min(max_windows);
    }
    if ctx < 4 || n == 0 {
        return Err(ModelError::ContextFull { needed: ctx.max(4), capacity: ids.len() });
    }
    let tk = &model.tokenizer;
    let vocab = model.config.vocab;
    let mut s = Session::new(Arc::clone(model), pool, ctx);
    let (mut nll, mut count) = (0.0f64, 0usize);
    for w in 0..n {
        let mut win = ids[w * ctx..(w + 1) * ctx].to_vec();
        if let (true, Some(b)) = (tk.add_bos, tk.bos) {
            win[0] = b;
        }
        s.truncate(0);
        let logits = s.eval(&win, Logits::All)?;
        for i in ctx / 2..ctx - 1 {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let lse = row.iter().map(|&v| f64::from(v - max).exp()).sum::<f64>().ln() + f64::from(max);
            nll += lse - f64::from(row[win[i + 1] as usize]);
            count += 1;
        }
    }
    Ok(Perplexity { ppl: (nll / count as f64).exp(), scored: count })
}

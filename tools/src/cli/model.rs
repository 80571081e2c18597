//! Commands over the model alone: tokenize, logits, generate, chat, perplexity, bench.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use ::engine::chat::Message;
use ::engine::{Logits, Model, Sampler, SamplerConfig, Session, ThreadPool, Utf8Stream};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;

use super::*;

/// `llms tokenize`.
#[derive(Args, Debug)]
pub struct TokenizeArgs {
    #[arg(long)]
    pub text_file: PathBuf,
    /// Do not parse special tokens such as <|im_start|> written in the text.
    #[arg(long)]
    pub no_special: bool,
    #[command(flatten)]
    pub m: ModelArgs,
}

impl TokenizeArgs {
    pub fn run(self) -> Result<()> {
        let Self { text_file, no_special, m } = self;
        let tk = load_tokenizer(&m)?;
        let ids = tk.encode(&read_text(&text_file)?, tk.add_bos, !no_special)?;
        println!("{}", serde_json::to_string(&ids)?);
        Ok(())
    }
}

/// `llms logits`.
#[derive(Args, Debug)]
pub struct LogitsArgs {
    #[arg(long)]
    pub prompt_file: PathBuf,
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// The highest logits at every position (`"positions": [[..], ..]`), not only the last:
    /// what a comparison against a reference over a whole text needs.
    #[arg(long)]
    pub all_positions: bool,
    #[command(flatten)]
    pub m: ModelArgs,
}

impl LogitsArgs {
    pub fn run(self) -> Result<()> {
        let Self { prompt_file, top, all_positions, m } = self;
        let (model, pool, sp) = load_sparse(&m)?;
        let ids = encode(&model, &read_text(&prompt_file)?, true)?;
        if ids.is_empty() {
            bail!("the prompt has no tokens");
        }
        let mut s = Session::new(Arc::clone(&model), pool, ids.len());
        s.set_sparsity(sp)?;
        let highest = |logits: &[f32]| {
            let mut idx: Vec<usize> = (0..logits.len()).collect();
            idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            idx.iter().take(top).map(|&i| json!({"id": i, "logit": logits[i]})).collect::<Vec<_>>()
        };
        if all_positions {
            let logits = s.eval(&ids, Logits::All)?;
            let positions: Vec<_> = logits.chunks_exact(model.config.vocab).map(highest).collect();
            println!("{}", json!({"tokens": ids, "positions": positions}));
        } else {
            println!("{}", json!({"tokens": ids, "top": highest(s.eval(&ids, Logits::Last)?)}));
        }
        Ok(())
    }
}

/// `llms generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[arg(long, conflicts_with = "prompt")]
    pub prompt_file: Option<PathBuf>,
    #[arg(long)]
    pub prompt: Option<String>,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Wrap the prompt in the model's chat template as one user message.
    #[arg(long)]
    pub chat: bool,
    /// Print {"tokens":[...],"text":"..."} at the end instead of streaming.
    #[arg(long)]
    pub json: bool,
    /// Print prefill and decode speed to stderr.
    #[arg(long)]
    pub stats: bool,
    #[command(flatten)]
    pub m: ModelArgs,
}

impl GenerateArgs {
    pub fn run(self) -> Result<()> {
        let Self { prompt_file, prompt, max_tokens, temperature, top_k, top_p, seed, chat, json, stats, m } = self;
        let text = match (prompt_file, prompt) {
            (Some(f), None) => read_text(&f)?,
            (None, Some(p)) => p,
            _ => bail!("give exactly one of --prompt-file and --prompt"),
        };
        let (model, pool, sp) = load_sparse(&m)?;
        let text = if chat { render_chat(&model, &[Message::new("user", &text)])? } else { text };
        let ids = encode(&model, &text, true)?;
        let cfg = SamplerConfig { temperature, top_k, top_p, seed };
        let mut out = std::io::stdout().lock();
        let mut sink = |piece: &str| -> Result<()> {
            if !json {
                out.write_all(piece.as_bytes())?;
                out.flush()?;
            }
            Ok(())
        };
        let r = generate(&model, pool, sp, &ids, max_tokens, cfg, &mut sink)?;
        if json {
            println!("{}", json!({"tokens": r.tokens, "text": r.text}));
        } else {
            println!();
        }
        if stats {
            eprintln!("{}", r.speed_line());
            if let Some(l) = weights_line(ids.len() + r.tokens.len()) {
                eprintln!("{l}");
            }
            eprintln!(
                "memory: model file {:.1} MiB, KV cache {:.1} MiB, resident now {} (peak {})",
                mib(model.file_bytes()),
                mib(r.kv_bytes),
                proc_status_kib("VmRSS").map_or("?".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0)),
                proc_status_kib("VmHWM").map_or("?".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0)),
            );
        }
        Ok(())
    }
}

/// `llms chat`.
#[derive(Args, Debug)]
pub struct ChatArgs {
    /// Chat in this llmsd context ("new" creates one and prints its id).
    #[arg(long)]
    pub ctx: Option<String>,
    #[command(flatten)]
    pub d: DaemonArgs,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub m: ModelArgs,
}

impl ChatArgs {
    pub fn run(self) -> Result<()> {
        let Self { ctx, d, max_tokens, temperature, seed, system, m } = self;
        match ctx {
            Some(ctx) => super::service::chat_daemon(&d, &ctx, max_tokens, temperature, seed, system),
            None => chat_loop(&m, max_tokens, temperature, seed, system),
        }
    }
}

/// `llms perplexity`.
#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[arg(long)]
    pub text_file: PathBuf,
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Score at most this many windows (0 = all).
    #[arg(long, default_value_t = 0)]
    pub chunks: usize,
    /// KV cache while scoring: f16 (default), int8, q4, q2, q4r, q2r, k4v4, k3v3, k2v2, k4v3,
    /// mix:R (tolerance-aware levels at R x int8 bytes; docs/kv.md). With --kv, windows are fed
    /// one KV chunk at a time.
    #[arg(long)]
    pub kv: Option<String>,
    /// Tokens per KV chunk (with --kv).
    #[arg(long, default_value_t = llmsd::config::DEFAULT_CHUNK_TOKENS)]
    pub chunk_tokens: usize,
    /// The levels a mix chooses from, the base first (with --kv mix:R), the service's unless told.
    #[arg(long, value_delimiter = ',', default_values_t = super::strings(&llmsd::config::DEFAULT_LEVELS))]
    pub kv_levels: Vec<String>,
    /// With --kv: also run the int8 cache on the same windows and report the mean KL
    /// divergence of --kv's next-token distributions from int8's (nats per scored token) and
    /// int8's perplexity. It resolves levels whose perplexities differ by less than a run of a
    /// few thousand tokens does (docs/kv.md). Twice the time.
    #[arg(long)]
    pub kl: bool,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub m: ModelArgs,
}

impl PerplexityArgs {
    pub fn run(self) -> Result<()> {
        let Self { text_file, ctx, chunks, kv, chunk_tokens, kv_levels, kl, json, m } = self;
        if kl && kv.is_none() {
            bail!("--kl compares a --kv plan with int8: give --kv");
        }
        let levels: Vec<::engine::kv::KvFormat> = kv_levels
            .iter()
            .map(|l| ::engine::kv::KvFormat::parse(l).with_context(|| format!("--kv-levels: {l:?} is not a KV format")))
            .collect::<Result<_>>()?;
        if levels.first() != Some(&::engine::kv::KvFormat::Int8) {
            bail!("--kv-levels: the base level int8 comes first");
        }
        llmsd::config::check_level_count(&levels).context("--kv-levels")?;
        let (model, pool, sp) = load_sparse(&m)?;
        if ctx < 8 || ctx > model.config.ctx_len {
            bail!("--ctx must be between 8 and the model's context length {}", model.config.ctx_len);
        }
        let ids = model.tokenizer.encode(&read_text(&text_file)?, false, false)?;
        if ids.len() < ctx {
            bail!("the text has {} tokens, fewer than one window of {ctx}", ids.len());
        }
        if sp.is_some() && kv.is_some() {
            bail!("--sparsity and --kv: one at a time");
        }
        if let (Some(sp), false) = (&sp, json) {
            println!("sparsity {}: per-site levels {}", sp.target, sp.describe());
        }
        let mut uses = None;
        let mut vs_int8 = None;
        let (r, ratio) = match kv {
            None if sp.is_some() => {
                let (r, u) = ::engine::eval::perplexity_channel_use(&model, pool, &ids, ctx, chunks, sp)?;
                uses = Some(u);
                (r, None)
            }
            None => (::engine::eval::perplexity(&model, pool, &ids, ctx, chunks)?, None),
            Some(k) => {
                let plan = ::engine::eval::KvPlan::parse(&k).with_context(|| {
                    format!("--kv {k:?}: expected a format (f16, int8, q4, q2, q4r, q2r, k4v4, k3v3, k2v2, k4v3) or mix:R with 0 < R <= 1")
                })?;
                if chunk_tokens == 0 || chunk_tokens > ctx {
                    bail!("--chunk-tokens must be between 1 and --ctx");
                }
                // The mix's levels are mm's policy (eq. 2-3), over --kv-levels.
                let ratio = if let ::engine::eval::KvPlan::Mix(r) = plan { r } else { 1.0 };
                let choose = llmsd::kvmm::mix_chooser(&model, chunk_tokens, ratio, &levels);
                let run = ::engine::eval::KvRun { plan, chunk_tokens, choose: &choose };
                if kl {
                    let k = ::engine::eval::kl_kv(&model, pool, &ids, ctx, chunks, run)?;
                    vs_int8 = Some((k.kl, k.int8.ppl));
                    (k.ppl, Some(k.bytes))
                } else {
                    let (r, ratio) = ::engine::eval::perplexity_kv(&model, pool, &ids, ctx, chunks, run, None)?;
                    (r, Some(ratio))
                }
            }
        };
        // What a per-channel hot cache could serve: the most used channels' columns kept
        // (ranked over this run), as shares of the layers' weight bytes.
        const CACHE_SHARES: [f64; 4] = [0.1, 0.25, 0.5, 0.75];
        let cache = uses.map(|u| (u.read_share(), CACHE_SHARES.map(|c| u.hit_rate(c))));
        if json {
            let mut v = json!({"ppl": r.ppl, "scored": r.scored});
            if let Some(x) = ratio {
                v["kv_bytes_vs_int8"] = json!(x);
            }
            if let Some((kl, p)) = vs_int8 {
                v["kl_vs_int8"] = json!(kl);
                v["int8_ppl"] = json!(p);
            }
            if let Some((read, hits)) = cache {
                v["layer_bytes_read_share"] = json!(read);
                v["hot_cache_hit_rate"] = CACHE_SHARES.iter().zip(hits).map(|(c, h)| (format!("{c}"), json!(h))).collect();
            }
            println!("{v}");
        } else {
            println!("perplexity {:.4} over {} scored tokens (ctx {ctx})", r.ppl, r.scored);
            if let Some(x) = ratio {
                println!("KV bytes of full chunks: {:.3} x int8", x);
            }
            if let Some((kl, p)) = vs_int8 {
                println!(
                    "vs int8 on the same windows: perplexity {p:.4} ({:+.2}%), KL divergence {kl:.5} nats/token",
                    100.0 * (r.ppl / p - 1.0)
                );
            }
            if let Some((read, hits)) = cache {
                let hits: Vec<String> =
                    CACHE_SHARES.iter().zip(hits).map(|(c, h)| format!("{:.0}%: {:.1}%", 100.0 * c, 100.0 * h)).collect();
                println!("layer weight bytes read per token: {:.1}%; a hot-channel cache of the most used columns (share of layer bytes: share of reads served) {}", 100.0 * read, hits.join(", "));
            }
        }
        Ok(())
    }
}

/// `llms bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// KV cache format: f16 or int8; a lower level (q4, q2, q4r, q2r, k4v4, k3v3, k2v2, k4v3):
    /// written as int8, the depth's full chunks then lowered (the attention cost of a
    /// compressed context). Several, comma-separated, are timed side by side (pp runs one after
    /// another, tg interleaved token by token) and compared with the first by the median of
    /// their paired ratios.
    #[arg(long, default_value = "f16", value_delimiter = ',')]
    pub kv: Vec<String>,
    /// Context depth: pp and tg run after a prefilled context of this many tokens (like
    /// llama-bench -d).
    #[arg(short = 'd', long, default_value_t = 0)]
    pub depth: usize,
    #[arg(long, default_value_t = 512)]
    pub pp: usize,
    #[arg(long, default_value_t = 128)]
    pub tg: usize,
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// After the timed runs, one more pp and tg run with the thread pool's statistics on: per
    /// parallel operation, calls per token, tasks per call, time per call, the threads'
    /// utilization and the imbalance of their work (docs/engine.md "Threads").
    #[arg(long)]
    pub pool_report: bool,
    /// Also measure the memory floor of decoding in the same run: a streaming read, by the
    /// pool's threads, of a buffer the size of the weights one token reads, right before and
    /// after each repetition's tg run; tg is reported as a share of the floor's tokens/s
    /// (bandwidth / bytes), the median of the repetitions' own ratios.
    #[arg(long)]
    pub floor: bool,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub m: ModelArgs,
}

impl BenchArgs {
    pub fn run(self) -> Result<()> {
        let Self { kv, depth, pp, tg, reps, pool_report, floor, json, m } = self;
        bench(&m, &kv, depth, pp, tg, reps, pool_report, floor, json)?;
        Ok(())
    }
}

/// The pool's statistics for one run of `tokens` tokens, as a table and as JSON.
#[allow(clippy::cast_precision_loss)]
pub(crate) fn pool_report(what: &str, tokens: usize, ops: &[::engine::pool::OpProfile], wall_s: f64) -> (String, serde_json::Value) {
    use std::fmt::Write as _;
    let threads = ops.first().map_or(1, |o| o.threads);
    let in_ops: f64 = ops.iter().map(|o| o.wall.as_secs_f64()).sum();
    let busy: f64 = ops.iter().map(|o| o.busy.as_secs_f64()).sum();
    let rows: Vec<serde_json::Value> = ops
        .iter()
        .map(|o| {
            json!({"op": o.name, "calls_per_token": o.calls as f64 / tokens as f64, "tasks_per_call": o.tasks as f64 / o.calls as f64,
                   "us_per_call": o.wall.as_secs_f64() * 1e6 / o.calls as f64, "share_of_time": o.wall.as_secs_f64() / wall_s,
                   "utilization": o.utilization(), "imbalance": o.imbalance()})
        })
        .collect();
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{what}: {threads} threads; parallel operations {:.0}% of the time, threads busy {:.0}% of it",
        100.0 * in_ops / wall_s,
        100.0 * busy / (in_ops * threads as f64).max(f64::MIN_POSITIVE)
    );
    let _ = writeln!(
        t,
        "  {:<24}{:>10}{:>10}{:>10}{:>8}{:>8}{:>10}",
        "operation", "calls/tok", "tasks", "us/call", "time", "busy", "imbalance"
    );
    for (o, r) in ops.iter().zip(&rows) {
        let _ = writeln!(
            t,
            "  {:<24}{:>10.1}{:>10.1}{:>10.1}{:>7.0}%{:>7.0}%{:>10.2}",
            o.name,
            r["calls_per_token"].as_f64().unwrap_or(0.0),
            r["tasks_per_call"].as_f64().unwrap_or(0.0),
            r["us_per_call"].as_f64().unwrap_or(0.0),
            100.0 * r["share_of_time"].as_f64().unwrap_or(0.0),
            100.0 * o.utilization(),
            o.imbalance()
        );
    }
    (t, json!({"threads": threads, "tokens": tokens, "seconds": wall_s, "in_operations_share": in_ops / wall_s, "ops": rows}))
}

struct GenResult {
    kv_bytes: usize,
    tokens: Vec<u32>,
    text: String,
    prompt_tokens: usize,
    prefill_s: f64,
    decode_s: f64,
}

impl GenResult {
    #[allow(clippy::cast_precision_loss)]
    fn speed_line(&self) -> String {
        let n_dec = self.tokens.len().saturating_sub(1);
        format!(
            "prefill: {} tokens in {:.3} s ({:.1} tok/s); decode: {} tokens in {:.3} s ({:.1} tok/s)",
            self.prompt_tokens,
            self.prefill_s,
            self.prompt_tokens as f64 / self.prefill_s.max(1e-9),
            n_dec,
            self.decode_s,
            n_dec as f64 / self.decode_s.max(1e-9)
        )
    }
}

/// Prefills `ids`, then samples up to `max_tokens`, handing each decoded piece to `sink`.
/// Stops at end-of-generation tokens (not included in the result).
fn generate(
    model: &Arc<Model>,
    pool: Arc<ThreadPool>,
    sparsity: Sparsity,
    ids: &[u32],
    max_tokens: usize,
    cfg: SamplerConfig,
    sink: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<GenResult> {
    if ids.is_empty() {
        bail!("the prompt has no tokens");
    }
    let cap = (ids.len() + max_tokens).min(model.config.ctx_len);
    if ids.len() >= cap {
        bail!("the prompt ({} tokens) does not fit the model's context of {}", ids.len(), model.config.ctx_len);
    }
    let mut s = Session::new(Arc::clone(model), pool, cap);
    s.set_sparsity(sparsity)?;
    let mut sampler = Sampler::new(cfg);
    let mut utf8 = Utf8Stream::default();
    let t0 = Instant::now();
    let mut next = sampler.sample(s.eval(ids, Logits::Last)?);
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut tokens = Vec::new();
    let mut text = String::new();
    while tokens.len() < max_tokens && !model.tokenizer.is_eog(next) {
        tokens.push(next);
        let mut bytes = Vec::new();
        model.tokenizer.token_bytes(next, false, &mut bytes);
        let piece = utf8.push(&bytes);
        text.push_str(&piece);
        sink(&piece)?;
        if tokens.len() == max_tokens || s.n_past() >= s.capacity() {
            break;
        }
        next = sampler.sample(s.eval(&[next], Logits::Last)?);
    }
    let tail = utf8.finish();
    text.push_str(&tail);
    sink(&tail)?;
    Ok(GenResult { kv_bytes: s.kv.bytes(), tokens, text, prompt_tokens: ids.len(), prefill_s, decode_s: t1.elapsed().as_secs_f64() })
}

fn chat_loop(m: &ModelArgs, max_tokens: usize, temperature: f32, seed: u64, system: Option<String>) -> Result<()> {
    let (model, pool, sp) = load_sparse(m)?;
    let mut msgs = Vec::new();
    if let Some(s) = system {
        msgs.push(Message::new("system", &s));
    }
    chat_turns(&mut |line| {
        msgs.push(Message::new("user", line));
        let mut ids = encode(&model, &render_chat(&model, &msgs)?, true)?;
        // A long conversation forgets its oldest turns (never the system prompt or the new
        // message) rather than failing once it outgrows the model's context.
        let first = usize::from(msgs.first().is_some_and(|m| m.role == "system"));
        while ids.len() + max_tokens > model.config.ctx_len && msgs.len() > first + 1 {
            msgs.remove(first);
            ids = encode(&model, &render_chat(&model, &msgs)?, true)?;
        }
        let mut out = std::io::stdout().lock();
        let cfg = SamplerConfig { temperature, seed, ..SamplerConfig::default() };
        let r = generate(&model, Arc::clone(&pool), sp.clone(), &ids, max_tokens, cfg, &mut |p| {
            out.write_all(p.as_bytes())?;
            out.flush()?;
            Ok(())
        })?;
        println!();
        eprintln!("[{}]", r.speed_line());
        msgs.push(Message::new("assistant", &r.text));
        Ok(())
    })
}

/// One timed run of `llms bench` on a session at its level, the pool's statistics on or off.
type RunOnce<'a> = dyn Fn(&mut Session, Option<::engine::kv::KvFormat>, bool) -> Result<f64> + 'a;

#[allow(clippy::cast_precision_loss, clippy::too_many_lines, clippy::too_many_arguments)]
fn bench(
    m: &ModelArgs,
    kvs: &[String],
    depth: usize,
    pp: usize,
    tg: usize,
    reps: usize,
    pool_stats: bool,
    floor: bool,
    json: bool,
) -> Result<()> {
    use ::engine::kv::KvFormat;
    let (model, pool, sp) = load_sparse(m)?;
    // The floor's buffer: as many bytes as a decoded token reads, filled (so its pages exist),
    // in memory like the resident weights' (engine::arena: on huge pages where the kernel
    // gives them; read from 4 KiB pages, the same bytes came ~1/3 slower in a VM).
    let floor_arena = if floor {
        let words = usize::try_from(model.decode_bytes() / 8).context("weight bytes")?;
        let mut b = ::engine::arena::ArenaBuilder::new(words * 8).context("the floor's buffer")?;
        for (i, w) in b.space_mut().chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&(i as u64).to_le_bytes());
        }
        Some(b.finish().context("the floor's buffer")?)
    } else {
        None
    };
    let floor_buf: &[u64] = floor_arena.as_ref().map_or(&[], |a| bytemuck::cast_slice(a.bytes()));
    // Each repetition's tg is held to reads right before and after it (the better of the two):
    // this shared host's memory speed moves between minutes (1.7B Q4_0: reads of 42-45 GB/s
    // in one run and 63-66 in the next, the decode at 0.93 of them in both), and a floor read
    // before and after all the runs had put decode above 1.1 of it in one row of
    // tools/bench/sizes and below 0.85 in the next. A read after the decode alone caught a
    // slower second than the decode's eight (7B: one repetition at 1.21).
    let mut floor_reads = Vec::new();
    if pp == 0 || tg == 0 || reps == 0 || depth + pp.max(tg) > model.config.ctx_len {
        bail!("--pp, --tg and --reps must be positive and depth + pp (and depth + tg) within the context");
    }
    if kvs.is_empty() || kvs.len() > 8 {
        bail!("--kv: one to eight formats");
    }
    let formats: Vec<(KvFormat, Option<KvFormat>)> = kvs
        .iter()
        .map(|kv| match KvFormat::parse(kv) {
            Some(f) if f.is_base() => Ok((f, None)),
            Some(f) => Ok((KvFormat::Int8, Some(f))),
            None => bail!("--kv {kv:?}: expected f16, int8, q4, q2, q4r, q2r, k4v4, k3v3, k2v2 or k4v3 (or several, comma-separated)"),
        })
        .collect::<Result<_>>()?;
    // Token ids as llama-bench uses: arbitrary valid ids, here a fixed pseudo-random sequence.
    let vocab = u32::try_from(model.config.vocab).context("vocab")?;
    let prompt: Vec<u32> = (0..u32::try_from(depth + pp.max(tg))?).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) % vocab).collect();
    let mut sessions = Vec::with_capacity(formats.len());
    for &(base, _) in &formats {
        let opts = ::engine::model::SessionOptions { base, ..::engine::model::SessionOptions::new(depth + pp.max(tg)) };
        let mut s = Session::with_options(Arc::clone(&model), Arc::clone(&pool), opts);
        s.set_sparsity(sp.clone())?;
        sessions.push(s);
    }
    // Both runs start from `depth` tokens of context (0: an empty one, as llama-bench's
    // pp512/tg128), its full chunks lowered to the --kv level when that is a reduced one.
    let at_depth = |s: &mut Session, lower: Option<KvFormat>| -> Result<()> {
        s.truncate(0);
        if depth > 0 {
            s.eval(&prompt[..depth], Logits::None)?;
        }
        if let Some(f) = lower {
            for i in 0..depth / s.kv.geom.chunk_tokens {
                s.kv.set_format(i, f)?;
            }
        }
        Ok(())
    };
    // `profile`: the pool's statistics on for the timed part only (not the context's prefill).
    let profiled = |profile: bool, timed: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        if profile {
            pool.take_profile();
            pool.set_profiling(true);
        }
        let t = Instant::now();
        let r = timed();
        let secs = t.elapsed().as_secs_f64();
        pool.set_profiling(false);
        r.map(|()| secs)
    };
    let run_pp = |s: &mut Session, lower: Option<KvFormat>, profile: bool| -> Result<f64> {
        at_depth(s, lower)?;
        profiled(profile, &mut || s.eval(&prompt[depth..depth + pp], Logits::Last).map(|_| ()).map_err(Into::into))
    };
    let run_tg = |s: &mut Session, lower: Option<KvFormat>, profile: bool| -> Result<f64> {
        at_depth(s, lower)?;
        let mut tok = prompt[depth];
        profiled(profile, &mut || {
            for _ in 0..tg {
                tok = ::engine::sampler::argmax(s.eval(&[tok], Logits::Last)?);
            }
            Ok(())
        })
    };
    // Several formats are timed side by side: every session is brought to its depth first
    // (untimed), then the pp runs follow one another and the tg runs are interleaved token by
    // token, the order rotated, so a drift of this shared machine's speed falls on all alike
    // (with each format's run whole, a neighbour's load could land on one format's minute and
    // not the next: paired 4k ratios of one build ranged 0.87-1.28x). Each one's rates are then
    // compared with the first's of the same repetition (paired ratios).
    let k = formats.len();
    let (mut pp_rates, mut tg_rates) = (vec![Vec::new(); k], vec![Vec::new(); k]);
    for rep in 0..=reps {
        // The context at depth is made once (its prefill dwarfs a short prompt's pass); each
        // repetition cuts back to it, so every rep times the same steady-state passes.
        for (s, f) in sessions.iter_mut().zip(&formats) {
            if rep == 0 {
                at_depth(s, f.1)?;
            } else {
                s.truncate(depth);
            }
        }
        let mut pp_s = vec![0.0; k];
        for j in 0..k {
            let i = (j + rep) % k;
            pp_s[i] = profiled(false, &mut || sessions[i].eval(&prompt[depth..depth + pp], Logits::Last).map(|_| ()).map_err(Into::into))?;
            sessions[i].truncate(depth);
        }
        let before = if floor && rep > 0 { ::engine::kernels::floor_read(&pool, floor_buf, 3) } else { 0.0 };
        let (mut tok, mut tg_s) = (vec![prompt[depth]; k], vec![0.0; k]);
        for step in 0..tg {
            for j in 0..k {
                let i = (j + step + rep) % k;
                let t = Instant::now();
                tok[i] = ::engine::sampler::argmax(sessions[i].eval(&[tok[i]], Logits::Last)?);
                tg_s[i] += t.elapsed().as_secs_f64();
            }
        }
        if rep > 0 {
            // rep 0 is the warm-up.
            for i in 0..k {
                pp_rates[i].push(pp as f64 / pp_s[i]);
                tg_rates[i].push(tg as f64 / tg_s[i]);
            }
            if floor {
                floor_reads.push(before.max(::engine::kernels::floor_read(&pool, floor_buf, 3)));
            }
        }
    }
    let med = llmsd::stats::median;
    // tg's share of each repetition's floor (its read over the bytes a token reads), paired as
    // the formats' ratios are, and the median of those.
    #[allow(clippy::cast_precision_loss)]
    let bytes = model.decode_bytes() as f64;
    let vs_floor = |i: usize| med(tg_rates[i].iter().zip(&floor_reads).map(|(t, bw)| t * bytes / bw).collect());
    let floor_bw = med(floor_reads.clone());
    let floor_tok_s = floor_bw / bytes;
    let paired = |rates: &[Vec<f64>], i: usize| med(rates[i].iter().zip(&rates[0]).map(|(a, b)| a / b).collect());
    // The pool's statistics come from runs of their own, so the timed ones carry no probes.
    let (mut pool_text, mut pool_json) = (String::new(), serde_json::Value::Null);
    if pool_stats {
        let lower = formats[0].1;
        let mut report = |what: &str, tokens: usize, run: &RunOnce| -> Result<serde_json::Value> {
            let secs = run(&mut sessions[0], lower, true)?;
            let (text, v) = pool_report(what, tokens, &pool.take_profile(), secs);
            pool_text.push_str(&text);
            Ok(v)
        };
        pool_json = json!({"pp": report(&format!("pp{pp}"), pp, &run_pp)?, "tg": report(&format!("tg{tg}"), tg, &run_tg)?});
    }
    let format_name = if m.weights == Some(super::WeightsMode::Mmap) {
        "mmap"
    } else if model.uses_image() {
        "paged"
    } else if model.is_channel_major() {
        "channel-major"
    } else {
        "packed"
    };
    let name = |i: usize| formats[i].1.unwrap_or(formats[i].0).name();
    let ahead = ::engine::kernels::ahead::report();
    let huge = model.huge_page_share();
    if json {
        let rows: Vec<serde_json::Value> = (0..k)
            .map(|i| {
                let mut v = json!({"model": model_path(m), "pp": pp, "tg": tg, "depth": depth, "kv": name(i), "threads": pool.threads(), "simd": ::engine::kernels::simd_name(), "weight_format": format_name, "huge_page_share": huge.map(|(_, s)| s), "sparsity": m.sparsity, format!("pp{pp}_tok_s"): med(pp_rates[i].clone()), format!("tg{tg}_tok_s"): med(tg_rates[i].clone())});
                if floor {
                    v["floor"] = json!({"read_gb_s": floor_bw / 1e9, "decode_bytes": model.decode_bytes(), "tg_tok_s": floor_tok_s,
                                        "tg_vs_floor": vs_floor(i), "reps_read_gb_s": floor_reads.iter().map(|b| b / 1e9).collect::<Vec<_>>()});
                }
                if i == 0 {
                    v["pool"] = pool_json.clone();
                    v["prefetch"] = json!({"bytes": ahead.bytes, "tuning_rounds": ahead.rounds, "fixed": ahead.fixed});
                } else {
                    v["vs"] = json!({"kv": name(0), "pp": paired(&pp_rates, i), "tg": paired(&tg_rates, i)});
                }
                v
            })
            .collect();
        // One format: its object, as before; several: one object each, in --kv's order.
        println!("{}", if k == 1 { rows[0].clone() } else { serde_json::Value::from(rows) });
    } else {
        let kv_names: Vec<&str> = (0..k).map(name).collect();
        println!(
            "model {} | threads {} | kernels {} | kv {} | depth {depth} | weights {format_name}{}{}",
            model.file.path.display(),
            pool.threads(),
            ::engine::kernels::simd_name(),
            kv_names.join(","),
            huge.map_or(String::new(), |(_, s)| if ::engine::arena::huge_pages_wanted() {
                format!(" ({:.0}% on huge pages)", 100.0 * s)
            } else {
                " (huge pages off: LLMS_HUGE_PAGES)".to_string()
            }),
            m.sparsity.map_or(String::new(), |s| format!(" | sparsity {s}"))
        );
        for i in 0..k {
            let (ppr, tgr) = (med(pp_rates[i].clone()), med(tg_rates[i].clone()));
            let label = if k == 1 { String::new() } else { format!("{}: ", name(i)) };
            print!("{label}pp{pp}: {ppr:.1} tok/s, tg{tg}: {tgr:.1} tok/s (medians of {reps})");
            if i > 0 {
                print!(
                    "; vs {}: pp {:.3}x, tg {:.3}x (median of the {reps} paired ratios)",
                    name(0),
                    paired(&pp_rates, i),
                    paired(&tg_rates, i)
                );
            }
            println!();
        }
        if floor {
            let mb = bytes / 1e6;
            println!(
                "memory floor: {:.1} GB/s streaming read ({} threads) over the {mb:.0} MB a token reads: {floor_tok_s:.1} tok/s; tg{tg} at {:.2} of it (medians of {reps}, each repetition against its own read)",
                floor_bw / 1e9,
                pool.threads(),
                vs_floor(0)
            );
        }
        let how = if ahead.fixed { "fixed by LLMS_PREFETCH_AHEAD".to_string() } else { format!("tuned, {} rounds", ahead.rounds) };
        match ahead.bytes {
            0 => println!("prefetch distance: none, the hardware prefetchers alone ({how})"),
            b => println!("prefetch distance: {b} bytes ({how})"),
        }
        print!("{pool_text}");
    }
    Ok(())
}

/// `llms synth`.
#[derive(Args, Debug)]
pub struct SynthArgs {
    /// The shape to start from (smollm2-135m, smollm2-1.7b, qwen2-1.5b, llama2-7b,
    /// mistral-7b, llama3-8b); the flags below change parts of it.
    #[arg(long, default_value = "smollm2-135m")]
    pub like: String,
    #[arg(long, value_enum)]
    pub arch: Option<crate::synth::Arch>,
    #[arg(long)]
    pub dim: Option<usize>,
    #[arg(long)]
    pub layers: Option<usize>,
    #[arg(long)]
    pub heads: Option<usize>,
    #[arg(long)]
    pub kv_heads: Option<usize>,
    #[arg(long)]
    pub ffn: Option<usize>,
    /// Context length in the metadata.
    #[arg(long)]
    pub ctx: Option<usize>,
    #[arg(long)]
    pub rope_base: Option<f32>,
    /// Llama 3's RoPE frequency factors (rope_freqs.weight): true or false.
    #[arg(long)]
    pub llama3_rope: Option<bool>,
    /// Linear RoPE scaling factor (1: none).
    #[arg(long)]
    pub rope_scale: Option<f32>,
    /// The output projection is the token embedding: true or false.
    #[arg(long)]
    pub tied: Option<bool>,
    /// Weight type of the matrices.
    #[arg(long = "type", value_enum, default_value = "q4_0")]
    pub ty: crate::synth::WType,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The GGUF file whose tokenizer the model gets [default: the default model]
    #[arg(long)]
    pub tokenizer_from: Option<PathBuf>,
    #[arg(long)]
    pub out: PathBuf,
    /// Print what was written as JSON.
    #[arg(long)]
    pub json: bool,
}

impl SynthArgs {
    /// The shape asked for: the preset with the flags' changes.
    pub fn shape(&self) -> Result<crate::synth::Shape> {
        let mut s = crate::synth::preset(&self.like)?;
        let set = |v: Option<usize>, f: &mut usize| *f = v.unwrap_or(*f);
        s.arch = self.arch.unwrap_or(s.arch);
        set(self.dim, &mut s.dim);
        set(self.layers, &mut s.layers);
        set(self.heads, &mut s.heads);
        set(self.kv_heads, &mut s.kv_heads);
        set(self.ffn, &mut s.ffn);
        set(self.ctx, &mut s.ctx);
        s.rope_base = self.rope_base.unwrap_or(s.rope_base);
        s.llama3_rope = self.llama3_rope.unwrap_or(s.llama3_rope);
        s.rope_scale = self.rope_scale.unwrap_or(s.rope_scale);
        s.tied = self.tied.unwrap_or(s.tied);
        Ok(s)
    }

    pub fn run(self) -> Result<()> {
        let shape = self.shape()?;
        let tok = self.tokenizer_from.as_deref().map_or_else(llmsd::default_model, llmsd::model_file);
        let w = crate::synth::write(&shape, self.ty, self.seed, &tok, &self.out)?;
        if self.json {
            println!(
                "{}",
                json!({"out": self.out, "shape": shape, "type": self.ty, "seed": self.seed, "bytes": w.bytes, "params": w.params, "vocab": w.vocab})
            );
        } else {
            println!("{}: {}", self.out.display(), crate::synth::describe(&shape, self.ty, &w));
        }
        Ok(())
    }
}

//! Context-switching traces (`llms trace`), the paper's experiments over them (`llms
//! experiment`, docs/traces.md) and the page that gathers their results (`llms report`).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};

use super::*;

/// `llms report`.
#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Where the experiments wrote their figures.
    #[arg(long, default_value = "docs/results")]
    pub results: PathBuf,
    #[arg(long, default_value = "docs/RESULTS.md")]
    pub out: PathBuf,
}

impl ReportArgs {
    pub fn run(self) -> Result<()> {
        let Self { results, out } = self;
        if !results.is_dir() {
            bail!("{}: no such directory (run an experiment first: llms experiment --help)", results.display());
        }
        let r = crate::report::write(&results, &out)?;
        println!("wrote {}: {} figures", out.display(), r.included.len());
        for m in &r.missing {
            println!("not measured yet: {m}");
        }
        Ok(())
    }
}

/// What every trace experiment shares.
#[derive(clap::Args, Debug)]
pub struct TraceExp {
    /// Calls per context in each trace.
    #[arg(long, default_value_t = 3)]
    calls_per_context: usize,
    /// Scale of Table 3's delta lengths [default: the experiment's, see docs/traces.md].
    #[arg(long)]
    scale: Option<f64>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Text files for the prompts [default: /usr/share/common-licenses/*].
    #[arg(long)]
    corpus: Vec<PathBuf>,
    /// Tokens of a system prompt per app that every context of the app opens with (at the
    /// largest length when the deltas scale with it, proportionally fewer below): what prefix
    /// sharing shares; the policy `llms-noshare` is llms with `prefix_sharing = false`. 0: none.
    #[arg(long, default_value_t = 0)]
    system_tokens: usize,
    /// Apps the contexts belong to (Fig. 10, 11: context k to app k mod N).
    #[arg(long, default_value_t = 4)]
    apps: usize,
    #[arg(long, default_value = "docs/results")]
    out_dir: PathBuf,
    /// Where the load profiles are (measured there if missing); runs use fresh stores under it.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// The llms policy's KV levels, the base first (docs/kv.md), the service's unless told.
    #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = strings(&llmsd::config::DEFAULT_LEVELS))]
    llms_levels: Vec<String>,
    /// The llms policy's global ratio (x the base's bytes): a number in (0, 1], or `quality`:
    /// the most compressed ratio whose perplexity is within --quality-tolerance of the base
    /// level's on every --accuracy-text (found before the runs, printed and used), the service's unless told.
    #[arg(long, default_value_t = llmsd::config::DEFAULT_RATIO.to_string())]
    llms_ratio: String,
    /// With --llms-ratio quality: the perplexity allowed above the base level's, in percent.
    #[arg(long, default_value_t = 1.0)]
    quality_tolerance: f64,
    /// With --llms-ratio quality: the texts scored (ctx 512, --quality-windows windows each).
    #[arg(long, default_values = ACCURACY_TEXTS)]
    accuracy_text: Vec<PathBuf>,
    /// With --llms-ratio quality: windows of 512 tokens scored per text (0: all).
    #[arg(long, default_value_t = 8)]
    quality_windows: usize,
    #[command(flatten)]
    m: ModelArgs,
}

/// Fig. 12's plans unless told: the service's levels each alone, and their mix at the service's
/// ratio and at 0.5.
fn default_plans() -> Vec<String> {
    let mut p = strings(&llmsd::config::DEFAULT_LEVELS);
    p.push(format!("mix:{}", llmsd::config::DEFAULT_RATIO));
    p.push("mix:0.5".into());
    p
}

/// The KV accuracy texts (docs/kv.md): the quality search's and Fig. 12's llama.cpp comparison's.
const ACCURACY_TEXTS: [&str; 2] = ["tests/fixtures/gpl-3.txt", "tests/fixtures/heapq.py.txt"];
/// llama.cpp's KV perplexities on them (`make fixtures` writes it).
const DEFAULT_PEER: &str = "tests/fixtures/llama_cpp.json";

#[derive(Subcommand, Debug)]
pub enum ExperimentCmd {
    /// Fig. 12: perplexity, teacher-forced and free-running greedy agreement vs KV memory.
    AccuracyVsMemory {
        /// What to measure: formats and mixes; unless told, the service's levels each alone, and
        /// mixed at the service's ratio and at 0.5.
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = default_plans())]
        plans: Vec<String>,
        #[arg(long, default_value_t = 512)]
        ctx: usize,
        #[arg(long, default_value_t = 8)]
        windows: usize,
        #[arg(long, default_value_t = llmsd::config::DEFAULT_CHUNK_TOKENS)]
        chunk_tokens: usize,
        /// Tokens generated greedily after a prompt of ctx/2 tokens per window (0: skip).
        #[arg(long, default_value_t = 64)]
        generate: usize,
        /// Text files [default: /usr/share/common-licenses/*].
        #[arg(long)]
        corpus: Vec<PathBuf>,
        /// The levels the mix plans choose from, the base (int8) first (docs/kv.md), the service's unless
        /// told.
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = strings(&llmsd::config::DEFAULT_LEVELS))]
        levels: Vec<String>,
        /// llama.cpp's perplexities with its own KV cache types (`kv_perplexity` in the JSON
        /// `make fixtures` writes): the plans run again on --peer-texts with the same windows,
        /// beside them [default: tests/fixtures/llama_cpp.json when it is there].
        #[arg(long)]
        peer: Option<PathBuf>,
        /// No llama.cpp comparison.
        #[arg(long, conflicts_with = "peer")]
        no_peer: bool,
        /// The texts of the llama.cpp comparison, named in --peer's entries by file name
        /// [default: tests/fixtures/gpl-3.txt, tests/fixtures/heapq.py.txt].
        #[arg(long, value_delimiter = ',')]
        peer_texts: Vec<PathBuf>,
        #[arg(long, default_value = "docs/results")]
        out_dir: PathBuf,
        #[command(flatten)]
        m: ModelArgs,
    },
    /// Fig. 9: average switch latency vs active contexts, per policy and pattern [scale 0.1].
    SwitchVsContexts {
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [2usize, 4, 8, 12, 16])]
        contexts: Vec<usize>,
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = strings(&["llms", "vllm-sq", "vllm-s", "swap", "lmk"]))]
        policies: Vec<String>,
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = strings(&["random", "markov", "gaussian"]))]
        patterns: Vec<String>,
        #[arg(long, default_value = "8MiB")]
        budget: String,
        #[command(flatten)]
        t: TraceExp,
    },
    /// Fig. 10: most active contexts under switch latency bounds, for several budgets [scale 0.1].
    ContextsVsBudget {
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = strings(&["4MiB", "8MiB", "16MiB"]))]
        budgets: Vec<String>,
        /// Maximum context length (tokens).
        #[arg(long, default_value_t = 2048)]
        length: usize,
        #[command(flatten)]
        x: MaxArgs,
    },
    /// Fig. 11: most active contexts under switch latency bounds, for several maximum context
    /// lengths [scale 0.2 at the largest length, proportional to the length below it, so
    /// contexts fill a similar share of every window and few slide].
    ContextsVsLength {
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [512usize, 1024, 2048])]
        lengths: Vec<usize>,
        #[arg(long, default_value = "8MiB")]
        budget: String,
        #[command(flatten)]
        x: MaxArgs,
    },
    /// Fig. 13: the llms policy with one technique off at a time (lctru, compression, pipeline,
    /// aot) [scale 0.1].
    Ablation {
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = strings(&["llms", "no-lctru", "no-compression", "no-pipeline", "no-aot", "vllm-sq"]))]
        variants: Vec<String>,
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [4usize, 8, 16])]
        contexts: Vec<usize>,
        #[arg(long, default_value = "markov")]
        pattern: String,
        #[arg(long, default_value = "8MiB")]
        budget: String,
        #[command(flatten)]
        t: TraceExp,
    },
    /// Fig. 14: average switch latency vs tokens per chunk [scale 0.1].
    ChunkSize {
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [4usize, 8, 16, 32, 64])]
        chunk_tokens: Vec<usize>,
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = strings(&["llms", "vllm-sq"]))]
        policies: Vec<String>,
        #[arg(long, default_value_t = 8)]
        contexts: usize,
        #[arg(long, default_value = "markov")]
        pattern: String,
        #[arg(long, default_value = "8MiB")]
        budget: String,
        #[command(flatten)]
        t: TraceExp,
    },
    /// Fig. 15b: average switch latency vs call rate, calls replayed in real time [scale 0.1].
    CallRate {
        /// Calls per second.
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [0.5f64, 1.0, 2.0, 4.0, 8.0])]
        rates: Vec<f64>,
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = strings(&["llms", "vllm-sq"]))]
        policies: Vec<String>,
        #[arg(long, default_value_t = 8)]
        contexts: usize,
        #[arg(long, default_value = "markov")]
        pattern: String,
        #[arg(long, default_value = "8MiB")]
        budget: String,
        #[command(flatten)]
        t: TraceExp,
    },
    /// Fig. 15a: prefill and decode speed with the KV cache in mm's userfaultfd regions vs the
    /// engine's own memory.
    Inference {
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [256usize, 512, 1024, 2048])]
        lengths: Vec<usize>,
        #[arg(long, default_value_t = 32)]
        decode: usize,
        #[arg(long, default_value_t = 5)]
        reps: usize,
        #[arg(long, default_value_t = llmsd::config::DEFAULT_CHUNK_TOKENS)]
        chunk_tokens: usize,
        #[arg(long, default_value = "docs/results")]
        out_dir: PathBuf,
        /// Where the runs' stores go.
        #[arg(long)]
        state_dir: Option<PathBuf>,
        #[command(flatten)]
        m: ModelArgs,
    },
}

/// What `contexts-vs-budget` and `contexts-vs-length` share.
#[derive(clap::Args, Debug)]
pub struct MaxArgs {
    /// Average switch latency bounds, ms: the paper's 10 and 25 ms for Llama2-7B, scaled by
    /// KV bytes per token (512 KiB there, 23 KiB in f16 for SmolLM2-135M: about 1/22).
    #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [0.5f64, 1.0])]
    bounds: Vec<f64>,
    /// Active contexts tried, ascending (a policy stops at the first count over every bound).
    #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [2usize, 4, 6, 8, 12, 16, 24, 32])]
    contexts: Vec<usize>,
    #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = strings(&["llms", "vllm-sq", "vllm-s", "swap", "lmk"]))]
    policies: Vec<String>,
    #[arg(long, default_value = "markov")]
    pattern: String,
    #[command(flatten)]
    t: TraceExp,
}

/// A trace experiment's setting up: the corpus, the base configuration, the load profile of
/// 16-token chunks measured (or found) in the state directory, and a work directory under it.
struct ExpEnv {
    corpus: Vec<PathBuf>,
    base: llmsd::config::Config,
    profiles: PathBuf,
    work: PathBuf,
    /// How the llms ratio was chosen (for captions).
    ratio_by: String,
}

impl ExpEnv {
    fn new(t: &TraceExp, policies: &[String]) -> Result<Self> {
        for p in policies {
            crate::experiment::check_policy(p)?;
        }
        if t.calls_per_context < 2 {
            bail!("--calls-per-context must be at least 2: the first call of a context is not a switch");
        }
        let corpus = if t.corpus.is_empty() { crate::trace::default_corpus() } else { t.corpus.clone() };
        let profiles = t.state_dir.clone().unwrap_or_else(llmsd::profile::state_dir);
        std::fs::create_dir_all(&profiles).with_context(|| format!("creating {}", profiles.display()))?;
        let (model, pool) = load(&t.m)?;
        llmsd::profile::load_or_measure(&profiles, &model, &pool, 16, false)?;
        let mut base = llmsd::config::Config {
            model: model_path(&t.m),
            threads: t.m.threads.unwrap_or(0),
            levels: t.llms_levels.clone(),
            ..llmsd::config::Config::default()
        };
        let levels = base.level_formats()?;
        let ratio_by;
        (base.ratio, ratio_by) = match t.llms_ratio.as_str() {
            "quality" => {
                if !(t.quality_tolerance >= 0.0 && t.quality_tolerance.is_finite()) {
                    bail!("--quality-tolerance must be a percentage >= 0");
                }
                let r =
                    crate::experiment::ratio_by_quality(&model, &pool, &levels, &t.accuracy_text, t.quality_windows, t.quality_tolerance)?
                        .0;
                let names: Vec<String> =
                    t.accuracy_text.iter().map(|p| p.file_name().unwrap_or(p.as_os_str()).to_string_lossy().into_owned()).collect();
                let windows = if t.quality_windows == 0 { "all".to_string() } else { t.quality_windows.to_string() };
                let by = format!(
                    "the most compressed ratio within {}% of {}'s perplexity on {}, {windows} windows of 512 tokens each",
                    t.quality_tolerance,
                    t.llms_levels[0],
                    names.join(", ")
                );
                (r, by)
            }
            r => (
                crate::experiment::parse_ratio(r).with_context(|| format!("--llms-ratio {r:?}: a number in (0, 1] or `quality`"))?,
                "a fixed ratio".to_string(),
            ),
        };
        let work = profiles.join(format!("experiment-{}", std::process::id()));
        Ok(Self { corpus, base, profiles, work, ratio_by })
    }

    fn done(&self, files: Result<Vec<PathBuf>>) -> Result<()> {
        let _ = std::fs::remove_dir_all(&self.work);
        for f in files? {
            println!("wrote {}", f.display());
        }
        Ok(())
    }
}

fn print_sweep(r: &crate::experiment::SweepRun) {
    let s = &r.summary;
    println!(
        "{:<16} {:>8} {:>12.2} {:>12.2} {:>10.1} {:>8} {:>8}",
        r.label, r.x, s.switch_mean_ms, s.switch_p90_ms, s.ttft_mean_ms, s.read_chunks, s.recomputed_chunks
    );
}

fn sweep_header(x: &str) {
    println!("{:<16} {:>8} {:>12} {:>12} {:>10} {:>8} {:>8}", "run", x, "switch_ms", "p90_ms", "ttft_ms", "read", "recomp");
}

#[allow(clippy::too_many_lines)]
pub fn experiment_cmd(cmd: ExperimentCmd) -> Result<()> {
    use crate::experiment as ex;
    match cmd {
        ExperimentCmd::AccuracyVsMemory {
            plans,
            ctx,
            windows,
            chunk_tokens,
            generate,
            corpus,
            levels,
            peer,
            no_peer,
            peer_texts,
            out_dir,
            m,
        } => {
            if !(8..=4096).contains(&ctx) || chunk_tokens == 0 || chunk_tokens > ctx || windows == 0 || generate > 4096 {
                bail!("--ctx must be 8-4096, --chunk-tokens 1..=ctx, --windows at least 1, --generate at most 4096");
            }
            let corpus = if corpus.is_empty() { crate::trace::default_corpus() } else { corpus };
            // The peer's fixture is used when given, or when this runs in a checkout that has it.
            let peer = match (no_peer, peer) {
                (true, _) => None,
                (false, Some(p)) => Some(p),
                (false, None) => Some(PathBuf::from(DEFAULT_PEER)).filter(|p| p.is_file()),
            };
            if peer.is_none() && !no_peer {
                println!("no llama.cpp comparison: {DEFAULT_PEER} is not here (--peer FILE names one; `make fixtures` writes it)");
            }
            let peer_texts = if peer_texts.is_empty() { ACCURACY_TEXTS.iter().map(PathBuf::from).collect() } else { peer_texts };
            let s = ex::AccuracyVsMemory { plans, ctx, windows, chunk_tokens, corpus, generate, levels, peer, peer_texts };
            let (model, pool) = load(&m)?;
            let rows = ex::accuracy_vs_memory(&model, &pool, &s)?;
            println!(
                "{:<10} {:>10} {:>10} {:>9} {:>10} {:>10} {:>8}",
                "plan", "bytes/int8", "ppl", "vs int8", "teacher", "greedy", "prefix"
            );
            for r in &rows {
                println!(
                    "{:<10} {:>10.3} {:>10.4} {:>+8.2}% {:>9.1}% {:>9.1}% {:>7.1}%",
                    r.plan,
                    r.bytes_vs_int8,
                    r.ppl,
                    r.ppl_vs_int8_pct,
                    r.top1_agreement * 100.0,
                    r.greedy_agreement * 100.0,
                    r.greedy_prefix * 100.0
                );
            }
            let peer = ex::peer_comparison(&model, &pool, &s)?;
            print!("{}", ex::peer_table(&peer));
            for f in ex::write_accuracy(&out_dir, "accuracy_vs_memory", &s, &rows, &peer)? {
                println!("wrote {}", f.display());
            }
        }
        ExperimentCmd::SwitchVsContexts { contexts, policies, patterns, budget, t } => {
            let env = ExpEnv::new(&t, &policies)?;
            let s = ex::SwitchVsContexts {
                contexts,
                policies,
                patterns,
                calls_per_context: t.calls_per_context,
                budget,
                scale: t.scale.unwrap_or(0.1),
                seed: t.seed,
                corpus: env.corpus.clone(),
                llms_levels: env.base.levels.clone(),
                llms_ratio: env.base.ratio,
                llms_ratio_by: env.ratio_by.clone(),
            };
            println!(
                "{:<9} {:<8} {:>8} {:>12} {:>12} {:>10} {:>6} {:>7}",
                "pattern", "policy", "contexts", "switch_ms", "p90_ms", "ttft_ms", "read", "recomp"
            );
            let pts = ex::switch_vs_contexts(&env.base, &s, &env.work, &env.profiles, &mut |p| {
                println!(
                    "{:<9} {:<8} {:>8} {:>12.2} {:>12.2} {:>10.1} {:>6} {:>7}",
                    p.pattern, p.policy, p.contexts, p.switch_mean_ms, p.switch_p90_ms, p.ttft_mean_ms, p.read_chunks, p.recomputed_chunks
                );
            });
            env.done(pts.and_then(|pts| ex::write_switch_vs_contexts(&t.out_dir, "switch_vs_contexts", &s, &pts)))?;
        }
        ExperimentCmd::ContextsVsBudget { budgets, length, x } => {
            max_contexts_cmd(budgets, vec![length], x, 0.1, false, "contexts_vs_budget")?
        }
        ExperimentCmd::ContextsVsLength { lengths, budget, x } => {
            max_contexts_cmd(vec![budget], lengths, x, 0.2, true, "contexts_vs_length")?
        }
        ExperimentCmd::Ablation { variants, contexts, pattern, budget, t } => {
            let env = ExpEnv::new(&t, &[])?;
            for v in &variants {
                ex::variant_config(&env.base, v)?;
            }
            let s = ex::Ablation {
                variants,
                contexts,
                pattern,
                calls_per_context: t.calls_per_context,
                budget,
                scale: t.scale.unwrap_or(0.1),
                seed: t.seed,
                corpus: env.corpus.clone(),
            };
            sweep_header("contexts");
            let runs = ex::ablation(&env.base, &s, &env.work, &env.profiles, &mut print_sweep);
            env.done(runs.and_then(|r| ex::write_ablation(&t.out_dir, "ablation", &s, &r)))?;
        }
        ExperimentCmd::ChunkSize { chunk_tokens, policies, contexts, pattern, budget, t } => {
            let env = ExpEnv::new(&t, &policies)?;
            let s = ex::ChunkSize {
                chunk_tokens,
                policies,
                contexts,
                pattern,
                calls_per_context: t.calls_per_context,
                budget,
                scale: t.scale.unwrap_or(0.1),
                seed: t.seed,
                corpus: env.corpus.clone(),
            };
            sweep_header("chunk");
            let runs = ex::chunk_size(&env.base, &s, &env.work, &env.profiles, &mut print_sweep);
            env.done(runs.and_then(|r| ex::write_chunk_size(&t.out_dir, "chunk_size", &s, &r)))?;
        }
        ExperimentCmd::CallRate { rates, policies, contexts, pattern, budget, t } => {
            if rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
                bail!("--rates must be positive");
            }
            let env = ExpEnv::new(&t, &policies)?;
            let s = ex::CallRate {
                rates,
                policies,
                contexts,
                pattern,
                calls_per_context: t.calls_per_context,
                budget,
                scale: t.scale.unwrap_or(0.1),
                seed: t.seed,
                corpus: env.corpus.clone(),
            };
            sweep_header("calls/s");
            let runs = ex::call_rate(&env.base, &s, &env.work, &env.profiles, &mut print_sweep);
            env.done(runs.and_then(|r| ex::write_call_rate(&t.out_dir, "call_rate", &s, &r)))?;
        }
        ExperimentCmd::Inference { lengths, decode, reps, chunk_tokens, out_dir, state_dir, m } => {
            let dir = state_dir.unwrap_or_else(llmsd::profile::state_dir);
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let (model, pool) = load(&m)?;
            let s = ex::Inference { lengths, decode, reps, chunk_tokens };
            println!("{:<8} {:>8} {:>12} {:>12}", "memory", "tokens", "prefill t/s", "decode t/s");
            let rows = ex::inference(&model, &pool, &s, &dir, &mut |r| {
                println!("{:<8} {:>8} {:>12.1} {:>12.1}", r.memory, r.length, r.prefill_tok_s, r.decode_tok_s);
            })?;
            for f in ex::write_inference(&out_dir, "inference", &s, &rows)? {
                println!("wrote {}", f.display());
            }
        }
    }
    Ok(())
}

fn max_contexts_cmd(budgets: Vec<String>, lengths: Vec<usize>, x: MaxArgs, scale: f64, scale_with_length: bool, name: &str) -> Result<()> {
    use crate::experiment as ex;
    if x.contexts.is_empty() || x.contexts.windows(2).any(|w| w[0] >= w[1]) || x.bounds.iter().any(|b| !(b.is_finite() && *b > 0.0)) {
        bail!("--contexts must be ascending and non-empty, --bounds positive");
    }
    let env = ExpEnv::new(&x.t, &x.policies)?;
    let s = ex::MaxContexts {
        budgets,
        lengths,
        bounds_ms: x.bounds,
        contexts: x.contexts,
        policies: x.policies,
        pattern: x.pattern,
        calls_per_context: x.t.calls_per_context,
        scale: x.t.scale.unwrap_or(scale),
        scale_with_length,
        seed: x.t.seed,
        corpus: env.corpus.clone(),
        system_tokens: x.t.system_tokens,
        apps: x.t.apps,
    };
    println!(
        "{:<8} {:>8} {:<8} {:>8} {:>12} {:>6} {:>6} {:>6}",
        "budget", "length", "policy", "contexts", "switch_ms", "slid", "read", "recomp"
    );
    let r = ex::max_contexts(&env.base, &s, &env.work, &env.profiles, &mut |r| {
        println!(
            "{:<8} {:>8} {:<8} {:>8} {:>12.2} {:>6} {:>6} {:>6}",
            r.budget, r.length, r.policy, r.contexts, r.switch_mean_ms, r.slid_calls, r.read_chunks, r.recomputed_chunks
        );
    });
    env.done(r.and_then(|(runs, rows)| {
        for r in &rows {
            println!(
                "{} {} {} under {} ms: {}{:.1}",
                r.budget,
                r.length,
                r.policy,
                r.bound_ms,
                if r.at_least { ">= " } else { "" },
                r.max_contexts
            );
        }
        ex::write_max_contexts(&x.t.out_dir, name, &s, &runs, &rows)
    }))
}

// Parsed once per run: the size of the variants that carry ModelArgs does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum TraceCmd {
    /// Writes a synthetic trace (JSON lines; docs/traces.md).
    Gen {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 8)]
        contexts: usize,
        #[arg(long, default_value_t = 4)]
        apps: usize,
        #[arg(long, default_value_t = 100)]
        calls: usize,
        /// random, markov or gaussian.
        #[arg(long, default_value = "markov")]
        pattern: String,
        /// Calls per second (Poisson arrivals).
        #[arg(long, default_value_t = 0.5)]
        rate: f64,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Scale of the delta lengths of Table 3.
        #[arg(long, default_value_t = 1.0)]
        scale: f64,
        /// Markov: probability ratio between consecutive depths of the recency stack.
        #[arg(long, default_value_t = 0.5)]
        markov_decay: f64,
        /// Text files the prompts come from [default: /usr/share/common-licenses/*].
        #[arg(long)]
        corpus: Vec<PathBuf>,
        /// Tokens of a system prompt per app that every context of the app opens with (corpus
        /// text): what the service's prefix sharing shares. 0: none.
        #[arg(long, default_value_t = 0)]
        system_tokens: usize,
    },
    /// Replays a trace: against a running llmsd (--socket) or one started here with the given
    /// policy and budget; per-call results as JSON lines (--out) and a summary.
    Replay {
        trace: PathBuf,
        /// Drive the llmsd listening here instead of starting one.
        #[arg(long)]
        socket: Option<PathBuf>,
        #[arg(long, default_value = "llms")]
        policy: String,
        #[arg(long, default_value = "64MiB")]
        budget: String,
        #[arg(long, default_value_t = llmsd::config::DEFAULT_CHUNK_TOKENS)]
        chunk_tokens: usize,
        /// The llms policy's levels, the service's unless told.
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = strings(&llmsd::config::DEFAULT_LEVELS))]
        levels: Vec<String>,
        /// The llms policy's ratio, the service's unless told.
        #[arg(long, default_value_t = llmsd::config::DEFAULT_RATIO)]
        ratio: f64,
        #[arg(long, default_value_t = 2048)]
        max_context_tokens: usize,
        /// Parts of the llms policy to switch off: lctru, compression, pipeline, aot.
        #[arg(long, value_delimiter = ',', num_args = 1..)]
        ablate: Vec<String>,
        /// Send calls at their trace times instead of back to back (idle gaps compressed).
        #[arg(long)]
        realtime: bool,
        /// When the started service's swap-store records reach the disk: off, batch, group or
        /// group:MS [default: llmsd's, batch].
        #[arg(long)]
        durability: Option<String>,
        /// Where the load profile is (measured there if missing); runs use a fresh store under it.
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Per-call results, JSON lines.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Print the summary as JSON (and no per-call lines).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        m: ModelArgs,
    },
}

pub fn trace_cmd(cmd: TraceCmd) -> Result<()> {
    match cmd {
        TraceCmd::Gen { out, contexts, apps, calls, pattern, rate, seed, scale, markov_decay, corpus, system_tokens } => {
            let pattern =
                crate::trace::Pattern::parse(&pattern).with_context(|| format!("--pattern {pattern:?}: random, markov or gaussian"))?;
            let corpus = if corpus.is_empty() { crate::trace::default_corpus() } else { corpus };
            let p = crate::trace::GenParams { contexts, apps, calls, pattern, rate, seed, scale, markov_decay, corpus, system_tokens };
            let (h, recs) = crate::trace::generate(&p)?;
            crate::trace::write(&out, &h, &recs)?;
            eprintln!("wrote {} calls over {contexts} contexts to {}", recs.len(), out.display());
        }
        TraceCmd::Replay {
            trace,
            socket,
            policy,
            budget,
            chunk_tokens,
            levels,
            ratio,
            max_context_tokens,
            ablate,
            realtime,
            durability,
            state_dir,
            out,
            json,
            m,
        } => {
            let (h, recs) = crate::trace::read(&trace)?;
            if socket.is_some() && (!ablate.is_empty() || durability.is_some()) {
                bail!("--ablate and --durability configure a service this command starts; with --socket, set them in that llmsd's configuration");
            }
            let mut local = None;
            let mut work = None;
            let socket = match socket {
                Some(s) => s,
                None => {
                    let dir = state_dir.unwrap_or_else(llmsd::profile::state_dir);
                    std::fs::create_dir_all(&dir)?;
                    let (model, pool) = load(&m)?;
                    llmsd::profile::load_or_measure(&dir, &model, &pool, chunk_tokens, json)?;
                    drop((model, pool));
                    let w = dir.join(format!("replay-{}", std::process::id()));
                    crate::loadbench::fresh_state(&w, &dir)?;
                    let cfg = llmsd::config::Config {
                        model: model_path(&m),
                        threads: m.threads.unwrap_or(0),
                        socket: w.join("llmsd.sock"),
                        state_dir: w.clone(),
                        policy,
                        budget,
                        chunk_tokens,
                        levels,
                        ratio,
                        max_context_tokens,
                        ablate,
                        pressure: false,
                        durability: durability.unwrap_or_else(|| llmsd::config::Config::default().durability),
                        ..llmsd::config::Config::default()
                    };
                    let l = llmsd::service::Local::start(cfg)?;
                    let s = l.socket.clone();
                    local = Some(l);
                    work = Some(w);
                    s
                }
            };
            let mut file = match &out {
                Some(p) => Some(std::io::BufWriter::new(std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?)),
                None => None,
            };
            if !json {
                println!(
                    "{:>5} {:>9} {:>4} {:>10} {:>9} {:>6} {:>6} {:>9} {:>7}",
                    "call", "t_s", "ctx", "switch_ms", "ttft_ms", "read", "recomp", "KV_MiB", "tok/s"
                );
            }
            let t0 = Instant::now();
            let mut err = None;
            let pace = if realtime { crate::replay::Pace::Realtime } else { crate::replay::Pace::Compressed };
            let results = crate::replay::replay_paced(&socket, &h, &recs, pace, &mut |r| {
                if let Some(f) = &mut file {
                    if let Err(e) =
                        serde_json::to_writer(&mut *f, r).map_err(anyhow::Error::from).and_then(|()| writeln!(f).map_err(Into::into))
                    {
                        err = Some(e);
                    }
                }
                if !json {
                    println!(
                        "{:>5} {:>9.2} {:>4} {:>10.2} {:>9.1} {:>6} {:>6} {:>9.2} {:>7.1}",
                        r.i,
                        r.t,
                        r.ctx,
                        r.switch_ms,
                        r.ttft_ms,
                        r.read_chunks,
                        r.recomputed_chunks,
                        r.resident_bytes as f64 / 1048576.0,
                        r.decode_tok_s
                    );
                }
            });
            let stopped = local.map(llmsd::service::Local::stop);
            if let Some(w) = work {
                let _ = std::fs::remove_dir_all(w);
            }
            let results = results?;
            if let Some(e) = err {
                return Err(e);
            }
            if let Some(mut f) = file {
                f.flush()?;
            }
            if let Some(s) = stopped {
                s?;
            }
            let sum = crate::replay::summarize(&results, t0.elapsed().as_secs_f64());
            if json {
                println!("{}", serde_json::to_string(&sum)?);
            } else {
                println!(
                    "{} calls over {} contexts in {:.1} s: switch latency mean {:.2} ms, p50 {:.2}, p90 {:.2}, p99 {:.2}; TTFT mean {:.1} ms; decode {:.1} tok/s; {} chunks read, {} recomputed; peak KV {:.1} MiB",
                    sum.calls, sum.contexts, sum.seconds, sum.switch_mean_ms, sum.switch_p50_ms, sum.switch_p90_ms, sum.switch_p99_ms,
                    sum.ttft_mean_ms, sum.decode_tok_s, sum.read_chunks, sum.recomputed_chunks, sum.max_resident_bytes as f64 / 1048576.0
                );
                if sum.slid_calls > 0 {
                    println!(
                        "{} call(s) found their context full: the sliding window rebuilt it (in their prefill, not their switch)",
                        sum.slid_calls
                    );
                }
            }
        }
    }
    Ok(())
}

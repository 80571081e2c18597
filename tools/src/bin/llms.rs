//! `llms`: the LLMS command line. Subcommands print stable JSON where documented in
//! docs/CLI.md, so other tools can script them.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use engine::chat::Message;
use engine::{Logits, Model, Sampler, SamplerConfig, Session, ThreadPool, Utf8Stream};
use serde_json::json;

const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Parser, Debug)]
#[command(name = "llms", version, about = "LLMS: an LLM as a system service — command line")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args, Debug, Clone)]
struct ModelArgs {
    /// GGUF model file [default: $LLMS_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long, global = true)]
    model: Option<PathBuf>,
    /// Worker threads [default: number of cores]
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// Where the weights live: `resident` (packed in memory) or `paged` (served from a weight
    /// image on flash under --weights-budget; docs/weights.md) [default: resident, paged when
    /// --weights-budget is given]
    #[arg(long, global = true, value_enum)]
    weights: Option<WeightsMode>,
    /// Weight budget with paged weights: bytes (48M) or a share of the weight bytes (50%)
    /// [default: 100%]
    #[arg(long, global = true)]
    weights_budget: Option<tools::weights::Budget>,
    /// The weight image [default: next to the model, MODEL.llms-weights; built when missing
    /// or stale]
    #[arg(long, global = true)]
    weights_image: Option<PathBuf>,
    /// Paged weights without read-ahead: every miss is a fault.
    #[arg(long, global = true)]
    no_preload: bool,
    /// Top-K activation sparsity (generate, bench, perplexity, logits, chat): this share of
    /// the projections' input entries (weighted by the weight bytes they select) is zeroed;
    /// per-site levels and thresholds are calibrated on --calib-text (docs/weights.md).
    #[arg(long, global = true)]
    sparsity: Option<f32>,
    /// Calibration text for --sparsity [default: /usr/share/common-licenses/Apache-2.0].
    #[arg(long, global = true)]
    calib_text: Option<PathBuf>,
    /// How layer matrices are stored: `packed` (fastest dense kernels) or `channel-major` (a
    /// token reads only the columns of its non-zero inputs, so sparsity saves reads and time;
    /// paged, a channel-major image read by active channel) [default: channel-major with
    /// --sparsity, else packed]
    #[arg(long, global = true, value_enum)]
    weight_format: Option<FormatArg>,
    /// With paged weights (generate, bench, perplexity, logits, chat): choose the sparsity
    /// (up to --max-sparsity) and the layers per group by ActiveFlow's cost model from
    /// measured bandwidths and activation statistics (`llms plan-weights`; docs/weights.md).
    #[arg(long, global = true)]
    weights_plan: bool,
    /// Highest sparsity a weight plan may choose (sparsity costs quality) [default: 0.5].
    #[arg(long, global = true)]
    max_sparsity: Option<f32>,
    /// Layers per group of the channel-major image (set by a weight plan).
    #[arg(skip)]
    weights_span: Option<usize>,
}

use tools::weights::plan::{DEFAULT_CALIB_TEXT as CALIB_TEXT, PLAN_LEVELS};

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum FormatArg {
    Packed,
    ChannelMajor,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum WeightsMode {
    Resident,
    Paged,
}

/// The paged weights of the model `load` loaded, if any (for their statistics).
static PAGED: std::sync::OnceLock<Arc<tools::weights::PagedWeights>> = std::sync::OnceLock::new();

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Print the token ids of a text as a JSON array.
    Tokenize {
        #[arg(long)]
        text_file: PathBuf,
        /// Do not parse special tokens such as <|im_start|> written in the text.
        #[arg(long)]
        no_special: bool,
        #[command(flatten)]
        m: ModelArgs,
    },
    /// Print the highest logits at the last position of a prompt as JSON.
    Logits {
        #[arg(long)]
        prompt_file: PathBuf,
        #[arg(long, default_value_t = 10)]
        top: usize,
        #[command(flatten)]
        m: ModelArgs,
    },
    /// Generate text from a prompt, streaming it.
    Generate {
        #[arg(long, conflicts_with = "prompt")]
        prompt_file: Option<PathBuf>,
        #[arg(long)]
        prompt: Option<String>,
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 40)]
        top_k: usize,
        #[arg(long, default_value_t = 0.95)]
        top_p: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Wrap the prompt in the model's chat template as one user message.
        #[arg(long)]
        chat: bool,
        /// Print {"tokens":[...],"text":"..."} at the end instead of streaming.
        #[arg(long)]
        json: bool,
        /// Print prefill and decode speed to stderr.
        #[arg(long)]
        stats: bool,
        #[command(flatten)]
        m: ModelArgs,
    },
    /// Contexts held by a running llmsd: create, call, delete, list.
    Ctx {
        #[command(subcommand)]
        cmd: CtxCmd,
    },
    /// The service's figures: budget and usage, switch latency, faults, pressure, and this
    /// app's contexts (residency and levels).
    Stats {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        d: DaemonArgs,
    },
    /// Interactive chat with the model's template; tokens are streamed as they come. With
    /// --ctx the conversation is a context of a running llmsd (it persists).
    Chat {
        /// Chat in this llmsd context ("new" creates one and prints its id).
        #[arg(long)]
        ctx: Option<String>,
        #[command(flatten)]
        d: DaemonArgs,
        #[arg(long, default_value_t = 256)]
        max_tokens: usize,
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long)]
        system: Option<String>,
        #[command(flatten)]
        m: ModelArgs,
    },
    /// Perplexity by llama.cpp's method: windows of N tokens, score the second half of each.
    Perplexity {
        #[arg(long)]
        text_file: PathBuf,
        #[arg(long, default_value_t = 512)]
        ctx: usize,
        /// Score at most this many windows (0 = all).
        #[arg(long, default_value_t = 0)]
        chunks: usize,
        /// KV cache while scoring: f16 (default), int8, q4, q2, or mix:R (tolerance-aware
        /// levels at R x int8 bytes). With --kv, windows are fed one KV chunk at a time.
        #[arg(long)]
        kv: Option<String>,
        /// Tokens per KV chunk (with --kv).
        #[arg(long, default_value_t = 16)]
        chunk_tokens: usize,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        m: ModelArgs,
    },
    /// Measure the swap-recompute planner's cost profiles (T_re, T_io) and save them.
    Profile {
        #[arg(long, default_value_t = 16)]
        chunk_tokens: usize,
        /// Where the swap store and profiles live [default: $LLMS_STATE_DIR, else ~/.local/state/llms]
        #[arg(long)]
        state_dir: Option<PathBuf>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        m: ModelArgs,
    },
    /// Switch-in latency of contexts held entirely on flash: all-read, all-recompute and the
    /// planned pipeline, next to the floor (bytes / the store's read bandwidth).
    BenchLoad {
        /// Context sizes in tokens.
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [256usize, 1024, 4096])]
        tokens: Vec<usize>,
        #[arg(long, default_value_t = 3)]
        reps: usize,
        #[arg(long, default_value_t = 16)]
        chunk_tokens: usize,
        #[arg(long)]
        state_dir: Option<PathBuf>,
        #[arg(long)]
        json: bool,
        /// The load staging arena (docs/mm.md): more keeps more reads in flight; memory held
        /// beyond the KV budget.
        #[arg(long, default_value = "8MiB", value_parser = staging_arg)]
        staging: usize,
        #[command(flatten)]
        m: ModelArgs,
    },
    /// The service's switch latency and time to first token for contexts that are resident,
    /// partly evicted, fully evicted, and recomputed whole (lmk), in process over a socket.
    BenchSwitch {
        /// Context sizes in tokens.
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [1024usize, 4096])]
        tokens: Vec<usize>,
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Where the load profile is (measured there if missing) and the runs' stores go.
        #[arg(long)]
        state_dir: Option<PathBuf>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        m: ModelArgs,
    },
    /// Context-switching traces: synthesize them, replay them against llmsd.
    Trace {
        #[command(subcommand)]
        cmd: TraceCmd,
    },
    /// Gathers the experiments' tables and plots into one page with the machine and the
    /// commands (docs/RESULTS.md).
    Report {
        /// Where the experiments wrote their figures.
        #[arg(long, default_value = "docs/results")]
        results: PathBuf,
        #[arg(long, default_value = "docs/RESULTS.md")]
        out: PathBuf,
    },
    /// Experiments over traces (docs/traces.md): each writes a table and a plot.
    Experiment {
        #[command(subcommand)]
        cmd: ExperimentCmd,
    },
    /// Decode speed with weights resident and paged under budgets (shares of the weight
    /// bytes), flash bytes read per token, hit rate, and the flash floor; runs interleaved.
    BenchWeights {
        /// Budgets in percent of the weight bytes.
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [100.0f64, 75.0, 50.0, 25.0])]
        budgets: Vec<f64>,
        #[arg(long, default_value_t = 32)]
        tg: usize,
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Also run each budget below 100% without read-ahead.
        #[arg(long)]
        no_preload_too: bool,
        /// Top-K sparsity levels (e.g. 0,0.5,0.7): with any above 0, paged weights are read by
        /// active channel from a channel-major image, and each level also runs resident
        /// channel-major [default: 0, the packed image]. Calibrated on --calib-text.
        #[arg(long = "levels", value_delimiter = ',', num_args = 1..)]
        levels: Vec<f32>,
        /// Score perplexity (windows of 512 tokens) on this text with each configuration.
        #[arg(long)]
        ppl_text: Option<PathBuf>,
        #[arg(long, default_value_t = 2)]
        ppl_windows: usize,
        /// One paged case per budget as the weight plan chooses it (sparsity from
        /// --plan-levels up to --max-sparsity, group size), next to what the plan predicted.
        #[arg(long)]
        plan: bool,
        /// Sparsity levels a plan chooses from.
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = PLAN_LEVELS)]
        plan_levels: Vec<f32>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        m: ModelArgs,
    },
    /// The weight plan for each budget: ActiveFlow's cost model (eq. 1-9) fed by this
    /// machine's measured bandwidths and each sparsity level's measured reads; picks the
    /// sparsity, the layers per group and the cache size, and predicts decode speed.
    PlanWeights {
        /// Budgets in percent of the weight bytes.
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [100.0f64, 75.0, 50.0, 25.0])]
        budgets: Vec<f64>,
        /// Sparsity levels to choose from (each calibrated on --calib-text once).
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = PLAN_LEVELS)]
        levels: Vec<f32>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        m: ModelArgs,
    },
    /// userfaultfd mechanism costs next to their floors (memcpy, kernel anonymous faults).
    BenchUffd {
        #[arg(long, default_value_t = 51)]
        reps: usize,
        #[arg(long)]
        json: bool,
    },
    /// The memory-pressure monitor: watch it live, record samples, replay a recording.
    Pressure {
        #[command(subcommand)]
        cmd: PressureCmd,
    },
    /// What this machine offers LLMS (userfaultfd, ...), and how to fix what is missing.
    Doctor {
        #[arg(long)]
        json: bool,
    },
    /// Prefill (pp512) and decode (tg128) speed, like llama-bench.
    Bench {
        /// KV cache format: f16 or int8; q4 or q2: written as int8, the depth's full chunks
        /// then lowered (the attention cost of compressed context).
        #[arg(long, default_value = "f16")]
        kv: String,
        /// Context depth: pp and tg run after a prefilled context of this many tokens (like
        /// llama-bench -d).
        #[arg(short = 'd', long, default_value_t = 0)]
        depth: usize,
        #[arg(long, default_value_t = 512)]
        pp: usize,
        #[arg(long, default_value_t = 128)]
        tg: usize,
        #[arg(long, default_value_t = 5)]
        reps: usize,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        m: ModelArgs,
    },
}

#[derive(Args, Debug, Clone)]
struct DaemonArgs {
    /// llmsd's socket [default: $LLMS_SOCKET, else $XDG_RUNTIME_DIR/llms/llmsd.sock, else /run/llms/llmsd.sock]
    #[arg(long)]
    socket: Option<PathBuf>,
    /// The app name to bind as (contexts belong to an app of a user).
    #[arg(long, default_value = "llms-cli")]
    app: String,
}

impl DaemonArgs {
    fn connect(&self) -> Result<tools::client::Client> {
        let socket = self.socket.clone().unwrap_or_else(tools::client::default_socket);
        tools::client::Client::connect(&socket, &self.app)
    }
}

#[derive(Subcommand, Debug)]
enum CtxCmd {
    /// Creates a context and prints its id.
    New {
        #[arg(long)]
        system: Option<String>,
        #[command(flatten)]
        d: DaemonArgs,
    },
    /// Sends a prompt to a context and streams the answer (stats to stderr with --stats).
    Call {
        ctx: String,
        prompt: String,
        #[arg(long, default_value_t = 128)]
        max_tokens: u32,
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Stop when the output contains this (repeatable).
        #[arg(long)]
        stop: Vec<String>,
        /// Append the prompt as it is, not as a chat turn.
        #[arg(long)]
        raw: bool,
        /// Print {"text":..., "stats":...} at the end instead of streaming.
        #[arg(long)]
        json: bool,
        #[arg(long)]
        stats: bool,
        #[command(flatten)]
        d: DaemonArgs,
    },
    /// Deletes a context and its data.
    Del {
        ctx: String,
        #[command(flatten)]
        d: DaemonArgs,
    },
    /// This app's contexts.
    List {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        d: DaemonArgs,
    },
}

fn ctx_cmd(cmd: CtxCmd) -> Result<()> {
    match cmd {
        CtxCmd::New { system, d } => println!("{}", d.connect()?.new_ctx(system.as_deref())?),
        CtxCmd::Call { ctx, prompt, max_tokens, temperature, seed, stop, raw, json, stats, d } => {
            let mut c = d.connect()?;
            let call = tools::proto::Call { ctx, prompt, max_tokens, temperature, seed, stop, raw };
            let mut out = std::io::stdout().lock();
            let (text, st) = c.call(&call, &mut |t| {
                if !json {
                    let _ = out.write_all(t.as_bytes());
                    let _ = out.flush();
                }
            })?;
            if json {
                writeln!(out, "{}", json!({"text": text, "stats": st}))?;
            } else {
                writeln!(out)?;
            }
            if stats {
                eprintln!("{}", call_line(&st));
            }
        }
        CtxCmd::Del { ctx, d } => d.connect()?.del_ctx(&ctx)?,
        CtxCmd::List { json, d } => {
            let v = d.connect()?.list()?;
            if json {
                println!("{}", serde_json::to_string(&v)?);
            } else {
                print_contexts(&v);
            }
        }
    }
    Ok(())
}

fn call_line(st: &tools::proto::CallStats) -> String {
    format!(
        "[switch {:.1} ms ({} missing: {} read, {} recomputed), queue {:.1} ms, ttft {:.1} ms, prefill {} tok {:.1} ms, decode {} tok {:.1} ms, {}]",
        st.switch_ms,
        st.missing_chunks,
        st.read_chunks,
        st.recomputed_chunks,
        st.queue_ms,
        st.ttft_ms,
        st.prompt_tokens,
        st.prefill_ms,
        st.output_tokens,
        st.decode_ms,
        st.finish
    )
}

fn print_contexts(v: &[tools::proto::CtxInfo]) {
    println!("{:<34} {:>7} {:>7} {:>12} {:>12} {:>6}  levels", "context", "tokens", "chunks", "resident_KiB", "flash_KiB", "calls");
    for c in v {
        let lv: Vec<String> = c.levels.iter().map(|(k, n)| format!("{k}:{n}")).collect();
        println!(
            "{:<34} {:>7} {:>7} {:>12} {:>12} {:>6}  {}{}",
            c.ctx,
            c.tokens,
            c.chunks,
            c.resident_bytes >> 10,
            c.flash_bytes >> 10,
            c.calls,
            lv.join(" "),
            if c.busy { " (in a call)" } else { "" }
        );
    }
}

fn stats_cmd(json: bool, d: &DaemonArgs) -> Result<()> {
    let s = d.connect()?.stats()?;
    if json {
        println!("{}", serde_json::to_string(&s)?);
        return Ok(());
    }
    println!(
        "policy {}  budget {:.1} MiB (configured {:.1})  resident {:.1} MiB  contexts {}  queue {}  pressure {}",
        s.policy,
        s.budget_bytes as f64 / 1048576.0,
        s.configured_budget_bytes as f64 / 1048576.0,
        s.resident_bytes as f64 / 1048576.0,
        s.contexts,
        s.queue,
        s.pressure
    );
    println!(
        "calls {}  switch latency p50 {:.2} ms  p90 {:.2} ms  p99 {:.2} ms  faults {}  evicted chunks {}  AoT writes {}  sync writes {}",
        s.calls, s.switch_p50_ms, s.switch_p90_ms, s.switch_p99_ms, s.faults, s.evicted_chunks, s.written_aot, s.written_sync
    );
    if s.weights_budget_bytes > 0 {
        println!(
            "weights paged: {:.1} MiB of the budget, {:.1} MiB resident, {:.1} MiB read from flash",
            s.weights_budget_bytes as f64 / 1048576.0,
            s.weights_resident_bytes as f64 / 1048576.0,
            s.weights_read_bytes as f64 / 1048576.0
        );
        if !s.weights_plan.is_empty() {
            println!("{}", s.weights_plan);
        }
    }
    print_contexts(&s.mine);
    Ok(())
}

/// A chat whose conversation is an llmsd context.
fn chat_daemon(d: &DaemonArgs, ctx: &str, max_tokens: usize, temperature: f32, seed: u64, system: Option<String>) -> Result<()> {
    let mut c = d.connect()?;
    let ctx = if ctx == "new" {
        let id = c.new_ctx(system.as_deref())?;
        eprintln!("llms chat: new context {id}");
        id
    } else {
        ctx.to_string()
    };
    chat_turns(&mut |line| {
        let call = tools::proto::Call {
            ctx: ctx.clone(),
            prompt: line.to_string(),
            max_tokens: u32::try_from(max_tokens).unwrap_or(u32::MAX),
            temperature,
            seed,
            stop: Vec::new(),
            raw: false,
        };
        let mut out = std::io::stdout().lock();
        let (_, st) = c.call(&call, &mut |t| {
            let _ = out.write_all(t.as_bytes());
            let _ = out.flush();
        })?;
        println!();
        eprintln!("{}", call_line(&st));
        Ok(())
    })
}

/// Reads the user's messages from stdin, one per line, until an empty line or EOF.
fn chat_turns(turn: &mut dyn FnMut(&str) -> Result<()>) -> Result<()> {
    let stdin = std::io::stdin();
    let mut line = String::new();
    eprintln!("llms chat: type a message, empty line or Ctrl-D to quit");
    loop {
        eprint!("> ");
        line.clear();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            return Ok(());
        }
        turn(line.trim_end())?;
    }
}

/// What every trace experiment shares.
#[derive(clap::Args, Debug)]
struct TraceExp {
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
    #[arg(long, default_value = "docs/results")]
    out_dir: PathBuf,
    /// Where the load profiles are (measured there if missing); runs use fresh stores under it.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    #[command(flatten)]
    m: ModelArgs,
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_string()).collect()
}

#[derive(Subcommand, Debug)]
enum ExperimentCmd {
    /// Fig. 12: perplexity, teacher-forced and free-running greedy agreement vs KV memory.
    AccuracyVsMemory {
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = strings(&["int8", "q4", "q2", "mix:0.75", "mix:0.5", "mix:0.375"]))]
        plans: Vec<String>,
        #[arg(long, default_value_t = 512)]
        ctx: usize,
        #[arg(long, default_value_t = 8)]
        windows: usize,
        #[arg(long, default_value_t = 16)]
        chunk_tokens: usize,
        /// Tokens generated greedily after a prompt of ctx/2 tokens per window (0: skip).
        #[arg(long, default_value_t = 64)]
        generate: usize,
        /// Text files [default: /usr/share/common-licenses/*].
        #[arg(long)]
        corpus: Vec<PathBuf>,
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
        #[arg(long, default_value_t = 16)]
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
struct MaxArgs {
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
    base: tools::config::Config,
    profiles: PathBuf,
    work: PathBuf,
}

impl ExpEnv {
    fn new(t: &TraceExp, policies: &[String]) -> Result<Self> {
        for p in policies {
            mm::Policy::parse(p).with_context(|| format!("policy {p:?}: llms, vllm-sq, vllm-s, swap or lmk"))?;
        }
        if t.calls_per_context < 2 {
            bail!("--calls-per-context must be at least 2: the first call of a context is not a switch");
        }
        let corpus = if t.corpus.is_empty() { tools::trace::default_corpus() } else { t.corpus.clone() };
        let profiles = t.state_dir.clone().unwrap_or_else(tools::loadbench::state_dir);
        std::fs::create_dir_all(&profiles).with_context(|| format!("creating {}", profiles.display()))?;
        let (model, pool) = load(&t.m)?;
        tools::loadbench::load_or_measure(&profiles, &model, &pool, 16, false)?;
        let base = tools::config::Config { model: model_path(&t.m), threads: t.m.threads.unwrap_or(0), ..tools::config::Config::default() };
        let work = profiles.join(format!("experiment-{}", std::process::id()));
        Ok(Self { corpus, base, profiles, work })
    }

    fn done(&self, files: Result<Vec<PathBuf>>) -> Result<()> {
        let _ = std::fs::remove_dir_all(&self.work);
        for f in files? {
            println!("wrote {}", f.display());
        }
        Ok(())
    }
}

fn print_sweep(r: &tools::experiment::SweepRun) {
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
fn experiment_cmd(cmd: ExperimentCmd) -> Result<()> {
    use tools::experiment as ex;
    match cmd {
        ExperimentCmd::AccuracyVsMemory { plans, ctx, windows, chunk_tokens, generate, corpus, out_dir, m } => {
            if !(8..=4096).contains(&ctx) || chunk_tokens == 0 || chunk_tokens > ctx || windows == 0 || generate > 4096 {
                bail!("--ctx must be 8-4096, --chunk-tokens 1..=ctx, --windows at least 1, --generate at most 4096");
            }
            let corpus = if corpus.is_empty() { tools::trace::default_corpus() } else { corpus };
            let s = ex::AccuracyVsMemory { plans, ctx, windows, chunk_tokens, corpus, generate };
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
            for f in ex::write_accuracy(&out_dir, "accuracy_vs_memory", &s, &rows)? {
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
            let dir = state_dir.unwrap_or_else(tools::loadbench::state_dir);
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
    use tools::experiment as ex;
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
    };
    println!("{:<8} {:>8} {:<8} {:>8} {:>12} {:>6}", "budget", "length", "policy", "contexts", "switch_ms", "slid");
    let r = ex::max_contexts(&env.base, &s, &env.work, &env.profiles, &mut |r| {
        println!("{:<8} {:>8} {:<8} {:>8} {:>12.2} {:>6}", r.budget, r.length, r.policy, r.contexts, r.switch_mean_ms, r.slid_calls);
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
enum TraceCmd {
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
        #[arg(long, default_value_t = 16)]
        chunk_tokens: usize,
        #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = ["int8".to_string(), "q4".to_string(), "q2".to_string()])]
        levels: Vec<String>,
        #[arg(long, default_value_t = 0.5)]
        ratio: f64,
        #[arg(long, default_value_t = 2048)]
        max_context_tokens: usize,
        /// Parts of the llms policy to switch off: lctru, compression, pipeline, aot.
        #[arg(long, value_delimiter = ',', num_args = 1..)]
        ablate: Vec<String>,
        /// Send calls at their trace times instead of back to back (idle gaps compressed).
        #[arg(long)]
        realtime: bool,
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

fn trace_cmd(cmd: TraceCmd) -> Result<()> {
    match cmd {
        TraceCmd::Gen { out, contexts, apps, calls, pattern, rate, seed, scale, markov_decay, corpus } => {
            let pattern =
                tools::trace::Pattern::parse(&pattern).with_context(|| format!("--pattern {pattern:?}: random, markov or gaussian"))?;
            let corpus = if corpus.is_empty() { tools::trace::default_corpus() } else { corpus };
            let p = tools::trace::GenParams { contexts, apps, calls, pattern, rate, seed, scale, markov_decay, corpus };
            let (h, recs) = tools::trace::generate(&p)?;
            tools::trace::write(&out, &h, &recs)?;
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
            state_dir,
            out,
            json,
            m,
        } => {
            let (h, recs) = tools::trace::read(&trace)?;
            if socket.is_some() && !ablate.is_empty() {
                bail!("--ablate configures a service this command starts; with --socket, set it in that llmsd's configuration");
            }
            let mut local = None;
            let mut work = None;
            let socket = match socket {
                Some(s) => s,
                None => {
                    let dir = state_dir.unwrap_or_else(tools::loadbench::state_dir);
                    std::fs::create_dir_all(&dir)?;
                    let (model, pool) = load(&m)?;
                    tools::loadbench::load_or_measure(&dir, &model, &pool, chunk_tokens, json)?;
                    drop((model, pool));
                    let w = dir.join(format!("replay-{}", std::process::id()));
                    tools::loadbench::fresh_state(&w, &dir)?;
                    let cfg = tools::config::Config {
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
                        ..tools::config::Config::default()
                    };
                    let l = tools::service::Local::start(cfg)?;
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
            let pace = if realtime { tools::replay::Pace::Realtime } else { tools::replay::Pace::Compressed };
            let results = tools::replay::replay_paced(&socket, &h, &recs, pace, &mut |r| {
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
            let stopped = local.map(tools::service::Local::stop);
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
            let sum = tools::replay::summarize(&results, t0.elapsed().as_secs_f64());
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

#[derive(Subcommand, Debug)]
enum PressureCmd {
    /// Samples and classifies continuously: one line per sample (level, headroom, PSI stall,
    /// reclaim scan rate, cgroup usage, budget target), or JSON lines with --json.
    Watch {
        #[arg(long)]
        json: bool,
        /// Stop after this many samples (0: run until interrupted).
        #[arg(long, default_value_t = 0)]
        count: u64,
        #[command(flatten)]
        p: PressureArgs,
    },
    /// Records samples as JSON lines to FILE (replayable).
    Record {
        file: PathBuf,
        #[arg(long, default_value_t = 100)]
        count: u64,
        #[command(flatten)]
        p: PressureArgs,
    },
    /// Replays recorded (or synthetic) samples through the classifier and controller and
    /// prints the events as JSON lines.
    Replay {
        file: PathBuf,
        /// Budget maximum in bytes.
        #[arg(long, default_value_t = 1 << 30)]
        budget_max: u64,
        #[arg(long, default_value_t = 0)]
        budget_floor: u64,
    },
}

#[derive(Args, Debug, Clone)]
struct PressureArgs {
    /// Monitor this cgroup directory instead of the process's own.
    #[arg(long)]
    cgroup: Option<PathBuf>,
    /// Budget maximum in bytes for the memory LLMS manages.
    #[arg(long, default_value_t = 1 << 30)]
    budget_max: u64,
    #[arg(long, default_value_t = 0)]
    budget_floor: u64,
    /// Sampling interval while calm, in milliseconds.
    #[arg(long, default_value_t = 500)]
    interval_ms: u64,
}

fn pressure(cmd: PressureCmd) -> Result<()> {
    let opts = |p: &PressureArgs| cgroup::MonitorOptions {
        budget_max: p.budget_max,
        budget_floor: p.budget_floor,
        slow_ms: p.interval_ms.max(10),
        fast_ms: (p.interval_ms / 10).max(10),
        ..Default::default()
    };
    match cmd {
        PressureCmd::Watch { json, count, p } => {
            let probe = cgroup::probe(p.cgroup.as_deref());
            let mut n = 0;
            let mut out = std::io::stdout().lock();
            if !json {
                writeln!(
                    out,
                    "{:>8} {:>9} {:>9} {:>12} {:>7} {:>10} {:>12} {:>12}",
                    "t_ms", "level", "headroom", "avail_MiB", "stall%", "scan/s", "cg_MiB", "budget_MiB"
                )?;
            }
            cgroup::run(&probe, opts(&p), &mut |s, e| {
                n += 1;
                let line = if json {
                    json!({"sample": s, "event": e}).to_string()
                } else {
                    format!(
                        "{:>8} {:>9} {:>8.1}% {:>12} {:>7.2} {:>10.0} {:>12} {:>12}",
                        e.t_ms,
                        format!("{:?}", e.level),
                        e.signals.headroom * 100.0,
                        s.mem.available >> 20,
                        e.signals.stall * 100.0,
                        e.signals.scan_rate,
                        s.cgroup.map_or("-".into(), |c| (c.usage >> 20).to_string()),
                        e.budget >> 20
                    )
                };
                writeln!(out, "{line}").is_ok() && (count == 0 || n < count)
            })?;
        }
        PressureCmd::Record { file, count, p } => {
            let probe = cgroup::probe(p.cgroup.as_deref());
            let mut f = std::io::BufWriter::new(std::fs::File::create(&file).with_context(|| format!("creating {}", file.display()))?);
            let mut n = 0;
            let mut err = None;
            cgroup::run(&probe, opts(&p), &mut |s, _| {
                n += 1;
                if let Err(e) = serde_json::to_writer(&mut f, s).map_err(anyhow::Error::from).and_then(|()| writeln!(f).map_err(Into::into))
                {
                    err = Some(e);
                    return false;
                }
                n < count
            })?;
            if let Some(e) = err {
                return Err(e);
            }
            f.flush()?;
            eprintln!("recorded {n} samples to {}", file.display());
        }
        PressureCmd::Replay { file, budget_max, budget_floor } => {
            let text = read_text(&file)?;
            let samples: Vec<cgroup::Sample> = text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
                .map(|(i, l)| serde_json::from_str(l).with_context(|| format!("{}:{}: not a sample", file.display(), i + 1)))
                .collect::<Result<_>>()?;
            for e in cgroup::replay(&samples, cgroup::Thresholds::default(), budget_max, budget_floor) {
                println!("{}", serde_json::to_string(&e)?);
            }
        }
    }
    Ok(())
}

fn model_path(m: &ModelArgs) -> PathBuf {
    if let Some(p) = &m.model {
        return p.clone();
    }
    if let Some(p) = std::env::var_os("LLMS_MODEL") {
        return PathBuf::from(p);
    }
    let local = PathBuf::from(DEFAULT_MODEL);
    if local.exists() {
        return local;
    }
    // Next to the repository the binary was built in (target/<profile>/llms).
    if let Ok(exe) = std::env::current_exe() {
        if let Some(root) = exe.ancestors().nth(3) {
            let p = root.join(DEFAULT_MODEL);
            if p.exists() {
                return p;
            }
        }
    }
    local
}

fn load(m: &ModelArgs) -> Result<(Arc<Model>, Arc<ThreadPool>)> {
    if m.sparsity.is_some() || m.calib_text.is_some() || m.weights_plan {
        bail!("--sparsity, --calib-text and --weights-plan go with generate, bench, perplexity, logits and chat");
    }
    load_model(m)
}

/// [`load`], with Top-K sparsity calibrated when --sparsity asks for it.
type Sparsity = Option<Arc<engine::sparsity::Sparsity>>;
fn load_sparse(m: &ModelArgs) -> Result<(Arc<Model>, Arc<ThreadPool>, Sparsity)> {
    if m.weights_plan {
        return load_planned(m);
    }
    if m.max_sparsity.is_some() {
        bail!("--max-sparsity goes with --weights-plan");
    }
    if m.calib_text.is_some() && m.sparsity.is_none() {
        bail!("--calib-text goes with --sparsity");
    }
    let (model, pool) = load_model(m)?;
    let text = m.calib_text.clone().unwrap_or_else(|| PathBuf::from(CALIB_TEXT));
    let sp = m
        .sparsity
        .map(|t| tools::weights::sparsity::calibrated(&model, &pool, &model_path(m), &tools::loadbench::state_dir(), t, &text))
        .transpose()?;
    Ok((model, pool, sp))
}

fn threads_of(m: &ModelArgs) -> usize {
    m.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The model file, which must exist.
fn existing_model(m: &ModelArgs) -> Result<PathBuf> {
    let path = model_path(m);
    if !path.exists() {
        bail!("model {} not found: run `make demo` (fetches the default model) or pass --model / set LLMS_MODEL", path.display());
    }
    Ok(path)
}

/// --threads, checked.
fn valid_threads(m: &ModelArgs) -> Result<usize> {
    let threads = threads_of(m);
    if threads == 0 || threads > 256 {
        bail!("--threads must be between 1 and 256");
    }
    Ok(threads)
}

/// What the weight planner plans with: `levels` (calibrated on --calib-text) up to
/// --max-sparsity.
fn plan_setup(m: &ModelArgs, levels: &[f32]) -> tools::weights::plan::PlanSetup {
    tools::weights::plan::PlanSetup {
        levels: levels.to_vec(),
        max_sparsity: m.max_sparsity.unwrap_or(0.5),
        calib_text: m.calib_text.clone().unwrap_or_else(|| PathBuf::from(CALIB_TEXT)),
        state_dir: tools::loadbench::state_dir(),
        threads: threads_of(m),
    }
}

/// The weight planner's inputs for this model: `levels` profiled (calibrated on
/// --calib-text), bandwidths measured now.
fn plan_inputs(m: &ModelArgs, levels: &[f32]) -> Result<(mm::weightplan::PlanInputs, Vec<(f32, Sparsity)>)> {
    tools::weights::plan::inputs(&existing_model(m)?, &plan_setup(m, levels))
}

/// `--weights-plan`: the plan for the budget picks the sparsity and the image's group size.
fn load_planned(m: &ModelArgs) -> Result<(Arc<Model>, Arc<ThreadPool>, Sparsity)> {
    if m.sparsity.is_some() || m.weight_format.is_some() || m.weights == Some(WeightsMode::Resident) {
        bail!("--weights-plan chooses the sparsity and layout of paged weights: drop --sparsity, --weight-format and --weights resident");
    }
    let path = existing_model(m)?;
    let threads = valid_threads(m)?;
    let budget = m.weights_budget.unwrap_or(tools::weights::Budget::Percent(100.0));
    let p = tools::weights::plan::load_planned(&path, budget, m.weights_image.clone(), !m.no_preload, &plan_setup(m, &PLAN_LEVELS))?;
    eprintln!("llms: {}", tools::weights::plan::describe(&p.plan));
    let _ = PAGED.set(p.weights);
    Ok((p.model, Arc::new(ThreadPool::new(threads)), p.sparsity))
}

fn load_model(m: &ModelArgs) -> Result<(Arc<Model>, Arc<ThreadPool>)> {
    let path = existing_model(m)?;
    let threads = valid_threads(m)?;
    let paged = m.weights == Some(WeightsMode::Paged) || (m.weights.is_none() && m.weights_budget.is_some());
    if !paged && (m.weights_budget.is_some() || m.weights_image.is_some() || m.no_preload) {
        bail!("--weights-budget, --weights-image and --no-preload go with --weights paged");
    }
    let format = match m.weight_format {
        Some(FormatArg::ChannelMajor) => engine::WeightFormat::ChannelMajor,
        Some(FormatArg::Packed) => engine::WeightFormat::Packed,
        None if m.sparsity.is_some() && !paged => engine::WeightFormat::ChannelMajor,
        None => engine::WeightFormat::Packed,
    };
    // Paged weights with sparsity read by active channel: a channel-major image.
    let image_format = if paged && (format == engine::WeightFormat::ChannelMajor || (m.weight_format.is_none() && m.sparsity.is_some())) {
        engine::weights::ImageFormat::ChannelMajor { span: m.weights_span.unwrap_or(tools::weights::DEFAULT_SPAN) }
    } else {
        engine::weights::ImageFormat::Packed
    };
    let model = if paged {
        let opts = tools::weights::PagedOptions {
            budget: m.weights_budget.unwrap_or(tools::weights::Budget::Percent(100.0)),
            image: m.weights_image.clone(),
            preload: !m.no_preload,
            format: image_format,
        };
        let (model, pw) = tools::weights::load_paged(&path, &opts)?;
        let _ = PAGED.set(pw);
        model
    } else {
        Arc::new(Model::load_as(&path, format).with_context(|| format!("loading {}", path.display()))?)
    };
    Ok((model, Arc::new(ThreadPool::new(threads))))
}

/// One line about the paged weights (budget, residency, reads, hit rate), if weights are paged.
#[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
fn weights_line(tokens: usize) -> Option<String> {
    let pw = PAGED.get()?;
    let s = pw.stats();
    Some(format!(
        "weights: paged{}, budget {:.1} MiB of {:.1} MiB ({:.0}%), resident {:.1} MiB{}, read {:.2} MiB/token, hit rate {:.1}%, faults {} slots, preloaded {} slots{}{}",
        if pw.is_sparse() { " by channel" } else { "" },
        mib(s.budget as usize),
        mib(pw.weight_bytes),
        100.0 * s.budget as f64 / pw.weight_bytes as f64,
        mib(s.resident_bytes as usize),
        // The sparse pager's cache is by use count, with no fixed hot set.
        if pw.is_sparse() { String::new() } else { format!(" (hot {:.1})", mib(s.hot_bytes as usize)) },
        mib(s.bytes_read as usize) / tokens.max(1) as f64,
        100.0 * s.hit_rate(),
        s.fault_slots,
        s.preload_slots,
        pw.preload_precision(s.preload_slots, s.prefetch_used).map_or(String::new(), |p| format!(" (precision {:.1}%)", 100.0 * p)),
        if s.advised_landing > 0 {
            format!(", {:.1}% of reads waited for a preload", 100.0 * s.advised_landing as f64 / s.advised_slots.max(1) as f64)
        } else {
            String::new()
        },
    ))
}

fn read_text(p: &Path) -> Result<String> {
    std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
}

fn encode(model: &Model, text: &str, special: bool) -> Result<Vec<u32>> {
    let tk = &model.tokenizer;
    Ok(tk.encode(text, tk.add_bos, special)?)
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("llms: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Tokenize { text_file, no_special, m } => {
            let (model, _) = load(&m)?;
            let ids = encode(&model, &read_text(&text_file)?, !no_special)?;
            println!("{}", serde_json::to_string(&ids)?);
        }
        Cmd::Logits { prompt_file, top, m } => {
            let (model, pool, sp) = load_sparse(&m)?;
            let ids = encode(&model, &read_text(&prompt_file)?, true)?;
            if ids.is_empty() {
                bail!("the prompt has no tokens");
            }
            let mut s = Session::new(Arc::clone(&model), pool, ids.len());
            s.set_sparsity(sp)?;
            let logits = s.eval(&ids, Logits::Last)?;
            let mut idx: Vec<usize> = (0..logits.len()).collect();
            idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            let top: Vec<_> = idx.iter().take(top).map(|&i| json!({"id": i, "logit": logits[i]})).collect();
            println!("{}", json!({"tokens": ids, "top": top}));
        }
        Cmd::Generate { prompt_file, prompt, max_tokens, temperature, top_k, top_p, seed, chat, json, stats, m } => {
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
        }
        Cmd::Chat { ctx: Some(ctx), d, max_tokens, temperature, seed, system, .. } => {
            chat_daemon(&d, &ctx, max_tokens, temperature, seed, system)?;
        }
        Cmd::Chat { ctx: None, max_tokens, temperature, seed, system, m, .. } => chat_loop(&m, max_tokens, temperature, seed, system)?,
        Cmd::Ctx { cmd } => ctx_cmd(cmd)?,
        Cmd::Stats { json, d } => stats_cmd(json, &d)?,
        Cmd::Perplexity { text_file, ctx, chunks, kv, chunk_tokens, json, m } => {
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
            let (r, ratio) = match kv {
                None if sp.is_some() => {
                    let (r, u) = engine::eval::perplexity_channel_use(&model, pool, &ids, ctx, chunks, sp)?;
                    uses = Some(u);
                    (r, None)
                }
                None => (engine::eval::perplexity(&model, pool, &ids, ctx, chunks)?, None),
                Some(k) => {
                    let plan = engine::eval::KvPlan::parse(&k)
                        .with_context(|| format!("--kv {k:?}: expected f16, int8, q4, q2 or mix:R with 0 < R <= 1"))?;
                    if chunk_tokens == 0 || chunk_tokens > ctx {
                        bail!("--chunk-tokens must be between 1 and --ctx");
                    }
                    // The mix's levels are mm's policy (eq. 2-3), over {int8, q4, q2}.
                    let ratio = if let engine::eval::KvPlan::Mix(r) = plan { r } else { 1.0 };
                    let choose = tools::kvmm::mix_chooser(&model, chunk_tokens, ratio);
                    let (r, ratio) = engine::eval::perplexity_kv(&model, pool, &ids, ctx, chunks, plan, chunk_tokens, &choose, None)?;
                    (r, Some(ratio))
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
                if let Some((read, hits)) = cache {
                    let hits: Vec<String> =
                        CACHE_SHARES.iter().zip(hits).map(|(c, h)| format!("{:.0}%: {:.1}%", 100.0 * c, 100.0 * h)).collect();
                    println!("layer weight bytes read per token: {:.1}%; a hot-channel cache of the most used columns (share of layer bytes: share of reads served) {}", 100.0 * read, hits.join(", "));
                }
            }
        }
        Cmd::Bench { kv, depth, pp, tg, reps, json, m } => bench(&m, &kv, depth, pp, tg, reps, json)?,
        Cmd::BenchUffd { reps, json } => bench_uffd(reps, json)?,
        Cmd::BenchWeights { budgets, tg, reps, no_preload_too, levels, ppl_text, ppl_windows, plan, plan_levels, json, m } => {
            let plan_levels = plan.then_some(plan_levels);
            bench_weights(&m, budgets, tg, reps, no_preload_too, &levels, ppl_text, ppl_windows, plan_levels.as_deref(), json)?;
        }
        Cmd::PlanWeights { budgets, levels, json, m } => plan_weights(&m, &budgets, &levels, json)?,
        Cmd::Profile { chunk_tokens, state_dir, json, m } => profile_cmd(&m, chunk_tokens, state_dir, json)?,
        Cmd::BenchLoad { tokens, reps, chunk_tokens, state_dir, json, staging, m } => {
            bench_load(&m, &tokens, reps, chunk_tokens, state_dir, json, staging)?;
        }
        Cmd::BenchSwitch { tokens, reps, state_dir, json, m } => bench_switch(&m, &tokens, reps, state_dir, json)?,
        Cmd::Trace { cmd } => trace_cmd(cmd)?,
        Cmd::Experiment { cmd } => experiment_cmd(cmd)?,
        Cmd::Report { results, out } => {
            if !results.is_dir() {
                bail!("{}: no such directory (run an experiment first: llms experiment --help)", results.display());
            }
            let r = tools::report::write(&results, &out)?;
            println!("wrote {}: {} figures", out.display(), r.included.len());
            for m in &r.missing {
                println!("not measured yet: {m}");
            }
        }
        Cmd::Doctor { json } => doctor(json),
        Cmd::Pressure { cmd } => pressure(cmd)?,
    }
    Ok(())
}

fn render_chat(model: &Model, msgs: &[Message]) -> Result<String> {
    Ok(model.render_chat(msgs, true)?)
}

#[allow(clippy::cast_precision_loss)]
fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// A `kB` field of /proc/self/status (VmRSS, VmHWM).
#[allow(clippy::cast_precision_loss)]
fn proc_status_kib(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?;
    line[field.len() + 1..].trim().trim_end_matches("kB").trim().parse().ok()
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

fn bench_switch(m: &ModelArgs, tokens: &[usize], reps: usize, state_dir: Option<PathBuf>, json: bool) -> Result<()> {
    if tokens.is_empty() || tokens.iter().any(|&n| !(32..=7000).contains(&n)) || reps == 0 {
        bail!("--tokens must be between 32 and 7000 and --reps at least 1");
    }
    let dir = state_dir.unwrap_or_else(tools::loadbench::state_dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let (model, pool) = load(m)?;
    // The profile first, so every run plans with it.
    tools::loadbench::load_or_measure(&dir, &model, &pool, 16, json)?;
    drop((model, pool));
    let base = tools::config::Config { model: model_path(m), threads: m.threads.unwrap_or(0), ..tools::config::Config::default() };
    let work = dir.join(format!("bench-switch-{}", std::process::id()));
    let rows = tools::switchbench::run(&base, tokens, reps, &work, &dir);
    let _ = std::fs::remove_dir_all(&work);
    let rows = rows?;
    if json {
        println!("{}", serde_json::to_string(&rows)?);
        return Ok(());
    }
    println!("{:>7} {:<22} {:>10} {:>10} {:>8} {:>6} {:>8}", "tokens", "scenario", "switch_ms", "ttft_ms", "missing", "read", "recomp");
    for r in &rows {
        println!(
            "{:>7} {:<22} {:>10.2} {:>10.2} {:>8.0} {:>6.0} {:>8.0}",
            r.tokens, r.scenario, r.switch_ms, r.ttft_ms, r.missing_chunks, r.read_chunks, r.recomputed_chunks
        );
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn bench_weights(
    m: &ModelArgs,
    budgets: Vec<f64>,
    tg: usize,
    reps: usize,
    no_preload_too: bool,
    levels: &[f32],
    ppl_text: Option<PathBuf>,
    ppl_windows: usize,
    plan_levels: Option<&[f32]>,
    json: bool,
) -> Result<()> {
    let path = model_path(m);
    let threads = threads_of(m);
    let ppl_text = ppl_text.map(|p| read_text(&p).map(|t| (t, ppl_windows))).transpose()?;
    if let Some(&s) = levels.iter().find(|s| !(0.0..1.0).contains(*s)) {
        bail!("--levels: {s} is not a sparsity in [0, 1)");
    }
    let mut sparsity = Vec::new();
    if levels.iter().any(|&s| s > 0.0) {
        let (model, pool) = (Arc::new(Model::load(&path)?), Arc::new(ThreadPool::new(threads)));
        let text = m.calib_text.clone().unwrap_or_else(|| PathBuf::from(CALIB_TEXT));
        for &s in levels {
            let sp = (s > 0.0)
                .then(|| tools::weights::sparsity::calibrated(&model, &pool, &path, &tools::loadbench::state_dir(), s, &text))
                .transpose()?;
            sparsity.push((s, sp));
        }
    }
    let mut plans = Vec::new();
    if let Some(pl) = plan_levels {
        let (inputs, thresholds) = plan_inputs(m, pl)?;
        for &b in &budgets {
            let plan = inputs.plan(tools::weights::plan::budget_bytes(tools::weights::Budget::Percent(b), &inputs))?;
            let sp = thresholds.iter().find(|(l, _)| *l == plan.sparsity).and_then(|(_, sp)| sp.clone());
            plans.push((tools::weights::PlanState { inputs: inputs.clone(), plan }, sp));
        }
    }
    let o = tools::weights::bench::BenchOptions {
        budgets,
        tg,
        reps,
        threads,
        image: m.weights_image.clone(),
        no_preload_too,
        ppl_text,
        sparsity,
        plans,
    };
    let rows = tools::weights::bench::run(&path, &o)?;
    if json {
        println!("{}", serde_json::to_string(&rows)?);
        return Ok(());
    }
    println!("model {} | threads {threads} | tg{tg}, median of {reps}", path.display());
    println!(
        "{:<9} {:<13} {:>2} {:>5} {:>8} {:>7} {:>8} {:>7} {:>10} {:>8} {:>9} {:>9} {:>9} {:>8} {:>12} {:>12}",
        "weights",
        "layout",
        "N",
        "S",
        "budget",
        "preload",
        "tg tok/s",
        "vs res",
        "MiB read/t",
        "hit",
        "precision",
        "faults/t",
        "floor t/s",
        "ppl",
        "plan t/s,MiB",
        "demand t/s,MiB"
    );
    for r in &rows {
        println!(
            "{:<9} {:<13} {:>2} {:>5.2} {:>8.1} {:>7} {:>8.1} {:>7.3} {:>10.2} {:>7.1}% {:>9} {:>9.1} {:>9} {:>8} {:>12} {:>12}",
            r.weights,
            r.layout,
            if r.span > 0 { r.span.to_string() } else { "-".into() },
            r.sparsity,
            r.budget_mib,
            if r.preload { "yes" } else { "no" },
            r.tg_tok_s,
            r.vs_resident,
            r.read_mib_per_token,
            100.0 * r.hit_rate,
            r.preload_precision.map_or("-".into(), |p| format!("{:.1}%", 100.0 * p)),
            r.faults_per_token,
            r.floor_tok_s.map_or("-".into(), |f| format!("{f:.1}")),
            r.ppl.map_or("-".into(), |p| format!("{p:.4}")),
            r.planned_tok_s.zip(r.planned_read_mib).map_or("-".into(), |(t, m)| format!("{t:.1},{m:.1}")),
            r.planned_demand_tok_s.zip(r.planned_demand_read_mib).map_or("-".into(), |(t, m)| format!("{t:.1},{m:.1}")),
        );
    }
    Ok(())
}

/// `llms plan-weights`: the inputs, then the plan for each budget.
#[allow(clippy::cast_precision_loss)]
fn plan_weights(m: &ModelArgs, budgets: &[f64], levels: &[f32], json: bool) -> Result<()> {
    if let Some(&b) = budgets.iter().find(|&&b| !(b > 0.0 && b <= 100.0)) {
        bail!("--budgets: {b} is not a percentage in (0, 100]");
    }
    let (inputs, _) = plan_inputs(m, levels)?;
    let plans: Vec<_> = budgets
        .iter()
        .map(|&b| inputs.plan(tools::weights::plan::budget_bytes(tools::weights::Budget::Percent(b), &inputs)))
        .collect::<Result<_, _>>()?;
    if json {
        println!("{}", json!({"bandwidths": inputs.bw, "levels": inputs.levels, "plans": plans}));
        return Ok(());
    }
    let mib = |b: f64| b / f64::from(1 << 20);
    let sh = &inputs.shape;
    println!(
        "model {}: {} layers of {:.2} MiB, head {:.1} MiB, a channel's column {} bytes; weight bytes {:.1} MiB",
        model_path(m).display(),
        sh.n_layers,
        mib(sh.layer_bytes as f64),
        mib(sh.head_bytes as f64),
        sh.column_bytes,
        mib(sh.weight_bytes() as f64)
    );
    let flash: Vec<String> = inputs.bw.flash.iter().map(|&(n, b)| format!("{} KiB {:.0}", n >> 10, b / 1e6)).collect();
    println!(
        "bandwidth MB/s: computing (the engine over its weights, or memory if lower) {:.0}, packed kernels {:.0}; installing pages {:.0}; flash reads of {}",
        inputs.bw.mem / 1e6,
        inputs.packed_mem / 1e6,
        inputs.bw.install / 1e6,
        flash.join(", ")
    );
    println!("{:>5} {:>10} {:>15} {:>15} {:>13}", "S", "read/token", "predicted 1/4/8", "hit at 25/50%", "");
    for l in &inputs.levels {
        println!(
            "{:>5.2} {:>9.1}% {:>4.0}%/{:>3.0}%/{:>3.0}% {:>6.1}%/{:>5.1}%",
            l.sparsity,
            100.0 * l.read_share,
            100.0 * l.similarity[0],
            100.0 * l.group_similarity(4),
            100.0 * l.group_similarity(8),
            100.0 * l.hit_rate(0.25),
            100.0 * l.hit_rate(0.5)
        );
    }
    println!(
        "{:>7} {:>9} {:>5} {:>3} {:>9} {:>9} {:>9} {:>6} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "budget",
        "MiB",
        "S",
        "N",
        "group MiB",
        "cache MiB",
        "room MiB",
        "hit",
        "MiB read/t",
        "preload",
        "comp",
        "onload",
        "tok/s",
        "on demand",
        "demand MiB"
    );
    for (b, p) in budgets.iter().zip(&plans) {
        let ms = |t: f64| format!("{:.2}ms", 1e3 * t);
        println!(
            "{:>6}% {:>9.1} {:>5.2} {:>3} {:>9.2} {:>9.1} {:>9.1} {:>5.1}% {:>10.1} {:>9} {:>9} {:>9} {:>9.1} {:>9.1} {:>10.1}",
            b,
            mib(p.budget as f64),
            p.sparsity,
            if p.packed { "pk".to_string() } else { p.span.to_string() },
            mib(p.group_bytes as f64),
            mib(p.cache_bytes as f64),
            mib(p.preload_room as f64),
            100.0 * p.hit_rate,
            mib(p.read_bytes),
            ms(p.times.preload),
            ms(p.times.comp),
            ms(p.times.onload),
            p.tok_s(),
            p.demand_tok_s(),
            mib(p.demand_read_bytes)
        );
    }
    Ok(())
}

fn bench_uffd(reps: usize, json: bool) -> Result<()> {
    let rows = uffd_handler::bench::run(reps)?;
    if json {
        let v: Vec<_> = rows.iter().map(|r| json!({"name": r.name, "bytes": r.bytes, "median_us": r.median_us})).collect();
        println!("{}", serde_json::to_string(&v)?);
        return Ok(());
    }
    println!("{:<52} {:>12}", "operation (median)", "µs");
    for r in &rows {
        println!("{:<52} {:>12.2}", r.name, r.median_us);
    }
    Ok(())
}

/// One line per facility: present/usable, and the fix when not.
fn doctor(json: bool) {
    let mut checks = Vec::new();
    match uffd_handler::Pager::new() {
        Ok(p) => {
            let c = p.capabilities();
            checks.push(json!({"facility": "userfaultfd", "ok": true,
                "detail": format!("created via {:?}; dirty tracking (WP_ASYNC): {}; UFFDIO_MOVE: {}; UFFDIO_POISON: {}", c.origin, c.wp_async, c.r#move, c.poison)}));
        }
        Err(e) => checks.push(json!({"facility": "userfaultfd", "ok": false, "detail": e.to_string()})),
    }
    let p = cgroup::probe(None);
    checks.push(match &p.psi {
        Ok(path) => json!({"facility": "PSI", "ok": true, "detail": format!("{} readable; triggers {}", path.display(),
            if p.cap_sys_resource { "with any window (CAP_SYS_RESOURCE)" } else { "with windows rounded to 2 s (no CAP_SYS_RESOURCE)" })}),
        Err(e) => {
            json!({"facility": "PSI", "ok": false, "detail": format!("{e}; the monitor falls back to MemAvailable and vmstat polling")})
        }
    });
    checks.push(match &p.cgroup {
        Ok((dir, kind)) => json!({"facility": "memory cgroup", "ok": true, "detail": format!("{:?} mode, {kind:?} files at {}", p.cgroup_mode, dir.display())}),
        Err(e) => json!({"facility": "memory cgroup", "ok": false, "detail": format!("{e}; give the service a cgroup (llms pressure --cgroup DIR) or rely on system-wide signals")}),
    });
    let simd = engine::kernels::simd_name();
    checks.push(json!({"facility": "cpu kernels", "ok": simd != "scalar", "detail": format!("{simd} (AVX2+FMA+F16C {})", if simd == "scalar" { "missing: slow scalar code" } else { "present" })}));
    if json {
        println!("{}", serde_json::to_string(&checks).unwrap_or_default());
        return;
    }
    for c in &checks {
        let ok = c["ok"].as_bool().unwrap_or(false);
        println!("[{}] {}: {}", if ok { " ok " } else { "FAIL" }, c["facility"].as_str().unwrap_or(""), c["detail"].as_str().unwrap_or(""));
    }
}

#[allow(clippy::cast_precision_loss)]
#[allow(clippy::too_many_arguments)]
fn bench(m: &ModelArgs, kv: &str, depth: usize, pp: usize, tg: usize, reps: usize, json: bool) -> Result<()> {
    use engine::kv::KvFormat;
    let (model, pool, sp) = load_sparse(m)?;
    if pp == 0 || tg == 0 || reps == 0 || depth + pp.max(tg) > model.config.ctx_len {
        bail!("--pp, --tg and --reps must be positive and depth + pp (and depth + tg) within the context");
    }
    let (base, lower) = match KvFormat::parse(kv) {
        Some(f) if f.is_base() => (f, None),
        Some(f) => (KvFormat::Int8, Some(f)),
        None => bail!("--kv must be f16, int8, q4 or q2"),
    };
    // Token ids as llama-bench uses: arbitrary valid ids, here a fixed pseudo-random sequence.
    let vocab = u32::try_from(model.config.vocab).context("vocab")?;
    let prompt: Vec<u32> = (0..u32::try_from(depth + pp.max(tg))?).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) % vocab).collect();
    let opts = engine::model::SessionOptions { base, ..engine::model::SessionOptions::new(depth + pp.max(tg)) };
    let mut s = Session::with_options(Arc::clone(&model), Arc::clone(&pool), opts);
    s.set_sparsity(sp.clone())?;
    // Both runs start from `depth` tokens of context (0: an empty one, as llama-bench's
    // pp512/tg128), its full chunks lowered to the --kv level when that is q4/q2.
    let at_depth = |s: &mut Session| -> Result<()> {
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
    let mut pp_rates = Vec::new();
    let mut tg_rates = Vec::new();
    for rep in 0..=reps {
        at_depth(&mut s)?;
        let t = Instant::now();
        s.eval(&prompt[depth..depth + pp], Logits::Last)?;
        let pp_s = t.elapsed().as_secs_f64();
        at_depth(&mut s)?;
        let mut tok = prompt[depth];
        let t = Instant::now();
        for _ in 0..tg {
            tok = engine::sampler::argmax(s.eval(&[tok], Logits::Last)?);
        }
        let tg_s = t.elapsed().as_secs_f64();
        if rep > 0 {
            // rep 0 is the warm-up.
            pp_rates.push(pp as f64 / pp_s);
            tg_rates.push(tg as f64 / tg_s);
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (ppr, tgr) = (med(&mut pp_rates), med(&mut tg_rates));
    let format_name = if model.uses_image() {
        "paged"
    } else if model.is_channel_major() {
        "channel-major"
    } else {
        "packed"
    };
    if json {
        println!(
            "{}",
            json!({"pp": pp, "tg": tg, "depth": depth, "kv": lower.unwrap_or(base).name(), "threads": pool.threads(), "simd": engine::kernels::simd_name(), "weight_format": format_name, "sparsity": m.sparsity, format!("pp{pp}_tok_s"): ppr, format!("tg{tg}_tok_s"): tgr})
        );
    } else {
        println!(
            "model {} | threads {} | kernels {} | kv {} | depth {depth} | weights {format_name}{}",
            model.file.path.display(),
            pool.threads(),
            engine::kernels::simd_name(),
            lower.unwrap_or(base).name(),
            m.sparsity.map_or(String::new(), |s| format!(" | sparsity {s}"))
        );
        println!("pp{pp}: {ppr:.1} tok/s (median of {reps})");
        println!("tg{tg}: {tgr:.1} tok/s (median of {reps})");
    }
    Ok(())
}

fn check_chunk_tokens(ct: usize) -> Result<()> {
    if ct == 0 || ct > 4096 {
        bail!("--chunk-tokens must be between 1 and 4096");
    }
    Ok(())
}

fn profile_cmd(m: &ModelArgs, chunk_tokens: usize, state_dir: Option<PathBuf>, json: bool) -> Result<()> {
    check_chunk_tokens(chunk_tokens)?;
    let (model, pool) = load(m)?;
    let dir = state_dir.unwrap_or_else(tools::loadbench::state_dir);
    let p = tools::loadbench::measure_profile(&dir, &model, &pool, chunk_tokens)?;
    let codec = tools::kvmm::EngineCodec::new(&model, chunk_tokens);
    let path = tools::loadbench::profile_path(&dir, &codec);
    p.save(&path)?;
    if json {
        println!("{}", serde_json::to_string(&json!({"path": path, "profile": p}))?);
    } else {
        println!("T_re(x chunks) = {:.3} ms + {:.3} ms * x", p.recompute.fixed * 1e3, p.recompute.per_unit * 1e3);
        println!("T_io(m bytes)  = {:.3} ms + m / {:.0} MB/s", p.io.fixed * 1e3, 1e-6 / p.io.per_unit.max(1e-18));
        println!("saved to {}", path.display());
    }
    Ok(())
}

fn staging_arg(s: &str) -> Result<usize, String> {
    tools::size::parse_bytes(s).map_err(|e| e.to_string())
}

fn bench_load(
    m: &ModelArgs,
    sizes: &[usize],
    reps: usize,
    chunk_tokens: usize,
    state_dir: Option<PathBuf>,
    json: bool,
    staging: usize,
) -> Result<()> {
    use mm::Strategy;
    use tools::loadbench as lb;
    check_chunk_tokens(chunk_tokens)?;
    if reps == 0 || reps > 1000 {
        bail!("--reps must be between 1 and 1000");
    }
    let (model, pool) = load(m)?;
    if let Some(&t) = sizes.iter().find(|&&t| t < chunk_tokens || t + chunk_tokens > model.config.ctx_len) {
        bail!("--tokens {t}: each size must be between --chunk-tokens and the model's context ({})", model.config.ctx_len);
    }
    let dir = state_dir.unwrap_or_else(lb::state_dir);
    let profile = lb::load_or_measure(&dir, &model, &pool, chunk_tokens, json)?;
    let run_dir = dir.join(format!("bench-load-{}", std::process::id()));
    let mut rows = Vec::new();
    if !json {
        println!(
            "tokens | chunks |    MB | floor ms |  read ms | recompute ms | planned ms (read+recomp) | planned / min(floor, recompute)"
        );
    }
    for &n in sizes {
        let max_chunks = n.div_ceil(chunk_tokens) + 2;
        let mut mm = lb::manager(
            &run_dir,
            &model,
            chunk_tokens,
            lb::mm_config(mm::Policy::Llms, &[engine::kv::KvFormat::Int8], 1.0, max_chunks),
            Some(profile.clone()),
        )?;
        mm.set_load_staging(staging)?;
        let toks = lb::synthetic_tokens(&model, n);
        let id = n as u64;
        let mut s = lb::build_context(&mut mm, id, &model, &pool, &toks, chunk_tokens)?;
        let all = n.div_ceil(chunk_tokens);
        let (mut floor, mut read, mut rec, mut plan) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut bytes, mut split) = (0u64, (0usize, 0usize));
        for _ in 0..reps {
            // The floor is taken both right before and right after the read load: on a shared
            // VM's disk two back-to-back reads of the same records can differ by 1.5x, and one
            // position only would favour one side.
            let before = lb::read_bandwidth(mm.store(), id, all)?;
            let r = lb::timed_load(&mut mm, id, &mut s, all, Strategy::AllRead)?;
            read.push(r.seconds);
            bytes = r.read_bytes;
            floor.push(bytes as f64 / before);
            floor.push(bytes as f64 / lb::read_bandwidth(mm.store(), id, all)?);
            rec.push(lb::timed_load(&mut mm, id, &mut s, all, Strategy::AllRecompute)?.seconds);
            let r = lb::timed_load(&mut mm, id, &mut s, all, Strategy::Planned)?;
            plan.push(r.seconds);
            split = (r.read, r.recomputed);
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (f, rd, rc, pl) = (med(&mut floor), med(&mut read), med(&mut rec), med(&mut plan));
        let ratio_best = pl / f.min(rc).max(1e-12);
        if json {
            rows.push(json!({"tokens": n, "chunks": all, "bytes": bytes, "floor_s": f, "read_s": rd, "recompute_s": rc, "planned_s": pl, "planned_read": split.0, "planned_recomputed": split.1, "planned_over_best": ratio_best}));
        } else {
            println!(
                "{n:>6} | {all:>6} | {:>5.1} | {:>8.1} | {:>8.1} | {:>12.1} | {:>10.1} ({:>3}+{:<3})      | {ratio_best:.2}x",
                bytes as f64 / 1e6,
                f * 1e3,
                rd * 1e3,
                rc * 1e3,
                pl * 1e3,
                split.0,
                split.1
            );
        }
        mm.delete(id)?;
    }
    let _ = std::fs::remove_dir_all(&run_dir);
    if json {
        println!("{}", serde_json::to_string(&json!({"reps": reps, "staging_bytes": staging, "profile": profile, "sizes": rows}))?);
    } else {
        println!(
            "medians of {reps} (the floor: of {} reads, before and after each read load); load staging {:.0} MiB; profile: T_re = {:.2} ms + {:.2} ms/chunk, T_io = {:.2} ms + {:.0} MB/s",
            2 * reps,
            staging as f64 / f64::from(1u32 << 20),
            profile.recompute.fixed * 1e3,
            profile.recompute.per_unit * 1e3,
            profile.io.fixed * 1e3,
            1e-6 / profile.io.per_unit.max(1e-18)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    /// `--help` shows list defaults space-separated; both that form and commas are accepted.
    #[test]
    fn lists_take_spaces_or_commas() {
        for args in [&["--variants", "llms", "no-aot", "--contexts", "4", "8"][..], &["--variants", "llms,no-aot", "--contexts", "4,8"]] {
            let cli = Cli::try_parse_from(["llms", "experiment", "ablation"].iter().chain(args)).unwrap();
            let Cmd::Experiment { cmd: ExperimentCmd::Ablation { variants, contexts, .. }, .. } = cli.cmd else {
                panic!("parsed as {:?}", cli.cmd)
            };
            assert_eq!((variants, contexts), (vec!["llms".to_string(), "no-aot".to_string()], vec![4, 8]));
        }
        assert!(Cli::try_parse_from(["llms", "experiment", "ablation", "--contexts", "4", "x"]).is_err(), "a bad list item is an error");
    }
}

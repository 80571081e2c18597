//! The `llms` command line, one room per command family: [`model`] (the model alone:
//! tokenize, logits, generate, chat, perplexity, bench), [`service`] (a running llmsd's
//! contexts and figures), [`mod@bench`] (switch-in, load and userfaultfd costs, the load profile),
//! [`experiment`] (traces, the paper's experiments, the report), [`pressure`] (the monitor),
//! [`weights`] (paged-weight benches and plans), [`doctor`]. This file holds what several
//! share: the model arguments (flattened into each command that loads the model), the daemon
//! arguments, and loading the model as they ask. `src/bin/llms.rs` is only the parser.

pub mod bench;
pub mod doctor;
pub mod experiment;
pub mod lab;
pub mod model;
pub mod pressure;
pub mod record;
pub mod service;
pub mod weights;

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ::engine::chat::Message;
use ::engine::{Model, ThreadPool};
use anyhow::{bail, Context, Result};
use clap::Args;

use llmsd::weights::plan::{DEFAULT_CALIB_TEXT as CALIB_TEXT, PLAN_LEVELS};

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// GGUF model file, or a fetched model's name: smollm2 (`make model`), gemma3 (`make
    /// model-gemma3`) [default: $LLMS_MODEL, else smollm2]
    #[arg(long, global = true)]
    model: Option<PathBuf>,
    /// Worker threads [default: number of cores]
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// Where the weights live: `resident` (packed in memory), `paged` (served from a weight
    /// image on flash under --weights-budget; docs/weights.md) or `mmap` (the same image mapped
    /// from its file, paged by the kernel's page cache: the baseline for `paged`) [default:
    /// resident, paged when --weights-budget is given]
    #[arg(long, global = true, value_enum)]
    weights: Option<WeightsMode>,
    /// Weight budget with paged weights: bytes (48M) or a share of the weight bytes (50%)
    /// [default: 100%]
    #[arg(long, global = true)]
    weights_budget: Option<llmsd::weights::Budget>,
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

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatArg {
    Packed,
    ChannelMajor,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightsMode {
    Resident,
    Paged,
    /// The packed weight image mapped from its file and paged by the kernel's page cache (the
    /// baseline paged weights are compared with; docs/lab.md).
    Mmap,
}

/// The paged weights of the model `load` loaded, if any (for their statistics).
pub(crate) static PAGED: std::sync::OnceLock<Arc<llmsd::weights::PagedWeights>> = std::sync::OnceLock::new();

#[derive(Args, Debug, Clone)]
pub struct DaemonArgs {
    /// llmsd's socket [default: $LLMS_SOCKET, else $XDG_RUNTIME_DIR/llms/llmsd.sock, else /run/llms/llmsd.sock]
    #[arg(long)]
    socket: Option<PathBuf>,
    /// The app name to bind as (contexts belong to an app of a user).
    #[arg(long, default_value = "llms-cli")]
    app: String,
}

impl DaemonArgs {
    fn connect(&self) -> Result<llmsd::client::Client> {
        let socket = self.socket.clone().unwrap_or_else(llmsd::client::default_socket);
        Ok(llmsd::client::Client::connect(&socket, &self.app)?)
    }
}

/// Reads the user's messages from stdin, one per line, until an empty line or EOF.
pub(crate) fn chat_turns(turn: &mut dyn FnMut(&str) -> Result<()>) -> Result<()> {
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

pub(crate) fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_string()).collect()
}

pub(crate) fn model_path(m: &ModelArgs) -> PathBuf {
    match &m.model {
        Some(p) => llmsd::model_file(p),
        None => llmsd::default_model(),
    }
}

pub(crate) fn load(m: &ModelArgs) -> Result<(Arc<Model>, Arc<ThreadPool>)> {
    if m.sparsity.is_some() || m.calib_text.is_some() || m.weights_plan {
        bail!("--sparsity, --calib-text and --weights-plan go with generate, bench, perplexity, logits and chat");
    }
    load_model(m)
}

/// The model file's tokenizer alone (`llms tokenize`): no weight is read, so a file of any
/// architecture whose vocabulary we read tokenizes. Flags about weights are refused, as
/// [`load`] refuses flags that do not apply.
pub(crate) fn load_tokenizer(m: &ModelArgs) -> Result<::engine::tokenizer::Tokenizer> {
    if m.sparsity.is_some() || m.calib_text.is_some() || m.weights_plan {
        bail!("--sparsity, --calib-text and --weights-plan go with generate, bench, perplexity, logits and chat");
    }
    if m.weights.is_some()
        || m.weights_budget.is_some()
        || m.weights_image.is_some()
        || m.no_preload
        || m.weight_format.is_some()
        || m.max_sparsity.is_some()
    {
        bail!("tokenize reads only the vocabulary: the --weights*, --no-preload and --max-sparsity flags do not apply");
    }
    let path = existing_model(m)?;
    let file = ::engine::gguf::GgufFile::open(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(::engine::tokenizer::Tokenizer::from_gguf(&file)?)
}

/// Top-K sparsity thresholds a session computes with, if any.
pub(crate) type Sparsity = Option<Arc<::engine::sparsity::Sparsity>>;

/// [`load`], with Top-K sparsity calibrated when --sparsity asks for it.
pub(crate) fn load_sparse(m: &ModelArgs) -> Result<(Arc<Model>, Arc<ThreadPool>, Sparsity)> {
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
        .map(|t| llmsd::weights::sparsity::calibrated(&model, &pool, &model_path(m), &llmsd::profile::state_dir(), t, &text))
        .transpose()?;
    Ok((model, pool, sp))
}

pub(crate) fn threads_of(m: &ModelArgs) -> usize {
    m.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The model file, which must exist.
pub(crate) fn existing_model(m: &ModelArgs) -> Result<PathBuf> {
    let path = model_path(m);
    if !path.exists() {
        let names = llmsd::MODELS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ");
        bail!("model {} not found: run `make demo` (fetches the default model; `make model-gemma3` Gemma 3) or pass --model / set LLMS_MODEL (a GGUF file or one of {names})", path.display());
    }
    Ok(path)
}

/// --threads, checked.
pub(crate) fn valid_threads(m: &ModelArgs) -> Result<usize> {
    let threads = threads_of(m);
    if threads == 0 || threads > 256 {
        bail!("--threads must be between 1 and 256");
    }
    Ok(threads)
}

/// What the weight planner plans with: `levels` (calibrated on --calib-text) up to
/// --max-sparsity.
pub(crate) fn plan_setup(m: &ModelArgs, levels: &[f32]) -> llmsd::weights::plan::PlanSetup {
    llmsd::weights::plan::PlanSetup {
        levels: levels.to_vec(),
        max_sparsity: m.max_sparsity.unwrap_or(0.5),
        calib_text: m.calib_text.clone().unwrap_or_else(|| PathBuf::from(CALIB_TEXT)),
        state_dir: llmsd::profile::state_dir(),
        threads: threads_of(m),
    }
}

/// The weight planner's inputs for this model: `levels` profiled (calibrated on
/// --calib-text), bandwidths measured now.
pub(crate) fn plan_inputs(m: &ModelArgs, levels: &[f32]) -> Result<(mm::weightplan::PlanInputs, Vec<(f32, Sparsity)>)> {
    llmsd::weights::plan::inputs(&existing_model(m)?, &plan_setup(m, levels))
}

/// `--weights-plan`: the plan for the budget picks the sparsity and the image's group size.
pub(crate) fn load_planned(m: &ModelArgs) -> Result<(Arc<Model>, Arc<ThreadPool>, Sparsity)> {
    if m.sparsity.is_some() || m.weight_format.is_some() || matches!(m.weights, Some(WeightsMode::Resident | WeightsMode::Mmap)) {
        bail!(
            "--weights-plan chooses the sparsity and layout of paged weights: drop --sparsity, --weight-format and --weights resident/mmap"
        );
    }
    let path = existing_model(m)?;
    let threads = valid_threads(m)?;
    let budget = m.weights_budget.unwrap_or(llmsd::weights::Budget::Percent(100.0));
    let p = llmsd::weights::plan::load_planned(&path, budget, m.weights_image.clone(), !m.no_preload, &plan_setup(m, &PLAN_LEVELS))?;
    eprintln!("llms: {}", llmsd::weights::plan::describe(&p.plan));
    let _ = PAGED.set(p.weights);
    Ok((p.model, Arc::new(ThreadPool::new(threads)), p.sparsity))
}

pub(crate) fn load_model(m: &ModelArgs) -> Result<(Arc<Model>, Arc<ThreadPool>)> {
    let path = existing_model(m)?;
    let threads = valid_threads(m)?;
    if m.weights == Some(WeightsMode::Mmap) {
        if m.weights_budget.is_some() || m.no_preload || m.sparsity.is_some() || m.weight_format == Some(FormatArg::ChannelMajor) {
            bail!("--weights mmap maps the packed image whole (the kernel decides what stays): no --weights-budget, --no-preload, --sparsity or channel-major");
        }
        let (model, _) = llmsd::weights::load_mapped(&path, m.weights_image.clone())?;
        return Ok((model, Arc::new(ThreadPool::new(threads))));
    }
    let paged = m.weights == Some(WeightsMode::Paged) || (m.weights.is_none() && m.weights_budget.is_some());
    if !paged && (m.weights_budget.is_some() || m.weights_image.is_some() || m.no_preload) {
        bail!("--weights-budget, --weights-image and --no-preload go with --weights paged");
    }
    let format = match m.weight_format {
        Some(FormatArg::ChannelMajor) => ::engine::WeightFormat::ChannelMajor,
        Some(FormatArg::Packed) => ::engine::WeightFormat::Packed,
        None if m.sparsity.is_some() && !paged => ::engine::WeightFormat::ChannelMajor,
        None => ::engine::WeightFormat::Packed,
    };
    // Paged weights with sparsity read by active channel: a channel-major image.
    let image_format = if paged && (format == ::engine::WeightFormat::ChannelMajor || (m.weight_format.is_none() && m.sparsity.is_some())) {
        ::engine::weights::ImageFormat::ChannelMajor { span: m.weights_span.unwrap_or(llmsd::weights::DEFAULT_SPAN) }
    } else {
        ::engine::weights::ImageFormat::Packed
    };
    let model = if paged {
        let opts = llmsd::weights::PagedOptions {
            budget: m.weights_budget.unwrap_or(llmsd::weights::Budget::Percent(100.0)),
            image: m.weights_image.clone(),
            preload: !m.no_preload,
            format: image_format,
        };
        let (model, pw) = llmsd::weights::load_paged(&path, &opts)?;
        let _ = PAGED.set(pw);
        model
    } else {
        Arc::new(Model::load_as(&path, format).with_context(|| format!("loading {}", path.display()))?)
    };
    Ok((model, Arc::new(ThreadPool::new(threads))))
}

/// One line about the paged weights (budget, residency, reads, hit rate), if weights are paged.
#[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
pub(crate) fn weights_line(tokens: usize) -> Option<String> {
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

pub(crate) fn read_text(p: &Path) -> Result<String> {
    std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
}

pub(crate) fn encode(model: &Model, text: &str, special: bool) -> Result<Vec<u32>> {
    let tk = &model.tokenizer;
    Ok(tk.encode(text, tk.add_bos, special)?)
}

pub(crate) fn render_chat(model: &Model, msgs: &[Message]) -> Result<String> {
    Ok(model.render_chat(msgs, true)?)
}

#[allow(clippy::cast_precision_loss)]
pub(crate) fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// A `kB` field of /proc/self/status (VmRSS, VmHWM).
#[allow(clippy::cast_precision_loss)]
pub(crate) fn proc_status_kib(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?;
    line[field.len() + 1..].trim().trim_end_matches("kB").trim().parse().ok()
}

pub(crate) fn check_chunk_tokens(ct: usize) -> Result<()> {
    if ct == 0 || ct > 4096 {
        bail!("--chunk-tokens must be between 1 and 4096");
    }
    Ok(())
}

pub(crate) fn staging_arg(s: &str) -> Result<usize, String> {
    llmsd::size::parse_bytes(s).map_err(|e| e.to_string())
}

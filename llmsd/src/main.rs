//! `llmsd`: the LLMS system service. Loads the model once and serves apps' contexts over a
//! Unix socket (docs/llmsd.md: configuration, protocol, running it under systemd or init).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Parser;
use llmsd::config::Config;
use llmsd::service::{bind_socket, HttpListeners, Service};

#[derive(Parser, Debug)]
#[command(name = "llmsd", version, about = "LLMS: the LLM system service")]
struct Cli {
    /// TOML configuration file (docs/llmsd.md); the flags below override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// GGUF model file, or a fetched model's name (smollm2, gemma3) [default: $LLMS_MODEL, else
    /// smollm2]
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Socket permission bits, octal (e.g. 0660).
    #[arg(long)]
    socket_mode: Option<String>,
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Memory for KV chunks, e.g. 64MiB.
    #[arg(long)]
    budget: Option<String>,
    /// Page the weights under this part of the budget: bytes or a share of the weights (50%).
    #[arg(long)]
    weights_budget: Option<String>,
    /// The weight image file (default: next to the model).
    #[arg(long)]
    weights_image: Option<PathBuf>,
    /// Page the weights as the planner chooses for --weights-budget (sparsity, layers per
    /// group, cache, preload room); see docs/weights.md.
    #[arg(long)]
    weights_plan: bool,
    /// Highest sparsity the weight plan may choose (above 0 the output changes) [default: 0].
    #[arg(long)]
    weights_max_sparsity: Option<f32>,
    /// Do not follow memory pressure (keep the configured budget).
    #[arg(long)]
    no_pressure: bool,
    /// Monitor this cgroup directory instead of the service's own.
    #[arg(long)]
    cgroup: Option<PathBuf>,
    /// llms, vllm-sq, vllm-s, swap or lmk.
    #[arg(long)]
    policy: Option<String>,
    #[arg(long)]
    chunk_tokens: Option<usize>,
    /// Compression levels, the base first [default: int8,k4v4,k4v3,k3v3].
    #[arg(long, value_delimiter = ',')]
    levels: Option<Vec<String>>,
    /// Global compression ratio (KV bytes relative to the base level).
    #[arg(long)]
    ratio: Option<f64>,
    /// Switch off parts of the llms policy (ablation studies): lctru, compression, pipeline, aot.
    #[arg(long, value_delimiter = ',')]
    ablate: Option<Vec<String>>,
    #[arg(long)]
    max_contexts_per_app: Option<usize>,
    #[arg(long)]
    max_context_tokens: Option<usize>,
    #[arg(long)]
    threads: Option<usize>,
    /// The OpenAI-compatible HTTP front's Unix socket ("" for none); by default beside --socket, `<name>.http.sock`
    #[arg(long)]
    http_socket: Option<PathBuf>,
    /// Also serve HTTP on this loopback TCP address (e.g. 127.0.0.1:8080); needs --http-tokens
    #[arg(long)]
    http: Option<String>,
    /// Bearer tokens of TCP clients: `<app> <token>` lines, mode 0600
    #[arg(long)]
    http_tokens: Option<PathBuf>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    print_config: bool,
}

fn config(cli: Cli) -> Result<(Config, bool)> {
    let mut c = match &cli.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    if c.model == Config::default().model {
        if let Some(m) = llmsd::env_path("LLMS_MODEL") {
            c.model = m;
        }
    }
    macro_rules! set {
        ($($f:ident),*) => { $( if let Some(v) = cli.$f { c.$f = v; } )* };
    }
    set!(
        model,
        socket,
        socket_mode,
        state_dir,
        budget,
        policy,
        chunk_tokens,
        levels,
        ratio,
        ablate,
        max_contexts_per_app,
        max_context_tokens,
        threads
    );
    if cli.cgroup.is_some() {
        c.cgroup = cli.cgroup;
    }
    if cli.http_socket.is_some() {
        c.http_socket = cli.http_socket;
    }
    if cli.http.is_some() {
        c.http = cli.http;
    }
    if cli.http_tokens.is_some() {
        c.http_tokens = cli.http_tokens;
    }
    if cli.weights_budget.is_some() {
        c.weights_budget = cli.weights_budget;
    }
    if cli.weights_image.is_some() {
        c.weights_image = cli.weights_image;
    }
    if cli.weights_plan {
        c.weights_plan = true;
    }
    if let Some(s) = cli.weights_max_sparsity {
        c.weights_max_sparsity = s;
    }
    if cli.no_pressure {
        c.pressure = false;
    }
    c.validate()?;
    Ok((c, cli.print_config))
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        // Colours only on a terminal: a log file or the journal gets plain `key=value` fields.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = run() {
        eprintln!("llmsd: error: {}", llmsd::describe(&e));
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let (cfg, print) = config(Cli::parse())?;
    // Everything the service writes (swap store, contexts, profiles) holds conversations:
    // private to its uid, whatever umask it was started with.
    // SAFETY: umask has no preconditions and cannot fail.
    unsafe { libc::umask(0o077) };
    if print {
        print!("{}", toml::to_string(&cfg)?);
        return Ok(());
    }
    // SIGTERM and SIGINT are taken by a thread of ours (blocked everywhere else, inherited by
    // every thread started after this), so a stop always runs the clean shutdown.
    let mut sigs = nix::sys::signal::SigSet::empty();
    sigs.add(nix::sys::signal::Signal::SIGTERM);
    sigs.add(nix::sys::signal::Signal::SIGINT);
    sigs.thread_block().context("blocking SIGTERM")?;
    let mode = cfg.socket_mode_bits()?;
    let socket = cfg.socket.clone();
    let svc = Service::open(cfg)?;
    // The HTTP front first: once the native socket exists, both are there.
    let http = HttpListeners::bind(svc.config())?;
    let listener = bind_socket(&socket, mode)?;
    tracing::info!(socket = %socket.display(), http = %http.describe(), budget = svc.config().budget, policy = %svc.config().policy, "llmsd ready");
    let stopper = Arc::clone(&svc);
    std::thread::Builder::new().name("llmsd-signals".into()).spawn(move || {
        if let Ok(sig) = sigs.wait() {
            tracing::info!("{sig:?}: stopping");
            stopper.stop();
        }
    })?;
    let r = svc.serve(listener, http);
    let _ = std::fs::remove_file(&socket);
    r
}

//! Commands for a running llmsd: its contexts (`llms ctx`), its figures (`llms stats`), and the
//! chat whose conversation is one of its contexts (`llms chat --ctx`).

use std::io::Write;

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::json;

use super::*;

/// `llms stats`.
#[derive(Args, Debug)]
pub struct StatsArgs {
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub d: DaemonArgs,
}

impl StatsArgs {
    pub fn run(self) -> Result<()> {
        let Self { json, d } = self;
        stats_cmd(json, &d)?;
        Ok(())
    }
}

#[derive(Subcommand, Debug)]
pub enum CtxCmd {
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
    /// A new context holding CTX's tokens, to go on apart from it (its K/V shared, not
    /// copied); prints the new id.
    Fork {
        ctx: String,
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

pub fn ctx_cmd(cmd: CtxCmd) -> Result<()> {
    match cmd {
        CtxCmd::New { system, d } => println!("{}", d.connect()?.new_ctx(system.as_deref())?),
        CtxCmd::Call { ctx, prompt, max_tokens, temperature, seed, stop, raw, json, stats, d } => {
            let mut c = d.connect()?;
            let call = llmsd::proto::Call { ctx, prompt, max_tokens, temperature, seed, stop, raw, top_p: None };
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
        CtxCmd::Fork { ctx, d } => println!("{}", d.connect()?.fork(&ctx)?),
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

fn call_line(st: &llmsd::proto::CallStats) -> String {
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

fn print_contexts(v: &[llmsd::proto::CtxInfo]) {
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
            if c.busy {
                " (in a call)".to_string()
            } else if !c.unavailable.is_empty() {
                format!(" (unavailable: {})", c.unavailable)
            } else {
                String::new()
            }
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
    if s.write_failures > 0 {
        println!(
            "swap store: {} write batch(es) failed, last: {}; {} chunk(s) evicted unwritten (recomputed when next loaded)",
            s.write_failures, s.last_write_error, s.dropped_unsaved
        );
    }
    let sh = &s.sharing;
    if sh.logical_chunks > 0 || sh.forks > 0 || sh.reused_tokens > 0 {
        println!(
            "shared prefixes (this app): {} chunks held once for {} references, {:.1} MiB saved; {} prompt tokens taken, {} forks, {} copies on write",
            sh.unique_chunks,
            sh.logical_chunks,
            sh.bytes_saved as f64 / 1048576.0,
            sh.reused_tokens,
            sh.forks,
            sh.copied_on_write
        );
    }
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
pub(crate) fn chat_daemon(d: &DaemonArgs, ctx: &str, max_tokens: usize, temperature: f32, seed: u64, system: Option<String>) -> Result<()> {
    let mut c = d.connect()?;
    let ctx = if ctx == "new" {
        let id = c.new_ctx(system.as_deref())?;
        eprintln!("llms chat: new context {id}");
        id
    } else {
        ctx.to_string()
    };
    chat_turns(&mut |line| {
        let call = llmsd::proto::Call {
            ctx: ctx.clone(),
            prompt: line.to_string(),
            max_tokens: u32::try_from(max_tokens).unwrap_or(u32::MAX),
            temperature,
            seed,
            stop: Vec::new(),
            raw: false,
            top_p: None,
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

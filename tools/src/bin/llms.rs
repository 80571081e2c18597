//! `llms`: the LLMS command line. Subcommands print stable JSON where documented in
//! docs/CLI.md, so other tools can script them. Each command family lives in `tools::cli`;
//! this file is the top-level parser and the dispatch.

use anyhow::Result;
use clap::{Parser, Subcommand};
use tools::cli::experiment::{ExperimentCmd, TraceCmd};
use tools::cli::lab::LabCmd;
use tools::cli::pressure::PressureCmd;
use tools::cli::service::CtxCmd;
use tools::cli::{bench, doctor, experiment, lab, model, pressure, record, service, weights};

#[derive(Parser, Debug)]
#[command(name = "llms", version, about = "LLMS: an LLM as a system service — command line")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once per run: the size of the variants that carry ModelArgs does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Cmd {
    /// Print the token ids of a text as a JSON array.
    Tokenize(model::TokenizeArgs),
    /// Print the highest logits at the last position of a prompt as JSON.
    Logits(model::LogitsArgs),
    /// Generate text from a prompt, streaming it.
    Generate(model::GenerateArgs),
    /// Contexts held by a running llmsd: create, call, delete, list.
    Ctx {
        #[command(subcommand)]
        cmd: CtxCmd,
    },
    /// The service's figures: budget and usage, switch latency, faults, pressure, and this
    /// app's contexts (residency and levels).
    Stats(service::StatsArgs),
    /// Interactive chat with the model's template; tokens are streamed as they come. With
    /// --ctx the conversation is a context of a running llmsd (it persists).
    Chat(model::ChatArgs),
    /// Perplexity by llama.cpp's method: windows of N tokens, score the second half of each.
    Perplexity(model::PerplexityArgs),
    /// Measure the swap-recompute planner's cost profiles (T_re, T_io) and save them.
    Profile(bench::ProfileArgs),
    /// Switch-in latency of contexts held entirely on flash: all-read, all-recompute and the
    /// planned pipeline, next to the floor (bytes / the store's read bandwidth).
    BenchLoad(bench::BenchLoadArgs),
    /// The service's switch latency and time to first token for contexts that are resident,
    /// partly evicted, fully evicted, and recomputed whole (lmk), in process over a socket.
    BenchSwitch(bench::BenchSwitchArgs),
    /// The HTTP front: a stateless client's TTFT with its context continued vs its history
    /// prefilled in full (resident and after eviction), and the front's overhead per call.
    BenchHttp(bench::BenchHttpArgs),
    /// Shared prefixes: conversations opening with one system prompt, a fork, a branch, each
    /// beside the same run with prefix_sharing = false.
    BenchPrefix(bench::BenchPrefixArgs),
    /// Decoding several contexts in one forward pass per step (Session::decode_batch):
    /// aggregate tokens/s and step time per batch size, against one context at a time.
    BenchBatch(bench::BenchBatchArgs),
    /// The tokenizer on hostile inputs (a 1 MB word, runs of one character) beside prose.
    BenchTokenize(bench::BenchTokenizeArgs),
    /// What one app's hostile text costs the others: an app's short call alone and while
    /// another sends a long word over HTTP.
    BenchDoors(bench::BenchDoorsArgs),
    /// Many apps at once: N clients each making M calls on its own context against llmsd
    /// (batched decoding, max_batch); aggregate decode tok/s, TTFT and inter-token latency.
    BenchServe(bench::BenchServeArgs),
    /// Context-switching traces: synthesize them, replay them against llmsd.
    Trace {
        #[command(subcommand)]
        cmd: TraceCmd,
    },
    /// Gathers the experiments' tables and plots into one page with the machine and the
    /// commands (docs/RESULTS.md).
    Report(experiment::ReportArgs),
    /// Run a measuring command (`llms record --out F -- llms bench-serve ... --json`) and
    /// store its JSON with the command line, the machine and the date: the file a figure in
    /// the docs links to.
    Record(record::RecordArgs),
    /// Experiments over traces (docs/traces.md): each writes a table and a plot.
    Experiment {
        #[command(subcommand)]
        cmd: ExperimentCmd,
    },
    /// Decode speed with weights resident and paged under budgets (shares of the weight
    /// bytes), flash bytes read per token, hit rate, and the flash floor; runs interleaved.
    BenchWeights(weights::BenchWeightsArgs),
    /// The weight plan for each budget: ActiveFlow's cost model (eq. 1-9) fed by this
    /// machine's measured bandwidths and each sparsity level's measured reads; picks the
    /// sparsity, the layers per group and the cache size, and predicts decode speed.
    PlanWeights(weights::PlanWeightsArgs),
    /// userfaultfd mechanism costs next to their floors (memcpy, kernel anonymous faults).
    BenchUffd(bench::BenchUffdArgs),
    /// The memory-pressure monitor: watch it live, record samples, replay a recording.
    Pressure {
        #[command(subcommand)]
        cmd: PressureCmd,
    },
    /// The device lab's programs, run inside its guest (docs/lab.md): a memory hog, a
    /// PSI-driven low-memory killer, the status quo's app, the trace driver, the prebuilt
    /// conversations of the held scenario (on the host), the summary.
    Lab {
        #[command(subcommand)]
        cmd: LabCmd,
    },
    /// What this machine offers LLMS (userfaultfd, ...), and how to fix what is missing.
    Doctor(doctor::DoctorArgs),
    /// Prefill (pp512) and decode (tg128) speed, like llama-bench.
    Bench(model::BenchArgs),
    /// Write a random-weight model of a given architecture and shape (a preset such as
    /// llama2-7b, or any dimensions) with the default model's tokenizer: outputs are noise,
    /// the costs are real (docs/engine.md "Architectures").
    Synth(model::SynthArgs),
}

fn main() {
    let cli = Cli::parse();
    // The benches and experiments run llmsd in this process: RUST_LOG shows its log (each
    // call's switch and stats, as llmsd prints them), on stderr.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("RUST_LOG") {
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    }
    if let Err(e) = run(cli) {
        eprintln!("llms: error: {}", llmsd::describe(&e));
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Tokenize(a) => a.run(),
        Cmd::Logits(a) => a.run(),
        Cmd::Generate(a) => a.run(),
        Cmd::Ctx { cmd } => service::ctx_cmd(cmd),
        Cmd::Stats(a) => a.run(),
        Cmd::Chat(a) => a.run(),
        Cmd::Perplexity(a) => a.run(),
        Cmd::Profile(a) => a.run(),
        Cmd::BenchLoad(a) => a.run(),
        Cmd::BenchSwitch(a) => a.run(),
        Cmd::BenchHttp(a) => a.run(),
        Cmd::BenchPrefix(a) => a.run(),
        Cmd::BenchBatch(a) => a.run(),
        Cmd::BenchTokenize(a) => a.run(),
        Cmd::BenchDoors(a) => a.run(),
        Cmd::BenchServe(a) => a.run(),
        Cmd::Trace { cmd } => experiment::trace_cmd(cmd),
        Cmd::Report(a) => a.run(),
        Cmd::Record(a) => a.run(),
        Cmd::Experiment { cmd } => experiment::experiment_cmd(cmd),
        Cmd::BenchWeights(a) => a.run(),
        Cmd::PlanWeights(a) => a.run(),
        Cmd::BenchUffd(a) => a.run(),
        Cmd::Pressure { cmd } => pressure::pressure(cmd),
        Cmd::Lab { cmd } => lab::lab(cmd),
        Cmd::Doctor(a) => a.run(),
        Cmd::Bench(a) => a.run(),
        Cmd::Synth(a) => a.run(),
    }
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

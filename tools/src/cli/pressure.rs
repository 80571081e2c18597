//! `llms pressure`: the memory-pressure monitor live, recorded and replayed.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use serde_json::json;

use super::*;

#[derive(Subcommand, Debug)]
pub enum PressureCmd {
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
pub struct PressureArgs {
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

pub fn pressure(cmd: PressureCmd) -> Result<()> {
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

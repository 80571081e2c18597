//! `llms record`: runs a measuring command and stores what it printed as a result file,
//! with the command line and where and when it ran. Every figure the docs quote links to
//! such a file (tests/tests/figures.rs), so a figure and the command that made it travel
//! together and a hand-typed number has nowhere to hide.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

use crate::provenance;

#[derive(Args, Debug)]
pub struct RecordArgs {
    /// The result file to write (JSON): {"command", "measured", "result"}.
    #[arg(long)]
    out: PathBuf,
    /// The command, after `--`: `llms ...` runs this build of llms; anything else runs as
    /// given (e.g. tools/bench/vs-llama-cpp). It must print JSON: all of its output, or as
    /// its last line.
    #[arg(last = true, required = true, num_args = 1..)]
    command: Vec<String>,
}

/// What `stdout` says as JSON: all of it, else its last non-empty line (scripts print a
/// table for people, then one line for tools).
fn json_of(stdout: &str) -> Option<Value> {
    serde_json::from_str(stdout)
        .ok()
        .or_else(|| stdout.lines().rev().find(|l| !l.trim().is_empty()).and_then(|l| serde_json::from_str(l).ok()))
}

/// `value` as the stored result of `command`, measured as `measured` says.
fn record(command: &[String], measured: &str, value: Value) -> Value {
    json!({"command": command.join(" "), "measured": measured, "result": value})
}

/// Writes `v` to `out` through a temporary file and a rename: an interrupted run leaves
/// the previous result whole.
fn write(out: &Path, v: &Value) -> Result<()> {
    let tmp = out.with_extension("json.tmp");
    let mut text = serde_json::to_string_pretty(v)?;
    text.push('\n');
    std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, out)).with_context(|| format!("writing {}", out.display()))
}

impl RecordArgs {
    pub fn run(self) -> Result<()> {
        // Checked first: a bench can run for an hour before it has anything to write.
        let dir = self.out.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        if !dir.is_dir() {
            bail!("{} is not a directory", dir.display());
        }
        let (prog, args) = self.command.split_first().context("no command after --")?;
        let exe = if prog == "llms" { std::env::current_exe().context("finding this llms")? } else { PathBuf::from(prog) };
        let output = Command::new(&exe)
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .with_context(|| format!("running {}", exe.display()))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        print!("{stdout}");
        if !output.status.success() {
            bail!("{} failed ({}); {} left as it was", self.command.join(" "), output.status, self.out.display());
        }
        let Some(value) = json_of(&stdout) else {
            bail!("{} printed no JSON (does it need --json?); {} left as it was", self.command.join(" "), self.out.display());
        };
        let measured = format!("{}, {}", provenance::machine(), provenance::today());
        write(&self.out, &record(&self.command, &measured, value))?;
        eprintln!("llms: recorded {}", self.out.display());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_json_whole_or_its_last_line() {
        assert_eq!(json_of("{\"a\": 1}\n"), Some(json!({"a": 1})));
        assert_eq!(json_of("llms  llama.cpp\npp512 1 2\n{\"ratio\": 2.5}\n\n"), Some(json!({"ratio": 2.5})));
        assert_eq!(json_of("a table\nno json\n"), None);
        assert_eq!(json_of(""), None);
    }

    #[test]
    fn a_failed_or_silent_command_leaves_the_old_result() {
        let dir = std::env::temp_dir().join(format!("llms-record-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("r.json");
        std::fs::write(&out, "old").unwrap();
        for cmd in [&["false"][..], &["echo", "not json"]] {
            let a = RecordArgs { out: out.clone(), command: cmd.iter().map(ToString::to_string).collect() };
            assert!(a.run().is_err(), "{cmd:?}");
            assert_eq!(std::fs::read_to_string(&out).unwrap(), "old");
        }
        let a = RecordArgs { out: out.clone(), command: ["echo", "{\"x\": 3}"].iter().map(ToString::to_string).collect() };
        a.run().unwrap();
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!((v["command"].as_str(), &v["result"]), (Some("echo {\"x\": 3}"), &json!({"x": 3})));
        assert!(v["measured"].as_str().unwrap().contains("cores"));
        let missing = RecordArgs { out: dir.join("no/such/r.json"), command: vec!["echo".into(), "{}".into()] };
        assert!(missing.run().is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

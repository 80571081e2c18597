//! The device lab's smoke run (docs/lab.md): a real Linux kernel booted under qemu, llmsd in a
//! cgroup v2 group with memory.high, one pressure step in that group; the pressure monitor must
//! see the group's real PSI stall and llmsd's budget must shrink, then grow back when the step
//! ends. Needs qemu-system-x86_64 and the guest kernel (`make lab-deps`, which `make test`
//! runs); without them it skips, or fails under LLMS_REQUIRE_KERNEL=1.

use std::path::{Path, PathBuf};
use std::process::Command;

use llms_tests::{repo_root, require_kernel};
use serde_json::Value;

/// What the smoke needs on the host, or why it cannot run.
fn lab_ready() -> Result<(), String> {
    let qemu = Command::new("qemu-system-x86_64").arg("--version").output();
    if !qemu.is_ok_and(|o| o.status.success()) {
        return Err("qemu-system-x86_64 is not installed (`make lab-deps` installs it)".into());
    }
    if !repo_root().join("target/lab/cache/kernel.ok").exists() {
        return Err("the guest kernel is not downloaded (`make lab-deps`)".into());
    }
    Ok(())
}

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{name} missing from the guest's results ({e})"))
}

/// `some ... total=N` of a PSI file.
fn psi_some_total(text: &str) -> u64 {
    let line = text.lines().find(|l| l.starts_with("some ")).expect("a `some` line");
    line.split_whitespace().find_map(|w| w.strip_prefix("total=")).expect("total=").parse().expect("a number")
}

#[test]
fn a_real_kernel_under_a_pressure_step_shrinks_the_budget_through_psi() {
    if require_kernel("the device lab", lab_ready()).is_none() {
        return;
    }
    let llms = PathBuf::from(env!("CARGO_BIN_EXE_llms"));
    let llmsd = llms.with_file_name("llmsd");
    assert!(llmsd.exists(), "{} is missing: `cargo test --workspace` (make test) builds it", llmsd.display());
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("lab-smoke");
    let run = Command::new("bash")
        .arg(repo_root().join("tools/lab/lab.sh"))
        .args(["run", "smoke"])
        .env("LLMS_BIN", &llms)
        .env("LLMSD_BIN", &llmsd)
        .env("LAB_OUT", &out)
        .env("LAB_TIMEOUT", "600")
        .output()
        .expect("run tools/lab/lab.sh");
    let console = std::fs::read_to_string(out.join("console.log")).unwrap_or_default();
    assert!(
        run.status.success(),
        "lab.sh failed: {}\n{}\nthe guest's console, last lines:\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr),
        console.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    );
    let log = std::fs::read_to_string(out.join("scenario.log")).unwrap_or_default();
    assert_eq!(read(&out, "rc").trim(), "0", "the smoke scenario failed in the guest:\n{log}");
    assert!(read(&out, "kernel").starts_with("6.12."), "the guest runs Debian's 6.12 kernel");

    let env = read(&out, "smoke.env");
    for want in ["shrunk=1", "grown=1", "alive=1"] {
        assert!(env.lines().any(|l| l == want), "{want} expected in the guest's result:\n{env}\n{log}");
    }
    // The contexts held KV before the step, and the budget started at the configured value.
    let before: Value = serde_json::from_str(&read(&out, "stats-before.json")).expect("stats JSON");
    assert!(before["resident_bytes"].as_u64().unwrap() > 0, "{before}");
    assert_eq!(before["budget_bytes"], before["configured_budget_bytes"]);
    let during: Value = serde_json::from_str(&read(&out, "stats-during.json")).expect("stats JSON");
    assert!(during["budget_bytes"].as_u64() < during["configured_budget_bytes"].as_u64(), "{during}");
    // The group really stalled: its own memory.pressure counted it.
    let (psi0, psi1) = (psi_some_total(&read(&out, "psi-before")), psi_some_total(&read(&out, "psi-during")));
    assert!(psi1 > psi0, "the group's PSI some total did not move: {psi0} -> {psi1}");
    // And the monitor saw that stall as a signal on its own (over the Reclaim threshold), on
    // the group's files read from a real cgroupfs, and left Normal.
    let events: Vec<Value> = read(&out, "pressure.jsonl").lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    assert!(!events.is_empty(), "the monitor wrote no samples");
    let stall = events.iter().map(|e| e["event"]["signals"]["stall"].as_f64().unwrap_or(0.0)).fold(0.0, f64::max);
    assert!(stall > 0.10, "the monitor's peak stall signal was {stall}");
    assert!(events.iter().any(|e| e["event"]["level"] != "Normal"), "the monitor never left Normal");
    assert!(events.iter().any(|e| !e["sample"]["cgroup_psi"].is_null()), "the group's memory.pressure was never read");
    let llmsd_log = read(&out, "llmsd.log");
    assert!(
        llmsd_log.lines().any(|l| l.contains("pressure") && (l.contains("level=Reclaim") || l.contains("level=Critical"))),
        "llmsd never followed a Reclaim or Critical level:\n{llmsd_log}"
    );
}

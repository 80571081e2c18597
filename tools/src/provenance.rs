//! Where and when a result was measured: the machine (kernel, CPU, cores, memory, swap, the
//! commit) and the day, written beside every stored figure and result.

use std::fmt::Write as _;

/// A fact of this machine from a /proc file: the value after `key:` on its first line.
fn proc_field(path: &str, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_once(':')).map(|(_, v)| v.trim().to_string())
}

/// One paragraph on the machine: kernel, CPU, cores, memory, swap, and the commit.
pub fn machine() -> String {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").map_or_else(|_| "unknown".into(), |s| s.trim().to_string());
    let cpu = proc_field("/proc/cpuinfo", "model name").unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    let gib = |k: &str| {
        proc_field("/proc/meminfo", k)
            .and_then(|v| v.trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or_else(|| "?".into(), |kb| format!("{:.0} GiB", kb / f64::from(1 << 20)))
    };
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let mut s =
        format!("Linux {kernel} {}, {cpu}, {cores} cores, {} memory, {} swap", std::env::consts::ARCH, gib("MemTotal"), gib("SwapTotal"));
    if let Some(c) = commit {
        let _ = write!(s, "; commit {c}");
    }
    s
}

/// Today's date (UTC), as "26 Nov 2026": the date part of an HTTP date (httpdate, which the
/// HTTP front already builds), not a calendar written here.
pub fn today() -> String {
    let d = httpdate::fmt_http_date(std::time::SystemTime::now()); // "Thu, 26 Nov 2026 02:58:00 GMT"
    d.get(5..16).unwrap_or(&d).to_string()
}

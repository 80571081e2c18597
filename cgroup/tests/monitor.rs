//! The monitor on this machine's real files, on fixture trees shaped like cgroupfs, and under
//! real memory pressure from a child process.
#![allow(clippy::cast_precision_loss)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use cgroup::{
    parse_counters, parse_meminfo, parse_psi, probe, replay, round_rule, CgroupKind, Classifier, Level, PsiTrigger, Sources, Thresholds,
    TriggerError,
};
use llms_tests::require_kernel;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("llms-cgroup-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

const MEMINFO: &str = "MemTotal:       16384000 kB\nMemFree:         1000000 kB\nMemAvailable:    4096000 kB\nBuffers:           10000 kB\nCached:          3000000 kB\n";
const VMSTAT: &str =
    "nr_free_pages 250000\npgscan_kswapd 100\npgscan_direct 20\npgscan_proactive 999\npgsteal_kswapd 90\nworkingset_refault_file 7\n";
const PSI: &str = "some avg10=1.50 avg60=0.40 avg300=0.10 total=123456\nfull avg10=0.20 avg60=0.05 avg300=0.01 total=2345\n";

#[test]
fn this_machines_proc_files_parse() {
    let psi = require_kernel("PSI (/proc/pressure/memory)", std::fs::read_to_string("/proc/pressure/memory"));
    if let Some(t) = psi {
        parse_psi("/proc/pressure/memory", &t).unwrap();
    }
    let m = parse_meminfo("/proc/meminfo", &std::fs::read_to_string("/proc/meminfo").unwrap()).unwrap();
    assert!(m.total > 0 && m.available > 0 && m.available <= m.total);
    let c = parse_counters("/proc/vmstat", &std::fs::read_to_string("/proc/vmstat").unwrap()).unwrap();
    assert!(c.contains_key("nr_free_pages"));
    let w = cgroup::parse_zoneinfo("/proc/zoneinfo", &std::fs::read_to_string("/proc/zoneinfo").unwrap()).unwrap();
    assert!(w.min < w.low && w.low < w.high && w.free > 0);
    assert!(cgroup::parse_zoneinfo("z", "Node 0, zone DMA\n  pages free lots\n").is_err());
    assert!(cgroup::parse_zoneinfo("z", "").is_err());
    let p = probe(None);
    let s = p.sources().sample(0).unwrap();
    assert!(s.headroom() > 0.0 && s.headroom() <= 1.0);
}

#[test]
fn fixture_files_parse_and_proactive_reclaim_is_ignored() {
    let psi = parse_psi("fixture", PSI).unwrap();
    assert_eq!(psi.some.total_us, 123_456);
    assert!((psi.full.avg10 - 0.2).abs() < 1e-9);
    let m = parse_meminfo("fixture", MEMINFO).unwrap();
    assert_eq!(m.available, 4_096_000 * 1024);
    let vm = cgroup::vmstat_from(&parse_counters("fixture", VMSTAT).unwrap());
    assert_eq!((vm.pgscan, vm.pgsteal, vm.workingset_refault), (120, 90, 7), "pgscan_proactive is our own doing");
}

#[test]
fn malformed_files_are_clear_errors() {
    for (text, want) in [
        ("some avg10=x avg60=0 avg300=0 total=1\n", "bad number"),
        ("some avg10=0.0 avg60=0.0\n", "expected avg10"),
        ("full avg10=0 avg60=0 avg300=0 total=1\n", "no \"some\" line"),
        ("weird avg10=0 avg60=0 avg300=0 total=1\n", "unknown PSI line"),
        ("some avg10 avg60=0 avg300=0 total=1\n", "not key=value"),
    ] {
        let e = parse_psi("p", text).unwrap_err().to_string();
        assert!(e.contains(want), "{text:?}: {e}");
    }
    assert!(parse_counters("v", "pgscan_kswapd many\n").unwrap_err().to_string().contains("line 1"));
    assert!(parse_counters("v", "lonely\n").is_err());
    assert!(parse_meminfo("m", "MemTotal: 5 kB\n").is_err(), "no MemAvailable");
    assert!(parse_meminfo("m", "garbage\0\u{1}").is_err());
}

#[test]
fn fixture_cgroup_trees_v1_v2_and_none() {
    let proc = tmpdir("proc");
    write(&proc, "meminfo", MEMINFO);
    write(&proc, "vmstat", VMSTAT);
    write(&proc, "pressure", PSI);
    let v2 = tmpdir("v2");
    write(&v2, "memory.current", "1879048192\n");
    write(&v2, "memory.max", "2147483648\n");
    write(&v2, "memory.high", "max\n");
    write(&v2, "memory.low", "0\n");
    write(&v2, "memory.events", "low 0\nhigh 3\nmax 1\noom 0\noom_kill 0\n");
    write(&v2, "memory.pressure", "some avg10=0.00 avg60=0.00 avg300=0.00 total=77\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=5\n");
    write(
        &proc,
        "zoneinfo",
        "Node 0, zone   Normal\n  pages free     1000\n        min      10\n        low      20\n        high     30\n",
    );
    let v1 = tmpdir("v1");
    write(&v1, "memory.usage_in_bytes", "536870912\n");
    write(&v1, "memory.limit_in_bytes", "9223372036854771712\n");
    write(&v1, "memory.failcnt", "2\n");
    write(&v1, "memory.soft_limit_in_bytes", "268435456\n");
    let src = |cg| Sources { proc_root: proc.clone(), psi: Some(proc.join("pressure")), cgroup: cg };
    let s = src(Some((v2.clone(), CgroupKind::V2))).sample(5).unwrap();
    let c = s.cgroup.unwrap();
    assert_eq!((c.usage, c.max, c.high, c.low, c.events_high, c.events_max), (7 << 28, Some(2 << 30), None, None, 3, 1));
    assert!((s.headroom() - 0.125).abs() < 1e-9, "the cgroup's room (12.5%) is tighter than the system's 25%");
    assert_eq!(s.headroom_bytes(), 1 << 28);
    assert_eq!(s.cgroup_psi.unwrap().some.total_us, 77, "the v2 group's own memory.pressure");
    assert_eq!(s.watermarks.unwrap(), cgroup::Watermarks { free: 1000 * 4096, min: 40960, low: 81920, high: 122_880 });
    // memory.high under memory.max is the limit the group meets first.
    write(&v2, "memory.high", "1946157056\n");
    let s = src(Some((v2.clone(), CgroupKind::V2))).sample(5).unwrap();
    assert_eq!(s.cgroup.unwrap().limit(), Some(1_946_157_056));
    assert_eq!(s.headroom_bytes(), 64 << 20, "the room under memory.high");
    assert_eq!(s.headroom_base(), 1_946_157_056);
    let s = src(Some((v1.clone(), CgroupKind::V1))).sample(5).unwrap();
    assert_eq!(s.cgroup.unwrap().max, None, "v1's LONG_MAX means unlimited");
    assert_eq!(s.cgroup.unwrap().limit(), None, "v1's soft limit throttles nothing");
    assert!((s.headroom() - 0.25).abs() < 1e-9);
    let s = src(None).sample(5).unwrap();
    assert!(s.cgroup.is_none() && s.psi.is_some());
    // A cgroup file that went bad is an error naming it.
    write(&v2, "memory.max", "lots\n");
    let e = src(Some((v2.clone(), CgroupKind::V2))).sample(6).unwrap_err().to_string();
    assert!(e.contains("memory.max"), "{e}");
    for d in [proc, v1, v2] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn psi_triggers_register_with_window_rounding() {
    assert_eq!(round_rule(150_000, 1_000_000, false), (300_000, 2_000_000), "same stall rate over a 2 s window");
    assert_eq!(round_rule(150_000, 1_000_000, true), (150_000, 1_000_000));
    assert_eq!(round_rule(70_000, 4_000_000, false), (70_000, 4_000_000));
    let p = probe(None);
    let Some(path) = require_kernel("PSI", p.psi.clone()) else { return };
    let t = PsiTrigger::register(&path, false, 150_000, 1_000_000, p.cap_sys_resource).unwrap();
    assert!(t.rule.starts_with("some "));
    // No pressure here: a short wait times out (one spurious wake after arming is allowed).
    let _ = t.wait(10).unwrap();
    let full = PsiTrigger::register(&path, true, 100_000, 2_000_000, p.cap_sys_resource).unwrap();
    assert_eq!(full.rule, "full 100000 2000000");
    // A stall longer than its window is refused by the kernel with a clear error.
    match PsiTrigger::register(&path, false, 3_000_000, 2_000_000, p.cap_sys_resource) {
        Err(TriggerError::Refused { rule, .. }) => assert_eq!(rule, "some 3000000 2000000"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    // A copy of a pressure file (a fixture tree) is sampled, never armed: arming would
    // overwrite it.
    let dir = tmpdir("psi-copy");
    let copy = dir.join("memory.pressure");
    std::fs::write(&copy, PSI).unwrap();
    assert!(matches!(PsiTrigger::register(&copy, false, 150_000, 2_000_000, false), Err(TriggerError::NotPsi { .. })));
    assert_eq!(std::fs::read_to_string(&copy).unwrap(), PSI);
    let _ = std::fs::remove_dir_all(dir);
}

/// Run in a child by `real_memory_pressure_moves_headroom_and_level`: holds 1.5 GiB of
/// touched memory until stdin closes.
#[test]
#[ignore = "helper: runs in a child process"]
fn child_holds_memory() {
    let mut v = vec![0u8; 3 << 29];
    for i in (0..v.len()).step_by(4096) {
        v[i] = 1;
    }
    println!("ready");
    let mut s = String::new();
    let _ = std::io::stdin().read_line(&mut s);
    std::hint::black_box(&v);
}

#[test]
fn real_memory_pressure_moves_headroom_and_level() {
    use std::io::{BufRead, BufReader, Write};
    let p = probe(None);
    let src = p.sources();
    let before = src.sample(0).unwrap();
    // Only run where 1.5 GiB is a small part of what is available (never push a machine
    // toward its OOM killer).
    if before.mem.available < 6 << 30 {
        assert!(!llms_tests::kernel_required(), "real memory pressure needs 6 GiB available, {} MiB are", before.mem.available >> 20);
        eprintln!("skipping: only {} MiB available", before.mem.available >> 20);
        return;
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_holds_memory", "--nocapture", "--test-threads=1"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("ready") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "child exited early");
    }
    let during = src.sample(1000).unwrap();
    child.stdin.take().unwrap().write_all(b"\n").unwrap();
    child.wait().unwrap();
    // The machine is shared, and this VM gives freed memory back to MemAvailable slowly: it
    // has been seen to take more than 5 s to show (the balloon's free-page reporting), and,
    // after a session of multi-GiB runs, to trickle back at ~15 MiB/s — 1.5 GiB freed showed
    // +744 MiB at once, +1170 MiB after 60 s, and in one CI run +1004 MiB after 90 s. How
    // fast the host returns pages is not the monitor's to decide, so wait (bounded) for most
    // of it and then ask only that the release is seen at all, with the classifier's
    // thresholds placed inside what was measured.
    let mut after = src.sample(3000).unwrap();
    for _ in 0..120 {
        if after.mem.available + (256 << 20) >= before.mem.available {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
        after = src.sample(3000).unwrap();
    }
    let drop = before.mem.available.saturating_sub(during.mem.available);
    assert!(drop > 1 << 30, "MemAvailable fell by {} MiB while the child held 1.5 GiB", drop >> 20);
    let rise = after.mem.available.saturating_sub(during.mem.available);
    assert!(
        rise > 512 << 20,
        "and came back: MemAvailable {} MiB before, {} during, {} after",
        before.mem.available >> 20,
        during.mem.available >> 20,
        after.mem.available >> 20
    );
    // Thresholds between the pressed and released samples: the classifier, fed the real
    // samples, enters a level on the child's allocation and leaves it on the release.
    let (low, high) = (during.headroom(), after.headroom().min(before.headroom()));
    assert!(low < high, "headroom fell with MemAvailable: {low} during, {high} after");
    let th = Thresholds {
        headroom_enter: [low + 0.4 * (high - low), 0.0, 0.0],
        headroom_exit: [low + 0.8 * (high - low), 0.0, 0.0],
        min_level_ms: 0,
        hold_off_ms: 0,
        ..Thresholds::default()
    };
    let ev = replay(&[before, during, after], th, 1 << 30, 0);
    assert_eq!(ev.iter().map(|e| e.level).collect::<Vec<_>>(), vec![Level::Normal, Level::Elevated, Level::Normal]);
    // No swap and no memory limit here: real stall cannot be produced, only headroom moves.
    let mut c = Classifier::new(Thresholds::default());
    let (_, sig) = c.update(&during);
    assert!(sig.stall == 0.0);
}

#[test]
fn watermarks_escalate_and_the_monitor_thread_publishes_events() {
    let base = cgroup::Sample { mem: cgroup::MemInfo { total: 100, available: 90 }, ..Default::default() };
    let wm = |free| Some(cgroup::Watermarks { free, min: 10, low: 20, high: 30 });
    let samples: Vec<cgroup::Sample> =
        [40, 25, 15, 5].iter().enumerate().map(|(i, &f)| cgroup::Sample { t_ms: i as u64 * 10, watermarks: wm(f), ..base }).collect();
    let lv: Vec<Level> = replay(&samples, Thresholds::default(), 1000, 0).iter().map(|e| e.level).collect();
    assert_eq!(lv, vec![Level::Normal, Level::Elevated, Level::Reclaim, Level::Critical], "below high, low, min");
    let opts = cgroup::MonitorOptions { slow_ms: 20, fast_ms: 10, ..Default::default() };
    let (rx, h) = cgroup::spawn(probe(None), opts);
    let a = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    let b = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert!(b.t_ms > a.t_ms);
    drop(rx);
    h.join().unwrap().unwrap();
}

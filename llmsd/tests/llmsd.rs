//! llmsd end to end: the real daemon binary, the real model, real sockets. Conversations under a
//! budget that forces eviction give the same output as with unlimited memory; a kill -9 and
//! corrupted records lose nothing; apps and users cannot reach each other's contexts; hostile
//! clients do not take the service down.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::{fill_disk, kernel_ok, refused_start, small_disk, Daemon};
use llmsd::client::{Client, ClientError};
use llmsd::proto::{self, Call, CallStats, ErrorCode, Event, Request};

const PROMPTS: [&str; 6] = [
    "Name three colours of the rainbow.",
    "What is the capital of Italy?",
    "Write one sentence about the sea.",
    "How many legs does a spider have?",
    "Give me a word that rhymes with cat.",
    "What do bees make?",
];

fn call(c: &mut Client, ctx: &str, prompt: &str, max_tokens: u32) -> (String, CallStats) {
    let call =
        Call { ctx: ctx.into(), prompt: prompt.into(), max_tokens, temperature: 0.0, seed: 0, stop: vec![], raw: false, top_p: None };
    let mut streamed = String::new();
    let (text, st) = c.call(&call, &mut |t| streamed.push_str(t)).expect("call");
    assert_eq!(streamed, text, "the streamed pieces make the output");
    (text, st)
}

/// Rounds `rounds` of a conversation over contexts `ids` (context k gets prompt k + round).
fn rounds(c: &mut Client, ids: &[String], rounds: std::ops::Range<usize>) -> Vec<Vec<(String, CallStats)>> {
    rounds.map(|r| ids.iter().enumerate().map(|(k, id)| call(c, id, PROMPTS[(k + r) % PROMPTS.len()], 12)).collect()).collect()
}

fn new_contexts(c: &mut Client, n: usize) -> Vec<String> {
    (0..n).map(|k| c.new_ctx((k % 2 == 1).then_some("You are brief.")).expect("new_ctx")).collect()
}

/// Resident bytes of the process's userfaultfd-registered mappings (smaps VmFlags `um`).
fn uffd_rss(pid: u32) -> u64 {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) else { return 0 };
    let (mut total, mut rss) = (0, 0);
    for line in s.lines() {
        if let Some(v) = line.strip_prefix("Rss:") {
            rss = v.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap_or(0) * 1024;
        } else if let Some(f) = line.strip_prefix("VmFlags:") {
            if f.split_whitespace().any(|x| x == "um") {
                total += rss;
            }
        }
    }
    total
}

/// The peak of [`uffd_rss`] of a process, sampled every 5 ms on a thread until stopped.
struct PeakSampler {
    done: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl PeakSampler {
    fn start(pid: u32) -> Self {
        let done = Arc::new(AtomicBool::new(false));
        let d = Arc::clone(&done);
        let thread = std::thread::spawn(move || {
            let mut peak = 0;
            while !d.load(Ordering::SeqCst) {
                peak = peak.max(uffd_rss(pid));
                std::thread::sleep(Duration::from_millis(5));
            }
            peak
        });
        Self { done, thread }
    }

    fn stop(self) -> u64 {
        self.done.store(true, Ordering::SeqCst);
        self.thread.join().unwrap()
    }
}

const TIGHT: u64 = 3 << 20;

#[test]
fn interleaved_contexts_under_a_tight_budget_match_unlimited_memory() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exact = "levels = [\"int8\"]\nratio = 1.0\n";
    let run = |name: &str, settings: &str, watch: bool| {
        let d = Daemon::start(dir.path(), name, &dir.path().join(name), settings);
        let sampler = watch.then(|| PeakSampler::start(d.child.id()));
        let mut c = d.client("app");
        let ids = new_contexts(&mut c, 8);
        let out = rounds(&mut c, &ids, 0..3);
        let peak = sampler.map_or(0, PeakSampler::stop);
        let st = c.stats().unwrap();
        let biggest = st.mine.iter().map(|x| u64::from(x.chunks)).max().unwrap();
        d.stop();
        (out, st, biggest, peak)
    };
    let (free, _, _, _) = run("free", &format!("budget = \"1GiB\"\n{exact}"), false);
    let (tight, st, biggest, peak) = run("tight", &format!("budget = {TIGHT}\n{exact}"), true);
    assert!(st.evicted_chunks > 0, "the budget forced eviction: {st:?}");
    let read: u32 = tight.iter().flatten().map(|(_, s)| s.read_chunks).sum();
    assert!(read > 0, "contexts came back from flash");
    for (r, (a, b)) in free.iter().zip(&tight).enumerate() {
        for (k, (x, y)) in a.iter().zip(b).enumerate() {
            assert_eq!(x.0, y.0, "round {r} context {k}: output differs under the tight budget");
        }
    }
    // KV memory stayed within the budget plus the pinned working set (one context's chunks,
    // each slot at most 200 KiB for this model) during the whole run.
    let bound = TIGHT + biggest * (200 << 10);
    assert!(peak > 0 && peak <= bound, "uffd-resident {peak} over budget {TIGHT} + working set ({biggest} chunks)");

    // With compression on the outputs may differ: the lower levels must really be used, and
    // how many outputs agree is reported.
    let (mixed, mst, _, _) = run("mixed", &format!("budget = {TIGHT}\nlevels = [\"int8\", \"q4\", \"q2\"]\nratio = 0.5\n"), false);
    assert!(mst.mine.iter().any(|c| c.levels.keys().any(|k| k != "int8")), "no chunk was compressed at ratio 0.5: {:?}", mst.mine);
    let same = free.iter().flatten().zip(mixed.iter().flatten()).filter(|(a, b)| a.0 == b.0).count();
    eprintln!("compression at ratio 0.5: {same}/{} greedy outputs identical to uncompressed", free.len() * 8);
}

#[test]
fn kill_nine_and_corrupt_records_lose_nothing() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let settings = format!("budget = {TIGHT}\nlevels = [\"int8\"]\nratio = 1.0\n");
    let n = 4;
    // The reference: five rounds without incident.
    let reference = {
        let d = Daemon::start(dir.path(), "ref", &dir.path().join("ref"), &settings);
        let mut c = d.client("app");
        let ids = new_contexts(&mut c, n);
        let out = rounds(&mut c, &ids, 0..5);
        d.stop();
        out
    };
    let state = dir.path().join("crash");
    let d = Daemon::start(dir.path(), "crash1", &state, &settings);
    let mut c = d.client("app");
    let ids = new_contexts(&mut c, n);
    let first = rounds(&mut c, &ids, 0..2);
    let texts = |v: &[Vec<(String, CallStats)>]| v.iter().map(|r| r.iter().map(|x| x.0.clone()).collect::<Vec<_>>()).collect::<Vec<_>>();
    assert_eq!(texts(&first), texts(&reference[..2]));
    // Round 2 runs on another connection; the daemon is killed in the middle of it, after
    // its first call was answered.
    let answered = Arc::new(AtomicU64::new(0));
    let storm = {
        let (socket, ids, answered) = (d.socket.clone(), ids.clone(), Arc::clone(&answered));
        std::thread::spawn(move || {
            let Ok(mut c) = Client::connect(&socket, "app") else { return };
            for (k, id) in ids.iter().enumerate() {
                let call = Call { ctx: id.clone(), prompt: PROMPTS[(k + 2) % PROMPTS.len()].into(), max_tokens: 12, ..base_call() };
                if c.call(&call, &mut |_| {}).is_err() {
                    break;
                }
                answered.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    llms_tests::wait_until("round 2's first answer", Duration::from_secs(60), || (answered.load(Ordering::SeqCst) > 0).then_some(()));
    d.kill9();
    storm.join().unwrap();
    eprintln!("{} call(s) of round 2 answered before the kill", answered.load(Ordering::SeqCst));

    // Restart: every context continues as the reference did; the interrupted call is either
    // applied (calls = 3) or not (calls = 2).
    let d = Daemon::start(dir.path(), "crash2", &state, &settings);
    let mut c = d.client("app");
    let listed = c.list().unwrap();
    assert_eq!(listed.len(), n, "every context survived: {listed:?}");
    for (k, id) in ids.iter().enumerate() {
        let info = listed.iter().find(|x| &x.ctx == id).expect("listed");
        assert!(info.calls == 2 || info.calls == 3, "context {k} has {} calls", info.calls);
        for r in usize::try_from(info.calls).unwrap()..4 {
            let (text, _) = call(&mut c, id, PROMPTS[(k + r) % PROMPTS.len()], 12);
            assert_eq!(text, reference[r][k].0, "context {k} round {r} after the restart");
        }
    }
    d.stop();

    // Corrupt every record on flash: the next calls recompute and still answer exactly.
    let mut files = 0;
    for e in walk(&state.join("store")) {
        if is_context_store(&e) || e.to_string_lossy().contains(POOL_FILE) {
            let mut b = std::fs::read(&e).unwrap();
            for i in (4096 + 100..b.len()).step_by(4096) {
                b[i] ^= 0x5a;
            }
            std::fs::write(&e, b).unwrap();
            files += 1;
        }
    }
    assert_eq!(walk(&state.join("store")).iter().filter(|e| is_context_store(e)).count(), n, "one store file per context");
    assert!(files >= n, "the shared chunks' file (when some are shared) is corrupted too");
    let d = Daemon::start(dir.path(), "crash3", &state, &settings);
    let mut c = d.client("app");
    let mut recomputed = 0;
    for (k, id) in ids.iter().enumerate() {
        let (text, st) = call(&mut c, id, PROMPTS[(k + 4) % PROMPTS.len()], 12);
        assert_eq!(text, reference[4][k].0, "context {k} after its records were corrupted");
        recomputed += st.recomputed_chunks;
    }
    assert!(recomputed > 0, "corrupted records were recomputed");
    // Deleting a context removes its data.
    c.del_ctx(&ids[0]).unwrap();
    assert_eq!(c.list().unwrap().len(), n - 1);
    d.stop();
    let left = walk(&state.join("store")).iter().filter(|p| is_context_store(p)).count();
    assert_eq!(left, n - 1, "the deleted context's store file is gone");
}

/// The store's file of shared chunks (`mm::POOL_CTX`'s), beside one file per context.
const POOL_FILE: &str = "ctx-ffffffffffffffff.kv";

/// Whether `p` is a context's own store file (not the shared chunks').
fn is_context_store(p: &Path) -> bool {
    p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("ctx-") && n != POOL_FILE)
}

fn base_call() -> Call {
    Call { ctx: String::new(), prompt: String::new(), max_tokens: 8, temperature: 0.0, seed: 0, stop: vec![], raw: false, top_p: None }
}

fn walk(p: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            let path = e.path();
            if path.is_dir() {
                out.extend(walk(&path));
            } else {
                out.push(path);
            }
        }
    }
    out
}

fn code_of(e: &ClientError) -> Option<ErrorCode> {
    e.service().map(|s| s.code)
}

#[test]
fn apps_and_users_cannot_reach_each_other() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Other users must be able to reach the socket's directory for the mode to matter.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let d = Daemon::start(dir.path(), "open", &dir.path().join("state"), "socket_mode = \"0666\"\nmax_contexts_per_app = 3\n");
    let mut a = d.client("alpha");
    let ctx = a.new_ctx(None).unwrap();
    call(&mut a, &ctx, "Hello.", 4);
    let mut b = d.client("beta");
    assert!(b.list().unwrap().is_empty(), "another app sees nothing");
    let e = b.call(&Call { ctx: ctx.clone(), prompt: "x".into(), ..base_call() }, &mut |_| {}).unwrap_err();
    assert_eq!(code_of(&e), Some(ErrorCode::NotFound));
    assert_eq!(code_of(&b.del_ctx(&ctx).unwrap_err()), Some(ErrorCode::NotFound));
    // At most K contexts per app.
    for _ in 0..2 {
        a.new_ctx(None).unwrap();
    }
    assert_eq!(code_of(&a.new_ctx(None).unwrap_err()), Some(ErrorCode::TooMany));
    // Another user, same app name: the kernel's uid tells them apart. Running as another
    // user needs root (the machines this is built for run tests as root).
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        assert!(!llms_tests::kernel_required(), "not root: the other-uid half of this test cannot drop privileges");
        eprintln!("not root: the other-uid half of this test cannot drop privileges; skipped");
        d.stop();
        return;
    }
    let llms = common::llms_bin();
    let as_nobody = |args: &[&str]| {
        let out = Command::new(&llms).args(args).env("LLMS_SOCKET", &d.socket).uid(65534).gid(65534).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, out, err) = as_nobody(&["ctx", "list", "--app", "alpha", "--json"]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "[]", "uid 65534 sees none of root's contexts");
    let (ok, _, err) = as_nobody(&["ctx", "call", &ctx, "hi", "--app", "alpha"]);
    assert!(!ok && err.contains("NotFound"), "{err}");
    d.stop();

    // The default mode 0660 keeps other users out at connect(2).
    let d = Daemon::start(dir.path(), "closed", &dir.path().join("state2"), "");
    let mode = std::fs::metadata(&d.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);
    let (ok, _, err) = as_nobody_at(&llms, &d.socket);
    assert!(!ok && err.contains("ermission denied"), "{err}");
    d.stop();
}

fn as_nobody_at(llms: &Path, socket: &Path) -> (bool, String, String) {
    let out = Command::new(llms).args(["ctx", "list"]).env("LLMS_SOCKET", socket).uid(65534).gid(65534).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn raw_frame(s: &mut UnixStream, body: &[u8]) {
    proto::write_frame(s, body).unwrap();
}

/// The next event on a raw connection, None when it closed. Nothing for 5 minutes fails the
/// test (a connection the service admitted by mistake waits `idle_timeout_s`, an hour, for a
/// request): it must fail, not hang its CI run, nor pass as a close.
fn read_event(s: &mut UnixStream) -> Option<Event> {
    if s.read_timeout().ok().flatten().is_none() {
        s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    }
    match proto::read_frame(s) {
        Ok(b) => Some(proto::decode_event(&b).unwrap()),
        Err(proto::FrameError::Io(e)) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            panic!("no event and no close in 5 minutes")
        }
        Err(_) => None,
    }
}

fn is_error(e: Option<Event>, code: ErrorCode) -> bool {
    matches!(e, Some(Event::Error { code: c, .. }) if c == code)
}

#[test]
fn hostile_clients_do_not_take_the_service_down() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "h", &dir.path().join("state"), "io_timeout_s = 1\nmax_context_tokens = 256\nkeep_tokens = 32\n");
    let mut good = d.client("good");
    let ctx = good.new_ctx(None).unwrap();

    // Garbage, requests before bind, unknown ops, bad versions: errors, the connection lives.
    let mut s = UnixStream::connect(&d.socket).unwrap();
    raw_frame(&mut s, b"{not json");
    assert!(is_error(read_event(&mut s), ErrorCode::BadRequest));
    raw_frame(&mut s, &proto::encode(&Request::List {}));
    assert!(is_error(read_event(&mut s), ErrorCode::NotBound));
    raw_frame(&mut s, br#"{"op":"bind","app":"x","version":99}"#);
    assert!(is_error(read_event(&mut s), ErrorCode::Version));
    raw_frame(&mut s, br#"{"op":"bind","app":"../etc","version":1}"#);
    assert!(is_error(read_event(&mut s), ErrorCode::BadRequest));
    raw_frame(&mut s, &proto::encode(&Request::Bind { app: "x".into(), version: proto::VERSION }));
    assert!(matches!(read_event(&mut s), Some(Event::Bound { .. })));
    raw_frame(&mut s, br#"{"op":"call","ctx":"nope","prompt":"hi"}"#);
    assert!(is_error(read_event(&mut s), ErrorCode::NotFound));
    raw_frame(&mut s, &proto::encode(&Request::Call(Call { ctx: ctx.clone(), ..base_call() })));
    assert!(is_error(read_event(&mut s), ErrorCode::NotFound), "another app's context");
    raw_frame(&mut s, br#"{"op":"call","ctx":"x","prompt":"hi","max_tokens":4000000000}"#);
    assert!(is_error(read_event(&mut s), ErrorCode::NotFound));
    // An oversized frame: an error, then the service hangs up (the stream cannot resync).
    s.write_all(&u32::MAX.to_be_bytes()).unwrap();
    assert!(is_error(read_event(&mut s), ErrorCode::TooLarge));
    assert!(read_event(&mut s).is_none());

    // A half-sent frame is dropped after the I/O timeout; others are served meanwhile.
    let mut slow = UnixStream::connect(&d.socket).unwrap();
    slow.write_all(&[0, 0, 0, 50, b'{']).unwrap();
    call(&mut good, &ctx, "Hi.", 4);
    slow.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 1];
    assert_eq!(slow.read(&mut buf).unwrap_or(0), 0, "the slow client was hung up on");

    // A client that vanishes mid-call: the call is cancelled, what it made is kept. (A
    // context of its own: the 256-token window must not slide during the check.)
    let quit = good.new_ctx(None).unwrap();
    let (_, before) = call(&mut good, &quit, "Hi.", 4);
    {
        let mut v = d.client("good");
        let c = Call { ctx: quit.clone(), prompt: "1, 2, 3, 4, 5, 6, 7, 8,".into(), max_tokens: 100, raw: true, ..base_call() };
        v.request(&Request::Call(c)).unwrap();
    }
    // It queued ahead of this call; had it run to its 100 tokens, the context would have grown
    // by more than 100 tokens.
    let (_, after) = call(&mut good, &quit, "Go on.", 1);
    eprintln!("vanished call: context {} -> {} tokens", before.context_tokens, after.context_tokens);
    assert!(
        after.context_tokens > before.context_tokens && after.context_tokens < before.context_tokens + 100,
        "the vanished client's call was not cancelled: {} -> {} tokens",
        before.context_tokens,
        after.context_tokens
    );
    // Stop strings end the output before them.
    let c = Call { ctx: ctx.clone(), prompt: "Tell me about the sea.".into(), max_tokens: 40, stop: vec![" ".into()], ..base_call() };
    let (text, st) = good.call(&c, &mut |_| {}).unwrap();
    assert_eq!(st.finish, "stop", "{text:?}");
    assert!(!text.contains(' '), "{text:?}");
    // A prompt longer than the context window slides it.
    let long = "the quick brown fox jumps over the lazy dog ".repeat(40);
    let (_, st) = call(&mut good, &ctx, &long, 8);
    assert!(st.slid_tokens > 0 && st.context_tokens <= 256, "{st:?}");
    let (_, st) = call(&mut good, &ctx, "And now?", 8);
    assert!(st.context_tokens <= 256);

    // A flood of new contexts stops at the app's limit; the service keeps serving.
    let mut flood = d.client("flood");
    let mut made = 0;
    let err = loop {
        match flood.new_ctx(None) {
            Ok(_) => made += 1,
            Err(e) => break e,
        }
        assert!(made <= 16);
    };
    assert_eq!(code_of(&err), Some(ErrorCode::TooMany));
    assert_eq!(made, 16);
    call(&mut good, &ctx, "Still there?", 4);
    assert!(!good.list().unwrap()[0].busy);
    d.stop();
}

#[test]
fn pressure_on_the_services_cgroup_lowers_the_budget_and_reclaims() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // A cgroup v2 directory of our own (the machine's tree is not ours to change): the
    // monitor reads it like any cgroup; the test moves its usage.
    let cg = dir.path().join("cgroup");
    std::fs::create_dir(&cg).unwrap();
    let set = |current: u64| {
        for (f, v) in [
            ("memory.current", current.to_string()),
            ("memory.max", (1u64 << 30).to_string()),
            ("memory.high", "max".into()),
            ("memory.low", "0".into()),
            ("memory.events", "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n".into()),
            ("memory.pressure", "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n".into()),
        ] {
            let tmp = cg.join(format!("{f}.tmp"));
            std::fs::write(&tmp, v).unwrap();
            std::fs::rename(&tmp, cg.join(f)).unwrap();
        }
    };
    set(100 << 20);
    let settings = format!("budget = \"64MiB\"\nlevels = [\"int8\"]\nratio = 1.0\npressure = true\ncgroup = {cg:?}\n");
    let d = Daemon::start(dir.path(), "p", &dir.path().join("state"), &settings);
    let mut c = d.client("app");
    let ids = new_contexts(&mut c, 4);
    rounds(&mut c, &ids, 0..1);
    let calm = c.stats().unwrap();
    assert_eq!(calm.budget_bytes, 64 << 20, "{calm:?}");
    assert!(calm.resident_bytes > 0);
    // The cgroup fills up to 98% of its limit: critical.
    set(1_052_000_000);
    let squeezed = llms_tests::wait_until("the budget to follow the pressure", Duration::from_secs(30), || {
        let s = c.stats().unwrap();
        (s.budget_bytes < 64 << 20 && s.resident_bytes < calm.resident_bytes).then_some(s)
    });
    assert_ne!(squeezed.pressure, "normal");
    assert!(squeezed.resident_bytes <= squeezed.budget_bytes);
    // Calls still work (and give the same answers) under the squeezed budget.
    let again = rounds(&mut c, &ids, 1..2);
    assert!(again[0].iter().all(|(t, _)| !t.is_empty()));
    d.stop();
    let log = std::fs::read_to_string(dir.path().join("p.log")).unwrap();
    assert!(log.contains("reclaim under pressure"), "the reclaim was logged");
    // ...and told to the monitor (its post-eviction hold-off, docs/pressure.md).
    assert!(log.contains("the monitor holds off headroom"), "the reclaim was told to the monitor");
}

#[test]
fn paged_weights_share_the_budget_and_change_no_output() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exact = "levels = [\"int8\"]\nratio = 1.0\n";
    let run = |name: &str, settings: &str| {
        let d = Daemon::start(dir.path(), name, &dir.path().join(name), settings);
        let mut c = d.client("app");
        let ids = new_contexts(&mut c, 3);
        let out: Vec<String> = rounds(&mut c, &ids, 0..2).into_iter().flatten().map(|(t, _)| t).collect();
        let peak = uffd_rss(d.child.id());
        let st = c.stats().unwrap();
        d.stop();
        (out, st, peak)
    };
    let (resident, st0, _) = run("resident", &format!("budget = \"64MiB\"\n{exact}"));
    assert_eq!(st0.weights_budget_bytes, 0);
    let total: u64 = 48 << 20;
    let image = dir.path().join("w.img");
    let (paged, st, peak) = run("paged", &format!("budget = {total}\nweights_budget = \"40%\"\nweights_image = {image:?}\n{exact}"));
    assert_eq!(resident, paged, "paged weights changed the output");
    // One budget: the weights' share plus mm's KV budget is the configured total.
    assert_eq!(st.budget_bytes, total, "{st:?}");
    assert!(st.weights_budget_bytes > 0 && st.weights_budget_bytes < total);
    assert!(st.weights_resident_bytes <= st.weights_budget_bytes + (3 << 20), "{st:?}");
    // 40% of the weights cannot hold them: they streamed from the image.
    assert!(st.weights_read_bytes > 2 * st.weights_budget_bytes, "{st:?}");
    // userfaultfd-resident memory (weights and KV) within the budget plus one weight group in
    // flight and the running context's chunks.
    assert!(peak > 0 && peak <= total + (3 << 20) + (4 << 20), "uffd-resident {peak} over {total} (or never read)");
    assert!(st.weights_plan.is_empty(), "no plan was asked for: {st:?}");

    // Planned (dense: the output must not change): a channel-major image read by channel with
    // the plan's cache and preload room, or the packed image streamed, whichever the plan
    // predicts faster on this machine — under the same one budget.
    let image = dir.path().join("wp.img");
    let (planned, st, peak) =
        run("planned", &format!("budget = {total}\nweights_budget = \"40%\"\nweights_plan = true\nweights_image = {image:?}\n{exact}"));
    assert_eq!(resident, planned, "planned paged weights changed the output");
    assert_eq!(st.budget_bytes, total, "{st:?}");
    assert!(st.weights_budget_bytes > 0 && st.weights_budget_bytes < total);
    // Within the budget but for one streamed group in flight, or the embedding rows the
    // prompts fault in before the sparse pager next accounts them.
    assert!(st.weights_resident_bytes <= st.weights_budget_bytes + (3 << 20), "{st:?}");
    assert!(st.weights_read_bytes > st.weights_budget_bytes, "{st:?}");
    assert!(peak > 0 && peak <= total + (3 << 20) + (4 << 20), "uffd-resident {peak} over {total} (or never read)");
    let log = std::fs::read_to_string(dir.path().join("planned.log")).unwrap();
    assert!(log.contains("weight plan: sparsity 0,"), "the plan was not logged: {log}");
    // `llms stats` shows the plan in force.
    assert!(st.weights_plan.starts_with("weight plan: sparsity 0,"), "{st:?}");
}

/// Runs llmsd with `settings` and expects it to refuse to start; returns what it printed.
/// A state directory is one service's: a second instance, a regular file in the socket's place,
/// another user's directory, tmpfs and bad settings are refused with a message that says what
/// is wrong; what the service writes is private to its uid.
#[test]
fn the_state_dir_is_one_services_and_bad_settings_say_what_is_wrong() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let d = Daemon::start(dir.path(), "first", &state, "");
    let mut c = d.client("app");
    let ctx = c.new_ctx(Some("You are brief.")).unwrap();
    call(&mut c, &ctx, "Hi.", 4);

    // A second llmsd on the same state directory (its own socket) is refused, naming the pid.
    let err = refused_start(dir.path(), "second", &format!("socket = {:?}\nstate_dir = {state:?}", dir.path().join("second.sock")));
    assert!(err.contains("in use by another llmsd") && err.contains(&format!("pid {}", d.child.id())), "{err}");
    call(&mut c, &ctx, "Still yours?", 4);

    // The socket path names a regular file: refused, and the file is left as it was.
    let file = dir.path().join("precious.txt");
    std::fs::write(&file, "keep me").unwrap();
    let err = refused_start(dir.path(), "file", &format!("socket = {file:?}\nstate_dir = {:?}", dir.path().join("s2")));
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");

    // A state directory that is a file, on tmpfs, or another user's.
    let err = refused_start(dir.path(), "statefile", &format!("socket = {:?}\nstate_dir = {file:?}", dir.path().join("s3.sock")));
    assert!(err.contains("not a directory"), "{err}");
    let shm = Path::new("/dev/shm");
    if shm.is_dir() && Command::new("stat").args(["-f", "-c", "%T", "/dev/shm"]).output().is_ok_and(|o| o.stdout.starts_with(b"tmpfs")) {
        let t = tempfile::tempdir_in(shm).unwrap();
        let err = refused_start(dir.path(), "tmpfs", &format!("socket = {:?}\nstate_dir = {:?}", dir.path().join("s4.sock"), t.path()));
        assert!(err.contains("tmpfs"), "{err}");
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let theirs = dir.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        let err = refused_start(dir.path(), "theirs", &format!("socket = {:?}\nstate_dir = {theirs:?}", dir.path().join("s5.sock")));
        assert!(err.contains("belongs to uid 65534"), "{err}");
    } else {
        assert!(!llms_tests::kernel_required(), "the other-uid state directory check needs root");
    }

    // Settings that are wrong say how.
    let other = format!("socket = {:?}\nstate_dir = {:?}", dir.path().join("s6.sock"), dir.path().join("s6"));
    let model_dir = format!("model = {:?}", dir.path());
    for (setting, says) in
        [("budget = -5", "negative"), ("budget = true", "a size"), ("budget = 0", "zero"), (model_dir.as_str(), "is a directory")]
    {
        let err = refused_start(dir.path(), "bad", &format!("{other}\n{setting}"));
        assert!(err.contains(says), "{setting}: {err}");
    }

    // Everything the service wrote is private to its uid.
    d.stop();
    for f in walk(&state) {
        let mode = std::fs::metadata(&f).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{} is mode {mode:o}", f.display());
    }
}

/// A context whose saved tokens are outside the vocabulary, or longer than the configured
/// window, is kept and reported, never run and never deleted; the others go on. Bad calls are
/// refused with an error frame; time to first token counts the queue once.
#[test]
fn one_bad_context_never_stops_the_service() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let settings = "max_context_tokens = 512\nkeep_tokens = 32\n";
    let d = Daemon::start(dir.path(), "a", &state, settings);
    let mut c = d.client("app");
    let (bad, good) = (c.new_ctx(None).unwrap(), c.new_ctx(None).unwrap());
    call(&mut c, &bad, "Hi.", 4);
    call(&mut c, &good, PROMPTS[0], 24);

    // max_tokens 0 is refused and changes nothing.
    // (Tokens and calls: the records on flash may still be landing from the calls before.)
    let contents = |c: &mut Client| c.list().unwrap().into_iter().map(|i| (i.ctx, i.tokens, i.calls)).collect::<Vec<_>>();
    let before = contents(&mut c);
    let err = c.call(&Call { ctx: good.clone(), max_tokens: 0, ..base_call() }, &mut |_| {}).unwrap_err();
    assert_eq!(code_of(&err), Some(ErrorCode::BadRequest), "{err:#}");
    assert_eq!(contents(&mut c), before);

    // An error that would quote a huge input is cut to fit a frame: an answer, not a hang-up.
    let mut s = UnixStream::connect(&d.socket).unwrap();
    raw_frame(&mut s, &proto::encode(&Request::Bind { app: "app".into(), version: proto::VERSION }));
    assert!(matches!(read_event(&mut s), Some(Event::Bound { .. })));
    raw_frame(&mut s, &proto::encode(&Request::Call(Call { ctx: "x".repeat(proto::MAX_FRAME - 200), ..base_call() })));
    match read_event(&mut s) {
        Some(Event::Error { code: ErrorCode::NotFound, message }) => {
            assert!(message.len() <= proto::MAX_ERROR_MESSAGE, "{}", message.len())
        }
        e => panic!("{e:?}"),
    }

    // Time to first token counts the wait in the queue once: never more than the caller saw.
    let socket = d.socket.clone();
    let ahead = {
        let good = good.clone();
        std::thread::spawn(move || {
            let mut c2 = Client::connect(&socket, "app").unwrap();
            call(&mut c2, &good, "Count from one to twenty.", 64)
        })
    };
    let busy = |c: &mut Client, ctx: &str| c.list().unwrap().iter().any(|i| i.ctx == ctx && i.busy);
    llms_tests::wait_until("the call ahead to run", Duration::from_secs(60), || busy(&mut c, &good).then_some(()));
    let t = Instant::now();
    let (_, st) = call(&mut c, &bad, "Hello.", 2);
    let seen_ms = t.elapsed().as_secs_f64() * 1e3;
    ahead.join().unwrap();
    assert!(st.queue_ms > 0.0 && st.ttft_ms >= st.queue_ms && st.ttft_ms <= seen_ms, "{st:?}, caller saw {seen_ms:.1} ms");
    d.stop();

    // A token id outside the vocabulary in a context file (one an older build wrote: no
    // checksum to catch the edit, so the vocabulary check must).
    let file = state.join("contexts").join(format!("{bad}.json"));
    let text = std::fs::read_to_string(&file).unwrap();
    let body = text.rsplit_once("\n#crc32c ").map_or(text.as_str(), |(b, _)| b);
    let mut v: serde_json::Value = serde_json::from_str(body).unwrap();
    v["version"] = serde_json::json!(1);
    v["tokens"][3] = serde_json::json!(999_999);
    std::fs::write(&file, serde_json::to_vec(&v).unwrap()).unwrap();
    let d = Daemon::start(dir.path(), "b", &state, settings);
    let mut c = d.client("app");
    let err = c.call(&Call { ctx: bad.clone(), ..base_call() }, &mut |_| {}).unwrap_err();
    assert!(format!("{err:#}").contains("outside the vocabulary"), "{err:#}");
    let (_, st) = call(&mut c, &good, PROMPTS[1], 8);
    assert!(st.read_chunks + st.recomputed_chunks == st.missing_chunks);
    let list = c.list().unwrap();
    assert!(list.iter().any(|i| i.ctx == bad && i.unavailable.contains("outside the vocabulary")), "{list:?}");
    c.del_ctx(&bad).unwrap();
    assert!(!file.exists());
    let good_tokens = c.list().unwrap()[0].tokens as usize;
    d.stop();

    // Restarted with a window shorter than a context: the context is kept, not deleted.
    let short = format!("max_context_tokens = {}\nkeep_tokens = 8\n", (good_tokens / 2).max(32));
    let d = Daemon::start(dir.path(), "c", &state, &short);
    let mut c = d.client("app");
    let err = c.call(&Call { ctx: good.clone(), ..base_call() }, &mut |_| {}).unwrap_err();
    assert!(format!("{err:#}").contains("max_context_tokens"), "{err:#}");
    d.stop();
    let records = walk(&state.join("store")).iter().filter(|p| is_context_store(p)).count();
    assert_eq!(records, 1, "the context's records were kept");
    let d = Daemon::start(dir.path(), "d", &state, settings);
    let mut c = d.client("app");
    call(&mut c, &good, PROMPTS[2], 4);
    d.stop();
}

/// On a full disk a call fails whole: the caller hears ENOSPC, the context is as before the
/// call, and a retry once space is back adds the turn once. Stopping while the disk is full
/// says what is not on flash; after a restart every acknowledged turn is there.
#[test]
fn a_full_disk_fails_calls_whole_and_the_stop_tells_the_truth() {
    let Some((dir, img, mnt)) = small_disk(24 << 20, 256) else { return };
    let state = mnt.join("state");
    let settings = "budget = \"64MiB\"\n";
    let d = Daemon::start_on(dir.path(), "full", &state, settings, Some(&img));
    let mut c = d.client("app");
    let (a, r) = (c.new_ctx(None).unwrap(), c.new_ctx(None).unwrap());
    for ctx in [&a, &r] {
        call(&mut c, ctx, PROMPTS[0], 8);
    }
    call(&mut c, &r, PROMPTS[1], 8);
    let tokens = |c: &mut Client, ctx: &str| c.list().unwrap().into_iter().find(|i| i.ctx == ctx).unwrap().tokens;
    let before = tokens(&mut c, &a);

    let filler = fill_disk(&d, &mnt);
    let err = c.call(&Call { ctx: a.clone(), prompt: PROMPTS[1].into(), ..base_call() }, &mut |_| {}).unwrap_err();
    assert!(format!("{err:#}").contains("No space left on device"), "{err:#}");
    assert_eq!(tokens(&mut c, &a), before, "a failed call leaves its context as it was");
    std::fs::remove_dir_all(&filler).unwrap();
    call(&mut c, &a, PROMPTS[1], 8);
    assert_eq!(tokens(&mut c, &a), tokens(&mut c, &r), "the retry added the turn once");

    // Stop with the disk full: the log tells whether every chunk reached flash.
    fill_disk(&d, &mnt);
    let _ = c.call(&Call { ctx: a.clone(), prompt: PROMPTS[2].into(), ..base_call() }, &mut |_| {});
    let st = c.stats().unwrap();
    let acknowledged = tokens(&mut c, &a);
    let log = dir.path().join("full.log");
    d.stop();
    let log = std::fs::read_to_string(log).unwrap();
    if st.write_failures > 0 {
        assert!(st.last_write_error.contains("No space left"), "{st:?}");
        assert!(log.contains("not on flash") && !log.contains("every context is on flash"), "{log}");
    }
    // The disk image is mounted again in a fresh namespace (its filler is still there: free
    // it from inside once up). Every acknowledged turn came back.
    let d = Daemon::start_on(dir.path(), "full2", &state, settings, Some(&img));
    std::fs::remove_dir_all(PathBuf::from(format!("/proc/{}/root{}", d.child.id(), mnt.join("filler").display()))).unwrap();
    let mut c = d.client("app");
    assert_eq!(tokens(&mut c, &a), acknowledged);
    call(&mut c, &a, PROMPTS[3], 4);
    d.stop();
}

/// A swap store that cannot take chunks (its own file system full; the contexts' files are
/// elsewhere, so calls are acknowledged) does not stop the service or push it past its
/// budget: a chunk whose write fails is evicted unwritten and recomputed at its next load,
/// and every answer is what it is with the disk free.
#[test]
fn chunks_a_full_store_cannot_take_are_recomputed_and_the_budget_holds() {
    let Some((dir, img, mnt)) = small_disk(64 << 20, 2048) else { return };
    let Some((_store_dir, store_img, _)) = small_disk(16 << 20, 256) else { return };
    let settings = format!("budget = {TIGHT}\nlevels = [\"int8\"]\nratio = 1.0\n");
    let reference = {
        let d = Daemon::start(dir.path(), "free", &dir.path().join("free"), &settings);
        let mut c = d.client("app");
        let ids = new_contexts(&mut c, 4);
        let out = rounds(&mut c, &ids, 0..3);
        d.stop();
        out
    };
    let state = mnt.join("state");
    let store = state.join("store");
    let d = Daemon::start_mounted(dir.path(), "full", &state, &settings, &[(&img, &mnt), (&store_img, &store)]);
    let mut c = d.client("app");
    let ids = new_contexts(&mut c, 4);
    // Full but for 100 KiB: less than a chunk's record (about 200 KiB), which a write fails
    // part-way through.
    let filler = fill_disk(&d, &store);
    let blocks = std::fs::OpenOptions::new().write(true).open(filler.join("blocks")).unwrap();
    blocks.set_len(blocks.metadata().unwrap().len() - (100 << 10)).unwrap();
    blocks.sync_all().unwrap();
    let sampler = PeakSampler::start(d.child.id());
    let out = rounds(&mut c, &ids, 0..3);
    let peak = sampler.stop();
    let st = c.stats().unwrap();
    assert!(st.write_failures > 0, "the store took the chunks: {st:?}");
    assert!(st.dropped_unsaved > 0, "nothing was evicted unwritten: {st:?}");
    let recomputed: u32 = out.iter().flatten().map(|(_, s)| s.recomputed_chunks).sum();
    assert!(recomputed > 0, "no chunk was recomputed");
    for (r, (a, b)) in reference.iter().zip(&out).enumerate() {
        for (k, (x, y)) in a.iter().zip(b).enumerate() {
            assert_eq!(x.0, y.0, "round {r} context {k}: output differs with the store full");
        }
    }
    let biggest = st.mine.iter().map(|x| u64::from(x.chunks)).max().unwrap();
    let bound = TIGHT + biggest * (200 << 10);
    assert!(peak > 0 && peak <= bound, "uffd-resident {peak} over budget {TIGHT} + working set ({biggest} chunks)");
    d.stop();
}

/// Limits per uid (app names are the client's to choose, the uid is the kernel's): connections,
/// contexts over all its apps, text held, calls waiting and records on flash; each refusal
/// names its limit. A frame trickled a byte at a time is cut off at `io_timeout_s`.
#[test]
fn one_uid_cannot_take_the_service_for_itself() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let settings = "io_timeout_s = 1\nmax_connections_per_uid = 4\nmax_contexts_per_uid = 4\nmax_queued_per_uid = 1\n\
                    max_text_per_uid = \"2KiB\"\nmax_disk_per_uid = \"4MiB\"\n";
    let d = Daemon::start(dir.path(), "u", &dir.path().join("state"), settings);
    let mut c = d.client("a");
    // The start-up probe (a connection opened and closed) is counted until its thread sees
    // it closed: without waiting for it, the fifth below may fit.
    common::wait_only_this_connection(&mut c, "the start-up probe");

    // Connections: the main client and three more; a fifth is refused, naming the limit.
    let mut extra: Vec<UnixStream> = (0..3).map(|_| UnixStream::connect(&d.socket).unwrap()).collect();
    let mut fifth = UnixStream::connect(&d.socket).unwrap();
    match read_event(&mut fifth) {
        Some(Event::Error { code: ErrorCode::TooMany, message }) => assert!(message.contains("max_connections_per_uid"), "{message}"),
        e => panic!("{e:?}"),
    }
    extra.clear();

    // A trickled frame: one byte every 300 ms is hung up on at the frame's deadline.
    // (Bound first: the three connections just closed may not be released yet, and a refused
    // connection's answer must not be taken for an answer to the trickle.)
    let mut slow = (0..100)
        .find_map(|_| {
            let mut s = UnixStream::connect(&d.socket).ok()?;
            // A refused connection may be closed before the bind is written: try again.
            if proto::write_frame(&mut s, &proto::encode(&Request::Bind { app: "slow".into(), version: proto::VERSION })).is_err() {
                std::thread::sleep(Duration::from_millis(50));
                return None;
            }
            if !matches!(read_event(&mut s), Some(Event::Bound { .. })) {
                std::thread::sleep(Duration::from_millis(50));
                return None;
            }
            s.write_all(&[0, 0, 0, 50]).ok()?;
            Some(s)
        })
        .unwrap();
    slow.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let mut sent = 0;
    let mut buf = [0u8; 64];
    let hung_up = loop {
        if slow.write_all(b" ").is_err() {
            break true;
        }
        sent += 1;
        match slow.read(&mut buf) {
            Ok(0) => break true,
            Ok(_) => panic!("an answer to half a frame"),
            Err(_) if sent < 49 => {}
            Err(_) => break false,
        }
    };
    assert!(hung_up && sent < 20, "the trickled frame was still open after {sent} bytes");
    drop(slow);

    // Text held: a system prompt over the uid's text limit is refused.
    let err = c.new_ctx(Some(&"You are brief. ".repeat(200))).unwrap_err();
    assert!(format!("{err:#}").contains("max_text_per_uid"), "{err:#}");
    // Contexts over all of a uid's app names.
    let mut b = d.client("b");
    let ids = [c.new_ctx(None).unwrap(), c.new_ctx(None).unwrap(), b.new_ctx(None).unwrap(), b.new_ctx(None).unwrap()];
    let err = d.client("c").new_ctx(None).unwrap_err();
    assert!(format!("{err:#}").contains("max_contexts_per_uid"), "{err:#}");
    drop(b);

    // Calls waiting: one runs, one waits, the next is refused. (The waiting call is on the
    // running call's context: a call on another context would join the running one's batch.)
    let socket = d.socket.clone();
    let running = {
        let id = ids[0].clone();
        std::thread::spawn(move || {
            // Counting, raw: a continuation that does not end early.
            let long = Call { ctx: id, prompt: "1, 2, 3, 4, 5, 6, 7, 8,".into(), max_tokens: 200, raw: true, ..base_call() };
            Client::connect(&socket, "a").unwrap().call(&long, &mut |_| {}).unwrap()
        })
    };
    llms_tests::wait_until("the long call to run", Duration::from_secs(60), || {
        c.list().unwrap().iter().any(|i| i.ctx == ids[0] && i.busy).then_some(())
    });
    let mut waiting = UnixStream::connect(&d.socket).unwrap();
    raw_frame(&mut waiting, &proto::encode(&Request::Bind { app: "a".into(), version: proto::VERSION }));
    assert!(matches!(read_event(&mut waiting), Some(Event::Bound { .. })));
    raw_frame(&mut waiting, &proto::encode(&Request::Call(Call { ctx: ids[0].clone(), prompt: "Hi.".into(), ..base_call() })));
    let mut b = d.client("b");
    llms_tests::wait_until("the second call to queue", Duration::from_secs(60), || (b.stats().unwrap().queue > 0).then_some(()));
    let err = b.call(&Call { ctx: ids[2].clone(), prompt: "Hi.".into(), ..base_call() }, &mut |_| {}).unwrap_err();
    assert!(format!("{err:#}").contains("max_queued_per_uid"), "{err:#}");
    running.join().unwrap();
    drop(waiting);
    // The waiting call is dropped with its client: let the worker take it off the queue.
    llms_tests::wait_until("the queue to drain", Duration::from_secs(60), || (c.stats().unwrap().queue == 0).then_some(()));

    // Records on flash: calls go on until the uid's contexts hold more than its share.
    let mut refused = None;
    for _ in 0..30 {
        match c.call(&Call { ctx: ids[0].clone(), prompt: "Go on.".into(), max_tokens: 64, ..base_call() }, &mut |_| {}) {
            Ok(_) => {}
            Err(e) => {
                refused = Some(format!("{e:#}"));
                break;
            }
        }
    }
    let refused = refused.expect("the disk limit was never reached");
    assert!(refused.contains("max_disk_per_uid"), "{refused}");
    // Deleting frees the share.
    c.del_ctx(&ids[0]).unwrap();
    call(&mut c, &ids[1], "Hi.", 4);
    d.stop();
}

/// Context files carry a checksum and a previous good copy: an edited token id is caught and
/// the previous copy used (loudly, one call behind); a context whose files are both damaged is
/// left as it is with its store data; `llms doctor --state-dir` reports both.
#[test]
fn damaged_context_files_are_caught_never_continued() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let d = Daemon::start(dir.path(), "a", &state, "");
    let mut c = d.client("app");
    let ids = new_contexts(&mut c, 3);
    for id in &ids {
        call(&mut c, id, PROMPTS[0], 6);
    }
    let after_one: Vec<u32> = c.list().unwrap().iter().map(|i| i.tokens).collect();
    let order: Vec<String> = c.list().unwrap().iter().map(|i| i.ctx.clone()).collect();
    for id in &ids {
        call(&mut c, id, PROMPTS[1], 6);
    }
    d.stop();
    let records = || walk(&state.join("store")).iter().filter(|p| is_context_store(p)).count();
    assert_eq!(records(), 3);
    let file = |id: &str| state.join("contexts").join(format!("{id}.json"));

    // An edited token id (the JSON still well-formed).
    let (edited, broken) = (&order[0], &order[1]);
    let text = std::fs::read_to_string(file(edited)).unwrap();
    let at = text.find("\"tokens\":[").unwrap() + 10;
    let end = at + text[at..].find(',').unwrap();
    std::fs::write(file(edited), format!("{}{}{}", &text[..at], text[at..end].parse::<u32>().unwrap() ^ 1, &text[end..])).unwrap();
    // A flipped bit in both copies of another.
    for f in [file(broken), state.join("contexts").join(format!("{broken}.json.prev"))] {
        let mut b = std::fs::read(&f).unwrap();
        b[20] ^= 0x10;
        std::fs::write(&f, b).unwrap();
    }
    let out = Command::new(common::llms_bin()).args(["doctor", "--json", "--state-dir"]).arg(&state).output().unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let status =
        |id: &str| report.as_array().unwrap().iter().find(|c| c["facility"] == format!("context {id}")).map(|c| c["status"].clone());
    assert_eq!(status(edited), Some(serde_json::json!("previous copy")), "{report}");
    assert_eq!(status(broken), Some(serde_json::json!("damaged")), "{report}");

    let d = Daemon::start(dir.path(), "b", &state, "");
    let mut c = d.client("app");
    let list = c.list().unwrap();
    assert_eq!(list.len(), 2, "the damaged context is not served: {list:?}");
    let e = list.iter().find(|i| &i.ctx == edited).unwrap();
    assert_eq!(e.tokens, after_one[0], "the edited context went back to its previous copy");
    assert!(d.log_text().contains("previous copy is used"), "{}", d.log_text());
    for i in &list {
        call(&mut c, &i.ctx, PROMPTS[2], 4);
    }
    d.stop();
    assert_eq!(records(), 3, "the damaged context's store data is kept");
}

/// What a soak client knows of its context.
#[derive(Debug, Clone)]
struct Known {
    ctx: String,
    /// Tokens after its last acknowledged call (or as listed after a reconnect).
    tokens: u32,
}

/// Whether an error is the service's answer (the connection lives) rather than a dead
/// connection.
fn answered(e: &ClientError) -> bool {
    e.service().is_some()
}

/// One soak client: calls (and every seventh turn replaces) its context until `until`,
/// checking every acknowledged call against the one before (no turn lost, none duplicated);
/// after the service is killed it reconnects and checks its context against what was
/// acknowledged. Returns its context and its counts: acknowledged, refused or failed, reconnects.
fn soak_client(socket: &Path, k: usize, until: Instant) -> Result<(usize, Known, [u32; 3]), String> {
    let app = format!("soak{k}");
    let connect = || -> Result<Client, String> {
        let t = Instant::now();
        loop {
            match Client::connect(socket, &app) {
                Ok(c) => return Ok(c),
                Err(_) if t.elapsed() < Duration::from_secs(120) => std::thread::sleep(Duration::from_millis(100)),
                Err(e) => return Err(format!("client {k}: cannot reconnect: {e:#}")),
            }
        }
    };
    let mut c = connect()?;
    let mut me: Option<Known> = None;
    let (mut acked, mut failed, mut reconnects) = (0u32, 0u32, 0u32);
    let mut n = 0usize;
    while Instant::now() < until {
        n += 1;
        let outcome: Result<(), ClientError> = match me.clone() {
            None => c.new_ctx(None).map(|id| me = Some(Known { ctx: id, tokens: 0 })),
            // Churn: the context goes (a new one comes at the next turn).
            Some(m) if n.is_multiple_of(7) => c.del_ctx(&m.ctx).map(|()| me = None),
            Some(m) => {
                let call = Call { ctx: m.ctx.clone(), prompt: PROMPTS[(k + n) % PROMPTS.len()].into(), max_tokens: 6, ..base_call() };
                match c.call(&call, &mut |_| {}) {
                    Ok((_, st)) => {
                        let want =
                            i64::from(m.tokens) - i64::from(st.slid_tokens) + i64::from(st.prompt_tokens) + i64::from(st.output_tokens);
                        if i64::from(st.context_tokens) != want {
                            return Err(format!(
                                "client {k}: {} tokens after a call, {want} expected from the last one: {st:?}",
                                st.context_tokens
                            ));
                        }
                        me = Some(Known { ctx: m.ctx.clone(), tokens: st.context_tokens });
                        acked += 1;
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
        };
        match outcome {
            Ok(()) => {}
            Err(e) if answered(&e) => failed += 1,
            Err(_) => {
                // The connection died (the service was killed): reconnect; what was
                // acknowledged must be there. An answer that never came may or may not have
                // been done (a turn saved, a context deleted or made): the list says which.
                reconnects += 1;
                c = connect()?;
                let list = c.list().map_err(|e| e.to_string())?;
                if let Some(m) = &me {
                    match list.iter().find(|i| i.ctx == m.ctx) {
                        Some(i) if i.tokens >= m.tokens => me = Some(Known { ctx: m.ctx.clone(), tokens: i.tokens }),
                        Some(i) => return Err(format!("client {k}: {} tokens after a restart, {} were acknowledged", i.tokens, m.tokens)),
                        None if n.is_multiple_of(7) => me = None,
                        None => return Err(format!("client {k}: context {} with {} acknowledged tokens is gone", m.ctx, m.tokens)),
                    }
                }
            }
        }
    }
    // End with a context (its tokens are checked after a restart).
    if me.is_none() {
        me = Some(Known { ctx: c.new_ctx(None).map_err(|e| format!("client {k}: {e:#}"))?, tokens: 0 });
    }
    Ok((k, me.expect("set above"), [acked, failed, reconnects]))
}

/// A CI-sized soak: 32 clients for 60 s, their contexts churned, the disk filled for part of
/// it and the service killed with SIGKILL and restarted in the middle: no acknowledged turn is
/// lost or duplicated, nothing hangs, KV memory stays within the budget plus one pinned
/// context, and the store within the uid's disk share plus one context's records.
#[test]
fn soak_many_clients_a_full_disk_and_a_kill() {
    let Some((dir, img, mnt)) = small_disk(256 << 20, 2048) else { return };
    let state = mnt.join("state");
    const BUDGET: u64 = 8 << 20;
    const DISK: u64 = 96 << 20;
    let settings = format!(
        "budget = {BUDGET}\nmax_context_tokens = 256\nkeep_tokens = 16\nmax_connections = 64\nmax_connections_per_uid = 64\n\
         max_queued_per_uid = 64\nmax_contexts_per_app = 4\nmax_disk_per_uid = {DISK}\n"
    );
    let mut d = Daemon::start_on(dir.path(), "soak", &state, &settings, Some(&img));
    let socket = d.socket.clone();
    let t0 = Instant::now();
    let until = t0 + Duration::from_secs(60);
    let (tx, rx) = std::sync::mpsc::channel();
    for k in 0..32 {
        let (tx, socket) = (tx.clone(), socket.clone());
        std::thread::spawn(move || tx.send(soak_client(&socket, k, until)).unwrap());
    }
    drop(tx);
    // The controller: memory sampled all along; the disk full from 15 to 25 s; a SIGKILL at
    // 35 s and a restart at once.
    let mut peak = 0u64;
    let (mut filled, mut killed) = (None, false);
    while Instant::now() < until {
        peak = peak.max(uffd_rss(d.child.id()));
        let t = t0.elapsed();
        if filled.is_none() && t > Duration::from_secs(15) && t < Duration::from_secs(25) {
            filled = Some(fill_disk(&d, &mnt));
        }
        if t > Duration::from_secs(25) {
            if let Some(f) = filled.take() {
                std::fs::remove_dir_all(f).unwrap_or_else(|e| panic!("freeing the disk: {e}; llmsd: {}", d.log_text()));
            }
        }
        if !killed && t > Duration::from_secs(35) {
            d.kill9();
            // Same name: same socket, which the clients reconnect to.
            d = Daemon::start_on(dir.path(), "soak", &state, &settings, Some(&img));
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    if let Some(f) = filled.take() {
        std::fs::remove_dir_all(f).unwrap();
    }
    let mut known = Vec::new();
    let mut totals = [0u32; 3];
    for _ in 0..32 {
        let r = rx.recv_timeout(Duration::from_secs(180)).expect("a soak client hung");
        let (k, me, counts) = r.unwrap_or_else(|e| panic!("{e}\n{}", d.log_text()));
        known.push((k, me));
        for (t, c) in totals.iter_mut().zip(counts) {
            *t += c;
        }
    }
    eprintln!(
        "soak: {} calls acknowledged, {} refused or failed, {} reconnects; peak uffd-resident {peak}",
        totals[0], totals[1], totals[2]
    );
    assert!(totals[0] > 100 && totals[2] > 0, "the soak ran: {totals:?}");
    let bound = BUDGET + 17 * (200 << 10);
    assert!(peak > 0 && peak <= bound, "uffd-resident {peak} over the budget {BUDGET} + one pinned context (or never read)");
    let store =
        Command::new("du").args(["-sB1"]).arg(format!("/proc/{}/root{}", d.child.id(), state.join("store").display())).output().unwrap();
    let on_disk: u64 = String::from_utf8_lossy(&store.stdout).split_whitespace().next().unwrap().parse().unwrap();
    assert!(on_disk <= DISK + 17 * (260 << 10), "the store holds {on_disk} bytes, over the uid's share {DISK}");
    // A clean stop and start: every context holds exactly its acknowledged turns.
    d.stop();
    let d = Daemon::start_on(dir.path(), "soak3", &state, &settings, Some(&img));
    for (k, me) in &known {
        let list = Client::connect(&d.socket, &format!("soak{k}")).unwrap().list().unwrap();
        let i = list.iter().find(|i| i.ctx == me.ctx).unwrap_or_else(|| {
            let f = format!("/proc/{}/root{}", d.child.id(), state.join("contexts").join(format!("{}.json", me.ctx)).display());
            let log: String = d.log_text().lines().filter(|l| !l.contains("INFO")).collect::<Vec<_>>().join("\n");
            panic!("client {k}'s context {me:?} is gone; its app lists {list:?}; file there: {}; log: {log}", Path::new(&f).exists())
        });
        assert_eq!(i.tokens, me.tokens, "client {k}");
    }
    d.stop();
}

/// Compiles a C program of the client crate against the C library (the static archive cargo
/// built beside this test) and returns the executable.
fn build_c(dir: &Path, source: &str, name: &str) -> PathBuf {
    let client = Path::new(env!("CARGO_MANIFEST_DIR")).join("../client");
    let deps = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    let lib = deps.join("libllms_client.a");
    assert!(lib.exists(), "the C library was not built at {}", lib.display());
    let exe = dir.join(name);
    let out = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-D_DEFAULT_SOURCE", "-I"])
        .arg(client.join("include"))
        .arg(client.join(source))
        .arg(&lib)
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(&exe)
        .output()
        .expect("cc runs");
    assert!(out.status.success(), "cc {source}: {}", String::from_utf8_lossy(&out.stderr));
    exe
}

/// The C library against a live llmsd: its test program (errors, a streamed two-turn
/// conversation, cancellation from the callback and from another thread, listing, deleting)
/// and the example chat, both compiled here with the header.
#[test]
fn the_c_library_talks_to_llmsd() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "c", &dir.path().join("state"), "");
    let test = build_c(dir.path(), "tests/c/client_test.c", "client_test");
    let out = Command::new(&test).arg(&d.socket).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("passed, 0 failed"), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let chat = build_c(dir.path(), "examples/chat.c", "chat");
    let out = Command::new(&chat).arg(&d.socket).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(stdout.matches("> ").count(), 2, "two turns: {stdout}");
    assert!(stdout.lines().filter(|l| !l.starts_with("> ") && !l.trim().is_empty()).count() >= 2, "two answers: {stdout}");
    d.stop();
}

/// The default levels (the split ones) rotate head vectors: llmsd refuses a model whose heads
/// cannot be rotated at start, naming the levels that work, and serves it with those.
#[test]
fn levels_a_model_cannot_hold_are_refused_at_start() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // The default model's shape, small, with heads of 48 channels: not a power of two.
    let m = dir.path().join("hd48.gguf");
    let out = Command::new(common::llms_bin())
        .args(["synth", "--like", "smollm2-135m", "--dim", "96", "--layers", "2", "--heads", "2", "--kv-heads", "2", "--ffn", "128"])
        .args(["--type", "f32", "--seed", "1", "--tokenizer-from"])
        .arg(llms_tests::model_path())
        .arg("--out")
        .arg(&m)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let at = |name: &str| {
        format!("model = {m:?}\nsocket = {:?}\nstate_dir = {:?}\n", dir.path().join(format!("{name}.sock")), dir.path().join(name))
    };
    let err = refused_start(dir.path(), "split", &at("split"));
    assert!(err.contains("k4v4") && err.contains("48 channels") && err.contains("\"q4\""), "{err}");
    let d = Daemon::start(dir.path(), "q", &dir.path().join("q"), &format!("model = {m:?}\nlevels = [\"int8\", \"q4\", \"q2\"]\n"));
    let mut c = d.client("app");
    let ctx = c.new_ctx(None).unwrap();
    let (_, st) = call(&mut c, &ctx, "Hello", 4);
    assert_eq!(st.output_tokens, 4, "{st:?}");
    d.stop();
}

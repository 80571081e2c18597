//! llmsd's OpenAI-compatible HTTP front end to end: the real `openai` and `prometheus_client`
//! Python packages (llmsd/tests/py, installed into target/py by `make pyenv`) against the real
//! daemon, a conversation continued across a restart, `curl -N` reading the event stream, and
//! hostile HTTP (oversized bodies, headers that never end, bad settings).

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{kernel_ok, refused_start, Daemon};
use llms_tests::kernel_required;

const TOKEN_A: &str = "tok-a-0123456789abcdef";
const TOKEN_B: &str = "tok-b-0123456789abcdef";

/// The venv's Python with the pinned clients, or `None` (a failure under `make test`).
fn python() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/py/bin/python");
    let ok = p.exists() && Command::new(&p).args(["-c", "import openai, prometheus_client"]).output().is_ok_and(|o| o.status.success());
    if ok {
        return Some(p);
    }
    let msg = format!("{} with openai and prometheus_client is missing (make pyenv)", p.display());
    assert!(!kernel_required(), "{msg}");
    eprintln!("skipping: {msg}");
    None
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn tokens_file(dir: &Path, mode: u32) -> PathBuf {
    let p = dir.join(format!("tokens-{mode:o}"));
    std::fs::write(&p, format!("# app token\npy-tcp {TOKEN_A}\npy-tcp2 {TOKEN_B}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    p
}

fn run_py(py: &Path, phase: &str, http: &Path, port: u16, state: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/openai_client.py");
    let out = Command::new(py)
        .arg(script)
        .args([phase, &http.display().to_string(), &format!("http://127.0.0.1:{port}"), TOKEN_A, TOKEN_B, &state.display().to_string()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("ok "), "{phase}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
}

/// A raw HTTP exchange on the HTTP socket: what comes back before the server closes or
/// `wait` passes.
fn raw_http(sock: &Path, request: &[u8], wait: Duration) -> String {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(wait)).unwrap();
    let _ = s.write_all(request);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

fn settings(port: u16, tokens: &Path) -> String {
    // int8 only: no lossy level, so a continued context's greedy output equals a fresh one's.
    // A 2 MiB budget evicts; max_queue = 2 makes a burst of calls meet 429; max_batch = 1 makes
    // a call that comes while another runs wait in the queue (batched, the stop scenario's
    // "queued" call could join the running one's batch before the stop and be answered 200:
    // it did in release builds).
    format!(
        "levels = [\"int8\"]\nbudget = \"2MiB\"\nmax_context_tokens = 512\nmax_queue = 2\nmax_batch = 1\nio_timeout_s = 2\nhttp = \"127.0.0.1:{port}\"\nhttp_tokens = {tokens:?}\n"
    )
}

/// Every client-visible behaviour of the front, with the real clients; the conversation goes
/// on after the service was stopped and started again.
#[test]
fn openai_clients_continue_persistent_contexts() {
    if !kernel_ok() {
        return;
    }
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let tokens = tokens_file(dir.path(), 0o600);
    let port = free_port();
    let d = Daemon::start(dir.path(), "h", &state, &settings(port, &tokens));
    let http = dir.path().join("h.http.sock");
    assert!(http.exists(), "the HTTP socket sits beside the native one");
    let conv = dir.path().join("conversation.json");
    run_py(&py, "main", &http, port, &conv);

    // curl -N reads the events as they come.
    let out = Command::new("curl")
        .args(["-sN", "--unix-socket"])
        .arg(&http)
        .args(["-H", "X-LLMS-App: curl", "http://llmsd/v1/chat/completions", "-d"])
        .arg(r#"{"messages":[{"role":"user","content":"Hi!"}],"stream":true,"max_tokens":8,"temperature":0}"#)
        .output()
        .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.trim().is_empty()).collect();
    assert!(events.len() >= 4 && events.iter().all(|e| e.starts_with("data: ")), "{text}");
    assert_eq!(events.last().copied(), Some("data: [DONE]"), "{text}");

    // Hostile HTTP: an oversized body, headers that never end, a body that is not JSON.
    let big = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n", 2 << 20);
    let mut req = big.into_bytes();
    req.extend(std::iter::repeat_n(b'x', 2 << 20));
    let r = raw_http(&http, &req, Duration::from_secs(10));
    assert!(r.starts_with("HTTP/1.1 413") && r.contains("request_too_large"), "{}", &r[..r.len().min(300)]);
    let t = Instant::now();
    let r = raw_http(&http, b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: ", Duration::from_secs(30));
    assert!(t.elapsed() < Duration::from_secs(20), "a connection whose headers never end is closed (io_timeout_s)");
    assert!(!r.contains("200 OK"), "{r}");
    let r = raw_http(
        &http,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 3\r\n\r\n\xff\xfe{",
        Duration::from_secs(10),
    );
    assert!(r.starts_with("HTTP/1.1 400") && r.contains("invalid_request_error"), "{r}");
    // The service still answers.
    let r = raw_http(&http, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", Duration::from_secs(10));
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");

    // A stop: the call running finishes its answer, a queued one gets 503.
    let mut first = UnixStream::connect(&http).unwrap();
    first.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body =
        r#"{"messages":[{"role":"user","content":"Count from one to fifty in words."}],"stream":true,"max_tokens":60,"temperature":0}"#;
    write!(first, "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-llms-app: stop-a\r\ncontent-length: {}\r\n\r\n{body}", body.len())
        .unwrap();
    let mut head = [0u8; 64];
    let n = first.read(&mut head).unwrap();
    assert!(head[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&head[..n]));
    let queued = std::thread::spawn({
        let http = http.clone();
        move || {
            let body = r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":4}"#;
            let req = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-llms-app: stop-b\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}", body.len());
            raw_http(&http, req.as_bytes(), Duration::from_secs(60))
        }
    });
    let mut watch = d.client("watch");
    llms_tests::wait_until("the second call to queue", Duration::from_secs(60), || (watch.stats().unwrap().queue > 0).then_some(()));
    // SAFETY: plain kill(2) on our child.
    unsafe { libc::kill(i32::try_from(d.child.id()).unwrap(), libc::SIGTERM) };
    let mut rest = Vec::new();
    let _ = first.read_to_end(&mut rest);
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("data: [DONE]") && rest.contains("\"finish_reason\":\""), "the running call is answered whole: {rest}");
    let r = queued.join().unwrap();
    assert!(r.starts_with("HTTP/1.1 503") && r.contains("shutting_down") && r.to_lowercase().contains("retry-after"), "{r}");
    d.stop();
    assert!(!http.exists(), "the HTTP socket is removed at shutdown");
    let d = Daemon::start(dir.path(), "h", &state, &settings(port, &tokens));
    run_py(&py, "restart", &http, port, &conv);
    d.stop();
}

/// TCP without tokens, on an address others can reach, or with a token file others can read
/// is refused at start, saying why.
#[test]
fn the_http_front_refuses_unsafe_settings() {
    let dir = tempfile::tempdir().unwrap();
    let base = |name: &str| format!("socket = {:?}\nstate_dir = {:?}\n", dir.path().join(format!("{name}.sock")), dir.path().join(name));
    let e = refused_start(dir.path(), "t1", &format!("{}http = \"127.0.0.1:{}\"\n", base("t1"), free_port()));
    assert!(e.contains("needs http_tokens"), "{e}");
    let e = refused_start(dir.path(), "t2", &format!("{}http = \"0.0.0.0:{}\"\nhttp_tokens = \"/x\"\n", base("t2"), free_port()));
    assert!(e.contains("loopback"), "{e}");
    if kernel_ok() {
        let loose = tokens_file(dir.path(), 0o644);
        let e = refused_start(dir.path(), "t3", &format!("{}http = \"127.0.0.1:{}\"\nhttp_tokens = {loose:?}\n", base("t3"), free_port()));
        assert!(e.contains("must be mode 0600"), "{e}");
        let short = dir.path().join("short");
        std::fs::write(&short, "app short\n").unwrap();
        std::fs::set_permissions(&short, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = refused_start(dir.path(), "t4", &format!("{}http = \"127.0.0.1:{}\"\nhttp_tokens = {short:?}\n", base("t4"), free_port()));
        assert!(e.contains("at least 16 characters"), "{e}");
    }
}

/// `curl` as uid 65534 on the HTTP socket: exit status and output.
fn curl_as_nobody(http: &Path, app: &str, extra: &[&str], body: &str) -> String {
    let out = Command::new("curl")
        .args(["-s", "--unix-socket"])
        .arg(http)
        .args(["-H", &format!("X-LLMS-App: {app}")])
        .args(extra)
        .args(["http://llmsd/v1/chat/completions", "-d", body])
        .uid(65534)
        .gid(65534)
        .output()
        .expect("curl runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Another uid cannot reach a context by naming it or its app, and acts as one app; a flood
/// of connections from one uid is refused past its limit while the service goes on answering.
#[test]
fn other_uids_and_floods_over_http() {
    if !kernel_ok() {
        return;
    }
    if !common::root_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let d = Daemon::start(dir.path(), "u", &dir.path().join("state"), "socket_mode = \"0666\"\nmax_connections_per_uid = 4\n");
    let http = dir.path().join("u.http.sock");
    let body = r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":4,"temperature":0}"#;
    // Root's context, named by another uid with the same app name: not found.
    let r = raw_http(
        &http,
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-llms-app: shared\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
        Duration::from_secs(60),
    );
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    let ctx = r.lines().find_map(|l| l.strip_prefix("x-llms-context: ")).expect("a context header").trim().to_string();
    let theirs = curl_as_nobody(&http, "shared", &["-H", &format!("X-LLMS-Context: {ctx}")], body);
    let none = curl_as_nobody(&http, "shared", &["-H", &format!("X-LLMS-Context: {}", "0".repeat(32))], body);
    assert!(theirs.contains("context_not_found"), "{theirs}");
    assert_eq!(theirs.replace(&ctx, "X"), none.replace(&"0".repeat(32), "X"), "the same answer whether it exists or not");
    // A uid acts as one app: after its first context, another name is refused.
    let first = curl_as_nobody(&http, "nobody-app", &[], body);
    assert!(first.contains("chat.completion"), "{first}");
    let other = curl_as_nobody(&http, "another-app", &[], body);
    assert!(other.contains("app_not_granted") && other.contains("nobody-app"), "{other}");
    let native = Command::new(common::llms_bin())
        .args(["ctx", "list", "--app", "another-app"])
        .env("LLMS_SOCKET", &d.socket)
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    assert!(!native.status.success() && String::from_utf8_lossy(&native.stderr).contains("app_names"), "{native:?}");
    // A flood: past max_connections_per_uid, 429 and closed; the others are still served.
    let held: Vec<UnixStream> = (0..4).map(|_| UnixStream::connect(&http).unwrap()).collect();
    // (The service counts a connection when it accepts it: a probe may come before the four.)
    let health = || raw_http(&http, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", Duration::from_secs(10));
    let r = llms_tests::wait_until("the fifth connection to be refused", Duration::from_secs(30), || {
        Some(health()).filter(|r| !r.starts_with("HTTP/1.1 200"))
    });
    assert!(r.starts_with("HTTP/1.1 429") && r.contains("max_connections_per_uid"), "{r}");
    drop(held);
    let r = llms_tests::wait_until("the held connections to be given back", Duration::from_secs(30), || {
        Some(health()).filter(|r| !r.starts_with("HTTP/1.1 429"))
    });
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    d.stop();
}

/// A series' value in a scrape of `/metrics` (0 when absent).
fn metric(http: &Path, series: &str) -> u64 {
    let r = raw_http(http, b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", Duration::from_secs(10));
    r.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok())).unwrap_or(0)
}

/// A client that goes away, streaming or not, ends its call: the worker stops decoding for
/// nobody and the context is saved as far as it got (finish `cancelled`), and the service
/// answers the next request.
#[test]
fn a_client_that_goes_away_cancels_its_call() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "g", &dir.path().join("state"), "max_context_tokens = 2048\n");
    let http = dir.path().join("g.http.sock");
    let cancelled = "llms_calls_total{finish=\"cancelled\"}";
    // A long answer at temperature 0: it runs to max_tokens when nobody leaves (the last
    // request below), so the first two end only because their clients went away.
    let request = |stream: bool, close: bool| {
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"Tell me a very long story about a dragon who learns to fly."}}],"max_tokens":1000,"temperature":0,"stream":{stream}}}"#
        );
        let connection = if close { "connection: close\r\n" } else { "" };
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-llms-app: gone\r\n{connection}content-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    // Streaming: gone after the first piece of text.
    let mut s = UnixStream::connect(&http).unwrap();
    s.write_all(request(true, false).as_bytes()).unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while !seen.contains("\"content\":\"") || seen.matches("data: ").count() < 2 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended before its first token: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    drop(s);
    llms_tests::wait_until("the streamed call to end as cancelled", Duration::from_secs(120), || {
        (metric(&http, cancelled) == 1).then_some(())
    });
    // Not streaming: gone once the call runs (it has made its context: a branch of the first,
    // which holds more than this history).
    assert_eq!(metric(&http, "llms_contexts"), 1);
    let mut s = UnixStream::connect(&http).unwrap();
    s.write_all(request(false, false).as_bytes()).unwrap();
    llms_tests::wait_until("the call to run", Duration::from_secs(120), || (metric(&http, "llms_contexts") == 2).then_some(()));
    drop(s);
    llms_tests::wait_until("the waiting call to end as cancelled", Duration::from_secs(120), || {
        (metric(&http, cancelled) == 2).then_some(())
    });
    let r = raw_http(&http, request(false, true).as_bytes(), Duration::from_secs(300));
    assert!(r.starts_with("HTTP/1.1 200") && r.contains("\"finish_reason\":\"length\""), "{}", &r[..r.len().min(400)]);
    assert_eq!(metric(&http, cancelled), 2);
    d.stop();
}

/// One POST of chat `msgs` (temperature 0, 6 tokens) as app `app`: the status, the
/// `x-llms-context-match` header and the answer's text. `Err` when the exchange broke (the
/// service was killed, or is starting again).
fn chat_turn(sock: &Path, app: &str, msgs: &[serde_json::Value]) -> Result<(u16, String, String), String> {
    let body = serde_json::json!({"messages": msgs, "max_tokens": 6, "temperature": 0}).to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-llms-app: {app}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut s = UnixStream::connect(sock).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(60))).map_err(|e| e.to_string())?;
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).map_err(|e| e.to_string())?;
    let r = String::from_utf8_lossy(&out);
    let (head, body) = r.split_once("\r\n\r\n").ok_or_else(|| format!("a cut answer: {r}"))?;
    let status = head.get(9..12).and_then(|s| s.parse().ok()).ok_or_else(|| format!("no status: {head}"))?;
    let how = head.lines().find_map(|l| l.strip_prefix("x-llms-context-match: ")).unwrap_or("").trim().to_string();
    if status != 200 {
        return Ok((status, how, body.to_string()));
    }
    let v: serde_json::Value = serde_json::from_str(body).map_err(|e| format!("{e}: a cut answer: {body}"))?;
    let text = v.pointer("/choices/0/message/content").and_then(|t| t.as_str()).ok_or_else(|| format!("no text: {body}"))?;
    Ok((status, how, text.to_string()))
}

/// An answered request: its messages and the answer's text.
type Acked = (Vec<serde_json::Value>, String);

/// An HTTP client of the kill storm: conversations of its own app, each opening with one
/// system prompt, continued turn by turn and branched at an earlier message. Every request
/// that was answered (200) is acknowledged; the next turn of an acknowledged conversation must
/// continue its context, before and after the kills. Returns each acknowledged (request,
/// answer), and how many turns were checked to continue.
fn http_storm_client(sock: &Path, k: u64, until: Instant) -> Result<(Vec<Acked>, usize), String> {
    use rand::{Rng, SeedableRng};
    use serde_json::json;
    let mut rng = rand::rngs::StdRng::seed_from_u64(k);
    let app = format!("storm{k}");
    let system =
        json!({"role": "system", "content": "You answer questions about the weather in the mountains, briefly and with care. ".repeat(8)});
    let mut conv = vec![system.clone()];
    // Whether `conv`'s last answer was acknowledged (a broken exchange may have left a turn
    // in its context that the client never saw: the next request then branches from it).
    let mut sure = false;
    let mut acked = Vec::new();
    let (mut n, mut continued) = (0, 0);
    while Instant::now() < until {
        n += 1;
        let user = |rng: &mut rand::rngs::StdRng| json!({"role": "user", "content": format!("Question {n} of client {k}: {}", ["Is it cold?", "Any snow?", "What about wind?", "And fog?"][rng.gen_range(0..4)])});
        let turns = (conv.len() - 1) / 2;
        let (req, continuing) = if turns >= 6 {
            // A new conversation (its system prompt's chunks are shared with the others').
            (vec![system.clone(), user(&mut rng)], false)
        } else if turns >= 2 && rng.gen_range(0..3) == 0 {
            // A branch: an earlier user message edited.
            let at = 1 + 2 * rng.gen_range(0..turns);
            let mut r = conv[..at].to_vec();
            r.push(user(&mut rng));
            (r, false)
        } else {
            let mut r = conv.clone();
            r.push(user(&mut rng));
            (r, turns > 0 && sure)
        };
        match chat_turn(sock, &app, &req) {
            Ok((200, how, text)) => {
                if continuing && how != "continued" {
                    return Err(format!("client {k}: an acknowledged conversation of {turns} turns was {how:?}, not continued"));
                }
                continued += usize::from(continuing);
                conv = req.clone();
                conv.push(json!({"role": "assistant", "content": text}));
                acked.push((req, text));
                sure = true;
            }
            Ok((500, _, body)) => return Err(format!("client {k}: 500: {body}")),
            // Refused (too many calls waiting, the service stopping) or broken by a kill.
            Ok(_) | Err(_) => {
                sure = false;
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    Ok((acked, continued))
}

/// Hostile to the HTTP front's state: conversations and branches of three apps (sharing their
/// system prompt's chunks, under a budget that evicts them) through two kill -9s. No acknowledged
/// conversation is lost (its next turn continues its context), nothing unreachable is left in
/// the store after a start, and every acknowledged answer is the one a service without sharing
/// and without kills gives to that request.
#[test]
fn http_conversations_and_branches_survive_kills() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let settings = "levels = [\"int8\"]\nratio = 1.0\nbudget = \"6MiB\"\nhttp_contexts_per_app = 64\nmax_contexts_per_app = 64\n";
    let state = dir.path().join("state");
    let mut d = Daemon::start(dir.path(), "k", &state, settings);
    let sock = dir.path().join("k.http.sock");
    let t0 = Instant::now();
    let until = t0 + Duration::from_secs(30);
    let clients: Vec<_> = (0..3)
        .map(|k| {
            let s = sock.clone();
            std::thread::spawn(move || http_storm_client(&s, k, until))
        })
        .collect();
    for at in [9, 19] {
        std::thread::sleep(Duration::from_secs(at).saturating_sub(t0.elapsed()));
        d.assert_running();
        d.kill9();
        d = Daemon::start(dir.path(), "k", &state, settings);
    }
    let (mut acked, mut continued) = (Vec::new(), 0);
    for h in clients {
        let (a, c) = h.join().unwrap().unwrap_or_else(|e| panic!("{e}\n{}", d.log_text()));
        acked.extend(a);
        continued += c;
    }
    d.stop();
    eprintln!("http storm: {} answers, {continued} turns continued their conversation's context", acked.len());
    assert!(acked.len() >= 12 && continued >= 6, "the storm ran: {} answers, {continued} continued", acked.len());
    // A start after a clean stop finds nothing to free; the doctor finds every shared chunk
    // reached by a saved context.
    let d = Daemon::start(dir.path(), "again", &state, settings);
    let log = d.log_text();
    assert!(!log.contains("freed shared chunks"), "a start after a clean stop finds no shared chunk unreachable: {log}");
    d.stop();
    let out = Command::new(common::llms_bin()).args(["doctor", "--json", "--state-dir"]).arg(&state).output().unwrap();
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    let shared = v.as_array().unwrap().iter().find(|c| c["facility"] == "shared chunks").cloned().unwrap_or_default();
    assert!(shared["named"].as_u64().is_some_and(|n| n > 0) && shared["named"] == shared["reached"], "{shared}");
    // The same requests to a service without sharing, never killed: the same answers.
    // (One app: its contexts retire as it makes more, where one app a request would meet
    // max_contexts_per_uid.)
    let p = Daemon::start(
        dir.path(),
        "plain",
        &dir.path().join("plain"),
        "levels = [\"int8\"]\nratio = 1.0\nbudget = \"6MiB\"\nprefix_sharing = false\n",
    );
    let psock = dir.path().join("plain.http.sock");
    for (i, (req, text)) in acked.iter().enumerate().filter(|(i, _)| i % 3 == 0) {
        let (status, _, t) = chat_turn(&psock, "plain", req).unwrap();
        assert_eq!((status, &t), (200, text), "answer {i} differs from the run without sharing: {}", serde_json::Value::from(req.clone()));
    }
    p.stop();
}

/// The CPU slice of each of process `pid`'s threads named `name`, as the kernel reports it
/// (`sched_runtime`, ns: 0 before Linux 6.12).
fn slices(pid: u32, name: &str) -> Vec<u64> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        if std::fs::read_to_string(e.path().join("comm")).unwrap_or_default().trim() != name {
            continue;
        }
        let tid: libc::pid_t = e.file_name().to_string_lossy().parse().unwrap();
        // SAFETY: an all-zero sched_attr is a valid value.
        let mut a: libc::sched_attr = unsafe { std::mem::zeroed() };
        let size = u32::try_from(std::mem::size_of::<libc::sched_attr>()).unwrap();
        // SAFETY: sched_getattr(2) on another thread writes at most `size` bytes into `a`.
        if unsafe { libc::syscall(libc::SYS_sched_getattr, tid, &raw mut a, size, 0u32) } == 0 {
            out.push(a.sched_runtime);
        }
    }
    out
}

/// The threads that carry tokens to apps (a native connection's, the HTTP front's runtime)
/// ask for the kernel's shortest CPU slice, the model's threads for a long one (llmsd's
/// sched.rs): a token does not wait for a pass's slice to end.
#[test]
fn the_threads_that_carry_tokens_ask_for_short_slices() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let tokens = tokens_file(dir.path(), 0o600);
    let d = Daemon::start(dir.path(), "slices", &dir.path().join("slices"), &settings(free_port(), &tokens));
    // A connection thread serves this client.
    let mut c = d.client("app");
    c.stats().unwrap();
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut v = release.trim().split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
    let k = (v.next().unwrap_or(0), v.next().unwrap_or(0));
    let probe = if k >= (6, 12) { Ok(()) } else { Err(format!("kernel {k:?} has none (Linux 6.12)")) };
    if llms_tests::require_kernel("a per-thread CPU slice", probe).is_some() {
        // The prefill lane runs where the pool has two threads or more (the default: a core each).
        let lane = std::thread::available_parallelism().map_or(1, std::num::NonZero::get) >= 2;
        let threads = [("llmsd-conn", 100_000), ("llmsd-http", 100_000), ("llmsd-worker", 10_000_000), ("llmsd-lane", 10_000_000)];
        for (name, want) in threads.into_iter().filter(|&(n, _)| lane || n != "llmsd-lane") {
            let got = slices(d.child.id(), name);
            assert!(!got.is_empty() && got.iter().all(|&s| s == want), "{name}: {got:?}, want {want}");
        }
    }
    d.stop();
}

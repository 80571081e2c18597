//! `llms bench-http`: what the HTTP front's persistent contexts buy a stateless client, and what
//! the front costs. The whole service runs in process; requests go over its HTTP Unix socket
//! through hyper's client on one kept-alive connection, as an OpenAI client library would send
//! them.
//!
//! - A conversation of `turns` turns (a system prompt, user messages of ~`user_tokens` tokens,
//!   replies of up to `reply_tokens`) is sent the stateless way: the whole history every turn.
//!   The last turn's time to first token is measured when the service continues the
//!   conversation's context ("continued"), and for the same request from an app without that
//!   context, which prefills the whole history as a server without a prompt cache would
//!   ("full prefill").
//! - Then other apps' long calls push the conversation's context out of a budget that cannot
//!   hold them all (its chunks go to flash); the next turn's TTFT ("after eviction") against the
//!   full prefill of that same request.
//! - Overhead: the same small call (one token, appended to a context of ~`user_tokens` tokens)
//!   alternated between the native protocol and `/v1/completions` with the whole text, on two
//!   contexts that grow alike; the difference of the medians of the round trips.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde::Serialize;
use serde_json::{json, Value};

use llmsd::client::Client;
use llmsd::config::Config;
use llmsd::proto::Call;
use llmsd::service::Local;
use llmsd::stats::median;

/// The conversation: turns, and tokens per user message and per reply (at most).
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub turns: usize,
    pub user_tokens: usize,
    pub reply_tokens: usize,
}

/// The benchmark's medians (ms) and ratios.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub turns: usize,
    pub user_tokens: usize,
    pub reply_tokens: usize,
    pub levels: Vec<String>,
    pub history_tokens: u64,
    pub ttft_continued_ms: f64,
    pub ttft_full_prefill_ms: f64,
    pub speedup: f64,
    /// Share of the conversation's chunks that were not resident at the turn after eviction
    /// (read or recomputed).
    pub evicted_share: f64,
    pub ttft_after_eviction_ms: f64,
    pub ttft_full_prefill_after_ms: f64,
    pub speedup_after_eviction: f64,
    pub native_call_ms: f64,
    pub http_call_ms: f64,
    pub http_overhead_ms: f64,
    pub reps: usize,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// One answer: status, the context header, time to the first generated text, round trip, body.
pub(crate) struct Resp {
    status: u16,
    ttft: Option<Duration>,
    total: Duration,
    body: Vec<u8>,
}

impl Resp {
    fn json(&self) -> Result<Value> {
        serde_json::from_slice(&self.body).with_context(|| format!("HTTP {}: {}", self.status, String::from_utf8_lossy(&self.body)))
    }

    /// The streamed text and the usage chunk's figures.
    fn stream(&self) -> Result<(String, Value)> {
        if self.status != 200 {
            bail!("HTTP {}: {}", self.status, String::from_utf8_lossy(&self.body));
        }
        let mut text = String::new();
        let mut usage = Value::Null;
        for ev in String::from_utf8_lossy(&self.body).split("\n\n") {
            let Some(d) = ev.strip_prefix("data: ") else { continue };
            if d == "[DONE]" {
                break;
            }
            let v: Value = serde_json::from_str(d)?;
            if let Some(t) = v.pointer("/choices/0/delta/content").and_then(Value::as_str) {
                text.push_str(t);
            }
            if v.get("usage").is_some_and(|u| !u.is_null()) {
                usage = v["usage"].clone();
            }
        }
        Ok((text, usage))
    }
}

/// hyper's HTTP/1.1 client on the front's Unix socket, one kept-alive connection.
pub(crate) struct Http {
    rt: tokio::runtime::Runtime,
    sock: PathBuf,
    tx: Option<hyper::client::conn::http1::SendRequest<Full<Bytes>>>,
}

/// Whether the event-stream bytes so far hold generated text (the first chunk holds only the
/// role, with empty content).
fn has_text(buf: &[u8]) -> bool {
    let pat = br#""content":""#;
    buf.windows(pat.len() + 1).any(|w| w.starts_with(pat) && w[pat.len()] != b'"')
}

impl Http {
    pub(crate) fn new(sock: &Path) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        Ok(Self { rt, sock: sock.to_path_buf(), tx: None })
    }

    fn post(&mut self, path: &str, app: &str, body: &Value) -> Result<Resp> {
        self.request(hyper::Method::POST, path, app, Some(body))
    }

    /// A counter's value from `/metrics`.
    fn counter(&mut self, name: &str) -> Result<f64> {
        let r = self.request(hyper::Method::GET, "/metrics", "bench", None)?;
        let text = String::from_utf8_lossy(&r.body).into_owned();
        let line = text.lines().find(|l| l.split_whitespace().next() == Some(name)).with_context(|| format!("{name} in /metrics"))?;
        Ok(line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0.0))
    }

    fn request(&mut self, method: hyper::Method, path: &str, app: &str, body: Option<&Value>) -> Result<Resp> {
        let stream = body.and_then(|b| b.get("stream")).and_then(Value::as_bool).unwrap_or(false);
        let req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "llmsd")
            .header("content-type", "application/json")
            .header("x-llms-app", app)
            .body(Full::new(Bytes::from(body.map(Value::to_string).unwrap_or_default())))?;
        let sock = self.sock.clone();
        let slot = &mut self.tx;
        self.rt.block_on(async move {
            if slot.as_ref().is_none_or(hyper::client::conn::http1::SendRequest::is_closed) {
                let s = tokio::net::UnixStream::connect(&sock).await.with_context(|| format!("connecting to {}", sock.display()))?;
                let (tx, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(s)).await?;
                tokio::spawn(conn);
                *slot = Some(tx);
            }
            let tx = slot.as_mut().context("connected")?;
            tx.ready().await?;
            let t0 = Instant::now();
            let resp = tx.send_request(req).await?;
            let status = resp.status().as_u16();
            let mut body = resp.into_body();
            let mut buf = Vec::new();
            let mut ttft = None;
            while let Some(f) = body.frame().await {
                if let Some(d) = f?.data_ref() {
                    buf.extend_from_slice(d);
                    if stream && ttft.is_none() && has_text(&buf) {
                        ttft = Some(t0.elapsed());
                    }
                }
            }
            Ok(Resp { status, ttft, total: t0.elapsed(), body: buf })
        })
    }

    /// A streamed chat turn: (reply, time to first token, usage).
    pub(crate) fn turn(&mut self, app: &str, msgs: &[Value], max_tokens: usize) -> Result<(String, Duration, Value)> {
        let body = json!({"messages": msgs, "temperature": 0, "max_tokens": max_tokens, "stream": true, "stream_options": {"include_usage": true}});
        let r = self.post("/v1/chat/completions", app, &body)?;
        let (text, usage) = r.stream()?;
        Ok((text, r.ttft.context("no text was generated")?, usage))
    }
}

/// A user message of about `n` tokens: sentences about the project's subject, varied by `k`.
pub(crate) fn message(k: usize, n: usize) -> String {
    const S: [&str; 8] = [
        "The phone keeps several assistants alive while the user switches between apps.",
        "Each context holds its attention cache in chunks that may live in memory or on flash.",
        "When memory runs short, the least useful chunks are compressed or written out first.",
        "A context that comes back is read from flash or recomputed, whichever finishes sooner.",
        "The kernel reports memory pressure long before it has to kill a process.",
        "Small models answer quickly, but their memory still competes with every other app.",
        "Switching between conversations should feel instant to the person holding the phone.",
        "Weights that do not fit are paged in from storage as the layers need them.",
    ];
    let mut s = format!("Question {k}: ");
    let mut i = k;
    // About 16 tokens (80 bytes) a sentence; the frame and the question take ~12.
    while s.len() + 60 < n * 5 {
        s.push_str(S[i % S.len()]);
        s.push(' ');
        i += 3;
    }
    s.push_str("What do you make of this?");
    s
}

/// Runs the benchmark; `base` gives the model and threads; the service's state goes to a fresh
/// directory under `work` (the load profile copied from `profile_dir` when there is one).
pub fn run(base: &Config, shape: Shape, reps: usize, work: &Path, profile_dir: &Path) -> Result<Report> {
    let Shape { turns, user_tokens, reply_tokens } = shape;
    let state = work.join("http");
    crate::loadbench::fresh_state(&state, profile_dir)?;
    // A budget that holds the conversation and a little more (about 1.1k tokens of int8 KV
    // is 12 MiB): the other apps' calls push it out.
    let cfg = Config {
        socket: work.join("bench.sock"),
        state_dir: state.clone(),
        budget: "24MiB".into(),
        pressure: false,
        max_contexts_per_app: 64,
        http_contexts_per_app: 4,
        ..base.clone()
    };
    let local = Local::start(cfg.clone())?;
    let sock = cfg.http_socket_path().context("an HTTP socket")?;
    let mut h = Http::new(&sock)?;
    let (mut cont, mut full, mut after, mut full_after, mut shares, mut hist) = (vec![], vec![], vec![], vec![], vec![], 0u64);
    for r in 0..reps {
        let app = format!("bench-conv{r}");
        let mut msgs = vec![json!({"role": "system", "content": "You are a helpful assistant. Answer briefly."})];
        let mut last = (Duration::ZERO, Value::Null);
        for k in 0..turns {
            msgs.push(json!({"role": "user", "content": message(k + r, user_tokens)}));
            let (reply, ttft, usage) = h.turn(&app, &msgs, reply_tokens)?;
            if k + 1 == turns {
                last = (ttft, usage);
                break;
            }
            msgs.push(json!({"role": "assistant", "content": reply}));
        }
        let cached = last.1.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64).unwrap_or(0);
        if cached == 0 {
            bail!("the last turn was not continued from its context: {}", last.1);
        }
        hist = last.1["prompt_tokens"].as_u64().unwrap_or(0);
        cont.push(ms(last.0));
        // The same request from an app without the context: the whole history is prefilled.
        let (reply, t_full, _) = h.turn(&format!("bench-full{r}"), &msgs, reply_tokens)?;
        full.push(ms(t_full));
        // Other apps' long calls evict the conversation's context to flash.
        for o in 0..4 {
            let m = vec![json!({"role": "user", "content": message(100 + o, 900)})];
            h.turn(&format!("bench-other{o}"), &m, 4)?;
        }
        let mut c = Client::connect(&local.socket, &app)?;
        let chunks = c.list()?.into_iter().map(|x| x.chunks).max().context("the conversation's context")?;
        drop(c);
        msgs.push(json!({"role": "assistant", "content": reply}));
        msgs.push(json!({"role": "user", "content": message(turns + r, user_tokens)}));
        let back = |h: &mut Http| -> Result<f64> { Ok(h.counter("llms_read_chunks_total")? + h.counter("llms_recomputed_chunks_total")?) };
        let before = back(&mut h)?;
        let (_, t_after, usage) = h.turn(&app, &msgs, reply_tokens)?;
        shares.push((back(&mut h)? - before) / f64::from(chunks.max(1)));
        if usage.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64).unwrap_or(0) == 0 {
            bail!("the turn after eviction was not continued from its context: {usage}");
        }
        after.push(ms(t_after));
        let (_, t_full_after, _) = h.turn(&format!("bench-full{r}b"), &msgs, reply_tokens)?;
        full_after.push(ms(t_full_after));
    }

    // Overhead: the same one-token call, native and HTTP, on two contexts that grow alike.
    let mut native = Client::connect(&local.socket, "bench-native")?;
    let nctx = native.new_ctx(None)?;
    let start = message(7, user_tokens * 3);
    let call = |c: &mut Client, prompt: &str| -> Result<(String, Duration)> {
        let call = Call {
            ctx: nctx.clone(),
            prompt: prompt.into(),
            max_tokens: 1,
            temperature: 0.0,
            seed: 0,
            stop: vec![],
            raw: true,
            top_p: None,
        };
        let t0 = Instant::now();
        let (text, _) = c.call(&call, &mut |_| {})?;
        Ok((text, t0.elapsed()))
    };
    call(&mut native, &start)?;
    let complete = |h: &mut Http, prompt: &str| -> Result<(String, Duration)> {
        let r = h.post("/v1/completions", "bench-http", &json!({"prompt": prompt, "max_tokens": 1, "temperature": 0}))?;
        let v = r.json()?;
        let text = v.pointer("/choices/0/text").and_then(Value::as_str).context("a completion")?.to_string();
        Ok((text, r.total))
    };
    let mut text = start.clone();
    text += &complete(&mut h, &start)?.0;
    let (mut tn, mut th) = (vec![], vec![]);
    for i in 0..(reps * 10).max(20) {
        // Alternated, so both see the same machine.
        let piece = if i % 2 == 0 { " and" } else { " so" };
        tn.push(ms(call(&mut native, piece)?.1));
        text.push_str(piece);
        let (t, d) = complete(&mut h, &text)?;
        text.push_str(&t);
        th.push(ms(d));
    }
    drop(native);
    local.stop()?;
    let _ = std::fs::remove_dir_all(&state);
    let (c, f, a, fa) = (median(cont), median(full), median(after), median(full_after));
    let (n, hh) = (median(tn), median(th));
    Ok(Report {
        turns,
        user_tokens,
        reply_tokens,
        levels: base.levels.clone(),

        history_tokens: hist,
        ttft_continued_ms: c,
        ttft_full_prefill_ms: f,
        speedup: f / c,
        evicted_share: median(shares),
        ttft_after_eviction_ms: a,
        ttft_full_prefill_after_ms: fa,
        speedup_after_eviction: fa / a,
        native_call_ms: n,
        http_call_ms: hh,
        http_overhead_ms: hh - n,
        reps,
    })
}

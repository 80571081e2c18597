//! The OpenAI-compatible endpoints: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.
//! A request's history goes to the worker, which continues the app's context holding the
//! longest prefix of it (history.rs); the answer names that context (`X-LLMS-Context`) and
//! counts the tokens it did not prefill (`usage.prompt_tokens_details.cached_tokens`).
//! Streaming answers are Server-Sent Events ending in `data: [DONE]`.

use std::convert::Infallible;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::super::history::{encode_segments, render_chat, ChatMessage, History, Segment};
use super::super::turns::Turns;
use super::super::Owner;
use super::{body_bytes, error, error_param, owner, refused, Conn, Front};
use crate::proto::{Call, CallStats, Event};

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// What both endpoints take besides their input (every other field is checked by
/// [`check_fields`] first: refused, or accepted only at a value that changes nothing).
#[derive(Debug, Deserialize)]
struct Params {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    stop: Option<Stop>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    logprobs: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Vec<Message>,
    #[serde(flatten)]
    params: Params,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: Prompt,
    #[serde(default)]
    echo: bool,
    #[serde(flatten)]
    params: Params,
}

/// Which endpoint is answering: the shape of its answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
}

fn bad(message: impl AsRef<str>) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_request", message)
}

fn parse<T: serde::de::DeserializeOwned>(b: &[u8], kind: Kind) -> Result<T, Response> {
    let v: Value = serde_json::from_slice(b).map_err(|e| bad(format!("the body is not a valid request: {e}")))?;
    let Some(fields) = v.as_object() else { return Err(bad("the body is not a valid request: a JSON object is needed")) };
    check_fields(fields, kind)?;
    serde_json::from_value(v).map_err(|e| bad(format!("the body is not a valid request: {e}")))
}

/// Fields this service implements, per endpoint (docs/http.md has the table).
const IMPLEMENTED: &[&str] =
    &["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "logprobs"];

/// Every request field is implemented, or accepted at a value that asks for nothing this
/// service lacks (`frequency_penalty: 0`, `tool_choice: "none"`, `user`), or refused with an
/// error naming it: a client is never answered as if a feature it asked for had been applied.
fn check_fields(fields: &serde_json::Map<String, Value>, kind: Kind) -> Result<(), Response> {
    let refuse = |field: &str, why: &str| {
        error_param(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "unsupported_parameter",
            Some(field),
            format!("{field}: {why} (docs/http.md lists the parameters this service takes)"),
        )
    };
    for (k, v) in fields {
        let input = match kind {
            Kind::Chat => k == "messages",
            Kind::Text => k == "prompt" || k == "echo",
        };
        if input || IMPLEMENTED.contains(&k.as_str()) {
            continue;
        }
        let absent = v.is_null();
        let zero = v.as_f64() == Some(0.0);
        let empty = v.as_array().is_some_and(Vec::is_empty) || v.as_object().is_some_and(serde_json::Map::is_empty);
        let neutral = match k.as_str() {
            // Who the end user is (OpenAI's abuse monitoring): the service knows its uid and app.
            "user" | "safety_identifier" | "prompt_cache_key" => true,
            "frequency_penalty" | "presence_penalty" => absent || zero,
            "logit_bias" | "metadata" | "tools" | "functions" => absent || empty,
            "tool_choice" | "function_call" => absent || v == "none",
            "parallel_tool_calls" => absent || v.is_boolean(),
            "response_format" => absent || v.get("type").is_some_and(|t| t == "text"),
            "top_logprobs" | "suffix" | "audio" | "prediction" | "reasoning_effort" | "web_search_options" | "service_tier" => {
                absent || (k == "service_tier" && (v == "auto" || v == "default"))
            }
            "best_of" => absent || v.as_u64() == Some(1),
            "modalities" => absent || v.as_array().is_some_and(|a| a.iter().all(|m| m == "text")),
            "store" => absent || *v == Value::Bool(false),
            _ => return Err(refuse(k, "this parameter is not known here")),
        };
        if !neutral {
            return Err(refuse(k, "not supported by this service"));
        }
    }
    Ok(())
}

/// Who is asking (before anything reads the body), then the body within its deadline, then
/// the request it holds with every field checked.
async fn request<T: serde::de::DeserializeOwned>(
    front: &Front,
    conn: &Conn,
    headers: &HeaderMap,
    body: Body,
    kind: Kind,
) -> Result<(Owner, T), Response> {
    let owner = owner(front, conn, headers)?;
    let b = body_bytes(front, headers, body).await?;
    Ok((owner, parse(&b, kind)?))
}

pub(super) async fn models(State(front): State<Arc<Front>>, Extension(conn): Extension<Arc<Conn>>, headers: HeaderMap) -> Response {
    if let Err(r) = owner(&front, &conn, &headers) {
        return r;
    }
    axum::Json(json!({
        "object": "list",
        "data": [{"id": front.model_id, "object": "model", "created": 0, "owned_by": "llms"}],
    }))
    .into_response()
}

pub(super) async fn chat(
    State(front): State<Arc<Front>>,
    Extension(conn): Extension<Arc<Conn>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (owner, req): (Owner, ChatRequest) = match request(&front, &conn, &headers, body, Kind::Chat).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let mut msgs = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.into_iter().enumerate() {
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut t = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(x)) => t.push_str(&x),
                        (k, _) => {
                            return bad(format!("messages[{i}]: content of type {} is not supported (text only)", crate::proto::quote(k)))
                        }
                    }
                }
                t
            }
        };
        msgs.push(ChatMessage { role: m.role, content });
    }
    let svc = &front.svc;
    let turns = match svc.turns() {
        Ok(t) => t,
        Err(r) => return bad(r.1),
    };
    let segments = match render_chat(turns, |t| Turns::system(&svc.model, t), &msgs) {
        Ok(s) => s,
        Err(e) => return bad(e),
    };
    run(&front, &owner, &headers, Kind::Chat, segments, req.params).await
}

pub(super) async fn completions(
    State(front): State<Arc<Front>>,
    Extension(conn): Extension<Arc<Conn>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (owner, req): (Owner, CompletionRequest) = match request(&front, &conn, &headers, body, Kind::Text).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    if req.echo {
        return bad("echo is not supported");
    }
    let prompt = match req.prompt {
        Prompt::One(p) => p,
        Prompt::Many(mut v) if v.len() == 1 => v.remove(0),
        Prompt::Many(_) => return bad("prompt: one prompt per request"),
    };
    if prompt.is_empty() {
        return bad("prompt is empty");
    }
    // As the native protocol's raw calls: control tokens written in the prompt are parsed.
    let segments = vec![Segment { text: prompt, special: true }];
    run(&front, &owner, &headers, Kind::Text, segments, req.params).await
}

/// A call's events as its answer reads them, and the guard that cancels the call if the answer
/// is dropped before the call's end (the client went away).
struct CallEvents {
    rx: mpsc::UnboundedReceiver<Event>,
    guard: Option<super::super::call::CancelOnDrop>,
}

impl CallEvents {
    async fn recv(&mut self) -> Option<Event> {
        let ev = self.rx.recv().await;
        if matches!(ev, Some(Event::Done { .. } | Event::Error { .. })) {
            // The call has ended: nothing left to cancel.
            if let Some(g) = self.guard.take() {
                g.disarm();
            }
        }
        ev
    }
}

async fn run(front: &Arc<Front>, owner: &Owner, headers: &HeaderMap, kind: Kind, segments: Vec<Segment>, p: Params) -> Response {
    if let Some(m) = p.model.as_deref().filter(|m| *m != front.model_id && *m != "default") {
        return error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!("model {} is not served here (this service serves {})", crate::proto::quote(m), front.model_id),
        );
    }
    let unsupported = |field: &str, why: &str| {
        error_param(StatusCode::BAD_REQUEST, "invalid_request_error", "unsupported_parameter", Some(field), format!("{field}: {why}"))
    };
    if p.n.is_some_and(|n| n != 1) {
        return unsupported("n", "one choice per request");
    }
    if p.logprobs.as_ref().is_some_and(|l| !l.is_null() && *l != Value::Bool(false)) {
        return unsupported("logprobs", "not supported by this service");
    }
    let pin = match headers.get("x-llms-context").map(HeaderValue::to_str) {
        None => None,
        Some(Ok(c)) => Some(c.to_string()),
        Some(Err(_)) => return bad("X-LLMS-Context: a context id"),
    };
    let stop = match p.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    let svc = Arc::clone(&front.svc);
    // The rendering is encoded here, on the blocking pool where this request waits, never on
    // the worker every app shares (its time is this caller's; O(n log n) in its length).
    let ids = {
        let svc = Arc::clone(&svc);
        match tokio::task::spawn_blocking(move || {
            super::super::fault_point("http-tokenize", &segments.iter().map(|s| s.text.as_str()).collect::<String>());
            encode_segments(&svc.model.tokenizer, &segments)
        })
        .await
        {
            Ok(Ok(ids)) => ids,
            Ok(Err(e)) => return bad(e),
            Err(e) => {
                tracing::error!("encoding a request failed: {e}");
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "failed",
                    "the request failed inside the service (its log says why)",
                );
            }
        }
    };
    let limit = u32::try_from(svc.cfg.max_context_tokens / 2 - 2).unwrap_or(u32::MAX);
    let call = Call {
        ctx: String::new(),
        prompt: String::new(),
        max_tokens: p.max_completion_tokens.or(p.max_tokens).unwrap_or(256.min(limit)),
        // OpenAI's defaults: temperature 1, no nucleus cut.
        temperature: p.temperature.unwrap_or(1.0),
        seed: p.seed.map_or_else(rand::random, |s| u64::from_ne_bytes(s.to_ne_bytes())),
        stop,
        raw: kind == Kind::Text,
        top_p: Some(p.top_p.unwrap_or(1.0)),
    };
    let (chosen_tx, mut chosen_rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    // The client going away drops this request's future (hyper watches the connection while
    // a handler runs), or its streamed answer, and with it this guard: the call leaves the
    // queue, or ends after its next step (so does a panic here). Disarmed once the call ended.
    let guard = super::super::call::CancelOnDrop::new(&cancel);
    let history = History { ids, pin, chosen: chosen_tx };
    let mut events = match svc.submit_history(owner, call, history, Arc::clone(&cancel)) {
        Ok(rx) => CallEvents { rx, guard: Some(guard) },
        Err(r) => return refused(r.0, &r.1),
    };
    let chosen = match chosen_rx.recv().await {
        Some(c) => c,
        // Refused before a context was chosen: the error follows on the events.
        None => {
            return match events.recv().await {
                Some(Event::Error { code, message }) => refused(code, &message),
                Some(_) | None => error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "failed", "the call ended without an answer"),
            }
        }
    };
    super::super::fault_point("http-answer", &owner.app);
    let id = format!("{}-{:024x}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }, rand::random::<u128>() >> 32);
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let answer = Answer { kind, id, created, model: front.model_id.clone(), cached: chosen.cached_tokens };
    let mut r = if p.stream.unwrap_or(false) {
        let usage = p.stream_options.unwrap_or_default().include_usage;
        stream(answer, events, usage)
    } else {
        loop {
            match events.recv().await {
                Some(Event::Done { text, stats }) => break axum::Json(answer.whole(&text, &stats)).into_response(),
                Some(Event::Error { code, message }) => break refused(code, &message),
                Some(_) => {}
                None => break error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "failed", "the call ended without an answer"),
            }
        }
    };
    if let Ok(v) = HeaderValue::from_str(&chosen.ctx) {
        r.headers_mut().insert("x-llms-context", v);
    }
    r.headers_mut().insert("x-llms-context-match", HeaderValue::from_static(chosen.how));
    if !chosen.notice.is_empty() {
        // A header holds visible ASCII only: anything else in the reason becomes '?'.
        let ascii: String = chosen.notice.chars().map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).collect();
        if let Ok(v) = HeaderValue::from_str(&ascii) {
            r.headers_mut().insert("x-llms-notice", v);
        }
    }
    r
}

struct Answer {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    cached: u32,
}

fn finish_reason(stats: &CallStats) -> &'static str {
    if stats.finish == "length" {
        "length"
    } else {
        "stop"
    }
}

impl Answer {
    fn usage(&self, s: &CallStats) -> Value {
        // The continued context's tokens, and what a new (branched) context took from chunks
        // its app holds: neither was prefilled.
        let prompt = s.prompt_tokens + self.cached;
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": s.output_tokens,
            "total_tokens": prompt + s.output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached + s.cached_tokens},
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }

    fn whole(&self, text: &str, s: &CallStats) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish_reason(s)})
            }
            Kind::Text => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason(s)}),
        };
        json!({"id": self.id, "object": self.object(false), "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(s)})
    }

    /// One streamed chunk: a piece of text, or the end (`finish`).
    fn chunk(&self, text: Option<&str>, first: bool, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Kind::Text => json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}),
        };
        json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [choice]})
    }

    fn usage_chunk(&self, s: &CallStats) -> Value {
        json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [], "usage": self.usage(s)})
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The answer as Server-Sent Events: a first chunk (the assistant's role), one chunk per
/// piece of text, the finish, the usage when asked, then `data: [DONE]`. An error after the
/// answer has begun is sent as an error object in the stream.
fn stream(a: Answer, rx: CallEvents, include_usage: bool) -> Response {
    struct St {
        a: Answer,
        rx: CallEvents,
        first: bool,
        queued: Vec<Bytes>,
        done: bool,
        usage: bool,
    }
    let st = St { a, rx, first: true, queued: Vec::new(), done: false, usage: include_usage };
    let s = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if !st.queued.is_empty() {
                let b = st.queued.remove(0);
                return Some((Ok::<Bytes, Infallible>(b), st));
            }
            if st.done {
                return None;
            }
            if st.first && st.a.kind == Kind::Chat {
                st.first = false;
                st.queued.push(sse(&st.a.chunk(Some(""), true, None)));
                continue;
            }
            match st.rx.recv().await {
                Some(Event::Token { text }) => st.queued.push(sse(&st.a.chunk(Some(&text), false, None))),
                Some(Event::Done { stats, .. }) => {
                    st.queued.push(sse(&st.a.chunk(None, false, Some(finish_reason(&stats)))));
                    if st.usage {
                        st.queued.push(sse(&st.a.usage_chunk(&stats)));
                    }
                    st.queued.push(Bytes::from_static(b"data: [DONE]\n\n"));
                    st.done = true;
                }
                Some(Event::Error { message, .. }) => {
                    st.queued.push(sse(&json!({"error": {"message": message, "type": "server_error", "param": null, "code": "failed"}})));
                    st.queued.push(Bytes::from_static(b"data: [DONE]\n\n"));
                    st.done = true;
                }
                Some(_) => {}
                None => {
                    st.queued.push(sse(&json!({"error": {"message": "the call ended without an answer", "type": "server_error", "param": null, "code": "failed"}})));
                    st.done = true;
                }
            }
        }
    });
    let mut r = Response::new(Body::from_stream(s));
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

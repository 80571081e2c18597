//! The HTTP front: the OpenAI-compatible API (`openai.rs`), `/metrics` and `/health`, served by
//! hyper (axum's router) on a tokio runtime of its own, beside the native socket. It ends in
//! the same queue as the native protocol ([`Service::submit_history`]): the worker, its
//! atomic calls and the per-uid limits are the same for both doors.
//!
//! Identity: on the Unix socket the kernel's uid (SO_PEERCRED), as on the native socket, and
//! the app the client names (`X-LLMS-App`, else `default`); on loopback TCP a bearer token
//! from `http_tokens`, which names its app. TCP peers have no uid: their contexts belong to
//! [`NETWORK_UID`] and the token's app, and the per-uid limits count per app there
//! ([`Owner::shares_quota`]); a TCP connection counts against its app once a request shows the
//! token, and waits among a bounded pool of unauthenticated connections until then. A request
//! is authenticated before its body is read; headers must arrive within `io_timeout_s` and the
//! body within `io_timeout_s` after; bodies are at most [`MAX_BODY`] bytes.

// Handlers return their error answers as `Err(Response)`: built once per failed request, so
// boxing them would buy nothing.
#![allow(clippy::result_large_err)]

mod openai;

use std::collections::HashMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use tracing::{info, warn};

use super::metrics::Viewer;
use super::slots::{Holder, Slot};
use super::{Owner, Service};
use crate::proto::ErrorCode;

/// The uid TCP clients count as (they have none): the per-uid limits hold them together.
pub const NETWORK_UID: u32 = u32::MAX - 1;
/// How long a stop waits for the HTTP requests in flight.
const STOP_GRACE: Duration = Duration::from_secs(30);
/// Largest request body: a whole conversation fits many times over.
pub const MAX_BODY: usize = crate::proto::MAX_FRAME;

/// The front's listeners, bound before the service is announced (so a taken address fails
/// the start, not a later thread).
#[derive(Debug)]
pub struct Listeners {
    unix: Option<(std::os::unix::net::UnixListener, PathBuf)>,
    tcp: Option<std::net::TcpListener>,
    tokens: Tokens,
}

impl Listeners {
    /// Binds what the configuration asks for: the HTTP Unix socket (mode `socket_mode`) and
    /// the loopback TCP address with its token file.
    pub fn bind(cfg: &crate::config::Config) -> Result<Self> {
        let tokens = match &cfg.http_tokens {
            Some(p) => Tokens::load(p)?,
            None => Tokens::default(),
        };
        let unix = match cfg.http_socket_path() {
            Some(p) => Some((super::bind_socket(&p, cfg.socket_mode_bits()?)?, p)),
            None => None,
        };
        let tcp = match &cfg.http {
            Some(a) => {
                let l = std::net::TcpListener::bind(a).with_context(|| format!("binding http {a}"))?;
                Some(l)
            }
            None => None,
        };
        Ok(Self { unix, tcp, tokens })
    }

    /// Where the front listens, for the log.
    pub fn describe(&self) -> String {
        let mut v = Vec::new();
        if let Some((_, p)) = &self.unix {
            v.push(p.display().to_string());
        }
        if let Some(t) = &self.tcp {
            v.push(t.local_addr().map_or_else(|_| "tcp".into(), |a| format!("http://{a}")));
        }
        v.join(", ")
    }
}

/// Bearer tokens of TCP clients: token -> app.
#[derive(Default)]
struct Tokens(HashMap<String, String>);

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} apps)", self.0.len())
    }
}

impl Tokens {
    /// Reads `<app> <token>` lines (`#` starts a comment). The file must be the service user's
    /// and readable by nobody else: a token is a password.
    fn load(path: &Path) -> Result<Self> {
        let m = std::fs::metadata(path).with_context(|| format!("http_tokens {}", path.display()))?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if !m.is_file() {
            bail!("http_tokens {}: not a regular file", path.display());
        }
        if m.permissions().mode() & 0o077 != 0 || m.uid() != me {
            bail!(
                "http_tokens {}: mode {:o} owned by uid {}; it must be mode 0600 and owned by uid {me} (tokens are passwords)",
                path.display(),
                m.permissions().mode() & 0o777,
                m.uid()
            );
        }
        if m.len() > 1 << 20 {
            bail!("http_tokens {}: over 1 MiB", path.display());
        }
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut t = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut parts = line.split_whitespace();
            let (Some(app), Some(token), None) = (parts.next(), parts.next(), parts.next()) else {
                bail!("http_tokens {} line {}: want `<app> <token>`", path.display(), i + 1);
            };
            if !super::conn::valid_app(app) {
                bail!("http_tokens {} line {}: app: 1-64 characters of A-Z a-z 0-9 . _ -", path.display(), i + 1);
            }
            if token.len() < 16 {
                bail!("http_tokens {} line {}: a token of at least 16 characters", path.display(), i + 1);
            }
            if t.insert(token.to_string(), app.to_string()).is_some() {
                bail!("http_tokens {} line {}: a token given twice", path.display(), i + 1);
            }
        }
        Ok(Self(t))
    }

    /// The app a bearer token names. Every token is compared in full (no early exit on the
    /// first differing byte): the time taken does not tell how much of a guess was right.
    fn app(&self, token: &str) -> Option<&str> {
        let mut found = None;
        for (t, app) in &self.0 {
            let same = t.len() == token.len() && t.bytes().zip(token.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
            if same {
                found = Some(app.as_str());
            }
        }
        found
    }
}

/// Who is at the other end of a connection.
#[derive(Debug, Clone, Copy)]
enum Peer {
    Unix { uid: u32 },
    Tcp,
}

/// A connection as its requests see it.
#[derive(Debug)]
struct Conn {
    peer: Peer,
    /// TCP: the app this connection serves and its slot among the app's connections, from
    /// its first authenticated request (one connection serves one app).
    app: std::sync::Mutex<Option<(String, Slot)>>,
    /// TCP: its place among the connections not yet authenticated, until then.
    waiting: Option<u64>,
}

/// TCP connections that have not authenticated yet. They hold no app's slot (so strangers
/// cannot take a token holder's place); there are at most `max_connections` of them, and
/// when another comes the oldest is closed (each also has `io_timeout_s` to send its headers).
#[derive(Debug, Default)]
struct Unauthenticated {
    next: u64,
    order: std::collections::VecDeque<(u64, Arc<tokio::sync::Notify>)>,
}

impl Front {
    /// Takes a place for a new TCP connection, closing the oldest waiting one when full;
    /// the notify fires when this one is to close.
    fn wait_for_auth(&self) -> (u64, Arc<tokio::sync::Notify>) {
        let mut u = super::lock(&self.unauthenticated);
        while u.order.len() >= self.svc.cfg.max_connections.max(1) {
            if let Some((_, kick)) = u.order.pop_front() {
                kick.notify_one();
            }
        }
        u.next += 1;
        let id = u.next;
        let kick = Arc::new(tokio::sync::Notify::new());
        u.order.push_back((id, Arc::clone(&kick)));
        (id, kick)
    }

    fn authenticated(&self, id: u64) {
        super::lock(&self.unauthenticated).order.retain(|(i, _)| *i != id);
    }
}

struct Front {
    svc: Arc<Service>,
    /// Connections being served (a stop waits for them).
    active: std::sync::atomic::AtomicUsize,
    /// True once the service stops: connections finish their request and close.
    stopped: watch::Receiver<bool>,
    tokens: Tokens,
    /// The model's name in `/v1/models` and the `model` field.
    model_id: String,
    unauthenticated: std::sync::Mutex<Unauthenticated>,
}

/// The running front; dropped when the service stops.
pub(super) struct Running {
    stop: watch::Sender<bool>,
    front: Arc<Front>,
    rt: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running").finish_non_exhaustive()
    }
}

impl Running {
    /// Stops accepting; requests in flight finish (the call running ends, queued ones are
    /// answered 503 by the worker as it stops), idle connections close; whatever is left
    /// after [`STOP_GRACE`] (a client that stopped reading) is dropped.
    pub(super) fn stop(mut self) {
        let _ = self.stop.send(true);
        let until = std::time::Instant::now() + STOP_GRACE;
        while self.front.active.load(std::sync::atomic::Ordering::SeqCst) > 0 && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

impl Service {
    /// Starts the front on its listeners (none: nothing runs).
    pub(super) fn start_http(self: &Arc<Self>, l: Listeners) -> Result<Option<Running>> {
        if l.unix.is_none() && l.tcp.is_none() {
            return Ok(None);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("llmsd-http")
            .on_thread_start(crate::sched::short_slice_or_warn)
            .enable_all()
            .build()?;
        let model_id = self.cfg.model.file_stem().map_or_else(|| "llms".into(), |s| s.to_string_lossy().into_owned());
        let (stop, stopped) = watch::channel(false);
        let front = Arc::new(Front {
            svc: Arc::clone(self),
            active: std::sync::atomic::AtomicUsize::new(0),
            stopped: stopped.clone(),
            tokens: l.tokens,
            model_id,
            unauthenticated: std::sync::Mutex::new(Unauthenticated::default()),
        });
        let router = router(Arc::clone(&front));
        if let Some((u, path)) = l.unix {
            u.set_nonblocking(true)?;
            let _g = rt.enter();
            let u = tokio::net::UnixListener::from_std(u)?;
            info!(socket = %path.display(), "HTTP front (OpenAI API) listening");
            rt.spawn(accept_loop(Arc::clone(&front), u, router.clone(), stopped.clone()));
        }
        if let Some(t) = l.tcp {
            t.set_nonblocking(true)?;
            let _g = rt.enter();
            let t = tokio::net::TcpListener::from_std(t)?;
            info!(addr = %t.local_addr()?, "HTTP front (OpenAI API) listening on TCP (bearer tokens)");
            rt.spawn(accept_loop(Arc::clone(&front), t, router, stopped));
        }
        Ok(Some(Running { stop, front, rt: Some(rt) }))
    }
}

fn router(front: Arc<Front>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "invalid_request_error", "not_found", "no such endpoint") })
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&front), count))
        .with_state(front)
}

/// Counts every answer by endpoint and status (`llms_http_requests_total`), and answers a
/// request whose handling panicked with a 500 that does not repeat the panic's text (the log
/// has it); the connection's slot is given back as the connection ends.
async fn count(State(front): State<Arc<Front>>, req: Request, next: Next) -> Response {
    use futures_util::FutureExt;
    let endpoint = req.extensions().get::<MatchedPath>().map_or_else(|| "other".to_string(), |p| p.as_str().to_string());
    let r = match std::panic::AssertUnwindSafe(next.run(req)).catch_unwind().await {
        Ok(r) => r,
        Err(p) => {
            tracing::error!(endpoint, "an HTTP request's handling panicked; answered 500: {}", super::call::panic_message(p.as_ref()));
            error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "failed", "the request failed inside the service (its log says why)")
        }
    };
    front.svc.prom.http.get_or_create(&super::metrics::HttpLabels { endpoint, status: r.status().as_u16() }).inc();
    r
}

/// A listener the front accepts from: the connection, who is at the other end, and the uid
/// its connections count against.
trait Accept {
    type Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static;
    /// `Ok(None)`: a connection that is dropped at once (its peer cannot be identified).
    fn next(&self) -> impl std::future::Future<Output = std::io::Result<Option<(Self::Io, Peer, u32)>>> + Send;
}

impl Accept for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    async fn next(&self) -> std::io::Result<Option<(Self::Io, Peer, u32)>> {
        let (s, _) = self.accept().await?;
        Ok(s.peer_cred().ok().map(|c| (s, Peer::Unix { uid: c.uid() }, c.uid())))
    }
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn next(&self) -> std::io::Result<Option<(Self::Io, Peer, u32)>> {
        let (s, _) = self.accept().await?;
        let _ = s.set_nodelay(true);
        Ok(Some((s, Peer::Tcp, NETWORK_UID)))
    }
}

async fn accept_loop<L: Accept>(front: Arc<Front>, l: L, router: Router, mut stop: watch::Receiver<bool>) {
    loop {
        let (stream, peer, uid) = tokio::select! {
            r = l.next() => match r {
                Ok(Some(c)) => c,
                Ok(None) => continue,
                Err(e) => { warn!("http accept: {e}"); tokio::time::sleep(Duration::from_millis(50)).await; continue; }
            },
            _ = stop.changed() => return,
        };
        serve(&front, stream, &router, peer, uid);
    }
}

/// Serves one connection on its own task. A Unix peer's connection counts against its uid
/// from the start; a TCP peer's waits among the unauthenticated ones until its first request
/// shows a token, then counts against that token's app.
fn serve<S>(front: &Arc<Front>, mut stream: S, router: &Router, peer: Peer, uid: u32)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = Arc::clone(&front.svc);
    let (slot, waiting) = match peer {
        Peer::Unix { .. } => match svc.admit_connection(Holder::Uid(uid)) {
            Ok(slot) => (Some(slot), None),
            Err(why) => {
                tokio::spawn(async move {
                    let body = error_body("rate_limit_error", "too_many_connections", &why);
                    let head = format!(
                        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    let _ = tokio::time::timeout(Duration::from_secs(1), async {
                        let _ = stream.write_all(head.as_bytes()).await;
                        let _ = stream.write_all(body.as_bytes()).await;
                    })
                    .await;
                });
                return;
            }
        },
        Peer::Tcp => (None, Some(front.wait_for_auth())),
    };
    let io = Duration::from_secs(svc.cfg.io_timeout_s.max(1));
    let conn = Arc::new(Conn { peer, app: std::sync::Mutex::new(None), waiting: waiting.as_ref().map(|w| w.0) });
    let app = router.clone().layer(Extension(Arc::clone(&conn)));
    let mut stopped = front.stopped.clone();
    let front = Arc::clone(front);
    tokio::spawn(async move {
        // Given back however the task ends (a panic included): the connection's slot, its
        // place among the unauthenticated, its count among the active.
        let _slot = slot;
        let _active = Active::new(&front);
        let _waiting = Waiting(&front, waiting.as_ref().map(|w| w.0));
        let kicked = async {
            match &waiting {
                Some((_, kick)) => kick.notified().await,
                None => std::future::pending().await,
            }
        };
        let service = hyper_util::service::TowerToHyperService::new(app);
        let http = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(io)
            .max_buf_size(64 * 1024)
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        let mut http = std::pin::pin!(http);
        tokio::select! {
            _ = http.as_mut() => {}
            // Still unauthenticated when the pool is full: the oldest goes.
            () = kicked, if conn.app_name().is_none() => {}
            () = async { let _ = stopped.wait_for(|s| *s).await; } => {
                // The request in flight is answered, then the connection closes.
                http.as_mut().graceful_shutdown();
                let _ = http.await;
            }
        }
        drop(conn);
    });
}

impl Conn {
    fn app_name(&self) -> Option<String> {
        super::lock(&self.app).as_ref().map(|(a, _)| a.clone())
    }
}

/// A connection counted among the front's active ones (a stop waits for them).
struct Active(Arc<Front>);

impl Active {
    fn new(front: &Arc<Front>) -> Self {
        front.active.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self(Arc::clone(front))
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A TCP connection's place among the unauthenticated, given back when it ends.
struct Waiting<'a>(&'a Front, Option<u64>);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.1 {
            self.0.authenticated(id);
        }
    }
}

/// The owner a request acts for, or the answer that says why it has none. Called before
/// anything reads a request's body. A TCP connection's first valid token binds it to the
/// token's app and counts it against that app's connections.
fn owner(front: &Front, conn: &Conn, headers: &HeaderMap) -> Result<Owner, Response> {
    match conn.peer {
        Peer::Unix { uid } => {
            let app = match headers.get("x-llms-app") {
                None => "default".to_string(),
                Some(v) => match v.to_str() {
                    Ok(a) if super::conn::valid_app(a) => a.to_string(),
                    _ => {
                        return Err(error(
                            StatusCode::BAD_REQUEST,
                            "invalid_request_error",
                            "invalid_app",
                            "X-LLMS-App: 1-64 characters of A-Z a-z 0-9 . _ -",
                        ))
                    }
                },
            };
            super::fault_point("http-auth", &app);
            front.svc.may_use_app(uid, &app).map_err(|why| error(StatusCode::FORBIDDEN, "permission_error", "app_not_granted", why))?;
            Ok(Owner { uid, app })
        }
        Peer::Tcp => {
            let token =
                headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).map(str::trim);
            let Some(app) = token.and_then(|t| front.tokens.app(t)) else {
                return Err(error(
                    StatusCode::UNAUTHORIZED,
                    "authentication_error",
                    "invalid_api_key",
                    if token.is_some() {
                        "the bearer token is not valid"
                    } else {
                        "a bearer token is needed (Authorization: Bearer <token>)"
                    },
                ));
            };
            let mut bound = super::lock(&conn.app);
            match &*bound {
                Some((a, _)) if a == app => {}
                Some((a, _)) => {
                    return Err(error(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        "one_app_per_connection",
                        format!("this connection serves app {}; open another one for {}", crate::proto::quote(a), crate::proto::quote(app)),
                    ))
                }
                None => {
                    let slot = front
                        .svc
                        .admit_connection(Holder::App(app.to_string()))
                        .map_err(|why| error(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "too_many_connections", why))?;
                    *bound = Some((app.to_string(), slot));
                    if let Some(id) = conn.waiting {
                        front.authenticated(id);
                    }
                }
            }
            Ok(Owner { uid: NETWORK_UID, app: app.to_string() })
        }
    }
}

async fn health(State(front): State<Arc<Front>>) -> Response {
    if front.svc.stopping.load(std::sync::atomic::Ordering::SeqCst) {
        return error(StatusCode::SERVICE_UNAVAILABLE, "server_error", "shutting_down", "the service is stopping");
    }
    axum::Json(serde_json::json!({"status": "ok"})).into_response()
}

async fn metrics(State(front): State<Arc<Front>>, Extension(conn): Extension<Arc<Conn>>, headers: HeaderMap) -> Response {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let viewer = match conn.peer {
        Peer::Unix { uid } if uid == 0 || uid == me => Viewer::All,
        Peer::Unix { uid } => Viewer::Uid(uid),
        Peer::Tcp => match owner(&front, &conn, &headers) {
            Ok(o) => Viewer::App { uid: o.uid, app: o.app },
            Err(r) => return r,
        },
    };
    let registry = front.svc.prom.registry(&front.svc, viewer);
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registry) {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "metrics", format!("encoding the metrics: {e}"));
    }
    let mut r = out.into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"));
    r
}

fn error_body(kind: &str, code: &str, message: &str) -> String {
    error_body_param(kind, code, None, message)
}

fn error_body_param(kind: &str, code: &str, param: Option<&str>, message: &str) -> String {
    serde_json::json!({"error": {"message": message, "type": kind, "param": param, "code": code}}).to_string()
}

/// An answer in OpenAI's error object.
fn error(status: StatusCode, kind: &str, code: &str, message: impl AsRef<str>) -> Response {
    error_param(status, kind, code, None, message)
}

/// An answer in OpenAI's error object that names the request field at fault.
fn error_param(status: StatusCode, kind: &str, code: &str, param: Option<&str>, message: impl AsRef<str>) -> Response {
    let mut r = (status, error_body_param(kind, code, param, message.as_ref())).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// The HTTP answer to a service error.
fn refused(code: ErrorCode, message: &str) -> Response {
    let (status, kind, c) = match code {
        ErrorCode::BadRequest | ErrorCode::NotBound | ErrorCode::Version => {
            (StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_request")
        }
        ErrorCode::TooLong => (StatusCode::BAD_REQUEST, "invalid_request_error", "context_length_exceeded"),
        ErrorCode::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", "request_too_large"),
        ErrorCode::NotFound => (StatusCode::NOT_FOUND, "invalid_request_error", "context_not_found"),
        ErrorCode::TooMany => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "too_many"),
        ErrorCode::Busy => (StatusCode::CONFLICT, "invalid_request_error", "context_busy"),
        ErrorCode::Failed => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", "failed"),
        ErrorCode::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "server_error", "shutting_down"),
    };
    error(status, kind, c, message)
}

/// Reads a request body of at most [`MAX_BODY`] bytes, whole within `io_timeout_s`: a
/// `Content-Length` over the limit is refused before any of it is read, and a body that
/// stalls is answered 408 (a sender cannot hold a connection slot by trickling).
async fn body_bytes(front: &Front, headers: &HeaderMap, body: Body) -> Result<axum::body::Bytes, Response> {
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("the body is over {MAX_BODY} bytes (or broken off)"),
        )
    };
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(too_large());
    }
    let io = Duration::from_secs(front.svc.cfg.io_timeout_s.max(1));
    match tokio::time::timeout(io, axum::body::to_bytes(body, MAX_BODY)).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(_)) => Err(too_large()),
        Err(_) => Err(error(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "request_timeout",
            format!("the body did not arrive within {} s (io_timeout_s)", io.as_secs()),
        )),
    }
}

//! The HTTP front: the OpenAI-compatible API (`openai.rs`), `/metrics` and `/health`, served by
//! hyper (axum's router) on a tokio runtime of its own, beside the native socket. It ends in
//! the same queue as the native protocol ([`Service::submit_history`]): the worker, its
//! atomic calls and the per-uid limits are the same for both doors.
//!
//! Identity: on the Unix socket the kernel's uid (SO_PEERCRED), as on the native socket, and
//! the app the client names (`X-LLMS-App`, else `default`); on loopback TCP a bearer token
//! from `http_tokens`, which names its app. TCP peers have no uid: they count as
//! [`NETWORK_UID`] for the per-uid limits. Connections are limited as native ones are, headers
//! must arrive within `io_timeout_s`, bodies are at most [`MAX_BODY`] bytes.

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

struct Front {
    svc: Arc<Service>,
    /// Connections being served (a stop waits for them).
    active: std::sync::atomic::AtomicUsize,
    /// True once the service stops: connections finish their request and close.
    stopped: watch::Receiver<bool>,
    tokens: Tokens,
    /// The model's name in `/v1/models` and the `model` field.
    model_id: String,
    registry: prometheus_client::registry::Registry,
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
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("llmsd-http").enable_all().build()?;
        let model_id = self.cfg.model.file_stem().map_or_else(|| "llms".into(), |s| s.to_string_lossy().into_owned());
        let registry = self.prom.registry(self);
        let (stop, stopped) = watch::channel(false);
        let front = Arc::new(Front {
            svc: Arc::clone(self),
            active: std::sync::atomic::AtomicUsize::new(0),
            stopped: stopped.clone(),
            tokens: l.tokens,
            model_id,
            registry,
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

/// Counts every answer by endpoint and status (`llms_http_requests_total`).
async fn count(State(front): State<Arc<Front>>, req: Request, next: Next) -> Response {
    let endpoint = req.extensions().get::<MatchedPath>().map_or_else(|| "other".to_string(), |p| p.as_str().to_string());
    let r = next.run(req).await;
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

/// Serves one connection on its own task, within the connection limits of `uid`.
fn serve<S>(front: &Arc<Front>, mut stream: S, router: &Router, peer: Peer, uid: u32)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = Arc::clone(&front.svc);
    if let Err(why) = svc.admit_connection(uid) {
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
    let io = Duration::from_secs(svc.cfg.io_timeout_s.max(1));
    let app = router.clone().layer(Extension(peer));
    let mut stopped = front.stopped.clone();
    let front = Arc::clone(front);
    front.active.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    tokio::spawn(async move {
        let service = hyper_util::service::TowerToHyperService::new(app);
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(io)
            .max_buf_size(64 * 1024)
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        let mut conn = std::pin::pin!(conn);
        tokio::select! {
            _ = conn.as_mut() => {}
            () = async { let _ = stopped.wait_for(|s| *s).await; } => {
                // The request in flight is answered, then the connection closes.
                conn.as_mut().graceful_shutdown();
                let _ = conn.await;
            }
        }
        svc.release_connection(uid);
        front.active.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    });
}

/// The owner a request acts for, or the 401 that says why it has none.
fn owner(front: &Front, peer: Peer, headers: &HeaderMap) -> Result<Owner, Response> {
    match peer {
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
            front.svc.may_use_app(uid, &app).map_err(|why| error(StatusCode::FORBIDDEN, "permission_error", "app_not_granted", why))?;
            Ok(Owner { uid, app })
        }
        Peer::Tcp => {
            let token =
                headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).map(str::trim);
            match token.and_then(|t| front.tokens.app(t)) {
                Some(app) => Ok(Owner { uid: NETWORK_UID, app: app.to_string() }),
                None => Err(error(
                    StatusCode::UNAUTHORIZED,
                    "authentication_error",
                    "invalid_api_key",
                    if token.is_some() {
                        "the bearer token is not valid"
                    } else {
                        "a bearer token is needed (Authorization: Bearer <token>)"
                    },
                )),
            }
        }
    }
}

async fn health(State(front): State<Arc<Front>>) -> Response {
    if front.svc.stopping.load(std::sync::atomic::Ordering::SeqCst) {
        return error(StatusCode::SERVICE_UNAVAILABLE, "server_error", "shutting_down", "the service is stopping");
    }
    axum::Json(serde_json::json!({"status": "ok"})).into_response()
}

async fn metrics(State(front): State<Arc<Front>>, Extension(peer): Extension<Peer>, headers: HeaderMap) -> Response {
    if matches!(peer, Peer::Tcp) {
        if let Err(r) = owner(&front, peer, &headers) {
            return r;
        }
    }
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &front.registry) {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "metrics", format!("encoding the metrics: {e}"));
    }
    let mut r = out.into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"));
    r
}

fn error_body(kind: &str, code: &str, message: &str) -> String {
    serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}}).to_string()
}

/// An answer in OpenAI's error object.
fn error(status: StatusCode, kind: &str, code: &str, message: impl AsRef<str>) -> Response {
    let mut r = (status, error_body(kind, code, message.as_ref())).into_response();
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

/// Reads a request body of at most [`MAX_BODY`] bytes.
async fn body_bytes(body: Body) -> Result<axum::body::Bytes, Response> {
    axum::body::to_bytes(body, MAX_BODY).await.map_err(|_| {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("the body is over {MAX_BODY} bytes (or broken off)"),
        )
    })
}

//! A client of llmsd: one connection, bound to one app.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use crate::proto::{self, Call, CallStats, CtxInfo, ErrorCode, Event, FrameError, Request, ServiceStats};

/// The socket llmsd listens on unless told: `$LLMS_SOCKET`, else `$XDG_RUNTIME_DIR/llms/llmsd.sock`
/// when that directory is set, else `/run/llms/llmsd.sock`.
pub fn default_socket() -> PathBuf {
    if let Some(p) = std::env::var_os("LLMS_SOCKET").filter(|v| !v.is_empty()) {
        return p.into();
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => PathBuf::from(d).join("llms/llmsd.sock"),
        None => PathBuf::from("/run/llms/llmsd.sock"),
    }
}

/// An error the service answered with.
#[derive(Debug, thiserror::Error)]
#[error("llmsd: {code:?}: {message}")]
pub struct ServiceError {
    pub code: ErrorCode,
    pub message: String,
}

/// Why a client operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connecting to llmsd at {} (is it running? `llmsd --socket PATH`)", path.display())]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The connection broke, or a frame could not be read or written.
    #[error("{what} llmsd")]
    Frame {
        what: &'static str,
        #[source]
        source: FrameError,
    },
    /// The service answered with an error.
    #[error(transparent)]
    Service(#[from] ServiceError),
    /// The service answered something this request does not expect (a protocol mismatch).
    #[error("unexpected answer to {op}: {event}")]
    Unexpected { op: &'static str, event: String },
}

impl ClientError {
    /// The service's answer, when the service answered with an error.
    pub fn service(&self) -> Option<&ServiceError> {
        match self {
            Self::Service(s) => Some(s),
            _ => None,
        }
    }

    fn unexpected(op: &'static str, e: &Event) -> Self {
        Self::Unexpected { op, event: format!("{e:?}") }
    }
}

pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// A bound connection.
#[derive(Debug)]
pub struct Client {
    stream: UnixStream,
    pub uid: u32,
    pub app: String,
}

impl Client {
    /// Connects to `socket` and binds as `app`.
    pub fn connect(socket: &Path, app: &str) -> Result<Self> {
        let stream = UnixStream::connect(socket).map_err(|source| ClientError::Connect { path: socket.into(), source })?;
        let mut c = Self { stream, uid: 0, app: app.into() };
        match c.request(&Request::Bind { app: app.into(), version: proto::VERSION })? {
            Event::Bound { uid, .. } => c.uid = uid,
            e => return Err(ClientError::unexpected("bind", &e)),
        }
        Ok(c)
    }

    /// A second handle on the connection's socket (to shut it down from another thread: the
    /// service cancels a call whose client hangs up).
    pub fn try_clone_stream(&self) -> std::io::Result<UnixStream> {
        self.stream.try_clone()
    }

    /// Sends `req` and reads one answer (an error answer is an `Err` with a [`ServiceError`]).
    pub fn request(&mut self, req: &Request) -> Result<Event> {
        self.send(req)?;
        self.next()
    }

    fn send(&mut self, req: &Request) -> Result<()> {
        proto::write_frame(&mut self.stream, &proto::encode(req)).map_err(|source| ClientError::Frame { what: "sending to", source })
    }

    fn next(&mut self) -> Result<Event> {
        let read = |source| ClientError::Frame { what: "reading from", source };
        let body = proto::read_frame(&mut self.stream).map_err(read)?;
        match proto::decode_event(&body).map_err(read)? {
            Event::Error { code, message } => Err(ServiceError { code, message }.into()),
            e => Ok(e),
        }
    }

    pub fn new_ctx(&mut self, system_prompt: Option<&str>) -> Result<String> {
        match self.request(&Request::NewCtx { system_prompt: system_prompt.map(Into::into) })? {
            Event::Created { ctx } => Ok(ctx),
            e => Err(ClientError::unexpected("new_ctx", &e)),
        }
    }

    /// A new context holding `ctx`'s tokens (its K/V shared with `ctx`, not copied); returns its id.
    pub fn fork(&mut self, ctx: &str) -> Result<String> {
        match self.request(&Request::Fork { ctx: ctx.into() })? {
            Event::Created { ctx } => Ok(ctx),
            e => Err(ClientError::unexpected("fork", &e)),
        }
    }

    /// Runs a call, handing each streamed piece to `on_token`; returns the output and stats.
    pub fn call(&mut self, call: &Call, on_token: &mut dyn FnMut(&str)) -> Result<(String, CallStats)> {
        self.send(&Request::Call(call.clone()))?;
        loop {
            match self.next()? {
                Event::Token { text } => on_token(&text),
                Event::Done { text, stats } => return Ok((text, stats)),
                e => return Err(ClientError::unexpected("call", &e)),
            }
        }
    }

    pub fn del_ctx(&mut self, ctx: &str) -> Result<()> {
        match self.request(&Request::DelCtx { ctx: ctx.into() })? {
            Event::Deleted { .. } => Ok(()),
            e => Err(ClientError::unexpected("del_ctx", &e)),
        }
    }

    pub fn list(&mut self) -> Result<Vec<CtxInfo>> {
        match self.request(&Request::List {})? {
            Event::List { contexts } => Ok(contexts),
            e => Err(ClientError::unexpected("list", &e)),
        }
    }

    pub fn stats(&mut self) -> Result<ServiceStats> {
        match self.request(&Request::Stats {})? {
            Event::Stats { stats } => Ok(*stats),
            e => Err(ClientError::unexpected("stats", &e)),
        }
    }
}

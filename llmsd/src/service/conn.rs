//! Connections: the native protocol (framed JSON over the Unix socket, docs/llmsd.md) — accept,
//! identify the peer (SO_PEERCRED), bind it to an app, and turn requests into service calls,
//! streaming a call's events back. Timeouts and limits keep one client from holding a thread.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::warn;

use super::slots::Holder;
use super::{lock, refuse, Owner, Service};
use crate::proto::{self, Call, ErrorCode, Event, FrameError, Request};
use std::panic::{catch_unwind, AssertUnwindSafe};
use tracing::error;

impl Service {
    /// Accepts connections until the service stops, one thread each, up to `max_connections`
    /// in all and `max_connections_per_uid` per uid.
    pub(super) fn accept(self: &Arc<Self>, listener: UnixListener) {
        for conn in listener.incoming() {
            if self.stopping.load(Ordering::SeqCst) {
                break;
            }
            let stream = match conn {
                Ok(s) => s,
                Err(e) => {
                    warn!("accept: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            };
            // The peer's uid, from the kernel: the unit every per-user limit counts in.
            let Ok(cred) = nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials) else {
                continue;
            };
            let uid = cred.uid();
            let slot = match self.admit_connection(Holder::Uid(uid)) {
                Ok(slot) => slot,
                Err(why) => {
                    let mut s = stream;
                    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
                    let _ = proto::write_frame(&mut s, &proto::encode(&Event::error(ErrorCode::TooMany, why)));
                    continue;
                }
            };
            let svc = Arc::clone(self);
            // The slot moves into the thread and is given back when it ends, however it ends
            // (a panic included); if the thread cannot start, the closure is dropped with it.
            let spawned = std::thread::Builder::new().name("llmsd-conn".into()).spawn(move || {
                let _slot = slot;
                crate::sched::short_slice_or_warn();
                let mut stream = stream;
                if let Err(p) = catch_unwind(AssertUnwindSafe(|| svc.connection(&mut stream, uid))) {
                    error!(
                        uid,
                        "a connection's handling panicked; it is closed and the service goes on: {}",
                        super::call::panic_message(p.as_ref())
                    );
                    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
                    let _ = send(
                        &mut stream,
                        &Event::error(ErrorCode::Failed, "the service failed handling this connection (its log says why); it is closed"),
                    );
                }
            });
            if let Err(e) = spawned {
                warn!("cannot start a connection thread: {e}");
            }
        }
    }

    /// Whether `uid` may act as `app`. An app name is tied to the uid that uses it: a uid acts
    /// as one app (the one its contexts belong to) unless `app_names` grants it more; root and
    /// the service's own user may use any (they can read the state directory anyway). Contexts
    /// are owned by (uid, app), so another uid never reaches them whatever name it declares.
    pub(super) fn may_use_app(&self, uid: u32, app: &str) -> Result<(), String> {
        // SAFETY: geteuid has no preconditions.
        if uid == 0 || uid == unsafe { libc::geteuid() } {
            return Ok(());
        }
        if let Some(names) = self.cfg.app_names.get(&uid.to_string()) {
            return if names.iter().any(|n| n == "*" || n == app) {
                Ok(())
            } else {
                Err(format!("uid {uid} may act as {} only (app_names), not as {}", names.join(", "), proto::quote(app)))
            };
        }
        let reg = lock(&self.registry);
        match reg.values().map(|e| &e.saved.owner).find(|o| o.uid == uid && o.app != app) {
            Some(o) => Err(format!(
                "uid {uid} acts as app {}, the app of its contexts; one uid is one app unless the configuration grants it more names (app_names)",
                proto::quote(&o.app)
            )),
            None => Ok(()),
        }
    }

    fn connection(&self, stream: &mut UnixStream, uid: u32) {
        let idle = Duration::from_secs(self.cfg.idle_timeout_s.max(1));
        let io = Duration::from_secs(self.cfg.io_timeout_s.max(1));
        let _ = stream.set_write_timeout(Some(io));
        let mut owner: Option<Owner> = None;
        loop {
            // Wait for a request as long as a client may idle; once it starts, the frame must
            // arrive within the I/O timeout (a slow sender cannot hold the thread forever).
            if !readable(stream, idle) {
                return;
            }
            if self.stopping.load(Ordering::SeqCst) {
                let _ = send(stream, &Event::error(ErrorCode::ShuttingDown, "the service is stopping"));
                return;
            }
            let body = match proto::read_frame(&mut Deadline { stream, until: Instant::now() + io }) {
                Ok(b) => b,
                Err(FrameError::TooLarge(n)) => {
                    // The rest of the frame cannot be skipped safely: answer and hang up.
                    let _ = send(stream, &Event::error(ErrorCode::TooLarge, format!("frame of {n} bytes is over {}", proto::MAX_FRAME)));
                    return;
                }
                Err(_) => return,
            };
            let req = match proto::decode_request(&body) {
                Ok(r) => {
                    super::fault_point("native-request", &String::from_utf8_lossy(&body));
                    r
                }
                Err(e) => {
                    if send(stream, &Event::error(ErrorCode::BadRequest, e.to_string())).is_err() {
                        return;
                    }
                    continue;
                }
            };
            let answer = match (req, &owner) {
                (Request::Bind { app, version }, None) => {
                    if version != proto::VERSION {
                        Err(refuse(ErrorCode::Version, format!("this service speaks protocol {}, not {version}", proto::VERSION)))
                    } else if !valid_app(&app) {
                        Err(refuse(ErrorCode::BadRequest, "app: 1-64 characters of A-Z a-z 0-9 . _ -"))
                    } else if let Err(why) = self.may_use_app(uid, &app) {
                        Err(refuse(ErrorCode::NotBound, why))
                    } else {
                        let o = Owner { uid, app };
                        let ev = Event::Bound { protocol: proto::VERSION, uid, app: o.app.clone() };
                        owner = Some(o);
                        Ok(ev)
                    }
                }
                (Request::Bind { .. }, Some(_)) => Err(refuse(ErrorCode::NotBound, "this connection is already bound")),
                (_, None) => Err(refuse(ErrorCode::NotBound, "bind first")),
                (Request::NewCtx { system_prompt }, Some(o)) => {
                    self.new_ctx(o, system_prompt.as_deref(), false).map(|ctx| Event::Created { ctx })
                }
                (Request::DelCtx { ctx }, Some(o)) => self.del_ctx(o, &ctx).map(|()| Event::Deleted { ctx }),
                (Request::Fork { ctx }, Some(o)) => self.fork_ctx(o, &ctx).map(|ctx| Event::Created { ctx }),
                (Request::List {}, Some(o)) => Ok(Event::List { contexts: self.list(o) }),
                (Request::Stats {}, Some(o)) => Ok(Event::Stats { stats: Box::new(self.stats(o)) }),
                (Request::Call(call), Some(o)) => {
                    let o = o.clone();
                    match self.stream_call(stream, &o, call) {
                        Ok(()) => continue,
                        Err(()) => return,
                    }
                }
            };
            let ev = answer.unwrap_or_else(Event::from);
            if send(stream, &ev).is_err() {
                return;
            }
        }
    }

    /// Runs a call for a connection, streaming its events; `Err` when the client is gone.
    fn stream_call(&self, stream: &mut UnixStream, owner: &Owner, call: Call) -> Result<(), ()> {
        let cancel = Arc::new(AtomicBool::new(false));
        // However this ends (the answer sent, the client gone, a panic), the call does not go
        // on for nobody: after `done` the flag changes nothing.
        let _cancel_on_drop = super::call::CancelOnDrop::new(&cancel);
        let rx = match self.submit(owner, call, Arc::clone(&cancel)) {
            Ok(rx) => rx,
            Err(r) => return send(stream, &r.into()).map_err(|_| ()),
        };
        super::fault_point("native-stream", &owner.app);
        loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(ev) => {
                    let last = matches!(ev, Event::Done { .. } | Event::Error { .. });
                    if send(stream, &ev).is_err() {
                        // The client is gone: the call stops at its next token; what it made
                        // stays in the context and is written out.
                        cancel.store(true, Ordering::SeqCst);
                        return Err(());
                    }
                    if last {
                        return Ok(());
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    if peer_gone(stream) {
                        cancel.store(true, Ordering::SeqCst);
                        return Err(());
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return Err(()),
            }
        }
    }
}

fn send(stream: &mut UnixStream, ev: &Event) -> Result<(), FrameError> {
    proto::write_frame(stream, &proto::encode(ev))
}

/// Reads from a stream until a deadline: each read waits only for what is left of it, so a
/// frame trickled a byte at a time still ends at the deadline (a per-read timeout would let
/// one byte every few seconds hold a connection thread forever).
struct Deadline<'a> {
    stream: &'a UnixStream,
    until: Instant,
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the frame did not arrive within io_timeout_s"));
        }
        self.stream.set_read_timeout(Some(left))?;
        (&mut &*self.stream).read(buf)
    }
}

/// Waits until the socket has data (or the peer hung up: the read that follows sees it);
/// false on timeout.
fn readable(stream: &UnixStream, timeout: Duration) -> bool {
    let mut p = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    loop {
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&raw mut p, 1, ms) };
        if n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return n > 0;
        }
    }
}

/// Whether the peer hung up (without reading from the socket).
fn peer_gone(stream: &UnixStream) -> bool {
    let mut p = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&raw mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

pub(super) fn valid_app(s: &str) -> bool {
    (1..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

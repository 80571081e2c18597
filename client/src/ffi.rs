//! The C ABI over [`crate::Client`]: what `include/llms.h` declares (generated from this file
//! by cbindgen; a test keeps the two in step). Apps, JNI code and any language with a C FFI
//! link `libllms_client.so` or `libllms_client.a`.
//!
//! Contracts the header states: a client handle is used by one thread at a time, except
//! [`llms_cancel`], which any thread may call while a call runs; error messages are per thread
//! ([`llms_last_error`]); strings handed out are freed with [`llms_free_string`]. No function
//! unwinds into C: a panic is caught and reported as `LLMS_ERR_INTERNAL`.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::os::unix::net::UnixStream;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::client::{Client, ClientError};
use crate::describe;
use crate::proto::FrameError;
use crate::proto::{Call, ErrorCode};

/// What a function of the library returns: `LLMS_OK`, or why it failed (the thread's
/// [`llms_last_error`] says more).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlmsStatus {
    LlmsOk = 0,
    /// A NULL or non-UTF-8 argument, or a buffer too small.
    LlmsErrInvalidArgument = 1,
    /// llmsd is not listening at the socket (or refused the connection).
    LlmsErrConnect = 2,
    /// The connection broke; the handle reconnects at its next request.
    LlmsErrIo = 3,
    /// llmsd answered something this library does not understand.
    LlmsErrProtocol = 4,
    /// The call was cancelled ([`llms_cancel`], or the token callback returned non-zero).
    LlmsErrCancelled = 5,
    /// A bug in the library (a caught panic).
    LlmsErrInternal = 6,
    // llmsd's own error codes (docs/llmsd.md, "Protocol").
    LlmsErrBadRequest = 10,
    LlmsErrTooLarge = 11,
    LlmsErrNotBound = 12,
    LlmsErrVersion = 13,
    LlmsErrNotFound = 14,
    LlmsErrTooMany = 15,
    LlmsErrBusy = 16,
    LlmsErrFailed = 17,
    LlmsErrShuttingDown = 18,
    LlmsErrTooLong = 19,
}

/// Bytes a context id takes with its terminating NUL (32 hex digits).
pub const LLMS_CTX_ID_LEN: usize = 33;

/// A connection to llmsd bound to one app (opaque to C).
#[derive(Debug)]
pub struct LlmsClient {
    socket: PathBuf,
    app: String,
    /// `None` after the connection broke (a cancel shuts it down): the next request reconnects.
    conn: Mutex<Option<Client>>,
    /// A second handle on the running call's socket, for [`llms_cancel`] from another thread.
    running: Mutex<Option<UnixStream>>,
    cancelled: AtomicBool,
}

/// A streamed piece of a call's output: `piece` is UTF-8, NUL-terminated, `len` bytes long,
/// valid only during the callback. Return 0 to go on, non-zero to cancel the call.
pub type LlmsTokenCallback = Option<unsafe extern "C" fn(piece: *const c_char, len: usize, user: *mut c_void) -> c_int>;

/// A call's arguments. `ctx` and `prompt` are required; `raw` appends the prompt as it is
/// (special tokens parsed) instead of as a chat turn; temperature 0 is greedy.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct LlmsCallOptions {
    pub ctx: *const c_char,
    pub prompt: *const c_char,
    pub max_tokens: u32,
    pub temperature: f32,
    pub seed: u64,
    pub raw: bool,
}

thread_local! {
    static LAST_ERROR: std::cell::RefCell<CString> = std::cell::RefCell::new(CString::default());
}

fn set_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

fn fail(status: LlmsStatus, msg: &str) -> LlmsStatus {
    set_error(msg);
    status
}

/// The status of a failed client operation, with its message recorded.
fn status_of(e: &ClientError) -> LlmsStatus {
    use LlmsStatus::*;
    let status = match e.service() {
        Some(s) => match s.code {
            ErrorCode::BadRequest => LlmsErrBadRequest,
            ErrorCode::TooLarge => LlmsErrTooLarge,
            ErrorCode::NotBound => LlmsErrNotBound,
            ErrorCode::Version => LlmsErrVersion,
            ErrorCode::NotFound => LlmsErrNotFound,
            ErrorCode::TooMany => LlmsErrTooMany,
            ErrorCode::Busy => LlmsErrBusy,
            ErrorCode::Failed => LlmsErrFailed,
            ErrorCode::ShuttingDown => LlmsErrShuttingDown,
            ErrorCode::TooLong => LlmsErrTooLong,
        },
        None => match e {
            ClientError::Connect { .. } | ClientError::Frame { source: FrameError::Io(_) | FrameError::Closed, .. } => LlmsErrIo,
            _ => LlmsErrProtocol,
        },
    };
    fail(status, &describe(e))
}

/// A C string argument as UTF-8 (`None`: NULL or not UTF-8).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for the call.
unsafe fn arg<'a>(p: *const c_char) -> Option<&'a str> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller's contract: a valid NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_str().ok()
}

/// Writes a new context's `id`, NUL-terminated, into `ctx_out` when `s` is success.
///
/// # Safety
/// `ctx_out` is writable for `ctx_out_len` bytes.
unsafe fn give_id(s: LlmsStatus, id: &str, ctx_out: *mut c_char, ctx_out_len: usize) -> LlmsStatus {
    if s != LlmsStatus::LlmsOk {
        return s;
    }
    let bytes = id.as_bytes();
    if bytes.len() >= ctx_out_len {
        return fail(LlmsStatus::LlmsErrProtocol, "a context id longer than LLMS_CTX_ID_LEN");
    }
    // SAFETY: `ctx_out` holds `ctx_out_len` > `bytes.len()` bytes (checked above).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), ctx_out.cast::<u8>(), bytes.len());
        *ctx_out.add(bytes.len()) = 0;
    }
    s
}

/// Runs `f` with nothing unwinding into C.
fn guard(f: impl FnOnce() -> LlmsStatus) -> LlmsStatus {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let what = p.downcast_ref::<&str>().map(|s| (*s).to_string()).or_else(|| p.downcast_ref::<String>().cloned());
        fail(LlmsStatus::LlmsErrInternal, &format!("internal error: {}", what.unwrap_or_default()))
    })
}

impl LlmsClient {
    /// Runs `op` on the connection, reconnecting first if the last one broke; a broken
    /// connection is dropped so the next request starts afresh.
    fn with(&self, op: impl FnOnce(&mut Client) -> Result<(), ClientError>) -> LlmsStatus {
        let mut conn = self.conn.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if conn.is_none() {
            match Client::connect(&self.socket, &self.app) {
                Ok(c) => *conn = Some(c),
                Err(e) => return fail(LlmsStatus::LlmsErrConnect, &describe(&e)),
            }
        }
        match op(conn.as_mut().expect("connected above")) {
            Ok(()) => LlmsStatus::LlmsOk,
            Err(e) => {
                let s = status_of(&e);
                if s == LlmsStatus::LlmsErrIo || s == LlmsStatus::LlmsErrProtocol {
                    *conn = None;
                }
                s
            }
        }
    }
}

/// Connects to llmsd at `socket` (NULL: `$LLMS_SOCKET`, else `$XDG_RUNTIME_DIR/llms/llmsd.sock`,
/// else `/run/llms/llmsd.sock`) and binds as `app`; `*out` receives the handle, to be closed
/// with [`llms_close`].
///
/// # Safety
/// `socket` is NULL or a NUL-terminated string; `app` a NUL-terminated string; `out` a valid
/// pointer to write the handle to.
#[no_mangle]
pub unsafe extern "C" fn llms_connect(socket: *const c_char, app: *const c_char, out: *mut *mut LlmsClient) -> LlmsStatus {
    guard(|| {
        if out.is_null() {
            return fail(LlmsStatus::LlmsErrInvalidArgument, "out is NULL");
        }
        // SAFETY: the caller's contract.
        let Some(app) = (unsafe { arg(app) }) else { return fail(LlmsStatus::LlmsErrInvalidArgument, "app: NULL or not UTF-8") };
        let socket = if socket.is_null() {
            crate::client::default_socket()
        } else {
            // SAFETY: the caller's contract.
            match unsafe { arg(socket) } {
                Some(s) => PathBuf::from(s),
                None => return fail(LlmsStatus::LlmsErrInvalidArgument, "socket: not UTF-8"),
            }
        };
        let client = match Client::connect(&socket, app) {
            Ok(c) => c,
            Err(e) => {
                let s = status_of(&e);
                return if s == LlmsStatus::LlmsErrIo { fail(LlmsStatus::LlmsErrConnect, &format!("{e:#}")) } else { s };
            }
        };
        let c = LlmsClient {
            socket,
            app: app.to_string(),
            conn: Mutex::new(Some(client)),
            running: Mutex::new(None),
            cancelled: AtomicBool::new(false),
        };
        // SAFETY: `out` is valid for a write (checked non-NULL; the caller's contract).
        unsafe { *out = Box::into_raw(Box::new(c)) };
        LlmsStatus::LlmsOk
    })
}

/// Closes a handle (NULL is ignored). No call may be running on it.
///
/// # Safety
/// `client` is NULL or a handle from [`llms_connect`] not closed before.
#[no_mangle]
pub unsafe extern "C" fn llms_close(client: *mut LlmsClient) {
    if !client.is_null() {
        // SAFETY: the caller's contract: a live handle, given up here.
        drop(unsafe { Box::from_raw(client) });
    }
}

/// Creates a context (with `system_prompt`, or none if NULL) and writes its id, NUL-terminated,
/// into `ctx_out` (at least `LLMS_CTX_ID_LEN` bytes).
///
/// # Safety
/// `client` a live handle; `system_prompt` NULL or a NUL-terminated string; `ctx_out` writable
/// for `ctx_out_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn llms_new_ctx(
    client: *const LlmsClient,
    system_prompt: *const c_char,
    ctx_out: *mut c_char,
    ctx_out_len: usize,
) -> LlmsStatus {
    guard(|| {
        // SAFETY: the caller's contract.
        let Some(c) = (unsafe { client.as_ref() }) else { return fail(LlmsStatus::LlmsErrInvalidArgument, "client is NULL") };
        if ctx_out.is_null() || ctx_out_len < LLMS_CTX_ID_LEN {
            return fail(LlmsStatus::LlmsErrInvalidArgument, "ctx_out must hold LLMS_CTX_ID_LEN bytes");
        }
        // SAFETY: the caller's contract.
        let system = unsafe { arg(system_prompt) };
        if system.is_none() && !system_prompt.is_null() {
            return fail(LlmsStatus::LlmsErrInvalidArgument, "system_prompt: not UTF-8");
        }
        let mut id = String::new();
        let s = c.with(|cl| cl.new_ctx(system).map(|x| id = x));
        // SAFETY: the caller's contract (`ctx_out` writable for `ctx_out_len` bytes).
        unsafe { give_id(s, &id, ctx_out, ctx_out_len) }
    })
}

/// Creates a context holding the tokens of context `ctx` (its K/V shared with `ctx`, not
/// copied: the two go on apart from there) and writes its id, NUL-terminated, into `ctx_out`
/// (at least `LLMS_CTX_ID_LEN` bytes).
///
/// # Safety
/// `client` a live handle; `ctx` a NUL-terminated string; `ctx_out` writable for
/// `ctx_out_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn llms_fork(client: *const LlmsClient, ctx: *const c_char, ctx_out: *mut c_char, ctx_out_len: usize) -> LlmsStatus {
    guard(|| {
        // SAFETY: the caller's contract.
        let Some(c) = (unsafe { client.as_ref() }) else { return fail(LlmsStatus::LlmsErrInvalidArgument, "client is NULL") };
        if ctx_out.is_null() || ctx_out_len < LLMS_CTX_ID_LEN {
            return fail(LlmsStatus::LlmsErrInvalidArgument, "ctx_out must hold LLMS_CTX_ID_LEN bytes");
        }
        // SAFETY: the caller's contract.
        let Some(from) = (unsafe { arg(ctx) }) else { return fail(LlmsStatus::LlmsErrInvalidArgument, "ctx: NULL or not UTF-8") };
        let mut id = String::new();
        let s = c.with(|cl| cl.fork(from).map(|x| id = x));
        // SAFETY: the caller's contract.
        unsafe { give_id(s, &id, ctx_out, ctx_out_len) }
    })
}

/// Deletes a context and its data.
///
/// # Safety
/// `client` a live handle; `ctx` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn llms_del_ctx(client: *const LlmsClient, ctx: *const c_char) -> LlmsStatus {
    guard(|| {
        // SAFETY: the caller's contract.
        let (Some(c), Some(ctx)) = (unsafe { client.as_ref() }, unsafe { arg(ctx) }) else {
            return fail(LlmsStatus::LlmsErrInvalidArgument, "client or ctx is NULL");
        };
        c.with(|cl| cl.del_ctx(ctx))
    })
}

/// Sends a prompt to a context and streams the answer to `on_token` (may be NULL). With
/// `text_out` non-NULL, `*text_out` receives the whole output (free it with
/// [`llms_free_string`]). Returns `LLMS_ERR_CANCELLED` when [`llms_cancel`] or the callback
/// stopped it (what was generated stays in the context, as with a client that goes away).
///
/// # Safety
/// `client` a live handle; `opts` a valid options struct whose strings are NUL-terminated;
/// `text_out` NULL or writable; `on_token` NULL or a function safe to call with `user`.
#[no_mangle]
pub unsafe extern "C" fn llms_call(
    client: *const LlmsClient,
    opts: *const LlmsCallOptions,
    on_token: LlmsTokenCallback,
    user: *mut c_void,
    text_out: *mut *mut c_char,
) -> LlmsStatus {
    guard(|| {
        // SAFETY: the caller's contract.
        let (Some(c), Some(o)) = (unsafe { client.as_ref() }, unsafe { opts.as_ref() }) else {
            return fail(LlmsStatus::LlmsErrInvalidArgument, "client or opts is NULL");
        };
        // SAFETY: the caller's contract.
        let (Some(ctx), Some(prompt)) = (unsafe { arg(o.ctx) }, unsafe { arg(o.prompt) }) else {
            return fail(LlmsStatus::LlmsErrInvalidArgument, "ctx and prompt: NUL-terminated UTF-8");
        };
        let call = Call {
            ctx: ctx.into(),
            prompt: prompt.into(),
            max_tokens: o.max_tokens,
            temperature: o.temperature,
            seed: o.seed,
            stop: Vec::new(),
            raw: o.raw,
            top_p: None,
        };
        c.cancelled.store(false, Ordering::SeqCst);
        let mut text = String::new();
        let s = c.with(|cl| {
            *c.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = cl.try_clone_stream().ok();
            let r = cl.call(&call, &mut |piece| {
                if c.cancelled.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(cb) = on_token {
                    let z = CString::new(piece.replace('\0', " ")).unwrap_or_default();
                    // SAFETY: the caller's contract on `on_token` and `user`; `z` outlives it.
                    if unsafe { cb(z.as_ptr(), piece.len(), user) } != 0 {
                        c.cancelled.store(true, Ordering::SeqCst);
                        // The protocol cancels a call whose client hangs up.
                        if let Some(s) = c.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref() {
                            let _ = s.shutdown(std::net::Shutdown::Both);
                        }
                    }
                }
            });
            *c.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
            r.map(|(t, _)| text = t)
        });
        if c.cancelled.swap(false, Ordering::SeqCst) {
            // The connection was shut down to stop the call: the next request reconnects.
            *c.conn.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
            return fail(LlmsStatus::LlmsErrCancelled, "the call was cancelled");
        }
        if s == LlmsStatus::LlmsOk && !text_out.is_null() {
            // SAFETY: `text_out` is writable (the caller's contract).
            unsafe { *text_out = CString::new(text.replace('\0', " ")).unwrap_or_default().into_raw() };
        }
        s
    })
}

/// Cancels the call running on `client`, from any thread (a no-op when none runs). The call
/// returns `LLMS_ERR_CANCELLED`.
///
/// # Safety
/// `client` a live handle.
#[no_mangle]
pub unsafe extern "C" fn llms_cancel(client: *const LlmsClient) -> LlmsStatus {
    guard(|| {
        // SAFETY: the caller's contract.
        let Some(c) = (unsafe { client.as_ref() }) else { return fail(LlmsStatus::LlmsErrInvalidArgument, "client is NULL") };
        if let Some(s) = c.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref() {
            c.cancelled.store(true, Ordering::SeqCst);
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        LlmsStatus::LlmsOk
    })
}

/// This app's contexts as JSON (`[{"ctx":..,"tokens":..,...}]`, docs/llmsd.md); free
/// `*json_out` with [`llms_free_string`].
///
/// # Safety
/// `client` a live handle; `json_out` writable.
#[no_mangle]
pub unsafe extern "C" fn llms_list_json(client: *const LlmsClient, json_out: *mut *mut c_char) -> LlmsStatus {
    guard(|| {
        // SAFETY: the caller's contract.
        let Some(c) = (unsafe { client.as_ref() }) else { return fail(LlmsStatus::LlmsErrInvalidArgument, "client is NULL") };
        if json_out.is_null() {
            return fail(LlmsStatus::LlmsErrInvalidArgument, "json_out is NULL");
        }
        let mut json = String::new();
        let s = c.with(|cl| cl.list().map(|v| json = serde_json::to_string(&v).unwrap_or_default()));
        if s == LlmsStatus::LlmsOk {
            // SAFETY: `json_out` is writable (checked non-NULL; the caller's contract).
            unsafe { *json_out = CString::new(json).unwrap_or_default().into_raw() };
        }
        s
    })
}

/// Frees a string this library handed out (NULL is ignored).
///
/// # Safety
/// `s` is NULL or a string from this library, not freed before.
#[no_mangle]
pub unsafe extern "C" fn llms_free_string(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: the caller's contract: a string from `CString::into_raw`.
        drop(unsafe { CString::from_raw(s) });
    }
}

/// What the last failing function on this thread said (empty if none failed yet). Valid until
/// the next failing function on this thread.
#[no_mangle]
pub extern "C" fn llms_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// A fixed description of a status code (an `LlmsStatus`; unknown codes are said to be).
#[no_mangle]
pub extern "C" fn llms_status_name(status: c_int) -> *const c_char {
    use LlmsStatus::*;
    // An int, not the enum: a C caller may pass any value, and an enum value out of range
    // would be undefined behaviour on this side.
    let all = [
        LlmsOk,
        LlmsErrInvalidArgument,
        LlmsErrConnect,
        LlmsErrIo,
        LlmsErrProtocol,
        LlmsErrCancelled,
        LlmsErrInternal,
        LlmsErrBadRequest,
        LlmsErrTooLarge,
        LlmsErrNotBound,
        LlmsErrVersion,
        LlmsErrNotFound,
        LlmsErrTooMany,
        LlmsErrBusy,
        LlmsErrFailed,
        LlmsErrShuttingDown,
        LlmsErrTooLong,
    ];
    let s: &'static CStr = match all.into_iter().find(|&x| x as c_int == status) {
        Some(LlmsOk) => c"ok",
        Some(LlmsErrInvalidArgument) => c"invalid argument",
        Some(LlmsErrConnect) => c"cannot connect to llmsd",
        Some(LlmsErrIo) => c"connection broken",
        Some(LlmsErrProtocol) => c"unexpected answer from llmsd",
        Some(LlmsErrCancelled) => c"cancelled",
        Some(LlmsErrInternal) => c"internal error",
        Some(LlmsErrBadRequest) => c"bad request",
        Some(LlmsErrTooLarge) => c"request too large",
        Some(LlmsErrNotBound) => c"not bound",
        Some(LlmsErrVersion) => c"protocol version not spoken",
        Some(LlmsErrNotFound) => c"no such context for this app",
        Some(LlmsErrTooMany) => c"a limit was reached",
        Some(LlmsErrBusy) => c"the context is in a call",
        Some(LlmsErrFailed) => c"the call failed",
        Some(LlmsErrShuttingDown) => c"llmsd is stopping",
        Some(LlmsErrTooLong) => c"the conversation does not fit in a context",
        None => c"unknown status",
    };
    s.as_ptr()
}

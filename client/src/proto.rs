//! The llmsd wire protocol, version 1 (docs/llmsd.md, "Protocol"): frames of a 4-byte big-endian
//! length and a JSON object, over a Unix stream socket. A client sends one request at a time;
//! the service answers with events, the last of which is `done` or `error` (a `call` streams
//! `token` events before its `done`).
//!
//! Frames are hostile input: the length is checked against a limit before anything is
//! allocated, and a malformed body is an error frame, never a panic.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

/// The protocol version this build speaks; `bind` names the version a client wants.
pub const VERSION: u32 = 1;

/// Largest frame either side accepts (a prompt of about a megabyte).
pub const MAX_FRAME: usize = 1 << 20;

/// A request, tagged by `op`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Names the app; must be the first request of a connection.
    Bind {
        app: String,
        version: u32,
    },
    /// Creates a context; `system_prompt` starts it (chat form).
    NewCtx {
        #[serde(default)]
        system_prompt: Option<String>,
    },
    /// Appends `prompt` to the context and generates up to `max_tokens`.
    Call(Call),
    DelCtx {
        ctx: String,
    },
    /// Creates a context holding `ctx`'s tokens, to go on from there apart from it: its whole
    /// chunks are shared with `ctx` (no K/V copied), answered with `created`.
    Fork {
        ctx: String,
    },
    /// The caller's contexts.
    List {},
    /// Service-wide statistics (the caller's contexts only, in detail).
    Stats {},
}

/// The arguments of a `call`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Call {
    pub ctx: String,
    pub prompt: String,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// 0 is greedy.
    #[serde(default)]
    pub temperature: f32,
    #[serde(default)]
    pub seed: u64,
    /// Generation stops when the output contains any of these (the output is cut before it).
    #[serde(default)]
    pub stop: Vec<String>,
    /// Append `prompt` as it is instead of as a chat turn.
    #[serde(default)]
    pub raw: bool,
    /// Nucleus sampling's cut (0, 1]; unset: the engine's default (0.95).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
}

fn default_max_tokens() -> u32 {
    128
}

/// Why a request failed, as a stable code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Malformed frame or request.
    BadRequest,
    /// A frame over [`MAX_FRAME`].
    TooLarge,
    /// A request before `bind`, or a second `bind`.
    NotBound,
    /// A protocol version this service does not speak.
    Version,
    /// No such context for this app.
    NotFound,
    /// The app holds its maximum of contexts, or the service its maximum.
    TooMany,
    /// The context is in a call.
    Busy,
    /// The call could not be run (the message says why).
    Failed,
    /// The service is stopping.
    ShuttingDown,
    /// The call's tokens do not fit in a context (`max_context_tokens`).
    TooLong,
}

/// Per-call measurements, reported with `done`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CallStats {
    /// Time waiting for the model (other calls ahead), ms.
    pub queue_ms: f64,
    /// Call taken from the queue → context ready (its KV loaded and pinned), ms.
    pub switch_ms: f64,
    /// Chunks that were not resident, and how they came back.
    pub missing_chunks: u32,
    pub read_chunks: u32,
    pub recomputed_chunks: u32,
    /// KV bytes read from flash to bring the context back.
    #[serde(default)]
    pub read_bytes: u64,
    pub prefill_ms: f64,
    /// Call received → first token, ms.
    pub ttft_ms: f64,
    pub decode_ms: f64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// Tokens the context holds after the call.
    pub context_tokens: u32,
    /// Positions dropped by the sliding window before this call.
    pub slid_tokens: u32,
    /// Of `prompt_tokens`, those whose K/V came from chunks the app already held (a shared
    /// prefix): not computed (docs/llmsd.md, "Shared prefixes").
    #[serde(default)]
    pub cached_tokens: u32,
    /// `stop`, `length` (max_tokens), `eog` (end of generation) or `cancelled`.
    pub finish: String,
    /// Of `queue_ms`, the time this call waited for memory: the calls running beside it
    /// pinned so much of the budget that its chunks did not fit (docs/llmsd.md, "Batching").
    #[serde(default)]
    pub memory_wait_ms: f64,
    /// The most calls that shared a forward pass with this one, itself included (1: it ran
    /// alone).
    #[serde(default)]
    pub batch_max: u32,
    /// Of `prompt_tokens`, those prefilled on the prefill lane: on their own share of the
    /// threads beside other calls' decoding (`prefill_lane`, docs/llmsd.md, "Batching").
    #[serde(default)]
    pub lane_tokens: u32,
    /// What the caller must know about its context before trusting this answer (it was
    /// restored from its previous copy: the last call it acknowledged is not in it).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub notice: String,
}

/// One context as `list` and `stats` show it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CtxInfo {
    pub ctx: String,
    pub tokens: u32,
    pub chunks: u32,
    pub resident_bytes: u64,
    pub flash_bytes: u64,
    /// What its chunks would take, at their levels, if every chunk kept every layer: above
    /// resident + flash copies when a sliding-window model's old chunks dropped their local
    /// layers (docs/kv.md "Sliding windows").
    #[serde(default)]
    pub every_layer_bytes: u64,
    /// Chunks per format name (e.g. {"int8": 3, "q4": 10}).
    pub levels: std::collections::BTreeMap<String, u32>,
    pub calls: u64,
    pub busy: bool,
    /// Why the context cannot be used (damaged and quarantined, or longer than this
    /// service's `max_context_tokens`); empty when it can. It can still be deleted.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub unavailable: String,
    /// What the owner must know about the context: it was restored from its previous copy
    /// (its last acknowledged call is lost). Shown until the next call succeeds.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub notice: String,
}

/// Service-wide state, as `stats` shows it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServiceStats {
    pub policy: String,
    pub budget_bytes: u64,
    pub configured_budget_bytes: u64,
    pub resident_bytes: u64,
    pub contexts: u32,
    pub queue: u32,
    pub calls: u64,
    /// Switch latency percentiles over recent calls, ms.
    pub switch_p50_ms: f64,
    pub switch_p90_ms: f64,
    pub switch_p99_ms: f64,
    /// Chunks the AoT writer has yet to write.
    pub aot_pending: u64,
    /// Chunk lowerings the leveller has yet to finish (each is then written: `aot_pending`).
    #[serde(default)]
    pub level_pending: u64,
    pub evicted_chunks: u64,
    pub written_aot: u64,
    pub written_sync: u64,
    /// Chunks evicted without a record because their write failed (a full disk): each is
    /// recomputed from its context's tokens at its next load.
    #[serde(default)]
    pub dropped_unsaved: u64,
    pub faults: u64,
    pub pressure: String,
    /// The caller's contexts.
    pub mine: Vec<CtxInfo>,
    /// Paged weights (0 when the weights are resident, outside the budget): their share of
    /// the budget, what is resident, and bytes read from flash so far.
    #[serde(default)]
    pub weights_budget_bytes: u64,
    #[serde(default)]
    pub weights_resident_bytes: u64,
    #[serde(default)]
    pub weights_read_bytes: u64,
    /// The weight plan in force (it follows budget changes), empty without one.
    #[serde(default)]
    pub weights_plan: String,
    /// Chunk write batches to the swap store that failed (a full disk, say), and the last
    /// error: those chunks stay in memory until written, or are recomputed after a restart.
    #[serde(default)]
    pub write_failures: u64,
    #[serde(default)]
    pub last_write_error: String,
    /// Times the first call in line waited because the running calls left its chunks no room
    /// in the budget.
    #[serde(default)]
    pub memory_waits: u64,
    /// Calls the prefill lane started itself, beside the decoding calls' pass in flight
    /// (docs/llmsd.md, "Batching"), rather than at the pass's end.
    #[serde(default)]
    pub lane_starts: u64,
    /// Connections the caller's uid holds open now (this one included), on both sockets.
    #[serde(default)]
    pub connections: u32,
    /// Shared prefixes among the caller's app's contexts (docs/llmsd.md, "Shared prefixes").
    #[serde(default)]
    pub sharing: SharingInfo,
}

/// What sharing chunks holds and did among one app's contexts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharingInfo {
    /// Chunks held once for several contexts, and the references contexts hold to them.
    pub unique_chunks: u64,
    pub logical_chunks: u64,
    /// Bytes of memory those chunks would take again, per extra holder (resident ones).
    pub bytes_saved: u64,
    /// Prompt tokens contexts took from held chunks instead of computing (forks included).
    pub reused_tokens: u64,
    pub forks: u64,
    /// Shared chunks copied into a context's own memory because it wrote into them.
    pub copied_on_write: u64,
}

/// A frame from the service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Bound {
        protocol: u32,
        uid: u32,
        app: String,
    },
    Created {
        ctx: String,
    },
    /// A piece of the output (whole UTF-8 characters), streamed during a call.
    Token {
        text: String,
    },
    /// The call finished; `text` is its whole output.
    Done {
        text: String,
        stats: CallStats,
    },
    Deleted {
        ctx: String,
    },
    List {
        contexts: Vec<CtxInfo>,
    },
    Stats {
        stats: Box<ServiceStats>,
    },
    Error {
        code: ErrorCode,
        message: String,
    },
}

/// Longest error message sent: a message may quote what the client sent (up to a frame), and an
/// answer that outgrew the frame limit would close the connection instead of explaining.
pub const MAX_ERROR_MESSAGE: usize = 1024;

impl Event {
    /// An error event; a message over [`MAX_ERROR_MESSAGE`] bytes is cut (at a character
    /// boundary) and says how long it was.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        let mut message = message.into();
        if message.len() > MAX_ERROR_MESSAGE {
            let n = message.len();
            let mut cut = MAX_ERROR_MESSAGE - 40;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str(&format!("... ({n} bytes in all)"));
        }
        Self::Error { code, message }
    }
}

/// `s` for an error message: itself if short, else its start and its length (inputs are
/// hostile and may be as long as a frame).
pub fn quote(s: &str) -> String {
    const SHOWN: usize = 64;
    if s.len() <= SHOWN {
        return format!("{s:?}");
    }
    let mut cut = SHOWN;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{:?}... ({} bytes)", &s[..cut], s.len())
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("connection closed")]
    Closed,
    #[error("frame of {0} bytes is over the limit of {MAX_FRAME}")]
    TooLarge(usize),
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Reads one frame's body (the length checked before allocating).
pub fn read_frame(r: &mut impl Read) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let n = u32::from_be_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(FrameError::TooLarge(n));
    }
    let mut body = vec![0u8; n];
    r.read_exact(&mut body)?;
    Ok(body)
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, body: &[u8]) -> Result<(), FrameError> {
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(body.len()));
    }
    let n = u32::try_from(body.len()).map_err(|_| FrameError::TooLarge(body.len()))?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&n.to_be_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)?;
    w.flush()?;
    Ok(())
}

/// Decodes a request body.
pub fn decode_request(body: &[u8]) -> Result<Request, FrameError> {
    serde_json::from_slice(body).map_err(|e| FrameError::Malformed(e.to_string()))
}

/// Decodes an event body.
pub fn decode_event(body: &[u8]) -> Result<Event, FrameError> {
    serde_json::from_slice(body).map_err(|e| FrameError::Malformed(e.to_string()))
}

/// Serializes a message (requests and events are plain data: this cannot fail).
pub fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("protocol types serialize")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_defaults_apply() {
        let r = decode_request(br#"{"op":"call","ctx":"ab","prompt":"hi"}"#).unwrap();
        let Request::Call(c) = &r else { panic!("{r:?}") };
        assert_eq!((c.max_tokens, c.temperature, c.raw), (128, 0.0, false));
        assert_eq!(decode_request(&encode(&r)).unwrap(), r);
        for bad in [&b"{"[..], br#"{"op":"nope"}"#, br#"{"op":"bind","app":"x"}"#, br#"{"op":"list","extra":1}"#, b"\xff\xfe"] {
            assert!(matches!(decode_request(bad), Err(FrameError::Malformed(_))), "{bad:?}");
        }
    }

    #[test]
    fn frames_check_their_length_before_allocating() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b"{}").unwrap();
        assert_eq!(read_frame(&mut &buf[..]).unwrap(), b"{}");
        let huge = (u32::MAX).to_be_bytes();
        assert!(matches!(read_frame(&mut &huge[..]), Err(FrameError::TooLarge(_))));
        assert!(matches!(read_frame(&mut &[0u8, 0][..]), Err(FrameError::Closed)));
        // A truncated body is an I/O error, not a short frame.
        assert!(matches!(read_frame(&mut &[0u8, 0, 0, 9, b'{'][..]), Err(FrameError::Io(_))));
    }
}

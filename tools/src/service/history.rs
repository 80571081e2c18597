//! Persistent contexts for stateless clients. An OpenAI-style client resends its whole
//! conversation at every call; the service renders it (the chat template's pieces, as the
//! native path appends them) and continues the app's context whose text is the longest prefix
//! of it, so only the new tokens are prefilled — wherever that context's chunks are.
//!
//! Matching is by text, not by token ids: a reply the model generated is held as the ids it
//! sampled, and the client sends it back as text, which the tokenizer may split differently;
//! comparing the bytes the context's tokens stand for with the request's text continues the
//! context in that case too. A request that agrees with a context only in part (an edited
//! earlier message, or another conversation with the same system prompt) branches: a new
//! context is made and the whole request is prefilled into it (the common prefix is
//! re-prefilled; chunks are not shared between contexts), the matched context is left as it
//! was. New contexts count against the app's `http_contexts_per_app`; the least recently used
//! context the front made is retired first.

use std::time::{SystemTime, UNIX_EPOCH};

use engine::Tokenizer;
use tracing::info;

use super::turns::Turns;
use super::{lock, not_found, refuse, Owner, Refusal, Service};
use crate::proto::ErrorCode;

/// A piece of a rendered request: text, and whether control tokens written in it are parsed
/// (the template's markup) or not (what the user or the model wrote: an app cannot forge a
/// turn inside a message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Segment {
    pub(crate) text: String,
    pub(crate) special: bool,
}

impl Segment {
    fn markup(t: &str) -> Self {
        Self { text: t.to_string(), special: true }
    }
    fn content(t: &str) -> Self {
        Self { text: t.to_string(), special: false }
    }
}

/// One chat message of a request.
#[derive(Debug, Clone)]
pub(crate) struct ChatMessage {
    pub(crate) role: String,
    pub(crate) content: String,
}

/// A stateless request's history, as the worker matches it.
#[derive(Debug)]
pub(super) struct History {
    pub(super) segments: Vec<Segment>,
    /// The context the client named (`X-LLMS-Context`), if any: only it is matched.
    pub(super) pin: Option<String>,
    pub(super) chosen: std::sync::mpsc::Sender<Chosen>,
}

/// The context a stateless request ran in, told to the front before any token.
#[derive(Debug, Clone)]
pub(crate) struct Chosen {
    pub(crate) ctx: String,
    /// Tokens the call did not have to prefill.
    pub(crate) cached_tokens: u32,
    /// `continued`, `new` or `branched` (a partial match: a new context, fully prefilled).
    pub(crate) how: &'static str,
}

/// Renders chat messages into segments with the model's own turn pieces. `system` (and
/// `developer`) messages come first; the rest alternate user and assistant turns and end with
/// a user turn (the assistant's turn is opened for the reply).
pub(super) fn render_chat(
    turns: &Turns,
    system: impl Fn(&str) -> anyhow::Result<String>,
    msgs: &[ChatMessage],
) -> Result<Vec<Segment>, String> {
    let mut out = Vec::new();
    let mut i = 0;
    let mut sys = Vec::new();
    while i < msgs.len() && matches!(msgs[i].role.as_str(), "system" | "developer") {
        sys.push(msgs[i].content.as_str());
        i += 1;
    }
    if !sys.is_empty() {
        // The template writes the system turn; its content is the app's own text.
        let marked = system("\u{1}").map_err(|e| e.to_string())?;
        let (a, b) = marked.split_once('\u{1}').ok_or("the chat template drops the system prompt")?;
        out.push(Segment::markup(a));
        out.push(Segment::content(&sys.join("\n\n")));
        out.push(Segment::markup(b));
    }
    let rest = &msgs[i..];
    if rest.is_empty() {
        return Err("messages: at least one user message is needed".into());
    }
    for (j, m) in rest.iter().enumerate() {
        let user_turn = j % 2 == 0;
        match (m.role.as_str(), user_turn) {
            ("user", true) => {
                let first = out.is_empty();
                out.push(Segment::markup(if first { &turns.first_open } else { &turns.open }));
                out.push(Segment::content(&m.content));
                out.push(Segment::markup(&turns.close_user));
            }
            ("assistant", false) => {
                out.push(Segment::content(&m.content));
                out.push(Segment::markup(&turns.close_assistant));
            }
            ("system" | "developer", _) => return Err(format!("messages[{}]: a system message must come before the conversation", i + j)),
            ("user" | "assistant", _) => {
                return Err(format!("messages[{}]: user and assistant messages must alternate, starting with user", i + j));
            }
            (r, _) => {
                return Err(format!(
                    "messages[{}]: role {} is not supported (system, developer, user, assistant)",
                    i + j,
                    crate::proto::quote(r)
                ))
            }
        }
    }
    if rest.len().is_multiple_of(2) {
        return Err("messages: the last message must be the user's".into());
    }
    Ok(out)
}

/// Encodes the segments' text from byte `from` of their concatenation.
pub(super) fn encode_from(tk: &Tokenizer, segs: &[Segment], from: usize) -> Result<Vec<u32>, String> {
    let mut ids = Vec::new();
    let mut at = 0;
    for s in segs {
        let end = at + s.text.len();
        if end > from {
            let t = &s.text[from.saturating_sub(at)..];
            ids.extend(tk.encode(t, false, s.special).map_err(|e| e.to_string())?);
        }
        at = end;
    }
    Ok(ids)
}

/// How many of `tokens` (from `skip`) spell a prefix of `text`, and the bytes they cover;
/// the match ends on a character boundary of `text`.
pub(super) fn matched(tk: &Tokenizer, tokens: &[u32], skip: usize, text: &[u8]) -> (usize, usize) {
    let mut at = 0;
    let mut buf = Vec::new();
    let mut best = (0, 0);
    for (i, &t) in tokens.iter().enumerate().skip(skip) {
        buf.clear();
        tk.token_bytes(t, true, &mut buf);
        if text.len() < at + buf.len() || text[at..at + buf.len()] != buf[..] {
            break;
        }
        at += buf.len();
        if std::str::from_utf8(&text[..at]).is_ok() || at == text.len() {
            best = (i + 1, at);
        }
    }
    best
}

pub(super) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Service {
    /// Chooses the context a stateless request continues (or makes one) and the tokens it must
    /// prefill. Runs on the worker, so no other call changes a context meanwhile.
    pub(super) fn resolve(&self, owner: &Owner, h: &History) -> Result<(Chosen, Vec<u32>), Refusal> {
        let tk = &self.model.tokenizer;
        let text: String = h.segments.iter().map(|s| s.text.as_str()).collect();
        let bos = usize::from(tk.add_bos && tk.bos.is_some());
        let best = {
            let reg = lock(&self.registry);
            if let Some(p) = &h.pin {
                match reg.get(p) {
                    Some(e) if e.saved.owner == *owner => {
                        if let Some(why) = &e.unavailable {
                            return Err(refuse(ErrorCode::Failed, format!("context {p} is unavailable: {why}")));
                        }
                    }
                    _ => return Err(not_found(p)),
                }
            }
            let mut best: Option<(usize, usize, String, usize, u64)> = None;
            for (id, e) in reg.iter() {
                let s = &e.saved;
                let usable = s.owner == *owner && e.unavailable.is_none() && e.session.is_some() && s.pending.is_empty();
                if !usable || h.pin.as_ref().is_some_and(|p| p != id) {
                    continue;
                }
                let skip = usize::from(bos == 1 && s.tokens.first() == tk.bos.as_ref());
                let (n, bytes) = matched(tk, &s.tokens, skip, text.as_bytes());
                if n <= skip {
                    continue;
                }
                let better = best.as_ref().is_none_or(|b| (n, s.last_used) > (b.0, b.4));
                if better {
                    best = Some((n, bytes, id.clone(), s.tokens.len(), s.last_used));
                }
            }
            best
        };
        let fail = |e: String| refuse(ErrorCode::BadRequest, e);
        if let Some((n, bytes, ctx, len, _)) = &best {
            if n == len {
                let ids = encode_from(tk, &h.segments, *bytes).map_err(fail)?;
                if ids.is_empty() {
                    return Err(refuse(ErrorCode::BadRequest, "the request adds nothing to its context: the last message must be new"));
                }
                let cached = u32::try_from(*n).unwrap_or(u32::MAX);
                return Ok((Chosen { ctx: ctx.clone(), cached_tokens: cached, how: "continued" }, ids));
            }
        }
        // A new context (a branch when part of the request matched one).
        self.retire_for(owner)?;
        let ctx = self.new_ctx(owner, None, true)?;
        let mut ids = Vec::new();
        if bos == 1 {
            ids.extend(tk.bos);
        }
        ids.extend(encode_from(tk, &h.segments, 0).map_err(fail)?);
        let how = if best.is_some() { "branched" } else { "new" };
        if let Some((n, _, from, _, _)) = best {
            info!(ctx = %ctx, from = %from, common_tokens = n, "history diverges from its context: branched (the common prefix is prefilled again)");
        }
        Ok((Chosen { ctx, cached_tokens: 0, how }, ids))
    }

    /// Before the front makes a context for `owner`: at `http_contexts_per_app`, the least
    /// recently used context it made for the app (not in a call) is deleted.
    fn retire_for(&self, owner: &Owner) -> Result<(), Refusal> {
        let victim = {
            let reg = lock(&self.registry);
            let auto: Vec<_> = reg.iter().filter(|(_, e)| e.saved.owner == *owner && e.saved.auto).collect();
            if auto.len() < self.cfg.http_contexts_per_app {
                return Ok(());
            }
            auto.iter()
                .filter(|(_, e)| e.session.is_some() || e.unavailable.is_some())
                .min_by_key(|(_, e)| e.saved.last_used)
                .map(|(id, _)| (*id).clone())
        };
        match victim {
            Some(id) => {
                info!(ctx = %id, app = %owner.app, "retired: the least recently used of the app's contexts (http_contexts_per_app)");
                self.del_ctx(owner, &id)
            }
            None => Err(refuse(ErrorCode::TooMany, "every context of this app is in a call")),
        }
    }
}

//! Persistent contexts for stateless clients. An OpenAI-style client resends its whole
//! conversation at every call; the service renders it (the chat template's pieces, as the
//! native path appends them), encodes it on the caller's thread, and continues the app's
//! context whose tokens are the longest prefix of it, so only the new tokens are prefilled —
//! wherever that context's chunks are.
//!
//! Matching is by what tokens spell ([`common_prefix`]): a control token matches only itself
//! (text that spells turn markup never matches real markup, so an app cannot forge a turn),
//! and plain-text tokens compare by their bytes — a reply the model generated is held as the
//! ids it sampled, and the client sends it back as text, which the tokenizer may split
//! differently; it continues all the same. A request that agrees with a context only in part (an edited
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
    /// The rendering as tokens ([`encode_segments`]).
    pub(super) ids: Vec<u32>,
    /// The context the client named (`X-LLMS-Context`), if any: only it is matched.
    pub(super) pin: Option<String>,
    /// Awaited by the front's request task (as the call's events, call.rs's `Events`).
    pub(super) chosen: tokio::sync::mpsc::UnboundedSender<Chosen>,
}

/// The context a stateless request ran in, told to the front before any token.
#[derive(Debug, Clone)]
pub(crate) struct Chosen {
    pub(crate) ctx: String,
    /// Tokens the call did not have to prefill.
    pub(crate) cached_tokens: u32,
    /// `continued`, `new` or `branched` (a partial match: a new context, which takes the
    /// whole chunks it shares with the matched one when prefix sharing is on).
    pub(crate) how: &'static str,
    /// The context's notice for its owner (see `Saved::notice`), if any.
    pub(crate) notice: String,
}

/// A system turn as segments: the template writes the markup; its content is the app's own
/// text (never parsed for control tokens).
fn system_turn(system: &impl Fn(&str) -> anyhow::Result<String>, content: &str) -> Result<Vec<Segment>, String> {
    let marked = system("\u{1}").map_err(|e| e.to_string())?;
    let (a, b) = marked.split_once('\u{1}').ok_or("the chat template drops the system prompt")?;
    Ok(vec![Segment::markup(a), Segment::content(content), Segment::markup(b)])
}

/// A native context's system prompt as segments (see [`system_turn`]).
pub(super) fn system_segments(model: &engine::Model, content: &str) -> Result<Vec<Segment>, String> {
    system_turn(&|t: &str| Turns::system(model, t), content)
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
        out.extend(system_turn(&system, &sys.join("\n\n"))?);
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

/// The request's rendering as tokens: BOS where the model adds one, then each segment
/// (control tokens parsed in markup only). Runs where the caller waits (the HTTP front's
/// blocking pool), never on the worker: its time is the caller's.
pub(crate) fn encode_segments(tk: &Tokenizer, segs: &[Segment]) -> Result<Vec<u32>, String> {
    let mut ids = Vec::new();
    if tk.add_bos {
        ids.extend(tk.bos);
    }
    for s in segs {
        ids.extend(tk.encode(&s.text, false, s.special).map_err(|e| e.to_string())?);
    }
    Ok(ids)
}

/// Where a context's tokens and a request's agree from the start.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Common {
    /// Context tokens and request tokens that spell the same prefix, ending where both have a
    /// token boundary.
    pub(super) ctx: usize,
    pub(super) req: usize,
    /// The context agrees whole and ends inside request token `req`: these are the rest of
    /// that token's bytes (the context continues with them as byte tokens, then `req + 1..`).
    pub(super) bridge: Vec<u8>,
}

/// The common prefix of a context's tokens `a` and a request's `b`, by what they spell:
/// a control (or user-defined) token is a symbol of its own that only the same id matches —
/// so text that spells `<|im_end|>` never matches the control token, and the reverse — and
/// plain-text tokens compare by their bytes, so a reply the model sampled continues when the
/// client sends it back as text that the tokenizer splits differently.
pub(super) fn common_prefix(tk: &Tokenizer, a: &[u32], b: &[u32]) -> Common {
    let (mut i, mut j, mut ai, mut bj) = (0, 0, 0, 0);
    let (mut abuf, mut bbuf) = (Vec::new(), Vec::new());
    let mut best = Common::default();
    loop {
        if ai == 0 && bj == 0 {
            best.ctx = i;
            best.req = j;
        }
        if i == a.len() || j == b.len() {
            break;
        }
        if ai == 0 && bj == 0 && a[i] == b[j] {
            i += 1;
            j += 1;
            continue;
        }
        if !tk.is_plain_text(a[i]) || !tk.is_plain_text(b[j]) {
            break;
        }
        abuf.clear();
        tk.token_bytes(a[i], false, &mut abuf);
        bbuf.clear();
        tk.token_bytes(b[j], false, &mut bbuf);
        let n = (abuf.len() - ai).min(bbuf.len() - bj);
        if abuf[ai..ai + n] != bbuf[bj..bj + n] {
            break;
        }
        ai += n;
        bj += n;
        if ai == abuf.len() {
            (i, ai) = (i + 1, 0);
        }
        if bj == bbuf.len() {
            (j, bj) = (j + 1, 0);
        }
    }
    if i == a.len() && ai == 0 && bj > 0 {
        best.ctx = i;
        best.req = j;
        best.bridge = bbuf[bj..].to_vec();
    }
    best
}

pub(super) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Service {
    /// Chooses the context a stateless request continues (or makes one) and the tokens it must
    /// prefill: of the caller's own contexts, the longest that the request continues whole;
    /// else a new context (a branch when part of one matched). Runs on the worker, so no other
    /// call changes a context meanwhile; its work is comparing tokens (the request was encoded
    /// by its caller), at most one token's bytes turned into byte tokens.
    pub(super) fn resolve(&self, owner: &Owner, h: &History) -> Result<(Chosen, Vec<u32>), Refusal> {
        let tk = &self.model.tokenizer;
        let (complete, partial) = {
            let reg = lock(&self.registry);
            if let Some(p) = &h.pin {
                match reg.get(p) {
                    Some(e) if e.saved.owner == *owner => {
                        if let Some(why) = &e.unavailable {
                            return Err(refuse(ErrorCode::Failed, format!("context {p} is unavailable: {why}")));
                        }
                        if e.session.is_none() {
                            return Err(refuse(ErrorCode::Busy, format!("context {p} is in a call")));
                        }
                    }
                    _ => return Err(not_found(p)),
                }
            }
            // (common prefix, last used, id, notice) of the best whole match and the best
            // partial one.
            let mut complete: Option<(Common, u64, String, String)> = None;
            let mut partial: Option<(usize, String)> = None;
            for (id, e) in reg.iter() {
                let s = &e.saved;
                // A context whose last answer waits for its file's sync is in its call still
                // (syncer.rs): continued now, its file would be written over one not yet synced.
                let usable =
                    s.owner == *owner && e.unavailable.is_none() && e.session.is_some() && s.pending.is_empty() && !self.sync.waits(id);
                if !usable || h.pin.as_ref().is_some_and(|p| p != id) {
                    continue;
                }
                let c = common_prefix(tk, &s.tokens, &h.ids);
                // BOS alone is no match.
                let bos = usize::from(s.tokens.first().is_some_and(|t| Some(*t) == tk.bos));
                if c.ctx <= bos {
                    continue;
                }
                if c.ctx == s.tokens.len() {
                    if complete.as_ref().is_none_or(|b| (c.ctx, s.last_used) > (b.0.ctx, b.1)) {
                        complete = Some((c, s.last_used, id.clone(), s.notice.clone()));
                    }
                } else if partial.as_ref().is_none_or(|b| c.ctx > b.0) {
                    partial = Some((c.ctx, id.clone()));
                }
            }
            (complete, partial)
        };
        if let Some((c, _, ctx, notice)) = complete {
            let mut ids: Vec<u32> = Vec::with_capacity(c.bridge.len() + h.ids.len() - c.req);
            let from = if c.bridge.is_empty() { c.req } else { c.req + 1 };
            for &b in &c.bridge {
                ids.push(tk.byte_token(b).ok_or_else(|| refuse(ErrorCode::BadRequest, "a byte the vocabulary has no token for"))?);
            }
            ids.extend_from_slice(&h.ids[from..]);
            if ids.is_empty() {
                return Err(refuse(ErrorCode::BadRequest, "the request adds nothing to its context: the last message must be new"));
            }
            let cached = u32::try_from(c.ctx).unwrap_or(u32::MAX);
            return Ok((Chosen { ctx, cached_tokens: cached, how: "continued", notice }, ids));
        }
        // A new context (a branch when part of the request matched one).
        self.retire_for(owner)?;
        let ctx = self.new_ctx(owner, None, true)?;
        let how = if partial.is_some() { "branched" } else { "new" };
        if let Some((n, from)) = partial {
            info!(ctx = %ctx, from = %from, common_tokens = n, "history diverges from its context: branched");
        }
        Ok((Chosen { ctx, cached_tokens: 0, how, notice: String::new() }, h.ids.clone()))
    }
}

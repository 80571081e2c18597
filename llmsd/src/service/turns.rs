//! Chat turns as the model's own template writes them, cut into the pieces a persistent
//! context appends call by call (the whole conversation is never re-rendered).

use anyhow::{anyhow, bail, Context as _, Result};
use engine::chat::Message;
use engine::Model;

/// How a chat turn is written, from the model's own template (see [`Turns::new`]).
#[derive(Debug, Clone)]
pub(super) struct Turns {
    /// Before the first user message of a context without a system prompt (the template may
    /// add its default system prompt here).
    pub(super) first_open: String,
    /// Before a user message.
    pub(super) open: String,
    /// After a user message: opens the assistant's turn.
    pub(super) close_user: String,
    /// After an assistant message.
    pub(super) close_assistant: String,
    /// The four above as tokens (special tokens parsed), encoded once: a call's turn is
    /// assembled from them without the tokenizer.
    pub(super) ids: TurnIds,
}

#[derive(Debug, Clone)]
pub(super) struct TurnIds {
    pub(super) first_open: Vec<u32>,
    pub(super) open: Vec<u32>,
    pub(super) close_user: Vec<u32>,
    pub(super) close_assistant: Vec<u32>,
}

impl Turns {
    /// Renders probe conversations with the template and cuts the turn markup out of them:
    /// appending turn by turn must give the same text as rendering the whole conversation.
    pub(super) fn new(model: &Model) -> Result<Self> {
        const MARK: &str = "\u{1}LLMS\u{1}";
        let r = |m: &[Message], g: bool| model.render_chat(m, g).map_err(|e| anyhow!("chat template: {e}"));
        let sys = Message::new("system", "S");
        let split = |s: &str| -> Result<(String, String)> {
            let (a, b) = s.split_once(MARK).context("chat template drops message content")?;
            Ok((a.to_string(), b.to_string()))
        };
        let (first_open, close_user) = split(&r(&[Message::new("user", MARK)], true)?)?;
        let head = r(std::slice::from_ref(&sys), false)?;
        let full = r(&[sys.clone(), Message::new("user", MARK)], true)?;
        let rest = full.strip_prefix(&head).context("chat template is not incremental (a turn changes earlier text)")?;
        let (open, close_user2) = split(rest)?;
        let u = Message::new("user", "u");
        let before = r(&[sys.clone(), u.clone()], true)?;
        let after = r(&[sys, u, Message::new("assistant", MARK)], false)?;
        let rest = after.strip_prefix(&before).context("chat template is not incremental (the assistant turn)")?;
        let (lead, close_assistant) = split(rest)?;
        if !lead.is_empty() || close_user2 != close_user {
            bail!("chat template writes turns in a way llmsd cannot continue");
        }
        let enc = |t: &str| model.tokenizer.encode(t, false, true).map_err(|e| anyhow!("chat template markup {t:?}: {e}"));
        let ids = TurnIds {
            first_open: enc(&first_open)?,
            open: enc(&open)?,
            close_user: enc(&close_user)?,
            close_assistant: enc(&close_assistant)?,
        };
        Ok(Self { first_open, open, close_user, close_assistant, ids })
    }

    pub(super) fn system(model: &Model, text: &str) -> Result<String> {
        model.render_chat(&[Message::new("system", text)], false).map_err(|e| anyhow!("chat template: {e}"))
    }
}

//! A context's file on disk (`contexts/<id>.json`): its JSON, then a trailer line with the
//! JSON's CRC32C (the swap store's checksum), so an edited or damaged file is detected rather
//! than continued. Written atomically (a temporary file, fsync, rename, fsync of the directory)
//! beside a previous good copy (`<id>.json.prev`, a hard link to the file it replaces): a
//! damaged file falls back to it, loudly, and a file that cannot be read either way is left
//! where it is for `llms doctor --state-dir` to report.
//!
//! Files of an older build (version 1, no trailer) are read as they are and get a trailer at
//! the context's next save.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use serde::{Deserialize, Serialize};

use super::Owner;

/// The format this build writes.
pub(super) const VERSION: u32 = 2;
const TRAILER: &str = "\n#crc32c ";
/// A context file is small (its tokens and a little text); a larger one is not ours.
const MAX_FILE: u64 = 64 << 20;

/// What a context keeps on disk besides its KV records: enough to continue it after a restart.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Saved {
    pub(super) version: u32,
    pub(super) ctx: String,
    pub(super) mm_id: u64,
    pub(super) owner: Owner,
    pub(super) tokens: Vec<u32>,
    /// Text not yet run (a system prompt waits for the first call).
    pub(super) pending: String,
    /// `pending` as tokens, encoded when the context was made (on its caller's thread): the
    /// template's markup with control tokens parsed, the app's text without — a system
    /// prompt cannot forge a turn. Empty in files of older builds (then `pending` is encoded).
    #[serde(default)]
    pub(super) pending_ids: Vec<u32>,
    /// The last call was a chat turn whose end-of-turn text is not in the cache yet.
    pub(super) open_turn: bool,
    /// Tokens at the start kept when the context slides.
    pub(super) keep: usize,
    pub(super) calls: u64,
    pub(super) attention_sum: Vec<f64>,
    pub(super) attention_count: Vec<u64>,
    /// Made by the HTTP front for a stateless client (retired least recently used first).
    #[serde(default)]
    pub(super) auto: bool,
    /// When the context's last call ended, ms since the epoch.
    #[serde(default)]
    pub(super) last_used: u64,
    /// Told to the owner in `list` and in its next answer, then cleared: the context was
    /// restored from its previous copy at a start (its last acknowledged call is lost).
    #[serde(default)]
    pub(super) notice: String,
}

/// A new unguessable context id: 128 bits from the kernel's random source.
pub(super) fn new_ctx_id() -> Result<(String, u64)> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).context("reading /dev/urandom")?;
    let id: String = b.iter().map(|x| format!("{x:02x}")).collect();
    let mm_id = u64::from_le_bytes(b[..8].try_into().expect("8 bytes")) | 1;
    Ok((id, mm_id))
}

pub(super) fn valid_ctx_id(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

fn path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.json"))
}

fn prev_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.json.prev"))
}

/// The bytes of `saved` as this build writes them.
fn encode(saved: &Saved) -> Result<Vec<u8>> {
    let mut b = serde_json::to_vec(saved)?;
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(format!("{TRAILER}{crc:08x}\n").as_bytes());
    Ok(b)
}

/// A context file's content, checked; the error says what is wrong with it.
fn decode(bytes: &[u8]) -> Result<Saved, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8".to_string())?;
    let saved: Saved = match text.rfind(TRAILER) {
        Some(at) => {
            let want = text[at + TRAILER.len()..].trim();
            let want = u32::from_str_radix(want, 16).map_err(|_| format!("checksum trailer {want:?} is not a CRC32C"))?;
            let body = &bytes[..at];
            let got = crc32c::crc32c(body);
            if got != want {
                return Err(format!("checksum mismatch (stored {want:08x}, content {got:08x}): the file was damaged or edited"));
            }
            let s: Saved = serde_json::from_slice(body).map_err(|e| format!("not a context: {e}"))?;
            if s.version != VERSION {
                return Err(format!("version {} with a checksum trailer (this build writes {VERSION})", s.version));
            }
            s
        }
        None => {
            let s: Saved = serde_json::from_slice(bytes).map_err(|e| format!("not a context: {e}"))?;
            if s.version != 1 {
                return Err(format!("version {} without a checksum (only version 1 files have none)", s.version));
            }
            s
        }
    };
    Ok(saved)
}

/// A context file's bytes checked as a start reads them (the fuzz target `context_file`): the
/// context's id, or why the file would not be continued. A file that decodes writes back to the
/// same bytes.
pub fn check_context_file(bytes: &[u8]) -> Result<String, String> {
    let saved = decode(bytes)?;
    if saved.version == VERSION {
        let again = encode(&saved).map_err(|e| e.to_string())?;
        let back = decode(&again)?;
        assert_eq!(encode(&back).map_err(|e| e.to_string())?, again, "a context file does not survive a rewrite");
    }
    Ok(saved.ctx)
}

fn read_one(p: &Path, id: &str) -> Result<Saved, String> {
    let meta = std::fs::metadata(p).map_err(|e| e.to_string())?;
    if meta.len() > MAX_FILE {
        return Err(format!("{} bytes, more than a context file holds", meta.len()));
    }
    let s = decode(&std::fs::read(p).map_err(|e| e.to_string())?)?;
    if s.ctx != id {
        return Err(format!("names context {:?}, not its own", s.ctx));
    }
    Ok(s)
}

/// What reading a context's file found.
#[derive(Debug)]
pub(super) enum Found {
    /// The file, checked.
    Current(Saved),
    /// The file is damaged (why); its previous good copy is used — one save behind, so the
    /// context's last call is lost.
    Previous(Saved, String),
    /// Neither the file nor a previous copy could be read (why).
    Damaged(String),
}

/// Reads context `id`'s file in `dir`, falling back to its previous copy.
pub(super) fn read(dir: &Path, id: &str) -> Found {
    match read_one(&path(dir, id), id) {
        Ok(s) => Found::Current(s),
        Err(why) => match read_one(&prev_path(dir, id), id) {
            Ok(s) => Found::Previous(s, why),
            Err(prev) => Found::Damaged(format!("{why}; previous copy: {prev}")),
        },
    }
}

/// Writes `saved` atomically, keeping the file it replaces as the previous good copy, and
/// makes it durable (file and directory synced) before it returns.
pub(super) fn write(dir: &Path, saved: &Saved) -> Result<()> {
    write_as(dir, saved, true)
}

/// Makes the context files `ids` durable, as [`write`] would have (each file, then the
/// directory once for them all): for files written by [`write_as`] without the syncs. A file
/// that is gone (its context deleted since) needs nothing.
pub(super) fn sync(dir: &Path, ids: &[&str]) -> Result<()> {
    for id in ids {
        match std::fs::File::open(path(dir, id)) {
            Ok(f) => f.sync_all().with_context(|| format!("syncing context {id}'s file"))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("opening context {id}'s file to sync it")),
        }
    }
    std::fs::File::open(dir)?.sync_all().context("syncing the contexts directory")?;
    Ok(())
}

/// [`write`] without the syncs (`durable` false): as safe against a crash of the process (the
/// file is whole in the page cache once renamed), not against a power loss, after which the
/// file may be missing. For a context nothing was acknowledged in yet.
pub(super) fn write_as(dir: &Path, saved: &Saved, durable: bool) -> Result<()> {
    let (p, prev) = (path(dir, &saved.ctx), prev_path(dir, &saved.ctx));
    let tmp = dir.join(format!("{}.json.tmp", saved.ctx));
    // Conversations are private to the service: 0600 whatever the umask.
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    f.write_all(&encode(saved)?)?;
    if durable {
        f.sync_all()?;
    }
    if p.exists() {
        // The current file becomes the previous copy (a second name for the same inode, made
        // under a temporary name and renamed: `prev` is always a whole file).
        let prev_tmp = dir.join(format!("{}.json.prev.tmp", saved.ctx));
        let _ = std::fs::remove_file(&prev_tmp);
        if std::fs::hard_link(&p, &prev_tmp).is_err() {
            // A file system without hard links: a copy serves as well (the file is small).
            std::fs::copy(&p, &prev_tmp)?;
        }
        std::fs::rename(&prev_tmp, &prev)?;
    }
    std::fs::rename(&tmp, &p)?;
    if durable {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Removes context `id`'s files.
pub(super) fn remove(dir: &Path, id: &str) {
    let _ = std::fs::remove_file(path(dir, id));
    let _ = std::fs::remove_file(prev_path(dir, id));
}

/// One context file as `llms doctor --state-dir` reports it.
#[derive(Debug, Clone, Serialize)]
pub struct ContextCheck {
    pub ctx: String,
    /// `ok`, `previous copy` (the file is damaged, its previous copy is good), or `damaged`.
    pub status: String,
    pub detail: String,
    pub tokens: usize,
    pub app: String,
    pub uid: Option<u32>,
}

/// Checks every context file of the state directory `state_dir` (no model needed: checksums,
/// structure and ids; a context's tokens are checked against the vocabulary when llmsd starts).
pub fn check_state_dir(state_dir: &Path) -> Result<Vec<ContextCheck>> {
    let dir = state_dir.join("contexts");
    let mut out = Vec::new();
    if !dir.is_dir() {
        return Ok(out);
    }
    let mut ids: Vec<String> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(".json").or_else(|| n.strip_suffix(".json.prev")).map(str::to_string))
        .filter(|id| valid_ctx_id(id))
        .collect();
    ids.sort();
    ids.dedup();
    for id in ids {
        let c = |status: &str, detail: String, s: Option<&Saved>| ContextCheck {
            ctx: id.clone(),
            status: status.into(),
            detail,
            tokens: s.map_or(0, |s| s.tokens.len()),
            app: s.map_or(String::new(), |s| s.owner.app.clone()),
            uid: s.map(|s| s.owner.uid),
        };
        out.push(match read(&dir, &id) {
            Found::Current(s) => c("ok", String::new(), Some(&s)),
            Found::Previous(s, why) => c("previous copy", format!("{why}: its previous copy is used (its last call is lost)"), Some(&s)),
            Found::Damaged(why) => c("damaged", format!("{why}: left as it is, its store data kept"), None),
        });
    }
    Ok(out)
}

/// The shared chunks of a state directory's store (one line per model's store).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SharedCheck {
    pub store: String,
    /// Chunks the pool's log names, and of them those a saved context reaches (its owner's
    /// scope, its tokens from position 0): the others are unreachable, and the next start
    /// frees them and their records.
    pub named: usize,
    pub reached: usize,
}

/// Checks the shared chunks of `state_dir` against its saved contexts (no model needed: the
/// pool's log names each chunk by scope, parent and tokens; a context file by owner and tokens).
pub fn check_shared(state_dir: &Path) -> Result<Vec<SharedCheck>> {
    let mut saved = Vec::new();
    for c in check_state_dir(state_dir)? {
        if let Found::Current(s) | Found::Previous(s, _) = read(&state_dir.join("contexts"), &c.ctx) {
            saved.push((s.owner.scope(), s.tokens));
        }
    }
    let mut out = Vec::new();
    for e in std::fs::read_dir(state_dir.join("store")).into_iter().flatten().flatten() {
        let dir = e.path();
        if !dir.join("pool.log").exists() {
            continue;
        }
        let names = mm::shared_names(&dir);
        let ct = names.first().map_or(1, |n| n.tokens.len().max(1));
        let mut reached = std::collections::HashSet::new();
        for (scope, tokens) in &saved {
            let mut prev = None;
            for chunk in tokens.chunks_exact(ct) {
                let Some(n) = names.iter().find(|n| n.scope == *scope && n.parent == prev && n.tokens == chunk) else { break };
                reached.insert(n.chunk);
                prev = Some(n.chunk);
            }
        }
        out.push(SharedCheck { store: dir.display().to_string(), named: names.len(), reached: reached.len() });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::Owner;

    fn saved(id: &str) -> Saved {
        Saved {
            version: VERSION,
            ctx: id.into(),
            mm_id: 7,
            owner: Owner { uid: 1000, app: "a".into() },
            tokens: vec![1, 2, 3],
            pending: String::new(),
            pending_ids: Vec::new(),
            open_turn: false,
            keep: 0,
            calls: 1,
            attention_sum: Vec::new(),
            attention_count: Vec::new(),
            auto: false,
            last_used: 0,
            notice: String::new(),
        }
    }

    #[test]
    fn a_file_written_without_syncs_is_whole_and_the_next_save_keeps_it_as_previous() {
        let state = tempfile::tempdir().unwrap();
        let dir = state.path().join("contexts");
        std::fs::create_dir(&dir).unwrap();
        let id = "fedcba9876543210fedcba9876543210";
        let mut s = saved(id);
        write_as(dir.as_path(), &s, false).unwrap();
        assert!(matches!(read(dir.as_path(), id), Found::Current(x) if x.tokens == [1, 2, 3]));
        assert!(!dir.join(format!("{id}.json.tmp")).exists(), "the temporary file was renamed");
        s.tokens.push(4);
        write(dir.as_path(), &s).unwrap();
        std::fs::write(path(dir.as_path(), id), b"torn").unwrap();
        assert!(matches!(read(dir.as_path(), id), Found::Previous(x, _) if x.tokens == [1, 2, 3]));
    }

    #[test]
    fn damage_is_detected_and_the_previous_copy_used() {
        let state = tempfile::tempdir().unwrap();
        let dir = state.path().join("contexts");
        std::fs::create_dir(&dir).unwrap();
        let id = "0123456789abcdef0123456789abcdef";
        let mut s = saved(id);
        write(dir.as_path(), &s).unwrap();
        assert!(matches!(read(dir.as_path(), id), Found::Current(x) if x.tokens == [1, 2, 3]));
        s.tokens.push(4);
        write(dir.as_path(), &s).unwrap();
        // An edited token id: the checksum catches it; the previous copy is one save behind.
        let p = path(dir.as_path(), id);
        let text = std::fs::read_to_string(&p).unwrap().replace("[1,2,3,4]", "[1,2,9,4]");
        std::fs::write(&p, text).unwrap();
        match read(dir.as_path(), id) {
            Found::Previous(x, why) => assert!(x.tokens == [1, 2, 3] && why.contains("checksum"), "{why}"),
            f => panic!("{f:?}"),
        }
        // A flipped bit in both: damaged, never read as something else.
        for f in [&p, &prev_path(dir.as_path(), id)] {
            let mut b = std::fs::read(f).unwrap();
            b[10] ^= 1;
            std::fs::write(f, b).unwrap();
        }
        assert!(matches!(read(dir.as_path(), id), Found::Damaged(_)));
        // The doctor's view of the same state directory.
        let checks = check_state_dir(state.path()).unwrap();
        assert_eq!(checks.len(), 1, "{checks:?}");
        assert_eq!((checks[0].ctx.as_str(), checks[0].status.as_str()), (id, "damaged"), "{checks:?}");
    }

    #[test]
    fn an_older_builds_file_is_read_and_anything_else_refused() {
        let mut s = saved("0123456789abcdef0123456789abcdef");
        s.version = 1;
        assert_eq!(decode(&serde_json::to_vec(&s).unwrap()).unwrap().tokens, [1, 2, 3]);
        s.version = 2;
        assert!(decode(&serde_json::to_vec(&s).unwrap()).is_err(), "version 2 without a checksum");
        assert!(decode(b"\xff\xfe").is_err());
        assert!(decode(b"{}\n#crc32c zz\n").is_err());
    }
}

//! The load profile llmsd plans context switches with: `T_re(x)` (recomputing x chunks) and
//! `T_io(m)` (reading m bytes) measured through the real manager, store and engine at first
//! start and kept in the state directory; and the manager over a store that llmsd and the
//! benchmarks build alike.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use engine::kv::KvFormat;
use engine::model::SessionOptions;
use engine::{Logits, Model, Session, ThreadPool};
use mm::{Codec, Manager, MmConfig, Policy, Profile, Store, Strategy};

use crate::kvmm::{code, EngineCodec, SessionKv};
use crate::stats::median;

/// Where swap stores and profiles live unless told: `$LLMS_STATE_DIR`, else
/// `$XDG_STATE_HOME/llms`, else `~/.local/state/llms`. Not a tmpfs: the store must be on flash.
pub fn state_dir() -> PathBuf {
    if let Some(d) = crate::env_path("LLMS_STATE_DIR") {
        return d;
    }
    if let Some(d) = std::env::var_os("XDG_STATE_HOME") {
        return PathBuf::from(d).join("llms");
    }
    std::env::var_os("HOME").map_or_else(|| PathBuf::from(".llms-state"), |h| PathBuf::from(h).join(".local/state/llms"))
}

/// The profile file of a model.
pub fn profile_path(dir: &Path, codec: &EngineCodec) -> PathBuf {
    dir.join(format!("profile-{:016x}.json", codec.fingerprint()))
}

/// A manager over a store in `dir` for `model` (int8 base) with chunks of `chunk_tokens`, its
/// records not synced (benches; llmsd chooses with [`manager_with`]).
pub fn manager(dir: &Path, model: &Model, chunk_tokens: usize, cfg: MmConfig, profile: Option<Profile>) -> Result<Manager> {
    manager_with(dir, model, chunk_tokens, cfg, profile, mm::Durability::Off)
}

/// [`manager`], its store's records reaching the disk as `durability` says.
pub fn manager_with(
    dir: &Path,
    model: &Model,
    chunk_tokens: usize,
    cfg: MmConfig,
    profile: Option<Profile>,
    durability: mm::Durability,
) -> Result<Manager> {
    let codec = EngineCodec::new(model, chunk_tokens);
    let geom = codec.store_geometry();
    let store = Arc::new(Store::open(dir, codec.fingerprint(), geom, durability)?);
    Ok(Manager::new(cfg, Arc::new(codec), store, profile)?)
}

/// mm's configuration for `policy` over `levels` at `ratio`, unbounded budget, all features.
pub fn mm_config(policy: Policy, levels: &[KvFormat], ratio: f64, max_chunks: usize) -> MmConfig {
    MmConfig {
        policy,
        budget: usize::MAX / 2,
        ratio,
        levels: levels.iter().map(|&f| code(f)).collect(),
        max_chunks,
        features: mm::Features::default(),
    }
}

/// Token ids for measuring: cost does not depend on which tokens, so no text is needed.
pub fn synthetic_tokens(model: &Model, n: usize) -> Vec<u32> {
    let vocab = u32::try_from(model.config.vocab).unwrap_or(u32::MAX).max(2);
    let mut x = 0x2545_f491_u32;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % vocab
        })
        .collect()
}

/// Registers context `id` with `mm` and runs `tokens` in session `s` as one call, so the
/// context's chunks live in mm's slots (and, once written, on flash).
pub fn hold(mm: &mut Manager, id: u64, s: &mut Session, tokens: &[u32]) -> Result<()> {
    mm.create(id)?;
    let want = s.n_past() + tokens.len();
    mm.prepare(id, &mut SessionKv(s), want)?;
    mm.begin(id, &mut SessionKv(s), Strategy::Planned)?;
    s.eval(tokens, Logits::None)?;
    mm.end(id, &mut SessionKv(s))?;
    Ok(())
}

/// A context of `tokens` held by `mm` as context `id`, written out.
pub fn build_context(
    mm: &mut Manager,
    id: u64,
    model: &Arc<Model>,
    pool: &Arc<ThreadPool>,
    tokens: &[u32],
    chunk_tokens: usize,
) -> Result<Session> {
    let opts = SessionOptions {
        capacity: tokens.len() + chunk_tokens,
        chunk_tokens,
        base: KvFormat::Int8,
        observe_attention: false,
        sliding_window: None,
    };
    let mut s = Session::with_options(Arc::clone(model), Arc::clone(pool), opts);
    hold(mm, id, &mut s, tokens)?;
    mm.flush();
    Ok(s)
}

/// Evicts the `n` least recently used chunks of a one-context manager (all of them if `n`
/// covers the context), writing them out first as the policy does.
fn evict_some(mm: &mut Manager, id: u64, n: usize, chunk_bytes: usize) -> Result<()> {
    let held = mm.context_bytes(id);
    mm.set_budget(held.saturating_sub(n * chunk_bytes))?;
    mm.set_budget(usize::MAX / 2)?;
    Ok(())
}

/// One load of context `id` with `strategy` after evicting `n` chunks; returns the report.
pub fn timed_load(mm: &mut Manager, id: u64, s: &mut Session, n: usize, strategy: Strategy) -> Result<mm::LoadReport> {
    let cb = EngineCodec::new(&s.model, s.kv.geom.chunk_tokens).geom.chunk_bytes(KvFormat::Int8).div_ceil(4096) * 4096;
    evict_some(mm, id, n, cb)?;
    let r = mm.begin(id, &mut SessionKv(s), strategy)?;
    mm.end(id, &mut SessionKv(s))?;
    Ok(r)
}

/// Measures `T_re(x)` and `T_io(m)` through real loads of a context of at least 512 tokens and
/// 32 chunks (recompute x chunks; read x chunks, x up to 32) and fits them.
pub fn measure_profile(dir: &Path, model: &Arc<Model>, pool: &Arc<ThreadPool>, chunk_tokens: usize) -> Result<Profile> {
    let tmp = dir.join(format!("profile-run-{}", std::process::id()));
    let n_tok = (32 * chunk_tokens).max(512);
    let mut mm = manager(&tmp, model, chunk_tokens, mm_config(Policy::Llms, &[KvFormat::Int8], 1.0, n_tok / chunk_tokens + 2), None)?;
    let toks = synthetic_tokens(model, n_tok);
    let mut s = build_context(&mut mm, 1, model, pool, &toks, chunk_tokens)?;
    let (mut re, mut io) = (Vec::new(), Vec::new());
    for x in [1usize, 2, 4, 8, 16, 32] {
        let mut tr = Vec::new();
        let mut ti = Vec::new();
        let mut bytes = 0;
        for _ in 0..3 {
            let r = timed_load(&mut mm, 1, &mut s, x, Strategy::AllRecompute)?;
            tr.push(r.seconds);
            let r = timed_load(&mut mm, 1, &mut s, x, Strategy::AllRead)?;
            ti.push(r.seconds);
            bytes = r.read_bytes;
        }
        re.push((x as u64, median(tr)));
        io.push((bytes, median(ti)));
    }
    drop(mm);
    let _ = std::fs::remove_dir_all(&tmp);
    let codec = EngineCodec::new(model, chunk_tokens);
    Ok(Profile::fit(codec.fingerprint(), chunk_tokens, re, io)?)
}

/// The saved profile of this model, or a new measurement (saved) when it is missing or was
/// measured for another model.
pub fn load_or_measure(dir: &Path, model: &Arc<Model>, pool: &Arc<ThreadPool>, chunk_tokens: usize, quiet: bool) -> Result<Profile> {
    let codec = EngineCodec::new(model, chunk_tokens);
    let path = profile_path(dir, &codec);
    match Profile::load(&path, codec.fingerprint(), chunk_tokens) {
        Ok(p) => Ok(p),
        Err(e) => {
            if !quiet {
                eprintln!("llms: {e}; measuring the load profile (about a minute)");
            }
            let p = measure_profile(dir, model, pool, chunk_tokens)?;
            p.save(&path).with_context(|| format!("saving {}", path.display()))?;
            Ok(p)
        }
    }
}

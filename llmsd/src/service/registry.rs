//! The context registry and its persistence: contexts created, listed, deleted and described,
//! each saved as a small file beside mm's swap store so it continues after a restart; on start
//! every saved context is restored and store data no context names is removed.

use std::collections::HashMap;

use anyhow::{Context as _, Result};
use engine::model::AttentionStats;
use engine::Session;
use mm::Manager;
use tracing::{info, warn};

use super::ctxfile::{self, new_ctx_id, valid_ctx_id, Saved};
use super::history::now_ms;
use super::turns::Turns;
use super::{lock, ms, not_found, refuse, Owner, Refusal, Service};
use crate::kvmm::SessionKv;
use crate::proto::{CtxInfo, ErrorCode, ServiceStats};

pub(super) struct CtxEntry {
    pub(super) saved: Saved,
    /// `None` while the context is in a call (or while it is unavailable).
    pub(super) session: Option<Session>,
    /// Why the context cannot be used, if it cannot: its data is kept (never deleted for
    /// it), its owner is told why at every call, and it can be deleted.
    pub(super) unavailable: Option<String>,
}

impl CtxEntry {
    fn usable(saved: Saved, session: Session) -> Self {
        Self { saved, session: Some(session), unavailable: None }
    }
}

impl Service {
    /// Reopens every saved context (its KV comes back from the store at its first call);
    /// store data no saved context names is removed. A context that cannot be used — its
    /// tokens outside the vocabulary, longer than `max_context_tokens`, or its records
    /// refused by mm — is kept as unavailable with the reason: one bad context never stops the
    /// service, and nothing is deleted because of it. While any context file is unreadable,
    /// no store data is removed (it may be that file's).
    pub(super) fn restore(&self) -> Result<()> {
        let mut reg = lock(&self.registry);
        let mut mm = lock(&self.mm);
        let mut unreadable = 0usize;
        for e in std::fs::read_dir(&self.ctx_dir)? {
            let path = e?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.ends_with(".tmp") {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            // A previous copy whose context was deleted (a crash between the two removals).
            if let Some(id) = name.strip_suffix(".json.prev") {
                if !self.ctx_dir.join(format!("{id}.json")).exists() {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            }
            let Some(id) = name.strip_suffix(".json").filter(|s| valid_ctx_id(s)) else { continue };
            let saved = match ctxfile::read(&self.ctx_dir, id) {
                ctxfile::Found::Current(s) => s,
                ctxfile::Found::Previous(mut s, why) => {
                    // Loud, never silent: the context goes back one call, its owner is told
                    // (list and its next answer), and the damaged file is kept aside for
                    // whoever wants to look at it.
                    let aside = self.ctx_dir.join(format!("{id}.json.damaged"));
                    warn!(file = %path.display(), aside = %aside.display(), "context file damaged ({why}); its previous copy is used: its last call is lost");
                    std::fs::rename(&path, &aside).with_context(|| format!("setting {} aside", path.display()))?;
                    s.notice = format!(
                        "restored from its previous copy (the current one was damaged: {why}): the last call acknowledged before the service restarted is not in this context"
                    );
                    ctxfile::write(&self.ctx_dir, &s).with_context(|| format!("rewriting {}", path.display()))?;
                    s
                }
                ctxfile::Found::Damaged(why) => {
                    warn!(file = %path.display(), "context file damaged and no good previous copy ({why}); left as it is, its store data kept (llms doctor --state-dir lists it)");
                    unreadable += 1;
                    continue;
                }
            };
            let entry = match self.reopen(&mut mm, &saved) {
                Ok(s) => {
                    info!(ctx = %id, app = %saved.owner.app, uid = saved.owner.uid, tokens = saved.tokens.len(), "context restored");
                    CtxEntry::usable(saved, s)
                }
                Err(why) => {
                    warn!(ctx = %id, app = %saved.owner.app, uid = saved.owner.uid, file = %path.display(), "context unavailable, its data kept: {why}");
                    CtxEntry { saved, session: None, unavailable: Some(why) }
                }
            };
            reg.insert(id.to_string(), entry);
        }
        if unreadable > 0 {
            warn!(files = unreadable, "context files unreadable: no store data is removed this start");
            return Ok(());
        }
        let known: Vec<u64> = reg.values().map(|e| e.saved.mm_id).collect();
        for c in mm.store().contexts() {
            // The shared chunks' records are the pool's: the sweep below frees what no
            // context took.
            if !known.contains(&c) && c != mm::POOL_CTX {
                mm.store().remove_context(c)?;
                info!(mm_id = c, "removed store data of a context that no longer exists");
            }
        }
        let swept = mm.sweep_shared();
        if swept > 0 {
            info!(chunks = swept, "freed shared chunks no context holds any more");
        }
        Ok(())
    }

    /// A saved context's session with its chunks known to mm, or why it cannot be used.
    pub(super) fn reopen(&self, mm: &mut Manager, saved: &Saved) -> Result<Session, String> {
        let vocab = self.model.config.vocab;
        if let Some(&t) = saved.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(format!("damaged: token id {t} is outside the vocabulary ({vocab} tokens); quarantined — delete it"));
        }
        if saved.tokens.len() > self.cfg.max_context_tokens {
            return Err(format!(
                "it holds {} tokens, over this service's max_context_tokens {}; restart with a larger max_context_tokens to use it (its data is kept)",
                saved.tokens.len(),
                self.cfg.max_context_tokens
            ));
        }
        let mut s = self.session();
        s.tokens.clone_from(&saved.tokens);
        mm.set_scope(saved.mm_id, self.scope(&saved.owner));
        mm.restore(saved.mm_id, &mut SessionKv(&mut s))
            .map_err(|e| format!("damaged: its records cannot be reopened ({e}); quarantined — delete it"))?;
        s.kv.set_len(saved.tokens.len()).map_err(|e| format!("damaged: {e}; quarantined — delete it"))?;
        if let Some(a) = &mut s.attention {
            if saved.attention_sum.len() == saved.attention_count.len() && saved.attention_sum.len() <= saved.tokens.len() {
                *a = AttentionStats { sum: saved.attention_sum.clone(), count: saved.attention_count.clone() };
            }
        }
        self.refill.set_tokens(saved.mm_id, &saved.tokens);
        Ok(s)
    }

    pub(super) fn save(&self, saved: &Saved) -> Result<()> {
        ctxfile::write(&self.ctx_dir, saved)
    }

    pub(super) fn new_ctx(&self, owner: &Owner, system_prompt: Option<&str>, auto: bool) -> Result<String, Refusal> {
        let fail = |e: anyhow::Error| refuse(ErrorCode::Failed, crate::describe(&e));
        let (pending, pending_ids) = match system_prompt {
            Some(p) => (Turns::system(&self.model, p).map_err(fail)?, self.system_ids(p)?),
            None => (String::new(), Vec::new()),
        };
        let reg = lock(&self.registry);
        self.admit_ctx(&reg, owner, pending.len())?;
        drop(reg);
        let (id, mm_id) = new_ctx_id().map_err(fail)?;
        let mut reg = lock(&self.registry);
        if reg.values().any(|e| e.saved.mm_id == mm_id) {
            return Err(refuse(ErrorCode::Failed, "context id collision; try again"));
        }
        {
            let mut mm = lock(&self.mm);
            mm.set_scope(mm_id, self.scope(owner));
            mm.create(mm_id).map_err(|e| fail(e.into()))?;
        }
        let saved = Saved {
            version: ctxfile::VERSION,
            ctx: id.clone(),
            mm_id,
            owner: owner.clone(),
            tokens: Vec::new(),
            pending,
            pending_ids,
            open_turn: false,
            keep: 0,
            calls: 0,
            attention_sum: Vec::new(),
            attention_count: Vec::new(),
            auto,
            last_used: super::history::now_ms(),
            notice: String::new(),
        };
        // A context the HTTP front makes for a request (`auto`) is acknowledged with the
        // request's first turn, whose save is durable; until then a power loss may take its
        // file, and the next start frees its data (an unknown context's). The syncs, on the
        // worker every call waits for, were most of a branch's `resolve` (0.4-0.6 ms of
        // 0.6-0.9: docs/notes/llmsd.md). A context made by `new` is acknowledged now.
        if let Err(e) = ctxfile::write_as(&self.ctx_dir, &saved, !auto) {
            let _ = lock(&self.mm).delete(mm_id);
            return Err(fail(e));
        }
        info!(ctx = %id, app = %owner.app, uid = owner.uid, "context created");
        reg.insert(id.clone(), CtxEntry::usable(saved, self.session()));
        Ok(id)
    }

    /// The tokens a system prompt `p` becomes at a context's start (after BOS): its turn in
    /// the model's chat template.
    pub(super) fn system_ids(&self, p: &str) -> Result<Vec<u32>, Refusal> {
        self.turns()?;
        let segs = super::history::system_segments(&self.model, p).map_err(|e| refuse(ErrorCode::Failed, e))?;
        let mut ids = Vec::new();
        for s in &segs {
            ids.extend(self.model.tokenizer.encode(&s.text, false, s.special).map_err(|e| refuse(ErrorCode::BadRequest, e.to_string()))?);
        }
        Ok(ids)
    }

    /// Declares `public_prefixes` to mm: each file's text as a context opens with it as its
    /// system prompt (BOS, the system turn); a model without turns takes the text as it is.
    pub(super) fn declare_public(&self) -> Result<()> {
        let tk = &self.model.tokenizer;
        let mut all = Vec::new();
        for path in &self.cfg.public_prefixes {
            let text = std::fs::read_to_string(path).with_context(|| format!("public_prefixes: {}", path.display()))?;
            let mut ids: Vec<u32> = tk.bos.filter(|_| tk.add_bos).into_iter().collect();
            match self.system_ids(&text) {
                Ok(s) => ids.extend(s),
                Err(_) => ids.extend(tk.encode(&text, false, false)?),
            }
            info!(file = %path.display(), tokens = ids.len(), "a prefix every app may share");
            all.push(ids);
        }
        lock(&self.mm).set_public_prefixes(all);
        Ok(())
    }

    /// A new context of `owner` from `src`'s tokens (`fork`): its full chunks shared with
    /// `src` (mm's `fork`: bookkeeping per chunk, no K/V copied), its last partial chunk
    /// copied, its text not yet run (a system prompt) and its turn state as `src`'s. Counts
    /// against the owner's quotas as a new context.
    pub(super) fn fork_ctx(&self, owner: &Owner, src: &str) -> Result<String, Refusal> {
        let fail = |e: &dyn std::fmt::Display| refuse(ErrorCode::Failed, e.to_string());
        if !self.cfg.prefix_sharing {
            return Err(refuse(ErrorCode::BadRequest, "fork needs prefix_sharing = true in the service's configuration"));
        }
        let (id, mm_id) = new_ctx_id().map_err(|e| fail(&crate::describe(&e)))?;
        let mut reg = lock(&self.registry);
        let from = match reg.get(src) {
            Some(e) if e.saved.owner == *owner => e,
            _ => return Err(not_found(src)),
        };
        if let Some(why) = &from.unavailable {
            return Err(super::call::unavailable(src, why));
        }
        let Some(src_session) = &from.session else { return Err(refuse(ErrorCode::Busy, "the context is in a call")) };
        let pending = from.saved.pending.len();
        self.admit_ctx(&reg, owner, pending)?;
        if reg.values().any(|e| e.saved.mm_id == mm_id) {
            return Err(refuse(ErrorCode::Failed, "context id collision; try again"));
        }
        let from = &reg[src];
        let mut s = self.session();
        s.tokens.clone_from(&src_session.tokens);
        if let (Some(a), Some(b)) = (&mut s.attention, &src_session.attention) {
            a.clone_from(b);
        }
        let src_mm = from.saved.mm_id;
        // The AoT writer holds its copies and writes until the fork is answered: the first
        // fork of a long context queues its chunks' pool records (52 MB at 4k tokens), and
        // their writes beside the new context's fsync held the answer up.
        let _quiet = self.passes.as_deref().map(mm::gate::PassGate::pass);
        let t0 = std::time::Instant::now();
        {
            let mut mm = lock(&self.mm);
            mm.fork(src_mm, mm_id, &mut SessionKv(&mut s)).map_err(|e| fail(&e))?;
            if let Err(e) = s.kv.set_len(s.tokens.len()) {
                let _ = mm.delete(mm_id);
                return Err(fail(&e));
            }
        }
        let saved = Saved {
            ctx: id.clone(),
            mm_id,
            calls: 0,
            auto: false,
            last_used: super::history::now_ms(),
            notice: String::new(),
            attention_sum: s.attention.as_ref().map(|a| a.sum.clone()).unwrap_or_default(),
            attention_count: s.attention.as_ref().map(|a| a.count.clone()).unwrap_or_default(),
            ..from.saved.clone()
        };
        let t1 = std::time::Instant::now();
        if let Err(e) = self.save(&saved) {
            let _ = lock(&self.mm).delete(mm_id);
            return Err(fail(&crate::describe(&e)));
        }
        lock(&self.metrics).last_fork_ms = (ms(t1 - t0), ms(t1.elapsed()));
        self.refill.set_tokens(mm_id, &saved.tokens);
        info!(ctx = %id, from = src, app = %owner.app, uid = owner.uid, tokens = saved.tokens.len(), "context forked");
        reg.insert(id.clone(), CtxEntry::usable(saved, s));
        Ok(id)
    }

    /// Whether `owner` may have one more context, holding `text` more bytes of text not yet
    /// run: the service's, the app's and the uid's limits, and the uid's disk.
    fn admit_ctx(&self, reg: &HashMap<String, CtxEntry>, owner: &Owner, text: usize) -> Result<(), Refusal> {
        let fail = |e: anyhow::Error| refuse(ErrorCode::Failed, crate::describe(&e));
        if reg.len() >= self.cfg.max_contexts {
            return Err(refuse(
                ErrorCode::TooMany,
                format!("the service holds its maximum of {} contexts (max_contexts)", self.cfg.max_contexts),
            ));
        }
        let mine = reg.values().filter(|e| e.saved.owner == *owner).count();
        if mine >= self.cfg.max_contexts_per_app {
            return Err(refuse(
                ErrorCode::TooMany,
                format!("app {} holds its maximum of {mine} contexts (max_contexts_per_app)", owner.app),
            ));
        }
        let theirs: Vec<&CtxEntry> = reg.values().filter(|e| e.saved.owner.shares_quota(owner)).collect();
        if theirs.len() >= self.cfg.max_contexts_per_uid {
            return Err(refuse(
                ErrorCode::TooMany,
                format!(
                    "{} holds its maximum of {} contexts over all its apps (max_contexts_per_uid)",
                    owner.quota_name(),
                    self.cfg.max_contexts_per_uid
                ),
            ));
        }
        // System prompts wait as text until the first call: they count against the owner.
        let text: usize = theirs.iter().map(|e| e.saved.pending.len()).sum::<usize>() + text;
        let max_text = self.cfg.max_text_bytes_per_uid().map_err(fail)?;
        if text > max_text {
            return Err(refuse(
                ErrorCode::TooMany,
                format!("{} would hold {text} bytes of text not yet run, over {max_text} (max_text_per_uid)", owner.quota_name()),
            ));
        }
        drop(theirs);
        self.check_disk(reg, owner)
    }

    pub(super) fn del_ctx(&self, owner: &Owner, ctx: &str) -> Result<(), Refusal> {
        let mut reg = lock(&self.registry);
        match reg.get(ctx) {
            Some(e) if e.saved.owner == *owner => {
                if e.session.is_none() && e.unavailable.is_none() {
                    return Err(refuse(ErrorCode::Busy, "the context is in a call"));
                }
            }
            _ => return Err(not_found(ctx)),
        }
        let e = reg.remove(ctx).expect("checked");
        // The saved file goes first: a crash in between leaves store data without a context,
        // which the next start removes.
        ctxfile::remove(&self.ctx_dir, ctx);
        drop(e.session);
        self.refill.forget(e.saved.mm_id);
        let mut mm = lock(&self.mm);
        // An unavailable context may never have been reopened in mm: its records go directly.
        let gone = match mm.delete(e.saved.mm_id) {
            Err(mm::MmError::NoContext(_)) if e.unavailable.is_some() => {
                mm.store().remove_context(e.saved.mm_id).map_err(|e| e.to_string())
            }
            r => r.map_err(|e| e.to_string()),
        };
        gone.map_err(|e| refuse(ErrorCode::Failed, e))?;
        info!(ctx, app = %owner.app, "context deleted");
        Ok(())
    }

    /// Bytes of swap-store records of context `mm_id` (whether or not mm has it open).
    fn flash_bytes(&self, mm: &Manager, mm_id: u64) -> u64 {
        let chunks = self.cfg.max_context_tokens.div_ceil(self.cfg.chunk_tokens) + 1;
        (0..chunks)
            .filter_map(|i| u32::try_from(i).ok().and_then(|i| mm.store().entry(mm_id, i)))
            .map(|r| u64::from(r.layer_len) * u64::from(r.meta.layers))
            .sum()
    }

    /// Refuses when the contexts of `owner`'s quota hold more records on flash than
    /// `max_disk_per_uid`.
    pub(super) fn check_disk(&self, reg: &HashMap<String, CtxEntry>, owner: &Owner) -> Result<(), Refusal> {
        let max = self.cfg.max_disk_bytes_per_uid().map_err(|e| refuse(ErrorCode::Failed, crate::describe(&e)))? as u64;
        let mm = lock(&self.mm);
        let used: u64 = reg.values().filter(|e| e.saved.owner.shares_quota(owner)).map(|e| self.flash_bytes(&mm, e.saved.mm_id)).sum();
        if used > max {
            return Err(refuse(
                ErrorCode::TooMany,
                format!("{}'s contexts hold {used} bytes on flash, over {max} (max_disk_per_uid): delete some", owner.quota_name()),
            ));
        }
        Ok(())
    }

    fn ctx_info(&self, mm: &Manager, id: &str, e: &CtxEntry) -> CtxInfo {
        let mut levels = std::collections::BTreeMap::new();
        let n = mm.n_chunks(e.saved.mm_id);
        let mut every_layer_bytes = 0;
        let geom = crate::kvmm::EngineCodec::new(&self.model, self.cfg.chunk_tokens).geom;
        for i in 0..n {
            if let Some(c) = mm.chunk_info(e.saved.mm_id, i) {
                *levels.entry(crate::kvmm::format(c.format).name().to_string()).or_insert(0) += 1;
                every_layer_bytes += geom.chunk_bytes(crate::kvmm::format(c.format)) as u64;
            }
        }
        let flash = self.flash_bytes(mm, e.saved.mm_id);
        CtxInfo {
            ctx: id.to_string(),
            tokens: u32::try_from(e.saved.tokens.len()).unwrap_or(u32::MAX),
            chunks: u32::try_from(n).unwrap_or(u32::MAX),
            resident_bytes: mm.context_bytes(e.saved.mm_id) as u64,
            flash_bytes: flash,
            every_layer_bytes,
            levels,
            calls: e.saved.calls,
            busy: e.session.is_none() && e.unavailable.is_none(),
            unavailable: e.unavailable.clone().unwrap_or_default(),
            notice: e.saved.notice.clone(),
        }
    }

    pub(super) fn list(&self, owner: &Owner) -> Vec<CtxInfo> {
        let reg = lock(&self.registry);
        let mm = lock(&self.mm);
        let mut v: Vec<CtxInfo> = reg.iter().filter(|(_, e)| e.saved.owner == *owner).map(|(id, e)| self.ctx_info(&mm, id, e)).collect();
        v.sort_by(|a, b| a.ctx.cmp(&b.ctx));
        v
    }

    /// The service's figures, with the caller's contexts in detail.
    pub(super) fn stats(&self, owner: &Owner) -> ServiceStats {
        let mine = self.list(owner);
        let reg = lock(&self.registry);
        let mm = lock(&self.mm);
        let faults = reg.values().filter_map(|e| mm.region_stats(e.saved.mm_id)).map(|s| s.faults).sum();
        let n_ctx = reg.len();
        drop(reg);
        let m = lock(&self.metrics);
        let mut sw: Vec<f64> = m.switch_ms.iter().copied().collect();
        let mut pct = |p: f64| crate::stats::percentile(&mut sw, p);
        ServiceStats {
            policy: mm.config().policy.name().into(),
            budget_bytes: mm.config().budget as u64 + self.weights.as_ref().map_or(0, |w| w.stats().budget),
            configured_budget_bytes: self.budget as u64,
            resident_bytes: mm.resident_bytes() as u64,
            contexts: u32::try_from(n_ctx).unwrap_or(u32::MAX),
            queue: u32::try_from(lock(&self.queue).len()).unwrap_or(u32::MAX),
            calls: m.calls,
            switch_p50_ms: pct(0.5),
            switch_p90_ms: pct(0.9),
            switch_p99_ms: pct(0.99),
            aot_pending: mm.pending_writes() as u64,
            level_pending: mm.level_jobs() as u64,
            evicted_chunks: mm.stats.evicted_chunks,
            written_aot: mm.stats.written_aot,
            written_sync: mm.stats.written_sync,
            dropped_unsaved: mm.stats.dropped_unsaved,
            faults,
            weights_budget_bytes: self.weights.as_ref().map_or(0, |w| w.stats().budget),
            weights_resident_bytes: self.weights.as_ref().map_or(0, |w| w.stats().resident_bytes),
            weights_read_bytes: self.weights.as_ref().map_or(0, |w| w.stats().bytes_read),
            weights_plan: self.weights.as_ref().and_then(|w| w.plan()).map(|p| crate::weights::plan::describe(&p)).unwrap_or_default(),
            write_failures: mm.write_failures().0,
            last_write_error: mm.write_failures().1,
            memory_waits: m.memory_waits,
            lane_starts: m.lane_starts,
            connections: u32::try_from(self.connections_of(&super::slots::Holder::Uid(owner.uid))).unwrap_or(u32::MAX),
            pressure: lock(&self.pressure).clone(),
            sharing: {
                let s = mm.sharing_stats(Some(self.scope(owner)));
                crate::proto::SharingInfo {
                    unique_chunks: s.unique_chunks,
                    logical_chunks: s.logical_chunks,
                    bytes_saved: s.bytes_saved,
                    reused_tokens: s.reused_tokens(self.cfg.chunk_tokens),
                    forks: s.forks,
                    copied_on_write: s.copied_on_write,
                }
            },
            mine,
        }
    }
}

impl Service {
    /// Before the front makes a context for `owner`: contexts the front made that no call used
    /// for `http_context_ttl_s` go (any app's); at `http_contexts_per_app` the least recently
    /// used of the owner's goes; when the service holds `max_contexts`, the least recently used
    /// front-made context of the owner holding the most of them goes, so one app's
    /// conversations never lock another app out. Contexts in a call and native ones stay.
    pub(super) fn retire_for(&self, owner: &Owner) -> Result<(), Refusal> {
        let ttl = self.cfg.http_context_ttl_s.saturating_mul(1000);
        let now = now_ms();
        let (expired, victim) = {
            let reg = lock(&self.registry);
            let idle = |e: &&CtxEntry| e.saved.auto && (e.session.is_some() || e.unavailable.is_some());
            let expired: Vec<(Owner, String)> = reg
                .iter()
                .filter(|(_, e)| idle(e) && now.saturating_sub(e.saved.last_used) > ttl)
                .map(|(id, e)| (e.saved.owner.clone(), id.clone()))
                .collect();
            let live = |e: &&CtxEntry| !expired.iter().any(|(_, id)| *id == e.saved.ctx);
            let lru = |of: &dyn Fn(&Owner) -> bool| {
                reg.iter()
                    .filter(|(_, e)| of(&e.saved.owner) && idle(e) && live(e))
                    .min_by_key(|(_, e)| e.saved.last_used)
                    .map(|(id, e)| (e.saved.owner.clone(), id.clone()))
            };
            let mine = reg.values().filter(|e| e.saved.owner == *owner && e.saved.auto && live(e)).count();
            let victim = if mine >= self.cfg.http_contexts_per_app {
                Some(lru(&|o| o == owner).ok_or_else(|| refuse(ErrorCode::TooMany, "every context of this app is in a call"))?)
            } else if reg.len() - expired.len() >= self.cfg.max_contexts {
                // The owner with the most front-made contexts gives one up, if it has more
                // than this one (else this one's own oldest goes, if it has any).
                let mut per: HashMap<&Owner, usize> = HashMap::new();
                for e in reg.values().filter(|e| idle(e) && live(e)) {
                    *per.entry(&e.saved.owner).or_default() += 1;
                }
                let top = per.into_iter().max_by_key(|(_, n)| *n).filter(|(o, n)| *n > mine || *o == owner).map(|(o, _)| o.clone());
                top.and_then(|o| lru(&|x| *x == o))
            } else {
                None
            };
            (expired, victim)
        };
        for (o, id) in expired {
            info!(ctx = %id, app = %o.app, "retired: unused for longer than http_context_ttl_s");
            let _ = self.del_ctx(&o, &id);
        }
        if let Some((o, id)) = victim {
            info!(ctx = %id, app = %o.app, for_app = %owner.app, "retired: the least recently used context of its app (http_contexts_per_app, max_contexts)");
            self.del_ctx(&o, &id)?;
        }
        Ok(())
    }
}

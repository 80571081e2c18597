//! The call path, top to bottom: a call is queued ([`Service::submit`]), the worker takes it
//! ([`Service::worker`]), and [`Service::run`] takes the context out of the registry, brings its
//! chunks back (mm `begin`: read or recompute as planned, then pinned), prefills and decodes
//! ([`Service::infer`]), ends it in mm (unpin, AoT write, re-level, reclaim) and saves the
//! context. One call runs at a time on the shared model; the registry and mm are never locked
//! while the model computes.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

use engine::model::Scratch;
use engine::{Logits, Sampler, SamplerConfig, Session, Utf8Stream};
use mm::Strategy;
use tracing::{error, info, warn};

use super::history::History;
use super::registry::Saved;
use super::{lock, ms, not_found, refuse, Owner, Refusal, Service};
use crate::kvmm::SessionKv;
use crate::proto::{Call, CallStats, ErrorCode, Event};

pub(super) struct Job {
    owner: Owner,
    call: Call,
    received: Instant,
    events: Sender<Event>,
    cancel: Arc<AtomicBool>,
    /// A stateless client's whole history: the worker chooses the context (`call.ctx` is
    /// unused) and prefills only what it lacks (history.rs).
    history: Option<History>,
}

impl Service {
    /// Queues a call; its events arrive on the returned channel.
    pub(super) fn submit(&self, owner: &Owner, call: Call, cancel: Arc<AtomicBool>) -> Result<Receiver<Event>, Refusal> {
        self.enqueue(owner, call, cancel, None)
    }

    /// Queues a stateless client's call: its history goes to the context that holds the
    /// longest prefix of it, or to a new one; the choice is sent on `history.chosen` before
    /// any event.
    pub(super) fn submit_history(
        &self,
        owner: &Owner,
        call: Call,
        history: History,
        cancel: Arc<AtomicBool>,
    ) -> Result<Receiver<Event>, Refusal> {
        self.enqueue(owner, call, cancel, Some(history))
    }

    fn enqueue(&self, owner: &Owner, call: Call, cancel: Arc<AtomicBool>, history: Option<History>) -> Result<Receiver<Event>, Refusal> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(refuse(ErrorCode::ShuttingDown, "the service is stopping"));
        }
        let uid = owner.uid;
        {
            let reg = lock(&self.registry);
            self.check_disk(&reg, uid)?;
            let named = if history.is_some() { history.as_ref().and_then(|h| h.pin.as_ref()) } else { Some(&call.ctx) };
            if let Some(ctx) = named {
                match reg.get(ctx) {
                    Some(e) if e.saved.owner == *owner => {
                        if let Some(why) = &e.unavailable {
                            return Err(unavailable(ctx, why));
                        }
                    }
                    _ => return Err(not_found(ctx)),
                }
            }
        }
        // A call that may generate nothing would still add its prompt (and, as it was, one
        // sampled token) to the context: a turn without an answer is refused.
        if call.max_tokens == 0 {
            return Err(refuse(ErrorCode::BadRequest, "max_tokens must be at least 1"));
        }
        if call.max_tokens as usize + 2 > self.cfg.max_context_tokens / 2 {
            return Err(refuse(ErrorCode::BadRequest, format!("max_tokens must be under {}", self.cfg.max_context_tokens / 2 - 2)));
        }
        if !(call.temperature.is_finite() && (0.0..=10.0).contains(&call.temperature)) {
            return Err(refuse(ErrorCode::BadRequest, "temperature must be between 0 and 10"));
        }
        if call.top_p.is_some_and(|p| !(p.is_finite() && p > 0.0 && p <= 1.0)) {
            return Err(refuse(ErrorCode::BadRequest, "top_p must be in (0, 1]"));
        }
        if call.stop.len() > 16 || call.stop.iter().any(|s| s.is_empty() || s.len() > 256) {
            return Err(refuse(ErrorCode::BadRequest, "stop: at most 16 non-empty strings of at most 256 bytes"));
        }
        let (tx, rx) = mpsc::channel();
        let mut q = lock(&self.queue);
        if q.len() >= self.cfg.max_queue {
            return Err(refuse(ErrorCode::TooMany, format!("{} calls are waiting, the maximum (max_queue); try later", q.len())));
        }
        let theirs = q.iter().filter(|j| j.owner.uid == uid).count();
        if theirs >= self.cfg.max_queued_per_uid {
            return Err(refuse(
                ErrorCode::TooMany,
                format!("uid {uid} has {theirs} calls waiting, its maximum (max_queued_per_uid); try later"),
            ));
        }
        q.push_back(Job { owner: owner.clone(), call, received: Instant::now(), events: tx, cancel, history });
        self.queued.notify_one();
        Ok(rx)
    }

    /// The inference worker: runs queued calls one at a time until the service stops.
    pub(super) fn worker(&self) {
        let mut scratch = Scratch::default();
        loop {
            let job = {
                let mut q = lock(&self.queue);
                loop {
                    if self.stopping.load(Ordering::SeqCst) {
                        for j in q.drain(..) {
                            let _ = j.events.send(Event::error(ErrorCode::ShuttingDown, "the service is stopping"));
                        }
                        return;
                    }
                    if let Some(j) = q.pop_front() {
                        break j;
                    }
                    q = self.queued.wait(q).unwrap_or_else(std::sync::PoisonError::into_inner);
                }
            };
            let ev = match catch_unwind(AssertUnwindSafe(|| self.run(&job, &mut scratch))) {
                Ok(Ok((text, stats))) => {
                    self.prom.call(&stats);
                    Event::Done { text, stats }
                }
                Ok(Err(r)) => {
                    self.prom.failed();
                    r.into()
                }
                Err(panic) => {
                    let what = panic_message(panic.as_ref());
                    error!(ctx = %job.call.ctx, "a call panicked outside the model: {what}");
                    scratch = Scratch::default();
                    Event::error(ErrorCode::Failed, format!("the call failed inside the service ({what})"))
                }
            };
            let _ = job.events.send(ev);
        }
    }

    /// One call, start to end (see docs/llmsd.md "The call path").
    fn run(&self, job: &Job, scratch: &mut Scratch) -> Result<(String, CallStats), Refusal> {
        let start = Instant::now();
        // A stateless client's call: which context, and what it lacks.
        let (ctx, given) = match &job.history {
            None => (job.call.ctx.clone(), None),
            Some(h) => {
                let (chosen, ids) = self.resolve(&job.owner, h)?;
                let ctx = chosen.ctx.clone();
                let made = chosen.how != "continued";
                self.prom.cached(chosen.cached_tokens);
                let _ = h.chosen.send(chosen);
                let r = self.run_ctx(job, &ctx, Some(ids), start, scratch);
                if r.is_err() && made {
                    // A context made for a call that failed holds nothing: it goes.
                    let _ = self.del_ctx(&job.owner, &ctx);
                }
                return r;
            }
        };
        self.run_ctx(job, &ctx, given, start, scratch)
    }

    fn run_ctx(
        &self,
        job: &Job,
        ctx: &str,
        given: Option<Vec<u32>>,
        start: Instant,
        scratch: &mut Scratch,
    ) -> Result<(String, CallStats), Refusal> {
        let (mut s, before) = {
            let mut reg = lock(&self.registry);
            let e = match reg.get_mut(ctx) {
                Some(e) if e.saved.owner == job.owner => e,
                _ => return Err(not_found(ctx)),
            };
            if let Some(why) = &e.unavailable {
                return Err(unavailable(ctx, why));
            }
            let s = e.session.take().ok_or_else(|| refuse(ErrorCode::Busy, "the context is in a call"))?;
            (s, e.saved.clone())
        };
        let mut saved = before.clone();
        s.set_scratch(std::mem::take(scratch));
        // A panic in the call (a bug, or data that got past validation) must not take the
        // worker with it: the call fails, the context is quarantined as it was before the call
        // (its saved state is not touched), and the service goes on with the others.
        let r = match catch_unwind(AssertUnwindSafe(|| self.run_in(job, ctx, given, &mut s, &mut saved, start))) {
            Ok(r) => r,
            Err(panic) => return Err(self.quarantine(ctx, s, saved.mm_id, panic.as_ref())),
        };
        *scratch = s.take_scratch();
        // A call is atomic: its turn is in the context once the context file holding it is on
        // disk, and only then acknowledged (a cancelled call keeps what it made). A call that
        // failed anywhere (a full disk included) leaves the context as it was before it.
        let r = r.and_then(|out| {
            saved.tokens.clone_from(&s.tokens);
            if let Some(a) = &s.attention {
                saved.attention_sum.clone_from(&a.sum);
                saved.attention_count.clone_from(&a.count);
            }
            saved.calls += 1;
            saved.last_used = super::history::now_ms();
            self.save(&saved).map_err(|e| refuse(ErrorCode::Failed, format!("saving the context: {e:#}")))?;
            Ok(out)
        });
        let (session, saved, unusable) = match &r {
            Ok(_) => {
                self.refill.set_tokens(saved.mm_id, &saved.tokens);
                (Some(s), saved, None)
            }
            Err(e) => {
                warn!(ctx, "call failed, the context is rolled back to before it: {}", e.1);
                drop(s);
                match self.roll_back(&before) {
                    Ok(s) => (Some(s), before, None),
                    Err(why) => {
                        warn!(ctx, "the context cannot be rolled back: {why}");
                        (None, before, Some(why))
                    }
                }
            }
        };
        if let Some(e) = lock(&self.registry).get_mut(ctx) {
            e.session = session;
            e.saved = saved;
            e.unavailable = unusable;
        }
        let (text, mut stats) = r?;
        stats.queue_ms = ms(start.duration_since(job.received));
        let mut m = lock(&self.metrics);
        m.calls += 1;
        m.switch_ms.push_back(stats.switch_ms);
        if m.switch_ms.len() > 4096 {
            m.switch_ms.pop_front();
        }
        Ok((text, stats))
    }

    /// The context as it was saved before a failed call: mm forgets its memory and reopens
    /// its records for the saved tokens (records the call wrote for other tokens do not match
    /// and are recomputed at the next call).
    fn roll_back(&self, before: &Saved) -> Result<Session, String> {
        let mut mm = lock(&self.mm);
        match mm.close(before.mm_id) {
            Ok(()) | Err(mm::MmError::NoContext(_)) => {}
            Err(e) => return Err(format!("damaged: rolling back a failed call: {e}")),
        }
        self.reopen(&mut mm, before)
    }

    /// After a call panicked: unpins what mm can, marks the context unavailable (its data
    /// kept, its owner told why, deletable) and says so.
    fn quarantine(&self, ctx: &str, s: Session, mm_id: u64, panic: &(dyn Any + Send)) -> Refusal {
        let what = panic_message(panic);
        // Its memory goes (the session may be half-way through anything); its records stay.
        drop(s);
        let _ = catch_unwind(AssertUnwindSafe(|| lock(&self.mm).close(mm_id)));
        let why = format!("damaged: a call failed inside the service ({what}); quarantined — delete it");
        error!(ctx, "call panicked; the context is quarantined and the service goes on: {what}");
        if let Some(e) = lock(&self.registry).get_mut(ctx) {
            e.unavailable = Some(why.clone());
        }
        unavailable(ctx, &why)
    }

    #[allow(clippy::too_many_lines)]
    #[allow(clippy::too_many_arguments)]
    fn run_in(
        &self,
        job: &Job,
        ctx: &str,
        given: Option<Vec<u32>>,
        s: &mut Session,
        saved: &mut Saved,
        start: Instant,
    ) -> Result<(String, CallStats), Refusal> {
        let fail = |e: &dyn std::fmt::Display| refuse(ErrorCode::Failed, e.to_string());
        let c = &job.call;
        let stateless = given.is_some();
        let mut ids = match given {
            Some(ids) => ids,
            None => self.native_ids(c, s, saved)?,
        };
        if s.n_past() == 0 {
            saved.keep = ids.len().min(self.cfg.keep_tokens);
        }
        let mm_id = saved.mm_id;
        let mut stats = CallStats { prompt_tokens: u32::try_from(ids.len()).unwrap_or(u32::MAX), ..CallStats::default() };

        // Sliding window: the context's start and its most recent tokens stay; the cache is
        // rebuilt from them (the dropped middle changes every later position). As llama.cpp's
        // context shift, half of what could stay after `keep` is dropped, not just enough for
        // this call: the rebuild is paid once per half window of turns, not at every call.
        let room = self.cfg.max_context_tokens - c.max_tokens as usize - 1;
        if stateless && s.n_past() + ids.len() > room {
            // A stateless client sent the history itself: dropping part of it would answer
            // another conversation than the one it sent.
            return Err(refuse(
                ErrorCode::TooLong,
                format!(
                    "the conversation is {} tokens and max_tokens {}: over this service's max_context_tokens {}",
                    s.n_past() + ids.len(),
                    c.max_tokens,
                    self.cfg.max_context_tokens
                ),
            ));
        }
        if s.n_past() + ids.len() > room {
            let keep = saved.keep.min(s.n_past());
            if keep + ids.len() > room {
                // The prompt alone is too long: its end is kept.
                let cut = keep + ids.len() - room;
                ids.drain(..cut.min(ids.len()));
            }
            let tail = (room.saturating_sub(keep + ids.len()) / 2).min(s.n_past() - keep);
            let mut kept: Vec<u32> = s.tokens[..keep].to_vec();
            kept.extend_from_slice(&s.tokens[s.n_past() - tail..]);
            stats.slid_tokens = u32::try_from(s.n_past() - kept.len()).unwrap_or(u32::MAX);
            kept.extend_from_slice(&ids);
            ids = kept;
            let mut mm = lock(&self.mm);
            mm.delete(mm_id).map_err(|e| fail(&e))?;
            mm.create(mm_id).map_err(|e| fail(&e))?;
            let scratch = s.take_scratch();
            *s = self.session();
            s.set_scratch(scratch);
        }

        // Load: the context's chunks come back (read or recomputed as the planner says) and
        // are pinned for the call.
        let report = lock(&self.mm).begin(mm_id, &mut SessionKv(s), Strategy::Planned).map_err(|e| fail(&e))?;
        stats.switch_ms = ms(start.elapsed());
        stats.missing_chunks = u32::try_from(report.missing).unwrap_or(u32::MAX);
        stats.read_chunks = u32::try_from(report.read).unwrap_or(u32::MAX);
        stats.recomputed_chunks = u32::try_from(report.recomputed).unwrap_or(u32::MAX);
        saved.pending.clear();
        saved.open_turn = false;
        let out = self.infer(job, s, mm_id, &ids, &mut stats);
        // Always end the call: unpin, write out what changed, re-level, reclaim.
        let ended = lock(&self.mm).end(mm_id, &mut SessionKv(s));
        let text = out?;
        ended.map_err(|e| fail(&e))?;
        // A stateless client sends the turn's end itself with its next history.
        saved.open_turn = !c.raw && !stateless && stats.finish != "cancelled";
        stats.context_tokens = u32::try_from(s.n_past()).unwrap_or(u32::MAX);
        info!(
            ctx, app = %job.owner.app, switch_ms = stats.switch_ms, read = stats.read_chunks,
            recomputed = stats.recomputed_chunks, prompt = stats.prompt_tokens, output = stats.output_tokens,
            finish = %stats.finish, "call"
        );
        Ok((text, stats))
    }

    /// A native call's new tokens: pending text (a system prompt), the end of the last
    /// assistant turn, then the prompt as a user turn (markup parsed for special tokens, the
    /// user's text not: an app cannot forge turns) or raw.
    fn native_ids(&self, c: &Call, s: &Session, saved: &Saved) -> Result<Vec<u32>, Refusal> {
        let tk = &self.model.tokenizer;
        let enc = |t: &str, special: bool| tk.encode(t, false, special).map_err(|e| refuse(ErrorCode::Failed, e.to_string()));
        let mut ids = Vec::new();
        if s.n_past() == 0 && tk.add_bos {
            ids.extend(tk.bos);
        }
        if !saved.pending.is_empty() {
            ids.extend(enc(&saved.pending, true)?);
        }
        if saved.open_turn {
            ids.extend(enc(&self.turns.close_assistant, true)?);
        }
        if c.raw {
            ids.extend(enc(&c.prompt, true)?);
        } else {
            let first = s.n_past() == 0 && saved.pending.is_empty();
            ids.extend(enc(if first { &self.turns.first_open } else { &self.turns.open }, true)?);
            ids.extend(enc(&c.prompt, false)?);
            ids.extend(enc(&self.turns.close_user, true)?);
        }
        Ok(ids)
    }

    /// Prefill and decode; new chunks get their slots from mm as the context grows.
    fn infer(&self, job: &Job, s: &mut Session, mm_id: u64, ids: &[u32], stats: &mut CallStats) -> Result<String, Refusal> {
        let fail = |e: &dyn std::fmt::Display| refuse(ErrorCode::Failed, e.to_string());
        let c = &job.call;
        let ct = self.cfg.chunk_tokens;
        let grow = |s: &mut Session, n: usize| -> Result<(), Refusal> {
            if n > s.kv.n_chunks() * ct {
                lock(&self.mm).prepare(mm_id, &mut SessionKv(s), n).map_err(|e| fail(&e))?;
            }
            Ok(())
        };
        let t0 = Instant::now();
        grow(s, s.n_past() + ids.len())?;
        let mut sampler = Sampler::new(SamplerConfig {
            temperature: c.temperature,
            seed: c.seed,
            top_p: c.top_p.unwrap_or(SamplerConfig::default().top_p),
            ..SamplerConfig::default()
        });
        let mut next = sampler.sample(s.eval(ids, Logits::Last).map_err(|e| fail(&e))?);
        stats.prefill_ms = ms(t0.elapsed());
        // From the call's arrival: its queue wait is in it once.
        stats.ttft_ms = ms(job.received.elapsed());
        let t1 = Instant::now();
        let tk = &self.model.tokenizer;
        let mut utf8 = Utf8Stream::default();
        let mut text = String::new();
        let mut bytes = Vec::new();
        let mut sent = 0;
        let mut n_out = 0u32;
        stats.finish = "length".into();
        loop {
            if tk.is_eog(next) {
                stats.finish = "eog".into();
                break;
            }
            bytes.clear();
            tk.token_bytes(next, false, &mut bytes);
            let before = text.len();
            text.push_str(&utf8.push(&bytes));
            n_out += 1;
            // The token joins the context whatever happens to the output.
            grow(s, s.n_past() + 1)?;
            let logits = s.eval(&[next], Logits::Last).map_err(|e| fail(&e))?;
            // Only a match ending in the new piece is new: search from one stop string's
            // length before it, not the whole output at every token.
            let from = |p: &String| floor_boundary(&text, before.saturating_sub(p.len()));
            if let Some(at) = c.stop.iter().filter_map(|p| text[from(p)..].find(p.as_str()).map(|i| i + from(p))).min() {
                text.truncate(at);
                stats.finish = "stop".into();
                break;
            }
            // Stream what can no longer become part of a stop string.
            let hold = c.stop.iter().map(|p| held_back(&text, p)).max().unwrap_or(0);
            let safe = text.len() - hold;
            if safe > sent && text.is_char_boundary(safe) {
                if job.events.send(Event::Token { text: text[sent..safe].to_string() }).is_err() {
                    job.cancel.store(true, Ordering::SeqCst);
                }
                sent = safe;
            }
            if job.cancel.load(Ordering::SeqCst) {
                stats.finish = "cancelled".into();
                break;
            }
            if n_out >= c.max_tokens {
                break;
            }
            next = sampler.sample(logits);
        }
        if stats.finish != "stop" {
            text.push_str(&utf8.finish());
        }
        if text.len() > sent && stats.finish != "cancelled" {
            let _ = job.events.send(Event::Token { text: text[sent..].to_string() });
        }
        stats.output_tokens = n_out;
        stats.decode_ms = ms(t1.elapsed());
        Ok(text)
    }
}

/// The largest char boundary of `s` at or before `i`.
pub(super) fn floor_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Bytes at the end of `text` that are the start of `stop` (they may yet become it).
pub(super) fn held_back(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1)).rev().find(|&k| text.as_bytes().ends_with(&stop.as_bytes()[..k])).unwrap_or(0)
}

fn unavailable(ctx: &str, why: &str) -> Refusal {
    refuse(ErrorCode::Failed, format!("context {ctx} is unavailable: {why}"))
}

/// What a panic said, for the log and the caller.
fn panic_message(p: &(dyn Any + Send)) -> String {
    let m = p.downcast_ref::<&str>().map(|s| (*s).to_string()).or_else(|| p.downcast_ref::<String>().cloned());
    format!("panic: {}", m.unwrap_or_else(|| "unknown".into()))
}

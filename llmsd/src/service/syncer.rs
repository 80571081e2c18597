//! The syncer: saves a finished call's turn (its context file written into the page cache and
//! renamed into place: whole against a crash of the process), makes the file durable, then
//! answers the call, on a thread of its own. The worker ends the call in mm and goes on with
//! the other calls' passes; their tokens used to wait out the file's two fsyncs at every
//! call's end, 0.5-3 ms each on this host's virtual disk and far longer on a phone's flash
//! under write load (#56), and then its write: ~0.5 ms here (encoding, the write, a link and
//! two renames), and a write into the page cache can itself wait, for the writeback of dirty
//! pages on a device under write load.
//!
//! A call is still acknowledged only once its turn is on disk: the answer waits here for the
//! write and the syncs. Until then its context counts as in a call: its session is out of
//! the registry (what lists it as busy, and refuses a fork or a delete of it) and a next call
//! on it waits in line (`Syncer::waits`), so nothing reads the turn before it is saved or
//! writes over a file not yet synced. A write that fails (a full disk) fails the call and
//! leaves the context as it was before it ([`Service::settle`]). A power loss before the sync
//! may leave the file damaged; reading falls back to the previous copy, which is the context
//! before the unacknowledged call (ctxfile.rs). A sync that fails leaves the context
//! unavailable (its file's state on disk is unknown: after a failed fsync the page cache cannot
//! be trusted to hold it either) and the call fails.

use std::collections::HashSet;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Mutex;

use tracing::warn;

use super::call::{Events, SyncJob, Turn};
use super::{lock, refuse, Service};
use crate::proto::{ErrorCode, Event};

/// The worker's side of the syncer: where answers go, and the contexts that wait.
#[derive(Default)]
pub(super) struct Syncer {
    /// None while no syncer thread runs (before `serve`, and after the worker stopped): the
    /// worker then syncs the file itself before it answers.
    tx: Mutex<Option<Sender<SyncJob>>>,
    /// Contexts whose answer waits for a sync.
    waiting: Mutex<HashSet<String>>,
}

impl Syncer {
    /// Starts taking answers; the receiver goes to [`Service::syncer`].
    pub(super) fn open(&self) -> Receiver<SyncJob> {
        let (tx, rx) = mpsc::channel();
        *lock(&self.tx) = Some(tx);
        rx
    }

    /// Stops taking answers: the thread answers what it has and returns.
    pub(super) fn close(&self) {
        lock(&self.tx).take();
    }

    /// Whether `ctx`'s last answer waits for a sync.
    pub(super) fn waits(&self, ctx: &str) -> bool {
        lock(&self.waiting).contains(ctx)
    }

    /// Hands an answer over (the context's file is written, not synced); gives it back if
    /// no thread takes it (the caller syncs and answers itself).
    pub(super) fn defer(&self, job: SyncJob) -> Result<(), Box<SyncJob>> {
        let tx = lock(&self.tx);
        let Some(tx) = tx.as_ref() else { return Err(Box::new(job)) };
        lock(&self.waiting).insert(job.ctx.clone());
        tx.send(job).map_err(|e| {
            lock(&self.waiting).remove(&e.0.ctx);
            Box::new(e.0)
        })
    }
}

impl Service {
    /// Runs until the syncer is closed and its answers are sent: takes every turn waiting and
    /// saves, syncs and answers them ([`Service::save_and_answer`]).
    pub(super) fn syncer(&self, rx: &Receiver<SyncJob>) {
        while let Ok(first) = rx.recv() {
            let mut jobs = vec![first];
            jobs.extend(rx.try_iter());
            self.save_and_answer(jobs);
            // A call on one of these contexts may wait in line for it.
            self.wake_worker();
        }
    }

    /// Saves each job's turn (its context file written, the session back in the registry, or
    /// the context rolled back when the write fails: [`Service::settle`]), syncs the files
    /// written (the directory once for them all) and answers every call.
    pub(super) fn save_and_answer(&self, jobs: Vec<SyncJob>) {
        let mut written = Vec::with_capacity(jobs.len());
        for SyncJob { ctx, app, events, turn } in jobs {
            let mm_id = turn.saved.mm_id;
            let saved = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                super::fault_point("save", &app);
                let Turn { owner, made, s, before, saved, text, stats } = *turn;
                self.settle(&owner, &ctx, made, s, before, saved, Ok((text, stats)))
            }));
            match saved {
                Ok(Ok((text, stats))) => written.push(Written { ctx, app, events, ev: Event::Done { text, stats } }),
                Ok(Err(r)) => {
                    self.prom.failed();
                    self.answer(&ctx, &events, r.into());
                }
                Err(p) => {
                    // A bug while saving: the session is gone with the unwinding; the
                    // context's records stay, quarantined as after a panic in a call.
                    let r = self.quarantine(&ctx, None, mm_id, &super::call::panic_message(p.as_ref()));
                    self.prom.failed();
                    self.answer(&ctx, &events, r.into());
                }
            }
        }
        if written.is_empty() {
            return;
        }
        let ids: Vec<&str> = written.iter().map(|j| j.ctx.as_str()).collect();
        let all = self.sync_files(&ids, &written);
        for job in written {
            // The batch failed: each file alone, so that only those that fail fail.
            let synced = if all.is_ok() { Ok(()) } else { self.sync_files(&[&job.ctx], std::slice::from_ref(&job)) };
            self.answer_synced(job, synced);
        }
    }

    /// Syncs the files `ids` (of `jobs`), or says why not; a panic in it (a bug) is a
    /// failure, not the end of the thread every answer waits on.
    fn sync_files(&self, ids: &[&str], jobs: &[Written]) -> Result<(), String> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for j in jobs {
                super::fault_point("sync", &j.app);
            }
            super::ctxfile::sync(&self.ctx_dir, ids).map_err(|e| crate::describe(&e))
        }))
        .unwrap_or_else(|p| Err(format!("the sync panicked: {}", super::call::panic_message(p.as_ref()))))
    }

    /// Sends a saved call's answer once its file's sync is done (`synced`), or fails the call
    /// and leaves its context unavailable.
    fn answer_synced(&self, job: Written, synced: Result<(), String>) {
        let ev = match synced {
            Ok(()) => {
                if let Event::Done { stats, .. } = &job.ev {
                    self.prom.call(stats);
                }
                job.ev
            }
            Err(why) => {
                warn!(ctx = %job.ctx, "the context's file could not be made durable: {why}");
                if let Some(e) = lock(&self.registry).get_mut(&job.ctx) {
                    e.unavailable = Some(format!("its file could not be made durable after a call ({why})"));
                }
                self.prom.failed();
                refuse(ErrorCode::Failed, format!("saving the context: {why}")).into()
            }
        };
        self.answer(&job.ctx, &job.events, ev);
    }

    /// The call on `ctx` is answered: its context no longer waits.
    fn answer(&self, ctx: &str, events: &Events, ev: Event) {
        lock(&self.sync.waiting).remove(ctx);
        let _ = events.send(ev);
    }
}

/// A call whose turn is saved, its file not yet synced.
struct Written {
    ctx: String,
    app: String,
    events: Events,
    ev: Event,
}

//! The syncer: makes a finished call's context file durable, then answers the call, on a
//! thread of its own. The worker writes the file (into the page cache, renamed into place:
//! whole against a crash of the process) and goes on with the other calls' passes; their
//! tokens used to wait out the file's two fsyncs at every call's end, 0.5-3 ms each on this
//! host's virtual disk and far longer on a phone's flash under write load (#56).
//!
//! A call is still acknowledged only once its turn is on disk: the answer waits here for the
//! syncs. Until then its context counts as in a call (`Syncer::waits`): a next call on it
//! waits in line, so nothing is written over a file not yet synced. A power loss before the
//! sync may leave the file damaged; reading falls back to the previous copy, which is the
//! context before the unacknowledged call (ctxfile.rs). A sync that fails leaves the context
//! unavailable (its file's state on disk is unknown: after a failed fsync the page cache cannot
//! be trusted to hold it either) and the call fails.

use std::collections::HashSet;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Mutex;

use tracing::warn;

use super::call::SyncJob;
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
    /// Runs until the syncer is closed and its answers are sent: takes every answer waiting,
    /// syncs their files (the directory once for them all), answers them.
    pub(super) fn syncer(&self, rx: &Receiver<SyncJob>) {
        while let Ok(first) = rx.recv() {
            let mut jobs = vec![first];
            jobs.extend(rx.try_iter());
            let ids: Vec<&str> = jobs.iter().map(|j| j.ctx.as_str()).collect();
            let all = self.sync_files(&ids, &jobs);
            for job in jobs {
                // The batch failed: each file alone, so that only those that fail fail.
                let synced = if all.is_ok() { Ok(()) } else { self.sync_files(&[&job.ctx], std::slice::from_ref(&job)) };
                self.answer_synced(job, synced);
            }
            // A call on one of these contexts may wait in line for it.
            self.wake_worker();
        }
    }

    /// Syncs the files `ids` (of `jobs`), or says why not; a panic in it (a bug) is a
    /// failure, not the end of the thread every answer waits on.
    fn sync_files(&self, ids: &[&str], jobs: &[SyncJob]) -> Result<(), String> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for j in jobs {
                super::fault_point("sync", &j.app);
            }
            super::ctxfile::sync(&self.ctx_dir, ids).map_err(|e| crate::describe(&e))
        }))
        .unwrap_or_else(|p| Err(format!("the sync panicked: {}", super::call::panic_message(p.as_ref()))))
    }

    /// Sends a deferred answer once its file's sync is done (`synced`), or fails the call and
    /// leaves its context unavailable.
    pub(super) fn answer_synced(&self, job: SyncJob, synced: Result<(), String>) {
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
        lock(&self.sync.waiting).remove(&job.ctx);
        let _ = job.events.send(ev);
    }
}

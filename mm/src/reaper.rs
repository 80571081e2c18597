//! Frees what a deleted context held on a thread of its own.
//!
//! Deleting a context unmaps its region (the kernel zaps every resident page) and closes its
//! unlinked store file (ext4 frees its blocks): milliseconds for a long context. A sliding
//! window deletes and recreates a context on the switch path, so neither may happen there.
//! The bookkeeping (budget, index, the file's name) is updated at once by the caller; only
//! the release of the memory and blocks is late, by the time the thread takes to get to it.

use std::sync::mpsc::{self, Sender};
use std::sync::Mutex;
use std::thread::JoinHandle;

type Item = Box<dyn Send>;

#[derive(Debug, Default)]
pub struct Reaper(Mutex<Option<(Sender<Item>, JoinHandle<()>)>>);

impl Reaper {
    /// Drops `x` on the reaper's thread (started on first use); here if it cannot start.
    pub fn release(&self, x: Item) {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            let (tx, rx) = mpsc::channel::<Item>();
            if let Ok(h) = std::thread::Builder::new().name("llms-reaper".into()).spawn(move || rx.into_iter().for_each(drop)) {
                *g = Some((tx, h));
            }
        }
        match g.as_ref() {
            // A send fails only if the thread is gone: the item comes back and drops here.
            Some((tx, _)) => drop(tx.send(x)),
            None => drop(x),
        }
    }
}

impl Drop for Reaper {
    /// Waits for everything released to be freed — unless this is the reaper's own thread
    /// (a released region can hold the last reference to the store that owns the reaper):
    /// there the thread is left to finish the item at hand and end, its channel closed.
    fn drop(&mut self) {
        if let Some((tx, h)) = self.0.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            drop(tx);
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    struct Owner {
        reaper: Reaper,
    }

    /// Holds the last reference to the reaper's owner, dropped on the reaper's thread.
    struct Holder {
        owner: Option<Arc<Owner>>,
        go: mpsc::Receiver<()>,
        done: Arc<AtomicBool>,
    }

    impl Drop for Holder {
        fn drop(&mut self) {
            let _ = self.go.recv();
            self.owner.take();
            self.done.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn the_reaper_may_free_its_own_owner() {
        let owner = Arc::new(Owner { reaper: Reaper::default() });
        let done = Arc::new(AtomicBool::new(false));
        let (go_tx, go) = mpsc::channel();
        owner.reaper.release(Box::new(Holder { owner: Some(Arc::clone(&owner)), go, done: Arc::clone(&done) }));
        // The holder now has the last reference: the owner, and its reaper, drop on the
        // reaper's thread, which must neither join itself nor panic.
        drop(owner);
        go_tx.send(()).unwrap();
        let t = Instant::now();
        while !done.load(Ordering::SeqCst) {
            assert!(t.elapsed() < Duration::from_secs(30), "the reaper did not finish dropping its owner");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn released_items_are_dropped_by_the_time_the_reaper_is() {
        let done = Arc::new(AtomicBool::new(false));
        struct Flag(Arc<AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let r = Reaper::default();
        r.release(Box::new(Flag(Arc::clone(&done))));
        drop(r);
        assert!(done.load(Ordering::SeqCst));
    }
}

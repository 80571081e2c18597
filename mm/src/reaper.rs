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
    /// Waits for everything released to be freed.
    fn drop(&mut self) {
        if let Some((tx, h)) = self.0.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            drop(tx);
            let _ = h.join();
        }
    }
}

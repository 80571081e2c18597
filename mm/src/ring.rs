//! A small io_uring driver: batches of reads and writes at file offsets, grouped under tags so
//! a caller can keep one batch in flight while it waits for another (the per-layer pipeline).
//! Every completion is checked: an error or a short transfer fails the whole tag.

use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, squeue, types, IoUring};

/// One transfer. The buffer must stay valid (and, for O_DIRECT, aligned) until its tag is
/// waited for.
#[derive(Debug, Clone, Copy)]
pub struct Op {
    pub fd: RawFd,
    pub offset: u64,
    pub buf: *mut u8,
    pub len: u32,
    pub write: bool,
}

#[derive(Debug, Default)]
struct Tag {
    left: usize,
    error: Option<String>,
}

pub struct Ring {
    ring: IoUring,
    /// user_data -> (tag, expected bytes)
    ops: HashMap<u64, (u32, u32)>,
    tags: HashMap<u32, Tag>,
    next: u64,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("in_flight", &self.ops.len()).finish()
    }
}

impl Ring {
    pub fn new(entries: u32) -> io::Result<Self> {
        Ok(Self { ring: IoUring::new(entries.next_power_of_two().max(8))?, ops: HashMap::new(), tags: HashMap::new(), next: 0 })
    }

    /// Queues `ops` under `tag` and submits them (without waiting).
    ///
    /// # Safety
    /// Every buffer must be valid for its length (writable for reads) until `wait(tag)`
    /// returns, and must not be touched by anything else meanwhile.
    pub unsafe fn submit(&mut self, tag: u32, ops: &[Op]) -> io::Result<()> {
        let tagged: Vec<(u32, Op)> = ops.iter().map(|&op| (tag, op)).collect();
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.submit_each(&tagged) }
    }

    /// Queues each op under its own tag and submits them all at once (one system call).
    ///
    /// # Safety
    /// As [`Ring::submit`], for each op until its tag is waited for.
    pub unsafe fn submit_each(&mut self, ops: &[(u32, Op)]) -> io::Result<()> {
        for &(tag, op) in ops {
            self.tags.entry(tag).or_default().left += 1;
            let id = self.next;
            self.next += 1;
            self.ops.insert(id, (tag, op.len));
            let e = if op.write {
                opcode::Write::new(types::Fd(op.fd), op.buf, op.len).offset(op.offset).build()
            } else {
                opcode::Read::new(types::Fd(op.fd), op.buf, op.len).offset(op.offset).build()
            };
            let e: squeue::Entry = e.user_data(id);
            // SAFETY: the caller keeps the buffer valid until the tag completes.
            while unsafe { self.ring.submission().push(&e) }.is_err() {
                self.ring.submit()?;
                self.reap(false)?;
            }
        }
        self.ring.submit()?;
        Ok(())
    }

    /// Waits until every op of `tag` completed; an error names the first failure.
    pub fn wait(&mut self, tag: u32) -> io::Result<()> {
        while self.tags.get(&tag).is_some_and(|t| t.left > 0) {
            self.reap(true)?;
        }
        match self.tags.remove(&tag).and_then(|t| t.error) {
            Some(e) => Err(io::Error::other(e)),
            None => Ok(()),
        }
    }

    fn reap(&mut self, block: bool) -> io::Result<()> {
        if block && self.ring.completion().is_empty() {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        let done: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (id, res) in done {
            let Some((tag, want)) = self.ops.remove(&id) else { continue };
            let t = self.tags.entry(tag).or_default();
            t.left = t.left.saturating_sub(1);
            if t.error.is_none() {
                if res < 0 {
                    t.error = Some(format!("io_uring op failed: {}", io::Error::from_raw_os_error(-res)));
                } else if res.cast_unsigned() != want {
                    t.error = Some(format!("short transfer: {res} of {want} bytes"));
                }
            }
        }
        Ok(())
    }
}

impl Ring {
    /// Waits for every op still in flight, whatever its tag, and forgets their outcomes: a
    /// ring kept between batches starts the next one empty, and nothing writes into a
    /// buffer after this returns.
    pub fn drain(&mut self) {
        while !self.ops.is_empty() {
            // Only a ring the kernel no longer serves fails here (EINTR is retried).
            if self.reap(true).is_err() {
                break;
            }
        }
        self.tags.clear();
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Buffers may be freed right after us: never leave the kernel writing into them.
        self.drain();
    }
}

//! Flash-resident weights: a weight image on flash, served into a userfaultfd region under a
//! byte budget, with read-ahead of the groups the reader is about to need.
//!
//! mm does not know what the image holds: it is a sequence of **groups** (byte ranges starting
//! on slot boundaries) that a reader walks in a fixed **cycle** each pass (for a model: its
//! layers, then its output head), plus groups read only where touched (the embedding rows).
//! The policy follows ActiveFlow's hot cache for a reader that touches everything it reads:
//! within the budget, a fixed **hot** set stays resident (every pass reads all of it, so the
//! bytes kept are the bytes not re-read); the rest streams through a **window**: when the reader
//! announces group `g` ([`WeightPager::advise`]), a preload thread reads the groups from `g` on
//! with large O_DIRECT io_uring reads, dropping the oldest streamed slots to stay within the
//! window. A slot the reader touches before it is loaded is filled on the fault path, so a
//! misprediction is slow, never wrong.
//!
//! The image file: the groups' bytes from offset 0 (each slot's CRC-32C recorded), then a
//! trailer naming the source it was built from (length and CRC-32C of the model file), the
//! slot size and the group table. Every slot read from flash is checked against its CRC: a
//! modified or truncated image poisons the slot (readers get a SIGBUS naming it) rather than
//! handing out wrong weights, and a stale or damaged image is refused at open.

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)] // sizes are checked against limits far below 2^32 slots

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use uffd_handler::{Pager, Region, RegionId, SlotSource, SlotState, SourceError, Staging, UffdError};

use crate::ring::{Op, Ring};

const MAGIC: &[u8; 8] = b"LLMSWIM1";
const VERSION: u32 = 1;
/// Trailer sanity limits, checked before anything is allocated.
const MAX_GROUPS: usize = 1 << 16;
const MAX_SLOTS: usize = 1 << 24;

#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("weight image {path}: {what}")]
    Format { path: PathBuf, what: String },
    #[error("weight image {path} was built from another model file ({what}); rebuild it")]
    Stale { path: PathBuf, what: String },
    #[error("weight budget: {0}")]
    Budget(String),
    #[error(transparent)]
    Uffd(#[from] UffdError),
}

pub type Result<T> = std::result::Result<T, WeightError>;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> WeightError + '_ {
    move |source| WeightError::Io { path: path.to_path_buf(), source }
}

/// Identity of the model file an image was built from: its length and CRC-32C.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    pub len: u64,
    pub crc: u32,
}

impl Fingerprint {
    /// Reads the whole file once (then asks the kernel to drop it from the page cache: the
    /// point of paging weights is not to hold them twice).
    pub fn of(path: &Path) -> Result<Self> {
        let mut f = File::open(path).map_err(io_err(path))?;
        let mut buf = vec![0u8; 1 << 20];
        let (mut crc, mut len) = (0u32, 0u64);
        loop {
            let n = f.read(&mut buf).map_err(io_err(path))?;
            if n == 0 {
                break;
            }
            crc = crc32c::crc32c_append(crc, &buf[..n]);
            len += n as u64;
        }
        drop_cache(&f);
        Ok(Self { len, crc })
    }
}

fn drop_cache(f: &File) {
    // SAFETY: advisory call on our own open file.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

/// A group of the image: `len` bytes at `offset` (a multiple of the slot size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupSpan {
    pub offset: u64,
    pub len: u64,
}

/// What an image's trailer says.
#[derive(Debug, Clone)]
pub struct ImageInfo {
    pub source: Fingerprint,
    pub slot_size: usize,
    pub groups: Vec<GroupSpan>,
    /// Bytes of group data (a multiple of the slot size).
    pub data_len: usize,
    pub slot_crc: Vec<u32>,
}

impl ImageInfo {
    pub fn n_slots(&self) -> usize {
        self.slot_crc.len()
    }
    fn slots_of(&self, g: usize) -> std::ops::Range<usize> {
        let s = self.groups[g];
        let (a, b) = (s.offset as usize, (s.offset + s.len) as usize);
        a / self.slot_size..b.div_ceil(self.slot_size)
    }

    /// Reads and checks the trailer of the image at `path`.
    pub fn read(path: &Path) -> Result<Self> {
        let bad = |what: String| WeightError::Format { path: path.to_path_buf(), what };
        let f = File::open(path).map_err(io_err(path))?;
        let file_len = f.metadata().map_err(io_err(path))?.len();
        if file_len < 16 {
            return Err(bad(format!("{file_len} bytes: too short for a trailer")));
        }
        let mut tail = [0u8; 16];
        f.read_exact_at(&mut tail, file_len - 16).map_err(io_err(path))?;
        if &tail[8..] != MAGIC {
            return Err(bad("no trailer magic at the end (truncated, or not an image)".into()));
        }
        let tlen = u64::from_le_bytes(tail[..8].try_into().expect("8 bytes"));
        if tlen < 44 || tlen > file_len - 16 || tlen > (MAX_SLOTS * 4 + MAX_GROUPS * 16 + 64) as u64 {
            return Err(bad(format!("trailer length {tlen} does not fit the file ({file_len} bytes)")));
        }
        let mut t = vec![0u8; tlen as usize];
        let start = file_len - 16 - tlen;
        f.read_exact_at(&mut t, start).map_err(io_err(path))?;
        let (body, crc) = t.split_at(t.len() - 4);
        if crc32c::crc32c(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(bad("trailer checksum mismatch (damaged)".into()));
        }
        let mut r = body;
        let mut take = |n: usize| -> Result<&[u8]> {
            if r.len() < n {
                return Err(bad("trailer is short".into()));
            }
            let (a, b) = r.split_at(n);
            r = b;
            Ok(a)
        };
        let u32_ = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes"));
        let u64_ = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        let version = u32_(take(4)?);
        if version != VERSION {
            return Err(bad(format!("version {version}, this build reads {VERSION}")));
        }
        let slot_size = u32_(take(4)?) as usize;
        let source = Fingerprint { len: u64_(take(8)?), crc: u32_(take(4)?) };
        let data_len = u64_(take(8)?);
        let n_groups = u32_(take(4)?) as usize;
        let n_slots = u32_(take(4)?) as usize;
        if slot_size == 0 || !slot_size.is_multiple_of(uffd_handler::PAGE) || slot_size > 1 << 26 {
            return Err(bad(format!("slot size {slot_size} is not a page multiple up to 64 MiB")));
        }
        if n_groups > MAX_GROUPS || n_slots > MAX_SLOTS || data_len != (n_slots * slot_size) as u64 || data_len != start {
            return Err(bad(format!("{n_slots} slots of {slot_size} bytes, {data_len} data bytes, trailer at {start}: inconsistent")));
        }
        let mut groups = Vec::with_capacity(n_groups);
        for _ in 0..n_groups {
            let g = GroupSpan { offset: u64_(take(8)?), len: u64_(take(8)?) };
            if !g.offset.is_multiple_of(slot_size as u64) || g.offset.checked_add(g.len).is_none_or(|e| e > data_len) {
                return Err(bad(format!("group {g:?} is not slot-aligned inside the data")));
            }
            groups.push(g);
        }
        let slot_crc = (0..n_slots).map(|_| take(4).map(u32_)).collect::<Result<Vec<u32>>>()?;
        Ok(Self { source, slot_size, groups, data_len: data_len as usize, slot_crc })
    }
}

/// Writes an image: groups in increasing offset order, then [`ImageWriter::finish`]. The file
/// appears under its name only when complete (written to a temporary name, synced, renamed).
#[derive(Debug)]
pub struct ImageWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: std::io::BufWriter<File>,
    slot_size: usize,
    source: Fingerprint,
    groups: Vec<GroupSpan>,
    pos: usize,
    crc: u32,
    slot_crc: Vec<u32>,
}

impl ImageWriter {
    pub fn create(path: &Path, slot_size: usize, source: Fingerprint) -> Result<Self> {
        if slot_size == 0 || !slot_size.is_multiple_of(uffd_handler::PAGE) {
            return Err(WeightError::Budget(format!("slot size {slot_size} is not a page multiple")));
        }
        // Unique per writer: two threads (or processes) building the same image must not
        // share a temporary file; the rename makes whichever finishes last the image.
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let tmp = path.with_extension(format!("tmp{}.{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
        let f = File::create(&tmp).map_err(io_err(&tmp))?;
        Ok(Self {
            path: path.to_path_buf(),
            tmp,
            out: std::io::BufWriter::with_capacity(1 << 20, f),
            slot_size,
            source,
            groups: Vec::new(),
            pos: 0,
            crc: 0,
            slot_crc: Vec::new(),
        })
    }

    fn put(&mut self, mut b: &[u8]) -> Result<()> {
        while !b.is_empty() {
            let room = self.slot_size - self.pos % self.slot_size;
            let (now, rest) = b.split_at(room.min(b.len()));
            self.out.write_all(now).map_err(io_err(&self.tmp))?;
            self.crc = crc32c::crc32c_append(self.crc, now);
            self.pos += now.len();
            if self.pos.is_multiple_of(self.slot_size) {
                self.slot_crc.push(std::mem::take(&mut self.crc));
            }
            b = rest;
        }
        Ok(())
    }

    fn pad_to(&mut self, at: usize) -> Result<()> {
        let zeros = [0u8; 4096];
        while self.pos < at {
            let n = (at - self.pos).min(zeros.len());
            self.put(&zeros[..n])?;
        }
        Ok(())
    }

    /// Appends a group at `offset` (slot-aligned, not before the end of the previous one).
    pub fn group(&mut self, offset: usize, bytes: &[u8]) -> Result<()> {
        if !offset.is_multiple_of(self.slot_size) || offset < self.pos {
            return Err(WeightError::Format { path: self.path.clone(), what: format!("group at {offset} is out of order or unaligned") });
        }
        self.pad_to(offset)?;
        self.groups.push(GroupSpan { offset: offset as u64, len: bytes.len() as u64 });
        self.put(bytes)
    }

    pub fn finish(mut self) -> Result<ImageInfo> {
        let end = self.pos.next_multiple_of(self.slot_size);
        self.pad_to(end)?;
        let mut t = Vec::new();
        t.extend_from_slice(&VERSION.to_le_bytes());
        t.extend_from_slice(&(self.slot_size as u32).to_le_bytes());
        t.extend_from_slice(&self.source.len.to_le_bytes());
        t.extend_from_slice(&self.source.crc.to_le_bytes());
        t.extend_from_slice(&(self.pos as u64).to_le_bytes());
        t.extend_from_slice(&(self.groups.len() as u32).to_le_bytes());
        t.extend_from_slice(&(self.slot_crc.len() as u32).to_le_bytes());
        for g in &self.groups {
            t.extend_from_slice(&g.offset.to_le_bytes());
            t.extend_from_slice(&g.len.to_le_bytes());
        }
        for c in &self.slot_crc {
            t.extend_from_slice(&c.to_le_bytes());
        }
        t.extend_from_slice(&crc32c::crc32c(&t).to_le_bytes());
        t.extend_from_slice(&(t.len() as u64).to_le_bytes());
        t.extend_from_slice(MAGIC);
        self.out.write_all(&t).map_err(io_err(&self.tmp))?;
        self.out.flush().map_err(io_err(&self.tmp))?;
        let f = self.out.get_ref();
        f.sync_all().map_err(io_err(&self.tmp))?;
        drop_cache(f);
        std::fs::rename(&self.tmp, &self.path).map_err(io_err(&self.path))?;
        if let Some(dir) = self.path.parent() {
            let _ = File::open(dir).and_then(|d| d.sync_all());
        }
        Ok(ImageInfo {
            source: self.source,
            slot_size: self.slot_size,
            groups: std::mem::take(&mut self.groups),
            data_len: self.pos,
            slot_crc: std::mem::take(&mut self.slot_crc),
        })
    }
}

impl Drop for ImageWriter {
    fn drop(&mut self) {
        // A writer dropped before `finish` (an error) leaves no partial file behind.
        let _ = std::fs::remove_file(&self.tmp);
    }
}

/// Counters of a weight pager.
#[derive(Debug, Default)]
struct Counters {
    fault_slots: AtomicU64,
    preload_slots: AtomicU64,
    bytes_read: AtomicU64,
    evicted_slots: AtomicU64,
    crc_failures: AtomicU64,
    advised_slots: AtomicU64,
    advised_resident: AtomicU64,
    advised_landing: AtomicU64,
    prefetch_used: AtomicU64,
}

impl Counters {
    /// The counters with the pager's residency, hot bytes and budget.
    fn snapshot(&self, resident_bytes: usize, hot_bytes: usize, budget: usize) -> WeightStats {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        WeightStats {
            fault_slots: ld(&self.fault_slots),
            preload_slots: ld(&self.preload_slots),
            prefetch_used: ld(&self.prefetch_used),
            bytes_read: ld(&self.bytes_read),
            evicted_slots: ld(&self.evicted_slots),
            crc_failures: ld(&self.crc_failures),
            advised_slots: ld(&self.advised_slots),
            advised_resident: ld(&self.advised_resident),
            advised_landing: ld(&self.advised_landing),
            resident_bytes: resident_bytes as u64,
            hot_bytes: hot_bytes as u64,
            budget: budget as u64,
        }
    }
}

/// A snapshot of a weight pager's counters.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct WeightStats {
    /// Slots filled on the fault path (touched before any preload brought them).
    pub fault_slots: u64,
    /// Slots brought in by preloading.
    pub preload_slots: u64,
    /// Of those, slots the reader then named before they were evicted (sparse pager: the
    /// preload precision is `prefetch_used / preload_slots`).
    pub prefetch_used: u64,
    /// Bytes read from the image, both paths.
    pub bytes_read: u64,
    pub evicted_slots: u64,
    pub crc_failures: u64,
    /// Slots of announced groups, and how many were already resident when announced.
    pub advised_slots: u64,
    pub advised_resident: u64,
    /// Of the rest, how many the preload thread was reading (the reader waited for them).
    pub advised_landing: u64,
    pub resident_bytes: u64,
    pub hot_bytes: u64,
    pub budget: u64,
}

impl WeightStats {
    /// Share of the slots the reader announced that were resident when it got there.
    pub fn hit_rate(&self) -> f64 {
        if self.advised_slots == 0 {
            1.0
        } else {
            self.advised_resident as f64 / self.advised_slots as f64
        }
    }
}

/// Reads slots from the image with O_DIRECT and checks their CRC (the fault path).
struct ImageSource {
    path: PathBuf,
    file: File,
    info: Arc<ImageInfo>,
    counters: Arc<Counters>,
    /// Slots filled by faults since the policy last looked (it must account them).
    faulted: Mutex<Vec<usize>>,
    /// When recording ([`WeightPager::record_accesses`]): the slots the reader announced or
    /// faulted, in order.
    log: AccessLog,
}

/// The reader's accesses as slot ranges, kept only while recording (a flag read first, so
/// a pager that is not recording takes no lock for it).
#[derive(Debug, Default)]
struct AccessLog {
    on: std::sync::atomic::AtomicBool,
    ranges: Mutex<Vec<std::ops::Range<usize>>>,
}

impl AccessLog {
    fn push(&self, r: std::ops::Range<usize>) {
        if self.on.load(Ordering::Relaxed) {
            self.ranges.lock().unwrap_or_else(|e| e.into_inner()).push(r);
        }
    }
}

impl SlotSource for ImageSource {
    fn fill(&self, _region: RegionId, slot: usize, buf: &mut [u8]) -> std::result::Result<usize, SourceError> {
        let ss = self.info.slot_size;
        let off = (slot * ss) as u64;
        let mut done = 0;
        while done < ss {
            match self.file.read_at(&mut buf[done..ss], off + done as u64) {
                Ok(0) => return Err(format!("{}: slot {slot}: image truncated at byte {}", self.path.display(), off + done as u64).into()),
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("{}: slot {slot}: {e}", self.path.display()).into()),
            }
        }
        self.counters.bytes_read.fetch_add(ss as u64, Ordering::Relaxed);
        if crc32c::crc32c(&buf[..ss]) != self.info.slot_crc[slot] {
            self.counters.crc_failures.fetch_add(1, Ordering::Relaxed);
            return Err(format!("{}: slot {slot}: checksum mismatch (the image was modified)", self.path.display()).into());
        }
        self.counters.fault_slots.fetch_add(1, Ordering::Relaxed);
        self.faulted.lock().unwrap_or_else(|e| e.into_inner()).push(slot);
        self.log.push(slot..slot + 1);
        Ok(ss)
    }
}

/// How to page an image.
#[derive(Debug, Clone)]
pub struct WeightOptions {
    /// Resident bytes allowed (hot set + streaming window).
    pub budget: usize,
    /// Groups the reader walks, in order, every pass; groups not listed are read only where
    /// touched (fault path).
    pub cycle: Vec<usize>,
    /// Read ahead of the reader (else every miss is a fault).
    pub preload: bool,
}

struct Policy {
    budget: usize,
    window: usize,
    hot: Vec<bool>,
    hot_bytes: usize,
    /// Non-hot resident slots, oldest first.
    streamed: VecDeque<usize>,
}

struct Shared {
    region: Region,
    src: Arc<ImageSource>,
    info: Arc<ImageInfo>,
    cycle: Vec<usize>,
    /// Position of each group in the cycle.
    pos_in_cycle: Vec<Option<usize>>,
    policy: Mutex<Policy>,
    counters: Arc<Counters>,
    preload: bool,
    /// Sequence number of the last announcement whose own group the preloader has dealt with.
    served: Mutex<u64>,
    served_cv: Condvar,
}

/// What both pagers start from: the image's trailer checked against the model file, the
/// image opened O_DIRECT as the fault path's source, and a fresh region over its slots.
type Opened = (Arc<ImageInfo>, Arc<ImageSource>, Arc<Counters>, Pager, Region);

fn open_image(path: &Path, source: Fingerprint) -> Result<Opened> {
    let info = Arc::new(ImageInfo::read(path)?);
    if info.source != source {
        return Err(WeightError::Stale {
            path: path.to_path_buf(),
            what: format!(
                "image from {} bytes crc {:08x}, model file is {} bytes crc {:08x}",
                info.source.len, info.source.crc, source.len, source.crc
            ),
        });
    }
    let file = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).map_err(io_err(path))?;
    let counters = Arc::new(Counters::default());
    let src = Arc::new(ImageSource {
        path: path.to_path_buf(),
        file,
        info: Arc::clone(&info),
        counters: Arc::clone(&counters),
        faulted: Mutex::new(Vec::new()),
        log: AccessLog::default(),
    });
    // UFFDIO_COPY, not MOVE: a moved page leaves the staging buffer, and the next read
    // into it must fault in and zero a fresh page (and MOVE flushes TLBs across the
    // reader's cores); copying from a staging buffer that stays populated costs less.
    let pager = Pager::with_options(uffd_handler::PagerOptions { allow_move: false })?;
    let region = pager.region_with(info.slot_size, info.n_slots().max(1), Arc::clone(&src) as Arc<dyn SlotSource>, false)?;
    Ok((info, src, counters, pager, region))
}

/// A weight image served from flash into a userfaultfd region under a budget.
pub struct WeightPager {
    shared: Arc<Shared>,
    tx: Mutex<Option<Sender<(u64, usize)>>>,
    seq: AtomicU64,
    thread: Option<JoinHandle<()>>,
    _pager: Pager,
}

impl std::fmt::Debug for WeightPager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightPager").field("path", &self.shared.src.path).field("stats", &self.stats()).finish()
    }
}

impl WeightPager {
    /// Opens the image at `path`, built from the model file with fingerprint `source`, and
    /// maps it into a fresh userfaultfd region (nothing resident yet).
    pub fn open(path: &Path, source: Fingerprint, opts: WeightOptions) -> Result<Self> {
        let (info, src, counters, pager, region) = open_image(path, source)?;
        if let Some(&g) = opts.cycle.iter().find(|&&g| g >= info.groups.len()) {
            return Err(WeightError::Budget(format!("cycle names group {g}, the image has {}", info.groups.len())));
        }
        let mut pos_in_cycle = vec![None; info.groups.len()];
        for (i, &g) in opts.cycle.iter().enumerate() {
            pos_in_cycle[g] = Some(i);
        }
        let policy = Policy { budget: 0, window: 0, hot: vec![false; info.n_slots()], hot_bytes: 0, streamed: VecDeque::new() };
        let shared = Arc::new(Shared {
            region,
            src,
            info,
            cycle: opts.cycle,
            pos_in_cycle,
            policy: Mutex::new(policy),
            counters,
            preload: opts.preload,
            served: Mutex::new(0),
            served_cv: Condvar::new(),
        });
        shared.set_budget(opts.budget)?;
        let (tx, rx) = channel();
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("llms-weights".into())
            .spawn(move || preloader(&s, &rx))
            .map_err(|e| WeightError::Io { path: path.to_path_buf(), source: e })?;
        Ok(Self { shared, tx: Mutex::new(Some(tx)), seq: AtomicU64::new(0), thread: Some(thread), _pager: pager })
    }

    /// The image's bytes as the reader sees them (paged on access).
    pub fn bytes(&self) -> &[u8] {
        let len = self.shared.info.data_len;
        // SAFETY: the region maps at least `data_len` bytes for as long as `self` lives; its
        // contents are read-only image bytes served by the pager (or SIGBUS if unreadable).
        unsafe { std::slice::from_raw_parts(self.shared.region.slot_ptr(0), len) }
    }

    pub fn info(&self) -> &ImageInfo {
        &self.shared.info
    }

    /// The reader is about to read group `g`: counts what is already resident and lets the
    /// preload thread read ahead from there. Returns false when `g` is not all in yet and is
    /// being preloaded: the reader should [`WeightPager::wait`] for it (one large read beats
    /// faulting its slots in one by one; the groups after it keep loading while it computes).
    pub fn advise(&self, g: usize) -> bool {
        let sh = &self.shared;
        let Some(span) = sh.info.groups.get(g) else { return true };
        if span.len == 0 {
            return true;
        }
        let slots = sh.info.slots_of(g);
        sh.src.log.push(slots.clone());
        let resident = sh.region.resident_in(slots.clone());
        sh.counters.advised_slots.fetch_add(slots.len() as u64, Ordering::Relaxed);
        sh.counters.advised_resident.fetch_add(resident as u64, Ordering::Relaxed);
        // Nothing to load or to account: this group and the next are in and no fault added a
        // slot. (The common case when the cycle fits: keep the preload thread asleep, it would
        // take a core from the reader.)
        if resident == slots.len() {
            let next = sh.pos_in_cycle[g].map(|i| sh.cycle[(i + 1) % sh.cycle.len()]);
            let next_in = next.is_none_or(|n| {
                let r = sh.info.slots_of(n);
                sh.region.resident_in(r.clone()) == r.len()
            });
            if next_in && sh.src.faulted.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
                return true;
            }
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let sent = self.tx.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|tx| tx.send((seq, g)).is_ok());
        !sent || !sh.preload || resident == slots.len() || sh.pos_in_cycle[g].is_none()
    }

    /// Starts (or stops) recording what the reader reads: every announced group's slots and
    /// every slot a fault filled (the embedding rows), in order — the sequence
    /// [`crate::pagecache::LruSim`] replays to tell what a page cache of the same size would
    /// have read. A reader of packed groups reads each announced group whole.
    pub fn record_accesses(&self, on: bool) {
        self.shared.src.log.on.store(on, Ordering::Relaxed);
    }

    /// The accesses recorded since the last call (slot ranges, in order).
    pub fn take_accesses(&self) -> Vec<std::ops::Range<usize>> {
        std::mem::take(&mut *self.shared.src.log.ranges.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Waits until the preload thread has dealt with the last announced group.
    pub fn wait(&self, _g: usize) {
        let seq = self.seq.load(Ordering::Relaxed);
        let sh = &self.shared;
        let mut served = sh.served.lock().unwrap_or_else(|e| e.into_inner());
        while *served < seq {
            let (s, timeout) = sh.served_cv.wait_timeout(served, std::time::Duration::from_millis(200)).unwrap_or_else(|e| e.into_inner());
            served = s;
            // A preloader that died (it never should) must not hang the reader: faults serve.
            if timeout.timed_out() && self.thread.as_ref().is_none_or(JoinHandle::is_finished) {
                return;
            }
        }
    }

    /// Changes the budget (pressure): the hot set is re-chosen and the excess dropped now.
    pub fn set_budget(&self, budget: usize) -> Result<()> {
        self.shared.set_budget(budget)
    }

    pub fn resident_bytes(&self) -> usize {
        self.shared.region.resident_bytes()
    }

    /// Bytes read from the image so far ([`SparsePager::bytes_read`]).
    pub fn bytes_read(&self) -> u64 {
        self.shared.counters.bytes_read.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> WeightStats {
        let p = self.shared.policy.lock().unwrap_or_else(|e| e.into_inner());
        self.shared.counters.snapshot(self.shared.region.resident_bytes(), p.hot_bytes, p.budget)
    }
}

impl Drop for WeightPager {
    fn drop(&mut self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn group_bytes(&self, g: usize) -> usize {
        self.info.slots_of(g).len() * self.info.slot_size
    }

    /// Hot set and window for `budget`. When the whole cycle fits (with room for a few slots
    /// of the touched-only groups), all of it is hot. Otherwise the window holds the two
    /// largest consecutive cycle groups (the one being read and the one being loaded) plus a
    /// few slots, and the rest of the budget is the hot set, taken from the start of the cycle.
    fn set_budget(&self, budget: usize) -> Result<()> {
        let ss = self.info.slot_size;
        if budget < ss {
            return Err(WeightError::Budget(format!("{budget} bytes cannot hold one {ss}-byte slot")));
        }
        let sizes: Vec<usize> = self.cycle.iter().map(|&g| self.group_bytes(g)).collect();
        let cycle_bytes: usize = sizes.iter().sum();
        let (window, cap) = if cycle_bytes <= budget {
            // Touched-only slots (embedding rows) live in what is left, possibly nothing: then
            // each is dropped at the next announcement (one slot over budget at most).
            (budget - cycle_bytes, usize::MAX)
        } else {
            stream_split(&sizes, ss, budget).unwrap_or((stream_window(&sizes, ss).min(budget), usize::MAX))
        };
        let mut p = self.policy.lock().unwrap_or_else(|e| e.into_inner());
        p.budget = budget;
        p.window = window;
        p.hot.iter_mut().for_each(|h| *h = false);
        let mut left = budget - window;
        // Each group's head beyond its streamed tail of `cap` bytes, then what the budget has
        // left from the start of the cycle.
        for (&g, &size) in self.cycle.iter().zip(&sizes) {
            for s in self.info.slots_of(g).take(size.saturating_sub(cap) / ss) {
                if left >= ss {
                    p.hot[s] = true;
                    left -= ss;
                }
            }
        }
        'pick: for &g in &self.cycle {
            for s in self.info.slots_of(g) {
                if left < ss {
                    break 'pick;
                }
                if !p.hot[s] {
                    p.hot[s] = true;
                    left -= ss;
                }
            }
        }
        p.hot_bytes = budget - window - left;
        // Slots that were resident and are no longer hot become streamed (oldest first).
        let was_hot: Vec<usize> =
            (0..self.info.n_slots()).filter(|&s| !p.hot[s] && !p.streamed.contains(&s) && self.is_resident(s)).collect();
        for s in was_hot.into_iter().rev() {
            p.streamed.push_front(s);
        }
        let Policy { hot, streamed, .. } = &mut *p;
        streamed.retain(|&s| !hot[s]);
        self.shrink(&mut p, 0, &[]);
        Ok(())
    }

    fn is_resident(&self, s: usize) -> bool {
        self.region.state(s).is_ok_and(|st| st == SlotState::Resident)
    }

    /// Takes in the slots faults filled, then drops the oldest streamed slots (not in `keep`)
    /// until `incoming` more bytes fit the window.
    fn shrink(&self, p: &mut Policy, incoming: usize, keep: &[std::ops::Range<usize>]) {
        let faulted = std::mem::take(&mut *self.src.faulted.lock().unwrap_or_else(|e| e.into_inner()));
        for s in faulted {
            if !p.hot[s] {
                p.streamed.push_back(s);
            }
        }
        let ss = self.info.slot_size;
        let mut skipped = VecDeque::new();
        let mut batch = Vec::new();
        while (p.streamed.len() + skipped.len()) * ss + incoming > p.window {
            let Some(s) = p.streamed.pop_front() else { break };
            if keep.iter().any(|r| r.contains(&s)) {
                skipped.push_back(s);
                continue;
            }
            batch.push(s);
        }
        // One batch (streamed slots are mostly whole groups: a few long runs). A slot a
        // fault is filling right now stays; the fault path reports it.
        let mut gone = Vec::new();
        let _ = self.region.evict_many(&batch, &mut gone);
        self.counters.evicted_slots.fetch_add(gone.len() as u64, Ordering::Relaxed);
        while let Some(s) = skipped.pop_back() {
            p.streamed.push_front(s);
        }
    }
}

/// The streaming window of a cycle whose groups take `sizes` bytes (whole slots, in cycle
/// order) when it does not fit the budget: the two largest consecutive groups (the one being
/// read and the one being loaded) and 4 slots. What the hot set gives up at most (the pager
/// and the planner cap each group's streamed part when the budget allows, [`stream_split`]);
/// the pager falls back to it when no split fits.
pub fn stream_window(sizes: &[usize], slot: usize) -> usize {
    let n = sizes.len();
    let pair = (0..n).map(|i| sizes[i] + sizes[(i + 1) % n]).max().unwrap_or(0);
    pair + 4 * slot
}

/// How a cycle of groups taking `sizes` bytes (whole slots, in cycle order) streams within
/// `budget` when it does not fit: each group streams at most its last `cap` bytes and keeps the
/// rest hot, and the window holds the two largest consecutive streamed parts and 4 slots.
/// Returns `(window, cap)` with the smallest window for which the groups' hot heads and the
/// window fit the budget (the rest of the budget is hot too), `None` when none does.
/// Streaming whole groups ([`stream_window`]) costs the two largest consecutive groups: at the
/// 7B shape the feed-forward's (72 MiB of a 1990 MiB budget); capping every group's streamed
/// part spreads the hot set over all of them so the window is two caps instead.
pub fn stream_split(sizes: &[usize], slot: usize, budget: usize) -> Option<(usize, usize)> {
    let n = sizes.len();
    let largest = sizes.iter().copied().max()?;
    // Scanning caps upwards, the first that fits has the smallest window (the window only
    // grows with the cap).
    (1..=largest.div_ceil(slot.max(1))).map(|k| k * slot).find_map(|cap| {
        let part = |i: usize| sizes[i % n].min(cap);
        let window = (0..n).map(|i| part(i) + part(i + 1)).max().unwrap_or(0) + 4 * slot;
        let hot: usize = sizes.iter().map(|&s| s.saturating_sub(cap)).sum();
        (hot + window <= budget).then_some((window, cap))
    })
}

/// The preload thread: for each announced group, makes the window's worth of groups from it
/// on resident, in cycle order, with one O_DIRECT read per run of missing slots.
fn preloader(s: &Shared, rx: &Receiver<(u64, usize)>) {
    let ss = s.info.slot_size;
    let max_group = s.cycle.iter().map(|&g| s.group_bytes(g)).max().unwrap_or(ss).max(ss);
    let Ok(mut staging) = Staging::new(max_group) else { return };
    let Ok(mut ring) = Ring::new(64) else { return };
    let latest = |mut g: (u64, usize)| {
        while let Ok(next) = rx.try_recv() {
            g = next;
        }
        g
    };
    let mut next = None;
    loop {
        // Only the latest announcement matters.
        let (seq, g) = match next.take() {
            Some(m) => latest(m),
            None => match rx.recv() {
                Ok(m) => latest(m),
                Err(_) => return,
            },
        };
        let serve = |s: &Shared| {
            let mut served = s.served.lock().unwrap_or_else(|e| e.into_inner());
            *served = (*served).max(seq);
            s.served_cv.notify_all();
        };
        let Some(at) = s.pos_in_cycle.get(g).copied().flatten() else {
            // Not a cycle group: just keep the window.
            let mut p = s.policy.lock().unwrap_or_else(|e| e.into_inner());
            s.shrink(&mut p, 0, &[]);
            drop(p);
            serve(s);
            continue;
        };
        // The groups to have resident: from `g` on while their streamed bytes fit the window.
        let mut targets = Vec::new();
        {
            let p = s.policy.lock().unwrap_or_else(|e| e.into_inner());
            let mut bytes = 0;
            for i in 0..s.cycle.len() {
                let tg = s.cycle[(at + i) % s.cycle.len()];
                let need: usize = s.info.slots_of(tg).filter(|&x| !p.hot[x]).count() * ss;
                if i > 0 && bytes + need > p.window {
                    break;
                }
                bytes += need;
                targets.push(tg);
                if !s.preload {
                    break;
                }
            }
        }
        let keep: Vec<std::ops::Range<usize>> = targets.iter().map(|&t| s.info.slots_of(t)).collect();
        for (i, &tg) in targets.iter().enumerate() {
            let missing: Vec<usize> = s.info.slots_of(tg).filter(|&x| !s.is_resident(x)).collect();
            {
                let mut p = s.policy.lock().unwrap_or_else(|e| e.into_inner());
                let incoming = missing.iter().filter(|&&x| !p.hot[x]).count() * ss;
                s.shrink(&mut p, incoming, &keep[..=i]);
            }
            if s.preload && !missing.is_empty() {
                load_runs(s, &mut ring, &mut staging, &missing);
            }
            if i == 0 {
                serve(s);
            }
            // A newer announcement: start over from there.
            if let Ok(n) = rx.try_recv() {
                next = Some(n);
                break;
            }
        }
    }
}

/// Reads runs of consecutive missing slots into `staging` (io_uring, O_DIRECT, one op per
/// run), checks each slot's CRC and installs it; a slot that fails is left to the fault path
/// (which poisons it with a message).
fn load_runs(s: &Shared, ring: &mut Ring, staging: &mut Staging, slots: &[usize]) {
    read_install(&s.region, &s.src, ring, staging, slots, &mut |slot| {
        s.counters.preload_slots.fetch_add(1, Ordering::Relaxed);
        let mut p = s.policy.lock().unwrap_or_else(|e| e.into_inner());
        if !p.hot[slot] {
            p.streamed.push_back(slot);
        }
    });
}

/// Reads `slots` (increasing) from the image: runs of consecutive slots packed one after the
/// other into `staging`, one io_uring op per run (per MiB), as many runs at a time as the
/// staging holds; each slot's CRC is checked and it is installed (UFFDIO_COPY), then
/// `installed(slot)`. A slot that fails its CRC (or a batch whose read fails) is left
/// missing: the fault path reads it again and poisons it with a message.
fn read_install(
    region: &Region,
    src: &ImageSource,
    ring: &mut Ring,
    staging: &mut Staging,
    slots: &[usize],
    installed: &mut dyn FnMut(usize),
) {
    let done = &mut Vec::new();
    let ss = src.info.slot_size;
    let fd = src.file.as_raw_fd();
    let room = staging.len() / ss;
    let mut i = 0;
    while i < slots.len() && room > 0 {
        let mut ops = Vec::new();
        let first = i;
        let mut used = 0;
        while i < slots.len() && used < room {
            let mut j = i + 1;
            while j < slots.len() && slots[j] == slots[j - 1] + 1 && used + (j - i) < room {
                j += 1;
            }
            let len = (j - i) * ss;
            let buf = staging.as_mut_slice()[used * ss..used * ss + len].as_mut_ptr();
            let mut done = 0;
            while done < len {
                // One op per MiB so the device sees several requests at once.
                let n = (len - done).min(1 << 20);
                // SAFETY: pointer inside the staging buffer, valid until the wait below.
                ops.push(Op { fd, offset: (slots[i] * ss + done) as u64, buf: unsafe { buf.add(done) }, len: n as u32, write: false });
                done += n;
            }
            used += j - i;
            i = j;
        }
        // SAFETY: the staging buffer outlives the wait and nothing else touches it meanwhile.
        if unsafe { ring.submit(0, &ops) }.is_err() || ring.wait(0).is_err() {
            return;
        }
        let read = &slots[first..i];
        src.counters.bytes_read.fetch_add((read.len() * ss) as u64, Ordering::Relaxed);
        let buf = &staging.as_mut_slice()[..read.len() * ss];
        // Runs of consecutive slots that pass their CRC go in with one copy each.
        let mut k = 0;
        while k < read.len() {
            if crc32c::crc32c(&buf[k * ss..(k + 1) * ss]) != src.info.slot_crc[read[k]] {
                src.counters.crc_failures.fetch_add(1, Ordering::Relaxed);
                k += 1;
                continue;
            }
            let mut e = k + 1;
            while e < read.len() && read[e] == read[e - 1] + 1 && crc32c::crc32c(&buf[e * ss..(e + 1) * ss]) == src.info.slot_crc[read[e]] {
                e += 1;
            }
            done.clear();
            if region.copy_run(read[k], &buf[k * ss..e * ss], done).is_ok() {
                done.iter().for_each(|&s| installed(s));
            }
            k = e;
        }
    }
}

/// How to page a channel-major image ([`SparsePager`]).
#[derive(Debug, Clone)]
pub struct SparseOptions {
    /// Resident bytes allowed.
    pub budget: usize,
    /// Read what the reader predicts ([`SparsePager::prefetch`]); else only what it names.
    pub preload: bool,
    /// Announcements a predicted slot not yet named stays protected from eviction (about the
    /// announcements of the layers a prediction covers).
    pub horizon: u32,
    /// Use counts are halved every this many announcements, so the cache follows what the
    /// current context uses (ActiveFlow §4.2's context-level cache).
    pub decay: u32,
    /// Bytes of the budget predictions may hold while not yet named (the room a plan sets
    /// aside beside its cache, ActiveFlow's `M_cl`): within it a prediction evicts the least
    /// used cached slots. Beyond it (or with 0) predictions only use free budget.
    pub reserve: usize,
}

/// LFU state of a [`SparsePager`].
struct Lfu {
    budget_slots: usize,
    /// Times each slot was named.
    uses: Vec<u32>,
    /// The announcement that last named (or, for a predicted slot, predicted) each slot.
    stamp: Vec<u32>,
    /// Loaded by a prediction and not yet named.
    predicted: Vec<bool>,
    /// Slots predicted and not yet named, resident or being read.
    n_predicted: usize,
    /// Being read (by either loader): the reader waits for the preload thread's rather than
    /// reading them a second time, and predictions skip the reader's.
    inflight: Vec<bool>,
    reserve_slots: usize,
    resident: Vec<bool>,
    /// Resident slots, plus those being read (reserved, so two loaders never overshoot).
    n_resident: usize,
    tick: u32,
    /// Victims in eviction order, from the last scan (taken until used up, then rescanned).
    victims: Vec<usize>,
}

struct SparseShared {
    region: Region,
    src: Arc<ImageSource>,
    info: Arc<ImageInfo>,
    counters: Arc<Counters>,
    lfu: Mutex<Lfu>,
    /// Signalled when a preload batch lands.
    landed: Condvar,
    horizon: u32,
    decay: u32,
}

/// A channel-major weight image served from flash under a budget, slot by slot (4 KiB),
/// as the reader names what it reads. Implements ActiveFlow's loading (§3-4) on LLMS's
/// regions: the reader names the bytes a layer needs now ([`SparsePager::need`]: the missing
/// ones are read in one batch while it waits) and the bytes it predicts for the layers ahead
/// ([`SparsePager::prefetch`]: read by a preload thread into free budget while it computes);
/// within the budget the **most often named** slots stay resident (LFU with decay, ties kept
/// by slot order so a cyclic reader keeps a fixed set instead of thrashing) and predicted
/// slots not yet named are evicted last for `horizon` announcements.
pub struct SparsePager {
    shared: Arc<SparseShared>,
    tx: Mutex<Option<Sender<Vec<usize>>>>,
    /// The reader's own loader: ring, staging, and the slot lists of one announcement.
    demand: Mutex<Loader>,
    thread: Option<JoinHandle<()>>,
    _pager: Pager,
}

struct Loader {
    ring: Ring,
    staging: Staging,
    slots: Vec<usize>,
    missing: Vec<usize>,
    /// Named slots the preload thread is reading.
    landing: Vec<usize>,
}

impl Loader {
    fn new(path: &Path) -> Result<Self> {
        // One batch of reads: a layer's share is at most a few MiB (more takes several).
        Ok(Self {
            ring: Ring::new(256).map_err(io_err(path))?,
            staging: Staging::new(4 << 20)?,
            slots: Vec::new(),
            missing: Vec::new(),
            landing: Vec::new(),
        })
    }
}

impl std::fmt::Debug for SparsePager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SparsePager").field("path", &self.shared.src.path).field("stats", &self.stats()).finish()
    }
}

/// The slots a set of byte ranges (sorted by offset) touches, increasing, each once.
fn slots_of_ranges(ranges: &[(usize, usize)], ss: usize, n_slots: usize, out: &mut Vec<usize>) {
    out.clear();
    for &(at, len) in ranges {
        if len == 0 {
            continue;
        }
        let (a, b) = (at / ss, ((at + len).div_ceil(ss)).min(n_slots));
        for s in a..b {
            match out.last() {
                Some(&l) if s == l => {}
                Some(&l) if s < l => {
                    // Out of order: keep the list sorted, each slot once.
                    let i = out.partition_point(|&x| x < s);
                    if out.get(i) != Some(&s) {
                        out.insert(i, s);
                    }
                }
                _ => out.push(s),
            }
        }
    }
}

impl SparsePager {
    /// Opens the image at `path` (built from the model file with fingerprint `source`) in a
    /// fresh userfaultfd region with nothing resident. The image's slots should be small (a
    /// page or a few): they are the unit of reading and of eviction.
    pub fn open(path: &Path, source: Fingerprint, opts: &SparseOptions) -> Result<Self> {
        let (info, src, counters, pager, region) = open_image(path, source)?;
        let n = region.n_slots();
        let lfu = Lfu {
            budget_slots: 0,
            uses: vec![0; n],
            stamp: vec![0; n],
            predicted: vec![false; n],
            n_predicted: 0,
            inflight: vec![false; n],
            reserve_slots: 0,
            resident: vec![false; n],
            n_resident: 0,
            tick: 0,
            victims: Vec::new(),
        };
        let shared = Arc::new(SparseShared {
            region,
            src,
            info,
            counters,
            lfu: Mutex::new(lfu),
            landed: Condvar::new(),
            horizon: opts.horizon.max(1),
            decay: opts.decay.max(1),
        });
        shared.set_budget(opts.budget)?;
        shared.set_reserve(opts.reserve);
        let demand = Mutex::new(Loader::new(path)?);
        let (tx, thread) = if opts.preload {
            let (tx, rx) = channel::<Vec<usize>>();
            let (s, mut ld) = (Arc::clone(&shared), Loader::new(path)?);
            let thread = std::thread::Builder::new()
                .name("llms-weights".into())
                .spawn(move || {
                    while let Ok(slots) = rx.recv() {
                        ld.slots = slots;
                        s.load(&mut ld, false, &|| {});
                    }
                })
                .map_err(|e| WeightError::Io { path: path.to_path_buf(), source: e })?;
            (Some(tx), Some(thread))
        } else {
            (None, None)
        };
        Ok(Self { shared, tx: Mutex::new(tx), demand, thread, _pager: pager })
    }

    /// The image's bytes as the reader sees them (paged on access).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: as `WeightPager::bytes`.
        unsafe { std::slice::from_raw_parts(self.shared.region.slot_ptr(0), self.shared.info.data_len) }
    }

    pub fn info(&self) -> &ImageInfo {
        &self.shared.info
    }

    /// The reader reads `ranges` (byte ranges of the image) next: counts them as used and
    /// reads the missing slots in one batch, calling `before_wait` first.
    pub fn need(&self, ranges: &[(usize, usize)], before_wait: &dyn Fn()) {
        let sh = &self.shared;
        let mut ld = self.demand.lock().unwrap_or_else(|e| e.into_inner());
        slots_of_ranges(ranges, sh.info.slot_size, sh.region.n_slots(), &mut ld.slots);
        sh.load(&mut ld, true, before_wait);
    }

    /// The reader will probably read `ranges` soon: the preload thread reads what is missing.
    pub fn prefetch(&self, ranges: &[(usize, usize)]) {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = tx.as_ref() else { return };
        let (mut slots, mut missing) = (Vec::new(), Vec::new());
        slots_of_ranges(ranges, self.shared.info.slot_size, self.shared.region.n_slots(), &mut slots);
        // Wake the preload thread only for something to read: it would take a core from
        // the reader.
        self.shared.region.evicted_of(&slots, &mut missing);
        if !missing.is_empty() {
            let _ = tx.send(missing);
        }
    }

    /// Changes the budget (pressure): the least used slots beyond it are dropped now.
    pub fn set_budget(&self, budget: usize) -> Result<()> {
        self.shared.set_budget(budget)
    }

    /// Sets how many bytes of the budget predictions may hold ([`SparseOptions::reserve`]).
    pub fn set_reserve(&self, bytes: usize) {
        self.shared.set_reserve(bytes);
    }

    pub fn resident_bytes(&self) -> usize {
        self.shared.region.resident_bytes()
    }

    /// Bytes read from the image so far, counted before they are installed (a lock-free
    /// load: a monitor may sample it as often as it likes).
    pub fn bytes_read(&self) -> u64 {
        self.shared.counters.bytes_read.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> WeightStats {
        let l = self.shared.lfu.lock().unwrap_or_else(|e| e.into_inner());
        self.shared.counters.snapshot(self.shared.region.resident_bytes(), 0, l.budget_slots * self.shared.info.slot_size)
    }
}

impl Drop for SparsePager {
    fn drop(&mut self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl SparseShared {
    fn set_budget(&self, budget: usize) -> Result<()> {
        let ss = self.info.slot_size;
        if budget < ss {
            return Err(WeightError::Budget(format!("{budget} bytes cannot hold one {ss}-byte slot")));
        }
        let mut l = self.lfu.lock().unwrap_or_else(|e| e.into_inner());
        l.budget_slots = budget / ss;
        self.make_room(&mut l, 0, false);
        Ok(())
    }

    fn set_reserve(&self, bytes: usize) {
        self.lfu.lock().unwrap_or_else(|e| e.into_inner()).reserve_slots = bytes / self.info.slot_size;
    }

    /// Whether slot `s` was predicted and not yet named within the horizon.
    fn fresh(&self, l: &Lfu, s: usize) -> bool {
        l.predicted[s] && l.tick.wrapping_sub(l.stamp[s]) <= self.horizon
    }

    /// Takes in the slots faults filled, then evicts until `incoming` more slots fit the
    /// budget: least used first — ties: the later slot, so a reader that uses everything
    /// alike keeps a fixed set resident and streams the rest rather than evicting what it
    /// needs next — fresh predictions last, the current announcement's never. The order
    /// comes from one scan, used until it runs out. For a prediction (`for_prediction`) fresh
    /// predictions are never evicted: one prediction must not push out another.
    fn make_room(&self, l: &mut Lfu, incoming: usize, for_prediction: bool) {
        for s in std::mem::take(&mut *self.src.faulted.lock().unwrap_or_else(|e| e.into_inner())) {
            if !std::mem::replace(&mut l.resident[s], true) {
                l.n_resident += 1;
            }
        }
        let tick = l.tick;
        let named_now = |l: &Lfu, s: usize| l.stamp[s] == tick && !l.predicted[s];
        // A scan that finds nothing to evict ends it: everything left is named now.
        let mut evicted_since_scan = true;
        let mut batch = Vec::new();
        while l.n_resident + incoming > l.budget_slots {
            let Some(s) = l.victims.pop() else {
                if !evicted_since_scan {
                    break;
                }
                evicted_since_scan = false;
                let mut c: Vec<(bool, u32, std::cmp::Reverse<usize>)> = (0..l.resident.len())
                    .filter(|&s| l.resident[s] && !named_now(l, s))
                    .map(|s| (self.fresh(l, s), l.uses[s], std::cmp::Reverse(s)))
                    .collect();
                // The first 1/16 of the budget in order, popped from the end.
                let k = (l.budget_slots / 16).max(1).min(c.len());
                if k > 0 && k < c.len() {
                    c.select_nth_unstable(k - 1);
                }
                c.truncate(k);
                c.sort_unstable();
                l.victims = c.into_iter().rev().map(|(_, _, std::cmp::Reverse(s))| s).collect();
                continue;
            };
            if !l.resident[s] || named_now(l, s) || (for_prediction && self.fresh(l, s)) {
                continue;
            }
            // Taken from the count now, dropped below in one batch.
            l.resident[s] = false;
            l.n_resident -= 1;
            batch.push(s);
            evicted_since_scan = true;
        }
        self.drop_slots(l, &batch);
    }

    /// Evicts `slots` (taken off the books by the caller) in one batch; one a fault is
    /// filling right now stays and is counted again.
    fn drop_slots(&self, l: &mut Lfu, slots: &[usize]) {
        if slots.is_empty() {
            return;
        }
        let mut gone = Vec::with_capacity(slots.len());
        if self.region.evict_many(slots, &mut gone).is_err() {
            gone.clear();
        }
        for &s in &gone {
            if std::mem::take(&mut l.predicted[s]) {
                l.n_predicted -= 1;
            }
        }
        self.counters.evicted_slots.fetch_add(gone.len() as u64, Ordering::Relaxed);
        if gone.len() < slots.len() {
            gone.sort_unstable();
            for &s in slots {
                if gone.binary_search(&s).is_err() {
                    l.resident[s] = true;
                    l.n_resident += 1;
                }
            }
        }
    }

    /// Makes the evicted ones of `ld.slots` resident. Named (`need`): a new announcement —
    /// uses counted, hits counted, room made by evicting. Predicted: only into free budget,
    /// a prediction never evicts the cache.
    fn load(&self, ld: &mut Loader, named: bool, before_wait: &dyn Fn()) {
        let Loader { ring, staging, slots, missing, landing } = ld;
        missing.clear();
        landing.clear();
        {
            let mut l = self.lfu.lock().unwrap_or_else(|e| e.into_inner());
            self.region.evicted_of(slots, missing);
            if named {
                l.tick = l.tick.wrapping_add(1);
                if l.tick.is_multiple_of(self.decay) {
                    l.uses.iter_mut().for_each(|u| *u /= 2);
                }
                let tick = l.tick;
                let mut used = 0;
                for &s in slots.iter() {
                    l.uses[s] = l.uses[s].saturating_add(1);
                    l.stamp[s] = tick;
                    if std::mem::take(&mut l.predicted[s]) {
                        l.n_predicted -= 1;
                        used += 1;
                    }
                }
                // What the preload thread is reading now is waited for, not read twice.
                missing.retain(|&s| {
                    !(l.inflight[s] && {
                        landing.push(s);
                        true
                    })
                });
                for &s in missing.iter() {
                    l.inflight[s] = true;
                }
                let c = &self.counters;
                c.prefetch_used.fetch_add(used, Ordering::Relaxed);
                c.advised_slots.fetch_add(slots.len() as u64, Ordering::Relaxed);
                c.advised_resident.fetch_add((slots.len() - missing.len() - landing.len()) as u64, Ordering::Relaxed);
                c.advised_landing.fetch_add(landing.len() as u64, Ordering::Relaxed);
                self.make_room(&mut l, missing.len(), false);
            } else {
                self.make_room(&mut l, 0, false);
                // Not what either loader is reading now.
                missing.retain(|&s| !l.inflight[s]);
                // Free budget, or the reserve's room (evicting the least used cached slots);
                // one staging's worth, so what lands is soon usable.
                let free = l.budget_slots.saturating_sub(l.n_resident);
                let room = free.max(l.reserve_slots.saturating_sub(l.n_predicted));
                missing.truncate(room.min(staging.len() / self.info.slot_size));
                if missing.len() > free {
                    self.make_room(&mut l, missing.len(), true);
                    missing.truncate(l.budget_slots.saturating_sub(l.n_resident));
                }
                let tick = l.tick;
                for &s in missing.iter() {
                    l.stamp[s] = tick;
                    l.predicted[s] = true;
                    l.inflight[s] = true;
                }
                l.n_predicted += missing.len();
            }
            // Reserved while the reads are in flight, so the other loader sees the room as
            // taken; each slot counts again below once installed.
            l.n_resident += missing.len();
        }
        if missing.is_empty() && landing.is_empty() {
            return;
        }
        before_wait();
        let mut done = Vec::with_capacity(missing.len());
        read_install(&self.region, &self.src, ring, staging, missing, &mut |s| done.push(s));
        let mut l = self.lfu.lock().unwrap_or_else(|e| e.into_inner());
        l.n_resident -= missing.len();
        done.sort_unstable();
        for &s in missing.iter() {
            let installed = done.binary_search(&s).is_ok();
            if installed && !std::mem::replace(&mut l.resident[s], true) {
                l.n_resident += 1;
            }
            l.inflight[s] = false;
            if !named {
                if installed {
                    self.counters.preload_slots.fetch_add(1, Ordering::Relaxed);
                } else if std::mem::take(&mut l.predicted[s]) {
                    // Not read: no longer held (one the reader named meanwhile was counted
                    // there; it faults in).
                    l.n_predicted -= 1;
                }
            }
        }
        if named {
            // A slot the preload could not install stays missing: the reader's touch faults it in.
            while landing.iter().any(|&s| l.inflight[s]) {
                l = self.landed.wait(l).unwrap_or_else(|e| e.into_inner());
            }
        } else {
            self.landed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{slots_of_ranges, stream_split, stream_window};

    /// Half a cycle of 7B-like groups streams through half the window whole groups would
    /// need, and the split is the smallest that fits.
    #[test]
    fn a_budget_streams_capped_tails_through_a_smaller_window() {
        let slot = 4;
        // A layer's groups at the 7B shape's proportions: 27, 9, 48, 24 (x 4-byte slots).
        let sizes: Vec<usize> = (0..8).flat_map(|_| [108, 36, 192, 96]).collect();
        let total: usize = sizes.iter().sum();
        let whole = stream_window(&sizes, slot);
        let (window, cap) = stream_split(&sizes, slot, total / 2).expect("half the cycle fits a split");
        assert!(window <= whole / 2, "window {window} vs {whole} streaming whole groups");
        let hot: usize = sizes.iter().map(|&s| s.saturating_sub(cap)).sum();
        assert!(hot + window <= total / 2);
        // The smallest: one slot less of cap does not fit.
        let smaller: usize = sizes.iter().map(|&s| s.saturating_sub(cap - slot)).sum();
        let w = 2 * (cap - slot) + 4 * slot;
        assert!(smaller + w > total / 2 || cap == slot);
        // A budget below any split: none; one that holds whole-group streaming: a split at
        // most as wide.
        assert_eq!(stream_split(&sizes, slot, 8), None);
        assert!(stream_split(&sizes, slot, whole).is_some_and(|(w, _)| w <= whole));
    }

    /// Ranges become each touched slot once, in order, whether they share slots, arrive out of
    /// order (two layer groups) or run past the image.
    #[test]
    fn ranges_name_each_slot_once_in_order() {
        let mut out = Vec::new();
        slots_of_ranges(&[(0, 10), (100, 4000), (4096, 1), (9000, 0), (20000, 5000)], 4096, 100, &mut out);
        assert_eq!(out, [0, 1, 4, 5, 6]);
        slots_of_ranges(&[(8192, 4096), (0, 4097), (4096, 1)], 4096, 100, &mut out);
        assert_eq!(out, [0, 1, 2]);
        slots_of_ranges(&[(4096 * 98, 3 * 4096)], 4096, 100, &mut out);
        assert_eq!(out, [98, 99], "slots past the image are not named");
    }
}

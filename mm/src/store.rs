//! The swap store: chunk records on flash, written and read with O_DIRECT so the data really
//! leaves RAM (the page cache never holds a copy).
//!
//! Layout: `<dir>/<model fingerprint>/ctx-<id>.kv`, one file per context, mode 0600. Chunk
//! `i` owns two fixed-size record places in its file, copies A and B at
//! `(2 i + copy) * record_len`. A write always goes to the copy that does not hold the
//! current version, with a higher sequence number, so a crash at any point leaves the old
//! version intact: after a restart the newest copy whose header and payload checksums hold is
//! the record (a torn write fails its checksum and the older copy wins). Nothing is ever
//! overwritten in place.
//!
//! A record is a 4 KiB-aligned `#[repr(C)]` [`Header`] (magic, version, fingerprint,
//! context, chunk, sequence, format, tokens, the hash of the token prefix the KV was computed
//! from, per-layer offsets, CRC32C of the payload and of the header) and then the payload,
//! layer-major and contiguous, exactly as the chunk lies in memory: a load reads it with
//! O_DIRECT straight into the page-aligned staging memory that then moves into the slot (no
//! copy), in aligned pieces so the first layers are usable while later ones are in flight. A reader states what it expects (format and prefix
//! hash); a record that fails a checksum or does not match is reported missing — the caller
//! recomputes the chunk — and is never served.
//!
//! Sliding-window models ([`StoreGeometry::kept_layers`] below `n_layers`): a chunk whose
//! tokens all left the window is *dead* and only its first `kept_layers` layers (the global
//! ones) are ever read again. Its record then holds, or serves, only those: a record written
//! whole keeps a second checksum over them (`head_crc`), so when the chunk dies the rest of
//! the record is given back (a hole punched, [`Store::shrink`]) and the kept part is still
//! checked and served, and is never written again; a chunk written after it died is written
//! with its kept layers only.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::reaper::Reaper;
use crate::IdMap;

use bytemuck::{Pod, Zeroable};

use crate::ring::{Op, Ring};

const MAGIC: [u8; 8] = *b"LLMSKV\0\x01";
const VERSION: u32 = 1;
/// Largest layer count a header describes.
pub const MAX_LAYERS: usize = 128;

/// The on-flash header of a record (little-endian, as the machine).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct Header {
    pub magic: [u8; 8],
    pub version: u32,
    pub header_len: u32,
    pub fingerprint: u64,
    pub context: u64,
    pub seq: u64,
    pub prefix_hash: u64,
    pub chunk: u32,
    pub format: u32,
    pub tokens: u32,
    pub n_layers: u32,
    /// Valid bytes of each layer.
    pub layer_len: u32,
    pub payload_crc: u32,
    /// CRC32C of the header with this field zero.
    pub header_crc: u32,
    /// CRC32C of the payload's first `kept_layers` layers when the record holds more (a
    /// sliding-window model's record written whole); 0 otherwise.
    pub head_crc: u32,
    pub layer_off: [u32; MAX_LAYERS],
}

// The record layout on flash: 48 bytes of u64-aligned fields, 8 u32s, the layer offsets. A
// field added or reordered changes every record; `VERSION` must change with it.
const _: () = assert!(size_of::<Header>() == 48 + 8 * 4 + 4 * MAX_LAYERS);

impl Header {
    fn crc(&self) -> u32 {
        let mut h = *self;
        h.header_crc = 0;
        crc32c::crc32c(bytemuck::bytes_of(&h))
    }
}

/// What a record is about, given by the writer and checked by the reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordMeta {
    pub context: u64,
    pub chunk: u32,
    /// The chunk's format code (the codec's).
    pub format: u32,
    /// Tokens of the chunk that hold data.
    pub tokens: u32,
    /// Hash of every token up to the end of this chunk: KV depends on the whole prefix, so a
    /// record computed from other tokens is stale.
    pub prefix_hash: u64,
    /// Layers of the chunk: all of them, or a dead chunk's kept ones
    /// ([`StoreGeometry::kept_layers`]).
    pub layers: u32,
}

/// Why a record cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("no record for context {0} chunk {1}")]
    NotStored(u64, u32),
    #[error("context {context} chunk {chunk}: checksum mismatch ({what}); the record is treated as missing")]
    Checksum { context: u64, chunk: u32, what: &'static str },
    #[error("context {context} chunk {chunk}: the record is stale ({what})")]
    Stale { context: u64, chunk: u32, what: String },
    #[error("swap store {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("swap store: {0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// Where the current version of a chunk is.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    pub copy: u8,
    pub seq: u64,
    /// What the record holds (`meta.layers` layers of `layer_len` bytes).
    pub meta: RecordMeta,
    pub layer_len: u32,
    pub payload_crc: u32,
    /// CRC32C of the first kept layers, when the record holds more (see [`Header::head_crc`]).
    pub head_crc: u32,
}

impl Entry {
    /// The part of this record that serves a dead chunk: its kept layers and their checksum.
    fn head(mut self, kept: u32) -> Self {
        self.meta.layers = kept;
        self.payload_crc = self.head_crc;
        self
    }
}

/// A heap buffer aligned for O_DIRECT (4 KiB), zeroed.
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: owns its allocation.
unsafe impl Send for AlignedBuf {}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({})", self.len)
    }
}

impl AlignedBuf {
    pub const ALIGN: usize = 4096;
    pub fn new(len: usize) -> Self {
        let len = len.div_ceil(Self::ALIGN).max(1) * Self::ALIGN;
        let layout = std::alloc::Layout::from_size_align(len, Self::ALIGN).expect("valid layout");
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, len }
    }
    pub fn as_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: len initialised bytes we own.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}
impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}
impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, Self::ALIGN).expect("valid layout");
        // SAFETY: allocated with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// The fixed shape of records in a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreGeometry {
    pub n_layers: usize,
    /// The largest layer of any format.
    pub max_layer_bytes: usize,
    /// Layers a dead chunk keeps (a sliding-window model's global layers, first in a chunk);
    /// `n_layers` for a model without a window.
    pub kept_layers: usize,
}

impl StoreGeometry {
    /// A model without a sliding window.
    pub fn new(n_layers: usize, max_layer_bytes: usize) -> Self {
        Self { n_layers, max_layer_bytes, kept_layers: n_layers }
    }
}

#[derive(Debug, Default)]
struct Index {
    files: IdMap<u64, Arc<File>>,
    entries: IdMap<(u64, u32), Entry>,
    seq: u64,
}

/// The swap store of one model. Internally synchronised: the fault path, the AoT writer and
/// the loader use it from different threads.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    fingerprint: u64,
    geom: StoreGeometry,
    /// O_DIRECT offset alignment of the filesystem (STATX_DIOALIGN, at least 512).
    align: usize,
    header_len: usize,
    record_len: usize,
    durability: Durability,
    /// With [`Durability::Group`]: the files written since the last group sync, and its thread.
    group: Option<GroupSync>,
    index: Mutex<Index>,
    reaper: Reaper,
}

/// When written records reach the disk itself, not only its cache. Every mode is safe against a
/// crash of the process (a write is complete before its record is current); they differ on
/// power loss, where a record that had not reached the disk is found missing or torn (its
/// checksum fails) and its chunk is recomputed from the context's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// No fdatasync: after a power loss, recent records may be lost (recomputed).
    Off,
    /// fdatasync after every batch, before its records become current: a current record
    /// survives a power loss. The writing thread waits for the disk.
    Batch,
    /// fdatasync of the files written, by a thread of the store, every period: a power loss
    /// loses at most the last period's records (recomputed); no writer waits for the disk.
    Group(std::time::Duration),
}

impl From<bool> for Durability {
    /// `true`: [`Durability::Batch`]; `false`: [`Durability::Off`].
    fn from(sync: bool) -> Self {
        if sync {
            Self::Batch
        } else {
            Self::Off
        }
    }
}

impl std::str::FromStr for Durability {
    type Err = String;
    /// `off`, `batch`, `group` (every 100 ms) or `group:<ms>`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "off" => Ok(Self::Off),
            "batch" => Ok(Self::Batch),
            "group" => Ok(Self::Group(std::time::Duration::from_millis(100))),
            _ => match s.strip_prefix("group:").and_then(|ms| ms.parse::<u64>().ok()) {
                Some(ms) if (1..=60_000).contains(&ms) => Ok(Self::Group(std::time::Duration::from_millis(ms))),
                _ => Err(format!("{s:?}: off, batch, group or group:<ms> (1-60000)")),
            },
        }
    }
}

/// The group-commit thread: syncs the files written since its last round, every period, and a
/// last time when the store closes.
#[derive(Debug)]
struct GroupSync {
    dirty: Arc<Mutex<HashMap<u64, Arc<File>>>>,
    stop: Arc<(Mutex<bool>, std::sync::Condvar)>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl GroupSync {
    fn spawn(period: std::time::Duration) -> Self {
        let dirty: Arc<Mutex<HashMap<u64, Arc<File>>>> = Arc::default();
        let stop: Arc<(Mutex<bool>, std::sync::Condvar)> = Arc::default();
        let (d, st) = (Arc::clone(&dirty), Arc::clone(&stop));
        let handle = std::thread::Builder::new()
            .name("llms-store-sync".into())
            .spawn(move || loop {
                let stopping = {
                    let g = st.0.lock().unwrap_or_else(|e| e.into_inner());
                    let (g, _) = st.1.wait_timeout_while(g, period, |s| !*s).unwrap_or_else(|e| e.into_inner());
                    *g
                };
                let files: Vec<Arc<File>> = std::mem::take(&mut *d.lock().unwrap_or_else(|e| e.into_inner())).into_values().collect();
                for f in files {
                    if let Err(e) = f.sync_data() {
                        eprintln!("llms: group sync of the swap store failed: {e}; records written since may not survive a power loss");
                    }
                }
                if stopping {
                    return;
                }
            })
            .expect("spawn the store's sync thread");
        Self { dirty, stop, handle: Some(handle) }
    }
}

impl Drop for GroupSync {
    fn drop(&mut self) {
        *self.stop.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.stop.1.notify_all();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io { path: path.to_path_buf(), source }
}

fn round_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// The O_DIRECT alignment (offset and memory) the filesystem of `path` needs.
pub fn dio_align(path: &Path) -> usize {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else { return 4096 };
    // SAFETY: a zeroed statx is a valid out-parameter.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and out-pointer.
    let rc = unsafe { libc::statx(libc::AT_FDCWD, c.as_ptr(), 0, libc::STATX_DIOALIGN, &raw mut st) };
    if rc != 0 || st.stx_mask & libc::STATX_DIOALIGN == 0 || st.stx_dio_offset_align == 0 {
        return 4096;
    }
    (st.stx_dio_offset_align.max(st.stx_dio_mem_align) as usize).clamp(512, AlignedBuf::ALIGN)
}

impl Store {
    /// Opens (creating) the store of the model `fingerprint` under `dir` and rebuilds the
    /// index from the records found there.
    /// `durability` says when records reach the disk itself ([`Durability`]; `true` is
    /// `Batch`, `false` is `Off`).
    pub fn open(dir: &Path, fingerprint: u64, geom: StoreGeometry, durability: impl Into<Durability>) -> Result<Self> {
        let durability = durability.into();
        if geom.n_layers == 0
            || geom.n_layers > MAX_LAYERS
            || geom.max_layer_bytes == 0
            || geom.kept_layers == 0
            || geom.kept_layers > geom.n_layers
        {
            return Err(StoreError::Invalid(format!(
                "{} layers of {} bytes, {} kept by a dead chunk: unsupported",
                geom.n_layers, geom.max_layer_bytes, geom.kept_layers
            )));
        }
        let dir = dir.join(format!("{fingerprint:016x}"));
        fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(io_err(&dir))?;
        let align = dio_align(&dir);
        let header_len = round_up(size_of::<Header>(), AlignedBuf::ALIGN);
        let record_len = header_len + round_up(geom.n_layers * geom.max_layer_bytes, AlignedBuf::ALIGN);
        let s = Self {
            dir,
            fingerprint,
            geom,
            align,
            header_len,
            record_len,
            durability,
            group: match durability {
                Durability::Group(period) => Some(GroupSync::spawn(period)),
                _ => None,
            },
            index: Mutex::new(Index::default()),
            reaper: Reaper::default(),
        };
        s.recover()?;
        Ok(s)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// Frees what deleted contexts held, off the caller's path.
    pub(crate) fn reaper(&self) -> &Reaper {
        &self.reaper
    }
    pub fn align(&self) -> usize {
        self.align
    }
    pub fn geometry(&self) -> StoreGeometry {
        self.geom
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn path(&self, ctx: u64) -> PathBuf {
        self.dir.join(format!("ctx-{ctx:016x}.kv"))
    }

    fn open_file(&self, ctx: u64, create: bool) -> Result<Arc<File>> {
        if let Some(f) = self.lock().files.get(&ctx) {
            return Ok(Arc::clone(f));
        }
        let path = self.path(ctx);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .mode(0o600)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
            .open(&path)
            .map_err(io_err(&path))?;
        let f = Arc::new(f);
        self.lock().files.insert(ctx, Arc::clone(&f));
        Ok(f)
    }

    fn offset(&self, chunk: u32, copy: u8) -> u64 {
        (2 * u64::from(chunk) + u64::from(copy)) * self.record_len as u64
    }

    /// Offset of a record's payload (the layers `e` holds or serves) and its length rounded up
    /// to the O_DIRECT alignment.
    pub fn body_extent(&self, e: &Entry) -> (u64, usize) {
        (self.offset(e.meta.chunk, e.copy) + self.header_len as u64, round_up(e.meta.layers as usize * e.layer_len as usize, self.align))
    }

    /// The aligned byte range of the file that covers `layer` of a stored record.
    pub fn layer_extent(&self, e: &Entry, layer: usize) -> (u64, usize) {
        let (body, _) = self.body_extent(e);
        let ll = e.layer_len as usize;
        let start = layer * ll / self.align * self.align;
        let end = round_up((layer + 1) * ll, self.align);
        (body + start as u64, end - start)
    }

    /// Rebuilds the index: for every chunk, the newest copy whose header and payload hold.
    fn recover(&self) -> Result<()> {
        let rd = fs::read_dir(&self.dir).map_err(io_err(&self.dir))?;
        let mut buf = AlignedBuf::new(self.record_len);
        for ent in rd {
            let ent = ent.map_err(io_err(&self.dir))?;
            let name = ent.file_name();
            let Some(ctx) = name.to_str().and_then(|n| n.strip_prefix("ctx-")).and_then(|n| n.strip_suffix(".kv")) else {
                continue;
            };
            let Ok(ctx) = u64::from_str_radix(ctx, 16) else { continue };
            let f = self.open_file(ctx, false)?;
            let len = f.metadata().map_err(io_err(&ent.path()))?.len();
            let n_chunks = len.div_ceil(2 * self.record_len as u64);
            for chunk in 0..u32::try_from(n_chunks).unwrap_or(u32::MAX) {
                let mut best: Option<Entry> = None;
                for copy in 0..2u8 {
                    if let Some(e) = self.verify_copy(&f, ctx, chunk, copy, &mut buf) {
                        if best.is_none_or(|b| e.seq > b.seq) {
                            best = Some(e);
                        }
                    }
                }
                if let Some(e) = best {
                    let mut ix = self.lock();
                    ix.seq = ix.seq.max(e.seq);
                    ix.entries.insert((ctx, chunk), e);
                }
            }
        }
        Ok(())
    }

    /// Reads one copy whole and checks it; `None` when absent, torn or foreign.
    fn verify_copy(&self, f: &File, ctx: u64, chunk: u32, copy: u8, buf: &mut AlignedBuf) -> Option<Entry> {
        let off = self.offset(chunk, copy);
        let n = read_full(f, &mut buf[..self.header_len], off).ok()?;
        if n < self.header_len {
            return None;
        }
        let h: Header = bytemuck::pod_read_unaligned(&buf[..size_of::<Header>()]);
        let mut e = self.check_header(&h, ctx, chunk)?;
        e.copy = copy;
        let (_, body) = self.body_extent(&e);
        if read_full(f, &mut buf[self.header_len..self.header_len + body], off + self.header_len as u64).ok()? < body {
            return None;
        }
        let payload = &buf[self.header_len..];
        let ll = e.layer_len as usize;
        if crc32c::crc32c(&payload[..e.meta.layers as usize * ll]) == e.payload_crc {
            return Some(e);
        }
        // A whole record whose chunk died: the rest was given back (a hole reads as zeros), the
        // kept layers still check.
        let kept = self.geom.kept_layers;
        let kept32 = u32::try_from(kept).ok()?;
        (e.meta.layers > kept32 && crc32c::crc32c(&payload[..kept * ll]) == e.head_crc).then(|| e.head(kept32))
    }

    fn check_header(&self, h: &Header, ctx: u64, chunk: u32) -> Option<Entry> {
        let ok = h.magic == MAGIC
            && h.version == VERSION
            && h.header_crc == h.crc()
            && h.fingerprint == self.fingerprint
            && h.context == ctx
            && h.chunk == chunk
            && (h.n_layers as usize == self.geom.n_layers || h.n_layers as usize == self.geom.kept_layers)
            && h.header_len as usize == self.header_len
            && (h.layer_len as usize) <= self.geom.max_layer_bytes;
        if !ok {
            return None;
        }
        let ll = h.layer_len as usize;
        if (0..h.n_layers as usize).any(|l| h.layer_off[l] as usize != self.header_len + l * ll) {
            return None;
        }
        let meta = RecordMeta { context: ctx, chunk, format: h.format, tokens: h.tokens, prefix_hash: h.prefix_hash, layers: h.n_layers };
        Some(Entry { copy: 0, seq: h.seq, meta, layer_len: h.layer_len, payload_crc: h.payload_crc, head_crc: h.head_crc })
    }

    /// The part of `e` that serves `want`: all of it, or a dead chunk's kept layers of a
    /// record written whole.
    fn serving(&self, e: Entry, want: &RecordMeta) -> Option<Entry> {
        let kept = u32::try_from(self.geom.kept_layers).ok()?;
        let e = if want.layers == kept && e.meta.layers > kept { e.head(kept) } else { e };
        (e.meta == *want).then_some(e)
    }

    /// Gives back the space of every layer a dead chunk no longer keeps, in its current record
    /// (a hole punched past the kept layers); the kept layers stay served and checked. A no-op
    /// for a record that holds only those, or a model without a window.
    pub fn shrink(&self, ctx: u64, chunk: u32) -> Result<()> {
        let kept = self.geom.kept_layers;
        let Some(e) = self.entry(ctx, chunk).filter(|e| e.meta.layers as usize > kept) else { return Ok(()) };
        let f = self.open_file(ctx, false)?;
        let keep = self.header_len + round_up(kept * e.layer_len as usize, self.align);
        let off = self.offset(chunk, e.copy) + keep as u64;
        if let (Ok(off), Ok(len)) = (i64::try_from(off), i64::try_from(self.record_len - keep)) {
            // SAFETY: fallocate on a descriptor this store owns, within its own record place.
            // A file system without hole punching keeps the blocks; the record is served alike.
            let _ = unsafe { libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off, len) };
        }
        let mut ix = self.lock();
        if let Some(cur) = ix.entries.get_mut(&(ctx, chunk)).filter(|c| c.seq == e.seq) {
            *cur = e.head(u32::try_from(kept).unwrap_or(u32::MAX));
        }
        Ok(())
    }

    /// The current entry of a chunk, if stored.
    pub fn entry(&self, ctx: u64, chunk: u32) -> Option<Entry> {
        self.lock().entries.get(&(ctx, chunk)).copied()
    }

    /// Whether the stored record of a chunk matches what the caller expects.
    pub fn matches(&self, want: &RecordMeta) -> bool {
        self.entry(want.context, want.chunk).is_some_and(|e| self.serving(e, want).is_some())
    }

    /// Writes records (payload layer-major: `n_layers` layers of equal length) with one
    /// io_uring batch, syncs, then makes them current. On error none of the batch is current.
    pub fn write_batch(&self, ring: &mut Ring, recs: &[(RecordMeta, &[u8])]) -> Result<()> {
        let mut bufs = Vec::with_capacity(recs.len());
        let mut ops = Vec::with_capacity(recs.len());
        let mut next = Vec::with_capacity(recs.len());
        let mut files = Vec::new();
        // The copies these records replace: freed once the new ones are current.
        let mut stale: Vec<(Arc<File>, u64)> = Vec::new();
        for (i, (meta, payload)) in recs.iter().enumerate() {
            let nl = meta.layers as usize;
            if !(nl == self.geom.n_layers || nl == self.geom.kept_layers)
                || !payload.len().is_multiple_of(nl)
                || payload.len() / nl > self.geom.max_layer_bytes
            {
                return Err(StoreError::Invalid(format!(
                    "a {}-byte payload of {nl} layers: records hold {} (or a dead chunk's {}) layers of at most {} bytes",
                    payload.len(),
                    self.geom.n_layers,
                    self.geom.kept_layers,
                    self.geom.max_layer_bytes
                )));
            }
            if recs[..i].iter().any(|(m, _)| (m.context, m.chunk) == (meta.context, meta.chunk)) {
                return Err(StoreError::Invalid(format!("chunk {} of context {} twice in one batch", meta.chunk, meta.context)));
            }
            let layer_len = payload.len() / nl;
            let f = self.open_file(meta.context, true)?;
            let (copy, seq, replaced) = {
                let mut ix = self.lock();
                ix.seq += 1;
                let prev = ix.entries.get(&(meta.context, meta.chunk)).map(|e| e.copy);
                (prev.map_or(0, |c| 1 - c), ix.seq, prev)
            };
            if let Some(c) = replaced {
                stale.push((Arc::clone(&f), self.offset(meta.chunk, c)));
            }
            let total = self.header_len + round_up(payload.len(), self.align);
            let mut buf = AlignedBuf::new(total);
            let mut h = Header::zeroed();
            h.magic = MAGIC;
            h.version = VERSION;
            h.header_len = u32::try_from(self.header_len).expect("4 KiB");
            h.fingerprint = self.fingerprint;
            h.context = meta.context;
            h.seq = seq;
            h.prefix_hash = meta.prefix_hash;
            h.chunk = meta.chunk;
            h.format = meta.format;
            h.tokens = meta.tokens;
            h.n_layers = u32::try_from(nl).expect("<= MAX_LAYERS");
            h.layer_len = u32::try_from(layer_len).expect("bounded by max_layer_bytes");
            for l in 0..nl {
                h.layer_off[l] =
                    u32::try_from(self.header_len + l * layer_len).map_err(|_| StoreError::Invalid("record too large".into()))?;
            }
            buf[self.header_len..self.header_len + payload.len()].copy_from_slice(payload);
            h.payload_crc = crc32c::crc32c(payload);
            if nl > self.geom.kept_layers {
                h.head_crc = crc32c::crc32c(&payload[..self.geom.kept_layers * layer_len]);
            }
            h.header_crc = h.crc();
            buf[..size_of::<Header>()].copy_from_slice(bytemuck::bytes_of(&h));
            ops.push(Op {
                fd: f.as_raw_fd(),
                offset: self.offset(meta.chunk, copy),
                buf: buf.as_ptr(),
                len: u32::try_from(total).map_err(|_| StoreError::Invalid("record too large".into()))?,
                write: true,
            });
            next.push(Entry { copy, seq, meta: *meta, layer_len: h.layer_len, payload_crc: h.payload_crc, head_crc: h.head_crc });
            if !files.iter().any(|(c, _): &(u64, Arc<File>)| *c == meta.context) {
                files.push((meta.context, Arc::clone(&f)));
            }
            bufs.push(buf);
        }
        let path = self.dir.clone();
        // SAFETY: bufs live until wait returns below; nothing else touches them.
        unsafe { ring.submit(0, &ops) }.map_err(io_err(&path))?;
        ring.wait(0).map_err(io_err(&path))?;
        drop(bufs);
        match (&self.durability, &self.group) {
            (Durability::Batch, _) => {
                for (_, f) in &files {
                    f.sync_data().map_err(io_err(&path))?;
                }
            }
            (Durability::Group(_), Some(g)) => g.dirty.lock().unwrap_or_else(|e| e.into_inner()).extend(files),
            _ => {}
        }
        let mut ix = self.lock();
        for e in next {
            ix.entries.insert((e.meta.context, e.meta.chunk), e);
        }
        drop(ix);
        // The replaced copies are no longer anyone's record: give their blocks back, so a
        // chunk costs one record on disk, not two. (The A/B scheme needs the old copy only
        // until the new one is complete — and, with `sync`, durable — which it now is. A
        // reader still holding the old entry reads a hole: it fails its checksum and is
        // recomputed, never served.) A file system without hole punching keeps the blocks.
        for (f, off) in stale {
            let (Ok(off), Ok(len)) = (i64::try_from(off), i64::try_from(self.record_len)) else { continue };
            // SAFETY: fallocate on a descriptor this store owns, within its own record place.
            let _ = unsafe { libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off, len) };
        }
        Ok(())
    }

    /// Reads a chunk's record into `out` (its payload, layer-major, contiguous) after checking
    /// it against `want`. Returns the payload length.
    pub fn read(&self, want: &RecordMeta, out: &mut [u8]) -> Result<usize> {
        let e = self.expect(want)?;
        let f = self.open_file(want.context, false)?;
        let (off0, body) = self.body_extent(&e);
        let len = e.meta.layers as usize * e.layer_len as usize;
        if out.len() < len {
            return Err(StoreError::Invalid(format!("a {}-byte buffer for a {len}-byte record", out.len())));
        }
        let mut buf = AlignedBuf::new(body);
        let path = self.path(want.context);
        if read_full(&f, &mut buf[..body], off0).map_err(io_err(&path))? < body {
            return Err(StoreError::Checksum { context: want.context, chunk: want.chunk, what: "record truncated" });
        }
        if crc32c::crc32c(&buf[..len]) != e.payload_crc {
            return Err(StoreError::Checksum { context: want.context, chunk: want.chunk, what: "payload" });
        }
        out[..len].copy_from_slice(&buf[..len]);
        Ok(len)
    }

    /// The entry for `want`, or why there is none that matches.
    pub fn expect(&self, want: &RecordMeta) -> Result<Entry> {
        let e = self.entry(want.context, want.chunk).ok_or(StoreError::NotStored(want.context, want.chunk))?;
        self.serving(e, want).ok_or_else(|| {
            let what = if e.meta.prefix_hash != want.prefix_hash || e.meta.tokens != want.tokens {
                "it was computed from other tokens".to_string()
            } else if e.meta.format != want.format {
                format!("it holds format {}, format {} is wanted", e.meta.format, want.format)
            } else {
                format!("it holds {} layers, {} are wanted", e.meta.layers, want.layers)
            };
            StoreError::Stale { context: want.context, chunk: want.chunk, what }
        })
    }

    /// Opens the file of a context for a batch of reads (the loader's own ring).
    pub fn file(&self, ctx: u64) -> Result<Arc<File>> {
        self.open_file(ctx, false)
    }

    /// Forgets a chunk's record (its data changed and was not written again).
    pub fn invalidate(&self, ctx: u64, chunk: u32) {
        self.lock().entries.remove(&(ctx, chunk));
    }

    /// [`Store::invalidate`] for each of `chunks`, under one lock.
    pub fn invalidate_all(&self, ctx: u64, chunks: impl IntoIterator<Item = u32>) {
        let mut g = self.lock();
        for chunk in chunks {
            g.entries.remove(&(ctx, chunk));
        }
    }

    /// Forgets a chunk's record and gives its space back: both record places are punched out,
    /// so no copy of it is served again, even after a restart (the chunk moved elsewhere: a
    /// shared chunk's record is the pool's).
    pub fn discard(&self, ctx: u64, chunk: u32) {
        let had = self.lock().entries.remove(&(ctx, chunk)).is_some();
        let Ok(f) = self.open_file(ctx, false) else { return };
        let (Ok(off), Ok(len)) = (i64::try_from(self.offset(chunk, 0)), i64::try_from(2 * self.record_len)) else { return };
        if had || f.metadata().is_ok_and(|m| m.len() > self.offset(chunk, 0)) {
            // SAFETY: fallocate on a descriptor this store owns, within the chunk's two record
            // places. A file system without hole punching keeps the blocks (and a stale copy,
            // which then fails to match the tokens the chunk is wanted for, or is overwritten).
            let _ = unsafe { libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off, len) };
        }
    }

    /// Deletes a context's records and file: its space is returned.
    pub fn remove_context(&self, ctx: u64) -> Result<()> {
        let mut ix = self.lock();
        ix.entries.retain(|k, _| k.0 != ctx);
        let open = ix.files.remove(&ctx);
        drop(ix);
        let path = self.path(ctx);
        // Unlink while a handle is open, so the unlink only drops the name and the blocks are
        // freed when the reaper closes the handle; the path is free for a new context at once.
        let handle = open.or_else(|| File::open(&path).ok().map(Arc::new));
        let r = match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::Io { path, source: e }),
        };
        if let Some(f) = handle {
            self.reaper.release(Box::new(f));
        }
        r
    }

    /// Contexts with at least one record.
    pub fn contexts(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.lock().entries.keys().map(|k| k.0).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Bytes of the files on disk (allocated blocks).
    pub fn disk_bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        fs::read_dir(&self.dir).map_or(0, |rd| rd.filter_map(|e| e.ok()?.metadata().ok()).map(|m| m.blocks() * 512).sum())
    }
}

/// Reads until `buf` is full or end of file; returns the bytes read.
fn read_full(f: &File, buf: &mut [u8], off: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

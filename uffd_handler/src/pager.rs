//! The pager: one userfaultfd, its fault-handler thread, fill workers, and the regions
//! registered with it.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::errno::Errno;

use crate::sigbus;
use crate::stats::{RegionStats, StatsSnapshot};
use crate::sys::{self, UffdOrigin};

pub use crate::error::{Result, UffdError, PAGE};

/// Why a source could not produce a slot.
pub type SourceError = Box<dyn std::error::Error + Send + Sync>;

/// Where the bytes of a slot come from when it is filled.
pub trait SlotSource: Send + Sync {
    /// Writes the contents of `slot` of `region` into `buf` (one slot long, page-aligned,
    /// zeroed) and returns how many bytes are valid; only those pages are installed, so a
    /// short slot (a compressed chunk) costs fewer pages. An error poisons the slot: readers
    /// get SIGBUS, never zeros.
    fn fill(&self, region: RegionId, slot: usize, buf: &mut [u8]) -> std::result::Result<usize, SourceError>;

    /// Whether `fill` is quick and never blocks (a copy or decode from memory). Fast sources
    /// are served on the fault-handler thread itself, saving a thread hop; slow ones (flash
    /// reads, recompute) run on fill workers so they never stall faults on other slots.
    fn is_fast(&self) -> bool {
        false
    }
}

/// Identifies a region of a pager.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionId(pub u32);

/// What the running kernel offers, found when the pager starts.
#[derive(Debug, Clone, Copy)]
pub struct Capabilities {
    pub origin: UffdOrigin,
    /// Dirty tracking with UFFD_FEATURE_WP_ASYNC + PAGEMAP_SCAN.
    pub wp_async: bool,
    /// UFFDIO_MOVE (cheap population from a staging buffer).
    pub r#move: bool,
    /// UFFDIO_POISON (a failed slot raises SIGBUS instead of blocking or reading zeros).
    pub poison: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    Evicted,
    Loading,
    Resident,
    Poisoned,
}

#[derive(Debug)]
struct Slot {
    state: SlotState,
    pins: u32,
    filled_pages: usize,
    /// Set by `mark_dirty` where the kernel cannot track writes.
    marked_dirty: bool,
    /// Fault addresses that arrived while loading, checked against the filled length.
    pending: Vec<u64>,
}

pub(crate) struct RegionInner {
    pub(crate) id: u32,
    base: NonNull<u8>,
    len: usize,
    slot_size: usize,
    n_slots: usize,
    source: Arc<dyn SlotSource>,
    slots: Mutex<Vec<Slot>>,
    changed: Condvar,
    pub(crate) stats: RegionStats,
    wp: bool,
    /// Filled pages of the Resident slots, kept with every change of a slot's state or pages
    /// (under the slots' lock): `resident_bytes` without a walk over every slot (a pool of
    /// shared chunks has tens of thousands, and reclaim asks after each eviction).
    resident_pages: AtomicUsize,
}

// SAFETY: the raw base pointer is only an address of a mapping owned by the region; all
// mutable state is behind the Mutex or atomics.
unsafe impl Send for RegionInner {}
// SAFETY: see Send.
unsafe impl Sync for RegionInner {}

impl RegionInner {
    fn slot_addr(&self, slot: usize) -> u64 {
        self.base.as_ptr() as u64 + (slot * self.slot_size) as u64
    }
    fn check(&self, slot: usize) -> Result<()> {
        if slot >= self.n_slots {
            return Err(UffdError::NoSlot { region: self.id, slot, n_slots: self.n_slots });
        }
        Ok(())
    }

    /// Whether `slot` (state `s`) may be evicted now: `Ok(false)` if it already is, an error
    /// naming why not (loading, pinned, unsaved writes unless `discard`).
    fn evictable(&self, s: &Slot, slot: usize, discard: bool) -> Result<bool> {
        match s.state {
            SlotState::Evicted => return Ok(false),
            SlotState::Loading => return Err(UffdError::Busy { region: self.id, slot }),
            SlotState::Resident | SlotState::Poisoned => {}
        }
        if s.pins > 0 {
            return Err(UffdError::Pinned { region: self.id, slot });
        }
        if !discard && s.state == SlotState::Resident {
            let dirty = if self.wp {
                crate::dirty::written_pages(self.id, self.slot_addr(slot), self.slot_size, false)?.len()
            } else if s.marked_dirty {
                s.filled_pages
            } else {
                0
            };
            if dirty > 0 {
                return Err(UffdError::Dirty { region: self.id, slot, pages: dirty });
            }
        }
        Ok(true)
    }
}

struct FillJob {
    region: Arc<RegionInner>,
    slot: usize,
}

pub(crate) struct PagerInner {
    uffd: OwnedFd,
    caps: Capabilities,
    regions: RwLock<HashMap<u32, Arc<RegionInner>>>,
    next_id: AtomicU64,
    stop: AtomicBool,
    wake_fd: OwnedFd,
    jobs: Mutex<Option<Sender<FillJob>>>,
}

/// A userfaultfd with its handler thread and fill workers. Regions created from it are served
/// until they are dropped; the pager's threads live as long as any region does, so a thread
/// touching a region is never left blocked on a dead handler.
pub struct Pager {
    inner: Arc<PagerInner>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Pager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pager").field("caps", &self.inner.caps).finish()
    }
}

/// A registered region of `n_slots` slots of `slot_size` bytes each. Reads and writes through
/// [`Region::slot_ptr`] are served by the pager: a non-resident slot is filled from the source
/// on first touch.
pub struct Region {
    inner: Arc<RegionInner>,
    pager: Arc<PagerInner>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("id", &self.inner.id).field("slots", &self.inner.n_slots).finish()
    }
}

const FILL_WORKERS: usize = 2;

/// Pager settings.
#[derive(Debug, Clone, Copy)]
pub struct PagerOptions {
    /// Install slots with UFFDIO_MOVE when the kernel has it (else always UFFDIO_COPY).
    pub allow_move: bool,
}

impl Default for PagerOptions {
    fn default() -> Self {
        Self { allow_move: true }
    }
}

impl Pager {
    /// Creates the userfaultfd (not user-mode-only, so kernel accesses are served too),
    /// negotiates the features this kernel offers, and starts the handler and fill workers.
    pub fn new() -> Result<Self> {
        Self::with_options(PagerOptions::default())
    }

    pub fn with_options(opts: PagerOptions) -> Result<Self> {
        let (uffd, origin) = sys::open_uffd().map_err(|(dev, syscall)| UffdError::Create { dev, syscall })?;
        // Ask for everything useful; fall back to the plain API if the kernel refuses some.
        let wanted = sys::UFFD_FEATURE_WP_ASYNC | sys::UFFD_FEATURE_PAGEFAULT_FLAG_WP | sys::UFFD_FEATURE_MOVE | sys::UFFD_FEATURE_POISON;
        let mut api = sys::UffdioApi { api: sys::UFFD_API, features: wanted, ioctls: 0 };
        // SAFETY: UFFDIO_API on our fresh uffd with a valid struct.
        let features = match unsafe { sys::uffdio_api(uffd.as_raw_fd(), &mut api) } {
            Ok(_) => api.features,
            Err(_) => {
                // UFFDIO_API may only be called once per fd: start over without features.
                let (uffd2, _) = sys::open_uffd().map_err(|(dev, syscall)| UffdError::Create { dev, syscall })?;
                let mut api = sys::UffdioApi { api: sys::UFFD_API, features: 0, ioctls: 0 };
                // SAFETY: as above.
                unsafe { sys::uffdio_api(uffd2.as_raw_fd(), &mut api) }.map_err(UffdError::Api)?;
                return Self::start(uffd2, Capabilities { origin, wp_async: false, r#move: false, poison: false });
            }
        };
        let caps = Capabilities {
            origin,
            wp_async: features & sys::UFFD_FEATURE_WP_ASYNC != 0,
            r#move: opts.allow_move && features & sys::UFFD_FEATURE_MOVE != 0,
            poison: features & sys::UFFD_FEATURE_POISON != 0,
        };
        Self::start(uffd, caps)
    }

    fn start(uffd: OwnedFd, caps: Capabilities) -> Result<Self> {
        // SAFETY: eventfd with valid flags; the fd is owned below.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(UffdError::Api(Errno::last()));
        }
        // SAFETY: the kernel just returned this fd.
        let wake_fd = unsafe { OwnedFd::from_raw_fd(efd) };
        let (tx, rx) = channel::<FillJob>();
        let inner = Arc::new(PagerInner {
            uffd,
            caps,
            regions: RwLock::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            stop: AtomicBool::new(false),
            wake_fd,
            jobs: Mutex::new(Some(tx)),
        });
        sigbus::install();
        let mut threads = Vec::new();
        let h = Arc::clone(&inner);
        threads.push(
            std::thread::Builder::new()
                .name("uffd-handler".into())
                .spawn(move || abort_on_panic("uffd handler", || handler(&h)))
                .expect("spawn uffd handler"),
        );
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..FILL_WORKERS {
            let (p, rx) = (Arc::clone(&inner), Arc::clone(&rx));
            threads.push(
                std::thread::Builder::new()
                    .name(format!("uffd-fill-{i}"))
                    .spawn(move || abort_on_panic("uffd fill worker", || fill_worker(&p, &rx)))
                    .expect("spawn fill worker"),
            );
        }
        Ok(Self { inner, threads })
    }

    pub fn capabilities(&self) -> Capabilities {
        self.inner.caps
    }

    /// Reserves and registers a region of `n_slots` slots of `slot_size` bytes (a multiple of
    /// the page size), tracking writes where the kernel can. Nothing is resident until a slot
    /// is touched or populated.
    pub fn region(&self, slot_size: usize, n_slots: usize, source: Arc<dyn SlotSource>) -> Result<Region> {
        self.region_with(slot_size, n_slots, source, true)
    }

    /// As [`Pager::region`]; `track_writes = false` skips write-protect registration (for
    /// read-only contents such as weights: installs are cheaper and nothing is ever dirty).
    pub fn region_with(&self, slot_size: usize, n_slots: usize, source: Arc<dyn SlotSource>, track_writes: bool) -> Result<Region> {
        let len = slot_size.checked_mul(n_slots).filter(|&l| l > 0 && l < 1 << 46 && slot_size.is_multiple_of(PAGE));
        let Some(len) = len else { return Err(UffdError::Geometry { slot_size, n_slots }) };
        // SAFETY: a fresh private anonymous reservation; owned by the Region from here on.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(UffdError::Map { len, source: Errno::last() });
        }
        let base = NonNull::new(ptr.cast::<u8>()).expect("mmap returned a non-null address");
        let id = u32::try_from(self.inner.next_id.fetch_add(1, Ordering::Relaxed)).unwrap_or(u32::MAX);
        let wp = track_writes && self.inner.caps.wp_async;
        let mut reg = sys::UffdioRegister {
            range: sys::UffdioRange { start: ptr as u64, len: len as u64 },
            mode: sys::UFFDIO_REGISTER_MODE_MISSING | if wp { sys::UFFDIO_REGISTER_MODE_WP } else { 0 },
            ioctls: 0,
        };
        // Registered before anything can touch it: no page of the region is ever populated
        // by the kernel's own zero-fill.
        // SAFETY: UFFDIO_REGISTER over the mapping we just created.
        if let Err(source) = unsafe { sys::uffdio_register(self.inner.uffd.as_raw_fd(), &mut reg) } {
            // SAFETY: unmapping the mapping we just created.
            unsafe { libc::munmap(ptr, len) };
            return Err(UffdError::Register { region: id, source });
        }
        let slots = (0..n_slots)
            .map(|_| Slot { state: SlotState::Evicted, pins: 0, filled_pages: 0, marked_dirty: false, pending: Vec::new() })
            .collect();
        let inner = Arc::new(RegionInner {
            id,
            base,
            len,
            slot_size,
            n_slots,
            source,
            slots: Mutex::new(slots),
            changed: Condvar::new(),
            stats: RegionStats::default(),
            wp,
            resident_pages: AtomicUsize::new(0),
        });
        sigbus::register(id, ptr as usize, len, slot_size);
        self.inner.regions.write().unwrap_or_else(|e| e.into_inner()).insert(id, Arc::clone(&inner));
        Ok(Region { inner, pager: Arc::clone(&self.inner) })
    }
}

impl Drop for Pager {
    fn drop(&mut self) {
        // The threads keep serving until every region is gone (see `handler`), so regions may
        // outlive this handle; they exit on their own then. Not joined here: a region still
        // in use would make that wait unbounded.
        self.inner.stop.store(true, Ordering::Release);
        wake_handler(&self.inner);
        self.threads.clear();
    }
}

fn wake_handler(p: &PagerInner) {
    let one: u64 = 1;
    // SAFETY: writing 8 bytes to our eventfd.
    unsafe { libc::write(p.wake_fd.as_raw_fd(), std::ptr::from_ref(&one).cast(), 8) };
}

fn abort_on_panic(what: &str, f: impl FnOnce()) {
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        // A dead handler would leave faulting threads blocked forever: fail loudly instead.
        eprintln!("llms: fatal: the {what} thread panicked; aborting rather than leaving faulting threads blocked");
        std::process::abort();
    }
}

/// The fault-handler loop: polls the uffd and the wake eventfd, reads faults in batches.
fn handler(p: &Arc<PagerInner>) {
    let mut msgs = [sys::UffdMsg::default(); 64];
    loop {
        if p.stop.load(Ordering::Acquire) && p.regions.read().unwrap_or_else(|e| e.into_inner()).is_empty() {
            // No region left to serve: let the fill workers go too.
            p.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
            return;
        }
        let mut fds = [
            libc::pollfd { fd: p.uffd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: p.wake_fd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: polling two fds we own; the timeout bounds how late a stop is noticed.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, 100) };
        if r < 0 {
            let e = Errno::last();
            assert!(e == Errno::EINTR, "poll on the userfaultfd failed: {e}");
            continue;
        }
        if fds[1].revents & libc::POLLIN != 0 {
            let mut v = 0u64;
            // SAFETY: reading 8 bytes from our eventfd into a u64.
            unsafe { libc::read(p.wake_fd.as_raw_fd(), std::ptr::from_mut(&mut v).cast(), 8) };
        }
        if fds[0].revents & (libc::POLLERR | libc::POLLHUP) != 0 {
            panic!("the userfaultfd reported an error condition");
        }
        if fds[0].revents & libc::POLLIN == 0 {
            continue;
        }
        loop {
            // SAFETY: reading whole uffd_msg records into a buffer of them.
            let n = unsafe { libc::read(p.uffd.as_raw_fd(), msgs.as_mut_ptr().cast(), std::mem::size_of_val(&msgs)) };
            if n < 0 {
                let e = Errno::last();
                if e == Errno::EAGAIN {
                    break;
                }
                assert!(e == Errno::EINTR, "read from the userfaultfd failed: {e}");
                continue;
            }
            let n = usize::try_from(n).unwrap_or(0) / std::mem::size_of::<sys::UffdMsg>();
            let now = Instant::now();
            for m in &msgs[..n] {
                if m.event == sys::UFFD_EVENT_PAGEFAULT {
                    on_fault(p, m.pf_address, now);
                }
            }
            if n < msgs.len() {
                break;
            }
        }
    }
}

fn find_region(p: &PagerInner, addr: u64) -> Option<Arc<RegionInner>> {
    p.regions
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .find(|r| addr >= r.base.as_ptr() as u64 && addr < r.base.as_ptr() as u64 + r.len as u64)
        .cloned()
}

fn on_fault(p: &Arc<PagerInner>, addr: u64, now: Instant) {
    let Some(r) = find_region(p, addr) else {
        // A fault in a range being unregistered: the unregister wakes the thread itself.
        return;
    };
    r.stats.faults.fetch_add(1, Ordering::Relaxed);
    let slot = usize::try_from((addr - r.base.as_ptr() as u64) / r.slot_size as u64).expect("inside the region");
    let page_addr = addr & !(PAGE as u64 - 1);
    let mut slots = r.slots.lock().unwrap_or_else(|e| e.into_inner());
    let s = &mut slots[slot];
    match s.state {
        SlotState::Loading => s.pending.push(page_addr),
        SlotState::Evicted => {
            s.state = SlotState::Loading;
            s.pending.push(page_addr);
            drop(slots);
            start_fill(p, &r, slot, now);
        }
        SlotState::Resident => {
            let page = usize::try_from(page_addr - r.slot_addr(slot)).expect("in slot") / PAGE;
            if page < s.filled_pages && page_present(page_addr) {
                // Installed meanwhile; the install woke the thread (a stale message).
                drop(slots);
                wake(p, page_addr, PAGE as u64);
            } else if page < s.filled_pages {
                // The page was dropped behind the pager's back (MADV_DONTNEED by someone
                // else): load the slot again from its source. Pages still present are kept
                // (the install skips them), so data written since the fill is not lost.
                r.resident_pages.fetch_sub(s.filled_pages, Ordering::Relaxed);
                s.state = SlotState::Loading;
                s.pending.push(page_addr);
                drop(slots);
                start_fill(p, &r, slot, now);
            } else {
                // A touch past what the source produced: there is no data for it.
                drop(slots);
                poison(p, &r, slot, page_addr, PAGE as u64);
            }
        }
        SlotState::Poisoned => {
            drop(slots);
            poison(p, &r, slot, page_addr, PAGE as u64);
        }
    }
}

/// Fills a slot marked Loading for a fault: inline for fast sources, else on a worker.
fn start_fill(p: &Arc<PagerInner>, r: &Arc<RegionInner>, slot: usize, now: Instant) {
    r.stats.fault_started(slot, now);
    if r.source.is_fast() {
        let _ = fill_slot(p, r, slot, None);
        return;
    }
    let job = FillJob { region: Arc::clone(r), slot };
    let sent = p.jobs.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|tx| tx.send(job));
    if !matches!(sent, Some(Ok(()))) {
        // No workers (shutting down): fill here rather than leave the thread blocked.
        let _ = fill_slot(p, r, slot, None);
    }
}

/// Whether a page of ours is mapped (mincore does not fault it in).
fn page_present(addr: u64) -> bool {
    let mut v = 0u8;
    // SAFETY: one page-aligned page inside a mapping of ours; mincore only writes `v`.
    let rc = unsafe { libc::mincore(addr as *mut libc::c_void, PAGE, &raw mut v) };
    // When mincore fails, assume present: the old behaviour (wake) is the safe default.
    rc != 0 || v & 1 == 1
}

fn fill_worker(p: &Arc<PagerInner>, rx: &Mutex<Receiver<FillJob>>) {
    loop {
        let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok(job) = job else { return };
        let _ = fill_slot(p, &job.region, job.slot, None);
    }
}

/// A page-aligned buffer of whole pages (the source writes into it; MOVE takes pages from it).
pub struct Staging {
    ptr: NonNull<u8>,
    len: usize,
    /// The whole mapping (`ptr`/`len` may be an aligned window of it).
    map: (NonNull<u8>, usize),
}

// SAFETY: a private anonymous mapping owned by this value.
unsafe impl Send for Staging {}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging").field("len", &self.len).finish()
    }
}

impl Staging {
    pub fn new(len: usize) -> Result<Self> {
        let len = len.div_ceil(PAGE).max(1) * PAGE;
        // SAFETY: fresh private anonymous mapping, owned by the returned value.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(UffdError::Map { len, source: Errno::last() });
        }
        let ptr = NonNull::new(p.cast()).expect("non-null");
        Ok(Self { ptr, len, map: (ptr, len) })
    }

    /// A buffer on transparent huge pages where the kernel gives them, its pages present:
    /// for reusable I/O staging. A read into 4 KiB pages scattered by the allocator is one
    /// scatter-gather segment per page, and a virtqueue without indirect descriptors
    /// (Firecracker's, this project's VMs) holds only a few such requests at once (five
    /// reads of 192 KiB in 256 descriptors): reads then complete in waves. A huge page is
    /// one segment. Without THP (or with it disabled) this is an ordinary buffer.
    pub fn huge(len: usize) -> Result<Self> {
        const HUGE: usize = 2 << 20;
        let len = len.div_ceil(PAGE).max(1) * PAGE;
        let map_len = len + HUGE;
        // SAFETY: fresh private anonymous mapping, owned by the returned value.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), map_len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(UffdError::Map { len: map_len, source: Errno::last() });
        }
        let map = (NonNull::new(p.cast::<u8>()).expect("non-null"), map_len);
        let start = (p as usize).next_multiple_of(HUGE) - p as usize;
        // SAFETY: start < HUGE, so [start, start + len) lies inside the mapping.
        let ptr = unsafe { map.0.add(start) };
        // SAFETY: advising our own mapping. Failure (THP compiled out or "never") only means
        // 4 KiB pages: the buffer works the same, reads are just split into more segments.
        unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        let mut s = Self { ptr, len, map };
        s.repopulate();
        Ok(s)
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: we own len bytes of read-write mapping.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    /// Gives the buffer its pages back after a MOVE took them: one MADV_POPULATE_WRITE
    /// instead of a fault per page (falls back to touching the pages on older kernels).
    pub fn repopulate(&mut self) {
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        // SAFETY: advising our own mapping; POPULATE_WRITE only pre-faults it.
        if unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, MADV_POPULATE_WRITE) } != 0 {
            for p in self.as_mut_slice().chunks_mut(PAGE) {
                // SAFETY: a volatile read-modify-write of our own buffer forces the page in.
                unsafe { std::ptr::write_volatile(p.as_mut_ptr(), std::ptr::read_volatile(p.as_ptr())) };
            }
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.map.0.as_ptr().cast(), self.map.1) };
    }
}

thread_local! {
    static STAGING: std::cell::RefCell<Option<Staging>> = const { std::cell::RefCell::new(None) };
}

/// Fills a slot that the caller has put in `Loading`: from the source (or `given` bytes),
/// installed whole in one ioctl; on failure the slot is poisoned. Wakes every waiter.
fn fill_slot(p: &PagerInner, r: &Arc<RegionInner>, slot: usize, given: Option<Src<'_>>) -> Result<()> {
    let result = match given {
        Some(src) => install(p, r, slot, src),
        None => STAGING.with(|cell| {
            let mut cell = cell.borrow_mut();
            if cell.as_ref().is_none_or(|s| s.len() < r.slot_size) {
                *cell = Some(Staging::new(r.slot_size)?);
            }
            let staging = cell.as_mut().expect("just set");
            let buf = &mut staging.as_mut_slice()[..r.slot_size];
            let got = catch_unwind(AssertUnwindSafe(|| r.source.fill(RegionId(r.id), slot, buf)));
            match got {
                Ok(Ok(n)) if n <= r.slot_size => {
                    // The source wrote [0, n); the rest of the last page would be stale bytes
                    // of an earlier fill: zero it.
                    let end = n.div_ceil(PAGE) * PAGE;
                    buf[n..end].fill(0);
                    // COPY, not MOVE: moving would take the pages out of this reused buffer, and
                    // getting them back (even with one MADV_POPULATE_WRITE) costs more than
                    // the copy saves (measured: `llms bench-uffd`).
                    install(p, r, slot, Src::Copy(&buf[..end]))
                }
                Ok(Ok(n)) => Err(UffdError::TooLong { region: r.id, slot, len: n, slot_size: r.slot_size }),
                Ok(Err(e)) => Err(UffdError::Source { region: r.id, slot, reason: e.to_string() }),
                Err(_) => Err(UffdError::Source { region: r.id, slot, reason: "the source panicked".into() }),
            }
        }),
    };
    if let Err(e) = &result {
        // Logged before the slot reads as Poisoned: another thread's fault on it from then on
        // gets SIGBUS at once, and its handler's message points at this line ("see the log
        // above"), so the line must be out first (CI once caught the SIGBUS winning the race).
        eprintln!("llms: uffd region {} slot {slot}: {e}; the slot is poisoned (readers get SIGBUS)", r.id);
    }
    let mut slots = r.slots.lock().unwrap_or_else(|e| e.into_inner());
    let s = &mut slots[slot];
    let pending = std::mem::take(&mut s.pending);
    let outcome = match result {
        Ok(pages) => {
            s.state = SlotState::Resident;
            s.filled_pages = pages;
            r.resident_pages.fetch_add(pages, Ordering::Relaxed);
            s.marked_dirty = false;
            drop(slots);
            r.stats.filled(slot, pages * PAGE);
            // Only a fault the handler saw while loading has a thread waiting: a fault it sees
            // from now on finds the slot Resident and wakes its thread itself (`on_fault`).
            // Not waking an empty slot saves a syscall per fill.
            if !pending.is_empty() {
                wake(p, r.slot_addr(slot), r.slot_size as u64);
            }
            // Faults that came while loading, past what was filled: no data exists for them.
            let end = r.slot_addr(slot) + (pages * PAGE) as u64;
            for a in pending.into_iter().filter(|&a| a >= end) {
                poison(p, r, slot, a, PAGE as u64);
            }
            Ok(())
        }
        Err(e) => {
            s.state = SlotState::Poisoned;
            drop(slots);
            poison(p, r, slot, r.slot_addr(slot), r.slot_size as u64);
            Err(e)
        }
    };
    r.changed.notify_all();
    outcome
}

/// process_madvise on ourselves was refused once (a kernel before 6.13): madvise per range.
static NO_PROCESS_MADVISE: AtomicBool = AtomicBool::new(false);

/// This process's pidfd, opened once (and again after a fork).
static SELF_PIDFD: Mutex<Option<(libc::pid_t, OwnedFd)>> = Mutex::new(None);

/// MADV_DONTNEED over `ranges` (address, length): one process_madvise on ourselves per 1024
/// ranges, so the kernel flushes the TLB once for the batch rather than once per range (an
/// IPI to every core running this process, each time).
fn dontneed(ranges: &[(*mut u8, usize)]) -> std::result::Result<(), Errno> {
    let each = |rs: &[(*mut u8, usize)]| {
        for &(at, len) in rs {
            // SAFETY: the caller passes ranges of its own mapping whose pages it drops.
            if unsafe { libc::madvise(at.cast(), len, libc::MADV_DONTNEED) } != 0 {
                return Err(Errno::last());
            }
        }
        Ok(())
    };
    if ranges.len() < 2 || NO_PROCESS_MADVISE.load(Ordering::Relaxed) {
        return each(ranges);
    }
    let pidfd = {
        let mut g = SELF_PIDFD.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        if g.as_ref().is_none_or(|(p, _)| *p != pid) {
            // SAFETY: pidfd_open(pid, 0) returns a new descriptor we own, or -1.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
            let Ok(fd) = i32::try_from(fd).map_err(drop).and_then(|fd| if fd < 0 { Err(()) } else { Ok(fd) }) else {
                NO_PROCESS_MADVISE.store(true, Ordering::Relaxed);
                return each(ranges);
            };
            // SAFETY: a fresh descriptor nobody else owns.
            *g = Some((pid, unsafe { OwnedFd::from_raw_fd(fd) }));
        }
        g.as_ref().map(|(_, fd)| fd.as_raw_fd()).unwrap_or(-1)
    };
    for batch in ranges.chunks(1024) {
        let iov: Vec<libc::iovec> = batch.iter().map(|&(at, len)| libc::iovec { iov_base: at.cast(), iov_len: len }).collect();
        let total: usize = batch.iter().map(|r| r.1).sum();
        // SAFETY: process_madvise reads `iov` (valid for the call) and drops pages of our own
        // ranges, as madvise would.
        let n = unsafe { libc::syscall(libc::SYS_process_madvise, pidfd, iov.as_ptr(), iov.len(), libc::MADV_DONTNEED, 0) };
        if usize::try_from(n).ok() != Some(total) {
            if n < 0 && matches!(Errno::last(), Errno::EINVAL | Errno::ENOSYS | Errno::EPERM) {
                NO_PROCESS_MADVISE.store(true, Ordering::Relaxed);
            }
            // Partly done or refused: DONTNEED twice is harmless, so the whole batch again.
            each(batch)?;
        }
    }
    Ok(())
}

/// Whole pages staged for a slot, from its first byte.
enum Src<'a> {
    /// Moved into the slot (UFFDIO_MOVE: no copy; the pages leave the buffer).
    Move(&'a mut [u8]),
    /// Copied into the slot (UFFDIO_COPY; the buffer keeps them).
    Copy(&'a [u8]),
}

/// Installs the staged pages into the slot. Returns the page count.
/// Nobody is woken here (DONTWAKE): the caller first records the slot as resident, then
/// wakes the waiters, so a woken thread never sees a half-installed slot, and never writes a
/// moved page before it is write-protected (that write would escape dirty tracking).
fn install(p: &PagerInner, r: &RegionInner, slot: usize, src: Src<'_>) -> Result<usize> {
    let (src, bytes, buf) = match src {
        Src::Move(b) => (b.as_ptr() as u64, b.len(), Some(b)),
        Src::Copy(b) => (b.as_ptr() as u64, b.len(), None),
    };
    debug_assert!(src.is_multiple_of(PAGE as u64) && bytes.is_multiple_of(PAGE));
    let pages = bytes / PAGE;
    if pages == 0 {
        return Ok(0);
    }
    let dst = r.slot_addr(slot);
    let bytes = bytes as u64;
    let fd = p.uffd.as_raw_fd();
    if let Some(buf) = buf {
        // MOVE needs the source pages present and exclusively ours: touch them (they are, the
        // source just wrote them; pages it did not write are zero-filled now).
        for pg in buf.chunks_mut(PAGE) {
            // SAFETY: a volatile read-modify-write of our own buffer forces the page in.
            unsafe { std::ptr::write_volatile(pg.as_mut_ptr(), std::ptr::read_volatile(pg.as_ptr())) };
        }
        ioctl_loop(r, slot, "UFFDIO_MOVE", bytes, |done| {
            let mut m =
                sys::UffdioMove { dst: dst + done, src: src + done, len: bytes - done, mode: sys::UFFDIO_MOVE_MODE_DONTWAKE, moved: 0 };
            // SAFETY: both ranges are ours: dst inside the registered region, src inside the
            // staging mapping; len stays within both.
            let r = unsafe { sys::uffdio_move(fd, &mut m) };
            (r.map(|_| ()), m.moved)
        })?;
        if r.wp {
            // Moved pages arrive writable: protect them so the next write is tracked.
            let mut wp =
                sys::UffdioWriteprotect { range: sys::UffdioRange { start: dst, len: bytes }, mode: sys::UFFDIO_WRITEPROTECT_MODE_WP };
            // SAFETY: write-protecting the pages we just installed in our region.
            unsafe { sys::uffdio_writeprotect(fd, &mut wp) }.map_err(|source| UffdError::Ioctl {
                op: "UFFDIO_WRITEPROTECT",
                region: r.id,
                slot,
                source,
            })?;
        }
    } else {
        let mode = sys::UFFDIO_COPY_MODE_DONTWAKE | if r.wp { sys::UFFDIO_COPY_MODE_WP } else { 0 };
        ioctl_loop(r, slot, "UFFDIO_COPY", bytes, |done| {
            let mut c = sys::UffdioCopy { dst: dst + done, src: src + done, len: bytes - done, mode, copy: 0 };
            // SAFETY: as for MOVE; COPY only reads the source range.
            let r = unsafe { sys::uffdio_copy(fd, &mut c) };
            (r.map(|_| ()), c.copy)
        })?;
    }
    Ok(pages)
}

/// Runs an install ioctl until `total` bytes are in, following the kernel's contract:
/// EAGAIN with progress continues from there; EAGAIN without progress (the mm is changing
/// under us) retries with a bounded backoff; EEXIST means the page is already there (skip
/// it); any other errno is an error.
fn ioctl_loop(
    r: &RegionInner,
    slot: usize,
    op: &'static str,
    total: u64,
    mut call: impl FnMut(u64) -> (nix::Result<()>, i64),
) -> Result<()> {
    let mut done = 0u64;
    let mut retries = 0u32;
    while done < total {
        let (res, progress) = call(done);
        let progress = u64::try_from(progress).unwrap_or(0);
        match res {
            Ok(()) => return Ok(()),
            Err(Errno::EAGAIN) if progress > 0 => done += progress,
            Err(Errno::EAGAIN) => {
                retries += 1;
                if retries > 1000 {
                    return Err(UffdError::Ioctl { op, region: r.id, slot, source: Errno::EAGAIN });
                }
                std::thread::sleep(Duration::from_micros(u64::from(retries.min(100))));
            }
            Err(Errno::EEXIST) => done += if progress > 0 { progress } else { PAGE as u64 },
            Err(source) => return Err(UffdError::Ioctl { op, region: r.id, slot, source }),
        }
    }
    Ok(())
}

fn wake(p: &PagerInner, start: u64, len: u64) {
    let mut range = sys::UffdioRange { start, len };
    // SAFETY: UFFDIO_WAKE on a range of our region; failure is harmless (nobody waiting).
    let _ = unsafe { sys::uffdio_wake(p.uffd.as_raw_fd(), &mut range) };
}

/// Makes reads of a range raise SIGBUS (UFFDIO_POISON) and wakes its waiters. Without the
/// feature, the waiters are woken to fault again, which blocks them until the slot is
/// evicted and refilled: never zeros.
fn poison(p: &PagerInner, r: &RegionInner, slot: usize, start: u64, len: u64) {
    r.stats.poisoned.fetch_add(1, Ordering::Relaxed);
    if p.caps.poison {
        let mut arg = sys::UffdioPoison { range: sys::UffdioRange { start, len }, mode: 0, updated: 0 };
        // SAFETY: UFFDIO_POISON over a range of our region. EEXIST (a page is present) is
        // fine: that page has data.
        if let Err(e) = unsafe { sys::uffdio_poison(p.uffd.as_raw_fd(), &mut arg) } {
            if e != Errno::EEXIST {
                eprintln!("llms: uffd region {} slot {slot}: UFFDIO_POISON failed: {e}", r.id);
            }
        }
    }
    wake(p, start, len);
}

impl Region {
    pub fn id(&self) -> RegionId {
        RegionId(self.inner.id)
    }
    pub fn slot_size(&self) -> usize {
        self.inner.slot_size
    }
    pub fn n_slots(&self) -> usize {
        self.inner.n_slots
    }
    /// Address of a slot. Memory there may block on a fault (served by the pager) and may be
    /// evicted at any time unless the slot is pinned: hold a pin while reading or writing it
    /// if its contents must not change under you.
    pub fn slot_ptr(&self, slot: usize) -> *mut u8 {
        assert!(slot < self.inner.n_slots, "slot {slot} out of range");
        // SAFETY: inside the mapping (checked above).
        unsafe { self.inner.base.as_ptr().add(slot * self.inner.slot_size) }
    }
    pub fn state(&self, slot: usize) -> Result<SlotState> {
        self.inner.check(slot)?;
        Ok(self.inner.slots.lock().unwrap_or_else(|e| e.into_inner())[slot].state)
    }

    /// Makes a slot resident before use, from its source; waits if a fault is filling it.
    pub fn populate(&self, slot: usize) -> Result<()> {
        self.populate_inner(slot, None)
    }

    /// Makes a slot resident from `len` bytes the caller staged (for example data written out
    /// ahead of time); the staging pages are moved, not copied, where the kernel allows.
    /// Returns Ok without using the bytes if the slot is already resident.
    pub fn populate_from(&self, slot: usize, staging: &mut Staging, len: usize) -> Result<()> {
        self.populate_from_at(slot, staging, 0, len)
    }

    /// As [`Region::populate_from`], with the slot's bytes at page-aligned `offset` of the
    /// staging buffer (one large read staged for many slots).
    pub fn populate_from_at(&self, slot: usize, staging: &mut Staging, offset: usize, len: usize) -> Result<()> {
        let fits = offset.is_multiple_of(PAGE) && offset.checked_add(len).is_some_and(|end| end <= staging.len());
        if len > self.inner.slot_size || !fits {
            return Err(UffdError::TooLong { region: self.inner.id, slot, len, slot_size: self.inner.slot_size });
        }
        let pages = &mut staging.as_mut_slice()[offset..offset + len.div_ceil(PAGE) * PAGE];
        self.populate_inner(slot, Some(if self.pager.caps.r#move { Src::Move(pages) } else { Src::Copy(pages) }))
    }

    /// Makes a slot resident from the first `len` bytes of `src` (rounded up to pages; `src`
    /// starts on a page and holds them), copied (UFFDIO_COPY): the buffer keeps its pages,
    /// so a reused one (on huge pages, say) stays as it is, and threads can install from
    /// disjoint parts of one buffer at once. Returns Ok without using the bytes if the slot
    /// is already resident.
    pub fn copy_from(&self, slot: usize, src: &[u8], len: usize) -> Result<()> {
        let whole = len.div_ceil(PAGE) * PAGE;
        if len > self.inner.slot_size || !(src.as_ptr() as usize).is_multiple_of(PAGE) || whole > src.len() {
            return Err(UffdError::TooLong { region: self.inner.id, slot, len, slot_size: self.inner.slot_size });
        }
        self.populate_inner(slot, Some(Src::Copy(&src[..whole])))
    }

    /// Makes slots `first..` resident from `src`, which holds whole slots back to back
    /// (page-aligned): one UFFDIO_COPY per run of evicted slots rather than one per slot, and
    /// no wake unless a fault is waiting. Slots already resident, being filled or poisoned
    /// are left as they are (their bytes in `src` unused). Appends the slots installed to
    /// `out`; a run the kernel refuses is retried slot by slot, and a slot that still fails is
    /// poisoned, as a failed fill is.
    pub fn copy_run(&self, first: usize, src: &[u8], out: &mut Vec<usize>) -> Result<()> {
        let r = &self.inner;
        let ss = r.slot_size;
        let n = src.len() / ss;
        if !src.len().is_multiple_of(ss) || !(src.as_ptr() as usize).is_multiple_of(PAGE) {
            return Err(UffdError::TooLong { region: r.id, slot: first, len: src.len(), slot_size: ss });
        }
        if n == 0 {
            return Ok(());
        }
        r.check(first + n - 1)?;
        let bytes_of = |a: usize, b: usize| &src[(a - first) * ss..(b - first) * ss];
        let mut at = first;
        while at < first + n {
            // The next run of evicted slots, taken (Loading) under one lock.
            let (a, b) = {
                let mut slots = r.slots.lock().unwrap_or_else(|e| e.into_inner());
                let Some(a) = (at..first + n).find(|&i| slots[i].state == SlotState::Evicted) else { break };
                let b = (a..first + n).find(|&i| slots[i].state != SlotState::Evicted).unwrap_or(first + n);
                slots[a..b].iter_mut().for_each(|s| s.state = SlotState::Loading);
                (a, b)
            };
            at = b;
            r.stats.populates.fetch_add((b - a) as u64, Ordering::Relaxed);
            if install(&self.pager, r, a, Src::Copy(bytes_of(a, b))).is_err() {
                // Slot by slot: `fill_slot` skips pages already in and poisons what fails.
                for s in a..b {
                    if fill_slot(&self.pager, r, s, Some(Src::Copy(bytes_of(s, s + 1)))).is_ok() {
                        out.push(s);
                    }
                }
                continue;
            }
            let mut waiting = false;
            {
                let mut slots = r.slots.lock().unwrap_or_else(|e| e.into_inner());
                for s in &mut slots[a..b] {
                    s.state = SlotState::Resident;
                    s.filled_pages = ss / PAGE;
                    r.resident_pages.fetch_add(ss / PAGE, Ordering::Relaxed);
                    s.marked_dirty = false;
                    // Whole slots are filled: every waiting fault has its page.
                    waiting |= !std::mem::take(&mut s.pending).is_empty();
                }
            }
            for s in a..b {
                r.stats.filled(s, ss);
                out.push(s);
            }
            if waiting {
                wake(&self.pager, r.slot_addr(a), ((b - a) * ss) as u64);
            }
        }
        r.changed.notify_all();
        Ok(())
    }

    /// Moves the pages of `n` resident slots from `first` into the `n` evicted slots from
    /// `to_first` of `to`, a region of the same pager and slot size, without copying them
    /// (UFFDIO_MOVE: the page tables change hands; one ioctl for the run, so the kernel
    /// batches what it can of the TLB flushes): the target slots become resident with them
    /// (in a region that tracks writes, written until cleaned), the source slots evicted.
    /// Ok(false), with every slot as it was, when it cannot be: the kernel has no
    /// UFFDIO_MOVE, the regions belong to different pagers or differ in slot size, a source
    /// slot is not resident or is pinned, a target slot is not evicted, or the kernel refused
    /// the move part-way (pages shared with a forked child, say) and what moved was moved
    /// back. The caller copies then. The caller must know nobody reads or writes the source
    /// slots meanwhile (a fault would wait for the move, then read the slot's source).
    pub fn move_into(&self, first: usize, to: &Region, to_first: usize, n: usize) -> Result<bool> {
        if n == 0 {
            return Ok(true);
        }
        self.inner.check(first + n - 1)?;
        to.inner.check(to_first + n - 1)?;
        let (r, d) = (&self.inner, &to.inner);
        let ss = r.slot_size;
        if !self.pager.caps.r#move || !Arc::ptr_eq(&self.pager, &to.pager) || d.slot_size != ss {
            return Ok(false);
        }
        // One region's slot lock at a time (no lock order to get wrong); Loading keeps faults
        // and other installs off each slot until it is settled.
        let filled: Vec<usize> = {
            let mut st = r.slots.lock().unwrap_or_else(|e| e.into_inner());
            let run = &mut st[first..first + n];
            if run.iter().any(|s| s.state != SlotState::Resident || s.pins > 0) {
                return Ok(false);
            }
            run.iter_mut()
                .map(|s| {
                    s.state = SlotState::Loading;
                    s.filled_pages
                })
                .collect()
        };
        let taken = {
            let mut st = d.slots.lock().unwrap_or_else(|e| e.into_inner());
            let run = &mut st[to_first..to_first + n];
            let ok = run.iter().all(|s| s.state == SlotState::Evicted);
            if ok {
                run.iter_mut().for_each(|s| s.state = SlotState::Loading);
            }
            ok
        };
        let fd = self.pager.uffd.as_raw_fd();
        let (src, dst, bytes) = (r.slot_addr(first), d.slot_addr(to_first), (n * ss) as u64);
        // Pages past a slot's filled ones are holes: skipped.
        let mode = sys::UFFDIO_MOVE_MODE_DONTWAKE | sys::UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES;
        let mut moved = 0u64;
        let result = if taken {
            ioctl_loop(d, to_first, "UFFDIO_MOVE", bytes, |done| {
                let mut m = sys::UffdioMove { dst: dst + done, src: src + done, len: bytes - done, mode, moved: 0 };
                // SAFETY: both ranges lie inside our registered regions (slots checked above);
                // no slot of either is readable by anyone while it is Loading.
                let res = unsafe { sys::uffdio_move(fd, &mut m) };
                moved = done + u64::try_from(m.moved).unwrap_or(0);
                (res.map(|_| ()), m.moved)
            })
        } else {
            Ok(())
        };
        if !taken || result.is_err() {
            // Put back what moved, then every slot as it was.
            let back = if moved > 0 {
                ioctl_loop(r, first, "UFFDIO_MOVE", moved, |done| {
                    let mut m = sys::UffdioMove { dst: src + done, src: dst + done, len: moved - done, mode, moved: 0 };
                    // SAFETY: as above, the other way.
                    let res = unsafe { sys::uffdio_move(fd, &mut m) };
                    (res.map(|_| ()), m.moved)
                })
            } else {
                Ok(())
            };
            if taken {
                let mut st = d.slots.lock().unwrap_or_else(|e| e.into_inner());
                st[to_first..to_first + n].iter_mut().for_each(|s| s.state = SlotState::Evicted);
                drop(st);
                d.changed.notify_all();
            }
            let mut st = r.slots.lock().unwrap_or_else(|e| e.into_inner());
            for (s, &f) in st[first..first + n].iter_mut().zip(&filled) {
                if back.is_ok() {
                    s.state = SlotState::Resident;
                } else {
                    // Pages we could not return: the slot must be refilled from its source.
                    r.resident_pages.fetch_sub(f, Ordering::Relaxed);
                    s.filled_pages = 0;
                    s.state = SlotState::Evicted;
                }
            }
            drop(st);
            r.changed.notify_all();
            return back.map(|()| false);
        }
        // Moved pages arrive writable, so a region that tracks writes counts them written until
        // `clean` protects them: never clean pages someone may write unseen. Not protected
        // here: that doubled a 51 MB move's cost (docs/notes/uffd.md), and the caller saving
        // them cleans them anyway.
        let waiting: Vec<usize> = {
            let mut st = r.slots.lock().unwrap_or_else(|e| e.into_inner());
            (first..first + n)
                .zip(&filled)
                .filter(|&(k, &f)| {
                    let s = &mut st[k];
                    r.resident_pages.fetch_sub(f, Ordering::Relaxed);
                    s.filled_pages = 0;
                    s.marked_dirty = false;
                    // A fault that came meanwhile (the caller said none would) is served from
                    // the source; the slot stays Loading for it.
                    let waits = !s.pending.is_empty();
                    if !waits {
                        s.state = SlotState::Evicted;
                    }
                    waits
                })
                .map(|(k, _)| k)
                .collect()
        };
        for &f in &filled {
            r.stats.evicted(f * PAGE);
        }
        for k in waiting {
            start_fill(&self.pager, r, k, Instant::now());
        }
        r.changed.notify_all();
        let pending: Vec<(usize, Vec<u64>)> = {
            let mut st = d.slots.lock().unwrap_or_else(|e| e.into_inner());
            (to_first..to_first + n)
                .zip(&filled)
                .map(|(k, &f)| {
                    let s = &mut st[k];
                    s.state = SlotState::Resident;
                    s.filled_pages = f;
                    s.marked_dirty = false;
                    d.resident_pages.fetch_add(f, Ordering::Relaxed);
                    (k, std::mem::take(&mut s.pending))
                })
                .collect()
        };
        for ((k, waiters), &f) in pending.into_iter().zip(&filled) {
            d.stats.filled(k, f * PAGE);
            if !waiters.is_empty() {
                wake(&self.pager, d.slot_addr(k), ss as u64);
                let end = d.slot_addr(k) + (f * PAGE) as u64;
                for a in waiters.into_iter().filter(|&a| a >= end) {
                    poison(&self.pager, d, k, a, PAGE as u64);
                }
            }
        }
        d.changed.notify_all();
        Ok(true)
    }

    fn populate_inner(&self, slot: usize, given: Option<Src<'_>>) -> Result<()> {
        self.inner.check(slot)?;
        let r = &self.inner;
        let mut slots = r.slots.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match slots[slot].state {
                SlotState::Resident => return Ok(()),
                SlotState::Poisoned => {
                    return Err(UffdError::Source { region: r.id, slot, reason: "the slot is poisoned; evict it to retry".into() })
                }
                SlotState::Loading => slots = r.changed.wait(slots).unwrap_or_else(|e| e.into_inner()),
                SlotState::Evicted => {
                    slots[slot].state = SlotState::Loading;
                    drop(slots);
                    r.stats.populates.fetch_add(1, Ordering::Relaxed);
                    return fill_slot(&self.pager, r, slot, given);
                }
            }
        }
    }

    /// How many slots of `range` are resident, under one lock (a reader checking a whole
    /// group before it reads it, on its hot path).
    pub fn resident_in(&self, range: std::ops::Range<usize>) -> usize {
        let slots = self.inner.slots.lock().unwrap_or_else(|e| e.into_inner());
        let end = range.end.min(slots.len());
        slots[range.start.min(end)..end].iter().filter(|s| s.state == SlotState::Resident).count()
    }

    /// The slots of `slots` that are evicted (neither resident, nor being filled, nor
    /// poisoned), appended to `out` in order, under one lock.
    pub fn evicted_of(&self, slots: &[usize], out: &mut Vec<usize>) {
        let st = self.inner.slots.lock().unwrap_or_else(|e| e.into_inner());
        out.extend(slots.iter().copied().filter(|&s| st.get(s).is_some_and(|x| x.state == SlotState::Evicted)));
    }

    /// Pins a slot (populating it first): it will not be evicted until unpinned.
    pub fn pin(&self, slot: usize) -> Result<()> {
        self.populate(slot)?;
        let mut slots = self.inner.slots.lock().unwrap_or_else(|e| e.into_inner());
        if slots[slot].state != SlotState::Resident {
            drop(slots);
            // Evicted between populate and the lock: go round again.
            return self.pin(slot);
        }
        slots[slot].pins += 1;
        Ok(())
    }

    pub fn unpin(&self, slot: usize) -> Result<()> {
        self.inner.check(slot)?;
        let mut slots = self.inner.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots[slot].pins = slots[slot].pins.saturating_sub(1);
        Ok(())
    }

    /// Records that a slot was written (for kernels without WP_ASYNC dirty tracking).
    pub fn mark_dirty(&self, slot: usize) -> Result<()> {
        self.inner.check(slot)?;
        self.inner.slots.lock().unwrap_or_else(|e| e.into_inner())[slot].marked_dirty = true;
        Ok(())
    }

    /// Pages of a resident slot written since it was filled or last cleaned.
    pub fn dirty_pages(&self, slot: usize) -> Result<Vec<usize>> {
        self.scan(slot, false)
    }

    /// Returns the written pages and marks the slot clean again in the same step (the caller
    /// has written those pages out).
    pub fn clean(&self, slot: usize) -> Result<Vec<usize>> {
        let pages = self.scan(slot, true)?;
        self.inner.slots.lock().unwrap_or_else(|e| e.into_inner())[slot].marked_dirty = false;
        Ok(pages)
    }

    fn scan(&self, slot: usize, reprotect: bool) -> Result<Vec<usize>> {
        self.inner.check(slot)?;
        let r = &self.inner;
        let (state, filled, marked) = {
            let s = &r.slots.lock().unwrap_or_else(|e| e.into_inner())[slot];
            (s.state, s.filled_pages, s.marked_dirty)
        };
        if state != SlotState::Resident {
            return Ok(Vec::new());
        }
        if !r.wp {
            return Ok(if marked { (0..filled).collect() } else { Vec::new() });
        }
        crate::dirty::written_pages(r.id, r.slot_addr(slot), r.slot_size, reprotect)
    }

    /// Drops a slot's pages so the next touch faults it in again. Refused while the slot is
    /// pinned, being loaded, or holds writes that were not cleaned (written out): eviction
    /// never loses data it was not told was saved.
    pub fn evict(&self, slot: usize) -> Result<()> {
        self.evict_inner(slot, false)
    }

    /// Evicts what it can of `slots` (as [`Region::evict`]: not pinned, being loaded or
    /// holding unsaved writes) with one batched MADV_DONTNEED — one syscall and one TLB flush
    /// for them all where the kernel offers process_madvise on itself (6.13+), else one
    /// madvise per run of adjacent slots. Appends the evicted slots to `out`.
    pub fn evict_many(&self, slots: &[usize], out: &mut Vec<usize>) -> Result<()> {
        let r = &self.inner;
        let mut st = r.slots.lock().unwrap_or_else(|e| e.into_inner());
        let mut go: Vec<usize> = Vec::with_capacity(slots.len());
        for &slot in slots {
            let Some(s) = st.get(slot) else { continue };
            match r.evictable(s, slot, false) {
                Ok(true) => go.push(slot),
                // Already evicted, or refused (pinned, loading, unsaved writes): skipped.
                Ok(false) | Err(UffdError::Busy { .. } | UffdError::Pinned { .. } | UffdError::Dirty { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        go.sort_unstable();
        go.dedup();
        let freed = self.drop_pages(&mut st, &go)?;
        drop(st);
        freed.into_iter().for_each(|b| r.stats.evicted(b));
        out.extend_from_slice(&go);
        r.changed.notify_all();
        Ok(())
    }

    /// Drops a slot's pages even if written (the caller no longer wants its contents).
    pub fn discard(&self, slot: usize) -> Result<()> {
        self.evict_inner(slot, true)
    }

    fn evict_inner(&self, slot: usize, discard: bool) -> Result<()> {
        self.inner.check(slot)?;
        let r = &self.inner;
        let mut slots = r.slots.lock().unwrap_or_else(|e| e.into_inner());
        if !r.evictable(&slots[slot], slot, discard)? {
            return Ok(());
        }
        let freed = self.drop_pages(&mut slots, &[slot])?;
        drop(slots);
        r.stats.evicted(freed[0]);
        r.changed.notify_all();
        Ok(())
    }

    /// Drops the pages of `go` (evictable slots, increasing, each once; the caller holds the
    /// slot lock) with one batched MADV_DONTNEED and marks them Evicted. Under the lock: a
    /// fault for these slots waits until they are Evicted, then refills them; the zap itself
    /// takes microseconds. Returns the bytes each freed.
    fn drop_pages(&self, st: &mut [Slot], go: &[usize]) -> Result<Vec<usize>> {
        let ss = self.inner.slot_size;
        let mut runs: Vec<(*mut u8, usize)> = Vec::new();
        let mut last = usize::MAX;
        for &s in go {
            match runs.last_mut() {
                Some((_, len)) if last.wrapping_add(1) == s => *len += ss,
                _ => runs.push((self.slot_ptr(s), ss)),
            }
            last = s;
        }
        dontneed(&runs).map_err(|source| UffdError::Ioctl {
            op: "MADV_DONTNEED",
            region: self.inner.id,
            slot: go.first().copied().unwrap_or(0),
            source,
        })?;
        Ok(go
            .iter()
            .map(|&slot| {
                let s = &mut st[slot];
                if s.state == SlotState::Resident {
                    self.inner.resident_pages.fetch_sub(s.filled_pages, Ordering::Relaxed);
                }
                s.state = SlotState::Evicted;
                s.marked_dirty = false;
                std::mem::take(&mut s.filled_pages) * PAGE
            })
            .collect())
    }

    /// Keeps only the first `len` bytes (rounded up to pages) of a resident slot and returns
    /// the rest of its pages (a chunk converted in place to a smaller format). Touching the
    /// dropped tail afterwards raises SIGBUS, as any touch past a slot's data does.
    pub fn shrink(&self, slot: usize, len: usize) -> Result<()> {
        self.inner.check(slot)?;
        let r = &self.inner;
        let mut slots = r.slots.lock().unwrap_or_else(|e| e.into_inner());
        let s = &mut slots[slot];
        let keep = len.div_ceil(PAGE);
        if s.state != SlotState::Resident || keep >= s.filled_pages {
            return Ok(());
        }
        // SAFETY: the tail pages of our own slot; the slot stays resident with fewer pages.
        let rc = unsafe { libc::madvise(self.slot_ptr(slot).add(keep * PAGE).cast(), (s.filled_pages - keep) * PAGE, libc::MADV_DONTNEED) };
        if rc != 0 {
            return Err(UffdError::Ioctl { op: "MADV_DONTNEED", region: r.id, slot, source: Errno::last() });
        }
        let freed = (s.filled_pages - keep) * PAGE;
        r.resident_pages.fetch_sub(s.filled_pages - keep, Ordering::Relaxed);
        s.filled_pages = keep;
        drop(slots);
        r.stats.evicted(freed);
        Ok(())
    }

    /// Whether writes to this region are tracked by the kernel (WP_ASYNC).
    pub fn tracks_writes(&self) -> bool {
        self.inner.wp
    }

    /// Bytes of the slots that are resident (their filled pages).
    pub fn resident_bytes(&self) -> usize {
        #[cfg(debug_assertions)]
        {
            let slots = self.inner.slots.lock().unwrap_or_else(|e| e.into_inner());
            let walked: usize = slots.iter().filter(|s| s.state == SlotState::Resident).map(|s| s.filled_pages).sum();
            assert_eq!(self.inner.resident_pages.load(Ordering::Relaxed), walked, "the resident count follows the slots");
        }
        self.inner.resident_pages.load(Ordering::Relaxed) * PAGE
    }

    /// Bytes resident of the slots in `range` (their filled pages), under one lock.
    pub fn resident_bytes_in(&self, range: std::ops::Range<usize>) -> usize {
        let slots = self.inner.slots.lock().unwrap_or_else(|e| e.into_inner());
        let end = range.end.min(slots.len());
        slots[range.start.min(end)..end].iter().filter(|s| s.state == SlotState::Resident).map(|s| s.filled_pages * PAGE).sum()
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.inner.stats.snapshot()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let r = &self.inner;
        self.pager.regions.write().unwrap_or_else(|e| e.into_inner()).remove(&r.id);
        sigbus::unregister(r.id);
        let mut range = sys::UffdioRange { start: r.base.as_ptr() as u64, len: r.len as u64 };
        // Order matters: unregister first (waking any thread still blocked in the range),
        // then unmap; the uffd itself stays open in the pager until every region is gone, so a
        // registered range never silently turns into zero-fill memory.
        // SAFETY: unregistering and unmapping the range this region owns.
        unsafe {
            let _ = sys::uffdio_unregister(self.pager.uffd.as_raw_fd(), &mut range);
            libc::munmap(r.base.as_ptr().cast(), r.len);
        }
        wake_handler(&self.pager);
    }
}

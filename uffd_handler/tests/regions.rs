//! The pager on the real kernel: faults, populate, evict, pin, dirty tracking, poison.
#![allow(clippy::cast_possible_truncation)]

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use llms_tests::{kernel_required, require_kernel};
use rand::{Rng, SeedableRng};
use uffd_handler::{Pager, Region, RegionId, SlotSource, SlotState, SourceError, Staging, UffdError, PAGE};

/// Slot contents derived from (region, slot, version): word i = f(region, slot, version, i).
fn word(region: RegionId, slot: usize, version: u64, i: usize) -> u64 {
    (u64::from(region.0) << 56) ^ ((slot as u64) << 40) ^ (version << 24) ^ i as u64
}

#[derive(Default)]
struct PatternSource {
    versions: Mutex<HashMap<usize, u64>>,
    calls: AtomicU64,
    /// Bytes produced per fill (None: the whole slot).
    len: Option<usize>,
    fail: HashSet<usize>,
    delay: Option<Duration>,
}

impl PatternSource {
    fn version(&self, slot: usize) -> u64 {
        *self.versions.lock().unwrap().get(&slot).unwrap_or(&0)
    }
}

impl SlotSource for PatternSource {
    fn fill(&self, region: RegionId, slot: usize, buf: &mut [u8]) -> Result<usize, SourceError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if let Some(d) = self.delay {
            std::thread::sleep(d);
        }
        if self.fail.contains(&slot) {
            return Err(format!("flash record for slot {slot} is corrupt").into());
        }
        let v = self.version(slot);
        let n = self.len.unwrap_or(buf.len());
        for (i, w) in buf[..n].chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&word(region, slot, v, i).to_le_bytes());
        }
        Ok(n)
    }
}

fn pager() -> Option<Pager> {
    require_kernel("userfaultfd", Pager::new())
}

/// Reads word `i` of a slot through the mapping (this is what may fault).
fn read_word(r: &Region, slot: usize, i: usize) -> u64 {
    // SAFETY: inside the slot; the pager serves the page.
    unsafe { std::ptr::read_volatile(r.slot_ptr(slot).cast::<u64>().add(i)) }
}

fn check_slot(r: &Region, slot: usize, version: u64, words: usize) {
    for i in (0..words).step_by(61) {
        assert_eq!(read_word(r, slot, i), word(r.id(), slot, version, i), "slot {slot} word {i}");
    }
}

const SLOT: usize = 16 * 1024;

#[test]
fn touching_a_slot_fills_it_from_its_source_and_eviction_refetches() {
    let Some(p) = pager() else { return };
    let src = Arc::new(PatternSource::default());
    let r = p.region(SLOT, 8, src.clone()).unwrap();
    for s in 0..8 {
        assert_eq!(r.state(s).unwrap(), SlotState::Evicted);
        check_slot(&r, s, 0, SLOT / 8);
        assert_eq!(r.state(s).unwrap(), SlotState::Resident);
    }
    assert_eq!(src.calls.load(Ordering::SeqCst), 8, "one fill per slot, whole slot at once");
    assert_eq!(r.resident_bytes(), 8 * SLOT);
    r.evict(3).unwrap();
    assert_eq!(r.resident_bytes(), 7 * SLOT);
    src.versions.lock().unwrap().insert(3, 9);
    check_slot(&r, 3, 9, SLOT / 8);
    let st = r.stats();
    assert_eq!(st.fills, 9);
    assert!(st.faults >= 9);
    assert_eq!(st.evictions, 1);
    assert!(st.faults_timed >= 9 && st.fault_p50_ns > 0 && st.fault_p99_ns >= st.fault_p50_ns);
    assert!(matches!(r.evict(99), Err(UffdError::NoSlot { .. })));
}

#[test]
fn pages_dropped_behind_the_pagers_back_are_loaded_again() {
    let Some(p) = pager() else { return };
    let src = Arc::new(PatternSource::default());
    let r = p.region(SLOT, 2, src.clone()).unwrap();
    check_slot(&r, 0, 0, SLOT / 8);
    // Page 0 is written (not yet saved), page 2 dropped by someone else.
    // SAFETY: inside slot 0.
    unsafe { std::ptr::write_volatile(r.slot_ptr(0).cast::<u64>(), 0xdead) };
    // SAFETY: MADV_DONTNEED on page 2 of slot 0, a range of our own mapping.
    let rc = unsafe { libc::madvise(r.slot_ptr(0).add(2 * PAGE).cast(), PAGE, libc::MADV_DONTNEED) };
    assert_eq!(rc, 0);
    // The next read of page 2 faults and gets the source's data again (not zeros, no hang);
    // the written page keeps its write.
    for i in (1..SLOT / 8).step_by(61) {
        assert_eq!(read_word(&r, 0, i), word(r.id(), 0, 0, i), "word {i}");
    }
    assert_eq!(read_word(&r, 0, 0), 0xdead);
    assert_eq!(read_word(&r, 0, 2 * PAGE / 8 + 5), word(r.id(), 0, 0, 2 * PAGE / 8 + 5));
    assert_eq!(src.calls.load(Ordering::SeqCst), 2, "the slot was filled again once");
    assert_eq!(r.state(0).unwrap(), SlotState::Resident);
}

#[test]
fn kernel_accesses_to_a_region_are_served() {
    let Some(p) = pager() else { return };
    let r = p.region(SLOT, 2, Arc::new(PatternSource::default())).unwrap();
    // write(2) from the region makes the kernel itself fault on it (copy_from_user): this
    // only works because the uffd is not user-mode-only.
    let mut fds = [0i32; 2];
    // SAFETY: creating a pipe.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: writing one page of slot 1 into the pipe.
    let n = unsafe { libc::write(fds[1], r.slot_ptr(1).cast(), PAGE) };
    assert_eq!(n, PAGE as isize);
    let mut buf = vec![0u8; PAGE];
    // SAFETY: reading it back into our buffer.
    assert_eq!(unsafe { libc::read(fds[0], buf.as_mut_ptr().cast(), PAGE) }, PAGE as isize);
    // SAFETY: closing our pipe.
    unsafe {
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
    assert_eq!(u64::from_le_bytes(buf[8..16].try_into().unwrap()), word(r.id(), 1, 0, 1));
}

#[test]
fn populate_races_safely_with_faults_on_the_same_slot() {
    let Some(p) = pager() else { return };
    let src = Arc::new(PatternSource { delay: Some(Duration::from_micros(300)), ..Default::default() });
    let r = Arc::new(p.region(SLOT, 4, src.clone()).unwrap());
    for round in 0..40u64 {
        r.evict(2).unwrap();
        src.versions.lock().unwrap().insert(2, round);
        let before = src.calls.load(Ordering::SeqCst);
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let r = Arc::clone(&r);
                std::thread::spawn(move || check_slot(&r, 2, round, SLOT / 8))
            })
            .collect();
        r.populate(2).unwrap();
        for t in readers {
            t.join().unwrap();
        }
        assert_eq!(src.calls.load(Ordering::SeqCst) - before, 1, "round {round}: one fill however many touch it");
    }
}

#[test]
fn a_short_fill_installs_only_its_pages() {
    let Some(p) = pager() else { return };
    let src = Arc::new(PatternSource { len: Some(5000), ..Default::default() });
    let r = p.region(SLOT, 2, src).unwrap();
    r.populate(0).unwrap();
    assert_eq!(r.resident_bytes(), 2 * PAGE, "5000 bytes take two pages, not the whole slot");
    check_slot(&r, 0, 0, 5000 / 8);
}

#[test]
fn pinned_slots_are_never_evicted() {
    let Some(p) = pager() else { return };
    let r = p.region(SLOT, 2, Arc::new(PatternSource::default())).unwrap();
    r.pin(1).unwrap();
    r.pin(1).unwrap();
    assert!(matches!(r.evict(1), Err(UffdError::Pinned { slot: 1, .. })));
    r.unpin(1).unwrap();
    assert!(matches!(r.evict(1), Err(UffdError::Pinned { .. })));
    r.unpin(1).unwrap();
    r.evict(1).unwrap();
    assert_eq!(r.state(1).unwrap(), SlotState::Evicted);
}

#[test]
fn dirty_tracking_finds_exactly_the_pages_written() {
    let Some(p) = pager() else { return };
    let slot_size = 8 * PAGE;
    let r = p.region(slot_size, 2, Arc::new(PatternSource::default())).unwrap();
    if !p.capabilities().wp_async {
        assert!(!kernel_required(), "this kernel lacks UFFD_FEATURE_WP_ASYNC");
        r.populate(0).unwrap();
        r.mark_dirty(0).unwrap();
        assert!(matches!(r.evict(0), Err(UffdError::Dirty { .. })));
        return;
    }
    r.populate(0).unwrap();
    check_slot(&r, 0, 0, slot_size / 8);
    assert_eq!(r.dirty_pages(0).unwrap(), Vec::<usize>::new(), "reads do not dirty");
    // SAFETY: writing inside slot 0, pages 1 and 5.
    unsafe {
        *r.slot_ptr(0).add(PAGE + 8) = 1;
        *r.slot_ptr(0).add(5 * PAGE + 100) = 2;
    }
    assert_eq!(r.dirty_pages(0).unwrap(), vec![1, 5]);
    assert!(matches!(r.evict(0), Err(UffdError::Dirty { pages: 2, .. })), "unsaved writes are never dropped");
    assert_eq!(r.clean(0).unwrap(), vec![1, 5]);
    assert_eq!(r.dirty_pages(0).unwrap(), Vec::<usize>::new());
    // SAFETY: writing page 5 again.
    unsafe { *r.slot_ptr(0).add(5 * PAGE) = 3 };
    assert_eq!(r.dirty_pages(0).unwrap(), vec![5]);
    r.clean(0).unwrap();
    r.evict(0).unwrap();
    // A slot populated ahead of use starts clean too.
    let mut st = Staging::new(slot_size).unwrap();
    st.as_mut_slice()[..8].copy_from_slice(&7u64.to_le_bytes());
    r.populate_from(1, &mut st, slot_size).unwrap();
    assert_eq!(read_word(&r, 1, 0), 7);
    assert_eq!(r.dirty_pages(1).unwrap(), Vec::<usize>::new());
    r.discard(1).unwrap();
}

#[test]
fn populate_from_a_staging_buffer_does_not_call_the_source() {
    let Some(p) = pager() else { return };
    let src = Arc::new(PatternSource::default());
    let r = p.region(SLOT, 2, src.clone()).unwrap();
    let mut st = Staging::new(SLOT).unwrap();
    for (i, w) in st.as_mut_slice().chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&word(r.id(), 0, 42, i).to_le_bytes());
    }
    r.populate_from(0, &mut st, SLOT).unwrap();
    check_slot(&r, 0, 42, SLOT / 8);
    assert_eq!(src.calls.load(Ordering::SeqCst), 0);
    assert!(matches!(r.populate_from(1, &mut st, SLOT + 1), Err(UffdError::TooLong { .. })));
}

/// Fills `buf` with the pattern of slots `first..` at `version`, back to back.
fn stage_pattern(r: &Region, first: usize, version: u64, buf: &mut [u8]) {
    for (k, slot) in buf.chunks_exact_mut(SLOT).enumerate() {
        for (i, w) in slot.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&word(r.id(), first + k, version, i).to_le_bytes());
        }
    }
}

#[test]
fn copy_run_installs_the_evicted_slots_of_a_run_and_leaves_the_rest() {
    let Some(p) = pager() else { return };
    let src = Arc::new(PatternSource::default());
    let r = p.region(SLOT, 8, src.clone()).unwrap();
    r.populate(2).unwrap();
    let mut st = Staging::new(5 * SLOT).unwrap();
    stage_pattern(&r, 0, 9, st.as_mut_slice());
    let mut out = Vec::new();
    r.copy_run(0, &st.as_mut_slice()[..4 * SLOT], &mut out).unwrap();
    assert_eq!(out, [0, 1, 3], "slot 2 was resident: left as it was");
    assert_eq!(src.calls.load(Ordering::SeqCst), 1, "only slot 2's own fill");
    for s in [0, 1, 3] {
        assert_eq!(r.state(s).unwrap(), SlotState::Resident);
        check_slot(&r, s, 9, SLOT / 8);
    }
    check_slot(&r, 2, 0, SLOT / 8);
    assert_eq!(r.resident_bytes(), 4 * SLOT);
    // Hostile calls: nothing installed, a clear error.
    let buf = st.as_mut_slice();
    assert!(matches!(r.copy_run(4, &buf[..SLOT + 8], &mut out), Err(UffdError::TooLong { .. })), "not whole slots");
    assert!(matches!(r.copy_run(4, &buf[8..SLOT + 8], &mut out), Err(UffdError::TooLong { .. })), "not page-aligned");
    assert!(matches!(r.copy_run(6, &buf[..3 * SLOT], &mut out), Err(UffdError::NoSlot { slot: 8, .. })), "past the region");
    assert_eq!(out, [0, 1, 3]);
    assert_eq!(r.state(6).unwrap(), SlotState::Evicted);
}

/// Readers faulting on slots while they are evicted and installed by runs always see the
/// right bytes and are always woken (a lost wake hangs this test).
#[test]
fn copy_run_wakes_every_reader_that_faulted() {
    let Some(p) = pager() else { return };
    // A slow source: a reader's fault usually finds the slot being filled by `copy_run`.
    let src = Arc::new(PatternSource { delay: Some(Duration::from_micros(500)), ..Default::default() });
    let r = Arc::new(p.region(SLOT, 8, src).unwrap());
    let mut st = Staging::new(8 * SLOT).unwrap();
    stage_pattern(&r, 0, 0, st.as_mut_slice());
    let stop = Arc::new(AtomicBool::new(false));
    // Each reader's count of checked slots: the runs go on until every reader has read
    // through a few, so a reader the scheduler started late still meets runs (on a loaded
    // 2-core machine 200 runs can end before a thread first runs), or until a reader has
    // ended (a wrong byte panics it: joined below, a failure rather than a hang).
    let reads: Arc<[AtomicU64; 3]> = Arc::new(Default::default());
    let readers: Vec<_> = (0..3)
        .map(|t| {
            let (r, stop, reads) = (Arc::clone(&r), Arc::clone(&stop), Arc::clone(&reads));
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let s = (t * 3 + n as usize) % 8;
                    check_slot(&r, s, 0, SLOT / 8);
                    n += 1;
                    reads[t].store(n, Ordering::Relaxed);
                }
                n
            })
        })
        .collect();
    let (mut out, mut gone) = (Vec::new(), Vec::new());
    let mut runs = 0;
    while runs < 200 || (reads.iter().any(|n| n.load(Ordering::Relaxed) < 16) && !readers.iter().any(|t| t.is_finished())) {
        gone.clear();
        r.evict_many(&(0..8).collect::<Vec<_>>(), &mut gone).unwrap();
        r.copy_run(0, st.as_mut_slice(), &mut out).unwrap();
        runs += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for t in readers {
        assert!(t.join().unwrap() >= 16);
    }
    assert!(!out.is_empty(), "runs installed slots");
}

#[test]
fn evict_many_drops_what_it_may_in_one_batch() {
    let Some(p) = pager() else { return };
    let src = Arc::new(PatternSource::default());
    let r = p.region(SLOT, 8, src.clone()).unwrap();
    for s in 0..8 {
        r.populate(s).unwrap();
    }
    r.pin(3).unwrap();
    let mut out = Vec::new();
    r.evict_many(&[7, 1, 2, 3, 5, 6, 7, 99], &mut out).unwrap();
    assert_eq!(out, [1, 2, 5, 6, 7], "pinned, repeated and out-of-range slots are not evicted");
    assert_eq!(r.resident_bytes(), 3 * SLOT);
    for s in 0..8 {
        let want = if [0, 3, 4].contains(&s) { SlotState::Resident } else { SlotState::Evicted };
        assert_eq!(r.state(s).unwrap(), want, "slot {s}");
    }
    // Dropped pages really went: touching one fills it from its source again.
    let before = src.calls.load(Ordering::SeqCst);
    check_slot(&r, 6, 0, SLOT / 8);
    assert_eq!(src.calls.load(Ordering::SeqCst), before + 1);
    assert_eq!(r.stats().evictions, 5);
}

/// The kilobytes of `AnonHugePages` of the mapping holding `addr` (from /proc/self/smaps).
fn anon_huge_kb(addr: usize) -> Option<usize> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = head.split_once('-').filter(|(a, _)| a.chars().all(|c| c.is_ascii_hexdigit())) {
            let (a, b) = (usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?);
            inside = (a..b).contains(&addr);
        } else if inside {
            if let Some(v) = line.strip_prefix("AnonHugePages:") {
                return v.trim().trim_end_matches("kB").trim().parse().ok();
            }
        }
    }
    None
}

#[test]
fn copying_from_a_huge_page_buffer_keeps_the_buffer() {
    let Some(p) = pager() else { return };
    let src = Arc::new(PatternSource::default());
    let r = p.region(SLOT, 2, src.clone()).unwrap();
    let mut st = Staging::huge(4 << 20).unwrap();
    let base = st.as_mut_slice().as_ptr() as usize;
    assert_eq!(base % (2 << 20), 0, "aligned to a huge page");
    assert!(st.as_mut_slice().iter().all(|&b| b == 0), "a fresh buffer is zeros");
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if thp.contains("[always]") || thp.contains("[madvise]") {
        assert!(anon_huge_kb(base).is_some_and(|kb| kb >= 2048), "THP is {thp:?} but the buffer has no huge page");
    }
    for slot in 0..2 {
        for (i, w) in st.as_mut_slice()[SLOT..2 * SLOT].chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&word(r.id(), slot, 9, i).to_le_bytes());
        }
        r.copy_from(slot, &st.as_mut_slice()[SLOT..], SLOT).unwrap();
        check_slot(&r, slot, 9, SLOT / 8);
        // The buffer kept its bytes (a MOVE would have left zeros behind).
        assert_eq!(st.as_mut_slice()[SLOT..SLOT + 8], word(r.id(), slot, 9, 0).to_le_bytes());
    }
    assert_eq!(src.calls.load(Ordering::SeqCst), 0);
    r.discard(0).unwrap();
    let buf = st.as_mut_slice();
    assert!(matches!(r.copy_from(0, &buf[100..], SLOT), Err(UffdError::TooLong { .. })), "sources start on a page");
    assert!(matches!(r.copy_from(0, &buf[..SLOT], SLOT + 1), Err(UffdError::TooLong { .. })), "and hold whole pages");
}

/// Readers, writers, an evictor and a populator on random slots for a bounded time; every
/// read matches what the source says the slot holds.
#[test]
fn integrity_under_concurrent_faults_writes_and_evictions() {
    let Some(p) = pager() else { return };
    const N: usize = 24;
    let src = Arc::new(PatternSource::default());
    let r = Arc::new(p.region(SLOT, N, src.clone()).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    // Unpinned readers on the read-only half: faults race with evictions there.
    for seed in 0..2u64 {
        let (r, stop) = (Arc::clone(&r), Arc::clone(&stop));
        threads.push(std::thread::spawn(move || {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            while !stop.load(Ordering::Relaxed) {
                let s = rng.gen_range(0..N / 2);
                check_slot(&r, s, 0, SLOT / 8);
            }
        }));
    }
    // A writer on the other half: lock the slot (as mm locks a context for a call), pin,
    // write a new version, "write it out" to the source, clean, unpin. A pinned reader there
    // checks whole-slot consistency under the same lock.
    let locks: Arc<Vec<Mutex<()>>> = Arc::new((0..N).map(|_| Mutex::new(())).collect());
    {
        let (r, stop, src, locks) = (Arc::clone(&r), Arc::clone(&stop), Arc::clone(&src), Arc::clone(&locks));
        threads.push(std::thread::spawn(move || {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(99);
            while !stop.load(Ordering::Relaxed) {
                let s = rng.gen_range(N / 2..N);
                let _g = locks[s].lock().unwrap();
                r.pin(s).unwrap();
                let v = src.version(s) + 1;
                for i in 0..SLOT / 8 {
                    // SAFETY: inside the pinned slot.
                    unsafe { std::ptr::write_volatile(r.slot_ptr(s).cast::<u64>().add(i), word(r.id(), s, v, i)) };
                }
                src.versions.lock().unwrap().insert(s, v);
                r.clean(s).unwrap();
                r.unpin(s).unwrap();
            }
        }));
    }
    {
        let (r, stop, src, locks) = (Arc::clone(&r), Arc::clone(&stop), Arc::clone(&src), Arc::clone(&locks));
        threads.push(std::thread::spawn(move || {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
            while !stop.load(Ordering::Relaxed) {
                let s = rng.gen_range(N / 2..N);
                let _g = locks[s].lock().unwrap();
                r.pin(s).unwrap();
                let v = read_word(&r, s, 0) >> 24 & 0xFFFF;
                assert_eq!(v, src.version(s), "a pinned slot holds the saved version");
                check_slot(&r, s, v, SLOT / 8);
                r.unpin(s).unwrap();
            }
        }));
    }
    // Evictor and populator.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let t0 = Instant::now();
    let (mut evicted, mut refused) = (0, 0);
    while t0.elapsed() < Duration::from_secs(2) {
        let s = rng.gen_range(0..N);
        match r.evict(s) {
            Ok(()) => evicted += 1,
            Err(UffdError::Pinned { .. } | UffdError::Busy { .. } | UffdError::Dirty { .. }) => refused += 1,
            Err(e) => panic!("evict: {e}"),
        }
        if rng.gen_bool(0.3) {
            r.populate(rng.gen_range(0..N)).unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    assert!(evicted > 100, "the evictor made progress ({evicted} evictions, {refused} refused)");
    assert!(r.stats().faults > 0);
}

#[test]
fn dropping_the_pager_with_threads_blocked_on_faults_does_not_hang() {
    let Some(p) = pager() else { return };
    let src = Arc::new(PatternSource { delay: Some(Duration::from_millis(200)), ..Default::default() });
    let r = Arc::new(p.region(SLOT, 4, src.clone()).unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    for s in 0..3 {
        let (r, tx) = (Arc::clone(&r), tx.clone());
        std::thread::spawn(move || {
            check_slot(&r, s, 0, 16);
            tx.send(s).unwrap();
        });
    }
    // Drop the pager while a fill is running (the source sleeps 200 ms in it).
    llms_tests::wait_until("a fault to reach the source", Duration::from_secs(60), || (src.calls.load(Ordering::SeqCst) > 0).then_some(()));
    drop(p);
    for _ in 0..3 {
        rx.recv_timeout(Duration::from_secs(60)).expect("a faulting thread was left blocked");
    }
    drop(r);
}

/// Run in a child process by `a_failing_source_poisons_its_slot_and_readers_get_sigbus`.
#[test]
#[ignore = "helper: runs in a child process, where it dies of SIGBUS"]
fn child_touches_a_poisoned_slot() {
    let p = Pager::new().unwrap();
    let short = std::env::var("LLMS_UFFD_CHILD_CASE").as_deref() == Ok("short");
    let src = Arc::new(PatternSource { fail: [2].into_iter().collect(), len: short.then_some(PAGE), ..Default::default() });
    let r = p.region(SLOT, 4, src).unwrap();
    check_slot(&r, 1, 0, 16);
    if short {
        // Slot 1 holds one page of data; its third page has none.
        let _ = read_word(&r, 1, 2 * PAGE / 8);
    } else {
        let _ = read_word(&r, 2, 0);
    }
    unreachable!("reading a poisoned slot must not return");
}

fn run_child(case: &str) -> (Option<i32>, String) {
    use std::os::unix::process::ExitStatusExt;
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_touches_a_poisoned_slot", "--nocapture", "--test-threads=1"])
        .env("LLMS_UFFD_CHILD_CASE", case)
        .output()
        .unwrap();
    (out.status.signal(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_failing_source_poisons_its_slot_and_readers_get_sigbus() {
    let Some(p) = pager() else { return };
    if !p.capabilities().poison {
        assert!(!kernel_required(), "this kernel lacks UFFD_FEATURE_POISON");
        return;
    }
    let (sig, err) = run_child("source");
    assert_eq!(sig, Some(libc::SIGBUS), "stderr: {err}");
    assert!(err.contains("poisoned slot 2 of userfaultfd region"), "{err}");
    assert!(err.contains("flash record for slot 2 is corrupt"), "{err}");
    // A read past the bytes a source produced is no silent zero either.
    let (sig, err) = run_child("short");
    assert_eq!(sig, Some(libc::SIGBUS), "stderr: {err}");
    assert!(err.contains("poisoned slot 1 of userfaultfd region"), "{err}");
}

#[test]
fn move_into_hands_slots_pages_to_another_region_without_copying() {
    let Some(p) = pager() else { return };
    if !p.capabilities().r#move {
        assert!(!kernel_required(), "this kernel lacks UFFDIO_MOVE (Linux 6.8+)");
        return;
    }
    let src = Arc::new(PatternSource::default());
    let a = p.region(SLOT, 3, src.clone()).unwrap();
    let b = p.region_with(SLOT, 4, Arc::new(PatternSource { fail: (0..4).collect(), ..Default::default() }), true).unwrap();
    check_slot(&a, 0, 0, SLOT / 8);
    check_slot(&a, 1, 0, SLOT / 8);
    // Written after the fill: the move must carry the write (no refill from the source).
    // SAFETY: inside slot 0 of `a`.
    unsafe { std::ptr::write_volatile(a.slot_ptr(0).cast::<u64>().add(3), 0xfeed) };
    // Slot 1 keeps one page: the rest of it is a hole, which stays one.
    a.shrink(1, PAGE).unwrap();
    assert!(a.move_into(0, &b, 1, 2).unwrap());
    assert_eq!((a.state(0).unwrap(), a.state(1).unwrap()), (SlotState::Evicted, SlotState::Evicted));
    assert_eq!((b.state(1).unwrap(), b.state(2).unwrap()), (SlotState::Resident, SlotState::Resident));
    assert_eq!(a.resident_bytes(), 0);
    assert_eq!(b.resident_bytes(), SLOT + PAGE);
    // b's source fails every fill: these reads see the moved pages themselves.
    for i in (0..SLOT / 8).step_by(61) {
        let want = if i == 3 { 0xfeed } else { word(a.id(), 0, 0, i) };
        assert_eq!(read_word(&b, 1, i), want, "word {i}");
    }
    assert_eq!(read_word(&b, 1, 3), 0xfeed);
    assert_eq!(read_word(&b, 2, 7), word(a.id(), 1, 0, 7));
    // In a region that tracks writes, moved pages count as written until cleaned.
    assert_eq!(b.dirty_pages(1).unwrap(), vec![0, 1, 2, 3]);
    assert!(matches!(b.evict(1), Err(UffdError::Dirty { pages: 4, .. })));
    assert_eq!(b.clean(1).unwrap(), vec![0, 1, 2, 3]);
    assert_eq!(b.dirty_pages(1).unwrap(), Vec::<usize>::new());
    // SAFETY: inside slot 1 of `b`.
    unsafe { std::ptr::write_volatile(b.slot_ptr(1).cast::<u64>(), 1) };
    assert_eq!(b.dirty_pages(1).unwrap(), vec![0]);
    // The source slots refill from their own source when touched again.
    src.versions.lock().unwrap().insert(0, 5);
    check_slot(&a, 0, 5, SLOT / 8);
    check_slot(&a, 1, 0, SLOT / 8);
    // Refused, every slot untouched: a pinned source, an occupied target, an empty source.
    a.pin(0).unwrap();
    assert!(!a.move_into(0, &b, 3, 1).unwrap());
    a.unpin(0).unwrap();
    assert!(!a.move_into(0, &b, 2, 2).unwrap(), "slot 2 of b is resident");
    assert_eq!(b.state(3).unwrap(), SlotState::Evicted);
    assert!(!a.move_into(2, &b, 3, 1).unwrap(), "slot 2 of a is not resident");
    assert_eq!((a.state(0).unwrap(), a.state(1).unwrap()), (SlotState::Resident, SlotState::Resident));
    check_slot(&a, 0, 5, SLOT / 8);
    check_slot(&a, 1, 0, SLOT / 8);
    // Another pager's region, or another slot size: never moved between them.
    let q = Pager::new().unwrap();
    let c = q.region(SLOT, 1, Arc::new(PatternSource::default())).unwrap();
    assert!(!a.move_into(0, &c, 0, 1).unwrap());
    let e = p.region(2 * SLOT, 1, Arc::new(PatternSource::default())).unwrap();
    assert!(!a.move_into(0, &e, 0, 1).unwrap());
    assert!(matches!(a.move_into(2, &b, 0, 2), Err(UffdError::NoSlot { .. })));
    // A move the kernel refuses leaves both slots as they were: in a process of its own,
    // since while its forked child lives every page of the process is shared, and moves in
    // other tests' threads would be refused too.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_a_move_the_kernel_refuses", "--nocapture", "--test-threads=1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr));
}

/// Run in a process of its own by `move_into_hands_slots_pages_to_another_region_without_copying`.
#[test]
#[ignore = "helper: forks, which shares every page of the test process while the child lives"]
fn child_a_move_the_kernel_refuses() {
    let p = Pager::new().unwrap();
    let a = p.region(SLOT, 1, Arc::new(PatternSource::default())).unwrap();
    let b = p.region(SLOT, 1, Arc::new(PatternSource { fail: [0].into(), ..Default::default() })).unwrap();
    check_slot(&a, 0, 0, SLOT / 8);
    // A forked child shares the slot's pages copy-on-write: the kernel refuses to move them
    // (EBUSY). The child waits on a pipe and exits without touching anything.
    let mut fds = [0; 2];
    // SAFETY: a fresh pipe.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the child only blocks on read() and calls _exit (async-signal-safe).
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let mut x = 0u8;
        // SAFETY: closing the child's copy of the write end (else the read never ends),
        // reading one byte from the pipe, then leaving without running destructors.
        unsafe {
            libc::close(fds[1]);
            libc::read(fds[0], (&raw mut x).cast(), 1);
            libc::_exit(0);
        }
    }
    let refused = a.move_into(0, &b, 0, 1);
    // SAFETY: closing our ends of the pipe releases the child; then reaping it.
    unsafe {
        libc::close(fds[1]);
        libc::close(fds[0]);
        libc::waitpid(pid, std::ptr::null_mut(), 0);
    }
    assert!(!refused.unwrap(), "pages shared with a child cannot be moved");
    assert_eq!((a.state(0).unwrap(), b.state(0).unwrap()), (SlotState::Resident, SlotState::Evicted));
    check_slot(&a, 0, 0, SLOT / 8);
    assert_eq!(a.resident_bytes(), SLOT);
}

//! Memory for resident weights: one anonymous mapping, aligned to 2 MiB and advised for
//! transparent huge pages, into which the loader packs every matrix, read-only once built.
//!
//! Why one mapping on huge pages: decoding streams every weight byte once a token. On 4 KiB
//! pages the stream crosses a page every 4 KiB; each crossing is a TLB miss, which in a virtual
//! machine walks the guest's and the host's page tables, and the hardware prefetchers stop at
//! the page's end. With THP in `madvise` mode (the usual distribution default) only advised
//! memory gets huge pages, so the heap's `Vec` of each matrix never did, and a matrix under
//! 2 MiB (every one of the default model's) could not fill one anyway: packed side by side,
//! they fill them all. What this gave in the Intel Xeon guest of 30 Nov 2026 is in
//! docs/notes/engine.md ("Weights on huge pages").
//!
//! Where THP is compiled out or off, the advice fails or does nothing and the arena is plain
//! memory: nothing else changes. `LLMS_HUGE_PAGES=0` asks for the opposite (`MADV_NOHUGEPAGE`,
//! so even THP `always` leaves the arena on 4 KiB pages): to compare on a host, or where huge
//! pages lose (ik_llama.cpp's THP trial, its PR #278, found decode 20% slower on one AMD
//! workstation and no gain on another). Who owns the arena keeps it alive for as long as anything
//! reads the matrices placed in it ([`crate::repack::PackedWeight::into_arena`]).

use std::io;
use std::ptr::NonNull;

use memmap2::{Advice, Mmap, MmapMut};

/// A transparent huge page on x86-64 and on arm64 with 4 KiB base pages.
pub const HUGE_PAGE: usize = 2 << 20;

/// Where each placed piece starts: the packed kernels' blocks need at most 64-byte alignment.
pub const PIECE_ALIGN: usize = 64;

/// An arena being filled: pieces are copied in one after another ([`ArenaBuilder::push`]).
pub struct ArenaBuilder {
    map: MmapMut,
    /// The first byte of the space, 2 MiB-aligned (`map`'s head before it is never touched,
    /// so it costs address space, not memory).
    base: NonNull<u8>,
    start: usize,
    cap: usize,
    at: usize,
}

impl std::fmt::Debug for ArenaBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaBuilder").field("cap", &self.cap).field("used", &self.at).finish_non_exhaustive()
    }
}

/// Whether arenas ask for huge pages, from `LLMS_HUGE_PAGES` (read once): unset, `1` or `on`
/// yes; `0` or `off` no; anything else is reported and taken as yes.
pub fn huge_pages_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| {
        let v = std::env::var("LLMS_HUGE_PAGES").ok();
        parse_wanted(v.as_deref()).unwrap_or_else(|bad| {
            eprintln!("LLMS_HUGE_PAGES={bad:?}: expected 0/off or 1/on; huge pages stay on");
            true
        })
    })
}

/// `LLMS_HUGE_PAGES`'s value as a choice; the value itself when it is none.
fn parse_wanted(v: Option<&str>) -> Result<bool, String> {
    match v.map(str::trim) {
        None | Some("" | "1" | "on") => Ok(true),
        Some("0" | "off") => Ok(false),
        Some(other) => Err(other.to_string()),
    }
}

impl ArenaBuilder {
    /// Space for `cap` bytes (none of it touched yet, so none of it resident), on huge pages
    /// unless `LLMS_HUGE_PAGES` says otherwise ([`huge_pages_wanted`]).
    pub fn new(cap: usize) -> io::Result<Self> {
        Self::with_huge_pages(cap, huge_pages_wanted())
    }

    /// Space for `cap` bytes, advised for huge pages or (`huge` false) against them.
    pub fn with_huge_pages(cap: usize, huge: bool) -> io::Result<Self> {
        let map_len = cap.max(1).checked_add(HUGE_PAGE).ok_or_else(|| io::Error::other("arena size overflows"))?;
        let mut map = MmapMut::map_anon(map_len)?;
        let addr = map.as_ptr() as usize;
        let start = addr.next_multiple_of(HUGE_PAGE) - addr;
        // Advised before the first touch, so each fault inside an aligned 2 MiB range can take
        // a whole huge page (khugepaged would otherwise collapse them later, or never). Failure
        // only means 4 KiB pages.
        let advice = if huge { Advice::HugePage } else { Advice::NoHugePage };
        let _ = map.advise_range(advice, start, cap.max(1));
        // SAFETY: start < HUGE_PAGE <= map_len - cap, so base..base + cap lies in the mapping,
        // which `self` owns; every write and borrow below goes through this one pointer.
        let base = unsafe { NonNull::new_unchecked(map.as_mut_ptr().add(start)) };
        Ok(Self { map, base, start, cap, at: 0 })
    }

    /// The whole space as bytes to fill in place, for a buffer that is not a set of pieces (it
    /// reaches pieces already placed: not to be mixed with [`ArenaBuilder::push`]).
    pub fn space_mut(&mut self) -> &mut [u8] {
        // SAFETY: `cap` bytes from `base` lie in our mapping; `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr(), self.cap) }
    }

    /// Copies `bytes` in at the next [`PIECE_ALIGN`] boundary and returns a pointer to the
    /// copy, stable for the life of the mapping (it survives [`ArenaBuilder::finish`]); `None`
    /// when they do not fit.
    pub fn push(&mut self, bytes: &[u8]) -> Option<NonNull<u8>> {
        let at = self.at.next_multiple_of(PIECE_ALIGN);
        let end = at.checked_add(bytes.len()).filter(|&e| e <= self.cap)?;
        // SAFETY: at..end lies inside the space (checked) and was never handed out: pieces only
        // move forward, so no placed piece overlaps it.
        let dst = unsafe { self.base.add(at) };
        // SAFETY: `bytes` is another allocation (a caller cannot hold a slice of unplaced space).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.as_ptr(), bytes.len()) };
        self.at = end;
        Some(dst)
    }

    /// Bytes placed so far (with their alignment padding).
    pub fn used(&self) -> usize {
        self.at
    }

    /// The arena, read-only from now on: a stray write faults instead of changing a weight.
    pub fn finish(self) -> io::Result<Arena> {
        let Self { map, start, cap, at, .. } = self;
        // mprotect keeps the mapping (and its huge pages) where it is: pointers from `push`
        // stay valid.
        let map = map.make_read_only()?;
        Ok(Arena { map, start, len: cap, used: at })
    }
}

/// A built arena (see the module doc). Dropping it unmaps every piece placed in it.
pub struct Arena {
    map: Mmap,
    start: usize,
    len: usize,
    /// Bytes placed by `push` (the rest of `len` was never touched, unless filled in place).
    used: usize,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena").field("len", &self.len).finish_non_exhaustive()
    }
}

impl Arena {
    /// The space, placed pieces and all.
    pub fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }

    /// Bytes its pieces took ([`ArenaBuilder::used`] when it was built).
    pub fn used(&self) -> usize {
        self.used
    }

    /// Bytes of the arena's mapping the kernel backs with huge pages now (`AnonHugePages`
    /// in /proc/self/smaps); `None` when that cannot be read.
    pub fn huge_bytes(&self) -> Option<usize> {
        anon_huge_bytes(self.bytes().as_ptr() as usize)
    }
}

/// `AnonHugePages` of the mapping holding `addr`, in bytes, from /proc/self/smaps.
fn anon_huge_bytes(addr: usize) -> Option<usize> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        // A mapping's first line starts with its range, "start-end" in hex.
        if let Some((a, b)) = head.split_once('-').filter(|(a, _)| !a.is_empty() && a.chars().all(|c| c.is_ascii_hexdigit())) {
            let (a, b) = (usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?);
            inside = (a..b).contains(&addr);
        } else if inside {
            if let Some(v) = line.strip_prefix("AnonHugePages:") {
                return v.trim().trim_end_matches("kB").trim().parse::<usize>().ok().map(|kb| kb << 10);
            }
        }
    }
    None
}

/// Whether the kernel hands advised memory huge pages (THP `always` or `madvise`).
pub fn thp_available() -> bool {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    s.contains("[always]") || s.contains("[madvise]")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_aligned_kept_and_bounded() {
        let mut b = ArenaBuilder::new(1000).unwrap();
        let p1 = b.push(&[1u8; 10]).unwrap();
        let p2 = b.push(&[2u8; 100]).unwrap();
        assert_eq!(p1.as_ptr() as usize % HUGE_PAGE, 0, "the space starts on a huge page");
        assert_eq!(p2.as_ptr() as usize - p1.as_ptr() as usize, 64, "the next piece on a 64-byte boundary");
        assert!(b.push(&[3u8; 900]).is_none(), "a piece past the end does not fit");
        assert_eq!(b.used(), 164);
        let a = b.finish().unwrap();
        assert_eq!((a.bytes().len(), a.used()), (1000, 164));
        assert!(a.bytes()[..10].iter().all(|&x| x == 1));
        assert!(a.bytes()[10..64].iter().all(|&x| x == 0), "padding is zeros");
        assert!(a.bytes()[64..164].iter().all(|&x| x == 2));
        // The pointers handed out read the same bytes after `finish`.
        // SAFETY: p2 points at 100 placed bytes of `a`, which is alive.
        assert_eq!(unsafe { std::slice::from_raw_parts(p2.as_ptr(), 100) }, &a.bytes()[64..164]);
    }

    /// Whether this process gets huge pages at all, by another road than the arena's: a
    /// touched 4 MiB anonymous mapping collapsed in place (`MADV_COLLAPSE`, Linux 6.1). Under
    /// qemu-user (`make test-arm64-ci`) madvise is not passed to the kernel and nothing is.
    fn collapse_gives_huge_pages() -> bool {
        const MADV_COLLAPSE: libc::c_int = 25;
        let mut m = MmapMut::map_anon(2 * HUGE_PAGE).unwrap();
        m.fill(1);
        let addr = m.as_ptr() as usize;
        let start = addr.next_multiple_of(HUGE_PAGE) - addr;
        // SAFETY: advising a range of our own mapping (start + 2 MiB <= 4 MiB).
        let r = unsafe { libc::madvise(m.as_mut_ptr().add(start).cast(), HUGE_PAGE, MADV_COLLAPSE) };
        r == 0 && anon_huge_bytes(addr).is_some_and(|b| b >= HUGE_PAGE)
    }

    #[test]
    fn an_arena_of_several_huge_pages_gets_them() {
        if !thp_available() || !collapse_gives_huge_pages() {
            // Not a feature anything needs (the arena is plain memory then): nothing to check.
            eprintln!("skipped: this process gets no transparent huge pages (THP off, or emulated)");
            return;
        }
        let mut b = ArenaBuilder::with_huge_pages(8 << 20, true).unwrap();
        b.space_mut().fill(7);
        let a = b.finish().unwrap();
        let huge = a.huge_bytes().expect("/proc/self/smaps has the arena");
        assert!(huge >= HUGE_PAGE, "THP is on but the arena has {huge} bytes on huge pages");
        // Asked not to, it gets none (`MADV_NOHUGEPAGE` holds even under THP `always`).
        let mut b = ArenaBuilder::with_huge_pages(8 << 20, false).unwrap();
        b.space_mut().fill(7);
        let a = b.finish().unwrap();
        assert_eq!(a.huge_bytes(), Some(0), "an arena advised against huge pages has some");
    }

    #[test]
    fn the_switch_reads_on_off_and_refuses_the_rest() {
        for (v, want) in
            [(None, Ok(true)), (Some("1"), Ok(true)), (Some(" on "), Ok(true)), (Some("0"), Ok(false)), (Some("off"), Ok(false))]
        {
            assert_eq!(parse_wanted(v), want, "{v:?}");
        }
        assert_eq!(parse_wanted(Some("maybe")), Err("maybe".to_string()));
    }
}

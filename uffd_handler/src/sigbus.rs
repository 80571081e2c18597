//! A SIGBUS handler that names the region and slot of a poisoned access before the process
//! dies, so a failed slot is a clear message rather than a mystery crash. Only
//! async-signal-safe work happens in the handler: atomic loads, formatting into a stack
//! buffer, write(2), restoring the default action.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Once;

const MAX_REGIONS: usize = 256;

struct Entry {
    id: AtomicU64,
    base: AtomicUsize,
    len: AtomicUsize,
    slot_size: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)] // used only to initialise the array
const EMPTY: Entry = Entry { id: AtomicU64::new(0), base: AtomicUsize::new(0), len: AtomicUsize::new(0), slot_size: AtomicUsize::new(0) };
static TABLE: [Entry; MAX_REGIONS] = [EMPTY; MAX_REGIONS];
static INSTALLED: AtomicBool = AtomicBool::new(false);

pub(crate) fn register(id: u32, base: usize, len: usize, slot_size: usize) {
    for e in &TABLE {
        if e.id.compare_exchange(0, u64::from(id), Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            e.slot_size.store(slot_size, Ordering::Relaxed);
            e.len.store(len, Ordering::Relaxed);
            e.base.store(base, Ordering::Release);
            return;
        }
    }
    // Table full: the region still works; a poisoned access just gets the plain SIGBUS.
}

pub(crate) fn unregister(id: u32) {
    for e in &TABLE {
        if e.id.load(Ordering::Acquire) == u64::from(id) {
            e.base.store(0, Ordering::Release);
            e.id.store(0, Ordering::Release);
        }
    }
}

pub(crate) fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: installing a SA_SIGINFO handler for SIGBUS; the handler only does
        // async-signal-safe work (see the module doc).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = handler as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESETHAND;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
        }
        INSTALLED.store(true, Ordering::Release);
    });
}

/// Writes `n` in decimal into `buf` at `at`, returns the new position.
fn put_num(buf: &mut [u8], mut at: usize, n: usize) -> usize {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut v = n;
    loop {
        i -= 1;
        digits[i] = b'0' + u8::try_from(v % 10).unwrap_or(0);
        v /= 10;
        if v == 0 {
            break;
        }
    }
    for &d in &digits[i..] {
        if at < buf.len() {
            buf[at] = d;
            at += 1;
        }
    }
    at
}

fn put(buf: &mut [u8], mut at: usize, s: &[u8]) -> usize {
    for &b in s {
        if at < buf.len() {
            buf[at] = b;
            at += 1;
        }
    }
    at
}

extern "C" fn handler(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    let mut buf = [0u8; 256];
    let mut at = put(&mut buf, 0, b"llms: SIGBUS at 0x");
    let mut hex = [0u8; 16];
    for (i, h) in hex.iter_mut().enumerate() {
        let nib = (addr >> ((15 - i) * 4)) & 0xF;
        *h = b"0123456789abcdef"[nib];
    }
    at = put(&mut buf, at, &hex);
    for e in &TABLE {
        let base = e.base.load(Ordering::Acquire);
        let len = e.len.load(Ordering::Relaxed);
        if base != 0 && addr >= base && addr < base + len {
            let slot = (addr - base) / e.slot_size.load(Ordering::Relaxed).max(1);
            at = put(&mut buf, at, b": poisoned slot ");
            at = put_num(&mut buf, at, slot);
            at = put(&mut buf, at, b" of userfaultfd region ");
            at = put_num(&mut buf, at, usize::try_from(e.id.load(Ordering::Relaxed)).unwrap_or(0));
            at = put(&mut buf, at, b" (its source could not produce the data; see the log above)");
            break;
        }
    }
    at = put(&mut buf, at, b"\n");
    // SAFETY: write(2) is async-signal-safe; SA_RESETHAND restored the default action, so
    // returning re-runs the access and the process dies of SIGBUS as it should.
    unsafe { libc::write(2, buf.as_ptr().cast(), at) };
}

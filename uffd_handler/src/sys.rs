//! Raw kernel interfaces: userfaultfd (include/uapi/linux/userfaultfd.h) and PAGEMAP_SCAN
//! (include/uapi/linux/fs.h), declared here rather than taken from the `userfaultfd` crate,
//! which lacks UFFDIO_MOVE, UFFDIO_POISON, UFFDIO_COPY_MODE_WP, the WP_ASYNC/MOVE/POISON
//! feature bits and PAGEMAP_SCAN, and turns a zero-progress EAGAIN into a byte count.
#![allow(dead_code)] // the full set of constants is kept for reference next to the header

use std::os::fd::{FromRawFd, OwnedFd};

use nix::errno::Errno;

pub const UFFD_API: u64 = 0xAA;
const UFFDIO: u8 = 0xAA;

// Features (UFFDIO_API.features).
pub const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
pub const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
pub const UFFD_FEATURE_SIGBUS: u64 = 1 << 7;
pub const UFFD_FEATURE_THREAD_ID: u64 = 1 << 8;
pub const UFFD_FEATURE_EXACT_ADDRESS: u64 = 1 << 11;
pub const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
pub const UFFD_FEATURE_POISON: u64 = 1 << 14;
pub const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
pub const UFFD_FEATURE_MOVE: u64 = 1 << 16;

// Register modes.
pub const UFFDIO_REGISTER_MODE_MISSING: u64 = 1 << 0;
pub const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;

// Ioctl modes.
pub const UFFDIO_COPY_MODE_DONTWAKE: u64 = 1 << 0;
pub const UFFDIO_COPY_MODE_WP: u64 = 1 << 1;
pub const UFFDIO_MOVE_MODE_DONTWAKE: u64 = 1 << 0;
pub const UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES: u64 = 1 << 1;
pub const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
pub const UFFDIO_POISON_MODE_DONTWAKE: u64 = 1 << 0;

// Events.
pub const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
pub const UFFD_PAGEFAULT_FLAG_WRITE: u64 = 1 << 0;
pub const UFFD_PAGEFAULT_FLAG_WP: u64 = 1 << 1;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct UffdioApi {
    pub api: u64,
    pub features: u64,
    pub ioctls: u64,
}
const _: () = assert!(std::mem::size_of::<UffdioApi>() == 24);

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct UffdioRange {
    pub start: u64,
    pub len: u64,
}
const _: () = assert!(std::mem::size_of::<UffdioRange>() == 16);

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct UffdioRegister {
    pub range: UffdioRange,
    pub mode: u64,
    pub ioctls: u64,
}
const _: () = assert!(std::mem::size_of::<UffdioRegister>() == 32);

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct UffdioCopy {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
    pub mode: u64,
    /// Bytes copied, or a negated errno.
    pub copy: i64,
}
const _: () = assert!(std::mem::size_of::<UffdioCopy>() == 40);

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct UffdioMove {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
    pub mode: u64,
    /// Bytes moved, or a negated errno.
    pub moved: i64,
}
const _: () = assert!(std::mem::size_of::<UffdioMove>() == 40);

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct UffdioWriteprotect {
    pub range: UffdioRange,
    pub mode: u64,
}
const _: () = assert!(std::mem::size_of::<UffdioWriteprotect>() == 24);

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct UffdioPoison {
    pub range: UffdioRange,
    pub mode: u64,
    pub updated: i64,
}
const _: () = assert!(std::mem::size_of::<UffdioPoison>() == 32);

/// `struct uffd_msg` for a page fault (the only event we enable).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct UffdMsg {
    pub event: u8,
    pub reserved1: u8,
    pub reserved2: u16,
    pub reserved3: u32,
    pub pf_flags: u64,
    pub pf_address: u64,
    pub pf_ptid: u32,
    pub pad: u32,
}
const _: () = assert!(std::mem::size_of::<UffdMsg>() == 32);

nix::ioctl_readwrite!(uffdio_api, UFFDIO, 0x3F, UffdioApi);
nix::ioctl_readwrite!(uffdio_register, UFFDIO, 0x00, UffdioRegister);
nix::ioctl_read!(uffdio_unregister, UFFDIO, 0x01, UffdioRange);
nix::ioctl_read!(uffdio_wake, UFFDIO, 0x02, UffdioRange);
nix::ioctl_readwrite!(uffdio_copy, UFFDIO, 0x03, UffdioCopy);
nix::ioctl_readwrite!(uffdio_move, UFFDIO, 0x05, UffdioMove);
nix::ioctl_readwrite!(uffdio_writeprotect, UFFDIO, 0x06, UffdioWriteprotect);
nix::ioctl_readwrite!(uffdio_poison, UFFDIO, 0x08, UffdioPoison);
// /dev/userfaultfd: USERFAULTFD_IOC_NEW = _IO(0xAA, 0x00), argument = open flags.
nix::ioctl_write_int_bad!(userfaultfd_ioc_new, nix::request_code_none!(UFFDIO, 0x00));

// PAGEMAP_SCAN on /proc/self/pagemap (Linux 6.7).
pub const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
pub const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
pub const PAGE_IS_WPALLOWED: u64 = 1 << 0;
pub const PAGE_IS_WRITTEN: u64 = 1 << 1;
pub const PAGE_IS_PRESENT: u64 = 1 << 3;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct PmScanArg {
    pub size: u64,
    pub flags: u64,
    pub start: u64,
    pub end: u64,
    pub walk_end: u64,
    pub vec: u64,
    pub vec_len: u64,
    pub max_pages: u64,
    pub category_inverted: u64,
    pub category_mask: u64,
    pub category_anyof_mask: u64,
    pub return_mask: u64,
}
const _: () = assert!(std::mem::size_of::<PmScanArg>() == 96);

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct PageRegion {
    pub start: u64,
    pub end: u64,
    pub categories: u64,
}
const _: () = assert!(std::mem::size_of::<PageRegion>() == 24);

nix::ioctl_readwrite!(pagemap_scan, b'f', 16, PmScanArg);

/// How the userfaultfd was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UffdOrigin {
    Device,
    Syscall,
}

/// Opens a userfaultfd that also handles kernel-mode faults (not UFFD_USER_MODE_ONLY), so
/// read(2)/write(2) into a region are served: through /dev/userfaultfd (needs access to the
/// device node) or the syscall (needs CAP_SYS_PTRACE or vm.unprivileged_userfaultfd=1).
pub fn open_uffd() -> Result<(OwnedFd, UffdOrigin), (Errno, Errno)> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    let dev_err = match std::fs::OpenOptions::new().read(true).write(true).open("/dev/userfaultfd") {
        Ok(dev) => {
            use std::os::fd::AsRawFd;
            // SAFETY: USERFAULTFD_IOC_NEW on the device fd takes the open flags by value and
            // returns a new fd, which we own from here on.
            match unsafe { userfaultfd_ioc_new(dev.as_raw_fd(), flags) } {
                // SAFETY: the kernel just returned this fd to us.
                Ok(fd) => return Ok((unsafe { OwnedFd::from_raw_fd(fd) }, UffdOrigin::Device)),
                Err(e) => e,
            }
        }
        Err(e) => Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
    };
    // SAFETY: plain syscall with flags; the returned fd (if any) is owned below.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
    if fd < 0 {
        return Err((dev_err, Errno::last()));
    }
    let fd = i32::try_from(fd).map_err(|_| (dev_err, Errno::EBADF))?;
    // SAFETY: the kernel just returned this fd to us.
    Ok((unsafe { OwnedFd::from_raw_fd(fd) }, UffdOrigin::Syscall))
}

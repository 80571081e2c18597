//! The crate's error type and page size, below both the pager and the dirty-page scan.

use nix::errno::Errno;

/// The page size every region is laid out in.
pub const PAGE: usize = 4096;

/// Errors of the pager, each naming the operation and where.
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    #[error(
        "cannot create a userfaultfd: /dev/userfaultfd: {dev}; userfaultfd(2): {syscall}. \
         Fix: give this user read-write access to /dev/userfaultfd, or CAP_SYS_PTRACE, \
         or set vm.unprivileged_userfaultfd=1"
    )]
    Create { dev: Errno, syscall: Errno },
    #[error("UFFDIO_API handshake failed: {0}")]
    Api(Errno),
    #[error("slot size {slot_size} must be a non-zero multiple of the page size {PAGE}, and {n_slots} slots must fit the address space")]
    Geometry { slot_size: usize, n_slots: usize },
    #[error("mmap of a {len}-byte region failed: {source}")]
    Map { len: usize, source: Errno },
    #[error("UFFDIO_REGISTER of region {region} failed: {source}")]
    Register { region: u32, source: Errno },
    #[error("{op} of region {region} slot {slot} failed: {source}")]
    Ioctl { op: &'static str, region: u32, slot: usize, source: Errno },
    #[error("region {region} slot {slot} is out of range ({n_slots} slots)")]
    NoSlot { region: u32, slot: usize, n_slots: usize },
    #[error("region {region} slot {slot}: the source failed: {reason}")]
    Source { region: u32, slot: usize, reason: String },
    #[error("region {region} slot {slot} is pinned; it cannot be evicted")]
    Pinned { region: u32, slot: usize },
    #[error("region {region} slot {slot} has {pages} written page(s) that were not written out; clean it first")]
    Dirty { region: u32, slot: usize, pages: usize },
    #[error("region {region} slot {slot} is being loaded")]
    Busy { region: u32, slot: usize },
    #[error("{len} bytes do not fit slot {slot} of region {region} ({slot_size} bytes)")]
    TooLong { region: u32, slot: usize, len: usize, slot_size: usize },
    #[error("dirty tracking on region {region}: PAGEMAP_SCAN failed: {source}")]
    Scan { region: u32, source: Errno },
    #[error("the pager is shutting down")]
    ShuttingDown,
}

pub type Result<T> = std::result::Result<T, UffdError>;

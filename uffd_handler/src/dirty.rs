//! Which pages of a range were written: PAGEMAP_SCAN over /proc/self/pagemap on a region
//! registered for write-protect with UFFD_FEATURE_WP_ASYNC. A page installed write-protected
//! loses its protection on the first write (the kernel resolves the fault itself), which
//! PAGEMAP_SCAN reports as PAGE_IS_WRITTEN; PM_SCAN_WP_MATCHING protects it again in the same
//! walk, so "read the dirty set and mark it clean" is one atomic step.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::OnceLock;

use nix::errno::Errno;

use crate::error::{UffdError, PAGE};
use crate::sys;

fn pagemap() -> Result<&'static File, Errno> {
    static PAGEMAP: OnceLock<Result<File, Errno>> = OnceLock::new();
    PAGEMAP
        .get_or_init(|| File::open("/proc/self/pagemap").map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))))
        .as_ref()
        .map_err(|e| *e)
}

/// Page indices (from `start`) of the present pages of `[start, start+len)` written since
/// they were installed or last re-protected; with `reprotect`, protects them again.
pub(crate) fn written_pages(region: u32, start: u64, len: usize, reprotect: bool) -> Result<Vec<usize>, UffdError> {
    let scan_err = |source| UffdError::Scan { region, source };
    let fd = pagemap().map_err(scan_err)?.as_raw_fd();
    let end = start + len as u64;
    let mut out = Vec::new();
    let mut regions = [sys::PageRegion::default(); 64];
    let mut at = start;
    while at < end {
        let mut arg = sys::PmScanArg {
            size: std::mem::size_of::<sys::PmScanArg>() as u64,
            flags: if reprotect { sys::PM_SCAN_WP_MATCHING | sys::PM_SCAN_CHECK_WPASYNC } else { 0 },
            start: at,
            end,
            vec: regions.as_mut_ptr() as u64,
            vec_len: regions.len() as u64,
            category_mask: sys::PAGE_IS_WRITTEN | sys::PAGE_IS_PRESENT,
            return_mask: sys::PAGE_IS_WRITTEN,
            ..Default::default()
        };
        // SAFETY: PAGEMAP_SCAN reads our arg and writes at most vec_len regions into `regions`.
        let n = unsafe { sys::pagemap_scan(fd, &mut arg) }.map_err(scan_err)?;
        for r in &regions[..usize::try_from(n).unwrap_or(0)] {
            let (a, b) = (usize::try_from(r.start - start).expect("in range"), usize::try_from(r.end - start).expect("in range"));
            out.extend(a / PAGE..b / PAGE);
        }
        if arg.walk_end <= at {
            break;
        }
        at = arg.walk_end;
    }
    Ok(out)
}

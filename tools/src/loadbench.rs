//! Measuring context loads: the switch-in latency benchmark (`llms bench-load`) and what the
//! experiments share with it; the profile llmsd plans with is `llmsd::profile`.

use std::path::Path;

use anyhow::{Context, Result};
use mm::Store;

/// Makes `dir` an empty state directory holding the load profiles found in `profiles` (so a
/// run in it plans with them instead of measuring again).
pub fn fresh_state(dir: &Path, profiles: &Path) -> Result<()> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for e in std::fs::read_dir(profiles).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with("profile-") {
            std::fs::copy(e.path(), dir.join(e.file_name()))?;
        }
    }
    Ok(())
}

/// Read bandwidth of the store for a context's records, bytes per second: every record read
/// whole (O_DIRECT, all in flight at once through io_uring) into one buffer on huge pages,
/// the best case for the device (see `uffd_handler::Staging::huge`; loads stage the same
/// way). `bytes / this` is the load floor.
pub fn read_bandwidth(store: &Store, ctx: u64, n_chunks: usize) -> Result<f64> {
    use std::os::fd::AsRawFd;
    let f = store.file(ctx)?;
    let extents: Vec<(u64, usize)> =
        (0..n_chunks).filter_map(|i| store.entry(ctx, u32::try_from(i).ok()?)).map(|e| store.body_extent(&e)).collect();
    let total: usize = extents.iter().map(|&(_, len)| len).sum();
    let mut buf = uffd_handler::Staging::huge(total)?;
    let base = buf.as_mut_slice().as_mut_ptr();
    let mut at = 0;
    let ops: Vec<mm::ring::Op> = extents
        .iter()
        .map(|&(offset, len)| {
            let op = mm::ring::Op {
                fd: f.as_raw_fd(),
                offset,
                // SAFETY: the extents are laid end to end inside the `total` bytes of `buf`.
                buf: unsafe { base.add(at) },
                len: u32::try_from(len).unwrap_or(u32::MAX),
                write: false,
            };
            at += len;
            op
        })
        .collect();
    let mut ring = mm::ring::Ring::new(u32::try_from(ops.len() + 1).unwrap_or(u32::MAX))?;
    let t = std::time::Instant::now();
    // SAFETY: the buffer outlives the wait below and nothing else touches it.
    unsafe { ring.submit(0, &ops) }?;
    ring.wait(0)?;
    let secs = t.elapsed().as_secs_f64().max(1e-9);
    Ok(total as f64 / secs)
}

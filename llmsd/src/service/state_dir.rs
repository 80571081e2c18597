//! The state directory (swap store, contexts, profiles): the service's own, private, on a real
//! file system, and used by one llmsd at a time. Checked before anything in it is read, so a
//! second instance or a directory planted by another user never sees or changes a context.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use anyhow::{bail, Context, Result};

/// The lock file inside the state directory; it holds the owner's pid for the error message.
pub(super) const LOCK_FILE: &str = "llmsd.lock";

/// Creates `dir` (0700) if missing, checks it, and takes its lock for the life of the returned
/// file: an exclusive `flock`, released by the kernel when the process ends however it ends
/// (kill -9 included), so a stale lock never blocks a restart.
pub(super) fn claim(dir: &Path) -> Result<File> {
    match std::fs::symlink_metadata(dir) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .with_context(|| format!("creating the state directory {}", dir.display()))?;
        }
        Err(e) => return Err(e).with_context(|| format!("state_dir {}", dir.display())),
    }
    // Follow a symlink to what it names: that is what must be ours.
    let meta = std::fs::metadata(dir).with_context(|| format!("state_dir {}", dir.display()))?;
    if !meta.is_dir() {
        bail!("state_dir {} is not a directory", dir.display());
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        bail!(
            "state_dir {} belongs to uid {}, not to this service's uid {me}: another user could read or change the conversations in it; \
             give the service a directory of its own",
            dir.display(),
            meta.uid()
        );
    }
    if on_tmpfs(dir) {
        bail!("state_dir {} is on tmpfs: the swap store would keep evicted KV in memory, freeing nothing; put it on flash", dir.display());
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("making {} private (0700)", dir.display()))?;
    let path = dir.join(LOCK_FILE);
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match f.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut pid = String::new();
            let _ = f.read_to_string(&mut pid);
            let pid = pid.trim();
            bail!(
                "state_dir {} is in use by another llmsd (pid {}); stop it first, or give this one its own state_dir",
                dir.display(),
                if pid.is_empty() { "unknown" } else { pid }
            );
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(e).with_context(|| format!("locking {}", path.display())),
    }
    f.set_len(0)?;
    f.rewind()?;
    writeln!(f, "{}", std::process::id())?;
    Ok(f)
}

/// Whether `dir` is on tmpfs (memory, not flash).
fn on_tmpfs(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else { return false };
    // SAFETY: an all-zero statfs is a valid value to be overwritten.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid statfs to fill.
    let r = unsafe { libc::statfs(c.as_ptr(), &raw mut st) };
    // Compared as i128: f_type and the magic are i64 in glibc, u64 in Android's bionic.
    r == 0 && i128::from(st.f_type) == i128::from(libc::TMPFS_MAGIC)
}

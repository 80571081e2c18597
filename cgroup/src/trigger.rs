//! PSI triggers: the kernel wakes us (EPOLLPRI) when stall time within a window crosses a
//! threshold, instead of us polling.
//!
//! Kernel contract (Documentation/accounting/psi.rst): write `"some|full <stall us> <window us>"`
//! to the pressure file, one trigger per open fd, and poll for EPOLLPRI; EPOLLERR means the
//! file went away (cgroup removed). Without CAP_SYS_RESOURCE the window must be a multiple of
//! 2 s (`some 150000 1000000` gets EINVAL, `some 150000 2000000` works here), so we round the
//! window up and scale the stall threshold with it. Unprivileged triggers can fire once
//! spuriously after arming: callers confirm an event against the `total` counter.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TriggerError {
    #[error("cannot open {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("the kernel refused trigger {rule:?} on {path}: {source}")]
    Refused { path: PathBuf, rule: String, source: std::io::Error },
    #[error("epoll on {path}: {source}")]
    Epoll { path: PathBuf, source: std::io::Error },
    #[error("{path} is not a kernel pressure file (not on procfs or cgroupfs); it can be sampled, not armed")]
    NotPsi { path: PathBuf },
    #[error("the pressure file {path} reported an error (removed?); re-arm or fall back to polling")]
    Gone { path: PathBuf },
}

/// An armed PSI trigger.
#[derive(Debug)]
pub struct PsiTrigger {
    file: File,
    epoll: OwnedFd,
    pub path: PathBuf,
    /// The rule as written (after rounding), e.g. "some 300000 2000000".
    pub rule: String,
}

/// Rounds a trigger for an unprivileged caller: window up to a multiple of 2 s, stall scaled
/// by the same factor (the same stall *rate*). Privileged callers keep their numbers.
pub fn round_rule(stall_us: u64, window_us: u64, privileged: bool) -> (u64, u64) {
    const UNIT: u64 = 2_000_000;
    if privileged || (window_us >= UNIT && window_us.is_multiple_of(UNIT)) {
        return (stall_us, window_us);
    }
    let w = window_us.max(1).div_ceil(UNIT) * UNIT;
    (stall_us.saturating_mul(w) / window_us.max(1), w)
}

impl PsiTrigger {
    pub fn register(path: &Path, full: bool, stall_us: u64, window_us: u64, privileged: bool) -> Result<Self, TriggerError> {
        let (s, w) = round_rule(stall_us, window_us, privileged);
        let rule = format!("{} {s} {w}", if full { "full" } else { "some" });
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| TriggerError::Open { path: path.into(), source })?;
        // Writing a rule into anything but the kernel's own file would overwrite it (a copy, a
        // fixture tree): only procfs and cgroupfs files take triggers.
        // SAFETY: statfs is plain old data; all zeros is a valid value.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: fstatfs on our open fd into a zeroed struct of the right type.
        if unsafe { libc::fstatfs(file.as_raw_fd(), &raw mut fs) } != 0
            || ![libc::PROC_SUPER_MAGIC, libc::CGROUP_SUPER_MAGIC, libc::CGROUP2_SUPER_MAGIC]
                .iter()
                .any(|&m| fs_magic(m) == fs_magic(fs.f_type))
        {
            return Err(TriggerError::NotPsi { path: path.into() });
        }
        // The trailing NUL terminates the rule for the kernel's parser.
        let mut bytes = rule.clone().into_bytes();
        bytes.push(0);
        file.write_all(&bytes).map_err(|source| TriggerError::Refused { path: path.into(), rule: rule.clone(), source })?;
        // SAFETY: creating an epoll instance; the fd is owned below.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(TriggerError::Epoll { path: path.into(), source: std::io::Error::last_os_error() });
        }
        // SAFETY: the kernel just returned this fd.
        let epoll = unsafe { OwnedFd::from_raw_fd(ep) };
        let mut ev = libc::epoll_event { events: (libc::EPOLLPRI | libc::EPOLLERR) as u32, u64: 0 };
        // SAFETY: registering our pressure fd with our epoll instance.
        if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, file.as_raw_fd(), &mut ev) } != 0 {
            return Err(TriggerError::Epoll { path: path.into(), source: std::io::Error::last_os_error() });
        }
        Ok(Self { file, epoll, path: path.into(), rule })
    }

    /// Waits up to `timeout_ms` for the trigger. Ok(true): it fired; Ok(false): timeout.
    pub fn wait(&self, timeout_ms: i32) -> Result<bool, TriggerError> {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: waiting on our epoll fd for one event into a valid struct.
        let n = unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), &mut ev, 1, timeout_ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(TriggerError::Epoll { path: self.path.clone(), source: e });
        }
        // EPOLLERR is checked first: a removed cgroup also reports readiness.
        if n > 0 && ev.events & libc::EPOLLERR as u32 != 0 {
            return Err(TriggerError::Gone { path: self.path.clone() });
        }
        let _ = &self.file;
        Ok(n > 0 && ev.events & libc::EPOLLPRI as u32 != 0)
    }
}

/// A file system magic number as u64: `statfs::f_type` and the `*_MAGIC` constants are i64 in
/// glibc and u64 in Android's bionic; the magic numbers are small and positive either way.
#[allow(clippy::cast_sign_loss, clippy::unnecessary_cast, clippy::cast_possible_truncation)]
pub(crate) fn fs_magic<T: Into<i128>>(x: T) -> u64 {
    x.into() as u64
}

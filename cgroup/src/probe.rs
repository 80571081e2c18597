//! What this machine offers the monitor, and where its signals are read from.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::signals::{self, CgroupKind, Sample, SignalError};

/// The cgroup setup of this process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum CgroupMode {
    /// cgroup v2 with the memory controller for our group.
    V2,
    /// cgroup v1 memory controller.
    V1,
    /// v1 memory controller with a cgroup2 hierarchy mounted beside it (without memory).
    Hybrid,
    None,
}

/// The outcome of probing: which signals can be read, and why not where not.
#[derive(Debug, Clone, Serialize)]
pub struct Probe {
    pub psi: std::result::Result<PathBuf, String>,
    /// The process may use PSI triggers with windows under 2 s (CAP_SYS_RESOURCE).
    pub cap_sys_resource: bool,
    pub cgroup_mode: CgroupMode,
    /// Our memory cgroup directory and its kind, when readable.
    pub cgroup: std::result::Result<(PathBuf, CgroupKind), String>,
}

/// Where the sampler reads from (the real /proc and /sys, or a fixture tree in tests).
#[derive(Debug, Clone)]
pub struct Sources {
    pub proc_root: PathBuf,
    pub psi: Option<PathBuf>,
    pub cgroup: Option<(PathBuf, CgroupKind)>,
}

impl Sources {
    /// Reads every available signal once. PSI and cgroup are optional: a file that became
    /// unreadable is an error, a source that was never there is skipped.
    pub fn sample(&self, t_ms: u64) -> Result<Sample, SignalError> {
        let mi = self.proc_root.join("meminfo");
        let mem = signals::parse_meminfo(&mi.display().to_string(), &signals::read(&mi)?)?;
        let vs = self.proc_root.join("vmstat");
        let vm = signals::vmstat_from(&signals::parse_counters(&vs.display().to_string(), &signals::read(&vs)?)?);
        let psi = match &self.psi {
            Some(p) => Some(signals::parse_psi(&p.display().to_string(), &signals::read(p)?)?),
            None => None,
        };
        let cgroup = match &self.cgroup {
            Some((dir, kind)) => Some(signals::read_cgroup(dir, kind)?),
            None => None,
        };
        let cgroup_psi = match self.cgroup_psi() {
            Some(p) => Some(signals::parse_psi(&p.display().to_string(), &signals::read(&p)?)?),
            None => None,
        };
        let zi = self.proc_root.join("zoneinfo");
        let watermarks = match signals::read(&zi) {
            Ok(t) => Some(signals::parse_zoneinfo(&zi.display().to_string(), &t)?),
            Err(_) => None,
        };
        Ok(Sample { t_ms, psi, mem, vm, cgroup, cgroup_psi, watermarks })
    }

    /// The cgroup's own `memory.pressure` (v2, not the root group).
    pub fn cgroup_psi(&self) -> Option<PathBuf> {
        match &self.cgroup {
            Some((dir, CgroupKind::V2)) => Some(dir.join("memory.pressure")).filter(|p| p.exists()),
            _ => None,
        }
    }
}

/// Finds our memory cgroup from /proc/self/cgroup and the mount table.
fn find_cgroup(proc_cgroup: &str, mountinfo: &str) -> (CgroupMode, std::result::Result<(PathBuf, CgroupKind), String>) {
    let mut v1_mem_mount = None;
    let mut v2_mount = None;
    for line in mountinfo.lines() {
        // "... mountpoint ... - fstype source superopts"
        let Some((pre, post)) = line.split_once(" - ") else { continue };
        let mp = pre.split_whitespace().nth(4).unwrap_or("");
        let mut post = post.split_whitespace();
        let fstype = post.next().unwrap_or("");
        let opts = post.nth(1).unwrap_or("");
        if fstype == "cgroup2" {
            v2_mount = Some(PathBuf::from(mp));
        } else if fstype == "cgroup" && opts.split(',').any(|o| o == "memory") {
            v1_mem_mount = Some(PathBuf::from(mp));
        }
    }
    let mut v1_path = None;
    let mut v2_path = None;
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, ctrls, path) = (parts.next(), parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        if ctrls.is_empty() {
            v2_path = Some(path.trim_start_matches('/').to_string());
        } else if ctrls.split(',').any(|c| c == "memory") {
            v1_path = Some(path.trim_start_matches('/').to_string());
        }
    }
    if let (Some(m), Some(p)) = (&v1_mem_mount, &v1_path) {
        let mode = if v2_mount.is_some() { CgroupMode::Hybrid } else { CgroupMode::V1 };
        return (mode, Ok((m.join(p), CgroupKind::V1)));
    }
    if let (Some(m), Some(p)) = (&v2_mount, &v2_path) {
        let dir = m.join(p);
        // The root group has no memory.current: system-wide signals describe it already.
        let has_mem = std::fs::read_to_string(dir.join("memory.current")).is_ok();
        if has_mem {
            return (CgroupMode::V2, Ok((dir, CgroupKind::V2)));
        }
        return (CgroupMode::None, Err(format!("cgroup2 at {} has no memory controller for this group", dir.display())));
    }
    (CgroupMode::None, Err("no memory cgroup: neither a v1 memory hierarchy nor cgroup2 with memory".into()))
}

/// Probes the running system. `cgroup_dir` overrides the process's own cgroup (an integrator
/// may point the monitor at the service's cgroup explicitly).
pub fn probe(cgroup_dir: Option<&Path>) -> Probe {
    let psi_path = PathBuf::from("/proc/pressure/memory");
    let psi = match std::fs::read_to_string(&psi_path) {
        Ok(t) => signals::parse_psi("/proc/pressure/memory", &t).map(|_| psi_path).map_err(|e| e.to_string()),
        Err(e) => Err(format!("{}: {e} (kernel without CONFIG_PSI, or psi=0 on the command line)", psi_path.display())),
    };
    let cap_sys_resource = caps::has_cap(None, caps::CapSet::Effective, caps::Capability::CAP_SYS_RESOURCE).unwrap_or(false);
    let (cgroup_mode, mut cgroup) = find_cgroup(
        &std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default(),
        &std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default(),
    );
    if let Some(dir) = cgroup_dir {
        let kind = if dir.join("memory.current").exists() { CgroupKind::V2 } else { CgroupKind::V1 };
        cgroup = Ok((dir.to_path_buf(), kind));
    }
    if let Ok((dir, kind)) = &cgroup {
        if let Err(e) = signals::read_cgroup(dir, kind) {
            cgroup = Err(format!("{} is not readable: {e}", dir.display()));
        }
    }
    Probe { psi, cap_sys_resource, cgroup_mode, cgroup }
}

impl Probe {
    /// The sources to sample on this machine.
    pub fn sources(&self) -> Sources {
        Sources { proc_root: PathBuf::from("/proc"), psi: self.psi.as_ref().ok().cloned(), cgroup: self.cgroup.as_ref().ok().cloned() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_layouts_are_recognised() {
        let hybrid_mounts = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw";
        let (m, c) = find_cgroup("4:memory:/app/x\n0::/", hybrid_mounts);
        assert_eq!(m, CgroupMode::Hybrid);
        assert_eq!(c.unwrap(), (PathBuf::from("/sys/fs/cgroup/memory/app/x"), CgroupKind::V1));
        let (m, _) = find_cgroup("4:memory:/app/x", "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory");
        assert_eq!(m, CgroupMode::V1);
        let (m, c) = find_cgroup("0::/", "29 23 0:26 / /nonexistent-cgroup2 rw - cgroup2 cgroup2 rw");
        assert_eq!(m, CgroupMode::None);
        assert!(c.unwrap_err().contains("no memory controller"));
        let (m, _) = find_cgroup("", "");
        assert_eq!(m, CgroupMode::None);
    }
}

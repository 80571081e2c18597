//! Memory-pressure monitor: sees memory trouble before the kernel or a low-memory killer acts.
//!
//! What it is for: reading the kernel's memory signals — PSI (triggers and `total` deltas),
//! MemAvailable, reclaim activity from /proc/vmstat, and the service's cgroup (v2 or v1) —
//! classifying them into levels with hysteresis, and publishing a budget target for the memory
//! LLMS manages. Samples and events can be recorded as JSON lines and replayed through the
//! same classifier and controller.
//!
//! What it is not for: it only observes and classifies; it never evicts anything itself
//! (`mm` obeys the budget), and it never writes to a cgroup.
//!
//! Where this crate sits among the others, and its modules' layers: docs/ARCHITECTURE.md.

mod monitor;
mod policy;
mod probe;
mod signals;
mod trigger;

pub use monitor::{run, run_noting, spawn, spawn_noting, Evictions, MonitorOptions};
pub use policy::{replay, BudgetController, Classifier, Event, Level, Signals, Thresholds};
pub use probe::{probe, CgroupMode, Probe, Sources};
pub use signals::{
    parse_counters, parse_meminfo, parse_psi, parse_zoneinfo, read_cgroup, vmstat_from, CgroupKind, CgroupMem, MemInfo, Psi, PsiLine,
    Sample, SignalError, VmStat, Watermarks,
};
pub use trigger::{round_rule, PsiTrigger, TriggerError};

//! Memory-pressure monitor: PSI and cgroup memory signals classified into levels and a budget
//! target. Observes only; never evicts. Not built yet: see the cgroup issue.

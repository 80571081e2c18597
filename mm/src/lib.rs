//! LLMS context memory manager: chunk table, tolerance-aware compression, LCTRU eviction,
//! ahead-of-time swap-out, the swap store and the swap-recompute planner.
//!
//! `mm` owns policy: which chunk lives where, in which format, and when it moves. The mechanism
//! (userfaultfd slots) is `uffd_handler`; the numerics (chunk formats, recompute) are the
//! engine's. Not built yet: see the mm issue.

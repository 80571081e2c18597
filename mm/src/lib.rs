//! LLMS context memory manager: chunk table, tolerance-aware compression, LCTRU eviction,
//! ahead-of-time swap-out, the swap store and the swap-recompute planner.
//!
//! What it is for: policy — which chunk lives where, in which format, and when it moves. The
//! mechanism (userfaultfd slots) is `uffd_handler`; the numerics (chunk formats, recompute)
//! are the engine's.
//!
//! Built so far: the LCTRU queue and the eq. 4 planner (the pieces that need neither the
//! store nor the engine). The rest is the mm issue's.

mod lctru;
mod planner;

pub use lctru::{ChunkId, Lctru};
pub use planner::{plan, Linear, Plan};

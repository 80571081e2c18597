//! LLMS context memory manager: chunk table, tolerance-aware compression, LCTRU eviction,
//! ahead-of-time swap-out, the swap store and the swap-recompute planner.
//!
//! What it is for: policy — which chunk lives where, in which format, and when it moves. The
//! mechanism (userfaultfd slots) is `uffd_handler`; the numerics (chunk formats, recompute)
//! are the engine's, reached through the [`KvContext`] trait so mm stays model-agnostic.

mod lctru;
mod planner;
pub mod ring;
pub mod store;

pub use lctru::{ChunkId, Lctru};
pub use planner::{plan, Linear, Plan};
pub use store::{RecordMeta, Store, StoreError, StoreGeometry};

//! LLMS context memory manager: chunk table, tolerance-aware compression, LCTRU eviction,
//! ahead-of-time swap-out, the swap store and the swap-recompute planner.
//!
//! What it is for: policy — which chunk lives where, in which format, and when it moves. The
//! mechanism (userfaultfd slots) is `uffd_handler`; the numerics (chunk formats, recompute)
//! are the engine's, reached through the [`KvContext`] and [`Codec`] traits so mm stays
//! model-agnostic.
//!
//! Where this crate sits among the others, and its modules' layers: docs/ARCHITECTURE.md.

mod context;
pub mod gate;
mod lctru;
pub mod levels;
mod manager;
pub mod pagecache;
mod planner;
mod profile;
mod reaper;
pub mod ring;
pub mod store;
pub mod weightplan;
pub mod weights;

pub use context::{prefix_hashes, Codec, EngineError, FaultRecompute, Format, KvContext};
pub use lctru::{ChunkId, Lctru};
pub use manager::{
    shared_names, ChunkInfo, Features, LevelWork, LoadReport, Manager, MmConfig, MmError, MmStats, Policy, SharedName, SharingStats,
    Strategy, POOL_CTX, PUBLIC_SCOPE,
};
pub use planner::{plan, plan_forced, Linear, Plan};
pub use profile::{Profile, ProfileError};
pub use store::{Durability, RecordMeta, Store, StoreError, StoreGeometry};

/// A map keyed by ids the service assigns (context ids, chunk indices, pool slots), never
/// chosen by an app: a fast hasher without a random key is safe for them, and the first fork
/// of a 4k-token context touches five such maps per chunk (SipHash was a third of its time
/// in mm). Maps keyed by what an app controls (the sharing index, by a hash of its tokens)
/// keep std's keyed hasher.
pub(crate) type IdMap<K, V> = std::collections::HashMap<K, V, rustc_hash::FxBuildHasher>;

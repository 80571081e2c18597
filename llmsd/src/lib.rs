//! The LLMS system service: apps' contexts kept in a memory budget and served over a Unix
//! socket (the native protocol) and an OpenAI-compatible HTTP front ([`service`]); its settings
//! ([`config`]); the adapter that lets the memory manager (`mm`) drive the engine's KV cache
//! ([`kvmm`]); paged weights ([`weights`]); the load profile it plans switches with
//! ([`profile`]). The `llms` CLI and the evaluation live in the `tools` crate; the map of the
//! crates: docs/ARCHITECTURE.md.

pub mod config;
pub mod kvmm;
pub mod profile;
pub mod service;
pub mod size;
pub mod stats;
pub mod weights;

// The protocol and the client live in `llms_client` (shared with the C library and the CLI).
pub use llms_client::{client, proto};

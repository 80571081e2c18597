//! The `llms` CLI ([`cli`]) and the `llmsd` service ([`service`]), and the wiring they share:
//! the adapter that lets the memory manager (`mm`) drive the engine's KV cache ([`kvmm`]), paged
//! weights ([`weights`]), the native protocol ([`proto`], [`client`]), traces and experiments.
//! The map of the crates and of these modules: docs/ARCHITECTURE.md.

pub mod cli;
pub mod config;
pub mod experiment;
pub mod figure;
pub mod httpbench;
pub mod kvmm;
pub mod loadbench;
pub mod replay;
pub mod report;
pub mod servebench;
pub mod service;
pub mod size;
pub mod stats;
pub mod switchbench;
pub mod synth;
pub mod trace;
pub mod weights;

// The protocol and the client live in `llms_client` (shared with the C library); these names
// keep `tools::client` and `tools::proto` for the service and the CLI.
pub use llms_client::{client, proto};

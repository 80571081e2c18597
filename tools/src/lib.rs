//! The `llms` CLI ([`cli`]) and the `llmsd` service ([`service`]), and the wiring they share:
//! the adapter that lets the memory manager (`mm`) drive the engine's KV cache ([`kvmm`]), paged
//! weights ([`weights`]), the native protocol ([`proto`], [`client`]), traces and experiments.
//! The map of the crates and of these modules: docs/ARCHITECTURE.md.

pub mod cli;
pub mod client;
pub mod config;
pub mod experiment;
pub mod figure;
pub mod kvmm;
pub mod loadbench;
pub mod proto;
pub mod replay;
pub mod report;
pub mod service;
pub mod size;
pub mod switchbench;
pub mod trace;
pub mod weights;

//! Wiring shared by the `llms` CLI and the `llmsd` service: the adapter that lets the memory
//! manager (`mm`) drive the engine's KV cache.

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

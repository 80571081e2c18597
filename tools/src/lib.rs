//! The `llms` CLI ([`cli`]) and the evaluation: the paper's experiments ([`experiment`]), their
//! figures and report ([`figure`], [`report`]), traces and replay ([`trace`], [`replay`]),
//! synthetic models ([`synth`]) and the benchmarks (`*bench`). The service itself is the
//! `llmsd` crate. The map of the crates and of these modules: docs/ARCHITECTURE.md.

pub mod cli;
pub mod experiment;
pub mod figure;
pub mod httpbench;
pub mod loadbench;
pub mod prefixbench;
pub mod provenance;
pub mod replay;
pub mod report;
pub mod servebench;
pub mod switchbench;
pub mod synth;
pub mod trace;
pub mod weightbench;

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

/// An error and its causes on one line, each said once ([`llms_client::describe`] over the
/// context chain).
pub fn describe(e: &anyhow::Error) -> String {
    llms_client::describe(e.as_ref())
}

/// A path from the environment variable `name`, when it is set and not empty (an empty value
/// means unset, as shells write `LLMS_MODEL= cmd`).
pub fn env_path(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os(name).filter(|v| !v.is_empty()).map(Into::into)
}

#[cfg(test)]
mod tests {
    #[test]
    fn each_cause_is_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory (os error 2)");
        let quoted = anyhow::Error::new(std::io::Error::other(format!("cannot open /nope: {io}"))).context("tokenizer source /nope");
        assert_eq!(super::describe(&quoted), "tokenizer source /nope: cannot open /nope: No such file or directory (os error 2)");
        let chained = anyhow::Error::new(io).context("reading /x").context("loading");
        assert_eq!(super::describe(&chained), "loading: reading /x: No such file or directory (os error 2)");
    }
}

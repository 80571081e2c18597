//! The LLMS system service: apps' contexts kept in a memory budget and served over a Unix
//! socket (the native protocol) and an OpenAI-compatible HTTP front ([`service`]); its settings
//! ([`config`]); the adapter that lets the memory manager (`mm`) drive the engine's KV cache
//! ([`kvmm`]); paged weights ([`weights`]); the load profile it plans switches with
//! ([`profile`]); how the kernel schedules the model's threads ([`sched`]). The `llms` CLI
//! and the evaluation live in the `tools` crate; the map of the crates: docs/ARCHITECTURE.md.

pub mod config;
pub mod kvmm;
pub mod profile;
pub mod sched;
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

/// The models `make` fetches (`make model`, `make model-gemma3`), by the names `--model`,
/// `LLMS_MODEL` and llmsd's `model =` take besides a path. The first is the default.
pub const MODELS: &[(&str, &str)] = &[("smollm2", "models/SmolLM2-135M-Instruct.Q4_1.gguf"), ("gemma3", "models/gemma-3-270m-q4_k_m.gguf")];

/// A model argument as a file. A name of [`MODELS`] is its file under the working directory,
/// else next to the repository this binary was built in (`target/<profile>/<bin>`), so the
/// installed tools find the fetched models from anywhere; an existing file of that name wins,
/// and anything else is a path, taken as it is.
pub fn model_file(arg: &std::path::Path) -> std::path::PathBuf {
    let Some(&(_, rel)) = MODELS.iter().find(|(name, _)| arg.as_os_str() == *name) else {
        return arg.to_path_buf();
    };
    if arg.exists() {
        return arg.to_path_buf();
    }
    let local = std::path::PathBuf::from(rel);
    if local.exists() {
        return local;
    }
    let beside_repo = std::env::current_exe().ok().and_then(|exe| exe.ancestors().nth(3).map(|root| root.join(rel)));
    beside_repo.filter(|p| p.exists()).unwrap_or(local)
}

/// The model when none is named: `$LLMS_MODEL` (a name or a path), else the first of [`MODELS`].
pub fn default_model() -> std::path::PathBuf {
    model_file(&env_path("LLMS_MODEL").unwrap_or_else(|| MODELS[0].0.into()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn model_names_resolve_to_the_fetched_files() {
        use std::path::Path;
        // A name is the fetched file (under the working directory or beside the repository).
        assert!(super::model_file(Path::new("gemma3")).ends_with("models/gemma-3-270m-q4_k_m.gguf"));
        assert!(super::model_file(Path::new("smollm2")).ends_with(super::MODELS[0].1));
        // Anything else is a path, untouched, found or not.
        assert_eq!(super::model_file(Path::new("/nope/gemma3")), Path::new("/nope/gemma3"));
        assert_eq!(super::model_file(Path::new("Gemma3")), Path::new("Gemma3"));
    }

    #[test]
    fn each_cause_is_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory (os error 2)");
        let quoted = anyhow::Error::new(std::io::Error::other(format!("cannot open /nope: {io}"))).context("tokenizer source /nope");
        assert_eq!(super::describe(&quoted), "tokenizer source /nope: cannot open /nope: No such file or directory (os error 2)");
        let chained = anyhow::Error::new(io).context("reading /x").context("loading");
        assert_eq!(super::describe(&chained), "loading: reading /x: No such file or directory (os error 2)");
    }
}

//! Helpers shared by the tests that run the real model: where the repository, the model and
//! the fixtures are, and the llama.cpp oracle values.
//!
//! The model is required: `make test` fetches it first. A test run without it fails with a
//! message saying how to get it, rather than skipping silently.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value;
use sha2::{Digest, Sha256};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ sits in the repository").to_path_buf()
}

/// The model the tests run: `$LLMS_MODEL`, else the set-up's default model.
pub fn model_path() -> PathBuf {
    let p = std::env::var_os("LLMS_MODEL").map(PathBuf::from).unwrap_or_else(|| repo_root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(p.exists(), "model {} not found: run `make test` (it fetches the default model) or set LLMS_MODEL", p.display());
    p
}

pub fn fixture(name: &str) -> PathBuf {
    repo_root().join("tests/fixtures").join(name)
}

/// llama.cpp's values for the default model (tests/fixtures/llama_cpp.json, made by
/// tools/oracle/make_fixtures.py). Panics if the model under test is not the one the fixtures
/// were made with: comparing against another model's values would prove nothing.
pub fn oracle() -> &'static Value {
    static ORACLE: OnceLock<Value> = OnceLock::new();
    ORACLE.get_or_init(|| checked_fixture("llama_cpp.json", &model_path()))
}

/// A fixture of llama.cpp's values, checked to be of the model file `model`.
pub fn checked_fixture(name: &str, model: &Path) -> Value {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(fixture(name)).unwrap_or_else(|e| panic!("read fixture {name}: {e}")))
        .unwrap_or_else(|e| panic!("fixture {name} is not JSON: {e}"));
    let want = v["model_sha256"].as_str().expect("fixture names its model");
    assert_eq!(sha256_file(model), want, "{} is not the model the fixture {name} was made with", model.display());
    v
}

/// Gemma 3 270M Q4_K_M (`make model-gemma3`), the second real model (issue #55).
pub fn gemma3_path() -> PathBuf {
    let p = repo_root().join("models/gemma-3-270m-q4_k_m.gguf");
    assert!(p.exists(), "model {} not found: run `make test` (it fetches it) or `make model-gemma3`", p.display());
    p
}

/// llama.cpp's values for Gemma 3 (tests/fixtures/gemma3.json), checked against its file as
/// [`oracle`] is.
pub fn gemma3_oracle() -> &'static Value {
    static ORACLE: OnceLock<Value> = OnceLock::new();
    ORACLE.get_or_init(|| checked_fixture("gemma3.json", &gemma3_path()))
}

/// A file's SHA-256, in hex.
pub fn sha256_file(path: &Path) -> String {
    format!("{:x}", Sha256::digest(std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))))
}

/// Token ids from a JSON array.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("array of ids").iter().map(|x| u32::try_from(x.as_u64().expect("id")).expect("id fits u32")).collect()
}

/// Kernel-feature tests probe first. When the probe fails, the test is skipped with the reason
/// printed, unless `LLMS_REQUIRE_KERNEL=1` (set by `make test`), which turns the skip into a
/// failure.
pub fn require_kernel<T, E: std::fmt::Display>(feature: &str, probe: Result<T, E>) -> Option<T> {
    match probe {
        Ok(v) => Some(v),
        Err(e) => {
            let msg = format!("{feature} is not usable here: {e}");
            assert!(std::env::var("LLMS_REQUIRE_KERNEL").as_deref() != Ok("1"), "{msg} (LLMS_REQUIRE_KERNEL=1 makes this a failure)");
            eprintln!("skipping: {msg}");
            None
        }
    }
}

/// Whether `LLMS_REQUIRE_KERNEL=1` is set.
pub fn kernel_required() -> bool {
    std::env::var("LLMS_REQUIRE_KERNEL").as_deref() == Ok("1")
}

/// Waits for an event: polls `probe` (short pauses, growing to 50 ms) until it gives a value,
/// and fails the test naming `what` if `limit` passes first. Tests wait on events this way,
/// never by sleeping for a guessed time: a slow machine only makes them slower, not wrong.
pub fn wait_until<T>(what: &str, limit: std::time::Duration, mut probe: impl FnMut() -> Option<T>) -> T {
    let t = std::time::Instant::now();
    let mut pause = std::time::Duration::from_millis(1);
    loop {
        if let Some(v) = probe() {
            return v;
        }
        assert!(t.elapsed() < limit, "waited {limit:?} for {what}");
        std::thread::sleep(pause);
        pause = (pause * 2).min(std::time::Duration::from_millis(50));
    }
}

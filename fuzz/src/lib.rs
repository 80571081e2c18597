//! What the fuzz targets share: the default model, a scratch directory, and one llmsd started
//! in the fuzzing process (the fronts' targets send it raw bytes over its real sockets). A panic
//! anywhere — a service thread included — aborts the process (libfuzzer-sys's hook), so a panic
//! the service would have caught and answered still counts as a crash.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

/// The default model (`make model`), or `LLMS_MODEL`.
pub fn model_path() -> PathBuf {
    std::env::var_os("LLMS_MODEL")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models/SmolLM2-135M-Instruct.Q4_1.gguf")), PathBuf::from)
}

/// A scratch directory of this process, made empty at first use: `LLMS_FUZZ_WORK` or
/// target/fuzz/work, on a real file system (the swap store uses O_DIRECT).
pub fn work_dir(name: &str) -> PathBuf {
    let base = std::env::var_os("LLMS_FUZZ_WORK")
        .map_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/fuzz/work")), PathBuf::from);
    let d = base.join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("the fuzz work directory can be made");
    d
}

/// The service every front target talks to: the default model, a small budget, short
/// deadlines (an input is sent whole, then the write side is closed), no pressure monitor.
pub fn service() -> &'static llmsd::service::Local {
    static SVC: OnceLock<llmsd::service::Local> = OnceLock::new();
    SVC.get_or_init(|| {
        let dir = work_dir("llmsd");
        let cfg = llmsd::config::Config {
            model: model_path(),
            socket: dir.join("llmsd.sock"),
            state_dir: dir.join("state"),
            budget: "16MiB".into(),
            pressure: false,
            load_profile: false,
            threads: 1,
            max_context_tokens: 256,
            io_timeout_s: 1,
            idle_timeout_s: 1,
            ..Default::default()
        };
        cfg.validate().expect("the fuzz service's settings are valid");
        llmsd::service::Local::start(cfg).expect("llmsd starts for fuzzing")
    })
}

/// Sends `data` on a new connection to `socket`, closes the write side and reads the whole
/// answer (the service closes it: the input ended, or a deadline passed).
pub fn exchange(socket: &std::path::Path, data: &[u8]) -> Vec<u8> {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket).expect("the service accepts connections");
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("a read timeout");
    let _ = s.write_all(data);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

//! `llms doctor`: what this machine offers LLMS, and how to fix what is missing.

use anyhow::Result;
use clap::Args;
use serde_json::json;

/// `llms doctor`.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    #[arg(long)]
    pub json: bool,
    /// Also check llmsd's state directory: every context file's checksum and structure, and
    /// which are damaged (left as they are, their data kept) or restored from their previous
    /// copy.
    #[arg(long)]
    pub state_dir: Option<std::path::PathBuf>,
}

impl DoctorArgs {
    pub fn run(self) -> Result<()> {
        let Self { json, state_dir } = self;
        let contexts = state_dir.as_deref().map(llmsd::service::check_state_dir).transpose()?;
        let shared = state_dir.as_deref().map(llmsd::service::check_shared).transpose()?;
        doctor(json, state_dir.as_deref(), contexts.as_deref(), shared.as_deref());
        Ok(())
    }
}

/// One line per facility: present/usable, and the fix when not.
fn doctor(
    json: bool,
    state_dir: Option<&std::path::Path>,
    contexts: Option<&[llmsd::service::ContextCheck]>,
    shared: Option<&[llmsd::service::SharedCheck]>,
) {
    let mut checks = Vec::new();
    match uffd_handler::Pager::new() {
        Ok(p) => {
            let c = p.capabilities();
            checks.push(json!({"facility": "userfaultfd", "ok": true,
                "detail": format!("created via {:?}; dirty tracking (WP_ASYNC): {}; UFFDIO_MOVE: {}; UFFDIO_POISON: {}", c.origin, c.wp_async, c.r#move, c.poison)}));
        }
        Err(e) => checks.push(json!({"facility": "userfaultfd", "ok": false, "detail": e.to_string()})),
    }
    let p = cgroup::probe(None);
    checks.push(match &p.psi {
        Ok(path) => json!({"facility": "PSI", "ok": true, "detail": format!("{} readable; triggers {}", path.display(),
            if p.cap_sys_resource { "with any window (CAP_SYS_RESOURCE)" } else { "with windows rounded to 2 s (no CAP_SYS_RESOURCE)" })}),
        Err(e) => {
            json!({"facility": "PSI", "ok": false, "detail": format!("{e}; the monitor falls back to MemAvailable and vmstat polling")})
        }
    });
    checks.push(match &p.cgroup {
        Ok((dir, kind)) => json!({"facility": "memory cgroup", "ok": true, "detail": format!("{:?} mode, {kind:?} files at {}", p.cgroup_mode, dir.display())}),
        Err(e) => json!({"facility": "memory cgroup", "ok": false, "detail": format!("{e}; give the service a cgroup (llms pressure --cgroup DIR) or rely on system-wide signals")}),
    });
    let simd = ::engine::kernels::simd_name();
    // io_uring carries the swap store's and the weight pager's reads and writes; a kernel or
    // a sandbox (Android's seccomp before 12, say) may refuse it.
    checks.push(match mm::ring::Ring::new(8) {
        Ok(_) => json!({"facility": "io_uring", "ok": true, "detail": "usable (swap store and weight reads)"}),
        Err(e) => json!({"facility": "io_uring", "ok": false, "detail": format!("{e}: the swap store and paged weights cannot run here (a kernel with io_uring, not blocked by seccomp or io_uring_disabled, is needed)")}),
    });
    // The kernels give the same results on every set (docs/engine.md); the scalar ones are slow.
    let detail = match simd {
        "scalar" if std::env::var("LLMS_SIMD").is_ok_and(|v| v == "scalar") => {
            "scalar (LLMS_SIMD=scalar: the vector kernels are turned off)".to_string()
        }
        "scalar" => "scalar: no AVX2+FMA+F16C or NEON here, slow scalar code".to_string(),
        "neon" => "neon (no dot-product extension: sdot would be faster)".to_string(),
        _ => simd.to_string(),
    };
    checks.push(json!({"facility": "cpu kernels", "ok": simd != "scalar", "detail": detail}));
    if let (Some(dir), Some(contexts)) = (state_dir, contexts) {
        let bad: Vec<_> = contexts.iter().filter(|c| c.status != "ok").collect();
        checks.push(json!({"facility": "state dir", "ok": bad.iter().all(|c| c.status != "damaged"),
            "detail": format!("{}: {} context file(s), {} damaged, {} from their previous copy", dir.display(), contexts.len(),
                bad.iter().filter(|c| c.status == "damaged").count(), bad.iter().filter(|c| c.status == "previous copy").count())}));
        for c in bad {
            checks.push(json!({"facility": format!("context {}", c.ctx), "ok": c.status != "damaged", "status": c.status,
                "detail": c.detail, "app": c.app, "uid": c.uid, "tokens": c.tokens}));
        }
    }
    for s in shared.unwrap_or_default() {
        // Unreachable chunks are not damage: the next start frees them (a kill -9 can leave some).
        checks.push(json!({"facility": "shared chunks", "ok": true, "store": s.store, "named": s.named, "reached": s.reached,
            "unreachable": s.named - s.reached,
            "detail": format!("{}: {} shared chunk(s), {} reached by saved contexts, {} unreachable (the next start frees them)",
                s.store, s.named, s.reached, s.named - s.reached)}));
    }
    if json {
        println!("{}", serde_json::to_string(&checks).unwrap_or_default());
        return;
    }
    for c in &checks {
        let ok = c["ok"].as_bool().unwrap_or(false);
        println!("[{}] {}: {}", if ok { " ok " } else { "FAIL" }, c["facility"].as_str().unwrap_or(""), c["detail"].as_str().unwrap_or(""));
    }
}

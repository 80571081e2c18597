//! `llms doctor`: what this machine offers LLMS, and how to fix what is missing.

use anyhow::Result;
use clap::Args;
use serde_json::json;

/// `llms doctor`.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    #[arg(long)]
    pub json: bool,
}

impl DoctorArgs {
    pub fn run(self) -> Result<()> {
        let Self { json } = self;
        doctor(json);
        Ok(())
    }
}

/// One line per facility: present/usable, and the fix when not.
fn doctor(json: bool) {
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
    checks.push(json!({"facility": "cpu kernels", "ok": simd != "scalar", "detail": format!("{simd} (AVX2+FMA+F16C {})", if simd == "scalar" { "missing: slow scalar code" } else { "present" })}));
    if json {
        println!("{}", serde_json::to_string(&checks).unwrap_or_default());
        return;
    }
    for c in &checks {
        let ok = c["ok"].as_bool().unwrap_or(false);
        println!("[{}] {}: {}", if ok { " ok " } else { "FAIL" }, c["facility"].as_str().unwrap_or(""), c["detail"].as_str().unwrap_or(""));
    }
}

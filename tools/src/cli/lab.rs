//! `llms lab`: the programs the device lab runs inside its guest (docs/lab.md). They drive the
//! same apps, trace and memory pressure against three systems and measure what the kernel does:
//! - `hog`: a process that takes and releases memory in steps, the way a camera or a game does;
//! - `killer`: a low-memory killer on the guest's PSI triggers, written to lmkd's documented
//!   rules (no packaged killer runs in a busybox guest: nohang needs Python, earlyoom ignores PSI);
//! - `app`: the status quo's app, an engine of its own holding its context in plain memory;
//! - `drive`: replays a trace's calls against llmsd or the status quo's apps, samples the
//!   kernel's signals, and writes one run's result;
//! - `prebuild`: on the host, conversations the trace's apps held before the run (long contexts
//!   on flash in a state directory the guest's llmsd starts from);
//! - `summary`: gathers the runs into `summary.json`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use llmsd::stats::percentile;

#[derive(Subcommand, Debug)]
pub enum LabCmd {
    /// Holds anonymous memory following a plan of steps `SECONDS:MIB,...` (from its start;
    /// `SECONDS:N%` is N% of MemTotal),
    /// touching every held page each `--touch-ms` (a working set, not a cold allocation);
    /// writes each step's time to get the memory as JSON lines to --out.
    Hog {
        #[arg(long)]
        plan: String,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 500)]
        touch_ms: u64,
    },
    /// A low-memory killer on the system's PSI triggers, after lmkd's rules: a `full` stall of
    /// --full-ms in a second kills at once; a `some` stall of --some-ms in a second kills when
    /// swap is nearly used up (free < 10%) or MemAvailable is under 5%. The victim is the
    /// process of --cgroup with the highest oom_score_adj (never below 0), the largest first.
    Killer {
        #[arg(long)]
        cgroup: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 70)]
        some_ms: u64,
        #[arg(long, default_value_t = 700)]
        full_ms: u64,
    },
    /// The status quo's app: its own engine and context in plain memory, serving JSON-line
    /// requests on stdin (`{"history": TEXT}` recomputes a lost context, `{"prompt": TEXT,
    /// "max_tokens": N}` is a call).
    App {
        #[arg(long)]
        model: PathBuf,
        #[arg(long, default_value_t = 2)]
        threads: usize,
        #[arg(long, default_value_t = 4096)]
        capacity: usize,
    },
    /// Replays a trace against a system (`llmsd`, `fixed-budget`: llmsd's socket; `status-quo`:
    /// one `llms lab app` process per context in --apps-cgroup) and writes `result.json` and
    /// `timeline.jsonl` to --out.
    Drive(Drive),
    /// On the host: a state directory in which every context of the trace's apps already holds
    /// a conversation of --tokens tokens (the trace's prompts, cycled), on flash: what the
    /// guest's llmsd holds from earlier use when a run starts (TCG prefills far too slowly to
    /// build long contexts in the guest).
    Prebuild {
        #[arg(long)]
        trace: PathBuf,
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        state_dir: PathBuf,
        #[arg(long)]
        tokens: usize,
        /// The guest's llmsd must allow as many (its `max_context_tokens`).
        #[arg(long, default_value_t = 8192)]
        max_context_tokens: usize,
    },
    /// Gathers the runs' `result.json` files under DIR into one summary (docs/lab.md).
    Summary {
        dir: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn lab(cmd: LabCmd) -> Result<()> {
    match cmd {
        LabCmd::Hog { plan, out, touch_ms } => hog(&parse_plan(&plan)?, &out, touch_ms),
        LabCmd::Killer { cgroup, out, some_ms, full_ms } => killer(&cgroup, &out, some_ms, full_ms),
        LabCmd::App { model, threads, capacity } => app(&model, threads, capacity),
        LabCmd::Drive(d) => d.run(),
        LabCmd::Prebuild { trace, model, state_dir, tokens, max_context_tokens } => {
            prebuild(&trace, &model, &state_dir, tokens, max_context_tokens)
        }
        LabCmd::Summary { dir, out } => summary(&dir, &out),
    }
}

/// `SECONDS:MIB,...`, times increasing.
fn parse_plan(s: &str) -> Result<Vec<(f64, usize)>> {
    let mut v: Vec<(f64, usize)> = Vec::new();
    for step in s.split(',').filter(|x| !x.is_empty()) {
        let (t, mb) = step.split_once(':').with_context(|| format!("plan step {step:?}: SECONDS:MIB"))?;
        let t: f64 = t.parse().with_context(|| format!("plan step {step:?}: {t:?} is not seconds"))?;
        let mb: usize = match mb.strip_suffix('%') {
            // A share of the machine's memory: one plan squeezes guests of any size alike.
            Some(pct) => {
                let pct: f64 =
                    pct.parse().ok().filter(|p| (0.0..=100.0).contains(p)).with_context(|| format!("plan step {step:?}: {mb:?}"))?;
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
                let v = (mem_total()? as f64 * pct / 100.0 / MIB as f64) as usize;
                v
            }
            None => mb.parse().with_context(|| format!("plan step {step:?}: {mb:?} is not MiB or a share of memory"))?,
        };
        if !t.is_finite() || t < 0.0 || v.last().is_some_and(|&(p, _)| t < p) || mb > 1 << 20 {
            bail!("plan step {step:?}: times must increase from 0, sizes stay under 1 TiB");
        }
        v.push((t, mb));
    }
    if v.is_empty() {
        bail!("an empty plan");
    }
    Ok(v)
}

const MIB: usize = 1 << 20;
const PAGE: usize = 4096;

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn hog(plan: &[(f64, usize)], out: &Path, touch_ms: u64) -> Result<()> {
    let mut log = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let start = Instant::now();
    let mut held: Vec<Box<[u8]>> = Vec::new();
    let mut last_touch = Instant::now();
    let mut x = 0x9e37_79b9_7f4a_7c15_u64;
    for &(t, mb) in plan {
        // Hold (and keep touching) what is held until the step's time.
        while start.elapsed().as_secs_f64() < t {
            if last_touch.elapsed() >= Duration::from_millis(touch_ms) {
                touch(&mut held);
                last_touch = Instant::now();
            }
            std::thread::sleep(Duration::from_millis(touch_ms.clamp(10, 100)));
        }
        let asked = Instant::now();
        held.truncate(mb);
        while held.len() < mb {
            // A fresh MiB of noise: the kernel has to find the memory now, and zram cannot
            // store it as same-filled or well-compressed pages (a game's textures, not zeros).
            let mut b = vec![0u8; MIB].into_boxed_slice();
            for w in b.chunks_exact_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                w.copy_from_slice(&x.to_le_bytes());
            }
            held.push(b);
        }
        writeln!(log, "{}", json!({"t_s": start.elapsed().as_secs_f64(), "mib": mb, "got_ms": ms_since(asked)}))?;
    }
    Ok(())
}

fn touch(held: &mut [Box<[u8]>]) {
    for b in held {
        for p in (0..b.len()).step_by(PAGE) {
            b[p] = b[p].wrapping_add(1);
        }
    }
}

/// `MemTotal` in bytes.
fn mem_total() -> Result<u64> {
    let t = std::fs::read_to_string("/proc/meminfo")?;
    let kb = t.lines().find_map(|l| l.strip_prefix("MemTotal:")?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok());
    Ok(kb.context("/proc/meminfo: no MemTotal")? * 1024)
}

/// `MemAvailable`, `SwapTotal`, `SwapFree` in bytes.
fn meminfo() -> Result<(u64, u64, u64)> {
    let t = std::fs::read_to_string("/proc/meminfo")?;
    let get = |k: &str| -> u64 {
        t.lines().find_map(|l| l.strip_prefix(k)?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()).unwrap_or(0) * 1024
    };
    Ok((get("MemAvailable:"), get("SwapTotal:"), get("SwapFree:")))
}

fn procs(cgroup: &Path) -> Vec<i32> {
    std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default().lines().filter_map(|l| l.trim().parse().ok()).collect()
}

fn read_i64(path: &str) -> Option<i64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Resident bytes of a process (statm's second field).
fn rss(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/statm")).ok().and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok()).unwrap_or(0)
        * PAGE as u64
}

fn killer(cgroup: &Path, out: &Path, some_ms: u64, full_ms: u64) -> Result<()> {
    let psi = Path::new("/proc/pressure/memory");
    let some = cgroup::PsiTrigger::register(psi, false, some_ms * 1000, 1_000_000, true).context("arming the some trigger")?;
    let full = cgroup::PsiTrigger::register(psi, true, full_ms * 1000, 1_000_000, true).context("arming the full trigger")?;
    let mut log = std::fs::File::create(out)?;
    let start = Instant::now();
    let mut last_kill: Option<Instant> = None;
    loop {
        let fired_some = some.wait(100).unwrap_or(false);
        let fired_full = full.wait(0).unwrap_or(false);
        if !fired_some && !fired_full {
            continue;
        }
        // lmkd waits for a victim to die and lets its memory show before the next kill.
        if last_kill.is_some_and(|k| k.elapsed() < Duration::from_millis(200)) {
            continue;
        }
        let (avail, swap_total, swap_free) = meminfo()?;
        let total = mem_total()?;
        let swap_low = swap_total > 0 && swap_free * 10 < swap_total;
        let mem_low = avail * 20 < total;
        let reason = if fired_full {
            "critical: full stall"
        } else if swap_low {
            "some stall, swap nearly full"
        } else if mem_low {
            "some stall, MemAvailable under 5%"
        } else {
            continue;
        };
        let victim = procs(cgroup)
            .into_iter()
            .filter_map(|pid| Some((read_i64(&format!("/proc/{pid}/oom_score_adj"))?, rss(pid), pid)))
            .filter(|&(adj, _, _)| adj >= 0)
            .max();
        let Some((adj, bytes, pid)) = victim else { continue };
        // SAFETY: kill(2) with a pid read from the cgroup and SIGKILL; no memory is touched.
        let r = unsafe { libc::kill(pid, libc::SIGKILL) };
        let t = Instant::now();
        while Path::new(&format!("/proc/{pid}")).exists() && t.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_millis(5));
        }
        last_kill = Some(Instant::now());
        writeln!(
            log,
            "{}",
            json!({"t_s": start.elapsed().as_secs_f64(), "pid": pid, "adj": adj, "rss": bytes, "reason": reason, "ok": r == 0,
                   "mem_available": avail, "swap_free": swap_free})
        )?;
        log.flush()?;
    }
}

#[derive(Deserialize)]
struct AppReq {
    #[serde(default)]
    history: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    max_tokens: usize,
}

fn app(model_path: &Path, threads: usize, capacity: usize) -> Result<()> {
    let t0 = Instant::now();
    let model = Arc::new(::engine::Model::load(model_path)?);
    let pool = Arc::new(::engine::ThreadPool::new(threads.max(1)));
    let mut s = ::engine::Session::new(Arc::clone(&model), pool, capacity);
    let load_ms = ms_since(t0);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    writeln!(out, "{}", json!({"ready": true, "load_ms": load_ms}))?;
    out.flush()?;
    for line in std::io::stdin().lock().lines() {
        let req: AppReq = serde_json::from_str(&line?).context("a request line")?;
        let reply = if let Some(h) = req.history {
            let t = Instant::now();
            let ids = model.tokenizer.encode(&h, true, false)?;
            let n = ids.len().min(capacity.saturating_sub(256));
            s.truncate(0);
            s.eval(&ids[..n], ::engine::Logits::None)?;
            json!({"recompute_ms": ms_since(t), "tokens": n})
        } else if let Some(p) = req.prompt {
            // The context made ready: every page of the process read once, so what the
            // kernel swapped to zram comes back now (the engine would fault on it anyway).
            let t = Instant::now();
            let pages = touch_own_memory();
            let ready_ms = ms_since(t);
            let ids = model.tokenizer.encode(&p, s.n_past() == 0, false)?;
            if s.n_past() + ids.len() + req.max_tokens >= capacity {
                bail!("the context is full ({} of {capacity} tokens)", s.n_past());
            }
            let mut tok = ::engine::sampler::argmax(s.eval(&ids, ::engine::Logits::Last)?);
            let ttft_ms = ms_since(t);
            let mut text = Vec::new();
            for _ in 1..req.max_tokens.max(1) {
                model.tokenizer.token_bytes(tok, false, &mut text);
                tok = ::engine::sampler::argmax(s.eval(&[tok], ::engine::Logits::Last)?);
            }
            json!({"ready_ms": ready_ms, "pages": pages, "ttft_ms": ttft_ms, "total_ms": ms_since(t), "prompt_tokens": ids.len(),
                   "output": String::from_utf8_lossy(&text)})
        } else {
            bail!("a request with neither history nor prompt");
        };
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    Ok(())
}

/// Reads one byte of every page of this process's private writable mappings; returns how many.
fn touch_own_memory() -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut n = 0;
    for l in maps.lines() {
        let mut f = l.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else { continue };
        if !perms.starts_with("rw") || !perms.ends_with('p') || l.contains("[vvar") || l.contains("[vsyscall") {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else { continue };
        let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) else { continue };
        for p in (a..b).step_by(PAGE) {
            // SAFETY: p lies in a readable mapping of this process (rw-p in /proc/self/maps,
            // read just now; nothing unmaps memory on this thread meanwhile).
            unsafe { std::ptr::read_volatile(p as *const u8) };
            n += 1;
        }
    }
    n
}

/// One call's measures, as every system reports them.
#[derive(Debug, Clone, Serialize)]
struct CallRec {
    t_s: f64,
    ctx: usize,
    /// Call sent → context ready (llmsd: its switch; status quo: restart, reload and
    /// recompute of a killed app, or faulting its memory back).
    switch_ms: f64,
    ttft_ms: f64,
    total_ms: f64,
    prompt_tokens: u64,
    lost: bool,
    error: Option<String>,
}

struct StatusQuoApp {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// One replay of `llms lab drive` (its flags: [`LabCmd::Drive`]).
#[derive(clap::Args, Debug)]
pub struct Drive {
    #[arg(long)]
    system: String,
    #[arg(long)]
    scenario: String,
    #[arg(long)]
    trace: PathBuf,
    #[arg(long)]
    out: PathBuf,
    #[arg(long)]
    model: PathBuf,
    /// The apps' cgroup (llmsd's for the llmsd systems).
    #[arg(long)]
    apps_cgroup: PathBuf,
    /// The pressure processes' cgroup.
    #[arg(long)]
    pressure_cgroup: PathBuf,
    #[arg(long, default_value = "/run/llmsd.sock")]
    socket: PathBuf,
    /// The killer's and the hog's logs, read into the result.
    #[arg(long)]
    killer_log: Option<PathBuf>,
    #[arg(long)]
    hog_log: Option<PathBuf>,
    /// Start no call after this many seconds, of the trace or of the wall (the trace is cut).
    #[arg(long, default_value_t = 600.0)]
    max_seconds: f64,
    /// llmsd: continue the app's context held from before the run (`llms lab prebuild`)
    /// instead of opening a new one.
    #[arg(long)]
    adopt: bool,
    /// Decode at most this many tokens a call (the trace's own counts when 0).
    #[arg(long, default_value_t = 0)]
    max_tokens: u32,
}

/// `llms lab prebuild`: an in-process llmsd over `state_dir`; each context of the trace gets
/// its app's connection and prompts (raw, cycled) until it holds `tokens` tokens; a clean stop
/// leaves every chunk on flash.
fn prebuild(trace: &Path, model: &Path, state_dir: &Path, tokens: usize, max_context_tokens: usize) -> Result<()> {
    let (_, recs) = crate::trace::read(trace)?;
    if tokens + 64 > max_context_tokens {
        bail!("--tokens {tokens} leaves no room for the run's calls under --max-context-tokens {max_context_tokens}");
    }
    std::fs::create_dir_all(state_dir)?;
    let socket = std::env::temp_dir().join(format!("llms-prebuild-{}.sock", std::process::id()));
    let cfg = llmsd::config::Config {
        model: model.to_path_buf(),
        state_dir: state_dir.to_path_buf(),
        socket: socket.clone(),
        budget: "1GiB".into(),
        pressure: false,
        load_profile: false,
        max_context_tokens,
        ..llmsd::config::Config::default()
    };
    cfg.validate()?;
    let l = llmsd::service::Local::start(cfg)?;
    let r = (|| -> Result<()> {
        let mut apps: Vec<(usize, &str)> = recs.iter().map(|r| (r.ctx, r.app.as_str())).collect();
        apps.sort_unstable();
        apps.dedup_by_key(|a| a.0);
        let prompts: Vec<&str> = recs.iter().map(|r| r.prompt.as_str()).collect();
        for (k, (ctx, app)) in apps.iter().enumerate() {
            let mut c = llmsd::client::Client::connect(&socket, app)?;
            if c.list()?.iter().any(|i| i.tokens > 0) {
                bail!("app {app} already holds a context in {}", state_dir.display());
            }
            let id = c.new_ctx(None)?;
            let mut held = 0usize;
            // Pieces of several prompts, so each call prefills a few hundred tokens.
            let mut at = k;
            while held < tokens {
                let piece: String = (0..8).map(|j| prompts[(at + j) % prompts.len()]).collect::<Vec<_>>().join(" ");
                at += 8;
                let call = llmsd::proto::Call {
                    ctx: id.clone(),
                    prompt: piece,
                    max_tokens: 1,
                    temperature: 0.0,
                    seed: 0,
                    stop: Vec::new(),
                    raw: true,
                    top_p: None,
                };
                let (_, st) = c.call(&call, &mut |_| {})?;
                held = c.list()?.iter().find(|i| i.ctx == id).map_or(0, |i| i.tokens as usize);
                if st.prompt_tokens == 0 {
                    bail!("context {ctx}: a call took no tokens");
                }
            }
            eprintln!("prebuild: app {app}: context {id}, {held} tokens");
        }
        Ok(())
    })();
    l.stop()?;
    r
}

fn write_adj(pid: u32, adj: i32) {
    let _ = std::fs::write(format!("/proc/{pid}/oom_score_adj"), adj.to_string());
}

impl Drive {
    fn spawn_app(&self) -> Result<(StatusQuoApp, f64)> {
        let t = Instant::now();
        let mut child = Command::new(std::env::current_exe()?)
            .args(["lab", "app", "--model"])
            .arg(&self.model)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        // Into the apps' group, as a cached background app until it is called.
        std::fs::write(self.apps_cgroup.join("cgroup.procs"), child.id().to_string()).context("moving an app into its cgroup")?;
        write_adj(child.id(), 900);
        let stdin = child.stdin.take().context("stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        if !line.contains("ready") {
            bail!("the app did not start: {line:?}");
        }
        Ok((StatusQuoApp { child, stdin, stdout }, ms_since(t)))
    }

    fn ask(app: &mut StatusQuoApp, req: &Value) -> Result<Value> {
        writeln!(app.stdin, "{req}")?;
        app.stdin.flush()?;
        let mut line = String::new();
        if app.stdout.read_line(&mut line)? == 0 {
            bail!("the app died");
        }
        Ok(serde_json::from_str(&line)?)
    }

    fn run(&self) -> Result<()> {
        let (_, recs) = crate::trace::read(&self.trace)?;
        std::fs::create_dir_all(&self.out)?;
        let llmsd = matches!(self.system.as_str(), "llmsd" | "fixed-budget");
        if !llmsd && self.system != "status-quo" {
            bail!("system {:?}: llmsd, fixed-budget or status-quo", self.system);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let sampler = {
            let (stop, out, apps, pressure, socket) = (
                Arc::clone(&stop),
                self.out.join("timeline.jsonl"),
                self.apps_cgroup.clone(),
                self.pressure_cgroup.clone(),
                self.socket.clone(),
            );
            std::thread::spawn(move || sample_loop(&stop, &out, &apps, &pressure, llmsd.then_some(socket.as_path())))
        };
        let psi0 = (psi_totals(Path::new("/proc/pressure/memory")), psi_totals(&self.apps_cgroup.join("memory.pressure")));
        let hog_psi0 = psi_totals(&self.pressure_cgroup.join("memory.pressure"));
        let vm0 = vmstat();
        let start = Instant::now();
        let mut calls = Vec::new();
        let mut lost = 0u64;
        // Per context: llmsd's client and context id, or the status quo's app and its history.
        let mut clients: HashMap<usize, (llmsd::client::Client, String)> = HashMap::new();
        let mut apps: HashMap<usize, StatusQuoApp> = HashMap::new();
        let mut history: HashMap<usize, String> = HashMap::new();
        for r in &recs {
            // Bounded by the trace's clock and the wall's: an overloaded system falls behind
            // the trace, and the guest has a deadline.
            if r.t > self.max_seconds || start.elapsed().as_secs_f64() > self.max_seconds {
                break;
            }
            let wait = r.t - start.elapsed().as_secs_f64();
            if wait > 0.0 {
                std::thread::sleep(Duration::from_secs_f64(wait));
            }
            let t_s = start.elapsed().as_secs_f64();
            let t = Instant::now();
            let mut rec =
                CallRec { t_s, ctx: r.ctx, switch_ms: 0.0, ttft_ms: 0.0, total_ms: 0.0, prompt_tokens: 0, lost: false, error: None };
            if llmsd {
                let res = (|| -> Result<llmsd::proto::CallStats> {
                    if let std::collections::hash_map::Entry::Vacant(e) = clients.entry(r.ctx) {
                        let mut c = llmsd::client::Client::connect(&self.socket, &r.app)?;
                        let held = if self.adopt { c.list()?.into_iter().max_by_key(|i| i.tokens).map(|i| i.ctx) } else { None };
                        let id = match held {
                            Some(id) => id,
                            None if self.adopt => bail!("app {} holds no context to continue", r.app),
                            None => c.new_ctx(None)?,
                        };
                        e.insert((c, id));
                    }
                    let (c, id) = clients.get_mut(&r.ctx).context("client")?;
                    let call = llmsd::proto::Call {
                        ctx: id.clone(),
                        prompt: r.prompt.clone(),
                        max_tokens: if self.max_tokens > 0 { r.max_tokens.min(self.max_tokens) } else { r.max_tokens },
                        temperature: 0.0,
                        seed: 0,
                        stop: Vec::new(),
                        raw: true,
                        top_p: None,
                    };
                    Ok(c.call(&call, &mut |_| {})?.1)
                })();
                match res {
                    Ok(st) => {
                        rec.switch_ms = st.switch_ms;
                        rec.ttft_ms = st.ttft_ms;
                        rec.prompt_tokens = u64::from(st.prompt_tokens);
                    }
                    Err(e) => {
                        rec.error = Some(format!("{e:#}"));
                        clients.remove(&r.ctx);
                    }
                }
            } else {
                let res = (|| -> Result<Value> {
                    let mut restart_ms = 0.0;
                    let dead = apps.get_mut(&r.ctx).is_some_and(|a| a.child.try_wait().ok().flatten().is_some());
                    if dead {
                        apps.remove(&r.ctx);
                        rec.lost = true;
                    }
                    let a = match apps.entry(r.ctx) {
                        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                        std::collections::hash_map::Entry::Vacant(e) => {
                            let (mut a, ms) = self.spawn_app()?;
                            restart_ms = ms;
                            if let Some(h) = history.get(&r.ctx) {
                                match Self::ask(&mut a, &json!({"history": h})) {
                                    Ok(v) => restart_ms += v["recompute_ms"].as_f64().unwrap_or(0.0),
                                    Err(e) => {
                                        // Killed again while recomputing: no orphan is left.
                                        let _ = a.child.kill();
                                        let _ = a.child.wait();
                                        return Err(e);
                                    }
                                }
                            }
                            e.insert(a)
                        }
                    };
                    // The called app is in the foreground for its call.
                    write_adj(a.child.id(), 0);
                    let max_tokens = if self.max_tokens > 0 { r.max_tokens.min(self.max_tokens) } else { r.max_tokens };
                    let v = Self::ask(a, &json!({"prompt": r.prompt, "max_tokens": max_tokens}));
                    write_adj(a.child.id(), 900);
                    let mut v = v?;
                    v["restart_ms"] = json!(restart_ms);
                    Ok(v)
                })();
                match res {
                    Ok(v) => {
                        rec.switch_ms = v["restart_ms"].as_f64().unwrap_or(0.0) + v["ready_ms"].as_f64().unwrap_or(0.0);
                        rec.ttft_ms = v["restart_ms"].as_f64().unwrap_or(0.0) + v["ttft_ms"].as_f64().unwrap_or(0.0);
                        rec.prompt_tokens = v["prompt_tokens"].as_u64().unwrap_or(0);
                        let h = history.entry(r.ctx).or_default();
                        h.push_str(&r.prompt);
                        h.push_str(v["output"].as_str().unwrap_or(""));
                    }
                    Err(e) => {
                        // Killed in the middle of its call: lost, and the call fails.
                        rec.error = Some(format!("{e:#}"));
                        rec.lost = true;
                        apps.remove(&r.ctx);
                    }
                }
            }
            lost += u64::from(rec.lost);
            rec.total_ms = ms_since(t);
            eprintln!(
                "t {:.1} s ctx {} switch {:.1} ms ttft {:.1} ms tokens {}{}{}",
                rec.t_s,
                rec.ctx,
                rec.switch_ms,
                rec.ttft_ms,
                rec.prompt_tokens,
                if rec.lost { " (context lost)" } else { "" },
                rec.error.as_deref().map(|e| format!(" error: {e}")).unwrap_or_default()
            );
            calls.push(rec);
        }
        let wall_s = start.elapsed().as_secs_f64();
        stop.store(true, Ordering::SeqCst);
        let _ = sampler.join();
        for (_, mut a) in apps {
            let _ = a.child.kill();
            let _ = a.child.wait();
        }
        let psi1 = (psi_totals(Path::new("/proc/pressure/memory")), psi_totals(&self.apps_cgroup.join("memory.pressure")));
        let hog_psi1 = psi_totals(&self.pressure_cgroup.join("memory.pressure"));
        let vm1 = vmstat();
        let read_lines = |p: &Option<PathBuf>| -> Vec<Value> {
            p.as_ref()
                .and_then(|p| std::fs::read_to_string(p).ok())
                .unwrap_or_default()
                .lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect()
        };
        let kills = read_lines(&self.killer_log);
        let hog = read_lines(&self.hog_log);
        let mut sw: Vec<f64> = calls.iter().filter(|c| c.error.is_none()).map(|c| c.switch_ms).collect();
        let mut ttft: Vec<f64> = calls.iter().filter(|c| c.error.is_none()).map(|c| c.ttft_ms).collect();
        let events = counters(&self.apps_cgroup.join("memory.events"));
        let oom_kills = events.get("oom_kill").copied().unwrap_or(0)
            + counters(&self.pressure_cgroup.join("memory.events")).get("oom_kill").copied().unwrap_or(0);
        let ms = |a: Option<(u64, u64)>, b: Option<(u64, u64)>, full: bool| -> f64 {
            match (a, b) {
                #[allow(clippy::cast_precision_loss)]
                (Some(a), Some(b)) => (if full { b.1.saturating_sub(a.1) } else { b.0.saturating_sub(a.0) }) as f64 / 1e3,
                _ => f64::NAN,
            }
        };
        let result = json!({
            "system": self.system,
            "scenario": self.scenario,
            "apps": recs.iter().map(|r| r.ctx).max().map_or(0, |m| m + 1),
            "calls": calls.len(),
            "failed_calls": calls.iter().filter(|c| c.error.is_some()).count(),
            "contexts_lost": lost,
            "oom_kills": oom_kills,
            "killer_kills": kills.len(),
            "switch_ms_p50": percentile(&mut sw, 0.5),
            "switch_ms_p99": percentile(&mut sw, 0.99),
            "ttft_ms_p50": percentile(&mut ttft, 0.5),
            "ttft_ms_p99": percentile(&mut ttft, 0.99),
            "psi_full_ms": ms(psi0.1, psi1.1, true),
            "psi_some_ms": ms(psi0.1, psi1.1, false),
            "pressure_psi_full_ms": ms(hog_psi0, hog_psi1, true),
            "pressure_psi_some_ms": ms(hog_psi0, hog_psi1, false),
            "system_psi_full_ms": ms(psi0.0, psi1.0, true),
            "system_psi_some_ms": ms(psi0.0, psi1.0, false),
            "swapped_out_pages": vm1.get("pswpout").copied().unwrap_or(0).saturating_sub(vm0.get("pswpout").copied().unwrap_or(0)),
            "swapped_in_pages": vm1.get("pswpin").copied().unwrap_or(0).saturating_sub(vm0.get("pswpin").copied().unwrap_or(0)),
            "hog_got_ms": hog.iter().map(|h| h["got_ms"].clone()).collect::<Vec<_>>(),
            "hog_got_ms_total": hog.iter().filter_map(|h| h["got_ms"].as_f64()).sum::<f64>(),
            "wall_s": wall_s,
            "kills": kills,
            "calls_detail": calls,
        });
        std::fs::write(self.out.join("result.json"), serde_json::to_string_pretty(&result)?)?;
        println!("{}", serde_json::to_string(&json!({"system": self.system, "contexts_lost": lost, "calls": calls.len()}))?);
        Ok(())
    }
}

fn counters(path: &Path) -> HashMap<String, u64> {
    std::fs::read_to_string(path).ok().and_then(|t| cgroup::parse_counters(&path.display().to_string(), &t).ok()).unwrap_or_default()
}

fn vmstat() -> HashMap<String, u64> {
    counters(Path::new("/proc/vmstat"))
}

/// PSI `some` and `full` totals, µs.
fn psi_totals(path: &Path) -> Option<(u64, u64)> {
    let t = std::fs::read_to_string(path).ok()?;
    let p = cgroup::parse_psi(&path.display().to_string(), &t).ok()?;
    Some((p.some.total_us, p.full.total_us))
}

fn sample_loop(stop: &AtomicBool, out: &Path, apps: &Path, pressure: &Path, socket: Option<&Path>) {
    let Ok(mut f) = std::fs::File::create(out) else { return };
    let start = Instant::now();
    let mut client = socket.and_then(|s| llmsd::client::Client::connect(s, "lab-sampler").ok());
    while !stop.load(Ordering::SeqCst) {
        let (avail, swap_total, swap_free) = meminfo().unwrap_or_default();
        let read = |p: PathBuf| std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse::<u64>().ok());
        let budget = client.as_mut().and_then(|c| c.stats().ok()).map(|s| (s.budget_bytes, s.resident_bytes));
        let v = json!({
            "t_s": start.elapsed().as_secs_f64(),
            "mem_available": avail,
            "swap_used": swap_total.saturating_sub(swap_free),
            "psi": psi_totals(Path::new("/proc/pressure/memory")),
            "apps_psi": psi_totals(&apps.join("memory.pressure")),
            "pressure_psi": psi_totals(&pressure.join("memory.pressure")),
            "apps_current": read(apps.join("memory.current")),
            "pressure_current": read(pressure.join("memory.current")),
            "budget": budget.map(|b| b.0),
            "resident": budget.map(|b| b.1),
        });
        let _ = writeln!(f, "{v}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn summary(dir: &Path, out: &Path) -> Result<()> {
    let mut runs = Vec::new();
    let mut kernel = String::new();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)?.flatten().map(|e| e.path()).filter(|p| p.join("result.json").exists()).collect();
    dirs.sort();
    for d in &dirs {
        let r: Value = serde_json::from_str(&std::fs::read_to_string(d.join("result.json"))?)?;
        if kernel.is_empty() {
            kernel = std::fs::read_to_string(d.join("kernel")).unwrap_or_default().trim().to_string();
        }
        let mut keep = serde_json::Map::new();
        for k in [
            "system",
            "scenario",
            "apps",
            "contexts_lost",
            "oom_kills",
            "killer_kills",
            "switch_ms_p50",
            "switch_ms_p99",
            "psi_full_ms",
            "ttft_ms_p50",
            "ttft_ms_p99",
            "hog_got_ms_total",
            "pressure_psi_some_ms",
            "pressure_psi_full_ms",
            "system_psi_some_ms",
            "system_psi_full_ms",
            "failed_calls",
            "calls",
        ] {
            keep.insert(k.into(), r[k].clone());
        }
        let rows: Vec<Value> = std::fs::read_to_string(d.join("timeline.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        if let Some(b) = budget_over_run(&rows) {
            keep.extend(b);
        }
        keep.extend(stall_peaks(&rows));
        for k in ["swapped_out_pages", "swapped_in_pages"] {
            keep.insert(k.into(), r[k].clone());
        }
        runs.push(Value::Object(keep));
    }
    let weights = weights_summary(&dir.join("weights").join("weights.jsonl"))?;
    if runs.is_empty() && weights.is_none() {
        bail!("no result.json or weights/weights.jsonl under {}", dir.display());
    }
    if kernel.is_empty() {
        kernel = std::fs::read_to_string(dir.join("weights").join("kernel")).unwrap_or_default().trim().to_string();
    }
    let mut s = json!({"guest_kernel": kernel, "runs": runs});
    if let Some(w) = weights {
        s["weights"] = w;
    }
    std::fs::write(out, serde_json::to_string_pretty(&s)?)?;
    plots(dir, out.parent().unwrap_or(Path::new(".")))?;
    println!("{}", serde_json::to_string_pretty(&s)?);
    Ok(())
}

/// llmsd's budget over a run's timeline: where it started, how far it followed the pressure
/// down, where it ended, and the most KV it held (MiB). None for a run without llmsd.
#[allow(clippy::cast_precision_loss)]
fn budget_over_run(rows: &[Value]) -> Option<serde_json::Map<String, Value>> {
    let mib = |k: &str| rows.iter().filter_map(|v| v[k].as_f64()).map(|x| x / MIB as f64).collect::<Vec<f64>>();
    let (budget, resident) = (mib("budget"), mib("resident"));
    let (first, last) = (*budget.first()?, *budget.last()?);
    let mut m = serde_json::Map::new();
    m.insert("budget_start_mib".into(), json!(first));
    m.insert("budget_min_mib".into(), json!(budget.iter().copied().fold(f64::INFINITY, f64::min)));
    m.insert("budget_end_mib".into(), json!(last));
    m.insert("resident_max_mib".into(), json!(resident.iter().copied().fold(0.0, f64::max)));
    Some(m)
}

/// The worst second of each PSI stall in a run's timeline (its cumulative totals sampled every
/// 250 ms): `<group>_psi_<some|full>_peak_ms`, the most stall any 1 s window held, for the
/// apps' group (`psi`), the pressure processes' (`pressure_psi`) and the whole guest
/// (`system_psi`). Totals say how much; peaks say whether anything stalled long at once.
#[allow(clippy::cast_precision_loss)]
fn stall_peaks(rows: &[Value]) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    for (col, name) in [("apps_psi", "psi"), ("pressure_psi", "pressure_psi"), ("psi", "system_psi")] {
        for (i, kind) in ["some", "full"].into_iter().enumerate() {
            let pts: Vec<(f64, f64)> = rows.iter().filter_map(|v| Some((v["t_s"].as_f64()?, v[col][i].as_f64()?))).collect();
            if pts.len() < 2 {
                continue;
            }
            let mut peak: f64 = 0.0;
            let mut k = 0;
            for &(t, total) in &pts {
                while pts[k].0 < t - 1.0 {
                    k += 1;
                }
                peak = peak.max(total - pts[k].1);
            }
            m.insert(format!("{name}_{kind}_peak_ms"), json!(peak / 1e3));
        }
    }
    m
}

/// The weights scenario (tools/lab/guest/weights.sh): for each way of holding the weights, the
/// bytes read from the disk per decoded token — the difference between its long and its short
/// run over the tokens between them (`llms bench --reps 1` decodes each count twice: a warm-up
/// and the timed run), so loading and prefill cancel — its decode rate, and paged against the
/// page cache under the same memory.max. None without the file.
fn weights_summary(path: &Path) -> Result<Option<Value>> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(None) };
    let lines: Vec<Value> = text.lines().filter(|l| !l.trim().is_empty()).map(serde_json::from_str).collect::<Result<_, _>>()?;
    let mut out = serde_json::Map::new();
    for name in ["paged", "mmap", "mmap-unlimited"] {
        let mut rs: Vec<&Value> = lines.iter().filter(|l| l["run"] == name).collect();
        rs.sort_by_key(|l| l["tokens"].as_u64());
        let (Some(short), Some(long)) = (rs.first(), rs.last()) else { continue };
        let (a, b) = (short["tokens"].as_u64().unwrap_or(0), long["tokens"].as_u64().unwrap_or(0));
        if b <= a {
            bail!("{}: {name} needs two runs of different lengths", path.display());
        }
        let bytes = long["read_bytes"].as_f64().unwrap_or(0.0) - short["read_bytes"].as_f64().unwrap_or(0.0);
        #[allow(clippy::cast_precision_loss)]
        let per_token = bytes / (2 * (b - a)) as f64;
        out.insert(
            name.into(),
            json!({"read_mib_per_token": per_token / f64::from(1 << 20), "tg_tok_s": long["tg_tok_s"], "memory_max": long["memory_max"],
                   "anon_peak_mib": long["anon_peak"].as_f64().unwrap_or(0.0) / f64::from(1 << 20), "tokens": [a, b]}),
        );
    }
    let per = |k: &str| out.get(k).and_then(|v| v["read_mib_per_token"].as_f64());
    if let (Some(p), Some(m)) = (per("paged"), per("mmap")) {
        out.insert("paged_vs_mmap_read".into(), json!(p / m));
    }
    Ok(Some(Value::Object(out)))
}

/// The runs over time (budget, the apps' PSI full stall, MemAvailable; one line per run) and
/// their switch latencies as CDFs: `lab-timeline.{svg,png}`, `lab-switch-cdf.{svg,png}` in `to`.
fn plots(dir: &Path, to: &Path) -> Result<()> {
    use crate::figure::{Figure, Panel, Series};
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)?.flatten().map(|e| e.path()).filter(|p| p.join("result.json").exists()).collect();
    dirs.sort();
    let mut panels = vec![
        Panel { title: "llmsd's KV budget".into(), y_desc: "MiB".into(), series: vec![] },
        Panel { title: "apps' PSI full stall".into(), y_desc: "ms, cumulative".into(), series: vec![] },
        Panel { title: "MemAvailable".into(), y_desc: "MiB".into(), series: vec![] },
        Panel { title: "pressure processes' PSI some stall".into(), y_desc: "ms, cumulative".into(), series: vec![] },
    ];
    let mut cdf = Panel { title: "switch latency".into(), y_desc: "share of calls".into(), series: vec![] };
    #[allow(clippy::cast_precision_loss)]
    for d in &dirs {
        let r: Value = serde_json::from_str(&std::fs::read_to_string(d.join("result.json"))?)?;
        let label = format!("{} ({})", r["system"].as_str().unwrap_or("?"), r["scenario"].as_str().unwrap_or("?"));
        let rows: Vec<Value> = std::fs::read_to_string(d.join("timeline.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let (mut b, mut st, mut av, mut hs) = (vec![], vec![], vec![], vec![]);
        let (mut next, mut psi0, mut hog0) = (0.0, None, None);
        for v in &rows {
            let t = v["t_s"].as_f64().unwrap_or(0.0);
            if t < next {
                continue;
            }
            next = t + 1.0;
            if let Some(x) = v["budget"].as_f64() {
                b.push((t, x / MIB as f64));
            }
            if let Some(full) = v["apps_psi"][1].as_f64() {
                let base = *psi0.get_or_insert(full);
                st.push((t, (full - base) / 1e3));
            }
            av.push((t, v["mem_available"].as_f64().unwrap_or(0.0) / MIB as f64));
            if let Some(some) = v["pressure_psi"][0].as_f64() {
                let base = *hog0.get_or_insert(some);
                hs.push((t, (some - base) / 1e3));
            }
        }
        // Every run in every panel, even with no points (the status quo has no budget): a
        // run keeps its colour across the panels.
        for (p, pts) in panels.iter_mut().zip([b, st, av, hs]) {
            p.series.push(Series { label: label.clone(), points: pts });
        }
        let mut sw: Vec<f64> =
            r["calls_detail"].as_array().into_iter().flatten().filter_map(|c| c["switch_ms"].as_f64()).map(|x| x.max(0.01)).collect();
        sw.sort_by(f64::total_cmp);
        let n = sw.len().max(1) as f64;
        cdf.series.push(Series { label, points: sw.iter().enumerate().map(|(i, &x)| (x, (i + 1) as f64 / n)).collect() });
    }
    let caption = "The device lab's runs (docs/lab.md)".to_string();
    Figure { caption: caption.clone(), x_desc: "seconds".into(), log_x: false, log_y: false, decimals: 1, panels }
        .plot(to, "lab-timeline")?;
    Figure { caption, x_desc: "switch latency, ms".into(), log_x: true, log_y: false, decimals: 2, panels: vec![cdf] }
        .plot(to, "lab-switch-cdf")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse_and_bad_ones_are_refused() {
        assert_eq!(parse_plan("0:0,10:200,30:0").unwrap(), vec![(0.0, 0), (10.0, 200), (30.0, 0)]);
        let half = parse_plan("0:50%").unwrap()[0].1;
        assert_eq!(half, usize::try_from(mem_total().unwrap() / 2 / MIB as u64).unwrap());
        for bad in ["", "10", "x:1", "1:x", "5:1,2:1", "-1:3", "0:99999999999", "0:101%", "0:x%"] {
            assert!(parse_plan(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_runs_budget_is_summarized_from_its_timeline() {
        let row = |t: f64, budget: Option<u64>, resident: u64| json!({"t_s": t, "budget": budget, "resident": resident});
        let rows = [row(0.0, Some(96 << 20), 10 << 20), row(1.0, Some(32 << 20), 40 << 20), row(2.0, Some(80 << 20), 20 << 20)];
        let b = budget_over_run(&rows).unwrap();
        assert_eq!((b["budget_start_mib"].clone(), b["budget_min_mib"].clone()), (json!(96.0), json!(32.0)));
        assert_eq!((b["budget_end_mib"].clone(), b["resident_max_mib"].clone()), (json!(80.0), json!(40.0)));
        // The status quo's timeline has no budget: nothing to say.
        assert!(budget_over_run(&[row(0.0, None, 0)]).is_none());
    }

    #[test]
    fn a_runs_worst_second_of_stall_is_found() {
        // Totals in microseconds, as PSI counts them: 300 ms of `full` stall between 1.0 and
        // 1.75 s, 100 ms more by 3 s; `some` twice that. A group without PSI says nothing.
        let row = |t: f64, full: u64| json!({"t_s": t, "psi": [2 * full, full], "apps_psi": [2 * full, full], "pressure_psi": null});
        let rows = [row(0.0, 0), row(0.5, 0), row(1.0, 0), row(1.25, 100_000), row(1.75, 300_000), row(2.5, 300_000), row(3.0, 400_000)];
        let p = stall_peaks(&rows);
        assert_eq!(p["psi_full_peak_ms"], json!(300.0));
        assert_eq!(p["system_psi_some_peak_ms"], json!(600.0));
        assert!(!p.contains_key("pressure_psi_full_peak_ms"));
    }

    #[test]
    fn the_weights_scenario_is_summarized_per_token() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("weights.jsonl");
        let line = |run: &str, tokens: u64, read: u64| {
            format!(r#"{{"run":"{run}","tokens":{tokens},"memory_max":"max","read_bytes":{read},"anon_peak":1048576,"tg_tok_s":1.5}}"#)
        };
        // 2 x 16 more tokens read 32 MiB more paged, 64 MiB more mapped: 1 and 2 MiB a token.
        let text =
            [line("paged", 8, 100 << 20), line("paged", 24, 132 << 20), line("mmap", 8, 50 << 20), line("mmap", 24, 114 << 20)].join("\n");
        std::fs::write(&p, text).unwrap();
        let w = weights_summary(&p).unwrap().unwrap();
        assert_eq!(w["paged"]["read_mib_per_token"], 1.0);
        assert_eq!(w["mmap"]["read_mib_per_token"], 2.0);
        assert_eq!(w["paged_vs_mmap_read"], 0.5);
        assert_eq!(w["paged"]["tokens"], json!([8, 24]), "which runs the figure comes from");
        assert!(w.get("mmap-unlimited").is_none());
        // Two runs of one length cannot be told apart; a damaged line is an error; no file, no summary.
        std::fs::write(&p, [line("paged", 8, 1), line("paged", 8, 2)].join("\n")).unwrap();
        assert!(weights_summary(&p).is_err());
        std::fs::write(&p, "{not json").unwrap();
        assert!(weights_summary(&p).is_err());
        assert!(weights_summary(&dir.path().join("none")).unwrap().is_none());
    }
}

//! What the end-to-end suites share: llmsd started from a configuration, stopped, killed.
#![allow(dead_code)]

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use llms_tests::{model_path, require_kernel};
use llmsd::client::Client;

/// The llmsd the suites run: this build's, or `LLMS_TEST_LLMSD` (an older build, to see a
/// test fail on the code before its fix).
pub fn llmsd_bin() -> PathBuf {
    std::env::var_os("LLMS_TEST_LLMSD").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_llmsd")), PathBuf::from)
}

/// The `llms` CLI (the tools crate's binary, which the suites use as a client: `ctx`, `doctor`,
/// `synth`): `LLMS_TEST_LLMS`, else the one cargo built beside this package's llmsd.
pub fn llms_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("LLMS_TEST_LLMS") {
        return p.into();
    }
    let p = Path::new(env!("CARGO_BIN_EXE_llmsd")).with_file_name("llms");
    assert!(p.exists(), "{} is missing: these suites run the llms CLI; `cargo test --workspace` (make test) builds it", p.display());
    p
}

pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl Daemon {
    /// Starts llmsd with `settings` (TOML lines) over the state directory `state`.
    pub fn start(dir: &Path, name: &str, state: &Path, settings: &str) -> Self {
        Self::start_on(dir, name, state, settings, None)
    }

    /// [`Daemon::start`], with `disk` (a file system image) loop-mounted at `state`'s parent in
    /// a mount namespace of llmsd's own (nothing outside it sees the mount).
    pub fn start_on(dir: &Path, name: &str, state: &Path, settings: &str, disk: Option<&Path>) -> Self {
        let mounts: Vec<(&Path, &Path)> = disk.iter().map(|img| (*img, state.parent().unwrap())).collect();
        Self::start_full(dir, name, state, settings, &mounts, &[])
    }

    /// [`Daemon::start`] with file system images loop-mounted in llmsd's own mount namespace,
    /// each `(image, mount point)` in order (a later one may lie inside an earlier one: the
    /// swap store on a file system of its own, say).
    pub fn start_mounted(dir: &Path, name: &str, state: &Path, settings: &str, mounts: &[(&Path, &Path)]) -> Self {
        Self::start_full(dir, name, state, settings, mounts, &[])
    }

    /// [`Daemon::start`] with environment variables for llmsd (fault injection).
    pub fn start_env(dir: &Path, name: &str, state: &Path, settings: &str, env: &[(&str, String)]) -> Self {
        Self::start_full(dir, name, state, settings, &[], env)
    }

    fn start_full(dir: &Path, name: &str, state: &Path, settings: &str, mounts: &[(&Path, &Path)], env: &[(&str, String)]) -> Self {
        let socket = dir.join(format!("{name}.sock"));
        let cfg = dir.join(format!("{name}.toml"));
        // A `model` line in `settings` replaces the default (TOML refuses a key twice).
        let model = if settings.contains("model =") { String::new() } else { format!("model = {:?}\n", model_path()) };
        let toml = format!(
            "{model}socket = {:?}\nstate_dir = {:?}\nload_profile = false\nthreads = 2\n{}{settings}\n",
            socket,
            state,
            if settings.contains("pressure") { "" } else { "pressure = false\n" }
        );
        std::fs::write(&cfg, toml).unwrap();
        let log = dir.join(format!("{name}.log"));
        let mut cmd = if mounts.is_empty() {
            Command::new(llmsd_bin())
        } else {
            // unshare(1) and sh exec in place: the child's pid is llmsd's. Paths are passed
            // as arguments ($1, $2, ...), never spliced into the script.
            let mut script = String::new();
            for k in 0..mounts.len() {
                let (img, at) = (2 * k + 1, 2 * k + 2);
                script.push_str(&format!("mkdir -p \"${{{at}}}\" && mount -o loop \"${{{img}}}\" \"${{{at}}}\" && "));
            }
            let bin = 2 * mounts.len() + 1;
            script.push_str(&format!("exec \"${{{bin}}}\" \"${{{}}}\" \"${{{}}}\"", bin + 1, bin + 2));
            let mut c = Command::new("unshare");
            c.args(["-m", "sh", "-c", &script, "sh"]);
            for (img, at) in mounts {
                c.arg(img).arg(at);
            }
            c.arg(llmsd_bin());
            c
        };
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        // A restart under the same name appends: a test that kills and restarts llmsd keeps
        // what every run before said (a crash in an earlier run is not lost with its log).
        let stderr = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let child = cmd.arg("--config").arg(&cfg).stderr(stderr).stdout(Stdio::null()).spawn().expect("llmsd starts");
        let mut d = Self { child, socket, log };
        llms_tests::wait_until(
            &format!("llmsd to listen on {} (log: {})", d.socket.display(), d.log.display()),
            Duration::from_secs(120),
            || {
                if let Some(st) = d.child.try_wait().unwrap() {
                    panic!("llmsd exited ({st}): {}", std::fs::read_to_string(&d.log).unwrap_or_default());
                }
                UnixStream::connect(&d.socket).is_ok().then_some(())
            },
        );
        d
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn client(&self, app: &str) -> Client {
        Client::connect(&self.socket, app).expect("connect")
    }

    /// SIGTERM and wait: the clean shutdown.
    pub fn stop(mut self) {
        // SAFETY: plain kill(2) on our child.
        unsafe { libc::kill(i32::try_from(self.child.id()).unwrap(), libc::SIGTERM) };
        let st = self.child.wait().unwrap();
        assert!(st.success(), "llmsd stopped with {st}: {}", self.log_text());
        assert!(!self.socket.exists(), "the socket is removed at shutdown");
    }

    /// Panics when llmsd has exited on its own (a test about to kill it checks it did not die
    /// first: a crash the kill would hide).
    pub fn assert_running(&mut self) {
        if let Some(st) = self.child.try_wait().unwrap() {
            panic!("llmsd exited on its own ({st}): {}", self.log_text());
        }
    }

    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether this test runs as root (it switches to another uid); says why not, and fails under
/// `LLMS_REQUIRE_KERNEL`.
pub fn root_or_skip() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    let msg = "switching to another uid needs root";
    assert!(!llms_tests::kernel_required(), "{msg}");
    eprintln!("skipping: {msg}");
    false
}

pub fn kernel_ok() -> bool {
    require_kernel("userfaultfd", uffd_handler::Pager::new()).is_some()
}

/// Runs llmsd with `settings` and expects it to refuse to start; returns what it said.
pub fn refused_start(dir: &Path, name: &str, settings: &str) -> String {
    let cfg = dir.join(format!("{name}.toml"));
    // A `model` line in `settings` replaces the default (TOML refuses a key twice).
    let model = if settings.contains("model =") { String::new() } else { format!("model = {:?}\n", model_path()) };
    std::fs::write(&cfg, format!("{model}load_profile = false\npressure = false\nthreads = 2\n{settings}\n")).unwrap();
    let out = Command::new(llmsd_bin()).arg("--config").arg(&cfg).stdout(Stdio::null()).output().expect("llmsd runs");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{name}: llmsd started with {settings:?}: {err}");
    err
}

/// A small ext4 image of `bytes` with `inodes` inodes (few, so they run out fast: see
/// [`fill_disk`]) and the directory to mount it on ([`Daemon::start_on`]): a temporary
/// directory, the image, the mount point. `None` where the test cannot run (loop mounts need
/// root; with LLMS_REQUIRE_KERNEL=1 that is a failure).
pub fn small_disk(bytes: u64, inodes: u32) -> Option<(tempfile::TempDir, PathBuf, PathBuf)> {
    if !kernel_ok() {
        return None;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        assert!(!llms_tests::kernel_required(), "a full disk is made by loop-mounting a small file system, which needs root");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(bytes).unwrap();
    let mkfs = Command::new("mkfs.ext4").args(["-q", "-F", "-N", &inodes.to_string()]).arg(&img).output().expect("mkfs.ext4 runs");
    assert!(mkfs.status.success(), "{}", String::from_utf8_lossy(&mkfs.stderr));
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    Some((dir, img, mnt))
}

/// Fills the file system llmsd's state is on (through its mount namespace) until ENOSPC: its
/// blocks, then its inodes (a small file can still be written into a full ext4 — the context
/// files are small — but not created without an inode). Returns the filler directory.
pub fn fill_disk(d: &Daemon, mnt: &Path) -> PathBuf {
    let filler = PathBuf::from(format!("/proc/{}/root{}", d.child.id(), mnt.join("filler").display()));
    std::fs::create_dir_all(&filler).expect("the filler directory");
    let mut f = std::fs::File::create(filler.join("blocks")).expect("the filler file");
    let block = vec![0u8; 64 << 10];
    loop {
        match f.write(&block) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
                break;
            }
        }
    }
    let _ = f.sync_all();
    for i in 0.. {
        if let Err(e) = std::fs::File::create(filler.join(i.to_string())) {
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
            break;
        }
        assert!(i < 100_000, "the file system's inodes do not run out");
    }
    filler
}

/// Waits until `c`'s uid holds `c`'s connection alone. A closed connection keeps its slot until
/// its thread sees the close (the start-up probe's, an HTTP request's, a panicked one's): a
/// test that counts connections or fills the uid's limit waits for them first.
pub fn wait_only_this_connection(c: &mut Client, what: &str) {
    llms_tests::wait_until(&format!("{what}: the closed connections' slots to be given back"), Duration::from_secs(30), || {
        (c.stats().unwrap().connections == 1).then_some(())
    });
}

//! llmsd's configuration: a TOML file (docs/llmsd.md) with command-line overrides.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use engine::kv::KvFormat;
use mm::Policy;

use crate::size::parse_bytes;
use serde::{Deserialize, Serialize};

/// Every setting of the service. Missing keys take the defaults below.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// GGUF model file, or a fetched model's name (`smollm2`, `gemma3`: [`crate::MODELS`]).
    pub model: PathBuf,
    /// Unix socket to listen on.
    pub socket: PathBuf,
    /// Permission bits of the socket (octal string): who may connect.
    pub socket_mode: String,
    /// Where the swap store, contexts and profiles live (on flash, not tmpfs).
    pub state_dir: PathBuf,
    /// Memory for KV chunks — and for the weights when they are paged: bytes, or with a suffix
    /// (`256MiB`, `1GiB`, `512k`).
    #[serde(deserialize_with = "size_or_string")]
    pub budget: String,
    /// Page the model's weights from flash under this share of `budget` (bytes, or a
    /// percentage of the weight bytes such as `50%`); the KV chunks get the rest. Unset: the
    /// weights are resident, outside the budget.
    pub weights_budget: Option<String>,
    /// The weight image (default: next to the model, `<model>.llms-weights`, or
    /// `<model>.llms-weights-cm<N>` under a plan).
    pub weights_image: Option<PathBuf>,
    /// Page the weights as ActiveFlow's planner chooses for `weights_budget` (docs/weights.md):
    /// a channel-major image read by channel, the layers per group, a frequency cache and
    /// the preload room; re-planned when pressure moves the budget. False: the packed image
    /// streams layer by layer.
    pub weights_plan: bool,
    /// Highest Top-K activation sparsity the plan may choose. Sparsity saves reads and time
    /// but changes the output (docs/weights.md gives its perplexity cost); 0 keeps the output
    /// exactly that of resident weights.
    pub weights_max_sparsity: f32,
    /// Text the sparsity levels are calibrated on (default: the Apache-2.0 license text).
    pub weights_calib_text: Option<PathBuf>,
    /// Follow memory pressure: the pressure monitor's budget target lowers the budget.
    pub pressure: bool,
    /// Monitor this cgroup (v2 or v1 directory) instead of the service's own.
    pub cgroup: Option<PathBuf>,
    /// Memory policy: llms, vllm-sq, vllm-s, swap, lmk.
    pub policy: String,
    /// Tokens per KV chunk.
    pub chunk_tokens: usize,
    /// Compression levels for the llms policy, first is the base (int8 or f16).
    pub levels: Vec<String>,
    /// Global compression ratio (KV bytes relative to the base level), 0 < ratio <= 1.
    pub ratio: f64,
    /// Parts of the llms policy to switch off, for ablation studies: `lctru` (reclaim by plain
    /// LRU), `compression` (every chunk at the base level), `pipeline` (read every chunk, never
    /// recompute), `aot` (write chunks when reclaimed, not when a call returns).
    pub ablate: Vec<String>,
    /// Contexts one app may hold.
    pub max_contexts_per_app: usize,
    /// Contexts the service holds in all.
    pub max_contexts: usize,
    /// Tokens one context holds; longer contexts slide (the oldest turns are dropped, the
    /// start of the context is kept).
    pub max_context_tokens: usize,
    /// Tokens kept at the start of a context when it slides.
    pub keep_tokens: usize,
    /// Measure the load profile at first start (about a minute, then saved) so the planner
    /// splits loads between reading and recomputing; false reads every chunk with a record.
    pub load_profile: bool,
    /// Compute threads (0: one per core).
    pub threads: usize,
    /// Seconds a connection may stay silent between requests.
    pub idle_timeout_s: u64,
    /// Seconds to finish sending a frame once started, and to take one from us.
    pub io_timeout_s: u64,
    /// Open connections at most.
    pub max_connections: usize,
    /// Calls waiting for the model at most.
    pub max_queue: usize,
    /// Calls that share the model's forward passes at most (1: one call at a time). Each
    /// decode step reads the weights once for all of them (docs/llmsd.md, "Batching").
    pub max_batch: usize,
    /// Tokens of a prompt prefilled per forward pass while other calls decode: its prefill is
    /// split so theirs are not stalled (a whole prompt runs at once when nothing decodes).
    pub prefill_piece: usize,
    /// A pass that carries a prompt piece beside decoding calls takes at most this many times
    /// a lone call's decode pass, or half again the decoding calls' own pass if that is longer
    /// (predicted from the worker's own pass times): the piece is cut to fit, down to one
    /// token, so a prompt never holds the others' next tokens longer than that.
    /// `prefill_piece` stays the most a piece holds.
    pub prefill_hold: f64,
    /// While calls decode, a joining prompt is prefilled on its own share of the threads (half
    /// of them, one of two) beside the decoding calls' pass on the rest, its piece sized to
    /// take as long as their pass, instead of in pieces inside their pass: their gap between
    /// tokens is then their pass on fewer threads, not their pass plus the prompt's arithmetic
    /// (docs/llmsd.md, "Batching"). Needs 2 threads or more; off: pieces as `prefill_hold` says.
    pub prefill_lane: bool,
    /// Contexts of one app that start with the same tokens hold one copy of those chunks, in
    /// memory and in the swap store; a new context whose first prompt starts with a prefix
    /// the app holds takes those chunks instead of computing them (docs/llmsd.md, "Shared
    /// prefixes"). Never across (uid, app). Off: every context keeps its own copy.
    pub prefix_sharing: bool,
    /// Files of system-wide instructions every app may share (the one exception to sharing
    /// inside an app): a context whose prompt opens with one of them, as its system prompt,
    /// shares those chunks with every other app's. At most 64 KiB each.
    pub public_prefixes: Vec<PathBuf>,
    /// When swap-store records reach the disk itself: `off`, `batch` or `group[:ms]`
    /// (mm::Durability; docs/llmsd.md). Acknowledged turns survive a power loss in every mode
    /// (the context file is synced per call); this sets how much KV is recomputed after one.
    pub durability: String,
    /// What one uid may hold (app names are self-declared, the uid is the kernel's): open
    /// connections, contexts over all its apps, calls waiting, bytes of text not yet run
    /// (system prompts), and bytes of its contexts' records on flash.
    pub max_connections_per_uid: usize,
    pub max_contexts_per_uid: usize,
    pub max_queued_per_uid: usize,
    #[serde(deserialize_with = "size_or_string")]
    pub max_text_per_uid: String,
    #[serde(deserialize_with = "size_or_string")]
    pub max_disk_per_uid: String,
    /// The OpenAI-compatible HTTP front's Unix socket (docs/http.md); unset: beside `socket`
    /// (`llmsd.sock` -> `llmsd.http.sock`); empty: no HTTP socket. Peers are identified by
    /// SO_PEERCRED as on the native socket; its permission bits are `socket_mode`.
    pub http_socket: Option<PathBuf>,
    /// The HTTP front on a loopback TCP address too (`127.0.0.1:8080`), for clients that cannot
    /// reach a Unix socket; needs `http_tokens`. Unset: no TCP.
    pub http: Option<String>,
    /// Bearer tokens for TCP clients: a file of `<app> <token>` lines (mode 0600, owned by the
    /// service's user), each token naming the app it acts as.
    pub http_tokens: Option<PathBuf>,
    /// App names a uid may act as, beyond the one of its contexts: `"1000" = ["mail", "notes"]`
    /// (`"*"`: any). Root and the service's own user may use any name.
    pub app_names: std::collections::BTreeMap<String, Vec<String>>,
    /// Contexts the HTTP front keeps per app for stateless clients; at the limit the least
    /// recently used one it made is retired.
    pub http_contexts_per_app: usize,
    /// A context the HTTP front made and no call used for this long is retired (seconds).
    pub http_context_ttl_s: u64,
}

/// The KV levels contexts are kept at, the base first: the split levels with k4v3 (docs/kv.md).
/// Every command that mixes levels defaults to these (`llms perplexity --kv mix:R`, the
/// experiments, the benches), so a figure measured without flags measures the service.
pub const DEFAULT_LEVELS: [&str; 4] = ["int8", "k4v4", "k4v3", "k3v3"];
/// The global ratio over [`DEFAULT_LEVELS`]: the paper's 0.5, within 1% of int8's perplexity
/// on both accuracy texts over every window (Fig. 12, docs/kv.md "Accuracy of the levels"; the
/// quality search, on each text's first 8 windows, stops at 0.49). It was 0.6 while the levels
/// needed it, 0.75 over int8, q4, q2.
pub const DEFAULT_RATIO: f64 = 0.5;
/// Tokens per KV chunk.
pub const DEFAULT_CHUNK_TOKENS: usize = 16;

impl Default for Config {
    fn default() -> Self {
        Self {
            model: PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            socket: crate::client::default_socket(),
            socket_mode: "0660".into(),
            state_dir: crate::profile::state_dir(),
            budget: "256MiB".into(),
            weights_budget: None,
            weights_image: None,
            weights_plan: false,
            weights_max_sparsity: 0.0,
            weights_calib_text: None,
            pressure: true,
            cgroup: None,
            policy: "llms".into(),
            chunk_tokens: DEFAULT_CHUNK_TOKENS,
            levels: DEFAULT_LEVELS.iter().map(|&l| l.into()).collect(),
            ratio: DEFAULT_RATIO,
            ablate: Vec::new(),
            max_contexts_per_app: 16,
            max_contexts: 256,
            max_context_tokens: 2048,
            keep_tokens: 64,
            load_profile: true,
            threads: 0,
            idle_timeout_s: 3600,
            io_timeout_s: 10,
            max_connections: 64,
            max_queue: 256,
            max_batch: 8,
            prefill_piece: 16,
            prefill_hold: 4.0,
            prefill_lane: true,
            prefix_sharing: true,
            public_prefixes: Vec::new(),
            durability: "batch".into(),
            max_connections_per_uid: 16,
            max_contexts_per_uid: 64,
            max_queued_per_uid: 16,
            max_text_per_uid: "1MiB".into(),
            max_disk_per_uid: "1GiB".into(),
            http_socket: None,
            http: None,
            http_tokens: None,
            app_names: std::collections::BTreeMap::new(),
            http_contexts_per_app: 8,
            http_context_ttl_s: 7 * 86_400,
        }
    }
}

/// Most levels a mix may choose from. The level solver is exact, and its work grows as
/// chunks^(levels - 2): five levels over a 4k-token context (256 chunks) take ~30 ms a
/// choice, and each level more multiplies that by up to the chunk count.
pub const MAX_LEVELS: usize = 5;

/// A mix's levels are distinct and at most [`MAX_LEVELS`].
pub fn check_level_count(levels: &[KvFormat]) -> Result<()> {
    if levels.len() > MAX_LEVELS {
        bail!("{} levels given; at most {MAX_LEVELS} (the base and four lower ones)", levels.len());
    }
    for (i, f) in levels.iter().enumerate() {
        if let Some(j) = levels[..i].iter().position(|x| x == f) {
            bail!("{} is given twice (at positions {} and {})", f.name(), j + 1, i + 1);
        }
    }
    Ok(())
}

impl Config {
    /// Reads a TOML file (unknown keys are errors: a typo must not pass silently).
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("{}: not a valid llmsd configuration", path.display()))
    }

    /// The HTTP front's Unix socket, if it has one.
    pub fn http_socket_path(&self) -> Option<PathBuf> {
        match &self.http_socket {
            Some(p) if p.as_os_str().is_empty() => None,
            Some(p) => Some(p.clone()),
            None => {
                let stem = self.socket.file_stem().map_or_else(|| "llmsd".into(), |s| s.to_string_lossy().into_owned());
                Some(self.socket.with_file_name(format!("{stem}.http.sock")))
            }
        }
    }

    /// The engine's threads: `threads`, 0 meaning every core.
    pub fn pool_threads(&self) -> usize {
        if self.threads == 0 {
            std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
        } else {
            self.threads
        }
    }

    pub fn budget_bytes(&self) -> Result<usize> {
        parse_bytes(&self.budget).with_context(|| format!("budget {:?}", self.budget))
    }

    /// Bytes of text (system prompts waiting for a first call) one uid may hold.
    pub fn max_text_bytes_per_uid(&self) -> Result<usize> {
        parse_bytes(&self.max_text_per_uid).with_context(|| format!("max_text_per_uid {:?}", self.max_text_per_uid))
    }

    /// Bytes of swap-store records one uid's contexts may hold.
    pub fn max_disk_bytes_per_uid(&self) -> Result<usize> {
        parse_bytes(&self.max_disk_per_uid).with_context(|| format!("max_disk_per_uid {:?}", self.max_disk_per_uid))
    }

    /// [`Config::durability`], parsed.
    pub fn durability(&self) -> Result<mm::Durability> {
        self.durability.parse().map_err(|e| anyhow::anyhow!("durability {e}"))
    }

    /// The weight budget, when weights are paged.
    pub fn weights_budget(&self) -> Result<Option<crate::weights::Budget>> {
        self.weights_budget.as_deref().map(|s| s.parse().with_context(|| format!("weights_budget {s:?}"))).transpose()
    }

    pub fn policy(&self) -> Result<Policy> {
        Policy::parse(&self.policy).with_context(|| format!("policy {:?}: expected llms, vllm-sq, vllm-s, swap or lmk", self.policy))
    }

    pub fn level_formats(&self) -> Result<Vec<KvFormat>> {
        let v: Vec<KvFormat> = self
            .levels
            .iter()
            .map(|l| {
                KvFormat::ALL.into_iter().find(|f| f.name() == l).with_context(|| {
                    let names: Vec<&str> = KvFormat::ALL.iter().map(|f| f.name()).collect();
                    format!("level {l:?}: expected one of {}", names.join(", "))
                })
            })
            .collect::<Result<_>>()?;
        match v.first() {
            None => bail!("levels: at least the base level is needed"),
            Some(b) if !b.is_base() => bail!("levels: the first level is the base and must be f16 or int8"),
            _ => {}
        }
        if v[1..].iter().any(|f| f.is_base()) {
            bail!("levels: only the first level may be f16 or int8");
        }
        check_level_count(&v).context("levels")?;
        Ok(v)
    }

    /// Whether contexts accumulate the attention each token receives: only the llms policy
    /// with more than one level picks levels by it, and not with compression ablated.
    pub fn observes_attention(&self) -> bool {
        self.policy().is_ok_and(|p| p == Policy::Llms)
            && self.level_formats().is_ok_and(|l| l.len() > 1)
            && !self.ablations().is_ok_and(|a| a.compression)
    }

    /// The ablations asked for, checked.
    pub fn ablations(&self) -> Result<Ablations> {
        let mut a = Ablations::default();
        for x in &self.ablate {
            match x.as_str() {
                "lctru" => a.lctru = true,
                "compression" => a.compression = true,
                "pipeline" => a.pipeline = true,
                "aot" => a.aot = true,
                _ => bail!("ablate {x:?}: expected lctru, compression, pipeline or aot"),
            }
        }
        if a != Ablations::default() && self.policy()? != Policy::Llms {
            bail!("ablate switches off parts of the llms policy; policy is {:?}", self.policy);
        }
        Ok(a)
    }

    /// mm's configuration: the policy, levels and ratio less what is ablated.
    pub fn mm_config(&self, max_chunks: usize) -> Result<mm::MmConfig> {
        let a = self.ablations()?;
        let mut levels = self.level_formats()?;
        let mut ratio = self.ratio;
        if a.compression {
            levels.truncate(1);
            ratio = 1.0;
        }
        let mut c = crate::profile::mm_config(self.policy()?, &levels, ratio, max_chunks);
        c.features = mm::Features { lctru: !a.lctru, aot: !a.aot };
        Ok(c)
    }

    pub fn socket_mode_bits(&self) -> Result<u32> {
        let bits = u32::from_str_radix(self.socket_mode.trim_start_matches("0o"), 8)
            .with_context(|| format!("socket_mode {:?}: expected octal such as 0660", self.socket_mode))?;
        if bits > 0o777 {
            bail!("socket_mode {:?}: only permission bits (at most 0777)", self.socket_mode);
        }
        Ok(bits)
    }

    /// Checks every setting; the service refuses to start on the first bad one.
    pub fn validate(&self) -> Result<()> {
        // Ranges the service cannot work outside of: refused at start with the reason, not
        // discovered as a stall or an out-of-memory kill later.
        self.max_text_bytes_per_uid()?;
        self.durability()?;
        self.max_disk_bytes_per_uid()?;
        let budget = self.budget_bytes()?;
        if budget == 0 {
            bail!("budget {:?} is zero: no context could hold a single chunk", self.budget);
        }
        if budget < MIN_BUDGET {
            bail!("budget {:?} is under {} MiB: too small to hold a context's chunks", self.budget, MIN_BUDGET >> 20);
        }
        if let Some(ram) = physical_memory().filter(|&ram| budget as u64 > ram) {
            bail!("budget {:?} is over this machine's memory ({} MiB)", self.budget, ram >> 20);
        }
        for (name, v, max) in [("io_timeout_s", self.io_timeout_s, 600), ("idle_timeout_s", self.idle_timeout_s, 86_400)] {
            if !(1..=max).contains(&v) {
                bail!("{name} {v} must be between 1 and {max} seconds");
            }
        }
        if let Some(c) = &self.cgroup {
            if !c.is_dir() {
                bail!("cgroup {}: no such directory (the service's cgroup, e.g. /sys/fs/cgroup/llmsd)", c.display());
            }
        }
        self.weights_budget()?;
        if self.weights_plan && self.weights_budget.is_none() {
            bail!("weights_plan plans paged weights: set weights_budget too");
        }
        if !(0.0..1.0).contains(&self.weights_max_sparsity) {
            bail!("weights_max_sparsity {} must be in [0, 1)", self.weights_max_sparsity);
        }
        if (self.weights_max_sparsity > 0.0 || self.weights_calib_text.is_some()) && !self.weights_plan {
            bail!("weights_max_sparsity and weights_calib_text go with weights_plan = true");
        }
        self.policy()?;
        self.level_formats()?;
        self.ablations()?;
        self.socket_mode_bits()?;
        for p in &self.public_prefixes {
            let len = std::fs::metadata(p).with_context(|| format!("public_prefixes: {}", p.display()))?.len();
            if len > 64 << 10 {
                bail!("public_prefixes: {} is {len} bytes, over 64 KiB", p.display());
            }
        }
        if !self.public_prefixes.is_empty() && !self.prefix_sharing {
            bail!("public_prefixes needs prefix_sharing = true");
        }
        if !(1.0..=100.0).contains(&self.prefill_hold) {
            bail!("prefill_hold {} must be in [1, 100] (times a lone call's decode pass)", self.prefill_hold);
        }
        if !(self.ratio > 0.0 && self.ratio <= 1.0) {
            bail!("ratio {} must be in (0, 1]", self.ratio);
        }
        if !(1..=256).contains(&self.chunk_tokens) {
            bail!("chunk_tokens {} must be between 1 and 256", self.chunk_tokens);
        }
        if self.max_context_tokens < 2 * self.chunk_tokens {
            bail!("max_context_tokens {} must hold at least two chunks", self.max_context_tokens);
        }
        if self.keep_tokens >= self.max_context_tokens / 2 {
            bail!("keep_tokens {} must be under half of max_context_tokens", self.keep_tokens);
        }
        for (name, v) in [
            ("max_contexts_per_app", self.max_contexts_per_app),
            ("max_contexts", self.max_contexts),
            ("max_connections", self.max_connections),
            ("max_queue", self.max_queue),
            ("max_batch", self.max_batch),
            ("prefill_piece", self.prefill_piece),
            ("max_connections_per_uid", self.max_connections_per_uid),
            ("max_contexts_per_uid", self.max_contexts_per_uid),
            ("max_queued_per_uid", self.max_queued_per_uid),
        ] {
            if v == 0 {
                bail!("{name} must be at least 1");
            }
        }
        for (uid, names) in &self.app_names {
            if uid.parse::<u32>().is_err() {
                bail!("app_names: {uid:?} is not a uid");
            }
            if let Some(bad) = names.iter().find(|n| n.as_str() != "*" && !(1..=64).contains(&n.len())) {
                bail!("app_names {uid}: {bad:?} is not an app name");
            }
        }
        if self.http_context_ttl_s == 0 {
            bail!("http_context_ttl_s must be at least 1");
        }
        if self.http_contexts_per_app == 0 {
            bail!("http_contexts_per_app must be at least 1");
        }
        if let Some(a) = &self.http {
            let addr: std::net::SocketAddr = a.parse().with_context(|| format!("http {a:?}: an address such as 127.0.0.1:8080"))?;
            if !addr.ip().is_loopback() {
                bail!("http {a:?}: the TCP front listens on loopback addresses only (127.0.0.1, ::1); reach it from elsewhere through a proxy that terminates TLS");
            }
            if self.http_tokens.is_none() {
                bail!("http {a:?} needs http_tokens: TCP peers have no uid, a bearer token names each app");
            }
        }
        if self.threads > 256 {
            bail!("threads {} must be at most 256", self.threads);
        }
        Ok(())
    }
}

/// Parts of the llms policy switched off (`ablate`): true means off.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ablations {
    pub lctru: bool,
    pub compression: bool,
    pub pipeline: bool,
    pub aot: bool,
}

/// A size written as a number of bytes or as a string with a unit.
fn size_or_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    // A visitor rather than an untagged enum: serde's untagged error ("did not match any
    // variant") does not say what a size is.
    struct SizeVisitor;
    impl serde::de::Visitor<'_> for SizeVisitor {
        type Value = String;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a size: a positive number of bytes or a string such as \"256MiB\"")
        }
        fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<String, E> {
            Ok(n.to_string())
        }
        fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<String, E> {
            u64::try_from(n)
                .map(|n| n.to_string())
                .map_err(|_| E::custom(format!("{n} is negative; a size is a positive number of bytes or a string such as \"256MiB\"")))
        }
        fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<String, E> {
            Ok(s.to_string())
        }
    }
    d.deserialize_any(SizeVisitor)
}

/// The smallest budget: a few chunks of the default model's KV at int8.
pub const MIN_BUDGET: usize = 1 << 20;

/// The machine's physical memory, if the kernel says.
/// The machine's physical memory, bytes (the most a budget may be).
pub fn physical_memory() -> Option<u64> {
    // SAFETY: sysconf has no preconditions.
    let (pages, size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    Some(u64::try_from(pages).ok()?.saturating_mul(u64::try_from(size).ok()?)).filter(|&b| b > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_bad_settings() {
        assert_eq!(parse_bytes("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_bytes("1.5g").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        for bad in ["", "x", "12 parsecs", "-1M", "1e999"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
        Config::default().validate().unwrap();
        let c: Config = toml::from_str("budget = \"64MiB\"\nlevels = [\"int8\"]\nratio = 1.0\n").unwrap();
        c.validate().unwrap();
        let c: Config = toml::from_str("levels = [\"int8\", \"k4v4\", \"k4v3\", \"k3v3\", \"k2v2\"]").unwrap();
        c.validate().unwrap();
        let c: Config = toml::from_str("weights_budget = \"50%\"\nweights_plan = true\nweights_max_sparsity = 0.5").unwrap();
        c.validate().unwrap();
        let c: Config = toml::from_str("budget = 3145728").unwrap();
        assert_eq!(c.budget_bytes().unwrap(), 3 << 20);
        assert!(toml::from_str::<Config>("bugdet = \"1M\"").is_err(), "unknown keys are errors");
        for bad in [
            "levels = [\"q4\"]",
            "levels = [\"int8\", \"k4v4\", \"k4v4\"]",
            "levels = [\"int8\", \"k4v4\", \"k4v3\", \"k3v3\", \"k2v2\", \"q4\"]",
            "ratio = 0.0",
            "prefill_hold = 0.5",
            "prefill_hold = nan",
            "policy = \"lru\"",
            "ablate = [\"lru\"]",
            "policy = \"swap\"\nablate = [\"aot\"]",
            "socket_mode = \"999\"",
            "chunk_tokens = 0",
            "weights_plan = true",
            "weights_budget = \"50%\"\nweights_max_sparsity = 0.5",
            "weights_budget = \"50%\"\nweights_plan = true\nweights_max_sparsity = 1.0",
            "weights_budget = \"50%\"\nweights_calib_text = \"x.txt\"",
        ] {
            let c: Config = toml::from_str(bad).unwrap();
            assert!(c.validate().is_err(), "{bad}");
        }
    }
}

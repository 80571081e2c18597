//! Prometheus metrics (`GET /metrics` on the HTTP front, text format, the `prometheus-client`
//! crate). Events are counted where they happen (the call path, the HTTP front); levels
//! (memory, queue, contexts, pressure) are read from the service at each scrape. Label values
//! are bounded: finish reasons, endpoints and status codes, pressure levels, and the owners
//! of contexts (at most `max_contexts`) — never context ids.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Weak};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use super::{lock, Service};
use crate::proto::CallStats;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct Finish {
    pub(super) finish: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct HttpLabels {
    pub(super) endpoint: String,
    pub(super) status: u16,
}

/// What the call path and the front count.
#[derive(Debug)]
pub(super) struct Prom {
    calls: Family<Finish, Counter>,
    failed_calls: Counter,
    switch: Histogram,
    ttft: Histogram,
    decode_rate: Gauge<f64, AtomicU64>,
    decoded: Counter,
    prefilled: Counter,
    cached: Counter,
    read_chunks: Counter,
    recomputed_chunks: Counter,
    batch: Histogram,
    pass: Histogram,
    pub(super) http: Family<HttpLabels, Counter>,
}

impl Default for Prom {
    fn default() -> Self {
        // 0.5 ms .. ~16 s: a resident switch is tens of microseconds, a cold 4k one tens of ms.
        let secs = || Histogram::new(exponential_buckets(0.000_5, 2.0, 16));
        Self {
            calls: Family::default(),
            failed_calls: Counter::default(),
            switch: secs(),
            ttft: secs(),
            decode_rate: Gauge::default(),
            decoded: Counter::default(),
            prefilled: Counter::default(),
            cached: Counter::default(),
            read_chunks: Counter::default(),
            recomputed_chunks: Counter::default(),
            batch: Histogram::new(exponential_buckets(1.0, 2.0, 8)),
            pass: secs(),
            http: Family::default(),
        }
    }
}

impl Prom {
    pub(super) fn call(&self, s: &CallStats) {
        self.calls.get_or_create(&Finish { finish: s.finish.clone() }).inc();
        self.switch.observe(s.switch_ms / 1000.0);
        self.ttft.observe(s.ttft_ms / 1000.0);
        self.decoded.inc_by(u64::from(s.output_tokens));
        self.prefilled.inc_by(u64::from(s.prompt_tokens));
        self.read_chunks.inc_by(u64::from(s.read_chunks));
        self.recomputed_chunks.inc_by(u64::from(s.recomputed_chunks));
        if s.decode_ms > 0.0 && s.output_tokens > 1 {
            self.decode_rate.set(f64::from(s.output_tokens) / (s.decode_ms / 1000.0));
        }
    }

    /// A forward pass with decoding calls: how many calls shared it and how long it took
    /// (each decoding call's time between two tokens).
    #[allow(clippy::cast_precision_loss)]
    pub(super) fn step(&self, calls: usize, pass_ms: f64) {
        self.batch.observe(calls as f64);
        self.pass.observe(pass_ms / 1000.0);
    }

    pub(super) fn failed(&self) {
        self.failed_calls.inc();
    }

    pub(super) fn cached(&self, tokens: u32) {
        self.cached.inc_by(u64::from(tokens));
    }

    /// The registry a scrape encodes: these instruments and the service's levels, the
    /// per-owner series only as far as `viewer` may see them.
    pub(super) fn registry(&self, svc: &Arc<Service>, viewer: Viewer) -> Registry {
        let mut r = Registry::with_prefix("llms");
        r.register("calls", "Calls finished, by how they ended", self.calls.clone());
        r.register("failed_calls", "Calls that failed (an error answered)", self.failed_calls.clone());
        r.register_with_unit(
            "switch_latency",
            "Call taken from the queue to its context loaded and pinned",
            Unit::Seconds,
            self.switch.clone(),
        );
        r.register_with_unit("ttft", "Call received to its first token (queue wait included)", Unit::Seconds, self.ttft.clone());
        r.register("decode_tokens_per_second", "Decode speed of the last call with more than one output token", self.decode_rate.clone());
        r.register("decoded_tokens", "Tokens generated", self.decoded.clone());
        r.register("prefilled_tokens", "Tokens prefilled", self.prefilled.clone());
        r.register(
            "cached_tokens",
            "Tokens of stateless clients' histories continued from a context instead of prefilled",
            self.cached.clone(),
        );
        r.register("read_chunks", "KV chunks read from flash when a context was switched in", self.read_chunks.clone());
        r.register("recomputed_chunks", "KV chunks recomputed when a context was switched in", self.recomputed_chunks.clone());
        r.register("batch_calls", "Calls sharing a forward pass that decodes (max_batch)", self.batch.clone());
        r.register_with_unit(
            "decode_pass",
            "One forward pass of the batch: a decoding call's time between two tokens",
            Unit::Seconds,
            self.pass.clone(),
        );
        r.register("http_requests", "HTTP requests answered, by endpoint and status", self.http.clone());
        r.register_collector(Box::new(Levels(Arc::downgrade(svc), viewer)));
        r
    }
}

/// Who is scraping: which owners' series (`contexts_per_app{uid,app}`) it may see. App names
/// are the apps' own business: another uid sees only its own, a TCP token its own app's;
/// the aggregates (no names) are for everyone who may connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Viewer {
    /// Root or the service's own user (it can read the state directory anyway).
    All,
    Uid(u32),
    App {
        uid: u32,
        app: String,
    },
}

impl Viewer {
    fn sees(&self, uid: u32, app: &str) -> bool {
        match self {
            Self::All => true,
            Self::Uid(u) => *u == uid,
            Self::App { uid: u, app: a } => *u == uid && a == app,
        }
    }
}

/// The service's levels, read at each scrape.
#[derive(Debug)]
struct Levels(Weak<Service>, Viewer);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Owner {
    uid: u32,
    app: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Level {
    level: String,
}

impl Collector for Levels {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(svc) = self.0.upgrade() else { return Ok(()) };
        let (per_owner, n_ctx) = {
            let reg = lock(&svc.registry);
            let mut m = std::collections::BTreeMap::<(u32, String), i64>::new();
            for e in reg.values().filter(|e| self.1.sees(e.saved.owner.uid, &e.saved.owner.app)) {
                *m.entry((e.saved.owner.uid, e.saved.owner.app.clone())).or_default() += 1;
            }
            (m, reg.len())
        };
        let (resident, budget, flash, evicted, aot, sync, pending, levelling, failures, dropped, releveled) = {
            let mm = lock(&svc.mm);
            (
                mm.resident_bytes() as u64,
                mm.config().budget as u64,
                mm.store().disk_bytes(),
                mm.stats.evicted_chunks,
                mm.stats.written_aot,
                mm.stats.written_sync,
                mm.pending_writes() as u64,
                mm.level_jobs() as u64,
                mm.write_failures().0,
                mm.stats.dropped_unsaved,
                mm.stats.releveled,
            )
        };
        let faults: u64 = {
            let reg = lock(&svc.registry);
            let mm = lock(&svc.mm);
            reg.values().filter_map(|e| mm.region_stats(e.saved.mm_id)).map(|s| s.faults).sum()
        };
        // Sharing among the contexts of the owners this viewer sees (an app sees its own).
        let sharing = {
            let scopes: Vec<u64> = lock(&svc.scopes).iter().filter(|(o, _)| self.1.sees(o.uid, &o.app)).map(|(_, s)| *s).collect();
            let mm = lock(&svc.mm);
            scopes.iter().map(|&s| mm.sharing_stats(Some(s))).fold(mm::SharingStats::default(), |a, b| a + b)
        };
        let queue = lock(&svc.queue).len() as i64;
        let pressure = lock(&svc.pressure).clone();
        let w = svc.weights.as_ref().map(|w| w.stats());
        let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let gauges: [(&str, &str, i64); 12] = [
            ("shared_chunks", "KV chunks held once for several contexts (shared prefixes)", i(sharing.unique_chunks)),
            ("shared_chunk_refs", "References contexts hold to shared chunks", i(sharing.logical_chunks)),
            ("sharing_saved_bytes", "Bytes of memory shared chunks would take again per extra holder", i(sharing.bytes_saved)),
            ("kv_resident_bytes", "KV chunk bytes resident in memory", i(resident)),
            ("kv_budget_bytes", "Memory budget of the KV chunks (it follows pressure)", i(budget)),
            ("configured_budget_bytes", "The configured budget (KV and paged weights)", i64::try_from(svc.budget).unwrap_or(i64::MAX)),
            ("flash_bytes", "Bytes of the swap store on flash", i(flash)),
            (
                "weights_resident_bytes",
                "Paged weight bytes resident (0: weights outside the budget)",
                i(w.as_ref().map_or(0, |w| w.resident_bytes)),
            ),
            ("aot_pending_chunks", "Chunks the ahead-of-time writer has yet to write", i(pending)),
            ("level_pending_chunks", "Chunk lowerings the leveller has yet to finish", i(levelling)),
            ("queue_depth", "Calls waiting for the model", queue),
            ("contexts", "Contexts the service holds", i64::try_from(n_ctx).unwrap_or(i64::MAX)),
        ];
        for (name, help, v) in gauges {
            let g = ConstGauge::new(v);
            g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        let counters: [(&str, &str, u64); 13] = [
            (
                "prefix_reused_tokens",
                "Prompt tokens taken from shared chunks, or copied from another context's, instead of computed (forks included)",
                sharing.reused_tokens(svc.cfg.chunk_tokens),
            ),
            ("forks", "Contexts forked from another", sharing.forks),
            ("copied_on_write_chunks", "Shared chunks copied because a context wrote into them", sharing.copied_on_write),
            (
                "promoted_chunks",
                "A context's own chunks made shared because another context wanted them (in place: no byte moves)",
                sharing.promoted,
            ),
            (
                "promoted_moved_chunks",
                "Shared chunks whose pages left the slot of the context that made them for the pool's without a copy (UFFDIO_MOVE)",
                sharing.moved,
            ),
            ("evicted_chunks", "KV chunks evicted from memory", evicted),
            ("aot_writes", "KV chunks written ahead of time (when a call returned)", aot),
            ("sync_writes", "KV chunks written on the eviction path", sync),
            ("write_failures", "Chunk write batches that failed", failures),
            ("dropped_unsaved_chunks", "KV chunks evicted unwritten because their write failed (recomputed when next loaded)", dropped),
            ("releveled_chunks", "KV chunks lowered to a smaller level", releveled),
            ("faults", "userfaultfd faults served on KV regions", faults),
            ("weights_read_bytes", "Paged weight bytes read from flash", w.as_ref().map_or(0, |w| w.bytes_read)),
        ];
        for (name, help, v) in counters {
            let c = ConstCounter::new(v);
            c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        let mut fam = enc.encode_descriptor(
            "contexts_per_app",
            "Contexts per owner (uid, app)",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for ((uid, app), n) in per_owner {
            ConstGauge::new(n).encode(fam.encode_family(&Owner { uid, app })?)?;
        }
        let mut fam = enc.encode_descriptor(
            "pressure_level",
            "The pressure monitor's level (1 for the current one)",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        // The monitor's levels (cgroup::Level), `unknown` before its first reading and
        // `unmonitored` when it stopped.
        const LEVELS: [&str; 6] = ["normal", "elevated", "reclaim", "critical", "unknown", "unmonitored"];
        for l in LEVELS {
            ConstGauge::new(i64::from(pressure == l)).encode(fam.encode_family(&Level { level: l.into() })?)?;
        }
        Ok(())
    }
}

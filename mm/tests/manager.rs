//! The manager under random workloads, with a synthetic engine whose chunk bytes are a
//! function of (token prefix, format): whatever is evicted, written, read or recomputed,
//! every chunk must come back with exactly its bytes, and resident memory must stay within
//! the budget except for the pinned working set of the running call.
#![allow(clippy::cast_possible_truncation)]

use std::ptr::NonNull;
use std::sync::atomic::AtomicPtr;
use std::sync::Arc;

use llms_tests::require_kernel;
use mm::{prefix_hashes, Codec, Format, KvContext, Manager, MmConfig, Policy, Store, StoreGeometry, Strategy as Load};
use proptest::prelude::*;

const CT: usize = 4;
const MAX_CHUNKS: usize = 12;

struct FakeCodec;

impl Codec for FakeCodec {
    fn n_layers(&self) -> usize {
        2
    }
    fn layer_bytes(&self, f: Format) -> usize {
        [6000, 3000, 1500][f as usize]
    }
    fn chunk_tokens(&self) -> usize {
        CT
    }
    fn bits(&self, f: Format) -> f64 {
        [8.0, 4.0, 2.0][f as usize]
    }
    fn name(&self, f: Format) -> &'static str {
        ["b8", "b4", "b2"][f as usize]
    }
    fn fingerprint(&self) -> u64 {
        42
    }
    fn convert(&self, from: Format, src: &[u8], to: Format, dst: &mut [u8], _tokens: usize, layers: usize) -> Result<(), mm::EngineError> {
        fake_convert(from, src, to, dst, layers)
    }
}

/// [`pattern`]'s conversion from the bytes alone: each layer of a chunk at a lower level is
/// the first bytes of that layer at the higher one, re-keyed (what a codec's `convert` must be:
/// a function of the bytes, layer by layer).
fn fake_convert(from: Format, src: &[u8], to: Format, dst: &mut [u8], layers: usize) -> Result<(), mm::EngineError> {
    let (fb, tb) = (FakeCodec.layer_bytes(from), FakeCodec.layer_bytes(to));
    if dst.len() != layers * tb || src.len() != layers * fb || tb > fb {
        return Err(mm::EngineError::new(format!("sizes {} -> {} for {layers} layers", src.len(), dst.len())));
    }
    for (d, s) in dst.chunks_exact_mut(tb).zip(src.chunks_exact(fb)) {
        for (d, s) in d.iter_mut().zip(s) {
            *d = s ^ key(from) ^ key(to);
        }
    }
    Ok(())
}

/// Tokens a local layer sees in [`WindowCodec`]'s model: its second layer is local, so a chunk
/// whose tokens all left the window keeps only its first layer.
const WINDOW: usize = 9;

/// [`FakeCodec`] for a model with a sliding window.
struct WindowCodec;

impl Codec for WindowCodec {
    fn n_layers(&self) -> usize {
        FakeCodec.n_layers()
    }
    fn layer_bytes(&self, f: Format) -> usize {
        FakeCodec.layer_bytes(f)
    }
    fn chunk_tokens(&self) -> usize {
        CT
    }
    fn bits(&self, f: Format) -> f64 {
        FakeCodec.bits(f)
    }
    fn name(&self, f: Format) -> &'static str {
        FakeCodec.name(f)
    }
    fn fingerprint(&self) -> u64 {
        43
    }
    fn kept_layers(&self) -> usize {
        1
    }
    fn convert(&self, from: Format, src: &[u8], to: Format, dst: &mut [u8], _tokens: usize, layers: usize) -> Result<(), mm::EngineError> {
        fake_convert(from, src, to, dst, layers)
    }
    fn dead_chunks(&self, tokens: usize) -> usize {
        (tokens + 1).saturating_sub(WINDOW) / CT
    }
}

/// A chunk's bytes at level `f`: each layer the first bytes of its base level's layer, keyed
/// by the level (so a lower level is a function of a higher one's bytes: [`fake_convert`]).
fn pattern(hash: u64, f: Format) -> Vec<u8> {
    let mut x = hash | 1;
    let base: Vec<u8> = (0..FakeCodec.chunk_bytes(0))
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    base.chunks_exact(FakeCodec.layer_bytes(0)).flat_map(|l| &l[..FakeCodec.layer_bytes(f)]).map(|b| b ^ key(f)).collect()
}

fn key(f: Format) -> u8 {
    [0x00, 0x5b, 0xa7][f as usize]
}

#[derive(Default)]
struct FakeKv {
    chunks: Vec<(NonNull<u8>, usize, Format)>,
    tokens: Vec<u32>,
    /// Leading chunks that are dead: only their first layer exists (a windowed model).
    dead: usize,
    /// Chunks mm had the engine convert (in `end`, without background levels).
    converted: usize,
    /// Chunks attached through an address mm may change (`attach_moving`): read there.
    moving: std::collections::HashMap<usize, Arc<AtomicPtr<u8>>>,
}

impl FakeKv {
    /// A chunk's bytes in its format: its first layer only when it is dead.
    fn len(&self, i: usize) -> usize {
        let f = self.chunks[i].2;
        if i < self.dead {
            FakeCodec.layer_bytes(f)
        } else {
            FakeCodec.chunk_bytes(f)
        }
    }
    /// Where chunk `i` is read now.
    fn ptr(&self, i: usize) -> *mut u8 {
        self.moving.get(&i).map_or(self.chunks[i].0.as_ptr(), |at| at.load(std::sync::atomic::Ordering::Acquire))
    }
    fn bytes(&self, i: usize) -> &[u8] {
        // SAFETY: attached by mm to a resident, pinned slot for the call.
        unsafe { std::slice::from_raw_parts(self.ptr(i), self.len(i)) }
    }
    fn write(&mut self, i: usize) {
        let h = prefix_hashes(&self.tokens, CT)[i];
        let f = self.chunks[i].2;
        let mut v = pattern(h, f);
        v.truncate(self.len(i));
        // SAFETY: as above; the chunk's memory holds its format.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), self.ptr(i), v.len()) };
    }
    /// The engine's truncation: positions `n..` forgotten; a partly kept chunk in a lower
    /// format goes back to the base one (converted in its memory, as `KvCache::truncate`).
    /// (A chunk's bytes here are a function of its whole prefix, so the partly kept one is
    /// written again for its new prefix.)
    fn truncate(&mut self, n: usize) {
        self.tokens.truncate(n);
        let keep = n.div_ceil(CT);
        if !n.is_multiple_of(CT) {
            self.chunks[keep - 1].2 = 0;
            self.write(keep - 1);
        }
    }
    fn check(&self) -> Result<(), String> {
        let hashes = prefix_hashes(&self.tokens, CT);
        for (i, h) in hashes.iter().enumerate() {
            if self.bytes(i) != &pattern(*h, self.chunks[i].2)[..self.len(i)] {
                return Err(format!("chunk {i} ({} tokens) lost its bytes", self.tokens.len()));
            }
        }
        Ok(())
    }
}

impl KvContext for FakeKv {
    fn base(&self) -> Format {
        0
    }
    fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    fn n_chunks(&self) -> usize {
        self.chunks.len()
    }
    fn format(&self, chunk: usize) -> Format {
        self.chunks[chunk].2
    }
    unsafe fn attach(&mut self, chunk: usize, ptr: NonNull<u8>, len: usize, format: Format) -> Result<(), mm::EngineError> {
        self.chunks[chunk] = (ptr, len, format);
        self.moving.remove(&chunk);
        Ok(())
    }
    unsafe fn attach_moving(&mut self, chunk: usize, at: Arc<AtomicPtr<u8>>, len: usize, format: Format) -> Result<(), mm::EngineError> {
        let ptr = NonNull::new(at.load(std::sync::atomic::Ordering::Acquire)).expect("an address");
        self.chunks[chunk] = (ptr, len, format);
        self.moving.insert(chunk, at);
        Ok(())
    }
    unsafe fn adopt(&mut self, _chunk: usize, _ptr: NonNull<u8>, _len: usize) -> Result<(), mm::EngineError> {
        Err(mm::EngineError::new("the fake engine never allocates chunks itself"))
    }
    unsafe fn push_chunk(&mut self, ptr: NonNull<u8>, len: usize) -> Result<(), mm::EngineError> {
        self.moving.remove(&self.chunks.len());
        self.chunks.push((ptr, len, 0));
        Ok(())
    }
    fn convert(&mut self, chunk: usize, to: Format) -> Result<(), mm::EngineError> {
        self.chunks[chunk].2 = to;
        self.write(chunk);
        self.converted += 1;
        Ok(())
    }
    fn set_dead(&mut self, n: usize) -> Result<(), mm::EngineError> {
        assert!(n >= self.dead, "a dead chunk came back to life without revive_all");
        self.dead = n;
        Ok(())
    }
    fn revive_all(&mut self) {
        self.dead = 0;
    }
    fn recompute(&mut self, chunks: &[usize], before_layer: &mut dyn FnMut(usize)) -> Result<(), mm::EngineError> {
        // As the engine: a recompute attends to the window before each chunk at every layer.
        assert_eq!(self.dead, 0, "recomputing over dead chunks");
        for l in 0..2 {
            before_layer(l);
        }
        let hashes = prefix_hashes(&self.tokens, CT);
        for &c in chunks {
            assert_eq!(self.chunks[c].2, 0, "recompute writes the base format");
            // Chunk c attends to every chunk before it, each read where mm attached it (an
            // empty slot would fault with nothing to fill it: a SIGBUS).
            if let Some(j) = (0..c).find(|&j| self.bytes(j) != &pattern(hashes[j], self.chunks[j].2)[..self.len(j)]) {
                return Err(mm::EngineError::new(format!("recomputing chunk {c}: chunk {j} before it does not hold its bytes")));
            }
            self.write(c);
        }
        Ok(())
    }
    fn densities(&self) -> Option<Vec<f64>> {
        Some((0..self.chunks.len()).map(|i| ((i * 7919) % 13) as f64 / 13.0 + 0.01).collect())
    }
}

#[derive(Debug, Clone)]
enum Op {
    Append {
        ctx: usize,
        n: usize,
    },
    Use {
        ctx: usize,
    },
    Budget(usize),
    /// With background levels: take up to `n` queued lowerings (held across the next ops),
    /// or encode and install every held one.
    Take(usize),
    Install,
    /// Sharing on: `dst` becomes a fork of `src` (its tokens, its full chunks shared).
    Fork {
        src: usize,
        dst: usize,
    },
    /// Sharing on: `dst` becomes a new context whose prompt is `src`'s first `keep` tokens
    /// and `extra` new ones (it takes the cached prefix, then computes the rest).
    Adopt {
        src: usize,
        dst: usize,
        keep: usize,
        extra: usize,
    },
    /// `ctx` forgets its tokens from `keep` on (a rollback); the next append writes there.
    Truncate {
        ctx: usize,
        keep: usize,
    },
    Delete {
        ctx: usize,
    },
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    prop_oneof![
        (0..3usize, 1..10usize).prop_map(|(ctx, n)| Op::Append { ctx, n }),
        (0..3usize).prop_map(|ctx| Op::Use { ctx }),
        (0..200_000usize).prop_map(Op::Budget),
        (1..6usize).prop_map(Op::Take),
        Just(Op::Install),
    ]
}

fn sharing_op() -> impl proptest::strategy::Strategy<Value = Op> {
    prop_oneof![
        3 => op(),
        1 => (0..3usize, 0..3usize).prop_map(|(src, dst)| Op::Fork { src, dst }),
        1 => (0..3usize, 0..3usize, 0..40usize, 0..9usize).prop_map(|(src, dst, keep, extra)| Op::Adopt { src, dst, keep, extra }),
        1 => (0..3usize, 0..40usize).prop_map(|(ctx, keep)| Op::Truncate { ctx, keep }),
        1 => (0..3usize).prop_map(|ctx| Op::Delete { ctx }),
    ]
}

/// Shared chunks the pool holds at most in the sharing runs: fewer than 3 contexts' full
/// chunks, so a full pool (no sharing for the rest) is met too.
const POOL_SLOTS: usize = 16;

fn run(policy: Policy, ops: &[Op], windowed: bool) -> Result<(), TestCaseError> {
    run_with(policy, ops, windowed, false, false)
}

/// Appends to `ctx` until it holds `want` tokens (new tokens from `tok` unless `given`).
fn append(mm: &mut Manager, ctx: usize, kv: &mut FakeKv, want: usize, tok: &mut u32, given: Option<&[u32]>) -> Result<(), TestCaseError> {
    mm.prepare(ctx as u64, kv, want).unwrap();
    mm.begin(ctx as u64, kv, Load::Planned).unwrap();
    check_in_call(mm, ctx as u64)?;
    kv.check().map_err(TestCaseError::fail)?;
    let first = kv.tokens.len() / CT;
    while kv.tokens.len() < want {
        let t = match given {
            Some(g) => g[kv.tokens.len()],
            None => {
                *tok = tok.wrapping_mul(31).wrapping_add(7);
                *tok
            }
        };
        kv.tokens.push(t);
    }
    for i in first..kv.tokens.len().div_ceil(CT) {
        kv.write(i);
    }
    mm.end(ctx as u64, kv).unwrap();
    Ok(())
}

#[allow(clippy::too_many_lines)]
fn run_with(policy: Policy, ops: &[Op], windowed: bool, background: bool, sharing: bool) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let geom = StoreGeometry { kept_layers: if windowed { 1 } else { 2 }, ..StoreGeometry::new(2, 6000) };
    let store = Arc::new(Store::open(dir.path(), 42, geom, false).unwrap());
    let cfg =
        MmConfig { policy, budget: 100_000, ratio: 0.6, levels: vec![0, 1, 2], max_chunks: MAX_CHUNKS, features: mm::Features::default() };
    let codec: Arc<dyn Codec> = if windowed { Arc::new(WindowCodec) } else { Arc::new(FakeCodec) };
    let Some(mut mm) = require_kernel("userfaultfd", Manager::new(cfg, codec, store, None)) else { return Ok(()) };
    mm.set_background_levels(background);
    if sharing {
        mm.enable_sharing(POOL_SLOTS).unwrap();
    }
    let mut held = Vec::new();
    let mut kvs: Vec<FakeKv> = (0..3).map(|_| FakeKv::default()).collect();
    for c in 0..3 {
        mm.set_scope(c, 7);
        mm.create(c).unwrap();
    }
    let mut tok = 0u32;
    for op in ops {
        let ctx = match op {
            Op::Append { ctx, n } => {
                let kv = &mut kvs[*ctx];
                let want = (kv.tokens.len() + n).min(MAX_CHUNKS * CT);
                let before = kv.dead;
                append(&mut mm, *ctx, kv, want, &mut tok, None)?;
                let dead = if windowed { WindowCodec.dead_chunks(kv.tokens.len()) } else { 0 };
                // Chunks stay dead when a rollback shortened the context.
                prop_assert_eq!(kv.dead, dead.min(kv.chunks.len()).max(before), "mm told the engine which chunks died");
                Some(*ctx)
            }
            Op::Use { ctx } => {
                let kv = &mut kvs[*ctx];
                mm.begin(*ctx as u64, kv, Load::Planned).unwrap();
                check_in_call(&mm, *ctx as u64)?;
                kv.check().map_err(TestCaseError::fail)?;
                mm.end(*ctx as u64, kv).unwrap();
                Some(*ctx)
            }
            Op::Budget(b) => {
                mm.set_budget(*b).unwrap();
                None
            }
            Op::Take(n) => {
                held.extend((0..*n).map_while(|_| mm.take_level_work()));
                // Work being encoded is still pending: a replayer waiting for an idle
                // leveller must not start the next call under it.
                prop_assert!(mm.level_jobs() >= held.len(), "{} taken lowerings, {} pending", held.len(), mm.level_jobs());
                None
            }
            Op::Install => {
                for w in held.drain(..) {
                    let lowered = w.encode(&**mm.codec());
                    mm.finish_level_work(w, lowered).unwrap();
                }
                None
            }
            Op::Fork { src, dst } if sharing && src != dst => {
                mm.delete(*dst as u64).unwrap();
                let mut kv = FakeKv { tokens: kvs[*src].tokens.clone(), ..FakeKv::default() };
                mm.fork(*src as u64, *dst as u64, &mut kv).unwrap();
                let full = kv.tokens.len() / CT;
                let shared: Vec<bool> = (0..kv.chunks.len()).map(|i| mm.chunk_info(*dst as u64, i).is_some_and(|c| c.shared)).collect();
                prop_assert!(shared.iter().skip(full).all(|s| !s), "a partial chunk is the context's own");
                prop_assert!(shared.windows(2).all(|w| w[0] || !w[1]), "shared chunks are a prefix: {shared:?}");
                kvs[*dst] = kv;
                Some(*dst)
            }
            Op::Adopt { src, dst, keep, extra } if sharing && src != dst => {
                let keep = (*keep).min(kvs[*src].tokens.len());
                let mut prompt = kvs[*src].tokens[..keep].to_vec();
                for _ in 0..*extra {
                    tok = tok.wrapping_mul(31).wrapping_add(7);
                    prompt.push(tok);
                }
                prompt.truncate(MAX_CHUNKS * CT);
                mm.delete(*dst as u64).unwrap();
                mm.set_scope(*dst as u64, 7);
                mm.create(*dst as u64).unwrap();
                let k = mm.cached_prefix(7, &prompt);
                prop_assert!(k * CT <= prompt.len());
                let mut kv = FakeKv { tokens: prompt[..k * CT].to_vec(), ..FakeKv::default() };
                mm.restore(*dst as u64, &mut kv).unwrap();
                let shared = (0..k).filter(|&i| mm.chunk_info(*dst as u64, i).is_some_and(|c| c.shared)).count();
                prop_assert_eq!(shared, k, "every chunk cached_prefix promised is shared");
                append(&mut mm, *dst, &mut kv, prompt.len(), &mut tok, Some(&prompt))?;
                kvs[*dst] = kv;
                Some(*dst)
            }
            Op::Truncate { ctx, keep } if sharing => {
                let kv = &mut kvs[*ctx];
                let keep = (*keep).min(kv.tokens.len());
                let dead = if windowed { WindowCodec.dead_chunks(kv.tokens.len()) } else { 0 };
                // The engine never cuts into dead chunks (a window's sink stays).
                if keep > 0 && keep.div_ceil(CT) > dead {
                    // In a call, as the service does (a rollback of the call's own tokens).
                    mm.begin(*ctx as u64, kv, Load::Planned).unwrap();
                    kv.check().map_err(TestCaseError::fail)?;
                    mm.truncate(*ctx as u64, kv, keep).unwrap();
                    kv.truncate(keep);
                    mm.end(*ctx as u64, kv).unwrap();
                }
                Some(*ctx)
            }
            Op::Delete { ctx } if sharing => {
                mm.delete(*ctx as u64).unwrap();
                mm.set_scope(*ctx as u64, 7);
                mm.create(*ctx as u64).unwrap();
                kvs[*ctx] = FakeKv::default();
                Some(*ctx)
            }
            Op::Fork { .. } | Op::Adopt { .. } | Op::Truncate { .. } | Op::Delete { .. } => None,
        };
        let _ = ctx;
        let r = mm.resident_bytes();
        prop_assert!(r <= mm.config().budget, "{policy:?}: {r} bytes resident over a budget of {}", mm.config().budget);
    }
    if background {
        prop_assert!(kvs.iter().all(|kv| kv.converted == 0), "nothing is lowered in the call's `end`");
    }
    for w in held.drain(..) {
        let lowered = w.encode(&**mm.codec());
        mm.finish_level_work(w, lowered).unwrap();
    }
    mm.finish_levelling().unwrap();
    prop_assert_eq!(mm.level_jobs(), 0);
    // Nothing was lost: every context comes back whole.
    for (c, kv) in kvs.iter_mut().enumerate() {
        mm.set_budget(0).unwrap();
        mm.begin(c as u64, kv, Load::Planned).unwrap();
        kv.check().map_err(TestCaseError::fail)?;
        mm.end(c as u64, kv).unwrap();
    }
    Ok(())
}

/// During a call only the running context may push memory over the budget.
fn check_in_call(mm: &Manager, ctx: u64) -> Result<(), TestCaseError> {
    let others = mm.resident_bytes() - mm.context_bytes(ctx);
    prop_assert!(
        others <= mm.config().budget || mm.context_bytes(ctx) == 0,
        "other contexts hold {others} bytes over a budget of {}",
        mm.config().budget
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn budget_holds_and_no_chunk_is_lost(policy in prop::sample::select(Policy::ALL.to_vec()), ops in prop::collection::vec(op(), 1..30)) {
        run(policy, &ops, false)?;
    }

    /// The same with a sliding window: dead chunks keep their first layer only, in memory,
    /// on flash and when read back (a whole recompute under `lmk` revives them first).
    #[test]
    fn a_sliding_window_loses_no_live_byte(policy in prop::sample::select(Policy::ALL.to_vec()), ops in prop::collection::vec(op(), 1..30)) {
        run(policy, &ops, true)?;
    }

    /// Levels lowered in the background (`set_background_levels`): lowerings taken, then
    /// installed after other calls, budget changes and evictions have gone by (a stale one
    /// changes nothing), with and without a window; every chunk still comes back with its
    /// bytes, at the level the engine is told.
    #[test]
    fn background_levels_lose_no_byte(windowed: bool, ops in prop::collection::vec(op(), 1..40)) {
        run_with(Policy::Llms, &ops, windowed, true, false)?;
    }

    /// Sharing on (#59): forks, contexts made from a cached prefix, rollbacks into shared
    /// chunks, deletes of one sharer, with budgets, evictions and levels lowered inline or in
    /// the background, with and without a window, under every policy: every context's every
    /// chunk keeps its bytes (a write into a shared chunk would change another's), and memory
    /// stays within the budget.
    #[test]
    fn shared_chunks_lose_no_byte(
        policy in prop::sample::select(Policy::ALL.to_vec()),
        windowed: bool,
        background: bool,
        ops in prop::collection::vec(sharing_op(), 1..40),
    ) {
        run_with(policy, &ops, windowed, background, true)?;
    }
}

/// A context whose chunks another context's prefix promoted into the pool, then ended by lmk:
/// its next call recomputes its own chunk, attending to the shared ones, which the engine must
/// read where the pool says they are (once read at a slot whose pages had gone to the pool,
/// the recompute faulted with nothing to fill it: a SIGBUS in Fig. 9's lmk runs). lmk ends
/// the context's own chunks only: the shared ones, still in its slots, are the pool's.
#[test]
fn a_recompute_after_lmk_reads_the_shared_chunks_at_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(dir.path(), 42, StoreGeometry::new(2, 6000), false).unwrap());
    let cfg = MmConfig {
        policy: Policy::Lmk,
        budget: 1 << 30,
        ratio: 1.0,
        levels: vec![0],
        max_chunks: MAX_CHUNKS,
        features: mm::Features::default(),
    };
    let Some(mut mm) = require_kernel("userfaultfd", Manager::new(cfg, Arc::new(FakeCodec), store, None)) else { return };
    mm.enable_sharing(POOL_SLOTS).unwrap();
    for c in 0..2 {
        mm.set_scope(c, 7);
        mm.create(c).unwrap();
    }
    let mut tok = 1u32;
    let mut a = FakeKv::default();
    append(&mut mm, 0, &mut a, 3 * CT + 3, &mut tok, None).unwrap();
    // Context 1 opens with context 0's three whole chunks: they become the pool's.
    let k = mm.cached_prefix(7, &a.tokens[..3 * CT]);
    assert_eq!(k, 3);
    let mut b = FakeKv { tokens: a.tokens[..3 * CT].to_vec(), ..FakeKv::default() };
    mm.restore(1, &mut b).unwrap();
    assert!((0..3).all(|i| mm.chunk_info(0, i).is_some_and(|c| c.shared)), "context 0's whole chunks are the pool's");
    // lmk ends context 0 (its own partial chunk goes, unsaved), then it is called again.
    mm.set_budget(0).unwrap();
    assert!(mm.chunk_info(0, 3).is_some_and(|c| c.state != uffd_handler::SlotState::Resident && !c.on_flash), "lmk ended context 0");
    mm.set_budget(1 << 30).unwrap();
    mm.begin(0, &mut a, Load::Planned).unwrap();
    a.check().unwrap();
    mm.end(0, &mut a).unwrap();
}

/// An llms manager over three levels at a ratio of 0.4: below b4's 0.5, a mix of b4 and b2
/// (the solver's loss makes 3 b8 + 7 b2 dearer).
fn levelled_manager(dir: &std::path::Path) -> Option<Manager> {
    let store = Arc::new(Store::open(dir, 42, StoreGeometry::new(2, 6000), false).unwrap());
    let cfg = MmConfig {
        policy: Policy::Llms,
        budget: 1 << 30,
        ratio: 0.4,
        levels: vec![0, 1, 2],
        max_chunks: MAX_CHUNKS,
        features: mm::Features::default(),
    };
    require_kernel("userfaultfd", Manager::new(cfg, Arc::new(FakeCodec), store, None))
}

/// [`levelled_manager`] lowering in the background, with context 9 of 10 chunks written out
/// and its lowerings queued.
fn levelled_context(dir: &std::path::Path) -> Option<(Manager, FakeKv)> {
    let mut mm = levelled_manager(dir)?;
    mm.set_background_levels(true);
    mm.create(9).unwrap();
    let mut kv = FakeKv::default();
    append(&mut mm, 9, &mut kv, 10 * CT, &mut 1, None).unwrap();
    mm.flush();
    Some((mm, kv))
}

/// With levels lowered in the background, a budget the lowered chunks fit is met by doing the
/// queued lowerings, not by evicting chunks about to shrink (which the next switch would read
/// back: Fig. 9's llms read 5x the chunks while the leveller lagged behind its calls).
#[test]
fn reclaim_lowers_queued_chunks_before_it_evicts() {
    let dir = tempfile::tempdir().unwrap();
    let Some((mut mm, mut kv)) = levelled_context(dir.path()) else { return };
    assert!(mm.level_jobs() > 0, "end queued the lowerings");
    let full = mm.resident_bytes();
    // Room for the chunks at their chosen levels, not at the base one.
    mm.set_budget(full * 3 / 4).unwrap();
    assert_eq!(mm.stats.evicted_chunks, 0, "a chunk about to shrink was evicted");
    assert!(mm.resident_bytes() <= full * 3 / 4);
    assert!((0..10).all(|i| mm.chunk_info(9, i).is_some_and(|c| c.state == uffd_handler::SlotState::Resident)));
    mm.begin(9, &mut kv, Load::Planned).unwrap();
    kv.check().unwrap();
    mm.end(9, &mut kv).unwrap();
}

/// A chunk lowered in the background while its context was out of a call is read at its new
/// level by the next call's recompute: the engine learns the level before the load, not after
/// it (read in the old format, it was wrong bytes, and a SIGBUS where the store had nothing
/// to fault in past the lowered length).
#[test]
fn a_recompute_reads_chunks_lowered_in_the_background_at_their_level() {
    use uffd_handler::SlotState::Resident;
    let dir = tempfile::tempdir().unwrap();
    let Some((mut mm, mut kv)) = levelled_context(dir.path()) else { return };
    mm.finish_levelling().unwrap();
    mm.flush();
    // Room for about half: LCTRU takes the heaviest chunks, so light (lowered) ones stay.
    mm.set_budget(mm.resident_bytes() / 2).unwrap();
    let info: Vec<_> = (0..10).map(|i| mm.chunk_info(9, i).unwrap()).collect();
    let lowered = info.iter().position(|c| c.state == Resident && c.format != 0);
    let after = lowered.and_then(|j| (j + 1..10).find(|&k| info[k].state != Resident));
    let (Some(j), Some(k)) = (lowered, after) else { panic!("no resident lowered chunk before an evicted one: {info:?}") };
    assert_ne!(kv.format(j), info[j].format, "the engine has not been told of the lowering yet");
    // Chunk k has no record: the next call recomputes it, attending to chunk j.
    for i in (0..10).filter(|&i| info[i].state != Resident) {
        mm.store().invalidate(9, u32::try_from(i).unwrap());
    }
    mm.set_budget(1 << 30).unwrap();
    let report = mm.begin(9, &mut kv, Load::Planned).unwrap();
    assert!(report.recomputed > 0, "chunk {k} was recomputed: {report:?}");
    kv.check().unwrap();
    mm.end(9, &mut kv).unwrap();
}

#[test]
fn levels_follow_density_and_shrink_pages() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut mm) = levelled_manager(dir.path()) else { return };
    mm.create(9).unwrap();
    let mut kv = FakeKv::default();
    mm.prepare(9, &mut kv, 10 * CT).unwrap();
    mm.begin(9, &mut kv, Load::Planned).unwrap();
    kv.tokens = (0..10 * CT as u32).collect();
    for i in 0..10 {
        kv.write(i);
    }
    mm.end(9, &mut kv).unwrap();
    mm.flush();
    let d = kv.densities().unwrap();
    let info: Vec<_> = (0..10).map(|i| mm.chunk_info(9, i).unwrap()).collect();
    for i in 0..10 {
        for j in 0..10 {
            if d[i] > d[j] {
                assert!(info[i].format <= info[j].format, "denser chunk {i} has fewer bits than {j}");
            }
        }
    }
    assert!(info.iter().any(|c| c.format != info[0].format), "levels are mixed");
    let bytes: usize = info.iter().map(|c| FakeCodec.chunk_bytes(c.format)).sum();
    assert!(bytes * 10 <= 4 * 10 * FakeCodec.chunk_bytes(0), "average ratio {bytes} within 0.4");
    let pages: usize = info.iter().map(|c| FakeCodec.chunk_bytes(c.format).div_ceil(4096) * 4096).sum();
    assert_eq!(mm.context_bytes(9), pages, "only each chunk's format is populated");
    assert!(info.iter().all(|c| c.on_flash), "AoT wrote every chunk once the call ended");
    assert_eq!(mm.stats.written_aot, 10);
    // Another call that changes nothing writes nothing.
    mm.begin(9, &mut kv, Load::Planned).unwrap();
    mm.end(9, &mut kv).unwrap();
    mm.flush();
    assert_eq!(mm.stats.written_aot, 10, "clean chunks are never rewritten");
}

/// Two contexts of 10 chunks each at mixed levels, context 1 used before context 2; then the
/// budget drops to what context 2 holds. Returns the manager and the chunk states.
fn two_contexts_then_squeeze(features: mm::Features) -> Option<(Manager, Vec<mm::ChunkInfo>, Vec<mm::ChunkInfo>, tempfile::TempDir)> {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(dir.path(), 42, StoreGeometry::new(2, 6000), false).unwrap());
    // 0.6: two b8 chunks a context, the rest b4 (heavy and light chunks to choose between).
    let cfg = MmConfig { policy: Policy::Llms, budget: 1 << 30, ratio: 0.6, levels: vec![0, 1, 2], max_chunks: MAX_CHUNKS, features };
    let mut mm = require_kernel("userfaultfd", Manager::new(cfg, Arc::new(FakeCodec), store, None))?;
    for ctx in [1, 2] {
        mm.create(ctx).unwrap();
        let mut kv = FakeKv::default();
        mm.prepare(ctx, &mut kv, 10 * CT).unwrap();
        mm.begin(ctx, &mut kv, Load::Planned).unwrap();
        kv.tokens = (0..10 * CT as u32).map(|t| t + 1000 * ctx as u32).collect();
        for i in 0..10 {
            kv.write(i);
        }
        mm.end(ctx, &mut kv).unwrap();
        mm.flush();
    }
    let two = mm.context_bytes(2);
    mm.set_budget(two).unwrap();
    let info = |mm: &Manager, ctx| (0..10).map(|i| mm.chunk_info(ctx, i).unwrap()).collect::<Vec<_>>();
    let (a, b) = (info(&mm, 1), info(&mm, 2));
    Some((mm, a, b, dir))
}

#[test]
fn ablations_switch_off_lctru_order_and_aot_writes() {
    use uffd_handler::SlotState::Resident;
    // All on: LCTRU takes the heaviest level first, from both contexts; AoT wrote everything.
    let Some((mm, one, two, _d)) = two_contexts_then_squeeze(mm::Features::default()) else { return };
    assert_eq!(mm.stats.written_aot, 20);
    assert!(two.iter().any(|c| c.state != Resident), "LCTRU evicted heavy chunks of the recent context too");
    assert!(one.iter().any(|c| c.state == Resident), "and kept light chunks of the older one");
    // LRU: the older context goes first, whatever its levels; the recent one stays whole.
    // Without AoT nothing is written when calls return, only what reclaim evicts.
    let Some((mm, one, two, _d)) = two_contexts_then_squeeze(mm::Features { lctru: false, aot: false }) else { return };
    assert_eq!(mm.stats.written_aot, 0, "no AoT writer");
    assert!(two.iter().all(|c| c.state == Resident), "plain LRU keeps the most recent context: {two:?}");
    assert!(one.iter().all(|c| c.state != Resident), "and evicts the older one whole: {one:?}");
    assert!(one.iter().all(|c| c.on_flash) && two.iter().all(|c| !c.on_flash), "evicted chunks were written at reclaim, kept ones not");
    assert_eq!(mm.stats.written_sync, 10);
}

/// A context of `n` tokens (made by appending them in one call) in scope 7 of a sharing
/// manager with room for everything.
fn sharing_manager(dir: &std::path::Path) -> Option<Manager> {
    let store = Arc::new(Store::open(dir, 42, StoreGeometry::new(2, 6000), false).unwrap());
    let cfg = MmConfig {
        policy: Policy::Llms,
        budget: 1 << 30,
        ratio: 1.0,
        levels: vec![0],
        max_chunks: MAX_CHUNKS,
        features: mm::Features::default(),
    };
    let mut mm = require_kernel("userfaultfd", Manager::new(cfg, Arc::new(FakeCodec), store, None))?;
    mm.enable_sharing(64).unwrap();
    Some(mm)
}

/// A sharing manager holding context 1, of scope 7, with `n` tokens (and the token
/// generator's state after them).
fn sharing_with_one(dir: &std::path::Path, n: usize) -> Option<(Manager, FakeKv, u32)> {
    let mut mm = sharing_manager(dir)?;
    let mut tok = 0;
    mm.set_scope(1, 7);
    mm.create(1).unwrap();
    let mut a = FakeKv::default();
    append(&mut mm, 1, &mut a, n, &mut tok, None).unwrap();
    Some((mm, a, tok))
}

#[test]
fn a_fork_holds_one_copy_and_copies_on_write() {
    let dir = tempfile::tempdir().unwrap();
    let Some((mut mm, mut a, mut tok)) = sharing_with_one(dir.path(), 10 * CT + 2) else { return };
    mm.flush();
    let before = mm.resident_bytes();
    let mut b = FakeKv { tokens: a.tokens.clone(), ..FakeKv::default() };
    assert_eq!(mm.fork(1, 2, &mut b).unwrap(), 10, "every full chunk is shared");
    let st = mm.sharing_stats(None);
    assert_eq!((st.unique_chunks, st.logical_chunks, st.promoted), (10, 20, 10));
    assert_eq!(st.moved, 0, "a fork moves no page");
    let (a0, alen) = mm.region_range(1).unwrap();
    for i in 0..10 {
        assert!((a0..a0 + alen).contains(&(b.ptr(i) as usize)), "chunk {i}: B reads it where A made it");
    }
    // One copy of the full chunks; the partial one copied (3 pages of the fake's base format).
    assert_eq!(mm.resident_bytes(), before + FakeCodec.chunk_bytes(0).div_ceil(4096) * 4096);
    mm.begin(2, &mut b, Load::Planned).unwrap();
    mm.begin(1, &mut a, Load::Planned).unwrap();
    for i in 0..10 {
        assert_eq!(a.ptr(i), b.ptr(i), "chunk {i}: both read the one copy");
    }
    assert_ne!(a.ptr(10), b.ptr(10), "the partial chunk is each one's own");
    b.check().unwrap();
    a.check().unwrap();
    mm.end(1, &mut a).unwrap();
    // B cuts back into shared chunk 4 and writes anew: A keeps its bytes.
    mm.truncate(2, &mut b, 4 * CT + 1).unwrap();
    b.truncate(4 * CT + 1);
    assert_eq!(mm.sharing_stats(None).copied_on_write, 1, "the chunk cut into was copied");
    assert_ne!(a.ptr(4), b.ptr(4));
    assert_eq!(a.ptr(3), b.ptr(3), "the chunks before it stay shared");
    b.tokens.extend([999_999, 999_998, 999_997]);
    b.write(4);
    mm.end(2, &mut b).unwrap();
    assert_eq!(mm.sharing_stats(None).logical_chunks, 10 + 4);
    // Deleting A leaves B whole (the chunks B shares leave A's slots for the pool's); squeezed
    // out and read back from the pool's records too.
    let resident = mm.resident_bytes();
    mm.delete(1).unwrap();
    assert_eq!(mm.sharing_stats(None).unique_chunks, 4, "what only A held went with it");
    if mm.pager_capabilities().r#move {
        assert_eq!(mm.sharing_stats(None).moved, 4, "resident chunks change hands without a copy");
    } else {
        assert!(!llms_tests::kernel_required(), "this kernel lacks UFFDIO_MOVE (Linux 6.8+)");
    }
    for i in 0..4 {
        assert!(!(a0..a0 + alen).contains(&(b.ptr(i) as usize)), "chunk {i} left A's slot");
    }
    assert!(mm.resident_bytes() < resident, "A's own chunks went");
    mm.begin(2, &mut b, Load::Planned).unwrap();
    b.check().unwrap();
    mm.end(2, &mut b).unwrap();
    mm.flush();
    mm.set_budget(0).unwrap();
    assert_eq!(mm.resident_bytes(), 0);
    mm.set_budget(1 << 30).unwrap();
    mm.begin(2, &mut b, Load::Planned).unwrap();
    b.check().unwrap();
    mm.end(2, &mut b).unwrap();
    // A fork of a context whose chunks are all on flash: its partial chunk comes from the
    // source's record, so its first load recomputes nothing.
    mm.set_scope(4, 7);
    mm.create(4).unwrap();
    let mut s = FakeKv::default();
    append(&mut mm, 4, &mut s, 2 * CT + 2, &mut tok, None).unwrap();
    mm.flush();
    mm.set_budget(0).unwrap();
    mm.set_budget(1 << 30).unwrap();
    let mut f = FakeKv { tokens: s.tokens.clone(), ..FakeKv::default() };
    assert_eq!(mm.fork(4, 5, &mut f).unwrap(), 2);
    let r = mm.begin(5, &mut f, Load::Planned).unwrap();
    assert_eq!((r.missing, r.recomputed), (0, 0), "{r:?}");
    f.check().unwrap();
    mm.end(5, &mut f).unwrap();
}

/// Context `src` of scope 7 made with `n` tokens in one call, and `dst` forked from it (every
/// full chunk shared); with `src`'s slots' address range.
fn made_and_forked(mm: &mut Manager, src: u64, dst: u64, n: usize, tok: &mut u32) -> (FakeKv, FakeKv, (usize, usize)) {
    mm.set_scope(src, 7);
    mm.create(src).unwrap();
    let mut a = FakeKv::default();
    append(mm, src as usize, &mut a, n, tok, None).unwrap();
    let range = mm.region_range(src).unwrap();
    let mut b = FakeKv { tokens: a.tokens.clone(), ..FakeKv::default() };
    assert_eq!(mm.fork(src, dst, &mut b).unwrap(), n / CT);
    (a, b, range)
}

/// A shared chunk stays in the slot it was made in (its home) until that slot is needed:
/// evicted there and read back into the pool's slot; moved (copied, while a sharer is in a
/// call) when its context goes or cuts back into it. Every sharer reads the right bytes
/// throughout, wherever the chunk is.
#[test]
fn shared_chunks_stay_home_until_their_slot_is_needed() {
    let dir = tempfile::tempdir().unwrap();
    let Some((mut mm, mut a, mut tok)) = sharing_with_one(dir.path(), 6 * CT + 2) else { return };
    let (a0, alen) = mm.region_range(1).unwrap();
    let home = |p: *mut u8, (r0, rlen): (usize, usize)| (r0..r0 + rlen).contains(&(p as usize));
    let mut b = FakeKv { tokens: a.tokens.clone(), ..FakeKv::default() };
    assert_eq!(mm.fork(1, 2, &mut b).unwrap(), 6);
    // Squeezed out at home, read back into the pool's slots: both read them there.
    mm.flush();
    mm.set_budget(0).unwrap();
    assert_eq!(mm.resident_bytes(), 0);
    mm.set_budget(1 << 30).unwrap();
    mm.begin(2, &mut b, Load::Planned).unwrap();
    mm.begin(1, &mut a, Load::Planned).unwrap();
    for i in 0..6 {
        assert!(!home(b.ptr(i), (a0, alen)), "chunk {i} was read back into the pool's slot");
        assert_eq!(a.ptr(i), b.ptr(i), "chunk {i}: one copy");
    }
    a.check().unwrap();
    b.check().unwrap();
    mm.end(1, &mut a).unwrap();
    mm.end(2, &mut b).unwrap();

    // C forks D; C goes while D is in a call (from another thread, as the service's
    // registry does): D's pass may be reading C's slot, so the chunks are copied and C's
    // region stays mapped until D's call ends.
    let (_, mut d, c_range) = made_and_forked(&mut mm, 3, 4, 5 * CT + 3, &mut tok);
    mm.begin(4, &mut d, Load::Planned).unwrap();
    let old: Vec<*mut u8> = (0..5).map(|i| d.ptr(i)).collect();
    assert!(old.iter().all(|&p| home(p, c_range)));
    let moved = mm.sharing_stats(None).moved;
    mm.delete(3).unwrap();
    assert_eq!(mm.sharing_stats(None).moved, moved, "copied, not moved, under a sharer's call");
    for (i, &p) in old.iter().enumerate() {
        assert_ne!(d.ptr(i), p, "chunk {i}: D reads the pool's copy from now on");
        // SAFETY: the home's region is kept mapped while D is in its call.
        let was = unsafe { std::slice::from_raw_parts(p, d.len(i)) };
        assert_eq!(was, d.bytes(i), "chunk {i}: a pass still reading the old place sees the same bytes");
    }
    d.check().unwrap();
    mm.end(4, &mut d).unwrap();
    mm.begin(4, &mut d, Load::Planned).unwrap();
    d.check().unwrap();
    mm.end(4, &mut d).unwrap();

    // E forks F; E cuts back into its chunk 2 while F is in a call: E's chunks 2.. leave
    // E's slots for the pool's (F keeps reading them), E writes its own there.
    let (mut e, mut f, e_range) = made_and_forked(&mut mm, 5, 6, 4 * CT + 1, &mut tok);
    mm.begin(6, &mut f, Load::Planned).unwrap();
    mm.begin(5, &mut e, Load::Planned).unwrap();
    mm.truncate(5, &mut e, 2 * CT + 3).unwrap();
    e.truncate(2 * CT + 3);
    for i in 0..4 {
        assert_eq!(home(f.ptr(i), e_range), i < 2, "chunk {i}: F reads it at E's slot only if E kept it");
    }
    e.tokens.extend([777_001, 777_002]);
    for i in 2..e.tokens.len().div_ceil(CT) {
        e.write(i);
    }
    f.check().unwrap();
    e.check().unwrap();
    mm.end(5, &mut e).unwrap();
    mm.end(6, &mut f).unwrap();
    mm.begin(6, &mut f, Load::Planned).unwrap();
    f.check().unwrap();
    mm.end(6, &mut f).unwrap();
}

#[test]
fn a_new_context_copies_the_rows_after_its_shared_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let Some((mut mm, mut a, _)) = sharing_with_one(dir.path(), 5 * CT + 2) else { return };
    // A prompt that leaves A's tokens 3 rows into its chunk 3 (of 4).
    let mut prompt = a.tokens[..3 * CT + 3].to_vec();
    prompt.extend([900_001, 900_002, 900_003, 900_004]);
    assert_eq!(mm.cached_prefix(7, &prompt), 3);
    assert_eq!(mm.partial_prefix(7, &prompt, 3, 0), 3, "A's chunk 3 holds the next 3 tokens");
    assert_eq!(mm.partial_prefix(8, &prompt, 3, 0), 0, "another app's contexts are never offered");
    assert_eq!(mm.partial_prefix(7, &prompt, 3, 1), 0, "rows are taken from the base format only");
    mm.flush();
    let before = mm.resident_bytes();
    mm.set_scope(2, 7);
    mm.create(2).unwrap();
    let mut b = FakeKv { tokens: prompt[..3 * CT + 3].to_vec(), ..FakeKv::default() };
    let usable = mm.restore(2, &mut b).unwrap();
    assert_eq!(usable, 3);
    assert!(mm.fill_partial(2, &mut b).unwrap());
    assert_eq!(mm.resident_bytes(), before + FakeCodec.chunk_bytes(0).div_ceil(4096) * 4096, "one chunk copied, none of the shared");
    mm.prepare(2, &mut b, prompt.len()).unwrap();
    let r = mm.begin(2, &mut b, Load::Planned).unwrap();
    assert_eq!((r.missing, r.recomputed), (0, 0), "the copied rows are not computed: {r:?}");
    mm.begin(1, &mut a, Load::Planned).unwrap();
    assert_ne!(a.ptr(3), b.ptr(3), "the copy is B's own");
    assert_eq!(a.bytes(3), b.bytes(3), "B's chunk 3 is a copy of A's");
    // A source in a call is not offered (it may be writing that chunk).
    assert_eq!(mm.partial_prefix(7, &prompt, 3, 0), 0);
    a.check().unwrap();
    mm.end(1, &mut a).unwrap();
    // B writes after the copied rows (the fake engine writes the whole chunk for its tokens).
    b.tokens.extend_from_slice(&prompt[3 * CT + 3..]);
    b.write(3);
    b.write(4);
    mm.end(2, &mut b).unwrap();
    mm.set_budget(0).unwrap();
    mm.set_budget(1 << 30).unwrap();
    for (id, kv) in [(1, &mut a), (2, &mut b)] {
        mm.begin(id, kv, Load::Planned).unwrap();
        kv.check().unwrap();
        mm.end(id, kv).unwrap();
    }
    // With no context holding the rows (A deleted), nothing is taken and the load computes them.
    mm.delete(1).unwrap();
    let mut c = FakeKv { tokens: prompt[..3 * CT + 3].to_vec(), ..FakeKv::default() };
    assert_eq!(mm.partial_prefix(7, &prompt, 3, 0), 3, "B holds them now");
    mm.delete(2).unwrap();
    assert_eq!(mm.partial_prefix(7, &prompt, 3, 0), 0);
    mm.set_scope(3, 7);
    mm.create(3).unwrap();
    mm.restore(3, &mut c).unwrap();
    assert!(!mm.fill_partial(3, &mut c).unwrap());
    let r = mm.begin(3, &mut c, Load::Planned).unwrap();
    assert!(r.recomputed > 0, "{r:?}");
    c.check().unwrap();
    mm.end(3, &mut c).unwrap();
}

#[test]
fn a_prefix_is_found_only_in_its_scope_and_only_for_its_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let Some((mut mm, a, mut tok)) = sharing_with_one(dir.path(), 6 * CT) else { return };
    let prompt = a.tokens.clone();
    assert_eq!(mm.cached_prefix(7, &prompt), 6);
    assert_eq!(mm.cached_prefix(8, &prompt), 0, "another app's contexts are never offered");
    // A prompt that differs inside chunk 3: the first three are found, nothing after.
    let mut edited = prompt.clone();
    edited[3 * CT + 1] ^= 1;
    assert_eq!(mm.cached_prefix(7, &edited), 3);
    // Same tokens in another order within a chunk: a different chunk.
    let mut swapped = prompt.clone();
    swapped.swap(0, 1);
    assert_eq!(mm.cached_prefix(7, &swapped), 0);
    // A new context of scope 8 with the same prompt computes it all itself.
    mm.set_scope(2, 8);
    mm.create(2).unwrap();
    let mut b = FakeKv { tokens: Vec::new(), ..FakeKv::default() };
    assert_eq!(mm.restore(2, &mut b).unwrap(), 0);
    append(&mut mm, 2, &mut b, prompt.len(), &mut tok, Some(&prompt)).unwrap();
    assert_eq!(mm.sharing_stats(None).unique_chunks, 0, "nothing crossed the scopes");
    // In scope 7 it is shared.
    mm.set_scope(3, 7);
    mm.create(3).unwrap();
    let mut c = FakeKv { tokens: prompt[..4 * CT].to_vec(), ..FakeKv::default() };
    assert_eq!(mm.restore(3, &mut c).unwrap(), 4);
    append(&mut mm, 3, &mut c, prompt.len(), &mut tok, Some(&prompt)).unwrap();
    c.check().unwrap();
    assert_eq!(mm.sharing_stats(None).logical_chunks, 8);
}

/// A manager over the store in `dir` with sharing on (a restart: the same directory again).
fn reopen(dir: &std::path::Path) -> Manager {
    sharing_manager(dir).expect("userfaultfd worked a moment ago")
}

/// Records of the pool in the store (chunks `0..64`, the test pool's slots).
fn pool_records(mm: &Manager) -> usize {
    (0..64).filter(|&p| mm.store().entry(mm::POOL_CTX, p).is_some()).count()
}

#[test]
fn shared_chunks_outlive_a_restart_and_unreachable_ones_are_freed() {
    let dir = tempfile::tempdir().unwrap();
    let Some((mut mm, mut a, _)) = sharing_with_one(dir.path(), 6 * CT + 1) else { return };
    let mut b = FakeKv { tokens: a.tokens.clone(), ..FakeKv::default() };
    assert_eq!(mm.fork(1, 2, &mut b).unwrap(), 6);
    mm.flush();
    let own_a: Vec<bool> = (0..6).map(|i| mm.store().entry(1, i).is_some()).collect();
    assert!(own_a.iter().all(|x| !x), "a promoted chunk's own record is gone: one record, the pool's");
    assert_eq!(pool_records(&mm), 6);
    drop(mm);

    // Restart: both contexts find the six chunks again, shared; nothing to sweep.
    let mut mm = reopen(dir.path());
    assert!((0..6).all(|i| mm.store().entry(1, i).is_none()), "the promoted chunks' own records stay given back");
    for (ctx, kv) in [(1, &mut a), (2, &mut b)] {
        *kv = FakeKv { tokens: kv.tokens.clone(), ..FakeKv::default() };
        mm.set_scope(ctx, 7);
        mm.restore(ctx, kv).unwrap();
        let shared = (0..7).filter(|&i| mm.chunk_info(ctx, i).is_some_and(|c| c.shared)).count();
        assert_eq!(shared, 6, "context {ctx} shares its six full chunks again");
    }
    assert_eq!(mm.sweep_shared(), 0);
    let st = mm.sharing_stats(None);
    assert_eq!((st.unique_chunks, st.logical_chunks), (6, 12));
    for (ctx, kv) in [(1, &mut a), (2, &mut b)] {
        mm.begin(ctx, kv, Load::Planned).unwrap();
        kv.check().unwrap();
        mm.end(ctx, kv).unwrap();
    }
    // Another scope's context of the same tokens after a restart finds nothing.
    mm.set_scope(3, 8);
    let mut c = FakeKv { tokens: a.tokens.clone(), ..FakeKv::default() };
    assert_eq!(mm.restore(3, &mut c).unwrap(), 0);
    mm.delete(3).unwrap();
    // Context 1 goes; then a restart where nothing restores context 2 (its file lost, say):
    // the sweep frees every pool record.
    mm.delete(1).unwrap();
    mm.flush();
    drop(mm);
    let mut mm = reopen(dir.path());
    assert_eq!(pool_records(&mm), 6, "kept until the contexts were restored");
    assert_eq!(mm.sweep_shared(), 6, "no context took them");
    assert_eq!(pool_records(&mm), 0);
    drop(mm);
    let mm = reopen(dir.path());
    assert_eq!(pool_records(&mm), 0, "and they stay freed");
}

/// Context 1 of 5 full chunks (scope 7) and its fork, context 2, every chunk shared and on flash.
fn forked_pair(dir: &std::path::Path) -> Option<(Manager, FakeKv, FakeKv)> {
    let mut mm = sharing_manager(dir)?;
    mm.set_scope(1, 7);
    mm.create(1).unwrap();
    let mut a = FakeKv::default();
    append(&mut mm, 1, &mut a, 5 * CT, &mut 0, None).unwrap();
    let mut b = FakeKv { tokens: a.tokens.clone(), ..FakeKv::default() };
    mm.fork(1, 2, &mut b).unwrap();
    mm.flush();
    Some((mm, a, b))
}

#[test]
fn a_damaged_pool_log_costs_recomputes_never_wrong_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let Some((mm, a, _b)) = forked_pair(dir.path()) else { return };
    let log = mm.store().dir().join("pool.log");
    drop(mm);
    // Flip a byte in the middle: the records from there on are not trusted.
    let mut bytes = std::fs::read(&log).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&log, &bytes).unwrap();
    let mut mm = reopen(dir.path());
    mm.set_scope(1, 7);
    let mut a2 = FakeKv { tokens: a.tokens.clone(), ..FakeKv::default() };
    let shared = mm.restore(1, &mut a2).unwrap();
    assert!(shared < 5, "the chunks named past the damage are not shared: {shared}");
    mm.sweep_shared();
    mm.begin(1, &mut a2, Load::Planned).unwrap();
    a2.check().unwrap();
    mm.end(1, &mut a2).unwrap();
    // Garbage for a log: nothing is shared, everything comes back right.
    drop(mm);
    std::fs::write(&log, b"not a log at all").unwrap();
    let mut mm = reopen(dir.path());
    mm.set_scope(1, 7);
    let mut a3 = FakeKv { tokens: a.tokens.clone(), ..FakeKv::default() };
    mm.restore(1, &mut a3).unwrap();
    assert!((0..5).all(|i| mm.chunk_info(1, i).is_some_and(|c| !c.shared)), "nothing is shared");
    assert_eq!(pool_records(&mm), 0, "records no name reaches are freed at the start");
    mm.begin(1, &mut a3, Load::Planned).unwrap();
    a3.check().unwrap();
    mm.end(1, &mut a3).unwrap();
}

#[test]
fn a_declared_public_prefix_and_only_it_crosses_scopes() {
    let dir = tempfile::tempdir().unwrap();
    let Some((mut mm, mut a, mut tok)) = sharing_with_one(dir.path(), 6 * CT) else { return };
    let prompt = a.tokens.clone();
    assert_eq!(mm.cached_prefix(8, &prompt), 0, "nothing is public yet");
    // The first two chunks and a bit of the third are declared public: two chunks cross.
    mm.set_public_prefixes(vec![prompt[..2 * CT + 1].to_vec()]);
    mm.begin(1, &mut a, Load::Planned).unwrap();
    mm.end(1, &mut a).unwrap();
    assert_eq!(mm.cached_prefix(8, &prompt), 2, "the public chunks, not the rest");
    assert_eq!(mm.cached_prefix(7, &prompt), 6, "its own app still finds all of it");
    mm.set_scope(2, 8);
    mm.create(2).unwrap();
    let mut b = FakeKv { tokens: prompt[..2 * CT].to_vec(), ..FakeKv::default() };
    assert_eq!(mm.restore(2, &mut b).unwrap(), 2);
    append(&mut mm, 2, &mut b, prompt.len(), &mut tok, Some(&prompt)).unwrap();
    b.check().unwrap();
    assert_eq!(mm.sharing_stats(Some(mm::PUBLIC_SCOPE)).unique_chunks, 2);
    assert_eq!(mm.sharing_stats(Some(7)).unique_chunks, 0, "app 7's own chunks stayed its own");
}

/// Shared chunks evicted from the pool come back from its records, read together; one whose
/// record fails its checksum costs a recompute of it and what follows it, never a wrong byte.
#[test]
fn a_pool_record_that_fails_its_checksum_is_recomputed_not_served() {
    let dir = tempfile::tempdir().unwrap();
    let Some((mut mm, mut a, mut b)) = forked_pair(dir.path()) else { return };
    mm.set_budget(0).unwrap();
    assert!(
        (0..5).all(|i| mm.chunk_info(1, i).is_some_and(|c| c.shared && c.on_flash && c.state != uffd_handler::SlotState::Resident)),
        "every shared chunk is on flash only"
    );
    mm.set_budget(1 << 30).unwrap();
    // The first load reads them all back, good.
    let r = mm.begin(1, &mut a, Load::Planned).unwrap();
    a.check().unwrap();
    assert_eq!(r.recomputed, 0, "{r:?}");
    mm.end(1, &mut a).unwrap();
    mm.flush();
    mm.set_budget(0).unwrap();
    mm.set_budget(1 << 30).unwrap();
    // Flip a byte in the body of the pool record with the most bytes past the start of the file.
    let store = mm.store();
    let (p, e) = (0..64).filter_map(|p| store.entry(mm::POOL_CTX, p).map(|e| (p, e))).max_by_key(|(_, e)| store.body_extent(e).0).unwrap();
    let (offset, len) = store.body_extent(&e);
    let path = store.dir().join(format!("ctx-{:016x}.kv", mm::POOL_CTX));
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[offset as usize + len / 2] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let r = mm.begin(2, &mut b, Load::Planned).unwrap();
    b.check().unwrap();
    assert!(r.recomputed > 0, "pool chunk {p}'s bad record was not noticed: {r:?}");
    mm.end(2, &mut b).unwrap();
    mm.begin(1, &mut a, Load::Planned).unwrap();
    a.check().unwrap();
    mm.end(1, &mut a).unwrap();
}

/// A new chunk's slot holds zeros and nothing else, call after call: its pages come from zero
/// buffers readied after the call before (`end`), some of which gave theirs to slots that
/// other contexts then wrote and freed. More chunks at once than are kept ready take the rest
/// at once.
#[test]
fn new_chunks_start_from_zeros_after_other_contexts_wrote_theirs() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut mm) = levelled_manager(dir.path()) else { return };
    let mut tok = 1u32;
    for (round, chunks) in [1usize, 3, 9, 2, 6].into_iter().enumerate() {
        let ctx = 100 + round as u64;
        mm.create(ctx).unwrap();
        let mut kv = FakeKv::default();
        mm.prepare(ctx, &mut kv, chunks * CT).unwrap();
        mm.begin(ctx, &mut kv, Load::Planned).unwrap();
        assert_eq!(kv.n_chunks(), chunks);
        for i in 0..chunks {
            // SAFETY: attached by mm to a resident, pinned slot for the call.
            let slot = unsafe { std::slice::from_raw_parts(kv.ptr(i), mm::Codec::chunk_bytes(&FakeCodec, 0)) };
            assert!(slot.iter().all(|&b| b == 0), "round {round}: new chunk {i} holds another's bytes");
        }
        // Written through (not zero), then gone: its pages are the next round's to reuse.
        for _ in 0..chunks * CT {
            tok = tok.wrapping_mul(31).wrapping_add(7);
            kv.tokens.push(tok);
        }
        (0..chunks).for_each(|i| kv.write(i));
        kv.check().unwrap();
        mm.end(ctx, &mut kv).unwrap();
        mm.delete(ctx).unwrap();
    }
}

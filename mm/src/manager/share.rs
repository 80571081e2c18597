//! Chunks shared between contexts (#59). A full chunk's K/V depends only on the tokens from
//! position 0 to its end, so contexts whose tokens start alike can hold one copy of those
//! chunks. A shared chunk belongs to the pool: one userfaultfd region of its own, one slot per
//! shared chunk, one record in the store (under [`POOL_CTX`]), one entry in LCTRU. Its bytes
//! stay in the slot of the context that made it (its home, [`Home`]) until that context needs
//! the slot or goes, or the chunk is evicted; then they live in its pool slot. Each sharer's
//! engine cache reads the chunk at the address its entry holds ([`KvContext::attach_moving`]),
//! so the one physical copy needs no second mapping of the same pages, and a fork moves none.
//!
//! Why not a memfd mapped into each context's region: a slot remapped `MAP_SHARED|MAP_FIXED`
//! splits the context's region into a VMA per shared chunk (the kernel's default limit is
//! 65,530 maps a process), the remapped range leaves the context's userfaultfd registration
//! (shmem would need its own, in MINOR mode, to be filled on a touch), and evicting it means a
//! hole punched in the memfd that every mapping must then fault on. The engine never needed
//! its chunks contiguous, so a pointer per chunk does it with the mechanism mm already has.
//!
//! Identity: a chunk is named by its tokens and the chunk before it, never by a hash alone.
//! The index maps (scope, hash of the tokens up to the chunk's end) to candidates; a candidate
//! is taken only if its tokens are the chunk's tokens and its parent is the chunk already
//! matched before it, so a collision can never hand one context another's K/V. A scope is the
//! service's (uid, app): chunks are found only inside one scope.
//!
//! Invariants: a context's shared chunks are a prefix of its chunks (0..k); every sharer of a
//! pool chunk shares its parent, so an entry with no sharer has no child with one, and
//! releasing a context's chunks last first frees children before parents. A context's own
//! full chunks are in the index too (between its calls), so a new context can find a prefix
//! another holds; sharing it promotes it into the pool first ([`Manager::promote_own`]).

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Arc;

use uffd_handler::{Region, SlotState};

use super::{chunk_u32, engine, ChunkMeta, LevelJob, Manager, MmError, Result, StoreSource};
use crate::context::{prefix_hashes, Format, KvContext};
use crate::store::RecordMeta;

/// The pool's id where a context's id goes: its records in the store, its chunks in LCTRU and
/// in the AoT writer's bookkeeping. The service never gives a context this id.
pub const POOL_CTX: u64 = u64::MAX;

/// The scope of chunks within a prefix the integrator declared public
/// ([`Manager::set_public_prefixes`]): found from every scope. A service's own scopes must
/// not be this value.
pub const PUBLIC_SCOPE: u64 = 0;

/// A link of a prefix chain: a pool chunk, or a context's own full chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ident {
    Pool(u32),
    Own(u64, u32),
}

/// Promotions made and not yet settled ([`Manager::settle`]): (chunk of the context, pool
/// chunk, the pool's record).
#[derive(Debug, Default)]
pub(super) struct Promoted(Vec<(u32, u32, RecordMeta)>);

/// A shared chunk.
#[derive(Debug)]
pub(super) struct Entry {
    pub scope: u64,
    /// The pool chunk before it (none for a context's first chunk).
    pub parent: Option<u32>,
    /// Its own tokens (`chunk_tokens` of them).
    pub tokens: Box<[u32]>,
    /// The hash of every token up to its end (the index key, and its record's prefix).
    pub prefix_hash: u64,
    pub level: Format,
    pub density: f64,
    /// (context, chunk) of each context that holds it.
    pub sharers: Vec<(u64, u32)>,
    /// The level each sharer's last `end` chose for it: it is lowered only to the heaviest of
    /// them, and only once every sharer has chosen.
    pub wanted: Vec<(u64, Format)>,
    /// Sharers in a call: while any is, its bytes and level stay as they are.
    pub calls: u32,
    /// Changes when a sharer begins a call (a queued lowering is then dropped).
    pub epoch: u64,
    /// Where its bytes are, as every sharer's engine reads them
    /// ([`KvContext::attach_moving`]): its home slot, or its pool slot.
    pub at: Arc<AtomicPtr<u8>>,
    /// While its bytes are still in the slot of the context it was promoted from: a
    /// promotion moves nothing, the chunk moves to its pool slot only when that context
    /// needs the slot or goes ([`Manager::unhome`]), or it leaves home when evicted.
    pub home: Option<Home>,
    /// The region of a home left while sharers were in a call ([`Manager::unhome`]): kept
    /// mapped until none is, as a pass may still read the old address.
    pub retired: Option<Arc<Region>>,
}

/// The slot a pool chunk's bytes are in until they move to its pool slot: slot `slot` of
/// context `ctx`'s region. While there the chunk is resident (an eviction takes it out of
/// home) and its context is one of its sharers.
#[derive(Debug)]
pub(super) struct Home {
    pub ctx: u64,
    pub region: Arc<Region>,
    pub slot: usize,
}

/// The shared chunks and the index of every shareable chunk.
#[derive(Debug)]
pub(super) struct Pool {
    pub region: Arc<Region>,
    pub entries: Vec<Option<Entry>>,
    free: Vec<u32>,
    pub index: HashMap<(u64, u64), Vec<Ident>>,
    /// What names each pool chunk (scope, parent, tokens) across restarts (see [`PoolLog`]).
    log: Option<PoolLog>,
    /// Chunks in the pool: with none, its store file goes too.
    live: usize,
}

/// The pool's identities on flash: `pool.log` beside the store's files, a log of records
/// `[len u32][crc32c u32][op u8, chunk u32, scope u64, parent u32 (MAX: none), prefix u64,
/// tokens u32 x n]` (little-endian), `op` 1 adds a chunk and 2 removes it. The chunks' bytes
/// are their records in the store (under [`POOL_CTX`]); this says which tokens after which
/// chunk, in which scope, each holds, so a restart shares them again only with contexts of
/// exactly those tokens (never by hash). Appended without fsync: a record lost to a power cut
/// only makes a chunk unreachable, and unreachable records are freed at the next start (the
/// contexts recompute what they no longer find). Rewritten whole at each start.
#[derive(Debug)]
struct PoolLog {
    file: std::fs::File,
    /// Records kept back to go out in one write ([`PoolLog::hold`]: a fork's promotions).
    held: Option<Vec<u8>>,
}

/// A pool chunk's identity as the log keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Named {
    p: u32,
    scope: u64,
    parent: Option<u32>,
    prefix_hash: u64,
    tokens: Vec<u32>,
}

impl Named {
    fn as_ref(&self) -> NameRef<'_> {
        NameRef { p: self.p, scope: self.scope, parent: self.parent, prefix_hash: self.prefix_hash, tokens: &self.tokens }
    }
}

/// A pool chunk's identity to write to the log, borrowing its tokens.
#[derive(Debug, Clone, Copy)]
struct NameRef<'a> {
    p: u32,
    scope: u64,
    parent: Option<u32>,
    prefix_hash: u64,
    tokens: &'a [u32],
}

const LOG_ADD: u8 = 1;
const LOG_DEL: u8 = 2;
/// Bytes of a log record's body before its tokens: op, chunk, scope, parent, prefix hash.
const LOG_HEAD: usize = 1 + 4 + 8 + 4 + 8;
/// Most tokens a chunk of the log holds (a bound on what a damaged length can ask for).
const LOG_MAX_TOKENS: usize = 4096;

impl PoolLog {
    fn path(dir: &std::path::Path) -> std::path::PathBuf {
        dir.join("pool.log")
    }

    /// The chunks the log names (a damaged or torn record ends the reading: what follows it
    /// is not trusted).
    fn read(dir: &std::path::Path) -> Vec<Named> {
        let Ok(bytes) = std::fs::read(Self::path(dir)) else { return Vec::new() };
        let mut live: HashMap<u32, Named> = HashMap::new();
        let mut at = 0;
        while let Some(head) = bytes.get(at..at + 8) {
            let len = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
            let crc = u32::from_le_bytes(head[4..].try_into().expect("4 bytes"));
            let Some(body) = bytes.get(at + 8..at + 8 + len) else { break };
            if crc32c::crc32c(body) != crc || len < LOG_HEAD {
                break;
            }
            at += 8 + len;
            let u32_at = |o: usize| u32::from_le_bytes(body[o..o + 4].try_into().expect("4 bytes"));
            let u64_at = |o: usize| u64::from_le_bytes(body[o..o + 8].try_into().expect("8 bytes"));
            let (op, p) = (body[0], u32_at(1));
            let n = (len - LOG_HEAD) / 4;
            if op == LOG_DEL {
                live.remove(&p);
            } else if op == LOG_ADD && n <= LOG_MAX_TOKENS && (len - LOG_HEAD).is_multiple_of(4) {
                let parent = Some(u32_at(13)).filter(|&x| x != u32::MAX);
                let tokens = (0..n).map(|k| u32_at(LOG_HEAD + 4 * k)).collect();
                live.insert(p, Named { p, scope: u64_at(5), parent, prefix_hash: u64_at(17), tokens });
            }
        }
        let mut v: Vec<Named> = live.into_values().collect();
        v.sort_by_key(|x| x.p);
        v
    }

    /// Appends a record to `out` in place (a fork's first promotions append 270 of them
    /// under mm's lock: no allocation each).
    fn record_into(out: &mut Vec<u8>, op: u8, n: &NameRef) {
        let len = LOG_HEAD + 4 * n.tokens.len();
        out.reserve(8 + len);
        let at = out.len();
        out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.push(op);
        out.extend_from_slice(&n.p.to_le_bytes());
        out.extend_from_slice(&n.scope.to_le_bytes());
        out.extend_from_slice(&n.parent.unwrap_or(u32::MAX).to_le_bytes());
        out.extend_from_slice(&n.prefix_hash.to_le_bytes());
        for t in n.tokens {
            out.extend_from_slice(&t.to_le_bytes());
        }
        let crc = crc32c::crc32c(&out[at + 8..]);
        out[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
    }

    /// A new log naming `live` (written aside, fsynced and renamed over the old one).
    fn rewrite(dir: &std::path::Path, live: &[Named]) -> std::io::Result<Self> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let tmp = dir.join("pool.log.tmp");
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
        let mut all = Vec::new();
        for n in live {
            Self::record_into(&mut all, LOG_ADD, &n.as_ref());
        }
        f.write_all(&all)?;
        f.sync_data()?;
        std::fs::rename(&tmp, Self::path(dir))?;
        let file = std::fs::OpenOptions::new().append(true).open(Self::path(dir))?;
        Ok(Self { file, held: None })
    }

    fn append(&mut self, op: u8, n: &NameRef) {
        match &mut self.held {
            Some(h) => Self::record_into(h, op, n),
            None => {
                let mut one = Vec::new();
                Self::record_into(&mut one, op, n);
                self.write(&one);
            }
        }
    }

    fn write(&mut self, bytes: &[u8]) {
        use std::io::Write;
        if let Err(e) = self.file.write_all(bytes) {
            // The chunk is then unreachable after a restart (freed, recomputed): never wrong.
            eprintln!("llms: the pool's log: {e}; a shared chunk may be recomputed after a restart");
        }
    }

    /// Keeps records back until [`PoolLog::release`] (one write for a fork's 270 promotions
    /// instead of 270). Nothing waits on the log: it is read only at the next start.
    fn hold(&mut self) {
        self.held.get_or_insert_with(Vec::new);
    }

    fn release(&mut self) {
        if let Some(h) = self.held.take().filter(|h| !h.is_empty()) {
            self.write(&h);
        }
    }
}

impl Pool {
    /// Where chunk `p`'s bytes are: its home (a context's slot) or its pool slot.
    pub fn loc(&self, p: u32) -> (&Arc<Region>, usize) {
        match self.get(p).and_then(|e| e.home.as_ref()) {
            Some(h) => (&h.region, h.slot),
            None => (&self.region, p as usize),
        }
    }
    /// The state of chunk `p`'s slot, where it is.
    pub fn state(&self, p: u32) -> uffd_handler::Result<SlotState> {
        let (r, slot) = self.loc(p);
        r.state(slot)
    }
    /// Bytes of chunk `p` resident, where it is.
    pub fn resident_bytes(&self, p: u32) -> usize {
        let (r, slot) = self.loc(p);
        r.resident_bytes_in(slot..slot + 1)
    }
    pub fn get(&self, p: u32) -> Option<&Entry> {
        self.entries.get(p as usize).and_then(Option::as_ref)
    }
    pub fn get_mut(&mut self, p: u32) -> Option<&mut Entry> {
        self.entries.get_mut(p as usize).and_then(Option::as_mut)
    }
    fn alloc(&mut self) -> Option<u32> {
        if let Some(p) = self.free.pop() {
            return Some(p);
        }
        (self.entries.len() < self.region.n_slots()).then(|| {
            self.entries.push(None);
            chunk_u32(self.entries.len() - 1)
        })
    }
    fn has_room(&self) -> bool {
        !self.free.is_empty() || self.entries.len() < self.region.n_slots()
    }
    fn index_add(&mut self, key: (u64, u64), id: Ident) {
        let v = self.index.entry(key).or_default();
        if !v.contains(&id) {
            v.push(id);
        }
    }
    /// `index_remove(key, old)` then `index_add(key, new)` in one lookup, and without freeing
    /// and allocating the candidates' list when `old` was its only one (a promotion).
    fn index_replace(&mut self, key: (u64, u64), old: Ident, new: Ident) {
        let v = self.index.entry(key).or_default();
        v.retain(|&x| x != old);
        if !v.contains(&new) {
            v.push(new);
        }
    }
    fn index_remove(&mut self, key: (u64, u64), id: Ident) {
        if let Some(v) = self.index.get_mut(&key) {
            v.retain(|&x| x != id);
            if v.is_empty() {
                self.index.remove(&key);
            }
        }
    }
}

/// What sharing saves now, and what it did so far.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct SharingStats {
    /// Chunks in the pool (one copy each).
    pub unique_chunks: u64,
    /// Chunks contexts hold through the pool (a chunk three contexts share counts three).
    pub logical_chunks: u64,
    /// Bytes of chunk memory the pool's resident chunks would take again per extra sharer.
    pub bytes_saved: u64,
    /// Own chunks made pool chunks because another context wanted them (in place: a
    /// resident one stays in its context's slot, its home).
    pub promoted: u64,
    /// Pool chunks whose resident pages later left their home slot for their pool slot
    /// without a copy (UFFDIO_MOVE: their context cut back into them or went).
    pub moved: u64,
    /// Chunks a context took from the pool when it was made (a fork, a cached prefix).
    pub reused: u64,
    /// Tokens of a new context's last, partial chunk copied from another context's chunk
    /// (a fork's, or the rows after a cached prefix) instead of computed.
    pub copied_rows: u64,
    /// Shared chunks copied into a context's own memory before it wrote into them.
    pub copied_on_write: u64,
    /// Contexts made by [`Manager::fork`].
    pub forks: u64,
}

impl SharingStats {
    /// Prompt tokens contexts took instead of computing them: the shared chunks they were
    /// made with (`chunk_tokens` each) and the rows copied after them.
    pub fn reused_tokens(&self, chunk_tokens: usize) -> u64 {
        self.reused * chunk_tokens as u64 + self.copied_rows
    }
}

impl std::ops::Add for SharingStats {
    type Output = Self;
    /// Two scopes' stats together.
    fn add(self, b: Self) -> Self {
        Self {
            unique_chunks: self.unique_chunks + b.unique_chunks,
            logical_chunks: self.logical_chunks + b.logical_chunks,
            bytes_saved: self.bytes_saved + b.bytes_saved,
            promoted: self.promoted + b.promoted,
            moved: self.moved + b.moved,
            reused: self.reused + b.reused,
            copied_rows: self.copied_rows + b.copied_rows,
            copied_on_write: self.copied_on_write + b.copied_on_write,
            forks: self.forks + b.forks,
        }
    }
}

/// A shared chunk as the pool's log names it (for `llms doctor --state-dir`, which reads a
/// state directory without a model or a running service).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedName {
    pub chunk: u32,
    pub scope: u64,
    pub parent: Option<u32>,
    pub tokens: Vec<u32>,
}

/// The shared chunks the pool's log in `store_dir` (a model's store directory) names, as a
/// start would read them (a damaged record ends the reading).
pub fn shared_names(store_dir: &std::path::Path) -> Vec<SharedName> {
    PoolLog::read(store_dir).into_iter().map(|n| SharedName { chunk: n.p, scope: n.scope, parent: n.parent, tokens: n.tokens }).collect()
}

/// How a chunk leaves the pool for its context's own memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unshare {
    /// Copy its bytes (the context keeps its tokens and is about to write after them).
    Copy,
    /// A zeroed slot in the base format (the context dropped its tokens and will write it anew).
    Fresh,
    /// Not resident, in the base format, with no record: the next load recomputes it.
    Missing,
}

impl Manager {
    /// Lets contexts with a scope ([`Manager::set_scope`]) share full chunks, through a pool of
    /// at most `slots` shared chunks (virtual address space only until used). Off by default:
    /// the experiments measure contexts that share nothing.
    ///
    /// The shared chunks of an earlier run come back (named by the pool's log, their bytes in
    /// their store records), held by no context until `restore` finds them for a context of
    /// the same scope and tokens; [`Manager::sweep_shared`] then frees the ones none took.
    /// Records the log does not name, or whose chunk's parent is gone, are freed now.
    pub fn enable_sharing(&mut self, slots: usize) -> Result<()> {
        if self.pool.is_some() {
            return Ok(());
        }
        let src = Arc::new(StoreSource {
            store: Arc::clone(&self.store),
            expected: Arc::clone(&self.expected),
            fallback: Arc::clone(&self.fallback),
            context: POOL_CTX,
        });
        let slots = slots.max(1);
        let region = self.pager.region_with(self.slot_size, slots, src, true)?;
        let ct = self.codec.chunk_tokens();
        let dir = self.store.dir().to_path_buf();
        let full = self.layers(false);
        let mut valid: HashMap<u32, Named> = PoolLog::read(&dir)
            .into_iter()
            .filter(|n| {
                (n.p as usize) < slots
                    && n.tokens.len() == ct
                    && self.store.entry(POOL_CTX, n.p).is_some_and(|e| {
                        let m = e.meta;
                        m.tokens as usize == ct && m.prefix_hash == n.prefix_hash && m.layers == full && self.cfg.levels.contains(&m.format)
                    })
            })
            .map(|n| (n.p, n))
            .collect();
        // A chunk whose parent is gone names a prefix no context can reach.
        loop {
            let orphans: Vec<u32> = valid.values().filter(|n| n.parent.is_some_and(|q| !valid.contains_key(&q))).map(|n| n.p).collect();
            if orphans.is_empty() {
                break;
            }
            for p in orphans {
                valid.remove(&p);
            }
        }
        for p in 0..chunk_u32(slots) {
            if !valid.contains_key(&p) && self.store.entry(POOL_CTX, p).is_some() {
                self.store.discard(POOL_CTX, p);
            }
        }
        let mut live: Vec<Named> = valid.into_values().collect();
        live.sort_by_key(|n| n.p);
        let log = match PoolLog::rewrite(&dir, &live) {
            Ok(l) => Some(l),
            Err(e) => {
                eprintln!("llms: the pool's log in {}: {e}; shared chunks will not outlive this run", dir.display());
                None
            }
        };
        let mut pool = Pool { region: Arc::new(region), entries: Vec::new(), free: Vec::new(), index: HashMap::new(), log, live: 0 };
        for n in live {
            let level = self.store.entry(POOL_CTX, n.p).map(|e| e.meta.format).expect("checked");
            let p = n.p as usize;
            if pool.entries.len() <= p {
                pool.entries.resize_with(p + 1, || None);
            }
            pool.index_add((n.scope, n.prefix_hash), Ident::Pool(n.p));
            pool.live += 1;
            self.epochs += 1;
            pool.entries[p] = Some(Entry {
                scope: n.scope,
                parent: n.parent,
                tokens: n.tokens.into(),
                prefix_hash: n.prefix_hash,
                level,
                density: 0.0,
                sharers: Vec::new(),
                wanted: Vec::new(),
                calls: 0,
                epoch: self.epochs,
                at: Arc::new(AtomicPtr::new(pool.region.slot_ptr(p))),
                home: None,
                retired: None,
            });
        }
        pool.free = (0..chunk_u32(pool.entries.len())).rev().filter(|&p| pool.entries[p as usize].is_none()).collect();
        if pool.live == 0 {
            // Nothing shared: no file left behind for it.
            self.store.remove_context(POOL_CTX)?;
        }
        self.pool = Some(pool);
        for p in 0..self.pool.as_ref().map_or(0, |pl| pl.entries.len()) {
            if let Some(meta) = self.pool_meta(chunk_u32(p)) {
                self.expected.lock().unwrap_or_else(|e| e.into_inner()).insert((POOL_CTX, chunk_u32(p)), meta);
            }
        }
        Ok(())
    }

    /// Frees the shared chunks no context holds (after a start, once every saved context was
    /// restored: what none of them took is unreachable). Returns how many.
    pub fn sweep_shared(&mut self) -> usize {
        let Some(pool) = &self.pool else { return 0 };
        let idle: Vec<u32> = pool
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.as_ref().is_some_and(|e| e.sharers.is_empty()))
            .map(|(p, _)| chunk_u32(p))
            .collect();
        for &p in &idle {
            self.free_entry(p);
        }
        idle.len()
    }

    /// Whether chunks can be shared.
    pub fn sharing(&self) -> bool {
        self.pool.is_some()
    }

    /// Puts `ctx` in `scope` (the service's (uid, app)): its full chunks are shared only with
    /// contexts of the same scope. Call it before `create`/`restore` or any time after; a
    /// context without a scope shares nothing.
    pub fn set_scope(&mut self, ctx: u64, scope: u64) {
        self.scopes.insert(ctx, scope);
    }

    /// Declares token sequences every scope may share (an integrator's system-wide
    /// instructions): a full chunk whose tokens from position 0 lie within one of them is
    /// found from any scope; nothing else crosses scopes. Chunks already indexed keep their
    /// scope until their contexts' next call.
    pub fn set_public_prefixes(&mut self, prefixes: Vec<Vec<u32>>) {
        self.public = prefixes;
    }

    /// The scope chunk `i` of `ctx` (holding `tokens`) is shared in: [`PUBLIC_SCOPE`] when its
    /// whole prefix lies within a declared public prefix, else its context's.
    fn chunk_scope(&self, ctx: u64, i: usize, tokens: &[u32]) -> Option<u64> {
        let own = *self.scopes.get(&ctx)?;
        let end = (i + 1) * self.codec.chunk_tokens();
        let public = tokens.len() >= end && self.public.iter().any(|p| p.len() >= end && p[..end] == tokens[..end]);
        Some(if public { PUBLIC_SCOPE } else { own })
    }

    /// What sharing holds and did: in `scope` (an app's), or in all of them.
    pub fn sharing_stats(&self, scope: Option<u64>) -> SharingStats {
        let mine = |s: u64| scope.is_none_or(|x| x == s);
        let mut s = SharingStats::default();
        for c in self.share_stats.iter().filter(|(k, _)| mine(**k)).map(|(_, c)| c) {
            s = s + SharingStats { unique_chunks: 0, logical_chunks: 0, bytes_saved: 0, ..*c };
        }
        if let Some(pool) = &self.pool {
            let live = || pool.entries.iter().enumerate().filter_map(|(p, e)| e.as_ref().map(|e| (p, e))).filter(|(_, e)| mine(e.scope));
            s.unique_chunks = live().count() as u64;
            s.logical_chunks = live().map(|(_, e)| e.sharers.len() as u64).sum();
            s.bytes_saved = live()
                .filter(|(p, _)| pool.state(chunk_u32(*p)).is_ok_and(|s| s == SlotState::Resident))
                .map(|(_, e)| (e.sharers.len().saturating_sub(1) * self.codec.chunk_bytes(e.level)) as u64)
                .sum();
        }
        s
    }

    /// The record a pool chunk is stored as.
    pub(super) fn pool_meta(&self, p: u32) -> Option<RecordMeta> {
        let e = self.pool.as_ref()?.get(p)?;
        Some(RecordMeta {
            context: POOL_CTX,
            chunk: p,
            format: e.level,
            tokens: chunk_u32(self.codec.chunk_tokens()),
            prefix_hash: e.prefix_hash,
            layers: self.layers(false),
        })
    }

    /// Chunk `i` of `ctx` as a chain link.
    fn ident(&self, ctx: u64, i: usize) -> Option<Ident> {
        let m = self.ctxs.get(&ctx)?.chunks.get(i)?;
        Some(m.shared.map_or(Ident::Own(ctx, chunk_u32(i)), Ident::Pool))
    }

    /// A chunk of `scope` holding exactly `tokens` as chunk `i`, after `prev` (none for the
    /// first), whose prefix hashes to `h`.
    fn lookup(&self, scope: u64, h: u64, prev: Option<Ident>, i: usize, tokens: &[u32]) -> Option<Ident> {
        let keys = [scope, PUBLIC_SCOPE];
        keys[..if scope == PUBLIC_SCOPE { 1 } else { 2 }].iter().find_map(|&key| self.lookup_in(key, h, prev, i, tokens))
    }

    /// [`Manager::lookup`] among the chunks shared in `scope` alone.
    fn lookup_in(&self, scope: u64, h: u64, prev: Option<Ident>, i: usize, tokens: &[u32]) -> Option<Ident> {
        let pool = self.pool.as_ref()?;
        let ct = self.codec.chunk_tokens();
        pool.index.get(&(scope, h))?.iter().copied().find(|&c| match c {
            Ident::Pool(p) => pool.get(p).is_some_and(|e| e.scope == scope && *e.tokens == *tokens && e.parent.map(Ident::Pool) == prev),
            Ident::Own(c2, j) => {
                let Some(x) = self.ctxs.get(&c2) else { return false };
                j as usize == i
                    && !x.in_call
                    && self.chunk_scope(c2, i, &x.tokens) == Some(scope)
                    && x.chunks.get(i).is_some_and(|m| {
                        // Its bytes are at hand: resident, or on flash as they are.
                        let present = x.region.state(i).is_ok_and(|s| s == SlotState::Resident) || self.store.matches(&self.meta(c2, i, m));
                        m.shared.is_none() && !m.dead && m.tokens as usize == ct && present
                    })
                    && x.tokens.get(i * ct..(i + 1) * ct) == Some(tokens)
                    && (if i == 0 { prev.is_none() } else { prev == self.ident(c2, i - 1) })
            }
        })
    }

    /// Leading full chunks of `tokens` that contexts of `scope` hold now and a context made
    /// with these tokens would share instead of computing (see [`Manager::restore`]).
    pub fn cached_prefix(&self, scope: u64, tokens: &[u32]) -> usize {
        let Some(pool) = &self.pool else { return 0 };
        let ct = self.codec.chunk_tokens();
        let hashes = prefix_hashes(tokens, ct);
        let (mut prev, mut n) = (None, 0);
        let mut room = pool.entries.iter().filter(|e| e.is_none()).count() + pool.region.n_slots().saturating_sub(pool.entries.len());
        for i in 0..tokens.len() / ct {
            let Some(id) = self.lookup(scope, hashes[i], prev, i, &tokens[i * ct..(i + 1) * ct]) else { break };
            if matches!(id, Ident::Own(..)) {
                if room == 0 {
                    break;
                }
                room -= 1;
            }
            prev = Some(id);
            n += 1;
        }
        n
    }

    /// Makes `dst` a fork of `src`: `kv` is a cache holding `src`'s tokens and no chunk; every
    /// full chunk of `src` is shared (promoted into the pool first if it is `src`'s own), and
    /// the last, partial chunk is copied (both contexts will write after it, so it is each
    /// one's own). Bookkeeping per chunk; no full chunk is copied. `dst` joins `src`'s scope.
    /// Returns the chunks shared (fewer than the full ones when the pool is full, a chunk is
    /// neither resident nor on flash, or `src`'s first chunks left a sliding window: the rest
    /// is then `dst`'s own, recomputed by its first load).
    pub fn fork(&mut self, src: u64, dst: u64, kv: &mut dyn KvContext) -> Result<usize> {
        let ct = self.codec.chunk_tokens();
        let Some(&scope) = self.scopes.get(&src) else {
            return Err(MmError::Config(format!("context {src} shares nothing (no scope, or sharing is off)")));
        };
        let c = self.ctx(src)?;
        if c.in_call {
            return Err(MmError::Config(format!("context {src} is in a call")));
        }
        if c.tokens != kv.tokens() {
            return Err(MmError::Config(format!("the fork of context {src} must start from its tokens")));
        }
        if self.pool.is_none() {
            return Err(MmError::Config("chunk sharing is off".into()));
        }
        let n_tok = kv.tokens().len();
        // The pool's records are queued for the AoT writer, and its log written, once the
        // loop is done: a writer copying while the pages move would make every move's TLB
        // flush reach its core too (3x slower moves here).
        self.hold_writes(true);
        let promoted = self.promote_prefix(src, n_tok / ct);
        self.hold_writes(false);
        promoted?;
        self.scopes.insert(dst, scope);
        self.restore_from(dst, kv, Some(src))?;
        self.share_stats.entry(scope).or_default().forks += 1;
        let shared = (0..self.n_chunks(dst)).filter(|&i| self.ctx(dst).is_ok_and(|c| c.chunks[i].shared.is_some())).count();
        // The partial chunk: a copy of `src`'s (with neither its memory nor its record, the
        // first load recomputes it from its few tokens).
        self.copy_partial(src, dst, n_tok / ct, kv)?;
        Ok(shared)
    }

    /// Tokens of `tokens` past its first `full` chunks that a context of `scope` (not in a
    /// call) holds as rows of its own chunk `full`, in the base format `base`, after the same
    /// tokens: rows a context made with `tokens[..full * ct + n]` takes with
    /// [`Manager::fill_partial`] instead of computing them. Under a chunk; 0 with `full` 0
    /// (no chunk before them is shared, so there is little to take).
    pub fn partial_prefix(&self, scope: u64, tokens: &[u32], full: usize, base: Format) -> usize {
        self.partial_source(scope, None, tokens, full, base).map_or(0, |(_, n)| n)
    }

    /// Fills `dst`'s last chunk — partial, made by [`Manager::restore`] after shared chunks,
    /// holding nothing yet — with a copy of a context of its scope whose own chunk there holds
    /// the same tokens after the same tokens (see [`Manager::partial_prefix`]). Returns whether
    /// it did; when not, `dst`'s first load recomputes the chunk's few tokens.
    pub fn fill_partial(&mut self, dst: u64, kv: &mut dyn KvContext) -> Result<bool> {
        let ct = self.codec.chunk_tokens();
        let toks = kv.tokens();
        let (full, n) = (toks.len() / ct, toks.len() % ct);
        let Some(&scope) = self.scopes.get(&dst) else { return Ok(false) };
        if n == 0 || full == 0 || self.pool.is_none() || self.ctx(dst)?.chunks.get(full - 1).is_none_or(|m| m.shared.is_none()) {
            return Ok(false);
        }
        match self.partial_source(scope, Some(dst), toks, full, kv.base()) {
            Some((src, m)) if m >= n => self.copy_partial(src, dst, full, kv),
            _ => Ok(false),
        }
    }

    /// A context of `scope` other than `not` for [`Manager::partial_prefix`], and how many of
    /// `tokens[full * ct..]` its chunk `full` holds (the most of any).
    fn partial_source(&self, scope: u64, not: Option<u64>, tokens: &[u32], full: usize, base: Format) -> Option<(u64, usize)> {
        let ct = self.codec.chunk_tokens();
        let at = full * ct;
        if full == 0 || tokens.len() <= at {
            return None;
        }
        let rest = &tokens[at..tokens.len().min(at + ct - 1)];
        // Sharing never crosses scopes: only this app's contexts are looked at (a public
        // prefix's pool chunks have sharers of every app).
        self.scopes
            .iter()
            .filter(|&(&c, &sc)| sc == scope && Some(c) != not)
            .filter_map(|(&c, _)| {
                let x = self.ctxs.get(&c)?;
                let m = x.chunks.get(full)?;
                if x.in_call || m.shared.is_some() || m.dead || m.level != base || x.tokens.get(..at) != Some(&tokens[..at]) {
                    return None;
                }
                let held = &x.tokens[at..x.tokens.len().min(at + m.tokens as usize)];
                let n = held.iter().zip(rest).take_while(|(a, b)| a == b).count();
                (n > 0).then_some((c, n))
            })
            .max_by_key(|&(c, n)| (n, std::cmp::Reverse(c)))
    }

    /// Copies `src`'s chunk `j` (its own, from memory or else its record) into `dst`'s chunk
    /// `j`, its own and holding nothing yet, as many of its tokens as `dst`'s meta says (the
    /// rows past them, `src`'s, are overwritten as `dst` goes on). `src` must hold `dst`'s
    /// tokens up to there (the callers check). Returns whether it copied.
    fn copy_partial(&mut self, src: u64, dst: u64, j: usize, kv: &mut dyn KvContext) -> Result<bool> {
        let (sc, dc) = (self.ctx(src)?, self.ctx(dst)?);
        let (Some(&m), Some(&dm)) = (sc.chunks.get(j), dc.chunks.get(j)) else { return Ok(false) };
        let (sr, dr) = (Arc::clone(&sc.region), Arc::clone(&dc.region));
        // Fewer rows than the source's only from the base format: `dst` writes after them.
        if sc.in_call
            || m.shared.is_some()
            || m.dead
            || dm.shared.is_some()
            || m.tokens < dm.tokens
            || (m.tokens != dm.tokens && m.level != kv.base())
        {
            return Ok(false);
        }
        let len = self.codec.live_bytes(m.level, false);
        if dr.state(j)? == SlotState::Resident {
            dr.discard(j)?;
        }
        if sr.state(j)? == SlotState::Resident {
            // Straight from the source's slot into the new one (one copy, in the kernel): a
            // fork's partial chunk went through the arena first, a second copy of its bytes.
            // SAFETY: resident (mm's lock held, `src` not in a call: nothing evicts or writes
            // it meanwhile) and the whole slot mapped. Past `len` within its last page come
            // the source slot's own bytes (this chunk's, of the context `dst` forks), which
            // nothing reads: a chunk is its `len` bytes.
            let from = unsafe { std::slice::from_raw_parts(sr.slot_ptr(j), self.slot_size) };
            dr.copy_from(j, from, len)?;
        } else {
            let record = self.meta(src, j, &m);
            let buf = &mut self.arena.as_mut_slice()[..self.slot_size];
            if self.store.read(&record, buf).is_err() {
                return Ok(false);
            }
            let tail = len.next_multiple_of(uffd_handler::PAGE).min(self.slot_size);
            buf[len..tail].fill(0);
            dr.copy_from(j, &self.arena.as_mut_slice()[..self.slot_size], len)?;
        }
        let ptr = NonNull::new(dr.slot_ptr(j)).expect("mapped");
        // SAFETY: `dst`'s own slot, resident; `begin` pins it before the engine reads it.
        unsafe { kv.attach(j, ptr, self.slot_size, m.level) }.map_err(engine)?;
        let dm = ChunkMeta { level: m.level, density: m.density, ..dm };
        self.ctxs.get_mut(&dst).ok_or_else(|| MmError::NoContext(dst))?.chunks[j] = dm;
        let meta = self.meta(dst, j, &dm);
        self.expected.lock().unwrap_or_else(|e| e.into_inner()).insert((dst, chunk_u32(j)), meta);
        self.lctru.touch((dst, chunk_u32(j)), self.level_index(m.level));
        if let Some(&scope) = self.scopes.get(&dst) {
            self.share_stats.entry(scope).or_default().copied_rows += u64::from(dm.tokens);
        }
        // Within the budget again (the copy may be the one thing over it: it is then written).
        self.reclaim()?;
        Ok(true)
    }

    /// For [`Manager::restore`]: chunk `i` of a context of `scope` made with `tokens`, shared
    /// when a chunk of the same tokens after the same chunks can be (promoted into the pool
    /// first if it is another context's own). Returns the pool chunk.
    pub(super) fn find_shared(&mut self, scope: Option<u64>, prev: Option<u32>, i: usize, h: u64, tokens: &[u32]) -> Result<Option<u32>> {
        let Some(scope) = scope else { return Ok(None) };
        if i > 0 && prev.is_none() {
            return Ok(None);
        }
        match self.lookup(scope, h, prev.map(Ident::Pool), i, tokens) {
            Some(Ident::Pool(p)) => Ok(Some(p)),
            Some(Ident::Own(c2, j)) => {
                let mut done = Promoted::default();
                let p = self.promote_own(c2, j as usize, &mut done);
                self.settle(c2, done);
                p
            }
            None => Ok(None),
        }
    }

    /// Makes a context's own full chunk a pool chunk (its chunks before it are pool chunks
    /// already): its record becomes the pool's, its place in LCTRU the pool chunk's. A
    /// resident chunk stays where it is, in its context's slot (its home, see [`Home`]): no
    /// byte moves, so a fork of a long context costs bookkeeping only (moving the 270 chunks
    /// of a 4k-token context with UFFDIO_MOVE took 2.5 ms, most of it the kernel's work on
    /// 12k page-table entries). One that is not resident is read from its record into its
    /// pool slot. None when it cannot be: the context is in a call, the pool is full, or the
    /// chunk is neither resident nor readable.
    /// The store's and the fault handler's maps are changed by [`Manager::settle`] once for
    /// all of `done`.
    pub(super) fn promote_own(&mut self, ctx: u64, i: usize, done: &mut Promoted) -> Result<Option<u32>> {
        if let Some(p) = self.ctx(ctx)?.chunks.get(i).and_then(|m| m.shared) {
            return Ok(Some(p));
        }
        if !self.promotable(ctx, i)? || !self.pool.as_ref().is_some_and(Pool::has_room) {
            return Ok(None);
        }
        let c = self.ctx(ctx)?;
        let (m, region) = (c.chunks[i], Arc::clone(&c.region));
        let pool = self.pool.as_mut().expect("checked");
        let p = pool.alloc().expect("checked");
        if region.state(i)? == SlotState::Resident {
            self.adopt(ctx, i, p, true, done)?;
            return Ok(Some(p));
        }
        let len = self.codec.live_bytes(m.level, false);
        let own = self.meta(ctx, i, &m);
        // Through the arena (page-aligned, whole pages).
        let buf = &mut self.arena.as_mut_slice()[..self.slot_size];
        let got = self.store.read(&own, buf).is_ok();
        let pool = self.pool.as_mut().expect("checked");
        if !got {
            pool.free.push(p);
            return Ok(None);
        }
        let tail = len.next_multiple_of(uffd_handler::PAGE).min(buf.len());
        buf[len..tail].fill(0);
        if let Err(e) = pool.region.copy_from(p as usize, &self.arena.as_mut_slice()[..self.slot_size], len) {
            pool.free.push(p);
            return Err(e.into());
        }
        self.adopt(ctx, i, p, false, done)?;
        Ok(Some(p))
    }

    /// Whether chunk `i` of `ctx` may be promoted (the chunk before it is a pool chunk).
    fn promotable(&self, ctx: u64, i: usize) -> Result<bool> {
        let ct = self.codec.chunk_tokens();
        let c = self.ctx(ctx)?;
        let Some(m) = c.chunks.get(i) else { return Ok(false) };
        let parent_ok = i == 0 || c.chunks[i - 1].shared.is_some();
        Ok(parent_ok
            && m.shared.is_none()
            && !c.in_call
            && !m.dead
            && m.tokens as usize == ct
            && self.chunk_scope(ctx, i, &c.tokens).is_some())
    }

    /// The bookkeeping of a promotion, once chunk `i` of `ctx` is pool chunk `p` (`home`: its
    /// bytes stay in the context's slot; else they are in the pool slot): the pool's entry,
    /// index and log, the context's record forgotten, LCTRU, the fault handler's
    /// expectations and the context's record forgotten (noted in `done`), the pool's record
    /// queued.
    fn adopt(&mut self, ctx: u64, i: usize, p: u32, home: bool, done: &mut Promoted) -> Result<()> {
        let ct = self.codec.chunk_tokens();
        let c = self.ctx(ctx)?;
        let scope = self.chunk_scope(ctx, i, &c.tokens).expect("checked promotable");
        let parent = match i {
            0 => None,
            _ => Some(c.chunks[i - 1].shared.expect("promoted in order")),
        };
        let m = c.chunks[i];
        let tokens: Box<[u32]> = c.tokens[i * ct..(i + 1) * ct].into();
        let home = home.then(|| Home { ctx, region: Arc::clone(&c.region), slot: i });
        let len = self.codec.live_bytes(m.level, false);
        self.epochs += 1;
        let pool = self.pool.as_mut().expect("checked");
        pool.live += 1;
        let at = home.as_ref().map_or(pool.region.slot_ptr(p as usize), |h| h.region.slot_ptr(h.slot));
        pool.entries[p as usize] = Some(Entry {
            scope,
            parent,
            tokens,
            prefix_hash: m.prefix_hash,
            level: m.level,
            density: m.density,
            // Room for the sharer a fork attaches next (a second allocation per chunk else).
            sharers: {
                let mut v = Vec::with_capacity(2);
                v.push((ctx, chunk_u32(i)));
                v
            },
            wanted: Vec::new(),
            calls: 0,
            epoch: self.epochs,
            at: Arc::new(AtomicPtr::new(at)),
            home,
            retired: None,
        });
        pool.index_replace((scope, m.prefix_hash), Ident::Own(ctx, chunk_u32(i)), Ident::Pool(p));
        if let Some(log) = &mut pool.log {
            let e = pool.entries[p as usize].as_ref().expect("made");
            log.append(LOG_ADD, &NameRef { p, scope, parent, prefix_hash: m.prefix_hash, tokens: &e.tokens });
        }
        // The context's own record is forgotten (`settle`) and its space given back once the
        // pool's is written (below): one record per chunk, and one on flash at every moment.
        if !self.lctru.rename((ctx, chunk_u32(i)), (POOL_CTX, p)) {
            self.lctru.touch((POOL_CTX, p), self.level_index(m.level));
        }
        self.ctxs.get_mut(&ctx).ok_or_else(|| MmError::NoContext(ctx))?.chunks[i].shared = Some(p);
        let meta = self.pool_meta(p).expect("made");
        done.0.push((chunk_u32(i), p, meta));
        let (region, slot) = self.pool.as_ref().map(|pl| pl.loc(p)).map(|(r, s)| (Arc::clone(r), s)).expect("made");
        self.write_aot_replacing(POOL_CTX, &region, slot, &meta, len, Some((ctx, chunk_u32(i))))?;
        self.share_stats.entry(scope).or_default().promoted += 1;
        Ok(())
    }

    /// Promotes `ctx`'s first `n` chunks until one cannot be.
    fn promote_prefix(&mut self, ctx: u64, n: usize) -> Result<()> {
        if let Some(pool) = self.pool.as_mut() {
            let room = pool.region.n_slots().saturating_sub(pool.entries.len());
            pool.entries.reserve(n.min(room));
        }
        let mut done = Promoted::default();
        let mut result = Ok(());
        for i in 0..n {
            match self.promote_own(ctx, i, &mut done) {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.settle(ctx, done);
        result
    }

    /// The maps other threads read, changed for promotions of `ctx`'s chunks under one lock
    /// each: the fault handler's expectations (a promoted chunk is the pool's record now) and
    /// the store's index (the context's own record is forgotten). Until then nothing reads
    /// them for these chunks: mm's lock is held, and a promoted chunk stays resident (at home,
    /// or in its pool slot just filled).
    pub(super) fn settle(&mut self, ctx: u64, done: Promoted) {
        if done.0.is_empty() {
            return;
        }
        self.store.invalidate_all(ctx, done.0.iter().map(|d| d.0));
        let mut ex = self.expected.lock().unwrap_or_else(|e| e.into_inner());
        for (i, p, meta) in done.0 {
            ex.remove(&(ctx, i));
            ex.insert((POOL_CTX, p), meta);
        }
    }

    /// Moves pool chunk `p` out of its home into its pool slot: its home context needs the
    /// slot (it cuts back into the chunk) or goes. One UFFDIO_MOVE where the kernel has it
    /// and no sharer holds the chunk in a call, else a copy. Every sharer's engine reads the
    /// chunk at its new place from its next read on ([`Entry::at`]); pins of sharers in a
    /// call move with it.
    ///
    /// `retire`: the home context is going while sharers are in a call, and one of their
    /// passes may be reading the home slot on another thread right now: the chunk is copied
    /// and the home slot's region kept mapped, untouched, until no sharer is in a call.
    /// Without it the caller runs no pass meanwhile (the calling thread is the one that runs
    /// them, or no sharer is in a call). Returns the home slot when it was kept so.
    pub(super) fn unhome(&mut self, p: u32, retire: bool) -> Result<Option<usize>> {
        let Some(pool) = self.pool.as_ref() else { return Ok(None) };
        let Some(e) = pool.get(p) else { return Ok(None) };
        let Some(h) = e.home.as_ref() else { return Ok(None) };
        let (region, slot, calls) = (Arc::clone(&h.region), h.slot, e.calls);
        let len = self.codec.live_bytes(e.level, false);
        let pool_region = Arc::clone(&pool.region);
        if let Some(w) = &self.writer {
            // The writer pins the home slot while it copies the pool's record from it (or
            // the context's own, queued before the promotion).
            w.wait_chunk((POOL_CTX, p));
            w.wait_chunk((h.ctx, chunk_u32(slot)));
        }
        let retire = retire && calls > 0;
        let mut moved = false;
        if !retire {
            for _ in 0..calls {
                region.unpin(slot)?;
            }
            moved = region.move_into(slot, &pool_region, p as usize, 1)?;
        }
        if !moved {
            self.stage_slot(&region, slot, len, len);
            pool_region.copy_from(p as usize, &self.arena.as_mut_slice()[..self.slot_size], len)?;
            if !retire {
                region.discard(slot)?;
            }
        }
        for _ in 0..calls {
            pool_region.pin(p as usize)?;
        }
        let h = self.left_home(p).expect("checked");
        let e = self.pool.as_mut().and_then(|pl| pl.get_mut(p)).expect("checked");
        if retire {
            e.retired = Some(h.region);
        }
        let scope = e.scope;
        self.share_stats.entry(scope).or_default().moved += u64::from(moved);
        Ok(retire.then_some(slot))
    }

    /// Holds back (`true`) the AoT writer's jobs and the pool log's records until released
    /// (`false`), which sends and writes them all.
    fn hold_writes(&mut self, hold: bool) {
        if let Some(log) = self.pool.as_mut().and_then(|p| p.log.as_mut()) {
            if hold {
                log.hold();
            } else {
                log.release();
            }
        }
        self.hold_aot(hold);
    }

    /// Makes chunk `i` of `ctx` (pushed, not yet attached) a sharer of pool chunk `p`.
    pub(super) fn attach_shared(&mut self, ctx: u64, i: usize, p: u32, kv: &mut dyn KvContext) -> Result<Format> {
        let pool = self.pool.as_mut().expect("sharing");
        let e = pool.get_mut(p).expect("a live pool chunk");
        e.sharers.push((ctx, chunk_u32(i)));
        let (level, scope, at) = (e.level, e.scope, Arc::clone(&e.at));
        // SAFETY: the chunk's slot (its home's or the pool's, which lives as long as the
        // manager) stays mapped while `at` names it; `begin` makes it resident and pins it
        // before the engine reads it, and nothing writes a shared chunk.
        unsafe { kv.attach_moving(i, at, self.slot_size, level) }.map_err(engine)?;
        self.share_stats.entry(scope).or_default().reused += 1;
        Ok(level)
    }

    /// Drops `ctx`'s hold on pool chunk `p` (its chunk `i`; `held`: counted in the chunk's
    /// calls and pinned); the chunk goes with its last sharer.
    pub(super) fn release(&mut self, ctx: u64, i: usize, p: u32, held: bool) {
        let Some(pool) = self.pool.as_mut() else { return };
        let (region, slot) = pool.loc(p);
        let (region, slot) = (Arc::clone(region), slot);
        let Some(e) = pool.get_mut(p) else { return };
        e.sharers.retain(|&s| s != (ctx, chunk_u32(i)));
        e.wanted.retain(|&(c, _)| c != ctx);
        if held {
            let _ = self.leave_call(p);
        }
        let Some(e) = self.pool.as_ref().and_then(|pl| pl.get(p)) else { return };
        if !e.sharers.is_empty() {
            // Still held by others: reclaim may take it when none of them is in a call.
            let level = e.level;
            if region.state(slot).is_ok_and(|s| s == SlotState::Resident) {
                self.lctru.touch((POOL_CTX, p), self.level_index(level));
            }
            return;
        }
        self.free_entry(p);
    }

    /// Pool chunk `p` is in its pool slot from now on (moved there, or evicted at its home and
    /// read back there when a sharer next needs it): every sharer's engine reads it there.
    /// Returns the home it left, if it had one.
    pub(super) fn left_home(&mut self, p: u32) -> Option<Home> {
        let pool = self.pool.as_mut()?;
        let ptr = pool.region.slot_ptr(p as usize);
        let e = pool.get_mut(p)?;
        let h = e.home.take()?;
        e.at.store(ptr, Ordering::Release);
        Some(h)
    }

    /// A sharer of pool chunk `p` is out of its call: one call fewer, one pin fewer where the
    /// chunk is; with none left, a home it left during a call goes.
    pub(super) fn leave_call(&mut self, p: u32) -> Result<()> {
        let Some(pool) = self.pool.as_mut() else { return Ok(()) };
        let (region, slot) = pool.loc(p);
        let (region, slot) = (Arc::clone(region), slot);
        let Some(e) = pool.get_mut(p) else { return Ok(()) };
        e.calls = e.calls.saturating_sub(1);
        let retired = if e.calls == 0 { e.retired.take() } else { None };
        if let Some(r) = retired {
            // No pass reads the old home now: its region goes (unmapped on the reaper).
            self.store.reaper().release(Box::new(r));
        }
        region.unpin(slot)?;
        Ok(())
    }

    /// Frees pool chunk `p` (no context holds it): its slot, record, name and place in LCTRU.
    fn free_entry(&mut self, p: u32) {
        let Some(pool) = self.pool.as_mut() else { return };
        let Some(e) = pool.entries.get_mut(p as usize).and_then(Option::take) else { return };
        let region = Arc::clone(&pool.region);
        pool.index_remove((e.scope, e.prefix_hash), Ident::Pool(p));
        if let Some(log) = &mut pool.log {
            log.append(LOG_DEL, &NameRef { p, scope: e.scope, parent: e.parent, prefix_hash: e.prefix_hash, tokens: &e.tokens });
        }
        if let Some(w) = &self.writer {
            if w.is_pending((POOL_CTX, p)) {
                // The writer still holds the slot: let it finish before the slot is reused.
                w.wait_context(POOL_CTX);
            }
        }
        // A chunk still at home is its home context's to keep or drop (that context is the
        // last sharer, releasing it: [`Manager::close`], [`Manager::unshare_from`]).
        let _ = region.discard(p as usize);
        if let Some(r) = e.retired {
            self.store.reaper().release(Box::new(r));
        }
        self.store.discard(POOL_CTX, p);
        if let Some(pool) = self.pool.as_mut() {
            pool.free.push(p);
            pool.live -= 1;
            if pool.live == 0 {
                // The last shared chunk went: so does the pool's store file.
                let _ = self.store.remove_context(POOL_CTX);
            }
        }
        self.lctru.remove((POOL_CTX, p));
        self.expected.lock().unwrap_or_else(|e| e.into_inner()).remove(&(POOL_CTX, p));
        self.levelling.retain(|j| (j.ctx, j.chunk) != (POOL_CTX, p as usize));
    }

    /// Takes chunks `from..` of `ctx` out of the pool, last first (its shared chunks stay a
    /// prefix), each as `how` says. In a call the chunks stay pinned in their new memory.
    /// `held`: the context counted itself a caller of those pool chunks and pinned them
    /// (`begin` did), which is undone.
    pub(super) fn unshare_from(&mut self, ctx: u64, kv: &mut dyn KvContext, from: usize, how: Unshare, held: bool) -> Result<()> {
        let base = kv.base();
        let c = self.ctx(ctx)?;
        let (region, in_call) = (Arc::clone(&c.region), c.in_call);
        let shared: Vec<(usize, u32)> = c.chunks.iter().enumerate().skip(from).filter_map(|(i, m)| m.shared.map(|p| (i, p))).collect();
        for &(i, p) in shared.iter().rev() {
            let m = self.ctx(ctx)?.chunks[i];
            if self.pool.as_ref().and_then(|pl| pl.get(p)).and_then(|e| e.home.as_ref()).is_some_and(|h| h.ctx == ctx) {
                // Its bytes are in this context's slot, which the context now wants for its own:
                // they move to the pool slot (the caller runs the passes: none is running).
                self.unhome(p, false)?;
            }
            let (at, at_slot) = self.pool.as_ref().expect("sharing").loc(p);
            let (at, at_slot) = (Arc::clone(at), at_slot);
            let level = match how {
                Unshare::Copy if at.state(at_slot)? == SlotState::Resident => {
                    let len = self.codec.live_bytes(m.level, false);
                    // Room for the base format: the engine brings a chunk it cuts into back to it.
                    let room = len.max(self.codec.chunk_bytes(base));
                    self.stage_slot(&at, at_slot, len, room);
                    if region.state(i)? == SlotState::Resident {
                        region.discard(i)?;
                    }
                    region.copy_from(i, &self.arena.as_mut_slice()[..self.slot_size], room)?;
                    let scope = self.scopes.get(&ctx).copied().unwrap_or(0);
                    self.share_stats.entry(scope).or_default().copied_on_write += 1;
                    m.level
                }
                Unshare::Copy | Unshare::Fresh if in_call => {
                    self.claim(&region, i, self.codec.chunk_bytes(base))?;
                    base
                }
                _ => {
                    if region.state(i)? == SlotState::Resident {
                        region.discard(i)?;
                    }
                    base
                }
            };
            if in_call && region.state(i)? == SlotState::Resident {
                region.pin(i)?;
            }
            self.release(ctx, i, p, held);
            let ptr = NonNull::new(region.slot_ptr(i)).expect("mapped");
            // SAFETY: the context's own slot, resident and pinned when in a call; otherwise
            // `begin` loads it before the engine reads it.
            unsafe { kv.attach(i, ptr, self.slot_size, level) }.map_err(engine)?;
            let cm = &mut self.ctxs.get_mut(&ctx).ok_or_else(|| MmError::NoContext(ctx))?.chunks[i];
            cm.shared = None;
            cm.level = level;
            let m = *cm;
            let meta = self.meta(ctx, i, &m);
            self.expected.lock().unwrap_or_else(|e| e.into_inner()).insert((ctx, chunk_u32(i)), meta);
        }
        Ok(())
    }

    /// Stages the first `len` bytes of resident `slot` of `region` in the arena for
    /// `Region::copy_from` (page-aligned, whole pages), zeroed after them up to `room`: the
    /// slot's own pages past `len` may be gone, so it is not copied from in place.
    fn stage_slot(&mut self, region: &Region, slot: usize, len: usize, room: usize) {
        let buf = &mut self.arena.as_mut_slice()[..self.slot_size];
        // SAFETY: the caller holds the slot resident and nothing writes it meanwhile (its
        // context is not in a call, or the call is the one asking, and mm holds its lock).
        buf[..len].copy_from_slice(unsafe { std::slice::from_raw_parts(region.slot_ptr(slot), len) });
        let tail = room.max(len).next_multiple_of(uffd_handler::PAGE).min(buf.len());
        buf[len..tail].fill(0);
    }

    /// The engine is about to forget positions `n..` of `ctx` and write new ones there: the
    /// shared chunks holding any of those positions become the context's own first (a chunk
    /// partly kept is copied; one dropped whole gets fresh memory), so a write never reaches
    /// another context's K/V. Call it before truncating the engine's cache.
    pub fn truncate(&mut self, ctx: u64, kv: &mut dyn KvContext, n: usize) -> Result<()> {
        let ct = self.codec.chunk_tokens();
        if let Some(w) = &self.writer {
            // The chunks from the cut on are written anew (`begin` did not wait for them).
            w.wait_chunks(ctx, n / ct);
        }
        if self.pool.is_some() {
            self.unindex_own(ctx);
            let held = self.ctx(ctx)?.in_call;
            // Dropped whole first (fresh memory), then the one partly kept (copied).
            self.unshare_from(ctx, kv, n.div_ceil(ct), Unshare::Fresh, held)?;
            self.unshare_from(ctx, kv, n / ct, Unshare::Copy, held)?;
        }
        // A partly kept chunk at a lower level goes back to the base format in its memory:
        // its slot, shrunk to the lower level's pages, gets room for the base format first.
        let j = n / ct;
        let c = self.ctx(ctx)?;
        let Some(&m) = c.chunks.get(j).filter(|_| !n.is_multiple_of(ct)) else { return Ok(()) };
        let region = Arc::clone(&c.region);
        let (base, in_call) = (kv.base(), c.in_call);
        let (len, room) = (self.codec.live_bytes(m.level, m.dead), self.codec.chunk_bytes(base));
        if m.shared.is_some() || m.dead || len >= room || region.state(j)? != SlotState::Resident {
            return Ok(());
        }
        self.stage_slot(&region, j, len, room);
        if in_call {
            region.unpin(j)?;
        }
        region.discard(j)?;
        region.copy_from(j, &self.arena.as_mut_slice()[..self.slot_size], room)?;
        if in_call {
            region.pin(j)?;
        }
        Ok(())
    }

    /// Removes `ctx`'s own chunks from the index (it is in a call, closing, or its tokens change).
    pub(super) fn unindex_own(&mut self, ctx: u64) {
        let Some(c) = self.ctxs.get(&ctx) else { return };
        let keys: Vec<(usize, Option<u64>, u64)> = c
            .chunks
            .iter()
            .enumerate()
            .filter(|(_, m)| m.shared.is_none())
            .map(|(i, m)| (i, self.chunk_scope(ctx, i, &c.tokens), m.prefix_hash))
            .collect();
        let Some(pool) = self.pool.as_mut() else { return };
        for (i, scope, h) in keys {
            if let Some(scope) = scope {
                pool.index_remove((scope, h), Ident::Own(ctx, chunk_u32(i)));
            }
        }
    }

    /// Adds `ctx`'s own full live chunks to the index (its tokens copied for the check).
    pub(super) fn index_own(&mut self, ctx: u64, tokens: &[u32]) {
        let ct = self.codec.chunk_tokens();
        if self.pool.is_none() || !self.scopes.contains_key(&ctx) {
            return;
        }
        let Some(c) = self.ctxs.get_mut(&ctx) else { return };
        c.tokens.clear();
        c.tokens.extend_from_slice(tokens);
        let c = &self.ctxs[&ctx];
        let keys: Vec<(usize, Option<u64>, u64)> = c
            .chunks
            .iter()
            .enumerate()
            .filter(|(_, m)| m.shared.is_none() && !m.dead && m.tokens as usize == ct)
            .map(|(i, m)| (i, self.chunk_scope(ctx, i, tokens), m.prefix_hash))
            .collect();
        let pool = self.pool.as_mut().expect("checked");
        for (i, scope, h) in keys {
            if let Some(scope) = scope {
                pool.index_add((scope, h), Ident::Own(ctx, chunk_u32(i)));
            }
        }
    }

    /// A shared chunk's level after its sharer `ctx` chose `want` for it (`end`): the heaviest
    /// any sharer chose, once all have. A lowering is queued (background levels) or done now
    /// when no sharer is in a call. Returns its level now.
    pub(super) fn want_level(&mut self, ctx: u64, p: u32, want: Format) -> Result<Format> {
        let background = self.background_levels;
        let pool = self.pool.as_mut().expect("sharing");
        let resident = pool.state(p)? == SlotState::Resident;
        let e = pool.get_mut(p).expect("a live pool chunk");
        match e.wanted.iter_mut().find(|(c, _)| *c == ctx) {
            Some(w) => w.1 = want,
            None => e.wanted.push((ctx, want)),
        }
        let cur = e.level;
        let all = e.sharers.iter().all(|(c, _)| e.wanted.iter().any(|(w, _)| w == c));
        let heaviest = e.wanted.iter().map(|&(_, f)| f).max_by_key(|&f| self.codec.chunk_bytes(f)).unwrap_or(cur);
        if !all || e.calls > 0 || self.codec.chunk_bytes(heaviest) >= self.codec.chunk_bytes(cur) {
            return Ok(cur);
        }
        if !resident {
            return Ok(cur);
        }
        let job = LevelJob { ctx: POOL_CTX, chunk: p as usize, from: cur, to: heaviest, epoch: e.epoch };
        if background {
            if !self.levelling.iter().any(|j| (j.ctx, j.chunk) == (POOL_CTX, p as usize)) {
                self.levelling.push_back(job);
            }
            return Ok(cur);
        }
        // Inline (no leveller): the codec's conversion of a copy, installed now.
        let Some(w) = self.take_job(job) else { return Ok(cur) };
        let lowered = w.encode(&*self.codec);
        self.finish_level_work(w, lowered)?;
        Ok(self.pool.as_ref().and_then(|pl| pl.get(p)).map_or(cur, |e| e.level))
    }
}

impl Manager {
    /// `end` for chunk `i` of `ctx`, shared as pool chunk `p` (out of this call already): its
    /// level (`target`, this context's choice, counts as one sharer's), its record (written
    /// once, whichever sharer ends first), its place in LCTRU.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn end_shared(
        &mut self,
        ctx: u64,
        kv: &mut dyn KvContext,
        i: usize,
        p: u32,
        target: Option<Format>,
        density: Option<f64>,
        dead: bool,
    ) -> Result<()> {
        let level = match target {
            Some(t) => self.want_level(ctx, p, t)?,
            None => self.pool.as_ref().and_then(|pl| pl.get(p)).expect("a live pool chunk").level,
        };
        let pool = self.pool.as_mut().expect("sharing");
        let (region, slot) = pool.loc(p);
        let (region, slot) = (Arc::clone(region), slot);
        let e = pool.get_mut(p).expect("a live pool chunk");
        if let Some(d) = density {
            e.density = e.density.max(d);
        }
        let (prefix_hash, at) = (e.prefix_hash, Arc::clone(&e.at));
        if kv.format(i) != level {
            // SAFETY: as in `attach_shared`; lowered just now, with no sharer in a call.
            unsafe { kv.attach_moving(i, at, self.slot_size, level) }.map_err(engine)?;
        }
        let tokens = chunk_u32(self.codec.chunk_tokens());
        let m = ChunkMeta { level, tokens, prefix_hash, density: density.unwrap_or(0.0), dead, shared: Some(p) };
        self.ctxs.get_mut(&ctx).ok_or_else(|| MmError::NoContext(ctx))?.chunks[i] = m;
        let meta = self.pool_meta(p).expect("a live pool chunk");
        let queued = self.levelling.iter().any(|j| (j.ctx, j.chunk) == (POOL_CTX, p as usize));
        let pending = self.writer.as_ref().is_some_and(|w| w.is_pending((POOL_CTX, p)));
        let resident = region.state(slot)? == SlotState::Resident;
        if !queued && !pending && resident && !self.store.matches(&meta) {
            self.write_aot_len(POOL_CTX, &region, slot, &meta, self.codec.live_bytes(level, false))?;
        }
        if resident {
            self.lctru.touch((POOL_CTX, p), self.level_index(level));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_keeps_one_of_each_and_forgets_empty_keys() {
        let Some(pager) = llms_tests::require_kernel("userfaultfd", uffd_handler::Pager::new()) else { return };
        struct Never;
        impl uffd_handler::SlotSource for Never {
            fn fill(&self, _: uffd_handler::RegionId, _: usize, _: &mut [u8]) -> std::result::Result<usize, uffd_handler::SourceError> {
                Err("never".into())
            }
        }
        let region = pager.region(4096, 2, Arc::new(Never)).unwrap();
        let mut pool = Pool { region: Arc::new(region), entries: Vec::new(), free: Vec::new(), index: HashMap::new(), log: None, live: 0 };
        pool.index_add((1, 7), Ident::Pool(0));
        pool.index_add((1, 7), Ident::Pool(0));
        pool.index_add((1, 7), Ident::Own(3, 0));
        assert_eq!(pool.index[&(1, 7)].len(), 2);
        pool.index_remove((1, 7), Ident::Pool(0));
        pool.index_remove((1, 7), Ident::Own(3, 0));
        assert!(pool.index.is_empty());
        assert_eq!((pool.alloc(), pool.alloc(), pool.alloc()), (Some(0), Some(1), None), "two slots, two chunks");
        // A promotion's replace is a remove then an add: the new one last, each once.
        pool.index_add((2, 9), Ident::Own(4, 1));
        pool.index_add((2, 9), Ident::Own(5, 1));
        pool.index_replace((2, 9), Ident::Own(4, 1), Ident::Pool(1));
        assert_eq!(pool.index[&(2, 9)], vec![Ident::Own(5, 1), Ident::Pool(1)]);
        pool.index_replace((2, 9), Ident::Own(5, 1), Ident::Pool(1));
        assert_eq!(pool.index[&(2, 9)], vec![Ident::Pool(1)]);
        pool.index_replace((3, 1), Ident::Own(6, 0), Ident::Pool(0));
        assert_eq!(pool.index[&(3, 1)], vec![Ident::Pool(0)]);
    }

    /// The log reads back what was written whole at start and appended since, held or not; a
    /// torn last record ends the reading and what came before stays.
    #[test]
    fn the_pool_log_reads_back_its_records() {
        let dir = tempfile::tempdir().unwrap();
        let named = |p: u32, parent: Option<u32>| Named {
            p,
            scope: 7,
            parent,
            prefix_hash: 0x1234 + u64::from(p),
            tokens: (0..16).map(|t| t * 3 + p).collect(),
        };
        let mut log = PoolLog::rewrite(dir.path(), &[named(0, None), named(1, Some(0))]).unwrap();
        log.hold();
        log.append(LOG_ADD, &named(2, Some(1)).as_ref());
        log.append(LOG_DEL, &named(1, Some(0)).as_ref());
        log.release();
        log.append(LOG_ADD, &named(3, Some(2)).as_ref());
        assert_eq!(PoolLog::read(dir.path()), vec![named(0, None), named(2, Some(1)), named(3, Some(2))]);
        let path = PoolLog::path(dir.path());
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        assert_eq!(PoolLog::read(dir.path()), vec![named(0, None), named(2, Some(1))]);
    }
}

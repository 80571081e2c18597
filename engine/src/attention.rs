//! Attention over a context's chunked KV cache, read in place in each chunk's format (f16,
//! int8, the reduced and the split levels): `attention` for a batch of query rows of one
//! context (prefill), `attend_spans` for one query row of each of several contexts (a decode
//! step), split over the thread pool by spans of chunks. Reduced blocks are decoded once per
//! span (to int8 when exact, else to f32) where their kernels cannot read them in place.
#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use crate::kernels::{self, OutPtr};
use crate::kv::KvFormat;
use crate::kvcache::ChunkedKv;
use crate::loader::Config;
use crate::pool::ThreadPool;

/// Attention received per position: the sum of probabilities over (row, head, layer) and the
/// number of (row, head, layer) triples that could see the position.
#[derive(Debug, Default, Clone)]
pub struct AttentionStats {
    pub sum: Vec<f64>,
    pub count: Vec<u64>,
}

impl AttentionStats {
    /// Adds attention rows (`probs[i * ld ..][..limits[i]]`, one row per query of one head
    /// of one layer): every position a row can see gets its probability and one count.
    pub fn add_rows(&mut self, probs: &[f32], ld: usize, limits: &[usize]) {
        // The crate builds for baseline x86-64, where these loops took 2 lanes at a time
        // (SSE2); each position's sums are the same operations in the same order at any width.
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has_avx2() {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { self.add_rows_avx2(probs, ld, limits) };
        }
        self.add_rows_body(probs, ld, limits);
    }

    /// [`Self::add_rows`] compiled for AVX2.
    ///
    /// # Safety
    /// Needs AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn add_rows_avx2(&mut self, probs: &[f32], ld: usize, limits: &[usize]) {
        self.add_rows_body(probs, ld, limits);
    }

    #[inline(always)]
    fn add_rows_body(&mut self, probs: &[f32], ld: usize, limits: &[usize]) {
        for (i, &lim) in limits.iter().enumerate() {
            if self.sum.len() < lim {
                self.sum.resize(lim, 0.0);
                self.count.resize(lim, 0);
            }
            // Zipped slices, no index: the service observes every row of every pass, and the
            // indexed loop's bounds checks kept it scalar (1.74% of `llms bench-serve`'s CPU
            // samples; 0.82% so).
            let row = &probs[i * ld..i * ld + lim];
            for (s, &a) in self.sum[..lim].iter_mut().zip(row) {
                *s += f64::from(a);
            }
            for c in &mut self.count[..lim] {
                *c += 1;
            }
        }
    }

    /// The totals [`Self::add_rows`] would add for these rows, into `sum` and `count` (sized to
    /// the longest row): per position, the probabilities the rows give it and how many rows
    /// see it.
    pub fn totals(probs: &[f32], ld: usize, limits: &[usize], sum: &mut Vec<f64>, count: &mut Vec<u64>) {
        // As `add_rows`: the same sums at any width, on AVX2 where the CPU has it.
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has_avx2() {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { Self::totals_avx2(probs, ld, limits, sum, count) };
        }
        Self::totals_body(probs, ld, limits, sum, count);
    }

    /// [`Self::totals`] compiled for AVX2.
    ///
    /// # Safety
    /// Needs AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn totals_avx2(probs: &[f32], ld: usize, limits: &[usize], sum: &mut Vec<f64>, count: &mut Vec<u64>) {
        Self::totals_body(probs, ld, limits, sum, count);
    }

    #[inline(always)]
    fn totals_body(probs: &[f32], ld: usize, limits: &[usize], sum: &mut Vec<f64>, count: &mut Vec<u64>) {
        let n = limits.iter().copied().max().unwrap_or(0);
        sum.clear();
        sum.resize(n, 0.0);
        count.clear();
        count.resize(n, 0);
        for (i, &lim) in limits.iter().enumerate().filter(|(_, &lim)| lim > 0) {
            for (s, &a) in sum[..lim].iter_mut().zip(&probs[i * ld..i * ld + lim]) {
                *s += f64::from(a);
            }
            // A row sees positions 0..lim: marked at its last, then summed from the top down,
            // so count[p] is the rows whose limit is above p.
            count[lim - 1] += 1;
        }
        for p in (0..n.saturating_sub(1)).rev() {
            count[p] += count[p + 1];
        }
    }

    /// Adds totals from [`Self::totals`]. The same sums as adding the rows one by one: the
    /// probabilities are f16 values (softmax rounds them), each a multiple of 2^-24 at most 1,
    /// so their sums are exact in f64 in any order.
    pub fn add_totals(&mut self, sum: &[f64], count: &[u64]) {
        let n = sum.len().min(count.len());
        if self.sum.len() < n {
            self.sum.resize(n, 0.0);
            self.count.resize(n, 0);
        }
        for (s, &a) in self.sum[..n].iter_mut().zip(sum) {
            *s += a;
        }
        for (c, &k) in self.count[..n].iter_mut().zip(count) {
            *c += k;
        }
    }

    /// Information density of a range of positions (LLMS eq. 1): each token's received
    /// attention averaged over the rows that see it, the heads and the layers; then averaged
    /// over the tokens of the range.
    #[allow(clippy::cast_precision_loss)]
    pub fn density(&self, range: std::ops::Range<usize>) -> f64 {
        let toks: Vec<f64> =
            range.filter(|&p| p < self.count.len() && self.count[p] > 0).map(|p| self.sum[p] / self.count[p] as f64).collect();
        if toks.is_empty() {
            0.0
        } else {
            toks.iter().sum::<f64>() / toks.len() as f64
        }
    }
}

/// Where a reduced chunk's blocks are decoded to.
enum Dst<'a> {
    Int8(&'a mut [u8]),
    F32(&'a mut [f32]),
}

/// Attention computes queries in tiles of this many tokens; a pass with at most one tile per
/// context (decoding) runs [`attend_spans`].
pub(crate) const TILE: usize = 8;

/// Whether chunks of format `f` are decoded before attention's jobs start: the reduced levels
/// that are not read in place, except Q4/Q2 when each job decodes the blocks it reads
/// (`in_job`).
fn up_front(f: KvFormat, in_job: bool, hd: usize) -> bool {
    !(f.is_base() || f.split() || in_job && crate::kv::decodes_to_int8(f, hd))
}

/// Decodes the chunks of layer `layer` that attention over `positions` reads and cannot read
/// in place ([`up_front`]) into `dec8` (int8 blocks) and `dec32` (f32), spread over the pool;
/// returns each chunk's slot in them (empty when there is none).
#[allow(clippy::too_many_arguments)]
fn decode_up_front(
    pool: &ThreadPool,
    c: &Config,
    kv: &ChunkedKv,
    layer: usize,
    positions: &[usize],
    in_job: bool,
    dec8: &mut Vec<u8>,
    dec32: &mut Vec<f32>,
) -> Vec<usize> {
    let (hd, ct) = (c.head_dim, kv.geom.chunk_tokens);
    let seen = positions.iter().copied().max().map_or(0, |p| p + 1);
    let last = seen.div_ceil(ct);
    let first = first_chunk(c, kv, layer, positions);
    let reduced = |ch: &usize| *ch >= first && up_front(kv.format(*ch), in_job, hd);
    if !(0..last).any(|ch| reduced(&ch)) {
        return Vec::new();
    }
    let blk8 = kv.geom.head_block_bytes(KvFormat::Int8, 0);
    let blocks = 2 * c.n_kv_heads;
    let to8 = |ch: &usize| crate::kv::decodes_to_int8(kv.format(*ch), hd);
    let mut slot_of = vec![usize::MAX; last];
    let (mut n8, mut n32) = (0, 0);
    for (ch, slot) in slot_of.iter_mut().enumerate().filter(|(ch, _)| reduced(ch)) {
        if to8(&ch) {
            (*slot, n8) = (n8, n8 + 1);
        } else {
            (*slot, n32) = (n32, n32 + 1);
        }
    }
    dec8.resize(n8 * blocks * blk8, 0);
    dec32.resize(n32 * blocks * ct * hd, 0.0);
    let items8 = (0..last).filter(reduced).filter(to8).zip(dec8.chunks_exact_mut(blocks * blk8).map(Dst::Int8));
    let items32 = (0..last).filter(reduced).filter(|ch| !to8(ch)).zip(dec32.chunks_exact_mut(blocks * ct * hd).map(Dst::F32));
    pool.scatter("kv decode", items8.chain(items32).collect(), &|(ch, mut dst)| {
        let f = kv.format(ch);
        let n_c = ct.min(seen - ch * ct);
        for b in 0..blocks {
            let kvsel = b / c.n_kv_heads;
            let off = kv.block_offset(f, layer, kvsel, b % c.n_kv_heads);
            let src = &kv.chunk(ch)[off..off + kv.geom.head_block_bytes(f, kvsel)];
            match &mut dst {
                Dst::Int8(d) => {
                    kernels::decode_block_to_int8(f, src, ct, hd, n_c, &mut d[b * blk8..(b + 1) * blk8]);
                }
                Dst::F32(d) => crate::kv::read_block_f32(f, kvsel, src, ct, hd, n_c, &mut d[b * ct * hd..(b + 1) * ct * hd]),
            }
        }
    });
    slot_of
}

/// The first chunk any of the queries at `positions` sees in `layer`: a local layer's chunks
/// wholly before every query's window are neither read nor decoded (their scores are masked
/// to -inf, so they add exact zeros; a memory manager may have given their bytes back, see
/// [`ChunkedKv::set_dead`]).
fn first_chunk(c: &Config, kv: &ChunkedKv, layer: usize, positions: &[usize]) -> usize {
    let first = positions.iter().copied().min().map_or(0, |p| c.window_start(layer, p)) / kv.geom.chunk_tokens;
    debug_assert!(!c.is_local(layer) || first >= kv.dead(), "a local layer's window reaches a dead chunk");
    first
}

/// Decoding attention splits the context into spans of this many tokens (rounded to whole
/// chunks): a job is one KV head's whole GQA group over one span. A fixed length, not a
/// share of the threads, so the bits do not depend on the thread count.
const SPAN_TOKENS: usize = 128;

/// How one layer's chunks are read by attention: base-format and split-level blocks in place,
/// Q4/Q2 decoded to int8 by the job that reads them (`in_job`) or up front, rotated levels
/// decoded up front to f32 (`slot_of` indexes `dec8` / `dec32` in blocks of [kvsel][kv head]).
struct LayerBlocks<'a> {
    kv: &'a ChunkedKv,
    hd: usize,
    n_kv_heads: usize,
    in_job: bool,
    slot_of: &'a [usize],
    dec8: &'a [u8],
    dec32: &'a [f32],
    /// Per format (`KvFormat::ALL`'s order): where this layer starts in a chunk, and a K and a
    /// V head block's bytes. Worked out once here: from the format at every block's ask and
    /// read, they were 1.6% of a 7-context step on one thread (`perf`, docs/notes/engine.md).
    geo: [[usize; 3]; KvFormat::ALL.len()],
}

/// [`LayerBlocks::geo`] of `layer` in `kv`'s chunks.
fn layer_geometry(kv: &ChunkedKv, layer: usize) -> [[usize; 3]; KvFormat::ALL.len()] {
    KvFormat::ALL.map(|f| [kv.block_offset(f, layer, 0, 0), kv.geom.head_block_bytes(f, 0), kv.geom.head_block_bytes(f, 1)])
}

/// A job's buffers for [`LayerBlocks::rows`]: a Q4/Q2 block decoded to int8, a split K
/// block's channel zero points and steps, a split V block's token scales.
#[derive(Default)]
struct BlockScratch {
    own8: Vec<u8>,
    zero: Vec<f32>,
    step: Vec<f32>,
    scales: Vec<f32>,
}

impl BlockScratch {
    fn fit(&mut self, b: &LayerBlocks) {
        let blk8 = if b.in_job { b.kv.geom.head_block_bytes(KvFormat::Int8, 0) } else { 0 };
        self.own8.resize(blk8, 0);
        self.zero.resize(b.hd, 0.0);
        self.step.resize(b.hd, 0.0);
        self.scales.resize(b.kv.geom.chunk_tokens, 0.0);
    }
}

thread_local! {
    /// Each thread's buffers for decoding attention's jobs (a decoded token runs ~100 jobs a
    /// layer at 4k: allocating them per job showed), and the calling thread's scores and span
    /// outputs.
    static SPAN_JOB: std::cell::RefCell<(BlockScratch, Vec<usize>)> = std::cell::RefCell::default();
    static SPAN_BUFS: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

thread_local! {
    /// Each thread's buffers for [`attend_spans`]' whole-context jobs: a KV head's score rows,
    /// and its span sums and totals (four sets of the queries' outputs).
    static WHOLE_JOB: std::cell::RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Whether [`attend_spans`] gives each context and KV head one job instead of a job a span:
/// when every context is one span (the jobs are the same either way, and a whole job rounds
/// its own queries and writes its own output, leaving nothing to the calling thread between
/// the layer's products while the others wait: a decode step of 8 contexts 64 deep took 0.98x
/// the time, medians of 100 steps alternating in one process); or when a context spans more
/// than one span and the jobs are enough to share out evenly (the threads' shares at least
/// twice the longest job, in positions read). One long context alone (a lone decode step: as
/// many jobs as KV heads) or one much longer than the rest still goes by spans, which spread
/// it over the threads. Either way the same bits.
fn whole_contexts(plans: &[SpanPlan], nkv: usize, threads: usize) -> bool {
    let longest = plans.iter().map(|p| p.p_max).max().unwrap_or(0);
    let total: usize = plans.iter().map(|p| p.p_max * nkv).sum();
    plans.iter().all(|p| p.spans <= 1) || total >= 2 * threads * longest
}

/// Each thread's buffers for a prefill tile's jobs ([`attention`]): the queries, outputs and
/// span parts (five tiles of floats), the queries' limits and visible counts, the blocks'
/// scratch, the scores, and the job's attention totals per position for an observer.
type TileJob = (Vec<f32>, Vec<usize>, Vec<usize>, BlockScratch, Vec<f32>, (Vec<f64>, Vec<u64>));

thread_local! {
    static TILE_JOB: std::cell::RefCell<TileJob> = std::cell::RefCell::default();
}

/// Runs `f` with this thread's job buffers, fitted to `lb` and `nq` queries.
fn with_span_job<R>(lb: &LayerBlocks, nq: usize, f: impl FnOnce(&mut BlockScratch, &mut [usize]) -> R) -> R {
    SPAN_JOB.with(|cell| {
        let g = &mut *cell.borrow_mut();
        g.0.fit(lb);
        g.1.resize(nq, 0);
        f(&mut g.0, &mut g.1)
    })
}

impl<'a> LayerBlocks<'a> {
    /// Whether chunks of format `f` are decoded before the jobs start.
    fn up_front(&self, f: KvFormat) -> bool {
        up_front(f, self.in_job, self.hd)
    }

    /// Asks the CPU for the cache lines of chunk `ch`'s K or V block of KV head `kvh`, as
    /// stored (a hint: nothing is read, a block not in memory is not touched). Each head's
    /// block of a chunk is a few KiB in a chunk of its own, so one head's chunks are separate
    /// short streams the hardware prefetchers do not follow: without the hint each block's
    /// first lines waited a memory latency, and a step 512 tokens deep at the 1.7B shape spent
    /// 41% of its time in attention reading its K and V at ~1/4 of the memory's bandwidth.
    fn prefetch(&self, ch: usize, kvsel: usize, kvh: usize) {
        let f = self.kv.format(ch);
        if self.up_front(f) {
            // Read from the blocks decoded before the jobs, just written.
            return;
        }
        kernels::prefetch(self.stored(ch, f, kvsel, kvh));
    }

    /// Chunk `ch`'s K (`kvsel` 0) or V (1) block of KV head `kvh` as stored in format `f`.
    fn stored(&self, ch: usize, f: KvFormat, kvsel: usize, kvh: usize) -> &'a [u8] {
        // `KvFormat::ALL` lists the formats in their declared order.
        let [layer0, k_bytes, v_bytes] = self.geo[f as usize];
        let bytes = if kvsel == 0 { k_bytes } else { v_bytes };
        let off = layer0 + kvsel * self.n_kv_heads * k_bytes + kvh * bytes;
        &self.kv.chunk(ch)[off..off + bytes]
    }

    /// The rows of chunk `ch`'s K (`kvsel` 0) or V (1) block of KV head `kvh`, of which the
    /// first `n_c` tokens are read.
    fn rows<'b>(&'b self, ch: usize, kvsel: usize, kvh: usize, n_c: usize, s: &'b mut BlockScratch) -> kernels::KvRows<'b>
    where
        'a: 'b,
    {
        let (kv, hd, ct) = (self.kv, self.hd, self.kv.geom.chunk_tokens);
        let f = kv.format(ch);
        let bytes = self.stored(ch, f, kvsel, kvh);
        match f {
            KvFormat::F16 => kernels::KvRows::F16(bytes),
            KvFormat::Int8 => kernels::KvRows::Int8 { blk: bytes, t_cap: ct },
            f if f.split() && kvsel == 0 => {
                let (outliers, codes) = crate::kernels::split_k_params(bytes, ct, hd, &mut s.zero, &mut s.step);
                kernels::KvRows::Channel { codes, bits: f.bits(), zero: &s.zero, step: &s.step, outliers }
            }
            f if f.split() => {
                let codes = crate::kv::split_v_params(bytes, f.v_bits(), ct, &mut s.scales);
                kernels::KvRows::Token { codes, scales: &s.scales, bits: f.v_bits(), levels: crate::kv::split_v_levels(f.v_bits()) }
            }
            f if !self.up_front(f) => {
                kernels::decode_block_to_int8(f, bytes, ct, hd, n_c, &mut s.own8);
                kernels::KvRows::Int8 { blk: &s.own8, t_cap: ct }
            }
            f => {
                let blocks = 2 * self.n_kv_heads;
                let b = self.slot_of.get(ch).copied().expect("reduced chunks are decoded above") * blocks + kvsel * self.n_kv_heads + kvh;
                if crate::kv::decodes_to_int8(f, hd) {
                    let blk8 = kv.geom.head_block_bytes(KvFormat::Int8, 0);
                    kernels::KvRows::Int8 { blk: &self.dec8[b * blk8..(b + 1) * blk8], t_cap: ct }
                } else {
                    kernels::KvRows::F32(&self.dec32[b * ct * hd..(b + 1) * ct * hd])
                }
            }
        }
    }
}

/// Causal grouped-query attention of the batch's queries (at `positions`) over the chunked
/// cache. Base-format and split-level blocks are read in place (a split level's V in the
/// rotated domain, its share of the output rotated back once per query). Other reduced ones
/// are decoded — Q4/Q2 to int8 blocks, Q4R/Q2R to f32 — by each job into an L1 buffer when one
/// tile is computed, and otherwise once for the layer before the jobs start (a 128-token
/// prefill has 16 tiles, and decoding per job made attention over Q4 chunks twice as slow as
/// over int8).
///
/// Many tokens (prefill): a job is a tile of up to 8 tokens and a set of query heads sharing
/// one KV head; each chunk's K (then V) block is read once per job and reused by every query in
/// it; with enough jobs a set is the whole GQA group. One tile (decoding): [`attend_spans`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    pool: &ThreadPool,
    c: &Config,
    kv: &ChunkedKv,
    layer: usize,
    qkv: &[f32],
    ld: usize,
    positions: &[usize],
    out: &mut [f32],
    observer: Option<&mut AttentionStats>,
) {
    let n = positions.len();
    let obs = observer.map(std::sync::Mutex::new);
    if n <= TILE {
        attend_spans(pool, c, layer, ld, &mut [Decoding { kv, qkv, positions, out, obs: obs.as_ref() }]);
        return;
    }
    let (hd, nh) = (c.head_dim, c.n_heads);
    let group = c.n_heads / c.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let ct = kv.geom.chunk_tokens;
    let tiles = n.div_ceil(TILE);
    let per_job = if c.n_kv_heads * tiles >= 2 * pool.threads() { group } else { 1 };
    let sets = nh / per_job;
    // Reduced chunks decoded up front, once for the layer (per job, a block was decoded by
    // every tile and every head set that reads it: 16x for a 128-token prefill). Q4/Q2 blocks
    // become int8 blocks (exact: they hold int8 codes), read by the int8 kernel; rotated
    // levels become f32. Every reduced chunk of the context is decoded again at each token, so
    // the decoded bytes are the cost: int8 writes and reads a quarter of f32's. The buffers are
    // kept per thread, so decoding a token does not map fresh pages every layer.
    thread_local! {
        static DECODED: std::cell::RefCell<(Vec<u8>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }
    let (mut dec8, mut dec32) = DECODED.with(|d| std::mem::take(&mut *d.borrow_mut()));
    let slot_of = decode_up_front(pool, c, kv, layer, positions, false, &mut dec8, &mut dec32);
    let geo = layer_geometry(kv, layer);
    let lb = LayerBlocks { kv, hd, n_kv_heads: c.n_kv_heads, in_job: false, slot_of: &slot_of, dec8: &dec8, dec32: &dec32, geo };
    let outp = OutPtr::new(out);
    pool.for_chunks("attention tiles", sets * tiles, 1, &|a, b| {
        TILE_JOB.with(|cell| {
            // This thread's buffers, kept between jobs and layers: each is written before it is
            // read (a score past a query's limit is never read), so none is cleared. Allocating
            // and zeroing them per job (a 24-query job's scores are 67 KB at depth 700) was
            // work a prefill at depth did for every job of every layer.
            let bufs = &mut *cell.borrow_mut();
            let (floats, limits, visible, scratch) = (&mut bufs.0, &mut bufs.1, &mut bufs.2, &mut bufs.3);
            let tile = TILE * per_job * hd;
            if floats.len() < 5 * tile {
                floats.resize(5 * tile, 0.0);
            }
            let (q, rest) = floats.split_at_mut(tile);
            let (o, rest) = rest.split_at_mut(tile);
            // Split-level V rows are summed apart, in the rotated domain, and rotated back once
            // per query (H is linear). Each span's share is summed apart (`po`, `pr`) and added in
            // span order, as decoding does (`attend_spans`): a position gets the same bits whether
            // it was prefilled or decoded, so recomputing a decoded token is exact.
            let (o_rot, rest) = rest.split_at_mut(tile);
            let (po, pr) = rest.split_at_mut(tile);
            limits.resize(TILE * per_job, 0);
            visible.resize(TILE * per_job, 0);
            scratch.fit(&lb);
            let scores = &mut bufs.4;
            let span = (SPAN_TOKENS / ct).max(1);
            let first = first_chunk(c, kv, layer, positions);
            for job in a..b {
                let (set, tile) = (job % sets, job / sets);
                let (t0, t1) = (tile * TILE, ((tile + 1) * TILE).min(n));
                let h0 = set * per_job;
                let kvh = h0 / group;
                let nq = (t1 - t0) * per_job;
                for t in t0..t1 {
                    for j in 0..per_job {
                        let qi = (t - t0) * per_job + j;
                        round_query(&qkv[t * ld + (h0 + j) * hd..][..hd], &mut q[qi * hd..(qi + 1) * hd]);
                        limits[qi] = positions[t] + 1;
                    }
                }
                let p_max = limits[..nq].iter().copied().max().unwrap_or(0);
                if scores.len() < nq * p_max {
                    scores.resize(nq * p_max, 0.0);
                }
                let n_chunks = p_max.div_ceil(ct);
                for kvsel in [0usize, 1] {
                    if kvsel == 1 {
                        for (i, &lim) in limits[..nq].iter().enumerate() {
                            let row = &mut scores[i * p_max..i * p_max + lim];
                            mask_before_window(c, layer, row);
                            kernels::softmax_f16(row);
                        }
                        po[..nq * hd].fill(0.0);
                        pr[..nq * hd].fill(0.0);
                    }
                    let mut rotated = false;
                    let mut started = false;
                    for ch in first..n_chunks {
                        let col0 = ch * ct;
                        let n_c = ct.min(p_max - col0);
                        for (v, &lim) in visible[..nq].iter_mut().zip(&limits[..nq]) {
                            *v = lim.saturating_sub(col0).min(n_c);
                        }
                        let rows = lb.rows(ch, kvsel, kvh, n_c, scratch);
                        if kvsel == 0 {
                            kernels::chunk_scores(q, hd, rows, &visible[..nq], scale, scores, p_max, col0);
                        } else {
                            rotated |= matches!(rows, kernels::KvRows::Token { .. });
                            let acc = if matches!(rows, kernels::KvRows::Token { .. }) { &mut *pr } else { &mut *po };
                            kernels::chunk_values(scores, p_max, col0, rows, &visible[..nq], hd, acc);
                            if (ch + 1) % span == 0 || ch + 1 == n_chunks {
                                for (total, part) in [(&mut *o, &mut *po), (&mut *o_rot, &mut *pr)] {
                                    if !started {
                                        total[..nq * hd].copy_from_slice(&part[..nq * hd]);
                                    } else {
                                        total[..nq * hd].iter_mut().zip(&part[..nq * hd]).for_each(|(a, &b)| *a += b);
                                    }
                                    part[..nq * hd].fill(0.0);
                                }
                                started = true;
                            }
                        }
                    }
                    if rotated {
                        for (oq, rq) in o[..nq * hd].chunks_exact_mut(hd).zip(o_rot.chunks_exact_mut(hd)) {
                            add_rotated_back(oq, rq);
                        }
                    }
                }
                if let Some(obs) = &obs {
                    // The job's rows summed per position first, outside the lock: every job of
                    // the context adds to the same positions, and with the rows added under it
                    // (24 rows of a few hundred positions a job) the threads queued for it.
                    let (sum, count) = &mut bufs.5;
                    AttentionStats::totals(&scores[..nq * p_max], p_max, &limits[..nq], sum, count);
                    obs.lock().unwrap_or_else(|e| e.into_inner()).add_totals(sum, count);
                }
                for t in t0..t1 {
                    for j in 0..per_job {
                        let (h, qi) = (h0 + j, (t - t0) * per_job + j);
                        outp.write_row(t * nh * hd + h * hd, &o[qi * hd..(qi + 1) * hd]);
                    }
                }
            }
        })
    });
    DECODED.with(|d| *d.borrow_mut() = (dec8, dec32));
}

/// A local layer's query row (scores up to its position, `row.len() - 1`) without the
/// positions before its window: their scores become -inf, so the softmax gives them nothing
/// (llama.cpp's sliding-window mask). Global layers' rows are left as they are.
fn mask_before_window(c: &Config, layer: usize, row: &mut [f32]) {
    let start = c.window_start(layer, row.len().saturating_sub(1));
    row[..start].fill(f32::NEG_INFINITY);
}

/// A query rounded to f16, as llama.cpp does before its f16 K·Q product.
fn round_query(src: &[f32], dst: &mut [f32]) {
    kernels::round_f16(src, dst);
}

/// `o += H r`: a split level's share of the output, summed in the rotated domain, rotated back.
fn add_rotated_back(o: &mut [f32], r: &mut [f32]) {
    crate::kv::fwht(r);
    for (a, &b) in o.iter_mut().zip(r.iter()) {
        *a += b;
    }
}

/// One context's share of a pass that computes at most one tile ([`TILE`]) of its tokens: a
/// decode step's token, or a short piece of a prompt. `qkv` and `out` are its rows.
pub(crate) struct Decoding<'a, 'o> {
    pub(crate) kv: &'a ChunkedKv,
    pub(crate) qkv: &'a [f32],
    pub(crate) positions: &'a [usize],
    pub(crate) out: &'a mut [f32],
    pub(crate) obs: Option<&'a std::sync::Mutex<&'o mut AttentionStats>>,
}

/// How [`attend_spans`] lays out one context: its queries, spans, and where its pieces of the
/// shared buffers start.
struct SpanPlan {
    /// Queries of one KV head (tokens x the GQA group), their longest row, chunks and spans.
    nq: usize,
    p_max: usize,
    n_chunks: usize,
    /// The first chunk read ([`first_chunk`]).
    first: usize,
    spans: usize,
    /// Tokens in a chunk, chunks in a span, tokens in a span.
    ct: usize,
    span: usize,
    st: usize,
    rotated: bool,
    /// Offsets in the queries, limits, scores and span outputs.
    q0: usize,
    l0: usize,
    sc0: usize,
    pa0: usize,
}

/// How many chunks ahead a decoding step's attention asks for a head's K or V blocks.
const AHEAD_CHUNKS: usize = 2;

/// Attention for passes of at most one tile per context (decode steps, alone or batched):
/// split-K over each context, as flash-decoding does. A job is one KV head's whole GQA group
/// over one span of [`SPAN_TOKENS`] of one context: each K and V row is unpacked once for all
/// the group's query heads (one head a job read every row three times on this model, and a
/// split level's unpacking and step table three times), and a long context gives every thread
/// work. Three passes: the scores of each span; each query's softmax over its whole row
/// (gathered from the spans, so it is the one softmax of every other path); each span's share
/// of the output, which are then added in span order (the only arithmetic that differs from
/// one job over the whole context, and only past the first span). A context of one span runs
/// all three in one job (the same operations on the same rows, so the same bits).
///
/// Every context of a batch runs in the same three pool operations (or one, when each has one
/// span): with a pass per context, a batch of four 150-token contexts was twelve operations
/// of 3-6 jobs a layer, each a barrier with an idle thread at its end. When the batch's
/// contexts give the threads enough jobs by themselves ([`whole_contexts`]), each context and
/// KV head is one job that runs all three, summing the values span by span and adding the
/// spans in order as the three passes do: one operation a layer, and no gathering and
/// scattering of score rows for the softmax. A decode step of 2, 4 and 8 contexts 200 tokens
/// deep took 0.97x, 0.92x and 0.94x the time (default model, 2 threads, medians of 150 paired
/// steps against the three passes; a step with a 16-token prompt piece beside them 0.97-1.0x).
pub(crate) fn attend_spans(pool: &ThreadPool, c: &Config, layer: usize, ld: usize, ctxs: &mut [Decoding]) {
    let (hd, nh, nkv) = (c.head_dim, c.n_heads, c.n_kv_heads);
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    // Chunks read neither in place nor by the job (rotated legacy levels): decoded first.
    let decoded: Vec<(Vec<usize>, Vec<u8>, Vec<f32>)> = ctxs
        .iter()
        .map(|d| {
            let (mut d8, mut d32) = (Vec::new(), Vec::new());
            let slot_of = decode_up_front(pool, c, d.kv, layer, d.positions, true, &mut d8, &mut d32);
            (slot_of, d8, d32)
        })
        .collect();
    let lbs: Vec<LayerBlocks> = ctxs
        .iter()
        .zip(&decoded)
        .map(|(d, (slot_of, d8, d32))| LayerBlocks {
            kv: d.kv,
            hd,
            n_kv_heads: nkv,
            in_job: true,
            slot_of,
            dec8: d8,
            dec32: d32,
            geo: layer_geometry(d.kv, layer),
        })
        .collect();
    let (mut nq_all, mut sc_all, mut pa_all) = (0, 0, 0);
    let plans: Vec<SpanPlan> = ctxs
        .iter()
        .map(|d| {
            // A KV head's queries, token-major: query `qi` is token `qi / group`, head
            // `qi % group` of the group.
            let nq = d.positions.len() * group;
            let ct = d.kv.geom.chunk_tokens;
            let p_max = d.positions.iter().copied().max().map_or(0, |p| p + 1);
            let n_chunks = p_max.div_ceil(ct);
            let span = (SPAN_TOKENS / ct).max(1);
            let spans = n_chunks.div_ceil(span);
            let st = span * ct;
            let first = first_chunk(c, d.kv, layer, d.positions);
            let rotated = (first..n_chunks).any(|ch| d.kv.format(ch).split());
            let p = SpanPlan {
                nq,
                p_max,
                n_chunks,
                first,
                spans,
                ct,
                span,
                st,
                rotated,
                q0: nq_all * nkv * hd,
                l0: nq_all,
                sc0: sc_all,
                pa0: pa_all,
            };
            nq_all += nq;
            sc_all += nkv * spans * nq * st;
            pa_all += nkv * spans * 2 * nq * hd;
            p
        })
        .collect();
    let whole = whole_contexts(&plans, nkv, pool.threads());
    // Each context's output, for the whole-context jobs (each writes its own heads' columns).
    let outs: Vec<OutPtr> = if whole { ctxs.iter_mut().map(|d| OutPtr::new(d.out)).collect() } else { Vec::new() };
    // Context `i`'s queries of KV head `kvh`, rounded into `dst` (token-major, as `SpanPlan`).
    let round_group = |i: usize, kvh: usize, dst: &mut [f32]| {
        for (qi, dst) in dst.chunks_exact_mut(hd).enumerate() {
            let (t, h) = (qi / group, kvh * group + qi % group);
            round_query(&ctxs[i].qkv[t * ld + h * hd..][..hd], dst);
        }
    };
    let mut limits = vec![0usize; nq_all];
    for (d, p) in ctxs.iter().zip(&plans) {
        for (qi, l) in limits[p.l0..p.l0 + p.nq].iter_mut().enumerate() {
            *l = d.positions[qi / group] + 1;
        }
    }
    // The chunks of span `s` of context `i`: (chunk, its tokens up to `p_max`, its first
    // column in the span).
    let span_chunks = |i: usize, s: usize| {
        let p = &plans[i];
        ((s * p.span).max(p.first)..((s + 1) * p.span).min(p.n_chunks))
            .map(move |ch| (ch, p.ct.min(p.p_max - ch * p.ct), ch * p.ct - s * p.st))
    };
    // How many of chunk `ch`'s `n_c` tokens each query of context `i` sees.
    let see = |i: usize, ch: usize, n_c: usize, visible: &mut [usize]| {
        let p = &plans[i];
        for (v, &lim) in visible.iter_mut().zip(&limits[p.l0..p.l0 + p.nq]) {
            *v = lim.saturating_sub(ch * p.ct).min(n_c);
        }
    };
    // While a job reads a head's block of chunk `ch`, it asks for the block `AHEAD_CHUNKS`
    // chunks on (at its first chunk, for every one up to there): see `LayerBlocks::prefetch`.
    let prefetch_ahead = |i: usize, s: usize, ch: usize, kvsel: usize, kvh: usize| {
        let p = &plans[i];
        let from = if ch == (s * p.span).max(p.first) { ch + 1 } else { ch + AHEAD_CHUNKS };
        for next in from..(ch + AHEAD_CHUNKS + 1).min(p.n_chunks) {
            lbs[i].prefetch(next, kvsel, kvh);
        }
    };
    // The span jobs' queries, rounded once here and shared by a head's spans (a whole job
    // rounds its own: nothing of the layer's work is left on the calling thread while the
    // others wait).
    let mut q = Vec::new();
    if !whole {
        q.resize(nq_all * nkv * hd, 0.0);
        for (i, p) in plans.iter().enumerate() {
            for (kvh, dst) in q[p.q0..p.q0 + nkv * p.nq * hd].chunks_exact_mut(p.nq * hd).enumerate() {
                round_group(i, kvh, dst);
            }
        }
    }
    let job_scores = |i: usize, kvh: usize, s: usize, sc: &mut [f32]| {
        let (p, lb) = (&plans[i], &lbs[i]);
        with_span_job(lb, p.nq, |scratch, visible| {
            for (ch, n_c, col0) in span_chunks(i, s) {
                prefetch_ahead(i, s, ch, 0, kvh);
                see(i, ch, n_c, visible);
                let rows = lb.rows(ch, 0, kvh, n_c, scratch);
                let q = &q[p.q0 + kvh * p.nq * hd..p.q0 + (kvh + 1) * p.nq * hd];
                kernels::chunk_scores(q, hd, rows, visible, scale, sc, p.st, col0);
            }
        });
    };
    let job_values = |i: usize, kvh: usize, s: usize, probs: &[f32], part: &mut [f32]| {
        let (p, lb) = (&plans[i], &lbs[i]);
        let (o, o_rot) = part.split_at_mut(p.nq * hd);
        with_span_job(lb, p.nq, |scratch, visible| {
            for (ch, n_c, col0) in span_chunks(i, s) {
                prefetch_ahead(i, s, ch, 1, kvh);
                see(i, ch, n_c, visible);
                let rows = lb.rows(ch, 1, kvh, n_c, scratch);
                let acc = if matches!(rows, kernels::KvRows::Token { .. }) { &mut *o_rot } else { &mut *o };
                kernels::chunk_values(probs, p.st, col0, rows, visible, hd, acc);
            }
        });
    };
    let observe = |i: usize, probs: &[f32], lim: usize| {
        if let Some(obs) = ctxs[i].obs {
            obs.lock().unwrap_or_else(|e| e.into_inner()).add_rows(probs, lim, &[lim]);
        }
    };
    if whole {
        // One job per context and KV head: its scores, softmax and values in one go, the
        // values summed span by span and the spans added in order as the three passes below
        // add them (the same operations on the same rows in the same order: the same bits;
        // tests/batch.rs checks a batch against each context's own decode by spans).
        let items: Vec<(usize, usize)> = (0..plans.len()).flat_map(|i| (0..nkv).map(move |kvh| (i, kvh))).collect();
        pool.scatter("attention contexts", items, &|(i, kvh)| {
            let (p, lb) = (&plans[i], &lbs[i]);
            let (nq, ct, p_max) = (p.nq, p.ct, p.p_max);
            WHOLE_JOB.with(|cell| {
                let (sc, acc, q) = &mut *cell.borrow_mut();
                q.resize(nq * hd, 0.0);
                round_group(i, kvh, q);
                let q = &q[..];
                // Each is written before it is read: a score past a query's limit is never
                // read, the sums are cleared per span below.
                if sc.len() < nq * p_max {
                    sc.resize(nq * p_max, 0.0);
                }
                acc.resize(4 * nq * hd, 0.0);
                let (po, rest) = acc.split_at_mut(nq * hd);
                let (pr, rest) = rest.split_at_mut(nq * hd);
                let (o, o_rot) = rest.split_at_mut(nq * hd);
                with_span_job(lb, nq, |scratch, visible| {
                    for kvsel in [0, 1] {
                        if kvsel == 1 {
                            for (qi, &lim) in limits[p.l0..p.l0 + nq].iter().enumerate() {
                                let row = &mut sc[qi * p_max..qi * p_max + lim];
                                mask_before_window(c, layer, row);
                                kernels::softmax_f16(row);
                                observe(i, row, lim);
                            }
                        }
                        for s in 0..p.spans {
                            if kvsel == 1 {
                                po.fill(0.0);
                                pr.fill(0.0);
                            }
                            for (ch, n_c, _) in span_chunks(i, s) {
                                let from = if ch == p.first { ch + 1 } else { ch + AHEAD_CHUNKS };
                                for next in from..(ch + AHEAD_CHUNKS + 1).min(p.n_chunks) {
                                    lb.prefetch(next, kvsel, kvh);
                                }
                                see(i, ch, n_c, visible);
                                let rows = lb.rows(ch, kvsel, kvh, n_c, scratch);
                                if kvsel == 0 {
                                    kernels::chunk_scores(q, hd, rows, visible, scale, sc, p_max, ch * ct);
                                } else {
                                    let acc = if matches!(rows, kernels::KvRows::Token { .. }) { &mut *pr } else { &mut *po };
                                    kernels::chunk_values(sc, p_max, ch * ct, rows, visible, hd, acc);
                                }
                            }
                            if kvsel == 1 {
                                if s == 0 {
                                    o.copy_from_slice(po);
                                    o_rot.copy_from_slice(pr);
                                } else {
                                    o.iter_mut().zip(&*po).for_each(|(a, &b)| *a += b);
                                    o_rot.iter_mut().zip(&*pr).for_each(|(a, &b)| *a += b);
                                }
                            }
                        }
                    }
                });
                for (qi, (oq, rq)) in o.chunks_exact_mut(hd).zip(o_rot.chunks_exact_mut(hd)).enumerate() {
                    if p.rotated {
                        add_rotated_back(oq, rq);
                    }
                    let (t, h) = (qi / group, kvh * group + qi % group);
                    outs[i].write_row(t * nh * hd + h * hd, oq);
                }
            });
        });
        return;
    }
    // Scores and span outputs in job order ([context][kv head][span]), one disjoint piece a
    // job. Every score read is written first (each span's chunks cover its columns up to
    // every query's limit); the outputs are sums, so they start at zero.
    let (mut scores, mut parts) = SPAN_BUFS.with(|b| std::mem::take(&mut *b.borrow_mut()));
    scores.resize(sc_all, 0.0);
    parts.clear();
    parts.resize(pa_all, 0.0);
    {
        // Pass 1: every span's scores; a one-span context's whole job.
        let mut items = Vec::new();
        let (mut sc_rest, mut pa_rest) = (&mut scores[..], &mut parts[..]);
        for (i, p) in plans.iter().enumerate() {
            for kvh in 0..nkv {
                for s in 0..p.spans {
                    let (sc, r) = std::mem::take(&mut sc_rest).split_at_mut(p.nq * p.st);
                    sc_rest = r;
                    let (pa, r) = std::mem::take(&mut pa_rest).split_at_mut(2 * p.nq * hd);
                    pa_rest = r;
                    items.push((i, kvh, s, sc, pa));
                }
            }
        }
        pool.scatter("attention span scores", items, &|(i, kvh, s, sc, part)| {
            job_scores(i, kvh, s, sc);
            let p = &plans[i];
            if p.spans > 1 {
                return;
            }
            for (qi, &lim) in limits[p.l0..p.l0 + p.nq].iter().enumerate() {
                let row = &mut sc[qi * p.st..qi * p.st + lim];
                mask_before_window(c, layer, row);
                kernels::softmax_f16(row);
                observe(i, row, lim);
            }
            job_values(i, kvh, 0, sc, part);
            if p.rotated {
                let (o, o_rot) = part.split_at_mut(p.nq * hd);
                for (oq, rq) in o.chunks_exact_mut(hd).zip(o_rot.chunks_exact_mut(hd)) {
                    add_rotated_back(oq, rq);
                }
            }
        });
    }
    if plans.iter().any(|p| p.spans > 1) {
        // Pass 2: each query's softmax over its whole row, gathered from its spans.
        let mut items = Vec::new();
        let mut sc_rest = &mut scores[..];
        for (i, p) in plans.iter().enumerate() {
            for _ in 0..nkv {
                let (sc, r) = std::mem::take(&mut sc_rest).split_at_mut(p.spans * p.nq * p.st);
                sc_rest = r;
                if p.spans > 1 {
                    items.push((i, sc));
                }
            }
        }
        pool.scatter("attention softmax", items, &|(i, sc)| {
            let p = &plans[i];
            let (nq, st) = (p.nq, p.st);
            let mut row = vec![0.0f32; p.p_max];
            for (qi, &lim) in limits[p.l0..p.l0 + nq].iter().enumerate() {
                let piece = |s: usize| (s * st, ((s + 1) * st).min(lim), (s * nq + qi) * st);
                for (lo, hi, at) in (0..p.spans).map(piece).take_while(|x| x.0 < x.1) {
                    row[lo..hi].copy_from_slice(&sc[at..at + hi - lo]);
                }
                mask_before_window(c, layer, &mut row[..lim]);
                kernels::softmax_f16(&mut row[..lim]);
                for (lo, hi, at) in (0..p.spans).map(piece).take_while(|x| x.0 < x.1) {
                    sc[at..at + hi - lo].copy_from_slice(&row[lo..hi]);
                }
                observe(i, &row[..lim], lim);
            }
        });
        // Pass 3: every span's share of the output.
        let probs_all = &scores;
        let mut items = Vec::new();
        let mut pa_rest = &mut parts[..];
        for (i, p) in plans.iter().enumerate() {
            for kvh in 0..nkv {
                for s in 0..p.spans {
                    let (pa, r) = std::mem::take(&mut pa_rest).split_at_mut(2 * p.nq * hd);
                    pa_rest = r;
                    if p.spans > 1 {
                        items.push((i, kvh, s, pa));
                    }
                }
            }
        }
        pool.scatter("attention span values", items, &|(i, kvh, s, part)| {
            let p = &plans[i];
            let at = p.sc0 + ((kvh * p.spans + s) * p.nq) * p.st;
            job_values(i, kvh, s, &probs_all[at..at + p.nq * p.st], part);
        });
    }
    // The spans' shares added in span order, rotated back, into each context's output.
    let (mut o, mut o_rot) = (vec![0.0f32; hd], vec![0.0f32; hd]);
    for (d, p) in ctxs.iter_mut().zip(&plans) {
        let parts = &parts[p.pa0..p.pa0 + nkv * p.spans * 2 * p.nq * hd];
        for kvh in 0..nkv {
            for qi in 0..p.nq {
                let (t, h) = (qi / group, kvh * group + qi % group);
                let dst = &mut d.out[t * nh * hd + h * hd..][..hd];
                let mut spans = parts[kvh * p.spans * 2 * p.nq * hd..].chunks_exact(2 * p.nq * hd).take(p.spans);
                if p.spans == 1 {
                    // Summed and rotated back by its job.
                    dst.copy_from_slice(&spans.next().expect("one span")[qi * hd..(qi + 1) * hd]);
                    continue;
                }
                for (s, part) in spans.enumerate() {
                    let (po, pr) = (&part[qi * hd..(qi + 1) * hd], &part[(p.nq + qi) * hd..(p.nq + qi + 1) * hd]);
                    if s == 0 {
                        o.copy_from_slice(po);
                        o_rot.copy_from_slice(pr);
                    } else {
                        o.iter_mut().zip(po).for_each(|(a, &b)| *a += b);
                        o_rot.iter_mut().zip(pr).for_each(|(a, &b)| *a += b);
                    }
                }
                if p.rotated {
                    add_rotated_back(&mut o, &mut o_rot);
                }
                dst.copy_from_slice(&o);
            }
        }
    }
    SPAN_BUFS.with(|b| *b.borrow_mut() = (scores, parts));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvGeometry;
    use rand::{Rng, SeedableRng};

    /// A job's rows summed per position, then added, give the stats adding the rows one by one
    /// gives, bit for bit (f16 probabilities: exact sums), into stats already holding a row.
    #[test]
    fn observed_totals_equal_the_rows_added_one_by_one() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (ld, limits) = (40, [17usize, 18, 18, 1, 40, 33]);
        let probs: Vec<f32> = (0..limits.len() * ld).map(|_| half::f16::from_f32(rng.gen_range(0.0f32..1.0)).to_f32()).collect();
        let first: Vec<f32> = (0..9).map(|_| half::f16::from_f32(rng.gen_range(0.0f32..1.0)).to_f32()).collect();
        let (mut rows, mut totals) = (AttentionStats::default(), AttentionStats::default());
        for st in [&mut rows, &mut totals] {
            st.add_rows(&first, 9, &[9]);
        }
        rows.add_rows(&probs, ld, &limits);
        let (mut sum, mut count) = (Vec::new(), Vec::new());
        AttentionStats::totals(&probs, ld, &limits, &mut sum, &mut count);
        totals.add_totals(&sum, &count);
        assert_eq!(rows.count, totals.count);
        assert!(rows.sum == totals.sum, "the same sums");
        assert_eq!(totals.count[..3], [7, 6, 6]);
        // The vector builds (AVX2 where the CPU has it) against the plain loops, any values.
        let probs: Vec<f32> = (0..limits.len() * ld).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let (mut wide, mut plain) = (AttentionStats::default(), AttentionStats::default());
        wide.add_rows(&probs, ld, &limits);
        plain.add_rows_body(&probs, ld, &limits);
        assert!(wide.sum == plain.sum && wide.count == plain.count, "add_rows");
        let (mut s2, mut c2) = (Vec::new(), Vec::new());
        AttentionStats::totals(&probs, ld, &limits, &mut sum, &mut count);
        AttentionStats::totals_body(&probs, ld, &limits, &mut s2, &mut c2);
        assert!(sum == s2 && count == c2, "totals");
    }

    /// Attention over chunks in every format equals a plain f32 attention over their
    /// dequantized values (same f16 rounding of Q and of the probabilities).
    #[test]
    fn attention_over_mixed_formats_equals_dequantized_reference() {
        // GQA groups of 3 over 2 KV heads (the default model's kind), and of 2 over 16 (many
        // heads' jobs a span: the 1.7B shape has 32 KV heads).
        check_mixed_formats(6, 2);
        check_mixed_formats(32, 16);
    }

    fn check_mixed_formats(n_heads: usize, n_kv_heads: usize) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(21);
        let group = n_heads / n_kv_heads;
        let c = Config {
            arch: "llama".into(),
            n_layers: 2,
            dim: n_heads * 64,
            ffn_dim: 8,
            n_heads,
            n_kv_heads,
            head_dim: 64,
            vocab: 8,
            ctx_len: 512,
            rope_base: 10000.0,
            rope_dims: 64,
            rope_neox: false,
            rope_freq_scale: 1.0,
            rope_factors: None,
            norm_eps: 1e-5,
            embd_scale: None,
            ffn_gelu: false,
            swa: None,
        };
        // 300 tokens: decoding attention's spans (SPAN_TOKENS) cover them in three pieces.
        let (kvd, n) = (c.kv_dim(), 300);
        let geom = KvGeometry { n_layers: 2, n_kv_heads, head_dim: 64, chunk_tokens: 16 };
        let mut kv = ChunkedKv::new(geom, 512, KvFormat::Int8);
        kv.ensure(n).unwrap();
        for layer in 0..2 {
            for pos in 0..n {
                let k: Vec<f32> = (0..kvd).map(|_| rng.gen_range(-2.0..2.0)).collect();
                let v: Vec<f32> = (0..kvd).map(|_| rng.gen_range(-2.0..2.0)).collect();
                kv.write(layer, pos, &k, &v);
            }
        }
        // Every span mixes formats; the last chunk stays int8 (partial); the split levels are
        // read in place, V rotated back.
        let formats = [
            KvFormat::Q4,
            KvFormat::F16,
            KvFormat::K4V4,
            KvFormat::Q2,
            KvFormat::K3V3,
            KvFormat::Q4R,
            KvFormat::Int8,
            KvFormat::K2V2,
            KvFormat::K4V3,
        ];
        for i in 0..n / 16 {
            kv.set_format(i, formats[i % formats.len()]).unwrap();
        }
        // Two tiles (reduced chunks decoded once for the layer); one token and a tile of
        // scattered positions (split over spans, Q4/Q2 decoded by each job); one token and a
        // tile within the first span (its three passes run as one job).
        for positions in [(n - 9..n).collect::<Vec<usize>>(), vec![n - 1], vec![5, 130, 131, 299, 200], vec![100], vec![3, 60, 127]] {
            let ld = c.dim + 2 * kvd;
            let qkv: Vec<f32> = (0..positions.len() * ld).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let mut out = vec![0.0; positions.len() * c.dim];
            let mut stats = AttentionStats::default();
            attention(&ThreadPool::new(2), &c, &kv, 1, &qkv, ld, &positions, &mut out, Some(&mut stats));
            // Reference: dequantize every chunk, then textbook attention.
            let deq = |kvsel: usize, pos: usize, h: usize| -> Vec<f32> {
                let ch = pos / 16;
                let f = kv.format(ch);
                let mut blk = vec![0.0; 16 * 64];
                let off = geom.block_offset(f, 1, kvsel, h);
                crate::kv::read_block_f32(f, kvsel, &kv.chunk(ch)[off..], 16, 64, 16, &mut blk);
                blk[(pos % 16) * 64..(pos % 16 + 1) * 64].to_vec()
            };
            for (t, &pos) in positions.iter().enumerate() {
                for h in 0..c.n_heads {
                    let q: Vec<f32> =
                        qkv[t * ld + h * 64..t * ld + (h + 1) * 64].iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
                    let mut sc: Vec<f32> =
                        (0..=pos).map(|p| deq(0, p, h / group).iter().zip(&q).map(|(a, b)| a * b).sum::<f32>() / 8.0).collect();
                    kernels::softmax_f16(&mut sc);
                    let mut want = vec![0.0f32; 64];
                    for (p, &w) in sc.iter().enumerate() {
                        for (o, x) in want.iter_mut().zip(deq(1, p, h / group)) {
                            *o += w * x;
                        }
                    }
                    for (d, &w) in want.iter().enumerate() {
                        let got = out[t * c.dim + h * 64 + d];
                        assert!((got - w).abs() < 1e-4, "pos {pos} head {h} dim {d}: {got} vs {w}");
                    }
                }
            }
            for p in [0, 6, 131, 132, 299] {
                let rows = (positions.iter().filter(|&&q| q >= p).count() * n_heads) as u64;
                let got = stats.count.get(p).copied().unwrap_or(0);
                assert_eq!(got, rows, "position {p}: every query row of every head that sees it");
            }
        }
    }
}

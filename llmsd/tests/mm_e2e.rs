//! The memory manager driving the real model: contexts forced out to the swap store and back
//! (read, recompute, mixed) give the same next-token logits as before they left.

use std::sync::Arc;

use engine::kv::KvFormat;
use engine::model::SessionOptions;
use engine::{Logits, Model, Session, ThreadPool};
use llms_tests::{fixture, model_path, require_kernel};
use llmsd::kvmm::{code, EngineCodec, SessionKv};
use llmsd::profile::hold;
use mm::{Linear, Manager, MmConfig, Policy, Profile, Store, Strategy};

const CT: usize = 16;
const N: usize = 200; // 12 full chunks and a partial one

struct Setup {
    model: Arc<Model>,
    pool: Arc<ThreadPool>,
    ids: Vec<u32>,
    _dir: tempfile::TempDir,
}

fn setup() -> Setup {
    let model = Arc::new(Model::load(&model_path()).expect("model"));
    let text = std::fs::read_to_string(fixture("gpl-3.txt")).expect("text");
    let ids = model.tokenizer.encode(&text, false, false).expect("tokens");
    Setup { model, pool: Arc::new(ThreadPool::new(2)), ids, _dir: tempfile::tempdir().expect("tmp") }
}

fn manager(s: &Setup, policy: Policy, levels: &[KvFormat], ratio: f64, profile: Option<Profile>) -> Option<Manager> {
    manager_of(s, policy, levels, ratio, profile, 64)
}

fn manager_of(s: &Setup, policy: Policy, levels: &[KvFormat], ratio: f64, profile: Option<Profile>, max_chunks: usize) -> Option<Manager> {
    let codec = EngineCodec::new(&s.model, CT);
    let geom = codec.store_geometry();
    let store = Arc::new(Store::open(s._dir.path(), mm::Codec::fingerprint(&codec), geom, false).expect("store"));
    let cfg = MmConfig {
        policy,
        budget: 1 << 30,
        ratio,
        levels: levels.iter().map(|&f| code(f)).collect(),
        max_chunks,
        features: mm::Features::default(),
    };
    require_kernel("userfaultfd", Manager::new(cfg, Arc::new(codec), store, profile))
}

fn session(s: &Setup, observe: bool) -> Session {
    let opts = SessionOptions { capacity: 1024, chunk_tokens: CT, base: KvFormat::Int8, observe_attention: observe, sliding_window: None };
    Session::with_options(Arc::clone(&s.model), Arc::clone(&s.pool), opts)
}

/// Logits of the next token, then the token is forgotten again.
fn next_logits(mm: &mut Manager, ctx: u64, sess: &mut Session, tok: u32, strategy: Strategy) -> (Vec<f32>, mm::LoadReport) {
    let want = sess.n_past() + 1;
    mm.prepare(ctx, &mut SessionKv(sess), want).unwrap();
    let r = mm.begin(ctx, &mut SessionKv(sess), strategy).unwrap();
    let n = sess.n_past();
    let l = sess.eval(&[tok], Logits::Last).unwrap().to_vec();
    sess.truncate(n);
    mm.end(ctx, &mut SessionKv(sess)).unwrap();
    (l, r)
}

/// Everything out: nothing of the context stays resident (checked against the kernel).
fn force_out(mm: &mut Manager, ctx: u64) {
    mm.flush();
    mm.set_budget(0).unwrap();
    assert_eq!(mm.context_bytes(ctx), 0);
    assert_eq!(smaps_rss(mm.region_range(ctx).unwrap()), 0, "the kernel still maps pages of the evicted context");
    mm.set_budget(1 << 30).unwrap();
}

/// Rss of the mapping starting at `start`, from /proc/self/smaps.
fn smaps_rss((start, _len): (usize, usize)) -> usize {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut in_it = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(_)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                in_it = a == start;
                continue;
            }
        }
        if let Some(v) = line.strip_prefix("Rss:").filter(|_| in_it) {
            return v.trim().trim_end_matches("kB").trim().parse::<usize>().unwrap() * 1024;
        }
    }
    panic!("no mapping at {start:#x}");
}

/// Overwrites 64 bytes of chunk `chunk`'s record on flash, in the aligned block where layer
/// `layer` starts, behind mm's back.
fn damage(mm: &Manager, ctx: u64, chunk: u32, layer: usize) {
    let path = mm.store().dir().join(format!("ctx-{ctx:016x}.kv"));
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let e = mm.store().entry(ctx, chunk).unwrap();
    let (off, _) = mm.store().layer_extent(&e, layer);
    std::os::unix::fs::FileExt::write_at(&f, &[0x5a; 64], off + 128).unwrap();
}

/// Bytes of one slot of context `ctx`'s region.
fn len_of_one_slot(mm: &Manager, ctx: u64) -> usize {
    let (_, len) = mm.region_range(ctx).unwrap();
    len / 64
}

/// A profile under which recomputing a chunk costs as much as reading one: the planner
/// splits the load.
fn even_profile(fp: u64) -> Profile {
    Profile {
        fingerprint: fp,
        chunk_tokens: CT,
        recompute: Linear { fixed: 0.0, per_unit: 1.0 },
        io: Linear { fixed: 0.0, per_unit: 1.0 / 190_080.0 },
        recompute_points: vec![],
        io_points: vec![],
    }
}

#[test]
fn evicted_contexts_come_back_exactly_by_read_recompute_and_mixed() {
    let s = setup();
    let fp = mm::Codec::fingerprint(&EngineCodec::new(&s.model, CT));
    let Some(mut mm) = manager(&s, Policy::Llms, &[KvFormat::Int8], 1.0, Some(even_profile(fp))) else { return };
    let mut sess = session(&s, false);
    hold(&mut mm, 1, &mut sess, &s.ids[..N]).unwrap();
    let resident = mm.context_bytes(1);
    assert_eq!(smaps_rss(mm.region_range(1).unwrap()), resident, "mm's accounting is the kernel's");
    let tok = s.ids[N];
    let (reference, r) = next_logits(&mut mm, 1, &mut sess, tok, Strategy::Planned);
    assert_eq!(r.missing, 0);

    for strategy in [Strategy::AllRead, Strategy::AllRecompute, Strategy::Planned] {
        force_out(&mut mm, 1);
        let (got, r) = next_logits(&mut mm, 1, &mut sess, tok, strategy);
        assert_eq!(r.missing, N.div_ceil(CT));
        match strategy {
            Strategy::AllRead => assert_eq!((r.read, r.recomputed), (N.div_ceil(CT), 0)),
            Strategy::AllRecompute => assert_eq!((r.read, r.recomputed), (0, N.div_ceil(CT))),
            Strategy::Planned => assert!(r.read > 0 && r.recomputed > 0, "the even profile splits the load: {r:?}"),
        }
        assert_eq!(got, reference, "{strategy:?}: the logits changed after eviction");
    }

    // A damaged record is recomputed, never served.
    force_out(&mut mm, 1);
    damage(&mm, 1, 3, 5);
    let (got, r) = next_logits(&mut mm, 1, &mut sess, tok, Strategy::AllRead);
    assert_eq!(r.unreadable, 1, "{r:?}");
    assert_eq!(got, reference, "the damaged chunk was recomputed exactly");
    mm.delete(1).unwrap();
}

/// A context longer than the load's staging arena (8 MiB: 22 slots of this model) streams
/// through it: buffers are reused while later reads are in flight, chunks are checked by the
/// loading thread and its helper in turn, and damaged records on either side of the first
/// pass are recomputed, never served.
#[test]
fn a_context_longer_than_the_staging_arena_reads_back_exactly() {
    const LONG: usize = 60 * CT;
    let s = setup();
    let Some(mut mm) = manager(&s, Policy::VllmSq, &[KvFormat::Int8], 1.0, None) else { return };
    let mut sess = session(&s, false);
    hold(&mut mm, 4, &mut sess, &s.ids[..LONG]).unwrap();
    let tok = s.ids[LONG];
    let (reference, _) = next_logits(&mut mm, 4, &mut sess, tok, Strategy::Planned);
    force_out(&mut mm, 4);
    let (got, r) = next_logits(&mut mm, 4, &mut sess, tok, Strategy::AllRead);
    assert_eq!((r.read, r.recomputed, r.unreadable), (60, 0, 0), "{r:?}");
    assert_eq!(got, reference, "the logits changed after a streamed load");

    force_out(&mut mm, 4);
    damage(&mm, 4, 6, 7);
    damage(&mm, 4, 41, 7);
    let (got, r) = next_logits(&mut mm, 4, &mut sess, tok, Strategy::AllRead);
    assert_eq!(r.unreadable, 2, "{r:?}");
    assert_eq!(got, reference, "the damaged chunks were recomputed exactly");

    // The smallest arena (one slot: every read waits for the one before to be installed).
    mm.set_load_staging(0).unwrap();
    assert_eq!(mm.load_staging(), len_of_one_slot(&mm, 4));
    force_out(&mut mm, 4);
    let (got, r) = next_logits(&mut mm, 4, &mut sess, tok, Strategy::AllRead);
    assert_eq!((r.read, r.unreadable), (60, 0), "{r:?}");
    assert_eq!(got, reference, "the logits changed after a load through one buffer");
    assert!(mm.set_load_staging(usize::MAX).is_err(), "an absurd arena is refused");
    mm.delete(4).unwrap();
}

/// The load lanes keep their rings and helper thread between loads: a load whose reads fail
/// half way (a store file cut short behind mm's back, some reads still in flight) must leave
/// them empty, so the next load of another context reads back exactly.
#[test]
fn a_load_that_fails_mid_read_leaves_the_lanes_ready_for_the_next() {
    const LONG: usize = 30 * CT;
    let s = setup();
    let Some(mut mm) = manager(&s, Policy::VllmSq, &[KvFormat::Int8], 1.0, None) else { return };
    let (mut a, mut b) = (session(&s, false), session(&s, false));
    hold(&mut mm, 1, &mut a, &s.ids[..LONG]).unwrap();
    hold(&mut mm, 2, &mut b, &s.ids[LONG..2 * LONG]).unwrap();
    let tok = s.ids[2 * LONG];
    let (reference, _) = next_logits(&mut mm, 2, &mut b, tok, Strategy::Planned);
    mm.flush();
    mm.set_budget(0).unwrap();
    assert_eq!(mm.context_bytes(1) + mm.context_bytes(2), 0);
    mm.set_budget(1 << 30).unwrap();

    // Context 1's records end half way: its later reads come back short.
    let path = mm.store().dir().join(format!("ctx-{:016x}.kv", 1));
    let e = mm.store().entry(1, 15).unwrap();
    let (cut, _) = mm.store().layer_extent(&e, 0);
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(cut).unwrap();
    let r = mm.begin(1, &mut SessionKv(&mut a), Strategy::AllRead);
    assert!(r.is_err(), "reads past the end of a cut store file fail the load: {r:?}");

    for _ in 0..3 {
        let (got, r) = next_logits(&mut mm, 2, &mut b, tok, Strategy::AllRead);
        assert_eq!((r.read, r.unreadable), (LONG / CT, 0), "{r:?}");
        assert_eq!(got, reference, "a load after a failed one read other bytes");
        mm.flush();
        mm.set_budget(0).unwrap();
        mm.set_budget(1 << 30).unwrap();
    }
}

#[test]
fn compressed_levels_survive_eviction_and_recompute_stays_close() {
    let s = setup();
    let fp = mm::Codec::fingerprint(&EngineCodec::new(&s.model, CT));
    let Some(mut mm) = manager(&s, Policy::Llms, &[KvFormat::Int8, KvFormat::Q4, KvFormat::Q2], 0.6, Some(even_profile(fp))) else {
        return;
    };
    let mut sess = session(&s, true);
    hold(&mut mm, 7, &mut sess, &s.ids[..N]).unwrap();
    let formats: Vec<u32> = (0..N / CT).map(|i| mm.chunk_info(7, i).unwrap().format).collect();
    assert!(formats.contains(&code(KvFormat::Q2)) || formats.contains(&code(KvFormat::Q4)), "ratio 0.6 lowers chunks: {formats:?}");
    // Below q4's 0.64 of int8 every chunk is lowered, the densest to q4 (the solver's loss,
    // 8^-bits, makes int8 chunks paid for with q2 ones dearer); a mix of levels either way.
    assert!(formats.iter().any(|&f| f != formats[0]), "chunks at different levels: {formats:?}");
    // Levels are fixed from here on (no observer), so every load is compared in the same formats.
    sess.attention = None;
    let tok = s.ids[N];
    let (reference, _) = next_logits(&mut mm, 7, &mut sess, tok, Strategy::Planned);
    let resident = mm.context_bytes(7);
    let int8 = N.div_ceil(CT) * EngineCodec::new(&s.model, CT).geom.chunk_bytes(KvFormat::Int8);
    assert!(resident < int8 * 3 / 4, "compressed chunks cost fewer pages: {resident} vs {int8} at int8");

    let mut plain = session(&s, false);
    plain.eval(&s.ids[..N], Logits::None).unwrap();
    let int8 = plain.eval(&[tok], Logits::Last).unwrap().to_vec();
    let d = int8.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    force_out(&mut mm, 7);
    let (got, r) = next_logits(&mut mm, 7, &mut sess, tok, Strategy::AllRead);
    assert_eq!(r.read, N.div_ceil(CT));
    assert_eq!(got, reference, "reads bring compressed chunks back bit for bit");
    assert_eq!(mm.context_bytes(7), resident, "only each chunk's format is populated again");

    // Recomputing everything from the base format redoes the original computation (every
    // chunk was int8 when it was first computed), then lowers the chunks again: exact.
    force_out(&mut mm, 7);
    let (got, _) = next_logits(&mut mm, 7, &mut sess, tok, Strategy::AllRecompute);
    assert_eq!(got, reference, "all-recompute is exact");
    // A mixed load recomputes some chunks while attending to lowered chunks it read (they were
    // int8 when it was first computed): close, and moved less than compression itself moves
    // the logits.
    force_out(&mut mm, 7);
    let (got, r) = next_logits(&mut mm, 7, &mut sess, tok, Strategy::Planned);
    assert!(r.read > 0 && r.recomputed > 0, "{r:?}");
    let top = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
    assert_eq!(top(&got), top(&reference));
    let diff = got.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(diff <= d, "a mixed load moved the logits by {diff}, more than compression's own {d}");

    // A damaged record of a lowered chunk: read, its checksum fails, it is recomputed and
    // lowered back to its level (never left at int8). It attends to the lowered chunks before
    // it (they were int8 when it was first computed), so it is close, not bit-exact.
    let lowered = (0..N / CT).rev().find(|&i| formats[i] != code(KvFormat::Int8)).expect("a lowered chunk");
    force_out(&mut mm, 7);
    damage(&mm, 7, u32::try_from(lowered).unwrap(), 3);
    let (got, r) = next_logits(&mut mm, 7, &mut sess, tok, Strategy::AllRead);
    assert_eq!((r.unreadable, r.recomputed), (1, 1), "{r:?}");
    let after: Vec<u32> = (0..N / CT).map(|i| mm.chunk_info(7, i).unwrap().format).collect();
    assert_eq!(after, formats, "the recomputed chunk is back at its level");
    assert_eq!(mm.context_bytes(7), resident, "and costs that level's pages");
    assert_eq!(top(&got), top(&reference));
    let diff = got.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(diff <= d, "a recomputed damaged chunk moved the logits by {diff}, more than compression's own {d}");
}

#[test]
fn lmk_recomputes_a_killed_context_exactly() {
    let s = setup();
    let Some(mut mm) = manager(&s, Policy::Lmk, &[KvFormat::Int8], 1.0, None) else { return };
    let mut sess = session(&s, false);
    hold(&mut mm, 2, &mut sess, &s.ids[..N]).unwrap();
    let tok = s.ids[N];
    let (reference, _) = next_logits(&mut mm, 2, &mut sess, tok, Strategy::Planned);
    force_out(&mut mm, 2);
    assert_eq!(mm.stats.killed_contexts, 1);
    assert!(mm.store().entry(2, 0).is_none(), "lmk writes nothing to flash");
    let (got, r) = next_logits(&mut mm, 2, &mut sess, tok, Strategy::Planned);
    assert_eq!(r.recomputed, N.div_ceil(CT));
    assert_eq!(got, reference);
}

#[test]
fn a_fault_on_a_chunk_without_a_record_recomputes_it() {
    let s = setup();
    let levels = [KvFormat::Int8, KvFormat::Q4];
    let Some(mut mm) = manager(&s, Policy::Llms, &levels, 1.0, None) else { return };
    let rec = Arc::new(llmsd::kvmm::EngineRecompute::new(Arc::clone(&s.model), CT, KvFormat::Int8));
    mm.set_fault_recompute(Some(rec.clone()));
    let mut sess = session(&s, false);
    hold(&mut mm, 1, &mut sess, &s.ids[..N]).unwrap();
    // One chunk in a lower level too: the fault path must rebuild it in its format.
    sess.kv.set_format(2, KvFormat::Q4).unwrap();
    mm.end(1, &mut SessionKv(&mut sess)).unwrap();
    mm.flush();
    rec.set_tokens(1, &sess.tokens);
    let tok = s.ids[N];
    let (reference, _) = next_logits(&mut mm, 1, &mut sess, tok, Strategy::Planned);

    // Behind mm's back: chunks 2 and 5 lose their records and their pages. mm still counts
    // them resident, so the engine's next read faults on them.
    let (base, len) = mm.region_range(1).unwrap();
    let slot = len / 64;
    for c in [2usize, 5] {
        mm.store().invalidate(1, u32::try_from(c).unwrap());
        // SAFETY: MADV_DONTNEED on one slot of the context's region, which mm owns and
        // nothing reads right now.
        let rc = unsafe { libc::madvise((base + c * slot) as *mut libc::c_void, slot, libc::MADV_DONTNEED) };
        assert_eq!(rc, 0);
    }
    let (got, r) = next_logits(&mut mm, 1, &mut sess, tok, Strategy::Planned);
    assert_eq!(r.missing, 0, "mm did not see the pages go");
    assert_eq!(got, reference, "the fault path recomputed both chunks exactly");
    assert!(mm.region_stats(1).unwrap().faults >= 2);
}

/// Gemma 3 (five of every six layers see the last 512 tokens): a long context's chunks that
/// left the window keep only the global layers — in memory, on flash and when loaded — and
/// the model's answers are bit for bit those of a cache that keeps everything, after eviction,
/// after a restart, and when a lost record makes the whole context be recomputed.
#[test]
fn sliding_window_chunks_keep_only_global_layers_and_change_no_logit() {
    const LONG: usize = 1200;
    let model = Arc::new(Model::load(&llms_tests::gemma3_path()).expect("Gemma 3"));
    let text = std::fs::read_to_string(fixture("gpl-3.txt")).expect("text");
    let ids = model.tokenizer.encode(&text, true, false).expect("tokens");
    let s = Setup { model, pool: Arc::new(ThreadPool::new(2)), ids, _dir: tempfile::tempdir().expect("tmp") };
    let codec = EngineCodec::new(&s.model, CT);
    let (kept, dead) = (mm::Codec::kept_layers(&codec), mm::Codec::dead_chunks(&codec, LONG));
    let n_chunks = LONG.div_ceil(CT);
    assert_eq!((kept, dead, n_chunks), (3, 43, 75), "Gemma 3 270M: 3 global layers of 18; (1201 - 512) / 16 chunks dead");
    let Some(mut mm) = manager_of(&s, Policy::Llms, &[KvFormat::Int8], 1.0, None, 128) else { return };
    let tok = s.ids[LONG];

    // The reference: the engine alone, every layer of every chunk kept.
    let opts = SessionOptions { capacity: 2048, chunk_tokens: CT, base: KvFormat::Int8, observe_attention: false, sliding_window: None };
    let mut plain = Session::with_options(Arc::clone(&s.model), Arc::clone(&s.pool), opts);
    plain.eval(&s.ids[..LONG], Logits::None).unwrap();
    let reference = plain.eval(&[tok], Logits::Last).unwrap().to_vec();

    let mut sess = Session::with_options(Arc::clone(&s.model), Arc::clone(&s.pool), opts);
    hold(&mut mm, 1, &mut sess, &s.ids[..LONG]).unwrap();
    assert_eq!(sess.kv.dead(), dead, "mm told the engine which chunks died");
    let layer = codec.geom.layer_bytes(KvFormat::Int8);
    let pages = |b: usize| b.next_multiple_of(4096);
    let live = dead * pages(kept * layer) + (n_chunks - dead) * pages(18 * layer);
    assert_eq!(mm.context_bytes(1), live, "dead chunks hold their global layers' pages only");
    assert_eq!(smaps_rss(mm.region_range(1).unwrap()), live, "mm's accounting is the kernel's");
    let (got, _) = next_logits(&mut mm, 1, &mut sess, tok, Strategy::Planned);
    assert!(got == reference, "resident: the logits differ from a cache that keeps every layer");

    // Out and back: only live bytes are read, nothing faults (a read of a dead layer would).
    mm.flush();
    let on_flash = mm.store().disk_bytes();
    let full_records = n_chunks as u64 * (4096 + pages(18 * layer) as u64);
    assert!(on_flash < full_records * 6 / 10, "the store kept {on_flash} bytes, whole records take {full_records}");
    force_out(&mut mm, 1);
    let faults = mm.region_stats(1).unwrap().faults;
    let (got, r) = next_logits(&mut mm, 1, &mut sess, tok, Strategy::Planned);
    assert_eq!((r.read, r.recomputed), (n_chunks, 0), "{r:?}");
    let live_bytes = (dead * kept * layer + (n_chunks - dead) * 18 * layer) as u64;
    assert_eq!(r.read_bytes, live_bytes, "a load reads the live layers only");
    assert_eq!(mm.region_stats(1).unwrap().faults, faults, "something read memory mm did not load");
    assert!(got == reference, "after eviction: the logits differ");

    // A restart: the records (whole ones with their local layers punched out, and the ones
    // written after their chunk died) are recovered and serve the same context.
    mm.flush();
    drop(mm);
    let Some(mut mm) = manager_of(&s, Policy::Llms, &[KvFormat::Int8], 1.0, None, 128) else { return };
    let mut back = Session::with_options(Arc::clone(&s.model), Arc::clone(&s.pool), opts);
    back.tokens = s.ids[..LONG].to_vec();
    assert_eq!(mm.restore(1, &mut SessionKv(&mut back)).unwrap(), n_chunks, "every record survived the restart");
    back.kv.set_len(LONG).unwrap();
    let (got, r) = next_logits(&mut mm, 1, &mut back, tok, Strategy::Planned);
    assert_eq!((r.read, r.read_bytes), (n_chunks, live_bytes), "{r:?}");
    assert!(got == reference, "after a restart: the logits differ");

    // A live chunk's record lost: its window reaches dead chunks, so the whole context is
    // recomputed from its tokens, and the dead chunks are dropped again.
    force_out(&mut mm, 1);
    mm.store().invalidate(1, 70);
    let (got, r) = next_logits(&mut mm, 1, &mut back, tok, Strategy::Planned);
    assert_eq!(r.recomputed, n_chunks, "{r:?}");
    assert!(got == reference, "after recomputing the whole context: the logits differ");
    // (and the empty chunk the next-token calls prepared, whole).
    let with_next = live + pages(18 * layer);
    assert_eq!((back.kv.dead(), mm.context_bytes(1)), (dead, with_next), "the recomputed dead chunks were dropped again");
    mm.delete(1).unwrap();
}

/// Levels lowered in the background (what llmsd's leveller does: each chunk copied, encoded by
/// the codec outside the call, installed) are the bytes the engine's own conversion writes in
/// `end`: the same levels, the same slot bytes, the same pages, bit-identical logits, and
/// the engine learns each chunk's level at the next call.
#[test]
fn background_levels_are_the_engines_own_conversion() {
    let s = setup();
    let levels = [KvFormat::Int8, KvFormat::K4V4, KvFormat::K4V3, KvFormat::K3V3];
    let (Some(mut inline), Some(mut bg)) = (manager(&s, Policy::Llms, &levels, 0.5, None), manager(&s, Policy::Llms, &levels, 0.5, None))
    else {
        return;
    };
    bg.set_background_levels(true);
    let (mut a, mut b) = (session(&s, true), session(&s, true));
    hold(&mut inline, 3, &mut a, &s.ids[..N]).unwrap();
    hold(&mut bg, 3, &mut b, &s.ids[..N]).unwrap();
    let queued = bg.level_jobs();
    assert!(queued > 0 && bg.stats.releveled == 0, "end queued {queued} lowerings and did none");
    assert!((0..N / CT).all(|i| b.kv.format(i) == KvFormat::Int8), "the engine's chunks are untouched until installed");
    bg.finish_levelling().unwrap();
    assert_eq!(bg.stats.releveled, inline.stats.releveled);
    let info = |mm: &Manager| (0..N.div_ceil(CT)).map(|i| mm.chunk_info(3, i).unwrap().format).collect::<Vec<_>>();
    assert_eq!(info(&bg), info(&inline), "the same levels");
    assert_eq!(bg.context_bytes(3), inline.context_bytes(3), "the same pages");
    bg.flush();
    assert!((0..N / CT).all(|i| bg.chunk_info(3, i).unwrap().on_flash), "each lowered chunk written once lowered");
    a.attention = None;
    b.attention = None;
    let tok = s.ids[N];
    let (la, _) = next_logits(&mut inline, 3, &mut a, tok, Strategy::Planned);
    let (lb, _) = next_logits(&mut bg, 3, &mut b, tok, Strategy::Planned);
    for i in 0..N.div_ceil(CT) {
        assert_eq!(b.kv.format(i), a.kv.format(i), "chunk {i}: the engine learned its level");
        assert_eq!(b.kv.chunk(i), a.kv.chunk(i), "chunk {i}: the same bytes");
    }
    assert_eq!(la, lb, "bit-identical logits");
}

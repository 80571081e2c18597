//! Paged weights on the real model: any budget computes exactly what resident weights compute,
//! the budget holds (smaps of the weight region), and a stale, truncated or modified image is
//! an error or a poisoned slot, never wrong weights.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use engine::sparsity::{Sparsity, SITES};
use engine::weights::{ImageFormat, WeightMemory};
use engine::{Logits, Model, Session, ThreadPool, WeightFormat};
use llms_tests::{fixture, model_path, require_kernel};
use llmsd::weights::{load_paged, Budget, PagedOptions, PagedWeights, SLOT};
use mm::weights::{Fingerprint, ImageInfo, WeightError, WeightOptions, WeightPager};

const PROMPT_TOKENS: usize = 40;
const DECODE: usize = 12;

fn uffd_ok() -> bool {
    require_kernel("userfaultfd", uffd_handler::Pager::new()).is_some()
}

fn prompt(model: &Model) -> Vec<u32> {
    let text = std::fs::read_to_string(fixture("gpl-3.txt")).unwrap();
    model.tokenizer.encode(&text, true, false).unwrap()[..PROMPT_TOKENS].to_vec()
}

/// Logits of every prompt position, then of a greedy decode: everything the forward pass makes.
fn run(model: &Arc<Model>) -> Vec<f32> {
    run_sparse(model, None)
}

fn run_sparse(model: &Arc<Model>, sp: Option<Arc<Sparsity>>) -> Vec<f32> {
    let ids = prompt(model);
    let mut s = Session::new(Arc::clone(model), Arc::new(ThreadPool::new(2)), 256);
    s.set_sparsity(sp).unwrap();
    let mut out = s.eval(&ids, Logits::All).unwrap().to_vec();
    let mut tok = engine::sampler::argmax(&out[out.len() - model.config.vocab..]);
    for _ in 0..DECODE {
        let l = s.eval(&[tok], Logits::Last).unwrap();
        tok = engine::sampler::argmax(l);
        out.extend_from_slice(l);
    }
    out
}

fn resident_logits() -> &'static Vec<f32> {
    static R: OnceLock<Vec<f32>> = OnceLock::new();
    R.get_or_init(|| run(&Arc::new(Model::load(&model_path()).unwrap())))
}

/// One image for the tests of this file (built on first use).
/// The images this binary's tests share. A `TempDir` in a static is never dropped (statics
/// are not), so it left ~0.5 GB in /tmp per run; one fixed directory under cargo's target
/// tmp dir, emptied when the binary starts using it, keeps what a run leaves bounded.
fn image_dir() -> &'static Path {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("weights-images");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    })
}

fn paged(budget: Budget, preload: bool) -> (Arc<Model>, Arc<PagedWeights>) {
    let opts = PagedOptions { budget, image: Some(image_dir().join("w.img")), preload, format: ImageFormat::Packed };
    load_paged(&model_path(), &opts).unwrap()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn paged_weights_give_the_resident_logits_at_any_budget() {
    if !uffd_ok() {
        return;
    }
    let want = resident_logits();
    for (budget, preload) in
        [(Budget::Percent(100.0), true), (Budget::Percent(40.0), true), (Budget::Percent(15.0), true), (Budget::Percent(30.0), false)]
    {
        let (model, pw) = paged(budget, preload);
        let got = run(&model);
        let s = pw.stats();
        assert!(same_bits(&got, want), "{budget:?} preload {preload}: logits differ from resident weights");
        assert_eq!(s.crc_failures, 0);
        if budget != Budget::Percent(100.0) {
            // Below the model's size the weights really streamed: more read than the image.
            assert!(s.bytes_read > pw.weight_bytes as u64, "{budget:?}: only {} bytes read", s.bytes_read);
            assert!(s.evicted_slots > 0);
        }
        if preload {
            assert!(s.preload_slots > 0, "{budget:?}: nothing preloaded");
        } else {
            assert_eq!(s.preload_slots, 0);
            assert!(s.fault_slots > 0);
        }
    }
}

/// The page-cache baseline replays exactly what was read: at a budget below the weight bytes,
/// LRU misses every slot of every pass (a cyclic sweep larger than the cache), while the
/// pager's hot set is never re-read — it reads about the bytes outside the budget.
#[test]
fn a_page_cache_of_the_budget_rereads_what_the_hot_set_keeps() {
    if !uffd_ok() {
        return;
    }
    let (model, pw) = paged(Budget::Percent(50.0), true);
    let mut lru = pw.lru_baseline().expect("a packed image has a page-cache baseline");
    let ids = prompt(&model);
    let mut s = Session::new(Arc::clone(&model), Arc::new(ThreadPool::new(2)), 256);
    let mut tok = engine::sampler::argmax(s.eval(&ids, Logits::Last).unwrap());
    tok = engine::sampler::argmax(s.eval(&[tok], Logits::Last).unwrap());
    lru.feed(false); // the prompt and first token warm both sides
    let before = pw.stats().bytes_read;
    let tokens = 4;
    for _ in 0..tokens {
        tok = engine::sampler::argmax(s.eval(&[tok], Logits::Last).unwrap());
    }
    let ours = pw.stats().bytes_read - before;
    let lru_bytes = lru.feed(true);
    let weight = (tokens * pw.weight_bytes) as u64;
    eprintln!("{tokens} tokens: ours {ours} bytes, LRU {lru_bytes}, weight bytes {weight}");
    // Every announced slot missed (the embedding rows a token faults in come on top).
    assert!(lru_bytes >= weight, "LRU read {lru_bytes} of {weight} swept bytes");
    assert!(lru_bytes <= weight + (tokens * 4 * SLOT) as u64);
    // Ours: the half outside the budget plus the streaming window (two groups), not all.
    assert!(ours > weight / 2 && ours < weight * 11 / 20, "paged read {ours} bytes of {weight}");
}

/// Fixed thresholds (no calibration, which takes a minute): about half of each site's inputs
/// are below 0.05 to 0.1 on this model.
fn half_sparse(model: &Model) -> Arc<Sparsity> {
    let t = [0.08, 0.05, 0.08, 0.05];
    Arc::new(Sparsity { target: 0.5, levels: [0.5; SITES], thresholds: vec![t; model.config.n_layers] })
}

/// A channel-major image read by active channel (the sparse pager) computes what resident
/// channel-major weights compute, bit for bit, dense and sparse, at budgets that make it
/// evict; with sparsity a token names fewer bytes than dense, and the region's Rss (sampled
/// from smaps while the model runs) stays within the budget plus the slots of the embedding
/// rows the prompt faults in before the pager next accounts them.
#[test]
fn channel_major_paged_weights_give_the_resident_logits() {
    if !uffd_ok() {
        return;
    }
    let cm = Arc::new(Model::load_as(&model_path(), WeightFormat::ChannelMajor).unwrap());
    let sp = half_sparse(&cm);
    let want_dense = run_sparse(&cm, None);
    let want_sparse = run_sparse(&cm, Some(Arc::clone(&sp)));
    assert!(!same_bits(&want_dense, &want_sparse), "the thresholds zero nothing");
    let format = ImageFormat::ChannelMajor { span: llmsd::weights::DEFAULT_SPAN };
    let mut named = Vec::new();
    for (budget, preload) in [(100.0, true), (40.0, true), (25.0, false)] {
        for (sp, want) in [(None, &want_dense), (Some(Arc::clone(&sp)), &want_sparse)] {
            let opts = PagedOptions { budget: Budget::Percent(budget), image: Some(image_dir().join("cm.img")), preload, format };
            let (model, pw) = load_paged(&model_path(), &opts).unwrap();
            assert!(model.is_channel_major() && pw.is_sparse());
            let (got, peak, samples) = peak_rss_while(&pw, || run_sparse(&model, sp.clone()));
            let s = pw.stats();
            assert!(same_bits(&got, want), "budget {budget}% sparse {}: logits differ from resident channel-major", sp.is_some());
            assert_eq!(s.crc_failures, 0);
            assert!(samples > 10);
            // Embedding rows are faulted in before the pager next accounts them: a prompt's
            // worth at most, each row (612 bytes) on one slot or across two.
            let slack = 2 * (PROMPT_TOKENS as u64 + 1) * llmsd::weights::SPARSE_SLOT as u64;
            assert!(
                peak > 0 && peak as u64 <= s.budget + slack,
                "{budget}%: Rss peaked at {peak} (0: never read), budget {}: {s:?}",
                s.budget
            );
            assert!(s.resident_bytes <= s.budget + llmsd::weights::SPARSE_SLOT as u64, "{budget}%: {s:?}");
            if budget < 100.0 {
                assert!(s.evicted_slots > 0, "{budget}%: nothing evicted");
            }
            if budget == 100.0 {
                named.push(s.advised_slots);
            }
        }
    }
    // Slots named over the same tokens: sparse reads name fewer bytes than dense ones.
    assert!(named[1] < named[0], "sparse named {} slots, dense {}", named[1], named[0]);
}

/// A weight plan (dense here: no calibration) picks a group size the image is built with and a
/// budget it holds; the model computes the resident logits under it; when the budget changes
/// the plan is re-made with the same sparsity and group and a smaller cache, the pager drops
/// to the new budget, and a budget that cannot hold one group is refused with nothing changed.
#[test]
fn planned_weights_hold_the_plan_and_replan_when_the_budget_changes() {
    if !uffd_ok() {
        return;
    }
    use llmsd::weights::plan::{budget_bytes, PlanSetup, SPANS};
    let state = tempfile::tempdir().unwrap();
    let setup = PlanSetup {
        levels: vec![0.0, 0.5],
        max_sparsity: 0.0,
        calib_text: fixture("gpl-3.txt"),
        state_dir: state.path().into(),
        threads: 2,
    };
    let (mut inputs, levels) = llmsd::weights::plan::inputs(&model_path(), &setup).unwrap();
    assert_eq!(levels.len(), 1, "levels above --max-sparsity are not even calibrated");
    assert!(inputs.bw.mem > 0.0 && inputs.bw.flash.len() == llmsd::weights::plan::READ_SIZES.len());
    assert!(inputs.packed_mem > 0.0 && inputs.bw.install > 0.0, "{inputs:?}");
    let budget = budget_bytes(Budget::Percent(60.0), &inputs);
    // Streaming the packed image, when its kernels are predicted fast enough to win.
    let packed = {
        let mut q = inputs.clone();
        q.packed_mem = 1e15;
        (q.clone(), q.plan(budget).unwrap())
    };
    assert!(packed.1.packed, "{:?}", packed.1);
    // Channel-major planning: the packed candidate off, and planned as with a core to spare
    // for the preload thread (this machine may have none): the pipeline is what is tested.
    inputs.packed_mem = 0.0;
    inputs.spare_core = true;
    let plan = inputs.plan(budget).unwrap();
    assert!(!plan.packed);
    assert!(plan.sparsity == 0.0 && SPANS.contains(&plan.span) && plan.budget == budget, "{plan:?}");
    assert!(plan.cache_bytes <= budget && plan.hit_rate < 1.0 && plan.read_bytes > 0.0, "{plan:?}");

    let format = ImageFormat::ChannelMajor { span: plan.span };
    let opts = PagedOptions { budget: Budget::Bytes(budget), image: Some(image_dir().join("planned.img")), preload: true, format };
    let (model, pw) = load_paged(&model_path(), &opts).unwrap();
    assert_eq!(model.image_span(), plan.span);
    pw.set_plan(llmsd::weights::PlanState { inputs, plan: plan.clone() });
    let cm = Arc::new(Model::load_as(&model_path(), WeightFormat::ChannelMajor).unwrap());
    let want = run(&cm);
    assert!(same_bits(&run(&model), &want), "planned paging changed the logits");
    // The cache is full now; the plan's room beside it still takes the predictions, and
    // nothing is read twice: every slot read is a named miss, a preload or a fault (a named
    // slot the preload thread is reading is waited for).
    assert!(plan.preload_room > 0, "a dense layer predicts the next exactly: preloading pays ({plan:?})");
    let s0 = pw.stats();
    assert!(same_bits(&run(&model), &want));
    let s1 = pw.stats();
    let slot = pw.info().slot_size as u64;
    assert!(s1.preload_slots > s0.preload_slots, "predictions got no room once the cache filled");
    let read = (s1.bytes_read - s0.bytes_read) / slot;
    let misses =
        (s1.advised_slots - s0.advised_slots) - (s1.advised_resident - s0.advised_resident) - (s1.advised_landing - s0.advised_landing);
    let (pre, faults) = (s1.preload_slots - s0.preload_slots, s1.fault_slots - s0.fault_slots);
    assert!(read <= misses + pre + faults, "read {read} slots for {misses} misses, {pre} preloads, {faults} faults");
    assert!(pw.resident_bytes() <= budget, "{} resident over {budget}", pw.resident_bytes());
    // Predictions have a precision; with nothing preloaded there is none to state.
    let used = s1.prefetch_used - s0.prefetch_used;
    assert_eq!(pw.preload_precision(pre, used), Some(used as f64 / pre as f64));
    assert_eq!(pw.preload_precision(0, 0), None);

    let smaller = budget * 2 / 3;
    pw.set_budget(smaller).unwrap();
    let re = pw.plan().unwrap();
    assert_eq!((re.sparsity, re.span, re.budget), (plan.sparsity, plan.span, smaller));
    assert!(re.cache_bytes < plan.cache_bytes && re.read_bytes > plan.read_bytes && re.tok_s() < plan.tok_s(), "{re:?}");
    assert!(pw.resident_bytes() <= smaller, "{} resident over {smaller}", pw.resident_bytes());
    assert!(same_bits(&run(&model), &want), "logits changed after re-planning");

    let before = pw.stats().budget;
    let err = pw.set_budget(64 << 10).unwrap_err();
    assert!(err.to_string().contains("cannot hold one layer group"), "{err}");
    assert_eq!((pw.plan().unwrap(), pw.stats().budget), (re, before), "a refused budget changed something");
    drop((model, pw));

    // A packed plan pages the packed image (resident logits bit for bit) and re-plans as one.
    let (inputs, plan) = packed;
    let format = llmsd::weights::plan::image_format(&plan);
    assert_eq!(format, ImageFormat::Packed);
    let opts = PagedOptions { budget: Budget::Bytes(budget), image: Some(image_dir().join("planned-packed.img")), preload: true, format };
    let (model, pw) = load_paged(&model_path(), &opts).unwrap();
    assert!(!pw.is_sparse());
    assert_eq!(pw.preload_precision(10, 10), None, "reading ahead by layer order predicts nothing");
    pw.set_plan(llmsd::weights::PlanState { inputs, plan: plan.clone() });
    assert!(same_bits(&run(&model), resident_logits()), "packed planned paging changed the logits");
    pw.set_budget(smaller).unwrap();
    let re = pw.plan().unwrap();
    assert!(re.packed && re.budget == smaller && re.cache_bytes < plan.cache_bytes && re.read_bytes > plan.read_bytes, "{re:?}");
    assert!(same_bits(&run(&model), resident_logits()));
    assert!(pw.set_budget(64 << 10).is_err(), "two layers do not fit 64 KiB");
}

/// Rss of the mapping that starts at `addr`, from /proc/self/smaps.
fn smaps_rss(addr: usize) -> usize {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut in_it = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((a, _)) = range.split_once('-') {
                if a.chars().all(|c| c.is_ascii_hexdigit()) && !a.is_empty() {
                    in_it = usize::from_str_radix(a, 16).unwrap() == addr;
                    continue;
                }
            }
        }
        if in_it {
            if let Some(kb) = line.strip_prefix("Rss:") {
                return kb.trim().trim_end_matches("kB").trim().parse::<usize>().unwrap() * 1024;
            }
        }
    }
    panic!("no mapping at {addr:#x}");
}

/// Runs `f` while another thread samples the Rss of `pw`'s region: `f`'s result, the peak,
/// and how many samples were taken. A sample is not a snapshot: smaps walks the page tables
/// while the pager evicts behind the walk and installs ahead of it, so one reading can count
/// an evicted page and its replacement (CI once saw 153 slots over the budget this way, the
/// pager's own count at the budget). Every page installed during a reading was counted in
/// `bytes_read` before it went in, and one counted earlier was in flight, inside the budget
/// already; so a reading less the bytes read while it ran is at most what the pager held
/// (resident or reserved) when it began.
fn peak_rss_while<T>(pw: &PagedWeights, f: impl FnOnce() -> T) -> (T, usize, usize) {
    let addr = WeightMemory::bytes(pw).as_ptr() as usize;
    let stop = AtomicBool::new(false);
    let (mut peak, mut raw, mut samples) = (0, 0, 0);
    let out = std::thread::scope(|sc| {
        sc.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let before = pw.bytes_read();
                let rss = smaps_rss(addr);
                let arrived = usize::try_from(pw.bytes_read() - before).unwrap();
                peak = peak.max(rss.saturating_sub(arrived));
                raw = raw.max(rss);
                samples += 1;
            }
        });
        let out = f();
        stop.store(true, Ordering::Relaxed);
        out
    });
    eprintln!("region Rss peak {peak} ({raw} before taking out what arrived during a reading), {samples} readings");
    (out, peak, samples)
}

#[test]
fn resident_weight_bytes_stay_within_the_budget() {
    if !uffd_ok() {
        return;
    }
    let (model, pw) = paged(Budget::Percent(35.0), true);
    let budget = usize::try_from(pw.stats().budget).unwrap();
    let info = pw.info();
    // The largest group read in the cycle (layers, head parts; the last group is the
    // embedding table, read row by row).
    let largest =
        info.groups[..info.groups.len() - 1].iter().map(|g| usize::try_from(g.len).unwrap().next_multiple_of(SLOT)).max().unwrap();
    let (got, peak, samples) = peak_rss_while(&pw, || run(&model));
    assert!(same_bits(&got, resident_logits()));
    eprintln!("weight region Rss peak {peak} bytes over {samples} samples; budget {budget}, largest group {largest}");
    assert!(samples > 10);
    assert!(peak > budget / 2, "the region was barely used: peak {peak} of budget {budget}");
    assert!(peak <= budget + largest, "weight region Rss peaked at {peak} bytes: over the budget {budget} + one group {largest}");
    assert!(pw.resident_bytes() <= budget + largest);
}

fn copy_model(dir: &Path) -> PathBuf {
    let p = dir.join("m.gguf");
    std::fs::copy(model_path(), &p).unwrap();
    p
}

fn opts(budget: usize) -> WeightOptions {
    WeightOptions { budget, cycle: vec![0, 1, 2], preload: true }
}

#[test]
fn stale_truncated_and_damaged_images_are_refused() {
    if !uffd_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let gguf = copy_model(dir.path());
    let img = dir.path().join("m.img");
    let fp = Fingerprint::of(&gguf).unwrap();
    llmsd::weights::build(&gguf, &img, fp, ImageFormat::Packed).unwrap();
    assert!(WeightPager::open(&img, fp, opts(1 << 24)).is_ok());

    // The model file changes (one byte of the last tensor's data): the image is stale.
    let mut bytes = std::fs::read(&gguf).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x40;
    std::fs::write(&gguf, &bytes).unwrap();
    let fp2 = Fingerprint::of(&gguf).unwrap();
    assert!(matches!(WeightPager::open(&img, fp2, opts(1 << 24)), Err(WeightError::Stale { .. })));
    // Loading through the tools rebuilds it, and computes with the file as it is now.
    let po = PagedOptions { budget: Budget::Percent(50.0), image: Some(img.clone()), preload: true, format: ImageFormat::Packed };
    let (m, _pw) = load_paged(&gguf, &po).unwrap();
    assert!(same_bits(&run(&m), &run(&Arc::new(Model::load(&gguf).unwrap()))));
    drop(m);
    let fp = fp2;

    // Truncated: the trailer is gone.
    let full = std::fs::read(&img).unwrap();
    std::fs::write(&img, &full[..full.len() - 10]).unwrap();
    let e = ImageInfo::read(&img).unwrap_err();
    assert!(matches!(e, WeightError::Format { .. }), "{e}");
    // Cut inside the data, trailer re-appended: lengths no longer agree.
    let tlen = usize::try_from(u64::from_le_bytes(full[full.len() - 16..full.len() - 8].try_into().unwrap())).unwrap();
    let info_len = full.len() - 16 - tlen; // where the trailer starts
    let mut cut = full[..SLOT].to_vec();
    cut.extend_from_slice(&full[info_len..]);
    std::fs::write(&img, &cut).unwrap();
    assert!(matches!(WeightPager::open(&img, fp, opts(1 << 24)), Err(WeightError::Format { .. })));
    // A flipped trailer byte.
    let mut bad = full.clone();
    bad[info_len + 5] ^= 1;
    std::fs::write(&img, &bad).unwrap();
    assert!(matches!(WeightPager::open(&img, fp, opts(1 << 24)), Err(WeightError::Format { .. })));
    // Not an image at all.
    std::fs::write(&img, b"hello").unwrap();
    assert!(matches!(ImageInfo::read(&img), Err(WeightError::Format { .. })));
}

/// Child of the test below: computes over an image whose first layer was modified on flash.
#[test]
#[ignore = "run by modified_image_data_poisons_the_slot_not_the_logits"]
fn modified_image_child() {
    let Ok(dir) = std::env::var("LLMS_WEIGHTS_CHILD") else { return };
    let img = Path::new(&dir).join("m.img");
    let po = PagedOptions {
        budget: Budget::Percent(100.0),
        image: Some(img),
        preload: std::env::var("LLMS_PRELOAD").is_ok(),
        format: ImageFormat::Packed,
    };
    let (m, _pw) = load_paged(&model_path(), &po).unwrap();
    let _ = run(&m);
    println!("COMPUTED");
}

#[test]
fn modified_image_data_poisons_the_slot_not_the_logits() {
    use std::os::unix::process::ExitStatusExt;
    if !uffd_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("m.img");
    let gguf = model_path();
    llmsd::weights::build(&gguf, &img, Fingerprint::of(&gguf).unwrap(), ImageFormat::Packed).unwrap();
    // One byte of layer 0's q projection, rewritten in place (the trailer still describes the
    // original: as if the flash copy were modified behind our back).
    let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0x5a], 1000).unwrap();
    drop(f);
    for preload in [true, false] {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--ignored", "--exact", "modified_image_child", "--nocapture", "--test-threads=1"]).env("LLMS_WEIGHTS_CHILD", dir.path());
        if preload {
            cmd.env("LLMS_PRELOAD", "1");
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.signal(), Some(libc::SIGBUS), "preload {preload}: child ended {:?}; stderr: {stderr}", out.status);
        assert!(!String::from_utf8_lossy(&out.stdout).contains("COMPUTED"));
        assert!(stderr.contains("checksum mismatch"), "preload {preload}: stderr names no checksum failure: {stderr}");
    }
}

/// `--weights mmap` (the lab's page-cache baseline): the packed image mapped from its file
/// computes exactly what resident weights compute; a slot modified on flash is refused at open
/// (the mapping would read it behind the pager's checks), and the image is then rebuilt only
/// by deleting it.
#[test]
fn mapped_weights_give_the_resident_logits_and_refuse_a_modified_image() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("m.img");
    let (model, mapped) = llmsd::weights::load_mapped(&model_path(), Some(img.clone())).unwrap();
    assert!(same_bits(&run(&model), resident_logits()), "mapped weights compute what resident ones do");
    assert!(mapped.weight_bytes > 0);
    drop((model, mapped));
    // One byte of the first slot flipped, the trailer kept: the CRC check at open refuses it.
    let mut bytes = std::fs::read(&img).unwrap();
    bytes[100] ^= 0x10;
    std::fs::write(&img, &bytes).unwrap();
    let e = llmsd::weights::load_mapped(&model_path(), Some(img.clone())).unwrap_err();
    assert!(format!("{e:#}").contains("checksum mismatch"), "{e:#}");
    // A truncated image (no trailer) is rebuilt, as for paged weights.
    std::fs::write(&img, &bytes[..1000]).unwrap();
    let (model, _) = llmsd::weights::load_mapped(&model_path(), Some(img)).unwrap();
    assert!(same_bits(&run(&model), resident_logits()));
}

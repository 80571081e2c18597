//! llmsd's scheduler (batched decoding) end to end, on the real daemon and model: calls made at
//! the same time share forward passes and answer exactly what each answers alone; a call whose
//! chunks do not fit in the budget beside the running ones waits for them, and says so; a call
//! cancelled in a batch leaves it and the others go on.

use std::net::Shutdown;
use std::sync::{Arc, Barrier};
use std::time::Duration;

mod common;

use common::{kernel_ok, Daemon};
use llmsd::client::Client;
use llmsd::proto::{Call, CallStats};

/// Raw text continued greedily: long answers (no end of turn), each context its own text.
const TEXTS: [&str; 4] = [
    "The history of the printing press begins in the fifteenth century, when",
    "To bake a loaf of bread you need flour, water, salt and yeast. First,",
    "The river runs through the valley and past the old mill, where",
    "Operating systems manage memory by dividing it into pages, and",
];

fn raw(ctx: &str, prompt: &str, max_tokens: u32) -> Call {
    Call { ctx: ctx.into(), prompt: prompt.into(), max_tokens, temperature: 0.0, seed: 0, stop: vec![], raw: true, top_p: None }
}

/// Exact KV (one level) so outputs can be compared bit for bit between services.
const EXACT: &str = "levels = [\"int8\"]\nratio = 1.0\n";

/// Each of `TEXTS.len()` clients, on its own connection and context, makes `calls` calls at
/// the same time as the others (a barrier starts them together): outputs and stats per client.
fn concurrent(d: &Daemon, calls: usize, max_tokens: u32) -> Vec<Vec<(String, CallStats)>> {
    let start = Arc::new(Barrier::new(TEXTS.len()));
    let threads: Vec<_> = TEXTS
        .iter()
        .enumerate()
        .map(|(k, text)| {
            let (start, socket) = (Arc::clone(&start), d.socket.clone());
            std::thread::spawn(move || {
                let mut c = Client::connect(&socket, &format!("app{k}")).unwrap();
                let ctx = c.new_ctx(None).unwrap();
                start.wait();
                (0..calls)
                    .map(|j| {
                        let prompt = if j == 0 { (*text).to_string() } else { format!(" And then, part {j}:") };
                        let mut streamed = String::new();
                        let (out, st) = c.call(&raw(&ctx, &prompt, max_tokens), &mut |t| streamed.push_str(t)).unwrap();
                        assert_eq!(streamed, out, "the streamed pieces make the output");
                        (out, st)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn concurrent_calls_share_passes_and_answer_as_alone() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Reference: one call at a time.
    let d = Daemon::start(dir.path(), "solo", &dir.path().join("solo"), &format!("{EXACT}max_batch = 1\n"));
    let solo = concurrent(&d, 2, 40);
    let st = d.client("app0").stats().unwrap();
    d.stop();
    assert!(solo.iter().flatten().all(|(_, s)| s.batch_max == 1), "max_batch 1 runs calls alone");
    assert_eq!(st.memory_waits, 0);

    // Batched, with prompts prefilled in pieces of 8 tokens inside the others' decode steps,
    // and on the prefill lane beside them.
    for lane in [false, true] {
        let name = format!("batch-{lane}");
        let settings = format!("{EXACT}max_batch = 4\nprefill_piece = 8\nprefill_lane = {lane}\n");
        let d = Daemon::start(dir.path(), &name, &dir.path().join(&name), &settings);
        let batched = concurrent(&d, 2, 40);
        let st = d.client("app0").stats().unwrap();
        d.stop();
        let on_lane = batched.iter().flatten().filter(|(_, s)| s.lane_tokens > 0).count();
        if lane {
            // Four calls start together: the first prompt runs alone, the others on the lane
            // while it decodes. A client's second call, sent as its first ends while others
            // decode, is started by the lane itself during the pass in flight.
            assert!(on_lane > 0, "no prompt ran on the lane: {batched:?}");
            assert!(st.lane_starts > 0, "the lane started no call beside a pass: {st:?}");
            for (_, s) in batched.iter().flatten() {
                assert!(s.lane_tokens == 0 || s.lane_tokens == s.prompt_tokens, "a short prompt goes to the lane whole: {s:?}");
            }
        } else {
            assert_eq!((on_lane, st.lane_starts), (0, 0), "prefill_lane = false runs no lane");
        }
        for (k, (a, b)) in solo.iter().zip(&batched).enumerate() {
            for (j, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(!x.0.is_empty(), "client {k} call {j} generated nothing");
                assert_eq!(x.0, y.0, "client {k} call {j}: the batched answer differs from the one alone");
                assert_eq!(
                    (x.1.prompt_tokens, x.1.output_tokens, x.1.context_tokens),
                    (y.1.prompt_tokens, y.1.output_tokens, y.1.context_tokens)
                );
                assert!(y.1.batch_max <= 4);
            }
        }
        let shared = batched.iter().flatten().filter(|(_, s)| s.batch_max > 1).count();
        assert!(shared > 0, "four clients calling together never shared a pass: {batched:?}");
        eprintln!("lane {lane}: {shared} of 8 calls shared forward passes, {on_lane} prefilled on the lane");
    }
}

#[test]
fn a_call_that_does_not_fit_beside_the_running_ones_waits() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // An int8 chunk of 16 tokens is ~190 KiB for this model: 3 MiB holds ~16 chunks, and
    // each call below needs ~7 (its prompt and 96 answer tokens), so no more than two fit
    // beside each other and the other calls wait.
    let settings = format!("{EXACT}budget = {}\nmax_batch = 4\n", 3 << 20);
    let d = Daemon::start(dir.path(), "tight", &dir.path().join("tight"), &settings);
    let out = concurrent(&d, 1, 96);
    let st = d.client("app0").stats().unwrap();
    d.stop();
    assert!(st.memory_waits > 0, "no call waited for memory: {st:?}");
    let waited = out.iter().flatten().filter(|(_, s)| s.memory_wait_ms > 0.0).count();
    assert!(waited > 0, "no call says it waited for memory: {out:?}");
    for (_, s) in out.iter().flatten() {
        assert!(s.batch_max <= 2, "more calls ran together than the budget holds: {s:?}");
        assert!(s.memory_wait_ms <= s.queue_ms, "{s:?}");
    }

    // The same calls with room for all: the same answers.
    let d = Daemon::start(dir.path(), "roomy", &dir.path().join("roomy"), &format!("{EXACT}max_batch = 4\n"));
    let free = concurrent(&d, 1, 96);
    d.stop();
    for (k, (a, b)) in out.iter().zip(&free).enumerate() {
        assert_eq!(a[0].0, b[0].0, "client {k}: the answer depends on waiting for memory");
    }
}

#[test]
fn a_call_cancelled_in_a_batch_leaves_and_the_others_go_on() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "cancel", &dir.path().join("cancel"), &format!("{EXACT}max_batch = 4\n"));
    let mut quitter = d.client("quitter");
    let qctx = quitter.new_ctx(None).unwrap();
    let stream = quitter.try_clone_stream().unwrap();
    // The stayer joins once the quitter decodes; the quitter hangs up once the stayer has
    // tokens too: the cancel happens inside a batch of two.
    let (go, started) = std::sync::mpsc::channel::<()>();
    let stayer_has_tokens = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stayer = std::thread::spawn({
        let (socket, flag) = (d.socket.clone(), Arc::clone(&stayer_has_tokens));
        move || {
            let mut c = Client::connect(&socket, "stayer").unwrap();
            let ctx = c.new_ctx(None).unwrap();
            started.recv().unwrap();
            let mut n = 0;
            let r = c
                .call(&raw(&ctx, TEXTS[1], 64), &mut |_| {
                    n += 1;
                    if n == 8 {
                        flag.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                })
                .unwrap();
            (c, r)
        }
    });
    let mut seen = 0;
    let r = quitter.call(&raw(&qctx, TEXTS[0], 400), &mut |_| {
        seen += 1;
        if seen == 1 {
            go.send(()).unwrap();
        }
        if stayer_has_tokens.load(std::sync::atomic::Ordering::SeqCst) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    });
    assert!(r.is_err(), "the call was cut by the hang-up");
    let (mut c, (text, st)) = stayer.join().unwrap();
    assert_eq!(st.output_tokens, 64, "the other call ran to its length: {st:?}");
    assert_eq!(st.batch_max, 2, "the stayer shared passes with the quitter: {st:?}");
    // Alone on a fresh context, the stayer's call answers the same.
    let ctx2 = c.new_ctx(None).unwrap();
    let (again, alone) = c.call(&raw(&ctx2, TEXTS[1], 64), &mut |_| {}).unwrap();
    assert_eq!(alone.batch_max, 1);
    assert_eq!(text, again);
    // The cancelled call kept what it made, far less than its 400 tokens.
    let mut q = d.client("quitter");
    let tokens = llms_tests::wait_until("the cancelled call to end", Duration::from_secs(60), || {
        let list = q.list().unwrap();
        let i = list.iter().find(|i| i.ctx == qctx).unwrap();
        (!i.busy).then_some(i.tokens)
    });
    assert!(tokens > 10 && tokens < 300, "the cancelled context holds {tokens} tokens");
    // A call that adds no tokens is refused before it can reach a shared pass.
    let err = q.call(&raw(&qctx, "", 8), &mut |_| {}).unwrap_err();
    assert!(format!("{err:#}").contains("adds no tokens"), "{err:#}");
    assert_eq!(q.list().unwrap().iter().find(|i| i.ctx == qctx).unwrap().tokens, tokens);
    d.stop();
}

/// One uid's long calls cannot keep another uid out of the model: with a batch of two, root
/// runs two calls and queues a third; a call of uid 65534 queued after it goes first once a
/// slot frees (a uid holding half the batch yields), and ends long before root's longer call.
#[test]
fn one_uid_cannot_keep_others_out_of_the_batch() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    use std::process::Command;
    use std::time::Instant;
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let d = Daemon::start(dir.path(), "fair", &dir.path().join("state"), &format!("{EXACT}max_batch = 2\nsocket_mode = \"0666\"\n"));
    let counting = "1, 2, 3, 4, 5, 6, 7, 8,";
    let root_call = |max_tokens: u32, started: std::sync::mpsc::Sender<()>| {
        let socket = d.socket.clone();
        std::thread::spawn(move || {
            let mut c = Client::connect(&socket, "root").unwrap();
            let ctx = c.new_ctx(None).unwrap();
            let mut first = Some(started);
            let (_, st) = c
                .call(&raw(&ctx, counting, max_tokens), &mut |_| {
                    if let Some(s) = first.take() {
                        let _ = s.send(());
                    }
                })
                .unwrap();
            (st, Instant::now())
        })
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let short = root_call(100, tx.clone());
    let long = root_call(300, tx.clone());
    rx.recv().unwrap();
    rx.recv().unwrap();
    let queued = root_call(300, tx);
    let mut c = d.client("watch");
    llms_tests::wait_until("root's third call to queue", Duration::from_secs(60), || (c.stats().unwrap().queue > 0).then_some(()));
    // uid 65534 through the CLI: a context and a short call, queued behind root's third.
    let llms = common::llms_bin();
    let as_nobody = |args: &[&str]| {
        let out = Command::new(&llms).args(args).env("LLMS_SOCKET", &d.socket).uid(65534).gid(65534).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let ctx = as_nobody(&["ctx", "new", "--app", "other"]);
    as_nobody(&["ctx", "call", &ctx, counting, "--raw", "--max-tokens", "16", "--app", "other"]);
    let other_done = Instant::now();
    let (s_short, _) = short.join().unwrap();
    let (s_long, long_done) = long.join().unwrap();
    let (s_queued, _) = queued.join().unwrap();
    for s in [&s_short, &s_long, &s_queued] {
        assert_eq!(s.finish, "length", "{s:?}");
    }
    assert!(other_done < long_done, "the other uid waited behind root's queued call: it ended after root's long call ({s_long:?})");
    d.stop();
}

/// A forward pass that panics with several calls in it fails only the call whose data made it
/// panic: each call's piece runs again alone, the guilty one panics again and its context is
/// quarantined, and the others go on, answering what they answer with no fault at all. (The
/// panic is injected: llmsd's debug build panics after a pass that fed `LLMS_FAULT_PANIC_TOKEN`
/// has written every call's K/V, standing for a context whose data crashes the model; without
/// the rollback of the innocent call's positions, its answer differs.)
#[test]
#[cfg_attr(not(debug_assertions), ignore = "the fault is injected in debug builds only (make test runs them)")]
fn a_pass_that_panics_fails_only_the_call_that_made_it() {
    if !kernel_ok() {
        return;
    }
    let model = engine::Model::load(&llms_tests::model_path()).expect("model");
    let enc = |t: &str| model.tokenizer.encode(t, false, false).expect("tokens");
    let poison_prompt = "Listen to the xylophone";
    let poison = *enc(poison_prompt).last().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let env = [("LLMS_FAULT_PANIC_TOKEN", poison.to_string())];
    // In pieces beside the innocent call's decoding (one pass, split after the panic), and on
    // the prefill lane beside it (a pass of its own, on its own thread).
    for lane in [false, true] {
        let name = format!("fault-{lane}");
        let settings = format!("{EXACT}max_batch = 4\nprefill_lane = {lane}\n");
        let d = Daemon::start_env(dir.path(), &name, &dir.path().join(&name), &settings, &env);
        // The innocent client: two calls on one context; the guilty one calls once the first of
        // them decodes, so its prompt runs in a pass with it (or beside it, on the lane).
        let (go, started) = std::sync::mpsc::channel::<()>();
        let guilty = std::thread::spawn({
            let socket = d.socket.clone();
            move || {
                let mut c = Client::connect(&socket, "guilty").unwrap();
                let ctx = c.new_ctx(None).unwrap();
                started.recv().unwrap();
                let err = c.call(&raw(&ctx, poison_prompt, 16), &mut |_| {}).unwrap_err();
                (c, ctx, format!("{err:#}"))
            }
        });
        let mut c = d.client("innocent");
        let ctx = c.new_ctx(None).unwrap();
        let mut seen = 0;
        let (first, st1) = c
            .call(&raw(&ctx, TEXTS[0], 48), &mut |_| {
                seen += 1;
                if seen == 1 {
                    go.send(()).unwrap();
                }
            })
            .unwrap();
        let (mut g, gctx, err) = guilty.join().unwrap();
        assert!(err.contains("quarantined"), "the guilty call's error: {err}");
        assert_eq!(st1.output_tokens, 48, "the innocent call ran to its length: {st1:?}");
        if lane {
            // Its prompt ran beside the innocent call's passes, not in one of them.
            assert_eq!(st1.batch_max, 1, "the guilty prompt went to the lane: {st1:?}");
            assert!(d.log_text().contains("injected fault"), "the lane's pass panicked: {}", d.log_text());
        } else {
            assert_eq!(st1.batch_max, 2, "the guilty prompt shared a pass with the innocent call: {st1:?}");
            assert!(d.log_text().contains("run again one by one"), "the batched pass panicked and was split: {}", d.log_text());
        }
        let (second, _) = c.call(&raw(&ctx, " And then:", 24), &mut |_| {}).unwrap();
        // The guilty context stays quarantined; its owner can still make others.
        let again = g.call(&raw(&gctx, " more", 4), &mut |_| {}).unwrap_err();
        assert!(format!("{again:#}").contains("quarantined"), "{again:#}");
        let fresh = g.new_ctx(None).unwrap();
        g.call(&raw(&fresh, "Hello", 4), &mut |_| {}).unwrap();
        // The innocent calls, again on a fresh context with nobody else: the same answers.
        let ctx2 = c.new_ctx(None).unwrap();
        let (first2, alone) = c.call(&raw(&ctx2, TEXTS[0], 48), &mut |_| {}).unwrap();
        let (second2, _) = c.call(&raw(&ctx2, " And then:", 24), &mut |_| {}).unwrap();
        assert_eq!(alone.batch_max, 1);
        assert_eq!((first, second), (first2.clone(), second2.clone()), "the failed pass changed an innocent call's answer");
        // The injected token never ran in the innocent calls (else they would have failed too).
        for t in [TEXTS[0], first2.as_str(), second2.as_str(), " And then:"] {
            assert!(!enc(t).contains(&poison), "{t:?} holds the injected token");
        }
        d.stop();
    }
}

/// Saving a finished call's turn holds no other call: with one app's save held (injected at
/// `save`: standing for a context file's write that waits, as a write into the page cache
/// does for dirty pages' writeback on a device under write load), another app's call runs its
/// passes and streams its tokens meanwhile; once the save goes on, both calls are answered
/// and the held one's turn is in its context. (With the write on the worker, no pass ran
/// while it waited.)
#[test]
#[cfg_attr(not(debug_assertions), ignore = "the hold is injected in debug builds only (make test runs them)")]
fn a_save_that_waits_holds_no_other_call() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let release = dir.path().join("release");
    let held = release.with_extension("held");
    let env = [("LLMS_FAULT_HOLD_AT", "save".to_string()), ("LLMS_FAULT_HOLD_FILE", release.display().to_string())];
    let d = Daemon::start_env(dir.path(), "hold", &dir.path().join("hold"), EXACT, &env);
    let slow = std::thread::spawn({
        let socket = d.socket.clone();
        move || {
            let mut c = Client::connect(&socket, "FAULT-app").unwrap();
            let ctx = c.new_ctx(None).unwrap();
            let (out, st) = c.call(&raw(&ctx, TEXTS[1], 8), &mut |_| {}).unwrap();
            let tokens = c.list().unwrap().into_iter().find(|i| i.ctx == ctx).unwrap().tokens;
            (out, st, tokens)
        }
    });
    llms_tests::wait_until("the first call's save to be held", Duration::from_secs(120), || held.exists().then_some(()));
    let mut c = d.client("other");
    let ctx = c.new_ctx(None).unwrap();
    let mut while_held = 0;
    let (out, st) = c
        .call(&raw(&ctx, TEXTS[2], 16), &mut |_| {
            if held.exists() {
                while_held += 1;
                if while_held == 4 {
                    // Its answer, too, goes through the syncer: the save goes on now.
                    std::fs::write(&release, b"").unwrap();
                }
            }
        })
        .unwrap();
    assert!(while_held >= 4, "the other call streamed {while_held} token(s) while the save was held: the save held the worker");
    assert_eq!(st.output_tokens, 16, "{out:?} {st:?}");
    let (slow_out, slow_st, slow_tokens) = slow.join().unwrap();
    assert_eq!(slow_st.output_tokens, 8, "{slow_out:?}");
    assert_eq!(slow_tokens, slow_st.context_tokens, "the held call's turn is saved in its context");
    d.stop();
}

/// A call the prefill lane takes from the line but cannot start (here its start panics,
/// injected for apps named `FAULT...`) is answered with an error there, and the lane and the
/// worker go on: the decoding call answers as it does alone, and a later call put in line is
/// still started by the lane beside a pass (were the failed call's place on the lane never
/// given back, no call could go to the lane again).
#[test]
#[cfg_attr(not(debug_assertions), ignore = "the fault is injected in debug builds only (make test runs them)")]
fn a_call_the_lane_cannot_start_is_answered_and_the_lane_goes_on() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let env = [("LLMS_FAULT_PANIC_AT", "begin".to_string())];
    let settings = format!("{EXACT}max_batch = 4\nprefill_lane = true\n");
    let d = Daemon::start_env(dir.path(), "lane-start", &dir.path().join("state"), &settings, &env);
    let (go, started) = std::sync::mpsc::channel::<()>();
    // When each of the steady call's tokens came: the later call waits for a few more after
    // the failed one's answer, so that it is put in line during a later pass (one put in line
    // during the same pass waits for the worker, as the lane is then still held by the failed
    // call), and then for half a step, so that it lands inside a pass. Sent the moment a token
    // arrived, it came as the pass that made the token ended, often in the worker's gap
    // between passes, where the worker starts it: one `make test` run had none of the 3 tries
    // started by the lane.
    let seen = Arc::new(std::sync::Mutex::new(Vec::<std::time::Instant>::new()));
    let others = std::thread::spawn({
        let (socket, seen) = (d.socket.clone(), Arc::clone(&seen));
        move || {
            let mut bad = Client::connect(&socket, "FAULT-app").unwrap();
            let bad_ctx = bad.new_ctx(None).unwrap();
            let mut good = Client::connect(&socket, "later").unwrap();
            let good_ctx = good.new_ctx(None).unwrap();
            started.recv().unwrap();
            let err = bad.call(&raw(&bad_ctx, TEXTS[1], 8), &mut |_| {}).unwrap_err();
            // A call put in line in the worker's short gap between two passes is started by
            // the worker (and may still prefill on the lane): the lane starts calls only during
            // a pass. So up to 3 later calls, each a few steady tokens after the last; a lane
            // never given back starts none of them.
            let mut later = None;
            for _ in 0..3 {
                let at = seen.lock().unwrap().len();
                // (A hang guard, not a timing assertion: the steady call has tokens to spare.)
                let t0 = std::time::Instant::now();
                while seen.lock().unwrap().len() < at + 3 && t0.elapsed() < Duration::from_secs(300) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let step = {
                    let s = seen.lock().unwrap();
                    s[s.len() - 1].duration_since(s[s.len() - 2])
                };
                std::thread::sleep(step / 2);
                later = Some(good.call(&raw(&good_ctx, TEXTS[2], 8), &mut |_| {}).unwrap());
                if good.stats().unwrap().lane_starts > 0 {
                    break;
                }
            }
            (format!("{err:#}"), later.unwrap())
        }
    });
    let mut c = d.client("steady");
    let ctx = c.new_ctx(None).unwrap();
    let (out, _) = c
        .call(&raw(&ctx, TEXTS[0], 96), &mut |_| {
            let mut s = seen.lock().unwrap();
            s.push(std::time::Instant::now());
            if s.len() == 1 {
                let _ = go.send(());
            }
        })
        .unwrap();
    let (err, (later_out, later_st)) = others.join().unwrap();
    let st = c.stats().unwrap();
    assert!(err.contains("failed inside the service"), "the call that could not start: {err}");
    assert!(!later_out.is_empty() && later_st.lane_tokens == later_st.prompt_tokens, "the later call went to the lane: {later_st:?}");
    assert!(st.lane_starts > 0, "the lane started no call after the failed one: {st:?}");
    // The decoding call's answer is its answer alone (a fresh context, the same prompt).
    let solo_ctx = c.new_ctx(None).unwrap();
    let (solo, _) = c.call(&raw(&solo_ctx, TEXTS[0], 96), &mut |_| {}).unwrap();
    assert_eq!(out, solo, "the decoding call's answer changed");
    d.stop();
}

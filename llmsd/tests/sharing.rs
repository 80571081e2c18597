//! Shared prefixes end to end (#59): the real daemon and model. Contexts of one app that open
//! with the same system prompt take its chunks from the first instead of computing them, and
//! answer exactly as without sharing; another app never finds them; under a budget that
//! evicts the shared chunks the answers stay the same.

mod common;

use common::{kernel_ok, Daemon};
use llmsd::client::{Client, ClientError};
use llmsd::proto::{Call, CallStats};

/// A system prompt of several chunks (~150 tokens of the default model).
fn system_prompt() -> String {
    let line = "You answer questions about the weather in the mountains, briefly and with care. ";
    line.repeat(8)
}

const QUESTIONS: [&str; 4] = ["Will it snow tomorrow?", "Is it windy on the ridge?", "Should I bring a coat?", "How cold is it at night?"];

fn call(c: &mut Client, ctx: &str, prompt: &str) -> (String, CallStats) {
    let call =
        Call { ctx: ctx.into(), prompt: prompt.into(), max_tokens: 10, temperature: 0.0, seed: 0, stop: vec![], raw: false, top_p: None };
    c.call(&call, &mut |_| {}).expect("call")
}

/// Each of `n` contexts of app `app` opens with the system prompt and gets its question, then
/// a second turn; the answers and each first call's stats.
fn conversations(c: &mut Client, n: usize) -> (Vec<String>, Vec<CallStats>) {
    let sys = system_prompt();
    let mut texts = Vec::new();
    let mut firsts = Vec::new();
    for k in 0..n {
        let id = c.new_ctx(Some(&sys)).expect("new_ctx");
        let (t, st) = call(c, &id, QUESTIONS[k % QUESTIONS.len()]);
        texts.push(t);
        firsts.push(st);
        texts.push(call(c, &id, "And the day after?").0);
    }
    (texts, firsts)
}

#[test]
fn contexts_with_one_system_prompt_share_it_and_answer_as_without() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // One KV level: a shared chunk is then exactly the chunk each context would compute.
    let exact = "levels = [\"int8\"]\nratio = 1.0\n";
    let run = |name: &str, settings: &str| {
        let d = Daemon::start(dir.path(), name, &dir.path().join(name), &format!("{exact}{settings}"));
        let mut a = d.client("weather");
        let out = conversations(&mut a, 3);
        let mut b = d.client("other-app");
        let other = conversations(&mut b, 1);
        let st = a.stats().unwrap();
        d.stop();
        (out, other, st)
    };
    let ((plain, plain_st), _, _) = run("plain", "prefix_sharing = false\nbudget = \"1GiB\"\n");
    assert!(plain_st.iter().all(|s| s.cached_tokens == 0), "nothing is shared with prefix_sharing = false");
    for (name, budget) in [("shared", "\"1GiB\""), ("shared-tight", "\"2MiB\"")] {
        let ((texts, firsts), (_, other), st) = run(name, &format!("budget = {budget}\n"));
        assert_eq!(texts, plain, "{name}: every answer is the one computed without sharing");
        assert_eq!(firsts[0].cached_tokens, 0, "{name}: the first context computes its prompt");
        for (k, f) in firsts.iter().enumerate().skip(1) {
            // The system prompt's whole chunks (BOS, the system turn), at least 128 tokens.
            assert!(f.cached_tokens >= 128, "{name}: context {k} took the shared prefix: {f:?}");
            assert!(f.cached_tokens < f.prompt_tokens);
        }
        assert_eq!(other[0].cached_tokens, 0, "{name}: another app never finds this app's prefix");
        let sh = &st.sharing;
        assert_eq!(sh.reused_tokens, u64::from(firsts[1].cached_tokens + firsts[2].cached_tokens), "{name}: {sh:?}");
        assert!(sh.unique_chunks >= 8 && sh.logical_chunks == 3 * sh.unique_chunks, "{name}: three contexts hold one copy: {sh:?}");
        if name == "shared-tight" {
            assert!(st.evicted_chunks > 0, "the budget evicted chunks: {st:?}");
        }
    }
}

#[test]
fn a_fork_goes_on_apart_from_its_source() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exact = "levels = [\"int8\"]\nratio = 1.0\nbudget = \"1GiB\"\n";
    let sys = system_prompt();
    let (t1, t2) = ("Will it rain on Sunday?", "What about Monday?");
    // Without sharing: the two conversations the fork makes, each computed whole.
    let d = Daemon::start(dir.path(), "plain", &dir.path().join("plain"), &format!("{exact}prefix_sharing = false\n"));
    let mut c = d.client("weather");
    let mut plain = Vec::new();
    for q in ["Should I bring a coat?", "Is the pass open?"] {
        let id = c.new_ctx(Some(&sys)).unwrap();
        call(&mut c, &id, t1);
        call(&mut c, &id, t2);
        plain.push(call(&mut c, &id, q).0);
        plain.push(call(&mut c, &id, "Thanks.").0);
    }
    let empty = c.new_ctx(None).unwrap();
    let refused = c.fork(&empty).unwrap_err().to_string();
    assert!(refused.contains("prefix_sharing"), "{refused}");
    d.stop();

    let d = Daemon::start(dir.path(), "shared", &dir.path().join("shared"), exact);
    let mut c = d.client("weather");
    let a = c.new_ctx(Some(&sys)).unwrap();
    call(&mut c, &a, t1);
    call(&mut c, &a, t2);
    let before = c.stats().unwrap();
    let b = c.fork(&a).unwrap();
    let after = c.stats().unwrap();
    let (ia, ib) = (after.mine.iter().find(|x| x.ctx == a).unwrap(), after.mine.iter().find(|x| x.ctx == b).unwrap());
    assert_eq!(ia.tokens, ib.tokens, "the fork holds its source's tokens");
    assert_eq!(after.sharing.forks, 1);
    assert!(after.sharing.unique_chunks >= 8 && after.sharing.logical_chunks == 2 * after.sharing.unique_chunks, "{:?}", after.sharing);
    // No K/V copied but the last, partial chunk (at most 200 KiB for this model).
    let grew = after.resident_bytes.saturating_sub(before.resident_bytes);
    assert!(grew <= 200 << 10, "the fork added {grew} bytes of memory");
    // Another app cannot fork it; a fork of a missing context is not found.
    let mut other = d.client("other-app");
    assert!(other.fork(&a).is_err());
    assert!(c.fork("ctx-does-not-exist").is_err());
    // Each goes on apart from the other, as if computed alone; the fork's first call loads nothing.
    let (ta, _) = call(&mut c, &a, "Should I bring a coat?");
    let (tb, sb) = call(&mut c, &b, "Is the pass open?");
    assert_eq!((sb.missing_chunks, sb.recomputed_chunks), (0, 0), "{sb:?}");
    // Deleting the source leaves the fork whole.
    c.del_ctx(&a).unwrap();
    let (tb2, _) = call(&mut c, &b, "Thanks.");
    assert_eq!(ta, plain[0]);
    assert_eq!(tb, plain[2]);
    assert_eq!(tb2, plain[3]);
    d.stop();
}

#[test]
fn shared_chunks_outlive_a_restart_and_a_kill() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exact = "levels = [\"int8\"]\nratio = 1.0\nbudget = \"1GiB\"\n";
    let sys = system_prompt();
    let state = dir.path().join("state");
    let d = Daemon::start(dir.path(), "a", &state, exact);
    let mut c = d.client("weather");
    let ids: Vec<String> = (0..3).map(|_| c.new_ctx(Some(&sys)).unwrap()).collect();
    for (k, id) in ids.iter().enumerate() {
        call(&mut c, id, QUESTIONS[k]);
    }
    let before = c.stats().unwrap().sharing;
    assert!(before.unique_chunks >= 8 && before.logical_chunks == 3 * before.unique_chunks, "{before:?}");
    d.stop();
    // A clean restart: the contexts hold their shared chunks again, read from the pool's
    // records (the next calls load them, nothing is recomputed).
    let d = Daemon::start(dir.path(), "b", &state, exact);
    let mut c = d.client("weather");
    let after = c.stats().unwrap().sharing;
    assert_eq!((after.unique_chunks, after.logical_chunks), (before.unique_chunks, before.logical_chunks), "{after:?}");
    let (_, st) = call(&mut c, &ids[1], "And tomorrow?");
    assert_eq!(st.recomputed_chunks, 0, "the shared chunks were read back: {st:?}");
    // kill -9, then one context deleted while the service is down is not possible; delete one
    // after the restart instead: the others keep their chunks, and the sweep at the next start
    // leaves no record unreachable.
    d.kill9();
    let d = Daemon::start(dir.path(), "c", &state, exact);
    let mut c = d.client("weather");
    c.del_ctx(&ids[0]).unwrap();
    let (_, st) = call(&mut c, &ids[2], "And tomorrow?");
    assert_eq!(st.recomputed_chunks, 0, "{st:?}");
    let mid = c.stats().unwrap().sharing;
    assert_eq!(mid.logical_chunks, 2 * mid.unique_chunks, "{mid:?}");
    d.stop();
    // The doctor finds every shared chunk reached by a saved context; with the two context
    // files gone (lost while the service was down), none is, and the next start frees them.
    let shared = |state: &std::path::Path| -> (u64, u64) {
        let out = std::process::Command::new(common::llms_bin()).args(["doctor", "--json", "--state-dir"]).arg(state).output().unwrap();
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
        let c = v.as_array().unwrap().iter().find(|c| c["facility"] == "shared chunks").cloned().unwrap_or_default();
        (c["named"].as_u64().unwrap_or(0), c["reached"].as_u64().unwrap_or(0))
    };
    assert_eq!(shared(&state), (mid.unique_chunks, mid.unique_chunks));
    for id in &ids[1..] {
        for ext in ["json", "json.prev"] {
            let _ = std::fs::remove_file(state.join("contexts").join(format!("{id}.{ext}")));
        }
    }
    assert_eq!(shared(&state), (mid.unique_chunks, 0), "unreachable once no context file names them");
    let d = Daemon::start(dir.path(), "d", &state, exact);
    let mut c = d.client("weather");
    assert_eq!(c.stats().unwrap().sharing.unique_chunks, 0);
    d.stop();
    assert_eq!(shared(&state), (0, 0), "the start freed them");
    let pool_files: Vec<_> = walk(&state).into_iter().filter(|p| p.to_string_lossy().contains("ctx-ffffffffffffffff")).collect();
    let held: u64 = pool_files.iter().map(|p| std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(p).unwrap()) * 512).sum();
    assert_eq!(held, 0, "no store space is left to shared chunks no context holds: {pool_files:?}");
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// One client of the storm: what it knows of each of its contexts. `tokens` is what `list`
/// said after the last acknowledged change; `history` the acknowledged (prompt, answer) turns;
/// `tainted` when a kill may have left a turn in the context that was never acknowledged.
#[derive(Debug, Clone)]
struct Known {
    ctx: String,
    tokens: u32,
    history: Vec<(String, String)>,
    tainted: bool,
}

const STORM_PROMPTS: [&str; 5] = ["Is it cold?", "Any snow?", "What about wind?", "And fog?", "Thanks."];

/// Forks, calls, deletes and new contexts on one app's contexts until `until`, through kills
/// of the service (reconnecting as they happen).
fn storm_client(socket: &std::path::Path, k: u64, until: std::time::Instant) -> Result<Vec<Known>, String> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(k);
    let sys = system_prompt();
    let mut mine: Vec<Known> = Vec::new();
    let connect = || -> Option<Client> { Client::connect(socket, "storm").ok() };
    let mut c: Option<Client> = None;
    while std::time::Instant::now() < until {
        let Some(cl) = c.as_mut() else {
            std::thread::sleep(std::time::Duration::from_millis(100));
            c = connect();
            if let Some(cl) = c.as_mut() {
                // After a reconnect: every acknowledged context is there, with at least its
                // acknowledged tokens; one with more holds a turn nobody saw acknowledged.
                let list = match cl.list() {
                    Ok(l) => l,
                    // Killed between the bind and the list: connect again.
                    Err(ClientError::Frame { .. }) => {
                        c = None;
                        continue;
                    }
                    Err(e) => return Err(format!("client {k}: listing after a reconnect: {e}")),
                };
                for m in &mut mine {
                    let Some(i) = list.iter().find(|i| i.ctx == m.ctx) else {
                        return Err(format!("client {k}: context {} is gone", m.ctx));
                    };
                    if i.tokens < m.tokens {
                        return Err(format!("client {k}: context {} holds {} tokens, {} acknowledged", m.ctx, i.tokens, m.tokens));
                    }
                    m.tainted |= i.tokens != m.tokens;
                }
            }
            continue;
        };
        let tokens_of = |cl: &mut Client, ctx: &str| cl.list().ok().and_then(|l| l.into_iter().find(|i| i.ctx == ctx)).map(|i| i.tokens);
        let r: Result<(), ()> = match rng.gen_range(0..10) {
            0 | 1 if mine.len() < 6 => {
                cl.new_ctx(Some(&sys)).map(|ctx| mine.push(Known { ctx, tokens: 0, history: vec![], tainted: false })).map_err(|_| ())
            }
            2 | 3 if !mine.is_empty() => {
                let i = rng.gen_range(0..mine.len());
                let src = mine[i].clone();
                match cl.fork(&src.ctx) {
                    Ok(ctx) => {
                        let tokens = tokens_of(cl, &ctx).unwrap_or(src.tokens);
                        mine.push(Known { ctx, tokens, ..src });
                        Ok(())
                    }
                    Err(_) => Err(()),
                }
            }
            4 if mine.len() > 1 => {
                let i = rng.gen_range(0..mine.len());
                let gone = mine.remove(i);
                cl.del_ctx(&gone.ctx).map_err(|_| ())
            }
            _ if !mine.is_empty() => {
                let i = rng.gen_range(0..mine.len());
                let p = STORM_PROMPTS[rng.gen_range(0..STORM_PROMPTS.len())];
                let call = Call {
                    ctx: mine[i].ctx.clone(),
                    prompt: p.into(),
                    max_tokens: 6,
                    temperature: 0.0,
                    seed: 0,
                    stop: vec![],
                    raw: false,
                    top_p: None,
                };
                match cl.call(&call, &mut |_| {}) {
                    Ok((text, _)) => {
                        let ctx = mine[i].ctx.clone();
                        mine[i].history.push((p.into(), text));
                        mine[i].tokens = tokens_of(cl, &ctx).unwrap_or(0);
                        Ok(())
                    }
                    Err(_) => Err(()),
                }
            }
            _ => Ok(()),
        };
        if r.is_err() {
            // The service was killed (or is starting again): reconnect and check.
            c = None;
        }
    }
    Ok(mine)
}

/// A storm of forks, calls, deletes and new contexts of one app sharing a system prompt, through
/// two kill -9s and a full disk (its blocks and inodes, 16-22 s in, between the kills): no
/// acknowledged context or turn is lost, nothing unreachable is left after a start, and every
/// answer is the one a service without sharing gives.
#[test]
fn a_storm_of_forks_deletes_kills_and_a_full_disk_loses_nothing() {
    let Some((dir, img, mnt)) = common::small_disk(256 << 20, 4096) else { return };
    // One level (exact), and a budget that keeps evicting shared chunks.
    let settings = "levels = [\"int8\"]\nratio = 1.0\nbudget = \"6MiB\"\nmax_contexts_per_app = 32\n";
    let state = mnt.join("state");
    let mut d = Daemon::start_on(dir.path(), "storm", &state, settings, Some(&img));
    let socket = d.socket.clone();
    let t0 = std::time::Instant::now();
    let until = t0 + std::time::Duration::from_secs(40);
    let clients: Vec<_> = (0..3)
        .map(|k| {
            let s = socket.clone();
            std::thread::spawn(move || storm_client(&s, k, until))
        })
        .collect();
    let wait = |at: u64| {
        while t0.elapsed() < std::time::Duration::from_secs(at) {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    wait(12);
    d.assert_running();
    d.kill9();
    d = Daemon::start_on(dir.path(), "storm", &state, settings, Some(&img));
    wait(16);
    let filler = common::fill_disk(&d, &mnt);
    wait(22);
    std::fs::remove_dir_all(&filler).unwrap();
    // The clients met the full disk (a write refused with ENOSPC, said in llmsd's log).
    let log = d.log_text();
    assert!(log.contains("No space left on device"), "the disk was full for the storm: {log}");
    wait(26);
    d.assert_running();
    d.kill9();
    d = Daemon::start_on(dir.path(), "storm", &state, settings, Some(&img));
    let known: Vec<Known> =
        clients.into_iter().flat_map(|h| h.join().unwrap().unwrap_or_else(|e| panic!("{e}\n{}", d.log_text()))).collect();
    d.stop();
    let checked: Vec<&Known> = known.iter().filter(|k| !k.tainted && !k.history.is_empty()).collect();
    eprintln!("storm: {} contexts known, {} checked against a run without sharing", known.len(), checked.len());
    assert!(checked.len() >= 3, "the storm ran: {known:?}");
    // Every acknowledged context is there, as acknowledged, after a start that sweeps what
    // the kills left; a second start finds nothing left to free.
    let d = Daemon::start_on(dir.path(), "after", &state, settings, Some(&img));
    let mut c = d.client("storm");
    let list = c.list().unwrap();
    for k in &known {
        let i = list.iter().find(|i| i.ctx == k.ctx).unwrap_or_else(|| panic!("context {} is gone", k.ctx));
        assert!(k.tainted || i.tokens == k.tokens, "{k:?} vs {i:?}");
    }
    d.stop();
    let d = Daemon::start_on(dir.path(), "again", &state, settings, Some(&img));
    let log = d.log_text();
    assert!(!log.contains("freed shared chunks"), "a start after a clean stop finds no shared chunk unreachable: {log}");
    d.stop();
    // Every acknowledged answer is the one a service without sharing gives to that history.
    let p = Daemon::start(dir.path(), "plain", &dir.path().join("plain"), &format!("{settings}prefix_sharing = false\n"));
    let mut c = p.client("storm");
    let sys = system_prompt();
    for k in checked {
        let id = c.new_ctx(Some(&sys)).unwrap();
        for (prompt, answer) in &k.history {
            let call = Call {
                ctx: id.clone(),
                prompt: prompt.clone(),
                max_tokens: 6,
                temperature: 0.0,
                seed: 0,
                stop: vec![],
                raw: false,
                top_p: None,
            };
            let (text, _) = c.call(&call, &mut |_| {}).unwrap();
            assert_eq!(&text, answer, "context {}: an answer differs from the run without sharing", k.ctx);
        }
    }
    p.stop();
}

#[test]
fn a_declared_public_prefix_is_shared_across_apps_and_nothing_else() {
    if !kernel_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("instructions.txt");
    std::fs::write(&file, system_prompt()).unwrap();
    let exact = "levels = [\"int8\"]\nratio = 1.0\nbudget = \"1GiB\"\n";
    let run = |name: &str, extra: &str| {
        let d = Daemon::start(dir.path(), name, &dir.path().join(name), &format!("{exact}{extra}"));
        let mut out = Vec::new();
        for app in ["mail", "notes", "maps"] {
            let mut c = d.client(app);
            let sys = if app == "maps" { format!("{} Be brief.", system_prompt()) } else { system_prompt() };
            let id = c.new_ctx(Some(&sys)).unwrap();
            out.push(call(&mut c, &id, QUESTIONS[1]));
        }
        d.stop();
        out
    };
    let plain = run("plain", "prefix_sharing = false\n");
    let public = run("public", &format!("public_prefixes = [{file:?}]\n"));
    for (k, ((a, _), (b, _))) in plain.iter().zip(&public).enumerate() {
        assert_eq!(a, b, "app {k}: the answer is the one computed without sharing");
    }
    assert_eq!(public[0].1.cached_tokens, 0, "the first app computes the instructions");
    // The whole chunks of the declared prefix (BOS and the system turn, ~120 tokens here).
    let c = public[1].1.cached_tokens;
    assert!(c >= 96 && c.is_multiple_of(16), "another app takes the declared prefix: {:?}", public[1].1);
    // An app whose system prompt goes on past the declared text shares the whole chunks that
    // lie within it, and nothing past them.
    let within = public[1].1.cached_tokens;
    assert!(public[2].1.cached_tokens > 0 && public[2].1.cached_tokens <= within, "{:?}", public[2].1);
    // Without the declaration another app finds nothing (contexts_with_one_system_prompt_...).
    let refused = refused_public(dir.path());
    assert!(refused.contains("public_prefixes"), "{refused}");
}

/// A start with a public prefix file that does not exist: refused, naming the setting.
fn refused_public(dir: &std::path::Path) -> String {
    common::refused_start(dir, "bad-public", &format!("public_prefixes = [{:?}]\n", dir.join("missing.txt")))
}

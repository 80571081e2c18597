//! Context-switching traces (LLMS eq. 5): a header with the generator's parameters, then one
//! record per `callLLM` — time, context, app, prompt, expected output — as JSON lines
//! (docs/traces.md). `generate` synthesizes them from real text with the paper's switching
//! patterns and Poisson arrivals.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Format version of trace files.
pub const TRACE_VERSION: u32 = 1;

/// How the next context is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pattern {
    /// Every context equally likely.
    Random,
    /// First-order Markov over the recency order: the next call goes to the context at depth
    /// d of the LRU stack with probability ∝ `markov_decay`^d (recently used contexts first).
    Markov,
    /// Contexts drawn by a Gaussian over their mean delta length: moderate workloads most.
    Gaussian,
}

impl Pattern {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "random" => Some(Self::Random),
            "markov" => Some(Self::Markov),
            "gaussian" => Some(Self::Gaussian),
            _ => None,
        }
    }
}

/// A workload of Table 3: the task, how much each call adds to the context, what it asks.
#[derive(Debug, Clone, Copy)]
pub struct Task {
    pub name: &'static str,
    /// The paper's dataset for this task (the text here comes from the corpus instead).
    pub dataset: &'static str,
    /// Context growth per call, tokens (Table 3).
    pub delta: (usize, usize),
    pub instruction: &'static str,
    pub max_tokens: u32,
}

/// Table 3 of the LLMS paper.
pub const TASKS: [Task; 6] = [
    Task {
        name: "classification",
        dataset: "AGnews",
        delta: (200, 500),
        instruction: "Classify the topic of this text in one word.",
        max_tokens: 8,
    },
    Task { name: "summary", dataset: "Xsum", delta: (1000, 2000), instruction: "Summarize this document in one sentence.", max_tokens: 48 },
    Task { name: "chat", dataset: "Samsum", delta: (100, 300), instruction: "Summarize this conversation briefly.", max_tokens: 32 },
    Task {
        name: "comprehension",
        dataset: "cnn_dailymail",
        delta: (500, 1000),
        instruction: "What is the main point of this text?",
        max_tokens: 32,
    },
    Task {
        name: "translation",
        dataset: "WMT17-de-en",
        delta: (100, 500),
        instruction: "Translate this text into German.",
        max_tokens: 64,
    },
    Task {
        name: "sentiment",
        dataset: "SST-2",
        delta: (10, 100),
        instruction: "Is the tone of this text positive or negative?",
        max_tokens: 4,
    },
];

/// The generator's parameters; the header of every trace repeats them.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GenParams {
    pub contexts: usize,
    pub apps: usize,
    pub calls: usize,
    pub pattern: Pattern,
    /// Poisson arrival rate, calls per second.
    pub rate: f64,
    pub seed: u64,
    /// Delta lengths are scaled by this (a small model or a short window wants shorter calls).
    pub scale: f64,
    pub markov_decay: f64,
    /// Files the prompts' text comes from.
    pub corpus: Vec<PathBuf>,
    /// Tokens of each app's system prompt (corpus text, one per app), which every context of
    /// the app opens with: what prefix sharing shares. 0: none.
    #[serde(default)]
    pub system_tokens: usize,
}

/// The first line of a trace.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Header {
    pub llms_trace: u32,
    pub generator: GenParams,
    /// Task of each context.
    pub tasks: Vec<String>,
}

/// One call.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Record {
    /// Seconds from the start.
    pub t: f64,
    /// Context index (0..contexts).
    pub ctx: usize,
    pub app: String,
    pub prompt: String,
    pub max_tokens: u32,
    /// Words of corpus text in the prompt (the context's growth, before the template).
    pub delta_words: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_output: Option<String>,
    /// On a context's first call: the system prompt its app opens every context with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
}

/// Words per token, roughly, for English under BPE tokenizers: delta lengths are in tokens,
/// the corpus is cut in words.
const WORDS_PER_TOKEN: f64 = 0.75;

/// The default corpus: Debian's license texts (real English prose every Debian system ships).
pub fn default_corpus() -> Vec<PathBuf> {
    let dir = Path::new("/usr/share/common-licenses");
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()).filter(|p| p.is_file()).collect();
    v.sort();
    v
}

fn load_words(files: &[PathBuf]) -> Result<Vec<String>> {
    let mut words = Vec::new();
    for f in files {
        let t = std::fs::read(f).with_context(|| format!("reading corpus file {}", f.display()))?;
        words.extend(String::from_utf8_lossy(&t).split_whitespace().map(str::to_string));
    }
    if words.len() < 1000 {
        bail!("the corpus has {} words; at least 1000 are needed", words.len());
    }
    Ok(words)
}

/// Synthesizes a trace.
pub fn generate(p: &GenParams) -> Result<(Header, Vec<Record>)> {
    if p.contexts == 0 || p.apps == 0 || p.apps > p.contexts || p.calls == 0 {
        bail!("need at least one context and call, and at most one app per context");
    }
    let ok = p.rate > 0.0 && p.rate.is_finite() && p.scale > 0.0 && p.scale <= 4.0 && p.markov_decay > 0.0 && p.markov_decay < 1.0;
    if !ok {
        bail!("rate must be > 0, scale in (0, 4], markov_decay in (0, 1)");
    }
    let words = load_words(&p.corpus)?;
    // Each app's system prompt, from a generator of its own: the calls are the same with and
    // without system prompts, so a comparison changes only what they add.
    let systems: Vec<Option<String>> = (0..p.apps)
        .map(|a| {
            #[allow(clippy::cast_precision_loss)]
            (p.system_tokens > 0)
                .then(|| passage(&mut ChaCha8Rng::seed_from_u64(p.seed ^ 0x5157_0000 ^ a as u64), &words, p.system_tokens as f64).0)
        })
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
    let tasks: Vec<Task> = (0..p.contexts).map(|i| TASKS[(i + rng.gen_range(0..TASKS.len())) % TASKS.len()]).collect();
    let mean_delta = |t: &Task| (t.delta.0 + t.delta.1) as f64 / 2.0;
    // Gaussian weights over the contexts' mean delta lengths: centred on the middle one.
    let means: Vec<f64> = tasks.iter().map(mean_delta).collect();
    let mu = means.iter().sum::<f64>() / means.len() as f64;
    let sd = (means.iter().map(|m| (m - mu).powi(2)).sum::<f64>() / means.len() as f64).sqrt().max(1.0);
    let gauss: Vec<f64> = means.iter().map(|m| (-0.5 * ((m - mu) / sd).powi(2)).exp()).collect();
    let mut lru: Vec<usize> = (0..p.contexts).collect();
    let mut t = 0.0;
    let mut out = Vec::with_capacity(p.calls);
    for i in 0..p.calls {
        // Poisson arrivals: exponential gaps.
        t += -(1.0 - rng.gen::<f64>()).ln() / p.rate;
        let ctx = match p.pattern {
            // Every context is active: its app creates it with a first call, in turn, before
            // the pattern chooses. (Without this a Markov chain that favours recent contexts
            // would never reach most of them, and "N active contexts" would be a handful.)
            _ if i < p.contexts => i,
            Pattern::Random => rng.gen_range(0..p.contexts),
            Pattern::Markov => {
                let w: Vec<f64> = (0..lru.len()).map(|d| p.markov_decay.powi(i32::try_from(d).unwrap_or(i32::MAX))).collect();
                lru[pick(&mut rng, &w)]
            }
            Pattern::Gaussian => pick(&mut rng, &gauss),
        };
        if let Some(pos) = lru.iter().position(|&c| c == ctx) {
            lru.remove(pos);
        }
        lru.insert(0, ctx);
        let task = &tasks[ctx];
        let (lo, hi) = task.delta;
        let toks = rng.gen_range(lo..=hi) as f64 * p.scale;
        let (passage, n) = passage(&mut rng, &words, toks);
        out.push(Record {
            t: (t * 1e6).round() / 1e6,
            ctx,
            app: format!("app{}", ctx % p.apps),
            prompt: format!("{}\n\n{passage}", task.instruction),
            max_tokens: task.max_tokens,
            delta_words: n,
            expected_output: None,
            system: if i < p.contexts { systems[ctx % p.apps].clone() } else { None },
        });
    }
    let header = Header { llms_trace: TRACE_VERSION, generator: p.clone(), tasks: tasks.iter().map(|t| t.name.to_string()).collect() };
    Ok((header, out))
}

/// About `tokens` tokens of consecutive corpus words from a place `rng` picks, and how many words.
fn passage(rng: &mut ChaCha8Rng, words: &[String], tokens: f64) -> (String, usize) {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let n = ((tokens * WORDS_PER_TOKEN).round() as usize).clamp(1, words.len() / 2);
    let start = rng.gen_range(0..words.len() - n);
    (words[start..start + n].join(" "), n)
}

/// An index drawn with probability ∝ `w`.
fn pick(rng: &mut ChaCha8Rng, w: &[f64]) -> usize {
    let total: f64 = w.iter().sum();
    let mut x = rng.gen::<f64>() * total;
    for (i, &wi) in w.iter().enumerate() {
        if x < wi {
            return i;
        }
        x -= wi;
    }
    w.len() - 1
}

/// Writes a trace as JSON lines.
pub fn write(path: &Path, h: &Header, recs: &[Record]) -> Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?);
    writeln!(f, "{}", serde_json::to_string(h)?)?;
    for r in recs {
        writeln!(f, "{}", serde_json::to_string(r)?)?;
    }
    f.flush()?;
    Ok(())
}

/// Reads a trace; a malformed line is an error naming it.
pub fn read(path: &Path) -> Result<(Header, Vec<Record>)> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
    let (_, first) = lines.next().with_context(|| format!("{}: empty trace", path.display()))?;
    let h: Header = serde_json::from_str(first).with_context(|| format!("{}:1: not a trace header", path.display()))?;
    if h.llms_trace != TRACE_VERSION {
        bail!("{}: trace version {} (this build reads {TRACE_VERSION})", path.display(), h.llms_trace);
    }
    let mut recs = Vec::new();
    let mut last = 0.0;
    for (i, l) in lines {
        let r: Record = serde_json::from_str(l).with_context(|| format!("{}:{}: not a trace record", path.display(), i + 1))?;
        if r.ctx >= h.generator.contexts || r.t.is_nan() || r.t < last {
            bail!("{}:{}: context out of range or time going backwards", path.display(), i + 1);
        }
        last = r.t;
        recs.push(r);
    }
    Ok((h, recs))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pattern: Pattern) -> GenParams {
        let corpus = vec![PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/gpl-3.txt"))];
        GenParams {
            contexts: 8,
            apps: 3,
            calls: 4000,
            pattern,
            rate: 2.0,
            seed: 7,
            scale: 1.0,
            markov_decay: 0.5,
            corpus,
            system_tokens: 0,
        }
    }

    #[test]
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    fn traces_are_reproducible_and_have_the_asked_statistics() {
        let (h, a) = generate(&params(Pattern::Random)).unwrap();
        let (_, b) = generate(&params(Pattern::Random)).unwrap();
        assert_eq!(a, b, "a seed makes it reproducible");
        let (_, c) = generate(&GenParams { seed: 8, ..params(Pattern::Random) }).unwrap();
        assert_ne!(a, c);
        // Poisson arrivals at rate 2/s: the mean gap is 0.5 s.
        let mean_gap = a.last().unwrap().t / a.len() as f64;
        assert!((mean_gap - 0.5).abs() < 0.05, "mean gap {mean_gap}");
        // Random: every context near 1/8 of the calls.
        let mut count = [0usize; 8];
        for r in &a {
            count[r.ctx] += 1;
            assert_eq!(r.app, format!("app{}", r.ctx % 3));
            let task = TASKS.iter().find(|t| t.name == h.tasks[r.ctx]).unwrap();
            let (lo, hi) = task.delta;
            let (lo, hi) = ((lo as f64 * WORDS_PER_TOKEN).floor() as usize, (hi as f64 * WORDS_PER_TOKEN).ceil() as usize);
            assert!((lo.max(1)..=hi).contains(&r.delta_words), "{} words for {}", r.delta_words, task.name);
            assert!(r.prompt.starts_with(task.instruction));
        }
        assert!(count.iter().all(|&n| (400..600).contains(&n)), "{count:?}");
    }

    #[test]
    fn every_context_is_created_first_whatever_the_pattern() {
        for pattern in [Pattern::Random, Pattern::Markov, Pattern::Gaussian] {
            let (_, recs) = generate(&GenParams { contexts: 32, calls: 96, markov_decay: 0.5, ..params(pattern) }).unwrap();
            let first: Vec<usize> = recs.iter().take(32).map(|r| r.ctx).collect();
            assert_eq!(first, (0..32).collect::<Vec<_>>(), "{pattern:?}");
            // Markov then favours the most recently created: the last ones, not context 0.
            if pattern == Pattern::Markov {
                let later = |c: usize| recs[32..].iter().filter(|r| r.ctx == c).count();
                assert!(later(31) + later(30) > later(0) + later(1), "{pattern:?}");
            }
        }
    }

    #[test]
    fn markov_favours_recent_contexts_and_gaussian_moderate_ones() {
        let (_, m) = generate(&params(Pattern::Markov)).unwrap();
        let repeats = m.windows(2).filter(|w| w[0].ctx == w[1].ctx).count() as f64 / m.len() as f64;
        assert!(repeats > 0.4, "with decay 0.5 about half the calls stay: {repeats}");
        let (_, r) = generate(&params(Pattern::Random)).unwrap();
        let rr = r.windows(2).filter(|w| w[0].ctx == w[1].ctx).count() as f64 / r.len() as f64;
        assert!(rr < 0.2, "random repeats about 1/8: {rr}");
        let (h, g) = generate(&params(Pattern::Gaussian)).unwrap();
        let mean = |t: &str| {
            let d = TASKS.iter().find(|x| x.name == t).unwrap().delta;
            (d.0 + d.1) as f64 / 2.0
        };
        let mu = h.tasks.iter().map(|t| mean(t)).sum::<f64>() / 8.0;
        let far = (0..8).max_by(|&a, &b| (mean(&h.tasks[a]) - mu).abs().total_cmp(&(mean(&h.tasks[b]) - mu).abs())).unwrap();
        let near = (0..8).min_by(|&a, &b| (mean(&h.tasks[a]) - mu).abs().total_cmp(&(mean(&h.tasks[b]) - mu).abs())).unwrap();
        let n = |c: usize| g.iter().filter(|r| r.ctx == c).count();
        assert!(n(near) > n(far), "moderate {} vs extreme {}", n(near), n(far));
    }

    #[test]
    fn system_prompts_are_per_app_and_change_nothing_else() {
        let base = GenParams { calls: 40, ..params(Pattern::Markov) };
        let (_, plain) = generate(&base).unwrap();
        let (_, with) = generate(&GenParams { system_tokens: 200, ..base }).unwrap();
        let strip = |r: &Record| Record { system: None, ..r.clone() };
        assert_eq!(plain, with.iter().map(strip).collect::<Vec<_>>(), "the calls are the same");
        // Every context's first call carries its app's prompt; no later call does.
        let mut by_app = std::collections::HashMap::new();
        for (i, r) in with.iter().enumerate() {
            let first = with[..i].iter().all(|x| x.ctx != r.ctx);
            assert_eq!(r.system.is_some(), first, "call {i}");
            if let Some(s) = &r.system {
                assert_eq!(by_app.entry(r.app.clone()).or_insert_with(|| s.clone()), s, "one prompt per app");
                let words = s.split_whitespace().count();
                assert_eq!(words, 150, "200 tokens of words");
            }
        }
        assert_eq!(by_app.len(), 3);
        assert_eq!(by_app.values().collect::<std::collections::HashSet<_>>().len(), 3, "apps differ");
    }

    #[test]
    fn traces_round_trip_and_bad_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        let (h, recs) = generate(&GenParams { calls: 20, ..params(Pattern::Markov) }).unwrap();
        write(&p, &h, &recs).unwrap();
        assert_eq!(read(&p).unwrap(), (h, recs));
        std::fs::write(&p, "{\"llms_trace\":1}\n").unwrap();
        assert!(read(&p).is_err());
        assert!(generate(&GenParams { apps: 9, ..params(Pattern::Random) }).is_err());
        assert!(generate(&GenParams { corpus: vec![], ..params(Pattern::Random) }).is_err());
    }
}

//! `llms report`: gathers the experiments' tables and plots (docs/results) into one page
//! (docs/RESULTS.md) with the machine they ran on and the command that made each, so anyone can
//! run every figure again. Text written by hand lives next to the figures and is kept: the
//! page's introduction in `intro.md`, the analysis of a figure in `<name>.notes.md`. Plots
//! whose JSON holds their figure are drawn again, so a change of style needs no new run.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::provenance::{machine, today};

/// The experiments in the paper's order: file name, section title, the command that makes it.
pub const EXPERIMENTS: [(&str, &str, &str); 8] = [
    ("switch_vs_contexts", "Switch latency vs active contexts (paper Fig. 9)", "llms experiment switch-vs-contexts"),
    ("contexts_vs_budget", "Most active contexts under a latency bound vs budget (paper Fig. 10)", "llms experiment contexts-vs-budget"),
    (
        "contexts_vs_length",
        "Most active contexts under a latency bound vs maximum context length (paper Fig. 11)",
        "llms experiment contexts-vs-length",
    ),
    ("accuracy_vs_memory", "Accuracy vs memory of the KV compression (paper Fig. 12)", "llms experiment accuracy-vs-memory"),
    ("ablation", "Ablation (paper Fig. 13)", "llms experiment ablation"),
    ("chunk_size", "Chunk size (paper Fig. 14)", "llms experiment chunk-size"),
    ("inference", "Inference speed with and without LLMS (paper Fig. 15a)", "llms experiment inference"),
    ("call_rate", "Switch latency vs call rate (paper Fig. 15b)", "llms experiment call-rate"),
];

/// What the report found.
#[derive(Debug)]
pub struct Report {
    pub included: Vec<String>,
    pub missing: Vec<String>,
}

/// `to` as a path relative to the directory `from` (both as given, made absolute when they can
/// be), with `/` separators; falls back to `to` itself.
fn relative(from: &Path, to: &Path) -> String {
    let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let (f, t) = (abs(from), abs(to));
    let fc: Vec<_> = f.components().collect();
    let tc: Vec<_> = t.components().collect();
    let common = fc.iter().zip(&tc).take_while(|(a, b)| a == b).count();
    let mut r = PathBuf::new();
    for _ in common..fc.len() {
        r.push("..");
    }
    for c in &tc[common..] {
        r.push(c);
    }
    r.to_string_lossy().into_owned()
}

/// A directory of `results` holding the same experiments run on another model or in another
/// setting (its `intro.md`, when there, says which), reported after the main ones.
pub const MODEL_SECTIONS: [(&str, &str); 3] = [
    ("7b-shape", "At the 7B shape (Llama 2 7B's dimensions, random weights)"),
    ("shared-prompt-2apps", "With a system prompt per app, prefix sharing on and off (2 apps)"),
    ("shared-prompt", "With a system prompt per app, prefix sharing on and off (4 apps)"),
];

/// The device lab's stored summary (`llms record` of `llms lab summary`; docs/lab.md): one
/// table of its runs and one of its weights scenario, after the experiments.
fn lab_section(results: &Path, md: &mut String) -> Result<bool> {
    let Ok(text) = std::fs::read_to_string(results.join("lab.json")) else { return Ok(false) };
    let v: serde_json::Value = serde_json::from_str(&text).context("lab.json")?;
    let r = &v["result"];
    let _ = write!(
        md,
        "\n## The device lab: a real kernel under memory pressure (docs/lab.md)\n\n```sh\nmake lab\n{}\n```\n\nMeasured: {}; guest kernel {}. \
         Single runs (a guest run takes minutes under emulation).\n\n",
        v["command"].as_str().unwrap_or("llms lab summary target/lab/out"),
        v["measured"].as_str().unwrap_or("not recorded"),
        r["guest_kernel"].as_str().unwrap_or("?"),
    );
    let num = |x: &serde_json::Value| {
        x.as_f64().map_or_else(|| "–".to_string(), |f| if f.fract() == 0.0 { format!("{f:.0}") } else { format!("{f:.2}") })
    };
    if let Some(runs) = r["runs"].as_array().filter(|a| !a.is_empty()) {
        md.push_str("| scenario | system | contexts lost | killer / OOM kills | switch p50 / p99 (ms) | apps' PSI full (ms) | calls |\n|---|---|---|---|---|---|---|\n");
        for x in runs {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} / {} | {} / {} | {} | {} |",
                x["scenario"].as_str().unwrap_or("?"),
                x["system"].as_str().unwrap_or("?"),
                num(&x["contexts_lost"]),
                num(&x["killer_kills"]),
                num(&x["oom_kills"]),
                num(&x["switch_ms_p50"]),
                num(&x["switch_ms_p99"]),
                num(&x["psi_full_ms"]),
                num(&x["calls"]),
            );
        }
        // What the pressure processes met: their stall, the whole guest's, their time to get
        // memory, and llmsd's budget following them (docs/lab.md "What the monitor is worth").
        md.push_str(
            "\n| scenario | system | pressure processes' PSI some / full (ms) | guest PSI full: total / worst second (ms) | pressure got its memory in (ms) | budget start / min / end (MiB) |\n|---|---|---|---|---|---|\n",
        );
        for x in runs {
            let _ = writeln!(
                md,
                "| {} | {} | {} / {} | {} / {} | {} | {} / {} / {} |",
                x["scenario"].as_str().unwrap_or("?"),
                x["system"].as_str().unwrap_or("?"),
                num(&x["pressure_psi_some_ms"]),
                num(&x["pressure_psi_full_ms"]),
                num(&x["system_psi_full_ms"]),
                num(&x["system_psi_full_peak_ms"]),
                num(&x["hog_got_ms_total"]),
                num(&x["budget_start_mib"]),
                num(&x["budget_min_mib"]),
                num(&x["budget_end_mib"]),
            );
        }
    }
    if let Some(w) = r["weights"].as_object() {
        md.push_str("\n| weights | MiB read per token | decode tok/s | memory.max |\n|---|---|---|---|\n");
        for name in ["paged", "mmap", "mmap-unlimited"] {
            if let Some(x) = w.get(name) {
                let _ = writeln!(
                    md,
                    "| {name} | {} | {} | {} |",
                    num(&x["read_mib_per_token"]),
                    num(&x["tg_tok_s"]),
                    x["memory_max"].as_str().unwrap_or("?")
                );
            }
        }
        if let Some(ratio) = w.get("paged_vs_mmap_read").and_then(serde_json::Value::as_f64) {
            let _ = writeln!(md, "\nPaged weights read {ratio:.2}x the page cache's bytes per token in the same room.");
        }
    }
    Ok(true)
}

/// Writes the report of the figures in `results` to `out`; `results/intro.md`, when there,
/// goes after the machine paragraph. Each figure says where and when it was measured (its
/// JSON's `measured`), which may be an earlier commit than the page's.
pub fn write(results: &Path, out: &Path) -> Result<Report> {
    let intro = std::fs::read_to_string(results.join("intro.md")).ok();
    let out_dir = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let rel = relative(out_dir, results);
    let mut md = String::from("# Results\n\n");
    let _ = writeln!(md, "Generated by `llms report` from the figures in `{rel}/` on {}, {}.", machine(), today());
    md.push_str(
        "The machine is shared and noisy: read the ratios, not the last digit. Every figure comes from the one command above it, \
         measured where and when the line under the command says (figures are re-run one by one, so they may predate this \
         page's commit); its settings and seeds are in its caption and in the `.json` next to its plot.\n",
    );
    if let Some(i) = &intro {
        md.push('\n');
        md.push_str(&rebase_links(i.trim_end(), &rel));
        md.push('\n');
    }
    let (mut included, mut missing) = (Vec::new(), Vec::new());
    figures(results, &rel, "##", &mut md, &mut included, Some(&mut missing))?;
    if !missing.is_empty() {
        md.push_str("\n## Not measured yet\n\n");
        for m in &missing {
            let _ = writeln!(md, "- {m}");
        }
    }
    for (dir, title) in MODEL_SECTIONS {
        let sub = results.join(dir);
        if !sub.is_dir() {
            continue;
        }
        let _ = write!(md, "\n## {title}\n");
        if let Ok(i) = std::fs::read_to_string(sub.join("intro.md")) {
            md.push('\n');
            md.push_str(&rebase_links(i.trim_end(), &format!("{rel}/{dir}")));
            md.push('\n');
        }
        let mut found = Vec::new();
        figures(&sub, &format!("{rel}/{dir}"), "###", &mut md, &mut found, None)?;
        included.extend(found.into_iter().map(|n| format!("{dir}/{n}")));
    }
    if lab_section(results, &mut md)? {
        included.push("lab".into());
    }
    std::fs::write(out, md).with_context(|| format!("writing {}", out.display()))?;
    Ok(Report { included, missing })
}

/// `text` (an intro or notes file written beside its results, its links relative to them) with
/// every relative link target put under `rel`, so the links hold on the report's page too.
fn rebase_links(text: &str, rel: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        out.push_str(&rest[..i + 2]);
        rest = &rest[i + 2..];
        let relative = !(rest.starts_with('#') || rest.starts_with('/') || rest.split(')').next().is_some_and(|t| t.contains("://")));
        if relative {
            out.push_str(rel);
            out.push('/');
        }
    }
    out.push_str(rest);
    out
}

/// The experiments found in `dir` (in the paper's order), each under a heading of `level`;
/// those not there are listed in `missing` when asked.
fn figures(
    dir: &Path,
    rel: &str,
    level: &str,
    md: &mut String,
    included: &mut Vec<String>,
    mut missing: Option<&mut Vec<String>>,
) -> Result<()> {
    for (name, title, default_cmd) in EXPERIMENTS {
        let Ok(table) = std::fs::read_to_string(dir.join(format!("{name}.md"))) else {
            if let Some(m) = missing.as_deref_mut() {
                m.push(format!("{title}: `{default_cmd}`"));
            }
            continue;
        };
        let json =
            std::fs::read_to_string(dir.join(format!("{name}.json"))).ok().and_then(|j| serde_json::from_str::<serde_json::Value>(&j).ok());
        let cmd = json.as_ref().and_then(|v| v["command"].as_str().map(str::to_string)).unwrap_or_else(|| default_cmd.to_string());
        let measured = json.as_ref().and_then(|v| v["measured"].as_str().map(str::to_string));
        // Plots are drawn again from their data: a change of style needs no new measurement.
        if let Some(fig) = json.and_then(|mut v| serde_json::from_value::<crate::figure::Figure>(v["figure"].take()).ok()) {
            fig.plot(dir, name)?;
        }
        let _ = write!(md, "\n{level} {title}\n\n```sh\n{cmd}\n```\n\n");
        let _ = writeln!(md, "Measured: {}.\n", measured.as_deref().unwrap_or("not recorded (a figure made before figures recorded it)"));
        if dir.join(format!("{name}.png")).exists() {
            let _ = writeln!(md, "![{title}]({rel}/{name}.png)\n");
        }
        md.push_str(table.trim_end());
        md.push('\n');
        if let Ok(notes) = std::fs::read_to_string(dir.join(format!("{name}.notes.md"))) {
            md.push('\n');
            md.push_str(&rebase_links(notes.trim_end(), rel));
            md.push('\n');
        }
        included.push(name.to_string());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_in_notes_are_rebased_onto_the_page() {
        let t = "[4.5x](a.json#ratio:/x:/y) and [doc](../kv.md), [web](https://x.org/a), [here](#top)";
        assert_eq!(
            rebase_links(t, "results"),
            "[4.5x](results/a.json#ratio:/x:/y) and [doc](results/../kv.md), [web](https://x.org/a), [here](#top)"
        );
    }

    #[test]
    fn the_report_gathers_figures_in_order_with_commands_plots_and_notes() {
        let dir = tempfile::tempdir().unwrap();
        let results = dir.path().join("docs/results");
        std::fs::create_dir_all(&results).unwrap();
        std::fs::write(results.join("intro.md"), "Intro text.\n").unwrap();
        for name in ["ablation", "switch_vs_contexts"] {
            std::fs::write(results.join(format!("{name}.md")), format!("table of {name}\n")).unwrap();
            std::fs::write(results.join(format!("{name}.png")), b"\x89PNG").unwrap();
        }
        std::fs::write(results.join("ablation.json"), r#"{"command": "llms experiment ablation --seed 3"}"#).unwrap();
        std::fs::write(results.join("ablation.notes.md"), "Why it came out so.\n").unwrap();
        // A figure with its data: the report draws its plot again.
        let fig = crate::figure::Figure {
            caption: "c".into(),
            x_desc: "x".into(),
            log_x: true,
            log_y: true,
            decimals: 2,
            panels: vec![crate::figure::Panel {
                title: "t".into(),
                y_desc: "y".into(),
                series: vec![crate::figure::Series { label: "llms".into(), points: vec![(4.0, 0.5), (16.0, 0.2)] }],
            }],
        };
        fig.write(&results, "chunk_size", &(), &()).unwrap();
        let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(results.join("chunk_size.json")).unwrap()).unwrap();
        assert!(j["measured"].as_str().unwrap().ends_with(&today()), "a figure records where and when: {j}");
        std::fs::remove_file(results.join("chunk_size.png")).unwrap();
        // The same experiment on another model, in its own section after the main ones.
        let seven = results.join("7b-shape");
        std::fs::create_dir_all(&seven).unwrap();
        std::fs::write(seven.join("intro.md"), "What the 7B shape is.\n").unwrap();
        std::fs::write(seven.join("switch_vs_contexts.md"), "table at 7B\n").unwrap();
        std::fs::write(
            seven.join("switch_vs_contexts.json"),
            r#"{"command": "llms experiment switch-vs-contexts --model l7.gguf", "measured": "M7"}"#,
        )
        .unwrap();
        std::fs::write(
            results.join("ablation.json"),
            r#"{"command": "llms experiment ablation --seed 3", "measured": "Linux X; commit abc, 2 Jan 2026"}"#,
        )
        .unwrap();
        // The lab's stored summary: a section of its own, last.
        std::fs::write(
            results.join("lab.json"),
            r#"{"command": "llms lab summary target/lab/out", "measured": "ML", "result": {"guest_kernel": "6.12.1",
                "runs": [{"system": "llmsd", "scenario": "squeeze", "contexts_lost": 0, "killer_kills": 0, "oom_kills": 0,
                          "switch_ms_p50": 5.14, "switch_ms_p99": 36.9, "psi_full_ms": 0.0, "calls": 25}],
                "weights": {"paged": {"read_mib_per_token": 30.6, "tg_tok_s": 0.7, "memory_max": "max"}, "paged_vs_mmap_read": 0.512}}}"#,
        )
        .unwrap();
        let out = dir.path().join("docs/RESULTS.md");
        let r = write(&results, &out).unwrap();
        assert_eq!(r.included, ["switch_vs_contexts", "ablation", "chunk_size", "7b-shape/switch_vs_contexts", "lab"], "the paper's order");
        assert_eq!(r.missing.len(), EXPERIMENTS.len() - 3, "a model section's missing figures are not listed");
        assert_eq!(&std::fs::read(results.join("chunk_size.png")).unwrap()[1..4], b"PNG", "drawn again from its JSON");
        let md = std::fs::read_to_string(&out).unwrap();
        let at = |s: &str| md.find(s).unwrap_or_else(|| panic!("{s:?} not in {md}"));
        assert!(at("Intro text.") < at("## Switch latency vs active contexts"));
        assert!(at("table of switch_vs_contexts") < at("## Ablation") && at("## Ablation") < at("table of ablation"));
        at("```sh\nllms experiment ablation --seed 3\n```");
        at("```sh\nllms experiment switch-vs-contexts\n```"); // no JSON: the bare command
        at("![Ablation (paper Fig. 13)](results/ablation.png)");
        assert!(at("table of ablation") < at("Why it came out so."));
        assert!(at("## Not measured yet") > at("Why it came out so."));
        at("`llms experiment call-rate`");
        // Each figure says where and when it was measured; the page's own date and commit apart.
        assert!(
            at("llms experiment ablation --seed 3") < at("Measured: Linux X; commit abc, 2 Jan 2026.")
                && at("Measured: Linux X") < at("table of ablation")
        );
        at("```sh\nllms experiment switch-vs-contexts\n```\n\nMeasured: not recorded");
        assert!(at("## Not measured yet") < at("## At the 7B shape"));
        assert!(
            at("## At the 7B shape") < at("What the 7B shape is.")
                && at("What the 7B shape is.") < at("### Switch latency vs active contexts")
        );
        assert!(at("llms experiment switch-vs-contexts --model l7.gguf") < at("Measured: M7.") && at("Measured: M7.") < at("table at 7B"));
        assert!(at("## At the 7B shape") < at("## The device lab"));
        at("Measured: ML; guest kernel 6.12.1.");
        at("| squeeze | llmsd | 0 | 0 / 0 | 5.14 / 36.90 | 0 | 25 |");
        at("| paged | 30.60 | 0.70 | max |");
        at("Paged weights read 0.51x");
        at(&format!("{}.", today()));
        let t = today();
        let parts: Vec<&str> = t.split(' ').collect();
        assert!(parts.len() == 3 && parts[0].parse::<u8>().is_ok_and(|d| (1..=31).contains(&d)), "{t}");
        assert!(parts[2].parse::<u16>().is_ok_and(|y| y >= 2024) && parts[1].len() == 3, "{t}");
        assert!(md.contains(&format!("Linux {}", std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap().trim())));
    }
}

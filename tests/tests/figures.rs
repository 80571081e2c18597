//! Figures that cannot drift. A figure quoted in README.md or docs/ is a link to the stored
//! result that holds it: `[+0.32%](results/accuracy_vs_memory.json#/peer/0/rows/kv=k4v4/vs_int8_pct)`.
//! This test reads every such link, looks the value up and fails when the number written
//! differs from it (at the precision written). It also fails on a relative link that leads
//! nowhere or out of the repository (the project is self-contained).
//!
//! The fragment is a path into the JSON: keys, indices, and `key=value[,key=value]` picking the
//! first element of an array whose fields match. `ratio:PATH:PATH` divides two values; a
//! trailing `*K` scales. The first number in the link's text is the figure; its sign and
//! decimals are the precision it claims (`232 ms` matches 231.6; `7.23x` matches 7.2347).
//! A space in a fragment is written `%20`, a comma inside a value `%2C`.
//!
//! And it fails on a figure written without its link: in README.md and the user docs (docs/,
//! but not the notebook docs/notes/, whose entries are dated records of past runs, nor the
//! pages `llms report` generates from stored results) a time or a rate (`ms`, `µs`, `tok/s`,
//! `MB/s`, ...) or a signed percentage outside a link or a code span is an error. Settings are
//! written as code (`--bounds 0.5 1`), measurements as links.

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The value `path` names in `v`.
fn lookup<'a>(v: &'a Value, path: &str) -> Result<&'a Value, String> {
    let mut cur = v;
    for seg in path.split('/').filter(|s| !s.is_empty()) {
        cur = if seg.contains('=') {
            let arr = cur.as_array().ok_or_else(|| format!("{seg}: not an array"))?;
            // A comma inside a value is written %2C (a bare one separates the fields).
            let want: Vec<(&str, String)> =
                seg.split(',').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k, v.replace("%2C", ","))).collect();
            let field = |e: &Value, k: &str| match e.get(k) {
                Some(Value::String(s)) => Some(s.clone()),
                Some(x) => Some(x.to_string()),
                None => None,
            };
            arr.iter()
                .find(|e| want.iter().all(|(k, val)| field(e, k).as_deref() == Some(val.as_str())))
                .ok_or_else(|| format!("no element with {seg}"))?
        } else if let Ok(i) = seg.parse::<usize>() {
            cur.get(i).ok_or_else(|| format!("no element {i}"))?
        } else {
            cur.get(seg).ok_or_else(|| format!("no field {seg:?}"))?
        };
    }
    Ok(cur)
}

/// The number a fragment names in `v`.
fn value_of(v: &Value, fragment: &str) -> Result<f64, String> {
    let (expr, scale) = match fragment.rsplit_once('*') {
        Some((e, k)) => (e, k.parse::<f64>().map_err(|_| format!("scale {k:?}"))?),
        None => (fragment, 1.0),
    };
    let num = |p: &str| lookup(v, p)?.as_f64().ok_or_else(|| format!("{p}: not a number"));
    let x = match expr.strip_prefix("ratio:") {
        Some(r) => {
            let (a, b) = r.split_once(':').ok_or("ratio:A:B")?;
            num(a)? / num(b)?
        }
        None => num(expr)?,
    };
    Ok(x * scale)
}

/// The first number in `text`: its value and its decimals.
fn figure(text: &str) -> Option<(f64, usize)> {
    let b = text.as_bytes();
    let start = (0..b.len()).find(|&i| b[i].is_ascii_digit())?;
    let mut end = start;
    while end < b.len() && (b[end].is_ascii_digit() || (b[end] == b'.' && b.get(end + 1).is_some_and(u8::is_ascii_digit))) {
        end += 1;
    }
    let digits = text[start..end].replace(',', "");
    let decimals = digits.split_once('.').map_or(0, |(_, d)| d.len());
    let neg = start > 0 && matches!(&text[..start], t if t.ends_with('-') || t.ends_with('\u{2212}'));
    let x: f64 = digits.parse().ok()?;
    Some((if neg { -x } else { x }, decimals))
}

/// Markdown links `[text](target)` in `md`.
fn links(md: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = md;
    while let Some(i) = rest.find("](") {
        let before = &rest[..i];
        let Some(open) = before.rfind('[') else {
            rest = &rest[i + 2..];
            continue;
        };
        let after = &rest[i + 2..];
        let Some(close) = after.find(')') else { break };
        out.push((before[open + 1..].to_string(), after[..close].to_string()));
        rest = &after[close..];
    }
    out
}

/// What is wrong with the links of the Markdown file `md_path` (text `md`), inside `root`.
fn check(md_path: &Path, md: &str, root: &Path) -> Vec<String> {
    let mut bad = Vec::new();
    let dir = md_path.parent().unwrap_or(root);
    for (text, target) in links(md) {
        let target = target.split_whitespace().next().unwrap_or("");
        if target.is_empty() || target.starts_with('#') || target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (file, fragment) = target.split_once('#').map_or((target, None), |(f, r)| (f, Some(r)));
        let p = dir.join(file);
        let Ok(real) = p.canonicalize() else {
            bad.push(format!("{}: [{text}]({target}): {} does not exist", md_path.display(), p.display()));
            continue;
        };
        if !real.starts_with(root) {
            bad.push(format!("{}: [{text}]({target}) leads out of the repository", md_path.display()));
            continue;
        }
        let (Some(fragment), true) = (fragment, file.ends_with(".json")) else { continue };
        let v: Value = match std::fs::read_to_string(&real)
            .map_err(|e| e.to_string())
            .and_then(|s| serde_json::from_str(&s).map_err(|e| e.to_string()))
        {
            Ok(v) => v,
            Err(e) => {
                bad.push(format!("{}: {target}: {e}", md_path.display()));
                continue;
            }
        };
        let Some((written, decimals)) = figure(&text) else {
            bad.push(format!("{}: [{text}]({target}): no number in the link's text", md_path.display()));
            continue;
        };
        match value_of(&v, &fragment.replace("%20", " ")) {
            Err(e) => bad.push(format!("{}: {target}: {e}", md_path.display())),
            Ok(stored) => {
                let half = 0.5 * 10f64.powi(-i32::try_from(decimals).unwrap_or(9)) + 1e-9;
                if (stored - written).abs() > half {
                    bad.push(format!("{}: [{text}] says {written}, {target} holds {stored}", md_path.display()));
                }
            }
        }
    }
    bad
}

/// The units a measured time or rate is written in.
const UNITS: [&str; 9] = ["ms", "µs", "us", "tok/s", "MB/s", "GB/s", "MiB/s", "GiB/s", "ns"];

/// `md` with fenced blocks, code spans and links blanked out: what is left is prose.
fn prose(md: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (n, line) in md.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut s = String::new();
        let mut rest = line;
        // Code spans first (a link target may hold a backtick-free `|`), then links.
        while let Some(i) = rest.find('`') {
            s.push_str(&rest[..i]);
            let after = &rest[i + 1..];
            match after.find('`') {
                Some(j) => {
                    s.push_str(" CODE ");
                    rest = &after[j + 1..];
                }
                None => {
                    rest = after;
                }
            }
        }
        s.push_str(rest);
        let mut t = String::new();
        let mut rest = s.as_str();
        while let Some(i) = rest.find("](") {
            let open = rest[..i].rfind('[').unwrap_or(i);
            t.push_str(&rest[..open]);
            let after = &rest[i + 2..];
            let close = after.find(')').map_or(after.len(), |c| c + 1);
            t.push_str(" LINK ");
            rest = &after[close..];
        }
        t.push_str(rest);
        out.push((n + 1, t));
    }
    out
}

/// Figures in `md`'s prose written without a link: `(line, figure)`.
fn bare_figures(md: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (n, line) in prose(md) {
        let b = line.as_bytes();
        let mut i = 0;
        while i < b.len() {
            let starts = b[i].is_ascii_digit() && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b"._/#=".contains(&b[i - 1])));
            if !starts {
                i += 1;
                continue;
            }
            let mut end = i;
            while end < b.len()
                && (b[end].is_ascii_digit() || (matches!(b[end], b'.' | b',') && b.get(end + 1).is_some_and(u8::is_ascii_digit)))
            {
                end += 1;
            }
            let signed = i > 0 && matches!(b[i - 1], b'+')
                || line[..i].ends_with('\u{2212}')
                || (i > 0 && b[i - 1] == b'-' && (i == 1 || b[i - 2] == b' ' || b[i - 2] == b'('));
            let tail = line[end..].strip_prefix(' ').unwrap_or(&line[end..]);
            let unit = UNITS.iter().find(|u| tail.starts_with(**u) && !tail[u.len()..].starts_with(|c: char| c.is_alphanumeric()));
            if unit.is_some() || (signed && tail.starts_with('%')) {
                found.push((
                    n,
                    line[i.saturating_sub(usize::from(signed))..end + unit.map_or(1, |u| u.len() + line[end..].len() - tail.len())]
                        .trim()
                        .to_string(),
                ));
            }
            i = end.max(i + 1);
        }
    }
    found
}

fn markdown_files(root: &Path) -> Vec<PathBuf> {
    fn walk(d: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    let mut out = vec![root.join("README.md")];
    walk(&root.join("docs"), &mut out);
    out
}

#[test]
fn quoted_figures_equal_their_stored_results() {
    let root = llms_tests::repo_root().canonicalize().unwrap();
    let mut bad = Vec::new();
    let mut figures = 0;
    for f in markdown_files(&root) {
        let md = std::fs::read_to_string(&f).unwrap();
        figures += links(&md).iter().filter(|(_, t)| t.contains(".json#")).count();
        bad.extend(check(&f, &md, &root));
    }
    assert!(figures >= 5, "the README's headline figures link their results ({figures} found)");
    assert!(bad.is_empty(), "figures and links that do not hold ({}):\n{}", bad.len(), bad.join("\n"));
}

/// The user docs quote measurements only as links (the notebook and generated pages aside).
#[test]
fn user_docs_write_no_figure_without_its_link() {
    let root = llms_tests::repo_root().canonicalize().unwrap();
    let mut bad = Vec::new();
    for f in markdown_files(&root) {
        let rel = f.strip_prefix(&root).unwrap().to_string_lossy().to_string();
        if rel.starts_with("docs/notes/") || rel.starts_with("docs/results/") || rel == "docs/RESULTS.md" {
            continue;
        }
        for (line, fig) in bare_figures(&std::fs::read_to_string(&f).unwrap()) {
            bad.push(format!("{rel}:{line}: {fig}"));
        }
    }
    assert!(
        bad.is_empty(),
        "figures without their stored result ({}): link them, or move dated runs to docs/notes/\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn a_bare_figure_is_found_and_links_code_and_settings_are_not() {
    let md =
        "took 163.5 ms alone, [+6.4 ms](r.json#/x), `--bounds 0.5 1`, +0.32% worse\n```\n12 ms\n```\n200 tok/s, 3 msgs, 2-3 ms, (-1.5%)";
    let found: Vec<String> = bare_figures(md).into_iter().map(|(_, f)| f).collect();
    assert_eq!(found, ["163.5 ms", "+0.32%", "200 tok/s", "3 ms", "-1.5%"]);
}

/// The check fails when a figure is edited by hand, a result moves, or a link leaves the tree.
#[test]
fn an_edited_figure_is_caught() {
    let dir = tempfile_dir();
    let root = dir.canonicalize().unwrap();
    std::fs::create_dir_all(root.join("docs/results")).unwrap();
    std::fs::write(
        root.join("docs/results/r.json"),
        r#"{"rows":[{"plan":"k4v4","pct":0.3231},{"plan":"mix:0.5","pct":0.71}],"a":7.2347,"b":1.0,"ms":231.6}"#,
    )
    .unwrap();
    let md = root.join("docs/x.md");
    let ok = "[+0.32%](results/r.json#/rows/plan=k4v4/pct), [7.23x](results/r.json#ratio:/a:/b), [232 ms](results/r.json#/ms), \
              [71%](results/r.json#/rows/plan=mix:0.5/pct*100), [the table](results/r.json)";
    assert_eq!(check(&md, ok, &root), Vec::<String>::new());
    for edited in [
        "[+0.28%](results/r.json#/rows/plan=k4v4/pct)",
        "[7.4x](results/r.json#ratio:/a:/b)",
        "[-0.32%](results/r.json#/rows/plan=k4v4/pct)",
    ] {
        assert_eq!(check(&md, edited, &root).len(), 1, "{edited} passed");
    }
    assert_eq!(check(&md, "[x](results/r.json#/rows/plan=q9/pct)", &root).len(), 1, "a missing row is an error");
    assert_eq!(check(&md, "[design](../../shared/DESIGN.md)", &root).len(), 1, "a link out of the tree is an error");
    let _ = std::fs::remove_dir_all(&root);
}

fn tempfile_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("llms-figures-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

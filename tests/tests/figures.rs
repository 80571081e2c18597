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
//! A space in a fragment is written `%20`.

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The value `path` names in `v`.
fn lookup<'a>(v: &'a Value, path: &str) -> Result<&'a Value, String> {
    let mut cur = v;
    for seg in path.split('/').filter(|s| !s.is_empty()) {
        cur = if seg.contains('=') {
            let arr = cur.as_array().ok_or_else(|| format!("{seg}: not an array"))?;
            let want: Vec<(&str, &str)> = seg.split(',').filter_map(|kv| kv.split_once('=')).collect();
            let field = |e: &Value, k: &str| match e.get(k) {
                Some(Value::String(s)) => Some(s.clone()),
                Some(x) => Some(x.to_string()),
                None => None,
            };
            arr.iter()
                .find(|e| want.iter().all(|(k, val)| field(e, k).as_deref() == Some(*val)))
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

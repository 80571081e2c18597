//! No module circles in any crate: inside each library crate, modules are layered (docs/
//! ARCHITECTURE.md), so two modules never depend on each other, directly or around a ring.
//!
//! The check reads every module file's `crate::` and `super::` paths (brace groups included),
//! ignoring its `#[cfg(test)] mod tests` (tests may reach anywhere) and references between a
//! module and its own rooms (a parent and its children are one unit seen from outside). A
//! reference from `a::x` to `b::y` is an edge between the two siblings that contain them (`a`
//! -> `b` under their common parent); a circle is a strongly connected set of siblings.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The workspace's library crates (binaries hold only parsers and wiring).
const CRATES: &[&str] = &["engine", "mm", "uffd_handler", "cgroup", "client", "llmsd", "tools", "tests"];

type Module = Vec<String>;
/// The siblings under one parent and the edges between them.
type Level = (BTreeSet<String>, BTreeSet<(String, String)>);

/// Module path of each source file under `src` (lib.rs is the root; bin/ and main.rs are
/// other crates).
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    fn walk(dir: &Path, at: &Module, out: &mut BTreeMap<Module, PathBuf>) {
        let Ok(rd) = std::fs::read_dir(dir) else { return };
        for e in rd.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                if at.is_empty() && name == "bin" {
                    continue;
                }
                let mut m = at.clone();
                m.push(name);
                walk(&p, &m, out);
            } else if let Some(stem) = name.strip_suffix(".rs") {
                let m = match stem {
                    "lib" if at.is_empty() => Vec::new(),
                    "main" if at.is_empty() => continue,
                    "mod" => at.clone(),
                    s => {
                        let mut m = at.clone();
                        m.push(s.to_string());
                        m
                    }
                };
                out.insert(m, p);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, &Vec::new(), &mut out);
    out
}

/// The code of a module file: without comments (a doc link is not an import) and without its
/// test module (by convention the file's last item).
fn code(text: &str) -> String {
    without_tests(text).lines().map(|l| l.find("//").map_or(l, |i| &l[..i])).collect::<Vec<_>>().join("\n")
}

fn without_tests(text: &str) -> &str {
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        if line.trim_start().starts_with("#[cfg(test)]") {
            let rest = &text[at + line.len()..];
            let next = rest.trim_start();
            if next.starts_with("mod tests") || next.starts_with("pub mod tests") || next.starts_with("mod test ") {
                return &text[..at];
            }
        }
        at += line.len();
    }
    text
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths a `{ ... }` group or a plain path starting at `s` names, each as segments; `s`
/// begins right after `crate::` or `super::`.
fn paths_at(s: &str) -> Vec<Vec<String>> {
    fn parse(s: &str, pos: &mut usize, prefix: &[String], out: &mut Vec<Vec<String>>) {
        let b = s.as_bytes();
        let mut segs = prefix.to_vec();
        loop {
            while *pos < b.len() && (b[*pos] as char).is_whitespace() {
                *pos += 1;
            }
            if *pos < b.len() && b[*pos] == b'{' {
                *pos += 1;
                loop {
                    parse(s, pos, &segs, out);
                    while *pos < b.len() && (b[*pos] as char).is_whitespace() {
                        *pos += 1;
                    }
                    match b.get(*pos) {
                        Some(b',') => *pos += 1,
                        Some(b'}') => {
                            *pos += 1;
                            return;
                        }
                        _ => return,
                    }
                    while *pos < b.len() && (b[*pos] as char).is_whitespace() {
                        *pos += 1;
                    }
                    if b.get(*pos) == Some(&b'}') {
                        *pos += 1;
                        return;
                    }
                }
            }
            let start = *pos;
            while *pos < b.len() && is_ident(b[*pos] as char) {
                *pos += 1;
            }
            if start == *pos {
                break;
            }
            segs.push(s[start..*pos].to_string());
            if s[*pos..].starts_with("::") {
                *pos += 2;
            } else {
                break;
            }
        }
        out.push(segs);
    }
    let mut out = Vec::new();
    let mut pos = 0;
    parse(s, &mut pos, &[], &mut out);
    out
}

/// The modules `text` (the file of module `me`) refers to.
fn references(text: &str, me: &Module, known: &BTreeSet<Module>) -> BTreeSet<Module> {
    let mut out = BTreeSet::new();
    // `super` is the parent module both of `a/b.rs` and of `b/mod.rs`.
    for (kw, base) in [("crate::", Vec::new()), ("super::", me[..me.len().saturating_sub(1)].to_vec())] {
        let mut from = 0;
        while let Some(i) = text[from..].find(kw) {
            let at = from + i;
            from = at + kw.len();
            if at > 0 && is_ident(text[..at].chars().next_back().unwrap_or(' ')) {
                continue; // `foo_crate::`, not a path root
            }
            let mut rest = &text[from..];
            let mut base = base.clone();
            // `super::super::x`
            while let Some(r) = rest.strip_prefix("super::") {
                base.pop();
                rest = r;
            }
            for p in paths_at(rest) {
                let mut full = base.clone();
                full.extend(p);
                // The longest known module the path lies in.
                while !full.is_empty() && !known.contains(&full) {
                    full.pop();
                }
                out.insert(full);
            }
        }
    }
    out
}

/// Strongly connected sets (more than one member) of `edges` (Tarjan's algorithm).
fn circles(nodes: &BTreeSet<String>, edges: &BTreeSet<(String, String)>) -> Vec<Vec<String>> {
    struct T<'a> {
        edges: &'a BTreeSet<(String, String)>,
        index: BTreeMap<String, usize>,
        low: BTreeMap<String, usize>,
        stack: Vec<String>,
        on: BTreeSet<String>,
        out: Vec<Vec<String>>,
    }
    fn visit(t: &mut T, v: &str) {
        let i = t.index.len();
        t.index.insert(v.to_string(), i);
        t.low.insert(v.to_string(), i);
        t.stack.push(v.to_string());
        t.on.insert(v.to_string());
        let next: Vec<String> = t.edges.iter().filter(|(a, _)| a == v).map(|(_, b)| b.clone()).collect();
        for w in next {
            if !t.index.contains_key(&w) {
                visit(t, &w);
                let l = t.low[&w].min(t.low[v]);
                t.low.insert(v.to_string(), l);
            } else if t.on.contains(&w) {
                let l = t.index[&w].min(t.low[v]);
                t.low.insert(v.to_string(), l);
            }
        }
        if t.low[v] == t.index[v] {
            let mut set = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(&w);
                let done = w == v;
                set.push(w);
                if done {
                    break;
                }
            }
            if set.len() > 1 {
                set.sort();
                t.out.push(set);
            }
        }
    }
    let mut t = T { edges, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on: BTreeSet::new(), out: Vec::new() };
    for n in nodes {
        if !t.index.contains_key(n) {
            visit(&mut t, n);
        }
    }
    t.out
}

/// Every module circle of the crate whose sources are in `src`, each as "parent: a <-> b".
fn crate_circles(src: &Path) -> Vec<String> {
    let mods = modules(src);
    let known: BTreeSet<Module> = mods.keys().cloned().collect();
    // Sibling edges grouped by their common parent.
    let mut levels: BTreeMap<Module, Level> = BTreeMap::new();
    for (m, path) in &mods {
        if let Some((last, parent)) = m.split_last() {
            levels.entry(parent.to_vec()).or_default().0.insert(last.clone());
        }
        let text = std::fs::read_to_string(path).unwrap();
        for r in references(&code(&text), m, &known) {
            let common = m.iter().zip(&r).take_while(|(a, b)| a == b).count();
            // A module and its own rooms are one unit.
            if common == m.len() || common == r.len() {
                continue;
            }
            let level = levels.entry(m[..common].to_vec()).or_default();
            level.1.insert((m[common].clone(), r[common].clone()));
        }
    }
    let mut out = Vec::new();
    for (parent, (nodes, edges)) in &levels {
        for c in circles(nodes, edges) {
            let why: Vec<String> =
                edges.iter().filter(|(a, b)| c.contains(a) && c.contains(b)).map(|(a, b)| format!("{a} -> {b}")).collect();
            out.push(format!(
                "{}: {} ({})",
                if parent.is_empty() { "crate".to_string() } else { parent.join("::") },
                c.join(", "),
                why.join("; ")
            ));
        }
    }
    out
}

#[test]
fn no_module_imports_another_that_imports_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found = Vec::new();
    for c in CRATES {
        let src = root.join(c).join("src");
        assert!(src.is_dir(), "{} is missing", src.display());
        found.extend(crate_circles(&src).into_iter().map(|s| format!("{c}: {s}")));
    }
    assert!(found.is_empty(), "module circles (docs/ARCHITECTURE.md layers each crate):\n{}", found.join("\n"));
}

/// The check sees a circle when there is one: two sibling modules naming each other, through
/// a `use` group, a `super::` path and a plain path.
#[test]
fn a_circle_is_seen() {
    let dir = std::env::temp_dir().join(format!("llms-layering-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("svc")).unwrap();
    std::fs::write(dir.join("lib.rs"), "pub mod a;\npub mod svc;\n").unwrap();
    std::fs::write(dir.join("a.rs"), "use crate::{svc::{x::X, y}};\n").unwrap();
    std::fs::write(dir.join("svc/mod.rs"), "pub mod x;\npub mod y;\nuse x::X;\n").unwrap();
    std::fs::write(dir.join("svc/x.rs"), "pub struct X(super::y::Y);\n#[cfg(test)]\nmod tests { use crate::a; }\n").unwrap();
    std::fs::write(dir.join("svc/y.rs"), "pub struct Y;\nfn f() { let _ = crate::svc::x::X; }\n").unwrap();
    let found = crate_circles(&dir);
    assert_eq!(found, vec!["svc: x, y (x -> y; y -> x)".to_string()], "{found:?}");
    // Without y's reference back, no circle (and a's use of svc and x's test do not count).
    std::fs::write(dir.join("svc/y.rs"), "/// Unlike [`crate::svc::x`].\npub struct Y; // not crate::svc::x\n").unwrap();
    assert!(crate_circles(&dir).is_empty());
    // A ring of three through the crate root.
    std::fs::write(dir.join("svc/y.rs"), "pub struct Y;\nfn f() { crate::a::g(); }\n").unwrap();
    std::fs::write(dir.join("a.rs"), "pub fn g() { crate::svc::x::X; }\n").unwrap();
    std::fs::write(dir.join("lib.rs"), "pub mod a;\npub mod svc;\npub mod b;\n").unwrap();
    std::fs::write(dir.join("b.rs"), "").unwrap();
    let found = crate_circles(&dir);
    assert_eq!(found, vec!["crate: a, svc (a -> svc; svc -> a)".to_string()], "{found:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

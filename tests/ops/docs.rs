//! The documentation's links cannot rot: every relative Markdown link in
//! the top-level `*.md` files and `docs/*.md` names a file of the
//! repository and, when it has a `#anchor`, a heading of that file, by
//! GitHub's anchor rules (lowercase, spaces to `-`, punctuation dropped,
//! `-1`, `-2`... for a repeated heading). No database, no server: it reads
//! files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The text outside fenced code blocks (a heading or a link inside one is
/// not one); each line of a block becomes an empty line, so positions still
/// tell the line.
fn outside_fences(md: &str) -> String {
    let mut out = String::with_capacity(md.len());
    let mut fence: Option<&str> = None;
    for line in md.split_inclusive('\n') {
        let t = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| t.starts_with(m));
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(f), Some(m)) if f == m => fence = None,
            (None, None) => {
                out.push_str(line);
                continue;
            }
            _ => {}
        }
        out.push('\n');
    }
    out
}

/// The text outside code: fenced blocks as in [`outside_fences`], and
/// inline code spans blanked (line breaks kept). A span is a run of n
/// backticks up to the next run of exactly n, which may be on a later
/// line; unmatched backticks are text.
fn prose(md: &str) -> String {
    let out = outside_fences(md);
    let chars: Vec<char> = out.chars().collect();
    let run = |i: usize| chars[i..].iter().take_while(|&&c| c == '`').count();
    let mut text = String::with_capacity(out.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            text.push(chars[i]);
            i += 1;
            continue;
        }
        let n = run(i);
        let mut j = i + n;
        let close = loop {
            if j >= chars.len() {
                break None;
            }
            if chars[j] == '`' {
                let m = run(j);
                if m == n {
                    break Some(j);
                }
                j += m;
            } else {
                j += 1;
            }
        };
        match close {
            Some(j) => {
                let span = &chars[i..j + n];
                text.extend(span.iter().map(|&c| if c == '\n' { '\n' } else { ' ' }));
                i = j + n;
            }
            None => {
                text.extend(&chars[i..i + n]);
                i += n;
            }
        }
    }
    text
}

/// GitHub's anchor of a heading's text: links reduced to their text,
/// lowercase, letters, digits, `-` and `_` kept, spaces to `-`, every
/// other character dropped.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    // `[text](target)` reads as `text`.
    while let Some(open) = rest.find("](") {
        match rest[open..].find(')') {
            Some(close) => {
                text.push_str(&rest[..open]);
                rest = &rest[open + close + 1..];
            }
            None => break,
        }
    }
    text.push_str(rest);
    text.trim()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .flat_map(char::to_lowercase)
        .collect()
}

/// The anchors of a Markdown file's ATX headings (`#` to `######`), a
/// repeated one numbered as GitHub numbers it.
fn anchors(md: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for line in outside_fences(md).lines() {
        let t = line.trim_start_matches(' ');
        if line.len() - t.len() > 3 {
            continue;
        }
        let hashes = t.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) {
            continue;
        }
        let rest = &t[hashes..];
        if !(rest.is_empty() || rest.starts_with(' ')) {
            continue;
        }
        let base = slug(rest.trim().trim_end_matches('#'));
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 { base } else { format!("{base}-{n}") });
        *n += 1;
    }
    out
}

/// Every link target of a Markdown file with its line: inline links and
/// images (`[text](target "title")`) and reference definitions
/// (`[label]: target`).
fn links(md: &str) -> Vec<(usize, String)> {
    let text = prose(md);
    let line_of = |pos: usize| text[..pos].matches('\n').count() + 1;
    let mut out = Vec::new();
    for (pos, _) in text.match_indices("](") {
        let start = pos + 2;
        let target: String = text[start..]
            .chars()
            .take_while(|&c| c != ')' && !c.is_whitespace())
            .collect();
        let target = target.trim_start_matches('<').trim_end_matches('>');
        out.push((line_of(pos), target.to_string()));
    }
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let t = line.trim_start();
        if let Some(close) = t.strip_prefix('[').and_then(|r| r.find("]:")) {
            let target = t[1 + close + 2..].split_whitespace().next().unwrap_or("");
            out.push((line_of(offset), target.to_string()));
        }
        offset += line.len();
    }
    out
}

/// `base`'s directory joined with `target`, `.` and `..` resolved; `None`
/// when it leaves the repository.
fn resolve(base: &Path, target: &str) -> Option<PathBuf> {
    let joined = base.parent().unwrap_or(Path::new("")).join(target);
    let mut parts: Vec<Component> = Vec::new();
    for c in joined.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::Normal(_) => parts.push(c),
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(parts.iter().collect())
}

/// The broken links of `file` (a path relative to the repository), as
/// messages naming the file, the line and what is missing. `read` gives a
/// Markdown file's text and `exists` says whether a path exists, both
/// relative to the repository.
fn broken_links(
    file: &Path,
    md: &str,
    read: &dyn Fn(&Path) -> Option<String>,
    exists: &dyn Fn(&Path) -> bool,
) -> Vec<String> {
    let mut out = Vec::new();
    for (line, target) in links(md) {
        let here = format!("{}:{line}: link {target:?}", file.display());
        // A scheme (`https:`, `mailto:`) before any `/` is not relative.
        let scheme = target.find(':').is_some_and(|c| !target[..c].contains('/'));
        if scheme || target.starts_with("//") {
            continue;
        }
        if target.is_empty() {
            out.push(format!("{here}: an empty target"));
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (target.as_str(), None),
        };
        let path = if path.is_empty() {
            file.to_path_buf()
        } else {
            match resolve(file, path) {
                Some(p) => p,
                None => {
                    out.push(format!("{here}: leaves the repository"));
                    continue;
                }
            }
        };
        if !exists(&path) {
            out.push(format!("{here}: no file {}", path.display()));
            continue;
        }
        let Some(anchor) = anchor else { continue };
        if path.extension().is_none_or(|e| e != "md") {
            continue;
        }
        let Some(text) = read(&path) else {
            out.push(format!("{here}: {} is not readable", path.display()));
            continue;
        };
        if !anchors(&text).contains(anchor) {
            out.push(format!(
                "{here}: {} has no heading with the anchor #{anchor}",
                path.display()
            ));
        }
    }
    out
}

/// The Markdown files the test covers: the top level's and `docs/`'s.
fn markdown_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in ["", "docs", "docs/benchmarks"] {
        for entry in std::fs::read_dir(Path::new(ROOT).join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "md") {
                files.push(Path::new(dir).join(path.file_name().unwrap()));
            }
        }
    }
    files.sort();
    files
}

#[test]
fn every_relative_link_in_the_docs_names_a_file_and_a_heading_that_exist() {
    let files = markdown_files();
    for required in [
        "README.md",
        "docs/api.md",
        "docs/design.md",
        "docs/testing.md",
    ] {
        assert!(
            files.contains(&PathBuf::from(required)),
            "{required} is not among {files:?}"
        );
    }
    let read = |p: &Path| std::fs::read_to_string(Path::new(ROOT).join(p)).ok();
    let exists = |p: &Path| Path::new(ROOT).join(p).exists();
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let md = read(file).unwrap();
        checked += links(&md).len();
        broken.extend(broken_links(file, &md, &read, &exists));
    }
    assert!(
        checked > 20,
        "only {checked} links found: is the parser blind?"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_link_check_finds_missing_files_and_headings_and_follows_githubs_anchors() {
    let docs: BTreeMap<PathBuf, &str> = [
        (
            "README.md",
            "# Title\n\n## Budgets: which clock bounds which stage\n\n## `ops` and `bench`\n\n\
             ## Again\n\n## Again\n\n```sh\n# not a heading\n```\n",
        ),
        (
            "docs/a.md",
            "# A\n\n### Alert: VolumeReconcilerNoReadyReplica\n",
        ),
    ]
    .into_iter()
    .map(|(p, t)| (PathBuf::from(p), t))
    .collect();
    let read = |p: &Path| docs.get(p).map(|t| t.to_string());
    let exists = |p: &Path| docs.contains_key(p) || p == Path::new("docs");
    let page = "See [a](docs/a.md#alert-volumereconcilernoreadyreplica), \
        [b](#budgets-which-clock-bounds-which-stage), [c](#ops-and-bench), \
        [d](#again-1), [the web](https://example.com/x#y), [dir](docs/) and\n\
        [e](docs/a.md#alert-volumereconcilernovaunreachable), [f](docs/b.md),\n\
        [g](#not-a-heading), [h](../outside.md), `[code](nowhere.md)` and\n\
        [i][ref].\n\n[ref]: docs/c.md\n";
    let found = broken_links(Path::new("README.md"), page, &read, &exists);
    let expected = [
        "README.md:2: link \"docs/a.md#alert-volumereconcilernovaunreachable\": \
         docs/a.md has no heading with the anchor #alert-volumereconcilernovaunreachable",
        "README.md:2: link \"docs/b.md\": no file docs/b.md",
        "README.md:3: link \"#not-a-heading\": README.md has no heading with the anchor #not-a-heading",
        "README.md:3: link \"../outside.md\": leaves the repository",
        "README.md:6: link \"docs/c.md\": no file docs/c.md",
    ];
    assert_eq!(found, expected);
    // From docs/, `../README.md` is the top level's.
    let back = broken_links(
        Path::new("docs/a.md"),
        "[back](../README.md#again)",
        &read,
        &exists,
    );
    assert!(back.is_empty(), "{back:?}");
}

/// `.ci/buf/last-release` (what `buf breaking` compares with in a clone
/// without tags) names the newest release tag and its commit.
#[test]
fn the_last_release_ci_compares_the_proto_with_is_the_newest_tag() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let recorded =
        std::fs::read_to_string(root.join(".ci/buf/last-release")).expect(".ci/buf/last-release");
    let (tag, commit) = recorded
        .trim()
        .split_once(' ')
        .expect("`<tag> <commit>` in .ci/buf/last-release");
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .expect("git runs")
    };
    let has_commit = git(&["cat-file", "-e", &format!("{commit}^{{commit}}")]);
    assert!(
        has_commit.status.success(),
        "{commit} (.ci/buf/last-release) is not a commit of this history"
    );
    let newest = git(&[
        "describe",
        "--tags",
        "--abbrev=0",
        "--match",
        "v[0-9]*",
        "HEAD",
    ]);
    if newest.status.success() {
        // With tags in this clone: the record follows the newest.
        let newest = String::from_utf8_lossy(&newest.stdout).trim().to_string();
        assert_eq!(
            tag, newest,
            "release {newest} is tagged: record it in .ci/buf/last-release"
        );
        let at = git(&["rev-parse", &format!("{newest}^{{commit}}")]);
        assert_eq!(
            String::from_utf8_lossy(&at.stdout).trim(),
            commit,
            "{newest}'s commit"
        );
    }
}

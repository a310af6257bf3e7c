//! Completion and man pages past the first word: bash itself runs the
//! generated script with the words of a command line being typed, and
//! every page the top man page names is written.

use std::process::Command;

use super::run;

/// A fresh directory of this test run's own.
fn scratch(what: &str) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{what}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// What bash completes for `words` (the last one being typed), with the
/// script `completions bash` prints loaded as a user's shell loads it.
fn complete(script: &std::path::Path, words: &[&str]) -> Vec<String> {
    let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let prev = words[words.len().saturating_sub(2)];
    let program = format!(
        r#"source '{script}'
fn=$(complete -p volume-reconciler | sed -n 's/.*-F \([^ ]*\).*/\1/p')
[ -n "$fn" ] || {{ echo "no completion function" >&2; exit 3; }}
COMP_WORDS=({words})
COMP_CWORD={cword}
COMP_LINE="${{COMP_WORDS[*]}}"
COMP_POINT=${{#COMP_LINE}}
"$fn" volume-reconciler '{cur}' '{prev}'
printf '%s\n' "${{COMPREPLY[@]}}""#,
        script = script.display(),
        words = quoted.join(" "),
        cword = words.len() - 1,
        cur = words[words.len() - 1],
    );
    let out = Command::new("bash")
        .args(["--norc", "--noprofile", "-c", &program])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{words:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect()
}

#[tokio::test]
async fn bash_completes_subcommands_flags_and_their_values_past_the_first_word() {
    let r = run(&["completions", "bash"], &[]).await;
    assert!(r.ok, "{}", r.stderr);
    let script = scratch("completion").join("volume-reconciler.bash");
    std::fs::write(&script, &r.stdout).unwrap();
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec!["volume-reconciler", "op"], vec!["ops"]),
        (vec!["volume-reconciler", "ops", "li"], vec!["list"]),
        (vec!["volume-reconciler", "ops", "at"], vec!["attach"]),
        (
            vec!["volume-reconciler", "ops", "list", "--state", ""],
            vec!["pending", "in-progress", "unknown", "succeeded", "failed"],
        ),
        (
            vec!["volume-reconciler", "ops", "list", "-o", ""],
            vec!["table", "wide", "json", "yaml", "name"],
        ),
        (
            vec!["volume-reconciler", "nova-sim", "--list"],
            vec!["--listen"],
        ),
        (vec!["volume-reconciler", "config", "sh"], vec!["show"]),
    ];
    for (words, want) in cases {
        let mut got = complete(&script, &words);
        got.sort();
        let mut want: Vec<String> = want.into_iter().map(String::from).collect();
        want.sort();
        assert_eq!(got, want, "{words:?}");
    }
}

#[tokio::test]
async fn man_writes_a_page_for_every_command_the_top_page_names() {
    let pages = scratch("man").join("man1");
    let r = run(&["man", "--dir", pages.to_str().unwrap()], &[]).await;
    assert!(r.ok, "{}", r.stderr);
    let top = std::fs::read_to_string(pages.join("volume-reconciler.1")).unwrap();
    // The top page names its commands as `volume-reconciler-NAME(1)`.
    let named: Vec<String> = top
        .split(|c: char| c.is_whitespace())
        .filter_map(|w| w.strip_suffix("(1)"))
        .filter(|w| w.starts_with("volume\\-reconciler") || w.starts_with("volume-reconciler"))
        .map(|w| w.replace("\\-", "-"))
        .collect();
    assert!(named.len() >= 10, "{named:?}");
    for page in &named {
        assert!(
            pages.join(format!("{page}.1")).exists(),
            "the top page names {page}(1), which was not written"
        );
    }
    for page in [
        "volume-reconciler-ops-list.1",
        "volume-reconciler-ops-attach.1",
        "volume-reconciler-dev.1",
    ] {
        let text = std::fs::read_to_string(pages.join(page)).unwrap();
        assert!(text.starts_with(".ie") || text.contains(".TH"), "{page}");
    }
    let ops = std::fs::read_to_string(pages.join("volume-reconciler-ops-list.1")).unwrap();
    assert!(
        ops.contains("\\-\\-state"),
        "the page lists the flags:\n{ops}"
    );
    assert!(!pages.join("volume-reconciler-help.1").exists());
    // The top page alone, on stdout, names the same pages.
    let r = run(&["man"], &[]).await;
    assert!(
        r.ok && !r.stdout.contains("reconciler\\-help(1)"),
        "{}",
        r.stdout
    );
}

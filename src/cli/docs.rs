//! `completions` and `man`: generated from the command line's own
//! definition, so they cannot drift from it.

use std::path::Path;

use crate::cli::output::emit;

/// The program's name, as scripts and pages call it.
const NAME: &str = "volume-reconciler";

/// The command line as the pages show it: without clap's `help`
/// subcommand, which has no page (`--help` is on every command).
fn command() -> clap::Command {
    let mut cmd = <super::Cli as clap::CommandFactory>::command().disable_help_subcommand(true);
    cmd.build();
    cmd
}

/// Prints the completion script of `shell`.
pub fn completions(shell: clap_complete::Shell) -> anyhow::Result<()> {
    let mut cmd = <super::Cli as clap::CommandFactory>::command();
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, NAME, &mut script);
    let script = String::from_utf8_lossy(&script);
    Ok(emit(&match shell {
        clap_complete::Shell::Bash => bash_fixed(&script),
        _ => script.into_owned(),
    })?)
}

/// clap_complete's bash script names each command's state twice, and
/// differently when the program's name has a hyphen: walking the words it
/// writes `volume__reconciler__subcmd__ops` (the hyphen as `__`), while the
/// case that completes that command is labelled
/// `volume__subcmd__reconciler__subcmd__ops` (the hyphen as the separator
/// of commands), so nothing past the first word completed. The labels are
/// written here the way the walk writes them.
fn bash_fixed(script: &str) -> String {
    let walked = NAME.replace('-', "__");
    let labelled = NAME.replace('-', "__subcmd__");
    script.replace(&labelled, &walked)
}

/// Prints the top man page, or writes one page per command into `dir`
/// (`volume-reconciler.1`, `volume-reconciler-ops-list.1`, ...): every
/// page the top one names under SUBCOMMANDS.
pub fn man(dir: Option<&Path>) -> anyhow::Result<()> {
    let Some(dir) = dir else {
        let mut page = Vec::new();
        clap_mangen::Man::new(command()).render(&mut page)?;
        return Ok(emit(&String::from_utf8_lossy(&page))?);
    };
    std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("--dir {}: {e}", dir.display()))?;
    clap_mangen::generate_to(command(), dir)
        .map_err(|e| anyhow::anyhow!("writing the man pages into {}: {e}", dir.display()))?;
    let mut written: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().to_string_lossy().to_string();
            (name.starts_with(NAME) && name.ends_with(".1")).then_some(name)
        })
        .collect();
    written.sort();
    Ok(emit(&format!(
        "{} man pages in {} ({}, ...)\n",
        written.len(),
        dir.display(),
        written
            .iter()
            .take(3)
            .cloned()
            .collect::<Vec<_>>()
            .join(", ")
    ))?)
}

#[cfg(test)]
mod tests {
    /// Every argument of every command, and every command, with the path
    /// that reaches it (`ops resolve --state`), that has no help text.
    fn undescribed(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
        if cmd.get_about().is_none() && cmd.get_long_about().is_none() {
            missing.push(format!("{path} (the command)"));
        }
        for arg in cmd.get_arguments() {
            let described = arg.get_help().is_some() || arg.get_long_help().is_some();
            if !described {
                let name = match arg.get_long() {
                    Some(long) => format!("--{long}"),
                    None => format!("<{}>", arg.get_id()),
                };
                missing.push(format!("{path} {name}"));
            }
        }
        for sub in cmd.get_subcommands() {
            undescribed(sub, &format!("{path} {}", sub.get_name()), missing);
        }
    }

    /// `--help` describes everything it lists: an argument or a command
    /// added without a doc comment fails here, by name.
    #[test]
    fn every_command_and_argument_has_a_help_text() {
        let mut missing = Vec::new();
        undescribed(&super::command(), super::NAME, &mut missing);
        assert!(
            missing.is_empty(),
            "without a help text:\n  {}",
            missing.join("\n  ")
        );
    }
}

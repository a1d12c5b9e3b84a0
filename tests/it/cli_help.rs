//! The command line explains itself: every command's `--help` (the whole tree, walked
//! through clap, so a new subcommand is checked without being listed here) describes
//! every argument, names the value of every option that takes one, and ends with
//! examples and the exit statuses; `--version` and the completion scripts work.

use clap::{CommandFactory, Parser};
use lapse::cli::Cli;

use crate::helpers::{run_lapse, stderr, stdout};

/// Every command with the words that reach it (`[]` is `lapse` itself).
fn commands() -> Vec<(Vec<String>, clap::Command)> {
    fn walk(path: Vec<String>, cmd: &clap::Command, out: &mut Vec<(Vec<String>, clap::Command)>) {
        out.push((path.clone(), cmd.clone()));
        for sub in cmd.get_subcommands() {
            let mut next = path.clone();
            next.push(sub.get_name().to_string());
            walk(next, sub, out);
        }
    }
    let mut out = Vec::new();
    walk(Vec::new(), &Cli::command(), &mut out);
    out
}

/// The first `lapse ...` command of an example line (up to `&&`, `|` or `>`), parsed
/// as the binary would: examples must not rot when an option is renamed.
fn parses(example: &str) -> Result<(), clap::Error> {
    let Some(start) = example.find("lapse ") else {
        return Ok(());
    };
    let command = example[start..]
        .split(['|', '>', '&'])
        .next()
        .unwrap_or_default();
    let words = command.split_whitespace().map(|w| w.trim_matches('"'));
    match Cli::try_parse_from(words) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => Ok(()),
        Err(e) => Err(e),
    }
}

#[test]
fn every_command_describes_its_arguments_and_ends_with_examples_and_exit_codes() {
    let all = commands();
    assert!(all.len() > 5, "the walk found only {} commands", all.len());
    let mut problems = Vec::new();
    for (path, cmd) in &all {
        let shown = format!("lapse {}", path.join(" "));
        if cmd.get_about().is_none() && !path.is_empty() {
            problems.push(format!("{shown}: no description"));
        }
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if arg.get_help().is_none() && arg.get_long_help().is_none() {
                problems.push(format!("{shown}: argument `{id}` has no description"));
            }
            // An option's value is named for what it holds (`<DURATION>`, `<ADDR>`), not
            // the field name clap derives by default (`<METRICS_LISTEN>`).
            let takes_value = arg.get_action().takes_values();
            let names: Vec<String> = arg
                .get_value_names()
                .unwrap_or_default()
                .iter()
                .map(|n| n.to_string())
                .collect();
            let derived = arg.get_long().is_some() && names == [id.to_uppercase()];
            if takes_value && (names.is_empty() || derived) {
                problems.push(format!("{shown}: argument `{id}` has no value name"));
            }
        }
        let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
        args.push("--help");
        let out = run_lapse(&args, &[]);
        let help = stdout(&out);
        if out.status.code() != Some(0) {
            problems.push(format!(
                "{shown} --help: exit {:?}: {}",
                out.status.code(),
                stderr(&out)
            ));
            continue;
        }
        let Some((_, after)) = help.split_once("\nExamples:\n") else {
            problems.push(format!("{shown} --help: no Examples section"));
            continue;
        };
        let Some((examples, statuses)) = after.split_once("\nExit status:\n") else {
            problems.push(format!(
                "{shown} --help: no Exit status section after the examples"
            ));
            continue;
        };
        if !examples.lines().any(|l| l.trim_start().contains("lapse ")) {
            problems.push(format!(
                "{shown} --help: the examples show no lapse command"
            ));
        }
        for example in examples.lines() {
            if let Err(e) = parses(example) {
                problems.push(format!(
                    "{shown} --help: example `{}` does not parse: {e}",
                    example.trim()
                ));
            }
        }
        let codes: Vec<&str> = statuses
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        if !codes.contains(&"0") || !codes.contains(&"2") {
            problems.push(format!(
                "{shown} --help: exit statuses 0 and 2 not both listed: {codes:?}"
            ));
        }
        if let Some(bad) = codes.iter().find(|c| !matches!(**c, "0" | "1" | "2" | "3")) {
            problems.push(format!(
                "{shown} --help: `{bad}` is not one of the exit statuses 0-3"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The package version and the commit the binary was built from (this checkout's
/// HEAD when the tests run in one).
#[test]
fn version_prints_the_package_version_and_the_commit() {
    let out = run_lapse(&["--version"], &[]);
    assert_eq!(out.status.code(), Some(0));
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    assert_eq!(
        stdout(&out).trim(),
        format!("lapse {} (commit {head})", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn completion_scripts_cover_every_top_level_command() {
    let top: Vec<String> = Cli::command()
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .collect();
    for (shell, marker) in [
        ("bash", "complete -F _lapse"),
        ("zsh", "#compdef lapse"),
        ("fish", "complete -c lapse"),
    ] {
        // No configuration is needed, even a broken one.
        let out = run_lapse(&["completions", shell], &[("LAPSE_WORKER__PREFECH", "5")]);
        let script = stdout(&out);
        assert_eq!(out.status.code(), Some(0), "{shell}: {}", stderr(&out));
        assert!(script.contains(marker), "{shell}: no `{marker}`");
        for name in &top {
            assert!(script.contains(name.as_str()), "{shell}: `{name}` missing");
        }
    }
    let out = run_lapse(&["completions", "tcsh"], &[]);
    assert_eq!(out.status.code(), Some(2));
}

#[tokio::test]
async fn migrate_pay_and_extend_report_in_json() {
    let env = crate::helpers::TestEnv::with_database(&["1s"]).await;
    let json = |args: &[&str], code: i32| {
        let out = env.lapse(args);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {}", stderr(&out));
        serde_json::from_str::<serde_json::Value>(&stdout(&out))
            .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {}", stdout(&out)))
    };
    assert_eq!(json(&["migrate", "--json"], 0)["applied"], 0);
    let ids = json(
        &[
            "order",
            "create",
            "--expires-in",
            "1h",
            "--line",
            "apple:1",
            "--json",
        ],
        0,
    );
    let id = ids[0].as_i64().expect("an id").to_string();
    let extended = json(&["order", "extend", &id, "--by", "10m", "--json"], 0);
    assert_eq!(extended["extended"], true);
    assert!(
        extended["deadline_version"].as_i64().is_some(),
        "{extended}"
    );
    assert_eq!(json(&["order", "pay", &id, "--json"], 0)["outcome"], "PAID");
    assert_eq!(
        json(&["order", "pay", &id, "--json"], 0)["outcome"],
        "ALREADY_PAID"
    );
    let refused = json(&["order", "extend", &id, "--by", "10m", "--json"], 1);
    assert_eq!(refused["extended"], false);
    assert!(refused["refused"].is_string(), "{refused}");
    assert_eq!(
        json(&["order", "pay", "999999999", "--json"], 1)["outcome"],
        "NOT_FOUND"
    );
    env.cleanup().await;
}

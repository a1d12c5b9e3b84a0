//! Invalid configuration, through the binary: exit status 2, the key named, no
//! credentials in the output.

use crate::helpers::{run_lapse, stderr};

struct Case {
    name: &'static str,
    config: &'static str,
    tiers: &'static str,
    env: &'static [(&'static str, &'static str)],
    key: &'static str,
}

const SECRET: &str = "hunter2secret";

#[test]
fn every_invalid_configuration_exits_2_naming_the_key() {
    let ok_tiers = "tiers = [\"1s\", \"5s\"]";
    let cases = [
        Case {
            name: "unknown key",
            config: "[broker]\nprefx = \"x\"",
            tiers: ok_tiers,
            env: &[],
            key: "broker.prefx",
        },
        Case {
            name: "unknown section",
            config: "[brokers]\nurl = \"x\"",
            tiers: ok_tiers,
            env: &[],
            key: "brokers",
        },
        Case {
            name: "unknown env key",
            config: "",
            tiers: ok_tiers,
            env: &[("LAPSE_WORKER__PREFECH", "5")],
            key: "worker.prefech",
        },
        Case {
            name: "unparsable duration",
            config: "[worker]\ntier_tolerance = \"a bit\"",
            tiers: ok_tiers,
            env: &[],
            key: "worker.tier_tolerance",
        },
        Case {
            name: "unparsable env duration",
            config: "",
            tiers: ok_tiers,
            env: &[("LAPSE_SWEEPER__INTERVAL", "often")],
            key: "sweeper.interval",
        },
        Case {
            name: "bad broker url",
            config: "[broker]\nurl = \"ftp://guest:hunter2secret@host\"",
            tiers: ok_tiers,
            env: &[],
            key: "broker.url",
        },
        Case {
            name: "bad management url",
            config: "[broker]\nmanagement_url = \"not a url hunter2secret\"",
            tiers: ok_tiers,
            env: &[],
            key: "broker.management_url",
        },
        Case {
            name: "bad database url",
            config: "[database]\nurl = \"postgres://u:hunter2secret@host:notaport/db\"",
            tiers: ok_tiers,
            env: &[],
            key: "database.url",
        },
        Case {
            name: "empty tier list",
            config: "",
            tiers: "tiers = []",
            env: &[],
            key: "tiers",
        },
        Case {
            name: "duplicate tiers",
            config: "",
            tiers: "tiers = [\"1m\", \"60s\"]",
            env: &[],
            key: "tiers[1]",
        },
        Case {
            name: "zero tier",
            config: "",
            tiers: "tiers = [\"0s\"]",
            env: &[],
            key: "tiers[0]",
        },
        Case {
            name: "tier above the TTL maximum",
            config: "",
            tiers: "tiers = [\"1s\", \"50days\"]",
            env: &[],
            key: "tiers[1]",
        },
        Case {
            name: "prefix with a space",
            config: "[broker]\nprefix = \"my shop\"",
            tiers: ok_tiers,
            env: &[],
            key: "broker.prefix",
        },
        Case {
            name: "sweeper interval that would spin",
            config: "[sweeper]\ninterval = \"0s\"",
            tiers: ok_tiers,
            env: &[],
            key: "sweeper.interval",
        },
        Case {
            name: "relay poll interval that would spin",
            config: "",
            tiers: ok_tiers,
            env: &[("LAPSE_RELAY__POLL_INTERVAL", "0s")],
            key: "relay.poll_interval",
        },
        Case {
            name: "lock retry that would spin",
            config: "[worker]\nlock_retry = \"0ms\"",
            tiers: ok_tiers,
            env: &[],
            key: "worker.lock_retry",
        },
        Case {
            name: "heartbeat switched off",
            config: "[broker]\nheartbeat = \"0s\"",
            tiers: ok_tiers,
            env: &[],
            key: "broker.heartbeat",
        },
        Case {
            name: "statement timeout switched off",
            config: "",
            tiers: ok_tiers,
            env: &[("LAPSE_DATABASE__STATEMENT_TIMEOUT", "0s")],
            key: "database.statement_timeout",
        },
        Case {
            name: "reserved prefix",
            config: "",
            tiers: ok_tiers,
            env: &[("LAPSE_BROKER__PREFIX", "amq.x")],
            key: "broker.prefix",
        },
    ];
    for case in cases {
        let dir = tempfile::tempdir().unwrap();
        let tiers = dir.path().join("tiers.toml");
        std::fs::write(&tiers, case.tiers).unwrap();
        let config = dir.path().join("lapse.toml");
        // The topology section comes first so a case's own sections follow it.
        std::fs::write(
            &config,
            format!(
                "[topology]\nfile = {:?}\n{}\n",
                tiers.display().to_string(),
                case.config
            ),
        )
        .unwrap();
        let out = run_lapse(
            &["--config", config.to_str().unwrap(), "topology", "plan"],
            case.env,
        );
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{}: {err}", case.name);
        assert!(
            err.contains(case.key),
            "{}: expected key `{}` in: {err}",
            case.name,
            case.key
        );
        assert!(
            !err.contains(SECRET),
            "{}: credentials leaked: {err}",
            case.name
        );
        assert!(!String::from_utf8_lossy(&out.stdout).contains(SECRET));
    }
}

#[test]
fn a_missing_explicit_config_file_exits_2() {
    let out = run_lapse(
        &["--config", "/nonexistent/lapse.toml", "topology", "plan"],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--config"));
}

#[test]
fn bad_arguments_exit_2() {
    let out = run_lapse(&["topology", "frobnicate"], &[]);
    assert_eq!(out.status.code(), Some(2));
}

/// `LAPSE_LOG` filters and `LAPSE_LOG_FORMAT` formats the logs; neither is taken for a
/// configuration key, and a bad value is exit 2 naming the variable.
#[tokio::test]
async fn the_logging_variables_work_and_are_not_configuration_keys() {
    let tiers = tempfile::tempdir().unwrap();
    let tier_file = tiers.path().join("tiers.toml");
    std::fs::write(&tier_file, "tiers = [\"1s\"]").unwrap();
    let tier_file = tier_file.to_str().unwrap().to_string();
    let base = [("LAPSE_TOPOLOGY__FILE", tier_file.as_str())];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut vars: Vec<(&str, &str)> = base.to_vec();
        vars.extend_from_slice(extra);
        vars
    };

    let out = run_lapse(
        &["topology", "plan"],
        &with(&[("LAPSE_LOG_FORMAT", "json"), ("LAPSE_LOG", "debug")]),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    // `lapse migrate` of a new database logs "created database" at info.
    let migrate = |extra: &[(&'static str, &'static str)]| {
        let name = crate::helpers::unique("log");
        let url = crate::helpers::database_url(&name);
        let mut vars = with(extra);
        vars.push(("LAPSE_DATABASE__URL", url.as_str()));
        let out = run_lapse(&["migrate"], &vars);
        (name, out)
    };
    let (json_db, out) = migrate(&[("LAPSE_LOG_FORMAT", "json")]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let line = err
        .lines()
        .find(|l| l.contains("created database"))
        .unwrap_or_else(|| panic!("no log line: {err}"));
    let event: serde_json::Value = serde_json::from_str(line).expect("a JSON log line");
    assert_eq!(event["level"], "INFO", "{line}");
    assert_eq!(event["fields"]["message"], "created database", "{line}");

    let (text_db, out) = migrate(&[("LAPSE_LOG", "info")]);
    let err = stderr(&out);
    assert!(
        err.lines()
            .any(|l| l.contains("INFO") && l.contains("created database")),
        "{err}"
    );
    assert!(serde_json::from_str::<serde_json::Value>(err.lines().next().unwrap_or("")).is_err());
    assert!(
        !err.contains('\u{1b}'),
        "no colour codes off a terminal: {err}"
    );

    let (quiet_db, out) = migrate(&[("LAPSE_LOG", "warn")]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        !stderr(&out).contains("created database"),
        "{}",
        stderr(&out)
    );

    for name in [json_db, text_db, quiet_db] {
        crate::helpers::drop_database(&name).await;
    }

    for (var, value) in [("LAPSE_LOG_FORMAT", "xml"), ("LAPSE_LOG", "lapse=loud")] {
        let out = run_lapse(&["topology", "plan"], &with(&[(var, value)]));
        assert_eq!(out.status.code(), Some(2), "{var}={value}");
        assert!(stderr(&out).contains(var), "{var}: {}", stderr(&out));
    }
}

/// `LAPSE_CONFIG` names the configuration file as `--config` does (which wins); it is
/// not read as a configuration key.
#[test]
fn lapse_config_names_the_file_and_config_wins_over_it() {
    let dir = tempfile::tempdir().unwrap();
    let from_var = dir.path().join("from-var.toml");
    let from_flag = dir.path().join("from-flag.toml");
    std::fs::write(&from_var, "[broker]\nprefix = \"named-by-the-variable\"\n").unwrap();
    std::fs::write(&from_flag, "[broker]\nprefix = \"named-by-the-flag\"\n").unwrap();
    let var = from_var.to_str().unwrap();
    let out = run_lapse(&["topology", "plan", "--json"], &[("LAPSE_CONFIG", var)]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("named-by-the-variable."), "{text}");
    let flag = from_flag.to_str().unwrap();
    let out = run_lapse(
        &["--config", flag, "topology", "plan", "--json"],
        &[("LAPSE_CONFIG", var)],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("named-by-the-flag."));
}

/// Output into a pipe whose reader is gone (`lapse ... | head -1`) ends the command
/// quietly, as other Unix tools do, instead of a panic.
#[test]
fn a_closed_pipe_ends_the_output_without_a_panic() {
    use std::os::unix::process::ExitStatusExt;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lapse"))
        .args(["topology", "plan"])
        .env_remove("LAPSE_CONFIG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The reader goes away before the command has written anything.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        out.status.success() || out.status.signal() == Some(13),
        "ends quietly (or killed by SIGPIPE): {:?} {err}",
        out.status
    );
}

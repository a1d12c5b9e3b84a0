//! An installed lapse: the built binary copied into a directory that holds no
//! `lapse.toml` and no `topology/` folder, run from there as a systemd unit, a cron
//! job or a container with another working directory would run it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::demo::{Demo, report};
use crate::helpers::{TestEnv, amqp_url, database_url, management_url, stderr, stdout};

/// The binary copied into `dir/bin`, as `cargo install` or a package would place it.
fn install(dir: &Path) -> PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir(&bin).unwrap();
    let exe = bin.join("lapse");
    std::fs::copy(env!("CARGO_BIN_EXE_lapse"), &exe).unwrap();
    exe
}

/// Runs the installed binary in `cwd` with no inherited `LAPSE_` variables plus `vars`.
fn run(exe: &Path, cwd: &Path, args: &[&str], vars: &[(&str, String)]) -> Output {
    let mut cmd = Command::new(exe);
    for (key, _) in std::env::vars() {
        if key.starts_with("LAPSE_") {
            cmd.env_remove(key);
        }
    }
    cmd.current_dir(cwd)
        .args(args)
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())));
    cmd.output().expect("run the installed lapse")
}

#[tokio::test(flavor = "multi_thread")]
async fn an_installed_binary_plans_demos_migrates_and_checks_from_an_empty_directory() {
    let home = tempfile::tempdir().unwrap();
    let exe = install(home.path());
    let cwd = home.path();
    assert!(!cwd.join("topology").exists() && !cwd.join("lapse.toml").exists());

    // The plan names the built-in tiers and says where they came from.
    let plan = run(&exe, cwd, &["topology", "plan"], &[]);
    assert_eq!(plan.status.code(), Some(0), "{}", stderr(&plan));
    let text = stdout(&plan);
    assert!(
        text.starts_with("TIERS 1s 5s 15s 1m 5m 15m 30m 1h 6h 1d (from built-in default"),
        "{text}"
    );
    assert!(text.contains("lapse.wait.1d"), "{text}");
    let json = run(&exe, cwd, &["topology", "plan", "--json"], &[]);
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(json["tiers"].as_array().unwrap().len(), 10, "{json}");
    assert!(
        json["tiers_from"].as_str().unwrap().starts_with("built-in"),
        "{json}"
    );

    // The demo, with its picture at its default path in the working directory.
    let demo = Demo::new();
    let out = run(
        &exe,
        cwd,
        &["demo", "--json", "--orders", "300", "--duration", "10s"],
        &demo.services(),
    );
    let r = report(&out);
    assert_eq!(out.status.code(), Some(0), "{r:#}\n{}", stderr(&out));
    assert_eq!(r["orders"], 300, "{r:#}");
    assert_eq!(r["early"], 0, "{r:#}");
    assert_eq!(r["open"], 0, "{r:#}");
    assert_eq!(r["problems"], serde_json::json!([]), "{r:#}");
    let svg = std::fs::read_to_string(cwd.join("lapse-demo.svg")).expect("the SVG in the cwd");
    assert!(
        svg.starts_with("<svg") || svg.starts_with("<?xml"),
        "{svg:.80}"
    );
    assert_eq!(demo.leftovers().await, (vec![], vec![]));
    demo.remove().await;

    // migrate (embedded migrations), topology apply and status --check of a
    // deployment of its own, all from the same directory.
    let mut env = TestEnv::new(&["1s"]).await;
    env.database = Some(env.prefix.clone());
    let vars = vec![
        ("LAPSE_BROKER__URL", amqp_url()),
        ("LAPSE_BROKER__MANAGEMENT_URL", management_url()),
        ("LAPSE_BROKER__PREFIX", env.prefix.clone()),
        ("LAPSE_DATABASE__URL", database_url(&env.prefix)),
    ];
    for args in [
        &["migrate"][..],
        &["topology", "apply"],
        &["topology", "verify"],
    ] {
        let out = run(&exe, cwd, args, &vars);
        assert_eq!(
            out.status.code(),
            Some(0),
            "lapse {args:?}\nstdout: {}\nstderr: {}",
            stdout(&out),
            stderr(&out)
        );
    }
    // A worker started from the same directory; with it consuming, `status --check`
    // finds nothing to report.
    let mut worker = tokio::process::Command::new(&exe);
    for (key, _) in std::env::vars() {
        if key.starts_with("LAPSE_") {
            worker.env_remove(key);
        }
    }
    let mut worker = worker
        .current_dir(cwd)
        .arg("worker")
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let passed = loop {
        let out = run(&exe, cwd, &["status", "--check"], &vars);
        let text = format!("{}{}", stdout(&out), stderr(&out));
        if out.status.code() == Some(0) || started.elapsed() > Duration::from_secs(60) {
            break (out.status.code(), text);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    worker.start_kill().unwrap();
    let (_, log) = crate::helpers::exit_of(worker).await;
    assert_eq!(
        passed.0,
        Some(0),
        "status --check: {}\nworker: {log}",
        passed.1
    );
    env.cleanup().await;
}

#[test]
fn a_configured_tier_file_that_is_missing_exits_2_naming_the_path() {
    let home = tempfile::tempdir().unwrap();
    let exe = install(home.path());
    let out = run(
        &exe,
        home.path(),
        &["topology", "plan"],
        &[("LAPSE_TOPOLOGY__FILE", "tiers/shop.toml".to_string())],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("topology.file"), "{err}");
    assert!(err.contains("tiers/shop.toml"), "{err}");
    let resolved = home.path().join("tiers/shop.toml");
    assert!(err.contains(&resolved.display().to_string()), "{err}");
    assert!(err.contains("working directory"), "{err}");
}

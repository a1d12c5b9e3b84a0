//! What a worker does at start with several order databases: an error of one shard
//! names its key, `database.shards[i]`.

use std::process::Stdio;
use std::time::Duration;

use lapse::config::Secret;

use super::{Databases, connect};
use crate::helpers::{TestEnv, free_port};
use crate::pg_proxy::{Mode, PgProxy};

/// Runs `lapse worker` with the env's config file and `vars`; its exit status and
/// stderr (it must stop on its own within a minute).
async fn worker_exit(env: &TestEnv, vars: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_lapse"));
    for (key, _) in std::env::vars() {
        if key.starts_with("LAPSE_") {
            cmd.env_remove(key);
        }
    }
    cmd.args(["--config", env.config_path().to_str().unwrap(), "worker"])
        .envs(vars.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = cmd.spawn().unwrap();
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("the worker stops on its own")
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn migrated(urls: &[String]) {
    for url in urls {
        lapse::db::migrate(&Secret::new(url.clone())).await.unwrap();
    }
}

fn shards_config(env: &TestEnv, urls: &[String]) {
    let list: Vec<String> = urls.iter().map(|u| format!("{u:?}")).collect();
    env.write_config(&format!("[database]\nshards = [{}]\n", list.join(", ")));
}

/// A shard whose schema history has a migration this version does not know (a newer
/// version ran there): refinery refuses it, and the start stops naming that shard.
#[tokio::test]
async fn a_failed_migration_at_start_names_the_shard() {
    let env = TestEnv::new(&["1s"]).await;
    let dbs = Databases::new(&["f0", "f1"]);
    let urls = dbs.urls();
    migrated(&urls).await;
    connect(&urls[1])
        .await
        .batch_execute(
            "INSERT INTO refinery_schema_history (version, name, applied_on, checksum)
             VALUES (999, 'from_a_newer_version', '2026-01-01T00:00:00Z', '0')",
        )
        .await
        .unwrap();
    shards_config(&env, &urls);
    let (code, err) = worker_exit(&env, &[]).await;
    assert_eq!(code, Some(1), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.contains("database.shards[1]") && last.contains("missing from the filesystem"),
        "{err}"
    );
    drop(dbs);
    env.cleanup().await;
}

/// With `worker.migrate_on_start` off the worker checks each shard's schema; a
/// connection that drops after the login fails the check naming the shard, not
/// `database.url`.
#[tokio::test]
async fn a_check_whose_connection_drops_names_the_shard() {
    let env = TestEnv::new(&["1s"]).await;
    let dbs = Databases::new(&["c0", "c1"]);
    let mut urls = dbs.urls();
    migrated(&urls).await;
    let proxy = PgProxy::start(free_port(), Mode::CutAfterLogin);
    let name = urls[1].rsplit_once('/').unwrap().1.to_string();
    urls[1] = PgProxy::url(proxy.port, &name);
    shards_config(&env, &urls);
    let (code, err) = worker_exit(&env, &[("LAPSE_WORKER__MIGRATE_ON_START", "false")]).await;
    assert_eq!(code, Some(3), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.contains("database.shards[1]") && !last.contains("database.url"),
        "{err}"
    );
    drop(proxy);
    drop(dbs);
    env.cleanup().await;
}

//! Quiet, honest output and failing fast, through the binary: expected broker answers
//! are not logged as errors; common mistakes get exit status 2 or 3 and a message that
//! says what to do; at startup the worker stops on what no retry heals (refused
//! database credentials, a missing database) and waits for what is merely unreachable.

use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

use crate::helpers::{
    TestEnv, database_url, drop_database, exit_of, run_lapse, spawn_worker, stderr, stdout, unique,
};

/// A local TCP port nothing listens on.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

fn lapse_with(env: &TestEnv, args: &[&str], vars: &[(&str, &str)]) -> std::process::Output {
    let config = env.config_path();
    let mut full = vec!["--config", config.to_str().unwrap()];
    full.extend_from_slice(args);
    run_lapse(&full, vars)
}

fn assert_quiet(what: &str, err: &str) {
    assert!(
        !err.lines().any(|l| l.contains("ERROR")),
        "{what}: an ERROR line in stderr:\n{err}"
    );
    assert!(
        !err.contains('\u{1b}'),
        "{what}: colour codes off a terminal:\n{err}"
    );
}

#[tokio::test]
async fn verify_of_an_empty_prefix_or_a_drifted_queue_logs_no_error() {
    let mut env = TestEnv::new(&["1s", "5s"]).await;
    // Even with the most verbose filter, the broker's expected 404s are no errors.
    let out = lapse_with(&env, &["topology", "verify"], &[("LAPSE_LOG", "trace")]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stdout(&out).contains("missing"), "{}", stdout(&out));
    assert_quiet("empty prefix", &stderr(&out));

    // A due queue declared by hand without lapse's arguments: drift, answered 406.
    let due = env.names().due_queue();
    env.track_queue(&due);
    let ch = env.conn.create_channel().await.unwrap();
    ch.queue_declare(
        due.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let out = lapse_with(&env, &["topology", "verify"], &[("LAPSE_LOG", "debug")]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stdout(&out).contains(&due), "{}", stdout(&out));
    assert_quiet("drifted queue", &stderr(&out));
    env.cleanup().await;
}

#[tokio::test]
async fn broker_mistakes_name_the_key_and_what_to_do() {
    let env = TestEnv::new(&["1s"]).await;
    let secret = "not-the-password-hunter2";
    let refused = format!("amqp://guest:{secret}@127.0.0.1:5672/%2f");
    let out = lapse_with(
        &env,
        &["topology", "verify"],
        &[("LAPSE_BROKER__URL", &refused)],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("refused the login of broker.url"), "{err}");
    assert!(!err.contains(secret), "{err}");
    assert_quiet("refused login", &err);

    let away = format!("amqp://guest:guest@127.0.0.1:{}/%2f", closed_port());
    let out = lapse_with(
        &env,
        &["topology", "apply"],
        &[("LAPSE_BROKER__URL", &away)],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains("cannot reach the broker of broker.url"),
        "{err}"
    );

    let no_plugin = format!("http://guest:guest@127.0.0.1:{}", closed_port());
    let out = lapse_with(
        &env,
        &["topology", "verify"],
        &[("LAPSE_BROKER__MANAGEMENT_URL", &no_plugin)],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains("rabbitmq_management"),
        "says to enable the plugin: {err}"
    );
    assert_eq!(
        err.lines().count(),
        1,
        "one error, not one per object: {err}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn database_mistakes_name_the_key_and_what_to_do() {
    let env = TestEnv::new(&["1s"]).await;
    let missing = database_url(&unique("nodb"));
    let out = lapse_with(
        &env,
        &["order", "show", "1"],
        &[("LAPSE_DATABASE__URL", &missing)],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("run `lapse migrate`"), "{err}");
    assert!(
        !err.contains("db error: db error"),
        "no doubled prefixes: {err}"
    );

    let stranger = missing.replace("postgres@", "nosuchrole@");
    let out = lapse_with(&env, &["status"], &[("LAPSE_DATABASE__URL", &stranger)]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("refused the login of database.url"), "{err}");

    let away = format!("postgres://postgres@127.0.0.1:{}/lapse", closed_port());
    let out = lapse_with(
        &env,
        &["order", "pay", "1"],
        &[("LAPSE_DATABASE__URL", &away)],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains("cannot reach the database of database.url"),
        "{err}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn the_worker_stops_at_startup_on_a_database_no_retry_can_heal() {
    let env = TestEnv::new(&["1s"]).await;
    let name = unique("nodb");
    let missing = database_url(&name);
    let child = spawn_worker(
        &env,
        &[
            ("LAPSE_DATABASE__URL", &missing),
            ("LAPSE_WORKER__MIGRATE_ON_START", "false"),
        ],
    );
    let (code, err) = exit_of(child).await;
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("does not exist") && err.contains("lapse migrate"),
        "{err}"
    );

    let stranger = missing.replace("postgres@", "nosuchrole@");
    for migrate in ["true", "false"] {
        let child = spawn_worker(
            &env,
            &[
                ("LAPSE_DATABASE__URL", &stranger),
                ("LAPSE_WORKER__MIGRATE_ON_START", migrate),
            ],
        );
        let (code, err) = exit_of(child).await;
        assert_eq!(code, Some(2), "migrate_on_start={migrate}: {err}");
        assert!(
            err.contains("refused the login of database.url"),
            "migrate_on_start={migrate}: {err}"
        );
    }
    // None of these created the database.
    drop_database(&name).await;
    env.cleanup().await;
}

#[tokio::test]
async fn the_worker_waits_for_an_unreachable_database() {
    let env = TestEnv::new(&["1s"]).await;
    let away = format!("postgres://postgres@127.0.0.1:{}/lapse", closed_port());
    for migrate in ["true", "false"] {
        let mut child = spawn_worker(
            &env,
            &[
                ("LAPSE_DATABASE__URL", &away),
                ("LAPSE_WORKER__MIGRATE_ON_START", migrate),
            ],
        );
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(
            child.try_wait().unwrap().is_none(),
            "migrate_on_start={migrate}: the worker gave up on an unreachable database"
        );
        let pid = child.id().unwrap().to_string();
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        let (code, err) = exit_of(child).await;
        assert!(code.is_some(), "{err}");
    }
    env.cleanup().await;
}

//! `lapse status --check | --watch` and the exit codes of `status` and `topology
//! verify`: 0 healthy, 1 a problem found, 3 the broker or database unreachable.

use std::process::{Command, Stdio};
use std::time::Duration;

use lapin::BasicProperties;
use lapse::amqp::broker::Publisher;
use lapse::orders::Line;
use serde_json::Value;

use crate::helpers::{
    TestEnv, amqp_url, count, create_orders, database_url, eventually, management_url, stderr,
    stdout, wait_released,
};

/// A port nothing listens on.
const CLOSED_PORT: u16 = 9;

fn lines(sku: &str) -> Vec<Line> {
    vec![Line {
        sku: sku.into(),
        qty: 1,
    }]
}

/// Publishes `n` messages straight into `queue` (default exchange).
async fn put(env: &TestEnv, exchange: &str, key: &str, n: usize, properties: BasicProperties) {
    let publisher = Publisher::new(&env.conn).await.unwrap();
    for i in 0..n {
        publisher
            .publish(
                exchange,
                key,
                format!("not a timeout {i}").as_bytes(),
                properties.clone(),
            )
            .await
            .unwrap();
    }
}

/// Rewrites the config file with other broker, management and database URLs.
fn write_urls(env: &TestEnv, broker: &str, management: &str, database: &str) {
    std::fs::write(
        env.config_path(),
        format!(
            "[broker]\nurl = {broker:?}\nmanagement_url = {management:?}\nprefix = {:?}\n\n[topology]\nfile = {:?}\n\n[database]\nurl = {database:?}\n",
            env.prefix,
            env.tier_path().display().to_string(),
        ),
    )
    .unwrap();
}

#[tokio::test]
async fn check_is_silent_and_green_while_a_worker_runs() {
    let env = TestEnv::with_database(&["1s"]).await;
    let worker = env.start(&env.config()).await;
    let mut db = env.db().await;
    create_orders(&mut db, &[Duration::from_millis(500); 3], &lines("green")).await;
    eventually(Duration::from_secs(30), "three closes", || async {
        let closed = count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
        (closed == 3).then_some(())
    })
    .await;
    wait_released(&db, 3).await;

    let check = env.lapse(&["status", "--check"]);
    assert_eq!(
        check.status.code(),
        Some(0),
        "{}{}",
        stdout(&check),
        stderr(&check)
    );
    assert_eq!(stdout(&check), "", "no problem, no output");
    let json = env.lapse(&["status", "--check", "--json"]);
    assert_eq!(json.status.code(), Some(0), "{}", stdout(&json));
    let report: Value = serde_json::from_str(&stdout(&json)).unwrap();
    assert_eq!(report["ok"], true, "{report}");
    assert_eq!(report["problems"].as_array().unwrap().len(), 0);

    // The plain view shows the consumers the worker attached.
    let shown = env.lapse(&["status", "--json"]);
    let status: Value = serde_json::from_str(&stdout(&shown)).unwrap();
    let due = status["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["role"] == "due")
        .unwrap()
        .clone();
    assert!(due["consumers"].as_u64().unwrap() >= 1, "{due}");
    assert_eq!(status["releases_missing"], 0, "{status}");
    worker.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn check_names_a_due_queue_without_consumer_first_and_parked_messages() {
    let env = TestEnv::with_database(&["1s"]).await;
    let parked =
        lapse::message::parked_properties(&BasicProperties::default(), "test", "test: poison");
    put(&env, &env.names().parked(), "", 2, parked).await;
    let mut db = env.db().await;
    create_orders(&mut db, &[Duration::from_millis(200)], &lines("late")).await;
    // Past the deadline and the outbox row older than 1 s (no relay, no worker).
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let check = env.lapse(&["status", "--check"]);
    let out = stdout(&check);
    assert_eq!(check.status.code(), Some(1), "{out}{}", stderr(&check));
    let found: Vec<&str> = out.lines().collect();
    assert!(
        found[0].starts_with("NO_CONSUMER: the due queue")
            && found[0].contains(&env.names().due_queue()),
        "{out}"
    );
    assert!(
        found
            .iter()
            .any(|l| l.starts_with("NO_CONSUMER: the stock release queue")),
        "{out}"
    );
    assert!(
        found
            .iter()
            .any(|l| l.starts_with("PARKED: 2 messages parked")),
        "{out}"
    );
    // Within the default thresholds the overdue order and the outbox row are no problem.
    assert!(
        !found
            .iter()
            .any(|l| l.starts_with("OVERDUE") || l.starts_with("OUTBOX")),
        "{out}"
    );

    let strict = env.lapse(&[
        "status",
        "--check",
        "--json",
        "--max-overdue",
        "1s",
        "--max-outbox-age",
        "1s",
        "--max-parked",
        "2",
    ]);
    assert_eq!(strict.status.code(), Some(1), "{}", stdout(&strict));
    let report: Value = serde_json::from_str(&stdout(&strict)).unwrap();
    assert_eq!(report["ok"], false);
    let kinds: Vec<&str> = report["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["no_consumer", "no_consumer", "overdue", "outbox"],
        "{report}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn status_exits_3_naming_the_broker_or_the_database_it_cannot_reach() {
    let env = TestEnv::with_database(&["1s"]).await;
    let closed_broker = format!("amqp://guest:guest@127.0.0.1:{CLOSED_PORT}/%2f");
    write_urls(&env, &closed_broker, &management_url(), &env.database_url());
    for args in [&["status"][..], &["status", "--check"]] {
        let out = env.lapse(args);
        let text = format!("{}{}", stdout(&out), stderr(&out));
        assert_eq!(out.status.code(), Some(3), "{args:?}: {text}");
        assert!(
            text.contains(&format!(
                "cannot reach the broker at 127.0.0.1:{CLOSED_PORT}"
            )),
            "{args:?}: {text}"
        );
        assert!(!text.contains("cannot reach the database"), "{text}");
    }

    // A database that does not answer is an outage (3); one that does not exist is a
    // configuration mistake (2) with the next step.
    let closed_db = env
        .database_url()
        .replace("127.0.0.1:5432", &format!("127.0.0.1:{CLOSED_PORT}"));
    assert_ne!(
        closed_db,
        env.database_url(),
        "the test's database URL has a port"
    );
    write_urls(&env, &amqp_url(), &management_url(), &closed_db);
    let out = env.lapse(&["status", "--check"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(3), "{text}{}", stderr(&out));
    assert!(
        text.starts_with("UNREACHABLE: cannot reach the database"),
        "{text}"
    );
    assert!(!text.contains("cannot reach the broker"), "{text}");

    let missing = format!("{}_missing", env.prefix);
    write_urls(
        &env,
        &amqp_url(),
        &management_url(),
        &database_url(&missing),
    );
    let out = env.lapse(&["status", "--check"]);
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains("does not exist"), "{text}");
    assert!(text.contains("lapse migrate"), "{text}");
    env.cleanup().await;
}

#[tokio::test]
async fn watch_refreshes_with_the_backlog_rate_and_stops_cleanly_on_ctrl_c() {
    let env = TestEnv::with_database(&["1s"]).await;
    put(
        &env,
        "",
        &env.names().due_queue(),
        20,
        BasicProperties::default(),
    )
    .await;
    let config = env.config_path();
    let child = Command::new(env!("CARGO_BIN_EXE_lapse"))
        .args([
            "--config",
            config.to_str().unwrap(),
            "status",
            "--watch",
            "--interval",
            "500ms",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let signalled = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(signalled.success());
    let out = child.wait_with_output().unwrap();
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    let refreshes: Vec<&str> = text.lines().filter(|l| l.starts_with("BACKLOG")).collect();
    assert!(refreshes.len() >= 2, "{text}");
    assert!(
        refreshes.iter().all(|l| l.starts_with("BACKLOG 20;")),
        "{text}"
    );
    // From the second refresh on, the rate is measured and an ETA given (none here:
    // nothing consumes the backlog).
    assert!(
        refreshes[1..]
            .iter()
            .all(|l| l.contains("steady over the last") && l.contains("ETA: none")),
        "{text}"
    );
    assert!(!text.contains("\x1b[2J"), "no screen clearing into a pipe");
    env.cleanup().await;
}

#[tokio::test]
async fn verify_exits_0_clean_1_on_drift_2_refused_3_unreachable_saying_why_once() {
    let env = TestEnv::new(&["1s", "5s"]).await;
    assert!(env.lapse(&["topology", "apply"]).status.success());
    let clean = env.lapse(&["topology", "verify"]);
    assert_eq!(clean.status.code(), Some(0), "{}", stdout(&clean));

    // The management API on a closed port: one line saying so, not one per queue.
    let refused = format!("http://guest:guest@127.0.0.1:{CLOSED_PORT}");
    write_urls(&env, &amqp_url(), &refused, &env.database_url());
    let out = env.lapse(&["topology", "verify"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(3), "{text}");
    let about: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("management API"))
        .collect();
    assert_eq!(about.len(), 1, "{text}");
    assert!(
        about[0].contains(&format!("http://127.0.0.1:{CLOSED_PORT}/"))
            && about[0].contains("connection refused"),
        "{text}"
    );
    assert!(
        stderr(&out).contains("connection refused"),
        "{}",
        stderr(&out)
    );

    // Refused credentials: 401, the password never shown.
    let wrong = management_url().replace("guest:guest@", "guest:Wr0ngPassw0rd@");
    write_urls(&env, &amqp_url(), &wrong, &env.database_url());
    let out = env.lapse(&["topology", "verify", "--json"]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    let report: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let why = report["management_unreachable"].as_str().unwrap();
    assert!(why.contains("401"), "{why}");
    assert!(!format!("{}{}", stdout(&out), stderr(&out)).contains("Wr0ngPassw0rd"));

    // The broker itself unreachable.
    let closed_broker = format!("amqp://guest:guest@127.0.0.1:{CLOSED_PORT}/%2f");
    write_urls(&env, &closed_broker, &management_url(), &env.database_url());
    let out = env.lapse(&["topology", "verify"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        stderr(&out).contains("cannot reach the broker of broker.url")
            && stderr(&out).contains("refused"),
        "{}",
        stderr(&out)
    );

    // Drift: a missing queue.
    write_urls(&env, &amqp_url(), &management_url(), &env.database_url());
    crate::queues::delete(&env.conn, &env.names().parked()).await;
    let out = env.lapse(&["topology", "verify"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    env.cleanup().await;
}

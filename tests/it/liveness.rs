//! Liveness and what a stuck or frozen worker can hold: a loop that stops making
//! progress fails `GET /livez`; a frozen worker's deliveries go back to the healthy
//! one within a couple of AMQP heartbeats; failures that stop the process give a
//! non-zero exit status.

use std::process::Stdio;
use std::time::{Duration, Instant};

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapse::orders::Line;
use serde_json::Value;

use crate::endpoints::{free_port, get};
use crate::helpers::{
    TestEnv, assert_never_early, count, create_orders, eventually, signal, stderr, wait_released,
};

/// `lapse worker` with this env's config; stderr (the logs) is kept only when
/// `capture` (a long-running worker would fill an unread pipe and block on it).
fn worker(
    env: &TestEnv,
    args: &[&str],
    vars: &[(&str, &str)],
    capture: bool,
) -> tokio::process::Child {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_lapse"));
    for (key, _) in std::env::vars() {
        if key.starts_with("LAPSE_") {
            cmd.env_remove(key);
        }
    }
    cmd.args(["--config", env.config_path().to_str().unwrap(), "worker"])
        .args(args)
        .envs(vars.iter().copied())
        .stdout(Stdio::null())
        .stderr(if capture {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .kill_on_drop(true);
    cmd.spawn().unwrap()
}

/// Waits until the due and the stock-release queues each have `n` consumers.
async fn consumers_on_both_queues(
    env: &TestEnv,
    channel: &lapin::Channel,
    n: u32,
    limit: Duration,
) {
    for queue in [env.names().due_queue(), env.names().stock_release_queue()] {
        eventually(limit, "the workers consuming", || async {
            let q = channel
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .ok()?;
            (q.consumer_count() == n).then_some(())
        })
        .await;
    }
}

async fn stderr_of(child: tokio::process::Child) -> (Option<i32>, String) {
    let out = child.wait_with_output().await.unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A table lock nobody releases makes the relay's round hang: with a long statement
/// timeout that is a stall, and `/livez` names it; with a short one the hung call
/// ends with an error and the worker stays live.
#[tokio::test]
async fn a_hung_database_call_fails_livez_unless_the_statement_timeout_ends_it() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = env.db().await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let _stuck = worker(
        &env,
        &["--no-sweeper", "--metrics-listen", &listen],
        &[
            ("LAPSE_WORKER__STALL_LIMIT", "2s"),
            ("LAPSE_DATABASE__STATEMENT_TIMEOUT", "120s"),
        ],
        false,
    );
    eventually(Duration::from_secs(20), "a live worker", || async {
        (get(port, "/livez").await?.0 == 200).then_some(())
    })
    .await;

    db.batch_execute("BEGIN; LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let body = eventually(Duration::from_secs(20), "/livez failing", || async {
        let (status, body) = get(port, "/livez").await?;
        (status == 503).then_some(body)
    })
    .await;
    let livez: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(livez["status"], "stalled", "{livez}");
    assert_eq!(livez["stalled"][0]["component"], "relay", "{livez}");
    let (status, body) = get(port, "/health").await.unwrap();
    let health: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status, 503);
    assert_eq!(health["status"], "stalled", "{health}");
    assert_eq!(health["components"]["relay"]["stalled"], true, "{health}");
    assert_eq!(health["components"]["consumer"]["stalled"], false);
    // `lapse probe` (the image's HEALTHCHECK) says the same with its exit status.
    let probe = env.lapse(&["probe", "--address", &listen]);
    assert_eq!(probe.status.code(), Some(1), "{}", stderr(&probe));
    assert!(stderr(&probe).contains("stalled"), "{}", stderr(&probe));

    db.batch_execute("ROLLBACK").await.unwrap();
    eventually(Duration::from_secs(20), "live again", || async {
        (get(port, "/livez").await?.0 == 200).then_some(())
    })
    .await;
    let probe = env.lapse(&["probe", "--address", &listen]);
    assert_eq!(probe.status.code(), Some(0), "{}", stderr(&probe));
    drop(_stuck);

    // The same hang with a statement timeout shorter than the stall limit: the call
    // is cancelled, the relay retries, and the worker never stops being live.
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let _timely = worker(
        &env,
        &["--no-sweeper", "--metrics-listen", &listen],
        &[
            ("LAPSE_WORKER__STALL_LIMIT", "3s"),
            ("LAPSE_DATABASE__STATEMENT_TIMEOUT", "1s"),
        ],
        false,
    );
    eventually(Duration::from_secs(20), "a live worker", || async {
        (get(port, "/livez").await?.0 == 200).then_some(())
    })
    .await;
    db.batch_execute("BEGIN; LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let until = Instant::now() + Duration::from_secs(7);
    while Instant::now() < until {
        let (status, body) = get(port, "/livez").await.expect("answers");
        assert_eq!(status, 200, "{body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    db.batch_execute("ROLLBACK").await.unwrap();
    drop(_timely);
    env.cleanup().await;
}

/// Two workers; one is frozen (SIGSTOP: it keeps its connections and whatever the
/// broker pushed to it) just before a few hundred orders come due, so the broker
/// pushes its share to it while it is stopped, and it may be stopped inside a close
/// transaction. With the default `broker.heartbeat` (5 s) the broker takes its
/// deliveries back within about two and a half heartbeats, and a close transaction
/// it froze in ends after `SHORT_TRANSACTION_IDLE` (5 s), so the healthy worker closes
/// everything within the stated bound while the frozen one is still stopped (with the
/// earlier 10 s heartbeat and 30 s idle limit: 23-30 s). Only the healthy worker
/// relays, so a relay frozen mid-round is not what this test is about.
#[tokio::test]
async fn a_frozen_worker_gives_its_deliveries_back_and_the_healthy_one_closes_them() {
    const ORDERS: usize = 300;
    let env = TestEnv::with_database(&["1s", "5s"]).await;
    let mut db = env.db().await;
    // Small packs and no gathering: the orders, all due at once, travel as many
    // deliveries, so both workers get a share (one gathered pack could go to either).
    let small = [
        ("LAPSE_PACKS__MAX_ENTRIES", "10"),
        ("LAPSE_RELAY__GATHER", "0s"),
    ];
    let frozen = worker(&env, &["--no-sweeper", "--no-relay"], &small, false);
    let healthy = worker(&env, &["--no-sweeper"], &small, false);
    let channel = env.conn.create_channel().await.unwrap();
    // Generous: two processes start beside other tests' private nodes.
    consumers_on_both_queues(&env, &channel, 2, Duration::from_secs(90)).await;

    let lines = [Line {
        sku: "frozen-widget".into(),
        qty: 1,
    }];
    create_orders(&mut db, &[Duration::from_secs(7); ORDERS], &lines).await;
    let deadline = Instant::now() + Duration::from_secs(7);
    tokio::time::sleep(Duration::from_millis(6_700)).await;
    signal(&frozen, "STOP");
    let stopped = Instant::now();

    // The scenario happened: the frozen worker holds part of the work. Looked at 1 s
    // after the deadline, before the broker can notice the freeze (no sooner than
    // `broker.heartbeat`, 5 s, after it).
    tokio::time::sleep(
        (deadline + Duration::from_secs(1)).saturating_duration_since(Instant::now()),
    )
    .await;
    let held = count(&db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await;
    assert!(
        held > 0,
        "the frozen worker was given a share of the deliveries"
    );

    // docs/reliability.md: about 2.5 heartbeats; generous for a loaded machine.
    let bound = Duration::from_secs(20);
    eventually(
        (stopped + bound).saturating_duration_since(Instant::now()),
        "every order closed while one worker is frozen",
        || async {
            (count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await
                == ORDERS as i64)
                .then_some(())
        },
    )
    .await;
    let frozen_for = stopped.elapsed();
    assert!(frozen_for < bound, "closed within {bound:?} of the freeze");

    // Keep it frozen past the bound, then let it go: nothing happens twice.
    tokio::time::sleep((stopped + bound).saturating_duration_since(Instant::now())).await;
    signal(&frozen, "CONT");
    wait_released(&db, ORDERS as i64).await;
    // Woken up mid-batch, it finds its connections gone (a confirm it waited for can
    // take `broker.confirm_timeout`): stopped once it consumes again, its shutdown is a
    // drained one.
    consumers_on_both_queues(&env, &channel, 2, Duration::from_secs(60)).await;
    assert_never_early(&db).await;
    let twice = count(
        &db,
        "SELECT count(*) FROM (SELECT order_id FROM order_events WHERE event = 'closed'
          GROUP BY order_id HAVING count(*) > 1) d",
    )
    .await;
    assert_eq!(twice, 0, "an order closed twice");
    assert_eq!(
        count(&db, "SELECT sum(reserved)::bigint FROM stock").await,
        0
    );
    for child in [frozen, healthy] {
        signal(&child, "TERM");
        let (code, err) = tokio::time::timeout(Duration::from_secs(30), stderr_of(child))
            .await
            .expect("exits after SIGTERM");
        assert_eq!(code, Some(0), "a drained shutdown exits 0: {err}");
    }
    eprintln!("{held} orders held by the frozen worker; all closed {frozen_for:?} after it froze");
    env.cleanup().await;
}

#[tokio::test]
async fn a_metrics_address_that_cannot_be_bound_is_a_startup_error() {
    let env = TestEnv::with_database(&["1s"]).await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let child = worker(&env, &["--metrics-listen", &addr], &[], true);
    let (code, err) = tokio::time::timeout(Duration::from_secs(30), stderr_of(child))
        .await
        .expect("the worker exits instead of running without its endpoint");
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&addr), "names the address: {err}");
    assert!(err.contains("--metrics-listen"), "names the option: {err}");
    env.cleanup().await;
}

#[tokio::test]
async fn refused_broker_credentials_stop_the_worker_with_a_non_zero_status() {
    let env = TestEnv::with_database(&["1s"]).await;
    let secret = "not-the-password-hunter2";
    let url = format!("amqp://guest:{secret}@127.0.0.1:5672/%2f");
    let child = worker(&env, &[], &[("LAPSE_BROKER__URL", &url)], true);
    let (code, err) = tokio::time::timeout(Duration::from_secs(60), stderr_of(child))
        .await
        .expect("a worker that can never log in stops");
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("ACCESS_REFUSED"), "says why: {err}");
    assert!(!err.contains(secret), "no credentials in the output: {err}");
    env.cleanup().await;
}

//! Failures mid-run: the database away for a few seconds, the worker stopped by
//! SIGTERM while busy.

use std::process::Stdio;
use std::time::{Duration, Instant};

use lapse::config::Secret;
use lapse::observe::stats::Outcome;
use lapse::orders::{self, Deadline, Line};

use crate::helpers::{TestEnv, assert_never_early, count, eventually, wait_released};
use crate::private_pg::PrivatePostgres;

async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) =
        tokio_postgres::connect(&crate::helpers::on_lapse_path(url), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    client
}

#[tokio::test]
async fn a_database_outage_loses_nothing_and_work_resumes_on_its_own() {
    let env = TestEnv::new(&["250ms", "1s"]).await;
    let pg = PrivatePostgres::start(crate::helpers::free_port());
    let url = pg.url("lapse");
    lapse::db::migrate(&Secret::new(url.clone())).await.unwrap();
    lapse::amqp::topology::apply(&env.conn, &env.topology())
        .await
        .unwrap();
    let mut config = env.config();
    config.database.url = Secret::new(url.clone());
    config.worker.max_attempts = 20;

    let mut db = connect(&url).await;
    let lines = [Line {
        sku: "x".into(),
        qty: 1,
    }];
    orders::ensure_stock(&db, &["x".to_string()], 10_000)
        .await
        .unwrap();
    let tx = db.transaction().await.unwrap();
    for i in 0..300u64 {
        orders::create(
            &tx,
            Deadline::In(Duration::from_millis(1_500 + i * 13)),
            &lines,
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let worker = env.start(&config).await;
    tokio::time::sleep(Duration::from_millis(1_200)).await; // intents relayed, waiting in the tiers
    pg.stop_server();
    tokio::time::sleep(Duration::from_secs(4)).await; // every deadline passes while it is away
    pg.start_server();

    let db = connect(&url).await;
    eventually(
        Duration::from_secs(60),
        "every order closed after the outage",
        || async {
            (count(&db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await == 0)
                .then_some(())
        },
    )
    .await;
    assert_eq!(
        count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await,
        300
    );
    assert_never_early(&db).await;
    assert!(
        worker.stats.get(Outcome::Retried) > 0,
        "the outage was seen and retried"
    );
    assert_eq!(worker.stats.get(Outcome::GaveUp), 0);
    wait_released(&db, 300).await;
    worker.stop().await;
    drop(db);
    env.cleanup().await;
}

#[tokio::test]
async fn sigterm_while_busy_exits_0_and_the_next_worker_finishes_without_double_effects() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let mut db = env.db().await;
    let lines = [
        Line {
            sku: "a".into(),
            qty: 1,
        },
        Line {
            sku: "b".into(),
            qty: 2,
        },
    ];
    orders::ensure_stock(&db, &["a".to_string(), "b".to_string()], 1_000_000)
        .await
        .unwrap();
    let tx = db.transaction().await.unwrap();
    for _ in 0..3_000 {
        orders::create(&tx, Deadline::In(Duration::from_millis(1_000)), &lines)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_lapse"))
        .args([
            "--config",
            env.config_path().to_str().unwrap(),
            "worker",
            "--no-sweeper",
        ])
        .env("LAPSE_WORKER__DRAIN_TIMEOUT", "5s")
        .env("LAPSE_WORKER__BATCH_SIZE", "20")
        .env("LAPSE_WORKER__CLOSES_PER_SECOND", "1000")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    eventually(Duration::from_secs(30), "closes under way", || async {
        (count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await > 100)
            .then_some(())
    })
    .await;
    let pid = child.id().unwrap() as i32;
    let sent = Instant::now();
    assert_eq!(send_sigterm(pid), 0);
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .expect("exits")
        .unwrap();
    assert_eq!(status.code(), Some(0), "exit status after SIGTERM");
    assert!(
        sent.elapsed() < Duration::from_secs(5 + 3),
        "within the drain limit: {:?}",
        sent.elapsed()
    );
    let closed_by_first = count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
    assert!(
        closed_by_first < 3_000,
        "SIGTERM arrived while work remained"
    );

    let worker = env.start(&env.config()).await;
    eventually(
        Duration::from_secs(60),
        "the next worker finishes",
        || async {
            (count(&db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await == 0)
                .then_some(())
        },
    )
    .await;
    wait_released(&db, 6_000).await;
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
    worker.stop().await;
    env.cleanup().await;
}

fn send_sigterm(pid: i32) -> i32 {
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .map(|s| s.code().unwrap_or(1))
        .unwrap_or(1)
}

#[tokio::test]
async fn lost_broker_connections_are_re_established_and_nothing_is_lost() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let worker = env.start(&env.config()).await;
    let mut db = env.db().await;
    let lines = [Line {
        sku: "c".into(),
        qty: 1,
    }];
    orders::ensure_stock(&db, &["c".to_string()], 10_000)
        .await
        .unwrap();
    let tx = db.transaction().await.unwrap();
    for i in 0..200u64 {
        orders::create(
            &tx,
            Deadline::In(Duration::from_millis(1_000 + i * 15)),
            &lines,
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();

    let ours = |name: Option<&str>| {
        name.is_some_and(|n| n.starts_with("lapse ") && n.ends_with(&env.prefix))
    };
    let names = eventually(
        Duration::from_secs(20),
        "the worker's connections listed",
        || async {
            let conns = env.management.connections().await.unwrap();
            let mine: Vec<String> = conns
                .iter()
                .filter(|c| ours(c.client_name()))
                .map(|c| c.name.clone())
                .collect();
            (mine.len() >= 3).then_some(mine)
        },
    )
    .await;
    for name in &names {
        env.management.close_connection(name).await.unwrap();
    }
    eventually(
        Duration::from_secs(30),
        "connections re-established",
        || async {
            let conns = env.management.connections().await.unwrap();
            let again = conns
                .iter()
                .filter(|c| ours(c.client_name()) && !names.contains(&c.name))
                .count();
            (again >= 3).then_some(())
        },
    )
    .await;
    eventually(
        Duration::from_secs(60),
        "every order closed and released",
        || async {
            let open = count(&db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await;
            let released = count(
                &db,
                "SELECT count(*) FROM stock_ledger WHERE kind = 'release'",
            )
            .await;
            (open == 0 && released == 200).then_some(())
        },
    )
    .await;
    assert_never_early(&db).await;
    worker.stop().await;
    env.cleanup().await;
}

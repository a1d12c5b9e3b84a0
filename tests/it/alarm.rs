//! A broker resource alarm on a private RabbitMQ node: publishing is blocked, while
//! acknowledgements (on the consumers' separate consuming connections) still flow;
//! confirm waits end in a timeout instead of hanging; after the alarm everything
//! finishes — all closed, never early, released exactly once.

use std::time::Duration;

use lapin::BasicProperties;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapse::amqp::broker::{BrokerError, Publisher};
use lapse::config::Secret;
use lapse::observe::stats::Stats;
use lapse::orders::Line;
use lapse::service::Service;
use tokio_util::sync::CancellationToken;

use crate::helpers::{TestEnv, assert_never_early, count, create_orders, eventually};
use crate::private_rabbit::PrivateRabbit;

fn one_line() -> Vec<Line> {
    vec![Line {
        sku: "alarm".into(),
        qty: 1,
    }]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_memory_alarm_blocks_publishes_but_due_orders_are_still_closed_and_acknowledged() {
    // A 10 s tier: the alarm (two `rabbitmqctl` calls, seconds each on a loaded
    // machine) must be up before the orders below come due.
    let env = TestEnv::with_database(&["1s", "10s"]).await;
    let rabbit = tokio::task::block_in_place(PrivateRabbit::start);
    let url = Secret::new(rabbit.amqp_url());
    let conn = lapse::amqp::broker::connect(&url, "lapse test")
        .await
        .unwrap();
    assert!(
        lapse::amqp::topology::apply(&conn, &env.topology())
            .await
            .unwrap()
            .ok()
    );
    let mut config = env.config();
    config.broker.url = url;
    config.broker.management_url = None;
    config.broker.confirm_timeout = Duration::from_secs(2);
    // The releases' events are the proof that publishing was blocked.
    config.worker.stock_release = lapse::close::StockRelease::Event;
    let token = CancellationToken::new();
    let service = Service::start(&config, Stats::default(), token.clone())
        .await
        .unwrap();
    let health = service.health();
    let worker = tokio::spawn(service.wait());

    let mut db = env.db().await;
    let outbox_empty = || async {
        (count(&env.db().await, "SELECT count(*) FROM outbox").await == 0).then_some(())
    };
    // Orders that need re-delays (publishes) while the alarm lasts: due in 21 s, they
    // hop 10s, 10s, 1s — their first arrival falls inside the alarm.
    create_orders(&mut db, &[Duration::from_secs(21); 10], &one_line()).await;
    eventually(
        Duration::from_secs(20),
        "long intents relayed",
        outbox_empty,
    )
    .await;
    // Orders that take one 10 s hop and arrive due during the alarm: no publish needed.
    let due: Vec<Duration> = (0..40u64)
        .map(|i| Duration::from_millis(10_000 + i))
        .collect();
    create_orders(&mut db, &due, &one_line()).await;
    eventually(
        Duration::from_secs(20),
        "short intents relayed",
        outbox_empty,
    )
    .await;

    tokio::task::block_in_place(|| rabbit.raise_memory_alarm());
    assert_eq!(
        count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await,
        0,
        "the alarm came up after the orders were due: this machine is too slow for the test"
    );
    let due_queue = env.names().due_queue();
    // Generous: the alarm lasts until this test clears it, and a loaded machine (a
    // backlog test beside this one) can take long to close 40 orders.
    eventually(
        Duration::from_secs(120),
        "the due orders closed and acknowledged during the alarm",
        || async {
            let closed = count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
            let queue = tokio::task::block_in_place(|| rabbit.queue_counts(&due_queue));
            let (ready, unacked) = queue
                .iter()
                .find(|(name, ..)| *name == due_queue)
                .map(|(_, r, u)| (*r, *u))
                .unwrap_or((u64::MAX, u64::MAX));
            // Only the 10 long orders may still be held (unacknowledged) by the worker.
            (closed == 40 && ready == 0 && unacked <= 10).then_some(())
        },
    )
    .await;
    // Publishing really was blocked: the releases of those closes are still in the
    // outbox, and the broker told lapse so.
    assert!(tokio::task::block_in_place(|| rabbit.alarms()).contains("memory"));
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM stock_ledger WHERE kind = 'release'"
        )
        .await,
        0
    );
    assert!(count(&db, "SELECT count(*) FROM outbox").await > 0);
    eventually(
        Duration::from_secs(30),
        "the block shown on health",
        || async {
            health
                .snapshot()
                .values()
                .any(|c| c.broker_blocked.is_some())
                .then_some(())
        },
    )
    .await;

    tokio::task::block_in_place(|| rabbit.clear_memory_alarm());
    eventually(
        Duration::from_secs(60),
        "every order closed and released once",
        || async {
            let open = count(&db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await;
            let released = count(
                &db,
                "SELECT count(*) FROM stock_ledger WHERE kind = 'release'",
            )
            .await;
            assert!(released <= 50, "{released} releases for 50 orders");
            (open == 0 && released == 50).then_some(())
        },
    )
    .await;
    assert_never_early(&db).await;
    let reserved: i64 = db
        .query_one("SELECT reserved FROM stock WHERE sku = 'alarm'", &[])
        .await
        .unwrap()
        .get("reserved");
    assert_eq!(reserved, 0, "every reservation released exactly once");
    eventually(
        Duration::from_secs(30),
        "the block cleared on health",
        || async {
            health
                .snapshot()
                .values()
                .all(|c| c.broker_blocked.is_none())
                .then_some(())
        },
    )
    .await;

    token.cancel();
    worker.await.unwrap();
    drop(conn);
    tokio::task::block_in_place(|| drop(rabbit));
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirm_that_never_comes_ends_in_a_timeout_not_a_hang() {
    crate::helpers::init_logs();
    let rabbit = tokio::task::block_in_place(PrivateRabbit::start);
    let conn = lapse::amqp::broker::connect(&Secret::new(rabbit.amqp_url()), "lapse test")
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_declare(
            "confirm-timeout".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let publisher = Publisher::new(&conn)
        .await
        .unwrap()
        .with_confirm_timeout(Duration::from_secs(2));
    publisher
        .publish("", "confirm-timeout", b"before", BasicProperties::default())
        .await
        .unwrap();

    tokio::task::block_in_place(|| rabbit.raise_memory_alarm());
    // An outer limit so that a hang fails the test instead of blocking it forever.
    let outcome = tokio::time::timeout(
        Duration::from_secs(30),
        publisher.publish("", "confirm-timeout", b"during", BasicProperties::default()),
    )
    .await
    .expect("the publish must give up by itself, not hang");
    assert!(
        matches!(outcome, Err(BrokerError::ConfirmTimeout { .. })),
        "{outcome:?}"
    );
    let batch = vec![
        lapse::amqp::broker::Outgoing::new(
            "",
            "confirm-timeout",
            b"x".to_vec(),
            BasicProperties::default()
        );
        3
    ];
    let outcomes = tokio::time::timeout(Duration::from_secs(30), publisher.publish_all(batch))
        .await
        .expect("publish_all must give up by itself, not hang");
    assert!(
        outcomes
            .iter()
            .all(|r| matches!(r, Err(BrokerError::ConfirmTimeout { .. }))),
        "{outcomes:?}"
    );
    tokio::task::block_in_place(|| rabbit.clear_memory_alarm());
    drop(conn);
    tokio::task::block_in_place(|| drop(rabbit));
}

//! The broker's consumer timeout against long holds: on a private node whose consumer
//! timeout is 4 s, an order row locked by the application for more than three times
//! that long, first across its deadline and then across its stock release. lapse keeps
//! no delivery unacknowledged past half the timeout (it renews it), so the broker never
//! closes a channel under it and no delivery budget is spent: nothing is parked even
//! with a delivery limit of 2, the order closes once when the lock goes, and its stock
//! comes back once.

use std::time::Duration;

use lapse::config::{Config, Secret};
use lapse::observe::stats::Outcome;
use lapse::orders::Line;

use crate::helpers::{Running, TestEnv, count, create_orders, eventually, wait_released};
use crate::private_rabbit::PrivateRabbit;

/// How long the application holds the row each time: three consumer timeouts.
const LOCKED_FOR: Duration = Duration::from_secs(13);

fn one_line() -> Vec<Line> {
    vec![Line {
        sku: "slow-payment".into(),
        qty: 1,
    }]
}

fn restarts(worker: &Running, component: &str) -> u32 {
    worker
        .health
        .snapshot()
        .get(component)
        .map_or(0, |c| c.restarts)
}

/// Locks order `id` in a transaction on `holder`, as an application inside a slow
/// payment would; a `ROLLBACK` on `holder` ends it.
async fn lock_row(holder: &tokio_postgres::Client, id: i64) {
    holder.batch_execute("BEGIN").await.unwrap();
    holder
        .query_one("SELECT id FROM orders WHERE id = $1 FOR UPDATE", &[&id])
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_row_locked_past_the_brokers_consumer_timeout_costs_no_channel_and_no_delivery() {
    let env = TestEnv::with_database(&["1s"]).await;
    env.write_tiers(&["1s"], "delivery_limit = 2");
    let rabbit = tokio::task::block_in_place(PrivateRabbit::start);
    let set = rabbit.ctl(&[
        "eval",
        "application:set_env(rabbit, consumer_timeout, 4000), \
         application:set_env(rabbit, channel_tick_interval, 500).",
    ]);
    assert!(set.status.success(), "{set:?}");
    let url = Secret::new(rabbit.amqp_url());
    let conn = lapse::amqp::broker::connect(&url, "lapse test")
        .await
        .unwrap();
    let report = lapse::amqp::topology::apply(&conn, &env.topology())
        .await
        .unwrap();
    assert!(report.ok(), "{report:?}");
    let mut config: Config = env.config();
    config.broker.url = url;
    config.broker.management_url = None;
    config.broker.consumer_timeout = Duration::from_secs(4);
    config.worker.lock_retry = Duration::from_millis(200);
    config.validate().unwrap();
    let mut db = env.db().await;
    let holder = env.db().await;

    // The close: the row is locked across the deadline, for three consumer timeouts.
    let mut closing = config.clone();
    closing.worker.releaser = false;
    closing.worker.stock_release = lapse::close::StockRelease::Event;
    let id = create_orders(&mut db, &[Duration::from_millis(1_500)], &one_line()).await[0].0;
    lock_row(&holder, id).await;
    let worker = Running::start(&closing).await;
    eventually(Duration::from_secs(30), "the locked order met", || async {
        (worker.stats.get(Outcome::Locked) >= 1).then_some(())
    })
    .await;
    tokio::time::sleep(LOCKED_FOR).await;
    assert_eq!(
        count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await,
        0,
        "closed through the application's lock"
    );
    holder.batch_execute("ROLLBACK").await.unwrap();
    eventually(Duration::from_secs(30), "the order closed", || async {
        let closed = count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
        (closed == 1).then_some(())
    })
    .await;
    assert_eq!(
        restarts(&worker, "consumer"),
        0,
        "the broker closed the consumer's channel"
    );
    // About one renewal per hold limit (2 s) of the lock: some, never a storm.
    let renewed = worker.stats.get(Outcome::Renewed);
    assert!(
        (2..=20).contains(&renewed),
        "{renewed} renewals over a {LOCKED_FOR:?} lock"
    );
    assert_eq!(worker.stats.get(Outcome::Parked), 0);
    worker.stop().await;

    // The release: the closed order's row is locked while its release waits.
    lock_row(&holder, id).await;
    let worker = Running::start(&config).await;
    eventually(
        Duration::from_secs(30),
        "the locked release met",
        || async { (worker.stats.get(Outcome::Locked) >= 1).then_some(()) },
    )
    .await;
    tokio::time::sleep(LOCKED_FOR).await;
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM stock_ledger WHERE kind = 'release'"
        )
        .await,
        0,
        "released through the application's lock"
    );
    holder.batch_execute("ROLLBACK").await.unwrap();
    wait_released(&db, 1).await;
    assert_eq!(
        restarts(&worker, "releaser"),
        0,
        "the broker closed the releaser's channel"
    );
    let renewed = worker.stats.get(Outcome::Renewed);
    assert!(
        (2..=20).contains(&renewed),
        "{renewed} renewals of the release over a {LOCKED_FOR:?} lock"
    );
    assert_eq!(worker.stats.get(Outcome::Parked), 0);
    worker.stop().await;

    let closes = count(
        &db,
        "SELECT count(*) FROM order_events WHERE event = 'closed'",
    )
    .await;
    assert_eq!(closes, 1, "closed exactly once");
    let names = env.names();
    let parked = tokio::task::block_in_place(|| rabbit.queue_counts(&names.parked()));
    assert!(
        parked
            .iter()
            .all(|(_, ready, unacked)| ready + unacked == 0),
        "nothing dead-lettered to parked: {parked:?}"
    );
    drop(conn);
    tokio::task::block_in_place(|| drop(rabbit));
    env.cleanup().await;
}

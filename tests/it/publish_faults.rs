//! Publishes the broker does not take: a queue deleted while the pipeline runs (the
//! broker returns `mandatory` publishes it cannot route), a full tier refusing
//! (`reject-publish`) and a deleted wait tier (whose publishes the delay exchange
//! would route to parked, so lapse checks the tier before publishing). Nothing is lost, and a refused destination waits alone.

use std::time::Duration;

use lapse::observe::stats::Outcome;
use lapse::orders::{Line, OrderId};

use crate::helpers::{
    TestEnv, assert_never_early, count, create_orders, eventually, wait_released,
};
use crate::queues;

fn line() -> Vec<Line> {
    vec![Line {
        sku: "gadget".into(),
        qty: 1,
    }]
}

async fn reapply(env: &TestEnv) {
    let report = lapse::amqp::topology::apply(&env.conn, &env.topology())
        .await
        .unwrap();
    assert!(report.ok(), "{report:?}");
}

#[tokio::test]
async fn releases_published_while_their_queue_is_deleted_wait_in_the_outbox_until_it_returns() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let mut config = env.config();
    config.worker.stock_release = lapse::close::StockRelease::Event;
    let worker = env.start(&config).await;
    let mut db = env.db().await;
    create_orders(&mut db, &[Duration::from_millis(300); 10], &line()).await;
    wait_released(&db, 10).await;
    // Nothing in flight: an operator deletes the queue (to change its arguments).
    queues::delete(&env.conn, &env.names().stock_release_queue()).await;

    create_orders(&mut db, &[Duration::from_millis(300); 50], &line()).await;
    eventually(
        Duration::from_secs(60),
        "orders closed, their releases held back in the outbox",
        || async {
            let closed = count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
            let held = count(
                &db,
                "SELECT count(*) FROM outbox
                  WHERE kind = 'stock.release' AND attempts > 0 AND last_error LIKE 'unroutable:%'",
            )
            .await;
            (closed == 60 && held == 50).then_some(())
        },
    )
    .await;
    assert!(worker.stats.get(Outcome::Unroutable) >= 50);

    reapply(&env).await;
    wait_released(&db, 60).await;
    assert_eq!(
        count(&db, "SELECT sum(reserved)::bigint FROM stock").await,
        0
    );
    assert_eq!(count(&db, "SELECT count(*) FROM outbox").await, 0);
    assert_eq!(
        queues::depth(&env.conn, &env.names().parked()).await,
        Some(0)
    );
    worker.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn timeouts_published_while_the_due_queue_is_deleted_wait_in_the_outbox_until_it_returns() {
    // Deadlines shorter than the only tier: the relay publishes them to the due queue.
    let env = TestEnv::with_database(&["30s"]).await;
    let worker = env.start(&env.config()).await;
    let mut db = env.db().await;
    create_orders(&mut db, &[Duration::from_millis(300); 5], &line()).await;
    wait_released(&db, 5).await;
    queues::delete(&env.conn, &env.names().due_queue()).await;

    let deadlines: Vec<Duration> = (0..50u64)
        .map(|i| Duration::from_millis(300 + i * 20))
        .collect();
    create_orders(&mut db, &deadlines, &line()).await;
    eventually(
        Duration::from_secs(60),
        "timeout intents held back in the outbox",
        || async {
            let held = count(
                &db,
                "SELECT count(*) FROM outbox
                  WHERE kind = 'timeout' AND attempts > 0 AND last_error LIKE 'unroutable:%'",
            )
            .await;
            (held == 50).then_some(())
        },
    )
    .await;
    assert!(worker.stats.get(Outcome::Unroutable) >= 50);
    assert_eq!(
        count(&db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await,
        50
    );

    reapply(&env).await;
    eventually(Duration::from_secs(60), "every order closed", || async {
        (count(&db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await == 0).then_some(())
    })
    .await;
    assert_never_early(&db).await;
    wait_released(&db, 55).await;
    assert_eq!(
        queues::depth(&env.conn, &env.names().parked()).await,
        Some(0)
    );
    worker.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_full_tier_refuses_alone_while_other_intents_and_releases_flow() {
    let env = TestEnv::with_database(&["2s", "1m"]).await;
    // Every wait queue holds 5 messages; the broker refuses the rest (reject-publish).
    env.write_tiers(&["2s", "1m"], "max_length = 5");
    for tier in ["2s", "1m"] {
        queues::delete(&env.conn, &format!("{}.wait.{tier}", env.prefix)).await;
    }
    reapply(&env).await;
    let mut config = env.config();
    config.relay.batch_size = 10;
    // A queue's length limit counts messages, and a pack is one: one deadline per
    // message, so that the tier fills up with deadlines.
    config.packs.max_entries = 1;
    let mut db = env.db().await;
    // 40 deadlines for the 1m tier: 5 fit, 35 are refused for at least a minute.
    create_orders(&mut db, &[Duration::from_secs(600); 40], &line()).await;
    let worker = env.start(&config).await;
    eventually(
        Duration::from_secs(30),
        "the full tier refusing",
        || async { (worker.stats.get(Outcome::PublishRefused) >= 35).then_some(()) },
    )
    .await;

    // Deadlines shorter than the smallest tier go to the due queue, and their stock
    // releases to the events exchange: neither may wait behind the full tier.
    create_orders(&mut db, &[Duration::from_millis(500); 30], &line()).await;
    eventually(
        Duration::from_secs(30),
        "the other intents closed and released",
        || async {
            let closed = count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
            let released = count(
                &db,
                "SELECT count(*) FROM stock_ledger WHERE kind = 'release'",
            )
            .await;
            (closed == 30 && released == 30).then_some(())
        },
    )
    .await;
    let still_refused = count(
        &db,
        "SELECT count(*) FROM outbox WHERE kind = 'timeout' AND attempts > 0",
    )
    .await;
    assert!(
        still_refused >= 30,
        "the full tier was still refusing meanwhile ({still_refused} rows waiting)"
    );
    assert_never_early(&db).await;
    worker.stop().await;
    env.cleanup().await;
}

/// How many of `ids` satisfy `condition` (a predicate on `orders o`).
async fn orders_where(db: &tokio_postgres::Client, ids: &[OrderId], condition: &str) -> i64 {
    let ids: Vec<i64> = ids.iter().map(|i| i.0).collect();
    let sql = format!("SELECT count(*) AS n FROM orders o WHERE o.id = ANY($1) AND {condition}");
    db.query_one(&sql, &[&ids]).await.unwrap().get("n")
}

#[tokio::test]
async fn timeouts_for_a_deleted_wait_tier_are_not_published_to_parked_and_close_once() {
    // `<P>.delay` routes a publish for a tier without a queue to parked and confirms it:
    // without the tier check such a timeout would count as delivered.
    let env = TestEnv::with_database(&["1s", "5s", "15s"]).await;
    let worker = env.start(&env.config()).await;
    let mut db = env.db().await;
    let names = env.names();
    let five = lapse::tier::Tier::parse("5s").unwrap();
    // Nothing in flight: an operator deletes the 5s tier (to change its arguments).
    queues::delete(&env.conn, &names.wait_queue(five)).await;

    // A: first hop 15s (relay), then the worker re-delays with ~11 s left: 5s.
    // B: the relay's first hop would be 5s, for ~9 s. C: 1s, which still exists.
    let a = create_orders(&mut db, &[Duration::from_secs(26); 10], &line()).await;
    let b = create_orders(&mut db, &[Duration::from_secs(14); 10], &line()).await;
    let c = create_orders(&mut db, &[Duration::from_secs(2); 10], &line()).await;
    eventually(
        Duration::from_secs(30),
        "B's intents held in the outbox while C closes",
        || async {
            let held = count(
                &db,
                "SELECT count(*) FROM outbox
                  WHERE kind = 'timeout' AND attempts > 0 AND last_error LIKE 'unroutable:%5s%'",
            )
            .await;
            let c_closed = orders_where(&db, &c, "o.status = 'CLOSED'").await;
            (held == 10 && c_closed == 10).then_some(())
        },
    )
    .await;
    assert_eq!(queues::depth(&env.conn, &names.parked()).await, Some(0));

    // With the tier still missing, every timeout goes through a smaller tier once its
    // remaining time drops below 5 s (the worker kept A's deliveries meanwhile).
    let abc: Vec<OrderId> = [a, b, c].concat();
    eventually(Duration::from_secs(60), "A, B and C closed", || async {
        (orders_where(&db, &abc, "o.status = 'CLOSED'").await == 30).then_some(())
    })
    .await;
    assert!(worker.stats.get(Outcome::Unroutable) >= 10);
    assert_eq!(queues::depth(&env.conn, &names.parked()).await, Some(0));

    // Re-created, the tier takes timeouts again.
    reapply(&env).await;
    let d = create_orders(&mut db, &[Duration::from_secs(8); 10], &line()).await;
    eventually(Duration::from_secs(60), "D closed", || async {
        (orders_where(&db, &d, "o.status = 'CLOSED'").await == 10).then_some(())
    })
    .await;
    let through_five = orders_where(
        &db,
        &d,
        "EXISTS (SELECT 1 FROM order_events e WHERE e.order_id = o.id
                    AND e.event = 'hop' AND e.detail->>'tier' = '5s')",
    )
    .await;
    assert_eq!(
        through_five, 10,
        "D's timeouts went through the re-created tier"
    );

    assert_never_early(&db).await;
    wait_released(&db, 40).await;
    assert_eq!(
        count(&db, "SELECT sum(reserved)::bigint FROM stock").await,
        0
    );
    assert_eq!(count(&db, "SELECT count(*) FROM outbox").await, 0);
    assert_eq!(queues::depth(&env.conn, &names.parked()).await, Some(0));
    worker.stop().await;
    env.cleanup().await;
}

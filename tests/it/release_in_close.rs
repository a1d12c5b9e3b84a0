//! The example shop's stock release in the close's own transaction
//! (`worker.stock_release = "in_close"`, docs/pipeline.md "The stock release"): no
//! release event unless a stock row is locked, exactly one release per (order, sku),
//! and a SKU another transaction holds never stalls a close.

use std::time::Duration;

use lapse::close::StockRelease;
use lapse::orders::Line;

use crate::helpers::{
    TestEnv, assert_never_early, count, create_orders, eventually, unstamped_closes, wait_closed,
    wait_released,
};

fn lines(skus: &[&str]) -> Vec<Line> {
    skus.iter()
        .map(|sku| Line {
            sku: (*sku).to_string(),
            qty: 2,
        })
        .collect()
}

/// Ready messages on the stock-release queue (the events the relay published).
async fn release_events(env: &TestEnv) -> u32 {
    crate::queues::depth(&env.conn, &env.names().stock_release_queue())
        .await
        .expect("the stock-release queue")
}

#[tokio::test]
async fn closes_release_their_stock_in_the_same_transaction_without_an_event() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    let mut config = env.config();
    config.worker.stock_release = StockRelease::InClose;
    config.worker.releaser = false; // an event would stay on its queue, counted below
    let deadlines = vec![Duration::from_millis(1500); 30];
    create_orders(&mut db, &deadlines, &lines(&["a", "b"])).await;
    let worker = env.start(&config).await;
    wait_released(&db, 60).await;
    let worker_stats = worker.stats.clone();
    worker.stop().await;

    assert_eq!(
        count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await,
        30
    );
    assert_eq!(unstamped_closes(&db).await, 0);
    // Every unit back: 30 orders of 2 of each SKU were reserved, and released.
    for sku in ["a", "b"] {
        let reserved = count(
            &db,
            &format!("SELECT reserved::bigint FROM stock WHERE sku = '{sku}'"),
        )
        .await;
        assert_eq!(reserved, 0, "{sku}: {reserved} still reserved");
    }
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE kind = 'stock.release'"
        )
        .await,
        0
    );
    assert_eq!(
        release_events(&env).await,
        0,
        "no release went through the broker"
    );
    assert_eq!(
        worker_stats.get(lapse::observe::stats::Outcome::Released),
        60,
        "releases in the close are counted"
    );
    assert_never_early(&db).await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_locked_stock_row_defers_only_its_orders_release_to_the_event_path() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    let mut config = env.config();
    config.worker.stock_release = StockRelease::InClose;
    let held = create_orders(&mut db, &[Duration::from_millis(1200); 5], &lines(&["hot"])).await;
    let free = create_orders(
        &mut db,
        &[Duration::from_millis(1200); 5],
        &lines(&["cold"]),
    )
    .await;
    // An application holds the hot SKU's stock row (a checkout inside a slow call).
    let mut app = env.db().await;
    let app_tx = app.transaction().await.unwrap();
    app_tx
        .execute("SELECT 1 FROM stock WHERE sku = 'hot' FOR UPDATE", &[])
        .await
        .unwrap();
    let worker = env.start(&config).await;
    // Every order closes on time although one SKU is locked; the cold ones release.
    wait_closed(&db, 10, Duration::from_secs(30)).await;
    let late = count(
        &db,
        // Less than database.lock_timeout: a close that waited for the lock would show.
        "SELECT count(*) FROM orders WHERE closed_at > expire_at + interval '3 seconds'",
    )
    .await;
    assert_eq!(late, 0, "a locked stock row held closes up");
    let cold_released = count(
        &db,
        "SELECT count(*) FROM stock_ledger WHERE kind = 'release' AND sku = 'cold'",
    )
    .await;
    assert_eq!(cold_released, free.len() as i64);
    let hot_released = count(
        &db,
        "SELECT count(*) FROM stock_ledger WHERE kind = 'release' AND sku = 'hot'",
    )
    .await;
    assert_eq!(hot_released, 0, "released under the application's lock");
    assert_eq!(
        worker
            .stats
            .get(lapse::observe::stats::Outcome::ReleaseDeferred),
        held.len() as u64,
        "the deferred releases are counted"
    );
    // The application lets go: the deferred releases arrive through the releaser.
    app_tx.rollback().await.unwrap();
    wait_released(&db, (held.len() + free.len()) as i64).await;
    worker.stop().await;
    eventually(Duration::from_secs(10), "every close stamped", || async {
        (unstamped_closes(&db).await == 0).then_some(())
    })
    .await;
    for sku in ["hot", "cold"] {
        let reserved = count(
            &db,
            &format!("SELECT reserved::bigint FROM stock WHERE sku = '{sku}'"),
        )
        .await;
        assert_eq!(reserved, 0, "{sku}: {reserved} still reserved");
    }
    assert_never_early(&db).await;
    env.cleanup().await;
}

#[tokio::test]
async fn the_event_path_still_releases_through_the_broker() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    let mut config = env.config();
    config.worker.stock_release = StockRelease::Event;
    config.worker.releaser = false;
    create_orders(&mut db, &[Duration::from_millis(1200); 4], &lines(&["a"])).await;
    let worker = env.start(&config).await;
    eventually(Duration::from_secs(30), "four release events", || async {
        (release_events(&env).await == 4).then_some(())
    })
    .await;
    worker.stop().await;
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM stock_ledger WHERE kind = 'release'"
        )
        .await,
        0,
        "nothing released in the close"
    );
    let releaser = env.start(&crate::helpers::releaser_only(&config)).await;
    wait_released(&db, 4).await;
    releaser.stop().await;
    assert_eq!(unstamped_closes(&db).await, 0);
    env.cleanup().await;
}

/// Closes `ids` (due) through the one close path with the release in the close, in a
/// transaction whose lock timeout is 700 ms; what the release did and the lock timeout
/// the transaction has afterwards.
async fn close_in_place(
    db: &mut tokio_postgres::Client,
    ids: &[lapse::orders::OrderId],
) -> (lapse::close::CloseReport, String) {
    let tx = db.transaction().await.unwrap();
    tx.batch_execute("SET LOCAL lock_timeout = '700ms'")
        .await
        .unwrap();
    let candidates: Vec<lapse::close::Candidate> = ids
        .iter()
        .map(|id| lapse::close::Candidate {
            order_id: id.0,
            deadline_version: 1,
            hops: 0,
        })
        .collect();
    let mut report = lapse::close::close_due(
        &tx,
        &candidates,
        lapse::close::CloseReason::Sweeper,
        StockRelease::InClose,
    )
    .await
    .unwrap();
    lapse::close::release_closed(&tx, &mut report, StockRelease::InClose)
        .await
        .unwrap();
    let timeout: String = tx.query_one("SHOW lock_timeout", &[]).await.unwrap().get(0);
    tx.commit().await.unwrap();
    (report, timeout)
}

#[tokio::test]
async fn a_release_the_data_refuses_sends_the_batch_to_the_event_path_and_keeps_the_closes() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    let fine = create_orders(&mut db, &[Duration::from_millis(50); 3], &lines(&["fine"])).await;
    let bad = create_orders(&mut db, &[Duration::from_millis(50)], &lines(&["broken"])).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A healthy batch: released in place, the close's own lock timeout back afterwards.
    let (report, timeout) = close_in_place(&mut db, &fine[..1]).await;
    assert_eq!(report.closed.len(), 1);
    assert_eq!(report.released.applied, 1);
    assert!(!report.released.refused);
    assert_eq!(timeout, "700ms");
    // Someone zeroed the reservation by hand: the release would break `reserved >= 0`.
    db.execute("UPDATE stock SET reserved = 0 WHERE sku = 'broken'", &[])
        .await
        .unwrap();
    let batch = [fine[1], fine[2], bad[0]];
    let (report, timeout) = close_in_place(&mut db, &batch).await;
    assert_eq!(report.closed.len(), 3, "the closes stand");
    assert_eq!(report.released.applied, 0);
    assert_eq!(report.released.deferred, 3, "{report:?}");
    assert!(report.released.refused, "{report:?}");
    assert_eq!(timeout, "700ms");
    let outboxed = count(
        &db,
        "SELECT count(*) FROM outbox WHERE kind = 'stock.release'",
    )
    .await;
    assert_eq!(outboxed, 3, "the batch's releases wait for the releaser");
    assert_eq!(
        count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await,
        3 + 1
    );
    env.cleanup().await;
}

//! The stock releaser's own batch window (`worker.release_batch_window`): release
//! events arriving one by one within it are released in one transaction; without a
//! window each arrives, and is released, on its own.

use std::time::Duration;

use crate::helpers::{TestEnv, count, releaser_only, wait_released};

/// Events published after the first, 150 ms apart.
const SPACED: i64 = 5;

/// `n` CLOSED orders, each with one line of `tea` reserved and no release yet.
async fn closed_unreleased(db: &tokio_postgres::Client, n: i64) -> Vec<i64> {
    db.batch_execute(&format!(
        "INSERT INTO stock (sku, available, reserved) VALUES ('tea', 0, {n});
         WITH o AS (
             INSERT INTO orders (status, expire_at, closed_at)
             SELECT 'CLOSED', now() - interval '1 minute', now() FROM generate_series(1, {n})
             RETURNING id),
         l AS (INSERT INTO order_lines (order_id, sku, qty) SELECT id, 'tea', 1 FROM o)
         INSERT INTO stock_ledger (order_id, sku, kind, qty) SELECT id, 'tea', 'reserve', 1 FROM o;"
    ))
    .await
    .unwrap();
    db.query("SELECT id FROM orders ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// The stock-release event of `order`, as the relay publishes it.
async fn publish(env: &TestEnv, order: i64) {
    crate::parked::publish(
        env,
        &env.names().events_exchange(),
        lapse::names::STOCK_RELEASE_ROUTING_KEY,
        format!(r#"{{"order_id":{order}}}"#).as_bytes(),
        lapin::BasicProperties::default(),
    )
    .await
}

/// Releases one event to show the releaser consumes, then `SPACED` more, 150 ms apart,
/// with `window`; returns how many transactions stamped those `SPACED` orders.
async fn transactions_for_spaced_events(window: Duration) -> i64 {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = env.db().await;
    let orders = SPACED + 1;
    let ids = closed_unreleased(&db, orders).await;
    let mut config = releaser_only(&env.config());
    config.worker.release_batch_window = window;
    let releaser = env.start(&config).await;
    publish(&env, ids[0]).await;
    wait_released(&db, 1).await;
    for id in &ids[1..] {
        publish(&env, *id).await;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    wait_released(&db, orders).await;
    assert_eq!(
        count(&db, "SELECT sum(reserved)::bigint FROM stock").await,
        0,
        "every reservation returned once"
    );
    let transactions = count(
        &db,
        &format!(
            "SELECT count(DISTINCT xmin::text) FROM orders
              WHERE released_at IS NOT NULL AND id > {}",
            ids[0]
        ),
    )
    .await;
    assert!(releaser.stop().await.is_empty(), "nothing abandoned");
    env.cleanup().await;
    transactions
}

#[tokio::test]
async fn events_within_the_release_window_share_one_transaction() {
    let one = transactions_for_spaced_events(Duration::from_secs(3)).await;
    assert_eq!(one, 1, "{SPACED} events within a 3 s window");
}

#[tokio::test]
async fn without_a_release_window_spaced_events_are_released_apart() {
    let apart = transactions_for_spaced_events(Duration::ZERO).await;
    assert!(
        apart >= 2,
        "{SPACED} events 150 ms apart with no window took {apart} transaction(s)"
    );
}

#[tokio::test]
async fn a_shutdown_does_not_wait_out_a_long_release_window() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = env.db().await;
    let ids = closed_unreleased(&db, 2).await;
    let mut config = releaser_only(&env.config());
    config.worker.release_batch_window = Duration::from_secs(10);
    let releaser = env.start(&config).await;
    publish(&env, ids[0]).await;
    wait_released(&db, 1).await;
    // The next event opens a 10 s window; the shutdown comes inside it.
    publish(&env, ids[1]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let asked = std::time::Instant::now();
    let abandoned = releaser.stop().await;
    let took = asked.elapsed();
    assert!(abandoned.is_empty(), "abandoned: {abandoned:?}");
    assert!(
        took < Duration::from_secs(4),
        "the shutdown waited {took:?} (drain limit 5 s, window 10 s)"
    );
    // The event was either released before the stop or went back to its queue.
    let released = count(
        &db,
        "SELECT count(*) FROM stock_ledger WHERE kind = 'release'",
    )
    .await;
    let queued = crate::queues::depth(&env.conn, &env.names().stock_release_queue())
        .await
        .unwrap_or(0);
    assert_eq!(released + i64::from(queued), 2, "nothing lost");
    env.cleanup().await;
}

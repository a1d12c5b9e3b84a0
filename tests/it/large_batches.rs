//! A close of a large batch in one call (a backlog after an outage, a sweep): the
//! kept generic plan of `lapse_close_orders`, made without the batch's size, must not
//! compare every order it closes with every candidate (migration V17: V16's did,
//! 999,000 rows thrown away for a batch of 1,000). The plans are read from the server
//! itself (`auto_explain`, nested statements, as notices on the closing connection).

use lapse::close::{Candidate, CloseReason, StockRelease, close_due};
use tokio::sync::mpsc;

use crate::helpers::{TestEnv, connect_hearing, count};

/// Orders in the one batch.
const BATCH: i64 = 1_000;

/// A connection whose notices (the plans `auto_explain` logs) arrive on the receiver.
async fn explaining(env: &TestEnv) -> (tokio_postgres::Client, mpsc::UnboundedReceiver<String>) {
    let (client, rx) = connect_hearing(env, |m| match m {
        tokio_postgres::AsyncMessage::Notice(n) => Some(n.message().to_string()),
        _ => None,
    })
    .await;
    client
        .batch_execute(
            "LOAD 'auto_explain';
             SET auto_explain.log_min_duration = 0;
             SET auto_explain.log_analyze = on;
             SET auto_explain.log_nested_statements = on;
             SET auto_explain.log_level = notice;
             SET client_min_messages = notice;
             SET plan_cache_mode = force_generic_plan",
        )
        .await
        .expect("auto_explain (PostgreSQL's contrib module) and a superuser to load it");
    (client, rx)
}

/// The close's own plan among `notices`: the one whose query text is its statement.
fn close_plan(notices: &[String]) -> &str {
    let plans: Vec<&String> = notices
        .iter()
        .filter(|n| n.contains("WITH due AS") && n.contains("Update on orders"))
        .collect();
    assert_eq!(
        plans.len(),
        1,
        "auto_explain logged the close's plan once ({} notices)",
        notices.len()
    );
    plans[0]
}

/// The largest "Rows Removed by Join Filter" of `plan`.
fn most_rows_removed_by_join_filters(plan: &str) -> f64 {
    plan.lines()
        .filter_map(|l| l.trim().strip_prefix("Rows Removed by Join Filter:"))
        .map(|n| {
            n.trim()
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("a count in the plan: {n}"))
        })
        .fold(0.0, f64::max)
}

#[tokio::test]
async fn a_close_of_a_thousand_orders_compares_each_once() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = env.db().await;
    // Plans as the worker's are, whatever autovacuum would have analyzed meanwhile.
    for table in [
        "orders",
        "order_lines",
        "stock",
        "stock_ledger",
        "order_events",
    ] {
        db.batch_execute(&format!(
            "ALTER TABLE {table} SET (autovacuum_enabled = false)"
        ))
        .await
        .unwrap();
    }
    db.batch_execute(&format!(
        "INSERT INTO stock (sku, available, reserved) VALUES ('tea', 0, {BATCH});
         WITH o AS (
             INSERT INTO orders (status, expire_at)
             SELECT 'UNPAID', now() - interval '1 minute' FROM generate_series(1, {BATCH})
             RETURNING id),
         l AS (INSERT INTO order_lines (order_id, sku, qty) SELECT id, 'tea', 1 FROM o)
         INSERT INTO stock_ledger (order_id, sku, kind, qty) SELECT id, 'tea', 'reserve', 1 FROM o;"
    ))
    .await
    .unwrap();
    let ids: Vec<i64> = db
        .query("SELECT id FROM orders ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    // Each candidate with hops of its own; every tenth with a version the order does
    // not have (extended meanwhile): left alone.
    let candidates: Vec<Candidate> = ids
        .iter()
        .enumerate()
        .map(|(i, &order_id)| Candidate {
            order_id,
            deadline_version: if i % 10 == 9 { 2 } else { 1 },
            hops: (order_id % 7) as i32 + 1,
        })
        .collect();
    let (mut closer, mut notices) = explaining(&env).await;
    let tx = closer.transaction().await.unwrap();
    let mut report = close_due(
        &tx,
        &candidates,
        CloseReason::Timeout,
        StockRelease::InClose,
    )
    .await
    .unwrap();
    lapse::close::release_closed(&tx, &mut report, StockRelease::InClose)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let expected = BATCH - BATCH / 10;
    assert_eq!(report.closed.len() as i64, expected);
    assert_eq!(report.released.applied, expected);
    let mut plans = Vec::new();
    while let Ok(n) = notices.try_recv() {
        plans.push(n);
    }
    let removed = most_rows_removed_by_join_filters(close_plan(&plans));
    assert!(
        removed <= BATCH as f64,
        "a join in the close threw away {removed} rows for a batch of {BATCH}"
    );
    // What the close wrote is as before: each closed order's own hops on its timeline.
    let wrong = count(
        &db,
        "SELECT count(*) FROM orders o JOIN order_events e ON e.order_id = o.id AND e.event = 'closed'
          WHERE (e.detail->>'hops')::int IS DISTINCT FROM (o.id % 7) + 1",
    )
    .await;
    assert_eq!(wrong, 0, "closed events without their own order's hops");
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM order_events WHERE event = 'closed'"
        )
        .await,
        expected
    );
    assert_eq!(
        count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await,
        expected
    );
    let stale: Vec<i64> = candidates
        .iter()
        .filter(|c| c.deadline_version == 2)
        .map(|c| c.order_id)
        .collect();
    let unpaid: Vec<i64> = db
        .query(
            "SELECT id FROM orders WHERE status = 'UNPAID' ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        unpaid, stale,
        "the candidates of another version, and only they, stay"
    );
    drop((db, closer));
    env.cleanup().await;
}

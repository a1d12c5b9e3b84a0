//! A close of a large batch in one call (a backlog after an outage, a sweep): the
//! kept generic plans of `lapse_close_orders` and `lapse_release_closed_stock`, made
//! without the batch's size, must not compare every order with every other (migration
//! V17: V16's close did, 999,000 rows thrown away for a batch of 1,000). The plans are
//! read from the server itself (`auto_explain`, nested statements, as notices on the
//! closing connection).

use lapse::close::{Candidate, CloseReason, CloseReport, StockRelease, close_due};
use std::time::Duration;

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

/// The one plan among `notices` whose text has every one of `marks`: `what`'s.
fn plan<'a>(notices: &'a [String], what: &str, marks: &[&str]) -> &'a str {
    let plans: Vec<&String> = notices
        .iter()
        .filter(|n| marks.iter().all(|m| n.contains(m)))
        .collect();
    assert_eq!(
        plans.len(),
        1,
        "auto_explain logged {what}'s plan once ({} notices)",
        notices.len()
    );
    plans[0]
}

/// The close's own plan: the one whose query text is its statement.
fn close_plan(notices: &[String]) -> &str {
    plan(notices, "the close", &["WITH due AS", "Update on orders"])
}

/// The release's statement in `lapse_release_closed_stock` (not its fallback).
fn release_plan(notices: &[String]) -> &str {
    plan(
        notices,
        "the release",
        &["WITH lines AS MATERIALIZED", "Insert on stock_ledger"],
    )
}

/// The most rows a join or a filter of `plan` may throw away in all its loops: a few
/// times the batch's lines. Comparing each row of the batch with many throws away
/// about the square of that.
const MOST_REMOVED: f64 = (4 * LINES * BATCH) as f64;

/// Neither a join nor a filter of `plan` compares each row of the batch with many.
fn assert_linear(plan: &str, what: &str) {
    let (removed, at) = most_rows_removed(plan);
    assert!(
        removed <= MOST_REMOVED,
        "{what} threw away {removed} rows at `{at}` for a batch of {BATCH}:\n{plan}"
    );
    let per_row = subplans_run_per_row(plan);
    assert!(
        per_row.is_empty(),
        "{what} runs a subquery per row: {per_row:?}\n{plan}"
    );
}

/// Every subquery a filter runs per row of `plan`, unhashed (one scan of its whole
/// result per row: quadratic in the batch).
fn subplans_run_per_row(plan: &str) -> Vec<&str> {
    plan.lines()
        .filter(|l| l.contains("SubPlan") && l.contains("Filter:") && !l.contains("hashed SubPlan"))
        .map(str::trim)
        .collect()
}

/// The most rows one node of `plan` threw away by a filter or a join filter, over all
/// its loops (EXPLAIN shows the count per loop), and that node's line.
fn most_rows_removed(plan: &str) -> (f64, String) {
    let number = |text: &str| {
        text.trim()
            .parse::<f64>()
            .unwrap_or_else(|_| panic!("a count in the plan: {text}"))
    };
    let (mut most, mut at) = (0.0, String::new());
    let (mut loops, mut node) = (1.0, "");
    for line in plan.lines() {
        if let Some((_, rest)) = line.split_once("loops=") {
            loops = number(rest.trim_end_matches(')'));
            node = line.trim();
        } else if line.contains("(never executed)") {
            loops = 0.0;
            node = line.trim();
        }
        let trimmed = line.trim();
        let per_loop = trimmed
            .strip_prefix("Rows Removed by Filter:")
            .or_else(|| trimmed.strip_prefix("Rows Removed by Join Filter:"));
        if let Some(n) = per_loop {
            let removed = number(n) * loops;
            if removed > most {
                (most, at) = (removed, node.to_string());
            }
        }
    }
    (most, at)
}

/// Lines per order in the batch: a product of its own and one all orders share.
const LINES: i64 = 2;

/// `BATCH` unpaid orders past their deadline, each with a line of its own product and
/// one of `tea`, reserved (`BATCH + 1` stock rows); the
/// candidates to close them: each with hops of its own, every tenth with a version
/// the order does not have (extended meanwhile), to be left alone.
async fn thousand_due(db: &tokio_postgres::Client) -> Vec<Candidate> {
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
         l AS (
             INSERT INTO order_lines (order_id, sku, qty)
             SELECT id, sku, 1 FROM o CROSS JOIN LATERAL (VALUES ('tea'), ('own-' || id)) s(sku)
             RETURNING order_id, sku),
         s AS (
             INSERT INTO stock (sku, available, reserved)
             SELECT sku, 0, 1 FROM l WHERE sku <> 'tea')
         INSERT INTO stock_ledger (order_id, sku, kind, qty)
         SELECT order_id, sku, 'reserve', 1 FROM l;"
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
    ids.iter()
        .enumerate()
        .map(|(i, &order_id)| Candidate {
            order_id,
            deadline_version: if i % 10 == 9 { 2 } else { 1 },
            hops: (order_id % 7) as i32 + 1,
        })
        .collect()
}

/// Closes `candidates` in one transaction with the stock released in it, as the
/// worker does; the report and every plan the server logged meanwhile.
async fn close_explained(env: &TestEnv, candidates: &[Candidate]) -> (CloseReport, Vec<String>) {
    let (mut closer, mut notices) = explaining(env).await;
    let tx = closer.transaction().await.unwrap();
    let mut report = close_due(&tx, candidates, CloseReason::Timeout, StockRelease::InClose)
        .await
        .unwrap();
    lapse::close::release_closed(&tx, &mut report, StockRelease::InClose)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // Every notice arrived before the commit's reply; dropping the client ends the
    // stream.
    drop(closer);
    let mut plans = Vec::new();
    while let Ok(Some(n)) = tokio::time::timeout(Duration::from_secs(10), notices.recv()).await {
        plans.push(n);
    }
    (report, plans)
}

#[tokio::test]
async fn a_close_of_a_thousand_orders_compares_each_once() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = env.db().await;
    let candidates = thousand_due(&db).await;
    let (report, plans) = close_explained(&env, &candidates).await;
    let expected = BATCH - BATCH / 10;
    assert_eq!(report.closed.len() as i64, expected);
    assert_eq!(report.released.applied, expected * LINES);
    assert!(!report.released.refused);
    assert_linear(close_plan(&plans), "the close");
    assert_linear(release_plan(&plans), "the release");
    // Released in place: the shared product once per closed order, each own product
    // of a closed order once.
    assert_eq!(
        count(&db, "SELECT available FROM stock WHERE sku = 'tea'").await,
        expected
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM stock s JOIN orders o ON s.sku = 'own-' || o.id
              WHERE s.available = 1 AND s.reserved = 0 AND o.status = 'CLOSED'"
        )
        .await,
        expected
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
    drop(db);
    env.cleanup().await;
}

/// The release's other way: every stock row locked by the application, so each of the
/// batch's releases is deferred to the event path (an outbox row with its lines),
/// still without comparing every order with every other.
#[tokio::test]
async fn a_release_of_a_thousand_orders_whose_stock_is_locked_defers_each_once() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    let candidates = thousand_due(&db).await;
    let app = db.transaction().await.unwrap();
    let locked = app
        .execute("SELECT 1 FROM stock FOR UPDATE", &[])
        .await
        .unwrap();
    assert_eq!(locked, BATCH as u64 + 1);
    let (report, plans) = close_explained(&env, &candidates).await;
    app.rollback().await.unwrap();
    let expected = BATCH - BATCH / 10;
    assert_eq!(report.closed.len() as i64, expected);
    assert_eq!(report.released.applied, 0, "the stock rows were locked");
    assert_eq!(report.released.deferred, expected);
    assert!(!report.released.refused, "deferred, not refused");
    assert_linear(release_plan(&plans), "the deferred release");
    // Each closed order's release waits in the outbox once, with its own two lines.
    let events = count(
        &db,
        "SELECT count(*) FROM outbox o JOIN orders d ON d.id = o.order_id
          WHERE o.kind = 'stock.release' AND d.status = 'CLOSED'
            AND jsonb_array_length(o.payload->'lines') = 2
            AND o.payload->'lines' @> '[{\"sku\": \"tea\", \"qty\": 1}]'::jsonb
            AND o.payload->'lines' @> jsonb_build_array(
                    jsonb_build_object('sku', 'own-' || d.id, 'qty', 1))",
    )
    .await;
    assert_eq!(events, expected, "one release event per closed order");
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE kind = 'stock.release'"
        )
        .await,
        expected
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM stock_ledger WHERE kind = 'release'"
        )
        .await,
        0,
        "nothing released in place"
    );
    drop(db);
    env.cleanup().await;
}

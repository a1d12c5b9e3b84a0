//! Rows written before the deadline rules existed, in a database migrated since: the
//! range constraint `orders_expire_at_in_range` is present but `NOT VALID`, so the
//! legacy row stays readable while PostgreSQL refuses every UPDATE of it. Nothing may
//! fail because of such a row: the reconciler and the releaser skip (count, log) what
//! they cannot update and carry on, a payment is refused with a typed error.

use std::time::Duration;

use lapse::components::sweeper::Sweeper;
use lapse::db::DbError;
use lapse::observe::stats::Outcome;
use lapse::orders::{self, Line, OrderId, PayOutcome};

use crate::helpers::{TestEnv, count, create_orders, eventually, wait_released};
use crate::queues;
use crate::release_repair::closed_with_releases_queued;

const RANGE: &str = "CHECK (expire_at >= timestamptz '1970-01-01 00:00:00+00'
                            AND expire_at < timestamptz '10000-01-01 00:00:00+00') NOT VALID";

/// Runs `sql` as if before the deadline rules: without the range constraint, which is
/// then added back `NOT VALID`, exactly as migration V5 left a database it migrated.
async fn as_legacy(db: &tokio_postgres::Client, sql: &str) {
    db.batch_execute(&format!(
        "ALTER TABLE orders DROP CONSTRAINT orders_expire_at_in_range;
         {sql};
         ALTER TABLE orders ADD CONSTRAINT orders_expire_at_in_range {RANGE};"
    ))
    .await
    .unwrap();
}

fn sweeper(env: &TestEnv, batch_size: i64) -> Sweeper {
    let mut config = env.config().sweeper;
    config.release_grace = Duration::from_millis(500);
    config.batch_size = batch_size;
    Sweeper {
        retention: Default::default(),
        pool: lapse::db::pool(&env.config().database, 2).unwrap(),
        stats: lapse::observe::stats::Stats::default(),
        config,
        limiter: lapse::runtime::rate::RateLimiter::new(0),
        lock_timeout: Duration::from_secs(5),
        stock_release: env.config().worker.stock_release,
    }
}

/// The `id` column of the one row `sql` returns.
async fn id_of(db: &tokio_postgres::Client, sql: &str) -> i64 {
    db.query_one(sql, &[]).await.unwrap().get("id")
}

#[tokio::test]
async fn the_reconciler_skips_closed_rows_it_cannot_update_and_repairs_the_rest() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = env.db().await;
    // Legacy CLOSED rows, unreleased, closed first: they come first in the index.
    as_legacy(
        &db,
        "INSERT INTO orders (status, expire_at, closed_at, close_reason) VALUES
           ('CLOSED', '1960-01-01 00:00:00+00', now() - interval '3 hours', 'sweeper'),
           ('CLOSED', '-infinity', now() - interval '3 hours', 'sweeper')",
    )
    .await;
    let with_line = id_of(&db, "SELECT id FROM orders WHERE expire_at = '-infinity'").await;
    // Ordinary unreleased CLOSED orders after them: one without lines, one with.
    db.batch_execute(&format!(
        "INSERT INTO order_lines (order_id, sku, qty) VALUES ({with_line}, 'tea', 1);
         INSERT INTO orders (status, expire_at, closed_at, close_reason) VALUES
           ('CLOSED', now() - interval '2 hours', now() - interval '1 hour', 'sweeper'),
           ('CLOSED', now() - interval '2 hours', now() - interval '1 hour', 'sweeper');
         INSERT INTO order_lines (order_id, sku, qty)
           SELECT max(id), 'tea', 1 FROM orders;"
    ))
    .await
    .unwrap();
    // One row per page: pagination must pass the rows it skips.
    let sweeper = sweeper(&env, 1);
    let report = sweeper
        .run_once()
        .await
        .expect("a legacy row fails no pass");
    assert_eq!(report.releases_unreadable, 2, "{report:?}");
    assert_eq!(report.releases_repaired, 1, "{report:?}");
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM orders WHERE released_at IS NOT NULL"
        )
        .await,
        1,
        "the line-less ordinary order is stamped"
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE kind = 'stock.release'"
        )
        .await,
        1
    );
    // Again: still skipped, nothing repeated.
    let again = sweeper.run_once().await.unwrap();
    assert_eq!((again.releases_unreadable, again.releases_repaired), (2, 0));

    // The repair recipe for CLOSED rows (docs/operations.md), then the reconciler
    // stamps the line-less one and re-emits the other's release.
    db.batch_execute(
        "INSERT INTO order_events (order_id, event, detail)
           SELECT id, 'deadline_repaired', jsonb_build_object('was', expire_at::text)
             FROM orders WHERE status <> 'UNPAID'
              AND NOT (expire_at >= '1970-01-01+00' AND expire_at < '10000-01-01+00');
         UPDATE orders SET expire_at = closed_at
          WHERE status = 'CLOSED'
            AND NOT (expire_at >= '1970-01-01+00' AND expire_at < '10000-01-01+00');
         ALTER TABLE orders VALIDATE CONSTRAINT orders_expire_at_in_range;",
    )
    .await
    .unwrap();
    let repaired = sweeper.run_once().await.unwrap();
    assert_eq!(
        (repaired.releases_unreadable, repaired.releases_repaired),
        (0, 1),
        "{repaired:?}"
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM orders WHERE released_at IS NOT NULL"
        )
        .await,
        2
    );
    assert_eq!(
        count(
            &db,
            &format!("SELECT count(*) FROM outbox WHERE order_id = {with_line}")
        )
        .await,
        1
    );
    env.cleanup().await;
}

#[tokio::test]
async fn the_releaser_releases_a_legacy_closed_order_and_parks_nothing() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let mut db = env.db().await;
    let line = vec![Line {
        sku: "tea".into(),
        qty: 1,
    }];
    let ids = create_orders(&mut db, &[Duration::from_millis(300); 4], &line).await;
    let mut config = env.config();
    config.worker.releaser = false;
    config.worker.stock_release = lapse::close::StockRelease::Event;
    let closer = env.start(&config).await;
    closed_with_releases_queued(&env, &db, 4, 4).await;
    closer.stop().await;
    let legacy = ids[1].0;
    // The order's deadline becomes one from before the rules (closed_at >= expire_at
    // still holds).
    as_legacy(
        &db,
        &format!("UPDATE orders SET expire_at = '1960-01-01+00' WHERE id = {legacy}"),
    )
    .await;

    let releaser_only = crate::helpers::releaser_only(&env.config());
    let releaser = env.start(&releaser_only).await;
    wait_released(&db, 4).await;
    assert_eq!(
        count(&db, "SELECT sum(reserved)::bigint FROM stock").await,
        0
    );
    assert_eq!(
        crate::helpers::unstamped_closes(&db).await,
        1,
        "only the legacy row is left unstamped"
    );
    eventually(
        Duration::from_secs(30),
        "every delivery acknowledged",
        || async {
            (queues::depth(&env.conn, &env.names().stock_release_queue()).await == Some(0))
                .then_some(())
        },
    )
    .await;
    assert_eq!(releaser.stats.get(Outcome::Parked), 0);
    assert_eq!(
        queues::depth(&env.conn, &env.names().parked()).await,
        Some(0)
    );
    releaser.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn paying_an_order_whose_row_cannot_be_updated_is_refused_with_lp003() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = env.db().await;
    as_legacy(
        &db,
        "INSERT INTO orders (expire_at) VALUES ('infinity'), ('-infinity')",
    )
    .await;
    let never = id_of(&db, "SELECT id FROM orders WHERE expire_at = 'infinity'").await;
    let long_ago = id_of(&db, "SELECT id FROM orders WHERE expire_at = '-infinity'").await;

    let refused = orders::pay(&db, OrderId(never)).await;
    match &refused {
        Err(DbError::Refused(m)) => assert!(
            m.contains(&format!("order {never}")) && m.contains("infinity"),
            "{m}"
        ),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let raw = db
        .query_one("SELECT lapse_pay_order($1)", &[&never])
        .await
        .unwrap_err();
    assert_eq!(raw.code().map(|c| c.code()), Some("LP003"), "{raw:?}");
    assert_eq!(
        count(
            &db,
            &format!("SELECT count(*) FROM orders WHERE id = {never} AND status = 'UNPAID'")
        )
        .await,
        1
    );
    assert_eq!(count(&db, "SELECT count(*) FROM late_payments").await, 0);

    // A refusal that updates nothing behaves as before: EXPIRED, recorded once.
    assert_eq!(
        orders::pay(&db, OrderId(long_ago)).await.unwrap(),
        PayOutcome::Expired
    );
    assert_eq!(count(&db, "SELECT count(*) FROM late_payments").await, 1);
    env.cleanup().await;
}

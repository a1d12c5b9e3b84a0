//! Retention: the sweeper's leader prunes old timeline events, ledger rows and settled
//! late payments of finished orders, in batches; never anything of an open order or
//! of a close whose stock release has not been applied; and nothing it prunes lets a
//! repeated release or a repeated late payment count twice.

use std::time::Duration;

use lapse::components::sweeper::Sweeper;
use lapse::config::RetentionConfig;
use lapse::orders::{self, Line, OrderId, PayOutcome};
use serde_json::Value;

use crate::helpers::{TestEnv, count, create_orders, eventually, stdout, wait_released};
use crate::queues;

async fn of(db: &tokio_postgres::Client, table: &str, column: &str, id: OrderId) -> i64 {
    count(
        db,
        &format!("SELECT count(*) FROM {table} WHERE {column} = {}", id.0),
    )
    .await
}

/// The sweeper of `env`'s database (its leader prunes), with `retention`.
fn sweeper(env: &TestEnv, retention: RetentionConfig) -> Sweeper {
    let config = env.config();
    Sweeper {
        retention,
        pool: lapse::db::pool(&config.database, 2).unwrap(),
        stats: lapse::observe::stats::Stats::default(),
        config: config.sweeper.clone(),
        limiter: lapse::runtime::rate::RateLimiter::new(0),
        lock_timeout: Duration::from_secs(5),
        stock_release: env.config().worker.stock_release,
    }
}

async fn available(db: &tokio_postgres::Client) -> i64 {
    count(db, "SELECT available FROM stock WHERE sku = 'kept'").await
}

// Over 60 lines on purpose: one story (six orders in six states, aged, pruned, then
// the two repeats that pruning must not let through), asserted per order.
#[tokio::test]
async fn old_rows_of_finished_orders_go_in_batches_and_nothing_open_or_unapplied_does() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let running = env.start(&env.config()).await;
    let mut db = env.db().await;
    let lines = [Line {
        sku: "kept".into(),
        qty: 1,
    }];
    // paid, then four that close: released, release unapplied, settled refund, pending
    // refund; and one still open.
    let paid = create_orders(&mut db, &[Duration::from_secs(3600)], &lines).await[0];
    let closing = create_orders(&mut db, &[Duration::from_millis(300); 4], &lines).await;
    let (released, unapplied, settled, pending) = (closing[0], closing[1], closing[2], closing[3]);
    let open = create_orders(&mut db, &[Duration::from_secs(3600)], &lines).await[0];
    assert_eq!(orders::pay(&db, paid).await.unwrap(), PayOutcome::Paid);
    wait_released(&db, 4).await;
    for id in [settled, pending, unapplied] {
        assert_eq!(orders::pay(&db, id).await.unwrap(), PayOutcome::Late);
    }
    // Settled, but its order's stock release is not applied: kept with the order.
    db.batch_execute(&format!(
        "UPDATE late_payments SET refund = 'REFUNDED' WHERE order_id IN ({}, {});
         UPDATE orders SET released_at = NULL WHERE id = {};
         UPDATE order_events SET at = at - interval '40 days';
         UPDATE stock_ledger SET at = at - interval '100 days';
         UPDATE late_payments SET received_at = received_at - interval '500 days';",
        settled.0, unapplied.0, unapplied.0
    ))
    .await
    .unwrap();
    let events_before = count(&db, "SELECT count(*) FROM order_events").await;
    let ledger_before = count(&db, "SELECT count(*) FROM stock_ledger").await;
    let stock_before = available(&db).await;

    let sweeper = sweeper(
        &env,
        RetentionConfig {
            batch_size: 2, // several batches per table
            ..RetentionConfig::default()
        },
    );
    let report = sweeper.run_once().await.unwrap();
    assert!(report.leader, "{report:?}");

    // Kept: everything of the open order and of the close whose release is unapplied.
    for id in [open, unapplied] {
        assert!(of(&db, "order_events", "order_id", id).await > 0, "{id}");
        assert!(of(&db, "stock_ledger", "order_id", id).await > 0, "{id}");
    }
    // Gone: the rest of the timeline and the ledger.
    for id in [paid, released, settled, pending] {
        assert_eq!(of(&db, "order_events", "order_id", id).await, 0, "{id}");
        assert_eq!(of(&db, "stock_ledger", "order_id", id).await, 0, "{id}");
    }
    // The settled refund went, the pending one stays, and so does the settled one of
    // the order whose release is unapplied.
    assert_eq!(of(&db, "late_payments", "order_id", settled).await, 0);
    assert_eq!(of(&db, "late_payments", "order_id", pending).await, 1);
    assert_eq!(of(&db, "late_payments", "order_id", unapplied).await, 1);
    let pruned_events = events_before - count(&db, "SELECT count(*) FROM order_events").await;
    let pruned_ledger = ledger_before - count(&db, "SELECT count(*) FROM stock_ledger").await;
    assert_eq!(report.pruned, [pruned_events, pruned_ledger, 1]);
    assert!(pruned_events > 4 && pruned_ledger > 4, "{report:?}");
    assert_eq!(available(&db).await, stock_before, "pruning moved stock");

    // A second late payment of the order whose refund was pruned records nothing;
    // one of an order never paid late still does.
    assert_eq!(orders::pay(&db, settled).await.unwrap(), PayOutcome::Late);
    assert_eq!(of(&db, "late_payments", "order_id", settled).await, 0);
    assert_eq!(orders::pay(&db, released).await.unwrap(), PayOutcome::Late);
    assert_eq!(of(&db, "late_payments", "order_id", released).await, 1);

    // A repeated release event of an order whose ledger rows were pruned releases
    // nothing twice; the releaser consumes it.
    let channel = env.conn.create_channel().await.unwrap();
    channel
        .basic_publish(
            env.names().events_exchange().as_str().into(),
            lapse::names::STOCK_RELEASE_ROUTING_KEY.into(),
            Default::default(),
            format!("{{\"order_id\": {}}}", released.0).as_bytes(),
            Default::default(),
        )
        .await
        .unwrap();
    let queue = env.names().stock_release_queue();
    eventually(Duration::from_secs(30), "the repeat consumed", || async {
        (queues::depth(&env.conn, &queue).await == Some(0)).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        available(&db).await,
        stock_before,
        "a pruned release ran twice"
    );
    assert_eq!(of(&db, "stock_ledger", "order_id", released).await, 0);

    // `lapse status` counts what was pruned.
    let status = env.lapse(&["status", "--json"]);
    let status: Value = serde_json::from_str(&stdout(&status)).unwrap();
    assert_eq!(
        status["retention_pruned"],
        pruned_events + pruned_ledger + 1,
        "{status}"
    );
    assert!(status["retention_last_ms"].as_f64().is_some(), "{status}");
    running.stop().await;
    env.cleanup().await;
}

/// `forever` keeps a table whole; the others are still pruned.
#[tokio::test]
async fn a_table_kept_forever_is_not_pruned() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let mut db = env.db().await;
    let lines = [Line {
        sku: "kept".into(),
        qty: 1,
    }];
    let paid = create_orders(&mut db, &[Duration::from_secs(3600)], &lines).await[0];
    assert_eq!(orders::pay(&db, paid).await.unwrap(), PayOutcome::Paid);
    db.batch_execute(
        "UPDATE order_events SET at = at - interval '10 years';
         UPDATE stock_ledger SET at = at - interval '10 years';",
    )
    .await
    .unwrap();
    let sweeper = sweeper(
        &env,
        RetentionConfig {
            timeline: lapse::config::Keep::Forever,
            ..RetentionConfig::default()
        },
    );
    let report = sweeper.run_once().await.unwrap();
    assert_eq!(report.pruned[0], 0, "{report:?}");
    assert!(of(&db, "order_events", "order_id", paid).await > 0);
    assert!(report.pruned[1] > 0, "{report:?}");
    assert_eq!(of(&db, "stock_ledger", "order_id", paid).await, 0);
    env.cleanup().await;
}

/// A legacy order (its deadline outside the range lapse handles, written before the
/// rules; PostgreSQL refuses every UPDATE of it) with an old settled late payment: left
/// alone, while the same payment of an ordinary order goes; the sweep does not fail.
#[tokio::test]
async fn a_legacy_order_s_late_payment_is_left_alone_and_the_sweep_goes_on() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let db = env.db().await;
    db.batch_execute(
        "ALTER TABLE orders DROP CONSTRAINT orders_expire_at_in_range;
         INSERT INTO orders (id, status, expire_at, closed_at, close_reason, released_at) VALUES
           (9001, 'CLOSED', '-infinity', now() - interval '3 days', 'sweeper', now()),
           (9002, 'CLOSED', now() - interval '3 days', now() - interval '3 days', 'timeout', now());
         INSERT INTO late_payments (order_id, received_at, refund) VALUES
           (9001, now() - interval '500 days', 'REFUNDED'),
           (9002, now() - interval '500 days', 'REFUNDED');
         ALTER TABLE orders ADD CONSTRAINT orders_expire_at_in_range
           CHECK (expire_at >= timestamptz '1970-01-01 00:00:00+00'
                  AND expire_at < timestamptz '10000-01-01 00:00:00+00') NOT VALID;",
    )
    .await
    .unwrap();
    let sweeper = sweeper(&env, RetentionConfig::default());
    let report = sweeper.run_once().await.expect("the sweep does not fail");
    assert_eq!(report.pruned[2], 1, "{report:?}");
    assert_eq!(of(&db, "late_payments", "order_id", OrderId(9001)).await, 1);
    assert_eq!(of(&db, "late_payments", "order_id", OrderId(9002)).await, 0);
    assert_eq!(
        count(&db, "SELECT count(*) FROM orders WHERE late_payment_pruned").await,
        1
    );
    env.cleanup().await;
}

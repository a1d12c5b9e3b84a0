//! One close or release transaction against a large backlog: it reads rows in
//! proportion to its batch, not to the backlog, even when the planner's statistics are
//! older than the table (never analyzed, or a burst since the last analyze); and a
//! repeated release changes nothing, not even the first stamp.

use std::time::Duration;

use lapse::amqp::batch::Batching;
use lapse::close::{Candidate, CloseReason, StockRelease, close_due};
use lapse::components::releaser::Releaser;
use lapse::db::Pools;

use crate::helpers::{TestEnv, count, eventually};

/// Orders in the backlog a batch is part of.
const BACKLOG: i64 = 5_000;

fn releaser(env: &TestEnv) -> Releaser {
    Releaser {
        pools: Pools::single(lapse::db::pool(&env.config().database, 2).unwrap()),
        names: env.names(),
        stats: lapse::observe::stats::Stats::default(),
        batching: Batching::from_config(&env.config().worker),
    }
}

/// `n` more orders closed straight in the tables, as a burst of closes leaves them,
/// each with one line of `tea` reserved and no release yet.
async fn closed_unreleased(db: &tokio_postgres::Client, n: i64) {
    orders(db, n, "'CLOSED', now() - interval '1 minute', now()").await;
}

/// `n` more UNPAID orders, overdue by a minute, each with one line of `tea` reserved.
async fn overdue(db: &tokio_postgres::Client, n: i64) {
    orders(db, n, "'UNPAID', now() - interval '1 minute', NULL").await;
}

/// `n` orders of `(status, expire_at, closed_at)`, with lines, ledger and stock.
async fn orders(db: &tokio_postgres::Client, n: i64, row: &str) {
    db.batch_execute(&format!(
        "INSERT INTO stock (sku, available, reserved) VALUES ('tea', 0, 0) ON CONFLICT DO NOTHING;
         WITH o AS (
             INSERT INTO orders (status, expire_at, closed_at)
             SELECT {row} FROM generate_series(1, {n})
             RETURNING id),
         l AS (INSERT INTO order_lines (order_id, sku, qty) SELECT id, 'tea', 1 FROM o)
         INSERT INTO stock_ledger (order_id, sku, kind, qty) SELECT id, 'tea', 'reserve', 1 FROM o;
         UPDATE stock SET reserved = reserved + {n} WHERE sku = 'tea';"
    ))
    .await
    .unwrap();
}

/// Rows read from `orders` by sequential scans and index entries read from its
/// partial indexes, as the statistics collector has them so far.
async fn backlog_reads(db: &tokio_postgres::Client) -> i64 {
    db.query_one(
        "SELECT (SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables WHERE relname = 'orders')
              + (SELECT coalesce(sum(idx_tup_read), 0)::bigint FROM pg_stat_user_indexes
                  WHERE relname = 'orders' AND indexrelname <> 'orders_pkey')",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// Index scans of `orders_pkey` so far.
async fn pkey_scans(db: &tokio_postgres::Client) -> i64 {
    db.query_one(
        "SELECT coalesce(idx_scan, 0) FROM pg_stat_user_indexes WHERE indexrelname = 'orders_pkey'",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// A database whose `orders` statistics never see the backlog (autovacuum off for
/// the table, no ANALYZE), as after a burst before the next analyze.
async fn never_analyzed(env: &TestEnv) -> tokio_postgres::Client {
    let db = env.db().await;
    db.batch_execute("ALTER TABLE orders SET (autovacuum_enabled = false)")
        .await
        .unwrap();
    db
}

/// Rows and partial-index entries of `orders` that `act` read, as the statistics
/// collector reports them (`act` runs on connections of its own and must look up at
/// least one row by primary key).
async fn reads_of<F: std::future::Future<Output = ()>>(db: &tokio_postgres::Client, act: F) -> i64 {
    // The setup's own reads, flushed first.
    db.batch_execute("SELECT pg_stat_force_next_flush()")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = backlog_reads(db).await;
    let scans_before = pkey_scans(db).await;
    act.await;
    // A connection reports its counters once idle (within about a second).
    eventually(Duration::from_secs(20), "the reads reported", || async {
        (pkey_scans(db).await > scans_before).then_some(())
    })
    .await;
    // Until the counters stand still: a report can arrive in parts.
    let mut last = backlog_reads(db).await;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        let now = backlog_reads(db).await;
        if now == last {
            break;
        }
        last = now;
    }
    last - before
}

/// The newest `n` orders matching `condition`.
async fn newest_where(db: &tokio_postgres::Client, condition: &str, n: i64) -> Vec<i64> {
    db.query(
        &format!("SELECT id FROM orders WHERE {condition} ORDER BY id DESC LIMIT $1"),
        &[&n],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// A batch of `size` read (far) fewer rows than the backlog holds.
fn assert_own_rows(what: &str, size: i64, read: i64) {
    assert!(
        read < BACKLOG / 10,
        "one {what} batch of {size} read {read} rows or index entries of a backlog of {BACKLOG}"
    );
}

#[tokio::test]
async fn a_close_batch_reads_its_own_orders_not_the_backlog() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = never_analyzed(&env).await;
    overdue(&db, BACKLOG).await;
    let mut closer = env.db().await;
    let mut closed = 0;
    // A small batch, and one of a draining worker's size.
    for size in [8, 500] {
        let batch: Vec<Candidate> = newest_where(&db, "status = 'UNPAID'", size)
            .await
            .into_iter()
            .map(|order_id| Candidate {
                order_id,
                deadline_version: 1,
                hops: 1,
            })
            .collect();
        let read = reads_of(&db, async {
            let tx = closer.transaction().await.unwrap();
            let report = close_due(&tx, &batch, CloseReason::Timeout, StockRelease::Event)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            assert_eq!(report.closed.len() as i64, size);
            assert!(report.locked.is_empty());
        })
        .await;
        assert_own_rows("close", size, read);
        closed += size;
        assert_eq!(
            count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await,
            closed
        );
        assert_eq!(
            count(
                &db,
                "SELECT count(*) FROM outbox WHERE kind = 'stock.release'"
            )
            .await,
            closed
        );
    }
    drop((db, closer));
    env.cleanup().await;
}

#[tokio::test]
async fn a_release_batch_reads_its_own_orders_not_the_backlog() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = never_analyzed(&env).await;
    closed_unreleased(&db, BACKLOG).await;
    let releaser = releaser(&env);
    // A small batch only: for hundreds of ids in a table of a few thousand rows, one
    // scan of the table is what the planner rightly finds cheaper than the lookups
    // (one scan per statement; the close's test covers a large batch, where a join
    // misestimated at one row once meant one scan per id).
    let batch = newest_where(&db, "released_at IS NULL", 8).await;
    let read = reads_of(&db, async {
        let outcome = releaser.release(0, &batch).await.unwrap();
        assert_eq!(outcome.applied, 8);
        assert!(outcome.held.is_empty());
    })
    .await;
    assert_own_rows("release", 8, read);
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM orders WHERE released_at IS NOT NULL"
        )
        .await,
        8
    );
    assert_eq!(
        count(&db, "SELECT reserved FROM stock WHERE sku = 'tea'").await,
        BACKLOG - 8
    );
    drop(db);
    env.cleanup().await;
}

/// Every stamped order with its `released_at`, by id.
async fn stamps(db: &tokio_postgres::Client) -> Vec<(i64, String)> {
    db.query(
        "SELECT id, released_at::text FROM orders WHERE released_at IS NOT NULL ORDER BY id",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

#[tokio::test]
async fn a_repeated_release_keeps_the_first_stamp_and_releases_once() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = env.db().await;
    closed_unreleased(&db, 3).await;
    let mut ids = newest_where(&db, "true", 3).await;
    ids.reverse();
    let releaser = releaser(&env);
    assert_eq!(releaser.release(0, &ids[..2]).await.unwrap().applied, 2);
    let first = stamps(&db).await;
    assert_eq!(first.len(), 2);
    // Again, with the third order, and one id twice.
    let again = [ids[0], ids[1], ids[2], ids[2]];
    assert_eq!(releaser.release(0, &again).await.unwrap().applied, 1);
    let second = stamps(&db).await;
    assert_eq!(second.len(), 3);
    assert_eq!(
        &second[..2],
        &first[..],
        "the first stamps stay as they were"
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM stock_ledger WHERE kind = 'release'"
        )
        .await,
        3
    );
    assert_eq!(
        count(&db, "SELECT reserved FROM stock WHERE sku = 'tea'").await,
        0
    );
    drop(db);
    env.cleanup().await;
}

/// Rows of the close's and the release's tables read by sequential scans, and index
/// entries read from `orders`' partial indexes, so far.
const SCANNED_ROWS: &str =
    "SELECT (SELECT coalesce(sum(seq_tup_read), 0)::bigint FROM pg_stat_user_tables
              WHERE relname IN ('orders', 'order_lines', 'stock', 'stock_ledger', 'outbox'))
          + (SELECT coalesce(sum(idx_tup_read), 0)::bigint FROM pg_stat_user_indexes
              WHERE relname = 'orders' AND indexrelname <> 'orders_pkey')";

/// Rows of `orders` updated so far.
const UPDATES_OF_ORDERS: &str =
    "SELECT coalesce(n_tup_upd, 0) FROM pg_stat_user_tables WHERE relname = 'orders'";

/// The close and the release in the close are functions whose plans a connection keeps
/// (migration V16): after a few calls the server runs their generic plans, made
/// without the batch's size. Those must reach the batch's rows by key too: a join the
/// planner turned into a scan of `order_lines` read the whole table at every close.
#[tokio::test]
async fn the_kept_plans_of_the_close_and_its_release_read_only_their_batch() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = never_analyzed(&env).await;
    for table in ["order_lines", "stock", "stock_ledger", "outbox"] {
        db.batch_execute(&format!(
            "ALTER TABLE {table} SET (autovacuum_enabled = false)"
        ))
        .await
        .unwrap();
    }
    overdue(&db, BACKLOG).await;
    // A shop's many other SKUs: a scan of `stock` would show too.
    db.batch_execute(
        "INSERT INTO stock (sku, available) SELECT 'other-' || g, 1 FROM generate_series(1, 2000) g",
    )
    .await
    .unwrap();
    let ids = newest_where(&db, "status = 'UNPAID'", 60).await;
    let mut closer = env.db().await;
    // Generic plans from the first call, whatever the planner would choose by itself
    // (the functions force theirs too): the plans this test is about.
    closer
        .batch_execute("SET plan_cache_mode = force_generic_plan")
        .await
        .unwrap();
    db.batch_execute("SELECT pg_stat_force_next_flush()")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = count(&db, SCANNED_ROWS).await;
    let updates_before = count(&db, UPDATES_OF_ORDERS).await;
    // 20 batches of 3 on one connection, the last ones with the stock release sent as
    // an event (the close's own outbox insert).
    for (i, batch) in ids.chunks(3).enumerate() {
        let release = if i < 14 {
            StockRelease::InClose
        } else {
            StockRelease::Event
        };
        let candidates: Vec<Candidate> = batch
            .iter()
            .map(|&order_id| Candidate {
                order_id,
                deadline_version: 1,
                hops: 1,
            })
            .collect();
        let tx = closer.transaction().await.unwrap();
        let mut report = close_due(&tx, &candidates, CloseReason::Timeout, release)
            .await
            .unwrap();
        lapse::close::release_closed(&tx, &mut report, release)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(report.closed.len(), batch.len());
        if release == StockRelease::InClose {
            assert_eq!(report.released.applied, batch.len() as i64);
        }
    }
    closer
        .batch_execute("SELECT pg_stat_force_next_flush()")
        .await
        .unwrap();
    // The closing connection's counters have arrived when its updates have (60
    // closes, 42 stamps).
    eventually(
        Duration::from_secs(20),
        "the closes' counters reported",
        || async { (count(&db, UPDATES_OF_ORDERS).await >= updates_before + 102).then_some(()) },
    )
    .await;
    let read = count(&db, SCANNED_ROWS).await - before;
    assert!(
        read < BACKLOG / 10,
        "20 close transactions of 3 orders read {read} rows by scans, beside a backlog of {BACKLOG}"
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM orders WHERE released_at IS NOT NULL"
        )
        .await,
        42
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE kind = 'stock.release'"
        )
        .await,
        18
    );
    drop((db, closer));
    env.cleanup().await;
}

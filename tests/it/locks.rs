//! An application holding an order's row lock (`SELECT ... FOR UPDATE` around a slow
//! payment call) across the deadline: only that order waits; everything else closes.
//! And the timeouts that bound a hung database call.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use lapse::observe::stats::Outcome;
use lapse::orders::Line;

use crate::helpers::{
    TestEnv, assert_never_early, count, create_orders, eventually, wait_released,
};

fn one_line() -> Vec<Line> {
    vec![Line {
        sku: "locked-widget".into(),
        qty: 1,
    }]
}

/// Begins a transaction on `holder` that locks order `id` like an application would;
/// returns the database clock read once the lock was held (a bound on when it was
/// taken).
async fn hold_row_lock(holder: &tokio_postgres::Client, id: i64) -> DateTime<Utc> {
    holder.batch_execute("BEGIN").await.unwrap();
    holder
        .query_one("SELECT id FROM orders WHERE id = $1 FOR UPDATE", &[&id])
        .await
        .unwrap();
    holder
        .query_one("SELECT clock_timestamp() AS now", &[])
        .await
        .unwrap()
        .get("now")
}

/// Ends the holder's transaction; returns the database clock just before it ended.
async fn release_row_lock(holder: &tokio_postgres::Client) -> DateTime<Utc> {
    let at: DateTime<Utc> = holder
        .query_one("SELECT clock_timestamp() AS now", &[])
        .await
        .unwrap()
        .get("now");
    holder.batch_execute("ROLLBACK").await.unwrap();
    at
}

async fn times_closed(db: &tokio_postgres::Client) -> i64 {
    count(
        db,
        "SELECT count(*) FROM (SELECT order_id FROM order_events WHERE event = 'closed'
          GROUP BY order_id HAVING count(*) > 1) twice",
    )
    .await
}

#[tokio::test]
async fn a_locked_order_defers_only_itself_while_the_rest_of_the_batch_closes() {
    let env = TestEnv::with_database(&["1s"]).await;
    let worker = env.start(&env.config()).await;
    let mut db = env.db().await;
    let holder = env.db().await;
    // The lock is taken right after the order exists, well before its deadline (a
    // busy machine must not let the worker close it first), and the others are due
    // at the same moment, so the worker meets the locked row among them.
    let locked = create_orders(&mut db, &[Duration::from_secs(5)], &one_line()).await[0].0;
    let locked_by = hold_row_lock(&holder, locked).await;
    let expire_at: DateTime<Utc> = db
        .query_one("SELECT expire_at FROM orders WHERE id = $1", &[&locked])
        .await
        .unwrap()
        .get("expire_at");
    assert!(
        locked_by < expire_at,
        "the lock ({locked_by}) must be held before the deadline ({expire_at})"
    );
    let others = create_orders(&mut db, &[Duration::from_secs(5); 50], &one_line()).await;
    let created = Instant::now();

    // Everything else closes while the lock is still held.
    let closed_within = eventually(
        Duration::from_secs(60),
        "the 50 unlocked orders closed while one row is locked",
        || async {
            let closed = count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
            (closed == 50).then(|| created.elapsed())
        },
    )
    .await;
    let ids: Vec<i64> = others.iter().map(|o| o.0).collect();
    let closed_others: i64 = db
        .query_one(
            "SELECT count(*) AS closed FROM orders WHERE id = ANY($1) AND status = 'CLOSED'",
            &[&ids],
        )
        .await
        .unwrap()
        .get("closed");
    assert_eq!(closed_others, 50, "{closed_within:?} after creating them");
    // The worker met the lock, skipped it and keeps retrying it.
    eventually(Duration::from_secs(30), "the lock noticed", || async {
        (worker.stats.get(Outcome::Locked) >= 2).then_some(())
    })
    .await;
    let status: String = db
        .query_one("SELECT status FROM orders WHERE id = $1", &[&locked])
        .await
        .unwrap()
        .get("status");
    assert_eq!(status, "UNPAID", "nothing happens to a row someone holds");
    // The slow payment call goes on a little longer, well past the deadline.
    tokio::time::sleep(Duration::from_secs(7).saturating_sub(created.elapsed())).await;
    let released_at = release_row_lock(&holder).await;

    let closed_at: DateTime<Utc> = eventually(
        Duration::from_secs(30),
        "the locked order closed after the lock was released",
        || async {
            db.query_one(
                "SELECT closed_at FROM orders WHERE id = $1 AND status = 'CLOSED'",
                &[&locked],
            )
            .await
            .ok()
            .map(|r| r.get("closed_at"))
        },
    )
    .await;
    assert!(
        closed_at > released_at,
        "closed_at {closed_at} is the moment of the close, after the lock ended at {released_at}"
    );
    assert_never_early(&db).await;
    assert_eq!(times_closed(&db).await, 0, "an order closed twice");
    assert_eq!(
        count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await,
        51
    );
    worker.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn the_sweeper_skips_a_locked_row_and_closes_the_rest() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    let ids = create_orders(&mut db, &[Duration::from_millis(100); 31], &one_line()).await;
    tokio::time::sleep(Duration::from_millis(300)).await; // overdue, and no relay ran
    let mut config = env.config();
    config.sweeper.grace = Duration::from_millis(50);
    config.sweeper.batch_size = 7; // the locked row falls inside a keyset page
    let sweeper = lapse::components::sweeper::Sweeper {
        retention: Default::default(),
        pool: lapse::db::pool(&config.database, 2).unwrap(),
        stats: lapse::observe::stats::Stats::default(),
        config: config.sweeper.clone(),
        limiter: lapse::runtime::rate::RateLimiter::new(0),
        lock_timeout: config.database.lock_timeout,
        stock_release: env.config().worker.stock_release,
    };
    let holder = env.db().await;
    hold_row_lock(&holder, ids[10].0).await;

    let report = tokio::time::timeout(Duration::from_secs(10), sweeper.run_once())
        .await
        .expect("the sweep does not wait for the lock")
        .unwrap();
    assert_eq!((report.closed, report.locked), (30, 1), "{report:?}");
    let released_at = release_row_lock(&holder).await;
    let report = sweeper.run_once().await.unwrap();
    assert_eq!((report.closed, report.locked), (1, 0), "{report:?}");
    let closed_at: DateTime<Utc> = db
        .query_one("SELECT closed_at FROM orders WHERE id = $1", &[&ids[10].0])
        .await
        .unwrap()
        .get("closed_at");
    assert!(closed_at > released_at);
    assert_never_early(&db).await;
    assert_eq!(times_closed(&db).await, 0);
    env.cleanup().await;
}

/// Every transaction opened on a pool runs under `database.statement_timeout`, set
/// with `SET LOCAL` (no startup options, no session setting a pooler would hand to
/// another client): a hung call ends with an error, and the session keeps the
/// server's defaults.
#[tokio::test]
async fn every_pooled_transaction_has_a_statement_timeout() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut config = env.config();
    config.database.statement_timeout = Duration::from_millis(1_500);
    let pool = lapse::db::pool(&config.database, 1).unwrap();
    let mut client = pool.get().await.unwrap();
    let show = |setting: &'static str| format!("SHOW {setting}");
    let session: String = client
        .query_one(&show("statement_timeout"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        session, "0",
        "the session itself is left as the server made it"
    );
    let tx = lapse::db::begin(&mut client, pool.limits()).await.unwrap();
    for setting in ["statement_timeout", "idle_in_transaction_session_timeout"] {
        let value: String = tx.query_one(&show(setting), &[]).await.unwrap().get(0);
        assert_eq!(value, "1500ms", "{setting}");
    }
    let started = Instant::now();
    let hung = tx.execute("SELECT pg_sleep(30)", &[]).await;
    let error = hung.expect_err("a hung call ends with an error");
    assert_eq!(
        error.code(),
        Some(&tokio_postgres::error::SqlState::QUERY_CANCELED)
    );
    assert!(started.elapsed() < Duration::from_secs(15));
    drop(tx);
    let short =
        lapse::db::begin_short(&mut client, pool.limits(), Some(Duration::from_millis(700)))
            .await
            .unwrap();
    for (setting, expected) in [
        ("statement_timeout", "1500ms"),
        ("idle_in_transaction_session_timeout", "5s"),
        ("lock_timeout", "700ms"),
    ] {
        let value: String = short.query_one(&show(setting), &[]).await.unwrap().get(0);
        assert_eq!(value, expected, "{setting}");
    }
    drop(short);
    drop(client);
    drop(pool);
    env.cleanup().await;
}

#[tokio::test]
async fn an_application_writing_a_row_that_references_the_order_does_not_defer_its_close() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    // An application's own table that references orders: inserting into it takes a
    // key-share lock on the order's row for as long as its transaction lasts.
    db.batch_execute("CREATE TABLE app_audit (order_id bigint NOT NULL REFERENCES orders (id))")
        .await
        .unwrap();
    let id = create_orders(&mut db, &[Duration::from_secs(2)], &one_line()).await[0].0;
    let holder = env.db().await;
    holder.batch_execute("BEGIN").await.unwrap();
    holder
        .execute("INSERT INTO app_audit (order_id) VALUES ($1)", &[&id])
        .await
        .unwrap();
    let worker = env.start(&env.config()).await;
    eventually(
        Duration::from_secs(30),
        "the order closed while the application's transaction is still open",
        || async {
            (count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await == 1)
                .then_some(())
        },
    )
    .await;
    // The application's transaction was open the whole time, and still commits.
    holder.batch_execute("COMMIT").await.unwrap();
    assert_never_early(&db).await;
    assert_eq!(times_closed(&db).await, 0, "closed once");
    worker.stop().await;
    env.cleanup().await;
}

/// The deliveries around a held one are acknowledged together (a `multiple` ack);
/// the held one must stay unacknowledged at the broker, or a worker stopped while the
/// lock lasts would lose it (the sweeper is off here: only the message can close it).
#[tokio::test]
async fn a_held_delivery_among_acknowledged_ones_survives_a_worker_restart() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    // Created in one run, so their messages sit next to each other in the tier and
    // reach the worker in the same batches; the locked one is in the middle.
    let ids = create_orders(&mut db, &[Duration::from_secs(4); 41], &one_line()).await;
    let locked = ids[20].0;
    let holder = env.db().await;
    hold_row_lock(&holder, locked).await;
    let worker = env.start(&env.config()).await;
    eventually(
        Duration::from_secs(60),
        "the 40 unlocked orders closed and the lock met",
        || async {
            let closed = count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
            (closed == 40 && worker.stats.get(Outcome::Locked) >= 1).then_some(())
        },
    )
    .await;
    worker.stop().await;
    release_row_lock(&holder).await;

    let worker = env.start(&env.config()).await;
    eventually(
        Duration::from_secs(60),
        "the locked order closed by its message after the restart",
        || async {
            let closed = count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
            (closed == 41).then_some(())
        },
    )
    .await;
    assert_never_early(&db).await;
    assert_eq!(times_closed(&db).await, 0, "an order closed twice");
    worker.stop().await;
    env.cleanup().await;
}

/// The same for the releaser: the release events released together are acknowledged
/// together, the one whose order row an application holds is not.
#[tokio::test]
async fn a_held_stock_release_among_acknowledged_ones_survives_a_releaser_restart() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let mut db = env.db().await;
    let ids = create_orders(&mut db, &[Duration::from_millis(300); 41], &one_line()).await;
    let mut config = env.config();
    config.worker.releaser = false;
    config.worker.stock_release = lapse::close::StockRelease::Event;
    let closer = env.start(&config).await;
    crate::release_repair::closed_with_releases_queued(&env, &db, 41, 41).await;
    closer.stop().await;

    let holder = env.db().await;
    hold_row_lock(&holder, ids[20].0).await;
    let releaser_only = crate::helpers::releaser_only(&config);
    let releaser = env.start(&releaser_only).await;
    wait_released(&db, 40).await;
    eventually(Duration::from_secs(30), "the lock met", || async {
        (releaser.stats.get(Outcome::Locked) >= 1).then_some(())
    })
    .await;
    releaser.stop().await;
    release_row_lock(&holder).await;

    let releaser = env.start(&releaser_only).await;
    wait_released(&db, 41).await;
    assert_eq!(crate::helpers::unstamped_closes(&db).await, 0);
    assert_eq!(releaser.stats.get(Outcome::Parked), 0);
    releaser.stop().await;
    env.cleanup().await;
}

/// One closed order whose row an application holds (a late payment in an open
/// transaction) must not stall the stock releases of the orders after it: its event is
/// held back with its own back-off while later batches are released, and `locked`
/// counts that order once, not every retry.
#[tokio::test]
async fn one_locked_order_does_not_stall_the_stock_releases_after_it() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let mut db = env.db().await;
    let first = create_orders(&mut db, &[Duration::from_millis(300)], &one_line()).await[0].0;
    let mut config = env.config();
    config.worker.releaser = false;
    config.worker.stock_release = lapse::close::StockRelease::Event;
    let closer = env.start(&config).await;
    crate::release_repair::closed_with_releases_queued(&env, &db, 1, 1).await;
    closer.stop().await;

    let holder = env.db().await;
    hold_row_lock(&holder, first).await;
    let worker = env.start(&env.config()).await;
    eventually(Duration::from_secs(30), "the locked order met", || async {
        (worker.stats.get(Outcome::Locked) >= 1).then_some(())
    })
    .await;
    // A later order, closed and released while the first one's row is still held.
    let later = create_orders(&mut db, &[Duration::from_millis(300)], &one_line()).await[0].0;
    wait_released(&db, 1).await;
    let released: i64 = db
        .query_one(
            "SELECT count(*) AS n FROM stock_ledger WHERE kind = 'release' AND order_id = $1",
            &[&later],
        )
        .await
        .unwrap()
        .get("n");
    assert_eq!(released, 1, "the later order's stock came back first");
    // The lock lasts a few seconds more: the first order is retried with a back-off
    // and counted once.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(worker.stats.get(Outcome::Locked), 1, "locked counts orders");
    release_row_lock(&holder).await;
    wait_released(&db, 2).await;
    assert_eq!(crate::helpers::unstamped_closes(&db).await, 0);
    assert_eq!(worker.stats.get(Outcome::Parked), 0);
    worker.stop().await;
    env.cleanup().await;
}

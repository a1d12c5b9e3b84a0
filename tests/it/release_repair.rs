//! Stock releases under faults: a database outage while releases are in flight, a
//! release event lost after its close (repaired by the reconciler), and a release
//! that can never succeed (parked alone, the rest released).

use std::time::Duration;

use lapin::options::QueuePurgeOptions;
use lapse::components::sweeper::Sweeper;
use lapse::config::Secret;
use lapse::observe::stats::Outcome;
use lapse::orders::Line;

use crate::helpers::{TestEnv, count, create_orders, eventually, wait_released};
use crate::private_pg::PrivatePostgres;
use crate::queues;

fn line(sku: &str) -> Vec<Line> {
    vec![Line {
        sku: sku.into(),
        qty: 1,
    }]
}

async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) =
        tokio_postgres::connect(&crate::helpers::on_lapse_path(url), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    client
}

/// `orders` closed and `releases` release events relayed into `<P>.stock.release`.
pub async fn closed_with_releases_queued(
    env: &TestEnv,
    db: &tokio_postgres::Client,
    orders: i64,
    releases: u32,
) {
    let queue = env.names().stock_release_queue();
    eventually(
        Duration::from_secs(60),
        "orders closed, release events queued",
        || async {
            let closed = count(db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
            let outbox = count(db, "SELECT count(*) FROM outbox").await;
            let queued = queues::depth(&env.conn, &queue).await;
            (closed == orders && outbox == 0 && queued == Some(releases)).then_some(())
        },
    )
    .await;
}

#[tokio::test]
async fn a_database_outage_during_stock_releases_parks_nothing_and_releases_each_once() {
    let env = TestEnv::new(&["250ms", "1s"]).await;
    // A small delivery budget: giving deliveries back during the outage would spend it.
    env.write_tiers(&["250ms", "1s"], "delivery_limit = 5");
    let pg = PrivatePostgres::start(crate::helpers::free_port());
    let url = pg.url("lapse");
    lapse::db::migrate(&Secret::new(url.clone())).await.unwrap();
    assert!(
        lapse::amqp::topology::apply(&env.conn, &env.topology())
            .await
            .unwrap()
            .ok()
    );
    let mut config = env.config();
    config.database.url = Secret::new(url.clone());
    config.worker.releaser = false;
    config.worker.stock_release = lapse::close::StockRelease::Event;

    let mut db = connect(&url).await;
    create_orders(&mut db, &[Duration::from_millis(300); 200], &line("r")).await;
    let closer = env.start(&config).await;
    closed_with_releases_queued(&env, &db, 200, 200).await;
    closer.stop().await;

    // The releases are pending; the database goes away, then a releaser starts.
    pg.stop_server();
    let releaser_only = crate::helpers::releaser_only(&config);
    let releaser = env.start(&releaser_only).await;
    let queue = env.names().stock_release_queue();
    eventually(
        Duration::from_secs(20),
        "the releaser holds the deliveries",
        || async { (queues::depth(&env.conn, &queue).await == Some(0)).then_some(()) },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await; // the outage
    pg.start_server();

    let db = connect(&url).await;
    wait_released(&db, 200).await;
    assert_eq!(
        count(&db, "SELECT sum(reserved)::bigint FROM stock").await,
        0
    );
    assert_eq!(
        crate::helpers::unstamped_closes(&db).await,
        0,
        "every release stamped its order"
    );
    assert_eq!(
        queues::depth(&env.conn, &env.names().parked()).await,
        Some(0)
    );
    assert_eq!(releaser.stats.get(Outcome::Parked), 0);
    assert!(
        releaser.stats.get(Outcome::ReleaseRetried) > 0,
        "the outage was seen and retried"
    );
    releaser.stop().await;
    drop(db);
    env.cleanup().await;
}

#[tokio::test]
async fn the_reconciler_re_emits_a_lost_stock_release_exactly_once() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let mut config = env.config();
    config.worker.releaser = false;
    config.worker.stock_release = lapse::close::StockRelease::Event;
    let closer = env.start(&config).await;
    let mut db = env.db().await;
    create_orders(&mut db, &[Duration::from_millis(300); 20], &line("w")).await;
    // Orders without lines have nothing to release: the reconciler only stamps them.
    create_orders(&mut db, &[Duration::from_millis(300); 5], &[]).await;
    closed_with_releases_queued(&env, &db, 25, 20).await;
    // The release events are lost.
    let channel = env.conn.create_channel().await.unwrap();
    let purged = channel
        .queue_purge(
            env.names().stock_release_queue().as_str().into(),
            QueuePurgeOptions::default(),
        )
        .await
        .unwrap();
    assert_eq!(purged, 20);

    let mut sweeper_config = config.sweeper.clone();
    sweeper_config.release_grace = Duration::from_millis(500);
    let sweeper = Sweeper {
        retention: Default::default(),
        pool: lapse::db::pool(&env.config().database, 2).unwrap(),
        stats: lapse::observe::stats::Stats::default(),
        config: sweeper_config,
        limiter: lapse::runtime::rate::RateLimiter::new(0),
        lock_timeout: Duration::from_secs(5),
        stock_release: config.worker.stock_release,
    };
    let started = std::time::Instant::now();
    let mut repaired = 0;
    while repaired < 20 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the reconciler re-emitted only {repaired} of 20 lost releases"
        );
        repaired += sweeper.run_once().await.unwrap().releases_repaired;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(repaired, 20, "one repair per lost release");
    assert_eq!(
        sweeper.run_once().await.unwrap().releases_repaired,
        0,
        "a release just re-emitted is not emitted again"
    );

    let releaser = env.start(&env.config()).await;
    wait_released(&db, 20).await;
    assert_eq!(
        count(&db, "SELECT sum(reserved)::bigint FROM stock").await,
        0
    );
    // Past the grace period again: nothing is left to repair.
    eventually(
        Duration::from_secs(10),
        "the grace period passed",
        || async {
            (count(
                &db,
                "SELECT count(*) FROM orders WHERE release_repaired_at > now() - interval '600 ms'",
            )
            .await
                == 0)
                .then_some(())
        },
    )
    .await;
    let again = sweeper.run_once().await.unwrap();
    assert!(again.leader);
    assert_eq!(again.releases_repaired, 0);
    assert_eq!(
        crate::helpers::unstamped_closes(&db).await,
        0,
        "released orders stamped by the releaser, line-less ones by the reconciler"
    );
    assert_eq!(sweeper.stats.get(Outcome::ReleaseRepaired), 20);
    let status = lapse::status::collect(&env.conn, &db, &env.topology())
        .await
        .unwrap();
    assert_eq!(
        (status.recent_release_repairs, status.release_repairs_total),
        (20, 20)
    );
    closer.stop().await;
    releaser.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_release_that_can_never_succeed_is_parked_alone_and_the_rest_release() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let mut db = env.db().await;
    create_orders(&mut db, &[Duration::from_millis(300); 10], &line("fine")).await;
    let bad = create_orders(&mut db, &[Duration::from_millis(300)], &line("broken")).await[0];
    // Someone zeroed the reservation by hand: releasing it would break `reserved >= 0`.
    db.execute("UPDATE stock SET reserved = 0 WHERE sku = 'broken'", &[])
        .await
        .unwrap();
    let worker = env.start(&env.config()).await;
    wait_released(&db, 10).await;
    let reasons =
        queues::drain_reasons(&env.conn, &env.names().parked(), 1, Duration::from_secs(30)).await;
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    assert!(
        reasons[0].contains(&format!("stock release of order {bad} failed"))
            && reasons[0].contains("23514"),
        "{reasons:?}"
    );
    assert_eq!(worker.stats.get(Outcome::Parked), 1);
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM stock_ledger WHERE kind = 'release'"
        )
        .await,
        10
    );
    worker.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_application_holding_a_closed_orders_row_does_not_block_checkout_of_its_sku() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let mut db = env.db().await;
    let ids = create_orders(&mut db, &[Duration::from_millis(300); 2], &line("held")).await;
    let mut config = env.config();
    config.worker.releaser = false;
    config.worker.stock_release = lapse::close::StockRelease::Event;
    // A release waiting on a row lock would hold the SKU's stock lock this long.
    config.database.statement_timeout = Duration::from_secs(120);
    let closer = env.start(&config).await;
    closed_with_releases_queued(&env, &db, 2, 2).await;
    closer.stop().await;

    // The application pays too late inside a transaction it keeps open: it holds the
    // closed order's row lock.
    let app = env.db().await;
    app.batch_execute("BEGIN").await.unwrap();
    let late: String = app
        .query_one("SELECT lapse_pay_order($1) AS outcome", &[&ids[0].0])
        .await
        .unwrap()
        .get("outcome");
    assert_eq!(late, "LATE");

    let releaser_only = crate::helpers::releaser_only(&config);
    let releaser = env.start(&releaser_only).await;
    eventually(
        Duration::from_secs(30),
        "the releaser met the locked order",
        || async {
            let waiting = count(
                &db,
                "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .await;
            (waiting > 0 || releaser.stats.get(Outcome::Locked) > 0).then_some(())
        },
    )
    .await;
    // Checkout of the same SKU goes through while the lock is held.
    let checkout = tokio::time::timeout(
        Duration::from_secs(20),
        create_orders(&mut db, &[Duration::from_secs(60)], &line("held")),
    )
    .await;
    assert!(checkout.is_ok(), "checkout waited for the releaser");
    wait_released(&db, 1).await;

    app.batch_execute("COMMIT").await.unwrap();
    wait_released(&db, 2).await;
    assert_eq!(
        count(&db, "SELECT sum(reserved)::bigint FROM stock").await,
        1,
        "only the new order's reservation is left"
    );
    assert_eq!(crate::helpers::unstamped_closes(&db).await, 0);
    assert_eq!(releaser.stats.get(Outcome::Parked), 0);
    releaser.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn releases_failing_alike_against_a_mismatched_schema_are_held_not_parked() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let mut db = env.db().await;
    create_orders(&mut db, &[Duration::from_millis(300); 10], &line("schema")).await;
    let mut config = env.config();
    config.worker.releaser = false;
    config.worker.stock_release = lapse::close::StockRelease::Event;
    let closer = env.start(&config).await;
    closed_with_releases_queued(&env, &db, 10, 10).await;
    closer.stop().await;
    // A binary newer than the schema: a column it writes is missing.
    db.batch_execute("ALTER TABLE orders RENAME COLUMN released_at TO released_at_later")
        .await
        .unwrap();

    let releaser_only = crate::helpers::releaser_only(&config);
    let releaser = env.start(&releaser_only).await;
    eventually(
        Duration::from_secs(60),
        "the releaser held the failing batch twice, or parked",
        || async {
            let held = releaser.stats.get(Outcome::ReleaseRetried) >= 20;
            (held || releaser.stats.get(Outcome::Parked) > 0).then_some(())
        },
    )
    .await;
    assert_eq!(releaser.stats.get(Outcome::Parked), 0, "nothing parked");
    // The schema catches up: everything is released once.
    db.batch_execute("ALTER TABLE orders RENAME COLUMN released_at_later TO released_at")
        .await
        .unwrap();
    wait_released(&db, 10).await;
    assert_eq!(
        count(&db, "SELECT sum(reserved)::bigint FROM stock").await,
        0
    );
    assert_eq!(releaser.stats.get(Outcome::Parked), 0);
    assert_eq!(
        queues::depth(&env.conn, &env.names().parked()).await,
        Some(0)
    );
    releaser.stop().await;
    env.cleanup().await;
}

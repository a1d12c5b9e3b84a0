//! The durable chain: the sweeper backstop, intents that survive a dead relay and a
//! refusing broker, payments racing the deadline, a large overdue backlog drained at
//! the configured rate, and several workers at once.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::QueuePurgeOptions;
use lapse::observe::stats::Outcome;
use lapse::orders::{self, Line, OrderId, PayOutcome};

use crate::helpers::{
    TestEnv, assert_never_early, count, create_orders, eventually, wait_released,
};

async fn unpaid(db: &tokio_postgres::Client) -> i64 {
    count(db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await
}

fn one_line() -> Vec<Line> {
    vec![Line {
        sku: "widget".into(),
        qty: 1,
    }]
}

#[tokio::test]
async fn the_sweeper_closes_what_a_purge_of_the_wait_queues_lost() {
    let env = TestEnv::with_database(&["1s", "5s"]).await;
    let mut config = env.config();
    config.worker.sweeper = true;
    config.sweeper.interval = Duration::from_secs(1);
    config.sweeper.grace = Duration::from_secs(1);
    // No consumer: a timeout can only be in a wait tier or, once its TTL expired, in
    // the due queue. Purging both until all 100 are gone loses every one of them
    // however slowly a loaded machine relays them.
    config.worker.consumer = false;
    // The purges count messages: one deadline per message, so that 100 means all.
    config.packs.max_entries = 1;
    let worker = env.start(&config).await;
    let mut db = env.db().await;
    create_orders(&mut db, &[Duration::from_secs(5); 100], &one_line()).await;
    let channel = env.conn.create_channel().await.unwrap();
    let queues: Vec<String> = env
        .topology()
        .queues
        .iter()
        .filter(|q| q.name.contains(".wait.") || q.name == env.names().due_queue())
        .map(|q| q.name.clone())
        .collect();
    let mut purged = 0;
    let started = std::time::Instant::now();
    while purged < 100 && started.elapsed() < Duration::from_secs(60) {
        for q in &queues {
            purged += channel
                .queue_purge(q.as_str().into(), QueuePurgeOptions::default())
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(purged, 100, "every timeout was purged");

    eventually(
        Duration::from_secs(30),
        "the sweeper closed every order",
        || async { (unpaid(&db).await == 0).then_some(()) },
    )
    .await;
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM orders WHERE close_reason = 'sweeper'"
        )
        .await,
        100
    );
    assert_eq!(worker.stats.get(Outcome::SweptClosed), 100);
    assert_never_early(&db).await;
    // Within interval + grace of the deadline (plus generous slack for a busy machine).
    let worst = count(
        &db,
        "SELECT max(extract(epoch FROM closed_at - expire_at) * 1000)::bigint FROM orders",
    )
    .await;
    assert!(
        worst < 2_000 + 20_000,
        "swept {worst} ms after the deadline"
    );
    wait_released(&db, 100).await;
    worker.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn intents_survive_a_dead_relay_and_a_broker_refusing_publishes() {
    let env = TestEnv::with_database(&["1s"]).await;
    // A tier that holds 20 messages: the broker refuses (nacks) the rest until it drains.
    env.write_tiers(&["1s"], "max_length = 20");
    let channel = env.conn.create_channel().await.unwrap();
    channel
        .queue_delete(
            format!("{}.wait.1s", env.prefix).as_str().into(),
            Default::default(),
        )
        .await
        .unwrap();
    assert!(
        lapse::amqp::topology::apply(&env.conn, &env.topology())
            .await
            .unwrap()
            .ok()
    );

    // Committed intents with no relay running: as if it died between commit and publish.
    let mut db = env.db().await;
    // Far enough ahead that they still need the 1 s tier when the relay starts, however
    // long a loaded machine takes to create them.
    let deadlines: Vec<Duration> = (0..200u64)
        .map(|i| Duration::from_millis(8_000 + i * 10))
        .collect();
    create_orders(&mut db, &deadlines, &one_line()).await;
    assert_eq!(count(&db, "SELECT count(*) FROM outbox").await, 200);

    // A queue's length limit counts messages: one deadline per message, so that the
    // tier fills up with deadlines.
    let mut config = env.config();
    config.packs.max_entries = 1;
    let worker = env.start(&config).await;
    eventually(Duration::from_secs(60), "every order closed", || async {
        (unpaid(&db).await == 0).then_some(())
    })
    .await;
    assert!(
        worker.stats.get(Outcome::PublishRefused) > 0,
        "the broker refused publishes for a while"
    );
    assert_never_early(&db).await;
    eventually(
        Duration::from_secs(30),
        "outbox drained and stock released",
        || async {
            let drained = count(&db, "SELECT count(*) FROM outbox").await == 0;
            let released = count(
                &db,
                "SELECT count(*) FROM stock_ledger WHERE kind = 'release'",
            )
            .await
                == 200;
            (drained && released).then_some(())
        },
    )
    .await;
    worker.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn payments_racing_the_deadline_never_both_win() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let mut db = env.db().await;
    let lines = vec![
        Line {
            sku: "red".into(),
            qty: 2,
        },
        Line {
            sku: "blue".into(),
            qty: 1,
        },
    ];
    // Far enough ahead that creating them all on a loaded machine does not use up the
    // time before the first deadline.
    let deadlines: Vec<Duration> = (0..2000u64)
        .map(|i| Duration::from_millis(6_000 + i * 2))
        .collect();
    let ids = create_orders(&mut db, &deadlines, &lines).await;
    let initial: i64 = count(
        &db,
        "SELECT sum(available + reserved + sold)::bigint FROM stock",
    )
    .await;
    let worker = env.start(&env.config()).await;

    let pool = lapse::db::app_pool(&env.config().database, 16).unwrap();
    let deadlines: Vec<(i64, chrono::DateTime<chrono::Utc>)> = db
        .query("SELECT id, expire_at FROM orders ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get("id"), r.get("expire_at")))
        .collect();
    assert_eq!(deadlines.len(), ids.len());
    // Refused payments (LATE after the close, EXPIRED before it): each is recorded once.
    let refused = Arc::new(std::sync::atomic::AtomicI64::new(0));
    let mut payments = tokio::task::JoinSet::new();
    for (i, (id, expire_at)) in deadlines.into_iter().enumerate() {
        // Fire within ±50 ms of the deadline (by this machine's clock, which is the
        // database's); every tenth a second early, so that the race has both outcomes
        // however late a loaded machine wakes the others.
        let offset = if i % 10 == 0 {
            chrono::Duration::milliseconds(-1_000)
        } else {
            chrono::Duration::milliseconds((i as i64 * 37) % 101 - 50)
        };
        let (pool, refused) = (pool.clone(), refused.clone());
        payments.spawn(async move {
            let wait = (expire_at + offset - chrono::Utc::now())
                .to_std()
                .unwrap_or_default();
            tokio::time::sleep(wait).await;
            // 2,000 payments share 16 connections: on a loaded machine a wait for one
            // may time out; the payment is then simply made later.
            let client = loop {
                if let Ok(client) = pool.get().await {
                    break client;
                }
            };
            let outcome = orders::pay(&**client, OrderId(id)).await.unwrap();
            if matches!(outcome, PayOutcome::Late | PayOutcome::Expired) {
                refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            outcome
        });
    }
    let mut paid = 0;
    while let Some(outcome) = payments.join_next().await {
        if outcome.unwrap() == PayOutcome::Paid {
            paid += 1;
        }
    }
    eventually(Duration::from_secs(60), "every order settled", || async {
        (unpaid(&db).await == 0).then_some(())
    })
    .await;

    let closed = count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
    assert_eq!(
        count(&db, "SELECT count(*) FROM orders WHERE status = 'PAID'").await,
        paid
    );
    assert_eq!(paid + closed, 2000);
    assert!(
        paid > 0 && closed > 0,
        "the race had both outcomes: {paid} paid, {closed} closed"
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM orders WHERE status = 'PAID' AND paid_at >= expire_at"
        )
        .await,
        0
    );
    assert_never_early(&db).await;
    wait_released(&db, 2 * closed).await;
    let paid_released = count(
        &db,
        "SELECT count(*) FROM stock_ledger l JOIN orders o ON o.id = l.order_id WHERE o.status = 'PAID' AND l.kind = 'release'",
    )
    .await;
    assert_eq!(paid_released, 0);
    assert_eq!(
        count(
            &db,
            "SELECT sum(available + reserved + sold)::bigint FROM stock"
        )
        .await,
        initial
    );
    assert_eq!(
        count(&db, "SELECT sum(reserved)::bigint FROM stock").await,
        0
    );
    let late_rows = count(&db, "SELECT count(*) FROM late_payments").await;
    assert_eq!(
        late_rows,
        refused.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert_eq!(
        count(&db, "SELECT count(*) FROM late_payments p JOIN orders o ON o.id = p.order_id WHERE o.status <> 'CLOSED'").await,
        0
    );
    println!("payment race: {paid} paid, {closed} closed, {late_rows} late payments recorded");
    worker.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn two_workers_with_two_relays_have_no_double_effects() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let mut config = env.config();
    config.worker.sweeper = true;
    config.sweeper.interval = Duration::from_millis(500);
    config.sweeper.grace = Duration::from_millis(300);
    let first = env.start(&config).await;
    let second = env.start(&config).await;
    let mut db = env.db().await;
    let lines = vec![
        Line {
            sku: "p".into(),
            qty: 1,
        },
        Line {
            sku: "q".into(),
            qty: 3,
        },
    ];
    let deadlines: Vec<Duration> = (0..2000u64)
        .map(|i| Duration::from_millis(500 + (i * 7) % 2500))
        .collect();
    create_orders(&mut db, &deadlines, &lines).await;
    eventually(Duration::from_secs(60), "every order closed", || async {
        (unpaid(&db).await == 0).then_some(())
    })
    .await;
    wait_released(&db, 4000).await;
    let twice = count(
        &db,
        "SELECT count(*) FROM (SELECT order_id FROM order_events WHERE event = 'closed' GROUP BY order_id HAVING count(*) > 1) d",
    )
    .await;
    assert_eq!(twice, 0);
    let closes = first.stats.get(Outcome::Closed)
        + second.stats.get(Outcome::Closed)
        + first.stats.get(Outcome::SweptClosed)
        + second.stats.get(Outcome::SweptClosed);
    assert_eq!(closes, 2000);
    assert!(
        first.stats.get(Outcome::Relayed) > 0 && second.stats.get(Outcome::Relayed) > 0,
        "both relays worked"
    );
    assert_eq!(
        count(&db, "SELECT sum(reserved)::bigint FROM stock").await,
        0
    );
    assert_never_early(&db).await;
    first.stop().await;
    second.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn one_sweeper_leads_at_a_time_and_a_stuck_outbox_is_reported() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    create_orders(&mut db, &[Duration::from_millis(100); 30], &one_line()).await;
    tokio::time::sleep(Duration::from_millis(1_000)).await; // overdue, and no relay ran
    let mut config = env.config().sweeper;
    config.grace = Duration::from_millis(50);
    // Between the intents' age and the age of the release rows the sweep itself writes
    // (its duration, which a loaded machine stretches).
    config.stuck_outbox_after = Duration::from_millis(700);
    config.batch_size = 7; // several keyset pages
    let sweeper = lapse::components::sweeper::Sweeper {
        retention: Default::default(),
        pool: lapse::db::pool(&env.config().database, 2).unwrap(),
        stats: lapse::observe::stats::Stats::default(),
        config,
        limiter: lapse::runtime::rate::RateLimiter::new(0),
        lock_timeout: Duration::from_secs(5),
        stock_release: env.config().worker.stock_release,
    };
    // Another sweeper holds a live lease: this one does nothing.
    let other = env.db().await;
    other
        .execute(
            "INSERT INTO lapse_leader_leases (name, holder, epoch, expires_at)
             VALUES ('sweeper', 'another worker', 1, clock_timestamp() + interval '1 hour')",
            &[],
        )
        .await
        .unwrap();
    let report = sweeper.run_once().await.unwrap();
    assert!(!report.leader);
    assert_eq!(unpaid(&db).await, 30);
    // Its lease ran out: this one leads.
    other
        .execute(
            "UPDATE lapse_leader_leases SET expires_at = clock_timestamp() WHERE name = 'sweeper'",
            &[],
        )
        .await
        .unwrap();

    let report = sweeper.run_once().await.unwrap();
    assert!(report.leader);
    assert_eq!((report.scanned, report.closed), (30, 30));
    assert_eq!(report.stuck_outbox, 30, "30 timeout intents never relayed");
    assert_eq!(unpaid(&db).await, 0);
    assert_eq!(sweeper.stats.get(Outcome::SweptClosed), 30);
    env.cleanup().await;
}

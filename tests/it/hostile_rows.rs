//! Hostile values already stored or in flight: order rows with a deadline the
//! components cannot handle (written before the deadline rules existed) and outbox
//! payloads that are not timeout intents. Each is parked or skipped with a reason and
//! counted while everything else keeps working.

use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions};
use lapin::types::FieldTable;
use lapse::amqp::broker::Publisher;
use lapse::message::park_reason;
use lapse::observe::stats::Outcome;
use lapse::orders::Line;
use serde_json::Value;

use crate::helpers::{TestEnv, count, create_orders, eventually, stderr, stdout};

fn one_line() -> Vec<Line> {
    vec![Line {
        sku: "tea".into(),
        qty: 1,
    }]
}

/// Takes `n` messages from the parked queue; returns their park reasons.
async fn parked_reasons(env: &TestEnv, n: usize) -> Vec<String> {
    let channel = env.conn.create_channel().await.unwrap();
    let mut parked = channel
        .basic_consume(
            env.names().parked().as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut reasons = Vec::new();
    for _ in 0..n {
        let d = tokio::time::timeout(Duration::from_secs(30), parked.next())
            .await
            .expect("a parked message")
            .unwrap()
            .unwrap();
        reasons.push(park_reason(d.properties.headers().as_ref()).unwrap_or_default());
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    let _ = channel.close(200, "done".into()).await;
    reasons.sort();
    reasons
}

#[tokio::test]
async fn the_relay_parks_an_outbox_payload_that_is_not_a_timeout_intent() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    create_orders(&mut db, &[Duration::from_secs(60)], &[]).await;
    db.batch_execute(
        r#"INSERT INTO outbox (kind, order_id, payload) VALUES
             ('timeout', 1, '[1, 2]'),
             ('timeout', 1, '"text"'),
             ('timeout', 1, '{"order_id": 1}'),
             ('timeout', 1, '{"order_id": 1, "expire_at": "+10000-01-01T00:00:00.000Z", "deadline_version": 1}')"#,
    )
    .await
    .unwrap();
    let config = env.config();
    let relay = lapse::components::relay::Relay::new(
        &config,
        lapse::db::pool(&env.config().database, 2).unwrap(),
        config.tier_file().unwrap().tiers,
        lapse::observe::stats::Stats::default(),
    );
    let publisher = Publisher::new(&env.conn).await.unwrap();
    let outcome = relay.run_once(&env.conn, &publisher).await.unwrap();
    assert_eq!(
        outcome,
        lapse::components::relay::RelayOutcome::Published {
            sent: 5,
            refused: 0,
            returned: 0,
        }
    );
    assert_eq!(count(&db, "SELECT count(*) FROM outbox").await, 0);
    let reasons = parked_reasons(&env, 4).await;
    for reason in &reasons {
        assert!(reason.contains("is not a timeout intent"), "{reasons:?}");
    }
    assert_eq!(
        reasons
            .iter()
            .filter(|r| r.contains("not a JSON object"))
            .count(),
        2,
        "{reasons:?}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn the_sweeper_skips_rows_it_cannot_handle_and_keeps_sweeping() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = env.db().await;
    // Rows written before the deadline rules existed.
    db.batch_execute(
        "ALTER TABLE orders DROP CONSTRAINT orders_expire_at_in_range;
         INSERT INTO orders (expire_at) VALUES ('-infinity'), ('2000-01-01 BC'),
                (now() - interval '1 minute'), (now() - interval '2 minutes'), ('infinity');",
    )
    .await
    .unwrap();
    let mut config = env.config().sweeper;
    config.grace = Duration::from_millis(50);
    config.batch_size = 1; // the unreadable rows come first: pagination must pass them
    let sweeper = lapse::components::sweeper::Sweeper {
        retention: Default::default(),
        pool: lapse::db::pool(&env.config().database, 2).unwrap(),
        stats: lapse::observe::stats::Stats::default(),
        config,
        limiter: lapse::runtime::rate::RateLimiter::new(0),
        lock_timeout: Duration::from_secs(5),
        stock_release: env.config().worker.stock_release,
    };
    for _ in 0..2 {
        let report = sweeper.run_once().await.unwrap();
        assert_eq!(report.unreadable, 2, "{report:?}");
    }
    assert_eq!(sweeper.stats.get(Outcome::SweptClosed), 2);
    assert_eq!(
        count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await,
        2
    );
    let status = env.lapse(&["status", "--json"]);
    assert!(status.status.success(), "{}", stderr(&status));
    let status: Value = serde_json::from_str(&stdout(&status)).unwrap();
    assert_eq!(status["unreadable_deadlines"], 3, "{status}");
    env.cleanup().await;
}

#[tokio::test]
async fn a_poisoned_order_is_parked_with_a_reason_while_the_others_close() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    let ids = create_orders(&mut db, &[Duration::from_millis(1500); 21], &one_line()).await;
    let poisoned = ids[10];
    // The intent is already written; the row then gets a legacy value.
    db.batch_execute(&format!(
        "ALTER TABLE orders DROP CONSTRAINT orders_expire_at_in_range;
         UPDATE orders SET expire_at = '-infinity' WHERE id = {poisoned};"
    ))
    .await
    .unwrap();
    let mut config = env.config();
    config.worker.sweeper = true;
    config.sweeper.interval = Duration::from_millis(500);
    let worker = env.start(&config).await;
    eventually(
        Duration::from_secs(60),
        "the 20 other orders closed",
        || async {
            (count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await == 20)
                .then_some(())
        },
    )
    .await;
    let reasons = parked_reasons(&env, 1).await;
    assert!(
        reasons[0].contains(&format!(
            "order {poisoned} has a deadline lapse cannot handle"
        )),
        "{reasons:?}"
    );
    assert!(reasons[0].contains("-infinity"), "{reasons:?}");
    assert_eq!(worker.stats.get(Outcome::Parked), 1);

    // The worker keeps closing.
    let more = create_orders(&mut db, &[Duration::from_millis(500); 5], &one_line()).await;
    eventually(Duration::from_secs(60), "later orders closed", || async {
        (count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await == 25)
            .then_some(())
    })
    .await;
    assert_eq!(more.len(), 5);

    let shown = env.lapse(&["order", "show", &poisoned.to_string()]);
    assert_eq!(shown.status.code(), Some(1), "{}", stderr(&shown));
    assert!(
        stderr(&shown).contains("deadline lapse cannot handle (-infinity)"),
        "{}",
        stderr(&shown)
    );
    let status = env.lapse(&["status", "--json"]);
    assert!(status.status.success(), "{}", stderr(&status));
    let status: Value = serde_json::from_str(&stdout(&status)).unwrap();
    assert_eq!(status["unreadable_deadlines"], 1, "{status}");
    assert_eq!(status["overdue_unpaid"], 0, "{status}");
    worker.stop().await;
    env.cleanup().await;
}

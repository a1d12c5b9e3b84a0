//! Giving messages back without leaning on the broker's delivery limit: the worker
//! keeps a delivery whose publish a full tier refused (instead of a requeue that
//! spends its `x-delivery-limit`), and `redelivery::give_back` counts returns itself
//! and parks at lapse's own limit.

use std::time::Duration;

use lapin::BasicProperties;
use lapin::options::{BasicGetOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapse::amqp::broker::Endpoint;
use lapse::amqp::publishing::PublishingConnection;
use lapse::amqp::redelivery::{self, GiveBack, ReturnLimit};
use lapse::amqp::topology::ArgValue;
use lapse::amqp::topology::field_table;
use lapse::config::Secret;
use lapse::message::park_reason;
use lapse::observe::stats::Outcome;
use lapse::orders::Line;
use lapse::runtime::health::Health;

use crate::helpers::{TestEnv, amqp_url, assert_never_early, count, create_orders, eventually};

/// Messages ready in `queue` (a passive declare).
async fn depth(env: &TestEnv, queue: &str) -> u32 {
    let channel = env.conn.create_channel().await.unwrap();
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap()
        .message_count()
}

#[tokio::test]
async fn a_tier_refusing_redelays_never_spends_a_delivery_and_parks_nothing() {
    let env = TestEnv::with_database(&["1s", "3s"]).await;
    // A due queue that dead-letters a message on its second delivery: one requeue of a
    // refused re-delay would park it.
    env.write_tiers(&["1s", "3s"], "delivery_limit = 1");
    let names = env.names();
    let wait_1s = format!("{}.wait.1s", env.prefix);
    let channel = env.conn.create_channel().await.unwrap();
    for queue in [
        wait_1s.clone(),
        names.due_queue(),
        names.stock_release_queue(),
    ] {
        channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    let topology = env.topology();
    assert!(
        lapse::amqp::topology::apply(&env.conn, &topology)
            .await
            .unwrap()
            .ok()
    );
    // The 1 s tier refuses every publish, as a full tier does (reject-publish).
    channel
        .queue_delete(wait_1s.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let spec = topology.queues.iter().find(|q| q.name == wait_1s).unwrap();
    let mut args = spec.arguments.clone();
    args.insert("x-max-length".into(), ArgValue::Int(0));
    channel
        .queue_declare(
            wait_1s.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            field_table(&args),
        )
        .await
        .unwrap();
    for b in topology.bindings.iter().filter(|b| b.queue == wait_1s) {
        channel
            .queue_bind(
                b.queue.as_str().into(),
                b.exchange.as_str().into(),
                b.routing_key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
    }

    // A quorum queue at its length limit of 0 still takes a publish while it is empty:
    // one deadline per message, so that most re-delays meet the refusal.
    let mut config = env.config();
    config.packs.max_entries = 1;
    let worker = env.start(&config).await;
    let mut db = env.db().await;
    // One 3 s hop, then ~2.5 s left: the worker's re-delay to the 1 s tier is refused
    // until the order is due and closed without one. The relay may publish up to ~1.5 s
    // late on a loaded machine and still leave more than the 1 s tier to re-delay on.
    let deadlines: Vec<Duration> = (0..30u64)
        .map(|i| Duration::from_millis(5_500 + i * 10))
        .collect();
    let line = vec![Line {
        sku: "tier".into(),
        qty: 1,
    }];
    create_orders(&mut db, &deadlines, &line).await;
    eventually(Duration::from_secs(60), "every order closed", || async {
        let open = count(&db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await;
        let parked = depth(&env, &names.parked()).await;
        assert_eq!(parked, 0, "a refused re-delay must never end parked");
        (open == 0).then_some(())
    })
    .await;
    assert_never_early(&db).await;
    assert!(
        worker.stats.get(Outcome::PublishRefused) > 0,
        "the tier refused the worker's re-delays: {:?}",
        worker.stats.summary()
    );
    assert_eq!(depth(&env, &names.parked()).await, 0);
    worker.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn give_back_counts_its_own_returns_and_parks_at_lapses_limit() {
    let env = TestEnv::new(&["1s"]).await;
    assert!(
        lapse::amqp::topology::apply(&env.conn, &env.topology())
            .await
            .unwrap()
            .ok()
    );
    let names = env.names();
    let queue = names.stock_release_queue();
    let endpoint = Endpoint::new(Secret::new(amqp_url()));
    let name = format!("lapse test publish {}", env.prefix);
    let mut publishing = PublishingConnection::open(&endpoint, &name, "test", &Health::default())
        .await
        .unwrap();
    publishing
        .publish(lapse::amqp::broker::Outgoing::new(
            "",
            queue.as_str(),
            br#"{"order_id":7}"#.to_vec(),
            BasicProperties::default(),
        ))
        .await
        .unwrap();

    let channel = env.conn.create_channel().await.unwrap();
    let get = || async {
        eventually(Duration::from_secs(10), "a message to get", || async {
            channel
                .basic_get(queue.as_str().into(), BasicGetOptions::default())
                .await
                .unwrap()
        })
        .await
    };
    let limit = ReturnLimit(2);
    for expected in 1..=2 {
        let message = get().await;
        let verdict = redelivery::give_back(
            &mut publishing,
            &message.delivery,
            &queue,
            &names.parked(),
            limit,
            "database unavailable",
        )
        .await
        .unwrap();
        assert_eq!(verdict, GiveBack::Requeue { returns: expected });
    }
    let message = get().await;
    assert_eq!(redelivery::returns_so_far(&message.delivery.properties), 2);
    let verdict = redelivery::give_back(
        &mut publishing,
        &message.delivery,
        &queue,
        &names.parked(),
        limit,
        "database unavailable",
    )
    .await
    .unwrap();
    assert!(matches!(verdict, GiveBack::Park { .. }), "{verdict:?}");

    let parked = eventually(Duration::from_secs(10), "the parked copy", || async {
        channel
            .basic_get(names.parked().as_str().into(), BasicGetOptions::default())
            .await
            .unwrap()
    })
    .await;
    assert_eq!(parked.delivery.data, br#"{"order_id":7}"#);
    let reason = park_reason(parked.delivery.properties.headers().as_ref()).unwrap();
    assert!(
        reason.contains("given back 2 times") && reason.contains("database unavailable"),
        "{reason}"
    );
    // Every original was acknowledged: nothing is left behind.
    drop(channel);
    assert_eq!(depth(&env, &queue).await, 0);
    publishing.close().await;
    env.cleanup().await;
}

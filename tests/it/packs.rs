//! Packs (docs/pipeline.md, "Packs"): one timeout message carrying many deadlines.
//! Each entry is decided alone — closed, held, re-delayed, acknowledged as stale or
//! missing, parked — and a pack is never all-or-nothing for one entry's sake.

use std::time::Duration;

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use lapin::options::{BasicAckOptions, BasicGetOptions};

use lapse::amqp::broker::Publisher;
use lapse::message::{PARK_CAUSE_HEADER, TimeoutMessage, header_text};
use lapse::names::DUE_ROUTING_KEY;
use lapse::observe::stats::Outcome;
use lapse::orders::{self, Deadline, OrderId};
use lapse::pack;

use crate::helpers::{TestEnv, assert_never_early, count, create_orders, eventually, wait_closed};
use crate::parked::{json_out, list, park};

/// Each order's timeout as its relay would write it, from the database.
async fn timeouts(db: &tokio_postgres::Client, ids: &[OrderId]) -> Vec<TimeoutMessage> {
    let mut out = Vec::new();
    for id in ids {
        let view = orders::show(db, *id).await.unwrap().unwrap();
        out.push(TimeoutMessage::new(
            id.0,
            view.expire_at,
            view.deadline_version,
        ));
    }
    out
}

fn packed(bodies: &[Vec<u8>]) -> Vec<u8> {
    let refs: Vec<&[u8]> = bodies.iter().map(Vec::as_slice).collect();
    pack::body(&refs)
}

async fn publish_due(env: &TestEnv, body: &[u8]) {
    let publisher = Publisher::new(&env.conn).await.unwrap();
    publisher
        .publish(
            &env.names().due_exchange(),
            DUE_ROUTING_KEY,
            body,
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap();
}

/// Every message on the parked queue (taken off it), with its cause header.
async fn drain_parked(env: &TestEnv) -> Vec<(Vec<u8>, String)> {
    let channel = env.conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    while let Some(m) = channel
        .basic_get(
            env.names().parked().as_str().into(),
            BasicGetOptions::default(),
        )
        .await
        .unwrap()
    {
        let cause =
            header_text(m.properties.headers().as_ref(), PARK_CAUSE_HEADER).unwrap_or_default();
        out.push((m.data.clone(), cause));
        m.ack(BasicAckOptions::default()).await.unwrap();
    }
    out
}

async fn closed_events(db: &tokio_postgres::Client) -> i64 {
    count(
        db,
        "SELECT count(*) FROM order_events WHERE event = 'closed'",
    )
    .await
}

/// One pack carrying due entries, entries still seconds away, a stale entry (its
/// order's deadline was extended), a missing order, a malformed entry, and the same
/// entry twice (and again in a second pack): every order closes once, at or after
/// its deadline; the malformed entry alone is parked, as its own body.
#[tokio::test]
async fn each_entry_of_a_pack_is_decided_alone_and_a_bad_one_is_parked_alone() {
    let env = TestEnv::with_database(&["1s", "5s"]).await;
    let mut db = env.db().await;
    let mut deadlines = vec![Duration::from_millis(300); 10];
    deadlines.extend([Duration::from_millis(2_500); 10]);
    deadlines.push(Duration::from_secs(60));
    let ids = create_orders(&mut db, &deadlines, &[]).await;
    let mut messages = timeouts(&db, &ids).await;
    // The last order's deadline moves later: its timeout in the pack is stale.
    let extended = ids[20];
    orders::extend(&db, extended, Deadline::In(Duration::from_secs(120)))
        .await
        .unwrap()
        .expect("extended");
    let mut bodies: Vec<Vec<u8>> = messages.iter().map(TimeoutMessage::encode).collect();
    let malformed = br#"{"v":1,"order_id":"not a number"}"#.to_vec();
    bodies.insert(3, malformed.clone());
    bodies.push(TimeoutMessage::new(987_654_321, Utc::now(), 1).encode());
    bodies.push(messages[0].encode());
    bodies.push(messages[15].encode());
    // Only these packs: no relay publishing the orders' own intents.
    publish_due(&env, &packed(&bodies)).await;
    messages.truncate(2);
    publish_due(&env, &packed(&[messages[0].encode(), messages[1].encode()])).await;
    let mut config = env.config();
    config.worker.relay = false;
    let worker = env.start(&config).await;
    wait_closed(&db, 20, Duration::from_secs(60)).await;
    eventually(
        Duration::from_secs(20),
        "the missing order acknowledged",
        || async { (worker.stats.get(Outcome::Missing) == 1).then_some(()) },
    )
    .await;
    eventually(Duration::from_secs(20), "the bad entry parked", || async {
        (worker.stats.get(Outcome::Parked) == 1).then_some(())
    })
    .await;
    assert_never_early(&db).await;
    assert_eq!(closed_events(&db).await, 20, "each order closed once");
    assert_eq!(
        orders::show(&db, extended).await.unwrap().unwrap().status,
        "UNPAID",
        "a stale entry does not close its order"
    );
    assert!(worker.stats.get(Outcome::Stale) >= 1);
    let parked = drain_parked(&env).await;
    assert_eq!(parked, vec![(malformed, "undecodable".to_string())]);
    worker.stop().await;
    drop(db);
    env.cleanup().await;
}

/// A pack of 10,000 entries (the most a pack may carry) closes every order once.
#[tokio::test]
async fn a_pack_of_ten_thousand_entries_closes_every_order_once() {
    let env = TestEnv::with_database(&["1s", "5s"]).await;
    let db = env.db().await;
    // Orders written in one statement, due in 2 s (their intents stay in the outbox:
    // the relay is off, the pack is the only timeout).
    let made = db
        .query(
            "SELECT lapse_create_order(clock_timestamp() + interval '2 seconds', '[]'::jsonb) AS id
               FROM generate_series(1, 10000)",
            &[],
        )
        .await
        .unwrap();
    let made: Vec<i64> = made.iter().map(|r| r.get("id")).collect();
    let rows = db
        .query(
            "SELECT id, expire_at, deadline_version FROM orders WHERE id = ANY($1)",
            &[&made],
        )
        .await
        .unwrap();
    let bodies: Vec<Vec<u8>> = rows
        .iter()
        .map(|r| {
            let at: DateTime<Utc> = r.get("expire_at");
            TimeoutMessage::new(r.get("id"), at, r.get("deadline_version")).encode()
        })
        .collect();
    assert_eq!(bodies.len(), 10_000);
    publish_due(&env, &packed(&bodies)).await;
    let mut config = env.config();
    config.worker.relay = false;
    let worker = env.start(&config).await;
    wait_closed(&db, 10_000, Duration::from_secs(120)).await;
    assert_never_early(&db).await;
    assert_eq!(closed_events(&db).await, 10_000);
    worker.stop().await;
    drop(db);
    env.cleanup().await;
}

/// A worker stopped after closing the due half of a pack, while it holds the other
/// half: the broker hands the whole pack out again, the closed half is settled, the
/// held half closes at its deadline, once.
#[tokio::test]
async fn a_worker_stopped_between_closing_half_a_pack_and_acknowledging_it_loses_nothing() {
    let env = TestEnv::with_database(&["10s", "1m"]).await;
    let mut db = env.db().await;
    let mut deadlines = vec![Duration::from_millis(200); 10];
    deadlines.extend([Duration::from_secs(6); 10]);
    let ids = create_orders(&mut db, &deadlines, &[]).await;
    let messages = timeouts(&db, &ids).await;
    let bodies: Vec<Vec<u8>> = messages.iter().map(TimeoutMessage::encode).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    publish_due(&env, &packed(&bodies)).await;
    let mut config = env.config();
    config.worker.relay = false;
    let first = env.start(&config).await;
    wait_closed(&db, 10, Duration::from_secs(20)).await;
    // The pack is held (one hold of the delivery) with the other half in it.
    eventually(Duration::from_secs(5), "the other half held", || async {
        (first.stats.get(Outcome::Held) >= 1).then_some(())
    })
    .await;
    assert_eq!(
        count(&db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await,
        10
    );
    first.stop().await;
    let second = env.start(&config).await;
    wait_closed(&db, 20, Duration::from_secs(60)).await;
    assert_never_early(&db).await;
    assert_eq!(closed_events(&db).await, 20, "each order closed once");
    second.stop().await;
    drop(db);
    env.cleanup().await;
}

/// A pack parked whole (by the broker's delivery limit, or a worker older than packs)
/// is listed as one timeout and replayed whole; the worker then closes each entry.
#[tokio::test]
async fn a_pack_parked_whole_is_listed_and_replayed() {
    let env = TestEnv::with_database(&["1s", "1m"]).await;
    let mut db = env.db().await;
    let ids = create_orders(&mut db, &[Duration::from_millis(500); 5], &[]).await;
    let messages = timeouts(&db, &ids).await;
    let bodies: Vec<Vec<u8>> = messages.iter().map(TimeoutMessage::encode).collect();
    park(&env, &packed(&bodies), "delivery limit").await;
    let listed = list(&env);
    assert_eq!(listed.len(), 1, "{listed:?}");
    let id = listed[0]["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("pack-") && id.contains("-n5-"), "{id}");
    assert_eq!(listed[0]["kind"], "timeout");
    let mut config = env.config();
    config.worker.relay = false;
    let worker = env.start(&config).await;
    let done = json_out(&env.lapse(&["parked", "replay", &id, "--json"]));
    assert_eq!(done["messages"][0]["outcome"], "replayed", "{done}");
    wait_closed(&db, 5, Duration::from_secs(30)).await;
    assert_never_early(&db).await;
    assert_eq!(closed_events(&db).await, 5);
    worker.stop().await;
    drop(db);
    env.cleanup().await;
}

/// A pack a worker older than packs parked, and its archiver booked as unreadable
/// (it could not read version 3): this version reads it as a timeout and replays it.
#[tokio::test]
async fn a_pack_booked_as_unreadable_by_an_older_worker_is_replayed() {
    let env = TestEnv::with_database(&["1s", "1m"]).await;
    let mut db = env.db().await;
    let ids = create_orders(&mut db, &[Duration::from_millis(500); 3], &[]).await;
    let messages = timeouts(&db, &ids).await;
    let body = packed(
        &messages
            .iter()
            .map(TimeoutMessage::encode)
            .collect::<Vec<_>>(),
    );
    db.execute(
        "INSERT INTO lapse_parked (prefix, fingerprint, id, kind, cause, reason, reason_source,
                                   exchange, routing_key, body)
         VALUES ($1, 'older', 'raw-00000000000000aa', 'unreadable', 'undecodable',
                 'unknown message version 3 (this worker understands 1 and 2)', 'lapse',
                 $2, 'due', $3)",
        &[&env.prefix, &env.names().due_exchange(), &body],
    )
    .await
    .unwrap();
    let listed = list(&env);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["kind"], "timeout", "{listed:?}");
    let mut config = env.config();
    config.worker.relay = false;
    let worker = env.start(&config).await;
    let done = json_out(&env.lapse(&["parked", "replay", "--all", "--json"]));
    assert_eq!(done["messages"][0]["outcome"], "replayed", "{done}");
    wait_closed(&db, 3, Duration::from_secs(30)).await;
    assert_never_early(&db).await;
    assert_eq!(closed_events(&db).await, 3);
    worker.stop().await;
    drop(db);
    env.cleanup().await;
}

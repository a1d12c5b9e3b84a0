//! `lapse parked replay` against the real broker and database: a replay leaves parked
//! only after its destination confirmed; a timeout closes its order, a release
//! releases stock once; a pass the broker stops confirming (an alarm) loses nothing.

use std::time::Duration;

use chrono::Utc;
use lapin::options::QueuePurgeOptions;
use serde_json::Value;

use lapse::orders::Line;

use crate::helpers::{TestEnv, count, create_orders, eventually, stdout, wait_released};
use crate::parked::{applied, json_out, list, park, timeout};
use crate::queues;
#[tokio::test]
async fn a_replay_to_a_missing_tier_stays_parked_until_the_tier_is_back() {
    let env = applied(&["1s", "1m"]).await;
    let wait = env
        .names()
        .wait_queue(lapse::tier::Tier::parse("1m").unwrap());
    queues::delete(&env.conn, &wait).await;
    let expire_at = Utc::now() + chrono::Duration::minutes(5);
    park(
        &env,
        &timeout(7, expire_at, 1).encode(),
        "database unavailable",
    )
    .await;

    let refused = env.lapse(&["parked", "replay", "timeout-7-v1"]);
    assert_eq!(refused.status.code(), Some(1), "{}", stdout(&refused));
    assert!(
        stdout(&refused).contains("topology apply"),
        "{}",
        stdout(&refused)
    );
    assert_eq!(list(&env).len(), 1, "still parked");
    let unknown = env.lapse(&["parked", "replay", "timeout-8-v1"]);
    assert_eq!(unknown.status.code(), Some(1));

    let report = lapse::amqp::topology::apply(&env.conn, &env.topology())
        .await
        .unwrap();
    assert!(report.ok());
    let replayed = json_out(&env.lapse(&["parked", "replay", "timeout-7-v1", "--json"]));
    assert_eq!(replayed["messages"][0]["outcome"], "replayed", "{replayed}");
    assert!(list(&env).is_empty());
    assert_eq!(queues::depth(&env.conn, &wait).await, Some(1));

    // A destination that confirms but routes nowhere (the due queue deleted): the
    // broker returns the publish, so the message stays parked and says why.
    queues::delete(&env.conn, &env.names().due_queue()).await;
    let overdue = Utc::now() - chrono::Duration::seconds(5);
    park(
        &env,
        &timeout(9, overdue, 3).encode(),
        "database unavailable",
    )
    .await;
    let failed = env.lapse(&["parked", "replay", "--all", "--json"]);
    assert_eq!(failed.status.code(), Some(1));
    let failed: Value = serde_json::from_str(&stdout(&failed)).unwrap();
    assert_eq!(failed["messages"][0]["outcome"], "failed", "{failed}");
    let error = failed["messages"][0]["error"].as_str().unwrap();
    assert!(error.contains("unroutable"), "{error}");
    let left = list(&env);
    assert_eq!(left.len(), 1);
    assert_eq!(left[0]["id"], "timeout-9-v3");
    assert_eq!(left[0]["reason"], "database unavailable");
    env.cleanup().await;
}

#[tokio::test]
async fn a_replayed_timeout_closes_its_order_and_dry_run_and_reason_select() {
    let env = TestEnv::with_database(&["1s", "1m"]).await;
    let mut db = env.db().await;
    let lines = [Line {
        sku: "tea".into(),
        qty: 1,
    }];
    let ids: Vec<i64> = create_orders(
        &mut db,
        &[Duration::from_secs(1), Duration::from_secs(600)],
        &lines,
    )
    .await
    .into_iter()
    .map(|id| id.0)
    .collect();
    for (id, reason) in [
        (ids[0], "database unavailable after 5 attempts"),
        (ids[1], "other"),
    ] {
        let row = db
            .query_one(
                "SELECT expire_at, deadline_version FROM orders WHERE id = $1",
                &[&id],
            )
            .await
            .unwrap();
        park(
            &env,
            &timeout(id, row.get("expire_at"), row.get("deadline_version")).encode(),
            reason,
        )
        .await;
    }
    let wanted = format!("timeout-{}-v1", ids[0]);

    let dry = json_out(&env.lapse(&[
        "parked",
        "replay",
        "--reason",
        "DATABASE",
        "--dry-run",
        "--json",
    ]));
    let acted = dry["messages"].as_array().unwrap();
    assert_eq!(acted.len(), 1, "{dry}");
    assert_eq!(acted[0]["id"], wanted.as_str());
    assert_eq!(acted[0]["outcome"], "would_replay");
    assert_eq!(list(&env).len(), 2, "a dry run changes nothing");

    // The timeouts were parked, not relayed: no relay, no sweeper.
    let mut config = env.config();
    config.worker.relay = false;
    let worker = env.start(&config).await;
    let done = json_out(&env.lapse(&["parked", "replay", "--reason", "database", "--json"]));
    assert_eq!(done["messages"][0]["outcome"], "replayed", "{done}");
    let left = list(&env);
    assert_eq!(left.len(), 1);
    assert_eq!(left[0]["id"], format!("timeout-{}-v1", ids[1]).as_str());
    let closed = format!(
        "SELECT count(*) FROM orders WHERE id = {} AND status = 'CLOSED'",
        ids[0]
    );
    eventually(
        Duration::from_secs(30),
        "the replayed order closes",
        || async { (count(&db, &closed).await == 1).then_some(()) },
    )
    .await;
    crate::helpers::assert_never_early(&db).await;
    worker.stop().await;
    drop(db);
    env.cleanup().await;
}

#[tokio::test]
async fn a_replayed_release_releases_stock_exactly_once() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    let lines = [Line {
        sku: "cup".into(),
        qty: 3,
    }];
    let ids: Vec<i64> = create_orders(&mut db, &[Duration::from_millis(300)], &lines)
        .await
        .into_iter()
        .map(|id| id.0)
        .collect();
    let mut config = env.config();
    config.worker.releaser = false;
    config.worker.stock_release = lapse::close::StockRelease::Event;
    let closer = env.start(&config).await;
    let release_queue = env.names().stock_release_queue();
    eventually(
        Duration::from_secs(30),
        "closed, release queued",
        || async {
            let closed = count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
            (closed == 1 && queues::depth(&env.conn, &release_queue).await == Some(1)).then_some(())
        },
    )
    .await;
    closer.stop().await;
    // The event ends up parked (twice: a duplicate copy), not released.
    let channel = env.conn.create_channel().await.unwrap();
    channel
        .queue_purge(release_queue.as_str().into(), QueuePurgeOptions::default())
        .await
        .unwrap();
    let event = format!(
        r#"{{"order_id": {}, "lines": [{{"sku": "cup", "qty": 3}}]}}"#,
        ids[0]
    );
    park(&env, event.as_bytes(), "releaser: permanent error").await;
    // Two parkings of one message (a few milliseconds apart: one parked at the same
    // instant with the same reason is the same parking, archived once).
    tokio::time::sleep(Duration::from_millis(5)).await;
    park(&env, event.as_bytes(), "releaser: permanent error").await;

    let id = format!("release-{}", ids[0]);
    let out = json_out(&env.lapse(&["parked", "replay", &id, "--json"]));
    assert_eq!(out["messages"].as_array().unwrap().len(), 2, "{out}");
    assert!(list(&env).is_empty());
    let releaser = env.start(&env.config()).await;
    wait_released(&db, 1).await;
    eventually(Duration::from_secs(20), "both copies delivered", || async {
        (queues::depth(&env.conn, &release_queue).await == Some(0)).then_some(())
    })
    .await;
    releaser.stop().await; // drains: the duplicate is done
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM stock_ledger WHERE kind = 'release'"
        )
        .await,
        1
    );
    assert_eq!(
        count(&db, "SELECT reserved FROM stock WHERE sku = 'cup'").await,
        0
    );
    drop(db);
    let _ = channel.close(200, "done".into()).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_during_a_broker_alarm_stops_and_loses_nothing() {
    let mut env = TestEnv::new(&["1s"]).await;
    env.add_database().await;
    let rabbit = tokio::task::block_in_place(crate::private_rabbit::PrivateRabbit::start);
    let url = lapse::config::Secret::new(rabbit.amqp_url());
    let conn = lapse::amqp::broker::connect(&url, "lapse test")
        .await
        .unwrap();
    assert!(
        lapse::amqp::topology::apply(&conn, &env.topology())
            .await
            .unwrap()
            .ok()
    );
    let publisher = lapse::amqp::broker::Publisher::new(&conn).await.unwrap();
    let expire_at = Utc::now() + chrono::Duration::minutes(10);
    for order in [1, 2] {
        let props = lapse::message::parked_properties(
            &Default::default(),
            "database_unavailable",
            "database unavailable",
        );
        let body = timeout(order, expire_at, 1).encode();
        publisher
            .publish(&env.names().parked(), "", &body, props)
            .await
            .unwrap();
    }
    let config = env.dir.path().join("private.toml");
    std::fs::write(
        &config,
        format!(
            "[broker]\nurl = {:?}\nprefix = {:?}\nconfirm_timeout = \"2s\"\n\n[topology]\nfile = {:?}\n\n[database]\nurl = {:?}\n",
            rabbit.amqp_url(),
            env.prefix,
            env.tier_path().display().to_string(),
            env.database_url()
        ),
    )
    .unwrap();
    let run = |args: &[&str]| {
        let mut full = vec!["--config", config.to_str().unwrap()];
        full.extend_from_slice(args);
        crate::helpers::run_lapse(&full, &[])
    };

    tokio::task::block_in_place(|| rabbit.raise_memory_alarm());
    let stopped = tokio::task::block_in_place(|| run(&["parked", "replay", "--all"]));
    assert_eq!(stopped.status.code(), Some(1), "{}", stdout(&stopped));
    assert!(
        crate::helpers::stderr(&stopped).contains("stopped"),
        "{}",
        crate::helpers::stderr(&stopped)
    );
    tokio::task::block_in_place(|| rabbit.clear_memory_alarm());
    let listed = tokio::task::block_in_place(|| run(&["parked", "list", "--json"]));
    let entries: Value = json_out(&listed);
    let ids: Vec<&str> = entries
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["timeout-1-v1", "timeout-2-v1"], "nothing lost");
    let _ = conn.close(200, "done".into()).await;
    drop(rabbit);
    env.cleanup().await;
}

/// A row another replay holds (claimed, its publish in flight) is skipped, not
/// published twice; once the claim has passed (that replay died), the next replay
/// takes it.
#[tokio::test]
async fn a_row_claimed_by_another_replay_is_skipped_until_its_claim_passes() {
    let env = applied(&["1s", "1m"]).await;
    let expire_at = Utc::now() + chrono::Duration::minutes(5);
    for order in [21, 22] {
        park(
            &env,
            &timeout(order, expire_at, 1).encode(),
            "database unavailable",
        )
        .await;
    }
    assert_eq!(list(&env).len(), 2);
    let db = env.db().await;
    db.batch_execute(
        "UPDATE lapse_parked SET claimed_until = clock_timestamp() + interval '1 hour'
          WHERE id = 'timeout-21-v1'",
    )
    .await
    .unwrap();
    // The held row is reported (exit 1), the other replayed.
    let first = env.lapse(&["parked", "replay", "--all", "--json"]);
    assert_eq!(first.status.code(), Some(1));
    let first: Value = serde_json::from_str(&stdout(&first)).unwrap();
    let outcomes: Vec<(&str, &str)> = first["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["outcome"].as_str().unwrap()))
        .collect();
    assert_eq!(
        outcomes,
        [("timeout-21-v1", "failed"), ("timeout-22-v1", "replayed")],
        "{first}"
    );
    let left = list(&env);
    assert_eq!(left.len(), 1);
    assert_eq!(left[0]["id"], "timeout-21-v1");
    // Held rows are reported, not passed over in silence: by a replay and by a purge.
    let again = env.lapse(&["parked", "replay", "timeout-21-v1", "--json"]);
    assert_eq!(again.status.code(), Some(1));
    let again: Value = serde_json::from_str(&stdout(&again)).unwrap();
    assert_eq!(again["messages"][0]["outcome"], "failed", "{again}");
    assert!(
        again["messages"][0]["error"]
            .as_str()
            .unwrap()
            .contains("held by another replay"),
        "{again}"
    );
    let purge = env.lapse(&["parked", "purge", "--all", "--yes", "--json"]);
    assert_eq!(purge.status.code(), Some(1));
    assert_eq!(list(&env).len(), 1, "a held row is not purged");
    db.batch_execute(
        "UPDATE lapse_parked SET claimed_until = clock_timestamp() - interval '1 second'",
    )
    .await
    .unwrap();
    let second = json_out(&env.lapse(&["parked", "replay", "--all", "--json"]));
    assert_eq!(second["messages"][0]["id"], "timeout-21-v1", "{second}");
    assert_eq!(second["messages"][0]["outcome"], "replayed", "{second}");
    assert!(list(&env).is_empty());
    drop(db);
    env.cleanup().await;
}

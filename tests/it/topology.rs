//! `lapse topology plan | apply | verify` against the real broker, and the timing
//! properties of the tiers it declares.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::BasicProperties;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapse::amqp::broker::Publisher;
use lapse::amqp::topology::ArgValue;
use lapse::amqp::topology::field_table;
use serde_json::{Value, json};

use crate::helpers::{TestEnv, stdout};

/// What the management API says about every object of this prefix, for comparison.
async fn snapshot(env: &TestEnv) -> Vec<(String, Value)> {
    let mut out: Vec<(String, Value)> = env
        .management
        .queues("/")
        .await
        .unwrap()
        .into_iter()
        .filter(|q| q.name.starts_with(&format!("{}.", env.prefix)))
        .map(|q| (q.name, Value::Object(q.arguments)))
        .collect();
    for b in &env.topology().bindings {
        let keys: Vec<String> = env
            .management
            .bindings("/", &b.exchange, &b.queue)
            .await
            .unwrap()
            .into_iter()
            .map(|x| x.routing_key)
            .collect();
        out.push((format!("{} -> {}", b.exchange, b.queue), json!(keys)));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[tokio::test]
async fn apply_twice_gives_an_identical_broker_with_the_spec_arguments() {
    let env = TestEnv::new(&["300ms", "1s", "30m", "1h30m"]).await;
    let plan = env.lapse(&["topology", "plan"]);
    assert!(plan.status.success());
    assert!(
        stdout(&plan).contains(&format!("{}.wait.1h30m", env.prefix)),
        "{}",
        stdout(&plan)
    );

    let first = env.lapse(&["topology", "apply"]);
    assert!(first.status.success(), "{}", stdout(&first));
    let after_first = snapshot(&env).await;
    let second = env.lapse(&["topology", "apply"]);
    assert!(second.status.success(), "{}", stdout(&second));
    assert_eq!(after_first, snapshot(&env).await);
    // 4 wait queues + due + parked + stock.release, and one binding each.
    assert_eq!(after_first.len(), 7 + 7);

    let q = env
        .management
        .queue("/", &format!("{}.wait.30m", env.prefix))
        .await
        .unwrap()
        .expect("wait queue exists");
    let expected = json!({
        "x-queue-type": "quorum",
        "x-message-ttl": 1_800_000,
        "x-dead-letter-exchange": format!("{}.due", env.prefix),
        "x-dead-letter-routing-key": "due",
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
        // One node (the test broker): every node, at most 3.
        "x-quorum-initial-group-size": 1,
        "x-queue-leader-locator": "balanced",
    });
    assert_eq!(Value::Object(q.arguments), expected);

    let verify = env.lapse(&["topology", "verify"]);
    assert!(verify.status.success(), "{}", stdout(&verify));
    assert!(
        stdout(&verify).contains("0 failed, 0 skipped"),
        "{}",
        stdout(&verify)
    );
    env.cleanup().await;
}

/// Waits until the management API reports counts for every queue in `queues`: prune
/// keeps a queue without statistics (unknown is not empty), and a queue declared a
/// moment ago has none yet.
async fn stats_reported(env: &TestEnv, queues: &[String]) {
    crate::helpers::eventually(
        Duration::from_secs(30),
        "the management API's statistics of the orphans",
        || async {
            for name in queues {
                let q = env.management.queue("/", name).await.ok()??;
                q.messages.and(q.messages_unacknowledged).and(q.consumers)?;
            }
            Some(())
        },
    )
    .await;
}

async fn publish_to_tier(publisher: &Publisher, env: &TestEnv, tier: &str, body: &str) -> Instant {
    let sent = Instant::now();
    publisher
        .publish(
            &env.names().delay_exchange(),
            tier,
            body.as_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap();
    sent
}

#[tokio::test]
async fn tiers_deliver_after_their_ttl_and_a_short_tier_overtakes_a_long_one() {
    let env = TestEnv::new(&["300ms", "3s"]).await;
    assert!(env.lapse(&["topology", "apply"]).status.success());
    let publisher = Publisher::new(&env.conn).await.unwrap();
    let channel = env.conn.create_channel().await.unwrap();
    let mut due = channel
        .basic_consume(
            env.names().due_queue().as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();

    let long_sent = publish_to_tier(&publisher, &env, "3s", "long").await;
    let short_sent = publish_to_tier(&publisher, &env, "300ms", "short").await;
    let mut order = Vec::new();
    for _ in 0..2 {
        let delivery = tokio::time::timeout(Duration::from_secs(15), due.next())
            .await
            .expect("a message reaches the due queue")
            .unwrap()
            .unwrap();
        let body = String::from_utf8(delivery.data.clone()).unwrap();
        let waited = if body == "long" {
            long_sent.elapsed()
        } else {
            short_sent.elapsed()
        };
        let ttl = Duration::from_millis(if body == "long" { 3_000 } else { 300 });
        // The broker times a TTL with the Erlang VM's clock, which runs up to 1 %
        // fast while it catches up with a step of the system clock (seen here for
        // 20 minutes after the machine was paused; docs/benchmarks.md): a tier may
        // deliver that much early. lapse does not rely on it, it checks deadlines
        // against the database clock. The broker also keeps times in whole
        // milliseconds (1 ms more).
        assert!(
            waited >= ttl.mul_f64(0.99).saturating_sub(Duration::from_millis(1)),
            "{body} arrived more than 1 % early after {waited:?}"
        );
        delivery.ack(BasicAckOptions::default()).await.unwrap();
        order.push(body);
    }
    assert_eq!(
        order,
        ["short", "long"],
        "no head-of-line blocking across tiers"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn per_message_ttl_blocks_the_short_message_behind_the_long_one() {
    // The counter-demonstration: one queue, per-message `expiration`.
    let mut env = TestEnv::new(&["1s"]).await;
    let channel = env.conn.create_channel().await.unwrap();
    let target = format!("{}.demo.target", env.prefix);
    let waiting = format!("{}.demo.per-message", env.prefix);
    env.track_queue(&target);
    env.track_queue(&waiting);
    channel
        .queue_declare(
            target.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut args = lapse::amqp::topology::Arguments::new();
    args.insert(
        "x-dead-letter-exchange".into(),
        ArgValue::Str(String::new()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        ArgValue::Str(target.clone()),
    );
    channel
        .queue_declare(
            waiting.as_str().into(),
            QueueDeclareOptions::default(),
            field_table(&args),
        )
        .await
        .unwrap();
    let publisher = Publisher::new(&env.conn).await.unwrap();
    let started = Instant::now();
    for (body, ms) in [("long", "3000"), ("short", "300")] {
        publisher
            .publish(
                "",
                &waiting,
                body.as_bytes(),
                BasicProperties::default().with_expiration(ms.into()),
            )
            .await
            .unwrap();
    }
    let mut consumer = channel
        .basic_consume(
            target.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut arrivals = Vec::new();
    for _ in 0..2 {
        let d = tokio::time::timeout(Duration::from_secs(15), consumer.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        arrivals.push((
            String::from_utf8(d.data.clone()).unwrap(),
            started.elapsed(),
        ));
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(arrivals[0].0, "long");
    assert_eq!(arrivals[1].0, "short");
    assert!(
        arrivals[1].1 >= Duration::from_millis(3_000),
        "short waited behind long: {arrivals:?}"
    );
    env.cleanup().await;
}

async fn predeclare_wait_queue_with_ttl(env: &TestEnv, tier: &str, ttl: i64) {
    let topology = env.topology();
    let name = format!("{}.wait.{tier}", env.prefix);
    let mut args = topology.queue(&name).unwrap().arguments.clone();
    args.insert("x-message-ttl".into(), ArgValue::Int(ttl));
    declare_with(env, &name, &args).await;
}

/// Declares `name` as a durable queue with exactly `args`, as an operator or an older
/// lapse could have.
async fn declare_with(env: &TestEnv, name: &str, args: &lapse::amqp::topology::Arguments) {
    let channel = env.conn.create_channel().await.unwrap();
    channel
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            field_table(args),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn drift_fails_apply_and_verify_naming_queue_and_argument() {
    let env = TestEnv::new(&["1s", "5s"]).await;
    predeclare_wait_queue_with_ttl(&env, "1s", 2_000).await;
    let queue = format!("{}.wait.1s", env.prefix);

    let apply = env.lapse(&["topology", "apply"]);
    let out = stdout(&apply);
    assert_eq!(apply.status.code(), Some(1), "{out}");
    let drift_line = out.lines().find(|l| l.starts_with("DRIFT")).expect(&out);
    assert!(
        drift_line.contains(&queue) && drift_line.contains("x-message-ttl"),
        "{out}"
    );
    assert!(
        drift_line.contains("2000") && drift_line.contains("1000"),
        "{out}"
    );
    // The rest of the topology was still declared and reported.
    assert!(
        out.contains(&format!("declared  {}.wait.5s", env.prefix)),
        "{out}"
    );
    assert!(
        out.contains(&format!("declared  {}.due", env.prefix)),
        "{out}"
    );

    let verify = env.lapse(&["topology", "verify"]);
    let out = stdout(&verify);
    assert_eq!(verify.status.code(), Some(1), "{out}");
    let failed: Vec<&str> = out.lines().filter(|l| l.starts_with("FAILED")).collect();
    assert!(
        failed
            .iter()
            .any(|l| l.contains(&queue) && l.contains("x-message-ttl")),
        "{out}"
    );

    // Repaired (queue deleted and re-applied), verify passes.
    let channel = env.conn.create_channel().await.unwrap();
    channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    assert!(env.lapse(&["topology", "apply"]).status.success());
    let verify = env.lapse(&["topology", "verify", "--json"]);
    assert!(verify.status.success(), "{}", stdout(&verify));
    let report: Value = serde_json::from_str(&stdout(&verify)).unwrap();
    let checks = report["checks"].as_array().unwrap();
    assert!(checks.iter().any(|c| c["check"] == "feature flag"
        && c["subject"] == "quorum_queue"
        && c["status"] == "ok"));
    assert!(checks.iter().all(|c| c["status"] == "ok"));
    env.cleanup().await;
}

#[tokio::test]
async fn verify_without_management_says_what_it_could_not_check() {
    let env = TestEnv::new(&["1s"]).await;
    assert!(env.lapse(&["topology", "apply"]).status.success());
    std::fs::write(
        env.config_path(),
        format!(
            "[broker]\nurl = {:?}\nprefix = {:?}\n[topology]\nfile = {:?}\n",
            crate::helpers::amqp_url(),
            env.prefix,
            env.tier_path().display().to_string()
        ),
    )
    .unwrap();
    let verify = env.lapse(&["topology", "verify"]);
    let out = stdout(&verify);
    assert!(verify.status.success(), "{out}");
    for check in ["feature flags", "policies", "bindings"] {
        assert!(
            out.lines()
                .any(|l| l.starts_with("skipped") && l.contains(check)),
            "{out}"
        );
    }
    // A missing object is still found over AMQP alone.
    let channel = env.conn.create_channel().await.unwrap();
    channel
        .queue_delete(env.names().parked().as_str().into(), Default::default())
        .await
        .unwrap();
    let verify = env.lapse(&["topology", "verify"]);
    assert_eq!(verify.status.code(), Some(1));
    assert!(
        stdout(&verify)
            .lines()
            .any(|l| l.starts_with("FAILED") && l.contains("missing"))
    );
    env.cleanup().await;
}

#[tokio::test]
async fn prune_deletes_empty_orphans_and_keeps_those_holding_messages() {
    let env = TestEnv::new(&["1s", "30m", "1h"]).await;
    assert!(env.lapse(&["topology", "apply"]).status.success());
    let publisher = Publisher::new(&env.conn).await.unwrap();
    publish_to_tier(&publisher, &env, "1h", "still waiting").await;

    env.write_tiers(&["1s"], "");
    let plain = env.lapse(&["topology", "apply"]);
    assert!(plain.status.success(), "{}", stdout(&plain));
    let q = |tier: &str| format!("{}.wait.{tier}", env.prefix);
    assert!(
        env.management
            .queue("/", &q("30m"))
            .await
            .unwrap()
            .is_some(),
        "apply alone never deletes"
    );

    stats_reported(&env, &[q("30m"), q("1h")]).await;
    let pruned = env.lapse(&["topology", "apply", "--prune"]);
    let out = stdout(&pruned);
    assert!(
        pruned.status.success(),
        "{out}{}",
        crate::helpers::stderr(&pruned)
    );
    assert!(out.contains(&format!("deleted   {}", q("30m"))), "{out}");
    assert!(
        out.contains(&format!("kept      {} (1 messages", q("1h"))),
        "{out}"
    );
    assert!(
        env.management
            .queue("/", &q("30m"))
            .await
            .unwrap()
            .is_none()
    );
    assert!(env.management.queue("/", &q("1h")).await.unwrap().is_some());
    env.cleanup().await;
}

/// Deployment B's prefix is `<A>.wait.x`, so every queue of B starts with A's wait
/// prefix `<A>.wait.`. A's `apply --prune` must leave all of B alone, with the
/// message B's worker holds unacknowledged, and must keep A's own orphan that has a
/// consumer.
#[tokio::test]
async fn prune_never_deletes_a_neighbours_queues_or_a_queue_in_use() {
    let env = TestEnv::new(&["1s", "30m", "1h"]).await;
    assert!(env.lapse(&["topology", "apply"]).status.success());

    let neighbour = format!("{}.wait.x", env.prefix);
    let b_tiers = env.dir.path().join("b-tiers.toml");
    std::fs::write(&b_tiers, "tiers = [\"1s\"]\n").unwrap();
    let b_config = env.dir.path().join("b.toml");
    std::fs::write(
        &b_config,
        format!(
            "[broker]\nurl = {:?}\nmanagement_url = {:?}\nprefix = {neighbour:?}\n\n[topology]\nfile = {:?}\n",
            crate::helpers::amqp_url(),
            crate::helpers::management_url(),
            b_tiers.display().to_string(),
        ),
    )
    .unwrap();
    let b = lapse::names::Names::new(neighbour.clone());
    let applied = crate::helpers::run_lapse(
        &["--config", b_config.to_str().unwrap(), "topology", "apply"],
        &[],
    );
    assert!(applied.status.success(), "{}", stdout(&applied));
    let b_queues = [
        b.due_queue(),
        b.parked(),
        b.stock_release_queue(),
        format!("{neighbour}.wait.1s"),
    ];

    // B's worker holds one due message, unacknowledged: B's due queue reads 0 ready.
    let publisher = Publisher::new(&env.conn).await.unwrap();
    publisher
        .publish(
            &b.due_exchange(),
            "due",
            b"held by B",
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap();
    let b_worker = env.conn.create_channel().await.unwrap();
    let mut held = b_worker
        .basic_consume(
            b.due_queue().as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let delivery = tokio::time::timeout(Duration::from_secs(10), held.next())
        .await
        .expect("B's message")
        .unwrap()
        .unwrap();

    // A's own orphan `1h` has a consumer (an operator's), A's orphan `30m` is idle.
    let watcher = env.conn.create_channel().await.unwrap();
    let q = |tier: &str| format!("{}.wait.{tier}", env.prefix);
    let _watching = watcher
        .basic_consume(
            q("1h").as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();

    env.write_tiers(&["1s"], "");
    stats_reported(&env, &[q("30m"), q("1h")]).await;
    let pruned = env.lapse(&["topology", "apply", "--prune"]);
    let out = stdout(&pruned);
    assert!(
        pruned.status.success(),
        "{out}{}",
        crate::helpers::stderr(&pruned)
    );
    assert!(out.contains(&format!("deleted   {}", q("30m"))), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with(&format!("kept      {} (", q("1h"))) && l.contains("consumers")),
        "{out}"
    );
    for queue in &b_queues {
        assert!(
            !out.contains(queue.as_str()),
            "prune looked at {queue}: {out}"
        );
        assert!(
            env.management.queue("/", queue).await.unwrap().is_some(),
            "{queue} of the neighbour was deleted: {out}"
        );
    }
    assert!(env.management.queue("/", &q("1h")).await.unwrap().is_some());
    assert!(
        env.management
            .queue("/", &q("30m"))
            .await
            .unwrap()
            .is_none()
    );
    // B's held message is still B's to acknowledge.
    delivery.ack(BasicAckOptions::default()).await.unwrap();

    let channel = env.conn.create_channel().await.unwrap();
    for exchange in [
        b.delay_exchange(),
        b.due_exchange(),
        b.parked(),
        b.events_exchange(),
    ] {
        let _ = channel
            .exchange_delete(exchange.as_str().into(), Default::default())
            .await;
    }
    env.cleanup().await;
}

/// Reads one message from `queue`, waiting up to 10 s.
async fn next_from(env: &TestEnv, queue: &str) -> lapin::message::Delivery {
    let channel = env.conn.create_channel().await.unwrap();
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let delivery = tokio::time::timeout(std::time::Duration::from_secs(10), consumer.next())
        .await
        .expect("a message")
        .unwrap()
        .unwrap();
    delivery.ack(BasicAckOptions::default()).await.unwrap();
    delivery
}

#[tokio::test]
async fn an_unknown_tier_and_a_poison_message_are_parked_not_dropped() {
    let env = TestEnv::new(&["1s"]).await;
    env.write_tiers(&["1s"], "delivery_limit = 2");
    assert!(env.lapse(&["topology", "apply"]).status.success());
    let publisher = Publisher::new(&env.conn).await.unwrap();
    publish_to_tier(&publisher, &env, "7m", "no such tier").await;
    let parked = next_from(&env, &env.names().parked()).await;
    assert_eq!(parked.data, b"no such tier");

    // Delivered and returned more often than the delivery limit: the broker parks it.
    publisher
        .publish(
            &env.names().due_exchange(),
            "due",
            b"poison",
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap();
    let channel = env.conn.create_channel().await.unwrap();
    let mut due = channel
        .basic_consume(
            env.names().due_queue().as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for _ in 0..3 {
        let d = tokio::time::timeout(std::time::Duration::from_secs(10), due.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        d.nack(lapin::options::BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let parked = next_from(&env, &env.names().parked()).await;
    assert_eq!(parked.data, b"poison");
    let reason =
        lapse::message::header_text(parked.properties.headers().as_ref(), "x-first-death-reason");
    assert_eq!(reason.as_deref(), Some("delivery_limit"));
    env.cleanup().await;
}

/// Queues an older lapse created carry no leader locator: `apply` and `verify` accept
/// them as they are (the locator only counts at creation), and still find a real
/// drift on another argument of such a queue. The same for a parked queue created
/// without a delivery limit.
#[tokio::test]
async fn queues_created_without_a_leader_locator_are_accepted_and_still_checked() {
    let env = TestEnv::new(&["1s", "5s"]).await;
    let channel = env.conn.create_channel().await.unwrap();
    let wrong_ttl = format!("{}.wait.5s", env.prefix);
    for q in &env.topology().queues {
        let mut args = q.arguments.clone();
        assert!(
            args.remove("x-queue-leader-locator").is_some(),
            "{}",
            q.name
        );
        if q.name == wrong_ttl {
            args.insert("x-message-ttl".into(), ArgValue::Int(7_000));
        }
        // Nor did it give the parked queue a delivery limit.
        if q.name == env.names().parked() {
            assert!(args.remove("x-delivery-limit").is_some());
        }
        declare_with(&env, &q.name, &args).await;
    }
    let apply = env.lapse(&["topology", "apply"]);
    let out = stdout(&apply);
    assert_eq!(apply.status.code(), Some(1), "{out}");
    let drifts: Vec<&str> = out.lines().filter(|l| l.starts_with("DRIFT")).collect();
    assert_eq!(drifts.len(), 1, "{out}");
    assert!(
        drifts[0].contains(&wrong_ttl) && drifts[0].contains("x-message-ttl"),
        "{out}"
    );

    channel
        .queue_delete(wrong_ttl.as_str().into(), Default::default())
        .await
        .unwrap();
    let apply = env.lapse(&["topology", "apply"]);
    assert!(apply.status.success(), "{}", stdout(&apply));
    let verify = env.lapse(&["topology", "verify"]);
    assert!(verify.status.success(), "{}", stdout(&verify));
    // The parked queue without a limit is pointed out, with what to do on 4.x.
    let noted = stdout(&verify);
    assert!(
        noted.contains("created without x-delivery-limit") && noted.contains("policy of -1"),
        "{noted}"
    );
    // The re-created queue has the locator; the others kept what they had.
    let recreated = env
        .management
        .queue("/", &wrong_ttl)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(recreated.arguments["x-queue-leader-locator"], "balanced");
    let old = env
        .management
        .queue("/", &format!("{}.wait.1s", env.prefix))
        .await
        .unwrap()
        .unwrap();
    assert!(!old.arguments.contains_key("x-queue-leader-locator"));
    let parked = env
        .management
        .queue("/", &env.names().parked())
        .await
        .unwrap()
        .unwrap();
    assert!(!parked.arguments.contains_key("x-delivery-limit"));
    env.cleanup().await;
}

/// A queue someone declared with another leader locator is a drift, not accepted
/// silently like a missing one.
#[tokio::test]
async fn another_leader_locator_is_reported_as_drift() {
    let env = TestEnv::new(&["1s"]).await;
    let queue = format!("{}.wait.1s", env.prefix);
    let mut args = env.topology().queue(&queue).unwrap().arguments.clone();
    args.insert(
        "x-queue-leader-locator".into(),
        ArgValue::Str("client-local".into()),
    );
    declare_with(&env, &queue, &args).await;
    let apply = env.lapse(&["topology", "apply"]);
    let out = stdout(&apply);
    assert_eq!(apply.status.code(), Some(1), "{out}");
    assert!(
        out.lines().any(|l| l.starts_with("DRIFT")
            && l.contains(&queue)
            && l.contains("x-queue-leader-locator")),
        "{out}"
    );
    let verify = env.lapse(&["topology", "verify"]);
    let out = stdout(&verify);
    assert_eq!(verify.status.code(), Some(1), "{out}");
    assert!(
        out.lines().any(|l| l.starts_with("FAILED")
            && l.contains(&queue)
            && l.contains("x-queue-leader-locator")),
        "{out}"
    );
    env.cleanup().await;
}

//! `lapse parked list | counts | show | purge` against the real broker and database:
//! parked messages move into the parked book once, listing then never touches the
//! queue, pages, and counts by cause; purge asks. Replay: parked_replay.rs.

use std::time::Duration;

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use lapin::options::{BasicGetOptions, BasicRejectOptions};
use serde_json::Value;

use lapse::amqp::broker::Publisher;
use lapse::message::{TimeoutMessage, parked_properties};

use crate::helpers::{TestEnv, eventually, management_url, stderr, stdout};
use crate::queues;

pub(crate) async fn publish(
    env: &TestEnv,
    exchange: &str,
    key: &str,
    body: &[u8],
    props: BasicProperties,
) {
    let publisher = Publisher::new(&env.conn).await.unwrap();
    publisher.publish(exchange, key, body, props).await.unwrap();
}

/// Parks `body` the way the worker does: with the reason header.
pub(crate) async fn park(env: &TestEnv, body: &[u8], reason: &str) {
    let props = parked_properties(
        &BasicProperties::default().with_delivery_mode(2),
        "test",
        reason,
    );
    publish(env, &env.names().parked(), "", body, props).await;
}

pub(crate) fn timeout(order: i64, expire_at: DateTime<Utc>, version: i32) -> TimeoutMessage {
    let mut m = TimeoutMessage::new(order, expire_at, version);
    m.attempt = 5;
    m
}

pub(crate) fn json_out(o: &std::process::Output) -> Value {
    assert!(o.status.success(), "{}\n{}", stdout(o), stderr(o));
    serde_json::from_str(&stdout(o)).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

pub(crate) fn list(env: &TestEnv) -> Vec<Value> {
    json_out(&env.lapse(&["parked", "list", "--json"]))
        .as_array()
        .unwrap()
        .clone()
}

/// Parked messages need the topology and a database (the parked book).
pub(crate) async fn applied(tiers: &[&str]) -> TestEnv {
    TestEnv::with_database(tiers).await
}

/// Sets (or with `None` deletes) a `delivery-limit` policy on the parked queue.
async fn parked_delivery_limit(env: &TestEnv, limit: Option<i64>) {
    let http = lapse::tls::TlsFiles::default()
        .http_client()
        .unwrap()
        .build()
        .unwrap();
    let url = format!(
        "{}/api/policies/%2F/{}-parked-limit",
        management_url(),
        env.prefix
    );
    let url = url::Url::parse(&url).unwrap();
    let (user, password) = (
        url.username().to_string(),
        url.password().unwrap_or("").to_string(),
    );
    let mut bare = url.clone();
    bare.set_username("").unwrap();
    bare.set_password(None).unwrap();
    let request = match limit {
        Some(n) => http.put(bare).json(&serde_json::json!({
            "pattern": format!("^{}\\.parked$", env.prefix),
            "definition": {"delivery-limit": n},
            "apply-to": "queues",
            "priority": 10,
        })),
        None => http.delete(bare),
    };
    let response = request
        .basic_auth(user, Some(password))
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success(), "{:?}", response.status());
}

#[tokio::test]
async fn listing_more_often_than_the_delivery_limit_loses_nothing_and_unroutable_ones_carry_a_reason()
 {
    let mut env = TestEnv::new(&["1s", "1m"]).await;
    env.add_database().await;
    env.write_tiers(&["1s", "1m"], "delivery_limit = 1");
    let report = lapse::amqp::topology::apply(&env.conn, &env.topology())
        .await
        .unwrap();
    assert!(report.ok(), "{report:?}");
    let parked = env.names().parked();
    parked_delivery_limit(&env, Some(2)).await;
    eventually(Duration::from_secs(20), "the policy applies", || async {
        let q = env.management.queue("/", &parked).await.ok().flatten()?;
        q.policy
            .is_some_and(|p| p.ends_with("-parked-limit"))
            .then_some(())
    })
    .await;
    // Control: returning a parked message more often than the limit drops it.
    park(&env, b"control", "control").await;
    let channel = env.conn.create_channel().await.unwrap();
    for _ in 0..3 {
        if let Some(m) = channel
            .basic_get(parked.as_str().into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
        {
            m.delivery
                .acker
                .reject(BasicRejectOptions { requeue: true })
                .await
                .unwrap();
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        queues::depth(&env.conn, &parked).await,
        Some(0),
        "the limit is in force"
    );

    let expire_at = Utc::now() + chrono::Duration::minutes(10);
    park(
        &env,
        &timeout(41, expire_at, 2).encode(),
        "database unavailable",
    )
    .await;
    // A timeout published to a tier with no queue: the alternate route parks it bare.
    let stray = timeout(42, expire_at, 1);
    publish(
        &env,
        &env.names().delay_exchange(),
        "5m",
        &stray.encode(),
        stray.properties(),
    )
    .await;

    // A poison timeout: returned by its consumer over the due queue's delivery limit,
    // the broker dead-letters it to parked with its own reason.
    let poison = timeout(43, expire_at, 1);
    publish(
        &env,
        &env.names().due_exchange(),
        "due",
        &poison.encode(),
        poison.properties(),
    )
    .await;
    let due = env.names().due_queue();
    for _ in 0..3 {
        if let Some(m) = channel
            .basic_get(due.as_str().into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
        {
            m.delivery
                .acker
                .reject(BasicRejectOptions { requeue: true })
                .await
                .unwrap();
        }
    }
    eventually(Duration::from_secs(10), "the poison is parked", || async {
        (queues::depth(&env.conn, &parked).await == Some(3)).then_some(())
    })
    .await;

    for round in 0..5 {
        let entries = list(&env);
        assert_eq!(entries.len(), 3, "round {round}: {entries:?}");
        assert_eq!(entries[2]["id"], "timeout-43-v1");
        assert_eq!(entries[2]["reason_source"], "broker");
        assert_eq!(entries[2]["cause"], "broker_delivery_limit");
        assert_eq!(
            entries[2]["reason"],
            format!("broker: delivery_limit in {due}").as_str()
        );
        assert!(entries[2]["parked_at"].is_string(), "{entries:?}");
        assert_eq!(entries[0]["id"], "timeout-41-v2");
        assert_eq!(entries[0]["order_id"], 41);
        assert_eq!(entries[0]["deadline_version"], 2);
        assert_eq!(entries[0]["attempts"], 5);
        assert_eq!(entries[0]["reason"], "database unavailable");
        assert_eq!(entries[0]["cause"], "test");
        assert!(entries[0]["parked_at"].is_string());
        assert_eq!(entries[1]["id"], "timeout-42-v1");
        assert_eq!(entries[1]["cause"], "unroutable");
        let reason = entries[1]["reason"].as_str().unwrap();
        assert!(
            reason.contains("unroutable") && reason.contains("5m"),
            "{reason}"
        );
        assert!(entries[1]["parked_at"].is_string(), "{entries:?}");
        // Moved out of the queue by the first listing, never given back to it.
        assert_eq!(queues::depth(&env.conn, &parked).await, Some(0));
    }
    // Pages: a cursor, and the text says where the next page starts.
    let all = list(&env);
    let first = json_out(&env.lapse(&["parked", "list", "--limit", "2", "--json"]));
    assert_eq!(first.as_array().unwrap().len(), 2, "{first}");
    let text = stdout(&env.lapse(&["parked", "list", "--limit", "2"]));
    let next = format!(
        "more: lapse parked list --after {} --limit 2",
        all[1]["seq"]
    );
    assert!(text.contains(&next), "{text}");
    let rest = json_out(&env.lapse(&[
        "parked",
        "list",
        "--after",
        &all[1]["seq"].to_string(),
        "--json",
    ]));
    assert_eq!(rest.as_array().unwrap().len(), 1, "{rest}");
    assert_eq!(rest[0]["id"], "timeout-43-v1");
    let only = json_out(&env.lapse(&["parked", "list", "--reason", "unroutable", "--json"]));
    assert_eq!(only.as_array().unwrap().len(), 1, "{only}");
    // Counts by cause.
    let counts = json_out(&env.lapse(&["parked", "counts", "--json"]));
    let mut by_cause: Vec<(String, i64)> = counts
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["cause"].as_str().unwrap().to_string(),
                c["count"].as_i64().unwrap(),
            )
        })
        .collect();
    by_cause.sort();
    assert_eq!(
        by_cause,
        [
            ("broker_delivery_limit".to_string(), 1),
            ("test".to_string(), 1),
            ("unroutable".to_string(), 1)
        ]
    );
    let shown = json_out(&env.lapse(&["parked", "show", "timeout-42-v1", "--json"]));
    assert!(
        shown[0]["entry"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("unroutable")),
        "{shown}"
    );
    let missing = env.lapse(&["parked", "show", "timeout-1-v1"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        stderr(&missing).contains("parked list"),
        "{}",
        stderr(&missing)
    );

    parked_delivery_limit(&env, None).await;
    env.cleanup().await;
}

#[tokio::test]
async fn purge_asks_for_yes_and_removes_only_the_selected() {
    let env = applied(&["1s"]).await;
    let expire_at = Utc::now() + chrono::Duration::minutes(10);
    park(&env, b"\xff garbage", "body is not a JSON timeout message").await;
    park(
        &env,
        &timeout(1, expire_at, 1).encode(),
        "database unavailable",
    )
    .await;
    park(&env, &timeout(2, expire_at, 1).encode(), "other").await;
    let listed = list(&env);
    let raw = listed[0]["id"].as_str().unwrap().to_string();
    assert!(raw.starts_with("raw-"), "{raw}");
    // An unreadable body's shard is unknown (null), not shard 0; a timeout's is known.
    assert_eq!(listed[0]["shard"], Value::Null, "{listed:?}");
    assert_eq!(listed[1]["shard"], 0, "{listed:?}");
    let shown = json_out(&env.lapse(&["parked", "show", &raw, "--json"]));
    assert!(shown[0]["body"].as_str().unwrap().contains("garbage"));
    assert_eq!(shown[0]["entry"]["shard"], Value::Null, "{shown}");
    let text = stdout(&env.lapse(&["parked", "show", &raw]));
    let shard_line = text.lines().find(|l| l.trim_start().starts_with("shard "));
    assert_eq!(
        shard_line.map(|l| l.split_whitespace().collect::<Vec<_>>()),
        Some(vec!["shard", "-"]),
        "{text}"
    );
    let replay = env.lapse(&["parked", "replay", &raw]);
    assert_eq!(
        replay.status.code(),
        Some(1),
        "an unreadable body is not replayed"
    );

    let refused = env.lapse(&["parked", "purge", "--all"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(stderr(&refused).contains("--yes"), "{}", stderr(&refused));
    assert_eq!(list(&env).len(), 3);

    // On a terminal it asks: anything but "yes" purges nothing.
    if let Some(no) = on_a_terminal(&env, &["parked", "purge", &raw], "no") {
        assert_eq!(no.status.code(), Some(1), "{}", stdout(&no));
        assert!(stdout(&no).contains("nothing purged"), "{}", stdout(&no));
        assert_eq!(list(&env).len(), 3);
        let yes = on_a_terminal(&env, &["parked", "purge", &raw], "yes").unwrap();
        assert_eq!(yes.status.code(), Some(0), "{}", stdout(&yes));
        assert_eq!(list(&env).len(), 2);
        park(&env, b"\xff garbage", "body is not a JSON timeout message").await;
    }

    let purged = json_out(&env.lapse(&["parked", "purge", &raw, "--yes", "--json"]));
    assert_eq!(purged["messages"][0]["outcome"], "purged");
    let purged = env.lapse(&["parked", "purge", "--reason", "unavailable", "--yes"]);
    assert!(purged.status.success(), "{}", stderr(&purged));
    let left = list(&env);
    assert_eq!(left.len(), 1);
    assert_eq!(left[0]["id"], "timeout-2-v1");
    assert!(
        !left[0]["reason"].as_str().unwrap().contains("unavailable"),
        "{left:?}"
    );
    env.cleanup().await;
}

/// Runs `lapse` with its stdin on a pseudo-terminal (util-linux `script`), typing
/// `answer`; `None` (and a note) where `script` is not installed.
fn on_a_terminal(env: &TestEnv, args: &[&str], answer: &str) -> Option<std::process::Output> {
    use std::io::Write;
    let mut command = format!(
        "'{}' --config '{}'",
        env!("CARGO_BIN_EXE_lapse"),
        env.config_path().display()
    );
    for a in args {
        command.push_str(&format!(" '{a}'"));
    }
    let child = std::process::Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        eprintln!("`script` is not installed: the interactive purge prompt is not tested");
        return None;
    };
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{answer}").unwrap();
    drop(stdin);
    Some(child.wait_with_output().unwrap())
}

/// RabbitMQ 4.x gives a quorum queue without a delivery limit one of 20, and the
/// parked queue has no dead-letter exchange: a parked message returned 21 times would
/// be dropped. lapse sets the parked queue's limit as high as it goes, so a message
/// given back 25 times (interrupted commands, an outside consumer) is still there, on
/// 3.x and 4.x alike.
#[tokio::test]
async fn a_parked_message_given_back_more_often_than_the_brokers_default_limit_stays() {
    let env = applied(&["1s"]).await;
    park(&env, b"{\"returned\": true}", "test").await;
    let channel = env.conn.create_channel().await.unwrap();
    let queue = env.names().parked();
    for round in 0..25 {
        let got = eventually(Duration::from_secs(10), "the parked message", || async {
            channel
                .basic_get(queue.as_str().into(), BasicGetOptions::default())
                .await
                .unwrap()
        })
        .await;
        assert_eq!(got.delivery.data, b"{\"returned\": true}", "round {round}");
        // A reject counts towards the delivery limit on every version (4.3 stopped
        // counting a nack).
        got.delivery
            .reject(BasicRejectOptions { requeue: true })
            .await
            .unwrap();
    }
    assert_eq!(list(&env).len(), 1, "still parked after 25 returns");
    env.cleanup().await;
}

/// A running worker moves what is parked into the parked book within seconds, exports
/// the book by cause, and `lapse status` counts the book; with the book's database
/// away the messages wait in the queue, none lost.
#[tokio::test]
async fn a_worker_moves_parked_messages_into_the_book_and_counts_them_by_cause() {
    let env = applied(&["1s"]).await;
    let port = crate::endpoints::free_port();
    let mut worker = crate::endpoints::spawn_worker(&env, port, None);
    park(&env, b"\xff first", "body is not a JSON timeout message").await;
    park(&env, b"\xff second", "body is not a JSON timeout message").await;
    let db = env.db().await;
    eventually(Duration::from_secs(30), "both in the book", || async {
        (crate::helpers::count(&db, "SELECT count(*) FROM lapse_parked").await == 2).then_some(())
    })
    .await;
    assert_eq!(
        queues::depth(&env.conn, &env.names().parked()).await,
        Some(0)
    );
    eventually(Duration::from_secs(30), "the gauge by cause", || async {
        let (_, body) = crate::endpoints::get(port, "/metrics").await?;
        body.lines()
            .any(|l| l == "lapse_parked_entries{cause=\"test\"} 2")
            .then_some(())
    })
    .await;
    let status = json_out(&env.lapse(&["status", "--json"]));
    assert_eq!(status["parked_entries"], 2, "{status}");
    let check = env.lapse(&["status", "--check", "--max-parked", "1"]);
    assert_eq!(check.status.code(), Some(1));
    assert!(
        stdout(&check).contains("2 messages parked"),
        "{}",
        stdout(&check)
    );

    // The book's table away: what is parked waits in the queue, /health says why, and
    // it moves in once the table is back.
    db.batch_execute("ALTER TABLE lapse_parked RENAME TO lapse_parked_away")
        .await
        .unwrap();
    park(&env, b"\xff third", "body is not a JSON timeout message").await;
    eventually(
        Duration::from_secs(30),
        "the archiver reports it",
        || async {
            let (_, body) = crate::endpoints::get(port, "/health").await?;
            let health: serde_json::Value = serde_json::from_str(&body).ok()?;
            (health["components"]["parked"]["up"] == false).then_some(())
        },
    )
    .await;
    assert_eq!(
        queues::depth(&env.conn, &env.names().parked()).await,
        Some(1),
        "not archived: still in the queue"
    );
    // A worker that cannot archive still closes deadlines: it stays ready.
    let (status, body) = crate::endpoints::get(port, "/readyz").await.unwrap();
    assert_eq!(status, 200, "{body}");
    db.batch_execute("ALTER TABLE lapse_parked_away RENAME TO lapse_parked")
        .await
        .unwrap();
    eventually(Duration::from_secs(30), "all three in the book", || async {
        (crate::helpers::count(&db, "SELECT count(*) FROM lapse_parked").await == 3).then_some(())
    })
    .await;
    // Never taken while the table was away: delivered once, when it was archived (a
    // quorum queue counts earlier deliveries in x-delivery-count).
    let third = crate::helpers::count(
        &db,
        "SELECT count(*) FROM lapse_parked
          WHERE body = '\\xff207468697264'::bytea
            AND coalesce((headers ->> 'x-delivery-count')::int, 0) = 0",
    )
    .await;
    if third != 1 {
        let rows = db
            .query(
                "SELECT encode(body, 'hex') AS b, headers::text AS h FROM lapse_parked",
                &[],
            )
            .await
            .unwrap();
        let shown: Vec<(String, String)> = rows.iter().map(|r| (r.get("b"), r.get("h"))).collect();
        panic!("the third message was taken and given back while the table was away: {shown:?}");
    }

    // Purged: the gauge reads 0, not its last value.
    let purged = env.lapse(&["parked", "purge", "--all", "--yes"]);
    assert!(purged.status.success(), "{}", stderr(&purged));
    eventually(Duration::from_secs(30), "the gauge at 0", || async {
        let (_, body) = crate::endpoints::get(port, "/metrics").await?;
        body.lines()
            .any(|l| l == "lapse_parked_entries{cause=\"test\"} 0")
            .then_some(())
    })
    .await;
    let _ = worker.kill().await;
    let _ = worker.wait().await;
    drop(db);
    env.cleanup().await;
}

/// Two deployments (two prefixes) sharing one database: each lists, counts, replays
/// and purges only what its own `<P>.parked` held.
#[tokio::test]
async fn deployments_sharing_a_database_see_only_their_own_parked_messages() {
    let ours = applied(&["1s"]).await;
    let theirs = TestEnv::new(&["1s"]).await;
    assert!(
        lapse::amqp::topology::apply(&theirs.conn, &theirs.topology())
            .await
            .unwrap()
            .ok()
    );
    theirs.write_config(&format!("[database]\nurl = {:?}\n", ours.database_url()));
    park(&ours, b"\xff ours", "body is not a JSON timeout message").await;
    park(
        &theirs,
        b"\xff theirs",
        "body is not a JSON timeout message",
    )
    .await;
    let listed = list(&theirs);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(list(&ours).len(), 1);
    let counts = json_out(&theirs.lapse(&["parked", "counts", "--json"]));
    assert_eq!(counts[0]["count"], 1, "{counts}");
    let purged = json_out(&theirs.lapse(&["parked", "purge", "--all", "--yes", "--json"]));
    assert_eq!(purged["messages"].as_array().unwrap().len(), 1, "{purged}");
    assert!(list(&theirs).is_empty());
    let left = list(&ours);
    assert_eq!(left.len(), 1, "theirs purged ours: {left:?}");
    let shown =
        json_out(&ours.lapse(&["parked", "show", left[0]["id"].as_str().unwrap(), "--json"]));
    assert!(
        shown[0]["body"].as_str().unwrap().contains("ours"),
        "{shown}"
    );
    theirs.cleanup().await;
    ours.cleanup().await;
}

/// A reason carrying a NUL character (PostgreSQL text refuses it) is stored with U+FFFD
/// in its place; the message is neither stuck in the queue nor lost, and the rest of its
/// chunk moves too.
#[tokio::test]
async fn a_reason_with_a_nul_character_is_stored_and_listed() {
    let env = applied(&["1s"]).await;
    park(&env, b"{\"a\": 1}", "bad\0byte").await;
    park(&env, b"{\"b\": 2}", "fine").await;
    let listed = list(&env);
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(listed[0]["reason"], "bad\u{FFFD}byte");
    assert_eq!(
        queues::depth(&env.conn, &env.names().parked()).await,
        Some(0)
    );
    env.cleanup().await;
}

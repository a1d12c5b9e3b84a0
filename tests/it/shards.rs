//! Several order databases (shards): three databases — shard 0 on a private server
//! that is stopped for a while mid-run, shards 1 and 2 on the shared server — with
//! orders spread over them, one worker holding a pool per shard. The stopped shard is
//! the first, so that work handled shard by shard in order would wait behind it.

mod at_start;
mod positions;

use std::time::Duration;

use chrono::{DateTime, Utc};
use lapse::config::Secret;
use lapse::observe::stats::Outcome;
use lapse::orders::{self, Line};

use crate::helpers::{TestEnv, count, create_orders, drop_database, eventually, unique};
use crate::private_pg::PrivatePostgres;

const PER_SHARD: usize = 120;
/// Every fifth order is paid before its deadline.
const PAID_EVERY: usize = 5;
const INITIAL_STOCK: i64 = 1_000_000;

/// Databases a test creates on the shared server, dropped when it ends — also when it
/// fails part-way (then on a thread with its own runtime, as `TestEnv` does).
struct Databases(Vec<String>);

impl Databases {
    fn new(kinds: &[&str]) -> Self {
        Self(kinds.iter().map(|k| unique(k)).collect())
    }

    fn urls(&self) -> Vec<String> {
        self.0
            .iter()
            .map(|n| crate::helpers::database_url(n))
            .collect()
    }
}

impl Drop for Databases {
    fn drop(&mut self) {
        let names = std::mem::take(&mut self.0);
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                for name in &names {
                    drop_database(name).await;
                }
            });
        })
        .join();
    }
}

/// Every order of the shard closed and released.
async fn all_closed(db: &tokio_postgres::Client) -> Option<()> {
    let open = count(db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await;
    let unreleased = crate::helpers::unstamped_closes(db).await;
    (open == 0 && unreleased == 0).then_some(())
}

async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) =
        tokio_postgres::connect(&crate::helpers::on_lapse_path(url), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    client
}

async fn clock(db: &tokio_postgres::Client) -> DateTime<Utc> {
    db.query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0)
}

/// Orders due 2-9 s from now, two lines each; every fifth paid at once.
async fn create(db: &mut tokio_postgres::Client) {
    let lines = [
        Line {
            sku: "a".into(),
            qty: 1,
        },
        Line {
            sku: "b".into(),
            qty: 2,
        },
    ];
    let deadlines: Vec<Duration> = (0..PER_SHARD as u64)
        .map(|i| Duration::from_millis(2_000 + i * 7_000 / PER_SHARD as u64))
        .collect();
    let ids = create_orders(db, &deadlines, &lines).await;
    for id in ids.iter().step_by(PAID_EVERY) {
        orders::pay(&*db, *id).await.unwrap();
    }
}

/// The promise, in one shard: none closed early, every unpaid one closed, paid ones
/// untouched, one release per (order, sku), stock back where it belongs.
async fn assert_shard(shard: usize, db: &tokio_postgres::Client) {
    let paid = PER_SHARD.div_ceil(PAID_EVERY) as i64;
    let unpaid = PER_SHARD as i64 - paid;
    let q = |sql: &'static str| count(db, sql);
    assert_eq!(
        q("SELECT count(*) FROM orders WHERE closed_at < expire_at").await,
        0,
        "shard {shard}: closed early"
    );
    assert_eq!(
        q("SELECT count(*) FROM orders WHERE status = 'CLOSED'").await,
        unpaid,
        "shard {shard}"
    );
    assert_eq!(
        q("SELECT count(*) FROM orders WHERE status = 'PAID' AND closed_at IS NULL").await,
        paid,
        "shard {shard}: paid orders untouched"
    );
    assert_eq!(
        q("SELECT count(*) FROM stock_ledger WHERE kind = 'release'").await,
        unpaid * 2,
        "shard {shard}: one release per (order, sku)"
    );
    assert_eq!(
        q(
            "SELECT count(*) FROM stock_ledger l JOIN orders o ON o.id = l.order_id
            WHERE l.kind = 'release' AND o.status <> 'CLOSED'"
        )
        .await,
        0,
        "shard {shard}: a release of an order that is not closed"
    );
    let rows = db
        .query(
            "SELECT sku, available, reserved, sold FROM stock ORDER BY sku",
            &[],
        )
        .await
        .unwrap();
    for row in rows {
        let (sku, available, reserved, sold): (String, i64, i64, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        let qty = if sku == "a" { 1 } else { 2 };
        assert_eq!(reserved, 0, "shard {shard}, sku {sku}: reserved");
        assert_eq!(sold, paid * qty, "shard {shard}, sku {sku}: sold");
        assert_eq!(
            available + sold,
            INITIAL_STOCK,
            "shard {shard}, sku {sku}: available"
        );
    }
}

// Over 60 lines on purpose: one scenario (set up three databases, run, stop one, check each).
#[tokio::test]
async fn three_shards_close_every_order_while_one_database_is_down() {
    let env = TestEnv::new(&["1s", "3s"]).await;
    lapse::amqp::topology::apply(&env.conn, &env.topology())
        .await
        .unwrap();
    let shared = Databases::new(&["s0", "s1"]);
    let pg = PrivatePostgres::start(crate::helpers::free_port());
    let shared_urls = shared.urls();
    let urls = [
        pg.url("lapse"),
        shared_urls[0].clone(),
        shared_urls[1].clone(),
    ];
    let mut config = env.config();
    config.database.shards = Some(urls.iter().map(Secret::new).collect());
    // The database-away path must outlast the outage without parking anything.
    config.worker.max_attempts = 30;
    let settings = lapse::db::Settings::from_config(&config);
    for (shard, result) in lapse::db::migrate_shards(&config.database, &settings).await {
        assert!(result.is_ok(), "shard {}: {:?}", shard.index, result.err());
    }
    let mut dbs = Vec::new();
    for url in &urls {
        let mut db = connect(url).await;
        create(&mut db).await;
        dbs.push(db);
    }

    let worker = env.start(&config).await;
    // The first deadlines pass, then shard 0's database goes away for 5 s while
    // about 80 of its orders fall due (and as many in each other shard).
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let down_at = clock(&dbs[1]).await;
    pg.stop_server();
    // A stock release of shard 0 (a duplicate, harmless) arrives while it is down: the
    // releaser must hold it without holding up the other shards' releases.
    crate::parked::publish(
        &env,
        &env.names().events_exchange(),
        lapse::names::STOCK_RELEASE_ROUTING_KEY,
        br#"{"order_id":1}"#,
        lapin::BasicProperties::default(),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let up_at = clock(&dbs[1]).await;
    pg.start_server();
    dbs[0] = connect(&urls[0]).await;

    for (shard, db) in dbs.iter().enumerate() {
        eventually(
            Duration::from_secs(90),
            &format!("every unpaid order of shard {shard} closed and released"),
            || all_closed(db),
        )
        .await;
    }
    for (shard, db) in dbs.iter().enumerate() {
        assert_shard(shard, db).await;
    }
    // The other shards kept closing and releasing while shard 0 was down: their
    // orders due in the outage's first part (at least 2 s before it ended) closed and
    // were released before it ended.
    let settle = up_at - chrono::TimeDelta::seconds(2);
    for (shard, db) in dbs.iter().enumerate().skip(1) {
        let row = db
            .query_one(
                "SELECT count(*) AS due, count(*) FILTER (WHERE closed_at < $3) AS closed,
                        count(*) FILTER (WHERE released_at < $3) AS released
                   FROM orders WHERE status = 'CLOSED' AND expire_at > $1 AND expire_at < $2",
                &[&down_at, &settle, &up_at],
            )
            .await
            .unwrap();
        let (due, closed, released): (i64, i64, i64) =
            (row.get("due"), row.get("closed"), row.get("released"));
        assert!(
            due > 10,
            "shard {shard}: only {due} orders due in the outage"
        );
        assert_eq!(
            closed, due,
            "shard {shard}: orders due while shard 0 was down waited for it to close"
        );
        assert_eq!(
            released, due,
            "shard {shard}: releases while shard 0 was down waited for it"
        );
    }
    // And the outage did reach shard 0: its orders due then closed only after it.
    let late = dbs[0]
        .query_one(
            "SELECT count(*) FROM orders WHERE expire_at > $1 AND expire_at < $2 AND closed_at > $3",
            &[&down_at, &settle, &up_at],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    assert!(late > 0, "shard 0 closed its orders while it was down?");
    assert!(
        worker.stats.get(Outcome::Retried) > 0,
        "the consumer saw shard 2 away"
    );
    assert_eq!(worker.stats.get(Outcome::GaveUp), 0);
    assert_eq!(worker.stats.get(Outcome::Parked), 0);
    assert!(worker.stop().await.is_empty(), "drained");
    drop(dbs);
    drop(shared);
    drop(pg);
    env.cleanup().await;
}

/// Each shard has its own sweeper (and leader): with the consumer off, every shard's
/// overdue orders are closed by the sweeper of that shard, and released.
#[tokio::test]
async fn each_shard_is_swept_by_its_own_sweeper() {
    let env = TestEnv::new(&["1s"]).await;
    lapse::amqp::topology::apply(&env.conn, &env.topology())
        .await
        .unwrap();
    let names = Databases::new(&["w0", "w1"]);
    let urls = names.urls();
    let mut config = env.config();
    config.database.shards = Some(urls.iter().map(Secret::new).collect());
    config.worker.consumer = false;
    config.worker.sweeper = true;
    config.sweeper.interval = Duration::from_millis(300);
    config.sweeper.grace = Duration::ZERO;
    let settings = lapse::db::Settings::from_config(&config);
    for (shard, result) in lapse::db::migrate_shards(&config.database, &settings).await {
        assert!(result.is_ok(), "shard {}: {:?}", shard.index, result.err());
    }
    let mut dbs = Vec::new();
    for url in &urls {
        let mut db = connect(url).await;
        let line = [Line {
            sku: "a".into(),
            qty: 1,
        }];
        create_orders(&mut db, &[Duration::from_millis(300); 20], &line).await;
        dbs.push(db);
    }
    let worker = env.start(&config).await;
    for (shard, db) in dbs.iter().enumerate() {
        eventually(
            Duration::from_secs(60),
            &format!("shard {shard} swept and released"),
            || async {
                let swept = count(
                    db,
                    "SELECT count(*) FROM orders WHERE status = 'CLOSED' AND close_reason = 'sweeper'
                        AND released_at IS NOT NULL",
                )
                .await;
                (swept == 20).then_some(())
            },
        )
        .await;
        assert_eq!(
            count(
                db,
                "SELECT count(*) FROM orders WHERE closed_at < expire_at"
            )
            .await,
            0
        );
    }
    assert_eq!(worker.stats.get(Outcome::SweptClosed), 40);
    worker.stop().await;
    // `lapse status` shows each shard, and the totals.
    let shards: Vec<String> = urls.iter().map(|u| format!("{u:?}")).collect();
    env.write_config(&format!("[database]\nshards = [{}]\n", shards.join(", ")));
    let out = env.lapse(&["status", "--json"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        crate::helpers::stderr(&out)
    );
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["recent_sweeper_closes"], 40, "{status}");
    assert_eq!(
        status["shards"].as_array().map(Vec::len),
        Some(2),
        "{status}"
    );
    for shard in 0..2 {
        assert_eq!(status["shards"][shard]["shard"], shard, "{status}");
        assert_eq!(
            status["shards"][shard]["recent_sweeper_closes"], 20,
            "{status}"
        );
        assert_eq!(status["shards"][shard]["overdue_unpaid"], 0, "{status}");
    }
    let text = crate::helpers::stdout(&env.lapse(&["status"]));
    assert!(text.contains("SHARDS\n"), "{text}");
    drop(dbs);
    drop(names);
    env.cleanup().await;
}

/// `lapse migrate` migrates every shard and names the one it cannot, exit status 1.
#[tokio::test]
async fn migrate_reports_each_shard_and_fails_naming_the_one_it_cannot_reach() {
    let env = TestEnv::new(&["1s"]).await;
    let shard0 = Databases::new(&["m0"]);
    let unreachable = format!(
        "postgres://postgres:s3cret@127.0.0.1:{}/x",
        crate::helpers::free_port()
    );
    env.write_config(&format!(
        "[database]\nshards = [{:?}, {unreachable:?}]\n",
        shard0.urls()[0]
    ));
    let out = env.lapse(&["migrate"]);
    let (stdout, stderr) = (crate::helpers::stdout(&out), crate::helpers::stderr(&out));
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(
        stdout.contains("shard 0: ") && stdout.contains("migration(s) applied"),
        "{stdout}"
    );
    assert!(stderr.contains("shard 1 (database.shards[1])"), "{stderr}");
    assert!(!stderr.contains("s3cret"), "{stderr}");
    // Again, as JSON: shard 0 is up to date now.
    let out = env.lapse(&["migrate", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        json["shards"][0],
        serde_json::json!({"shard": 0, "applied": 0})
    );
    assert_eq!(json["shards"][1]["shard"], 1);
    assert!(json["shards"][1]["error"].is_string(), "{json}");
    // `lapse status` names the shard it cannot reach (exit 3).
    let out = env.lapse(&["status"]);
    let stderr = crate::helpers::stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("database of shard 1 (`x` at 127.0.0.1:"),
        "{stderr}"
    );
    assert!(!stderr.contains("s3cret"), "{stderr}");
    drop(shard0);
    env.cleanup().await;
}

/// Shard 0 and shard 1 each hold a closed order (ids collide: both are order 1). Their
/// release events arrive in one batch while an application holds both rows; once the
/// locks go, each shard must get its own release.
#[tokio::test]
async fn held_release_events_of_two_shards_are_each_released_in_their_own_shard() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let extra = Databases::new(&["s1"]);
    let url0 = env.database_url();
    let url1 = extra.urls()[0].clone();
    lapse::db::migrate(&Secret::new(url1.clone()))
        .await
        .unwrap();
    let mut config = env.config();
    config.database.shards = Some(vec![Secret::new(url0.clone()), Secret::new(url1.clone())]);
    config.worker.releaser = false;
    config.worker.stock_release = lapse::close::StockRelease::Event;
    let lines = [Line {
        sku: "a".into(),
        qty: 1,
    }];
    let mut db0 = connect(&url0).await;
    let mut db1 = connect(&url1).await;
    let id0 = create_orders(&mut db0, &[Duration::from_millis(300)], &lines).await[0].0;
    let id1 = create_orders(&mut db1, &[Duration::from_millis(300)], &lines).await[0].0;

    let closer = env.start(&config).await;
    let release_q = env.names().stock_release_queue();
    eventually(
        Duration::from_secs(30),
        "both closed, both events queued",
        || async {
            let c0 = count(&db0, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
            let c1 = count(&db1, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
            let q = crate::queues::depth(&env.conn, &release_q)
                .await
                .unwrap_or(0);
            (c0 == 1 && c1 == 1 && q == 2).then_some(())
        },
    )
    .await;
    closer.stop().await;

    // An application holds both closed orders' rows (a late payment inside a transaction).
    let app0 = connect(&url0).await;
    let app1 = connect(&url1).await;
    app0.batch_execute(&format!(
        "BEGIN; SELECT 1 FROM orders WHERE id = {id0} FOR UPDATE"
    ))
    .await
    .unwrap();
    app1.batch_execute(&format!(
        "BEGIN; SELECT 1 FROM orders WHERE id = {id1} FOR UPDATE"
    ))
    .await
    .unwrap();

    let releaser_only = crate::helpers::releaser_only(&config);
    let releaser = env.start(&releaser_only).await;
    eventually(Duration::from_secs(30), "both events held", || async {
        (releaser.stats.get(Outcome::Locked) >= 2).then_some(())
    })
    .await;
    app0.batch_execute("COMMIT").await.unwrap();
    app1.batch_execute("COMMIT").await.unwrap();

    const RELEASED: &str = "SELECT count(*) FROM stock_ledger WHERE kind = 'release'";
    eventually(Duration::from_secs(30), "both releases", || async {
        let (r0, r1) = (count(&db0, RELEASED).await, count(&db1, RELEASED).await);
        (r0 + r1 >= 2).then_some(())
    })
    .await;
    // Room for a wrong third release to show.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (r0, r1) = (count(&db0, RELEASED).await, count(&db1, RELEASED).await);
    let q = crate::queues::depth(&env.conn, &release_q).await;
    releaser.stop().await;
    db1.batch_execute("SELECT 1").await.unwrap();
    drop(db1);
    drop(app1);
    env.cleanup().await;
    assert_eq!(r0, 1, "shard 0's order released once");
    assert_eq!(
        r1, 1,
        "shard 1's order released (its event was acknowledged: queue {q:?})"
    );
}

/// `lapse order --shard I` works on `database.shards[I]`: an order created there is
/// in that database and no other, `show` finds it only there, and a shard that is not
/// configured is a usage error (exit 2) naming the range.
#[tokio::test]
async fn order_commands_work_on_the_shard_named() {
    let env = TestEnv::new(&["1s"]).await;
    let dbs = Databases::new(&["o0", "o1"]);
    let urls = dbs.urls();
    env.write_config(&format!(
        "[database]\nshards = [{:?}, {:?}]\n",
        urls[0], urls[1]
    ));
    let migrated = env.lapse(&["migrate"]);
    assert!(
        migrated.status.success(),
        "{}",
        crate::helpers::stderr(&migrated)
    );
    let created = env.lapse(&[
        "order",
        "--shard",
        "1",
        "create",
        "--expires-in",
        "10m",
        "--line",
        "tea:2",
        "--json",
    ]);
    assert!(
        created.status.success(),
        "{}",
        crate::helpers::stderr(&created)
    );
    let ids: Vec<i64> = serde_json::from_slice(&created.stdout).unwrap();
    let (db0, db1) = (connect(&urls[0]).await, connect(&urls[1]).await);
    assert_eq!(count(&db0, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&db1, "SELECT count(*) FROM orders").await, 1);
    let id = ids[0].to_string();
    let shown = env.lapse(&["order", "show", &id, "--shard", "1", "--json"]);
    assert!(shown.status.success(), "{}", crate::helpers::stderr(&shown));
    let order: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(order["status"], "UNPAID", "{order}");
    // Shard 0 has no such order (exit 1).
    assert_eq!(env.lapse(&["order", "show", &id]).status.code(), Some(1));
    let missing = env.lapse(&["order", "--shard", "2", "show", &id]);
    assert_eq!(missing.status.code(), Some(2));
    let stderr = crate::helpers::stderr(&missing);
    assert!(
        stderr.contains("--shard 2") && stderr.contains("0 to 1"),
        "{stderr}"
    );
    drop(dbs);
    env.cleanup().await;
}

/// A server that accepts the connection and then says nothing (a frozen server, a
/// proxy in front of a dead one) does not hang `lapse migrate`: the login is bounded,
/// the other shard is migrated, and the error names the silent one.
#[tokio::test]
async fn migrate_gives_up_on_a_server_that_accepts_but_never_answers() {
    let env = TestEnv::new(&["1s"]).await;
    let shard0 = Databases::new(&["n0"]);
    // Never accepted by the test: the kernel completes the handshake, nobody answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!(
        "postgres://postgres@127.0.0.1:{}/x",
        silent.local_addr().unwrap().port()
    );
    env.write_config(&format!(
        "[database]\nshards = [{:?}, {silent_url:?}]\n",
        shard0.urls()[0]
    ));
    let started = std::time::Instant::now();
    let out = env.lapse(&["migrate"]);
    let (stdout, stderr) = (crate::helpers::stdout(&out), crate::helpers::stderr(&out));
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stdout.contains("shard 0: "), "{stdout}");
    assert!(
        stderr.contains("database.shards[1]") && stderr.contains("did not complete the login"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(90),
        "took {:?}",
        started.elapsed()
    );
    // One database that says nothing: a database that cannot be reached (exit 3).
    env.write_config(&format!("[database]\nurl = {silent_url:?}\n"));
    let out = env.lapse(&["migrate"]);
    let stderr = crate::helpers::stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("did not complete the login") && stderr.contains("database.url"),
        "{stderr}"
    );
    drop(silent);
    drop(shard0);
    env.cleanup().await;
}

/// A pack whose entries live in two shards, one of them down: the live shard's entry
/// closes at once, the other waits on the database-away path and closes when its
/// database returns; neither is early, none lost.
#[tokio::test]
async fn a_pack_of_two_shards_closes_the_live_shards_entry_while_the_other_is_down() {
    let env = TestEnv::new(&["1s"]).await;
    lapse::amqp::topology::apply(&env.conn, &env.topology())
        .await
        .unwrap();
    let shared = Databases::new(&["s1"]);
    let pg = PrivatePostgres::start(crate::helpers::free_port());
    let urls = [pg.url("lapse"), shared.urls()[0].clone()];
    let mut config = env.config();
    config.database.shards = Some(urls.iter().map(Secret::new).collect());
    config.worker.max_attempts = 30;
    // Only the hand-made pack below carries these deadlines.
    config.worker.relay = false;
    let settings = lapse::db::Settings::from_config(&config);
    for (shard, result) in lapse::db::migrate_shards(&config.database, &settings).await {
        assert!(result.is_ok(), "shard {}: {:?}", shard.index, result.err());
    }
    let mut dbs = Vec::new();
    let mut entries = Vec::new();
    for (shard, url) in urls.iter().enumerate() {
        let mut db = connect(url).await;
        let id = create_orders(&mut db, &[Duration::from_millis(300)], &[]).await[0];
        let view = orders::show(&db, id).await.unwrap().unwrap();
        let message =
            lapse::message::TimeoutMessage::new(id.0, view.expire_at, view.deadline_version)
                .in_shard(shard as u16);
        entries.push(message.encode());
        dbs.push(db);
    }
    let worker = env.start(&config).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    pg.stop_server();
    let refs: Vec<&[u8]> = entries.iter().map(Vec::as_slice).collect();
    crate::parked::publish(
        &env,
        &env.names().due_exchange(),
        lapse::names::DUE_ROUTING_KEY,
        &lapse::pack::body(&refs),
        lapin::BasicProperties::default().with_delivery_mode(2),
    )
    .await;
    crate::helpers::wait_closed(&dbs[1], 1, Duration::from_secs(30)).await;
    pg.start_server();
    dbs[0] = connect(&urls[0]).await;
    crate::helpers::wait_closed(&dbs[0], 1, Duration::from_secs(60)).await;
    worker.stop().await;
    for db in &dbs {
        crate::helpers::assert_never_early(db).await;
    }
    let parked = crate::queues::drain_reasons(
        &env.conn,
        &env.names().parked(),
        0,
        Duration::from_millis(500),
    )
    .await;
    assert!(parked.is_empty(), "{parked:?}");
    env.cleanup().await;
}

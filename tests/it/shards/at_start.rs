//! What a worker does at start with several order databases: a shard that does not
//! answer is migrated once it does, and nothing works on it before; an error of one
//! shard names its key, `database.shards[i]`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use lapse::config::{Config, Secret};
use lapse::observe::stats::Outcome;
use lapse::orders::Line;

use super::{Databases, all_closed, clock, connect};
use crate::helpers::{TestEnv, count, create_orders, eventually, free_port};
use crate::tcp_proxy::{Mode, TcpProxy};

/// The same migrations as lapse's, to build the schema of the version before.
mod previous {
    refinery::embed_migrations!("migrations");
}

const ORDERS: i64 = 20;
/// Generous: the test machine is shared and loaded.
const LIMIT: Duration = Duration::from_secs(120);

/// The newest migration this version has.
fn latest_version() -> i32 {
    let runner = previous::migrations::runner();
    runner
        .get_migrations()
        .iter()
        .map(|m| m.version())
        .max()
        .unwrap()
}

/// The database at `url` with every migration but the newest: the schema a rolling
/// upgrade finds in a shard the previous version migrated.
async fn at_previous_version(url: &str) {
    lapse::db::ensure_database(&Secret::new(url.to_string()))
        .await
        .unwrap();
    let (mut client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    previous::migrations::runner()
        .set_target(refinery::Target::Version(latest_version() - 1))
        .run_async(&mut client)
        .await
        .unwrap();
}

async fn schema_version(db: &tokio_postgres::Client) -> i32 {
    db.query_one("SELECT max(version) FROM refinery_schema_history", &[])
        .await
        .unwrap()
        .get(0)
}

/// Orders due 3-9 s from now, one line each.
async fn orders_due_soon(db: &mut tokio_postgres::Client) {
    let deadlines: Vec<Duration> = (0..ORDERS as u64)
        .map(|i| Duration::from_millis(3_000 + i * 300))
        .collect();
    let line = [Line {
        sku: "a".into(),
        qty: 1,
    }];
    create_orders(db, &deadlines, &line).await;
}

/// The promise in one shard: every order closed, none early (nor before `not_before`),
/// one release each, stock back.
async fn assert_closed(shard: u16, db: &tokio_postgres::Client, not_before: Option<DateTime<Utc>>) {
    let q = |sql: &'static str| count(db, sql);
    assert_eq!(
        q("SELECT count(*) FROM orders WHERE closed_at < expire_at").await,
        0,
        "shard {shard}: closed early"
    );
    if let Some(t) = not_before {
        let before: i64 = db
            .query_one("SELECT count(*) FROM orders WHERE closed_at <= $1", &[&t])
            .await
            .unwrap()
            .get(0);
        assert_eq!(before, 0, "shard {shard}: closed before {t}");
    }
    assert_eq!(
        q("SELECT count(*) FROM orders WHERE status = 'CLOSED'").await,
        ORDERS,
        "shard {shard}"
    );
    assert_eq!(
        q("SELECT count(*) FROM stock_ledger WHERE kind = 'release'").await,
        ORDERS,
        "shard {shard}: one release per order"
    );
    assert_eq!(
        q("SELECT count(*) FROM stock WHERE reserved <> 0 OR available <> 1000000").await,
        0,
        "shard {shard}: stock back"
    );
}

/// The previous version's worker, relay only: it publishes both shards' timeouts, then
/// stops; they wait in the tiers for the next worker's consumer.
async fn relay_outboxes(env: &TestEnv, config: &Config, dbs: [&tokio_postgres::Client; 2]) {
    let mut relay_only = config.clone();
    relay_only.worker.consumer = false;
    relay_only.worker.releaser = false;
    let old = env.start(&relay_only).await;
    for db in dbs {
        eventually(LIMIT, "the outbox relayed", || async {
            (count(db, "SELECT count(*) FROM outbox").await == 0).then_some(())
        })
        .await;
    }
    old.stop().await;
}

/// The new version's worker with shard 0 behind `port`, its sweeper on and eager (it
/// would close shard 0's overdue orders if it ran there), and a retry budget that
/// outlasts the outage.
fn upgraded(config: &Config, urls: &[String], port: u16) -> Config {
    let name = urls[0].rsplit_once('/').unwrap().1;
    let mut c = config.clone();
    c.database.shards = Some(vec![
        Secret::new(TcpProxy::url(port, name)),
        Secret::new(urls[1].clone()),
    ]);
    c.worker.migrate_on_start = true;
    c.worker.sweeper = true;
    c.sweeper.interval = Duration::from_millis(300);
    c.sweeper.grace = Duration::ZERO;
    c.worker.max_attempts = 40;
    c
}

/// Blocks shard 0's migrations (lapse's migration lock) while the returned session
/// lives and has not unlocked.
async fn hold_migrations(url: &str) -> tokio_postgres::Client {
    let lock = connect(url).await;
    lock.execute("SELECT pg_advisory_lock($1)", &[&lapse::db::MIGRATION_LOCK])
        .await
        .unwrap();
    lock
}

/// A rolling upgrade whose new version brings a migration: shard 0 (on the previous
/// version's schema, its timeouts in flight) does not answer when the new worker starts.
/// Shard 1 works meanwhile. When shard 0 answers, the worker migrates it in the
/// background; until that commits (held here with the migration lock) nothing touches
/// shard 0, although it answers and its orders are overdue. Then they all close.
// Over 60 lines on purpose: one scenario in phases (before the upgrade, shard 0 away, shard 0 answering but not migrated, migrated), each checked as it happens.
#[tokio::test]
async fn a_shard_down_at_start_is_migrated_when_it_answers_and_only_then_worked_on() {
    let env = TestEnv::new(&["1s", "3s"]).await;
    lapse::amqp::topology::apply(&env.conn, &env.topology())
        .await
        .unwrap();
    let dbs = Databases::new(&["u0", "u1"]);
    let urls = dbs.urls();
    at_previous_version(&urls[0]).await;
    lapse::db::migrate(&Secret::new(urls[1].clone()))
        .await
        .unwrap();
    let (mut db0, mut db1) = (connect(&urls[0]).await, connect(&urls[1]).await);
    orders_due_soon(&mut db0).await;
    orders_due_soon(&mut db1).await;
    let mut config = env.config();
    config.database.shards = Some(urls.iter().map(Secret::new).collect());
    relay_outboxes(&env, &config, [&db0, &db1]).await;

    // Nothing listens on shard 0's port yet: refused, like a stopped server.
    let port = free_port();
    let worker = env.start(&upgraded(&config, &urls, port)).await;
    eventually(
        LIMIT,
        "shard 1 closed and released while shard 0 is away",
        || all_closed(&db1),
    )
    .await;
    eventually(LIMIT, "shard 0's deliveries retried", || async {
        (worker.stats.get(Outcome::Retried) > 0).then_some(())
    })
    .await;

    // Shard 0 answers; the worker's migration of it waits for the lock held here.
    let lock = hold_migrations(&urls[0]).await;
    let proxy = TcpProxy::postgres(port, Mode::Forward);
    eventually(
        LIMIT,
        "the worker's migration of shard 0 waiting",
        || async {
            let waiting = count(
                &db0,
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
                AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            )
            .await;
            (waiting > 0).then_some(())
        },
    )
    .await;
    // Room for sweeps, re-delivered timeouts and relay rounds to reach shard 0.
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Not ready meanwhile: `/readyz` fails on a component that is not up, and the
    // shard's migration is one until it commits.
    let migrating = worker.health.snapshot();
    let state = migrating.get("migrate.s0").expect("a migrate.s0 component");
    assert!(!state.up, "migrate.s0 up before its migration: {state:?}");
    assert_eq!(
        count(&db0, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await,
        0,
        "shard 0 worked on before it was migrated"
    );
    assert_eq!(schema_version(&db0).await, latest_version() - 1);
    let unlocked_at = clock(&db0).await;
    lock.execute(
        "SELECT pg_advisory_unlock($1)",
        &[&lapse::db::MIGRATION_LOCK],
    )
    .await
    .unwrap();

    eventually(LIMIT, "shard 0 closed and released once migrated", || {
        all_closed(&db0)
    })
    .await;
    assert_eq!(schema_version(&db0).await, latest_version(), "migrated");
    eventually(LIMIT, "migrate.s0 up once migrated", || async {
        worker.health.snapshot().get("migrate.s0")?.up.then_some(())
    })
    .await;
    assert_closed(0, &db0, Some(unlocked_at)).await;
    assert_closed(1, &db1, None).await;
    assert_eq!(worker.stats.get(Outcome::Parked), 0);
    assert_eq!(worker.stats.get(Outcome::GaveUp), 0);
    assert!(worker.stop().await.is_empty(), "drained");
    drop(proxy);
    drop((db0, db1, lock));
    drop(dbs);
    env.cleanup().await;
}

/// Runs `lapse worker` with the env's config file and `vars`; its exit status and
/// stderr (it must stop on its own within a minute).
async fn worker_exit(env: &TestEnv, vars: &[(&str, &str)]) -> (Option<i32>, String) {
    crate::helpers::exit_of(crate::helpers::spawn_worker(env, vars)).await
}

async fn migrated(urls: &[String]) {
    for url in urls {
        lapse::db::migrate(&Secret::new(url.clone())).await.unwrap();
    }
}

fn shards_config(env: &TestEnv, urls: &[String]) {
    let list: Vec<String> = urls.iter().map(|u| format!("{u:?}")).collect();
    env.write_config(&format!("[database]\nshards = [{}]\n", list.join(", ")));
}

/// A shard whose schema history has a migration this version does not know (a newer
/// version ran there): refinery refuses it, and the start stops naming that shard.
#[tokio::test]
async fn a_failed_migration_at_start_names_the_shard() {
    let env = TestEnv::new(&["1s"]).await;
    let dbs = Databases::new(&["f0", "f1"]);
    let urls = dbs.urls();
    migrated(&urls).await;
    connect(&urls[1])
        .await
        .batch_execute(
            "INSERT INTO refinery_schema_history (version, name, applied_on, checksum)
             VALUES (999, 'from_a_newer_version', '2026-01-01T00:00:00Z', '0')",
        )
        .await
        .unwrap();
    shards_config(&env, &urls);
    let (code, err) = worker_exit(&env, &[]).await;
    assert_eq!(code, Some(1), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.contains("database.shards[1]") && last.contains("missing from the filesystem"),
        "{err}"
    );
    drop(dbs);
    env.cleanup().await;
}

/// With `worker.migrate_on_start` off the worker checks each shard's schema; a
/// connection that drops after the login is a database that does not answer (its
/// components retry, `lapse worker --help`: exit 3 never): the worker starts, and the
/// warning names the shard, not `database.url`.
#[tokio::test]
async fn a_check_whose_connection_drops_starts_the_worker_and_names_the_shard() {
    let env = TestEnv::new(&["1s"]).await;
    let dbs = Databases::new(&["c0", "c1"]);
    let mut urls = dbs.urls();
    migrated(&urls).await;
    let proxy = TcpProxy::postgres(free_port(), Mode::CutAfterLogin);
    let name = urls[1].rsplit_once('/').unwrap().1.to_string();
    urls[1] = TcpProxy::url(proxy.port, &name);
    shards_config(&env, &urls);
    starts_and_warns_about_shard_1(&env, "start-up check").await;
    drop(proxy);
    drop(dbs);
    env.cleanup().await;
}

/// The same for a server that accepts the connection and then says nothing: the
/// check gives up on the login and the worker starts.
#[tokio::test]
async fn a_check_whose_server_never_answers_starts_the_worker() {
    let env = TestEnv::new(&["1s"]).await;
    let dbs = Databases::new(&["q0"]);
    let mut urls = dbs.urls();
    migrated(&urls).await;
    // Never accepted by the test: the kernel completes the handshake, nobody answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    urls.push(format!(
        "postgres://postgres@127.0.0.1:{}/x",
        silent.local_addr().unwrap().port()
    ));
    shards_config(&env, &urls);
    starts_and_warns_about_shard_1(&env, "did not complete the login").await;
    drop(silent);
    drop(dbs);
    env.cleanup().await;
}

/// Starts `lapse worker` (no migrations at start) and waits for a warning containing
/// `needle` that names `database.shards[1]`; the worker must then keep running.
async fn starts_and_warns_about_shard_1(env: &TestEnv, needle: &str) {
    use tokio::io::AsyncBufReadExt;
    let mut child = crate::helpers::spawn_worker(
        env,
        &[
            ("LAPSE_WORKER__MIGRATE_ON_START", "false"),
            ("LAPSE_LOG", "warn"),
        ],
    );
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let warned = tokio::time::timeout(Duration::from_secs(60), async {
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains(needle) {
                return line;
            }
        }
        String::new()
    })
    .await
    .unwrap_or_else(|_| panic!("no warning containing {needle:?} within 60 s"));
    assert!(
        warned.contains("database.shards[1]") && !warned.contains("database.url"),
        "{warned:?}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "the worker must keep running"
    );
    child.kill().await.unwrap();
}

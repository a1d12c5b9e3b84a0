//! lapse behind PgBouncer (Debian's package), a private instance in front of the test
//! server: in transaction mode (one shared instance) the migrations, the pipeline,
//! payments racing the deadline, the statement timeout and the sweeper's leadership
//! all work; the relay names lost notifications; session mode works without
//! `ignore_startup_parameters`.

use std::time::{Duration, Instant};

use lapse::config::Secret;
use lapse::orders::{Deadline, Line};

use crate::helpers::{
    TestEnv, assert_never_early, count, database_admin_url, eventually, lapse_process, run_lapse,
    signal, spawn_worker, stderr, stdout, wait_released,
};
use crate::leadership::{closed, sweeper_lease_holder};
use crate::private_pgbouncer::{PrivatePgBouncer, shared};

/// A fresh database (created directly: PgBouncer forwards to databases that exist),
/// the topology applied, and a config file whose `database.url` goes through
/// `bouncer`.
async fn behind(bouncer: &PrivatePgBouncer, tiers: &[&str], extra: &str) -> (TestEnv, String) {
    let mut env = TestEnv::new(tiers).await;
    env.database = Some(env.prefix.clone());
    let (admin, connection) = tokio_postgres::connect(&database_admin_url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    admin
        .batch_execute(&format!("CREATE DATABASE \"{}\"", env.prefix))
        .await
        .unwrap();
    let report = lapse::amqp::topology::apply(&env.conn, &env.topology())
        .await
        .unwrap();
    assert!(report.ok(), "{report:?}");
    let url = bouncer.url(&env.prefix);
    env.write_config(&format!("[database]\nurl = {url:?}\n{extra}"));
    (env, url)
}

/// Two `lapse migrate` at once through the pooler: both succeed, each migration is
/// applied once (the lock is a transaction's, on one server connection).
async fn migrate_twice_at_once(env: &TestEnv) {
    let config = env.config_path().display().to_string();
    let run = |config: String| {
        let mut cmd = lapse_process();
        cmd.args(["--config", &config, "migrate"]);
        cmd.output()
    };
    let (a, b) = tokio::join!(run(config.clone()), run(config));
    for out in [a.unwrap(), b.unwrap()] {
        assert!(
            out.status.success(),
            "lapse migrate through PgBouncer: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let db = env.db().await;
    let repeated = count(
        &db,
        "SELECT count(*) FROM (SELECT version FROM refinery_schema_history
                                GROUP BY version HAVING count(*) > 1) r",
    )
    .await;
    assert_eq!(repeated, 0, "a migration applied twice");
    assert!(count(&db, "SELECT count(*) FROM refinery_schema_history").await >= 11);
}

/// Every order created through the pooler is paid at its deadline by a `lapse order
/// pay` of its own, all at once, while two workers close them through the pooler:
/// each payment's answer holds (paid → PAID; refused → CLOSED and recorded as a late
/// payment), every other order is closed once, never early, its stock released once.
#[tokio::test]
async fn payments_racing_closes_through_pgbouncer_in_transaction_mode() {
    const ORDERS: usize = 24;
    let bouncer = shared();
    let (env, url) = behind(bouncer, &["1s"], "").await;
    migrate_twice_at_once(&env).await;
    let workers = [spawn_worker(&env, &[]), spawn_worker(&env, &[])];

    // Orders created through the pooler, by the library an application links.
    let mut database = env.config().database.clone();
    database.url = Secret::new(url);
    let pool = lapse::db::pool(&database, 4).unwrap();
    let lines = [Line {
        sku: "pooled".into(),
        qty: 2,
    }];
    // In the application's transactions (which find lapse's schema), as behind any
    // pooler in transaction mode.
    let mut client = pool.get().await.unwrap();
    let tx = lapse::db::begin(&mut client, pool.limits()).await.unwrap();
    lapse::orders::ensure_stock(&tx, &["pooled".to_string()], 1_000_000)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mut ids = Vec::new();
    for _ in 0..ORDERS {
        let tx = lapse::db::begin(&mut client, pool.limits()).await.unwrap();
        let id = lapse::orders::create(&tx, Deadline::In(Duration::from_secs(3)), &lines)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        ids.push(id.0);
    }
    drop(client);
    let created = Instant::now();
    tokio::time::sleep(Duration::from_millis(2_850).saturating_sub(created.elapsed())).await;

    let config = env.config_path().display().to_string();
    let payments: Vec<_> = ids
        .iter()
        .map(|id| {
            let mut cmd = lapse_process();
            cmd.args(["--config", &config, "order", "pay", &id.to_string()]);
            async move { (*id, cmd.output().await.unwrap()) }
        })
        .collect();
    let answers = futures_util::future::join_all(payments).await;

    let db = env.db().await;
    eventually(
        Duration::from_secs(60),
        "every unpaid order closed",
        || async {
            (count(&db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await == 0)
                .then_some(())
        },
    )
    .await;
    for (id, out) in &answers {
        let status: String = db
            .query_one("SELECT status FROM orders WHERE id = $1", &[id])
            .await
            .unwrap()
            .get(0);
        let said = stdout(out);
        match out.status.code() {
            Some(0) => assert_eq!(status, "PAID", "order {id}: {said}"),
            Some(1) => {
                assert!(
                    said.contains("refused"),
                    "order {id}: {said} {}",
                    stderr(out)
                );
                assert_eq!(status, "CLOSED", "order {id}: {said}");
            }
            other => panic!(
                "order {id}: lapse order pay exited {other:?}: {}",
                stderr(out)
            ),
        }
    }
    let closed = count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
    let refused = answers
        .iter()
        .filter(|(_, o)| o.status.code() == Some(1))
        .count();
    assert_eq!(
        count(&db, "SELECT count(*) FROM late_payments").await,
        i64::try_from(refused).unwrap(),
        "each refused payment recorded once"
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM order_events WHERE event = 'closed'"
        )
        .await,
        closed,
        "each order closed once"
    );
    wait_released(&db, closed).await;
    assert_never_early(&db).await;
    drop(workers);
    env.cleanup().await;
}

/// Orders only the sweeper can close; two sweeping workers through the pooler; the
/// leader is frozen mid-sweep: the other takes over within the lease (3 s) plus the
/// frozen transaction's idle limit (5 s), closes the rest, each order once.
#[tokio::test]
async fn a_frozen_sweeper_leader_is_replaced_through_pgbouncer() {
    const ORDERS: i64 = 30;
    let (env, _) = behind(shared(), &["1s"], "").await;
    migrate_twice_at_once(&env).await;
    let mut db = env.db().await;
    crate::helpers::create_orders(
        &mut db,
        &[Duration::from_millis(100); ORDERS as usize],
        &[Line {
            sku: "lost-intent".into(),
            qty: 1,
        }],
    )
    .await;
    db.execute("DELETE FROM outbox", &[]).await.unwrap();
    let sweeping = [
        ("LAPSE_SWEEPER__INTERVAL", "1s"),
        ("LAPSE_SWEEPER__GRACE", "100ms"),
        ("LAPSE_SWEEPER__BATCH_SIZE", "2"),
        ("LAPSE_SWEEPER__LEASE", "3s"),
        ("LAPSE_WORKER__CLOSES_PER_SECOND", "4"),
        ("LAPSE_DATABASE__STATEMENT_TIMEOUT", "5s"),
    ];
    let leader = spawn_worker(&env, &sweeping);
    eventually(
        Duration::from_secs(60),
        "the first worker sweeping",
        || async { (closed(&db).await >= 4).then_some(()) },
    )
    .await;
    signal(&leader, "STOP");
    let frozen_at = Instant::now();
    assert!(closed(&db).await < ORDERS, "the leader froze mid-sweep");
    let other = spawn_worker(&env, &sweeping);
    eventually(
        Duration::from_secs(90),
        "every order closed by the other worker",
        || async { (closed(&db).await == ORDERS).then_some(()) },
    )
    .await;
    let took = frozen_at.elapsed();
    let holder = sweeper_lease_holder(&db).await;
    assert!(
        holder.starts_with(&format!("pid {} ", other.id().unwrap())),
        "the other worker leads: {holder} (after {took:?})"
    );
    signal(&leader, "CONT");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM order_events WHERE event = 'closed'"
        )
        .await,
        ORDERS,
        "each order closed exactly once"
    );
    drop((leader, other));
    env.cleanup().await;
}

/// Through the pooler, the timeouts still hold (set per transaction, not as startup
/// options): a payment waiting for a row the application keeps locked ends with the
/// server's statement timeout, SQLSTATE shown, instead of waiting.
#[tokio::test]
async fn the_statement_timeout_holds_through_pgbouncer_in_transaction_mode() {
    let (env, url) = behind(shared(), &["1s"], "").await;
    let out = env.lapse(&["migrate"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut db = env.db().await;
    let ids = crate::helpers::create_orders(
        &mut db,
        &[Duration::from_secs(600)],
        &[Line {
            sku: "held".into(),
            qty: 1,
        }],
    )
    .await;
    let tx = db.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM orders WHERE id = $1 FOR UPDATE",
        &[&ids[0].0],
    )
    .await
    .unwrap();
    let started = Instant::now();
    let out = run_lapse(
        &[
            "--config",
            env.config_path().to_str().unwrap(),
            "order",
            "pay",
            &ids[0].0.to_string(),
        ],
        &[("LAPSE_DATABASE__STATEMENT_TIMEOUT", "1s")],
    );
    let waited = started.elapsed();
    assert!(
        !out.status.success(),
        "the payment cannot have gone through"
    );
    assert!(
        stderr(&out).contains("57014"),
        "the server's statement timeout, with its SQLSTATE: {}",
        stderr(&out)
    );
    assert!(waited < Duration::from_secs(30), "waited {waited:?}");
    tx.rollback().await.unwrap();
    drop(url);
    env.cleanup().await;
}

/// LISTEN through a transaction-mode pooler hears nothing: `lapse status` says so and
/// names `relay.listen_url`; with `relay.listen_url` pointing at the server it does not.
#[tokio::test]
async fn status_names_notifications_lost_behind_a_pooler_and_listen_url_fixes_it() {
    let (env, url) = behind(shared(), &["1s"], "").await;
    let out = env.lapse(&["migrate"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = env.lapse(&["status", "--check"]);
    assert!(
        stdout(&out).contains("RELAY_NOTIFICATIONS") && stdout(&out).contains("relay.listen_url"),
        "lost notifications named: {}",
        stdout(&out)
    );
    let shown = env.lapse(&["status"]);
    assert!(
        stdout(&shown).contains("warning: notifications on the outbox channel are not arriving"),
        "{}",
        stdout(&shown)
    );

    env.write_config(&format!(
        "[database]\nurl = {url:?}\n\n[relay]\nlisten_url = {:?}\n",
        env.database_url()
    ));
    let out = env.lapse(&["status", "--check"]);
    assert!(
        stdout(&out).contains("NO_CONSUMER") && !stdout(&out).contains("RELAY_NOTIFICATIONS"),
        "notifications arrive on the direct connection: {}",
        stdout(&out)
    );
    env.cleanup().await;
}

/// Session mode refused lapse's startup options before; now it needs no
/// `ignore_startup_parameters`: migrate, create, pay and show work.
#[tokio::test]
async fn lapse_works_through_pgbouncer_in_session_mode() {
    let bouncer = PrivatePgBouncer::start("session");
    let (env, _) = behind(&bouncer, &["1s"], "").await;
    let out = env.lapse(&["migrate"]);
    assert!(out.status.success(), "migrate: {}", stderr(&out));
    let out = env.lapse(&["order", "create", "--expires-in", "10m", "--line", "s:1"]);
    assert!(out.status.success(), "create: {}", stderr(&out));
    let id = stdout(&out).trim().to_string();
    let out = env.lapse(&["order", "pay", &id]);
    assert!(out.status.success(), "pay: {}", stderr(&out));
    let out = env.lapse(&["order", "show", &id]);
    assert!(stdout(&out).contains("PAID"), "show: {}", stdout(&out));
    env.cleanup().await;
    drop(bouncer);
}

/// One server connection for every client: a statement left prepared by any of them
/// (a named statement closed after its transaction, or never) would stay on it. After
/// a migration (which needs one server connection), a worker's whole pipeline,
/// `lapse order` and `lapse status`, nothing is prepared on the server connection.
#[tokio::test]
async fn nothing_is_left_prepared_on_a_single_shared_server_connection() {
    let bouncer = PrivatePgBouncer::start_with("transaction", 1);
    let (env, url) = behind(&bouncer, &["1s"], "").await;
    let out = env.lapse(&["migrate"]);
    assert!(out.status.success(), "migrate: {}", stderr(&out));
    let worker = spawn_worker(&env, &[("LAPSE_SWEEPER__INTERVAL", "1s")]);
    let mut ids = Vec::new();
    for _ in 0..6 {
        let out = env.lapse(&["order", "create", "--expires-in", "2s", "--line", "one:1"]);
        assert!(out.status.success(), "create: {}", stderr(&out));
        ids.push(stdout(&out).trim().to_string());
    }
    for id in &ids[..2] {
        let out = env.lapse(&["order", "pay", id]);
        assert!(out.status.success(), "pay: {}", stderr(&out));
    }
    let out = env.lapse(&["order", "show", &ids[0]]);
    assert!(out.status.success(), "show: {}", stderr(&out));
    let db = env.db().await;
    eventually(
        Duration::from_secs(60),
        "the unpaid orders closed and released",
        || async {
            (count(
                &db,
                "SELECT count(*) FROM orders WHERE status = 'CLOSED' AND released_at IS NOT NULL",
            )
            .await
                == 4)
                .then_some(())
        },
    )
    .await;
    let _ = env.lapse(&["status"]);
    let (pooled, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let left: Vec<String> = pooled
        .simple_query(
            "SELECT string_agg(name || ': ' || statement, '; ') FROM pg_prepared_statements",
        )
        .await
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
            _ => None,
        })
        .collect();
    assert!(
        left.is_empty(),
        "left prepared on the server connection: {left:?}"
    );
    assert_never_early(&db).await;
    drop(worker);
    env.cleanup().await;
    drop(bouncer);
}

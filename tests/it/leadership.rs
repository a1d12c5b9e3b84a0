//! The sweeper's leadership is a lease judged by the database clock and renewed by
//! every batch: a leader frozen mid-sweep (SIGSTOP: its connections stay open, its
//! kernel still answers keepalives) loses the lead within the lease, another worker
//! sweeps, and the old leader, woken up, writes nothing more.

use std::process::Stdio;
use std::time::Duration;

use lapse::orders::Line;

use crate::helpers::{TestEnv, count, create_orders, eventually, lapse_process, signal};

/// Orders only the sweeper can close (their timeout intents are lost).
const ORDERS: i64 = 40;

/// A worker with a slow, paced sweeper: batches of 2 at 4 closes a second, so that a
/// sweep of [`ORDERS`] lasts about 10 s; a 3 s lease.
fn sweeping_worker(env: &TestEnv) -> tokio::process::Child {
    lapse_process()
        .args(["--config", env.config_path().to_str().unwrap(), "worker"])
        .envs([
            ("LAPSE_SWEEPER__INTERVAL", "1s"),
            ("LAPSE_SWEEPER__GRACE", "100ms"),
            ("LAPSE_SWEEPER__BATCH_SIZE", "2"),
            ("LAPSE_SWEEPER__LEASE", "3s"),
            ("LAPSE_WORKER__CLOSES_PER_SECOND", "4"),
            // A leader frozen inside a batch's transaction keeps the lease row locked
            // until the server ends that transaction.
            ("LAPSE_DATABASE__STATEMENT_TIMEOUT", "5s"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

pub(crate) async fn closed(db: &tokio_postgres::Client) -> i64 {
    count(db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await
}

/// Who holds the sweeper's lease (`pid <pid> ...`).
pub(crate) async fn sweeper_lease_holder(db: &tokio_postgres::Client) -> String {
    db.query_one(
        "SELECT holder FROM lapse_leader_leases WHERE name = 'sweeper'",
        &[],
    )
    .await
    .unwrap()
    .get("holder")
}

#[tokio::test]
async fn a_frozen_sweeper_leader_loses_the_lead_and_another_worker_sweeps() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    let lines = [Line {
        sku: "lost-intent".into(),
        qty: 1,
    }];
    create_orders(
        &mut db,
        &[Duration::from_millis(100); ORDERS as usize],
        &lines,
    )
    .await;
    db.execute("DELETE FROM outbox", &[]).await.unwrap();

    let leader = sweeping_worker(&env);
    eventually(
        Duration::from_secs(60),
        "the first worker sweeping",
        || async { (closed(&db).await >= 4).then_some(()) },
    )
    .await;
    signal(&leader, "STOP");
    let at_freeze = closed(&db).await;
    assert!(
        at_freeze < ORDERS,
        "the leader froze mid-sweep ({at_freeze} closed)"
    );

    let other = sweeping_worker(&env);
    eventually(
        Duration::from_secs(60),
        "every order closed by the other worker while the leader is frozen",
        || async { (closed(&db).await == ORDERS).then_some(()) },
    )
    .await;
    let holder = sweeper_lease_holder(&db).await;
    let other_pid = other.id().unwrap();
    assert!(
        holder.starts_with(&format!("pid {other_pid} ")),
        "the other worker holds the lease: {holder}"
    );

    // Woken up, the old leader finds the lease gone and writes nothing.
    signal(&leader, "CONT");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let closes = count(
        &db,
        "SELECT count(*) FROM order_events WHERE event = 'closed'",
    )
    .await;
    assert_eq!(closes, ORDERS, "each order closed exactly once");
    drop(leader);
    drop(other);
    env.cleanup().await;
}

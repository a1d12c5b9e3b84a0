//! lapse on a 3-node RabbitMQ cluster under load: a node crashes (the due queue's
//! leader, then the busiest wait tier's leader) or is stopped for 10 s and comes back,
//! while two workers close a couple of thousand orders due over ~20 s; last, the due
//! queue's leader and one of the two workers (a process) are SIGKILLed together. Each time: none
//! early, every order closed exactly once, stock consistent, and lateness within a
//! generous bound (printed, see docs/scaling.md).
//!
//! Long (a few minutes), so it runs only with `RUN_CLUSTER_TESTS=1` (`scripts/test.sh` sets it unless told 0).
//! Not `LAPSE_...`: every `LAPSE_` variable is read as a configuration key.

use std::time::{Duration, Instant};

use lapse::amqp::topology::Topology;
use lapse::config::{Config, Secret};
use lapse::names::Names;
use lapse::orders::Line;
use lapse::tier_file::TierFile;

use crate::helpers::{
    Running, assert_never_early, count, create_orders, database_url, drop_database, eventually,
    init_logs, run_lapse, stdout, unique,
};
use crate::private_cluster::PrivateCluster;

const ORDERS: usize = 2_000;
const TIERS: [&str; 3] = ["1s", "5s", "15s"];
/// Generous: leader election and reconnect take seconds; a loaded 2-core machine more.
const LATENESS_BOUND: Duration = Duration::from_secs(60);

fn enabled() -> bool {
    if std::env::var("RUN_CLUSTER_TESTS").is_ok_and(|v| v == "1") {
        return true;
    }
    eprintln!("cluster tests not run: set RUN_CLUSTER_TESTS=1 (scripts/test.sh does)");
    false
}

/// What happens to the cluster mid-run.
#[derive(Clone, Copy, Debug)]
enum Fault {
    KillDueLeader,
    KillBusiestTierLeader,
    StopDueLeaderFor10s,
    /// SIGKILL the due queue's leader and, at the same moment, a worker process.
    KillDueLeaderAndAWorker,
}

impl Fault {
    const ALL: [Fault; 4] = [
        Fault::KillDueLeader,
        Fault::KillBusiestTierLeader,
        Fault::StopDueLeaderFor10s,
        Fault::KillDueLeaderAndAWorker,
    ];
}

/// One scenario's database, dropped also when the test fails.
struct Db(String);

impl Drop for Db {
    fn drop(&mut self) {
        let name = self.0.clone();
        let _ = std::thread::spawn(move || {
            tokio::runtime::Runtime::new()
                .unwrap()
                .block_on(drop_database(&name));
        })
        .join();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_node_cluster_keeps_the_promise_through_node_failures() {
    if !enabled() {
        return;
    }
    init_logs();
    let cluster = PrivateCluster::start(3);
    topology_is_replicated_on_every_node(&cluster);
    let mut faults = Fault::ALL.to_vec();
    // `CLUSTER_FAULTS=KillDueLeaderAndAWorker,...` runs only the scenarios named.
    if let Ok(only) = std::env::var("CLUSTER_FAULTS") {
        let only: Vec<&str> = only.split(',').map(str::trim).collect();
        faults = Fault::ALL
            .into_iter()
            .filter(|f| only.contains(&format!("{f:?}").as_str()))
            .collect();
        assert!(
            !faults.is_empty(),
            "CLUSTER_FAULTS names none of {:?}",
            Fault::ALL
        );
    }
    for fault in faults {
        run_scenario(&cluster, fault).await;
    }
}

/// `topology apply` on the cluster gives every queue 3 members; `verify` says so, and
/// fails naming the offline member while a node is down.
fn topology_is_replicated_on_every_node(cluster: &PrivateCluster) {
    let dir = tempfile::tempdir().unwrap();
    let tiers = dir.path().join("tiers.toml");
    std::fs::write(&tiers, "tiers = [\"1s\", \"5s\"]\n").unwrap();
    let urls = cluster.urls();
    let mgmt = cluster.management_url(2);
    let env = [
        ("LAPSE_BROKER__URL", urls.as_str()),
        ("LAPSE_BROKER__MANAGEMENT_URL", mgmt.as_str()),
        ("LAPSE_BROKER__PREFIX", "replicas"),
        ("LAPSE_TOPOLOGY__FILE", tiers.to_str().unwrap()),
    ];
    let out = run_lapse(&["topology", "apply"], &env);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let out = run_lapse(&["topology", "verify"], &env);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let text = stdout(&out);
    let replicas: Vec<&str> = text.lines().filter(|l| l.contains(" replicas ")).collect();
    assert_eq!(
        replicas.len(),
        5,
        "wait.1s, wait.5s, due, parked, stock.release\n{text}"
    );
    for line in &replicas {
        assert!(
            line.contains("3 members") && line.contains("target 3"),
            "{line}"
        );
    }
    // Leaders spread over the nodes (`x-queue-leader-locator: balanced`), not all on
    // the node `apply` connected to.
    let leaders: std::collections::BTreeSet<&str> = replicas
        .iter()
        .filter_map(|l| l.split("leader ").nth(1))
        .map(|l| l.split_whitespace().next().unwrap_or(l))
        .collect();
    assert!(leaders.len() >= 2, "leaders {leaders:?}\n{text}");
    cluster.stop_node(3);
    // The API shows a stopped member offline after a few seconds.
    let started = Instant::now();
    let out = loop {
        let out = run_lapse(&["topology", "verify"], &env);
        if stdout(&out).contains("offline: ") || started.elapsed() > Duration::from_secs(60) {
            break out;
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    cluster.start_node(3);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let text = stdout(&out);
    let offline = text
        .lines()
        .filter(|l| {
            l.starts_with("FAILED")
                && l.contains(" replicas ")
                && l.contains("offline: lapse-test-")
        })
        .count();
    assert!(offline >= 1, "{text}");
}

async fn run_scenario(cluster: &PrivateCluster, fault: Fault) {
    cluster.wait_all_running().await;
    let prefix = unique("c");
    let db_name = Db(prefix.clone());
    let db_url = database_url(&db_name.0);
    lapse::db::migrate(&Secret::new(db_url.clone()))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tier_path = dir.path().join("tiers.toml");
    let quoted: Vec<String> = TIERS.iter().map(|t| format!("{t:?}")).collect();
    std::fs::write(&tier_path, format!("tiers = [{}]\n", quoted.join(", "))).unwrap();
    let topology = Topology::new(
        &Names::new(prefix.clone()),
        &TierFile::load(&tier_path).unwrap(),
    )
    .with_group_size(3);
    let conn = lapse::amqp::broker::connect(&Secret::new(cluster.urls()), "lapse test")
        .await
        .unwrap();
    let report = lapse::amqp::topology::apply(&conn, &topology)
        .await
        .unwrap();
    assert!(report.ok(), "{report:?}");
    lapse::amqp::broker::close_quietly(&conn, "done").await;

    // Where the due queue's leader is to fail, every worker connects to its node
    // first: the fault then also takes every connection, so the workers must reconnect
    // and consume again on a node whose queue is electing a new leader (the hard case;
    // a worker on another node only sees the leader move).
    let first = match fault {
        Fault::KillBusiestTierLeader => 1,
        _ => {
            let leader = cluster.queue(&Names::new(prefix.clone()).due_queue()).await;
            cluster.index_of(&leader.leader.unwrap())
        }
    };
    let urls = cluster.urls_from(first);
    let config = config(&urls, &prefix, &db_url, &tier_path);
    // The second worker is a process where one is to be SIGKILLed, in-process otherwise.
    let workers = match fault {
        Fault::KillDueLeaderAndAWorker => vec![start(&config).await],
        _ => vec![start(&config).await, start(&config).await],
    };
    let mut process = match fault {
        Fault::KillDueLeaderAndAWorker => {
            Some(worker_process(&urls, &prefix, &db_url, &tier_path).await)
        }
        _ => None,
    };
    let (mut db, connection) = tokio_postgres::connect(
        &crate::helpers::on_lapse_path(&db_url),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    // Due from 5 s to 25 s after creation, 10 ms apart.
    let deadlines: Vec<Duration> = (0..ORDERS as u64)
        .map(|i| Duration::from_millis(5_000 + i * 10))
        .collect();
    let lines = [Line {
        sku: "apple".into(),
        qty: 1,
    }];
    let started = Instant::now();
    create_orders(&mut db, &deadlines, &lines).await;
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(started.elapsed())).await;

    // Mid-run: about a third of the orders are due, the rest wait in the tiers.
    let names = Names::new(prefix.clone());
    let queue = match fault {
        Fault::KillBusiestTierLeader => busiest_tier(cluster, &names).await,
        _ => names.due_queue(),
    };
    let leader = cluster.queue(&queue).await.leader.unwrap();
    let node = cluster.index_of(&leader);
    if !matches!(fault, Fault::KillBusiestTierLeader) {
        every_connection_is_on(cluster, &prefix, &leader).await;
    }
    let fault_at = db_now(&db).await;
    match fault {
        Fault::KillDueLeader | Fault::KillBusiestTierLeader => cluster.kill(node),
        Fault::StopDueLeaderFor10s => cluster.stop_node(node),
        Fault::KillDueLeaderAndAWorker => {
            cluster.kill(node);
            let mut child = process.take().expect("the worker process");
            child.start_kill().expect("SIGKILL the worker");
            child.wait().await.unwrap();
        }
    }
    if let Fault::StopDueLeaderFor10s = fault {
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
    // Crashed or stopped, the node comes back (for the next scenario too).
    cluster.start_node(node);

    let waited = Instant::now();
    while count(&db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await > 0 {
        if waited.elapsed() > Duration::from_secs(180) {
            let health: Vec<String> = workers
                .iter()
                .map(|w| format!("{:?}", w.health.snapshot()))
                .collect();
            panic!(
                "{fault:?}: not every order closed: {}; in-process workers' health: {}",
                diagnose(cluster, &db, &names).await,
                health.join(" | ")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_never_early(&db).await;
    assert_eq!(
        count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await,
        ORDERS as i64
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM (SELECT order_id FROM order_events WHERE event = 'closed' \
             GROUP BY order_id HAVING count(*) <> 1) x"
        )
        .await,
        0,
        "an order closed more than once"
    );
    eventually(Duration::from_secs(60), "every stock release", || async {
        let released = count(
            &db,
            "SELECT count(*) FROM stock_ledger WHERE kind = 'release'",
        )
        .await;
        assert!(released <= ORDERS as i64, "{released} releases");
        (released == ORDERS as i64).then_some(())
    })
    .await;
    let stock = db
        .query_one(
            "SELECT available, reserved, sold FROM stock WHERE sku = 'apple'",
            &[],
        )
        .await
        .unwrap();
    let (available, reserved, sold): (i64, i64, i64) = (
        stock.get("available"),
        stock.get("reserved"),
        stock.get("sold"),
    );
    assert_eq!(
        (available, reserved, sold),
        (1_000_000, 0, 0),
        "stock after every release"
    );

    let (all_max, affected_n, affected_p50, affected_p99, affected_max) =
        lateness(&db, fault_at).await;
    eprintln!(
        "cluster {fault:?} (queue {queue}, node {leader}): lateness max {all_max:.0} ms over all \
         {ORDERS}; orders due from the fault on: {affected_n}, p50 {affected_p50:.0} ms, \
         p99 {affected_p99:.0} ms, max {affected_max:.0} ms"
    );
    assert!(
        all_max < LATENESS_BOUND.as_millis() as f64,
        "{fault:?}: an order closed {all_max:.0} ms late"
    );
    for w in workers {
        w.stop().await;
    }
}

fn config(urls: &str, prefix: &str, db_url: &str, tiers: &std::path::Path) -> Config {
    let mut c = Config::default();
    c.broker.url = Secret::new(urls.to_string());
    c.broker.prefix = prefix.to_string();
    c.broker.heartbeat = Duration::from_secs(5);
    c.database.url = Secret::new(db_url);
    c.database.pool_size = 4;
    c.topology.file = Some(tiers.to_path_buf());
    // The message path alone must keep the promise: no sweeper to rescue it.
    c.worker.sweeper = false;
    c.worker.migrate_on_start = false;
    c.relay.tier_tolerance = Duration::from_millis(100);
    c.worker.drain_timeout = Duration::from_secs(5);
    c.relay.poll_interval = Duration::from_millis(200);
    c
}

async fn start(config: &Config) -> Running {
    Running::start(config).await
}

/// `lapse worker` as its own process, configured like [`config`], once it has taken
/// work (its consumer holds deliveries when it is killed).
async fn worker_process(
    urls: &str,
    prefix: &str,
    db_url: &str,
    tiers: &std::path::Path,
) -> tokio::process::Child {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_lapse"))
        .arg("worker")
        .env("LAPSE_BROKER__URL", urls)
        .env("LAPSE_BROKER__PREFIX", prefix)
        .env("LAPSE_BROKER__HEARTBEAT", "5s")
        .env("LAPSE_DATABASE__URL", db_url)
        .env("LAPSE_DATABASE__POOL_SIZE", "4")
        .env("LAPSE_TOPOLOGY__FILE", tiers)
        .env("LAPSE_WORKER__SWEEPER", "false")
        .env("LAPSE_WORKER__MIGRATE_ON_START", "false")
        .env("LAPSE_WORKER__DRAIN_TIMEOUT", "5s")
        .env("LAPSE_RELAY__TIER_TOLERANCE", "100ms")
        .env("LAPSE_RELAY__POLL_INTERVAL", "200ms")
        .env("LAPSE_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start lapse worker");
    let due = Names::new(prefix.to_string()).due_queue();
    let conn = lapse::amqp::broker::connect(&Secret::new(urls.to_string()), "lapse test")
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    eventually(
        Duration::from_secs(60),
        "the worker process consuming",
        || async {
            let queue = channel
                .queue_declare(
                    due.as_str().into(),
                    lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    Default::default(),
                )
                .await
                .unwrap();
            (queue.consumer_count() >= 2).then_some(())
        },
    )
    .await;
    lapse::amqp::broker::close_quietly(&conn, "done").await;
    child
}

/// Every worker connection of `prefix` is on node `leader` (the management API shows
/// connections a few seconds late, hence the wait): the fault then takes them all.
async fn every_connection_is_on(cluster: &PrivateCluster, prefix: &str, leader: &str) {
    let m = lapse::amqp::management::Management::new(&Secret::new(
        cluster.management_url(cluster.index_of(leader)),
    ))
    .unwrap();
    eventually(
        Duration::from_secs(30),
        "worker connections listed",
        || async {
            let ours: Vec<_> = m
                .connections()
                .await
                .ok()?
                .into_iter()
                .filter(|c| c.client_name().is_some_and(|n| n.ends_with(prefix)))
                .collect();
            // Each worker: consumer and releaser (a consuming and a publishing
            // connection each), relay, queue gauges.
            (ours.len() >= 12).then_some(ours)
        },
    )
    .await
    .iter()
    .for_each(|c| {
        assert_eq!(
            c.node.as_deref(),
            Some(leader),
            "connection {:?} is not on the due queue's leader",
            c.client_name()
        )
    });
}

/// The wait tier holding the most messages now.
async fn busiest_tier(cluster: &PrivateCluster, names: &Names) -> String {
    let mut best = (format!("{}{}", names.wait_queue_prefix(), TIERS[0]), 0);
    for tier in TIERS {
        let name = format!("{}{tier}", names.wait_queue_prefix());
        let depth = cluster.queue(&name).await.messages.unwrap_or(0);
        if depth > best.1 {
            best = (name, depth);
        }
    }
    best.0
}

/// What is left where, for a failure message.
async fn diagnose(cluster: &PrivateCluster, db: &tokio_postgres::Client, names: &Names) -> String {
    let mut out = format!(
        "unpaid {}, overdue {}, outbox {}",
        count(db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await,
        count(
            db,
            "SELECT count(*) FROM orders WHERE status = 'UNPAID' AND expire_at < now()"
        )
        .await,
        count(db, "SELECT count(*) FROM outbox").await
    );
    let mut queues: Vec<String> = TIERS
        .iter()
        .map(|t| format!("{}{t}", names.wait_queue_prefix()))
        .collect();
    queues.extend([
        names.due_queue(),
        names.parked(),
        names.stock_release_queue(),
    ]);
    for q in queues {
        let info = cluster.queue(&q).await;
        out.push_str(&format!(
            "; {q}: {:?} messages ({:?} ready, {:?} unacked), {:?} consumers, leader {:?}, online {:?}",
            info.messages,
            info.messages_ready,
            info.messages_unacknowledged,
            info.consumers,
            info.leader,
            info.online
        ));
    }
    out
}

async fn db_now(db: &tokio_postgres::Client) -> f64 {
    db.query_one("SELECT extract(epoch FROM now())::float8 AS now_s", &[])
        .await
        .unwrap()
        .get("now_s")
}

/// Lateness in ms: the maximum over all orders; count, p50, p99 and maximum of the
/// orders due at or after the fault.
async fn lateness(db: &tokio_postgres::Client, fault_at: f64) -> (f64, i64, f64, f64, f64) {
    let all: f64 = db
        .query_one(
            "SELECT (extract(epoch FROM max(closed_at - expire_at)) * 1000)::float8 AS max_ms FROM orders",
            &[],
        )
        .await
        .unwrap()
        .get("max_ms");
    let row = db
        .query_one(
            "WITH l AS (SELECT extract(epoch FROM closed_at - expire_at) * 1000 AS ms \
               FROM orders WHERE extract(epoch FROM expire_at)::float8 >= $1) \
             SELECT count(*) AS closed, \
                    coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), 0)::float8 AS p50, \
                    coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), 0)::float8 AS p99, \
                    coalesce(max(ms), 0)::float8 AS max FROM l",
            &[&fault_at],
        )
        .await
        .unwrap();
    (
        all,
        row.get("closed"),
        row.get("p50"),
        row.get("p99"),
        row.get("max"),
    )
}

//! `TestEnv`: a unique prefix, a private directory with a tier file and config,
//! connections to the real services, and cleanup of everything created.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use std::time::{Duration, Instant};

use lapse::amqp::management::Management;
use lapse::amqp::topology::Topology;
use lapse::config::{Config, Secret};
use lapse::names::Names;
use lapse::observe::stats::Stats;
use lapse::orders::{self, Deadline, Line, OrderId};
use lapse::service::Service;
use lapse::tier_file::TierFile;
use tokio_util::sync::CancellationToken;

// The services the tests use can be moved with TEST_BROKER_AMQP_URL,
// TEST_BROKER_MANAGEMENT_URL and TEST_DATABASE_URL (not LAPSE_*: the lapse processes
// the tests start would take those for configuration keys).
pub fn amqp_url() -> String {
    std::env::var("TEST_BROKER_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

pub fn management_url() -> String {
    std::env::var("TEST_BROKER_MANAGEMENT_URL")
        .unwrap_or_else(|_| "http://guest:guest@127.0.0.1:15672".into())
}

pub fn database_admin_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// The admin URL with another database name.
pub fn database_url(name: &str) -> String {
    let admin = database_admin_url();
    let (base, _) = admin.rsplit_once('/').expect("a URL with a database");
    format!("{base}/{name}")
}

/// `url` for the tests' own connections: lapse's schema on the search path, as an
/// application that uses the example shop has it (lapse's own connections set it per
/// transaction instead).
pub fn on_lapse_path(url: &str) -> String {
    let join = if url.contains('?') { '&' } else { '?' };
    format!("{url}{join}options=-c%20search_path%3Dlapse%2Cpublic")
}

/// A connection to the test's database (on lapse's search path), and what the server
/// sends it unasked (notifications, notices) as `pick` reads it.
pub async fn connect_hearing(
    env: &TestEnv,
    pick: fn(tokio_postgres::AsyncMessage) -> Option<String>,
) -> (
    tokio_postgres::Client,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    use futures_util::StreamExt;
    let (client, mut connection) =
        tokio_postgres::connect(&on_lapse_path(&env.database_url()), tokio_postgres::NoTls)
            .await
            .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(m)) = messages.next().await {
            if let Some(heard) = pick(m) {
                let _ = tx.send(heard);
            }
        }
    });
    (client, rx)
}

/// A loopback port nobody listens on right now, for a server a test starts. Taken
/// below the kernel's ephemeral range (32768 and up here, and by default on Linux), so
/// the port cannot be handed to an outgoing connection between this check and the
/// server's bind; a process-wide cursor from a random start keeps parallel tests of
/// this process, and other test processes, apart.
pub fn free_port() -> u16 {
    use std::sync::atomic::AtomicU16;
    const LOW: u16 = 20_000;
    const SPAN: u16 = 12_000;
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let _ = NEXT.compare_exchange(
        0,
        fastrand::u16(1..SPAN),
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let port = LOW + NEXT.fetch_add(1, Ordering::SeqCst) % SPAN;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port between {LOW} and {}", LOW + SPAN)
}

pub fn init_logs() {
    if std::env::var("TEST_LOG").is_ok() {
        lapse::observe::telemetry::init();
    }
}

/// A name that no other test (or earlier run) uses.
pub fn unique(kind: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "t{kind}{:x}{:x}{}",
        std::process::id(),
        nanos,
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

pub struct TestEnv {
    pub prefix: String,
    pub dir: tempfile::TempDir,
    pub conn: lapin::Connection,
    pub management: Management,
    /// The fresh database of this test, when it asked for one.
    pub database: Option<String>,
    extra_queues: Vec<String>,
    extra_exchanges: Vec<String>,
    extra_prefixes_cleaned: bool,
}

impl TestEnv {
    /// A fresh prefix and a tier file listing `tiers`.
    pub async fn new(tiers: &[&str]) -> Self {
        init_logs();
        let prefix = unique("p");
        let dir = tempfile::tempdir().unwrap();
        let env = Self {
            prefix,
            dir,
            conn: lapse::amqp::broker::connect(&Secret::new(amqp_url()), "lapse test")
                .await
                .expect("RabbitMQ must be running (scripts/services.sh starts it)"),
            management: Management::new(&Secret::new(management_url())).unwrap(),
            database: None,
            extra_queues: Vec::new(),
            extra_exchanges: Vec::new(),
            extra_prefixes_cleaned: false,
        };
        env.write_tiers(tiers, "");
        env.write_config("");
        env
    }

    /// Also a fresh, migrated database and the applied topology.
    pub async fn with_database(tiers: &[&str]) -> Self {
        let mut env = Self::new(tiers).await;
        env.add_database().await;
        let report = lapse::amqp::topology::apply(&env.conn, &env.topology())
            .await
            .unwrap();
        assert!(report.ok(), "{report:?}");
        env
    }

    /// A fresh, migrated database of this env's, named in its config file.
    pub async fn add_database(&mut self) {
        self.database = Some(self.prefix.clone());
        lapse::db::migrate(&Secret::new(self.database_url()))
            .await
            .expect("PostgreSQL must be running (scripts/services.sh starts it)");
        self.write_config(&format!("[database]\nurl = {:?}\n", self.database_url()));
    }

    pub fn database_url(&self) -> String {
        database_url(self.database.as_deref().unwrap_or("postgres"))
    }

    /// A configuration for in-process components: this prefix, database and tiers;
    /// short batch window; the sweeper off (tests of the message path must not be
    /// rescued by it).
    pub fn config(&self) -> Config {
        let mut c = Config::default();
        c.broker.url = Secret::new(amqp_url());
        c.broker.management_url = Some(Secret::new(management_url()));
        c.broker.prefix = self.prefix.clone();
        c.database.url = Secret::new(self.database_url());
        c.database.pool_size = 4;
        c.topology.file = Some(self.tier_path());
        c.worker.sweeper = false;
        c.worker.migrate_on_start = false;
        // Tests of the message path read `<P>.parked` itself; the parked book's
        // tests (parked.rs) turn the archiver on.
        c.worker.parked_archive = false;
        // Generous on a busy test machine: the slack used is the relay's actual lag.
        c.relay.tier_tolerance = Duration::from_millis(100);
        c.worker.retry_backoff = Duration::from_millis(250);
        c.worker.drain_timeout = Duration::from_secs(5);
        c.relay.poll_interval = Duration::from_millis(200);
        c
    }

    /// A direct connection to this test's database.
    pub async fn db(&self) -> tokio_postgres::Client {
        let (client, connection) =
            tokio_postgres::connect(&on_lapse_path(&self.database_url()), tokio_postgres::NoTls)
                .await
                .unwrap();
        tokio::spawn(connection);
        client
    }

    /// Starts `lapse worker` in-process.
    pub async fn start(&self, config: &Config) -> Running {
        Running::start(config).await
    }

    pub fn names(&self) -> Names {
        Names::new(self.prefix.clone())
    }

    pub fn tier_path(&self) -> PathBuf {
        self.dir.path().join("tiers.toml")
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("lapse.toml")
    }

    pub fn write_tiers(&self, tiers: &[&str], extra: &str) {
        let list: Vec<String> = tiers.iter().map(|t| format!("{t:?}")).collect();
        std::fs::write(
            self.tier_path(),
            format!("tiers = [{}]\n{extra}\n", list.join(", ")),
        )
        .unwrap();
    }

    /// Writes the config file; `extra` is appended (whole extra sections).
    pub fn write_config(&self, extra: &str) {
        std::fs::write(
            self.config_path(),
            format!(
                "[broker]\nurl = {:?}\nmanagement_url = {:?}\nprefix = {:?}\n\n[topology]\nfile = {:?}\n{extra}\n",
                amqp_url(),
                management_url(),
                self.prefix,
                self.tier_path().display().to_string(),
            ),
        )
        .unwrap();
    }

    pub fn topology(&self) -> Topology {
        Topology::new(&self.names(), &TierFile::load(&self.tier_path()).unwrap())
    }

    /// Runs the `lapse` binary with this env's config file.
    pub fn lapse(&self, args: &[&str]) -> Output {
        let config = self.config_path();
        let mut full = vec!["--config", config.to_str().unwrap()];
        full.extend_from_slice(args);
        run_lapse(&full, &[])
    }

    /// Registers a queue the test declares itself, to be deleted at cleanup.
    pub fn track_queue(&mut self, name: impl Into<String>) {
        self.extra_queues.push(name.into());
    }

    /// Registers an exchange the test declares itself, to be deleted at cleanup.
    pub fn track_exchange(&mut self, name: impl Into<String>) {
        self.extra_exchanges.push(name.into());
    }

    /// Deletes every queue and exchange whose name starts with this prefix.
    pub async fn cleanup(mut self) {
        self.delete_everything().await;
        self.extra_prefixes_cleaned = true;
    }

    async fn delete_everything(&self) {
        let vhost = "/";
        let mut queues: Vec<String> = self
            .management
            .queues(vhost)
            .await
            .unwrap_or_default()
            .into_iter()
            .map(|q| q.name)
            .filter(|n| n.starts_with(&format!("{}.", self.prefix)))
            .collect();
        queues.extend(self.topology_names().0);
        queues.extend(self.extra_queues.iter().cloned());
        queues.sort();
        queues.dedup();
        for q in queues {
            if let Ok(ch) = self.conn.create_channel().await {
                let _ = ch
                    .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
        }
        for e in self.topology_names().1.iter().chain(&self.extra_exchanges) {
            if let Ok(ch) = self.conn.create_channel().await {
                let _ = ch
                    .exchange_delete(e.as_str().into(), ExchangeDeleteOptions::default())
                    .await;
            }
        }
        if let Some(name) = &self.database {
            drop_database(name).await;
        }
    }

    fn topology_names(&self) -> (Vec<String>, Vec<String>) {
        let names = self.names();
        let mut queues = vec![
            names.due_queue(),
            names.parked(),
            names.stock_release_queue(),
        ];
        // The wait tiers by name too, so cleanup does not depend on the management
        // API answering (it lists the rest).
        if let Ok(file) = TierFile::load(&self.tier_path()) {
            queues.extend(file.tiers.iter().map(|t| names.wait_queue(t)));
        }
        let exchanges = vec![
            names.delay_exchange(),
            names.due_exchange(),
            names.parked(),
            names.events_exchange(),
        ];
        (queues, exchanges)
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        if self.extra_prefixes_cleaned {
            return;
        }
        // The test failed before cleanup: clean up on a thread with its own runtime.
        let prefix = self.prefix.clone();
        let queues = self.extra_queues.clone();
        let exchanges = self.extra_exchanges.clone();
        let database = self.database.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async move {
                let conn =
                    lapse::amqp::broker::connect(&Secret::new(amqp_url()), "lapse test cleanup")
                        .await
                        .unwrap();
                let env = TestEnv {
                    prefix,
                    dir: tempfile::tempdir().unwrap(),
                    conn,
                    management: Management::new(&Secret::new(management_url())).unwrap(),
                    database,
                    extra_queues: queues,
                    extra_exchanges: exchanges,
                    extra_prefixes_cleaned: true,
                };
                env.delete_everything().await;
            });
        })
        .join();
    }
}

/// Runs the binary with no inherited `LAPSE_` variables plus `env`.
pub fn run_lapse(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lapse"));
    for (key, _) in std::env::vars() {
        if key.starts_with("LAPSE_") {
            cmd.env_remove(key);
        }
    }
    cmd.args(args).envs(env.iter().copied());
    cmd.output().expect("run lapse")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub async fn drop_database(name: &str) {
    if let Ok((client, connection)) =
        tokio_postgres::connect(&database_admin_url(), tokio_postgres::NoTls).await
    {
        tokio::spawn(connection);
        let _ = client
            .batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
            .await;
    }
}

/// An in-process `lapse worker`.
pub struct Running {
    pub token: CancellationToken,
    pub stats: Stats,
    /// Its components' health, as `/health` shows it (for failure reports).
    pub health: lapse::runtime::health::Health,
    join: tokio::task::JoinHandle<lapse::service::Stopped>,
}

impl Running {
    /// Starts `lapse worker` in-process with `config`.
    pub async fn start(config: &Config) -> Self {
        let token = CancellationToken::new();
        let stats = Stats::default();
        let service = Service::start(config, stats.clone(), token.clone())
            .await
            .unwrap();
        Self {
            token,
            stats,
            health: service.health(),
            join: tokio::spawn(service.wait()),
        }
    }

    /// Cancels and waits for the drain; returns what had to be abandoned.
    pub async fn stop(self) -> Vec<String> {
        self.token.cancel();
        let stopped = self.join.await.unwrap();
        stopped.abandoned.iter().map(|c| c.to_string()).collect()
    }
}

/// Polls `probe` until it returns `Some`, or panics after `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The one bigint a query returns (one row, one column), e.g. a `count(*)`. The
/// query runs as a scalar subquery, which names its column.
pub async fn count(db: &tokio_postgres::Client, sql: &str) -> i64 {
    db.query_one(&format!("SELECT ({sql}) AS n"), &[])
        .await
        .unwrap()
        .get("n")
}

/// Creates one order per deadline with `lines` (SKUs get ample stock), 10 per
/// transaction (a transaction's duration counts as lateness: `now()` is its start).
pub async fn create_orders(
    db: &mut tokio_postgres::Client,
    deadlines: &[Duration],
    lines: &[Line],
) -> Vec<OrderId> {
    let skus: Vec<String> = lines.iter().map(|l| l.sku.clone()).collect();
    orders::ensure_stock(db, &skus, 1_000_000).await.unwrap();
    let mut ids = Vec::new();
    for chunk in deadlines.chunks(10) {
        let tx = db.transaction().await.unwrap();
        for d in chunk {
            ids.push(orders::create(&tx, Deadline::In(*d), lines).await.unwrap());
        }
        tx.commit().await.unwrap();
    }
    ids
}

/// Waits until exactly `n` orders are closed (never more), up to `limit`.
pub async fn wait_closed(db: &tokio_postgres::Client, n: i64, limit: Duration) {
    eventually(limit, &format!("{n} orders closed"), || async {
        let closed = count(db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
        assert!(closed <= n, "{closed} orders closed, more than {n}");
        (closed == n).then_some(())
    })
    .await;
}

/// Waits (up to 30 s) until exactly `n` release ledger rows exist.
pub async fn wait_released(db: &tokio_postgres::Client, n: i64) {
    eventually(Duration::from_secs(30), "stock releases", || async {
        let released = count(
            db,
            "SELECT count(*) FROM stock_ledger WHERE kind = 'release'",
        )
        .await;
        assert!(
            released <= n,
            "{released} releases, more than the {n} expected"
        );
        (released == n).then_some(())
    })
    .await;
}

/// Closed orders whose stock release has not stamped them (`released_at` unset).
pub async fn unstamped_closes(db: &tokio_postgres::Client) -> i64 {
    count(
        db,
        "SELECT count(*) FROM orders WHERE status = 'CLOSED' AND released_at IS NULL",
    )
    .await
}

/// The promise: no order was closed before its deadline.
pub async fn assert_never_early(db: &tokio_postgres::Client) {
    let early = count(
        db,
        "SELECT count(*) FROM orders WHERE closed_at < expire_at",
    )
    .await;
    assert_eq!(early, 0, "{early} orders closed before their deadline");
}

/// The binary as an async process without the test's own `LAPSE_` variables.
pub fn lapse_process() -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_lapse"));
    for (key, _) in std::env::vars() {
        if key.starts_with("LAPSE_") {
            cmd.env_remove(key);
        }
    }
    cmd
}

/// `lapse worker` as a process with the env's config file and `vars` (no inherited
/// `LAPSE_` variable), stdout discarded, stderr piped; killed when dropped.
pub fn spawn_worker(env: &TestEnv, vars: &[(&str, &str)]) -> tokio::process::Child {
    let mut cmd = lapse_process();
    cmd.args(["--config", env.config_path().to_str().unwrap(), "worker"])
        .envs(vars.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    cmd.spawn().unwrap()
}

/// The exit status and stderr of a worker process that must stop on its own within a
/// minute.
pub async fn exit_of(child: tokio::process::Child) -> (Option<i32>, String) {
    let out = tokio::time::timeout(std::time::Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("the worker stops on its own")
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `config` with only the releaser of the worker's components that touch orders on
/// (no consumer, no relay).
pub fn releaser_only(config: &Config) -> Config {
    let mut c = config.clone();
    c.worker.consumer = false;
    c.worker.relay = false;
    c.worker.releaser = true;
    c
}

/// Sends signal `name` (`STOP`, `CONT`, `TERM`, ...) to a child process.
pub fn signal(child: &tokio::process::Child, name: &str) {
    let pid = child.id().expect("running").to_string();
    let status = std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name} {pid}");
}

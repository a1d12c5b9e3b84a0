//! The demo's own corner of the local services: a unique broker prefix and a fresh
//! database next to the configured one, provisioned like a deployment (`lapse
//! migrate`, `lapse topology apply`) and removed afterwards.

use anyhow::Context;
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};

use crate::amqp::broker::{self, Endpoint};
use crate::amqp::topology::{self, Topology};
use crate::config::{Config, ConfigError, Secret};
use crate::db;

/// The demo's configuration (the user's, with its own prefix and database) and what
/// it declared.
pub struct Sandbox {
    pub config: Config,
    pub prefix: String,
    pub database: String,
    pub topology: Topology,
    endpoint: Endpoint,
    /// Set once this run created the database: only then does cleanup drop it.
    created: std::sync::atomic::AtomicBool,
}

/// `<pid><nanos>` in hex: unique per run on this machine.
fn suffix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!(
        "{:x}_{:x}_{:x}",
        std::process::id(),
        nanos & 0xffff_ffff,
        fastrand::u16(..)
    )
}

/// The URL of the demo's own database, `<name>_demo_<suffix>` on the server of
/// `database.url` (which must be a `postgres://` URL), and that database's name.
fn database_url(base: &Config, suffix: &str) -> Result<(url::Url, String), ConfigError> {
    let bad_url = |problem: &str| ConfigError {
        key: "database.url".into(),
        problem: problem.into(),
    };
    // With shards, the demo's database goes on shard 0's server; it never runs in
    // the shards themselves.
    let base_url = base.database.shard_list().remove(0).url;
    let mut url = url::Url::parse(base_url.expose())
        .ok()
        .filter(|u| matches!(u.scheme(), "postgres" | "postgresql"))
        .ok_or_else(|| {
            bad_url(
                "`lapse demo` needs a postgres:// URL: it creates its own database on \
                 the same server",
            )
        })?;
    // A database named in the query would win over the path: the demo would run
    // in (and drop) someone's real database.
    if url
        .query_pairs()
        .any(|(k, _)| k.eq_ignore_ascii_case("dbname"))
    {
        return Err(bad_url(
            "`lapse demo` names its own database: remove the dbname parameter",
        ));
    }
    let own: String = url
        .path()
        .trim_start_matches('/')
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
        .take(30)
        .collect::<String>()
        .to_ascii_lowercase();
    let own = if own.is_empty() { "lapse".into() } else { own };
    let database = format!("{own}_demo_{suffix}");
    url.set_path(&format!("/{database}"));
    Ok((url, database))
}

impl Sandbox {
    /// `<broker.prefix>-demo-<suffix>` and the database `<name>_demo_<suffix>` on the
    /// server of `database.url` (which must be a `postgres://` URL).
    pub fn new(base: &Config) -> Result<Self, ConfigError> {
        let suffix = suffix();
        let mut config = base.clone();
        let prefix = format!("{}-demo-{suffix}", base.broker.prefix);
        crate::config::validate_prefix(&prefix)?;
        let (url, database) = database_url(base, &suffix)?;
        config.database.url = Secret::new(url.to_string());
        config.database.shards = None;
        config.broker.prefix = prefix.clone();
        // The demo migrates before it starts the components, and runs every one of
        // them whatever the user's configuration switches off.
        config.worker.migrate_on_start = false;
        config.worker.consumer = true;
        config.worker.relay = true;
        config.worker.releaser = true;
        config.worker.sweeper = true;
        let topology = Topology::new(&config.names(), &config.tier_file()?);
        let endpoint = crate::amqp::endpoint(&config.broker).map_err(|e| ConfigError {
            key: "broker.tls".into(),
            problem: e.to_string(),
        })?;
        Ok(Self {
            config,
            prefix,
            database,
            topology,
            endpoint,
            created: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Creates the database and its schema, and declares the topology.
    pub async fn provision(&self) -> anyhow::Result<()> {
        self.create_database().await?;
        db::migrate_with_settings(
            &self.config.database.url,
            &db::Settings::from_config(&self.config),
        )
        .await?;
        let conn = self.endpoint.connect("lapse demo").await?;
        let report = topology::apply(&conn, &self.topology).await;
        broker::close_quietly(&conn, "done").await;
        let report = report?;
        if !report.ok() {
            anyhow::bail!(
                "topology apply failed for prefix {}: {:?} {:?}",
                self.prefix,
                report.drifts,
                report.failures
            );
        }
        Ok(())
    }

    /// Deletes the demo's queues and exchanges and drops its database. Every step is
    /// tried; the ones that failed are returned.
    pub async fn remove(&self) -> Vec<String> {
        let mut problems = Vec::new();
        match self.endpoint.connect("lapse demo cleanup").await {
            Ok(conn) => {
                for q in &self.topology.queues {
                    if let Err(e) = delete_queue(&conn, &q.name).await {
                        problems.push(format!("queue {}: {e}", q.name));
                    }
                }
                for x in &self.topology.exchanges {
                    if let Err(e) = delete_exchange(&conn, &x.name).await {
                        problems.push(format!("exchange {}: {e}", x.name));
                    }
                }
                broker::close_quietly(&conn, "done").await;
            }
            Err(e) => problems.push(format!("broker: {e}")),
        }
        if let Err(e) = self.drop_database().await {
            problems.push(format!("database {}: {e:#}", self.database));
        }
        problems
    }

    /// Creates the demo's database; fails if one of that name exists (never reuses
    /// one: cleanup drops it).
    async fn create_database(&self) -> anyhow::Result<()> {
        self.on_server(|db| format!("CREATE DATABASE {db}"))
            .await
            .with_context(|| {
                format!("CREATE DATABASE {} (it must not exist yet)", self.database)
            })?;
        self.created
            .store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// Drops the demo's database, only if this run created it.
    async fn drop_database(&self) -> anyhow::Result<()> {
        if !self.created.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        self.on_server(|db| format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
            .await
            .context("DROP DATABASE")
    }

    /// Runs the statement `sql` makes of the quoted database name, on the server's
    /// maintenance database.
    async fn on_server(&self, sql: impl FnOnce(&str) -> String) -> anyhow::Result<()> {
        let mut admin = db::pg_config(&self.config.database.url)?;
        admin.dbname("postgres");
        admin.connect_timeout(std::time::Duration::from_secs(5));
        let (client, connection) = db::connect(&admin).await?;
        let driver = tokio::spawn(connection);
        let quoted = format!("\"{}\"", self.database.replace('"', "\"\""));
        let done = client.batch_execute(&sql(&quoted)).await;
        drop(client);
        let _ = driver.await;
        Ok(done?)
    }
}

async fn delete_queue(conn: &lapin::Connection, name: &str) -> Result<(), lapin::Error> {
    let channel = conn.create_channel().await?;
    match channel
        .queue_delete(name.into(), QueueDeleteOptions::default())
        .await
    {
        Err(e) if broker::not_found(&e) => Ok(()),
        other => other.map(|_| ()),
    }
}

async fn delete_exchange(conn: &lapin::Connection, name: &str) -> Result<(), lapin::Error> {
    let channel = conn.create_channel().await?;
    match channel
        .exchange_delete(name.into(), ExchangeDeleteOptions::default())
        .await
    {
        Err(e) if broker::not_found(&e) => Ok(()),
        other => other.map(|_| ()),
    }
}

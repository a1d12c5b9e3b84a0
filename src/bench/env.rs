//! A benchmark's own world: a database and a broker prefix of its own, lapse's
//! topology under that prefix, and the worker processes it starts. Everything is
//! removed again by [`BenchEnv::cleanup`], which the command runs after success,
//! failure and Ctrl-C alike.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use tokio::process::{Child, Command};

use super::cpu;
use crate::amqp::broker::Endpoint;
use crate::amqp::topology::{self, Topology};
use crate::config::{Config, Secret};
use crate::db;
use crate::names::Names;
use crate::tier_file::TierFile;

/// The products of the steady generator, a burst and a backlog (`bench-0000` to
/// `bench-0999`, see `load::sku`), each stocked by [`BenchEnv::reset`].
pub const SKUS: usize = 1000;

/// The services and names one benchmark run uses.
pub struct BenchEnv {
    pub config: Config,
    /// `--config` given to lapse, passed on to the workers.
    pub config_file: Option<PathBuf>,
    pub database_name: String,
    pub database_url: Secret,
    pub names: Names,
    pub tier_file: TierFile,
    pub conn: lapin::Connection,
    /// Topologies declared (lapse's and the raw scratch ones), deleted at cleanup.
    declared: Vec<Topology>,
    workers: Vec<Worker>,
    /// The executable started as `lapse worker` (default: this one).
    pub worker_exe: Option<PathBuf>,
    /// The database URL the workers use, when not [`BenchEnv::database_url`] (a
    /// connection pooler in front of it).
    worker_database_url: Option<Secret>,
}

/// A `lapse worker` child process (killed when dropped).
pub struct Worker {
    pub child: Child,
    pub pid: u32,
    /// CPU seconds of workers already stopped (read before they were killed).
    pub cpu_at_stop: Option<f64>,
}

impl BenchEnv {
    /// Creates the database `<name>` next to `database.url`, migrates it, and applies
    /// lapse's topology under `prefix`.
    pub async fn create(
        config: &Config,
        config_file: Option<PathBuf>,
        prefix: &str,
        database_name: &str,
    ) -> anyhow::Result<Self> {
        crate::config::validate_prefix(prefix)?;
        let tier_file = config.tier_file()?;
        // With shards, the run's database goes on shard 0's server, never into a shard.
        let base_url = config.database.shard_list().remove(0).url;
        let mut url = url::Url::parse(base_url.expose())
            .context("database.url is not a valid PostgreSQL URL")?;
        url.set_path(&format!("/{database_name}"));
        let database_url = Secret::new(url.to_string());
        let mut config = config.clone();
        config.database.url = database_url.clone();
        config.database.shards = None;
        config.broker.prefix = prefix.to_string();
        let endpoint = crate::amqp::endpoint(&config.broker)?;
        let conn = endpoint.connect("lapse bench").await?;
        let mut env = Self {
            names: Names::new(prefix),
            config,
            config_file,
            database_name: database_name.to_string(),
            database_url,
            tier_file,
            conn,
            declared: Vec::new(),
            workers: Vec::new(),
            worker_exe: None,
            worker_database_url: None,
        };
        // What a failed setup created is removed again before the error is returned.
        match env.setup().await {
            Ok(()) => Ok(env),
            Err(e) => {
                let _ = env.cleanup().await;
                Err(e)
            }
        }
    }

    async fn setup(&mut self) -> anyhow::Result<()> {
        self.drop_database().await?;
        db::migrate_with_settings(&self.database_url, &db::Settings::from_config(&self.config))
            .await?;
        let topology = Topology::new(&self.names, &self.tier_file);
        self.declare(topology).await
    }

    /// Declares a topology and remembers it for cleanup.
    pub async fn declare(&mut self, topology: Topology) -> anyhow::Result<()> {
        self.declared.push(topology.clone());
        let report = topology::apply(&self.conn, &topology).await?;
        if !report.ok() {
            anyhow::bail!(
                "the broker refused the benchmark's topology: {:?} {:?}",
                report.drifts,
                report.failures
            );
        }
        Ok(())
    }

    /// A plain connection to the benchmark database.
    pub async fn client(&self) -> anyhow::Result<tokio_postgres::Client> {
        let mut target = db::pg_config(&self.database_url)?;
        db::with_search_path(&mut target);
        let (client, connection) = db::connect(&target).await?;
        tokio::spawn(connection);
        Ok(client)
    }

    /// Makes the workers reach the run's database through a connection pooler at
    /// `address` (`HOST:PORT`, same user and database names); their relays LISTEN on
    /// the database directly.
    pub fn through_pooler(&mut self, address: &str) -> anyhow::Result<()> {
        let bad = || crate::config::ConfigError {
            key: "--worker-pooler".into(),
            problem: format!("{address:?} is not HOST:PORT"),
        };
        let (host, port) = address.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        let mut url = url::Url::parse(self.database_url.expose())?;
        url.set_host(Some(host)).map_err(|_| bad())?;
        url.set_port(Some(port)).map_err(|_| bad())?;
        self.worker_database_url = Some(Secret::new(url.to_string()));
        Ok(())
    }

    /// Starts a `lapse worker` on the benchmark's database and prefix; `env` adds
    /// configuration overrides (`LAPSE_WORKER__PREFETCH`, ...).
    pub fn start_worker(&mut self, env: &[(&str, String)]) -> anyhow::Result<u32> {
        let exe = match &self.worker_exe {
            Some(exe) => exe.clone(),
            None => std::env::current_exe().context("cannot find the lapse executable")?,
        };
        let mut cmd = Command::new(exe);
        if let Some(file) = &self.config_file {
            cmd.arg("--config").arg(file);
        }
        let database_url = self
            .worker_database_url
            .as_ref()
            .unwrap_or(&self.database_url);
        if self.worker_database_url.is_some() {
            cmd.env("LAPSE_RELAY__LISTEN_URL", self.database_url.expose());
        }
        cmd.arg("worker")
            .env("LAPSE_DATABASE__URL", database_url.expose())
            .env("LAPSE_BROKER__PREFIX", &self.names.prefix)
            .env("LAPSE_WORKER__MIGRATE_ON_START", "false")
            .env(
                "LAPSE_LOG",
                std::env::var(crate::config::BENCH_WORKER_LOG_VAR)
                    .unwrap_or_else(|_| "error".into()),
            )
            // Read here, not by the worker: a `--worker-exe` older than the variable
            // would take it for an unknown configuration key.
            .env_remove(crate::config::BENCH_WORKER_LOG_VAR)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .kill_on_drop(true);
        for (key, value) in env {
            cmd.env(key, value);
        }
        let child = cmd.spawn().context("cannot start `lapse worker`")?;
        let pid = child.id().unwrap_or(0);
        self.workers.push(Worker {
            child,
            pid,
            cpu_at_stop: None,
        });
        Ok(pid)
    }

    /// SIGKILLs one worker (its CPU time is read first) and waits for it.
    pub async fn kill_worker(&mut self, pid: u32) {
        if let Some(w) = self
            .workers
            .iter_mut()
            .find(|w| w.pid == pid && w.cpu_at_stop.is_none())
        {
            w.cpu_at_stop = Some(cpu::of_pid(pid));
            let _ = w.child.start_kill();
            let _ = w.child.wait().await;
        }
    }

    /// Stops every worker still running.
    pub async fn stop_workers(&mut self) {
        let pids: Vec<u32> = self.workers.iter().map(|w| w.pid).collect();
        for pid in pids {
            self.kill_worker(pid).await;
        }
    }

    /// CPU seconds of every worker started so far (running or stopped).
    pub fn worker_cpu(&self) -> f64 {
        self.workers
            .iter()
            .map(|w| w.cpu_at_stop.unwrap_or_else(|| cpu::of_pid(w.pid)))
            .sum()
    }

    /// Peak RSS (MiB) over the workers still running.
    pub fn worker_rss(&self) -> Option<(f64, f64)> {
        self.workers
            .iter()
            .filter(|w| w.cpu_at_stop.is_none())
            .filter_map(|w| cpu::rss_mib(w.pid))
            .reduce(|a, b| (a.0 + b.0, a.1.max(b.1)))
    }

    /// Forgets stopped workers (their CPU was accounted by the scenario).
    pub fn forget_stopped(&mut self) {
        self.workers.retain(|w| w.cpu_at_stop.is_none());
    }

    /// A worker that exited on its own is a failed benchmark, not a slow one.
    pub fn check_workers(&mut self) -> anyhow::Result<()> {
        for w in &mut self.workers {
            if w.cpu_at_stop.is_some() {
                continue;
            }
            if let Ok(Some(status)) = w.child.try_wait() {
                anyhow::bail!("the benchmark's worker (pid {}) exited: {status}", w.pid);
            }
        }
        Ok(())
    }

    /// Empties the tables between scenarios (the schema stays).
    pub async fn reset(&self) -> anyhow::Result<()> {
        let db = self.client().await?;
        db.batch_execute(
            "TRUNCATE orders, order_lines, stock_ledger, order_events, late_payments, outbox;
             DELETE FROM stock;
             INSERT INTO stock (sku, available) VALUES ('bench', 1000000000000)",
        )
        .await?;
        db.execute(
            "INSERT INTO stock (sku, available)
             SELECT 'bench-' || lpad(g::text, 4, '0'), 1000000000000
               FROM generate_series(0, $1::int - 1) g",
            &[&(SKUS as i32)],
        )
        .await?;
        Ok(())
    }

    async fn drop_database(&self) -> anyhow::Result<()> {
        let mut admin = url::Url::parse(self.database_url.expose())?;
        admin.set_path("/postgres");
        let target = db::pg_config(&Secret::new(admin.to_string()))?;
        let (client, connection) = db::connect(&target).await?;
        tokio::spawn(connection);
        client
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                self.database_name
            ))
            .await?;
        Ok(())
    }

    /// Stops the workers, deletes every queue and exchange the run declared, and
    /// drops the database. Best effort: each step runs even when one before failed.
    pub async fn cleanup(mut self) -> anyhow::Result<()> {
        self.stop_workers().await;
        let mut problems = Vec::new();
        for topology in &self.declared {
            for q in &topology.queues {
                if let Err(e) = self.delete_queue(&q.name).await {
                    problems.push(format!("queue {}: {e}", q.name));
                }
            }
            for x in &topology.exchanges {
                if let Err(e) = self.delete_exchange(&x.name).await {
                    problems.push(format!("exchange {}: {e}", x.name));
                }
            }
        }
        if let Err(e) = self.drop_database().await {
            problems.push(format!("database {}: {e}", self.database_name));
        }
        let _ =
            tokio::time::timeout(Duration::from_secs(5), self.conn.close(200, "bye".into())).await;
        if problems.is_empty() {
            Ok(())
        } else {
            anyhow::bail!("cleanup left behind: {}", problems.join("; "))
        }
    }

    async fn delete_queue(&self, name: &str) -> anyhow::Result<()> {
        let ch = self.conn.create_channel().await?;
        ch.queue_delete(name.into(), QueueDeleteOptions::default())
            .await?;
        let _ = ch.close(200, "ok".into()).await;
        Ok(())
    }

    async fn delete_exchange(&self, name: &str) -> anyhow::Result<()> {
        let ch = self.conn.create_channel().await?;
        ch.exchange_delete(name.into(), ExchangeDeleteOptions::default())
            .await?;
        let _ = ch.close(200, "ok".into()).await;
        Ok(())
    }

    /// The broker connection for the raw scenario.
    pub fn broker(&self) -> &lapin::Connection {
        &self.conn
    }

    pub fn endpoint(&self) -> anyhow::Result<Endpoint> {
        Ok(crate::amqp::endpoint(&self.config.broker)?)
    }
}

/// Connects with `name` (used by the raw scenario's extra connections).
pub async fn connect(env: &BenchEnv, name: &str) -> anyhow::Result<lapin::Connection> {
    Ok(env.endpoint()?.connect(name).await?)
}

impl BenchEnv {
    /// Starts a worker and waits until the due queue has `consumers` consumers.
    pub async fn start_ready(
        &mut self,
        env: &[(&str, String)],
        consumers: u32,
    ) -> anyhow::Result<u32> {
        let pid = self.start_worker(env)?;
        let queue = self.names.due_queue();
        let until = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            self.check_workers()?;
            let q = crate::amqp::broker::queue_state(&self.conn, &queue)
                .await?
                .existing(&queue)?;
            if q.consumers >= consumers {
                // The relay starts with the consumer; give it a moment to listen.
                tokio::time::sleep(Duration::from_millis(300)).await;
                return Ok(pid);
            }
            if tokio::time::Instant::now() >= until {
                anyhow::bail!("the benchmark's worker did not start consuming within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

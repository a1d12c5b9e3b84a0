//! `lapse worker`: run the consumer, relay, releaser and sweeper until SIGINT/SIGTERM.
//!
//! Exit status: 0 only for a SIGINT/SIGTERM shutdown that drained within
//! `worker.drain_timeout`; 1 when a component failed fatally (e.g. the broker refused
//! the credentials) or the drain limit was reached; 2 for bad configuration, and for
//! what no retry can heal at startup: the database refuses the credentials, or it (or
//! its schema) does not exist while `worker.migrate_on_start` is off. A database or
//! broker that merely does not answer is waited for (with back-off), not an exit.

use anyhow::Context;
use clap::Args;

use super::{ExitStatus, help};
use crate::config::Config;
use crate::db;
use crate::observe::stats::Stats;
use crate::runtime::http;
use crate::runtime::shutdown;
use crate::runtime::supervisor::Stop;
use crate::service::Service;

#[derive(Debug, Args)]
#[command(after_help = help::after(
    &[
        "lapse worker",
        "lapse worker --metrics-listen 127.0.0.1:9464",
        "lapse worker --no-sweeper --no-releaser",
        "LAPSE_LOG=lapse=debug LAPSE_LOG_FORMAT=json lapse worker",
    ],
    &[
        (0, "stopped by SIGINT/SIGTERM and drained within worker.drain_timeout"),
        (1, "a component failed fatally (e.g. the broker refused the credentials), or \
             the drain limit was reached"),
        (2, "bad arguments or configuration; at startup also a database that refuses the \
             credentials, or that does not exist (or has no schema) while \
             worker.migrate_on_start is off: run `lapse migrate`"),
        (3, "never: an unreachable broker or database is retried with back-off and \
             shown on GET /health"),
    ],
))]
pub struct WorkerArgs {
    /// Do not consume the due queue.
    #[arg(long)]
    no_consumer: bool,
    /// Do not run the outbox relay.
    #[arg(long)]
    no_relay: bool,
    /// Do not run the stock releaser.
    #[arg(long)]
    no_releaser: bool,
    /// Do not run the backstop sweeper.
    #[arg(long)]
    no_sweeper: bool,
    /// Serve GET /metrics (Prometheus), GET /livez, GET /readyz and GET /health on this
    /// HOST:PORT (e.g. 127.0.0.1:9464, localhost:9464); overrides worker.metrics_listen.
    /// An address that cannot be bound is a startup error.
    #[arg(long, value_name = "HOST:PORT", value_parser = super::listen_address)]
    metrics_listen: Option<String>,
}

// Over 60 lines on purpose: the start-up sequence in order (bind, migrate or check, start, serve, wait, report); each step is one call and the order is the point.
pub async fn run(mut config: Config, args: WorkerArgs) -> anyhow::Result<ExitStatus> {
    let w = &mut config.worker;
    w.consumer &= !args.no_consumer;
    w.relay &= !args.no_relay;
    w.releaser &= !args.no_releaser;
    w.sweeper &= !args.no_sweeper;
    // Bind before anything starts: an address that cannot be bound is a startup error.
    let (key, address) = match (&args.metrics_listen, &config.worker.metrics_listen) {
        (Some(address), _) => ("--metrics-listen", Some(address.clone())),
        (None, address) => ("worker.metrics_listen", address.clone()),
    };
    let endpoint = match address {
        Some(address) => {
            let addr = http::resolve(&address)
                .await
                .with_context(|| format!("cannot listen on {key} {address}"))?;
            let listener = http::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {key} {address}"))?;
            Some((listener, http::install_recorder()?))
        }
        None => None,
    };
    let token = shutdown::on_signal();
    if config.worker.migrate_on_start {
        // With shards, `Service::start` migrates them (one that does not answer in the
        // background); the one database is waited for here.
        if !config.database.sharded() {
            if !migrate_when_reachable(&config, &token).await? {
                return Ok(ExitStatus::Ok);
            }
            config.worker.migrate_on_start = false;
        }
    } else {
        check_database(&config).await?;
    }
    let stats = Stats::default();
    let mut service = Service::start(&config, stats.clone(), token.clone()).await?;
    if let Some((listener, metrics)) = endpoint {
        let health = service.health();
        let readiness = crate::runtime::readiness::Readiness::from_config(&config);
        service.supervise(
            "http",
            Box::new(move |t| {
                Box::pin(http::serve(
                    listener.clone(),
                    metrics.clone(),
                    health.clone(),
                    readiness.clone(),
                    t,
                ))
            }),
        );
    }
    if let Some(warning) = config.broker.consumer_timeout_margin_short(
        config.database.statement_timeout,
        crate::amqp::batch::ACK_TIMEOUT,
    ) {
        tracing::warn!("{warning}");
    }
    tracing::info!(prefix = %config.broker.prefix, "worker running; SIGINT or SIGTERM stops it");
    let stopped = service.wait().await;
    let summary: Vec<String> = stats
        .summary()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    tracing::info!(summary = %summary.join(" "), "worker stopped");
    if !stopped.abandoned.is_empty() {
        tracing::warn!(abandoned = ?stopped.abandoned, "stopped at the drain limit");
    }
    match stopped.stop {
        Stop::Fatal { component, reason } => Err(anyhow::anyhow!(
            "{component} failed: {reason}; the worker stopped"
        )),
        Stop::Requested if stopped.clean() => Ok(ExitStatus::Ok),
        Stop::Requested => {
            eprintln!(
                "error: the drain limit (worker.drain_timeout) was reached; abandoned: {}",
                stopped.abandoned.join(", ")
            );
            Ok(ExitStatus::Failed)
        }
    }
}

fn uses_database(config: &Config) -> bool {
    let w = &config.worker;
    w.consumer || w.relay || w.releaser || w.sweeper
}

/// Applies the migrations to the one order database, waiting with back-off while it
/// does not answer (or answers that it is starting up); any other failure (refused
/// credentials, a failed migration) is an error. False when a signal came first. (Several
/// order databases are migrated by [`Service::start`]: one that does not answer must
/// not hold back the others, see `service::migrations`.)
async fn migrate_when_reachable(
    config: &Config,
    token: &tokio_util::sync::CancellationToken,
) -> anyhow::Result<bool> {
    let settings = db::Settings::from_config(config);
    let mut delay = std::time::Duration::from_millis(500);
    loop {
        // A SIGTERM ends an attempt too (one that waits for another worker's migration
        // lock, say); the server rolls the open migration back.
        let attempt = tokio::select! {
            result = db::migrate_with_settings(&config.database.url, &settings) => result,
            () = token.cancelled() => return Ok(false),
        };
        let error = match attempt {
            Ok(_) => return Ok(true),
            Err(e) if e.is_transient() => e.detail(),
            Err(e) => return Err(e.into()),
        };
        tracing::warn!(
            error = %error,
            retry_in_ms = delay.as_millis() as u64,
            "migrations wait for the database"
        );
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = token.cancelled() => return Ok(false),
        }
        delay = (delay * 2).min(std::time::Duration::from_secs(10));
    }
}

/// With `worker.migrate_on_start` off: refuses to start when the database refuses the
/// credentials, or it or its schema does not exist. A database that does not answer
/// is left to the components, which retry with back-off and show it on /health.
async fn check_database(config: &Config) -> anyhow::Result<()> {
    if !uses_database(config) {
        return Ok(());
    }
    // All shards at once: silent ones cost one bound, not one each.
    let shards = config.database.shard_list();
    let checks = shards.iter().map(|shard| check_shard(config, shard));
    futures_util::future::join_all(checks)
        .await
        .into_iter()
        .collect::<anyhow::Result<Vec<()>>>()?;
    // The list as a whole: another deployment's list under the same prefix is refused.
    db::check_shard_list(&config.database, &config.broker.prefix)
        .await
        .map_err(|(shard, e)| in_shard(config, shard, e))
}

/// `error` naming `database.shards[i]` when there are several order databases (with
/// one, the failure names `database.url` as it always did).
fn in_shard(config: &Config, shard: u16, error: db::DbError) -> anyhow::Error {
    match config.database.sharded() {
        true => db::InShard::new(shard, error).into(),
        false => error.into(),
    }
}

async fn check_shard(config: &Config, shard: &crate::config::Shard) -> anyhow::Result<()> {
    let key = match config.database.sharded() {
        true => db::shard_key(shard.index),
        false => "database.url".to_string(),
    };
    // A server that accepts the connection and then says nothing is one that does not
    // answer yet, not a reason to hang the start.
    let login = db::LOGIN_TIMEOUT;
    let (mut client, connection) = match db::bounded_connect(&db::bounded_config(&shard.url)?).await
    {
        Ok(pair) => pair,
        Err(db::DbError::Postgres(e)) if matches!(super::failure::database(&e), Some(f) if f.status == ExitStatus::Usage) =>
        {
            return Err(in_shard(config, shard.index, e.into()));
        }
        Err(e) if e.is_transient() || matches!(e, db::DbError::Postgres(_)) => {
            tracing::warn!(database = %key, error = %e.detail(),
                "the database does not answer yet; the components retry");
            return Ok(());
        }
        Err(e) => return Err(in_shard(config, shard.index, e)),
    };
    let driver = tokio::spawn(connection);
    // The connection may still drop: then, like a database that does not answer, the
    // components retry; another failure of the query stops the start naming the shard.
    // Whether it has lapse's schema, and the position its first migration recorded.
    let asked = async {
        let tx = db::begin_plain(&mut client).await?;
        db::schema_state(&tx).await
    };
    let failure = match tokio::time::timeout(login, asked).await {
        Ok(answer) => answer,
        Err(_) => Err(db::DbError::NoAnswer {
            step: "answer the start-up check",
            after: login,
        }),
    };
    let db::SchemaState { schema, position } = match failure {
        Ok(answer) => answer,
        Err(e) if e.is_transient() => {
            tracing::warn!(database = %key, error = %e.detail(),
                "the database connection failed during the start-up check; the components retry");
            return Ok(());
        }
        Err(e) => return Err(in_shard(config, shard.index, e)),
    };
    drop(client);
    let _ = driver.await;
    db::check_position(position, shard.index).map_err(|e| in_shard(config, shard.index, e))?;
    if !schema {
        return Err(crate::config::ConfigError {
            key,
            problem: "the database has no lapse schema; run `lapse migrate` (or set \
                      worker.migrate_on_start = true)"
                .into(),
        }
        .into());
    }
    Ok(())
}

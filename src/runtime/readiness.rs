//! `GET /readyz`: whether this worker can do its work right now: the broker and the
//! database are reachable and every component is running (up and not stalled), with
//! the reason for each check that fails. Unlike `/livez` it depends on the broker and
//! the database: a load balancer or an orchestrator may hold traffic or rollouts on
//! it, but must not restart the process for it (the components retry on their own).
//!
//! The checks are cheap: a TCP connect to the broker's address (no AMQP session, so
//! probing leaves no connection churn on the broker) and `SELECT 1` on a pool of one
//! connection, each bounded by [`CHECK_TIMEOUT`].

use std::str::FromStr;
use std::time::Duration;

use crate::db::Pool;
use serde_json::{Value, json};

use crate::config::Config;
use crate::runtime::health::Health;

/// Bounds each reachability check.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// Components left out of readiness: the parked archiver (`crate::parked::archiver`).
const ADVISORY: [&str; 1] = ["parked"];

/// What `/readyz` checks besides the components.
#[derive(Clone)]
pub struct Readiness {
    /// `host:port` of each broker address, when a component uses the broker.
    broker: Option<Result<Vec<(String, u16)>, String>>,
    /// One pool per order database, named as its check (`database`, or
    /// `database.s<i>` with shards).
    database: Result<Vec<(String, Pool)>, String>,
}

impl Readiness {
    pub fn from_config(config: &Config) -> Self {
        let w = &config.worker;
        let broker = (w.consumer || w.relay || w.releaser).then(|| {
            crate::config::split_addresses(&config.broker.url)
                .iter()
                .map(|a| {
                    lapin::uri::AMQPUri::from_str(a.expose())
                        .map(|u| (u.authority.host, u.authority.port))
                        .map_err(|_| "broker.url is not a valid AMQP URL".to_string())
                })
                .collect()
        });
        let database = config
            .database
            .shard_list()
            .iter()
            .map(|shard| {
                let pool = crate::db::pool(&config.database.for_shard(shard), 1)?;
                Ok((config.database.per_shard("database", shard.index), pool))
            })
            .collect::<Result<_, crate::db::DbError>>()
            .map_err(|e| e.to_string());
        Self { broker, database }
    }

    /// Runs every check; returns whether all passed and the JSON body.
    pub async fn check(&self, health: &Health) -> (bool, Value) {
        let (broker, databases) = tokio::join!(self.broker(), self.databases());
        let mut checks = serde_json::Map::new();
        let mut ready = true;
        let named = std::iter::once(("broker".to_string(), broker))
            .chain(databases.into_iter().map(|(name, r)| (name, Some(r))));
        for (name, result) in named {
            let Some(result) = result else { continue };
            ready &= result.is_ok();
            checks.insert(name, verdict(result));
        }
        for (name, state) in health.snapshot() {
            // Advisory components: a worker that cannot move parked messages into the
            // parked book still closes deadlines, so it is ready (`/health` shows it).
            if ADVISORY.contains(&name) {
                continue;
            }
            let result = if state.stalled {
                Err(format!(
                    "stalled: busy for {} ms without progress",
                    state.busy_ms.unwrap_or_default()
                ))
            } else if !state.up {
                Err(state.last_error.unwrap_or_else(|| "connecting".to_string()))
            } else {
                Ok(())
            };
            ready &= result.is_ok();
            checks.insert(format!("component:{name}"), verdict(result));
        }
        let body = json!({
            "status": if ready { "ready" } else { "not_ready" },
            "checks": checks,
        });
        (ready, body)
    }

    /// Ready when any of the broker's addresses accepts a TCP connection (lapse
    /// connects to the next one when a node is away).
    async fn broker(&self) -> Option<Result<(), String>> {
        let addresses = match self.broker.as_ref()? {
            Ok(addresses) => addresses,
            Err(e) => return Some(Err(e.clone())),
        };
        let mut problems = Vec::new();
        for (host, port) in addresses {
            let connect = tokio::net::TcpStream::connect((host.as_str(), *port));
            match tokio::time::timeout(CHECK_TIMEOUT, connect).await {
                Ok(Ok(_)) => return Some(Ok(())),
                Ok(Err(e)) => {
                    problems.push(format!("cannot reach the broker at {host}:{port}: {e}"))
                }
                Err(_) => problems.push(format!(
                    "cannot reach the broker at {host}:{port}: no answer within {CHECK_TIMEOUT:?}"
                )),
            }
        }
        Some(Err(problems.join("; ")))
    }

    /// Every order database, each checked on its own (all at once).
    async fn databases(&self) -> Vec<(String, Result<(), String>)> {
        let pools = match &self.database {
            Ok(pools) => pools,
            Err(e) => return vec![("database".to_string(), Err(e.clone()))],
        };
        let checks = pools
            .iter()
            .map(|(name, pool)| async move { (name.clone(), Self::database(pool).await) });
        futures_util::future::join_all(checks).await
    }

    async fn database(pool: &Pool) -> Result<(), String> {
        let ask = async {
            let client = pool.get().await.map_err(|e| e.to_string())?;
            client
                .simple_query("SELECT 1")
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        match tokio::time::timeout(CHECK_TIMEOUT, ask).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("cannot reach the database: {e}")),
            Err(_) => Err(format!(
                "cannot reach the database: no answer within {CHECK_TIMEOUT:?}"
            )),
        }
    }
}

fn verdict(result: Result<(), String>) -> Value {
    match result {
        Ok(()) => json!({ "ok": true }),
        Err(reason) => json!({ "ok": false, "reason": crate::redact::redact(&reason) }),
    }
}

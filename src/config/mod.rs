//! One typed configuration tree: named defaults, then the TOML file, then
//! `LAPSE_<SECTION>__<KEY>` environment overrides, then [`Config::validate`].
//! `LAPSE_LOG`, `LAPSE_LOG_FORMAT` and `LAPSE_BENCH_WORKER_LOG` are not configuration keys ([`LOG_ENV_VARS`]; read
//! by [`crate::observe::telemetry`]).
//!
//! Invariants: every error names the key it is about; credentials (the broker and
//! database URLs) never appear in `Debug` output or in error messages.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::names::Names;
use crate::tier_file::TierFile;

/// The file read when `--config` is not given; defaults apply when it is absent.
pub const DEFAULT_CONFIG_FILE: &str = "lapse.toml";

/// A configuration problem: the key and what is wrong with it.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {key}: {problem}")]
pub struct ConfigError {
    pub key: String,
    pub problem: String,
}

impl ConfigError {
    fn new(key: impl Into<String>, problem: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            problem: problem.into(),
        }
    }
}

pub use crate::redact::Secret;
pub use addresses::{join_addresses, split_addresses};
pub use kinds::{EventConfig, KeyType, KindConfig, Kinds};
pub use load::{BENCH_WORKER_LOG_VAR, CONFIG_VAR, LOG_ENV_VARS, LOG_FORMAT_VAR, LOG_VAR, env};
pub use moved::{MOVED_KEYS, moved_keys};
pub use packs::{MAX_PACK_ENTRIES, PacksConfig};
pub use retention::{Keep, RetentionConfig};
pub use shards::{ListenUrls, MAX_SHARDS, Shard, listen_url};

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub broker: BrokerConfig,
    pub database: DatabaseConfig,
    pub topology: TopologyConfig,
    pub worker: WorkerConfig,
    pub relay: RelayConfig,
    pub sweeper: SweeperConfig,
    pub orders: OrdersConfig,
    #[serde(default)]
    pub retention: RetentionConfig,
    /// The kinds of deadline fired over the shop's own tables (docs/adopting.md).
    #[serde(default)]
    pub kinds: Kinds,
    /// Many deadlines per timeout message (docs/pipeline.md, "Packs").
    #[serde(default)]
    pub packs: PacksConfig,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerConfig {
    /// AMQP URL, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`.
    pub url: Secret,
    /// Management HTTP API, e.g. `http://guest:guest@127.0.0.1:15672`; optional.
    pub management_url: Option<Secret>,
    /// Every broker object name starts with `<prefix>.`.
    pub prefix: String,
    /// AMQP heartbeat of the worker's connections (whole seconds; a `heartbeat` in
    /// `url` wins). The broker takes back a frozen worker's unacknowledged deliveries
    /// after about two and a half heartbeats (5 s by default: 12.9 s measured).
    #[serde(with = "humantime_serde")]
    pub heartbeat: Duration,
    /// How long a publish may wait for the broker's confirm before it counts as not
    /// delivered (and is retried on a fresh channel).
    #[serde(with = "humantime_serde")]
    pub confirm_timeout: Duration,
    /// The broker's delivery acknowledgement timeout (`consumer_timeout` in
    /// rabbitmq.conf, or a `consumer-timeout` policy or `x-consumer-timeout` argument
    /// on lapse's queues): the broker closes a channel that keeps a delivery
    /// unacknowledged longer. The worker keeps none longer than half of it; past that
    /// it replaces the delivery with a fresh copy of itself.
    #[serde(with = "humantime_serde")]
    pub consumer_timeout: Duration,
    /// TLS for `amqps://` and `https://` broker URLs.
    #[serde(default)]
    pub tls: BrokerTlsConfig,
}

/// Certificates for `amqps://` (and an `https://` management URL). The server's
/// certificate is always verified: against the system roots plus `ca_file`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BrokerTlsConfig {
    /// Extra CA certificate(s) (PEM) to trust, e.g. a private CA that signed the broker's.
    pub ca_file: Option<PathBuf>,
    /// Client certificate chain (PEM), for brokers that ask for one; needs `key_file`.
    pub cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM); needs `cert_file`.
    pub key_file: Option<PathBuf>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// PostgreSQL URL, e.g. `postgres://postgres@127.0.0.1:5432/lapse`: the only
    /// order database (shard 0) when `shards` is not set.
    pub url: Secret,
    /// Several order databases with the same schema: shard `i` is `shards[i]`. Set
    /// instead of `url`, never together with it (see [`DatabaseConfig::shard_list`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<Vec<Secret>>,
    /// Connections per pool (the worker, relay and sweeper each have their own; per
    /// shard).
    pub pool_size: usize,
    /// `statement_timeout` (and `idle_in_transaction_session_timeout`) of every pooled
    /// connection: a hung database call ends with an error instead of stalling a loop.
    #[serde(with = "humantime_serde")]
    pub statement_timeout: Duration,
    /// `lock_timeout` of the close path (row locks are skipped, not waited for; this
    /// bounds any other lock wait).
    #[serde(with = "humantime_serde")]
    pub lock_timeout: Duration,
    /// The search path a kind's action runs with (and is checked with): the shop's
    /// schemas, never lapse's (docs/adopting.md).
    #[serde(default = "kinds::default_shop_search_path")]
    pub shop_search_path: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopologyConfig {
    /// The tier file, relative to the working directory. Unset: the default tiers
    /// built into the binary (the repository's `topology/default.toml`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// `x-quorum-initial-group-size` of the queues `topology apply` creates: how many
    /// nodes hold a replica. Unset: every node of the cluster, at most 3 (the nodes
    /// are counted through `broker.management_url`, else the addresses in `broker.url`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quorum_group_size: Option<u32>,
}

/// Where the example shop's stock release is applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StockRelease {
    /// In the close's transaction, one statement per batch (an order whose stock row
    /// is locked falls back to the event).
    #[default]
    InClose,
    /// As a `stock.release` event through the broker to the stock releaser, which
    /// applies it in a transaction of its own.
    Event,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Run the due-queue consumer.
    pub consumer: bool,
    /// Run the outbox relay.
    pub relay: bool,
    /// Run the stock releaser.
    pub releaser: bool,
    /// Where the example shop's stock release is applied: `in_close` (in the close's
    /// transaction; an order whose stock row is locked falls back to the event) or
    /// `event` (a `stock.release` message to the stock releaser).
    #[serde(default)]
    pub stock_release: StockRelease,
    /// Run the backstop sweeper.
    pub sweeper: bool,
    /// Apply database migrations when the worker starts.
    pub migrate_on_start: bool,
    /// Unacknowledged deliveries the broker may push to one consumer.
    pub prefetch: u16,
    /// Deliveries decided in one database round trip.
    pub batch_size: usize,
    /// How long to wait for a batch to fill once its first delivery arrived.
    #[serde(with = "humantime_serde")]
    pub batch_window: Duration,
    /// How long the stock releaser's batch may wait to fill after its first event.
    /// Releases carry no lateness promise: a longer window than the consumer's turns
    /// many one-event transactions into few larger ones at low and moderate rates.
    #[serde(with = "humantime_serde")]
    pub release_batch_window: Duration,
    /// Deprecated: the relay's key [`RelayConfig::tier_tolerance`]. Still read (with a
    /// warning) when `relay.tier_tolerance` is not set; never used otherwise.
    #[serde(
        default,
        with = "humantime_serde::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub tier_tolerance: Option<Duration>,
    /// Retries after database errors before a timeout is parked.
    pub max_attempts: u32,
    /// First retry delay after a database error; doubles per attempt.
    #[serde(with = "humantime_serde")]
    pub retry_backoff: Duration,
    /// Time allowed for in-flight work after SIGINT/SIGTERM.
    #[serde(with = "humantime_serde")]
    pub drain_timeout: Duration,
    /// Upper bound on closes per second (0 = unlimited).
    pub closes_per_second: u32,
    /// A due order whose row another transaction holds locked is decided again after
    /// this long (the delivery stays unacknowledged meanwhile).
    #[serde(with = "humantime_serde")]
    pub lock_retry: Duration,
    /// A component busy on one unit of work for longer than this without progress is
    /// stalled: `GET /livez` answers 503 so that a supervisor restarts the process.
    #[serde(with = "humantime_serde")]
    pub stall_limit: Duration,
    /// Where `lapse worker` serves /metrics, /livez, /readyz and /health: `HOST:PORT`
    /// (`127.0.0.1:9464`, `localhost:9464`, `[::1]:9464`, `0.0.0.0:9464`). Unset: not
    /// served. `--metrics-listen` overrides it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
    /// Move parked messages from `<P>.parked` into the parked book (`lapse_parked`)
    /// every 5 s, and export `lapse_parked_entries`. Off, `lapse parked` commands still
    /// move them when they run.
    #[serde(default = "yes")]
    pub parked_archive: bool,
}

fn yes() -> bool {
    true
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayConfig {
    /// Upper bound on the slack the relay allows when choosing a first tier, so that a
    /// deadline equal to a tier takes one hop although the relay publishes a little
    /// after the order was written (the slack used is the relay's actual lag).
    #[serde(with = "humantime_serde")]
    pub tier_tolerance: Duration,
    /// Outbox rows published per round.
    pub batch_size: i64,
    /// Polling fallback when no notification arrives.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// How long intents due more than 2 seconds later may wait in the outbox so that
    /// more of one route leave as one pack (at most 1s; 0 publishes every intent at
    /// once). An event, a release or an intent due sooner never waits.
    #[serde(default = "default_gather", with = "humantime_serde")]
    pub gather: Duration,
    /// Where the relay LISTENs for new outbox rows, when not through the database's
    /// own URL: a connection pooler in transaction mode loses notifications, so point
    /// this at the server directly. One URL, or with `database.shards` a list of one
    /// per shard, in the same order. Unset: the database's own URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen_url: Option<ListenUrls>,
}

/// `relay.gather` unless set: `packs.window`'s default, chosen by measurement
/// (docs/benchmarks.md, "Packs: before and after"): longer rounds meet the window,
/// which parts what they gather anyway.
fn default_gather() -> Duration {
    Duration::from_millis(250)
}

/// The longest `relay.gather`: an intent that waits is due more than 2 seconds later
/// (migration V15), so it is still a second from its deadline when it is planned.
pub const MAX_GATHER: Duration = Duration::from_secs(1);

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweeperConfig {
    /// Time between sweeps.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Only orders overdue by more than this are swept (the message path goes first).
    #[serde(with = "humantime_serde")]
    pub grace: Duration,
    /// Orders closed per batch.
    pub batch_size: i64,
    /// Pause between batches.
    #[serde(with = "humantime_serde")]
    pub pause: Duration,
    /// Outbox rows older than this are reported as a stuck relay.
    #[serde(with = "humantime_serde")]
    pub stuck_outbox_after: Duration,
    /// A CLOSED order still unreleased this long after its close has lost its stock
    /// release; the reconciler emits it again.
    #[serde(with = "humantime_serde")]
    pub release_grace: Duration,
    /// How long the sweeper's leadership lasts unless its leader renews it (each
    /// batch does): a frozen or cut-off leader loses the lead this long after its
    /// last batch, and another worker sweeps instead.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrdersConfig {
    /// Stock given to a SKU that `lapse order create` meets for the first time.
    pub initial_stock: i64,
    /// How far ahead a deadline may be; `lapse migrate` writes it to the database,
    /// whose functions refuse anything later.
    #[serde(with = "humantime_serde")]
    pub deadline_horizon: Duration,
}

/// RabbitMQ's default `consumer_timeout`.
pub const DEFAULT_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The longest `orders.deadline_horizon` (100 years; the database holds the same bound).
pub const MAX_DEADLINE_HORIZON: Duration = Duration::from_secs(36_525 * 86_400);

impl Default for Config {
    fn default() -> Self {
        Self {
            broker: BrokerConfig {
                url: Secret::new("amqp://guest:guest@127.0.0.1:5672/%2f"),
                management_url: None,
                prefix: "lapse".into(),
                heartbeat: Duration::from_secs(5),
                confirm_timeout: Duration::from_secs(15),
                consumer_timeout: DEFAULT_CONSUMER_TIMEOUT,
                tls: BrokerTlsConfig::default(),
            },
            database: DatabaseConfig {
                url: Secret::new("postgres://postgres@127.0.0.1:5432/lapse"),
                shards: None,
                pool_size: 8,
                statement_timeout: Duration::from_secs(30),
                lock_timeout: Duration::from_secs(5),
                shop_search_path: kinds::default_shop_search_path(),
            },
            topology: TopologyConfig {
                file: None,
                quorum_group_size: None,
            },
            worker: WorkerConfig {
                consumer: true,
                relay: true,
                releaser: true,
                sweeper: true,
                migrate_on_start: true,
                prefetch: 1000,
                batch_size: 100,
                batch_window: Duration::from_millis(2),
                release_batch_window: Duration::from_millis(50),
                stock_release: Default::default(),
                tier_tolerance: None,
                max_attempts: 8,
                retry_backoff: Duration::from_millis(500),
                drain_timeout: Duration::from_secs(10),
                closes_per_second: 0,
                lock_retry: Duration::from_millis(500),
                stall_limit: Duration::from_secs(60),
                metrics_listen: None,
                parked_archive: true,
            },
            relay: RelayConfig {
                tier_tolerance: Duration::from_millis(50),
                batch_size: 500,
                poll_interval: Duration::from_millis(500),
                gather: default_gather(),
                listen_url: None,
            },
            sweeper: SweeperConfig {
                interval: Duration::from_secs(30),
                grace: Duration::from_secs(10),
                batch_size: 500,
                pause: Duration::from_millis(20),
                stuck_outbox_after: Duration::from_secs(60),
                release_grace: Duration::from_secs(60),
                lease: Duration::from_secs(15),
            },
            orders: OrdersConfig {
                initial_stock: 1000,
                deadline_horizon: Duration::from_secs(366 * 86_400),
            },
            retention: RetentionConfig::default(),
            kinds: Kinds::new(),
            packs: PacksConfig::default(),
        }
    }
}

impl Config {
    /// Loads and validates the tier file named by `topology.file`, or the built-in
    /// default tiers when it is not set.
    pub fn tier_file(&self) -> Result<TierFile, ConfigError> {
        let Some(path) = &self.topology.file else {
            return Ok(TierFile::built_in());
        };
        TierFile::load(path).map_err(|e| {
            let key = if e.key == "topology.file" {
                e.key
            } else {
                format!("topology.file ({}) {}", e.file.display(), e.key)
            };
            ConfigError::new(key, e.problem)
        })
    }

    pub fn names(&self) -> Names {
        Names::new(self.broker.prefix.clone())
    }
}

mod addresses;
pub mod kinds;
mod load;
mod moved;
mod packs;
pub mod pg_tls;
mod retention;
mod shards;
mod timing;
mod validate;

mod broker;
pub use validate::{listen_address, validate_prefix};

#[cfg(test)]
mod tests;

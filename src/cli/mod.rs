//! The command line: argument definitions and dispatch to the library.
//!
//! Exit status of every command: 0 success; 1 a problem was found (drift, a failed
//! check, a refused request such as a payment after the deadline); 2 usage or
//! configuration error (the message names the key; also refused credentials, a missing
//! database or schema, an invalid deadline); 3 the broker or the database could not
//! be reached. Each command's `--help` ends with examples and its exit statuses.

mod bench;
mod completions;
mod demo;
mod failure;
pub mod help;
mod kinds;
mod migrate;
mod order;
mod parked;
mod probe;
mod status;
mod topology;
mod worker;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::{Config, DEFAULT_CONFIG_FILE};

pub use failure::{Failure, explain};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitStatus {
    Ok = 0,
    Failed = 1,
    Usage = 2,
    /// The broker or the database could not be reached.
    Unreachable = 3,
}

/// `lapse --version`: the package version and the commit it was built from.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("BUILD_GIT_COMMIT"),
    ")"
);

#[derive(Debug, Parser)]
#[command(
    name = "lapse",
    version = VERSION,
    about = "Closes unpaid orders when their payment deadline passes",
    after_help = help::after(
        &[
            "lapse migrate && lapse topology apply && lapse worker",
            "lapse --config prod.toml status --json",
            "LAPSE_LOG=debug LAPSE_LOG_FORMAT=json lapse worker",
            "lapse completions bash > /etc/bash_completion.d/lapse",
        ],
        &[
            help::OK,
            (1, "a problem was found: drift, a failed check, a refused request"),
            help::USAGE_DB,
            help::UNREACHABLE,
        ],
    )
)]
pub struct Cli {
    /// Configuration file (default: lapse.toml in the working directory, if present).
    /// Any key can also be set as `LAPSE_<SECTION>__<KEY>`.
    #[arg(long, global = true, value_name = "FILE", env = "LAPSE_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Plan, apply or verify the broker topology from the tier file.
    #[command(after_help = help::after(
        &["lapse topology plan", "lapse topology apply --prune", "lapse topology verify --json"],
        &[help::OK, (1, "drift or a failed declaration"), help::USAGE, help::UNREACHABLE],
    ))]
    Topology {
        #[command(subcommand)]
        action: topology::TopologyCommand,
    },
    /// Create the database if needed and apply schema migrations (idempotent).
    #[command(after_help = help::after(
        &["lapse migrate", "LAPSE_DATABASE__URL=postgres://app@db:5432/shop lapse migrate --json"],
        &[help::OK, (1, "a migration failed"), help::USAGE, help::UNREACHABLE],
    ))]
    Migrate(migrate::MigrateArgs),
    /// Run the timeout pipeline: consumer, relay, stock releaser and sweeper.
    Worker(worker::WorkerArgs),
    /// Show lapse at work on the local services: thousands of orders with deadlines,
    /// payments and extensions, closed in-process, with live progress, a report and
    /// an SVG picture; removes what it created.
    Demo(demo::DemoArgs),
    /// Queue depths and consumers, overdue orders, outbox, parked messages and recent
    /// closes; `--check` for monitoring, `--watch` for a refreshing view.
    Status(status::StatusArgs),
    /// Create, pay, extend or show orders.
    #[command(after_help = help::after(
        &[
            "lapse order create --expires-in 30m --line apple:2",
            "lapse order pay 42",
            "lapse order show 42 --json",
            "lapse order --shard 2 show 42",
        ],
        &[help::OK, (1, "the request was refused"), help::USAGE_DB, help::UNREACHABLE],
    ))]
    Order {
        /// The order database to work on: an index into database.shards (0, the first,
        /// by default; with database.url alone only 0 exists).
        #[arg(long, value_name = "I", default_value_t = 0, global = true)]
        shard: u16,
        #[command(subcommand)]
        action: order::OrderCommand,
    },
    /// Print a shell completion script for bash, zsh or fish on stdout.
    #[command(after_help = completions::after_help())]
    Completions(completions::CompletionsArgs),
    /// List, count, show, replay or purge parked messages (kept in the parked book).
    #[command(after_help = help::after(
        &[
            "lapse parked list",
            "lapse parked counts",
            "lapse parked replay --all --dry-run",
            "lapse parked purge timeout-42-v1 --yes",
        ],
        &[
            help::OK,
            (1, "a message was not found or not replayed"),
            help::USAGE,
            (3, "the broker or the database could not be reached, or stopped answering"),
        ],
    ))]
    Parked {
        #[command(subcommand)]
        action: parked::ParkedCommand,
    },
    /// Check the deadline kinds of `[kinds]` against the order databases.
    #[command(after_help = help::after(
        &["lapse kinds check", "lapse kinds check --json"],
        &[
            help::OK,
            (1, "a kind does not check"),
            help::USAGE,
            help::UNREACHABLE,
        ],
    ))]
    Kinds {
        #[command(subcommand)]
        action: kinds::KindsCommand,
    },
    /// Ask a running worker whether it is live (or ready): exit 0 if so, for a
    /// container HEALTHCHECK or a supervisor.
    #[command(after_help = help::after(
        &[
            "lapse probe",
            "lapse probe --ready --address 127.0.0.1:9464",
        ],
        &[
            help::OK,
            (1, "the worker answered that it is stalled (or not ready)"),
            (2, "no address: worker.metrics_listen is not set and --address not given"),
            (3, "the worker did not answer"),
        ],
    ))]
    Probe(probe::ProbeArgs),
    /// Measure lateness, throughput and CPU per order on these services, next to the
    /// broker alone, in a database and broker prefix of its own.
    Bench(bench::BenchArgs),
}

impl Cli {
    /// The log level when neither LAPSE_LOG nor RUST_LOG says: `warn` for the demo,
    /// whose progress and report are its output, `info` for the rest.
    pub fn default_log_level(&self) -> &'static str {
        match self.command {
            Command::Demo(_) => "warn",
            _ => "info",
        }
    }

    /// The validated configuration as the file and the environment give it, no
    /// certificate file read.
    pub fn load_config_file(&self) -> Result<Config, crate::config::ConfigError> {
        match &self.config {
            Some(path) => Config::load(path, true),
            None => Config::load(std::path::Path::new(DEFAULT_CONFIG_FILE), false),
        }
    }

    /// The validated configuration, its `broker.tls.*` files read and checked too
    /// (that check needs the TLS adapter, which the configuration layer sits below).
    pub fn load_config(&self) -> Result<Config, crate::config::ConfigError> {
        let config = self.load_config_file()?;
        crate::amqp::tls_files(&config.broker.tls).map_err(|e| crate::config::ConfigError {
            key: "broker.tls".into(),
            problem: e.to_string(),
        })?;
        // Each database's sslrootcert, read and checked now, as the broker's files are.
        for shard in config.database.shard_list() {
            let key = match config.database.sharded() {
                true => crate::db::shard_key(shard.index),
                false => "database.url".to_string(),
            };
            crate::db::pg_config(&shard.url)
                .and_then(|target| target.connector().map(|_| ()))
                .map_err(|e| crate::config::ConfigError {
                    key,
                    problem: e.to_string(),
                })?;
        }
        Ok(config)
    }
}

/// A `HOST:PORT` argument (`--metrics-listen`, `lapse probe --address`), checked as
/// the `worker.metrics_listen` key is.
fn listen_address(text: &str) -> Result<String, String> {
    crate::config::listen_address(text).map(|()| text.trim().to_string())
}

pub async fn run(cli: Cli) -> anyhow::Result<ExitStatus> {
    if let Command::Completions(args) = &cli.command {
        return completions::run(args);
    }
    // A health check reads only where to ask: a certificate file being rotated must
    // not turn a live worker's HEALTHCHECK into a failure.
    let config = match cli.command {
        Command::Probe(_) => cli.load_config_file()?,
        _ => cli.load_config()?,
    };
    match cli.command {
        Command::Topology { action } => topology::run(&config, action).await,
        Command::Migrate(args) => migrate::run(&config, args).await,
        Command::Worker(args) => worker::run(config, args).await,
        Command::Demo(args) => demo::run(config, args).await,
        Command::Order { shard, action } => order::run(&config, shard, action).await,
        Command::Status(args) => status::run(&config, args).await,
        Command::Completions(args) => completions::run(&args),
        Command::Parked { action } => parked::run(&config, action).await,
        Command::Kinds { action } => kinds::run(&config, action).await,
        Command::Probe(args) => probe::run(&config, args).await,
        Command::Bench(args) => bench::run(&config, cli.config.clone(), args).await,
    }
}

/// Prints `value` as pretty JSON on stdout.
pub(crate) fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    // figment's Jail closures return its (large) error type by design.
    #![allow(clippy::result_large_err)]
    use clap::Parser;

    #[test]
    fn a_missing_ca_file_is_refused_naming_the_key_and_the_file() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("LAPSE_BROKER__URL", "amqps://u:hunter2@h/%2f");
            jail.set_env("LAPSE_BROKER__TLS__CA_FILE", "/nonexistent/ca.pem");
            let err = super::Cli::parse_from(["lapse", "status"])
                .load_config()
                .unwrap_err();
            assert_eq!(err.key, "broker.tls");
            assert!(err.problem.contains("/nonexistent/ca.pem"), "{err}");
            assert!(!err.to_string().contains("hunter2"), "{err}");
            Ok(())
        });
    }
}

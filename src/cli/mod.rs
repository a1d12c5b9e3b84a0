//! The command line: argument definitions and dispatch to the library.
//!
//! Exit status: 0 success, 1 the operation failed or was refused by rule (drift, a
//! payment after the deadline, an extension that would not move the deadline later,
//! insufficient stock, an order whose stored values cannot be read), 2 bad arguments
//! or configuration (including a deadline the database refuses as invalid: overflow,
//! past, beyond `orders.deadline_horizon`), 3 the broker or the database could not be
//! reached (`status`, `topology verify`).

mod order;
mod status;
mod topology;
mod worker;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::{Config, DEFAULT_CONFIG_FILE};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitStatus {
    Ok = 0,
    Failed = 1,
    Usage = 2,
    /// The broker or the database could not be reached.
    Unreachable = 3,
}

#[derive(Debug, Parser)]
#[command(
    name = "lapse",
    version,
    about = "Closes unpaid orders when their payment deadline passes"
)]
pub struct Cli {
    /// Configuration file (default: lapse.toml in the working directory, if present).
    #[arg(long, global = true)]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Plan, apply or verify the broker topology from the tier file.
    Topology {
        #[command(subcommand)]
        action: topology::TopologyCommand,
    },
    /// Create the database if needed and apply schema migrations (idempotent).
    Migrate,
    /// Run the timeout pipeline: consumer, relay, stock releaser and sweeper.
    Worker(worker::WorkerArgs),
    /// Queue depths and consumers, overdue orders, outbox, parked messages and recent
    /// closes; `--check` for monitoring, `--watch` for a refreshing view.
    Status(status::StatusArgs),
    /// Create, pay, extend or show orders.
    Order {
        #[command(subcommand)]
        action: order::OrderCommand,
    },
}

impl Cli {
    pub fn load_config(&self) -> Result<Config, crate::config::ConfigError> {
        match &self.config {
            Some(path) => Config::load(path, true),
            None => Config::load(std::path::Path::new(DEFAULT_CONFIG_FILE), false),
        }
    }
}

pub async fn run(cli: Cli) -> anyhow::Result<ExitStatus> {
    let config = cli.load_config()?;
    match cli.command {
        Command::Topology { action } => topology::run(&config, action).await,
        Command::Migrate => order::migrate(&config).await,
        Command::Worker(args) => worker::run(config, args).await,
        Command::Order { action } => order::run(&config, action).await,
        Command::Status(args) => status::run(&config, args).await,
    }
}

/// Prints `value` as pretty JSON on stdout.
pub(crate) fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

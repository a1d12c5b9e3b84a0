//! The command line: argument definitions and dispatch to the library.
//!
//! Exit status: 0 success, 1 the operation failed or was refused by rule (drift, a
//! payment after the deadline, an extension that would not move the deadline later,
//! insufficient stock, an order whose stored values cannot be read), 2 bad arguments
//! or configuration (including a deadline the database refuses as invalid: overflow,
//! past, beyond `orders.deadline_horizon`).

mod order;
mod parked;
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
    /// Queue depths, overdue orders, outbox and recent lateness.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Create, pay, extend or show orders.
    Order {
        #[command(subcommand)]
        action: order::OrderCommand,
    },
    /// List, show, replay or purge parked messages.
    Parked {
        #[command(subcommand)]
        action: parked::ParkedCommand,
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
        Command::Status { json } => status(&config, json).await,
        Command::Parked { action } => parked::run(&config, action).await,
    }
}

/// Prints `value` as pretty JSON on stdout.
pub(crate) fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

async fn status(config: &Config, json: bool) -> anyhow::Result<ExitStatus> {
    let topology = crate::topology::Topology::new(&config.names(), &config.tier_file()?);
    let conn = crate::broker::Endpoint::from_config(&config.broker)?
        .connect("lapse status")
        .await?;
    let pool = crate::db::pool(&config.database, 1)?;
    let client = pool.get().await?;
    let status = crate::status::collect(&conn, &**client, &topology).await?;
    let _ = conn.close(200, "done".into()).await;
    if json {
        print_json(&status)?;
    } else {
        print!("{}", status.render(&topology));
    }
    Ok(ExitStatus::Ok)
}

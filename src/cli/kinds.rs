//! `lapse kinds check`: every kind of `[kinds]` checked against each order database
//! before a worker runs it.

use clap::Subcommand;

use super::{ExitStatus, help, print_json};
use crate::config::Config;
use crate::kinds::Catalog;
use crate::kinds::check;
use crate::redact::redact;

#[derive(Debug, Subcommand)]
pub enum KindsCommand {
    /// Prepare every kind's action on each order database (nothing is executed): it
    /// must take the key as its one parameter and return named columns.
    #[command(after_help = help::after(
        &["lapse kinds check", "lapse kinds check --json"],
        &[
            (0, "every kind checks on every database"),
            (1, "a kind does not check (the message names the kind and the key)"),
            help::USAGE,
            help::UNREACHABLE,
        ],
    ))]
    Check {
        /// Print {"kinds": [{"shard", "kind", "columns"} | {"shard", "kind", "key", "error"}]}.
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(config: &Config, command: KindsCommand) -> anyhow::Result<ExitStatus> {
    let KindsCommand::Check { json } = command;
    let catalog = Catalog::new(&config.kinds, &config.database.shop_search_path);
    if catalog.is_empty() {
        if json {
            print_json(&serde_json::json!({ "kinds": [] }))?;
        } else {
            println!("no kinds are configured ([kinds.<name>] in the configuration file)");
        }
        return Ok(ExitStatus::Ok);
    }
    let mut shown = Vec::new();
    let mut failed = 0;
    for shard in config.database.shard_list() {
        let target = crate::db::bounded_config(&shard.url)?;
        let (mut client, connection) = match crate::db::bounded_connect(&target).await {
            Ok(connected) => connected,
            Err(e) => {
                eprintln!("error: database {}: {}", shard.index, redact(&e.detail()));
                return Ok(ExitStatus::Unreachable);
            }
        };
        let driver = tokio::spawn(connection);
        let results = check::check(&mut client, &catalog).await?;
        drop(client);
        let _ = driver.await;
        for result in results {
            match result {
                Ok(checked) => {
                    if !json {
                        println!(
                            "ok    shard {} kind {}: returns {}",
                            shard.index,
                            checked.kind,
                            checked.columns.join(", ")
                        );
                    }
                    shown.push(serde_json::json!({
                        "shard": shard.index, "kind": checked.kind, "columns": checked.columns,
                    }));
                }
                Err(problem) => {
                    failed += 1;
                    if !json {
                        eprintln!("error shard {}: {problem}", shard.index);
                    }
                    shown.push(serde_json::json!({
                        "shard": shard.index, "kind": problem.kind,
                        "key": format!("kinds.{}.{}", problem.kind, problem.field),
                        "error": problem.problem,
                    }));
                }
            }
        }
    }
    if json {
        print_json(&serde_json::json!({ "kinds": shown }))?;
    }
    Ok(if failed == 0 {
        ExitStatus::Ok
    } else {
        ExitStatus::Failed
    })
}

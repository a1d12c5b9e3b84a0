//! `lapse topology plan | apply | verify`.

use anyhow::Context;
use clap::Subcommand;

use super::{ExitStatus, print_json};
use crate::broker;
use crate::config::Config;
use crate::management::Management;
use crate::topology::{self, Topology};

#[derive(Debug, Subcommand)]
pub enum TopologyCommand {
    /// Show what would be declared, without touching the broker.
    Plan {
        #[arg(long)]
        json: bool,
    },
    /// Declare every exchange, queue and binding (idempotent).
    Apply {
        /// Also delete empty wait queues of this prefix that the tier file no longer lists.
        #[arg(long)]
        prune: bool,
        #[arg(long)]
        json: bool,
    },
    /// Compare the live broker with the tier file: exit 0 when it matches, 1 on any
    /// difference, 3 when the broker or its management API cannot be reached.
    #[command(after_help = VERIFY_HELP)]
    Verify {
        /// Print the checks as JSON.
        #[arg(long)]
        json: bool,
    },
}

const VERIFY_HELP: &str = "\
Examples:
  lapse topology verify
  lapse topology verify --json

Exit status:
  0  the broker matches the tier file (skipped checks are listed, not failed)
  1  drift: a missing object, different arguments, an overriding policy, a missing
     binding or a disabled feature flag
  2  usage or configuration error
  3  the broker, or the management API (broker.management_url), could not be reached;
     the line says which and why (connection refused, TLS, 401)";

pub async fn run(config: &Config, command: TopologyCommand) -> anyhow::Result<ExitStatus> {
    let names = config.names();
    let topology = Topology::new(&names, &config.tier_file()?);
    let vhost = broker::vhost(&config.broker.url);
    let endpoint = broker::Endpoint::from_config(&config.broker)?;
    let management = config
        .broker
        .management_url
        .as_ref()
        .map(|url| Management::with_tls(url, &endpoint.tls))
        .transpose()?;
    match command {
        TopologyCommand::Plan { json } => {
            if json {
                print_json(&topology)?;
            } else {
                print!("{}", topology.render_table());
            }
            Ok(ExitStatus::Ok)
        }
        TopologyCommand::Apply { prune, json } => {
            let conn = endpoint.connect("lapse topology").await?;
            let report = topology::apply(&conn, &topology).await?;
            let pruned = if prune {
                let m = management
                    .as_ref()
                    .context("--prune needs broker.management_url to list the broker's queues")?;
                Some(
                    topology::prune(&conn, m, &vhost, &names, &topology)
                        .await
                        .map_err(|e| anyhow::anyhow!("prune failed: {e}"))?,
                )
            } else {
                None
            };
            let _ = conn.close(200, "done".into()).await;
            if json {
                print_json(&serde_json::json!({ "apply": report, "prune": pruned }))?;
            } else {
                print_apply(&report, pruned.as_ref());
            }
            Ok(if report.ok() {
                ExitStatus::Ok
            } else {
                ExitStatus::Failed
            })
        }
        TopologyCommand::Verify { json } => {
            let unreachable = |e: broker::BrokerError| {
                eprintln!(
                    "error: cannot reach the broker at {}: {e}",
                    broker::shown_address(&config.broker.url)
                );
                Ok(ExitStatus::Unreachable)
            };
            let conn = match endpoint.connect("lapse topology").await {
                Ok(conn) => conn,
                Err(e) => return unreachable(e),
            };
            let report = match topology::verify(&conn, management.as_ref(), &vhost, &topology).await
            {
                Ok(report) => report,
                Err(e) => return unreachable(e),
            };
            broker::close_quietly(&conn, "done").await;
            if json {
                print_json(&report)?;
            } else {
                print!("{}", report.render_table());
            }
            if let Some(why) = &report.management_unreachable {
                eprintln!("error: {why}");
                return Ok(ExitStatus::Unreachable);
            }
            Ok(if report.ok() {
                ExitStatus::Ok
            } else {
                ExitStatus::Failed
            })
        }
    }
}

fn print_apply(report: &topology::ApplyReport, pruned: Option<&topology::PruneReport>) {
    for name in &report.declared {
        println!("declared  {name}");
    }
    for drift in &report.drifts {
        println!("DRIFT     {drift}");
    }
    for failure in &report.failures {
        println!("FAILED    {failure}");
    }
    if let Some(p) = pruned {
        for name in &p.deleted {
            println!("deleted   {name} (empty, no longer in the tier file)");
        }
        for (name, depth) in &p.kept {
            println!(
                "kept      {name} ({depth} messages; no longer in the tier file, delete it once it drains)"
            );
        }
        if p.deleted.is_empty() && p.kept.is_empty() {
            println!("prune     no orphan wait queues");
        }
    }
    println!(
        "{} declared, {} drifted, {} failed",
        report.declared.len(),
        report.drifts.len(),
        report.failures.len()
    );
}

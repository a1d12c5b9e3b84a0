//! `lapse topology plan | apply | verify`.

use anyhow::Context;
use clap::Subcommand;

use super::{ExitStatus, help, print_json};
use crate::amqp::broker;
use crate::amqp::management::Management;
use crate::amqp::topology::{self, Topology};
use crate::config::Config;

#[derive(Debug, Subcommand)]
pub enum TopologyCommand {
    /// Show what would be declared, without touching the broker.
    #[command(after_help = help::after(
        &["lapse topology plan", "lapse --config prod.toml topology plan --json"],
        &[help::OK, help::USAGE],
    ))]
    Plan {
        /// Print the plan as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Declare every exchange, queue and binding (idempotent).
    #[command(after_help = help::after(
        &["lapse topology apply", "lapse topology apply --prune --json"],
        &[
            (0, "everything is declared as the tier file says"),
            (1, "an object exists with other arguments (drift) or a declaration failed"),
            help::USAGE,
            (3, "could not reach the broker, or its management API (needed by --prune)"),
        ],
    ))]
    Apply {
        /// Also delete empty wait queues of this prefix that the tier file no longer
        /// lists (needs broker.management_url).
        #[arg(long)]
        prune: bool,
        /// Print {"apply", "prune"} as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Compare the live broker with the tier file: exit 0 when it matches, 1 on any
    /// difference, 3 when the broker or its management API cannot be reached.
    #[command(after_help = help::after(
        &["lapse topology verify", "lapse topology verify --json"],
        &[
            (0, "the broker matches the tier file (skipped checks are listed, not failed)"),
            (1, "drift: a missing object, different arguments, an overriding policy, a \
                 missing binding or a disabled feature flag"),
            help::USAGE,
            (3, "the broker, or the management API (broker.management_url), could not be \
                 reached; the line says which and why (connection refused, TLS)"),
        ],
    ))]
    Verify {
        /// Print the report as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
}

// Over 60 lines on purpose: one arm per subcommand (plan, apply, verify), each printing its report in text or JSON with its exit status.
pub async fn run(config: &Config, command: TopologyCommand) -> anyhow::Result<ExitStatus> {
    let names = config.names();
    let vhost = broker::vhost(&config.broker.url);
    let endpoint = crate::amqp::endpoint(&config.broker)?;
    let management = config
        .broker
        .management_url
        .as_ref()
        .map(|url| Management::with_tls(url, &endpoint.tls))
        .transpose()?;
    let group_size = group_size(config, management.as_ref()).await;
    let topology = Topology::new(&names, &config.tier_file()?).with_group_size(group_size);
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
            if prune && let Some(m) = &management {
                m.feature_flags().await?;
            }
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
            broker::close_quietly(&conn, "done").await;
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
            // Connect errors are explained by the caller: refused credentials are a
            // configuration error (2), no answer is exit 3.
            let conn = endpoint.connect("lapse topology").await?;
            let report = topology::verify(&conn, management.as_ref(), &vhost, &topology).await?;
            broker::close_quietly(&conn, "done").await;
            if json {
                print_json(&report)?;
            } else {
                print!("{}", report.render_table());
            }
            if let Some(why) = &report.management_unreachable {
                eprintln!("error: {why}");
                // A refused login heals only by changing the configuration.
                let refused = why.contains("401 Unauthorized") || why.contains("403 Forbidden");
                return Ok(if refused {
                    ExitStatus::Usage
                } else {
                    ExitStatus::Unreachable
                });
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
        for k in &p.kept {
            println!(
                "kept      {} ({}; no longer in the tier file, delete it once it drains)",
                k.queue, k.why
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

/// `topology.quorum_group_size`, else every node up to 3: the nodes the management API
/// lists (running or not), or, without it (or when it cannot be asked), the addresses
/// in `broker.url`.
async fn group_size(config: &Config, management: Option<&Management>) -> u32 {
    if let Some(size) = config.topology.quorum_group_size {
        return size;
    }
    let listed = match management {
        Some(m) => m.nodes().await.ok().map(|nodes| nodes.len()),
        None => None,
    };
    let nodes = listed.unwrap_or_else(|| crate::config::split_addresses(&config.broker.url).len());
    topology::default_group_size(nodes)
}

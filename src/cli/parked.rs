//! `lapse parked list | show | replay | purge`.

use std::collections::BTreeSet;
use std::io::{BufRead, IsTerminal, Write};

use clap::{Args, Subcommand};
use serde_json::json;

use super::{ExitStatus, print_json};
use crate::config::Config;
use crate::parked::{Entry, Item, Outcome, ParkedError, Pass, Plan, Router, headers_json, rfc3339};

/// Exit statuses shared by every `lapse parked` command.
const EXIT_CODES: &[(u8, &str)] = &[
    super::help::OK,
    (
        1,
        "a message was not found or not replayed, or another parked command is running",
    ),
    (
        2,
        "bad arguments or configuration (also: purge without --yes when stdin is not a \
         terminal)",
    ),
    (3, "the broker could not be reached, or stopped answering"),
];

#[derive(Debug, Subcommand)]
pub enum ParkedCommand {
    /// List parked messages in queue order: ID, kind, order, deadline, version,
    /// attempts, when parked and why. Listing never spends a delivery.
    #[command(after_help = super::help::after(
        &["lapse parked list", "lapse parked list --json"],
        EXIT_CODES,
    ))]
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show every copy of one parked message: its fields, headers and body.
    #[command(after_help = super::help::after(
        &["lapse parked show timeout-42-v1", "lapse parked show release-42 --json"],
        EXIT_CODES,
    ))]
    Show {
        /// The message ID from `lapse parked list` (e.g. timeout-42-v1, release-42, raw-…).
        #[arg(value_name = "ID")]
        id: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Put parked messages back on their path: a timeout to its wait tier or the due
    /// queue (own deadline and version, fresh attempt budget), a release to the stock
    /// releaser. Each leaves parked only after the broker confirmed it at its destination.
    #[command(after_help = super::help::after(
        &["lapse parked replay timeout-42-v1", "lapse parked replay --reason unavailable --dry-run", "lapse parked replay --all --json"],
        EXIT_CODES,
    ))]
    Replay {
        #[command(flatten)]
        select: Select,
        /// Only say where each message would go; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Delete parked messages for good. Asks for confirmation unless --yes.
    #[command(after_help = super::help::after(
        &["lapse parked purge raw-0123456789abcdef", "lapse parked purge --reason unreadable --yes"],
        EXIT_CODES,
    ))]
    Purge {
        #[command(flatten)]
        select: Select,
        /// Do not ask; required when stdin is not a terminal.
        #[arg(long)]
        yes: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// Which parked messages a replay or purge acts on.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct Select {
    /// Message IDs from `lapse parked list`; every copy of each is selected.
    #[arg(value_name = "ID")]
    ids: Vec<String>,
    /// Every parked message.
    #[arg(long)]
    all: bool,
    /// Messages whose reason contains this text (case-insensitive).
    #[arg(long, value_name = "TEXT")]
    reason: Option<String>,
}

impl Select {
    fn matches(&self, entry: &Entry) -> bool {
        self.all
            || self.ids.contains(&entry.id)
            || self
                .reason
                .as_deref()
                .is_some_and(|r| entry.reason_matches(r))
    }

    /// IDs asked for by name that no message has.
    fn not_found(&self, items: &[Item]) -> Vec<String> {
        let seen: BTreeSet<&str> = items.iter().map(|i| i.entry.id.as_str()).collect();
        self.ids
            .iter()
            .filter(|id| !seen.contains(id.as_str()))
            .cloned()
            .collect()
    }
}

pub async fn run(config: &Config, command: ParkedCommand) -> anyhow::Result<ExitStatus> {
    let endpoint = crate::amqp::endpoint(&config.broker)?;
    let router = match &command {
        ParkedCommand::Replay { .. } => Some(Router::new(
            config.names(),
            config.tier_file()?.tiers,
            endpoint.confirm_timeout,
        )),
        _ => None,
    };
    let mut pass = Pass {
        endpoint,
        names: config.names(),
        router,
        dry_run: false,
    };
    let result = match command {
        ParkedCommand::List { json } => list(&pass, json).await,
        ParkedCommand::Show { id, json } => show(&pass, &id, json).await,
        ParkedCommand::Replay {
            select,
            dry_run,
            json,
        } => {
            pass.dry_run = dry_run;
            act(&pass, &select, Plan::Replay, json).await
        }
        ParkedCommand::Purge { select, yes, json } => purge(&mut pass, select, yes, json).await,
    };
    match result {
        Ok(status) => Ok(status),
        Err(e) if e.unreachable() => {
            eprintln!("error: {}", crate::redact::redact(&e.to_string()));
            Ok(ExitStatus::Unreachable)
        }
        Err(e) => {
            eprintln!("error: {}", crate::redact::redact(&e.to_string()));
            Ok(ExitStatus::Failed)
        }
    }
}

async fn list(pass: &Pass, json: bool) -> Result<ExitStatus, ParkedError> {
    let items = pass.run(|_| Plan::Keep).await?;
    if json {
        let entries: Vec<&Entry> = items.iter().map(|i| &i.entry).collect();
        print_json(&entries).map_err(|e| ParkedError::Broker(unavailable(e)))?;
    } else {
        print!("{}", table(&items, false));
    }
    Ok(ExitStatus::Ok)
}

async fn show(pass: &Pass, id: &str, json: bool) -> Result<ExitStatus, ParkedError> {
    let items = pass.run(|_| Plan::Keep).await?;
    let copies: Vec<serde_json::Value> = items
        .iter()
        .filter(|i| i.entry.id == id)
        .map(|i| {
            json!({
                "entry": i.entry,
                "message_id": i.properties.message_id().as_ref().map(|m| m.to_string()),
                "headers": headers_json(i.properties.headers().as_ref()),
                "body": String::from_utf8_lossy(&i.body),
            })
        })
        .collect();
    if copies.is_empty() {
        eprintln!("no parked message has ID {id}; `lapse parked list` shows the IDs");
        return Ok(ExitStatus::Failed);
    }
    if json {
        print_json(&copies).map_err(|e| ParkedError::Broker(unavailable(e)))?;
    } else {
        for (n, copy) in copies.iter().enumerate() {
            println!("copy {} of {}", n + 1, copies.len());
            for section in ["entry", "headers"] {
                if let Some(fields) = copy[section].as_object() {
                    for (key, value) in fields {
                        println!("  {key:<18} {}", text(value));
                    }
                }
            }
            println!("  message_id         {}", text(&copy["message_id"]));
            println!("  body               {}", text(&copy["body"]));
        }
    }
    Ok(ExitStatus::Ok)
}

/// Replays or purges the selected messages and reports each.
async fn act(
    pass: &Pass,
    select: &Select,
    plan: Plan,
    json: bool,
) -> Result<ExitStatus, ParkedError> {
    let items = pass
        .run(|e| if select.matches(e) { plan } else { Plan::Keep })
        .await?;
    let not_found = select.not_found(&items);
    let acted: Vec<&Item> = items.iter().filter(|i| select.matches(&i.entry)).collect();
    let failed = acted
        .iter()
        .any(|i| matches!(i.outcome, Outcome::Failed { .. }));
    if json {
        print_json(&json!({ "messages": acted, "not_found": not_found }))
            .map_err(|e| ParkedError::Broker(unavailable(e)))?;
    } else {
        let owned: Vec<Item> = acted.into_iter().cloned().collect();
        print!("{}", table(&owned, true));
        for id in &not_found {
            println!("not found: {id} (`lapse parked list` shows the IDs)");
        }
    }
    Ok(if failed || !not_found.is_empty() {
        ExitStatus::Failed
    } else {
        ExitStatus::Ok
    })
}

async fn purge(
    pass: &mut Pass,
    select: Select,
    yes: bool,
    json: bool,
) -> Result<ExitStatus, ParkedError> {
    if yes {
        return act(pass, &select, Plan::Purge, json).await;
    }
    if !std::io::stdin().is_terminal() {
        eprintln!(
            "error: refusing to purge without confirmation: stdin is not a terminal; \
             pass --yes to purge the selected messages"
        );
        return Ok(ExitStatus::Usage);
    }
    // Show what would go, ask, then purge exactly those (not what arrived meanwhile).
    pass.dry_run = true;
    let items = pass
        .run(|e| {
            if select.matches(e) {
                Plan::Purge
            } else {
                Plan::Keep
            }
        })
        .await?;
    pass.dry_run = false;
    let chosen: Vec<Item> = items
        .into_iter()
        .filter(|i| select.matches(&i.entry))
        .collect();
    if chosen.is_empty() {
        println!("nothing to purge");
        return Ok(if select.ids.is_empty() {
            ExitStatus::Ok
        } else {
            ExitStatus::Failed
        });
    }
    print!("{}", table(&chosen, false));
    print!(
        "Purge these {} parked messages for good? Type yes: ",
        chosen.len()
    );
    let _ = std::io::stdout().flush();
    let mut answer = String::new();
    let _ = std::io::stdin().lock().read_line(&mut answer);
    if answer.trim() != "yes" {
        println!("nothing purged");
        return Ok(ExitStatus::Failed);
    }
    let ids: Vec<String> = chosen.iter().map(|i| i.entry.id.clone()).collect();
    let exact = Select {
        ids,
        all: false,
        reason: None,
    };
    act(pass, &exact, Plan::Purge, json).await
}

/// A JSON value as plain text (strings unquoted, null as `-`).
fn text(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => "-".into(),
        other => other.to_string(),
    }
}

fn unavailable(e: anyhow::Error) -> crate::amqp::broker::BrokerError {
    crate::amqp::broker::BrokerError::Unavailable {
        reason: e.to_string(),
    }
}

fn table(items: &[Item], outcome: bool) -> String {
    let dash = || "-".to_string();
    let mut out = format!(
        "{:<26} {:<10} {:>8} {:<24} {:>3} {:>4} {:<24} REASON{}\n",
        "ID",
        "KIND",
        "ORDER",
        "DEADLINE",
        "V",
        "ATT",
        "PARKED AT",
        if outcome { " / OUTCOME" } else { "" }
    );
    for i in items {
        let e = &i.entry;
        let kind = serde_json::to_value(e.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        out.push_str(&format!(
            "{:<26} {:<10} {:>8} {:<24} {:>3} {:>4} {:<24} {}",
            e.id,
            kind,
            e.order_id.map_or_else(dash, |o| o.to_string()),
            e.deadline.map_or_else(dash, rfc3339),
            e.deadline_version.map_or_else(dash, |v| v.to_string()),
            e.attempts,
            e.parked_at.map_or_else(dash, rfc3339),
            e.reason,
        ));
        if outcome {
            let o = match &i.outcome {
                Outcome::Kept => "kept".to_string(),
                Outcome::Replayed { to } => format!("replayed to {to}"),
                Outcome::WouldReplay { to } => format!("would replay to {to}"),
                Outcome::Purged => "purged".to_string(),
                Outcome::Failed { error } => format!("stays parked: {error}"),
            };
            out.push_str(&format!(" / {o}"));
        }
        out.push('\n');
    }
    out.push_str(&format!("{} message(s)\n", items.len()));
    out
}

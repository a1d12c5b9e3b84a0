//! `lapse parked list | counts | show | replay | purge`, over the parked book (the
//! table `lapse_parked`); each command first moves what arrived in `<P>.parked` into it.

use std::collections::BTreeSet;
use std::io::{BufRead, IsTerminal, Write};

use serde_json::json;

use super::{ExitStatus, print_json};
use crate::config::Config;
use crate::db::Pool;
mod args;
mod render;

pub use args::{ParkedCommand, Select};

use render::{table, text};

use crate::parked::{Item, Outcome, ParkedError, Router, Selection, book, rfc3339};

/// What every command works with: the broker (to move new arrivals in, and to
/// replay) and the first order database (the book).
struct Parked<'a> {
    config: &'a Config,
    pool: Pool,
}

impl Parked<'_> {
    /// Moves what arrived in `<P>.parked` into the book. For a command that only
    /// reads, a failure to move (the broker away, a message the database refuses) is a
    /// warning: the book is shown as it is.
    async fn archive(&self, required: bool) -> Result<Option<lapin::Connection>, ParkedError> {
        let endpoint = crate::amqp::endpoint(&self.config.broker)
            .map_err(|e| ParkedError::Broker(unavailable(e.into())))?;
        let moved = async {
            let conn = endpoint.connect("lapse parked").await?;
            match crate::parked::archive::archive(
                &conn,
                &self.config.names(),
                &self.pool,
                endpoint.confirm_timeout,
                &mut || true,
            )
            .await
            {
                Ok(_) => Ok(conn),
                Err(e) => {
                    crate::amqp::broker::close_quietly(&conn, "lapse parked failed").await;
                    Err(e)
                }
            }
        };
        match moved.await {
            Ok(conn) => Ok(Some(conn)),
            Err(e) if !required => {
                eprintln!(
                    "warning: new arrivals in {} not moved into the parked book ({}); \
                     showing the book as it is",
                    self.config.names().parked(),
                    crate::redact::redact(&e.to_string())
                );
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

pub async fn run(config: &Config, command: ParkedCommand) -> anyhow::Result<ExitStatus> {
    let home = config.database.for_shard(&config.database.shard_list()[0]);
    let parked = Parked {
        config,
        pool: crate::db::pool(&home, 2)?,
    };
    let result = match command {
        ParkedCommand::List {
            after,
            limit,
            reason,
            json,
        } => list(&parked, after, limit, reason, json).await,
        ParkedCommand::Counts { json } => counts(&parked, json).await,
        ParkedCommand::Show { id, json } => show(&parked, &id, json).await,
        ParkedCommand::Replay {
            select,
            dry_run,
            json,
        } => replay(&parked, &select, dry_run, json).await,
        ParkedCommand::Purge { select, yes, json } => purge(&parked, &select, yes, json).await,
    };
    match result {
        Ok(status) => Ok(status),
        Err(e) if e.unreachable() => {
            eprintln!("error: {}", crate::redact::redact(&e.to_string()));
            Ok(ExitStatus::Unreachable)
        }
        Err(ParkedError::Db(e)) => Err(e.into()),
        Err(e) => {
            eprintln!("error: {}", crate::redact::redact(&e.to_string()));
            Ok(ExitStatus::Failed)
        }
    }
}

async fn list(
    parked: &Parked<'_>,
    after: i64,
    limit: i64,
    reason: Option<String>,
    json: bool,
) -> Result<ExitStatus, ParkedError> {
    if let Some(conn) = parked.archive(false).await? {
        crate::amqp::broker::close_quietly(&conn, "lapse parked done").await;
    }
    let selection = reason.map(|reason| Selection {
        reason: Some(reason),
        ..Default::default()
    });
    let (rows, more) = book::page(
        &parked.pool,
        &parked.config.broker.prefix,
        selection.as_ref(),
        after,
        limit,
    )
    .await?;
    if json {
        print_json(&rows).map_err(|e| ParkedError::Broker(unavailable(e)))?;
    } else {
        print!("{}", table(rows.iter().map(|r| (r, None)), rows.len()));
        if let (true, Some(last)) = (more, rows.last()) {
            let mut next = format!("more: lapse parked list --after {}", last.seq);
            if limit != 100 {
                next.push_str(&format!(" --limit {limit}"));
            }
            if let Some(reason) = selection.as_ref().and_then(|s| s.reason.as_deref()) {
                next.push_str(&format!(" --reason {reason:?}"));
            }
            println!("{next}");
        }
    }
    Ok(ExitStatus::Ok)
}

async fn counts(parked: &Parked<'_>, json: bool) -> Result<ExitStatus, ParkedError> {
    if let Some(conn) = parked.archive(false).await? {
        crate::amqp::broker::close_quietly(&conn, "lapse parked done").await;
    }
    let counts = book::counts(&parked.pool, &parked.config.broker.prefix).await?;
    if json {
        print_json(&counts).map_err(|e| ParkedError::Broker(unavailable(e)))?;
        return Ok(ExitStatus::Ok);
    }
    let dash = || "-".to_string();
    println!(
        "{:<24} {:>8} {:<24} {:<24} EXAMPLE",
        "CAUSE", "COUNT", "OLDEST", "NEWEST"
    );
    for c in &counts {
        println!(
            "{:<24} {:>8} {:<24} {:<24} {}",
            c.cause,
            c.count,
            c.oldest_parked_at.map_or_else(dash, rfc3339),
            c.newest_parked_at.map_or_else(dash, rfc3339),
            c.example
        );
    }
    println!("{} message(s)", counts.iter().map(|c| c.count).sum::<i64>());
    Ok(ExitStatus::Ok)
}

async fn show(parked: &Parked<'_>, id: &str, json: bool) -> Result<ExitStatus, ParkedError> {
    if let Some(conn) = parked.archive(false).await? {
        crate::amqp::broker::close_quietly(&conn, "lapse parked done").await;
    }
    let selection = Selection {
        ids: vec![id.to_string()],
        ..Default::default()
    };
    let (rows, _) = book::page(
        &parked.pool,
        &parked.config.broker.prefix,
        Some(&selection),
        0,
        10_000,
    )
    .await?;
    let copies: Vec<serde_json::Value> = rows
        .iter()
        .filter(|r| r.entry.id == id)
        .map(|r| {
            json!({
                "entry": r,
                "message_id": r.message_id,
                "headers": r.headers,
                "body": String::from_utf8_lossy(&r.body),
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

async fn replay(
    parked: &Parked<'_>,
    select: &Select,
    dry_run: bool,
    json: bool,
) -> Result<ExitStatus, ParkedError> {
    let config = parked.config;
    let router = Router::new(
        config.names(),
        config
            .tier_file()
            .map_err(|e| ParkedError::Broker(unavailable(e.into())))?
            .tiers,
        crate::amqp::endpoint(&config.broker)
            .map_err(|e| ParkedError::Broker(unavailable(e.into())))?
            .confirm_timeout,
    );
    let conn = parked
        .archive(true)
        .await?
        .expect("a required archive connects or fails");
    let replayed = crate::parked::replay(
        &conn,
        &parked.pool,
        &router,
        &config.broker.prefix,
        &select.selection(),
        dry_run,
        config.broker.confirm_timeout,
    )
    .await;
    crate::amqp::broker::close_quietly(&conn, "lapse parked done").await;
    let replayed = replayed?;
    let status = report(select, replayed.items, json)?;
    match replayed.stalled {
        Some(why) => {
            eprintln!(
                "error: stopped: {why}; what was not confirmed stays parked (the rest is \
                 done); replay again once the broker accepts publishes"
            );
            Ok(ExitStatus::Failed)
        }
        None => Ok(status),
    }
}

async fn purge(
    parked: &Parked<'_>,
    select: &Select,
    yes: bool,
    json: bool,
) -> Result<ExitStatus, ParkedError> {
    if !yes && !std::io::stdin().is_terminal() {
        eprintln!(
            "error: refusing to purge without confirmation: stdin is not a terminal; \
             pass --yes to purge the selected messages"
        );
        return Ok(ExitStatus::Usage);
    }
    if let Some(conn) = parked.archive(false).await? {
        crate::amqp::broker::close_quietly(&conn, "lapse parked done").await;
    }
    if yes {
        let items = crate::parked::purge(
            &parked.pool,
            &parked.config.broker.prefix,
            &select.selection(),
            false,
        )
        .await?;
        return report(select, items, json);
    }
    // Show what would go, ask, then purge exactly those rows (not what arrived since).
    let chosen = crate::parked::purge(
        &parked.pool,
        &parked.config.broker.prefix,
        &select.selection(),
        true,
    )
    .await?;
    if chosen.is_empty() {
        println!("nothing to purge");
        return Ok(if select.ids.is_empty() {
            ExitStatus::Ok
        } else {
            ExitStatus::Failed
        });
    }
    print!(
        "{}",
        table(chosen.iter().map(|i| (&i.row, None)), chosen.len())
    );
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
    let exact = Selection {
        ids: chosen.iter().map(|i| i.row.entry.id.clone()).collect(),
        ..Default::default()
    };
    let seqs: BTreeSet<i64> = chosen.iter().map(|i| i.row.seq).collect();
    let items =
        crate::parked::purge_rows(&parked.pool, &parked.config.broker.prefix, &exact, &seqs)
            .await?;
    report(select, items, json)
}

/// Prints what a replay or purge did; exit 1 when one failed or an ID was not found.
fn report(select: &Select, items: Vec<Item>, json: bool) -> Result<ExitStatus, ParkedError> {
    let not_found = select.not_found(&items);
    let failed = items
        .iter()
        .any(|i| matches!(i.outcome, Outcome::Failed { .. }));
    if json {
        print_json(&json!({ "messages": items, "not_found": not_found }))
            .map_err(|e| ParkedError::Broker(unavailable(e)))?;
    } else {
        print!(
            "{}",
            table(
                items.iter().map(|i| (&i.row, Some(&i.outcome))),
                items.len()
            )
        );
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

fn unavailable(e: anyhow::Error) -> crate::amqp::broker::BrokerError {
    crate::amqp::broker::BrokerError::Unavailable {
        reason: e.to_string(),
    }
}

//! `lapse order create | pay | extend | show` and `lapse migrate`.

use std::time::Duration;

use clap::Subcommand;

use super::{ExitStatus, print_json};
use crate::config::Config;
use crate::db;
use crate::orders::{self, Deadline, Line, OrderId, PayOutcome};

#[derive(Debug, Subcommand)]
pub enum OrderCommand {
    /// Create UNPAID orders with a payment deadline; prints their ids.
    Create {
        /// Time until the deadline, by the database clock (e.g. 30m, 2s500ms); at most
        /// orders.deadline_horizon (exit 2 otherwise).
        #[arg(long, value_parser = humantime::parse_duration)]
        expires_in: Duration,
        /// An order line SKU:QTY (repeatable). A new SKU starts with orders.initial_stock.
        #[arg(long = "line")]
        lines: Vec<Line>,
        /// How many identical orders to create.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        count: u32,
        #[arg(long)]
        json: bool,
    },
    /// Pay an order (refused after its deadline; recorded as a late payment after a close).
    Pay { id: i64 },
    /// Move an UNPAID order's deadline later, before it passes (exit 1 when refused,
    /// 2 when the new deadline is invalid, e.g. beyond orders.deadline_horizon).
    Extend {
        id: i64,
        #[arg(long, value_parser = humantime::parse_duration)]
        by: Duration,
    },
    /// Show an order: state, deadline and version, times, lines, ledger and timeline.
    Show {
        id: i64,
        #[arg(long)]
        json: bool,
    },
}

/// Orders created per transaction by `create --count`.
const CREATE_CHUNK: u32 = 500;

pub async fn run(config: &Config, command: OrderCommand) -> anyhow::Result<ExitStatus> {
    let pool = db::pool(&config.database, 1)?;
    let mut client = pool.get().await?;
    match command {
        OrderCommand::Create {
            expires_in,
            lines,
            count,
            json,
        } => {
            let skus: Vec<String> = lines.iter().map(|l| l.sku.clone()).collect();
            orders::ensure_stock(&**client, &skus, config.orders.initial_stock).await?;
            let mut ids = Vec::with_capacity(count as usize);
            let progress = progress_bar(u64::from(count));
            while (ids.len() as u32) < count {
                let chunk = CREATE_CHUNK.min(count - ids.len() as u32);
                let tx = client.transaction().await?;
                for _ in 0..chunk {
                    match orders::create(&*tx, Deadline::In(expires_in), &lines).await {
                        Ok(id) => ids.push(id),
                        Err(e @ db::DbError::Refused(_)) => {
                            eprintln!("{e}; no order of this transaction was created");
                            return Ok(ExitStatus::Failed);
                        }
                        Err(db::DbError::InvalidDeadline(e)) => {
                            eprintln!("--expires-in: {e}; no order was created");
                            return Ok(ExitStatus::Usage);
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                tx.commit().await?;
                progress.inc(u64::from(chunk));
            }
            progress.finish_and_clear();
            if json {
                print_json(&ids)?;
            } else {
                for id in ids {
                    println!("{id}");
                }
            }
            Ok(ExitStatus::Ok)
        }
        OrderCommand::Pay { id } => {
            let outcome = orders::pay(&**client, OrderId(id)).await?;
            let (status, text) = match outcome {
                PayOutcome::Paid => (ExitStatus::Ok, "paid"),
                PayOutcome::AlreadyPaid => (ExitStatus::Ok, "already paid"),
                PayOutcome::Expired => (
                    ExitStatus::Failed,
                    "refused: the payment deadline has passed",
                ),
                PayOutcome::Late => (
                    ExitStatus::Failed,
                    "refused: the order is closed; recorded as a late payment to refund",
                ),
                PayOutcome::NotFound => (ExitStatus::Failed, "refused: no such order"),
            };
            println!("order {id}: {text}");
            Ok(status)
        }
        OrderCommand::Extend { id, by } => {
            match orders::extend_by(&**client, OrderId(id), by).await {
                Ok(Some(version)) => {
                    println!(
                        "order {id}: deadline extended by {}, now version {version}",
                        humantime::format_duration(by)
                    );
                    Ok(ExitStatus::Ok)
                }
                Ok(None) => {
                    println!(
                        "order {id}: refused: not found, not UNPAID, or the deadline has passed"
                    );
                    Ok(ExitStatus::Failed)
                }
                Err(db::DbError::Refused(e)) => {
                    println!("order {id}: refused: {e}");
                    Ok(ExitStatus::Failed)
                }
                Err(db::DbError::InvalidDeadline(e)) => {
                    eprintln!("--by: {e}; the deadline was not changed");
                    Ok(ExitStatus::Usage)
                }
                Err(e) => Err(e.into()),
            }
        }
        OrderCommand::Show { id, json } => match orders::show(&**client, OrderId(id)).await {
            Err(e @ db::DbError::Unreadable(_)) => {
                eprintln!("error: {e}");
                Ok(ExitStatus::Failed)
            }
            Err(e) => Err(e.into()),
            Ok(None) => {
                eprintln!("no such order: {id}");
                Ok(ExitStatus::Failed)
            }
            Ok(Some(view)) if json => {
                print_json(&view)?;
                Ok(ExitStatus::Ok)
            }
            Ok(Some(view)) => {
                print_order(&view);
                Ok(ExitStatus::Ok)
            }
        },
    }
}

fn progress_bar(len: u64) -> indicatif::ProgressBar {
    if len < 2 * u64::from(CREATE_CHUNK) {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "creating orders {bar:40} {pos}/{len} {per_sec} eta {eta}",
        )
        .expect("valid template"),
    );
    bar
}

fn print_order(v: &orders::OrderView) {
    println!("order {}  {}", v.id, v.status);
    println!("  created    {}", v.created_at);
    println!(
        "  expire_at  {}  (deadline version {})",
        v.expire_at, v.deadline_version
    );
    if let Some(t) = v.paid_at {
        println!("  paid_at    {t}");
    }
    if let Some(t) = v.closed_at {
        let late = (t - v.expire_at).num_microseconds().unwrap_or(0) as f64 / 1000.0;
        println!(
            "  closed_at  {t}  ({late:.3} ms after the deadline, by {})",
            v.close_reason.as_deref().unwrap_or("?")
        );
    }
    if v.late_payments > 0 {
        println!("  late payments to refund: {}", v.late_payments);
    }
    for l in &v.lines {
        println!("  line       {} x {}", l.sku, l.qty);
    }
    for e in &v.ledger {
        println!(
            "  ledger     {} {} x {} at {}",
            e["kind"], e["sku"], e["qty"], e["at"]
        );
    }
    println!("  timeline");
    for e in &v.timeline {
        let mut detail = e.clone();
        let at = detail["at"].take();
        let event = detail["event"].take();
        if let Some(map) = detail.as_object_mut() {
            map.remove("at");
            map.remove("event");
        }
        println!(
            "    {}  {:<24} {}",
            at.as_str().unwrap_or(""),
            event.as_str().unwrap_or(""),
            detail
        );
    }
}

pub async fn migrate(config: &Config) -> anyhow::Result<ExitStatus> {
    let applied =
        db::migrate_with_settings(&config.database.url, &db::Settings::from_config(config)).await?;
    println!("{applied} migration(s) applied; the schema is up to date");
    Ok(ExitStatus::Ok)
}

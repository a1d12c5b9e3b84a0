//! `lapse order create | pay | extend | show`.

use std::time::Duration;

use clap::Subcommand;

use super::{ExitStatus, help, print_json};
use crate::config::Config;
use crate::db;
use crate::orders::{self, Deadline, Line, OrderId, PayOutcome};

#[derive(Debug, Subcommand)]
pub enum OrderCommand {
    /// Create UNPAID orders with a payment deadline; prints their ids.
    #[command(after_help = help::after(
        &[
            "lapse order create --expires-in 30m --line apple:2 --line pear:1",
            "lapse order create --expires-in 2s500ms --line apple:1 --count 1000 --json",
        ],
        &[
            help::OK,
            (1, "refused by the database (e.g. insufficient stock); no order was created"),
            (2, "bad arguments or configuration, or a deadline the database refuses \
                 (beyond orders.deadline_horizon); no order was created"),
            help::UNREACHABLE,
        ],
    ))]
    Create {
        /// Time until the deadline, by the database clock (e.g. 30m, 2s500ms); at most
        /// orders.deadline_horizon (exit 2 otherwise).
        #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
        expires_in: Duration,
        /// An order line SKU:QTY (repeatable). A new SKU starts with orders.initial_stock.
        #[arg(long = "line", value_name = "SKU:QTY")]
        lines: Vec<Line>,
        /// How many identical orders to create.
        #[arg(
            long,
            value_name = "N",
            default_value_t = 1,
            value_parser = clap::value_parser!(u32).range(1..)
        )]
        count: u32,
        /// Print the ids as a JSON array on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Pay an order (refused after its deadline; recorded as a late payment after a close).
    #[command(after_help = help::after(
        &["lapse order pay 42", "lapse order pay 42 --json"],
        &[
            (0, "paid, or already paid"),
            (1, "refused: the deadline has passed, the order is closed, or no such order"),
            help::USAGE_DB,
            help::UNREACHABLE,
        ],
    ))]
    Pay {
        /// The order's id (as printed by `lapse order create`).
        #[arg(value_name = "ID")]
        id: i64,
        /// Print {"id", "outcome", "message"} as JSON on stdout; outcome is PAID,
        /// ALREADY_PAID, EXPIRED, LATE or NOT_FOUND.
        #[arg(long)]
        json: bool,
    },
    /// Move an UNPAID order's deadline later, before it passes (exit 1 when refused,
    /// 2 when the new deadline is invalid, e.g. beyond orders.deadline_horizon).
    #[command(after_help = help::after(
        &["lapse order extend 42 --by 15m", "lapse order extend 42 --by 1h --json"],
        &[
            (0, "the deadline was moved"),
            (1, "refused: not found, not UNPAID, or the deadline has passed"),
            (2, "bad arguments or configuration, or a new deadline the database refuses \
                 (beyond orders.deadline_horizon)"),
            help::UNREACHABLE,
        ],
    ))]
    Extend {
        /// The order's id.
        #[arg(value_name = "ID")]
        id: i64,
        /// How much later the deadline becomes (e.g. 15m, 1h30m).
        #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
        by: Duration,
        /// Print {"id", "extended", "deadline_version" | "refused"} as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Show an order: state, deadline and version, times, lines, ledger and timeline.
    #[command(after_help = help::after(
        &["lapse order show 42", "lapse order show 42 --json | jq .timeline"],
        &[
            help::OK,
            (1, "no such order, or its stored values cannot be read"),
            help::USAGE_DB,
            help::UNREACHABLE,
        ],
    ))]
    Show {
        /// The order's id.
        #[arg(value_name = "ID")]
        id: i64,
        /// Print the order as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
}

/// Orders created per transaction by `create --count`.
const CREATE_CHUNK: u32 = 500;

pub async fn run(config: &Config, shard: u16, command: OrderCommand) -> anyhow::Result<ExitStatus> {
    let shards = config.database.shard_list();
    let Some(chosen) = shards.iter().find(|s| s.index == shard) else {
        eprintln!(
            "--shard {shard}: no such order database ({} configured, so --shard takes 0 to {})",
            shards.len(),
            shards.len() - 1
        );
        return Ok(ExitStatus::Usage);
    };
    let pool = db::pool(&config.database.for_shard(chosen), 1)?;
    match command {
        OrderCommand::Create {
            expires_in,
            lines,
            count,
            json,
        } => create(config, &pool, expires_in, &lines, count, json).await,
        OrderCommand::Pay { id, json } => pay(&pool, id, json).await,
        OrderCommand::Extend { id, by, json } => extend(&pool, id, by, json).await,
        OrderCommand::Show { id, json } => show(&pool, id, json).await,
    }
}

/// `order create`: `count` orders in transactions of [`CREATE_CHUNK`].
async fn create(
    config: &Config,
    pool: &db::Pool,
    expires_in: Duration,
    lines: &[Line],
    count: u32,
    json: bool,
) -> anyhow::Result<ExitStatus> {
    let skus: Vec<String> = lines.iter().map(|l| l.sku.clone()).collect();
    let mut client = pool.get().await?;
    let tx = db::begin(&mut client, pool.limits()).await?;
    orders::ensure_stock(&tx, &skus, config.orders.initial_stock).await?;
    tx.commit().await?;
    let mut ids = Vec::with_capacity(count as usize);
    let progress = progress_bar(u64::from(count));
    while (ids.len() as u32) < count {
        let chunk = CREATE_CHUNK.min(count - ids.len() as u32);
        let tx = db::begin(&mut client, pool.limits()).await?;
        for _ in 0..chunk {
            match orders::create(&tx, Deadline::In(expires_in), lines).await {
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

/// Pay, extend and show run in a transaction of their own: under the pool's limits,
/// committed before anything is printed.
async fn pay(pool: &db::Pool, id: i64, json: bool) -> anyhow::Result<ExitStatus> {
    let mut client = pool.get().await?;
    let tx = db::begin(&mut client, pool.limits()).await?;
    let outcome = orders::pay(&tx, OrderId(id)).await?;
    tx.commit().await?;
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
    if json {
        print_json(&serde_json::json!({ "id": id, "outcome": outcome, "message": text }))?;
    } else {
        println!("order {id}: {text}");
    }
    Ok(status)
}

async fn extend(pool: &db::Pool, id: i64, by: Duration, json: bool) -> anyhow::Result<ExitStatus> {
    let refused = |reason: String| -> anyhow::Result<ExitStatus> {
        if json {
            print_json(&serde_json::json!({ "id": id, "extended": false, "refused": reason }))?;
        } else {
            println!("order {id}: refused: {reason}");
        }
        Ok(ExitStatus::Failed)
    };
    let mut client = pool.get().await?;
    let tx = db::begin(&mut client, pool.limits()).await?;
    let extended = orders::extend_by(&tx, OrderId(id), by).await;
    if extended.is_ok() {
        tx.commit().await?;
    }
    match extended {
        Ok(Some(version)) => {
            if json {
                print_json(&serde_json::json!({
                    "id": id,
                    "extended": true,
                    "by": humantime::format_duration(by).to_string(),
                    "deadline_version": version,
                }))?;
            } else {
                println!(
                    "order {id}: deadline extended by {}, now version {version}",
                    humantime::format_duration(by)
                );
            }
            Ok(ExitStatus::Ok)
        }
        Ok(None) => refused("not found, not UNPAID, or the deadline has passed".to_string()),
        Err(db::DbError::Refused(e)) => refused(e),
        Err(db::DbError::InvalidDeadline(e)) => {
            eprintln!("--by: {e}; the deadline was not changed");
            Ok(ExitStatus::Usage)
        }
        Err(e) => Err(e.into()),
    }
}

async fn show(pool: &db::Pool, id: i64, json: bool) -> anyhow::Result<ExitStatus> {
    let mut client = pool.get().await?;
    let tx = db::begin(&mut client, pool.limits()).await?;
    let shown = orders::show(&tx, OrderId(id)).await;
    drop(tx);
    match shown {
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

//! `lapse demo` as a library: in its own corner of the local services (a unique broker
//! prefix and a fresh database, see [`sandbox`]) it provisions like a deployment,
//! runs the consumer, relay, releaser and sweeper in-process (the [`Service`] that
//! `lapse worker` runs), plays a realistic mix of orders against them
//! ([`workload`]), shows progress ([`progress`]), waits until every order is paid or
//! closed and its stock released, then reads the verdict from the database
//! ([`report`]) and draws it ([`picture`]). Everything it created is removed at the
//! end — also after an error or Ctrl-C — unless it is asked to keep it.

pub mod picture;
pub mod progress;
pub mod report;
pub mod sandbox;
pub mod workload;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::db::Pool;
use chrono::{DateTime, Utc};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::db;
use crate::observe::stats::Stats;
use crate::orders;
use crate::runtime::health::Health;
use crate::runtime::supervisor::Stop;
use crate::service::{Service, Stopped};
use progress::{Display, Progress};
use report::{Lateness, Report};
use sandbox::Sandbox;
use workload::Counters;

/// What the demo runs.
#[derive(Clone, Debug)]
pub struct Options {
    pub orders: u32,
    /// Orders are created and fall due within this time.
    pub duration: Duration,
    /// Leave the queues, exchanges and database in place.
    pub keep: bool,
    /// Where the picture goes.
    pub svg: PathBuf,
    pub display: Display,
    /// Seed of the workload's random choices.
    pub seed: u64,
}

/// The run was stopped by SIGINT or SIGTERM (after cleaning up).
#[derive(Debug, thiserror::Error)]
#[error("interrupted; the demo stopped")]
pub struct Interrupted;

/// Runs the demo; the report's `problems` are empty when every promise held.
pub async fn run(
    config: &Config,
    options: Options,
    token: CancellationToken,
) -> anyhow::Result<Report> {
    let sandbox = Sandbox::new(config)?;
    picture::check_writable(&options.svg)?;
    tracing::info!(prefix = %sandbox.prefix, database = %sandbox.database, "demo starting");
    let outcome = run_in(&sandbox, &options, &token).await;
    let cleanup = if options.keep {
        Vec::new()
    } else {
        sandbox.remove().await
    };
    let mut report = match outcome {
        Ok(report) => report,
        Err(e) => {
            for problem in cleanup {
                eprintln!("error: could not clean up {problem}");
            }
            return Err(e);
        }
    };
    report.problems.extend(
        cleanup
            .into_iter()
            .map(|p| format!("could not clean up {p}")),
    );
    report.judge();
    Ok(report)
}

async fn run_in(
    sandbox: &Sandbox,
    o: &Options,
    token: &CancellationToken,
) -> anyhow::Result<Report> {
    sandbox.provision().await?;
    if token.is_cancelled() {
        return Err(Interrupted.into());
    }
    let config = &sandbox.config;
    let pool = db::app_pool(&config.database, config.database.pool_size.max(4))?;
    let (stock_start, start) = prepare(&pool, o.orders).await?;
    let tiers = config.tier_file()?.tiers;
    let plan = workload::plan(o.orders, o.duration, &tiers, o.seed);
    let last = workload::last_deadline(&plan);
    let counters = Arc::new(Counters::default());

    let service_token = token.child_token();
    let (health, service, service_done) = start_service(config, service_token.clone()).await?;
    let progress_token = CancellationToken::new();
    let progress = Progress {
        orders: u64::from(o.orders),
        pool: pool.clone(),
        endpoint: crate::amqp::endpoint(&config.broker)?,
        names: config.names(),
        tiers: tiers.clone(),
        counters: counters.clone(),
    };
    let progress = tokio::spawn(progress.run(o.display, progress_token.clone()));

    // Orders arrive at a running worker, as in production.
    ready(&health, token).await;
    let began = Instant::now();
    let played = workload::run(plan, pool.clone(), counters.clone(), token.clone()).await;
    let limit = began + last + settle_limit(config);
    let settled = match &played {
        Ok(()) => settle(&pool, &stock_start, limit, token, &service_done).await,
        Err(_) => Ok(()),
    };
    progress_token.cancel();
    let _ = progress.await;
    service_token.cancel();
    let stopped = service.await?;
    if token.is_cancelled() {
        return Err(Interrupted.into());
    }
    played?;
    settled?;

    let mut report = assemble(sandbox, o, &pool, &stock_start, start, &counters).await?;
    if let Stop::Fatal { component, reason } = stopped.stop {
        report
            .problems
            .push(format!("{component} failed: {reason}"));
    }
    Ok(report)
}

/// Starts the components in-process, as `lapse worker` does. Returns their health,
/// the task that waits for them to stop, and a token cancelled once they have.
async fn start_service(
    config: &Config,
    token: CancellationToken,
) -> anyhow::Result<(Health, JoinHandle<Stopped>, CancellationToken)> {
    let service = Service::start(config, Stats::default(), token).await?;
    let health = service.health();
    let service_done = CancellationToken::new();
    let done = service_done.clone();
    let service = tokio::spawn(async move {
        let stopped = service.wait().await;
        done.cancel();
        stopped
    });
    Ok((health, service, service_done))
}

/// Waits (at most 30 s) until the components that hold broker connections are up.
async fn ready(health: &Health, token: &CancellationToken) {
    let limit = Instant::now() + Duration::from_secs(30);
    while Instant::now() < limit && !token.is_cancelled() {
        let snapshot = health.snapshot();
        let up = |name: &str| snapshot.get(name).is_some_and(|s| s.up);
        if ["consumer", "relay", "releaser"].into_iter().all(up) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Stock for every order the demo may create, and the database's clock at the start.
async fn prepare(
    pool: &Pool,
    orders_planned: u32,
) -> anyhow::Result<(Vec<report::StockRow>, DateTime<Utc>)> {
    let client = pool.get().await?;
    let skus: Vec<String> = workload::SKUS.iter().map(|s| s.to_string()).collect();
    let units = i64::from(orders_planned) * i64::from(workload::MAX_QTY);
    orders::ensure_stock(&**client, &skus, units).await?;
    let stock = report::stock(&**client).await?;
    let start: DateTime<Utc> = client.query_typed_one("SELECT now()", &[]).await?.get(0);
    Ok((stock, start))
}

/// How long after the last deadline the demo waits for the last close and release:
/// long enough for the sweeper and the release repair to act if a message were lost.
fn settle_limit(config: &Config) -> Duration {
    config.sweeper.interval
        + config.sweeper.grace
        + config.sweeper.release_grace
        + Duration::from_secs(30)
}

/// Waits until no order is UNPAID and stock reservations are back where they
/// started, or until `limit` (what is left then shows in the report).
async fn settle(
    pool: &Pool,
    stock_start: &[report::StockRow],
    limit: Instant,
    token: &CancellationToken,
    service_done: &CancellationToken,
) -> anyhow::Result<()> {
    let reserved_start: i64 = stock_start.iter().map(|s| s.reserved).sum();
    loop {
        {
            let client = pool.get().await?;
            let (open, reserved) = report::unsettled(&**client).await?;
            if open == 0 && reserved == reserved_start {
                return Ok(());
            }
        }
        if Instant::now() >= limit || service_done.is_cancelled() {
            return Ok(());
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(200)) => {}
            () = token.cancelled() => return Ok(()),
        }
    }
}

async fn assemble(
    sandbox: &Sandbox,
    o: &Options,
    pool: &Pool,
    stock_start: &[report::StockRow],
    start: DateTime<Utc>,
    counters: &Counters,
) -> anyhow::Result<Report> {
    let client = pool.get().await?;
    let (p, closes) = report::gather(&**client, start).await?;
    let stock_end = report::stock(&**client).await?;
    let paid_units = report::paid_units(&**client).await?;
    let mut report = Report {
        orders: u64::from(o.orders),
        duration_s: o.duration.as_secs_f64(),
        prefix: sandbox.prefix.clone(),
        database: sandbox.database.clone(),
        closed: p.closed,
        closed_by_timeout: p.closed_by_timeout,
        closed_by_sweeper: p.closed_by_sweeper,
        paid: p.paid,
        open: p.open,
        extended: p.extended,
        late_payments_refused: p.late_payments_refused,
        late_payments_accepted: counters.late_accepted.load(Ordering::Relaxed),
        early: p.early,
        stock_consistent: report::stock_consistent(stock_start, &stock_end, &paid_units),
        stock_start: stock_start.to_vec(),
        stock_end,
        lateness_ms: Lateness::of(&closes.lateness_ms),
        hops: p.hops,
        actions_too_late: counters.too_slow.load(Ordering::Relaxed),
        action_errors: counters.errors.load(Ordering::Relaxed),
        svg: None,
        kept: o.keep,
        problems: Vec::new(),
    };
    if p.total != i64::from(o.orders) {
        report.problems.push(format!(
            "{} order(s) in the database, {} planned",
            p.total, o.orders
        ));
    }
    draw_picture(&mut report, &o.svg, &closes);
    Ok(report)
}

/// Draws the closes to `svg`, titled with the report's figures; records where the
/// picture went, or why it could not be written.
fn draw_picture(report: &mut Report, svg: &Path, closes: &report::Closes) {
    let svg = std::path::absolute(svg).unwrap_or_else(|_| svg.to_path_buf());
    let title = match &report.lateness_ms {
        Some(l) => format!(
            "lapse demo: {} orders, {} closed ({} early), lateness p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            report.orders, report.closed, report.early, l.p50, l.p99, l.max
        ),
        None => format!("lapse demo: {} orders, none closed", report.orders),
    };
    match picture::draw(&svg, closes, &title) {
        Ok(()) => report.svg = Some(svg.display().to_string()),
        Err(e) => report.problems.push(format!(
            "could not write the picture {}: {e:#}",
            svg.display()
        )),
    }
}

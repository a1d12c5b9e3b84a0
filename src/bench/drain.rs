//! `burst` (N orders sharing one deadline) and `backlog` (N orders already overdue
//! when K workers start): how fast closes drain, releases included.

use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};

use super::Meter;
use super::env::BenchEnv;
use super::load;
use super::measure;
use super::progress::Progress;
use super::report::ScenarioReport;

/// Settings that let one worker drain as fast as it can.
fn unthrottled() -> Vec<(&'static str, String)> {
    vec![
        ("LAPSE_WORKER__PREFETCH", "1000".into()),
        ("LAPSE_WORKER__BATCH_SIZE", "500".into()),
        ("LAPSE_SWEEPER__GRACE", "10m".into()),
    ]
}

pub async fn burst(env: &mut BenchEnv, orders: u64) -> anyhow::Result<ScenarioReport> {
    let mut report = ScenarioReport::new("burst");
    report.param("orders", orders);
    env.reset().await?;
    let db = env.client().await?;
    let after = measure::last_id(&db).await?;
    env.start_ready(&unthrottled(), 1).await?;
    let meter = Meter::start(env);
    // Far enough ahead that creating them all ends before the deadline: room for 1,500
    // orders/s (2 cores made about 3,000/s while the worker relayed their intents; at
    // the 4,000/s once assumed here, 100,000 orders were still being created 4-7 s after
    // their deadline, so closes competed with creation, and a slower run had its last
    // statements refused as more than 5 s in the past).
    let now: DateTime<Utc> = db.query_one("SELECT now()", &[]).await?.get(0);
    let ahead = Duration::from_millis(3_000u64.saturating_add(orders.saturating_mul(2) / 3));
    let at = now + chrono::Duration::from_std(ahead)?;
    let progress = Progress::new("burst: created", orders);
    load::create_at(&db, orders, Some(at), &progress)
        .await
        .with_context(|| {
            format!(
                "creating {orders} orders before their shared deadline, {} s ahead (room for \
                 1,500 orders/s): on a slower machine use a smaller --orders",
                ahead.as_secs()
            )
        })?;
    progress.finish();
    let done: DateTime<Utc> = db.query_one("SELECT clock_timestamp()", &[]).await?.get(0);
    report.figure("created_before_deadline_s", (at - done).as_seconds_f64());
    report.orders = orders;
    let progress = Progress::new("burst: closed", orders);
    let limit = ahead + Duration::from_secs(60 + orders / 500);
    report.lost = measure::wait_settled(&db, orders, limit, &progress).await?;
    meter.stop(env, &mut report, orders);
    measure::closes(&db, &mut report, after).await?;
    let last: Option<DateTime<Utc>> = db
        .query_one("SELECT max(closed_at) FROM orders WHERE id > $1", &[&after])
        .await?
        .get(0);
    if let Some(last) = last {
        report.figure("deadline_to_last_close_s", (last - at).as_seconds_f64());
    }
    env.stop_workers().await;
    env.forget_stopped();
    Ok(report)
}

pub async fn backlog(
    env: &mut BenchEnv,
    orders: u64,
    workers: u32,
) -> anyhow::Result<ScenarioReport> {
    let mut report = ScenarioReport::new("backlog");
    report.param("orders", orders);
    report.param("workers", workers);
    env.reset().await?;
    let db = env.client().await?;
    let after = measure::last_id(&db).await?;
    let progress = Progress::new("backlog: created", orders);
    load::create_at(&db, orders, None, &progress).await?;
    progress.finish();
    report.orders = orders;
    let meter = Meter::start(env);
    let started = Instant::now();
    for _ in 0..workers {
        env.start_worker(&unthrottled())?;
    }
    let progress = Progress::new("backlog: closed", orders);
    let limit = Duration::from_secs(120 + orders / 500);
    report.lost = measure::wait_settled(&db, orders, limit, &progress).await?;
    let drained = started.elapsed().as_secs_f64();
    if let Some((_, peak)) = env.worker_rss() {
        report.figure("worker_peak_rss_mib", peak);
    }
    meter.stop(env, &mut report, orders);
    measure::closes(&db, &mut report, after).await?;
    report.figure("drain_s", drained);
    report.figure("drained_per_s", orders as f64 / drained);
    env.stop_workers().await;
    env.forget_stopped();
    Ok(report)
}

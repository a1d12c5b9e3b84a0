//! `pending` (N orders scheduled hours ahead: what waiting costs in memory and disk)
//! and `schedule` (what `lapse_create_order` adds to the application's transaction).

use std::time::{Duration, Instant};

use super::Meter;
use super::env::BenchEnv;
use super::load::LINES;
use super::progress::Progress;
use super::report::{Lateness, ScenarioReport};
use crate::amqp::management::Management;

/// Bytes the wait queues under the benchmark's prefix use, from the management API
/// (`None` without `broker.management_url`). Its statistics are sampled every few
/// seconds, so this waits for a fresh sample first.
async fn wait_queue_bytes(env: &BenchEnv) -> anyhow::Result<Option<u64>> {
    let Some(url) = &env.config.broker.management_url else {
        return Ok(None);
    };
    tokio::time::sleep(Duration::from_secs(6)).await;
    let prefix = env.names.wait_queue_prefix();
    let queues = Management::new(url)?.queues("/").await?;
    Ok(Some(
        queues
            .iter()
            .filter(|q| q.name.starts_with(&prefix))
            .filter_map(|q| q.memory)
            .sum(),
    ))
}

pub async fn pending(env: &mut BenchEnv, orders: u64) -> anyhow::Result<ScenarioReport> {
    let mut report = ScenarioReport::new("pending");
    report.param("orders", orders);
    env.reset().await?;
    let db = env.client().await?;
    env.start_ready(&[], 1).await?;
    let bytes_before = database_size(&db).await?;
    let broker_before = wait_queue_bytes(env).await?;
    let meter = Meter::start(env);
    let started = Instant::now();
    let progress = Progress::new("pending: created", orders);
    create_ahead(&db, orders, &progress).await?;
    let created = started.elapsed();
    report.lost = outbox_left(&db, orders).await?;
    progress.finish();
    report.orders = orders;
    report.figure("create_s", created.as_secs_f64());
    report.figure("scheduled_s", started.elapsed().as_secs_f64());
    report.figure(
        "scheduled_per_s",
        orders as f64 / started.elapsed().as_secs_f64(),
    );
    db.batch_execute("CHECKPOINT").await.ok();
    let bytes = database_size(&db).await? - bytes_before;
    report.figure("db_bytes_per_order", bytes as f64 / orders as f64);
    if let (Some(before), Some(after)) = (broker_before, wait_queue_bytes(env).await?) {
        report.figure(
            "broker_bytes_per_message",
            after.saturating_sub(before) as f64 / orders as f64,
        );
    }
    if let Some((rss, peak)) = env.worker_rss() {
        report.figure("worker_rss_mib", rss);
        report.figure("worker_peak_rss_mib", peak);
    }
    meter.stop(env, &mut report, orders);
    env.stop_workers().await;
    env.forget_stopped();
    Ok(report)
}

/// Creates `orders` orders in chunks of 5,000, spread over an hour six hours ahead:
/// every order waits in a long tier.
async fn create_ahead(
    db: &tokio_postgres::Client,
    orders: u64,
    progress: &Progress,
) -> anyhow::Result<()> {
    let lines = serde_json::from_str::<serde_json::Value>(LINES)?;
    let mut left = orders;
    while left > 0 {
        let chunk = left.min(5_000) as i64;
        db.execute(
            "SELECT count(lapse_create_order(now() + interval '6 hours' + i * interval '3.6 ms', $1::jsonb))
               FROM generate_series(1, $2::bigint) i",
            &[&lines, &chunk],
        )
        .await?;
        left -= chunk as u64;
        progress.inc(chunk as u64);
    }
    Ok(())
}

/// Waits until the relay has published every outbox row, or for a limit that grows
/// with `orders`. Returns the rows still there.
async fn outbox_left(db: &tokio_postgres::Client, orders: u64) -> anyhow::Result<u64> {
    let until = Instant::now() + Duration::from_secs(120 + orders / 500);
    loop {
        let n: i64 = db
            .query_one("SELECT count(*) FROM outbox", &[])
            .await?
            .get(0);
        if n == 0 || Instant::now() >= until {
            return Ok(n as u64);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub async fn schedule(env: &mut BenchEnv, orders: u64) -> anyhow::Result<ScenarioReport> {
    let mut report = ScenarioReport::new("schedule");
    report.param("orders", orders);
    env.reset().await?;
    let mut db = env.client().await?;
    db.batch_execute(
        "CREATE TABLE IF NOT EXISTS bench_plain_orders (
             id bigserial PRIMARY KEY, status text NOT NULL DEFAULT 'UNPAID',
             created_at timestamptz NOT NULL DEFAULT now(), expire_at timestamptz NOT NULL);
         CREATE TABLE IF NOT EXISTS bench_plain_lines (
             order_id bigint NOT NULL REFERENCES bench_plain_orders (id), sku text NOT NULL,
             qty integer NOT NULL, PRIMARY KEY (order_id, sku));",
    )
    .await?;
    let lines = serde_json::from_str::<serde_json::Value>(LINES)?;
    let meter = Meter::start(env);
    let progress = Progress::new("schedule: orders", orders);
    let (mut with_lapse, mut plain) = (Vec::new(), Vec::new());
    // Alternating, so both see the same machine.
    for _ in 0..orders {
        let t = Instant::now();
        let tx = db.transaction().await?;
        tx.execute(
            "SELECT lapse_create_order(now() + interval '1 hour', $1::jsonb)",
            &[&lines],
        )
        .await?;
        tx.commit().await?;
        with_lapse.push(t.elapsed().as_secs_f64() * 1000.0);
        let t = Instant::now();
        let tx = db.transaction().await?;
        tx.execute(
            "WITH o AS (INSERT INTO bench_plain_orders (expire_at)
                        VALUES (now() + interval '1 hour') RETURNING id),
                  l AS (INSERT INTO bench_plain_lines (order_id, sku, qty)
                        SELECT o.id, l.sku, l.qty FROM o, jsonb_to_recordset($1::jsonb) AS l(sku text, qty integer))
             UPDATE stock SET available = available - 1, reserved = reserved + 1 WHERE sku = 'bench'",
            &[&lines],
        )
        .await?;
        tx.commit().await?;
        plain.push(t.elapsed().as_secs_f64() * 1000.0);
        progress.inc(1);
    }
    progress.finish();
    report.orders = orders;
    meter.stop(env, &mut report, orders);
    let l = Lateness::of(&mut with_lapse);
    let p = Lateness::of(&mut plain);
    report.figure("lapse_p50_ms", l.p50);
    report.figure("lapse_p99_ms", l.p99);
    report.figure("plain_p50_ms", p.p50);
    report.figure("plain_p99_ms", p.p99);
    report.figure("added_p50_ms", l.p50 - p.p50);
    report.figure("added_p99_ms", l.p99 - p.p99);
    Ok(report)
}

async fn database_size(db: &tokio_postgres::Client) -> anyhow::Result<i64> {
    Ok(db
        .query_one("SELECT pg_database_size(current_database())", &[])
        .await?
        .get(0))
}

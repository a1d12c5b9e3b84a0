//! `steady` and `crash`: orders created at a constant rate by several connections,
//! closed by one worker; `crash` SIGKILLs that worker a third of the way through and
//! starts a new one after a gap.

use std::time::{Duration, Instant};

use super::env::BenchEnv;
use super::load::Steady;
use super::measure;
use super::progress::Progress;
use super::report::ScenarioReport;
use super::traffic::Traffic;
use super::{Meter, settle_limit};

pub async fn steady(env: &mut BenchEnv, load: &Steady) -> anyhow::Result<ScenarioReport> {
    env.reset().await?;
    env.start_ready(&[], 1).await?;
    let report = step(env, load, "steady").await?;
    env.stop_workers().await;
    env.forget_stopped();
    Ok(report)
}

/// One steady load against the workers already running: creates the orders, waits
/// until they are closed and released, and reads lateness and CPU of this load alone
/// (`created_per_s` says whether the generator kept the rate).
pub async fn step(env: &BenchEnv, load: &Steady, name: &str) -> anyhow::Result<ScenarioReport> {
    let mut report = ScenarioReport::new(name);
    describe(&mut report, load);
    let db = env.client().await?;
    let after = measure::last_id(&db).await?;
    let clients = load.connect(env).await?;
    let traffic = Traffic::sample(env, &db, false).await;
    let meter = Meter::start(env);
    let progress = Progress::new(&format!("{name}: created"), load.total());
    let (orders, creating, generator_db) = load.run(clients, &progress).await?;
    report.orders = orders;
    if orders > 0 {
        // The application's own inserts, part of `postgres` in cpu_per_1000.
        report.figure(
            "generator_postgres_cpu_per_1000",
            generator_db * 1000.0 / orders as f64,
        );
    }
    progress.finish();
    if !creating.is_zero() {
        report.figure("created_per_s", orders as f64 / creating.as_secs_f64());
    }
    let progress = Progress::new(&format!("{name}: closed"), report.orders);
    report.lost = measure::wait_settled(&db, report.orders, settle_limit(load), &progress).await?;
    let orders = report.orders;
    meter.stop(env, &mut report, orders);
    traffic.record(Traffic::sample(env, &db, true).await, &mut report, orders);
    measure::closes(&db, &mut report, after).await?;
    Ok(report)
}

pub async fn crash(
    env: &mut BenchEnv,
    load: &Steady,
    gap: Duration,
) -> anyhow::Result<ScenarioReport> {
    let mut report = ScenarioReport::new("crash");
    describe(&mut report, load);
    report.param("gap", humantime::format_duration(gap));
    env.reset().await?;
    let db = env.client().await?;
    let after = measure::last_id(&db).await?;
    let first = env.start_ready(&[], 1).await?;
    let clients = load.connect(env).await?;
    let meter = Meter::start(env);
    let progress = Progress::new("crash: created", load.total());
    let generator = load.run(clients, &progress);
    let crash = async {
        tokio::time::sleep(load.duration / 3).await;
        let killed_at: chrono::DateTime<chrono::Utc> =
            db.query_one("SELECT clock_timestamp()", &[]).await?.get(0);
        env.kill_worker(first).await;
        tokio::time::sleep(gap).await;
        env.start_worker(&[])?;
        let restarted_at: chrono::DateTime<chrono::Utc> =
            db.query_one("SELECT clock_timestamp()", &[]).await?.get(0);
        anyhow::Ok((killed_at, restarted_at))
    };
    let started = Instant::now();
    let (created, times) = tokio::join!(generator, crash);
    report.orders = created?.0;
    let (killed_at, restarted_at) = times?;
    progress.finish();
    let progress = Progress::new("crash: closed", report.orders);
    let limit = settle_limit(load) + gap;
    report.lost = measure::wait_settled(&db, report.orders, limit, &progress).await?;
    let orders = report.orders;
    meter.stop(env, &mut report, orders);
    measure::closes(&db, &mut report, after).await?;
    let rows = db
        .query(
            "SELECT extract(epoch FROM closed_at - expire_at)::float8 * 1000 FROM orders
              WHERE id > $1 AND status = 'CLOSED' AND expire_at >= $2 AND expire_at < $3",
            &[&after, &killed_at, &restarted_at],
        )
        .await?;
    let mut gap_ms: Vec<f64> = rows.iter().map(|r| r.get(0)).collect();
    let g = super::report::Lateness::of(&mut gap_ms);
    report.figure("gap_s", (restarted_at - killed_at).as_seconds_f64());
    report.figure("gap_orders", g.count as f64);
    report.figure("gap_p99_ms", g.p99);
    report.figure("gap_max_ms", g.max);
    report.figure("gap_target_ms", gap.as_secs_f64() * 1000.0 + 250.0);
    report.figure("crash_run_s", started.elapsed().as_secs_f64());
    env.stop_workers().await;
    env.forget_stopped();
    Ok(report)
}

fn describe(report: &mut ScenarioReport, load: &Steady) {
    report.param("rate", load.rate);
    report.param("duration", humantime::format_duration(load.duration));
    report.param("connections", load.connections);
    let ds: Vec<String> = load
        .deadlines
        .iter()
        .map(|d| humantime::format_duration(*d).to_string())
        .collect();
    report.param("deadlines", ds.join(","));
}

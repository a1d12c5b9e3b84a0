//! Back-pressure: a large backlog of overdue orders drains completely, never faster
//! than the configured closes-per-second limit, with bounded memory. How close to the
//! limit it gets is a benchmark's question: a loaded machine only makes it slower.

use std::time::{Duration, Instant};

use lapse::orders;

use crate::helpers::{TestEnv, assert_never_early, count};

#[tokio::test]
async fn a_backlog_of_20k_overdue_orders_drains_no_faster_than_the_limit() {
    const ORDERS: i64 = 20_000;
    const RATE: f64 = 1_000.0;
    let env = TestEnv::with_database(&["1s", "5s"]).await;
    let db = env.db().await;
    orders::ensure_stock(&db, &["bulk".to_string()], 1_000_000)
        .await
        .unwrap();
    db.execute(
        "SELECT lapse_create_order(now() - interval '2 seconds', '[{\"sku\": \"bulk\", \"qty\": 1}]')
           FROM generate_series(1, $1::bigint)",
        &[&ORDERS],
    )
    .await
    .unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_lapse"))
        .args(["--config", env.config_path().to_str().unwrap(), "worker"])
        .env("LAPSE_WORKER__CLOSES_PER_SECOND", (RATE as u32).to_string())
        .env("LAPSE_WORKER__PREFETCH", "500")
        .env("LAPSE_WORKER__BATCH_SIZE", "250")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let mut samples: Vec<(Instant, i64)> = Vec::new();
    let started = Instant::now();
    let mut peak_rss_kb = 0;
    loop {
        let closed = count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
        samples.push((Instant::now(), closed));
        peak_rss_kb = peak_rss_kb.max(vm_hwm_kb(pid));
        if closed == ORDERS {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(240),
            "backlog not drained: {closed} closed"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The rate between 20% and 80% of the backlog, away from start-up and the tail.
    let at = |fraction: f64| {
        samples
            .iter()
            .find(|(_, n)| *n as f64 >= fraction * ORDERS as f64)
            .copied()
            .unwrap()
    };
    let ((t1, n1), (t2, n2)) = (at(0.2), at(0.8));
    let rate = (n2 - n1) as f64 / (t2 - t1).as_secs_f64();
    println!(
        "backlog of {ORDERS}: {rate:.0} closes/s with a limit of {RATE}; peak RSS {} MiB",
        peak_rss_kb / 1024
    );
    assert!(
        rate <= 1.2 * RATE,
        "drained at {rate:.0}/s, above the limit of {RATE}/s"
    );
    assert!(
        peak_rss_kb < 512 * 1024,
        "worker memory stayed bounded: peak {peak_rss_kb} kB"
    );
    assert_never_early(&db).await;
    let _ = tokio::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await;
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    env.cleanup().await;
}

fn vm_hwm_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

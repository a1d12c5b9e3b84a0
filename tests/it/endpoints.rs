//! `lapse worker --metrics-listen`: GET /metrics, /livez, /readyz and /health through
//! the binary.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

use crate::helpers::{TestEnv, eventually, run_lapse, stderr, stdout};

pub(crate) use crate::helpers::free_port;

pub(crate) async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let client = lapse::tls::TlsFiles::default()
        .http_client()
        .unwrap()
        .build()
        .unwrap();
    let response = client
        .get(format!("http://127.0.0.1:{port}{path}"))
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    Some((status, response.text().await.ok()?))
}

pub(crate) fn spawn_worker(
    env: &TestEnv,
    port: u16,
    broker_url: Option<&str>,
) -> tokio::process::Child {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_lapse"));
    cmd.args(["--config", env.config_path().to_str().unwrap(), "worker"])
        .args(["--metrics-listen", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    if let Some(url) = broker_url {
        cmd.env("LAPSE_BROKER__URL", url);
    }
    cmd.spawn().unwrap()
}

#[tokio::test]
async fn health_and_metrics_are_served_and_health_reports_a_lost_broker() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let port = free_port();
    let mut worker = spawn_worker(&env, port, None);
    let health: Value = eventually(Duration::from_secs(20), "a healthy worker", || async {
        let (status, body) = get(port, "/health").await?;
        let health: Value = serde_json::from_str(&body).ok()?;
        let all = ["consumer", "relay", "releaser", "sweeper", "http"];
        let listed = all.iter().all(|c| health["components"].get(c).is_some());
        (status == 200 && listed).then_some(health)
    })
    .await;
    assert_eq!(health["status"], "ok");
    for component in ["consumer", "relay", "releaser", "sweeper", "http"] {
        assert_eq!(health["components"][component]["up"], true, "{health}");
        assert_eq!(
            health["components"][component]["stalled"], false,
            "{health}"
        );
    }
    let (status, body) = get(port, "/livez").await.unwrap();
    assert_eq!(status, 200, "{body}");
    let (status, body) = get(port, "/readyz").await.unwrap();
    assert_eq!(status, 200, "{body}");
    let ready: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(ready["status"], "ready", "{ready}");
    for check in [
        "broker",
        "database",
        "component:consumer",
        "component:queues",
    ] {
        assert_eq!(ready["checks"][check]["ok"], true, "{ready}");
    }
    let created = env.lapse(&["order", "create", "--expires-in", "300ms"]);
    assert!(created.status.success());
    eventually(
        Duration::from_secs(20),
        "the close counted in /metrics",
        || async {
            let (_, body) = get(port, "/metrics").await?;
            body.lines()
                .any(|l| l.starts_with("lapse_closes_total{path=\"timeout\"} 1"))
                .then_some(())
        },
    )
    .await;
    // The standard process metrics, of the worker's own process.
    let (_, body) = get(port, "/metrics").await.unwrap();
    let value = |name: &str| -> f64 {
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{body}"))
    };
    assert!(value("process_resident_memory_bytes") > 1_000_000.0);
    assert!(value("process_open_fds") >= 3.0);
    assert!(value("process_threads") >= 1.0);
    assert!(value("process_cpu_seconds_total") > 0.0);
    let started = value("process_start_time_seconds");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        started <= now && started > now - 300.0,
        "{started} vs {now}"
    );
    assert_eq!(get(port, "/nothing").await.unwrap().0, 404);
    worker.kill().await.unwrap();

    // The same worker pointed at a broker that is not there: degraded, with the reason.
    let port = free_port();
    let mut worker = spawn_worker(&env, port, Some("amqp://guest:guest@127.0.0.1:1/%2f"));
    // Degraded from the start (nothing is up before its connection is open); wait
    // for the consumer's first failed connect to be reported.
    let (status, body) = eventually(Duration::from_secs(20), "a degraded worker", || async {
        let (status, body) = get(port, "/health").await?;
        let health: Value = serde_json::from_str(&body).ok()?;
        let failed = health["components"]["consumer"]["last_error"].is_string();
        (status == 503 && failed).then_some((status, body))
    })
    .await;
    let health: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status, 503);
    assert_eq!(health["status"], "degraded");
    assert_eq!(health["components"]["consumer"]["up"], false);
    let error = health["components"]["consumer"]["last_error"]
        .as_str()
        .unwrap();
    assert!(error.contains("connect"), "{error}");
    assert!(!body.contains("guest:guest"), "no credentials in /health");
    // Not ready, with the reasons; but alive: an unreachable broker is no reason to
    // restart the process.
    let (status, body) = get(port, "/readyz").await.unwrap();
    assert_eq!(status, 503, "{body}");
    let ready: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(ready["status"], "not_ready");
    assert_eq!(ready["checks"]["broker"]["ok"], false, "{ready}");
    let reason = ready["checks"]["broker"]["reason"].as_str().unwrap();
    assert!(reason.contains("127.0.0.1:1"), "{reason}");
    assert_eq!(ready["checks"]["database"]["ok"], true, "{ready}");
    assert_eq!(
        ready["checks"]["component:consumer"]["ok"], false,
        "{ready}"
    );
    assert!(!body.contains("guest:guest"), "no credentials in /readyz");
    let (status, body) = get(port, "/livez").await.unwrap();
    assert_eq!(status, 200, "{body}");
    worker.kill().await.unwrap();
    env.cleanup().await;
}

#[tokio::test]
async fn a_client_gone_silent_mid_request_does_not_hold_the_worker_s_shutdown() {
    use tokio::io::AsyncWriteExt;
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let port = free_port();
    let mut worker = spawn_worker(&env, port, None);
    eventually(Duration::from_secs(20), "a ready worker", || async {
        let (status, _) = get(port, "/readyz").await?;
        (status == 200).then_some(())
    })
    .await;
    // Half a request (no blank line after the headers), then silence: a scraper whose
    // host died mid-request.
    let mut stalled = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    stalled
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: lapse\r\n")
        .await
        .unwrap();
    stalled.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pid = worker.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    // The drain limit (10 s by default) bounds a shutdown; one that reaches it exits 1.
    let status = tokio::time::timeout(Duration::from_secs(60), worker.wait())
        .await
        .expect("the worker exits")
        .unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "a clean shutdown despite the silent client"
    );
    drop(stalled);
}

/// `worker.metrics_listen` (here from the environment) serves the endpoints too, and
/// takes a host name: `localhost` is bound as 127.0.0.1.
#[tokio::test]
async fn metrics_listen_from_the_configuration_takes_localhost() {
    let env = TestEnv::with_database(&["1s"]).await;
    let port = free_port();
    let address = format!("localhost:{port}");
    let mut worker =
        crate::helpers::spawn_worker(&env, &[("LAPSE_WORKER__METRICS_LISTEN", &address)]);
    eventually(Duration::from_secs(30), "/livez on localhost", || async {
        let (status, _) = get(port, "/livez").await?;
        (status == 200).then_some(())
    })
    .await;
    // `lapse probe` finds the worker through the same key.
    let config = env.config_path();
    let probe = |args: &[&str]| {
        let mut full = vec!["--config", config.to_str().unwrap(), "probe"];
        full.extend_from_slice(args);
        run_lapse(&full, &[("LAPSE_WORKER__METRICS_LISTEN", &address)])
    };
    let live = probe(&[]);
    assert_eq!(live.status.code(), Some(0), "{}", stderr(&live));
    assert!(stdout(&live).starts_with("livez: "), "{}", stdout(&live));
    eventually(Duration::from_secs(30), "lapse probe --ready", || async {
        (probe(&["--ready"]).status.code() == Some(0)).then_some(())
    })
    .await;
    let _ = worker.kill().await;
    let _ = worker.wait().await;
    let gone = probe(&[]);
    assert_eq!(gone.status.code(), Some(3), "{}", stderr(&gone));
    // Without the key or --address it cannot know where to ask.
    let nowhere = env.lapse(&["probe"]);
    assert_eq!(nowhere.status.code(), Some(2), "{}", stderr(&nowhere));
    assert!(
        stderr(&nowhere).contains("worker.metrics_listen"),
        "{}",
        stderr(&nowhere)
    );
    env.cleanup().await;
}

/// Orders past their deadline that nothing closes (their intents lost, the sweeper
/// off) show on `/metrics`: how many, and how long the oldest is overdue.
#[tokio::test]
async fn overdue_orders_show_on_metrics() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    crate::helpers::create_orders(
        &mut db,
        &[Duration::from_millis(1); 3],
        &[lapse::orders::Line {
            sku: "forgotten".into(),
            qty: 1,
        }],
    )
    .await;
    db.execute("DELETE FROM outbox", &[]).await.unwrap();
    let port = free_port();
    let address = format!("127.0.0.1:{port}");
    let mut worker = crate::helpers::spawn_worker(
        &env,
        &[
            ("LAPSE_WORKER__METRICS_LISTEN", &address),
            ("LAPSE_WORKER__SWEEPER", "false"),
        ],
    );
    let value = |text: &str, name: &str| -> Option<f64> {
        text.lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    };
    eventually(Duration::from_secs(30), "the overdue gauges", || async {
        let (_, text) = get(port, "/metrics").await?;
        let overdue = value(&text, "lapse_orders_overdue")?;
        let oldest = value(&text, "lapse_orders_overdue_oldest_seconds")?;
        (overdue == 3.0 && oldest > 0.0).then_some(())
    })
    .await;
    let _ = worker.kill().await;
    env.cleanup().await;
}

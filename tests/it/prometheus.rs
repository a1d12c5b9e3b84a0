//! A real Prometheus (Debian's `prometheus` package, installed by
//! `scripts/services.sh`) scrapes a running worker: the lateness histogram counts
//! exactly the closes in the database, and every dashboard query is valid PromQL that
//! returns data. `promtool` checks the alert rules and runs their tests.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

use crate::endpoints::{free_port, get, spawn_worker};
use crate::helpers::{TestEnv, count, eventually};

fn repo_file(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn on_path(tool: &str) -> bool {
    std::process::Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Makes sure `prometheus` and `promtool` are installed (the services script installs
/// them when absent); fails, never skips, when they cannot be had.
fn require_prometheus() {
    if on_path("prometheus") && on_path("promtool") {
        return;
    }
    let installed = std::process::Command::new("bash")
        .arg(repo_file("scripts/services.sh"))
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        installed && on_path("prometheus") && on_path("promtool"),
        "this test needs Prometheus: `prometheus` and `promtool` are not on PATH and \
         scripts/services.sh could not install them (run `apt-get install prometheus`)"
    );
}

/// A Prometheus of this test: loopback port, temporary config and data; killed when
/// dropped.
struct Prometheus {
    child: tokio::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    async fn start(target_port: u16) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: lapse\n    static_configs:\n      \
                 - targets: [\"127.0.0.1:{target_port}\"]\n"
            ),
        )
        .unwrap();
        let port = free_port();
        let child = tokio::process::Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start prometheus");
        let prometheus = Self {
            child,
            port,
            _dir: dir,
        };
        eventually(Duration::from_secs(30), "Prometheus ready", || async {
            let (status, _) = get(port, "/-/ready").await?;
            (status == 200).then_some(())
        })
        .await;
        prometheus
    }

    /// Runs an instant query; panics when Prometheus refuses it (invalid PromQL).
    async fn query(&self, expr: &str) -> Vec<Value> {
        let url = url::Url::parse_with_params(
            &format!("http://127.0.0.1:{}/api/v1/query", self.port),
            &[("query", expr)],
        )
        .unwrap();
        let path = format!("{}?{}", url.path(), url.query().unwrap());
        let (status, body) = get(self.port, &path).await.expect("Prometheus answers");
        let answer: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(status, 200, "query {expr} refused: {body}");
        assert_eq!(answer["status"], "success", "query {expr}: {body}");
        answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The value of a query that returns one sample.
    async fn scalar(&self, expr: &str) -> Option<f64> {
        let result = self.query(expr).await;
        result.first()?["value"][1].as_str()?.parse().ok()
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// Every query of the dashboard, with its panel's title, as Grafana sends it with
/// every instance selected (`$instance` is the variable's "All" value, `.+`). Checks on
/// the way that the dashboard is importable anywhere: every panel and query takes its
/// data source from the `datasource` variable, and an `instance` variable exists.
fn dashboard_queries() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo_file("deploy/grafana/lapse.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    let variable = |name: &str| variables.iter().find(|v| v["name"] == name).cloned();
    assert_eq!(variable("datasource").unwrap()["type"], "datasource");
    let instance = variable("instance").expect("an instance variable");
    assert_eq!(instance["allValue"], ".+", "{instance}");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        if panel["type"] == "row" {
            continue;
        }
        let title = panel["title"].as_str().unwrap().to_string();
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        for target in panel["targets"].as_array().unwrap() {
            assert_eq!(target["datasource"]["uid"], "${datasource}", "{title}");
            let expr = target["expr"].as_str().unwrap();
            assert!(expr.contains("instance=~\"$instance\""), "{title}: {expr}");
            queries.push((title.clone(), expr.replace("$instance", ".+")));
        }
    }
    queries
}

#[tokio::test]
async fn a_real_prometheus_counts_every_close_and_every_dashboard_query_returns_data() {
    require_prometheus();
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let port = free_port();
    let mut worker = spawn_worker(&env, port, None);
    eventually(Duration::from_secs(20), "a healthy worker", || async {
        let (status, _) = get(port, "/health").await?;
        (status == 200).then_some(())
    })
    .await;
    let prometheus = Prometheus::start(port).await;
    eventually(Duration::from_secs(30), "the first scrape", || async {
        (prometheus.scalar("up{job=\"lapse\"}").await == Some(1.0)).then_some(())
    })
    .await;

    // Orders closing while Prometheus watches, across both tiers and the due queue.
    let expiries = ["200ms", "400ms", "700ms", "1200ms", "1500ms", "2500ms"];
    for expires in expiries {
        let created = env.lapse(&["order", "create", "--expires-in", expires]);
        assert!(created.status.success(), "{created:?}");
    }
    let db = env.db().await;
    let closed = eventually(Duration::from_secs(30), "every order closed", || async {
        let closed = count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await;
        (closed == expiries.len() as i64).then_some(closed)
    })
    .await;

    // The histogram counts each close once, whichever path closed it.
    let counted = eventually(Duration::from_secs(30), "the closes scraped", || async {
        let n = prometheus
            .scalar("sum(lapse_close_lateness_seconds_count)")
            .await?;
        (n >= closed as f64).then_some(n)
    })
    .await;
    assert_eq!(
        counted, closed as f64,
        "lateness histogram count vs database"
    );
    let by_path = prometheus.scalar("sum(lapse_closes_total)").await;
    assert_eq!(by_path, Some(closed as f64), "closes by path vs database");
    let buckets = prometheus
        .query("lapse_close_lateness_seconds_bucket{le=\"60\"}")
        .await;
    assert!(!buckets.is_empty(), "buckets up to 60 s");

    // A message the worker cannot decode, for the parked-by-reason panel.
    let channel = env.conn.create_channel().await.unwrap();
    channel
        .basic_publish(
            "".into(),
            env.names().due_queue().as_str().into(),
            Default::default(),
            b"\xff not a timeout",
            Default::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    eventually(Duration::from_secs(30), "the message parked", || async {
        let n = prometheus
            .scalar("sum(lapse_parked_total{reason=\"undecodable\"})")
            .await?;
        (n >= 1.0).then_some(())
    })
    .await;

    // Every panel's query is accepted and has data.
    let queries = dashboard_queries();
    assert!(queries.len() >= 20, "{queries:?}");
    for (panel, expr) in &queries {
        eventually(
            Duration::from_secs(30),
            &format!("data for panel {panel:?}: {expr}"),
            || async { (!prometheus.query(expr).await.is_empty()).then_some(()) },
        )
        .await;
    }
    // Every metric the worker exports has help text and a type, and is documented.
    let (_, exported) = get(port, "/metrics").await.unwrap();
    let docs = std::fs::read_to_string(repo_file("docs/metrics.md")).unwrap();
    let mut names: Vec<&str> = exported
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .filter(|n| n.starts_with("lapse_"))
        .map(|n| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| n.strip_suffix(s))
                .filter(|base| exported.contains(&format!("# TYPE {base} histogram")))
                .unwrap_or(n)
        })
        .collect();
    names.sort();
    names.dedup();
    assert!(names.len() >= 15, "{names:?}");
    for name in names {
        assert!(
            exported.contains(&format!("# HELP {name} ")),
            "no help: {name}"
        );
        assert!(
            exported.contains(&format!("# TYPE {name} ")),
            "no type: {name}"
        );
        assert!(
            docs.contains(&format!("`{name}`")),
            "not in docs/metrics.md: {name}"
        );
    }
    prometheus.stop().await;
    worker.kill().await.unwrap();
    env.cleanup().await;
}

/// The names of the alerts in `alerts.yml`.
fn alert_names(rules: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert:"))
        .map(|name| name.trim().to_string())
        .collect()
}

#[tokio::test]
async fn every_alert_fires_on_its_failure_and_stays_quiet_when_healthy() {
    require_prometheus();
    let dir = repo_file("deploy/prometheus");
    let check = std::process::Command::new("promtool")
        .args(["check", "rules", "alerts.yml"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(check.status.success(), "{check:?}");
    let test = std::process::Command::new("promtool")
        .args(["test", "rules", "alerts_test.yml"])
        .current_dir(&dir)
        .output()
        .unwrap();
    let out =
        String::from_utf8_lossy(&test.stdout).into_owned() + &String::from_utf8_lossy(&test.stderr);
    assert!(test.status.success() && out.contains("SUCCESS"), "{out}");

    // Each alert has a firing case and a quiet case in the tests.
    let rules = std::fs::read_to_string(dir.join("alerts.yml")).unwrap();
    let tests = std::fs::read_to_string(dir.join("alerts_test.yml")).unwrap();
    let names = alert_names(&rules);
    // The shipped set, named: removing or renaming one is a change operators must hear of.
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        [
            "LapseCloseLatenessHigh",
            "LapseComponentDown",
            "LapseDueQueueWithoutConsumers",
            "LapseKindActionFailing",
            "LapseOutboxOldestRowTooOld",
            "LapseParkedMessages",
            "LapseReconcilerRepairing",
            "LapseSweeperClosing",
            "LapseWorkerAbsent",
        ]
    );
    for name in names {
        let cases: Vec<&str> = tests
            .split("- eval_time:")
            .filter(|case| case.contains(&format!("alertname: {name}\n")))
            .collect();
        assert!(
            cases.iter().any(|c| c.contains("exp_alerts: []")),
            "{name}: no case where it stays quiet"
        );
        assert!(
            cases.iter().any(|c| c.contains("exp_labels:")),
            "{name}: no case where it fires"
        );
    }
}

//! `lapse demo` at a small size, through the built binary: its JSON report accounts
//! for every order (none early, stock back), its picture is a well-formed SVG with
//! the plotted series, and it leaves nothing behind — or, with `--keep`, leaves its
//! queues, exchanges and database for the test to remove. No timing assertions
//! beyond a generous bound: the demo's own deadlines are short, the machine may be
//! loaded.

use lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapse::amqp::management::Management;
use lapse::config::Secret;
use lapse::names::Names;
use lapse::tier_file::TierFile;
use serde_json::Value;

use crate::helpers::{
    amqp_url, database_admin_url, database_url, management_url, run_lapse, stderr, stdout, unique,
};

const TIERS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/topology/default.toml");

/// A demo run's base names (its prefix and database derive from them), and cleanup of
/// whatever a run left under them — also when the test fails half-way.
pub(crate) struct Demo {
    bases: Bases,
    dir: tempfile::TempDir,
}

/// The base names alone: what cleanup needs. No `Drop` of its own, so a cleanup that
/// panics (a broker without its management API, say) fails the test once instead of
/// starting another cleanup.
#[derive(Clone)]
struct Bases {
    base_prefix: String,
    base_db: String,
}

impl Demo {
    pub(crate) fn new() -> Self {
        Self {
            bases: Bases {
                base_prefix: unique("demo"),
                base_db: unique("demo"),
            },
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn svg(&self) -> String {
        self.dir.path().join("demo.svg").display().to_string()
    }

    fn run(&self, args: &[&str]) -> std::process::Output {
        let mut full = vec!["demo", "--json", "--svg"];
        let svg = self.svg();
        full.push(&svg);
        full.extend_from_slice(args);
        let mut vars = self.services();
        vars.push(("LAPSE_TOPOLOGY__FILE", TIERS.to_string()));
        let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        run_lapse(&full, &vars)
    }

    /// The variables that point a demo at the test services under this demo's bases.
    pub(crate) fn services(&self) -> Vec<(&'static str, String)> {
        vec![
            ("LAPSE_BROKER__URL", amqp_url()),
            ("LAPSE_BROKER__MANAGEMENT_URL", management_url()),
            ("LAPSE_BROKER__PREFIX", self.bases.base_prefix.clone()),
            ("LAPSE_DATABASE__URL", database_url(&self.bases.base_db)),
        ]
    }

    pub(crate) async fn leftovers(&self) -> (Vec<String>, Vec<String>) {
        self.bases.leftovers().await
    }

    pub(crate) async fn remove(&self) {
        self.bases.remove().await
    }
}

impl Bases {
    /// Queues (by name) and databases whose names start with this test's bases.
    async fn leftovers(&self) -> (Vec<String>, Vec<String>) {
        let management = Management::new(&Secret::new(management_url())).unwrap();
        let queues = management
            .queues("/")
            .await
            .unwrap()
            .into_iter()
            .map(|q| q.name)
            .filter(|n| n.starts_with(&format!("{}-", self.base_prefix)))
            .collect();
        let admin = admin().await;
        let databases = admin
            .query(
                "SELECT datname::text AS name FROM pg_database WHERE starts_with(datname, $1)",
                &[&format!("{}_demo_", self.base_db)],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get("name"))
            .collect();
        (queues, databases)
    }

    /// Deletes the queues and exchanges of every demo prefix under the base prefix
    /// and drops its databases.
    async fn remove(&self) {
        let (queues, databases) = self.leftovers().await;
        let conn = lapse::amqp::broker::connect(&Secret::new(amqp_url()), "lapse test cleanup")
            .await
            .unwrap();
        let mut prefixes: Vec<String> = queues
            .iter()
            .filter_map(|q| q.split_once('.').map(|(p, _)| p.to_string()))
            .collect();
        prefixes.sort();
        prefixes.dedup();
        let mut doomed_queues = queues;
        let mut doomed_exchanges = Vec::new();
        for prefix in prefixes {
            let (q, e) = objects(&prefix);
            doomed_queues.extend(q);
            doomed_exchanges.extend(e);
        }
        for q in doomed_queues {
            let ch = conn.create_channel().await.unwrap();
            let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
        }
        for e in doomed_exchanges {
            let ch = conn.create_channel().await.unwrap();
            let _ = ch
                .exchange_delete(e.as_str().into(), Default::default())
                .await;
        }
        let admin = admin().await;
        for db in databases {
            admin
                .batch_execute(&format!("DROP DATABASE IF EXISTS \"{db}\" WITH (FORCE)"))
                .await
                .unwrap();
        }
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let bases = self.bases.clone();
        let _ = std::thread::spawn(move || {
            tokio::runtime::Runtime::new()
                .unwrap()
                .block_on(bases.remove());
        })
        .join();
    }
}

async fn admin() -> tokio_postgres::Client {
    let (client, connection) =
        tokio_postgres::connect(&database_admin_url(), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    client
}

/// The queues and exchanges a prefix's topology declares.
fn objects(prefix: &str) -> (Vec<String>, Vec<String>) {
    let names = Names::new(prefix);
    let mut queues = vec![
        names.due_queue(),
        names.parked(),
        names.stock_release_queue(),
    ];
    let tiers = TierFile::load(std::path::Path::new(TIERS)).unwrap().tiers;
    queues.extend(tiers.iter().map(|t| names.wait_queue(t)));
    let exchanges = vec![
        names.delay_exchange(),
        names.due_exchange(),
        names.parked(),
        names.events_exchange(),
    ];
    (queues, exchanges)
}

/// Which of a prefix's queues and exchanges exist, by passive declares.
async fn existing(prefix: &str) -> Vec<String> {
    let conn = lapse::amqp::broker::connect(&Secret::new(amqp_url()), "lapse test check")
        .await
        .unwrap();
    let (queues, exchanges) = objects(prefix);
    let mut found = Vec::new();
    for q in queues {
        let ch = conn.create_channel().await.unwrap();
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        if ch
            .queue_declare(q.as_str().into(), passive, FieldTable::default())
            .await
            .is_ok()
        {
            found.push(format!("queue {q}"));
        }
    }
    for e in exchanges {
        let ch = conn.create_channel().await.unwrap();
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        };
        if ch
            .exchange_declare(
                e.as_str().into(),
                lapin::ExchangeKind::Direct,
                passive,
                FieldTable::default(),
            )
            .await
            .is_ok()
        {
            found.push(format!("exchange {e}"));
        }
    }
    found
}

pub(crate) fn report(out: &std::process::Output) -> Value {
    serde_json::from_str(&stdout(out)).unwrap_or_else(|e| {
        panic!(
            "not a JSON report ({e}); exit {:?}\nstdout: {}\nstderr: {}",
            out.status.code(),
            stdout(out),
            stderr(out)
        )
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_small_demo_accounts_for_every_order_draws_its_picture_and_leaves_nothing_behind() {
    let demo = Demo::new();
    let out = demo.run(&["--orders", "150", "--duration", "5s"]);
    let r = report(&out);
    assert_eq!(out.status.code(), Some(0), "{r:#}\n{}", stderr(&out));
    assert_eq!(r["problems"], serde_json::json!([]), "{r:#}");
    assert_eq!(r["orders"], 150);
    assert_eq!(r["early"], 0, "{r:#}");
    assert_eq!(r["open"], 0, "{r:#}");
    let (closed, paid) = (r["closed"].as_i64().unwrap(), r["paid"].as_i64().unwrap());
    assert_eq!(closed + paid, 150, "{r:#}");
    assert!(closed > 0 && paid > 0, "{r:#}");
    assert_eq!(
        r["closed_by_timeout"].as_i64().unwrap() + r["closed_by_sweeper"].as_i64().unwrap(),
        closed
    );
    assert_eq!(r["stock_consistent"], true, "{r:#}");
    assert_eq!(r["stock_start"].as_array().unwrap().len(), 3);
    assert_eq!(r["late_payments_accepted"], 0);
    let hops: i64 = r["hops"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_i64().unwrap())
        .sum();
    assert_eq!(hops, closed, "one close event per closed order: {r:#}");
    // The message path did the work (a dead one would leave every close to the
    // sweeper, at hop 0): most closes by the timeout, some after a wait-queue hop.
    let by_timeout = r["closed_by_timeout"].as_i64().unwrap();
    assert!(
        by_timeout * 2 > closed,
        "closed mostly by the timeout path: {r:#}"
    );
    let hopped: i64 = r["hops"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.as_str() != "0")
        .map(|(_, v)| v.as_i64().unwrap())
        .sum();
    assert!(hopped > 0, "some closes came through a wait queue: {r:#}");
    // The mix happened: extensions, and late payments refused.
    assert!(r["extended"].as_i64().unwrap() > 0, "{r:#}");
    assert!(r["late_payments_refused"].as_i64().unwrap() > 0, "{r:#}");
    assert_eq!(r["action_errors"], 0, "{r:#}");
    let l = &r["lateness_ms"];
    let q = |k: &str| l[k].as_f64().unwrap();
    assert!(
        q("p50") >= 0.0 && q("p50") <= q("p90") && q("p90") <= q("p99") && q("p99") <= q("max")
    );
    assert!(q("max") < 120_000.0, "closed within a generous bound: {l}");
    assert_eq!(r["kept"], false);

    let path = r["svg"].as_str().unwrap();
    assert_eq!(path, demo.svg());
    let svg = std::fs::read_to_string(path).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
        "{svg}"
    );
    assert_eq!(svg.matches("<svg").count(), 1);
    assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
    for series in [
        "Close lateness",
        "deadlines falling due",
        "closes",
        "<polyline",
        "<rect",
    ] {
        assert!(svg.contains(series), "the picture has no {series}");
    }

    let prefix = r["prefix"].as_str().unwrap();
    assert!(prefix.starts_with(&format!("{}-demo-", demo.bases.base_prefix)));
    assert_eq!(existing(prefix).await, Vec::<String>::new());
    let (queues, databases) = demo.leftovers().await;
    assert_eq!(queues, Vec::<String>::new());
    assert_eq!(databases, Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn keep_leaves_the_queues_exchanges_and_database_in_place() {
    let demo = Demo::new();
    let out = demo.run(&["--orders", "20", "--duration", "2s", "--keep"]);
    let r = report(&out);
    assert_eq!(out.status.code(), Some(0), "{r:#}\n{}", stderr(&out));
    assert_eq!(r["kept"], true);
    let prefix = r["prefix"].as_str().unwrap().to_string();
    let database = r["database"].as_str().unwrap().to_string();
    let (queues, databases) = demo.leftovers().await;
    assert_eq!(databases, vec![database.clone()]);
    assert!(
        queues.contains(&Names::new(&prefix).due_queue()),
        "{queues:?}"
    );
    let (all_queues, all_exchanges) = objects(&prefix);
    assert_eq!(
        existing(&prefix).await.len(),
        all_queues.len() + all_exchanges.len()
    );
    // The kept database holds the run: every order paid or closed.
    let (client, connection) = tokio_postgres::connect(
        &crate::helpers::on_lapse_path(&database_url(&database)),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let settled: i64 = client
        .query_one(
            "SELECT count(*) AS settled FROM orders WHERE status IN ('PAID', 'CLOSED')",
            &[],
        )
        .await
        .unwrap()
        .get("settled");
    assert_eq!(settled, 20);
    drop(client);

    demo.remove().await;
    assert_eq!(existing(&prefix).await, Vec::<String>::new());
    assert_eq!(demo.leftovers().await, (Vec::new(), Vec::new()));
}

#[test]
fn bad_sizes_are_usage_errors_naming_the_option() {
    for (args, option) in [
        (["--orders", "0"], "--orders"),
        (["--orders", "100001"], "--orders"),
        (["--orders", "99999999999999"], "--orders"),
        (["--duration", "0s"], "--duration"),
        (["--duration", "-5s"], "--duration"),
        (["--duration", "2h"], "--duration"),
        (["--duration", "soon"], "--duration"),
    ] {
        let mut full = vec!["demo"];
        full.extend_from_slice(&args);
        let out = run_lapse(&full, &[]);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(option), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn a_database_named_in_the_url_query_is_refused_before_anything_is_created() {
    let url = format!("{}?dbname=postgres", crate::helpers::database_url(""));
    let out = run_lapse(
        &["demo", "--orders", "10", "--duration", "2s"],
        &[("LAPSE_DATABASE__URL", &url)],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("database.url"), "{}", stderr(&out));
    assert!(stderr(&out).contains("dbname"), "{}", stderr(&out));
}

#[test]
fn an_unwritable_picture_path_is_refused_before_the_run() {
    let dir = tempfile::tempdir().unwrap();
    for path in [
        dir.path().join("no-such-dir").join("demo.svg"),
        dir.path().to_path_buf(),
    ] {
        let started = std::time::Instant::now();
        let out = run_lapse(
            &[
                "demo",
                "--orders",
                "10",
                "--duration",
                "30s",
                "--svg",
                path.to_str().unwrap(),
            ],
            &[],
        );
        assert_eq!(out.status.code(), Some(2), "{path:?}: {}", stderr(&out));
        assert!(stderr(&out).contains("--svg"), "{}", stderr(&out));
        // Refused up front, not after the 30 s run.
        assert!(started.elapsed() < std::time::Duration::from_secs(20));
    }
    // The check leaves nothing behind where the file could be written.
    let fine = dir.path().join("fine.svg");
    lapse::demo::picture::check_writable(&fine).unwrap();
    assert!(!fine.exists());
}

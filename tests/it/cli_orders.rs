//! `lapse order ...` and `lapse status` through the binary: output and exit status
//! (0 success, 1 refused, 2 bad arguments).

use std::time::Duration;

use serde_json::Value;

use crate::helpers::{TestEnv, stderr, stdout};

#[tokio::test]
async fn order_commands_report_and_exit_as_documented() {
    let env = TestEnv::with_database(&["1s"]).await;
    let created = env.lapse(&[
        "order",
        "create",
        "--expires-in",
        "10m",
        "--line",
        "tea:2",
        "--line",
        "cup:1",
        "--count",
        "3",
        "--json",
    ]);
    assert!(created.status.success(), "{}", stderr(&created));
    let ids: Vec<i64> = serde_json::from_str(&stdout(&created)).unwrap();
    assert_eq!(ids.len(), 3);
    let id = ids[0].to_string();

    for bad in [
        vec!["order", "create"],
        vec!["order", "create", "--expires-in", "soon"],
        vec!["order", "create", "--expires-in", "1m", "--line", "tea"],
        vec!["order", "create", "--expires-in", "1m", "--line", "tea:0"],
        vec!["order", "create", "--expires-in", "1m", "--count", "0"],
        vec!["order", "pay", "not-a-number"],
    ] {
        assert_eq!(env.lapse(&bad).status.code(), Some(2), "{bad:?}");
    }

    let paid = env.lapse(&["order", "pay", &id]);
    assert_eq!(paid.status.code(), Some(0));
    assert!(stdout(&paid).contains("paid"));
    assert_eq!(
        env.lapse(&["order", "pay", &id]).status.code(),
        Some(0),
        "paying twice is not an error"
    );
    let extend_paid = env.lapse(&["order", "extend", &id, "--by", "5m"]);
    assert_eq!(
        extend_paid.status.code(),
        Some(1),
        "{}",
        stdout(&extend_paid)
    );
    assert_eq!(
        env.lapse(&["order", "pay", "999999999"]).status.code(),
        Some(1)
    );

    let extended = env.lapse(&["order", "extend", &ids[1].to_string(), "--by", "5m"]);
    assert_eq!(extended.status.code(), Some(0));
    assert!(
        stdout(&extended).contains("version 2"),
        "{}",
        stdout(&extended)
    );

    // A payment after the deadline (no worker running, so not closed yet) is refused.
    let short = env.lapse(&["order", "create", "--expires-in", "200ms"]);
    let short_id = stdout(&short).trim().to_string();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let refused = env.lapse(&["order", "pay", &short_id]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stdout(&refused).contains("deadline has passed"),
        "{}",
        stdout(&refused)
    );

    let shown = env.lapse(&["order", "show", &ids[1].to_string(), "--json"]);
    let view: Value = serde_json::from_str(&stdout(&shown)).unwrap();
    assert_eq!(view["status"], "UNPAID");
    assert_eq!(view["deadline_version"], 2);
    let events: Vec<&str> = view["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(events, ["created", "extended"]);
    assert_eq!(
        view["ledger"].as_array().unwrap().len(),
        2,
        "two reservations"
    );
    let text = env.lapse(&["order", "show", &id]);
    assert!(
        stdout(&text).contains("PAID") && stdout(&text).contains("sale"),
        "{}",
        stdout(&text)
    );
    assert_eq!(
        env.lapse(&["order", "show", "999999999"]).status.code(),
        Some(1)
    );

    let status = env.lapse(&["status", "--json"]);
    assert!(status.status.success(), "{}", stderr(&status));
    let status: Value = serde_json::from_str(&stdout(&status)).unwrap();
    assert_eq!(status["overdue_unpaid"], 1);
    assert_eq!(
        status["outbox_rows"], 5,
        "four creates and one extension, no relay running"
    );
    assert!(
        status["queues"]
            .as_array()
            .unwrap()
            .iter()
            .all(|q| q["messages"] == 0)
    );
    env.cleanup().await;
}

#[tokio::test]
async fn running_out_of_stock_is_a_refusal_that_creates_nothing() {
    let env = TestEnv::with_database(&["1s"]).await;
    env.write_config(&format!(
        "[database]\nurl = {:?}\n[orders]\ninitial_stock = 5\n",
        env.database_url()
    ));
    let ok = env.lapse(&[
        "order",
        "create",
        "--expires-in",
        "1m",
        "--line",
        "rare:2",
        "--count",
        "2",
    ]);
    assert!(ok.status.success(), "{}", stderr(&ok));
    let short = env.lapse(&[
        "order",
        "create",
        "--expires-in",
        "1m",
        "--line",
        "rare:2",
        "--count",
        "2",
    ]);
    assert_eq!(short.status.code(), Some(1));
    assert!(
        stderr(&short).contains("insufficient stock for sku rare"),
        "{}",
        stderr(&short)
    );
    let db = env.db().await;
    assert_eq!(
        crate::helpers::count(&db, "SELECT count(*) FROM orders").await,
        2,
        "the refused transaction left nothing"
    );
    assert_eq!(
        crate::helpers::count(&db, "SELECT available FROM stock WHERE sku = 'rare'").await,
        1
    );
    env.cleanup().await;
}

//! Hostile deadlines where they enter: not finite, out of range, in the past, beyond
//! the horizon, wrapped, or earlier than the current one, through the SQL functions,
//! the Rust API and the CLI; and payments judged by the real clock, each refused
//! payment recorded once for a refund.

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use lapse::db::DbError;
use lapse::orders::{self, Deadline, Line, OrderId};

use crate::helpers::{TestEnv, count, create_orders, eventually, stderr, stdout};

/// 2^64 ms minus 60 s: `as i64` turned it into "60 s earlier".
const WRAPPING: &str = "18446744073709491s616ms";

fn one_line() -> Vec<Line> {
    vec![Line {
        sku: "tea".into(),
        qty: 1,
    }]
}

/// The SQLSTATE of a failed statement (empty when it succeeded).
async fn sqlstate(db: &tokio_postgres::Client, sql: &str) -> String {
    match db.batch_execute(sql).await {
        Ok(()) => String::new(),
        Err(e) => e.code().map(|c| c.code().to_string()).unwrap_or_default(),
    }
}

async fn expire_at(db: &tokio_postgres::Client, id: i64) -> DateTime<Utc> {
    db.query_one("SELECT expire_at FROM orders WHERE id = $1", &[&id])
        .await
        .unwrap()
        .get("expire_at")
}

#[tokio::test]
async fn the_sql_functions_refuse_invalid_deadlines_with_lp001() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = env.db().await;
    let invalid = [
        "'infinity'",
        "'-infinity'",
        "NULL",
        "'2000-01-01 BC'",
        "'275760-09-13 00:00:00+00'",
        "now() - interval '1 hour'",
        "now() + interval '367 days'",
    ];
    for deadline in invalid {
        assert_eq!(
            sqlstate(&db, &format!("SELECT lapse_create_order({deadline})")).await,
            "LP001",
            "create with {deadline}"
        );
    }
    assert_eq!(count(&db, "SELECT count(*) FROM orders").await, 0);

    // The allowance for a clock a little behind, and the edge of the horizon.
    for deadline in [
        "now() - interval '2 seconds'",
        "now() + interval '365 days'",
    ] {
        assert_eq!(
            sqlstate(&db, &format!("SELECT lapse_create_order({deadline})")).await,
            "",
            "create with {deadline}"
        );
    }

    // Rounded up to the millisecond, never down.
    let made = db
        .query_one(
            "SELECT lapse_create_order(t) AS id, t AS asked
               FROM (SELECT date_trunc('milliseconds', now()) + interval '1 hour 400 microseconds') a(t)",
            &[],
        )
        .await
        .unwrap();
    let (made_id, asked): (i64, DateTime<Utc>) = (made.get("id"), made.get("asked"));
    let rounded_by_us = (expire_at(&db, made_id).await - asked).num_microseconds();
    assert_eq!(
        rounded_by_us,
        Some(600),
        "rounded up by 0.6 ms, not down by 0.4 ms"
    );

    let id: i64 = db
        .query_one(
            "SELECT lapse_create_order(now() + interval '1 hour') AS id",
            &[],
        )
        .await
        .unwrap()
        .get("id");
    for deadline in invalid {
        assert_eq!(
            sqlstate(
                &db,
                &format!("SELECT lapse_extend_deadline({id}, {deadline})")
            )
            .await,
            "LP001",
            "extend with {deadline}"
        );
    }
    // Extend only moves a deadline later.
    for deadline in [
        "now() + interval '59 minutes'",
        "(SELECT expire_at FROM orders WHERE id = $ID)",
    ] {
        let deadline = deadline.replace("$ID", &id.to_string());
        assert_eq!(
            sqlstate(
                &db,
                &format!("SELECT lapse_extend_deadline({id}, {deadline})")
            )
            .await,
            "LP002",
            "extend to {deadline}"
        );
    }
    let version: Option<i32> = db
        .query_one(
            "SELECT lapse_extend_deadline($1, now() + interval '2 hours') AS version",
            &[&id],
        )
        .await
        .unwrap()
        .get("version");
    assert_eq!(version, Some(2));

    // The horizon comes from the settings table, which `lapse migrate` writes.
    lapse::db::write_settings(
        &db,
        &lapse::db::Settings {
            deadline_horizon: Duration::from_secs(86_400),
            prefix: "lapse".into(),
            kinds: Default::default(),
            promote_within: Duration::from_secs(3600),
        },
    )
    .await
    .unwrap();
    assert_eq!(
        sqlstate(
            &db,
            "SELECT lapse_create_order(now() + interval '25 hours')"
        )
        .await,
        "LP001"
    );
    assert_eq!(
        sqlstate(
            &db,
            "SELECT lapse_create_order(now() + interval '23 hours')"
        )
        .await,
        ""
    );

    // Even a direct INSERT cannot write a deadline the components cannot read.
    for deadline in [
        "'infinity'",
        "'-infinity'",
        "'2000-01-01 BC'",
        "'10000-01-01 00:00:00+00'",
    ] {
        assert_eq!(
            sqlstate(
                &db,
                &format!("INSERT INTO orders (expire_at) VALUES ({deadline})")
            )
            .await,
            "23514",
            "insert {deadline}"
        );
    }
    env.cleanup().await;
}

#[tokio::test]
async fn the_rust_api_refuses_invalid_deadlines_with_a_typed_error() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    let year = |y: i32| Utc.with_ymd_and_hms(y, 1, 1, 0, 0, 0).unwrap();
    let invalid = [
        Deadline::At(year(262_000)),
        Deadline::At(year(-1)),
        Deadline::At(Utc::now() - chrono::TimeDelta::hours(1)),
        Deadline::In(Duration::from_secs(400 * 86_400)),
        Deadline::In(Duration::from_secs(300_000 * 31_557_600)),
        Deadline::In(Duration::from_millis(u64::MAX - 59_999)),
        Deadline::In(Duration::MAX),
    ];
    for deadline in invalid {
        let result = orders::create(&db, deadline, &[]).await;
        assert!(
            matches!(result, Err(DbError::InvalidDeadline(_))),
            "{deadline:?}: {result:?}"
        );
    }
    assert_eq!(count(&db, "SELECT count(*) FROM orders").await, 0);

    // A sub-millisecond deadline is rounded up.
    let asked = Utc::now() + chrono::TimeDelta::minutes(10) + chrono::TimeDelta::microseconds(1);
    let id = orders::create(&db, Deadline::At(asked), &[]).await.unwrap();
    let stored = expire_at(&db, id.0).await;
    assert!(stored >= asked, "{stored} is earlier than {asked}");
    assert!(stored - asked < chrono::TimeDelta::milliseconds(1));
    let id = create_orders(&mut db, &[Duration::from_micros(600_000_400)], &[]).await[0];
    let view = orders::show(&db, id).await.unwrap().unwrap();
    assert_eq!(view.expire_at.timestamp_subsec_micros() % 1000, 0);

    // Extend: only later, checked arithmetic, nothing changes when refused.
    let before = expire_at(&db, id.0).await;
    for deadline in invalid {
        let result = orders::extend(&db, id, deadline).await;
        assert!(
            matches!(result, Err(DbError::InvalidDeadline(_))),
            "{deadline:?}: {result:?}"
        );
    }
    let earlier = orders::extend(
        &db,
        id,
        Deadline::At(before - chrono::TimeDelta::seconds(1)),
    )
    .await;
    assert!(matches!(earlier, Err(DbError::Refused(_))), "{earlier:?}");
    let same = orders::extend_by(&db, id, Duration::ZERO).await;
    assert!(matches!(same, Err(DbError::Refused(_))), "{same:?}");
    for by in [
        Duration::from_millis(u64::MAX - 59_999),
        Duration::from_secs(300_000 * 31_557_600),
        Duration::from_secs(400 * 86_400),
    ] {
        let result = orders::extend_by(&db, id, by).await;
        assert!(
            matches!(result, Err(DbError::InvalidDeadline(_))),
            "{by:?}: {result:?}"
        );
    }
    assert_eq!(
        expire_at(&db, id.0).await,
        before,
        "refusals changed nothing"
    );
    assert_eq!(
        orders::extend_by(&db, id, Duration::from_micros(1))
            .await
            .unwrap(),
        Some(2)
    );
    assert_eq!(
        expire_at(&db, id.0).await - before,
        chrono::TimeDelta::milliseconds(1),
        "1 µs later is rounded up to 1 ms, not down to nothing"
    );
    assert_eq!(
        orders::extend_by(&db, OrderId(987_654_321), Duration::from_secs(1))
            .await
            .unwrap(),
        None
    );
    env.cleanup().await;
}

#[tokio::test]
async fn the_cli_exits_2_for_an_invalid_deadline_and_1_for_an_earlier_one() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = env.db().await;
    for expires_in in [WRAPPING, "300000years", "400days"] {
        let out = env.lapse(&["order", "create", "--expires-in", expires_in]);
        assert_eq!(out.status.code(), Some(2), "{expires_in}: {}", stderr(&out));
        assert!(stderr(&out).contains("deadline"), "{}", stderr(&out));
    }
    assert_eq!(count(&db, "SELECT count(*) FROM orders").await, 0);

    let created = env.lapse(&["order", "create", "--expires-in", "10m"]);
    assert!(created.status.success(), "{}", stderr(&created));
    let id = stdout(&created).trim().to_string();
    let before = expire_at(&db, id.parse().unwrap()).await;
    for by in [WRAPPING, "300000years", "400days"] {
        let out = env.lapse(&["order", "extend", &id, "--by", by]);
        assert_eq!(out.status.code(), Some(2), "{by}: {}", stderr(&out));
    }
    let same = env.lapse(&["order", "extend", &id, "--by", "0s"]);
    assert_eq!(same.status.code(), Some(1), "{}", stdout(&same));
    assert!(stdout(&same).contains("not later"), "{}", stdout(&same));
    assert_eq!(expire_at(&db, id.parse().unwrap()).await, before);

    let later = env.lapse(&["order", "extend", &id, "--by", "1m"]);
    assert_eq!(later.status.code(), Some(0), "{}", stderr(&later));
    assert_eq!(
        expire_at(&db, id.parse().unwrap()).await - before,
        chrono::TimeDelta::minutes(1)
    );

    // `lapse migrate` writes orders.deadline_horizon for the SQL functions.
    env.write_config(&format!(
        "[database]\nurl = {:?}\n[orders]\ndeadline_horizon = \"1day\"\n",
        env.database_url()
    ));
    let migrated = env.lapse(&["migrate"]);
    assert!(migrated.status.success(), "{}", stderr(&migrated));
    let too_far = env.lapse(&["order", "create", "--expires-in", "25h"]);
    assert_eq!(too_far.status.code(), Some(2), "{}", stderr(&too_far));
    assert!(stderr(&too_far).contains("horizon"), "{}", stderr(&too_far));
    let near = env.lapse(&["order", "create", "--expires-in", "23h"]);
    assert_eq!(near.status.code(), Some(0), "{}", stderr(&near));
    env.cleanup().await;
}

#[tokio::test]
async fn a_payment_after_the_deadline_is_refused_by_the_real_clock_and_recorded_once() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    let id = create_orders(&mut db, &[Duration::from_secs(2)], &one_line()).await[0];
    let deadline = expire_at(&db, id.0).await;

    // A transaction that begins before the deadline...
    let tx = db.transaction().await.unwrap();
    let began: DateTime<Utc> = tx
        .query_one("SELECT now() AS began", &[])
        .await
        .unwrap()
        .get("began");
    assert!(
        began < deadline,
        "the transaction must begin before the deadline"
    );
    // ...and pays after it, by the real clock.
    let observer = env.db().await;
    eventually(Duration::from_secs(30), "the deadline passed", || async {
        let passed: bool = observer
            .query_one(
                "SELECT clock_timestamp() > $1::timestamptz + interval '200 ms' AS passed",
                &[&deadline],
            )
            .await
            .unwrap()
            .get("passed");
        passed.then_some(())
    })
    .await;
    assert_eq!(
        orders::pay(&tx, id).await.unwrap(),
        orders::PayOutcome::Expired
    );
    assert_eq!(
        orders::pay(&tx, id).await.unwrap(),
        orders::PayOutcome::Expired
    );
    tx.commit().await.unwrap();
    assert_eq!(
        orders::pay(&db, id).await.unwrap(),
        orders::PayOutcome::Expired
    );
    let view = orders::show(&db, id).await.unwrap().unwrap();
    assert_eq!((view.status.as_str(), view.paid_at), ("UNPAID", None));
    assert_eq!(view.late_payments, 1, "recorded once for a refund");
    assert_eq!(
        count(&db, "SELECT sold FROM stock WHERE sku = 'tea'").await,
        0,
        "nothing was sold"
    );

    // After the close: LATE, still one record however often the payment is retried.
    assert_eq!(close_now(&mut db, id).await, 1);
    let other = create_orders(&mut db, &[Duration::from_millis(100)], &one_line()).await[0];
    let started = std::time::Instant::now();
    while close_now(&mut db, other).await == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the other order was never closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for order in [id, other, id, other] {
        assert_eq!(
            orders::pay(&db, order).await.unwrap(),
            orders::PayOutcome::Late
        );
    }
    assert_eq!(
        count(&db, "SELECT count(*) FROM late_payments").await,
        2,
        "one record per order"
    );
    env.cleanup().await;
}

/// Closes `id` through the one close path, as the sweeper would; how many it closed.
async fn close_now(db: &mut tokio_postgres::Client, id: orders::OrderId) -> usize {
    let tx = db.transaction().await.unwrap();
    let mut report = lapse::close::close_due(
        &tx,
        &[lapse::close::Candidate {
            order_id: id.0,
            deadline_version: 1,
            hops: 0,
        }],
        lapse::close::CloseReason::Sweeper,
        lapse::close::StockRelease::default(),
    )
    .await
    .unwrap();
    lapse::close::release_closed(&tx, &mut report, lapse::close::StockRelease::default())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    report.closed.len()
}

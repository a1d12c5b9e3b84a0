//! The decision table of docs/pipeline.md, row by row, against [`Decider::classify`]
//! and [`Decider::retry`] (pure: no database).

use super::*;
use crate::config::Secret;

fn decider() -> Decider {
    Decider {
        // Never connected: classify and retry are pure.
        pools: Pools::single(
            db::pool(
                &crate::config::DatabaseConfig {
                    url: Secret::new("postgres://nobody@127.0.0.1:1/none"),
                    ..crate::config::Config::default().database
                },
                1,
            )
            .unwrap(),
        ),
        names: Names::new("t"),
        tiers: TierSet::new(vec![
            Tier::parse("1s").unwrap(),
            Tier::parse("10s").unwrap(),
        ]),
        max_attempts: 3,
        retry_backoff: Duration::from_millis(500),
        lock_retry: Duration::from_millis(500),
        lock_timeout: Duration::from_secs(5),
        kinds: Default::default(),
        tier_tolerance: Duration::from_millis(50),
        clock_offset: Default::default(),
        stock_release: Default::default(),
        stats: Default::default(),
    }
}

fn now() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2026-12-02T10:00:00Z")
        .unwrap()
        .with_timezone(&Utc)
}

fn snapshot(row: Result<OrderRow, String>) -> Snapshot {
    Snapshot {
        db_now: now(),
        orders: HashMap::from([(7, row)]),
        closed: Vec::new(),
        locked: HashSet::new(),
        ..Default::default()
    }
}

fn unpaid(expire_at: Result<DateTime<Utc>, String>) -> OrderRow {
    OrderRow {
        status: "UNPAID".into(),
        deadline_version: 1,
        expire_at,
    }
}

#[test]
fn an_unreadable_deadline_parks_only_when_the_decision_needs_it() {
    let d = decider();
    let m = TimeoutMessage::new(7, now(), 1);
    let bad = || Err("order 7 has a deadline lapse cannot handle (-infinity)".to_string());
    let action = d.classify(&m, &snapshot(Ok(unpaid(bad()))), &mut HashSet::new());
    assert_eq!(
        action,
        Action::Park {
            reason: "order 7 has a deadline lapse cannot handle (-infinity)".into(),
            outcome: Outcome::Parked,
            kind: "bad_deadline",
        }
    );
    let stale = TimeoutMessage::new(7, now(), 2);
    let action = d.classify(&stale, &snapshot(Ok(unpaid(bad()))), &mut HashSet::new());
    assert_eq!(action, Action::Ack(Outcome::Stale));
    let paid = OrderRow {
        status: "PAID".into(),
        ..unpaid(bad())
    };
    let action = d.classify(&m, &snapshot(Ok(paid)), &mut HashSet::new());
    assert_eq!(action, Action::Ack(Outcome::Settled));
    let action = d.classify(&m, &snapshot(Err("order 7: x".into())), &mut HashSet::new());
    assert!(matches!(action, Action::Park { .. }), "{action:?}");
}

/// A message naming a shard this worker has no database for, and a body that does
/// not decode, are parked with the reason without asking any database (this
/// decider's only database is unreachable).
#[tokio::test]
async fn an_unknown_shard_and_an_undecodable_body_are_parked_with_the_reason() {
    let d = decider();
    let messages = [
        Ok(TimeoutMessage::new(7, now(), 1).in_shard(3)),
        TimeoutMessage::decode(b"{}"),
    ];
    let (actions, closed) = d.decide(&messages).await;
    assert!(closed.is_empty());
    let Action::Park {
        reason,
        outcome: Outcome::Parked,
        kind: "unknown_shard",
    } = &actions[0]
    else {
        panic!("expected an unknown_shard park, got {:?}", actions[0]);
    };
    assert!(
        reason.contains("shard 3") && reason.contains("1 order database(s)"),
        "{reason}"
    );
    assert!(
        matches!(
            &actions[1],
            Action::Park {
                kind: "undecodable",
                ..
            }
        ),
        "{:?}",
        actions[1]
    );
}

/// A shard whose schema is not migrated yet is away: its delivery takes the
/// database-away path (re-delayed with `attempt + 1`, parked after the last attempt
/// naming why) and nothing is read on its old schema (the reason would otherwise be
/// this decider's unreachable database).
#[tokio::test]
async fn a_shard_not_migrated_yet_is_away() {
    let mut d = decider();
    d.pools = d
        .pools
        .clone()
        .with_schemas(db::Schemas::with_pending(1, &[0]));
    let mut m = TimeoutMessage::new(7, now(), 1);
    let (actions, closed) = d.decide(&[Ok(m.clone())]).await;
    assert!(closed.is_empty());
    assert!(
        matches!(
            &actions[0],
            Action::Publish { outcome: Outcome::Retried, message, .. } if message.attempt == 1
        ),
        "{:?}",
        actions[0]
    );
    m.attempt = d.max_attempts;
    let (actions, _) = d.decide(&[Ok(m)]).await;
    let Action::Park {
        reason,
        kind: "database_unavailable",
        ..
    } = &actions[0]
    else {
        panic!("expected a database_unavailable park, got {:?}", actions[0]);
    };
    assert!(
        reason.contains("database.shards[0] is not migrated yet"),
        "{reason}"
    );
}

#[test]
fn counters_carried_in_messages_saturate() {
    let d = decider();
    let mut m = TimeoutMessage::new(7, now() + chrono::TimeDelta::seconds(30), 1);
    m.hops = u32::MAX;
    let action = d.classify(
        &m,
        &snapshot(Ok(unpaid(Ok(m.expire_at)))),
        &mut HashSet::new(),
    );
    let Action::Publish {
        message,
        reroute_after,
        ..
    } = action
    else {
        panic!("expected a re-delay, got {action:?}");
    };
    assert_eq!(message.hops, u32::MAX);
    // 30 s left, the 10s tier: another route once fewer than 10 s are left.
    assert_eq!(reroute_after, Some(Duration::from_secs(20)));

    m.attempt = u32::MAX;
    let error = DbError::Config("down".into());
    assert!(matches!(
        d.retry(&m, &error),
        Action::Park {
            outcome: Outcome::GaveUp,
            ..
        }
    ));
    m.attempt = 1;
    let Action::Publish {
        message,
        reroute_after: None,
        ..
    } = d.retry(&m, &error)
    else {
        panic!("expected a retry");
    };
    assert_eq!((message.attempt, message.hops), (2, u32::MAX));
}

/// What the order looks like to one row of the table, relative to [`now`].
enum Row {
    NoOrder,
    Status(&'static str),
    OtherVersion,
    Unreadable,
    /// UNPAID, same version, due in this many seconds (negative: overdue).
    DueIn(i64),
}

/// What the close of the batch did to the order (for due rows).
#[derive(Clone, Copy)]
enum Close {
    NotTried,
    ClosedByThisBatch,
    Locked,
    ChangedNothing,
}

fn shown(action: &Action) -> String {
    match action {
        Action::Ack(o) => format!("ack {}", o.as_str()),
        Action::Hold(d) => format!("hold {d:?}"),
        Action::Locked(d) => format!("locked {d:?}"),
        Action::Park { outcome, .. } => format!("park {}", outcome.as_str()),
        Action::Publish {
            route,
            message,
            outcome,
            ..
        } => format!(
            "publish {}/{} {} attempt={} hops={}",
            route.exchange,
            route.routing_key,
            outcome.as_str(),
            message.attempt,
            message.hops
        ),
    }
}

/// The decision table of docs/pipeline.md: one row per line of the table (tiers 1s
/// and 10s, `max_attempts` 3, `retry_backoff` 500 ms, `lock_retry` 500 ms).
// Over 60 lines on purpose: it walks the table of docs/pipeline.md in its order (the classified rows, the same message twice in a batch, the database-unavailable rows); the rows are the point, and split tests would scatter the table.
#[test]
fn the_decision_table() {
    let d = decider();
    let due = now() - chrono::TimeDelta::milliseconds(5);
    #[rustfmt::skip]
    let table: Vec<(&str, Row, Close, &str)> = vec![
        ("no such order",                   Row::NoOrder,         Close::NotTried,          "ack missing"),
        ("PAID",                            Row::Status("PAID"),  Close::NotTried,          "ack settled"),
        ("CLOSED",                          Row::Status("CLOSED"),Close::NotTried,          "ack settled"),
        ("deadline version differs",        Row::OtherVersion,    Close::NotTried,          "ack stale"),
        ("stored deadline unreadable",      Row::Unreadable,      Close::NotTried,          "park parked"),
        ("future, a tier fits",             Row::DueIn(30),       Close::NotTried,          "publish t.delay/10s redelayed attempt=0 hops=1"),
        ("future, a smaller tier fits",     Row::DueIn(5),        Close::NotTried,          "publish t.delay/1s redelayed attempt=0 hops=1"),
        ("future, below the smallest tier", Row::DueIn(0),        Close::NotTried,          "hold 0ns"),
        ("due, closed",                     Row::DueIn(-1),       Close::ClosedByThisBatch, "ack closed"),
        ("due, row locked elsewhere",       Row::DueIn(-1),       Close::Locked,            "locked 500ms"),
        ("due, the close changed nothing",  Row::DueIn(-1),       Close::ChangedNothing,    "ack raced"),
    ];
    for (case, row, close, expected) in table {
        let expire_at = match row {
            Row::DueIn(s) if s < 0 => due,
            Row::DueIn(s) => {
                now() + chrono::TimeDelta::seconds(s) + chrono::TimeDelta::milliseconds(400)
            }
            _ => now() + chrono::TimeDelta::seconds(30),
        };
        let m = TimeoutMessage::new(7, expire_at, 1);
        let order = match row {
            Row::NoOrder => None,
            Row::Status(status) => Some(OrderRow {
                status: status.into(),
                ..unpaid(Ok(expire_at))
            }),
            Row::OtherVersion => Some(OrderRow {
                deadline_version: 2,
                ..unpaid(Ok(expire_at))
            }),
            Row::Unreadable => Some(unpaid(Err(
                "order 7 has a deadline lapse cannot handle".into()
            ))),
            Row::DueIn(_) => Some(unpaid(Ok(expire_at))),
        };
        let mut snap = Snapshot {
            db_now: now(),
            orders: order.map(|o| (7, Ok(o))).into_iter().collect(),
            closed: Vec::new(),
            locked: HashSet::new(),
            ..Default::default()
        };
        let mut closed_ids = HashSet::new();
        match close {
            Close::NotTried | Close::ChangedNothing => {}
            Close::ClosedByThisBatch => {
                snap.closed.push(crate::close::Closed {
                    order_id: 7,
                    expire_at,
                    closed_at: now(),
                });
                closed_ids.insert(7);
            }
            Close::Locked => {
                snap.locked.insert(7);
            }
        }
        let action = d.classify(&m, &snap, &mut closed_ids);
        let shown = shown(&action);
        // The hold is the remaining time (400 ms here), whatever the exact nanoseconds.
        let shown = if shown.starts_with("hold ") {
            "hold 0ns".to_string()
        } else {
            shown
        };
        assert_eq!(shown, expected, "{case}");
        if let Action::Hold(after) = action {
            assert_eq!(after, Duration::from_millis(400), "{case}: held until due");
        }
    }

    // The same message twice in one batch: the second is settled, not closed twice.
    let m = TimeoutMessage::new(7, due, 1);
    let snap = Snapshot {
        db_now: now(),
        orders: HashMap::from([(7, Ok(unpaid(Ok(due))))]),
        closed: vec![crate::close::Closed {
            order_id: 7,
            expire_at: due,
            closed_at: now(),
        }],
        locked: HashSet::new(),
        ..Default::default()
    };
    let mut closed_ids = HashSet::from([7]);
    assert_eq!(shown(&d.classify(&m, &snap, &mut closed_ids)), "ack closed");
    assert_eq!(
        shown(&d.classify(&m, &snap, &mut closed_ids)),
        "ack settled",
        "duplicate"
    );

    // The database is unavailable: the tier nearest retry_backoff * 2^(attempt-1),
    // attempt+1, deadline unchanged; parked after max_attempts.
    let error = DbError::Config("down".into());
    #[rustfmt::skip]
    let retries: Vec<(u32, &str)> = vec![
        (0, "publish t.delay/1s retried attempt=1 hops=1"),
        (1, "publish t.delay/1s retried attempt=2 hops=1"),
        (2, "publish t.delay/1s retried attempt=3 hops=1"),
        (3, "park gave_up"),
    ];
    for (attempt, expected) in retries {
        let mut m = TimeoutMessage::new(7, now() + chrono::TimeDelta::seconds(30), 1);
        m.attempt = attempt;
        let action = d.retry(&m, &error);
        assert_eq!(shown(&action), expected, "attempt {attempt}");
        if let Action::Publish { message, .. } = action {
            assert_eq!(message.expire_at, m.expire_at);
            assert_eq!(message.deadline_version, m.deadline_version);
        }
    }
}

/// Undecodable bodies are parked without asking the database.
#[tokio::test]
async fn an_undecodable_body_is_parked() {
    let d = decider();
    let messages = vec![
        TimeoutMessage::decode(b"not json"),
        TimeoutMessage::decode(br#"{"v":99,"order_id":1}"#),
    ];
    let (actions, closed) = d.decide(&messages).await;
    assert!(closed.is_empty());
    let shown: Vec<String> = actions.iter().map(shown).collect();
    assert_eq!(shown, ["park parked", "park parked"]);
}

#[test]
fn a_kinds_deadline_follows_the_same_table_with_its_actions_verdict() {
    use crate::kinds::fire::{DeadlineRow, Verdict};
    let d = decider();
    let due = now() - chrono::Duration::milliseconds(5);
    let m = TimeoutMessage::for_deadline(7, "order_close", "SO-1", due, 2);
    let row = |state: &str, version: i32, expire_at: DateTime<Utc>| DeadlineRow {
        kind: "order_close".into(),
        key: "SO-1".into(),
        state: state.into(),
        version,
        expire_at: Ok(expire_at),
    };
    let decide = |row: Option<DeadlineRow>, verdict: Option<Verdict>| {
        let snap = Snapshot {
            db_now: now(),
            deadlines: row.map(|r| (7, Ok(r))).into_iter().collect(),
            verdicts: verdict.map(|v| (7, v)).into_iter().collect(),
            ..Default::default()
        };
        shown(&d.classify_deadline(&m, &snap, &mut HashSet::new()))
    };
    let fired = Verdict::Fired {
        expire_at: due,
        fired_at: now(),
    };
    assert_eq!(decide(None, None), "ack missing");
    assert_eq!(decide(Some(row("pending", 1, due)), None), "ack stale");
    assert_eq!(decide(Some(row("fired", 2, due)), None), "ack settled");
    assert_eq!(decide(Some(row("cancelled", 2, due)), None), "ack settled");
    assert_eq!(
        decide(Some(row("pending", 2, due)), Some(fired)),
        "ack closed"
    );
    assert_eq!(
        decide(Some(row("pending", 2, due)), Some(Verdict::Nothing)),
        "ack raced"
    );
    assert!(decide(Some(row("pending", 2, due)), Some(Verdict::Locked)).starts_with("locked"));
    assert!(
        decide(
            Some(row("pending", 2, due)),
            Some(Verdict::Park("the action changed 3 rows".into()))
        )
        .starts_with("park parked")
    );
    let later = now() + chrono::Duration::milliseconds(400);
    assert!(decide(Some(row("pending", 2, later)), None).starts_with("hold"));
    let mut other_kind = row("pending", 2, due);
    other_kind.kind = "auto_confirm".into();
    assert!(decide(Some(other_kind), None).starts_with("park parked"));
}

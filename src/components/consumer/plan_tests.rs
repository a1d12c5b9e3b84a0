use super::*;
use crate::message::{PARK_REASON_HEADER, Route, park_reason};
use crate::tier::TierSet;

fn tier(s: &str) -> Tier {
    Tier::parse(s).unwrap()
}

fn message(id: i64) -> TimeoutMessage {
    let at = chrono::Utc::now() + chrono::TimeDelta::seconds(60);
    TimeoutMessage::new(id, at, 1)
}

fn redelay(names: &Names, to: &str, id: i64) -> Action {
    let tiers = TierSet::new(vec![tier(to)]);
    Action::Publish {
        route: Route::tier(names, tiers.smallest()),
        message: message(id),
        outcome: Outcome::Redelayed,
        reroute_after: Some(Duration::from_secs(50)),
    }
}

fn delivery(entries: &[Entry]) -> Delivery {
    let bodies: Vec<&[u8]> = entries.iter().map(|e| e.body.as_slice()).collect();
    Delivery::mock(0, "t.due".into(), "due".into(), false, pack::body(&bodies))
}

/// A one-entry delivery's plan as one line, for the table below.
fn shown(plan: &Plan) -> String {
    let d = &plan.deliveries[0];
    let mut parts: Vec<String> = d
        .settled
        .iter()
        .map(|o| format!("ack {}", o.as_str()))
        .collect();
    for a in &d.again {
        parts.push(match &a.kept {
            None => format!(
                "hold {:?} {}",
                a.after.unwrap_or_default(),
                a.outcome.as_str()
            ),
            Some(missing) => format!(
                "keep {:?} missing={}",
                a.after.unwrap_or_default(),
                missing.as_deref().unwrap_or("-")
            ),
        });
    }
    for p in &plan.publishes {
        let mut s = format!(
            "publish {}/{} {}",
            p.message.exchange,
            p.message.routing_key,
            p.members[0].outcome.as_str()
        );
        if let Some(kind) = p.park {
            s += &format!(" park={kind}");
        }
        for hop in &p.hops {
            s += &format!(" hop={}", hop.tier);
        }
        parts.push(s);
    }
    parts.join("; ")
}

/// Every action, with every answer of the tier check, and what it becomes for a
/// delivery of one entry (as before packs).
#[test]
fn each_action_becomes_its_step() {
    let names = Names::new("t");
    let entry = Entry {
        body: b"{}".to_vec(),
        message: Err(crate::message::DecodeError::Malformed("test".into())),
    };
    let one = vec![entry.clone()];
    let batch = [Delivery::mock(
        0,
        "t.due".into(),
        "due".into(),
        false,
        b"{}".to_vec(),
    )];
    let none = Tiers::Missing(BTreeSet::new());
    let ten_missing = Tiers::Missing(BTreeSet::from([tier("10s")]));
    let five_missing = Tiers::Missing(BTreeSet::from([tier("5s")]));
    let park = |outcome, kind| Action::Park {
        reason: "why".into(),
        outcome,
        kind,
    };
    let ms = Duration::from_millis;
    #[rustfmt::skip]
    let table: Vec<(&str, Action, &Tiers, &str)> = vec![
        ("settled",            Action::Ack(Outcome::Settled), &none, "ack settled"),
        ("closed",             Action::Ack(Outcome::Closed),  &none, "ack closed"),
        ("short remainder",    Action::Hold(ms(300)),         &none, "hold 300ms held"),
        ("row locked",         Action::Locked(ms(500)),       &none, "hold 500ms locked"),
        ("tier exists",        redelay(&names, "10s", 7),     &none, "publish t.delay/10s redelayed hop=10s"),
        ("other tier missing", redelay(&names, "10s", 7),     &five_missing, "publish t.delay/10s redelayed hop=10s"),
        ("tier missing",       redelay(&names, "10s", 7),     &ten_missing, "keep 50s missing=t.wait.10s"),
        ("tier check failed",  redelay(&names, "10s", 7),     &Tiers::Unknown, "keep 50s missing=-"),
        ("undecodable",        park(Outcome::Parked, "undecodable"),  &none, "publish t.parked/ parked park=undecodable"),
        ("bad deadline",       park(Outcome::Parked, "bad_deadline"), &none, "publish t.parked/ parked park=bad_deadline"),
        ("unknown shard",      park(Outcome::Parked, "unknown_shard"), &none, "publish t.parked/ parked park=unknown_shard"),
        ("gave up",            park(Outcome::GaveUp, "database_unavailable"), &Tiers::Unknown, "publish t.parked/ gave_up park=database_unavailable"),
    ];
    for (case, action, tiers, expected) in table {
        let plan = plan(
            &batch,
            std::slice::from_ref(&one),
            vec![Vec::new()],
            vec![action],
            &names,
            tiers,
            100,
        );
        assert_eq!(shown(&plan), expected, "{case}");
        for p in plan.publishes.iter().filter(|p| p.park.is_some()) {
            assert_eq!(
                park_reason(p.message.properties.headers().as_ref()).as_deref(),
                Some("why"),
                "{case}: a parked copy carries {PARK_REASON_HEADER}"
            );
            assert_eq!(p.message.body, b"{}", "{case}: the original body is parked");
        }
        if !plan.publishes.is_empty() {
            assert_eq!(plan.deliveries[0].publishes, vec![0], "{case}");
        }
    }
}

/// Re-delays of a batch that share a route leave as packs of at most `pack_max`,
/// across deliveries; other routes and parked entries leave apart.
#[test]
fn entries_sharing_a_route_leave_as_packs_and_parked_ones_alone() {
    let names = Names::new("t");
    let entries_a: Vec<Entry> = (1..=3).map(|i| Entry::of(message(i))).collect();
    let entries_b: Vec<Entry> = (4..=6).map(|i| Entry::of(message(i))).collect();
    let batch = [delivery(&entries_a), delivery(&entries_b)];
    let park = Action::Park {
        reason: "bad".into(),
        outcome: Outcome::Parked,
        kind: "bad_deadline",
    };
    let actions = vec![
        redelay(&names, "10s", 1),
        redelay(&names, "5s", 2),
        park,
        redelay(&names, "10s", 4),
        Action::Hold(Duration::from_millis(200)),
        redelay(&names, "10s", 6),
    ];
    let none = Tiers::Missing(BTreeSet::new());
    let waiting = vec![
        Vec::new(),
        vec![Waiting {
            body: b"later".to_vec(),
            after: Duration::from_millis(70),
            deferred: false,
        }],
    ];
    let plan = plan(
        &batch,
        &[entries_a.clone(), entries_b.clone()],
        waiting,
        actions,
        &names,
        &none,
        2,
    );
    let shown: Vec<(String, Vec<i64>)> = plan
        .publishes
        .iter()
        .map(|p| {
            let ids = pack::unpack(&p.message.body)
                .into_iter()
                .map(|e| e.message.unwrap().order_id)
                .collect();
            (p.message.routing_key.clone(), ids)
        })
        .collect();
    assert_eq!(
        shown,
        vec![
            (String::new(), vec![3]),
            ("10s".into(), vec![1, 4]),
            ("10s".into(), vec![6]),
            ("5s".into(), vec![2]),
        ]
    );
    // The parked entry is its own body, with its own message id.
    assert_eq!(plan.publishes[0].message.body, entries_a[2].body);
    assert_eq!(
        plan.publishes[0].message.properties.message_id(),
        message(3).properties().message_id()
    );
    assert_eq!(plan.deliveries[0].publishes, vec![0, 1, 3]);
    assert_eq!(plan.deliveries[1].publishes, vec![1, 2]);
    // The entry left waiting comes first, then the one the decision held.
    assert_eq!(plan.deliveries[1].again.len(), 2);
    assert_eq!(plan.deliveries[1].again[0].body, b"later");
    assert_eq!(
        plan.deliveries[1].again[0].after,
        Some(Duration::from_millis(70))
    );
    assert_eq!(plan.deliveries[1].again[1].body, entries_b[1].body);
    assert!(
        plan.publishes[1]
            .members
            .iter()
            .map(|m| (m.delivery, m.body.clone()))
            .eq([
                (0, entries_a[0].body.clone()),
                (1, entries_b[0].body.clone())
            ])
    );
    assert_eq!(plan.publishes[1].hops.len(), 2);
}

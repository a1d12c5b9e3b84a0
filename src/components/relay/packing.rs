//! The relay's packs: the timeouts of a round whose first hop is the same route and
//! whose deadlines lie within `packs.window` of the pack's earliest leave as one
//! message (docs/pipeline.md, "Packs"). Every entry's own plan chose that route, so
//! none is early; the worker decides each entry alone when the pack arrives.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::amqp::broker::Outgoing;
use crate::message::TimeoutMessage;
use crate::pack;

use super::outgoing::RowPublish;

/// The messages to publish for `ready`, each with the rows it carries: rows that are
/// no timeout (events, parked rows) alone, timeouts packed per route and window.
pub(super) fn packs<'a>(
    ready: Vec<&'a RowPublish>,
    window: Duration,
    max: usize,
) -> Vec<(Outgoing, Vec<&'a RowPublish>)> {
    let mut out = Vec::new();
    let mut routes: BTreeMap<(String, String), Vec<(&'a RowPublish, &'a TimeoutMessage)>> =
        BTreeMap::new();
    for row in ready {
        match &row.timeout {
            Some(t) if max > 1 => routes
                .entry((
                    row.message.exchange.clone(),
                    row.message.routing_key.clone(),
                ))
                .or_default()
                .push((row, t)),
            _ => out.push((row.message.clone(), vec![row])),
        }
    }
    let window = chrono::Duration::from_std(window).unwrap_or(chrono::Duration::MAX);
    for (_, mut rows) in routes {
        rows.sort_by_key(|(_, t)| t.expire_at);
        let mut start = 0;
        while start < rows.len() {
            let first = rows[start].1.expire_at;
            let end = (start..rows.len())
                .take(max)
                .take_while(|i| rows[*i].1.expire_at - first <= window)
                .last()
                .map_or(start + 1, |i| i + 1);
            out.push(message(&rows[start..end]));
            start = end;
        }
    }
    out
}

/// One message for `rows` (a single row's own, or a pack).
fn message<'a>(rows: &[(&'a RowPublish, &'a TimeoutMessage)]) -> (Outgoing, Vec<&'a RowPublish>) {
    let members: Vec<&RowPublish> = rows.iter().map(|(r, _)| *r).collect();
    if let [(row, _)] = rows {
        return (row.message.clone(), members);
    }
    let bodies: Vec<&[u8]> = rows
        .iter()
        .map(|(r, _)| r.message.body.as_slice())
        .collect();
    let timeouts: Vec<&TimeoutMessage> = rows.iter().map(|(_, t)| *t).collect();
    let first = &rows[0].0.message;
    (
        Outgoing::new(
            first.exchange.clone(),
            first.routing_key.clone(),
            pack::body(&bodies),
            pack::properties(&timeouts),
        ),
        members,
    )
}

#[cfg(test)]
mod tests {
    use super::super::Source;
    use super::*;
    use chrono::{DateTime, Utc};

    fn row(id: i64, routing_key: &str, expire_at: DateTime<Utc>) -> RowPublish {
        let t = TimeoutMessage::new(id, expire_at, 1);
        RowPublish {
            outbox_id: id,
            source: Source::Outbox,
            message: Outgoing::new("t.delay", routing_key, t.encode(), t.properties()),
            hop: None,
            attempts: 0,
            tier: None,
            reroute_after: None,
            shop_exchange: None,
            timeout: Some(t),
        }
    }

    #[test]
    fn timeouts_of_one_route_within_the_window_share_a_message() {
        let t0 = Utc::now();
        let ms = chrono::Duration::milliseconds;
        let event = RowPublish {
            timeout: None,
            ..row(9, "x", t0)
        };
        let rows = [
            row(1, "10s", t0 + ms(100)),
            row(2, "10s", t0),
            row(3, "5s", t0),
            row(4, "10s", t0 + ms(250)),
            row(5, "10s", t0 + ms(251)),
            row(6, "10s", t0 + ms(260)),
            row(7, "10s", t0 + ms(270)),
            event,
        ];
        let out = packs(rows.iter().collect(), Duration::from_millis(250), 3);
        let shown: Vec<(String, Vec<i64>)> = out
            .iter()
            .map(|(m, members)| {
                let ids = members.iter().map(|r| r.outbox_id).collect::<Vec<_>>();
                let carried: Vec<i64> = pack::unpack(&m.body)
                    .into_iter()
                    .map(|e| e.message.map(|m| m.order_id).unwrap_or(-1))
                    .collect();
                if members[0].timeout.is_some() {
                    assert_eq!(ids, carried, "the body carries exactly its rows");
                }
                (m.routing_key.clone(), ids)
            })
            .collect();
        assert_eq!(
            shown,
            vec![
                ("x".into(), vec![9]),
                ("10s".into(), vec![2, 1, 4]),
                ("10s".into(), vec![5, 6, 7]),
                ("5s".into(), vec![3]),
            ]
        );
        // A single row goes as it always did; a pack is planned on its earliest entry.
        assert_eq!(out[3].0.body, rows[2].message.body);
        assert_eq!(
            out[1].0.properties.message_id().as_ref().unwrap().as_str(),
            "pack-order-2-v1-n3"
        );
        // Packs off: every row alone.
        assert_eq!(
            packs(rows.iter().collect(), Duration::from_secs(1), 1).len(),
            rows.len()
        );
    }
}

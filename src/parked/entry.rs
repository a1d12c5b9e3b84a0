//! What one parked message is: its stable ID, kind, order, deadline, version,
//! attempts, why it was parked and when — read from its body and headers alone.
//!
//! The ID is derived, never stored, so it is the same for messages parked by any
//! version of lapse, by the broker (dead-lettered over a delivery limit) or by the
//! delay exchange's alternate route, and every copy of one message shares it:
//! `timeout-<order>-v<version>` for a timeout, `pack-<earliest entry's message id>-n<entries>-<8
//! hex digits>` for a pack, `release-<order>` for a stock-release event,
//! `raw-<16 hex digits>` (a hash of the body) for a body lapse cannot read.

use chrono::{DateTime, SecondsFormat, TimeZone, Utc};
use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::amqp::redelivery::returns_so_far;
use crate::message::{
    PARK_CAUSE_HEADER, PARKED_AT_HEADER, TimeoutMessage, header_text, park_reason,
};
use crate::names::Names;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A timeout message: replayed to its wait tier or the due queue.
    Timeout,
    /// A stock-release event: replayed to `<P>.stock.release`.
    Release,
    /// A body lapse cannot read: shown and purged, never replayed.
    Unreadable,
}

/// Who gave the reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReasonSource {
    /// The `x-lapse-park-reason` header lapse sets when it parks.
    Lapse,
    /// The broker's dead-lettering headers (`x-first-death-reason`, `x-death`).
    Broker,
    /// Recognised by lapse: published to `<P>.delay` for a tier without a queue, so
    /// the delay exchange's alternate route put it in parked with no header at all.
    Unroutable,
    /// None of the above.
    Unknown,
}

/// One parked message as the operator sees it.
#[derive(Clone, Debug, Serialize)]
pub struct Entry {
    pub id: String,
    pub kind: Kind,
    pub order_id: Option<i64>,
    /// The order database (`database.shards` index) a timeout or release belongs to;
    /// `None` (JSON `null`) for a body lapse cannot read: its shard is unknown, not 0.
    pub shard: Option<u16>,
    pub deadline: Option<DateTime<Utc>>,
    pub deadline_version: Option<i32>,
    /// A timeout's database retries; otherwise the returns counted by lapse and the broker.
    pub attempts: u32,
    pub reason: String,
    /// One word for the reason, what `lapse parked counts` groups by: the cause lapse
    /// named when it parked (`undecodable`, `database_unavailable`, ...), the broker's
    /// as `broker_<reason>` (`broker_delivery_limit`), `unroutable`, or `lapse` /
    /// `unknown` for messages parked without one.
    pub cause: String,
    pub reason_source: ReasonSource,
    pub parked_at: Option<DateTime<Utc>>,
    /// The exchange and routing key it was last published with.
    pub exchange: String,
    pub routing_key: String,
    /// The timeout (a pack's earliest entry, what a replay is routed on).
    #[serde(skip)]
    pub timeout: Option<TimeoutMessage>,
    /// Every entry when the body is a pack (empty for a single message): a pack
    /// parked whole (by the broker's delivery limit, a worker older than packs) is
    /// replayed whole, and the worker then decides each entry alone.
    #[serde(skip)]
    pub pack: Vec<TimeoutMessage>,
}

impl Entry {
    // Over 60 lines on purpose: decodes one parked message header by header; each header is a few lines.
    pub fn read(delivery: &Delivery, names: &Names) -> Self {
        let properties = &delivery.properties;
        let headers = properties.headers().as_ref();
        let body = &delivery.data;
        let (timeout, pack) = timeouts(body);
        let release = if timeout.is_none() {
            release_order(body, properties.message_id().as_ref().map(|m| m.as_str()))
        } else {
            None
        };
        // Ids name the shard like message ids do (order ids repeat across shards).
        let (id, kind, shard) = match (&timeout, release) {
            (Some(m), _) if !pack.is_empty() => (
                // Its contents named too: two packs of one size may share an earliest entry.
                format!(
                    "pack-{}-n{}-{:08x}",
                    m.message_id(),
                    pack.len(),
                    fnv1a(body) as u32
                ),
                Kind::Timeout,
                Some(m.shard),
            ),
            // A kind's deadline is named as its message is (its id is not an order's).
            (Some(m), _) if m.deadline().is_some() => (
                sharded(
                    m.shard,
                    format!("deadline-{}-v{}", m.order_id, m.deadline_version),
                ),
                Kind::Timeout,
                Some(m.shard),
            ),
            (Some(m), _) => (
                sharded(
                    m.shard,
                    format!("timeout-{}-v{}", m.order_id, m.deadline_version),
                ),
                Kind::Timeout,
                Some(m.shard),
            ),
            (None, Some((order, shard))) => (
                sharded(shard, format!("release-{order}")),
                Kind::Release,
                Some(shard),
            ),
            (None, None) => (format!("raw-{:016x}", fnv1a(body)), Kind::Unreadable, None),
        };
        let exchange = delivery.exchange.to_string();
        let routing_key = delivery.routing_key.to_string();
        let unroutable = exchange == names.delay_exchange();
        let (reason, reason_source) = if let Some(r) = park_reason(headers) {
            (r, ReasonSource::Lapse)
        } else if let Some(r) = broker_reason(headers) {
            (r, ReasonSource::Broker)
        } else if unroutable {
            (
                format!(
                    "unroutable: tier {routing_key} has no wait queue ({}{routing_key} missing); \
                     the delay exchange's alternate route parked it",
                    names.wait_queue_prefix()
                ),
                ReasonSource::Unroutable,
            )
        } else {
            ("unknown: no reason header".into(), ReasonSource::Unknown)
        };
        let cause = match reason_source {
            ReasonSource::Lapse => header_text(headers, PARK_CAUSE_HEADER)
                .filter(|c| !c.trim().is_empty())
                .unwrap_or_else(|| "lapse".into()),
            ReasonSource::Broker => format!(
                "broker_{}",
                header_text(headers, "x-first-death-reason")
                    .or_else(|| death_field(headers, "reason"))
                    .unwrap_or_else(|| "unknown".into())
            ),
            ReasonSource::Unroutable => "unroutable".into(),
            ReasonSource::Unknown => "unknown".into(),
        };
        let parked_at = header_text(headers, PARKED_AT_HEADER)
            .and_then(|t| DateTime::parse_from_rfc3339(&t).ok())
            .map(|t| t.with_timezone(&Utc))
            .or_else(|| last_death_time(headers))
            .or_else(|| {
                (reason_source == ReasonSource::Unroutable)
                    .then(|| published_at(properties))
                    .flatten()
            });
        Self {
            id,
            kind,
            order_id: timeout
                .as_ref()
                .filter(|m| m.deadline().is_none())
                .map(|m| m.order_id)
                .or(release.map(|(order, _)| order)),
            shard,
            deadline: timeout.as_ref().map(|m| m.expire_at),
            deadline_version: timeout.as_ref().map(|m| m.deadline_version),
            attempts: timeout
                .as_ref()
                .map_or_else(|| returns_so_far(properties), |m| m.attempt),
            reason,
            cause,
            reason_source,
            parked_at,
            exchange,
            routing_key,
            timeout,
            pack,
        }
    }

    /// True when `needle` occurs in the reason, ignoring case.
    pub fn reason_matches(&self, needle: &str) -> bool {
        self.reason.to_lowercase().contains(&needle.to_lowercase())
    }
}

/// The timeout a body carries, and every entry when it is a pack whose entries all
/// decode: the earliest entry is the one a replay is routed on. A pack with an entry
/// that does not decode is no timeout (shown, never replayed).
pub fn timeouts(body: &[u8]) -> (Option<TimeoutMessage>, Vec<TimeoutMessage>) {
    let carried: Vec<TimeoutMessage> = match crate::pack::unpack(body)
        .into_iter()
        .map(|e| e.message)
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(all) => all,
        Err(_) => return (None, Vec::new()),
    };
    let earliest = carried.iter().min_by_key(|m| m.expire_at).cloned();
    match carried.len() {
        1 => (earliest, Vec::new()),
        _ => (earliest, carried),
    }
}

/// `s<k>-<id>` for shard `k` > 0, `<id>` for shard 0.
pub fn sharded(shard: u16, id: String) -> String {
    match shard {
        0 => id,
        k => format!("s{k}-{id}"),
    }
}

/// The order of a stock-release event: a body `{"order_id": N, "lines": [...]}` as the
/// close writes it, or any body with an integer `order_id` published as `release-N`
/// (`s<k>-release-N` in shard `k`). Anything else (say, an outbox row the relay
/// parked as "not a timeout intent") is not a release, so replay never turns it into
/// one.
///
/// Also its shard: 0 when the body names none; a shard that is not a small integer
/// makes the event unreadable rather than shard 0.
fn release_order(body: &[u8], message_id: Option<&str>) -> Option<(i64, u16)> {
    let Value::Object(fields) = serde_json::from_slice::<Value>(body).ok()? else {
        return None;
    };
    let order = fields.get("order_id")?.as_i64()?;
    let shard = match fields.get("shard") {
        None => 0,
        Some(v) => u16::try_from(v.as_u64()?).ok()?,
    };
    let named = message_id == Some(sharded(shard, format!("release-{order}")).as_str());
    ((fields.contains_key("lines") || named) && !fields.contains_key("expire_at"))
        .then_some((order, shard))
}

/// 64-bit FNV-1a: stable across runs and versions (unlike the std hasher).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The broker's reason on a message it dead-lettered, with the queue it left.
fn broker_reason(headers: Option<&FieldTable>) -> Option<String> {
    let reason =
        header_text(headers, "x-first-death-reason").or_else(|| death_field(headers, "reason"))?;
    let queue =
        header_text(headers, "x-first-death-queue").or_else(|| death_field(headers, "queue"));
    Some(match queue {
        Some(q) => format!("broker: {reason} in {q}"),
        None => format!("broker: {reason}"),
    })
}

fn last_death(headers: Option<&FieldTable>) -> Option<&FieldTable> {
    match headers?.inner().get("x-death")? {
        AMQPValue::FieldArray(deaths) => match deaths.as_slice().first()? {
            AMQPValue::FieldTable(t) => Some(t),
            _ => None,
        },
        _ => None,
    }
}

fn death_field(headers: Option<&FieldTable>, key: &str) -> Option<String> {
    header_text(last_death(headers), key)
}

fn last_death_time(headers: Option<&FieldTable>) -> Option<DateTime<Utc>> {
    match last_death(headers)?.inner().get("time")? {
        AMQPValue::Timestamp(secs) => Utc.timestamp_opt(i64::try_from(*secs).ok()?, 0).single(),
        _ => None,
    }
}

fn published_at(properties: &BasicProperties) -> Option<DateTime<Utc>> {
    let secs = i64::try_from((*properties.timestamp())?).ok()?;
    Utc.timestamp_opt(secs, 0).single()
}

pub fn rfc3339(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Headers as JSON, for `parked show` (strings as text, timestamps as RFC 3339).
pub fn headers_json(headers: Option<&FieldTable>) -> Value {
    let mut out = Map::new();
    for (k, v) in headers.map(|h| h.inner().iter()).into_iter().flatten() {
        out.insert(k.to_string(), value_json(v));
    }
    Value::Object(out)
}

fn value_json(v: &AMQPValue) -> Value {
    if let Some(n) = crate::message::int_value(v) {
        return n.into();
    }
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::Float(n) => (*n).into(),
        AMQPValue::Double(n) => (*n).into(),
        AMQPValue::ShortString(s) => s.to_string().into(),
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned().into(),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(value_json).collect()),
        AMQPValue::FieldTable(t) => headers_json(Some(t)),
        AMQPValue::Timestamp(secs) => i64::try_from(*secs)
            .ok()
            .and_then(|s| Utc.timestamp_opt(s, 0).single())
            .map_or(Value::Null, |t| rfc3339(t).into()),
        other => format!("{other:?}").into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_and_distinguish_kinds() {
        assert_eq!(
            release_order(br#"{"order_id": 7, "lines": []}"#, None),
            Some((7, 0))
        );
        assert_eq!(
            release_order(br#"{"order_id": 7}"#, Some("release-7")),
            Some((7, 0))
        );
        assert_eq!(
            release_order(br#"{"order_id": 7, "shard": 3}"#, Some("s3-release-7")),
            Some((7, 3))
        );
        // A shard that is not a small integer: unreadable, never shard 0.
        assert_eq!(
            release_order(br#"{"order_id": 7, "lines": [], "shard": -1}"#, None),
            None
        );
        assert_eq!(
            release_order(br#"{"order_id": 7, "lines": [], "shard": 70000}"#, None),
            None
        );
        assert_eq!(
            release_order(br#"{"order_id": 7}"#, Some("release-8")),
            None
        );
        assert_eq!(
            release_order(br#"{"order_id": 7, "deadline_version": 1}"#, None),
            None,
            "an intent without a deadline is not a release"
        );
        assert_eq!(
            release_order(
                br#"{"v":1,"order_id":7,"expire_at":"x","deadline_version":1,"lines":[]}"#,
                None
            ),
            None
        );
        assert_eq!(release_order(b"not json", Some("release-7")), None);
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    /// An unreadable body's shard is unknown: `null` in `--json`, never shard 0 (which
    /// would send an operator to the wrong database); a readable one has its shard.
    #[test]
    fn an_unreadable_body_has_no_shard() {
        let names = Names::new("t");
        let read = |body: &[u8]| {
            let d = Delivery::mock(0, "t.parked".into(), "".into(), false, body.to_vec());
            Entry::read(&d, &names)
        };
        let raw = read(b"\xff garbage");
        assert_eq!(raw.kind, Kind::Unreadable);
        assert_eq!(raw.shard, None);
        let json = serde_json::to_value(&raw).unwrap();
        assert_eq!(json.get("shard"), Some(&Value::Null), "{json}");
        let release = read(br#"{"order_id": 7, "lines": []}"#);
        assert_eq!((release.kind, release.shard), (Kind::Release, Some(0)));
        assert_eq!(serde_json::to_value(&release).unwrap()["shard"], 0);
    }

    #[test]
    fn the_broker_reason_names_the_queue() {
        let mut death = FieldTable::default();
        death.insert(
            "reason".into(),
            AMQPValue::LongString("delivery_limit".into()),
        );
        death.insert("queue".into(), AMQPValue::LongString("p.due".into()));
        death.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
        let mut headers = FieldTable::default();
        headers.insert(
            "x-death".into(),
            AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
        );
        assert_eq!(
            broker_reason(Some(&headers)).as_deref(),
            Some("broker: delivery_limit in p.due")
        );
        assert_eq!(
            last_death_time(Some(&headers)).map(rfc3339).as_deref(),
            Some("2023-11-14T22:13:20.000Z")
        );
        assert_eq!(broker_reason(None), None);
    }
}

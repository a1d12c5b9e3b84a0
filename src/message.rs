//! The timeout message: what travels through the tiers, how it is encoded, and where
//! it is routed next.
//!
//! Invariant: every hop carries the same `expire_at` and `deadline_version`; only
//! `attempt` (database retries) and `hops` change. The message is a reminder; the
//! database decides.

use chrono::{DateTime, Duration as ChronoDuration, Utc};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use serde::{Deserialize, Serialize};

use crate::names::{DUE_ROUTING_KEY, Names};
use crate::tier::{NextHop, Tier, TierSet};

pub const MESSAGE_VERSION: u32 = 1;
/// The version of a timeout for a deadline of a kind (`kind`, `key`; `order_id` is the
/// deadline's id in `lapse.deadlines`). A worker older than kinds parks it as an
/// unknown version instead of reading it as an order.
pub const KIND_MESSAGE_VERSION: u32 = 2;
/// Header set on messages the worker parks.
pub const PARK_REASON_HEADER: &str = "x-lapse-park-reason";
/// One word for why (`undecodable`, `unknown_shard`, `database_unavailable`, ...): what
/// `lapse parked counts` groups by, the same word as `lapse_parked_total{reason}`.
pub const PARK_CAUSE_HEADER: &str = "x-lapse-park-cause";
/// Header set on messages lapse parks: when (RFC 3339, UTC), for `lapse parked list`.
pub const PARKED_AT_HEADER: &str = "x-lapse-parked-at";

/// A timeout for one (order, deadline version).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimeoutMessage {
    pub v: u32,
    pub order_id: i64,
    #[serde(with = "millis")]
    pub expire_at: DateTime<Utc>,
    pub deadline_version: i32,
    /// Database retries so far.
    #[serde(default)]
    pub attempt: u32,
    /// Wait-queue publishes so far.
    #[serde(default)]
    pub hops: u32,
    /// The order database (shard) the order lives in: `database.shards[shard]`. 0, the
    /// only database without shards, is left out of the body, so a single database's
    /// messages are what they always were.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shard: u16,
    /// The deadline's kind (version 2 only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The deadline's key in its kind, as text (version 2 only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

fn is_zero(shard: &u16) -> bool {
    *shard == 0
}

/// Why a body is not a timeout message.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("body is not a JSON timeout message: {0}")]
    Malformed(String),
    #[error(
        "unknown message version {0} (this worker understands {MESSAGE_VERSION} and {KIND_MESSAGE_VERSION})"
    )]
    UnknownVersion(u64),
}

#[derive(Deserialize)]
struct VersionOnly {
    v: u64,
}

impl TimeoutMessage {
    pub fn new(order_id: i64, expire_at: DateTime<Utc>, deadline_version: i32) -> Self {
        Self {
            v: MESSAGE_VERSION,
            order_id,
            expire_at,
            deadline_version,
            attempt: 0,
            hops: 0,
            shard: 0,
            kind: None,
            key: None,
        }
    }

    /// A timeout for the deadline `id` of `kind` and `key` (version 2).
    pub fn for_deadline(
        id: i64,
        kind: &str,
        key: &str,
        expire_at: DateTime<Utc>,
        version: i32,
    ) -> Self {
        Self {
            v: KIND_MESSAGE_VERSION,
            kind: Some(kind.to_string()),
            key: Some(key.to_string()),
            ..Self::new(id, expire_at, version)
        }
    }

    /// The kind and key of a deadline's timeout; `None` for an order's.
    pub fn deadline(&self) -> Option<(&str, &str)> {
        Some((self.kind.as_deref()?, self.key.as_deref()?))
    }

    /// The same timeout, for an order of `shard`.
    pub fn in_shard(mut self, shard: u16) -> Self {
        self.shard = shard;
        self
    }

    pub fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        let version: VersionOnly =
            serde_json::from_slice(body).map_err(|e| DecodeError::Malformed(e.to_string()))?;
        if version.v != u64::from(MESSAGE_VERSION) && version.v != u64::from(KIND_MESSAGE_VERSION) {
            return Err(DecodeError::UnknownVersion(version.v));
        }
        let m: Self =
            serde_json::from_slice(body).map_err(|e| DecodeError::Malformed(e.to_string()))?;
        let is_deadline = m.v == KIND_MESSAGE_VERSION;
        if is_deadline != m.deadline().is_some()
            || is_deadline != m.kind.is_some()
            || is_deadline != m.key.is_some()
        {
            return Err(DecodeError::Malformed(format!(
                "a version {} timeout {} kind and key",
                m.v,
                if is_deadline { "needs both" } else { "has no" }
            )));
        }
        Ok(m)
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a timeout message always serialises")
    }

    /// Stable per (shard, order, deadline version): duplicates share it. Shard 0 is
    /// not named (a single database's ids are what they always were).
    pub fn message_id(&self) -> String {
        if self.deadline().is_some() {
            return match self.shard {
                0 => format!("deadline-{}-v{}", self.order_id, self.deadline_version),
                s => format!("s{s}-deadline-{}-v{}", self.order_id, self.deadline_version),
            };
        }
        match self.shard {
            0 => format!("order-{}-v{}", self.order_id, self.deadline_version),
            s => format!("s{s}-order-{}-v{}", self.order_id, self.deadline_version),
        }
    }

    pub fn properties(&self) -> BasicProperties {
        BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type(ShortString::from("application/json"))
            .with_message_id(ShortString::from(self.message_id()))
            // When it was published: for a publish the delay exchange's alternate route
            // parks (a tier without a queue), also when it was parked.
            .with_timestamp(Utc::now().timestamp().try_into().unwrap_or_default())
    }

    /// Time left until the deadline by the database clock (zero once passed).
    pub fn remaining(&self, db_now: DateTime<Utc>) -> std::time::Duration {
        (self.expire_at - db_now)
            .max(ChronoDuration::zero())
            .to_std()
            .unwrap_or_default()
    }
}

/// Where to publish a timeout next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub exchange: String,
    pub routing_key: String,
    /// The wait tier, or `None` when it goes straight to the due queue.
    pub tier: Option<Tier>,
}

impl Route {
    /// The tier rule (docs/pipeline.md): a wait tier when one fits, else straight to the due
    /// queue (the worker waits out a remainder shorter than the smallest tier).
    pub fn for_remaining(
        names: &Names,
        tiers: &TierSet,
        remaining: std::time::Duration,
        tolerance: std::time::Duration,
    ) -> Self {
        match tiers.next_hop(remaining, tolerance) {
            NextHop::Wait(tier) => Self::tier(names, tier),
            NextHop::Hold(_) | NextHop::Due => Self {
                exchange: names.due_exchange(),
                routing_key: DUE_ROUTING_KEY.to_string(),
                tier: None,
            },
        }
    }

    /// Like [`Route::for_remaining`], with the hop-bounding slack capped by `cap`
    /// (see [`TierSet::planned_hop`]).
    pub fn planned(
        names: &Names,
        tiers: &TierSet,
        remaining: std::time::Duration,
        slack: std::time::Duration,
        cap: std::time::Duration,
    ) -> Self {
        match tiers.planned_hop(remaining, slack, cap) {
            NextHop::Wait(tier) => Self::tier(names, tier),
            NextHop::Hold(_) | NextHop::Due => Self::due(names),
        }
    }

    fn due(names: &Names) -> Self {
        Self {
            exchange: names.due_exchange(),
            routing_key: DUE_ROUTING_KEY.to_string(),
            tier: None,
        }
    }

    pub fn tier(names: &Names, tier: Tier) -> Self {
        Self {
            exchange: names.delay_exchange(),
            routing_key: tier.name(),
            tier: Some(tier),
        }
    }
}

/// Properties of a parked copy: the original's, plus the reason and parked-at headers.
pub fn parked_properties(original: &BasicProperties, cause: &str, reason: &str) -> BasicProperties {
    let mut headers = original.headers().clone().unwrap_or_default();
    headers.insert(
        ShortString::from(PARK_CAUSE_HEADER),
        AMQPValue::LongString(LongString::from(cause)),
    );
    headers.insert(
        ShortString::from(PARK_REASON_HEADER),
        AMQPValue::LongString(LongString::from(reason)),
    );
    let now = Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    headers.insert(
        ShortString::from(PARKED_AT_HEADER),
        AMQPValue::LongString(LongString::from(now)),
    );
    original.clone().with_headers(headers)
}

/// Reads the reason header lapse sets on a message it parks.
pub fn park_reason(headers: Option<&FieldTable>) -> Option<String> {
    header_text(headers, PARK_REASON_HEADER)
}

/// A string header as text (RabbitMQ sends long strings as bytes), e.g. the broker's
/// `x-first-death-reason` on a message it dead-lettered.
pub fn header_text(headers: Option<&FieldTable>, key: &str) -> Option<String> {
    match headers?.inner().get(key)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

/// An integer header value (any of AMQP's integer widths) as an `i64`; `None` for
/// anything else (a number sent as text is not one).
pub fn int_value(value: &AMQPValue) -> Option<i64> {
    Some(match value {
        AMQPValue::ShortShortInt(n) => (*n).into(),
        AMQPValue::ShortShortUInt(n) => (*n).into(),
        AMQPValue::ShortInt(n) => (*n).into(),
        AMQPValue::ShortUInt(n) => (*n).into(),
        AMQPValue::LongInt(n) => (*n).into(),
        AMQPValue::LongUInt(n) => (*n).into(),
        AMQPValue::LongLongInt(n) => *n,
        _ => return None,
    })
}

mod millis {
    //! `expire_at` as RFC 3339 with millisecond precision, UTC. Encoding rounds up (a
    //! deadline is never carried earlier than it is); decoding refuses an instant
    //! outside the range lapse handles (`crate::deadline`), so such a body is parked
    //! as undecodable instead of reaching the decision.
    use chrono::{DateTime, SecondsFormat, Utc};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
        // Only the very last representable instant cannot round up; it is far outside
        // the range any decoder accepts anyway.
        let t = crate::deadline::round_up_to_millis(*t).unwrap_or(*t);
        s.serialize_str(&t.to_rfc3339_opts(SecondsFormat::Millis, true))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
        let text = String::deserialize(d)?;
        let t = DateTime::parse_from_rfc3339(&text)
            .map(|t| t.with_timezone(&Utc))
            .map_err(|e| serde::de::Error::custom(format!("expire_at {text:?}: {e}")))?;
        crate::deadline::checked(t).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_with_millisecond_precision() {
        let at = DateTime::parse_from_rfc3339("2026-12-02T10:15:00.123Z")
            .unwrap()
            .with_timezone(&Utc);
        let m = TimeoutMessage::new(42, at, 3);
        let body = String::from_utf8(m.encode()).unwrap();
        assert!(
            body.contains("\"expire_at\":\"2026-12-02T10:15:00.123Z\""),
            "{body}"
        );
        assert_eq!(TimeoutMessage::decode(body.as_bytes()).unwrap(), m);
        assert_eq!(m.message_id(), "order-42-v3");
    }

    #[test]
    fn a_deadline_timeout_is_version_2_with_kind_and_key() {
        let at = DateTime::parse_from_rfc3339("2026-12-02T10:15:00.123Z")
            .unwrap()
            .with_timezone(&Utc);
        let m = TimeoutMessage::for_deadline(9, "auto_confirm", "SO-1", at, 2).in_shard(1);
        let body = m.encode();
        assert_eq!(TimeoutMessage::decode(&body).unwrap(), m);
        assert_eq!(m.deadline(), Some(("auto_confirm", "SO-1")));
        assert_eq!(m.message_id(), "s1-deadline-9-v2");
        for half in [
            br#"{"v":2,"order_id":1,"expire_at":"2026-12-02T10:15:00.123Z","deadline_version":1,"kind":"a"}"#.as_slice(),
            br#"{"v":1,"order_id":1,"expire_at":"2026-12-02T10:15:00.123Z","deadline_version":1,"kind":"a","key":"k"}"#,
        ] {
            assert!(matches!(
                TimeoutMessage::decode(half),
                Err(DecodeError::Malformed(_))
            ));
        }
    }

    #[test]
    fn shard_zero_is_left_out_and_an_absent_shard_is_zero() {
        let at = DateTime::parse_from_rfc3339("2026-12-02T10:15:00.123Z")
            .unwrap()
            .with_timezone(&Utc);
        let single = TimeoutMessage::new(42, at, 3);
        // Byte for byte what a worker without shards always wrote.
        assert_eq!(
            String::from_utf8(single.encode()).unwrap(),
            r#"{"v":1,"order_id":42,"expire_at":"2026-12-02T10:15:00.123Z","deadline_version":3,"attempt":0,"hops":0}"#
        );
        let old =
            br#"{"v":1,"order_id":42,"expire_at":"2026-12-02T10:15:00.123Z","deadline_version":3}"#;
        assert_eq!(TimeoutMessage::decode(old).unwrap().shard, 0);
        let sharded = single.clone().in_shard(2);
        let body = String::from_utf8(sharded.encode()).unwrap();
        assert!(body.ends_with(r#""hops":0,"shard":2}"#), "{body}");
        assert_eq!(TimeoutMessage::decode(body.as_bytes()).unwrap(), sharded);
        assert_eq!(sharded.message_id(), "s2-order-42-v3");
        assert_ne!(sharded.message_id(), single.message_id());
        let too_big = br#"{"v":1,"order_id":1,"expire_at":"2026-12-02T10:15:00.123Z","deadline_version":1,"shard":65536}"#;
        assert!(matches!(
            TimeoutMessage::decode(too_big),
            Err(DecodeError::Malformed(_))
        ));
    }

    #[test]
    fn rejects_garbage_and_unknown_versions() {
        assert!(matches!(
            TimeoutMessage::decode(b"\xff garbage"),
            Err(DecodeError::Malformed(_))
        ));
        assert_eq!(
            TimeoutMessage::decode(br#"{"v": 3, "order_id": 1}"#),
            Err(DecodeError::UnknownVersion(3))
        );
        assert!(matches!(
            TimeoutMessage::decode(br#"{"v": 1, "order_id": "x"}"#),
            Err(DecodeError::Malformed(_))
        ));
    }

    #[test]
    fn a_deadline_outside_the_handled_range_is_undecodable() {
        for expire_at in [
            "275760-09-13T00:00:00.000Z",
            "+275760-09-13T00:00:00.000Z",
            "-0001-01-01T00:00:00.000Z",
            "0000-01-01T00:00:00.000Z",
            "+10000-01-01T00:00:00.000Z",
            "10000-01-01T00:00:00.000Z",
            "1969-12-31T23:59:59.999Z",
            "infinity",
            "-infinity",
        ] {
            let body =
                format!(r#"{{"v":1,"order_id":1,"expire_at":"{expire_at}","deadline_version":1}}"#);
            assert!(
                matches!(
                    TimeoutMessage::decode(body.as_bytes()),
                    Err(DecodeError::Malformed(_))
                ),
                "{expire_at} was accepted"
            );
        }
        let edge =
            r#"{"v":1,"order_id":1,"expire_at":"9999-12-31T23:59:59.999Z","deadline_version":1}"#;
        assert!(TimeoutMessage::decode(edge.as_bytes()).is_ok());
    }

    #[test]
    fn counters_at_their_maximum_decode_and_larger_ones_do_not() {
        let body = br#"{"v":1,"order_id":1,"expire_at":"2026-12-02T10:15:00.123Z","deadline_version":1,"attempt":4294967295,"hops":4294967295}"#;
        let m = TimeoutMessage::decode(body).unwrap();
        assert_eq!((m.attempt, m.hops), (u32::MAX, u32::MAX));
        let over = br#"{"v":1,"order_id":1,"expire_at":"2026-12-02T10:15:00.123Z","deadline_version":1,"hops":4294967296}"#;
        assert!(matches!(
            TimeoutMessage::decode(over),
            Err(DecodeError::Malformed(_))
        ));
    }

    #[test]
    fn encoding_rounds_a_sub_millisecond_deadline_up() {
        let at = DateTime::parse_from_rfc3339("2026-12-02T10:15:00.123400Z")
            .unwrap()
            .with_timezone(&Utc);
        let body = String::from_utf8(TimeoutMessage::new(1, at, 1).encode()).unwrap();
        assert!(body.contains("2026-12-02T10:15:00.124Z"), "{body}");
    }
}

//! Where one outbox row goes: a stock-release event to `<P>.events`; a timeout intent
//! to the tier chosen from the database clock (or the due queue); a row that is
//! neither to `<P>.parked` with the reason.

use std::time::Duration;

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use lapin::types::ShortString;
use serde_json::{Value, json};

use crate::amqp::broker::Outgoing;
use crate::timeline::Hop;

use super::Relay;
use crate::db::{DbError, column};
use crate::message::{Route, TimeoutMessage, parked_properties};
use crate::names::STOCK_RELEASE_ROUTING_KEY;
use crate::tier::Tier;

/// An outbox row as the relay read it.
pub(super) struct OutboxRow {
    pub outbox_id: i64,
    pub kind: String,
    pub order_id: i64,
    pub payload: Value,
    /// Earlier refusals of this row (it was rescheduled each time).
    pub attempts: u32,
}

/// A row ready to publish.
pub(super) struct RowPublish {
    pub outbox_id: i64,
    /// The outbox it came from (ids of the two are apart).
    pub source: super::Source,
    pub message: Outgoing,
    /// The timeline event of a timeout's first hop.
    pub hop: Option<Hop>,
    pub attempts: u32,
    /// The wait tier it goes to, if any (its queue is checked before publishing).
    pub tier: Option<Tier>,
    /// How soon this row would be routed elsewhere (a timeout whose remaining time
    /// drops below its tier); `None` when its route does not change with time.
    pub reroute_after: Option<Duration>,
    /// The shop's exchange an event goes to (checked before publishing: a publish to
    /// an exchange that does not exist would close the relay's channel).
    pub shop_exchange: Option<String>,
    /// The timeout it carries (a pack may take it along with others of its route).
    pub timeout: Option<TimeoutMessage>,
}

impl Relay {
    /// How much longer than the remaining time a first hop's tier may be: the time
    /// the relay itself took since the intent's transaction began (plus 1 ms for the
    /// deadline's millisecond rounding), capped by `relay.tier_tolerance`. A
    /// deadline equal to a tier then takes one hop, and the tier choice adds no more
    /// lateness than the relay's own lag.
    fn slack(&self, lag: Duration) -> Duration {
        (lag + Duration::from_millis(1)).min(self.tolerance)
    }

    /// One outbox row (`id, kind, order_id, payload, db_now, created_at, attempts`) as
    /// a publish. A row whose values cannot be decoded, or whose payload is not a
    /// timeout intent, is published to the parked queue with the reason (and deleted
    /// only after that publish is confirmed), never dropped and never a panic.
    ///
    /// `waited` is how long the round waited on purpose before it began (gathering,
    /// `relay.gather`): not the relay's lag, so no slack for it (a deadline equal to a
    /// tier would otherwise arrive that much later).
    pub(super) fn decode(
        &self,
        r: &tokio_postgres::Row,
        source: super::Source,
        waited: Duration,
    ) -> Result<RowPublish, DbError> {
        let mut publish = self.decode_row(r, waited)?;
        publish.source = source;
        Ok(publish)
    }

    fn decode_row(&self, r: &tokio_postgres::Row, waited: Duration) -> Result<RowPublish, DbError> {
        let outbox_id: i64 = column(r, "id")?;
        let attempts = column::<i32>(r, "attempts")
            .ok()
            .and_then(|a| u32::try_from(a).ok())
            .unwrap_or(0);
        let read = || -> Result<(String, i64, Value, DateTime<Utc>), DbError> {
            Ok((
                column(r, "kind")?,
                column(r, "order_id")?,
                column(r, "payload")?,
                column(r, "db_now")?,
            ))
        };
        let (kind, order_id, payload, db_now) = match read() {
            Ok(fields) => fields,
            Err(e) => {
                let reason = format!("relay: outbox row {outbox_id} cannot be read: {e}");
                return Ok(self.parked(outbox_id, 0, b"", &reason, attempts));
            }
        };
        // The lag only widens the tier choice; an unreadable write time counts as none.
        let lag = column::<DateTime<Utc>>(r, "created_at")
            .ok()
            .and_then(|written| (db_now - written).to_std().ok())
            .unwrap_or_default()
            .saturating_sub(waited);
        let row = OutboxRow {
            outbox_id,
            kind,
            order_id,
            payload,
            attempts,
        };
        Ok(self.outgoing(row, db_now, lag))
    }

    fn parked(
        &self,
        outbox_id: i64,
        order_id: i64,
        body: &[u8],
        reason: &str,
        attempts: u32,
    ) -> RowPublish {
        tracing::warn!(outbox_id, order_id, %reason, "relay: parking an outbox row");
        RowPublish {
            outbox_id,
            source: super::Source::Outbox,
            message: Outgoing::new(
                self.names.parked(),
                String::new(),
                body.to_vec(),
                parked_properties(
                    &BasicProperties::default().with_delivery_mode(2),
                    "unreadable_outbox_row",
                    reason,
                ),
            ),
            hop: None,
            attempts,
            tier: None,
            reroute_after: None,
            shop_exchange: None,
            timeout: None,
        }
    }

    /// A fired deadline's event (`{"exchange", "routing_key", "body"}` as the fire path
    /// writes it) to the shop's exchange, mandatory: a queue the shop deleted returns
    /// it and the row stays for a later try. Anything else is parked with the reason.
    fn event(&self, outbox_id: i64, deadline_id: i64, payload: Value, attempts: u32) -> RowPublish {
        let field = |name: &str| {
            payload
                .get(name)
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        let (Some(exchange), Some(routing_key), Some(body)) =
            (field("exchange"), field("routing_key"), payload.get("body"))
        else {
            let reason = format!(
                "relay: outbox row {outbox_id} is not an event (exchange, routing_key, body)"
            );
            return self.parked(
                outbox_id,
                deadline_id,
                payload.to_string().as_bytes(),
                &reason,
                attempts,
            );
        };
        let message_id = match (self.shard, body.get("version").and_then(Value::as_i64)) {
            (0, Some(v)) => format!("event-{deadline_id}-v{v}"),
            (s, Some(v)) => format!("s{s}-event-{deadline_id}-v{v}"),
            (_, None) => format!("event-row-{outbox_id}"),
        };
        RowPublish {
            outbox_id,
            source: super::Source::Outbox,
            shop_exchange: Some(exchange.clone()),
            message: Outgoing::new(
                exchange,
                routing_key,
                body.to_string().into_bytes(),
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_content_type(ShortString::from("application/json"))
                    .with_message_id(ShortString::from(message_id)),
            ),
            hop: None,
            attempts,
            tier: None,
            reroute_after: None,
            timeout: None,
        }
    }

    // Over 60 lines on purpose: the three kinds of row (stock release, timeout intent, neither) as one decision.
    fn outgoing(&self, row: OutboxRow, db_now: DateTime<Utc>, lag: Duration) -> RowPublish {
        let OutboxRow {
            outbox_id,
            kind,
            order_id,
            payload,
            attempts,
        } = row;
        if kind == "event" {
            return self.event(outbox_id, order_id, payload, attempts);
        }
        if kind == "stock.release" {
            // The event names its shard the way a timeout does: not at all for shard 0.
            let (payload, message_id) = match (self.shard, payload) {
                (0, payload) => (payload, format!("release-{order_id}")),
                (shard, Value::Object(mut fields)) => {
                    fields.insert("shard".into(), json!(shard));
                    (
                        Value::Object(fields),
                        format!("s{shard}-release-{order_id}"),
                    )
                }
                (shard, other) => (other, format!("s{shard}-release-{order_id}")),
            };
            return RowPublish {
                outbox_id,
                source: super::Source::Outbox,
                message: Outgoing::new(
                    self.names.events_exchange(),
                    STOCK_RELEASE_ROUTING_KEY,
                    payload.to_string().into_bytes(),
                    BasicProperties::default()
                        .with_delivery_mode(2)
                        .with_content_type(ShortString::from("application/json"))
                        .with_message_id(ShortString::from(message_id)),
                ),
                hop: None,
                attempts,
                tier: None,
                reroute_after: None,
                shop_exchange: None,
                timeout: None,
            };
        }
        let body = payload.to_string().into_bytes();
        let not_an_intent = |why: String| {
            self.parked(
                outbox_id,
                order_id,
                &body,
                &format!("relay: outbox row {outbox_id} is not a timeout intent: {why}"),
                attempts,
            )
        };
        let Value::Object(mut fields) = payload else {
            return not_an_intent("the payload is not a JSON object".into());
        };
        let version = match kind.as_str() {
            "deadline" => crate::message::KIND_MESSAGE_VERSION,
            _ => crate::message::MESSAGE_VERSION,
        };
        fields.insert("v".into(), json!(version));
        match serde_json::from_value::<TimeoutMessage>(Value::Object(fields)) {
            Ok(message) => {
                // The application's payload does not know its shard; this relay does.
                let mut message = message.in_shard(self.shard);
                let remaining = message.remaining(db_now);
                let slack = self.slack(lag);
                let route =
                    Route::planned(&self.names, &self.tiers, remaining, slack, self.tolerance);
                message.hops = u32::from(route.tier.is_some());
                // The chosen tier fits while remaining + slack >= tier (a tier taken
                // with the hop-bounding slack is re-planned at once when it is late).
                let reroute_after = route
                    .tier
                    .map(|t| (remaining + slack).saturating_sub(t.duration()));
                // A kind's deadline has no order timeline to record its hops in.
                let hop = (message.deadline().is_none())
                    .then(|| Hop::of(&message, route.tier.map(|t| t.name()), "relay"));
                RowPublish {
                    outbox_id,
                    source: super::Source::Outbox,
                    hop,
                    message: Outgoing::new(
                        route.exchange,
                        route.routing_key,
                        message.encode(),
                        message.properties(),
                    ),
                    attempts,
                    tier: route.tier,
                    reroute_after,
                    shop_exchange: None,
                    timeout: Some(message),
                }
            }
            // Rows written by lapse's functions always decode; anything else is kept.
            Err(e) => not_an_intent(e.to_string()),
        }
    }
}

//! lapse's own bound on giving a message back to its queue.
//!
//! Why: a consumer that cannot finish a delivery *now* (say the database is away)
//! must not lean on the broker's `x-delivery-limit` to stop an endless loop. That limit
//! is the budget meant for poison (a message that kills its consumer), RabbitMQ
//! versions count `basic.nack requeue=true` / `basic.reject` towards it differently
//! (3.x counts every requeue; 4.x does not count some), and a message over it is
//! dead-lettered — its effect lost unless something repairs it.
//!
//! How: prefer not to give a message back at all — keep the delivery and retry while
//! holding it, as the worker does with publishes (the due-queue consumer). Where a
//! delivery must go back, [`give_back`] republishes a copy to the queue it came from,
//! carrying [`RETURNS_HEADER`] = returns so far + 1, and only then acknowledges the
//! original; the copy is at the back of the queue, so other messages flow meanwhile.
//! "Returns so far" is lapse's header plus the broker's `x-delivery-count` (missing =
//! 0: deliveries that ended without an ack, e.g. a consumer that died holding it), so
//! crashes and give-backs share one budget. Once that reaches the [`ReturnLimit`],
//! the message is parked instead, with the reason — counted and visible, never
//! silently dropped. Counters saturate; a header that is not a number counts as 0.
//!
//! Invariant: the original delivery is acknowledged only after its copy (or its parked
//! copy) was confirmed; if publishing fails, the original is left untouched and
//! unacknowledged, for the caller to keep and retry.

use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use crate::amqp::broker::BrokerError;
use crate::amqp::publishing::{Outgoing, PublishingConnection, parked_copy};

/// The header in which lapse counts how often it gave a message back.
pub const RETURNS_HEADER: &str = "x-lapse-returns";
/// The broker's count of earlier deliveries that were not acknowledged (quorum queues).
pub const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// How many times a message may be given back before lapse parks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReturnLimit(pub u32);

/// What to do with a message that cannot be finished now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GiveBack {
    /// Put a copy back, carrying this count in [`RETURNS_HEADER`].
    Requeue { returns: u32 },
    /// The limit is reached: park it with this reason.
    Park { reason: String },
}

/// How often this message has come back so far: lapse's own count plus the broker's
/// `x-delivery-count` (each missing = 0), saturating.
pub fn returns_so_far(properties: &BasicProperties) -> u32 {
    let headers = properties.headers().as_ref();
    count(headers, RETURNS_HEADER).saturating_add(count(headers, DELIVERY_COUNT_HEADER))
}

fn count(headers: Option<&FieldTable>, key: &str) -> u32 {
    let Some(value) = headers.and_then(|h| h.inner().get(key)) else {
        return 0;
    };
    let n = crate::message::int_value(value).unwrap_or(0);
    u32::try_from(n.max(0)).unwrap_or(u32::MAX)
}

impl ReturnLimit {
    /// Requeue with the count raised by one, or park once `limit` returns were used.
    /// `why` says why the message could not be finished (it goes into the reason).
    pub fn decide(self, properties: &BasicProperties, why: &str) -> GiveBack {
        let so_far = returns_so_far(properties);
        if so_far >= self.0 {
            GiveBack::Park {
                reason: format!("given back {so_far} times (limit {}); last: {why}", self.0),
            }
        } else {
            GiveBack::Requeue {
                returns: so_far.saturating_add(1),
            }
        }
    }
}

/// The properties of the copy: the original's, with the new count and without the
/// broker's `x-delivery-count` (already included in the count; the broker would not
/// replace a stale one).
pub fn requeued_properties(original: &BasicProperties, returns: u32) -> BasicProperties {
    let mut headers = FieldTable::default();
    if let Some(old) = original.headers() {
        for (key, value) in old.inner() {
            if key.as_str() != DELIVERY_COUNT_HEADER && key.as_str() != RETURNS_HEADER {
                headers.insert(key.clone(), value.clone());
            }
        }
    }
    headers.insert(
        ShortString::from(RETURNS_HEADER),
        AMQPValue::LongLongInt(returns.into()),
    );
    original.clone().with_headers(headers)
}

/// Gives `delivery` back to `queue` (a copy through the default exchange) or, at the
/// limit, parks it on `parked_exchange`; acknowledges the original once the publish
/// was confirmed. Returns what it did. On error nothing was acknowledged: the caller
/// still holds the delivery.
pub async fn give_back(
    publishing: &mut PublishingConnection,
    delivery: &Delivery,
    queue: &str,
    parked_exchange: &str,
    limit: ReturnLimit,
    why: &str,
) -> Result<GiveBack, BrokerError> {
    let verdict = limit.decide(&delivery.properties, why);
    match &verdict {
        GiveBack::Requeue { returns } => {
            let properties = requeued_properties(&delivery.properties, *returns);
            let copy = Outgoing::new("", queue, delivery.data.clone(), properties);
            publishing.publish(copy).await?;
        }
        GiveBack::Park { reason } => {
            let copy = parked_copy(
                parked_exchange.into(),
                delivery,
                "returned_too_often",
                reason,
            );
            publishing.publish(copy).await?;
        }
    }
    crate::amqp::batch::ack(delivery).await?;
    Ok(verdict)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(headers: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (k, v) in headers {
            table.insert(ShortString::from(*k), v.clone());
        }
        BasicProperties::default().with_headers(table)
    }

    #[test]
    fn missing_headers_count_as_zero() {
        assert_eq!(returns_so_far(&BasicProperties::default()), 0);
        assert_eq!(
            ReturnLimit(3).decide(&BasicProperties::default(), "db down"),
            GiveBack::Requeue { returns: 1 }
        );
    }

    #[test]
    fn lapse_and_broker_counts_add_up_to_the_limit() {
        let props = with(&[
            (RETURNS_HEADER, AMQPValue::LongLongInt(2)),
            (DELIVERY_COUNT_HEADER, AMQPValue::LongInt(1)),
        ]);
        assert_eq!(returns_so_far(&props), 3);
        assert_eq!(
            ReturnLimit(4).decide(&props, "x"),
            GiveBack::Requeue { returns: 4 }
        );
        match ReturnLimit(3).decide(&props, "db down") {
            GiveBack::Park { reason } => {
                assert!(
                    reason.contains("3 times") && reason.contains("db down"),
                    "{reason}"
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn hostile_counts_saturate_or_count_as_zero() {
        let huge = with(&[
            (RETURNS_HEADER, AMQPValue::LongLongInt(i64::MAX)),
            (DELIVERY_COUNT_HEADER, AMQPValue::LongLongInt(i64::MAX)),
        ]);
        assert_eq!(returns_so_far(&huge), u32::MAX);
        assert!(matches!(
            ReturnLimit(u32::MAX).decide(&huge, "x"),
            GiveBack::Park { .. }
        ));
        let negative = with(&[(RETURNS_HEADER, AMQPValue::LongLongInt(-5))]);
        assert_eq!(returns_so_far(&negative), 0);
        let text = with(&[(RETURNS_HEADER, AMQPValue::LongString("9".into()))]);
        assert_eq!(returns_so_far(&text), 0);
    }

    #[test]
    fn the_copy_carries_the_new_count_and_drops_the_brokers() {
        let props = with(&[
            (DELIVERY_COUNT_HEADER, AMQPValue::LongInt(2)),
            ("x-lapse-park-reason", AMQPValue::LongString("kept".into())),
        ]);
        let copy = requeued_properties(&props, 3);
        let headers = copy.headers().as_ref().unwrap().inner();
        assert!(!headers.contains_key(DELIVERY_COUNT_HEADER));
        assert!(headers.contains_key("x-lapse-park-reason"));
        assert_eq!(returns_so_far(&copy), 3);
    }
}

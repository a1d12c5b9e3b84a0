//! The order timeline (`order_events`) as far as hops go: one writer for the relay's
//! first hop and the consumer's re-delays, so that every hop event has the same shape:
//! `{"tier": "30m" | "due", "by": "relay" | "worker", "deadline_version": n,
//! "attempt": n}`. Closes and repairs write their own events inside their statements
//! (`src/close.rs`, `src/reconciler.rs`).

use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::message::TimeoutMessage;

/// One hop of a timeout message to a wait tier (or straight to the due queue).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Hop {
    #[serde(skip)]
    pub order_id: i64,
    /// The order's database (written to that shard's timeline).
    #[serde(skip)]
    pub shard: u16,
    /// The tier's name, or `due` when the message skips the wait queues.
    pub tier: String,
    /// The component that published it.
    pub by: &'static str,
    pub deadline_version: i32,
    pub attempt: u32,
}

impl Hop {
    /// The hop `message` takes to `tier` (`None`: the due queue), published by `by`.
    pub fn of(message: &TimeoutMessage, tier: Option<String>, by: &'static str) -> Self {
        Self {
            order_id: message.order_id,
            shard: message.shard,
            tier: tier.unwrap_or_else(|| "due".into()),
            by,
            deadline_version: message.deadline_version,
            attempt: message.attempt,
        }
    }
}

/// Appends one `hop` event per element, in one statement.
pub async fn record_hops<C: GenericClient>(
    client: &C,
    hops: &[Hop],
) -> Result<(), tokio_postgres::Error> {
    if hops.is_empty() {
        return Ok(());
    }
    let ids: Vec<i64> = hops.iter().map(|h| h.order_id).collect();
    let details: Vec<serde_json::Value> = hops
        .iter()
        .map(|h| serde_json::to_value(h).unwrap_or_default())
        .collect();
    client
        .execute_typed(
            "INSERT INTO order_events (order_id, event, detail)
             SELECT id, 'hop', d FROM unnest($1::bigint[], $2::jsonb[]) AS x(id, d)",
            &[
                (&ids, tokio_postgres::types::Type::INT8_ARRAY),
                (&details, tokio_postgres::types::Type::JSONB_ARRAY),
            ],
        )
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hop_has_one_shape_whoever_wrote_it() {
        let at = chrono::Utc::now();
        let mut m = TimeoutMessage::new(7, at, 3);
        m.attempt = 2;
        let worker = serde_json::to_value(Hop::of(&m, Some("5s".into()), "worker")).unwrap();
        assert_eq!(
            worker,
            serde_json::json!({"tier": "5s", "by": "worker", "deadline_version": 3, "attempt": 2})
        );
        let relay = serde_json::to_value(Hop::of(&m, None, "relay")).unwrap();
        assert_eq!(relay["tier"], "due");
        assert_eq!(
            worker.as_object().unwrap().keys().collect::<Vec<_>>(),
            relay.as_object().unwrap().keys().collect::<Vec<_>>()
        );
    }
}

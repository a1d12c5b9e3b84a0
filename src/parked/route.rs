//! Where a replayed message goes: a timeout back onto its path (the wait tier that
//! fits its remaining time, or the due queue) with its own `expire_at` and deadline
//! version and a fresh attempt budget; a stock-release event to `<P>.stock.release`.
//!
//! A tier whose wait queue does not exist is not published to (`<P>.delay` would
//! route the message straight back to parked and confirm it): the message stays
//! parked with an error saying so. The tier is chosen by this machine's clock; the
//! worker decides by the database clock when it arrives, so a skewed clock can only
//! cost an extra hop, never an early close.

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::Utc;
use lapin::types::ShortString;
use lapin::{BasicProperties, Connection};

use super::{Entry, Kind};
use crate::amqp::broker::BrokerError;
use crate::amqp::publishing::Outgoing;
use crate::amqp::tier_check::TierCheck;
use crate::message::{Route, TimeoutMessage};
use crate::names::{Names, STOCK_RELEASE_ROUTING_KEY};
use crate::tier::{Tier, TierSet};

/// Chooses replay destinations.
pub struct Router {
    names: Names,
    tiers: TierSet,
    check: TierCheck,
}

/// A replay's destination and the message to publish there.
pub struct Target {
    exchange: String,
    routing_key: String,
    body: Vec<u8>,
    properties: BasicProperties,
}

impl Target {
    /// `exchange/routing-key`, for reports.
    pub fn to(&self) -> String {
        format!("{}/{}", self.exchange, self.routing_key)
    }

    pub fn outgoing(self) -> Outgoing {
        Outgoing::new(self.exchange, self.routing_key, self.body, self.properties)
    }
}

impl Router {
    /// `timeout` bounds the tier existence check (use `broker.confirm_timeout`).
    pub fn new(names: Names, tiers: TierSet, timeout: Duration) -> Self {
        let check = TierCheck::new(names.clone(), timeout);
        Self {
            names,
            tiers,
            check,
        }
    }

    /// The destination of each entry, in order, or why it cannot be replayed.
    pub async fn targets(
        &self,
        conn: &Connection,
        entries: &[&Entry],
    ) -> Result<Vec<Result<Target, String>>, BrokerError> {
        let planned: Vec<Result<(Target, Option<Tier>), String>> =
            entries.iter().map(|e| self.target(e)).collect();
        let tiers: BTreeSet<Tier> = planned
            .iter()
            .filter_map(|p| p.as_ref().ok().and_then(|(_, t)| *t))
            .collect();
        let missing = if tiers.is_empty() {
            BTreeSet::new()
        } else {
            self.check.missing(conn, tiers).await?
        };
        Ok(planned
            .into_iter()
            .map(|p| {
                let (target, tier) = p?;
                match tier.filter(|t| missing.contains(t)) {
                    Some(t) => Err(format!(
                        "not replayed: its tier {} has no wait queue ({} missing); \
                         run `lapse topology apply`, then replay again",
                        t.name(),
                        self.names.wait_queue(t)
                    )),
                    None => Ok(target),
                }
            })
            .collect())
    }

    fn target(&self, entry: &Entry) -> Result<(Target, Option<Tier>), String> {
        match (entry.kind, &entry.timeout, entry.order_id, entry.shard) {
            (Kind::Timeout, Some(earliest), _, _) if !entry.pack.is_empty() => {
                // Routed on its earliest entry: none of the others is early.
                let remaining = earliest.remaining(Utc::now());
                let route =
                    Route::for_remaining(&self.names, &self.tiers, remaining, Duration::ZERO);
                let messages: Vec<TimeoutMessage> = entry
                    .pack
                    .iter()
                    .cloned()
                    .map(|mut m| {
                        m.attempt = 0;
                        m.hops = m.hops.saturating_add(u32::from(route.tier.is_some()));
                        m
                    })
                    .collect();
                let (body, properties) = crate::pack::encode(&messages);
                Ok((
                    Target {
                        exchange: route.exchange,
                        routing_key: route.routing_key,
                        body,
                        properties,
                    },
                    route.tier,
                ))
            }
            (Kind::Timeout, Some(message), _, _) => {
                let mut message = message.clone();
                message.attempt = 0;
                let remaining = message.remaining(Utc::now());
                let route =
                    Route::for_remaining(&self.names, &self.tiers, remaining, Duration::ZERO);
                message.hops = message.hops.saturating_add(u32::from(route.tier.is_some()));
                Ok((
                    Target {
                        exchange: route.exchange,
                        routing_key: route.routing_key,
                        body: message.encode(),
                        properties: message.properties(),
                    },
                    route.tier,
                ))
            }
            (Kind::Release, _, Some(order_id), Some(shard)) => {
                // The shard goes back with it, as the relay wrote it (absent for 0).
                let body = match shard {
                    0 => serde_json::json!({ "order_id": order_id }),
                    shard => serde_json::json!({ "order_id": order_id, "shard": shard }),
                };
                let message_id = super::entry::sharded(shard, format!("release-{order_id}"));
                Ok((
                    Target {
                        exchange: self.names.events_exchange(),
                        routing_key: STOCK_RELEASE_ROUTING_KEY.into(),
                        body: body.to_string().into_bytes(),
                        properties: BasicProperties::default()
                            .with_delivery_mode(2)
                            .with_content_type(ShortString::from("application/json"))
                            .with_message_id(ShortString::from(message_id)),
                    },
                    None,
                ))
            }
            _ => Err(format!(
                "not replayed: lapse cannot read this body, so it has no path to go back to; \
                 inspect it with `lapse parked show {}`, then `lapse parked purge {}`",
                entry.id, entry.id
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::message::Delivery;

    /// A parked stock-release event of shard 2, listed and replayed: its id names the
    /// shard, and the replayed body: must still
    /// name shard 2, or the releaser applies it in shard 0's database.
    #[test]
    fn replaying_a_sharded_release_keeps_its_shard() {
        let names = Names::new("t");
        let mut d = Delivery::mock(
            0,
            "t.parked".into(),
            "".into(),
            false,
            br#"{"order_id":7,"lines":[{"sku":"a","qty":1}],"shard":2}"#.to_vec(),
        );
        d.properties =
            BasicProperties::default().with_message_id(ShortString::from("s2-release-7"));
        let entry = Entry::read(&d, &names);
        let router = Router::new(
            names.clone(),
            TierSet::new(vec![Tier::parse("1s").unwrap()]),
            Duration::from_secs(1),
        );
        let (target, _) = router.target(&entry).unwrap();
        let body: serde_json::Value = serde_json::from_slice(&target.body).unwrap();
        assert_eq!(entry.id, "s2-release-7");
        assert_eq!(entry.shard, Some(2));
        assert_eq!(body["shard"], 2, "replayed body {body}");
        assert_eq!(body["order_id"], 7);
        assert_eq!(
            target.properties.message_id().as_ref().map(|m| m.as_str()),
            Some("s2-release-7")
        );
    }
}

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
use crate::message::Route;
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
        match (entry.kind, &entry.timeout, entry.order_id) {
            (Kind::Timeout, Some(message), _) => {
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
            (Kind::Release, _, Some(order_id)) => Ok((
                Target {
                    exchange: self.names.events_exchange(),
                    routing_key: STOCK_RELEASE_ROUTING_KEY.into(),
                    body: serde_json::json!({ "order_id": order_id })
                        .to_string()
                        .into_bytes(),
                    properties: BasicProperties::default()
                        .with_delivery_mode(2)
                        .with_content_type(ShortString::from("application/json"))
                        .with_message_id(ShortString::from(format!("release-{order_id}"))),
                },
                None,
            )),
            _ => Err(format!(
                "not replayed: lapse cannot read this body, so it has no path to go back to; \
                 inspect it with `lapse parked show {}`, then `lapse parked purge {}`",
                entry.id, entry.id
            )),
        }
    }
}

//! Whether the wait queues a publish is about to use exist.
//!
//! `<P>.delay` routes a publish for a tier without a queue to its alternate exchange,
//! `<P>.parked`, and confirms it: `mandatory` never sees such a publish, so without a
//! check a timeout sent to a deleted tier (an operator re-creating it with new
//! arguments) would count as delivered while it lies in parked without a reason. The
//! relay and the worker therefore ask before publishing to a tier: a passive
//! `queue.declare` per tier, on a channel of its own (a 404 closes the channel it ran
//! on, never the connection), bounded by the confirm timeout (a connection blocked by
//! a broker alarm may not answer).
//!
//! Only a positive answer is remembered, for [`FRESH_FOR`]: the cost is at most one
//! round trip per tier in use per that interval, and a missing tier is asked about
//! again every time. A queue deleted within that interval after a positive answer can
//! still take a publish into parked; the sweeper closes such an order.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::Connection;
use tokio::time::Instant;

use crate::amqp::broker::{self, BrokerError};
use crate::names::Names;
use crate::tier::Tier;

/// How long a tier whose queue was seen stays believed to exist.
pub const FRESH_FOR: Duration = Duration::from_secs(2);

/// Checks wait queues for existence, remembering positive answers briefly. Clones
/// share what they remember.
#[derive(Clone)]
pub struct TierCheck {
    names: Names,
    timeout: Duration,
    seen: Arc<Mutex<HashMap<Tier, Instant>>>,
}

impl TierCheck {
    /// `timeout` bounds each question (use `broker.confirm_timeout`).
    pub fn new(names: Names, timeout: Duration) -> Self {
        Self {
            names,
            timeout,
            seen: Arc::default(),
        }
    }

    /// How long each question waits for the broker.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The tiers among `tiers` whose wait queue does not exist. An error (the
    /// connection is lost or does not answer in time) means the answer is unknown.
    pub async fn missing(
        &self,
        conn: &Connection,
        tiers: impl IntoIterator<Item = Tier>,
    ) -> Result<BTreeSet<Tier>, BrokerError> {
        let wanted: BTreeSet<Tier> = tiers.into_iter().collect();
        let ask = match self.seen.lock() {
            Ok(seen) => to_ask(&seen, &wanted, Instant::now()),
            Err(_) => wanted.iter().copied().collect(),
        };
        let mut missing = BTreeSet::new();
        for tier in ask {
            let exists = self.exists(conn, tier).await?;
            if let Ok(mut seen) = self.seen.lock() {
                if exists {
                    seen.insert(tier, Instant::now());
                } else {
                    seen.remove(&tier);
                }
            }
            if !exists {
                missing.insert(tier);
            }
        }
        Ok(missing)
    }

    /// One passive declare on a throwaway channel.
    async fn exists(&self, conn: &Connection, tier: Tier) -> Result<bool, BrokerError> {
        let queue = self.names.wait_queue(tier);
        tokio::time::timeout(self.timeout, broker::queue_state(conn, &queue))
            .await
            .unwrap_or(Err(BrokerError::ConfirmTimeout {
                after: self.timeout,
            }))
            .map(|state| state.counts().is_some())
    }
}

/// The tiers of `wanted` not seen within [`FRESH_FOR`] before `now`.
fn to_ask(seen: &HashMap<Tier, Instant>, wanted: &BTreeSet<Tier>, now: Instant) -> Vec<Tier> {
    wanted
        .iter()
        .filter(|t| {
            seen.get(t)
                .is_none_or(|at| now.saturating_duration_since(*at) >= FRESH_FOR)
        })
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asks_about_tiers_never_seen_or_seen_too_long_ago() {
        let (a, b, c) = (
            Tier::parse("1s").unwrap(),
            Tier::parse("10s").unwrap(),
            Tier::parse("1m").unwrap(),
        );
        let now = Instant::now() + Duration::from_secs(60);
        let seen = HashMap::from([(a, now - Duration::from_millis(500)), (b, now - FRESH_FOR)]);
        let wanted = BTreeSet::from([a, b, c]);
        assert_eq!(to_ask(&seen, &wanted, now), vec![b, c]);
        assert!(to_ask(&seen, &BTreeSet::from([a]), now).is_empty());
    }
}

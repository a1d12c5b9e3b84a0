//! Deliveries the worker keeps unacknowledged because their publish failed or was not
//! attempted (a full tier, no confirm in time, a broker alarm, a wait tier without a
//! queue), and when each is decided again.
//!
//! A kept delivery is never given back to the broker (that would spend its delivery
//! budget): it is handed back to the batch source after the worker's back-off, but no
//! later than the moment its route would change (its remaining time drops below the
//! tier it wanted), so waiting for a refused or missing tier never makes a close later
//! than taking a smaller tier would.

use std::time::Duration;

use lapin::message::Delivery;
use tokio::time::Instant;

use crate::amqp::batch::BatchSource;
use crate::amqp::broker::BrokerError;
use crate::runtime::backoff::Backoff;

/// The shortest wait before a kept delivery is decided again.
pub const MIN_RECHECK: Duration = Duration::from_millis(100);

/// The deliveries of one batch to keep, and the first reason.
#[derive(Default)]
pub(super) struct Kept {
    failure: Option<BrokerError>,
    deliveries: Vec<(Delivery, Option<Duration>)>,
}

impl Kept {
    /// Notes why deliveries are kept (the first reason is the one logged).
    pub fn because(&mut self, error: BrokerError) {
        self.failure.get_or_insert(error);
    }

    /// Keeps `delivery`; `reroute_after` counts from the batch's clock read.
    pub fn keep(&mut self, delivery: Delivery, reroute_after: Option<Duration>) {
        self.deliveries.push((delivery, reroute_after));
    }

    /// True when something failed (the back-off then grows instead of resetting).
    pub fn failed(&self) -> bool {
        self.failure.is_some() || !self.deliveries.is_empty()
    }

    /// Hands every kept delivery back to `source` when it is due to be decided again;
    /// returns how many were kept.
    pub fn hold_all(
        self,
        source: &mut BatchSource,
        retry: &mut Backoff,
        read_at: Instant,
    ) -> usize {
        if self.deliveries.is_empty() {
            return 0;
        }
        // Every kept delivery is held, also one whose reason was not recorded: dropping
        // it would leave it unacknowledged, occupying prefetch until the session ends.
        let error = self.failure.map_or_else(
            || "kept without a recorded reason".to_string(),
            |e| e.to_string(),
        );
        let delay = retry.next_delay();
        let kept = self.deliveries.len();
        tracing::warn!(%error, deliveries = kept,
            retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            "worker: publish failed or not attempted; keeping the deliveries to decide again");
        let now = Instant::now();
        for (delivery, reroute_after) in self.deliveries {
            source.hold(delivery, recheck_at(now, delay, read_at, reroute_after));
        }
        kept
    }
}

/// When to decide a kept delivery again: after `delay`, but not after its route
/// changes (`read_at + reroute_after`), and never sooner than [`MIN_RECHECK`].
fn recheck_at(
    now: Instant,
    delay: Duration,
    read_at: Instant,
    reroute_after: Option<Duration>,
) -> Instant {
    let backed_off = now + delay;
    match reroute_after {
        Some(r) => backed_off.min((read_at + r).max(now + MIN_RECHECK)),
        None => backed_off,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_delivery_is_decided_again_after_the_back_off_or_when_its_route_changes() {
        let read_at = Instant::now();
        let now = read_at + Duration::from_millis(50);
        let delay = Duration::from_secs(2);
        assert_eq!(recheck_at(now, delay, read_at, None), now + delay);
        let far = Some(Duration::from_secs(30));
        assert_eq!(recheck_at(now, delay, read_at, far), now + delay);
        let soon = Some(Duration::from_millis(700));
        assert_eq!(
            recheck_at(now, delay, read_at, soon),
            read_at + Duration::from_millis(700)
        );
        // Already past: not in a spin.
        assert_eq!(
            recheck_at(now, delay, read_at, Some(Duration::ZERO)),
            now + MIN_RECHECK
        );
    }
}

//! Counters for every outcome of the worker's decision table, tier hops, sweeper and
//! relay work, and the close-lateness histogram. Each is kept in-process (for
//! `run_once` callers and tests) and mirrored to the `metrics` facade (for the
//! Prometheus exporter): each outcome goes to the metric that means it (see
//! [`crate::observe::metric_catalog`]), which may depend on the component that records it
//! ([`Stats::by`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::observe::metric_catalog as m;

/// What happened to one delivery, or one unit of background work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Undecodable or unknown version: parked with the reason.
    Parked,
    /// No such order.
    Missing,
    /// Already PAID or CLOSED.
    Settled,
    /// The message's deadline version is not the order's.
    Stale,
    /// Not due yet: published to a wait tier again.
    Redelayed,
    /// Not due yet, shorter than the smallest tier: waited out in the worker.
    Held,
    /// Due, but another transaction held the order's row lock: skipped, and decided
    /// again after `worker.lock_retry` (the rest of the batch closed meanwhile).
    Locked,
    /// Closed by the worker.
    Closed,
    /// Due, but the guarded close changed nothing (a payment or close won the race).
    Raced,
    /// Database unavailable: re-delayed with attempt+1.
    Retried,
    /// Database unavailable for too many attempts: parked.
    GaveUp,
    /// Closed by the sweeper (should stay near zero).
    SweptClosed,
    /// Relay: outbox rows published and deleted.
    Relayed,
    /// Publishes the broker refused (a full tier with `reject-publish`); retried later.
    PublishRefused,
    /// Stock releaser: (order, sku) releases applied.
    Released,
    /// Stock releaser: a batch kept (unacknowledged) and retried after a transient
    /// database error; counts deliveries per retry.
    ReleaseRetried,
    /// Closes whose stock release could not be applied in the close's transaction (a
    /// stock row held, a table lock, a release the data refused): sent to the stock
    /// releaser as an event instead.
    ReleaseDeferred,
    /// A publish the broker could not route to any queue (returned, `mandatory`):
    /// the relay keeps the outbox row, the worker parks the delivery with the reason.
    /// Also a timeout not published because its wait tier has no queue: the relay
    /// keeps the row, the worker keeps the delivery.
    Unroutable,
    /// Reconciler: a CLOSED order's lost stock release emitted again (should stay 0).
    ReleaseRepaired,
    /// A delivery kept unacknowledged as long as the broker's consumer timeout allows
    /// (a long-locked row): replaced by a fresh copy of itself in its queue.
    Renewed,
    /// Such a delivery whose copy could not be published: given back with
    /// `basic.nack` (one delivery of its budget, not the whole channel's).
    GivenBack,
}

pub const ALL_OUTCOMES: [Outcome; 21] = [
    Outcome::Parked,
    Outcome::Missing,
    Outcome::Settled,
    Outcome::Stale,
    Outcome::Redelayed,
    Outcome::Held,
    Outcome::Locked,
    Outcome::Closed,
    Outcome::Raced,
    Outcome::Retried,
    Outcome::GaveUp,
    Outcome::SweptClosed,
    Outcome::Relayed,
    Outcome::PublishRefused,
    Outcome::Released,
    Outcome::ReleaseRetried,
    Outcome::ReleaseDeferred,
    Outcome::Unroutable,
    Outcome::ReleaseRepaired,
    Outcome::Renewed,
    Outcome::GivenBack,
];

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Parked => "parked",
            Outcome::Missing => "missing",
            Outcome::Settled => "settled",
            Outcome::Stale => "stale",
            Outcome::Redelayed => "redelayed",
            Outcome::Held => "held",
            Outcome::Locked => "locked",
            Outcome::Closed => "closed",
            Outcome::Raced => "raced",
            Outcome::Retried => "retried",
            Outcome::GaveUp => "gave_up",
            Outcome::SweptClosed => "swept_closed",
            Outcome::Relayed => "relayed",
            Outcome::PublishRefused => "publish_refused",
            Outcome::Released => "released",
            Outcome::ReleaseRetried => "release_retried",
            Outcome::ReleaseDeferred => "release_deferred",
            Outcome::Unroutable => "unroutable",
            Outcome::ReleaseRepaired => "release_repaired",
            Outcome::Renewed => "renewed",
            Outcome::GivenBack => "given_back",
        }
    }

    fn index(self) -> usize {
        ALL_OUTCOMES
            .iter()
            .position(|o| *o == self)
            .expect("listed")
    }
}

/// Shared counters; cheap to clone.
#[derive(Clone, Default)]
pub struct Stats {
    counts: Arc<[AtomicU64; ALL_OUTCOMES.len()]>,
    /// The component recording ("worker" when unset): the same outcome means a
    /// different thing from the relay, the releaser or the sweeper.
    by: &'static str,
}

impl Stats {
    /// The same counters, recorded on behalf of `component` (relay, releaser, sweeper).
    pub fn by(&self, component: &'static str) -> Stats {
        Stats {
            counts: self.counts.clone(),
            by: component,
        }
    }

    fn component(&self) -> &'static str {
        if self.by.is_empty() {
            "worker"
        } else {
            self.by
        }
    }

    pub fn record(&self, outcome: Outcome, n: u64) {
        if n == 0 {
            return;
        }
        self.counts[outcome.index()].fetch_add(n, Ordering::Relaxed);
        self.export(outcome, n);
    }

    fn export(&self, outcome: Outcome, n: u64) {
        use Outcome::*;
        let by = self.component();
        match (outcome, by) {
            (Relayed, _) => metrics::counter!(m::RELAY_PUBLISHED).increment(n),
            (PublishRefused, "relay") => metrics::counter!(m::RELAY_REFUSED).increment(n),
            (PublishRefused, _) => metrics::counter!(m::REDELAYS_REFUSED).increment(n),
            (Unroutable, _) => metrics::counter!(m::UNROUTABLE, "component" => by).increment(n),
            (Renewed, _) => {
                metrics::counter!(m::RENEWALS, "component" => by, "result" => "renewed")
                    .increment(n)
            }
            (GivenBack, _) => {
                metrics::counter!(m::RENEWALS, "component" => by, "result" => "given_back")
                    .increment(n)
            }
            (Released, _) => metrics::counter!(m::RELEASES).increment(n),
            (ReleaseRetried, _) => metrics::counter!(m::RELEASE_RETRIES).increment(n),
            (ReleaseDeferred, _) => metrics::counter!(m::RELEASES_DEFERRED).increment(n),
            (ReleaseRepaired, _) => metrics::counter!(m::RECONCILER_REPAIRS).increment(n),
            (SweptClosed, _) => metrics::counter!(m::CLOSES, "path" => "sweeper").increment(n),
            (Locked, "sweeper") => metrics::counter!(m::SWEEPER_LOCKED).increment(n),
            (Locked, "releaser") => metrics::counter!(m::RELEASES_LOCKED).increment(n),
            // Parked releases are counted by `parked` alone: they are no decision.
            (Parked, "releaser") => {}
            // The worker's decisions.
            (outcome, _) => {
                metrics::counter!(m::DECISIONS, "outcome" => outcome.as_str()).increment(n);
                match outcome {
                    Closed => metrics::counter!(m::CLOSES, "path" => "timeout").increment(n),
                    Redelayed => metrics::counter!(m::REDELAYS, "reason" => "not_due").increment(n),
                    Retried => {
                        metrics::counter!(m::REDELAYS, "reason" => "database_retry").increment(n)
                    }
                    Held => metrics::counter!(m::HOLDS, "reason" => "not_due").increment(n),
                    Locked => metrics::counter!(m::HOLDS, "reason" => "locked").increment(n),
                    _ => {}
                }
            }
        }
    }

    /// A message copied to the parked queue; `reason` is one of a few fixed words
    /// (undecodable, bad_deadline, database_unavailable, unroutable).
    pub fn parked(&self, reason: &'static str) {
        metrics::counter!(m::PARKED, "component" => self.component(), "reason" => reason)
            .increment(1);
    }

    pub fn get(&self, outcome: Outcome) -> u64 {
        self.counts[outcome.index()].load(Ordering::Relaxed)
    }

    /// A tier hop (a publish to a wait queue); `tier` is `None` for the due queue.
    pub fn hop(&self, tier: Option<&str>) {
        metrics::counter!(m::TIER_HOPS, "tier" => tier.unwrap_or("due").to_string()).increment(1);
    }

    /// Close time minus deadline of one closed order; `path` is "timeout" or "sweeper".
    pub fn lateness(&self, lateness: std::time::Duration, path: &'static str) {
        metrics::histogram!(m::CLOSE_LATENESS, "path" => path).record(lateness.as_secs_f64());
    }

    /// Every non-zero counter, for logs and summaries.
    pub fn summary(&self) -> Vec<(&'static str, u64)> {
        ALL_OUTCOMES
            .iter()
            .map(|o| (o.as_str(), self.get(*o)))
            .filter(|(_, n)| *n > 0)
            .collect()
    }
}

//! The stock releaser: consumes `<P>.stock.release` and returns a closed order's
//! reserved stock. The ledger's primary key (order, sku, 'release') makes a repeated
//! event a no-op; ledger rows and stock changes commit in one statement. The order
//! lines come from the database, not from the message. The same transaction stamps
//! `orders.released_at`, which the reconciler relies on.
//!
//! Locks: the order rows first, `FOR NO KEY UPDATE SKIP LOCKED`, then the stock rows in
//! SKU order, like every other writer of stock, so releases never deadlock with orders.
//! An order row another transaction holds (an application inside a payment) is not
//! waited for — waiting while holding a SKU's stock lock would block every checkout of
//! that SKU — its delivery is held back and tried again after a back-off while the rest
//! of the batch is released. An order whose deadline lies outside the range lapse handles
//! (a row older than the deadline rules; the range constraint refuses any update of it)
//! has its stock released but its row left unstamped, with an error logged; the
//! reconciler stamps it once the row is repaired (docs/operations.md).
//!
//! Failure handling: a transient database error (outage, failover, deadlock,
//! serialization failure) never gives a delivery back to the broker — that would spend
//! its `x-delivery-limit` budget and park a release that only needed a retry. The batch
//! stays unacknowledged and the transaction is retried with back-off until it
//! commits or shutdown. A permanent error (bad data) splits the batch until the
//! failing event is alone; only that one is parked, after lapse's own bounded tries.
//! When every event of a batch (two or more) fails alone with the same error, the
//! cause is not the data of one event (e.g. a binary newer than the schema): the batch
//! is held and retried like a transient error, at most [`SYSTEMIC_ROUNDS`] times, and
//! parked only then.

mod apply;

use std::time::Duration;

use deadpool_postgres::Pool;
use lapin::message::Delivery;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::amqp::batch::{BatchHandler, ConsumerSession, Consuming, ack, consume};
use crate::amqp::broker::{BrokerError, Endpoint};
use crate::observe::stats::{Outcome, Stats};
use crate::runtime::backoff::Backoff;
use crate::runtime::health::{Busy, Health};
use crate::runtime::supervisor::Fatal;

use crate::names::Names;

pub use apply::ReleaseOutcome;

#[derive(Deserialize)]
struct ReleaseEvent {
    order_id: i64,
}

/// Tries of one release that fails with a permanent (non-transient) error before it
/// is parked. lapse's own bound: the broker's delivery count is never spent on it.
pub const PERMANENT_ATTEMPTS: u32 = 3;

/// Rounds a batch whose every event fails identically is held and retried (with the
/// back-off, 100 ms doubling to 5 s: about 5 minutes) before its events are parked.
pub const SYSTEMIC_ROUNDS: u32 = 60;

/// A decoded event held unacknowledged until its release commits or it is parked.
struct Pending {
    delivery: Delivery,
    order_id: i64,
    failures: u32,
}

/// What is left of a batch after one round of tries.
#[derive(Default)]
struct Round {
    /// Single events that failed with a permanent error, with the error.
    failed: Vec<(Pending, String)>,
    /// Events whose order row another transaction held.
    held: Vec<Pending>,
    /// True when at least one release transaction committed.
    succeeded: bool,
}

/// True when the permanent failures look systemic rather than bad data: two or more
/// events each failed alone with the same error and nothing in the round committed
/// (e.g. a column or function the binary expects is missing from the schema).
fn systemic<T>(failed: &[(T, String)], succeeded: bool) -> bool {
    !succeeded
        && failed.len() >= 2
        && failed.windows(2).all(|pair| match pair {
            [(_, a), (_, b)] => a == b,
            _ => true,
        })
}

#[derive(Clone)]
pub struct Releaser {
    pub pool: Pool,
    pub names: Names,
    pub stats: Stats,
    pub prefetch: u16,
    pub batch_size: usize,
    pub batch_window: Duration,
}

impl Releaser {
    /// Consumes until `token` is cancelled, reconnecting with back-off.
    pub async fn run(
        self,
        broker: Endpoint,
        health: Health,
        token: CancellationToken,
    ) -> Result<(), Fatal> {
        crate::runtime::backoff::reconnecting("releaser", &health, &token, || {
            self.session(&broker, &health, &token)
        })
        .await
    }

    /// One broker session: the consumer's session loop ([`consume`]) with this
    /// releaser handling each batch.
    async fn session(
        &self,
        broker: &Endpoint,
        health: &Health,
        token: &CancellationToken,
    ) -> Result<(), BrokerError> {
        let how = Consuming {
            endpoint: broker,
            role: "releaser",
            prefix: &self.names.prefix,
            component: "releaser",
            queue: self.names.stock_release_queue(),
            prefetch: self.prefetch,
            batch_size: self.batch_size,
            batch_window: self.batch_window,
        };
        consume(&how, health, token, &mut &*self).await
    }

    /// Releases one batch. Undecodable events are parked at once. A transient
    /// database error keeps the deliveries unacknowledged and retries with back-off
    /// until the release commits or `token` is cancelled (then they return to the
    /// queue when the channel closes): an outage never spends a delivery's budget.
    /// An order whose row another transaction holds is held back and tried again after
    /// a back-off. A permanent error splits the batch until the events that fail are
    /// alone; each is tried [`PERMANENT_ATTEMPTS`] times, then parked with the reason —
    /// unless every event of the batch failed identically (see [`systemic`]): then
    /// the batch is held and retried up to [`SYSTEMIC_ROUNDS`] times first.
    // Over 60 lines on purpose: the retry state machine of one batch (split, systemic, permanent), documented above.
    async fn process(
        &self,
        batch: Vec<Delivery>,
        session: &mut ConsumerSession,
        token: &CancellationToken,
        busy: &Busy,
    ) -> Result<(), BrokerError> {
        let mut good = Vec::new();
        for delivery in batch {
            match serde_json::from_slice::<ReleaseEvent>(&delivery.data) {
                Ok(event) => good.push(Pending {
                    delivery,
                    order_id: event.order_id,
                    failures: 0,
                }),
                Err(e) => {
                    let reason = format!("not a stock-release event: {e}");
                    self.park(session, &delivery, &reason, "undecodable")
                        .await?;
                }
            }
        }
        let mut work = vec![good];
        let mut backoff = Backoff::new();
        let mut systemic_rounds = 0;
        loop {
            let round = self.round(work, token, busy, &mut backoff).await?;
            if token.is_cancelled() {
                return Ok(());
            }
            if round.failed.is_empty() && round.held.is_empty() {
                return Ok(());
            }
            let mut failed = round.failed;
            if systemic(&failed, round.succeeded) {
                let count = failed.len();
                let error = failed.first().map(|(_, e)| e.clone()).unwrap_or_default();
                systemic_rounds += 1;
                if systemic_rounds >= SYSTEMIC_ROUNDS {
                    for (one, error) in failed {
                        let reason = format!(
                            "stock release of order {} failed like every other event of its batch, {} times: {}",
                            one.order_id, systemic_rounds, error
                        );
                        self.park(session, &one.delivery, &reason, "release_failed")
                            .await?;
                    }
                } else {
                    tracing::error!(%error, events = count, round = systemic_rounds,
                        "releaser: every event of the batch fails with the same error; holding the batch and retrying");
                    self.stats
                        .by("releaser")
                        .record(Outcome::ReleaseRetried, u64::try_from(count).unwrap_or(0));
                    work = vec![failed.into_iter().map(|(p, _)| p).collect()];
                    work.push(round.held);
                    busy.idle_while(backoff.sleep(token)).await;
                    continue;
                }
                failed = Vec::new();
            }
            work = vec![round.held];
            for (mut one, error) in failed {
                one.failures += 1;
                if one.failures < PERMANENT_ATTEMPTS {
                    tracing::warn!(%error, order_id = one.order_id,
                        attempt = one.failures, "releaser: release failed; trying again");
                    work.push(vec![one]);
                } else {
                    let reason = format!(
                        "stock release of order {} failed {} times: {}",
                        one.order_id, one.failures, error
                    );
                    self.park(session, &one.delivery, &reason, "release_failed")
                        .await?;
                }
            }
            if work.iter().all(Vec::is_empty) {
                return Ok(());
            }
            // Waiting for a lock or a retry is not a stall.
            busy.idle_while(backoff.sleep(token)).await;
        }
    }

    /// Tries `work` once: releases what it can (acknowledging those deliveries),
    /// splits chunks that fail permanently down to single events, retries transient
    /// errors with back-off. Returns what is left.
    // Over 60 lines on purpose: one try of each chunk with its three answers (released, transient, permanent), each with its counters.
    async fn round(
        &self,
        mut work: Vec<Vec<Pending>>,
        token: &CancellationToken,
        busy: &Busy,
        backoff: &mut Backoff,
    ) -> Result<Round, BrokerError> {
        let mut round = Round::default();
        while let Some(mut chunk) = work.pop() {
            if chunk.is_empty() {
                continue;
            }
            let ids: Vec<i64> = chunk.iter().map(|p| p.order_id).collect();
            match self.release(&ids).await {
                Ok(outcome) => {
                    backoff.reset();
                    round.succeeded = true;
                    self.stats.by("releaser").record(
                        Outcome::Released,
                        u64::try_from(outcome.applied).unwrap_or(0),
                    );
                    for p in chunk {
                        if outcome.held.contains(&p.order_id) {
                            round.held.push(p);
                        } else {
                            ack(&p.delivery).await?;
                        }
                    }
                    if !outcome.held.is_empty() {
                        tracing::debug!(orders = ?outcome.held,
                            "releaser: order rows locked by another transaction; holding them back");
                        self.stats.by("releaser").record(
                            Outcome::Locked,
                            u64::try_from(outcome.held.len()).unwrap_or(0),
                        );
                    }
                }
                Err(e) if e.is_transient() => {
                    tracing::warn!(error = %e.detail(), held = chunk.len(),
                        "releaser: database unavailable; holding the deliveries and retrying");
                    self.stats.by("releaser").record(
                        Outcome::ReleaseRetried,
                        u64::try_from(chunk.len()).unwrap_or(0),
                    );
                    // Waiting out an outage is not a stall.
                    busy.idle_while(backoff.sleep(token)).await;
                    if token.is_cancelled() {
                        return Ok(round);
                    }
                    work.push(chunk);
                }
                Err(e) if chunk.len() > 1 => {
                    // Narrow down to the events that fail; the others go through.
                    tracing::debug!(error = %e.detail(), size = chunk.len(),
                        "releaser: permanent error; splitting the batch");
                    let right = chunk.split_off(chunk.len() / 2);
                    work.push(right);
                    work.push(chunk);
                }
                Err(e) => {
                    if let Some(one) = chunk.pop() {
                        round.failed.push((one, e.detail()));
                    }
                }
            }
        }
        Ok(round)
    }

    async fn park(
        &self,
        session: &mut ConsumerSession,
        delivery: &Delivery,
        reason: &str,
        kind: &'static str,
    ) -> Result<(), BrokerError> {
        tracing::warn!(%reason, "releaser: parking a message");
        session.park(self.names.parked(), delivery, reason).await?;
        let stats = self.stats.by("releaser");
        stats.record(Outcome::Parked, 1);
        stats.parked(kind);
        Ok(())
    }
}

/// The releaser handles each batch of the shared session loop.
impl BatchHandler for &Releaser {
    async fn handle(
        &mut self,
        batch: Vec<Delivery>,
        session: &mut ConsumerSession,
        token: &CancellationToken,
        busy: &Busy,
    ) -> Result<(), BrokerError> {
        self.process(batch, session, token, busy).await
    }
}

#[cfg(test)]
mod tests {
    use super::systemic;

    #[test]
    fn a_batch_failing_alike_everywhere_is_systemic_one_bad_event_is_not() {
        let same = "column \"released_at\" does not exist (SQLSTATE 42703)".to_string();
        let alike = vec![((), same.clone()), ((), same.clone()), ((), same.clone())];
        assert!(systemic(&alike, false));
        assert!(!systemic(&alike, true), "another event committed: the data");
        assert!(!systemic(&alike[..1], false), "one event tells nothing");
        let mixed = vec![
            ((), same.clone()),
            ((), "other (SQLSTATE 23514)".to_string()),
        ];
        assert!(!systemic(&mixed, false));
        assert!(!systemic::<()>(&[], false));
    }
}

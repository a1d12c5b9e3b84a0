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
//! that SKU — its delivery is held in the session's delay queue and tried again after
//! that order's own back-off, while the rest of the batch and later batches are
//! released (one locked order never stalls the others). An order whose deadline lies outside the range lapse handles
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
mod round;

use std::collections::{BTreeMap, HashMap};

use lapin::message::Delivery;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::amqp::batch::{
    BatchHandler, Batching, ConsumerSession, Consuming, consume_reconnecting,
};
use crate::amqp::broker::{BrokerError, Endpoint};
use crate::db::Pools;
use crate::observe::stats::{Outcome, Stats};
use crate::runtime::backoff::Backoff;
use crate::runtime::health::{Busy, Health};
use crate::runtime::supervisor::Fatal;

use crate::names::Names;

pub use apply::ReleaseOutcome;
use round::{hold_away, hold_locked};

/// Orders (shard, id) met with their row locked, with each one's back-off.
type Locked = HashMap<(u16, i64), Backoff>;

#[derive(Deserialize)]
struct ReleaseEvent {
    order_id: i64,
    /// The order's database; absent (0) without shards.
    #[serde(default)]
    shard: u16,
}

/// Tries of one release that fails with a permanent (non-transient) error before it
/// is parked. lapse's own bound: the broker's delivery count is never spent on it.
pub const PERMANENT_ATTEMPTS: u32 = 3;

/// How close to its hold limit (half the broker's consumer timeout) a delivery may be
/// before a batch retrying in place gives way: a back-off (at most 5 s) and one more
/// try (a pool wait of up to 10 s) fit in it. The batch's deliveries are then held in
/// the session's delay queue (and renewed at their limit) instead.
pub(super) const RETRY_MARGIN: std::time::Duration = std::time::Duration::from_secs(20);

/// Rounds a batch whose every event fails identically is held and retried (with the
/// back-off, 100 ms doubling to 5 s: about 5 minutes) before its events are parked.
pub const SYSTEMIC_ROUNDS: u32 = 60;

/// A decoded event held unacknowledged until its release commits or it is parked.
struct Pending {
    delivery: Delivery,
    order_id: i64,
    shard: u16,
    failures: u32,
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
    /// One pool per order database; an event's `shard` chooses.
    pub pools: Pools,
    pub names: Names,
    pub stats: Stats,
    pub batching: Batching,
}

impl Releaser {
    /// Consumes the stock-release queue until `token` is cancelled, reconnecting with
    /// back-off: the consumer's session loop (`amqp::batch::consume_reconnecting`) with this
    /// releaser handling each batch.
    pub async fn run(
        self,
        broker: Endpoint,
        health: Health,
        token: CancellationToken,
    ) -> Result<(), Fatal> {
        let how = Consuming {
            endpoint: &broker,
            role: "releaser",
            prefix: &self.names.prefix,
            component: "releaser",
            queue: self.names.stock_release_queue(),
            batching: self.batching,
            stats: self.stats.by("releaser"),
        };
        consume_reconnecting(how, &health, &token, || Batches {
            releaser: &self,
            away: HashMap::new(),
            locked: HashMap::new(),
        })
        .await
    }

    /// Releases one batch. Undecodable events are parked at once. A transient
    /// database error keeps the deliveries unacknowledged and retries with back-off
    /// until the release commits or `token` is cancelled (then they return to the
    /// queue when the channel closes): an outage never spends a delivery's budget.
    /// An order whose row another transaction holds is held back in the session's delay
    /// queue and tried again after its own back-off, while later batches go on
    /// ([`hold_locked`]). A permanent error splits the batch until the events that fail are
    /// alone; each is tried [`PERMANENT_ATTEMPTS`] times, then parked with the reason —
    /// unless every event of the batch failed identically (see [`systemic`]): then
    /// the batch is held and retried up to [`SYSTEMIC_ROUNDS`] times first.
    // Over 60 lines on purpose: the retry state machine of one batch (split, systemic, permanent), documented above.
    ///
    /// With several shards each shard's events are released in their own
    /// transaction; the events of a shard whose database is away are held
    /// unacknowledged and tried again after that shard's back-off (`away`), while the
    /// other shards' events are released.
    async fn process(
        &self,
        batch: Vec<Delivery>,
        session: &mut ConsumerSession,
        token: &CancellationToken,
        busy: &Busy,
        away: &mut HashMap<u16, Backoff>,
        locked: &mut Locked,
    ) -> Result<(), BrokerError> {
        let mut by_shard: BTreeMap<u16, Vec<Pending>> = BTreeMap::new();
        for delivery in batch {
            match serde_json::from_slice::<ReleaseEvent>(&delivery.data) {
                Ok(event) if self.pools.get(event.shard).is_none() => {
                    let reason = format!(
                        "the event names shard {}, but this worker has {} order database(s) \
                         (database.shards)",
                        event.shard,
                        self.pools.len()
                    );
                    self.park(session, &delivery, &reason, "unknown_shard")
                        .await?;
                }
                Ok(event) => by_shard.entry(event.shard).or_default().push(Pending {
                    delivery,
                    order_id: event.order_id,
                    shard: event.shard,
                    failures: 0,
                }),
                Err(e) => {
                    let reason = format!("not a stock-release event: {e}");
                    self.park(session, &delivery, &reason, "undecodable")
                        .await?;
                }
            }
        }
        let mut work: Vec<Vec<Pending>> = by_shard.into_values().collect();
        // Every chunk rebuilt below is regrouped by shard: a chunk is released in the
        // database of its first event, so events of two shards must never share one
        // (order ids repeat across shards).
        let mut backoff = Backoff::new();
        let mut systemic_rounds = 0;
        loop {
            let round = self
                .round(work, &mut session.source, token, busy, &mut backoff)
                .await?;
            if token.is_cancelled() {
                return Ok(());
            }
            for shard in &round.released {
                away.remove(shard);
            }
            for order in &round.released_orders {
                locked.remove(order);
            }
            hold_away(round.away, session, away);
            hold_locked(round.held, session, locked, &self.stats);
            if round.failed.is_empty() {
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
                    work = group_by_shard(failed.into_iter().map(|(p, _)| p));
                    if session.source.limit_near(RETRY_MARGIN) {
                        hold_away(work, session, away);
                        return Ok(());
                    }
                    busy.idle_while(backoff.sleep(token)).await;
                    continue;
                }
                failed = Vec::new();
            }
            work = Vec::new();
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
            if session.source.limit_near(RETRY_MARGIN) {
                hold_away(work, session, away);
                return Ok(());
            }
            // Waiting for a retry is not a stall.
            busy.idle_while(backoff.sleep(token)).await;
        }
    }

    async fn park(
        &self,
        session: &mut ConsumerSession,
        delivery: &Delivery,
        reason: &str,
        kind: &'static str,
    ) -> Result<(), BrokerError> {
        tracing::warn!(%reason, "releaser: parking a message");
        session
            .park(self.names.parked(), delivery, kind, reason)
            .await?;
        let stats = self.stats.by("releaser");
        stats.record(Outcome::Parked, 1);
        stats.parked(kind);
        Ok(())
    }
}

/// Events grouped into one chunk per shard (see `Releaser::handle`).
fn group_by_shard(events: impl IntoIterator<Item = Pending>) -> Vec<Vec<Pending>> {
    let mut by_shard: std::collections::BTreeMap<u16, Vec<Pending>> = Default::default();
    for one in events {
        by_shard.entry(one.shard).or_default().push(one);
    }
    by_shard.into_values().collect()
}

/// The releaser's side of a session: the back-off of each shard whose database was
/// away, for the session's lifetime.
struct Batches<'a> {
    releaser: &'a Releaser,
    away: HashMap<u16, Backoff>,
    locked: Locked,
}

/// The releaser handles each batch of the shared session loop.
impl BatchHandler for Batches<'_> {
    async fn handle(
        &mut self,
        batch: Vec<Delivery>,
        session: &mut ConsumerSession,
        token: &CancellationToken,
        busy: &Busy,
    ) -> Result<(), BrokerError> {
        self.releaser
            .process(
                batch,
                session,
                token,
                busy,
                &mut self.away,
                &mut self.locked,
            )
            .await
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

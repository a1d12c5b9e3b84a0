//! The worker's decision for a batch of deliveries (docs/pipeline.md), as data: read the
//! orders and the database clock in one transaction, close what is due with the
//! guarded UPDATE in the same transaction, and say what to do with each delivery.
//! Executing the actions (publish, ack, park, hold) is the consumer's job.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::close::{self, Candidate, CloseReason, Closed};
use crate::db::{self, DbError, Pools};
use crate::deadline;
use crate::kinds::Catalog;
use crate::kinds::fire::{DeadlineRow, Verdict};
use crate::message::{DecodeError, Route, TimeoutMessage};
use crate::names::Names;
use crate::observe::stats::Outcome;
use crate::tier::{Tier, TierSet};

/// What to do with one delivery.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Acknowledge; the outcome says why.
    Ack(Outcome),
    /// Publish `message` to `route` with confirm, then acknowledge.
    Publish {
        route: Route,
        message: TimeoutMessage,
        outcome: Outcome,
        /// How soon, counted from the clock read, the delivery would take another
        /// route (its remaining time drops below the tier); `None` when the route does
        /// not depend on time. A delivery kept after a failed publish is decided again
        /// no later than this.
        reroute_after: Option<Duration>,
    },
    /// Copy to the parked queue with the reason, then acknowledge. `kind` is the
    /// `parked` counter's reason (`undecodable`, `bad_deadline`, `unknown_shard`,
    /// `database_unavailable`).
    Park {
        reason: String,
        outcome: Outcome,
        kind: &'static str,
    },
    /// Keep unacknowledged, decide again after this long.
    Hold(Duration),
    /// Due, but another transaction holds the order's row lock (an application
    /// inside `SELECT ... FOR UPDATE`): keep unacknowledged and decide again after
    /// this long. Only this order waits; the rest of its batch was closed.
    Locked(Duration),
}

#[derive(Clone)]
pub struct Decider {
    /// One pool per order database; a message's `shard` chooses.
    pub pools: Pools,
    pub names: Names,
    pub tiers: TierSet,
    pub max_attempts: u32,
    pub retry_backoff: Duration,
    /// How long a due order whose row is locked waits before it is decided again.
    pub lock_retry: Duration,
    /// Bound on waiting for any other lock in the close statement.
    pub lock_timeout: Duration,
    /// Cap on the hop-bounding slack of a re-delay (`relay.tier_tolerance`).
    pub tier_tolerance: Duration,
    /// The deadline kinds this worker fires (`[kinds]`).
    pub kinds: Catalog,
    /// The database's clock minus this worker's, in milliseconds, as last read: what
    /// an entry's wait by the worker's clock is corrected by.
    pub clock_offset: ClockOffset,
    /// Where the stock release of what this worker closes is applied.
    pub stock_release: close::StockRelease,
    /// Where releases applied in the close are counted (`released`).
    pub stats: crate::observe::stats::Stats,
}

/// The database's clock minus the worker's, shared by clones of a [`Decider`].
#[derive(Clone, Debug, Default)]
pub struct ClockOffset(std::sync::Arc<std::sync::atomic::AtomicI64>);

impl ClockOffset {
    /// Notes the database's `now()` as just read.
    pub fn observe(&self, db_now: DateTime<Utc>) {
        let ms = (db_now - Utc::now()).num_milliseconds();
        self.0.store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// The database's clock now, as this worker estimates it.
    pub fn db_now(&self) -> DateTime<Utc> {
        let ms = self.0.load(std::sync::atomic::Ordering::Relaxed);
        Utc::now() + chrono::TimeDelta::milliseconds(ms)
    }
}

/// An order as the decision sees it. `expire_at` is an error (the reason) when the
/// stored deadline cannot be decoded or lies outside the range lapse handles (a row
/// written before the deadline rules existed): only a decision that needs the
/// deadline parks the delivery; the rest of the batch proceeds.
struct OrderRow {
    status: String,
    deadline_version: i32,
    expire_at: Result<DateTime<Utc>, String>,
}

impl OrderRow {
    /// Decodes one row of the batch read (`id, status, deadline_version, expire_at,
    /// raw`): `None` for the no-order row of the LEFT JOIN.
    fn decode(row: &tokio_postgres::Row) -> Option<(i64, Result<Self, String>)> {
        let id: i64 = db::column::<Option<i64>>(row, "id").ok()??;
        let fields = || -> Result<Self, DbError> {
            let expire_at = db::column(row, "expire_at")
                .map_err(|e| e.to_string())
                .and_then(|t| deadline::checked(t).map_err(|e| e.to_string()))
                .map_err(|e| {
                    let raw: String = db::column(row, "raw").unwrap_or_else(|_| "?".into());
                    format!("order {id} has a deadline lapse cannot handle ({raw}): {e}")
                });
            Ok(Self {
                status: db::column(row, "status")?,
                deadline_version: db::column(row, "deadline_version")?,
                expire_at,
            })
        };
        Some((id, fields().map_err(|e| format!("order {id}: {e}"))))
    }

    /// True when this row should be closed for `m` now.
    fn due_for(&self, m: &TimeoutMessage, db_now: DateTime<Utc>) -> bool {
        self.status == "UNPAID"
            && self.deadline_version == m.deadline_version
            && self.expire_at.as_ref().is_ok_and(|t| *t <= db_now)
    }
}

#[derive(Default)]
struct Snapshot {
    db_now: DateTime<Utc>,
    orders: HashMap<i64, Result<OrderRow, String>>,
    closed: Vec<Closed>,
    /// Due orders the close skipped because their row was locked.
    locked: HashSet<i64>,
    /// The deadlines of kinds the batch names, by id.
    deadlines: HashMap<i64, Result<DeadlineRow, String>>,
    /// What firing each due deadline did.
    verdicts: HashMap<i64, Verdict>,
}

impl Decider {
    /// Decides every message of a batch; also returns the orders it closed, with their
    /// shard. The messages of each shard are read and closed in that shard's own
    /// transaction, all shards at once: a shard whose database is away (or not
    /// migrated yet) takes the database-away path (re-delay with `attempt + 1`, park
    /// after `max_attempts`) while the others close. A message naming a shard this
    /// worker has no database for is parked with the reason.
    pub async fn decide(
        &self,
        messages: &[Result<TimeoutMessage, DecodeError>],
    ) -> (Vec<Action>, Vec<(u16, Closed)>) {
        let mut by_shard: BTreeMap<u16, Vec<&TimeoutMessage>> = BTreeMap::new();
        for m in messages.iter().filter_map(|m| m.as_ref().ok()) {
            let known_kind = m
                .deadline()
                .is_none_or(|(kind, _)| self.kinds.get(kind).is_some());
            if known_kind && self.pools.get(m.shard).is_some() {
                by_shard.entry(m.shard).or_default().push(m);
            }
        }
        // A batch of undecodable bodies (or unknown shards) needs no database at all.
        let reads = by_shard
            .iter()
            .map(|(shard, ms)| async move { (*shard, self.read_and_close(*shard, ms).await) });
        let mut snapshots: HashMap<u16, Result<Snapshot, DbError>> =
            futures_util::future::join_all(reads)
                .await
                .into_iter()
                .collect();
        let mut closed_ids: HashMap<u16, HashSet<i64>> = snapshots
            .iter()
            .filter_map(|(shard, s)| s.as_ref().ok().map(|s| (*shard, s)))
            .map(|(shard, s)| (shard, s.closed.iter().map(|c| c.order_id).collect()))
            .collect();
        // Deadline ids and order ids are apart (two sequences): each has its own set.
        let mut fired_ids: HashMap<u16, HashSet<i64>> = HashMap::new();
        let actions = messages
            .iter()
            .map(|m| match m {
                Err(e) => park(&e.to_string(), "undecodable"),
                Ok(m)
                    if m.deadline()
                        .is_some_and(|(k, _)| self.kinds.get(k).is_none()) =>
                {
                    park(&kinds::unknown_kind(m), "unknown_kind")
                }
                Ok(m) => match snapshots.get(&m.shard) {
                    None => park(&self.unknown_shard(m.shard), "unknown_shard"),
                    Some(Ok(snap)) if m.deadline().is_some() => {
                        self.classify_deadline(m, snap, fired_ids.entry(m.shard).or_default())
                    }
                    Some(Ok(snap)) => {
                        self.classify(m, snap, closed_ids.entry(m.shard).or_default())
                    }
                    Some(Err(e)) => self.retry(m, e),
                },
            })
            .collect();
        let mut closed = Vec::new();
        for (shard, snapshot) in snapshots.drain() {
            if let Ok(s) = snapshot {
                closed.extend(s.closed.into_iter().map(|c| (shard, c)));
                closed.extend(s.verdicts.into_iter().filter_map(|(id, v)| match v {
                    Verdict::Fired {
                        expire_at,
                        fired_at,
                    } => Some((
                        shard,
                        Closed {
                            order_id: id,
                            expire_at,
                            closed_at: fired_at,
                        },
                    )),
                    _ => None,
                }));
            }
        }
        (actions, closed)
    }

    fn unknown_shard(&self, shard: u16) -> String {
        format!(
            "the message names shard {shard}, but this worker has {} order database(s) \
             (database.shards): is a worker with a shorter list consuming this prefix?",
            self.pools.len()
        )
    }

    async fn read_and_close(
        &self,
        shard: u16,
        messages: &[&TimeoutMessage],
    ) -> Result<Snapshot, DbError> {
        let (deadlines, messages): (Vec<&TimeoutMessage>, Vec<&TimeoutMessage>) =
            messages.iter().partition(|m| m.deadline().is_some());
        let ids: Vec<i64> = messages.iter().map(|m| m.order_id).collect();
        // A shard not migrated yet is away: nothing reads or closes on its old schema.
        let pool = self.pools.ready(shard)?;
        let mut client = pool.get().await?;
        let tx = db::begin_short(&mut client, pool.limits(), Some(self.lock_timeout)).await?;
        let rows = tx
            .query_typed(
                "SELECT n.now, o.id, o.status, o.deadline_version, o.expire_at, o.expire_at::text AS raw
                   FROM (SELECT now()) AS n(now)
                   LEFT JOIN orders o ON o.id = ANY($1)",
                &[(&ids, tokio_postgres::types::Type::INT8_ARRAY)],
            )
            .await?;
        let first = rows
            .first()
            .ok_or_else(|| DbError::Unreadable("the batch read returned no row".into()))?;
        let db_now: DateTime<Utc> = db::column(first, "now")?;
        self.clock_offset.observe(db_now);
        let orders: HashMap<i64, Result<OrderRow, String>> =
            rows.iter().filter_map(OrderRow::decode).collect();
        let candidates: Vec<Candidate> = messages
            .iter()
            .filter(|m| {
                orders
                    .get(&m.order_id)
                    .is_some_and(|o| o.as_ref().is_ok_and(|o| o.due_for(m, db_now)))
            })
            .map(|m| Candidate {
                order_id: m.order_id,
                deadline_version: m.deadline_version,
                hops: i32::try_from(m.hops).unwrap_or(i32::MAX),
            })
            .collect();
        let mut report =
            close::close_due(&tx, &candidates, CloseReason::Timeout, self.stock_release).await?;
        let (deadlines, verdicts) = self.fire_due(&tx, &deadlines, db_now).await?;
        // Last: the stock rows it locks are held only until the commit.
        close::release_closed(&tx, &mut report, self.stock_release).await?;
        tx.commit().await?;
        self.stats.record(
            Outcome::Released,
            u64::try_from(report.released.applied).unwrap_or(0),
        );
        self.stats.record(
            Outcome::ReleaseDeferred,
            u64::try_from(report.released.deferred).unwrap_or(0),
        );
        Ok(Snapshot {
            db_now,
            orders,
            closed: report.closed,
            locked: report.locked.into_iter().collect(),
            deadlines,
            verdicts,
        })
    }

    /// `closed_ids` holds the orders this batch closed not yet attributed to a
    /// delivery: a duplicate in the same batch counts as settled, not closed twice.
    fn classify(
        &self,
        m: &TimeoutMessage,
        snap: &Snapshot,
        closed_ids: &mut HashSet<i64>,
    ) -> Action {
        let order = match snap.orders.get(&m.order_id) {
            None => return Action::Ack(Outcome::Missing),
            Some(Err(reason)) => return park(reason, "bad_deadline"),
            Some(Ok(order)) => order,
        };
        if order.status != "UNPAID" {
            return Action::Ack(Outcome::Settled);
        }
        if order.deadline_version != m.deadline_version {
            return Action::Ack(Outcome::Stale);
        }
        let expire_at = match &order.expire_at {
            Ok(t) => *t,
            Err(reason) => return park(reason, "bad_deadline"),
        };
        if expire_at <= snap.db_now {
            return if closed_ids.remove(&m.order_id) {
                Action::Ack(Outcome::Closed)
            } else if snap.locked.contains(&m.order_id) {
                Action::Locked(self.lock_retry)
            } else if snap.closed.iter().any(|c| c.order_id == m.order_id) {
                Action::Ack(Outcome::Settled)
            } else {
                // Due, but the guarded UPDATE changed nothing: a payment won meanwhile.
                Action::Ack(Outcome::Raced)
            };
        }
        self.wait_more(m, expire_at, snap.db_now)
    }

    /// Not due yet: re-delay to the tier that fits, or hold a remainder shorter than
    /// the smallest tier.
    fn wait_more(
        &self,
        m: &TimeoutMessage,
        expire_at: DateTime<Utc>,
        db_now: DateTime<Utc>,
    ) -> Action {
        let remaining = (expire_at - db_now).to_std().unwrap_or_default();
        // A re-delay goes out right after the clock was read: no slack for its own
        // lag, only the hop-bounding slack where the hop bound needs it (see
        // TierSet::planned_hop).
        let route = Route::planned(
            &self.names,
            &self.tiers,
            remaining,
            Duration::ZERO,
            self.tier_tolerance,
        );
        if route.tier.is_none() {
            return Action::Hold(remaining);
        }
        let reroute_after = route.tier.map(|t| remaining.saturating_sub(t.duration()));
        let mut message = m.clone();
        message.hops = message.hops.saturating_add(1);
        Action::Publish {
            route,
            message,
            outcome: Outcome::Redelayed,
            reroute_after,
        }
    }

    /// The database is unavailable: re-delay with attempt+1 (deadline unchanged), or
    /// park after the configured maximum.
    fn retry(&self, m: &TimeoutMessage, error: &DbError) -> Action {
        let attempt = m.attempt.saturating_add(1);
        if attempt > self.max_attempts {
            return Action::Park {
                reason: format!(
                    "database unavailable after {} attempts: {error}",
                    self.max_attempts
                ),
                outcome: Outcome::GaveUp,
                kind: "database_unavailable",
            };
        }
        let mut message = m.clone();
        message.attempt = attempt;
        message.hops = message.hops.saturating_add(1);
        Action::Publish {
            route: Route::tier(&self.names, self.backoff_tier(attempt)),
            message,
            outcome: Outcome::Retried,
            reroute_after: None,
        }
    }

    /// The largest tier not above `retry_backoff * 2^(attempt-1)`, at least the smallest.
    fn backoff_tier(&self, attempt: u32) -> Tier {
        let wanted = self
            .retry_backoff
            .saturating_mul(1u32 << (attempt - 1).min(20));
        self.tiers
            .iter()
            .filter(|t| t.duration() <= wanted)
            .last()
            .unwrap_or(self.tiers.smallest())
    }
}

/// A delivery whose order cannot be decided: parked with the reason, counted.
fn park(reason: &str, kind: &'static str) -> Action {
    Action::Park {
        reason: reason.to_string(),
        outcome: Outcome::Parked,
        kind,
    }
}

/// The same decision for the timeouts of kinds' deadlines.
#[path = "decide_kinds.rs"]
mod kinds;

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;

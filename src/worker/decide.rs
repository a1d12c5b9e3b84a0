//! The worker's decision for a batch of deliveries (SPEC §3), as data: read the
//! orders and the database clock in one transaction, close what is due with the
//! guarded UPDATE in the same transaction, and say what to do with each delivery.
//! Executing the actions (publish, ack, park, hold) is the consumer's job.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use deadpool_postgres::Pool;

use crate::close::{self, Candidate, CloseReason, Closed};
use crate::db::DbError;
use crate::message::{DecodeError, Route, TimeoutMessage};
use crate::stats::Outcome;
use crate::tier::{Tier, TierSet};
use crate::topology::Names;

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
    },
    /// Copy to the parked queue with the reason, then acknowledge.
    Park { reason: String, outcome: Outcome },
    /// Keep unacknowledged, decide again after this long.
    Hold(Duration),
    /// Due, but another transaction holds the order's row lock (an application
    /// inside `SELECT ... FOR UPDATE`): keep unacknowledged and decide again after
    /// this long. Only this order waits; the rest of its batch was closed.
    Locked(Duration),
}

#[derive(Clone)]
pub struct Decider {
    pub pool: Pool,
    pub names: Names,
    pub tiers: TierSet,
    pub max_attempts: u32,
    pub retry_backoff: Duration,
    /// How long a due order whose row is locked waits before it is decided again.
    pub lock_retry: Duration,
    /// Bound on waiting for any other lock in the close statement.
    pub lock_timeout: Duration,
}

/// An order as the decision sees it.
struct OrderRow {
    status: String,
    deadline_version: i32,
    expire_at: DateTime<Utc>,
}

#[derive(Default)]
struct Snapshot {
    db_now: DateTime<Utc>,
    orders: HashMap<i64, OrderRow>,
    closed: Vec<Closed>,
    /// Due orders the close skipped because their row was locked.
    locked: HashSet<i64>,
}

impl Decider {
    /// Decides every message of a batch; also returns the orders it closed.
    pub async fn decide(
        &self,
        messages: &[Result<TimeoutMessage, DecodeError>],
    ) -> (Vec<Action>, Vec<Closed>) {
        let decoded: Vec<&TimeoutMessage> =
            messages.iter().filter_map(|m| m.as_ref().ok()).collect();
        // A batch of undecodable bodies needs no database at all.
        let snapshot = if decoded.is_empty() {
            Ok(Snapshot::default())
        } else {
            self.read_and_close(&decoded).await
        };
        let mut closed_ids: HashSet<i64> = match &snapshot {
            Ok(s) => s.closed.iter().map(|c| c.order_id).collect(),
            Err(_) => HashSet::new(),
        };
        let actions = messages
            .iter()
            .map(|m| match (m, &snapshot) {
                (Err(e), _) => Action::Park {
                    reason: e.to_string(),
                    outcome: Outcome::Parked,
                },
                (Ok(m), Ok(snap)) => self.classify(m, snap, &mut closed_ids),
                (Ok(m), Err(e)) => self.retry(m, e),
            })
            .collect();
        let closed = snapshot.map(|s| s.closed).unwrap_or_default();
        (actions, closed)
    }

    async fn read_and_close(&self, messages: &[&TimeoutMessage]) -> Result<Snapshot, DbError> {
        let ids: Vec<i64> = messages.iter().map(|m| m.order_id).collect();
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let rows = tx
            .query(
                "SELECT n.now, o.id, o.status, o.deadline_version, o.expire_at
                   FROM (SELECT now()) AS n(now)
                   LEFT JOIN orders o ON o.id = ANY($1)",
                &[&ids],
            )
            .await?;
        let db_now: DateTime<Utc> = rows[0].get(0);
        let orders: HashMap<i64, OrderRow> = rows
            .iter()
            .filter_map(|r| {
                Some((
                    r.get::<_, Option<i64>>(1)?,
                    OrderRow {
                        status: r.get(2),
                        deadline_version: r.get(3),
                        expire_at: r.get(4),
                    },
                ))
            })
            .collect();
        let candidates: Vec<Candidate> = messages
            .iter()
            .filter(|m| {
                orders.get(&m.order_id).is_some_and(|o| {
                    o.status == "UNPAID"
                        && o.deadline_version == m.deadline_version
                        && o.expire_at <= db_now
                })
            })
            .map(|m| Candidate {
                order_id: m.order_id,
                deadline_version: m.deadline_version,
                hops: m.hops as i32,
            })
            .collect();
        let report =
            close::close_due(&tx, &candidates, CloseReason::Timeout, self.lock_timeout).await?;
        tx.commit().await?;
        Ok(Snapshot {
            db_now,
            orders,
            closed: report.closed,
            locked: report.locked.into_iter().collect(),
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
        let Some(order) = snap.orders.get(&m.order_id) else {
            return Action::Ack(Outcome::Missing);
        };
        if order.status != "UNPAID" {
            return Action::Ack(Outcome::Settled);
        }
        if order.deadline_version != m.deadline_version {
            return Action::Ack(Outcome::Stale);
        }
        if order.expire_at <= snap.db_now {
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
        let remaining = (order.expire_at - snap.db_now).to_std().unwrap_or_default();
        // No slack here: a re-delay goes out right after the clock was read, and a
        // tier longer than the remaining time would only make the close later.
        let route = Route::for_remaining(&self.names, &self.tiers, remaining, Duration::ZERO);
        if route.tier.is_none() {
            return Action::Hold(remaining);
        }
        let mut message = m.clone();
        message.hops += 1;
        Action::Publish {
            route,
            message,
            outcome: Outcome::Redelayed,
        }
    }

    /// The database is unavailable: re-delay with attempt+1 (deadline unchanged), or
    /// park after the configured maximum.
    fn retry(&self, m: &TimeoutMessage, error: &DbError) -> Action {
        let attempt = m.attempt + 1;
        if attempt > self.max_attempts {
            return Action::Park {
                reason: format!(
                    "database unavailable after {} attempts: {error}",
                    self.max_attempts
                ),
                outcome: Outcome::GaveUp,
            };
        }
        let mut message = m.clone();
        message.attempt = attempt;
        message.hops += 1;
        Action::Publish {
            route: Route::tier(&self.names, self.backoff_tier(attempt)),
            message,
            outcome: Outcome::Retried,
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

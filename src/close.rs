//! The one close path, shared by the worker and the sweeper: a guarded UPDATE that
//! closes only what is still UNPAID, of the expected deadline version, and due by the
//! database clock — with its stock-release outbox rows in the same statement.
//!
//! Invariants: never early (`expire_at <= now()` in the WHERE); at most once (the
//! status guard); only a row this statement changed gets release rows.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

use crate::db::{DbError, column};

/// Who closed an order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// The worker, from a timeout message.
    Timeout,
    /// The backstop sweeper.
    Sweeper,
}

impl CloseReason {
    pub fn as_str(self) -> &'static str {
        match self {
            CloseReason::Timeout => "timeout",
            CloseReason::Sweeper => "sweeper",
        }
    }
}

/// A close candidate: the order, the deadline version the caller saw, and how many
/// wait-queue hops its message took (0 for the sweeper).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub order_id: i64,
    pub deadline_version: i32,
    pub hops: i32,
}

/// An order this call closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Closed {
    pub order_id: i64,
    pub expire_at: DateTime<Utc>,
    pub closed_at: DateTime<Utc>,
}

impl Closed {
    /// Close time minus deadline.
    pub fn lateness(&self) -> std::time::Duration {
        (self.closed_at - self.expire_at)
            .to_std()
            .unwrap_or_default()
    }
}

const CLOSE_SQL: &str = "
WITH due AS (
    SELECT DISTINCT ON (id) id, v, hops
      FROM unnest($1::bigint[], $2::int[], $3::int[]) AS d(id, v, hops)
),
closed AS (
    UPDATE orders o
       SET status = 'CLOSED', closed_at = now(), close_reason = $4
      FROM due d
     WHERE o.id = d.id AND o.status = 'UNPAID'
       AND o.deadline_version = d.v AND o.expire_at <= now()
    RETURNING o.id, o.expire_at, o.closed_at, d.hops
),
release AS (
    INSERT INTO outbox (kind, order_id, payload)
    SELECT 'stock.release', c.id, jsonb_build_object('order_id', c.id, 'lines',
           jsonb_agg(jsonb_build_object('sku', l.sku, 'qty', l.qty)))
      FROM closed c JOIN order_lines l ON l.order_id = c.id
     GROUP BY c.id
),
events AS (
    INSERT INTO order_events (order_id, event, detail)
    SELECT id, 'closed', jsonb_build_object('by', $4::text, 'hops', hops,
           'late_ms', round(extract(epoch FROM closed_at - expire_at) * 1000, 3))
      FROM closed
)
SELECT id, expire_at, closed_at FROM closed";

/// Closes every candidate that is still UNPAID, of the same version and due.
pub async fn close_due<C: GenericClient>(
    client: &C,
    candidates: &[Candidate],
    reason: CloseReason,
) -> Result<Vec<Closed>, DbError> {
    if candidates.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<i64> = candidates.iter().map(|c| c.order_id).collect();
    let versions: Vec<i32> = candidates.iter().map(|c| c.deadline_version).collect();
    let hops: Vec<i32> = candidates.iter().map(|c| c.hops).collect();
    let rows = client
        .query(CLOSE_SQL, &[&ids, &versions, &hops, &reason.as_str()])
        .await?;
    rows.iter()
        .map(|r| {
            Ok(Closed {
                order_id: column(r, 0)?,
                expire_at: column(r, 1)?,
                closed_at: column(r, 2)?,
            })
        })
        .collect()
}

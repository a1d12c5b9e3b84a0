//! The one close path, shared by the worker and the sweeper: a guarded UPDATE that
//! closes only what is still UNPAID, of the expected deadline version, and due by the
//! database clock — and the example shop's stock release in the same transaction:
//! applied by the next statement (`worker.stock_release = "in_close"`, see
//! `release`) or as stock-release outbox rows written by the close statement itself
//! (`"event"`, for the stock releaser).
//!
//! Invariants: never early (`expire_at <= now()` in the WHERE); at most once (the
//! status guard); only a row this statement changed gets release rows; a row locked
//! by someone else defers only its own order (`SKIP LOCKED`), never the batch.

use chrono::{DateTime, Utc};
use tokio_postgres::Transaction;

use crate::db::{DbError, column};

mod release;

pub use release::{Released, StockRelease, TABLE_LOCK_WAIT};

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

/// The stock-release outbox row of each order in the CTE `$source` (column `id`), with
/// the order's lines: the event the releaser consumes. The reconciler writes it for a
/// release lost after its close; the close writes the same row (`lapse_close_orders`
/// and `lapse_release_closed_stock`, migrations V16 and V17, which reach the lines by key).
macro_rules! release_outbox_insert {
    ($source:literal) => {
        concat!(
            "INSERT INTO outbox (kind, order_id, payload)
    SELECT 'stock.release', c.id, jsonb_build_object('order_id', c.id, 'lines',
           jsonb_agg(jsonb_build_object('sku', l.sku, 'qty', l.qty)))
      FROM ",
            $source,
            " c JOIN order_lines l ON l.order_id = c.id
     GROUP BY c.id"
        )
    };
}
pub(crate) use release_outbox_insert;

/// The CTE `restocked`: returns to `available` what the CTE `released` (the new
/// `release` ledger rows, `sku, qty`) took from `reserved`, one UPDATE per SKU: the
/// stock releaser's; the release in the close does the same
/// (`lapse_release_closed_stock`, migration V16).
macro_rules! restock_cte {
    () => {
        "restocked AS (
    UPDATE stock s
       SET available = s.available + r.qty, reserved = s.reserved - r.qty
      FROM (SELECT sku, sum(qty) AS qty FROM released GROUP BY sku) r
     WHERE s.sku = r.sku
    RETURNING 1
),"
    };
}
pub(crate) use restock_cte;

/// The close, `lapse_close_orders` (migrations V16 and V17: a function, so that each server
/// connection plans it once, not at every close), locks what it closes with `SKIP
/// LOCKED`: a row someone else holds (an application inside `SELECT ... FOR UPDATE`
/// around a slow payment call) is left alone and reported as locked, instead of making
/// the whole batch wait for it. The lock is
/// `FOR NO KEY UPDATE`, the one the UPDATE itself takes: it does not conflict with the
/// key-share locks of inserts into tables that reference `orders`, so an application
/// writing such a row (an audit entry, a shipment) does not defer the close.
///
/// Each order is reached by primary key, whatever the planner's statistics say (never
/// analyzed, or a backlog created since the last analyze): the lock and the eligibility
/// check look up one row per id (`LATERAL ... OFFSET 0`, which the planner cannot turn
/// into a join over the whole table), and the UPDATE names its rows as an id array.
/// UNPAID is spelled `paid_at IS NULL AND closed_at IS NULL`, which the table's CHECK
/// constraints make the same as `status = 'UNPAID'` (every order is UNPAID, PAID with
/// `paid_at`, or CLOSED with `closed_at`), because `status = 'UNPAID'` matches the
/// predicate of the partial index `orders_unpaid_by_deadline`: with stale statistics the
/// planner scanned that index for every overdue order, twice per batch. Joined directly
/// to the batch, the same conditions made it scan the whole table once per batch row.
const CLOSE_SQL: &str = "SELECT r_id AS id, r_expire_at AS expire_at, r_closed_at AS closed_at
   FROM lapse_close_orders($1, $2, $3, $4, $5)";

/// Applies the stock release of what `report` closed in `tx` under
/// [`StockRelease::InClose`] (nothing to do under `Event`: the close wrote the outbox
/// rows). Called last before the commit, so that the transaction holds stock rows
/// for as short a time as it can.
pub async fn release_closed(
    tx: &Transaction<'_>,
    report: &mut CloseReport,
    release: StockRelease,
) -> Result<(), DbError> {
    if release == StockRelease::InClose {
        let ids: Vec<i64> = report.closed.iter().map(|c| c.order_id).collect();
        report.released = self::release::in_close(tx, &ids).await?;
    }
    Ok(())
}

/// What one close statement did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CloseReport {
    /// The orders it closed.
    pub closed: Vec<Closed>,
    /// Due orders it left alone because another transaction held their row lock;
    /// the caller retries them shortly.
    pub locked: Vec<i64>,
    /// What the stock release in the same transaction did (`in_close` only).
    pub released: Released,
}

/// Closes every candidate that is still UNPAID, of the same version and due, in
/// `tx`, with their stock-release outbox rows under [`StockRelease::Event`] (under
/// `InClose` the caller releases them with [`release_closed`] before it commits). Rows locked by another transaction are skipped and reported. `tx` must be a
/// short transaction whose waits for any other lock are bounded by the caller's lock
/// timeout (opened with [`crate::db::begin_short`]; a timeout is an error the caller
/// retries).
///
/// `closed_at` is the real clock at the moment of the close (`clock_timestamp()`), not
/// the transaction's start, so lateness is reported honestly; the guard compares with
/// `now()`, which is never later than the real clock: never early.
pub async fn close_due(
    tx: &Transaction<'_>,
    candidates: &[Candidate],
    reason: CloseReason,
    release: StockRelease,
) -> Result<CloseReport, DbError> {
    if candidates.is_empty() {
        return Ok(CloseReport::default());
    }
    let ids: Vec<i64> = candidates.iter().map(|c| c.order_id).collect();
    let versions: Vec<i32> = candidates.iter().map(|c| c.deadline_version).collect();
    let hops: Vec<i32> = candidates.iter().map(|c| c.hops).collect();
    let rows = tx
        .query_typed(
            CLOSE_SQL,
            &[
                (&ids, tokio_postgres::types::Type::INT8_ARRAY),
                (&versions, tokio_postgres::types::Type::INT4_ARRAY),
                (&hops, tokio_postgres::types::Type::INT4_ARRAY),
                (&reason.as_str(), tokio_postgres::types::Type::TEXT),
                (
                    &(release == StockRelease::Event),
                    tokio_postgres::types::Type::BOOL,
                ),
            ],
        )
        .await?;
    let mut report = CloseReport::default();
    for r in &rows {
        let order_id: i64 = column(r, "id")?;
        let at: Option<(DateTime<Utc>, DateTime<Utc>)> =
            column::<Option<DateTime<Utc>>>(r, "expire_at")?
                .zip(column::<Option<DateTime<Utc>>>(r, "closed_at")?);
        match at {
            Some((expire_at, closed_at)) => report.closed.push(Closed {
                order_id,
                expire_at,
                closed_at,
            }),
            None => report.locked.push(order_id),
        }
    }
    Ok(report)
}

//! The release reconciler: finds CLOSED orders whose stock release never happened
//! and emits it again. Run by the sweeper's leader after each sweep.
//!
//! A release can be lost after its close committed: its event parked (a delivery
//! limit spent by an older lapse or a broker outage), purged, or dropped with a
//! deleted queue. The database knows: the releaser stamps `orders.released_at` in
//! the transaction that writes the `release` ledger rows, so "CLOSED, unstamped,
//! closed more than `sweeper.release_grace` ago" is a small partial index
//! (`orders_unreleased`) walked by keyset pagination in bounded pages.
//!
//! For each such order, in one transaction per page: if it has no lines or already
//! has `release` ledger rows, only the stamp is missing and it is set; otherwise, unless a
//! `stock.release` outbox row is still pending, a new one is written (the same
//! payload as the close path's) and counted in `release_repairs`. Idempotent: the
//! ledger's primary key makes a duplicate release a no-op. Bounded: an order is
//! re-emitted at most [`MAX_REPAIRS`] times, at least `release_grace` apart, so a
//! release that can never succeed (parked by the releaser for bad data) is not
//! re-emitted forever. What it repairs is counted (`release_repaired`): it should be 0.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

use crate::config::SweeperConfig;
use crate::db::DbError;
use crate::stats::{Outcome, Stats};

/// Re-emissions of one order's release before the reconciler leaves it to a person.
pub const MAX_REPAIRS: i32 = 3;

/// What one reconciler pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Unstamped CLOSED orders past the grace period that were looked at.
    pub scanned: usize,
    /// Orders that had nothing (left) to release: stamped, nothing emitted.
    pub stamped: usize,
    /// Orders whose lost release was emitted again.
    pub repaired: usize,
    /// Orders still unreleased after [`MAX_REPAIRS`] re-emissions.
    pub exhausted: usize,
}

const STAMP_SQL: &str = "
UPDATE orders o SET released_at = clock_timestamp()
 WHERE o.id = ANY($1) AND o.status = 'CLOSED' AND o.released_at IS NULL
   AND (NOT EXISTS (SELECT 1 FROM order_lines l WHERE l.order_id = o.id)
        OR EXISTS (SELECT 1 FROM stock_ledger s WHERE s.order_id = o.id AND s.kind = 'release'))";

const REEMIT_SQL: &str = "
WITH pending AS MATERIALIZED (
    -- One pass over the outbox per page, whatever the planner thinks of it.
    SELECT DISTINCT order_id FROM outbox WHERE kind = 'stock.release' AND order_id = ANY($1)
),
lost AS (
    UPDATE orders o
       SET release_repairs = o.release_repairs + 1, release_repaired_at = clock_timestamp()
     WHERE o.id = ANY($1) AND o.status = 'CLOSED' AND o.released_at IS NULL
       AND o.release_repairs < $2
       AND (o.release_repaired_at IS NULL
            OR o.release_repaired_at < now() - $3::bigint * interval '1 millisecond')
       AND NOT EXISTS (SELECT 1 FROM stock_ledger s WHERE s.order_id = o.id AND s.kind = 'release')
       AND NOT EXISTS (SELECT 1 FROM pending p WHERE p.order_id = o.id)
    RETURNING o.id, o.release_repairs
),
emitted AS (
    INSERT INTO outbox (kind, order_id, payload)
    SELECT 'stock.release', c.id, jsonb_build_object('order_id', c.id, 'lines',
           jsonb_agg(jsonb_build_object('sku', l.sku, 'qty', l.qty)))
      FROM lost c JOIN order_lines l ON l.order_id = c.id
     GROUP BY c.id
),
events AS (
    INSERT INTO order_events (order_id, event, detail)
    SELECT id, 'release_repaired', jsonb_build_object('by', 'reconciler', 'repair', release_repairs)
      FROM lost
)
SELECT count(*) FROM lost";

const EXHAUSTED_SQL: &str = "
SELECT count(*) FROM orders
 WHERE id = ANY($1) AND released_at IS NULL AND release_repairs >= $2";

/// One reconciler pass over every unstamped CLOSED order past the grace period.
pub async fn run_once(
    client: &mut deadpool_postgres::Client,
    config: &SweeperConfig,
    stats: &Stats,
) -> Result<ReconcileReport, DbError> {
    let mut report = ReconcileReport::default();
    let grace_ms = millis(config.release_grace);
    let mut after: (Option<DateTime<Utc>>, i64) = (None, 0);
    loop {
        let rows = client
            .query(
                "SELECT id, closed_at FROM orders
                  WHERE status = 'CLOSED' AND released_at IS NULL
                    AND closed_at < now() - $1::bigint * interval '1 millisecond'
                    AND ($2::timestamptz IS NULL OR (closed_at, id) > ($2, $3))
                  ORDER BY closed_at, id
                  LIMIT $4",
                &[&grace_ms, &after.0, &after.1, &config.batch_size],
            )
            .await?;
        let Some(last) = rows.last() else { break };
        after = (Some(last.try_get(1)?), last.try_get(0)?);
        let ids = rows
            .iter()
            .map(|r| r.try_get::<_, i64>(0))
            .collect::<Result<Vec<i64>, _>>()?;
        let tx = client.transaction().await?;
        let stamped = tx.execute(STAMP_SQL, &[&ids]).await?;
        let repaired: i64 = tx
            .query_one(REEMIT_SQL, &[&ids, &MAX_REPAIRS, &grace_ms])
            .await?
            .try_get(0)?;
        let exhausted: i64 = tx
            .query_one(EXHAUSTED_SQL, &[&ids, &MAX_REPAIRS])
            .await?
            .try_get(0)?;
        tx.commit().await?;
        report.scanned += rows.len();
        report.stamped += usize::try_from(stamped).unwrap_or(usize::MAX);
        report.repaired += usize::try_from(repaired).unwrap_or(0);
        report.exhausted += usize::try_from(exhausted).unwrap_or(0);
        if i64::try_from(rows.len()).unwrap_or(i64::MAX) < config.batch_size {
            break;
        }
        tokio::time::sleep(config.pause).await;
    }
    stats.record(
        Outcome::ReleaseRepaired,
        u64::try_from(report.repaired).unwrap_or(u64::MAX),
    );
    if report.repaired > 0 {
        tracing::warn!(
            repaired = report.repaired,
            "reconciler emitted stock releases again that were lost after their close"
        );
    }
    if report.exhausted > 0 {
        tracing::error!(
            orders = report.exhausted,
            max_repairs = MAX_REPAIRS,
            "closed orders are still unreleased after every re-emission: see <P>.parked for the reason"
        );
    }
    Ok(report)
}

/// A duration in whole milliseconds for SQL, saturating.
fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Re-emitted releases (should be 0): in the last `window_minutes`, and ever.
pub async fn repairs<C: GenericClient>(db: &C, window_minutes: i64) -> Result<(i64, i64), DbError> {
    let row = db
        .query_one(
            "SELECT count(*) FILTER (WHERE release_repaired_at > now() - $1::bigint * interval '1 minute'),
                    coalesce(sum(release_repairs), 0)::bigint
               FROM orders WHERE release_repaired_at IS NOT NULL",
            &[&window_minutes],
        )
        .await?;
    Ok((row.try_get(0)?, row.try_get(1)?))
}

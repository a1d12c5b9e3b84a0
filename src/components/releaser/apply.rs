//! One release transaction in three statements: the order rows first (skipping, and
//! listing, those another transaction holds), then the stock rows in SKU order, then, in
//! one statement, the ledger rows, the stock changes and the `released_at` stamp (except
//! for a row whose deadline lies outside the range lapse handles, which cannot be
//! updated). See the parent module for why this lock order.

use crate::db::{DbError, column};
use crate::deadline;

use super::Releaser;

/// What one release transaction did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReleaseOutcome {
    /// (order, sku) release rows that were new.
    pub applied: i64,
    /// Orders whose row another transaction held: not released, to be tried again.
    pub held: Vec<i64>,
}

// The orders are reached through their ids as rows (`unnest`), so each is one primary-key
// lookup. Written as `id = ANY($1)` next to a join, or with `released_at IS NULL` (the
// predicate of the partial index `orders_unreleased`), the planner read every CLOSED
// order (a sequential scan joined to the lines) or every entry of `orders_unreleased`
// for each batch whenever its statistics were older than the table (a fresh database, or
// a burst of closes before autovacuum's next analyze): work per batch that grew with the
// backlog the batch was part of (29 ms per batch of 8 at 50,000 unreleased orders).
const RELEASE_SQL: &str = concat!(
    "
WITH released AS (
    INSERT INTO stock_ledger (order_id, sku, kind, qty)
    SELECT l.order_id, l.sku, 'release', l.qty
      FROM unnest($1::bigint[]) AS r(id)
      JOIN orders o ON o.id = r.id
      JOIN order_lines l ON l.order_id = o.id
     WHERE o.status = 'CLOSED'
    ON CONFLICT DO NOTHING
    RETURNING sku, qty
),
",
    crate::close::restock_cte!(),
    "
stamped AS (
    -- What the reconciler looks for: CLOSED orders without this stamp. `$2` holds only
    -- rows this transaction locked unstamped, so no `released_at IS NULL` here: that
    -- condition would let the planner walk the whole `orders_unreleased` index.
    UPDATE orders o SET released_at = clock_timestamp()
      FROM unnest($2::bigint[]) AS s(id)
     WHERE o.id = s.id AND o.status = 'CLOSED'
    RETURNING 1
)
SELECT (SELECT count(*) FROM released) AS applied, (SELECT count(*) FROM restocked) AS restocked,
       (SELECT count(*) FROM stamped) AS stamped"
);

/// Locks the CLOSED orders among `$1` that no other transaction holds (`locked`), with
/// whether each still lacks its `released_at` stamp (`unstamped`; the lock keeps it so
/// until commit), and lists the CLOSED ones it skipped (`locked` false).
fn lock_sql() -> String {
    format!(
        "WITH locked AS (
             SELECT id, {} AS readable, released_at IS NULL AS unstamped,
                    expire_at::text AS raw FROM orders
              WHERE id = ANY($1) AND status = 'CLOSED'
              ORDER BY id FOR NO KEY UPDATE SKIP LOCKED)
         SELECT id, readable, unstamped, raw, true AS locked FROM locked
         UNION ALL
         SELECT id, false, false, NULL, false FROM orders
          WHERE id = ANY($1) AND status = 'CLOSED' AND id NOT IN (SELECT id FROM locked)",
        deadline::in_range_sql("expire_at")
    )
}

impl Releaser {
    /// Applies the releases of these orders of `shard`, except those whose row another
    /// transaction holds (returned as `held`, nothing done for them).
    pub async fn release(&self, shard: u16, order_ids: &[i64]) -> Result<ReleaseOutcome, DbError> {
        // A shard not migrated yet is away (held and tried again), never released on
        // its old schema.
        let pool = self.pools.ready(shard)?;
        let mut client = pool.get().await?;
        let tx = crate::db::begin_short(&mut client, pool.limits(), None).await?;
        // Order rows first, without waiting for one another transaction holds; in the
        // same statement the CLOSED orders it could not lock (CLOSED is final, so
        // those are held by someone else).
        let rows = tx
            .query_typed(
                &lock_sql(),
                &[(&order_ids, tokio_postgres::types::Type::INT8_ARRAY)],
            )
            .await?;
        let mut locked = Vec::with_capacity(rows.len());
        let mut stampable = Vec::with_capacity(rows.len());
        let mut held = Vec::new();
        for row in &rows {
            let id: i64 = column(row, "id")?;
            if !column::<bool>(row, "locked")? {
                held.push(id);
                continue;
            }
            // A stamped order was released before (a repeated event): nothing to do.
            // Its ledger rows are not consulted, so retention may have pruned them.
            let unstamped: bool = column(row, "unstamped")?;
            if !unstamped {
                continue;
            }
            locked.push(id);
            if column::<bool>(row, "readable")? {
                stampable.push(id);
            } else {
                let raw: String = column(row, "raw").unwrap_or_else(|_| "?".into());
                tracing::error!(order_id = id, deadline = %raw,
                    "releaser: released the stock of a closed order whose deadline lapse cannot handle, but cannot stamp its row; repair it (docs/operations.md)");
            }
        }
        // Then the stock rows in SKU order, as every writer of stock does.
        tx.execute_typed(
            "SELECT 1 FROM stock WHERE sku IN
                    (SELECT sku FROM order_lines WHERE order_id = ANY($1))
              ORDER BY sku FOR UPDATE",
            &[(&locked, tokio_postgres::types::Type::INT8_ARRAY)],
        )
        .await?;
        let row = tx
            .query_typed_one(
                RELEASE_SQL,
                &[
                    (&locked, tokio_postgres::types::Type::INT8_ARRAY),
                    (&stampable, tokio_postgres::types::Type::INT8_ARRAY),
                ],
            )
            .await?;
        tx.commit().await?;
        Ok(ReleaseOutcome {
            applied: column(&row, "applied")?,
            held,
        })
    }
}

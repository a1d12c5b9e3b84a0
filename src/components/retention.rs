//! Retention: the sweeper's leader deletes what lapse recorded about finished orders
//! once it is older than `retention.*` — timeline events, stock ledger rows, settled
//! late payments — in batches of `retention.batch_size`, oldest first.
//!
//! Never pruned, whatever its age: anything of an order that is still UNPAID (an open
//! deadline), or CLOSED without its stock release applied (`released_at` unset: an
//! effect not applied yet, which the releaser and the reconciler still work from), and
//! a late payment whose refund is PENDING. Finished is final (PAID and CLOSED never
//! change, nor does a `released_at` once set), so a row judged prunable stays so.
//!
//! What pruning takes away is not consulted by anything that decides: the releaser
//! skips an order already stamped `released_at` without reading its ledger rows, and a
//! pruned late payment leaves `orders.late_payment_pruned` set, which keeps "one refund
//! per order" (`lapse_pay_order` records no second one).
//!
//! Paced like the reconciler: each batch is one transaction that first renews the
//! lease (a leader that lost it stops), at most [`BATCHES_PER_PASS`] per table and pass,
//! with `sweeper.pause` between batches as idleness, not a stall; shutdown ends it
//! between batches. Each batch adds to `lapse_retention` (what `lapse status` shows) and
//! to `lapse_retention_pruned_total{table}`.

use std::time::Duration;

use tokio_postgres::types::Type;
use tokio_util::sync::CancellationToken;

use crate::config::{Keep, RetentionConfig};
use crate::db::{DbError, Lease, Limits, column};
use crate::observe::metric_catalog as m;
use crate::runtime::health::Busy;

/// Batches one pass deletes at most per table; the next pass goes on.
pub const BATCHES_PER_PASS: usize = 50;

/// A table lapse prunes, in the order they are pruned ([`TABLES`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Table {
    Timeline,
    Ledger,
    LatePayments,
}

/// The three tables, in the order they are pruned.
pub const TABLES: [Table; 3] = [Table::Timeline, Table::Ledger, Table::LatePayments];

/// Deletes one batch of timeline events: `$1` the age in milliseconds, `$2` the batch
/// size; returns the deleted rows' count as `pruned`.
const TIMELINE_SQL: &str = "WITH gone AS (
        DELETE FROM order_events
         WHERE ctid = ANY (ARRAY(
               SELECT e.ctid FROM order_events e
                WHERE e.at < now() - $1::bigint * interval '1 millisecond'
                  AND NOT EXISTS (
                      SELECT 1 FROM orders o
                       WHERE o.id = e.order_id
                         AND (o.status = 'UNPAID'
                              OR (o.status = 'CLOSED' AND o.released_at IS NULL)))
                ORDER BY e.at
                LIMIT $2))
        RETURNING 1)
    SELECT count(*) AS pruned FROM gone";

/// The same for ledger rows.
const LEDGER_SQL: &str = "WITH gone AS (
        DELETE FROM stock_ledger
         WHERE ctid = ANY (ARRAY(
               SELECT l.ctid FROM stock_ledger l
                 JOIN orders o ON o.id = l.order_id
                WHERE l.at < now() - $1::bigint * interval '1 millisecond'
                  AND (o.status = 'PAID'
                       OR (o.status = 'CLOSED' AND o.released_at IS NOT NULL))
                ORDER BY l.at
                LIMIT $2))
        RETURNING 1)
    SELECT count(*) AS pruned FROM gone";

impl Table {
    /// As in `lapse_retention.table_name` and the metric's `table` label.
    pub fn name(self) -> &'static str {
        m::RETENTION_TABLES[self as usize]
    }

    /// How long `config` keeps this table's rows.
    fn keep(self, config: &RetentionConfig) -> Keep {
        match self {
            Table::Timeline => config.timeline,
            Table::Ledger => config.ledger,
            Table::LatePayments => config.late_payments,
        }
    }

    /// Deletes one batch in `tx`; returns how many rows went.
    async fn prune(
        self,
        tx: &tokio_postgres::Transaction<'_>,
        age_ms: i64,
        batch: i64,
    ) -> Result<i64, DbError> {
        let sql = match self {
            Table::Timeline => TIMELINE_SQL,
            Table::Ledger => LEDGER_SQL,
            // Two statements of its own: the orders are locked first, as
            // `lapse_pay_order` locks them.
            Table::LatePayments => return prune_late_payments(tx, age_ms, batch).await,
        };
        let row = tx
            .query_typed_one(sql, &[(&age_ms, Type::INT8), (&batch, Type::INT8)])
            .await?;
        column(&row, "pruned")
    }
}

/// Rows one pass deleted, per table (in [`TABLES`] order).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetentionReport {
    pub pruned: [i64; 3],
    /// The lease was lost part-way: the pass stopped there.
    pub lost_lead: bool,
}

/// One pass over every table, as the leader holding `lease`.
#[allow(clippy::too_many_arguments)]
pub async fn run_pass(
    client: &mut deadpool_postgres::Client,
    limits: Limits,
    lease: &mut Lease,
    config: &RetentionConfig,
    pause: Duration,
    busy: Option<&Busy>,
    token: &CancellationToken,
) -> Result<RetentionReport, DbError> {
    let mut report = RetentionReport::default();
    for (index, table) in TABLES.iter().enumerate() {
        let Some(age_ms) = table.keep(config).millis() else {
            continue;
        };
        for _ in 0..BATCHES_PER_PASS {
            if token.is_cancelled() {
                return Ok(report);
            }
            let tx = crate::db::begin_short(client, limits, None).await?;
            if !lease.fence(&tx, None).await? {
                report.lost_lead = true;
                return Ok(report);
            }
            let pruned = table.prune(&tx, age_ms, config.batch_size).await?;
            if pruned > 0 {
                tx.execute_typed(
                    "INSERT INTO lapse_retention AS r (table_name, pruned, last_pruned_at)
                     VALUES ($1, $2, clock_timestamp())
                     ON CONFLICT (table_name) DO UPDATE
                        SET pruned = r.pruned + EXCLUDED.pruned,
                            last_pruned_at = EXCLUDED.last_pruned_at",
                    &[(&table.name(), Type::TEXT), (&pruned, Type::INT8)],
                )
                .await?;
            }
            tx.commit().await?;
            report.pruned[index] += pruned;
            metrics::counter!(m::RETENTION_PRUNED, "table" => table.name())
                .increment(u64::try_from(pruned).unwrap_or(0));
            if pruned < config.batch_size {
                break;
            }
            let rest = async {
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = token.cancelled() => {}
                }
            };
            match busy {
                Some(busy) => busy.idle_while(rest).await,
                None => rest.await,
            }
        }
    }
    Ok(report)
}

/// One batch of settled late payments of finished orders: their orders are locked
/// first (`SKIP LOCKED`: an order the shop holds waits for the next pass), in id order
/// as `lapse_pay_order` locks an order before its late payment, so a payment racing the
/// prune waits, then sees `late_payment_pruned` and records nothing; then the rows are
/// deleted and the orders remember them. An order whose deadline lies outside the range
/// lapse handles cannot be updated and is left alone.
async fn prune_late_payments(
    tx: &tokio_postgres::Transaction<'_>,
    age_ms: i64,
    batch: i64,
) -> Result<i64, DbError> {
    let sane = crate::deadline::in_range_sql("o.expire_at");
    let victims = tx
        .query_typed(
            &format!(
                "SELECT l.id, l.order_id FROM late_payments l JOIN orders o ON o.id = l.order_id
                  WHERE l.refund <> 'PENDING'
                    AND l.received_at < now() - $1::bigint * interval '1 millisecond'
                    AND (o.status = 'PAID' OR (o.status = 'CLOSED' AND o.released_at IS NOT NULL))
                    AND {sane}
                  ORDER BY l.received_at
                  LIMIT $2"
            ),
            &[(&age_ms, Type::INT8), (&batch, Type::INT8)],
        )
        .await?;
    if victims.is_empty() {
        return Ok(0);
    }
    let mut payments = Vec::with_capacity(victims.len());
    let mut orders = Vec::with_capacity(victims.len());
    for v in &victims {
        payments.push(column::<i64>(v, "id")?);
        orders.push(column::<i64>(v, "order_id")?);
    }
    let locked = tx
        .query_typed(
            "SELECT id FROM orders WHERE id = ANY($1) ORDER BY id FOR UPDATE SKIP LOCKED",
            &[(&orders, Type::INT8_ARRAY)],
        )
        .await?;
    let locked: Vec<i64> = locked
        .iter()
        .map(|r| column::<i64>(r, "id"))
        .collect::<Result<_, _>>()?;
    let row = tx
        .query_typed_one(
            "WITH gone AS (
                 DELETE FROM late_payments
                  WHERE id = ANY($1) AND order_id = ANY($2) AND refund <> 'PENDING'
                 RETURNING order_id),
             remembered AS (
                 UPDATE orders SET late_payment_pruned = true
                  WHERE id IN (SELECT order_id FROM gone) AND NOT late_payment_pruned
                 RETURNING 1)
             SELECT count(*) AS pruned, (SELECT count(*) FROM remembered) AS remembered
               FROM gone",
            &[(&payments, Type::INT8_ARRAY), (&locked, Type::INT8_ARRAY)],
        )
        .await?;
    column(&row, "pruned")
}

/// What `lapse_retention` holds: rows pruned ever, over every table, and how long ago
/// the last batch ran (`None` before the first).
pub async fn pruned<C: tokio_postgres::GenericClient>(
    db: &C,
) -> Result<(i64, Option<f64>), DbError> {
    let row = db
        .query_typed_one(
            "SELECT coalesce(sum(pruned), 0)::bigint AS pruned,
                    extract(epoch FROM now() - max(last_pruned_at))::float8 * 1000 AS last_ms
               FROM lapse_retention",
            &[],
        )
        .await?;
    Ok((column(&row, "pruned")?, column(&row, "last_ms")?))
}

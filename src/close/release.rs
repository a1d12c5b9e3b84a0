//! The example shop's stock release applied in the close's own transaction
//! (`worker.stock_release = "in_close"`, the default): one more statement after the
//! close instead of an outbox row, a broker message, a delivery and the releaser's
//! transaction per batch (docs/pipeline.md, "The stock release").
//!
//! Locks: the close holds the order rows; this statement then locks their stock rows
//! in SKU order with `FOR NO KEY UPDATE SKIP LOCKED` (the lock its UPDATE takes, which
//! lets a shop's rows referencing `stock` be inserted meanwhile), so it never waits for
//! a row lock, and its table locks wait at most [`TABLE_LOCK_WAIT`] (then the batch's
//! releases go to the outbox, whose insert waits as any close's would): no deadlock
//! with checkouts, payments or the releaser, whatever order they take locks in, and a
//! checkout holding a SKU's row (inside a slow payment call) never stalls a close. An
//! order one of whose SKUs another transaction holds is not released here: it gets the
//! stock-release outbox row the event path writes, and the releaser applies it later,
//! as it does every release in `event` mode.
//!
//! Exactly once, as in the releaser: the ledger's key (order, sku, 'release') makes a
//! repeat a no-op and `released_at` is stamped in the same statement; the reconciler
//! still finds a CLOSED order left unstamped.

use tokio_postgres::Transaction;

use crate::db::{DbError, column};

/// Chosen in the configuration (`worker.stock_release`), which owns the type.
pub use crate::config::StockRelease;

/// How long the release waits for a table lock (not a row lock: those it skips)
/// before it gives the batch's releases to the event path.
pub const TABLE_LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// What the release of one batch of closes did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// (order, sku) release rows applied.
    pub applied: i64,
    /// Closed orders whose release went to the outbox instead (a stock row locked).
    pub deferred: i64,
}

// `lines` and `held` are MATERIALIZED so each runs once: the stock rows are locked
// once, in SKU order, before anything is written. An order is deferred when one of its
// SKUs has a stock row this statement could not lock; a SKU without a stock row is
// released as the releaser releases it (a ledger row, nothing to restock).
const RELEASE_IN_CLOSE_SQL: &str = concat!(
    "
WITH lines AS MATERIALIZED (
    SELECT l.order_id, l.sku, l.qty
      FROM unnest($1::bigint[]) AS c(id) JOIN order_lines l ON l.order_id = c.id
),
held AS MATERIALIZED (
    SELECT s.sku FROM stock s WHERE s.sku IN (SELECT sku FROM lines)
     ORDER BY s.sku FOR NO KEY UPDATE SKIP LOCKED
),
deferred AS MATERIALIZED (
    SELECT DISTINCT l.order_id AS id FROM lines l JOIN stock s ON s.sku = l.sku
     WHERE l.sku NOT IN (SELECT sku FROM held)
),
in_place AS (
    SELECT c.id FROM unnest($1::bigint[]) AS c(id) WHERE c.id NOT IN (SELECT id FROM deferred)
),
released AS (
    INSERT INTO stock_ledger (order_id, sku, kind, qty)
    SELECT l.order_id, l.sku, 'release', l.qty FROM lines l
     WHERE l.order_id IN (SELECT id FROM in_place)
    ON CONFLICT DO NOTHING
    RETURNING sku, qty
),
",
    super::restock_cte!(),
    "
stamped AS (
    UPDATE orders o SET released_at = clock_timestamp()
      FROM in_place i WHERE o.id = i.id AND o.status = 'CLOSED'
    RETURNING 1
),
outboxed AS (
    ",
    super::release_outbox_insert!("deferred"),
    "
    RETURNING 1
)
SELECT (SELECT count(*) FROM released) AS applied, (SELECT count(*) FROM restocked) AS restocked,
       (SELECT count(*) FROM stamped) AS stamped, (SELECT count(*) FROM deferred) AS deferred,
       (SELECT count(*) FROM outboxed) AS outboxed"
);

/// The stock-release outbox rows of every order in `$1` (the event path).
const DEFER_ALL_SQL: &str = concat!(
    "WITH deferred AS (SELECT unnest($1::bigint[]) AS id)
",
    super::release_outbox_insert!("deferred")
);

/// Releases the stock of `closed` (orders `tx` just closed and still holds) in `tx`,
/// or defers an order to the event path when one of its stock rows is locked.
///
/// In a savepoint: a release the data refuses (a stock row an operator changed by
/// hand so that `reserved` would go negative, a constraint or trigger of the shop's)
/// must not undo the closes. The whole batch's releases then go to the event path,
/// where the stock releaser parks the one that fails and releases the others.
pub async fn in_close(tx: &Transaction<'_>, closed: &[i64]) -> Result<Released, DbError> {
    if closed.is_empty() {
        return Ok(Released::default());
    }
    // The release statement's table locks (DDL, VACUUM FULL on stock, the ledger, the
    // order lines or the outbox) are waited for briefly; the close's own lock timeout,
    // read here, is restored after it (no custom setting: some servers refuse those).
    let setup = tx
        .simple_query(&format!(
            "SAVEPOINT lapse_release; SELECT current_setting('lock_timeout');
             SET LOCAL lock_timeout = '{}ms'",
            TABLE_LOCK_WAIT.as_millis()
        ))
        .await?;
    let restore = setup
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_string),
            _ => None,
        })
        .filter(|v| v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.'))
        // Unreadable (never seen): database.lock_timeout's default rather than none.
        .unwrap_or_else(|| "5s".to_string());
    let attempt = tx
        .query_typed_one(
            RELEASE_IN_CLOSE_SQL,
            &[(&closed, tokio_postgres::types::Type::INT8_ARRAY)],
        )
        .await;
    match attempt {
        Ok(row) => {
            tx.batch_execute(&format!(
                "RELEASE SAVEPOINT lapse_release; SET LOCAL lock_timeout = '{restore}'"
            ))
            .await?;
            Ok(Released {
                applied: column(&row, "applied")?,
                deferred: column(&row, "deferred")?,
            })
        }
        Err(e) => {
            tracing::warn!(error = %e, orders = closed.len(),
                "close: the stock release in the close's transaction failed; the batch's releases go to the stock releaser");
            // Only what the database refused goes on; a lost connection fails here. The
            // rollback also undoes the shorter lock timeout.
            tx.batch_execute("ROLLBACK TO SAVEPOINT lapse_release")
                .await?;
            let deferred = tx
                .execute_typed(
                    DEFER_ALL_SQL,
                    &[(&closed, tokio_postgres::types::Type::INT8_ARRAY)],
                )
                .await?;
            Ok(Released {
                applied: 0,
                deferred: i64::try_from(deferred).unwrap_or(i64::MAX),
            })
        }
    }
}

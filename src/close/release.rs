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
    /// The database refused the release (logged with its error): every order of the
    /// batch went to the outbox.
    pub refused: bool,
}

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
    // `lapse_release_closed_stock` (migration V16): the release statement in a
    // subtransaction, its table locks waited for at most TABLE_LOCK_WAIT, the close's
    // own lock timeout restored after it. A function, so that each server connection
    // plans the statement once rather than at every close.
    let row = tx
        .query_typed_one(
            "SELECT applied, deferred, refused FROM lapse_release_closed_stock($1, $2)",
            &[
                (&closed, tokio_postgres::types::Type::INT8_ARRAY),
                (
                    &format!("{}ms", TABLE_LOCK_WAIT.as_millis()),
                    tokio_postgres::types::Type::TEXT,
                ),
            ],
        )
        .await?;
    let refused = column::<Option<String>>(&row, "refused")?;
    if let Some(refused) = &refused {
        tracing::warn!(error = %refused, orders = closed.len(),
            "close: the stock release in the close's transaction failed; the batch's releases go to the stock releaser");
    }
    Ok(Released {
        applied: column(&row, "applied")?,
        deferred: column(&row, "deferred")?,
        refused: refused.is_some(),
    })
}

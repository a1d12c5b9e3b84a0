//! The backlog as every relay sees it: outbox rows waiting and the age of the oldest,
//! and UNPAID orders past their deadline and the age of the oldest, sampled on a timer
//! (not only by the sweeper's leader), so that a stuck outbox or orders nobody closes
//! show on any worker's `/metrics`.

use std::time::Duration;

use crate::db::Pool;
use tokio_util::sync::CancellationToken;

use crate::observe::metric_catalog as m;

/// How often the backlog is sampled: `count(*)` over the outbox, and over overdue
/// orders up to [`OVERDUE_COUNT_CAP`], is cheap at this pace even with a large backlog.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// Overdue orders are counted up to this many (an index range scan, bounded); the
/// gauge reads the cap when there are more.
pub const OVERDUE_COUNT_CAP: i64 = 100_000;

/// One sample.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Backlog {
    /// Rows waiting in the outbox.
    pub outbox_rows: i64,
    /// Age of the oldest outbox row in seconds (zero when empty).
    pub outbox_oldest_s: f64,
    /// UNPAID orders whose deadline has passed (by the database clock), at most
    /// [`OVERDUE_COUNT_CAP`].
    pub overdue: i64,
    /// How long the oldest of them is overdue, in seconds (zero when none).
    pub overdue_oldest_s: f64,
}

/// Samples the outbox and the overdue orders in one short transaction.
pub async fn sample(pool: &Pool) -> Result<Backlog, crate::db::DbError> {
    let mut client = pool.get().await?;
    let tx = crate::db::begin_short(&mut client, pool.limits(), None).await?;
    let sane = crate::deadline::in_range_sql("expire_at");
    let row = tx
        .query_typed_one(
            &format!(
                "SELECT (SELECT count(*) FROM outbox) AS waiting,
                        (SELECT COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(created_at)), 0)::float8
                           FROM outbox) AS oldest_s,
                        (SELECT count(*) FROM (SELECT 1 FROM orders
                                                WHERE status = 'UNPAID' AND expire_at <= now() AND {sane}
                                                LIMIT $1) o) AS overdue,
                        (SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(expire_at)), 0)::float8
                           FROM orders WHERE status = 'UNPAID' AND expire_at <= now() AND {sane}) AS overdue_s"
            ),
            &[(&OVERDUE_COUNT_CAP, tokio_postgres::types::Type::INT8)],
        )
        .await?;
    // The kinds' outbox too, where this database has it (migration V14).
    let (kind_rows, kind_oldest_ms, _) = crate::kinds::status::outbox(&tx).await?;
    tx.commit().await?;
    let column = |name: &str| crate::db::column::<f64>(&row, name);
    let kind_oldest_s = kind_oldest_ms.unwrap_or(0.0) / 1000.0;
    Ok(Backlog {
        outbox_rows: crate::db::column::<i64>(&row, "waiting")? + kind_rows,
        outbox_oldest_s: column("oldest_s")?.max(kind_oldest_s).max(0.0),
        overdue: crate::db::column(&row, "overdue")?,
        overdue_oldest_s: column("overdue_s")?.max(0.0),
    })
}

/// Samples until `token` is cancelled; a failed sample leaves the last values and is
/// logged at debug level (the relay's own errors say more). With shards, `shard` is the
/// gauges' `shard` label.
pub async fn run(pool: Pool, shard: Option<String>, token: CancellationToken) {
    let labels: Vec<(&'static str, String)> = shard.map(|s| vec![("shard", s)]).unwrap_or_default();
    loop {
        match sample(&pool).await {
            Ok(b) => {
                metrics::gauge!(m::OUTBOX_ROWS, &labels).set(b.outbox_rows as f64);
                metrics::gauge!(m::OUTBOX_OLDEST_AGE, &labels).set(b.outbox_oldest_s);
                metrics::gauge!(m::ORDERS_OVERDUE, &labels).set(b.overdue as f64);
                metrics::gauge!(m::ORDERS_OVERDUE_OLDEST_AGE, &labels).set(b.overdue_oldest_s);
            }
            Err(e) => tracing::debug!(error = %e, "relay: cannot sample the backlog"),
        }
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(SAMPLE_EVERY) => {}
        }
    }
}

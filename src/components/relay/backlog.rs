//! The outbox backlog as every relay sees it: rows waiting and the age of the oldest,
//! sampled on a timer (not only by the sweeper's leader), so that a stuck outbox shows
//! on any worker's `/metrics`.

use std::time::Duration;

use crate::db::Pool;
use tokio_util::sync::CancellationToken;

use crate::observe::metric_catalog as m;

/// How often the backlog is sampled: `count(*)` over the outbox is cheap at this pace
/// even with a large backlog.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// Rows waiting in the outbox and the age of the oldest (zero when empty).
pub async fn sample(pool: &Pool) -> Result<(i64, f64), crate::db::DbError> {
    let mut client = pool.get().await?;
    let tx = crate::db::begin_short(&mut client, pool.limits(), None).await?;
    let row = tx
        .query_typed_one(
            "SELECT count(*) AS waiting,
                    COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(created_at)), 0)::float8 AS oldest_s
               FROM outbox",
            &[],
        )
        .await?;
    tx.commit().await?;
    let waiting = crate::db::column(&row, "waiting")?;
    let oldest: f64 = crate::db::column(&row, "oldest_s")?;
    Ok((waiting, oldest.max(0.0)))
}

/// Samples until `token` is cancelled; a failed sample leaves the last values and is
/// logged at debug level (the relay's own errors say more). With shards, `shard` is the
/// gauges' `shard` label.
pub async fn run(pool: Pool, shard: Option<String>, token: CancellationToken) {
    loop {
        match sample(&pool).await {
            Ok((rows, oldest)) => match &shard {
                Some(shard) => {
                    metrics::gauge!(m::OUTBOX_ROWS, "shard" => shard.clone()).set(rows as f64);
                    metrics::gauge!(m::OUTBOX_OLDEST_AGE, "shard" => shard.clone()).set(oldest);
                }
                None => {
                    metrics::gauge!(m::OUTBOX_ROWS).set(rows as f64);
                    metrics::gauge!(m::OUTBOX_OLDEST_AGE).set(oldest);
                }
            },
            Err(e) => tracing::debug!(error = %e, "relay: cannot sample the outbox backlog"),
        }
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(SAMPLE_EVERY) => {}
        }
    }
}

//! The backstop sweeper: every interval, one leader (advisory lock) scans UNPAID
//! orders overdue by more than a grace period — keyset pagination over the partial
//! index, bounded batches, a pause between them — and closes them through the same
//! close path as the worker. What it closes should be ~0; a rise means the message
//! path is losing timeouts. It also reports outbox rows older than a threshold (a
//! stuck relay), and, still as the leader, runs the release reconciler
//! ([`crate::reconciler`]), which emits again the stock releases lost after a close.

use chrono::{DateTime, Utc};
use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;

use crate::close::{self, Candidate, CloseReason};
use crate::config::SweeperConfig;
use crate::db::DbError;
use crate::health::Health;
use crate::rate::RateLimiter;
use crate::reconciler;
use crate::stats::{Outcome, Stats};

/// Advisory lock key of the sweeper leader ("sweep").
pub const LEADER_LOCK: i64 = 0x0073_7765_6570;

#[derive(Clone)]
pub struct Sweeper {
    pub pool: Pool,
    pub stats: Stats,
    pub config: SweeperConfig,
    pub limiter: RateLimiter,
}

/// What one sweep did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// False when another sweeper held the leader lock (nothing was scanned).
    pub leader: bool,
    pub scanned: usize,
    pub closed: usize,
    /// Outbox rows older than `stuck_outbox_after`.
    pub stuck_outbox: i64,
    /// Lost stock releases the reconciler emitted again (should be 0).
    pub releases_repaired: usize,
}

impl Sweeper {
    pub async fn run_once(&self) -> Result<SweepReport, DbError> {
        let mut client = self.pool.get().await?;
        let leader: bool = client
            .query_one("SELECT pg_try_advisory_lock($1)", &[&LEADER_LOCK])
            .await?
            .get(0);
        if !leader {
            return Ok(SweepReport::default());
        }
        let mut result = self.sweep(&mut client).await;
        if let Ok(report) = &mut result {
            match reconciler::run_once(&mut client, &self.config, &self.stats).await {
                Ok(r) => report.releases_repaired = r.repaired,
                Err(e) => result = Err(e),
            }
        }
        let _ = client
            .execute("SELECT pg_advisory_unlock($1)", &[&LEADER_LOCK])
            .await;
        result
    }

    async fn sweep(&self, client: &mut deadpool_postgres::Client) -> Result<SweepReport, DbError> {
        let mut report = SweepReport {
            leader: true,
            ..Default::default()
        };
        let grace_ms = self.config.grace.as_millis() as i64;
        let mut after: (Option<DateTime<Utc>>, i64) = (None, 0);
        loop {
            let rows = client
                .query(
                    "SELECT id, deadline_version, expire_at FROM orders
                      WHERE status = 'UNPAID'
                        AND expire_at < now() - $1::bigint * interval '1 millisecond'
                        AND ($2::timestamptz IS NULL OR (expire_at, id) > ($2, $3))
                      ORDER BY expire_at, id
                      LIMIT $4",
                    &[&grace_ms, &after.0, &after.1, &self.config.batch_size],
                )
                .await?;
            let Some(last) = rows.last() else { break };
            after = (Some(last.get(2)), last.get(0));
            let candidates: Vec<Candidate> = rows
                .iter()
                .map(|r| Candidate {
                    order_id: r.get(0),
                    deadline_version: r.get(1),
                    hops: 0,
                })
                .collect();
            let tx = client.transaction().await?;
            let closed = close::close_due(&*tx, &candidates, CloseReason::Sweeper).await?;
            tx.commit().await?;
            self.limiter.acquire(closed.len()).await;
            for c in &closed {
                self.stats.lateness(c.lateness(), "sweeper");
            }
            report.scanned += rows.len();
            report.closed += closed.len();
            self.stats.record(Outcome::SweptClosed, closed.len() as u64);
            if (rows.len() as i64) < self.config.batch_size {
                break;
            }
            tokio::time::sleep(self.config.pause).await;
        }
        let stuck_ms = self.config.stuck_outbox_after.as_millis() as i64;
        report.stuck_outbox = client
            .query_one(
                "SELECT count(*) FROM outbox
                  WHERE created_at < clock_timestamp() - $1::bigint * interval '1 millisecond'",
                &[&stuck_ms],
            )
            .await?
            .get(0);
        metrics::gauge!("lapse_outbox_stuck_rows").set(report.stuck_outbox as f64);
        if report.closed > 0 {
            tracing::warn!(
                closed = report.closed,
                "sweeper closed overdue orders the message path missed"
            );
        }
        if report.stuck_outbox > 0 {
            tracing::warn!(
                rows = report.stuck_outbox,
                "outbox rows are waiting too long: is a relay running?"
            );
        }
        Ok(report)
    }

    pub async fn run(self, health: Health, token: CancellationToken) {
        loop {
            match self.run_once().await {
                Ok(report) => {
                    health.up("sweeper");
                    tracing::debug!(?report, "sweep done");
                }
                Err(e) => {
                    health.down("sweeper", e.to_string());
                    tracing::warn!(error = %e, "sweeper: database error");
                }
            }
            tokio::select! {
                _ = token.cancelled() => return,
                _ = tokio::time::sleep(self.config.interval) => {}
            }
        }
    }
}

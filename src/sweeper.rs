//! The backstop sweeper: every interval, one leader (advisory lock) scans UNPAID
//! orders overdue by more than a grace period — keyset pagination over the partial
//! index, bounded batches, a pause between them — and closes them through the same
//! close path as the worker. What it closes should be ~0; a rise means the message
//! path is losing timeouts. It also reports outbox rows older than a threshold (a
//! stuck relay). An order whose row another transaction holds locked is skipped
//! (`SKIP LOCKED` in the close path) and left to the next sweep.

use std::time::Duration;

use chrono::{DateTime, Utc};
use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;

use crate::close::{self, Candidate, CloseReason};
use crate::config::SweeperConfig;
use crate::db::DbError;
use crate::health::Busy;
use crate::health::Health;
use crate::rate::RateLimiter;
use crate::stats::{Outcome, Stats};

/// Advisory lock key of the sweeper leader ("sweep").
pub const LEADER_LOCK: i64 = 0x0073_7765_6570;

#[derive(Clone)]
pub struct Sweeper {
    pub pool: Pool,
    pub stats: Stats,
    pub config: SweeperConfig,
    pub limiter: RateLimiter,
    /// Bound on waiting for a lock other than a row lock in the close statement.
    pub lock_timeout: Duration,
}

/// What one sweep did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// False when another sweeper held the leader lock (nothing was scanned).
    pub leader: bool,
    pub scanned: usize,
    pub closed: usize,
    /// Overdue orders skipped because another transaction held their row lock.
    pub locked: usize,
    /// Outbox rows older than `stuck_outbox_after`.
    pub stuck_outbox: i64,
}

impl Sweeper {
    pub async fn run_once(&self) -> Result<SweepReport, DbError> {
        self.sweep_once(None).await
    }

    /// One sweep; `busy` (when given) hears of progress after every batch.
    async fn sweep_once(&self, busy: Option<&Busy>) -> Result<SweepReport, DbError> {
        let mut client = self.pool.get().await?;
        let leader: bool = client
            .query_one("SELECT pg_try_advisory_lock($1)", &[&LEADER_LOCK])
            .await?
            .get(0);
        if !leader {
            return Ok(SweepReport::default());
        }
        let result = self.sweep(&mut client, busy).await;
        let _ = client
            .execute("SELECT pg_advisory_unlock($1)", &[&LEADER_LOCK])
            .await;
        result
    }

    async fn sweep(
        &self,
        client: &mut deadpool_postgres::Client,
        busy: Option<&Busy>,
    ) -> Result<SweepReport, DbError> {
        let mut report = SweepReport {
            leader: true,
            ..Default::default()
        };
        let grace_ms = i64::try_from(self.config.grace.as_millis()).unwrap_or(i64::MAX);
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
            let done =
                close::close_due(&tx, &candidates, CloseReason::Sweeper, self.lock_timeout).await?;
            tx.commit().await?;
            let closed = done.closed;
            // Pacing is deliberate idleness, not a stall.
            let pace = async {
                self.limiter.acquire(closed.len()).await;
                if rows.len() >= self.config.batch_size.try_into().unwrap_or(usize::MAX) {
                    tokio::time::sleep(self.config.pause).await;
                }
            };
            match busy {
                Some(busy) => busy.idle_while(pace).await,
                None => pace.await,
            }
            for c in &closed {
                self.stats.lateness(c.lateness(), "sweeper");
            }
            report.scanned += rows.len();
            report.closed += closed.len();
            report.locked += done.locked.len();
            self.stats.record(Outcome::SweptClosed, closed.len() as u64);
            self.stats.record(Outcome::Locked, done.locked.len() as u64);
            if rows.len() < self.config.batch_size.try_into().unwrap_or(usize::MAX) {
                break;
            }
        }
        let stuck_ms =
            i64::try_from(self.config.stuck_outbox_after.as_millis()).unwrap_or(i64::MAX);
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
            let busy = health.busy("sweeper");
            let swept = self.sweep_once(Some(&busy)).await;
            drop(busy);
            match swept {
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

//! The backstop sweeper: every interval, one leader (a lease, [`Lease`]) scans UNPAID
//! orders overdue by more than a grace period — keyset pagination over the partial
//! index, bounded batches, a pause between them — and closes them through the same
//! close path as the worker. What it closes should be ~0; a rise means the message
//! path is losing timeouts. It also reports outbox rows older than a threshold (a
//! stuck relay), and, still as the leader, runs the release reconciler
//! ([`crate::components::reconciler`]), which emits again the stock releases lost after a close.
//! An overdue row whose deadline lapse cannot handle (written before the deadline
//! rules existed) is skipped with a reason and counted; the sweep goes on.
//! An order whose row another transaction holds locked is skipped (`SKIP LOCKED`
//! in the close path) and left to the next sweep.
//! Shutdown ends a sweep between batches and cuts its pauses and rate-limit waits
//! short; each batch (and each reconciler page) is reported as progress.
//!
//! Leadership: each batch's (and each reconciler page's) transaction renews the lease
//! first and writes nothing when it is no longer ours; the sweep then stops. A leader
//! that freezes or is cut off loses the lead `sweeper.lease` after its last batch
//! (the short-transaction idle limit, 5 s, when it froze inside one), and another
//! worker takes over at its next sweep. A leader that is merely slow (a paced batch)
//! keeps the lead unless another worker took it over meanwhile. The lease is given up
//! on shutdown.

use std::time::Duration;

use crate::db::Pool;
use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

use crate::close::{self, Candidate, CloseReason};
use crate::components::reconciler;
use crate::components::retention;
use crate::config::{RetentionConfig, SweeperConfig};
use crate::db::{DbError, Lease, column};
use crate::deadline;
use crate::observe::metric_catalog as m;
use crate::observe::stats::{Outcome, Stats};
use crate::runtime::health::Busy;
use crate::runtime::health::Health;
use crate::runtime::rate::RateLimiter;

/// The name of the sweeper's lease (one per order database).
pub const LEASE: &str = "sweeper";

/// How long giving the lease up on shutdown may take.
const GIVE_UP_WITHIN: Duration = Duration::from_secs(2);

#[derive(Clone)]
pub struct Sweeper {
    pub pool: Pool,
    pub stats: Stats,
    pub config: SweeperConfig,
    /// What the leader prunes after each sweep, and after how long.
    pub retention: RetentionConfig,
    pub limiter: RateLimiter,
    /// Bound on waiting for a lock other than a row lock in the close statement.
    pub lock_timeout: Duration,
    /// Where the stock release of what it closes is applied.
    pub stock_release: close::StockRelease,
}

/// What one sweep did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// False when another sweeper held the lease (nothing was scanned).
    pub leader: bool,
    /// True when the lease was lost part-way (expired while this worker was frozen or
    /// cut off, or taken over): the sweep stopped there.
    pub lost_lead: bool,
    pub scanned: usize,
    pub closed: usize,
    /// Overdue orders skipped because another transaction held their row lock.
    pub locked: usize,
    /// Outbox rows older than `stuck_outbox_after`.
    pub stuck_outbox: i64,
    /// Lost stock releases the reconciler emitted again (should be 0).
    pub releases_repaired: usize,
    /// CLOSED orders the reconciler skipped because their deadline lies outside the
    /// range lapse handles (their row cannot be stamped until repaired).
    pub releases_unreadable: usize,
    /// Overdue orders skipped because their deadline cannot be decoded or lies outside
    /// the range lapse handles (written before the deadline rules existed).
    pub unreadable: usize,
    /// Rows retention pruned, per table (`retention::TABLES` order).
    pub pruned: [i64; 3],
}

/// An overdue row as a close candidate, or why it is skipped.
fn sweepable(row: &tokio_postgres::Row) -> Result<Candidate, String> {
    let id: i64 = column(row, "id").map_err(|e| e.to_string())?;
    let readable = column::<DateTime<Utc>>(row, "expire_at")
        .map_err(|e| e.to_string())
        .and_then(|t| deadline::checked(t).map_err(|e| e.to_string()));
    if let Err(e) = readable {
        let raw: String = column(row, "raw").unwrap_or_else(|_| "?".into());
        return Err(format!("order {id} ({raw}): {e}"));
    }
    Ok(Candidate {
        order_id: id,
        deadline_version: column(row, "deadline_version")
            .map_err(|e| format!("order {id}: {e}"))?,
        hops: 0,
    })
}

impl SweepReport {
    /// Sets the gauges a leader's sweep measures, labelled `shard` when given.
    fn export(&self, shard: Option<&str>) {
        if !self.leader {
            return;
        }
        let (unreadable, stuck) = (self.unreadable as f64, self.stuck_outbox as f64);
        match shard {
            Some(shard) => {
                let shard = shard.to_string();
                metrics::gauge!(m::UNREADABLE_DEADLINES, "shard" => shard.clone()).set(unreadable);
                metrics::gauge!(m::OUTBOX_STUCK, "shard" => shard).set(stuck);
            }
            None => {
                metrics::gauge!(m::UNREADABLE_DEADLINES).set(unreadable);
                metrics::gauge!(m::OUTBOX_STUCK).set(stuck);
            }
        }
    }
}

impl Sweeper {
    /// One sweep and one reconciler pass from the start of its index, as leader when
    /// no other worker leads; the lease is given up afterwards.
    pub async fn run_once(&self) -> Result<SweepReport, DbError> {
        let token = CancellationToken::new();
        let mut lease = Lease::new(LEASE, self.config.lease);
        let report = self
            .sweep_once(&mut lease, None, &token, &mut reconciler::Cursor::default())
            .await;
        self.give_up(&mut lease).await;
        let report = report?;
        report.export(None);
        Ok(report)
    }

    /// Gives the lease up, so another worker can lead at once (best effort: it
    /// expires anyway).
    async fn give_up(&self, lease: &mut Lease) {
        if lease.epoch().is_none() {
            return;
        }
        // Bounded: a database that is away must not eat the shutdown's drain time.
        let release = async {
            match self.pool.get().await {
                Ok(mut client) => lease.release(&mut client, self.pool.limits()).await,
                Err(e) => Err(e.into()),
            }
        };
        let released = tokio::time::timeout(GIVE_UP_WITHIN, release)
            .await
            .unwrap_or(Err(DbError::NoAnswer {
                step: "take the lease back",
                after: GIVE_UP_WITHIN,
            }));
        if let Err(e) = released {
            tracing::debug!(error = %e, "sweeper: could not give the lease up; it expires");
        }
    }

    /// One sweep; `busy` (when given) hears of progress after every batch; `token`
    /// ends it early; the reconciler continues from `cursor`.
    async fn sweep_once(
        &self,
        lease: &mut Lease,
        busy: Option<&Busy>,
        token: &CancellationToken,
        cursor: &mut reconciler::Cursor,
    ) -> Result<SweepReport, DbError> {
        let mut client = self.pool.get().await?;
        if !lease.acquire(&mut client, self.pool.limits()).await? {
            return Ok(SweepReport::default());
        }
        let mut report = self.sweep(&mut client, lease, busy, token).await?;
        if !token.is_cancelled() && !report.lost_lead {
            let r = reconciler::run_pass(
                &mut client,
                self.pool.limits(),
                lease,
                &self.config,
                &self.stats,
                cursor,
                busy,
                token,
            )
            .await?;
            report.releases_repaired = r.repaired;
            report.releases_unreadable = r.unreadable;
            report.lost_lead = r.lost_lead;
        }
        if !token.is_cancelled() && !report.lost_lead {
            let r = retention::run_pass(
                &mut client,
                self.pool.limits(),
                lease,
                &self.retention,
                self.config.pause,
                busy,
                token,
            )
            .await?;
            report.pruned = r.pruned;
            report.lost_lead = r.lost_lead;
        }
        if report.lost_lead {
            tracing::warn!(
                "sweeper: the lease expired or was taken over mid-sweep (was this worker \
                 frozen or cut off?); another worker leads, this sweep stopped"
            );
        }
        Ok(report)
    }

    // Over 60 lines on purpose: one keyset-paged pass (page, close, count, pause); the cursor and the counters span the loop.
    async fn sweep(
        &self,
        client: &mut deadpool_postgres::Client,
        lease: &mut Lease,
        busy: Option<&Busy>,
        token: &CancellationToken,
    ) -> Result<SweepReport, DbError> {
        let mut report = SweepReport {
            leader: true,
            ..Default::default()
        };
        let grace_ms = deadline::saturating_millis(self.config.grace);
        let limits = self.pool.limits();
        // The cursor is the last row's id; the database reads its deadline itself, so
        // pagination never depends on decoding a deadline.
        let mut after: Option<i64> = None;
        let mut unreadable = Vec::new();
        loop {
            if token.is_cancelled() {
                break;
            }
            // The page is read in the transaction that closes it: every statement of
            // a pooled connection runs in a transaction opened under the pool's limits.
            let tx = crate::db::begin_short(client, limits, Some(self.lock_timeout)).await?;
            let rows = tx
                .query_typed(
                    "SELECT id, deadline_version, expire_at, expire_at::text AS raw FROM orders
                      WHERE status = 'UNPAID'
                        AND expire_at < now() - $1::bigint * interval '1 millisecond'
                        AND ($2::bigint IS NULL
                             OR (expire_at, id) > ((SELECT expire_at FROM orders WHERE id = $2), $2))
                      ORDER BY expire_at, id
                      LIMIT $3",
                    &[
                        (&grace_ms, tokio_postgres::types::Type::INT8),
                        (&after, tokio_postgres::types::Type::INT8),
                        (&self.config.batch_size, tokio_postgres::types::Type::INT8),
                    ],
                )
                .await?;
            let Some(last) = rows.last() else { break };
            after = Some(column(last, "id")?);
            let mut candidates = Vec::with_capacity(rows.len());
            for row in &rows {
                match sweepable(row) {
                    Ok(candidate) => candidates.push(candidate),
                    Err(reason) => unreadable.push(reason),
                }
            }
            if !lease.fence(&tx, Some(self.lock_timeout)).await? {
                report.lost_lead = true;
                break;
            }
            let mut done =
                close::close_due(&tx, &candidates, CloseReason::Sweeper, self.stock_release)
                    .await?;
            close::release_closed(&tx, &mut done, self.stock_release).await?;
            tx.commit().await?;
            self.stats.by("sweeper").record(
                Outcome::Released,
                u64::try_from(done.released.applied).unwrap_or(0),
            );
            self.stats.by("sweeper").record(
                Outcome::ReleaseDeferred,
                u64::try_from(done.released.deferred).unwrap_or(0),
            );
            let closed = done.closed;
            // Pacing is deliberate idleness, not a stall; shutdown cuts it short.
            let pace = async {
                if self.limiter.acquire_or_cancelled(closed.len(), token).await
                    && rows.len() >= self.config.batch_size.try_into().unwrap_or(usize::MAX)
                {
                    tokio::select! {
                        _ = tokio::time::sleep(self.config.pause) => {}
                        _ = token.cancelled() => {}
                    }
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
            self.stats.by("sweeper").record(
                Outcome::SweptClosed,
                u64::try_from(closed.len()).unwrap_or(0),
            );
            report.locked += done.locked.len();
            self.stats.by("sweeper").record(
                Outcome::Locked,
                u64::try_from(done.locked.len()).unwrap_or(0),
            );
            if i64::try_from(rows.len()).unwrap_or(i64::MAX) < self.config.batch_size {
                break;
            }
        }
        report.unreadable = unreadable.len();
        if !unreadable.is_empty() {
            tracing::error!(
                orders = unreadable.len(),
                first = %unreadable.iter().take(5).cloned().collect::<Vec<_>>().join("; "),
                "sweeper skipped overdue orders whose deadline lapse cannot handle; repair them (docs/operations.md)"
            );
        }
        let stuck_ms = deadline::saturating_millis(self.config.stuck_outbox_after);
        let tx = crate::db::begin_short(client, limits, None).await?;
        let stuck = tx
            .query_typed_one(
                "SELECT count(*) AS stuck FROM outbox
                  WHERE created_at < clock_timestamp() - $1::bigint * interval '1 millisecond'",
                &[(&stuck_ms, tokio_postgres::types::Type::INT8)],
            )
            .await?;
        tx.commit().await?;
        report.stuck_outbox = column(&stuck, "stuck")?;
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
        self.run_as("sweeper", None, health, token).await
    }

    /// [`Sweeper::run`] under the name `component` on `/health` (`sweeper.s<i>` with
    /// shards), its gauges labelled `shard` when given.
    pub async fn run_as(
        self,
        component: &'static str,
        shard: Option<String>,
        health: Health,
        token: CancellationToken,
    ) {
        let mut cursor = reconciler::Cursor::default();
        let mut lease = Lease::new(LEASE, self.config.lease);
        loop {
            let busy = health.busy(component);
            let swept = self
                .sweep_once(&mut lease, Some(&busy), &token, &mut cursor)
                .await;
            drop(busy);
            if token.is_cancelled() {
                self.give_up(&mut lease).await;
                return;
            }
            match swept {
                Ok(report) => {
                    health.up(component);
                    if report.leader {
                        report.export(shard.as_deref());
                    }
                    tracing::debug!(component, ?report, "sweep done");
                }
                Err(e) => {
                    health.down(component, e.to_string());
                    tracing::warn!(component, error = %e, "sweeper: database error");
                }
            }
            tokio::select! {
                _ = token.cancelled() => {
                    self.give_up(&mut lease).await;
                    return;
                }
                _ = tokio::time::sleep(self.config.interval) => {}
            }
        }
    }
}

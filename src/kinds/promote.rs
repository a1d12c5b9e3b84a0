//! The promoter of one order database: one leader (the lease `promoter`) hands the
//! deadlines of kinds that were kept in the database — further away than their kind's
//! `promote_within`, the top tier — to the broker once they come within range, and, as
//! the backstop (with `worker.sweeper`), fires pending deadlines overdue by more than
//! `sweeper.grace` whose timeout the message path lost.
//!
//! A 30-day deadline thus costs no broker message for 30 days: it waits in
//! `lapse.deadlines` (partial index on `expire_at` of those not yet handed over) and
//! then takes the tiers like any other. Promotion runs every quarter of the top tier
//! (between 100 ms and 30 s), so a deadline is handed over with at least three
//! quarters of the top tier left: the tiers, not the promoter, set its lateness.

use std::time::Duration;

use tokio_postgres::types::Type;
use tokio_util::sync::CancellationToken;

use super::Catalog;
use super::fire::{self, Due, Verdict};
use crate::config::Config;
use crate::db::{self, DbError, Lease, Pool};
use crate::observe::stats::{Outcome, Stats};
use crate::runtime::health::Health;

/// The lease of the promoter (one leader per order database).
pub const LEASE: &str = "promoter";

/// The lease of the kinds' backstop: only workers with `worker.sweeper` compete for
/// it, so the one that leads promotion never turns the backstop off for the others.
pub const BACKSTOP_LEASE: &str = "kinds_backstop";

/// How often the promoter looks: a quarter of `within`, between 100 ms and 30 s.
pub fn interval(within: Duration) -> Duration {
    (within / 4).clamp(Duration::from_millis(100), Duration::from_secs(30))
}

#[derive(Clone)]
pub struct Promoter {
    pub pool: Pool,
    pub kinds: Catalog,
    pub stats: Stats,
    pub batch_size: i64,
    pub lease_ttl: Duration,
    pub every: Duration,
    /// Fire pending deadlines overdue by more than this (the backstop); `None`: off.
    pub backstop_after: Option<Duration>,
    pub lock_timeout: Duration,
}

/// What one round did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Round {
    pub leader: bool,
    /// Deadlines handed to the broker.
    pub promoted: usize,
    /// Overdue deadlines the backstop fired (should stay 0).
    pub fired: usize,
}

impl Promoter {
    pub fn new(config: &Config, pool: Pool, stats: Stats) -> Self {
        Self {
            pool,
            kinds: Catalog::new(&config.kinds, &config.database.shop_search_path),
            stats,
            batch_size: config.sweeper.batch_size,
            lease_ttl: config.sweeper.lease,
            every: interval(super::promote_within(config)),
            backstop_after: config.worker.sweeper.then_some(config.sweeper.grace),
            lock_timeout: config.database.lock_timeout,
        }
    }

    /// One round: promote everything within range as the promoter's leader, then, with
    /// the backstop on, fire the overdue as the backstop's leader.
    pub async fn run_once(
        &self,
        lease: &mut Lease,
        backstop_lease: &mut Lease,
    ) -> Result<Round, DbError> {
        let mut client = self.pool.get().await?;
        let mut round = Round::default();
        // Nothing to do on a database `lapse migrate` has not brought to V14 yet.
        let tx = db::begin_short(&mut client, self.pool.limits(), None).await?;
        let migrated: bool = db::column(
            &tx.query_typed_one(
                "SELECT to_regclass('lapse.deadlines') IS NOT NULL AS migrated",
                &[],
            )
            .await?,
            "migrated",
        )?;
        tx.commit().await?;
        if !migrated {
            return Ok(round);
        }
        if lease.acquire(&mut client, self.pool.limits()).await? {
            round.leader = true;
            round.promoted = self.promote(&mut client, lease).await?;
        }
        if let Some(grace) = self.backstop_after
            && backstop_lease
                .acquire(&mut client, self.pool.limits())
                .await?
        {
            round.fired = self.backstop(&mut client, backstop_lease, grace).await?;
        }
        Ok(round)
    }

    /// Hands every deadline within range to the relay, a batch per transaction.
    async fn promote(
        &self,
        client: &mut deadpool_postgres::Client,
        lease: &mut Lease,
    ) -> Result<usize, DbError> {
        let mut promoted = 0;
        loop {
            let tx = db::begin_short(client, self.pool.limits(), Some(self.lock_timeout)).await?;
            if !lease.fence(&tx, Some(self.lock_timeout)).await? {
                break;
            }
            let moved = tx
                .execute_typed(PROMOTE_SQL, &[(&self.batch_size, Type::INT8)])
                .await?;
            tx.commit().await?;
            promoted += usize::try_from(moved).unwrap_or(usize::MAX);
            if i64::try_from(moved).unwrap_or(i64::MAX) < self.batch_size {
                break;
            }
        }
        Ok(promoted)
    }

    /// Fires the pending deadlines overdue by more than `grace`, a batch per
    /// transaction, through the worker's fire path. One whose action failed (its
    /// `last_error` says why) is tried again at most every 5 minutes, not every round.
    async fn backstop(
        &self,
        client: &mut deadpool_postgres::Client,
        lease: &mut Lease,
        grace: Duration,
    ) -> Result<usize, DbError> {
        let kinds: Vec<String> = self.kinds.iter().map(|k| k.name.clone()).collect();
        let grace_ms = crate::deadline::saturating_millis(grace);
        let mut after: Option<i64> = None;
        let mut fired = 0;
        loop {
            let tx = db::begin_short(client, self.pool.limits(), Some(self.lock_timeout)).await?;
            if !lease.fence(&tx, Some(self.lock_timeout)).await? {
                break;
            }
            let rows = tx
                .query_typed(
                    "SELECT id, version FROM lapse.deadlines
                      WHERE state = 'pending' AND in_tiers AND kind = ANY($1)
                        AND (failed_at IS NULL OR failed_at < now() - interval '5 minutes')
                        AND expire_at < now() - $2::bigint * interval '1 millisecond'
                        AND ($3::bigint IS NULL
                             OR (expire_at, id) > ((SELECT expire_at FROM lapse.deadlines WHERE id = $3), $3))
                      ORDER BY expire_at, id LIMIT $4",
                    &[
                        (&kinds, Type::TEXT_ARRAY),
                        (&grace_ms, Type::INT8),
                        (&after, Type::INT8),
                        (&self.batch_size, Type::INT8),
                    ],
                )
                .await?;
            let Some(last) = rows.last() else { break };
            after = Some(db::column(last, "id")?);
            let due: Vec<Due> = rows
                .iter()
                .map(|r| {
                    Ok(Due {
                        id: db::column(r, "id")?,
                        version: db::column(r, "version")?,
                    })
                })
                .collect::<Result<_, DbError>>()?;
            let ids: Vec<i64> = due.iter().map(|d| d.id).collect();
            let read = fire::read(&tx, &ids).await?;
            let verdicts = fire::fire(&tx, &self.kinds, &read, &due, self.lock_timeout).await?;
            tx.commit().await?;
            let now_fired = verdicts
                .values()
                .filter(|v| matches!(v, Verdict::Fired { .. }))
                .count();
            for v in verdicts.values() {
                if let Verdict::Fired {
                    expire_at,
                    fired_at,
                } = v
                {
                    let late = (*fired_at - *expire_at).to_std().unwrap_or_default();
                    self.stats.lateness(late, "sweeper");
                }
            }
            self.stats
                .by("sweeper")
                .record(Outcome::SweptClosed, u64::try_from(now_fired).unwrap_or(0));
            fired += now_fired;
            if i64::try_from(rows.len()).unwrap_or(i64::MAX) < self.batch_size {
                break;
            }
        }
        if fired > 0 {
            tracing::warn!(
                fired,
                "promoter: fired overdue deadlines of kinds the message path missed"
            );
        }
        Ok(fired)
    }

    /// Rounds every [`Promoter::every`] until `token` is cancelled.
    pub async fn run(self, component: &'static str, health: Health, token: CancellationToken) {
        let mut lease = Lease::new(LEASE, self.lease_ttl);
        let mut backstop_lease = Lease::new(BACKSTOP_LEASE, self.lease_ttl);
        loop {
            let busy = health.busy(component);
            let round = self.run_once(&mut lease, &mut backstop_lease).await;
            drop(busy);
            match round {
                Ok(_) => health.up(component),
                Err(e) => {
                    tracing::warn!(component, error = %e.detail(), "promoter: round failed; trying again");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(self.every) => {}
                _ = token.cancelled() => break,
            }
        }
        for lease in [&mut lease, &mut backstop_lease] {
            if lease.epoch().is_some()
                && let Ok(Ok(mut client)) =
                    tokio::time::timeout(Duration::from_secs(2), self.pool.get()).await
            {
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    lease.release(&mut client, self.pool.limits()),
                )
                .await;
            }
        }
    }
}

/// Hands a batch of deadlines within their kind's range to the relay (the same
/// intent `lapse.schedule` writes), earliest first. The bound on the largest range
/// keeps the scan on the partial index's first rows.
const PROMOTE_SQL: &str = "
WITH p AS (
    SELECT d.id FROM lapse.deadlines d JOIN lapse.kinds k ON k.name = d.kind
     WHERE d.state = 'pending' AND NOT d.in_tiers
       AND d.expire_at <= now() + (SELECT max(promote_within) FROM lapse.kinds)
       AND d.expire_at <= now() + k.promote_within
     ORDER BY d.expire_at, d.id LIMIT $1
       FOR UPDATE OF d SKIP LOCKED
)
UPDATE lapse.deadlines d
   SET in_tiers = lapse.intent(d.id, d.kind, d.key, d.expire_at, d.version)
  FROM p WHERE d.id = p.id";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn looks_every_quarter_of_the_top_tier_within_bounds() {
        assert_eq!(
            interval(Duration::from_secs(86_400)),
            Duration::from_secs(30)
        );
        assert_eq!(interval(Duration::from_secs(2)), Duration::from_millis(500));
        assert_eq!(
            interval(Duration::from_millis(100)),
            Duration::from_millis(100)
        );
    }
}

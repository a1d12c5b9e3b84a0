//! The due-queue consumer: batches deliveries, asks the [`Decider`] what to do with
//! each, and carries it out — publish (re-delay, retry, park) with confirms and only
//! then acknowledge; hold a short remainder unacknowledged; acknowledge settled ones.
//!
//! Invariants: a delivery is acknowledged only after its database transaction
//! committed and any publish it needed was confirmed; a crash anywhere before that
//! leaves it unacknowledged, so the broker redelivers it and the guarded close makes
//! the repeat harmless. A publish that fails (refused by a full tier, no confirm
//! within the timeout, publishing blocked by a broker alarm) never gives the delivery
//! back to the broker — that would spend its delivery budget — : the worker keeps it
//! and decides it again after a back-off, so a delivery that has meanwhile become due
//! is closed instead of re-delayed. A publish the broker confirms but cannot route
//! (its queue was deleted) is parked with the reason, never acknowledged away. A
//! re-delay to a wait tier whose queue does not exist is not published at all
//! (`<P>.delay` would route it to parked and confirm it, see [`crate::amqp::tier_check`]):
//! the delivery is kept and decided again after the back-off, as for a failed publish.
//! A kept delivery is decided again no later than when its route would change, so a
//! missing or full tier never makes a close late by more than that.

mod decide;
mod execute;
mod kept;
mod plan;

pub use decide::{Action, Decider};
use execute::Planned;
use kept::Kept;
pub use plan::{Plan, Tiers, Waiting, plan, wanted_tiers};

use std::collections::BTreeSet;

use lapin::message::Delivery;
use tokio_util::sync::CancellationToken;

use crate::amqp::batch::{
    BatchHandler, BatchSource, Batching, ConsumerSession, Consuming, consume_reconnecting,
};
use crate::amqp::broker::{BrokerError, Endpoint};
use crate::amqp::publishing::PublishingConnection;
use crate::amqp::tier_check::TierCheck;
use crate::config::Config;
use crate::db::Pools;
use crate::message::Route;
use crate::names::Names;
use crate::observe::stats::{Outcome, Stats};
use crate::pack::{self, Entry};
use crate::runtime::backoff::Backoff;
use crate::runtime::health::{Busy, Health};
use crate::runtime::rate::RateLimiter;
use crate::runtime::supervisor::Fatal;
use crate::tier::TierSet;

#[derive(Clone)]
pub struct Consumer {
    pub decider: Decider,
    pub names: Names,
    pub stats: Stats,
    pub batching: Batching,
    pub limiter: RateLimiter,
    pub tier_check: TierCheck,
    /// The most entries one re-delay carries (`packs.max_entries`).
    pub pack_max: usize,
}

/// The consumer's side of a session: `retry` paces the deliveries kept after a failed
/// publish, for the session's lifetime.
struct Batches<'a> {
    consumer: &'a Consumer,
    retry: Backoff,
}

impl BatchHandler for Batches<'_> {
    async fn handle(
        &mut self,
        batch: Vec<Delivery>,
        session: &mut ConsumerSession,
        token: &CancellationToken,
        busy: &Busy,
    ) -> Result<(), BrokerError> {
        let report = self
            .consumer
            .process(
                batch,
                &mut session.publishing,
                &mut session.source,
                &mut self.retry,
            )
            .await?;
        // Pay for the closes after the fact: the next batch waits, so a backlog
        // drains at the configured rate. Only closes count, not duplicates or stale ones.
        // A shutdown ends the wait at once (the next `next` then stops the loop).
        busy.idle_while(
            self.consumer
                .limiter
                .acquire_or_cancelled(report.closed, token),
        )
        .await;
        Ok(())
    }
}

/// What one batch did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BatchReport {
    pub deliveries: usize,
    pub acked: usize,
    pub held: usize,
    /// Deliveries whose publish failed; the worker keeps them and decides them again
    /// after a back-off.
    pub retrying: usize,
    /// Orders this batch closed (what the closes-per-second limit charges).
    pub closed: usize,
}

impl Consumer {
    /// `limiter` bounds closes per second; share it with the sweeper so that both
    /// together stay under `worker.closes_per_second`.
    pub fn new(
        config: &Config,
        pools: Pools,
        tiers: TierSet,
        stats: Stats,
        limiter: RateLimiter,
    ) -> Self {
        let names = config.names();
        let w = &config.worker;
        Self {
            decider: Decider {
                pools,
                names: names.clone(),
                tiers,
                max_attempts: w.max_attempts,
                retry_backoff: w.retry_backoff,
                lock_retry: w.lock_retry,
                lock_timeout: config.database.lock_timeout,
                tier_tolerance: config.relay.tier_tolerance,
                kinds: crate::kinds::Catalog::new(&config.kinds, &config.database.shop_search_path),
                clock_offset: Default::default(),
                stock_release: w.stock_release,
                stats: stats.clone(),
            },
            names,
            stats,
            batching: Batching::from_config(w),
            limiter,
            tier_check: TierCheck::new(config.names(), config.broker.confirm_timeout),
            pack_max: config.packs.max_entries,
        }
    }

    /// Consumes the due queue until `token` is cancelled, reconnecting with back-off
    /// (the session loop shared with the releaser, `amqp::batch::consume_reconnecting`). Opening
    /// a session and each batch are units of work for the liveness check; waiting for
    /// deliveries and rate limiting are not.
    pub async fn run(
        self,
        broker: Endpoint,
        health: Health,
        token: CancellationToken,
    ) -> Result<(), Fatal> {
        let how = Consuming {
            endpoint: &broker,
            role: "worker",
            prefix: &self.names.prefix,
            component: "consumer",
            queue: self.names.due_queue(),
            batching: self.batching,
            stats: self.stats.clone(),
        };
        consume_reconnecting(how, &health, &token, || Batches {
            consumer: &self,
            retry: Backoff::new(),
        })
        .await
    }

    /// Decides and carries out one batch: the decision (database read and close, then
    /// the pure [`plan`] of each delivery) and its execution. `retry` paces the
    /// deliveries kept after a failed publish.
    #[tracing::instrument(skip_all, fields(size = batch.len()))]
    pub async fn process(
        &self,
        batch: Vec<Delivery>,
        publishing: &mut PublishingConnection,
        source: &mut BatchSource,
        retry: &mut Backoff,
    ) -> Result<BatchReport, BrokerError> {
        // Holds count from the moment the clock was read, not from when this batch
        // finished: the time spent deciding must not add to the lateness.
        let read_at = tokio::time::Instant::now();
        let (entries, waiting) = self.split(&batch, self.decider.clock_offset.db_now());
        let messages: Vec<_> = entries
            .iter()
            .flatten()
            .map(|e| e.message.clone())
            .collect();
        let (actions, closed) = self.decider.decide(&messages).await;
        for (_, c) in &closed {
            self.stats.lateness(c.lateness(), "timeout");
        }
        let mut kept = Kept::default();
        let tiers = self.tiers_for(&actions, publishing, &mut kept).await;
        let away = self.shards_away(&actions);
        let plan = plan(
            &batch,
            &entries,
            waiting,
            actions,
            &self.names,
            &tiers,
            self.pack_max,
        );
        let mut report = self
            .execute(
                Planned {
                    batch,
                    plan,
                    read_at,
                    away,
                },
                publishing,
                source,
                retry,
                kept,
            )
            .await?;
        report.closed = closed.len();
        Ok(report)
    }

    /// The most entries one batch decides (one transaction per shard): a batch's
    /// worth under a closes-per-second limit (so that the limit paces within a pack
    /// too), else at least a whole pack.
    fn budget(&self) -> usize {
        if self.limiter.is_limited() {
            self.batching.batch_size.max(1)
        } else {
            self.batching.batch_size.max(self.pack_max).max(1)
        }
    }

    /// The entries of each delivery to decide now, and those to leave for later
    /// without asking the database: an entry not due by this worker's clock and
    /// nearer than the smallest tier (it would only be held; a pack's later entries
    /// wait so, and are read once each when due, not once per earlier entry), and
    /// entries past the batch's budget (decided in the next batch, so that a pack of
    /// thousands is decided a batch at a time and the rate limit paces it too).
    fn split(
        &self,
        batch: &[Delivery],
        now: chrono::DateTime<chrono::Utc>,
    ) -> (Vec<Vec<Entry>>, Vec<Vec<Waiting>>) {
        let d = &self.decider;
        let mut budget = self.budget();
        // The budget goes to the deliveries held longest first (the broker numbers its
        // deliveries in order): a fresh delivery never starves one left over.
        let mut order: Vec<usize> = (0..batch.len()).collect();
        order.sort_by_key(|i| batch[*i].delivery_tag);
        let mut out: Vec<(Vec<Entry>, Vec<Waiting>)> =
            (0..batch.len()).map(|_| Default::default()).collect();
        for i in order {
            let delivery = &batch[i];
            let (decide, wait) = &mut out[i];
            if budget == 0 {
                // Left as it is, unread: the next batch reads it.
                wait.push(Waiting {
                    body: delivery.data.clone(),
                    after: std::time::Duration::ZERO,
                    deferred: true,
                });
                continue;
            }
            for entry in pack::unpack(&delivery.data) {
                // Not due yet by the database's clock (as this worker estimates it),
                // and what is left would be held anyway (no tier fits it).
                let ahead = entry
                    .message
                    .as_ref()
                    .ok()
                    .and_then(|m| (m.expire_at - now).to_std().ok())
                    .filter(|r| {
                        !r.is_zero()
                            && Route::planned(
                                &d.names,
                                &d.tiers,
                                *r,
                                std::time::Duration::ZERO,
                                d.tier_tolerance,
                            )
                            .tier
                            .is_none()
                    });
                if let Some(after) = ahead {
                    wait.push(Waiting {
                        body: entry.body,
                        after,
                        deferred: false,
                    });
                } else if budget == 0 {
                    wait.push(Waiting {
                        body: entry.body,
                        after: std::time::Duration::ZERO,
                        deferred: true,
                    });
                } else {
                    budget -= 1;
                    decide.push(entry);
                }
            }
        }
        out.into_iter().unzip()
    }

    /// Which wait tiers the batch's re-delays need are missing (one check for the
    /// batch); unknown when the check itself failed (the reason is kept).
    async fn tiers_for(
        &self,
        actions: &[Action],
        publishing: &mut PublishingConnection,
        kept: &mut Kept,
    ) -> Tiers {
        let wanted = wanted_tiers(actions);
        if wanted.is_empty() {
            return Tiers::Missing(BTreeSet::new());
        }
        match publishing.missing_tiers(&self.tier_check, wanted).await {
            Ok(missing) => Tiers::Missing(missing),
            Err(e) => {
                kept.because(e);
                Tiers::Unknown
            }
        }
    }

    /// With several shards, those whose database was away: their hops are not written
    /// to their timeline (waiting for that database would hold up the other shards).
    /// One database is tried as it always was.
    fn shards_away(&self, actions: &[Action]) -> BTreeSet<u16> {
        actions
            .iter()
            .filter(|_| self.decider.pools.len() > 1)
            .filter_map(|a| match a {
                Action::Publish {
                    message,
                    outcome: Outcome::Retried,
                    ..
                } => Some(message.shard),
                _ => None,
            })
            .collect()
    }
}

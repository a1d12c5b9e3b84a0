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
mod kept;
mod plan;

pub use decide::{Action, Decider};
use kept::Kept;
pub use plan::{Publish, Step, Tiers, plan, wanted_tiers};

use std::collections::BTreeSet;
use std::time::Duration;

use deadpool_postgres::Pool;
use lapin::message::Delivery;
use tokio_util::sync::CancellationToken;

use crate::amqp::batch::{BatchHandler, BatchSource, ConsumerSession, Consuming, ack, consume};
use crate::amqp::broker::{BrokerError, Endpoint};
use crate::amqp::publishing::{Outgoing, PublishingConnection, parked_copy};
use crate::amqp::tier_check::TierCheck;
use crate::config::Config;
use crate::message::TimeoutMessage;
use crate::names::Names;
use crate::observe::stats::{Outcome, Stats};
use crate::runtime::backoff::Backoff;
use crate::runtime::health::{Busy, Health};
use crate::runtime::rate::RateLimiter;
use crate::runtime::supervisor::Fatal;
use crate::tier::TierSet;
use crate::timeline::Hop;

#[derive(Clone)]
pub struct Consumer {
    pub decider: Decider,
    pub names: Names,
    pub stats: Stats,
    pub prefetch: u16,
    pub batch_size: usize,
    pub batch_window: Duration,
    pub limiter: RateLimiter,
    pub tier_check: TierCheck,
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
        pool: Pool,
        tiers: TierSet,
        stats: Stats,
        limiter: RateLimiter,
    ) -> Self {
        let names = config.names();
        let w = &config.worker;
        Self {
            decider: Decider {
                pool,
                names: names.clone(),
                tiers,
                max_attempts: w.max_attempts,
                retry_backoff: w.retry_backoff,
                lock_retry: w.lock_retry,
                lock_timeout: config.database.lock_timeout,
                tier_tolerance: config.relay.tier_tolerance,
            },
            names,
            stats,
            prefetch: w.prefetch,
            batch_size: w.batch_size.min(usize::from(w.prefetch)),
            batch_window: w.batch_window,
            limiter,
            tier_check: TierCheck::new(config.names(), config.broker.confirm_timeout),
        }
    }

    /// Consumes until `token` is cancelled, reconnecting with back-off.
    pub async fn run(
        self,
        broker: Endpoint,
        health: Health,
        token: CancellationToken,
    ) -> Result<(), Fatal> {
        crate::runtime::backoff::reconnecting("consumer", &health, &token, || {
            self.session(&broker, &health, &token)
        })
        .await
    }

    /// One broker session (the loop shared with the releaser, [`consume`]). Opening
    /// it and each batch are units of work for the liveness check; waiting for
    /// deliveries and rate limiting are not.
    async fn session(
        &self,
        broker: &Endpoint,
        health: &Health,
        token: &CancellationToken,
    ) -> Result<(), BrokerError> {
        let how = Consuming {
            endpoint: broker,
            role: "worker",
            prefix: &self.names.prefix,
            component: "consumer",
            queue: self.names.due_queue(),
            prefetch: self.prefetch,
            batch_size: self.batch_size,
            batch_window: self.batch_window,
        };
        let mut batches = Batches {
            consumer: self,
            retry: Backoff::new(),
        };
        consume(&how, health, token, &mut batches).await
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
        let messages: Vec<_> = batch
            .iter()
            .map(|d| TimeoutMessage::decode(&d.data))
            .collect();
        // Holds count from the moment the clock was read, not from when this batch
        // finished: the time spent deciding must not add to the lateness.
        let read_at = tokio::time::Instant::now();
        let (actions, closed) = self.decider.decide(&messages).await;
        for c in &closed {
            self.stats.lateness(c.lateness(), "timeout");
        }
        let mut kept = Kept::default();
        let wanted = wanted_tiers(&actions);
        let tiers = match wanted.is_empty() {
            true => Tiers::Missing(BTreeSet::new()),
            false => match publishing.missing_tiers(&self.tier_check, wanted).await {
                Ok(missing) => Tiers::Missing(missing),
                Err(e) => {
                    kept.because(e);
                    Tiers::Unknown
                }
            },
        };
        let steps: Vec<(Delivery, Step)> = batch
            .into_iter()
            .zip(actions)
            .zip(&messages)
            .map(|((delivery, action), decoded)| {
                let step = plan(action, decoded, &delivery, &self.names, &tiers);
                (delivery, step)
            })
            .collect();
        let mut report = self
            .execute(steps, publishing, source, retry, read_at, kept)
            .await?;
        report.closed = closed.len();
        Ok(report)
    }

    /// Carries out the steps of one batch: acknowledges, holds, publishes (then
    /// acknowledges what was confirmed), keeps what could not be published.
    async fn execute(
        &self,
        steps: Vec<(Delivery, Step)>,
        publishing: &mut PublishingConnection,
        source: &mut BatchSource,
        retry: &mut Backoff,
        read_at: tokio::time::Instant,
        mut kept: Kept,
    ) -> Result<BatchReport, BrokerError> {
        let mut report = BatchReport {
            deliveries: steps.len(),
            ..Default::default()
        };
        let mut publishes = Vec::new();
        for (delivery, step) in steps {
            match step {
                Step::Ack(outcome) => {
                    ack(&delivery).await?;
                    self.stats.record(outcome, 1);
                    report.acked += 1;
                }
                Step::Hold { after, outcome } => {
                    self.stats.record(outcome, 1);
                    report.held += 1;
                    source.hold(delivery, read_at + after);
                }
                Step::Keep {
                    reroute_after,
                    missing_queue,
                } => {
                    if let Some(queue) = missing_queue {
                        self.stats.record(Outcome::Unroutable, 1);
                        kept.because(BrokerError::MissingTier { queue });
                    }
                    kept.keep(delivery, reroute_after);
                }
                Step::Publish(p) => publishes.push((delivery, *p)),
            }
        }
        let attempted = !publishes.is_empty();
        let hops = self
            .publish_then_ack(publishes, publishing, &mut kept, &mut report)
            .await?;
        // Keep the deliveries (no nack: that would spend their delivery budget) and
        // decide them again later: by then some may be due, or the tier may have room.
        if kept.failed() {
            report.retrying = kept.hold_all(source, retry, read_at);
        } else if attempted {
            retry.reset();
        }
        self.record_hops(&hops).await;
        Ok(report)
    }

    /// Publishes with confirms and acknowledges each delivery whose publish was
    /// confirmed; parks the ones the broker confirmed but could not route; keeps the
    /// rest. Returns the hops that went out.
    // Over 60 lines on purpose: each publish outcome (confirmed, confirmed but unroutable, failed) with its counters; the unroutable ones need a second publish.
    async fn publish_then_ack(
        &self,
        publishes: Vec<(Delivery, Publish)>,
        publishing: &mut PublishingConnection,
        kept: &mut Kept,
        report: &mut BatchReport,
    ) -> Result<Vec<Hop>, BrokerError> {
        let messages = publishes.iter().map(|(_, p)| p.message.clone()).collect();
        let results = publishing.publish_all(messages).await;
        let mut hops = Vec::new();
        let mut unroutable = Vec::new();
        for ((delivery, p), result) in publishes.into_iter().zip(results) {
            match result {
                Ok(()) => {
                    // The confirmed copy is in its tier whatever happens to this ack:
                    // its hop is recorded even when the ack fails and the session ends.
                    if let Some(hop) = p.hop {
                        self.stats.hop(Some(hop.tier.as_str()));
                        hops.push(hop);
                    }
                    if let Err(e) = ack(&delivery).await {
                        self.record_hops(&hops).await;
                        return Err(e);
                    }
                    self.stats.record(p.outcome, 1);
                    if let Some(kind) = p.park {
                        tracing::warn!(reason = kind, "worker: parked a message");
                        self.stats.parked(kind);
                    }
                    report.acked += 1;
                }
                // Confirmed but routed nowhere: acknowledging would lose it.
                Err(e @ BrokerError::Unroutable { .. }) => {
                    tracing::warn!(error = %e, "worker: publish unroutable; parking the delivery");
                    let copy = parked_copy(self.names.parked(), &delivery, &e.to_string());
                    unroutable.push((copy, delivery));
                }
                Err(e) => {
                    if matches!(e, BrokerError::Nacked { .. }) {
                        self.stats.record(Outcome::PublishRefused, 1);
                    }
                    kept.because(e);
                    kept.keep(delivery, p.reroute_after);
                }
            }
        }
        if unroutable.is_empty() {
            return Ok(hops);
        }
        let (copies, deliveries): (Vec<Outgoing>, Vec<Delivery>) = unroutable.into_iter().unzip();
        let results = publishing.publish_all(copies).await;
        for (delivery, result) in deliveries.into_iter().zip(results) {
            match result {
                Ok(()) => {
                    ack(&delivery).await?;
                    self.stats.record(Outcome::Unroutable, 1);
                    self.stats.parked("unroutable");
                    report.acked += 1;
                }
                Err(e) => {
                    kept.because(e);
                    kept.keep(delivery, None);
                }
            }
        }
        Ok(hops)
    }

    /// Best effort: the timeline is for people, the decision never depends on it.
    async fn record_hops(&self, hops: &[Hop]) {
        if hops.is_empty() {
            return;
        }
        let Ok(client) = self.decider.pool.get().await else {
            return;
        };
        let _ = crate::timeline::record_hops(&**client, hops).await;
    }
}

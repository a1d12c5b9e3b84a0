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
//! (`<P>.delay` would route it to parked and confirm it, see [`crate::tier_check`]):
//! the delivery is kept and decided again after the back-off, as for a failed publish.
//! A kept delivery is decided again no later than when its route would change, so a
//! missing or full tier never makes a close late by more than that.

mod decide;
mod kept;

pub use decide::{Action, Decider};
use kept::{Kept, hold};

use std::collections::BTreeSet;
use std::time::Duration;

use deadpool_postgres::Pool;
use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::batch::{BatchSource, ConsumerSession};
use crate::broker::{BrokerError, Endpoint};
use crate::config::Config;
use crate::health::Health;
use crate::message::{TimeoutMessage, parked_properties};
use crate::publishing::PublishingConnection;
use crate::rate::RateLimiter;
use crate::stats::{Outcome, Stats};
use crate::supervisor::Fatal;
use crate::tier::{Tier, TierSet};
use crate::tier_check::TierCheck;
use crate::topology::Names;

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
                tier_tolerance: config.worker.tier_tolerance,
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
        crate::backoff::reconnecting("consumer", &health, &token, || {
            self.session(&broker, &health, &token)
        })
        .await
    }

    /// One broker session. Opening it and each batch are units of work for the
    /// liveness check; waiting for deliveries and rate limiting are not.
    async fn session(
        &self,
        broker: &Endpoint,
        health: &Health,
        token: &CancellationToken,
    ) -> Result<(), BrokerError> {
        let queue = self.names.due_queue();
        let mut session = ConsumerSession::open(
            broker,
            "worker",
            &self.names.prefix,
            "consumer",
            health,
            &queue,
            self.prefetch,
        )
        .await?;
        let mut retry = Backoff::new();
        let result = loop {
            let batch = match session
                .source
                .next(self.batch_size, self.batch_window, token)
                .await
            {
                Ok(Some(batch)) => batch,
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            };
            let busy = health.busy("consumer");
            let report = self
                .process(batch, &mut session.publishing, &session.source, &mut retry)
                .await;
            // Pay for the closes after the fact: the next batch waits, so a backlog
            // drains at the configured rate. Only closes count, not duplicates or stale ones.
            // A shutdown ends the wait at once (the next `next` then stops the loop).
            if let Ok(report) = &report {
                busy.idle_while(self.limiter.acquire_or_cancelled(report.closed, token))
                    .await;
            }
            drop(busy);
            if let Err(e) = report {
                break Err(e);
            }
        };
        session.close().await;
        result
    }

    /// Decides and carries out one batch. `retry` paces the deliveries kept after a
    /// failed publish.
    #[tracing::instrument(skip_all, fields(size = batch.len()))]
    pub async fn process(
        &self,
        batch: Vec<Delivery>,
        publishing: &mut PublishingConnection,
        source: &BatchSource,
        retry: &mut Backoff,
    ) -> Result<BatchReport, BrokerError> {
        let mut report = BatchReport {
            deliveries: batch.len(),
            ..Default::default()
        };
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
        let tiers: BTreeSet<Tier> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Publish { route, .. } => route.tier,
                _ => None,
            })
            .collect();
        // Unknown (the question failed) counts as missing: keep those deliveries too.
        let (missing, unknown) = match tiers.is_empty() {
            true => (BTreeSet::new(), false),
            false => match publishing.missing_tiers(&self.tier_check, tiers).await {
                Ok(missing) => (missing, false),
                Err(e) => {
                    kept.because(e);
                    (BTreeSet::new(), true)
                }
            },
        };
        let mut to_publish = Vec::new();
        let mut waiting = Vec::new();
        let mut hops = Vec::new();
        for ((delivery, action), message) in batch.into_iter().zip(actions).zip(&messages) {
            match action {
                Action::Ack(outcome) => {
                    ack(&delivery).await?;
                    self.stats.record(outcome, 1);
                    report.acked += 1;
                }
                Action::Hold(after) | Action::Locked(after) => {
                    let outcome = match action {
                        Action::Locked(_) => Outcome::Locked,
                        _ => Outcome::Held,
                    };
                    self.stats.record(outcome, 1);
                    report.held += 1;
                    hold(source, delivery, read_at + after);
                }
                Action::Publish {
                    route,
                    message,
                    outcome,
                    reroute_after,
                } => {
                    if let Some(t) = route.tier.filter(|t| unknown || missing.contains(t)) {
                        if !unknown {
                            self.stats.record(Outcome::Unroutable, 1);
                            let queue = self.names.wait_queue(t);
                            kept.because(BrokerError::MissingTier { queue });
                        }
                        kept.keep(delivery, reroute_after);
                        continue;
                    }
                    let tier = route.tier.map(|t| t.name());
                    self.stats.hop(tier.as_deref());
                    hops.push((message.order_id, json!({
                        "tier": tier, "by": "worker", "deadline_version": message.deadline_version,
                        "attempt": message.attempt,
                    })));
                    to_publish.push((
                        route.exchange,
                        route.routing_key,
                        message.encode(),
                        message.properties(),
                    ));
                    waiting.push((delivery, outcome, reroute_after, None));
                }
                Action::Park { reason, outcome } => {
                    tracing::warn!(%reason, "worker: parking a message");
                    let kind = match (outcome, message) {
                        (Outcome::GaveUp, _) => "database_unavailable",
                        (_, Err(_)) => "undecodable",
                        (_, Ok(_)) => "bad_deadline",
                    };
                    let properties: BasicProperties =
                        parked_properties(&delivery.properties, &reason);
                    to_publish.push((
                        self.names.parked(),
                        String::new(),
                        delivery.data.clone(),
                        properties,
                    ));
                    waiting.push((delivery, outcome, None, Some(kind)));
                }
            }
        }
        let attempted = !to_publish.is_empty();
        let results = publishing.publish_all(to_publish).await;
        let mut unroutable = Vec::new();
        for ((delivery, outcome, reroute_after, park), result) in waiting.into_iter().zip(results) {
            match result {
                Ok(()) => {
                    ack(&delivery).await?;
                    self.stats.record(outcome, 1);
                    if let Some(kind) = park {
                        self.stats.parked(kind);
                    }
                    report.acked += 1;
                }
                // Confirmed but routed nowhere: acknowledging would lose it.
                Err(e @ BrokerError::Unroutable { .. }) => {
                    tracing::warn!(error = %e, "worker: publish unroutable; parking the delivery");
                    let properties = parked_properties(&delivery.properties, &e.to_string());
                    let copy = (
                        self.names.parked(),
                        String::new(),
                        delivery.data.clone(),
                        properties,
                    );
                    unroutable.push((copy, delivery));
                }
                Err(e) => {
                    if matches!(e, BrokerError::Nacked { .. }) {
                        self.stats.record(Outcome::PublishRefused, 1);
                    }
                    kept.because(e);
                    kept.keep(delivery, reroute_after);
                }
            }
        }
        for (delivery, result) in self.park_unroutable(unroutable, publishing).await {
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
        // Keep the deliveries (no nack: that would spend their delivery budget) and
        // decide them again later: by then some may be due, or the tier may have room.
        if kept.failed() {
            report.retrying = kept.hold_all(source, retry, read_at);
        } else if attempted {
            retry.reset();
        }
        self.record_hops(hops).await;
        report.closed = closed.len();
        Ok(report)
    }

    /// Publishes the parked copies of deliveries whose publish no queue took; each
    /// delivery with the result of its copy.
    async fn park_unroutable(
        &self,
        parked: Vec<(PublishItem, Delivery)>,
        publishing: &mut PublishingConnection,
    ) -> Vec<(Delivery, Result<(), BrokerError>)> {
        if parked.is_empty() {
            return Vec::new();
        }
        let (copies, deliveries): (Vec<PublishItem>, Vec<Delivery>) = parked.into_iter().unzip();
        let results = publishing.publish_all(copies).await;
        deliveries.into_iter().zip(results).collect()
    }

    /// Best effort: the timeline is for people, the decision never depends on it.
    async fn record_hops(&self, hops: Vec<(i64, serde_json::Value)>) {
        if hops.is_empty() {
            return;
        }
        let (ids, details): (Vec<i64>, Vec<serde_json::Value>) = hops.into_iter().unzip();
        let Ok(client) = self.decider.pool.get().await else {
            return;
        };
        let _ = client
            .execute(
                "INSERT INTO order_events (order_id, event, detail)
                 SELECT id, 'hop', d FROM unnest($1::bigint[], $2::jsonb[]) AS x(id, d)",
                &[&ids, &details],
            )
            .await;
    }
}

/// A publish: exchange, routing key, body, properties.
type PublishItem = (String, String, Vec<u8>, BasicProperties);

async fn ack(delivery: &Delivery) -> Result<(), BrokerError> {
    delivery
        .acker
        .ack(BasicAckOptions::default())
        .await
        .map(|_| ())
        .map_err(BrokerError::amqp("basic.ack"))
}

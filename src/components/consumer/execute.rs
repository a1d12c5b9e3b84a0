//! Carrying out a batch's steps: acknowledge, hold, publish with confirms and then
//! acknowledge, park what the broker confirmed but could not route, keep what could not
//! be published; then write the hops that went out to their shard's timeline.

use std::collections::BTreeSet;

use lapin::message::Delivery;

use super::kept::Kept;
use super::{BatchReport, Consumer, Publish, Step};
use crate::amqp::batch::{BatchSource, ack};
use crate::amqp::broker::BrokerError;
use crate::amqp::publishing::{Outgoing, PublishingConnection, parked_copy};
use crate::observe::stats::Outcome;
use crate::runtime::backoff::Backoff;
use crate::timeline::Hop;

/// A batch's steps, when its clock was read, and the shards whose database was away.
pub(super) struct Planned {
    pub steps: Vec<(Delivery, Step)>,
    pub read_at: tokio::time::Instant,
    pub away: BTreeSet<u16>,
}

impl Consumer {
    /// Carries out the steps of one batch: acknowledges, holds, publishes (then
    /// acknowledges what was confirmed), keeps what could not be published.
    pub(super) async fn execute(
        &self,
        planned: Planned,
        publishing: &mut PublishingConnection,
        source: &mut BatchSource,
        retry: &mut Backoff,
        mut kept: Kept,
    ) -> Result<BatchReport, BrokerError> {
        let Planned {
            steps,
            read_at,
            away,
        } = planned;
        let away = &away;
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
            .publish_then_ack(publishes, publishing, &mut kept, &mut report, away)
            .await?;
        // Keep the deliveries (no nack: that would spend their delivery budget) and
        // decide them again later: by then some may be due, or the tier may have room.
        if kept.failed() {
            report.retrying = kept.hold_all(source, retry, read_at);
        } else if attempted {
            retry.reset();
        }
        self.record_hops(&hops, away).await;
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
        away: &BTreeSet<u16>,
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
                        self.record_hops(&hops, away).await;
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
    /// Each hop goes to its order's shard; none to a shard in `away` (its database
    /// failed in this batch) or not migrated yet.
    pub(super) async fn record_hops(&self, hops: &[Hop], away: &BTreeSet<u16>) {
        let mut by_shard: std::collections::BTreeMap<u16, Vec<Hop>> = Default::default();
        for hop in hops.iter().filter(|h| !away.contains(&h.shard)) {
            by_shard.entry(hop.shard).or_default().push(hop.clone());
        }
        for (shard, hops) in by_shard {
            let Ok(pool) = self.decider.pools.ready(shard) else {
                continue;
            };
            let Ok(client) = pool.get().await else {
                continue;
            };
            let _ = crate::timeline::record_hops(&**client, &hops).await;
        }
    }
}

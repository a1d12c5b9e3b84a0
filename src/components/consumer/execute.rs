//! Carrying out a batch's steps: hold; acknowledge what is decided; publish with
//! confirms and acknowledge what the broker confirmed; park what it confirmed but
//! could not route, and acknowledge that; keep what could not be published; then write
//! the hops that went out to their shard's timeline. Acknowledgements go out in as
//! few frames as is safe ([`BatchSource::ack_all`]).

use std::collections::BTreeSet;

use lapin::message::Delivery;

use super::kept::Kept;
use super::{BatchReport, Consumer, Publish, Step};
use crate::amqp::batch::BatchSource;
use crate::amqp::broker::BrokerError;
use crate::amqp::publishing::{Outgoing, PublishingConnection, parked_copy};
use crate::observe::stats::Outcome;
use crate::runtime::backoff::Backoff;
use crate::timeline::Hop;

/// A delivery whose work is done (closed, re-delayed, parked), to acknowledge, with
/// what to count once it is.
struct Done {
    delivery: Delivery,
    outcome: Outcome,
    /// The `parked` counter's reason when it was parked.
    parked: Option<&'static str>,
}

/// What a batch's publishes came to.
#[derive(Default)]
struct Published {
    hops: Vec<Hop>,
    /// Confirmed: to acknowledge.
    confirmed: Vec<Done>,
    /// Confirmed but routed nowhere: the parked copy to publish, with its delivery.
    unroutable: Vec<(Outgoing, Delivery)>,
}

/// A batch's steps, when its clock was read, and the shards whose database was away.
pub(super) struct Planned {
    pub steps: Vec<(Delivery, Step)>,
    pub read_at: tokio::time::Instant,
    pub away: BTreeSet<u16>,
}

impl Consumer {
    /// Carries out the steps of one batch: holds, publishes, keeps what could not be
    /// published, acknowledges what is done (decided, or published and confirmed).
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
        let mut done = Vec::new();
        for (delivery, step) in steps {
            match step {
                Step::Ack(outcome) => done.push(Done {
                    delivery,
                    outcome,
                    parked: None,
                }),
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
        // What is decided is acknowledged before the publishes, which a broker alarm
        // can hold up for `broker.confirm_timeout`.
        self.acknowledge(source, done, &mut report).await?;
        let published = self.publish(publishes, publishing, &mut kept).await;
        // The confirmed copies are in their tiers whatever happens to the acks: their
        // hops are recorded even when an ack fails and the session ends. What was
        // confirmed is acknowledged before the unroutable ones are parked (a second
        // publish, which can wait as long again).
        let acked = async {
            self.acknowledge(source, published.confirmed, &mut report)
                .await?;
            let parked = self
                .park_unroutable(published.unroutable, publishing, &mut kept)
                .await;
            self.acknowledge(source, parked, &mut report).await
        }
        .await;
        if let Err(e) = acked {
            self.record_hops(&published.hops, away).await;
            return Err(e);
        }
        // Keep the deliveries (no nack: that would spend their delivery budget) and
        // decide them again later: by then some may be due, or the tier may have room.
        if kept.failed() {
            report.retrying = kept.hold_all(source, retry, read_at);
        } else if attempted {
            retry.reset();
        }
        self.record_hops(&published.hops, away).await;
        Ok(report)
    }

    /// Acknowledges `done` (in as few frames as is safe) and counts what was
    /// acknowledged, also when an acknowledgement fails part-way.
    async fn acknowledge(
        &self,
        source: &mut BatchSource,
        done: Vec<Done>,
        report: &mut BatchReport,
    ) -> Result<(), BrokerError> {
        let result = source.ack_all(done.iter().map(|d| &d.delivery)).await;
        for d in done.iter().filter(|d| !source.is_unacked(&d.delivery)) {
            self.stats.record(d.outcome, 1);
            if let Some(reason) = d.parked {
                self.stats.parked(reason);
            }
            report.acked += 1;
        }
        result
    }

    /// Publishes with confirms. Returns the deliveries whose publish was confirmed
    /// (to acknowledge), the ones the broker confirmed but could not route (to park),
    /// and the hops that went out; keeps the rest.
    async fn publish(
        &self,
        publishes: Vec<(Delivery, Publish)>,
        publishing: &mut PublishingConnection,
        kept: &mut Kept,
    ) -> Published {
        let messages = publishes.iter().map(|(_, p)| p.message.clone()).collect();
        let results = publishing.publish_all(messages).await;
        let mut out = Published::default();
        for ((delivery, p), result) in publishes.into_iter().zip(results) {
            match result {
                Ok(()) => {
                    if let Some(hop) = p.hop {
                        self.stats.hop(Some(hop.tier.as_str()));
                        out.hops.push(hop);
                    }
                    if let Some(kind) = p.park {
                        tracing::warn!(reason = kind, "worker: parked a message");
                    }
                    out.confirmed.push(Done {
                        delivery,
                        outcome: p.outcome,
                        parked: p.park,
                    });
                }
                // Confirmed but routed nowhere: acknowledging would lose it.
                Err(e @ BrokerError::Unroutable { .. }) => {
                    tracing::warn!(error = %e, "worker: publish unroutable; parking the delivery");
                    let copy =
                        parked_copy(self.names.parked(), &delivery, "unroutable", &e.to_string());
                    out.unroutable.push((copy, delivery));
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
        out
    }

    /// Parks the deliveries whose publish was routed nowhere; returns the ones whose
    /// parked copy was confirmed (to acknowledge) and keeps the rest.
    async fn park_unroutable(
        &self,
        unroutable: Vec<(Outgoing, Delivery)>,
        publishing: &mut PublishingConnection,
        kept: &mut Kept,
    ) -> Vec<Done> {
        if unroutable.is_empty() {
            return Vec::new();
        }
        let (copies, deliveries): (Vec<Outgoing>, Vec<Delivery>) = unroutable.into_iter().unzip();
        let results = publishing.publish_all(copies).await;
        let mut parked = Vec::new();
        for (delivery, result) in deliveries.into_iter().zip(results) {
            match result {
                Ok(()) => parked.push(Done {
                    delivery,
                    outcome: Outcome::Unroutable,
                    parked: Some("unroutable"),
                }),
                Err(e) => {
                    kept.because(e);
                    kept.keep(delivery, None);
                }
            }
        }
        parked
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
            let Ok(mut client) = pool.get().await else {
                continue;
            };
            // In a short transaction of its own, so the statement timeout bounds it.
            let Ok(tx) = crate::db::begin_short(&mut client, pool.limits(), None).await else {
                continue;
            };
            if crate::timeline::record_hops(&tx, &hops).await.is_ok() {
                let _ = tx.commit().await;
            }
        }
    }
}

//! Carrying out a batch's plan: acknowledge the deliveries whose every entry is
//! decided; publish with confirms (packs of re-delays, parked entries); park the
//! entries of a publish the broker confirmed but could not route; then acknowledge
//! each delivery whose entries are all done, and hold or keep the others with only
//! their unfinished entries; finally write the hops that went out to their shard's
//! timeline. Acknowledgements go out in as few frames as is safe
//! ([`BatchSource::ack_all`]).
//!
//! A delivery kept or held with part of its entries carries only those from then on
//! (its body is rewritten in memory): if the worker stops, the broker hands out the
//! original again, and the entries already done are decided again harmlessly (the
//! guarded close and the version check make a repeat a no-op).

use std::collections::BTreeSet;
use std::time::Duration;

use lapin::message::Delivery;
use tokio::time::Instant;

use super::kept::Kept;
use super::plan::{Again, Member, Plan};
use super::{BatchReport, Consumer};
use crate::amqp::batch::BatchSource;
use crate::amqp::broker::BrokerError;
use crate::amqp::publishing::{Outgoing, PublishingConnection};
use crate::message::parked_properties;
use crate::observe::stats::Outcome;
use crate::pack;
use crate::runtime::backoff::Backoff;
use crate::timeline::Hop;

/// A batch's plan, its deliveries, when its clock was read, and the shards whose
/// database was away.
pub(super) struct Planned {
    pub batch: Vec<Delivery>,
    pub plan: Plan,
    pub read_at: Instant,
    pub away: BTreeSet<u16>,
}

/// Where one delivery stands while its batch is carried out.
#[derive(Default)]
struct State {
    /// Entries done (decided, or published and confirmed), with why; counted once
    /// the delivery is acknowledged, or once it is held with the rest.
    done: Vec<Outcome>,
    parked: Vec<&'static str>,
    /// Entries to decide again.
    again: Vec<Again>,
    /// Publishes still to hear of.
    pending: usize,
}

impl State {
    fn kept(&self) -> bool {
        self.again.iter().any(|a| a.kept.is_some())
    }
}

impl Consumer {
    /// Carries out one batch's plan: holds, publishes, keeps what could not be
    /// published, acknowledges what is done.
    // Over 60 lines on purpose: the order of acknowledgements, publishes and holds is the invariant, read best in one place.
    pub(super) async fn execute(
        &self,
        planned: Planned,
        publishing: &mut PublishingConnection,
        source: &mut BatchSource,
        retry: &mut Backoff,
        mut kept: Kept,
    ) -> Result<BatchReport, BrokerError> {
        let Planned {
            batch,
            plan,
            read_at,
            away,
        } = planned;
        let mut report = BatchReport {
            deliveries: batch.len(),
            ..Default::default()
        };
        let mut states: Vec<State> = plan
            .deliveries
            .into_iter()
            .map(|d| {
                for a in &d.again {
                    if let Some(Some(queue)) = &a.kept {
                        self.stats.record(Outcome::Unroutable, 1);
                        kept.because(BrokerError::MissingTier {
                            queue: queue.clone(),
                        });
                    }
                }
                State {
                    done: d.settled,
                    parked: Vec::new(),
                    again: d.again,
                    pending: d.publishes.len(),
                }
            })
            .collect();
        let mut deliveries: Vec<Option<Delivery>> = batch.into_iter().map(Some).collect();
        // What is decided is acknowledged before the publishes, which a broker alarm
        // can hold up for `broker.confirm_timeout`.
        let ready = take_finished(&mut deliveries, &states);
        self.acknowledge(source, ready, &mut states, &mut report)
            .await?;
        let attempted = !plan.publishes.is_empty();
        let mut hops: Vec<Hop> = Vec::new();
        let mut unroutable: Vec<(Outgoing, Member)> = Vec::new();
        let messages = plan.publishes.iter().map(|p| p.message.clone()).collect();
        let results = publishing.publish_all(messages).await;
        for (p, result) in plan.publishes.into_iter().zip(results) {
            match result {
                Ok(()) => {
                    for hop in p.hops {
                        self.stats.hop(Some(hop.tier.as_str()));
                        hops.push(hop);
                    }
                    if let Some(kind) = p.park {
                        tracing::warn!(reason = kind, "worker: parked a message");
                    }
                    for m in p.members {
                        let s = &mut states[m.delivery];
                        s.done.push(m.outcome);
                        s.parked.extend(p.park);
                    }
                }
                // Confirmed but routed nowhere: acknowledging would lose it.
                Err(e @ BrokerError::Unroutable { .. }) => {
                    tracing::warn!(error = %e, "worker: publish unroutable; parking its entries");
                    for m in p.members {
                        let copy = self.unroutable_copy(&m, &deliveries, &e);
                        unroutable.push((copy, m));
                    }
                }
                Err(e) => {
                    if matches!(e, BrokerError::Nacked { .. }) {
                        // Per re-delay, as the metric says: a refused pack is many.
                        self.stats
                            .record(Outcome::PublishRefused, p.members.len() as u64);
                    }
                    kept.because(e);
                    for m in p.members {
                        states[m.delivery].again.push(kept_again(m));
                    }
                }
            }
        }
        for s in &mut states {
            s.pending = 0;
        }
        // The confirmed copies are in their tiers whatever happens to the acks: their
        // hops are recorded even when an ack fails and the session ends. What was
        // confirmed is acknowledged before the unroutable ones are parked (a second
        // publish, which can wait as long again).
        let acked = async {
            let ready = take_finished_unless(&mut deliveries, &states, &unroutable);
            self.acknowledge(source, ready, &mut states, &mut report)
                .await?;
            self.park_unroutable(unroutable, publishing, &mut states, &mut kept)
                .await;
            let ready = take_finished(&mut deliveries, &states);
            self.acknowledge(source, ready, &mut states, &mut report)
                .await
        }
        .await;
        if let Err(e) = acked {
            self.record_hops(&hops, &away).await;
            return Err(e);
        }
        // The rest carry only their unfinished entries from here on: held until the
        // first of them is to be decided again, or kept (no nack: that would spend
        // their delivery budget) and decided again after the back-off.
        for (i, delivery) in deliveries.iter_mut().enumerate() {
            let Some(mut delivery) = delivery.take() else {
                continue;
            };
            let s = &mut states[i];
            self.count(s);
            let bodies: Vec<&[u8]> = s.again.iter().map(|a| a.body.as_slice()).collect();
            // What is left is the whole body (left over, or one entry): unchanged.
            if !matches!(bodies.as_slice(), [one] if *one == delivery.data.as_slice()) {
                delivery.data = pack::body(&bodies);
            }
            let first = s.again.iter().filter_map(|a| a.after).min();
            if s.kept() {
                // Entries left over for want of room do not cut the back-off short.
                let first = s
                    .again
                    .iter()
                    .filter(|a| !a.deferred)
                    .filter_map(|a| a.after)
                    .min();
                kept.keep(delivery, first);
            } else {
                // One hold of the delivery, as before packs: its entries are counted
                // as held once per hold, not once each.
                let held = s.again.iter().filter(|a| !a.deferred).map(|a| a.outcome);
                if let Some(outcome) = held.reduce(|a, b| if b == Outcome::Locked { b } else { a })
                {
                    self.stats.record(outcome, 1);
                }
                report.held += 1;
                source.hold(delivery, read_at + first.unwrap_or(Duration::ZERO));
            }
        }
        if kept.failed() {
            report.retrying = kept.hold_all(source, retry, read_at);
        } else if attempted {
            retry.reset();
        }
        self.record_hops(&hops, &away).await;
        Ok(report)
    }

    /// Acknowledges `ready` (in as few frames as is safe) and counts what was
    /// acknowledged, also when an acknowledgement fails part-way.
    async fn acknowledge(
        &self,
        source: &mut BatchSource,
        ready: Vec<(usize, Delivery)>,
        states: &mut [State],
        report: &mut BatchReport,
    ) -> Result<(), BrokerError> {
        let result = source.ack_all(ready.iter().map(|(_, d)| d)).await;
        for (i, d) in &ready {
            if !source.is_unacked(d) {
                self.count(&mut states[*i]);
                report.acked += 1;
            }
        }
        result
    }

    /// Counts the entries a delivery has done so far (once: they are taken).
    fn count(&self, s: &mut State) {
        for outcome in s.done.drain(..) {
            self.stats.record(outcome, 1);
        }
        for reason in s.parked.drain(..) {
            self.stats.parked(reason);
        }
    }

    /// The parked copy of an entry whose publish was routed nowhere.
    fn unroutable_copy(
        &self,
        m: &Member,
        deliveries: &[Option<Delivery>],
        error: &BrokerError,
    ) -> Outgoing {
        // The delivery's own properties when it carried just this entry (as lapse
        // always parked), else the entry's, not the pack's.
        let delivery = deliveries[m.delivery].as_ref();
        let base = match delivery {
            Some(d) if d.data == m.body => d.properties.clone(),
            _ => crate::message::TimeoutMessage::decode(&m.body)
                .map(|t| t.properties())
                .unwrap_or_else(|_| lapin::BasicProperties::default().with_delivery_mode(2)),
        };
        Outgoing::new(
            self.names.parked(),
            String::new(),
            m.body.clone(),
            parked_properties(&base, "unroutable", &error.to_string()),
        )
    }

    /// Parks the entries whose publish was routed nowhere, one message each; keeps
    /// those whose parked copy was not confirmed.
    async fn park_unroutable(
        &self,
        unroutable: Vec<(Outgoing, Member)>,
        publishing: &mut PublishingConnection,
        states: &mut [State],
        kept: &mut Kept,
    ) {
        if unroutable.is_empty() {
            return;
        }
        let (copies, members): (Vec<Outgoing>, Vec<Member>) = unroutable.into_iter().unzip();
        let results = publishing.publish_all(copies).await;
        for (m, result) in members.into_iter().zip(results) {
            match result {
                Ok(()) => {
                    let s = &mut states[m.delivery];
                    s.done.push(Outcome::Unroutable);
                    s.parked.push("unroutable");
                }
                Err(e) => {
                    kept.because(e);
                    states[m.delivery].again.push(kept_again(Member {
                        reroute_after: None,
                        ..m
                    }));
                }
            }
        }
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

/// An entry whose publish failed: decided again after the back-off, no later than
/// its route changes.
fn kept_again(m: Member) -> Again {
    Again {
        body: m.body,
        after: m.reroute_after,
        outcome: m.outcome,
        kept: Some(None),
        deferred: false,
    }
}

/// The deliveries with nothing left to do or wait for: to acknowledge.
fn take_finished(deliveries: &mut [Option<Delivery>], states: &[State]) -> Vec<(usize, Delivery)> {
    take_finished_unless(deliveries, states, &[])
}

/// Like [`take_finished`], leaving those with an entry in `unroutable` (still to park).
fn take_finished_unless(
    deliveries: &mut [Option<Delivery>],
    states: &[State],
    unroutable: &[(Outgoing, Member)],
) -> Vec<(usize, Delivery)> {
    let parking: BTreeSet<usize> = unroutable.iter().map(|(_, m)| m.delivery).collect();
    deliveries
        .iter_mut()
        .enumerate()
        .filter(|(i, d)| {
            d.is_some()
                && states[*i].pending == 0
                && states[*i].again.is_empty()
                && !parking.contains(i)
        })
        .filter_map(|(i, d)| d.take().map(|d| (i, d)))
        .collect()
}

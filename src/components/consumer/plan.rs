//! The pure half of the consumer: what to do with each entry of a batch, given the
//! [`Decider`](super::Decider)'s [`Action`]s and what the broker said about the wait
//! tiers the batch wants. No I/O: the consumer's execute step carries the [`Plan`]
//! out (publish with confirms, then acknowledge; hold; keep).
//!
//! Entries of the whole batch that go the same way next (one wait tier, the due
//! queue, a back-off tier) leave as one pack (at most `pack_max` entries each): every
//! one of them would have taken that route alone, so none is early. A parked entry
//! leaves alone, as its own body, so `lapse parked` shows and replays entries.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use lapin::BasicProperties;
use lapin::message::Delivery;

use super::Action;
use crate::amqp::publishing::Outgoing;
use crate::message::{TimeoutMessage, parked_properties};
use crate::names::Names;
use crate::observe::stats::Outcome;
use crate::pack::{self, Entry};
use crate::tier::Tier;
use crate::timeline::Hop;

/// What the broker said about the wait tiers the batch wants to publish to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tiers {
    /// These tiers have no wait queue.
    Missing(BTreeSet<Tier>),
    /// The question failed: every tier counts as missing, and nothing is counted as
    /// unroutable (the reason is the failure, noted by the caller).
    Unknown,
}

/// An entry to decide again later, as the body it came in.
#[derive(Clone, Debug)]
pub struct Again {
    pub body: Vec<u8>,
    /// Decide it again no later than this after the batch's clock read.
    pub after: Option<Duration>,
    pub outcome: Outcome,
    /// Not published: its wait tier has no queue (named), or nobody knows (`None`).
    /// Such an entry is kept (the back-off grows), not merely held.
    pub kept: Option<Option<String>>,
    /// Not decided in this batch for want of room (not a hold to count).
    pub deferred: bool,
}

/// An entry left for later without a decision (see the consumer's `split`).
#[derive(Clone, Debug)]
pub struct Waiting {
    pub body: Vec<u8>,
    /// Decide it after this long, counted from the batch's clock read.
    pub after: Duration,
    /// Past the batch's budget, rather than not due yet.
    pub deferred: bool,
}

/// What one delivery's entries need beyond the batch's publishes.
#[derive(Clone, Debug, Default)]
pub struct DeliveryPlan {
    /// Entries the decision settled, with why (acknowledged with the delivery).
    pub settled: Vec<Outcome>,
    /// Entries to decide again (held: a short remainder, a locked row; kept: a
    /// publish not attempted).
    pub again: Vec<Again>,
    /// Publishes (indexes into [`Plan::publishes`]) carrying entries of this delivery.
    pub publishes: Vec<usize>,
}

/// One entry of a publish: whose it is and what to do if the publish fails.
#[derive(Clone, Debug)]
pub struct Member {
    /// The delivery (index in the batch) it came in.
    pub delivery: usize,
    /// Its body as it came (decided again if the publish fails).
    pub body: Vec<u8>,
    pub outcome: Outcome,
    /// See [`Action::Publish`]; a kept entry is decided again no later than this.
    pub reroute_after: Option<Duration>,
}

/// A publish deliveries wait on before they are acknowledged.
#[derive(Clone, Debug)]
pub struct Publish {
    pub message: Outgoing,
    pub members: Vec<Member>,
    /// The `parked` counter's reason when this publish parks its (one) entry.
    pub park: Option<&'static str>,
    /// The timeline events of the re-delays it carries, written once confirmed.
    pub hops: Vec<Hop>,
}

/// A batch's plan: per delivery, and the publishes.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub deliveries: Vec<DeliveryPlan>,
    pub publishes: Vec<Publish>,
}

/// The wait tiers `actions` publish to: the ones to ask the broker about.
pub fn wanted_tiers(actions: &[Action]) -> BTreeSet<Tier> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Publish { route, .. } => route.tier,
            _ => None,
        })
        .collect()
}

/// Re-delays that share a route, being gathered into packs.
struct Group {
    exchange: String,
    routing_key: String,
    members: Vec<Member>,
    messages: Vec<TimeoutMessage>,
    /// One per message: its order's timeline event (none for a kind's deadline).
    hops: Vec<Option<Hop>>,
}

/// The plan for a batch: `entries[i]` are delivery `i`'s entries decided now, with
/// `actions` one per entry in the same order (flattened); `waiting[i]` its entries
/// left for later.
// Over 60 lines on purpose: one arm per action; the table test below covers each.
pub fn plan(
    batch: &[Delivery],
    entries: &[Vec<Entry>],
    waiting: Vec<Vec<Waiting>>,
    actions: Vec<Action>,
    names: &Names,
    tiers: &Tiers,
    pack_max: usize,
) -> Plan {
    let mut out = Plan {
        deliveries: vec![DeliveryPlan::default(); batch.len()],
        publishes: Vec::new(),
    };
    let mut groups: Vec<Group> = Vec::new();
    let mut group_of: HashMap<(String, String), usize> = HashMap::new();
    for (d, waiting) in waiting.into_iter().enumerate().take(batch.len()) {
        out.deliveries[d]
            .again
            .extend(waiting.into_iter().map(|w| Again {
                body: w.body,
                after: Some(w.after),
                outcome: Outcome::Held,
                kept: None,
                deferred: w.deferred,
            }));
    }
    let mut actions = actions.into_iter();
    for (d, (delivery, entries)) in batch.iter().zip(entries).enumerate() {
        for entry in entries {
            let Some(action) = actions.next() else {
                // One action per entry, always; a shorter list keeps what it misses.
                out.deliveries[d].again.push(Again {
                    body: entry.body.clone(),
                    after: None,
                    outcome: Outcome::Held,
                    kept: Some(None),
                    deferred: false,
                });
                continue;
            };
            let mine = &mut out.deliveries[d];
            match action {
                Action::Ack(outcome) => mine.settled.push(outcome),
                Action::Hold(after) => mine.again.push(Again {
                    body: entry.body.clone(),
                    after: Some(after),
                    outcome: Outcome::Held,
                    kept: None,
                    deferred: false,
                }),
                Action::Locked(after) => mine.again.push(Again {
                    body: entry.body.clone(),
                    after: Some(after),
                    outcome: Outcome::Locked,
                    kept: None,
                    deferred: false,
                }),
                Action::Publish {
                    route,
                    message,
                    outcome,
                    reroute_after,
                } => {
                    if let Some(tier) = route.tier {
                        let missing = match tiers {
                            Tiers::Unknown => Some(None),
                            Tiers::Missing(m) if m.contains(&tier) => {
                                Some(Some(names.wait_queue(tier)))
                            }
                            Tiers::Missing(_) => None,
                        };
                        if let Some(missing) = missing {
                            mine.again.push(Again {
                                body: entry.body.clone(),
                                after: reroute_after,
                                outcome,
                                kept: Some(missing),
                                deferred: false,
                            });
                            continue;
                        }
                    }
                    let key = (route.exchange.clone(), route.routing_key.clone());
                    let g = *group_of.entry(key).or_insert_with(|| {
                        groups.push(Group {
                            exchange: route.exchange.clone(),
                            routing_key: route.routing_key.clone(),
                            members: Vec::new(),
                            messages: Vec::new(),
                            hops: Vec::new(),
                        });
                        groups.len() - 1
                    });
                    let group = &mut groups[g];
                    // A kind's deadline has no order timeline to record its hops in.
                    group.hops.push(
                        (message.deadline().is_none())
                            .then(|| Hop::of(&message, route.tier.map(|t| t.name()), "worker")),
                    );
                    group.members.push(Member {
                        delivery: d,
                        body: entry.body.clone(),
                        outcome,
                        reroute_after,
                    });
                    group.messages.push(message);
                }
                Action::Park {
                    reason,
                    outcome,
                    kind,
                } => {
                    mine.publishes.push(out.publishes.len());
                    out.publishes.push(Publish {
                        message: parked_entry(names, delivery, entry, kind, &reason),
                        members: vec![Member {
                            delivery: d,
                            body: entry.body.clone(),
                            outcome,
                            reroute_after: None,
                        }],
                        park: Some(kind),
                        hops: Vec::new(),
                    });
                }
            }
        }
    }
    for group in groups {
        out.pack(group, pack_max.max(1));
    }
    out
}

impl Plan {
    /// A group's packs, at most `max` entries each, in the order they came.
    fn pack(&mut self, group: Group, max: usize) {
        let Group {
            exchange,
            routing_key,
            members,
            messages,
            hops,
        } = group;
        let mut members = members.into_iter();
        let mut hops = hops.into_iter();
        for chunk in messages.chunks(max) {
            let (body, properties) = pack::encode(chunk);
            let mine: Vec<Member> = members.by_ref().take(chunk.len()).collect();
            let chunk_hops: Vec<Hop> = hops.by_ref().take(chunk.len()).flatten().collect();
            let index = self.publishes.len();
            for m in &mine {
                let publishes = &mut self.deliveries[m.delivery].publishes;
                if publishes.last() != Some(&index) {
                    publishes.push(index);
                }
            }
            self.publishes.push(Publish {
                message: Outgoing::new(exchange.clone(), routing_key.clone(), body, properties),
                members: mine,
                park: None,
                hops: chunk_hops,
            });
        }
    }
}

/// The parked copy of one entry: the delivery's own copy when it was just this entry
/// (as lapse always parked), else the entry's body with its own properties.
pub fn parked_entry(
    names: &Names,
    delivery: &Delivery,
    entry: &Entry,
    cause: &str,
    reason: &str,
) -> Outgoing {
    let base = if delivery.data == entry.body {
        delivery.properties.clone()
    } else {
        match &entry.message {
            Ok(m) => m.properties(),
            Err(_) => BasicProperties::default().with_delivery_mode(2),
        }
    };
    Outgoing::new(
        names.parked(),
        String::new(),
        entry.body.clone(),
        parked_properties(&base, cause, reason),
    )
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;

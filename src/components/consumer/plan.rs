//! The pure half of the consumer: what to do with one delivery, given the
//! [`Decider`](super::Decider)'s [`Action`] and what the broker said about the wait
//! tiers the batch wants. No I/O: the consumer's execute step carries the [`Step`]s
//! out (publish with confirms, then acknowledge; hold; keep).

use std::collections::BTreeSet;
use std::time::Duration;

use lapin::message::Delivery;

use super::Action;
use crate::amqp::publishing::{Outgoing, parked_copy};
use crate::names::Names;
use crate::observe::stats::Outcome;
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

/// One delivery's step.
#[derive(Clone, Debug)]
pub enum Step {
    /// Acknowledge now.
    Ack(Outcome),
    /// Keep unacknowledged and decide again `after` the batch's clock read.
    Hold { after: Duration, outcome: Outcome },
    /// Publish with confirm, then acknowledge.
    Publish(Box<Publish>),
    /// Not published (its wait tier has no queue, or nobody knows): keep it and decide
    /// it again after the back-off, but no later than `reroute_after`.
    Keep {
        reroute_after: Option<Duration>,
        /// The wait queue that does not exist; `None` when the tier check failed.
        missing_queue: Option<String>,
    },
}

/// A publish a delivery waits on before it is acknowledged.
#[derive(Clone, Debug)]
pub struct Publish {
    pub message: Outgoing,
    pub outcome: Outcome,
    /// See [`Action::Publish`]; a kept delivery is decided again no later than this.
    pub reroute_after: Option<Duration>,
    /// The `parked` counter's reason when this publish parks the delivery.
    pub park: Option<&'static str>,
    /// The timeline event of a re-delay, written once the broker confirmed it.
    pub hop: Option<Hop>,
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

/// The step for one delivery.
// Over 60 lines on purpose: one arm per action; the table test below covers each.
pub fn plan(action: Action, delivery: &Delivery, names: &Names, tiers: &Tiers) -> Step {
    match action {
        Action::Ack(outcome) => Step::Ack(outcome),
        Action::Hold(after) => Step::Hold {
            after,
            outcome: Outcome::Held,
        },
        Action::Locked(after) => Step::Hold {
            after,
            outcome: Outcome::Locked,
        },
        Action::Publish {
            route,
            message,
            outcome,
            reroute_after,
        } => {
            if let Some(tier) = route.tier {
                match tiers {
                    Tiers::Unknown => {
                        return Step::Keep {
                            reroute_after,
                            missing_queue: None,
                        };
                    }
                    Tiers::Missing(missing) if missing.contains(&tier) => {
                        return Step::Keep {
                            reroute_after,
                            missing_queue: Some(names.wait_queue(tier)),
                        };
                    }
                    Tiers::Missing(_) => {}
                }
            }
            // A kind's deadline has no order timeline to record its hops in.
            let hop = (message.deadline().is_none())
                .then(|| Hop::of(&message, route.tier.map(|t| t.name()), "worker"));
            Step::Publish(Box::new(Publish {
                message: Outgoing::new(
                    route.exchange,
                    route.routing_key,
                    message.encode(),
                    message.properties(),
                ),
                outcome,
                reroute_after,
                park: None,
                hop,
            }))
        }
        Action::Park {
            reason,
            outcome,
            kind,
        } => Step::Publish(Box::new(Publish {
            message: parked_copy(names.parked(), delivery, kind, &reason),
            outcome,
            reroute_after: None,
            park: Some(kind),
            hop: None,
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{PARK_REASON_HEADER, Route, TimeoutMessage, park_reason};
    use crate::tier::TierSet;

    fn tier(s: &str) -> Tier {
        Tier::parse(s).unwrap()
    }

    fn redelay(names: &Names, to: &str) -> Action {
        let tiers = TierSet::new(vec![tier(to)]);
        let at = chrono::Utc::now() + chrono::TimeDelta::seconds(60);
        Action::Publish {
            route: Route::tier(names, tiers.smallest()),
            message: TimeoutMessage::new(7, at, 1),
            outcome: Outcome::Redelayed,
            reroute_after: Some(Duration::from_secs(50)),
        }
    }

    /// A step as one line, for the table below.
    fn shown(step: &Step) -> String {
        match step {
            Step::Ack(o) => format!("ack {}", o.as_str()),
            Step::Hold { after, outcome } => format!("hold {after:?} {}", outcome.as_str()),
            Step::Keep {
                reroute_after,
                missing_queue,
            } => format!(
                "keep {:?} missing={}",
                reroute_after.unwrap_or_default(),
                missing_queue.as_deref().unwrap_or("-")
            ),
            Step::Publish(p) => {
                let mut s = format!(
                    "publish {}/{} {}",
                    p.message.exchange,
                    p.message.routing_key,
                    p.outcome.as_str()
                );
                if let Some(kind) = p.park {
                    s += &format!(" park={kind}");
                }
                if let Some(hop) = &p.hop {
                    s += &format!(" hop={}", hop.tier);
                }
                s
            }
        }
    }

    /// Every action, with every answer of the tier check, and the step it becomes.
    #[test]
    fn each_action_becomes_its_step() {
        let names = Names::new("t");
        let delivery = Delivery::mock(0, "t.due".into(), "due".into(), false, b"{}".to_vec());
        let none = Tiers::Missing(BTreeSet::new());
        let ten_missing = Tiers::Missing(BTreeSet::from([tier("10s")]));
        let five_missing = Tiers::Missing(BTreeSet::from([tier("5s")]));
        let park = |outcome, kind| Action::Park {
            reason: "why".into(),
            outcome,
            kind,
        };
        let ms = Duration::from_millis;
        #[rustfmt::skip]
        let table: Vec<(&str, Action, &Tiers, &str)> = vec![
            ("settled",            Action::Ack(Outcome::Settled), &none, "ack settled"),
            ("closed",             Action::Ack(Outcome::Closed),  &none, "ack closed"),
            ("short remainder",    Action::Hold(ms(300)),         &none, "hold 300ms held"),
            ("row locked",         Action::Locked(ms(500)),       &none, "hold 500ms locked"),
            ("tier exists",        redelay(&names, "10s"),        &none, "publish t.delay/10s redelayed hop=10s"),
            ("other tier missing", redelay(&names, "10s"),        &five_missing, "publish t.delay/10s redelayed hop=10s"),
            ("tier missing",       redelay(&names, "10s"),        &ten_missing, "keep 50s missing=t.wait.10s"),
            ("tier check failed",  redelay(&names, "10s"),        &Tiers::Unknown, "keep 50s missing=-"),
            ("undecodable",        park(Outcome::Parked, "undecodable"),  &none, "publish t.parked/ parked park=undecodable"),
            ("bad deadline",       park(Outcome::Parked, "bad_deadline"), &none, "publish t.parked/ parked park=bad_deadline"),
            ("unknown shard",      park(Outcome::Parked, "unknown_shard"), &none, "publish t.parked/ parked park=unknown_shard"),
            ("gave up",            park(Outcome::GaveUp, "database_unavailable"), &Tiers::Unknown, "publish t.parked/ gave_up park=database_unavailable"),
        ];
        for (case, action, tiers, expected) in table {
            let step = plan(action, &delivery, &names, tiers);
            assert_eq!(shown(&step), expected, "{case}");
            if let Step::Publish(p) = &step
                && let Publish {
                    park: Some(_),
                    message,
                    ..
                } = p.as_ref()
            {
                assert_eq!(
                    park_reason(message.properties.headers().as_ref()).as_deref(),
                    Some("why"),
                    "{case}: a parked copy carries {PARK_REASON_HEADER}"
                );
                assert_eq!(message.body, b"{}", "{case}: the original body is parked");
            }
        }
    }
}

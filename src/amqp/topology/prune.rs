//! `topology apply --prune`: delete empty orphan wait queues.
//!
//! Invariants: deletes only a queue whose whole name is `<prefix>.wait.<canonical tier
//! name>` (never a neighbour deployment's queue whose prefix starts with ours), and
//! never one that holds ready or unacknowledged messages or has a consumer. Quorum
//! queues refuse `queue.delete` with `if-empty` (a connection-level
//! `NOT_IMPLEMENTED`), so for them emptiness is checked, not enforced by the broker:
//! see [`prune`] for the order of checks and what it leaves.

use lapin::Connection;
use lapin::options::{QueueBindOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use serde::Serialize;

use super::Topology;
use super::apply::{REPLY_TIMEOUT, close, open, replied};
use crate::amqp::broker::{self, BrokerError};
use crate::amqp::management::Management;
use crate::names::Names;
use crate::tier::Tier;

#[derive(Debug, Default, Serialize)]
pub struct PruneReport {
    pub deleted: Vec<String>,
    /// Orphans kept because they hold messages or have consumers.
    pub kept: Vec<Kept>,
}

#[derive(Debug, Serialize)]
pub struct Kept {
    pub queue: String,
    /// Messages in the queue (ready and unacknowledged) when it was looked at.
    pub messages: u64,
    /// What kept it, e.g. "3 messages, 1 consumers".
    pub why: String,
}

/// The tier an orphan candidate stands for: `Some` only when `name` is exactly
/// `<wait_prefix><canonical tier name>`. Anything else under the same text prefix
/// (`P.wait.x.due` of a deployment whose prefix is `P.wait.x`, `P.wait.90m` when
/// lapse would name that tier `1h30m`) is not lapse's and is never touched.
pub fn orphan_tier(wait_prefix: &str, name: &str) -> Option<Tier> {
    let suffix = name.strip_prefix(wait_prefix)?;
    let tier = Tier::parse(suffix).ok()?;
    (tier.name() == suffix).then_some(tier)
}

/// Why an orphan was kept rather than deleted.
fn busy(messages: u64, unacknowledged: u64, consumers: u64) -> Option<String> {
    let mut why = Vec::new();
    if messages > 0 {
        why.push(format!("{messages} messages"));
    }
    if unacknowledged > 0 {
        why.push(format!("{unacknowledged} unacknowledged"));
    }
    if consumers > 0 {
        why.push(format!("{consumers} consumers"));
    }
    (!why.is_empty()).then(|| why.join(", "))
}

/// The management API's counts of a candidate: `Err` (messages, why) unless they show
/// no message of any kind and no consumer. A queue the statistics database has not
/// reported on yet has no counts: unknown is not empty.
fn unused_in_stats(
    messages: Option<u64>,
    unacknowledged: Option<u64>,
    consumers: Option<u64>,
) -> Result<(), (u64, String)> {
    let (Some(m), Some(u), Some(c)) = (messages, unacknowledged, consumers) else {
        let why = "the management API has no statistics for it yet; run prune again later";
        return Err((messages.unwrap_or(0), why.into()));
    };
    match busy(m, u, c) {
        Some(why) => Err((m, why)),
        None => Ok(()),
    }
}

/// A queue's binding to an exchange.
struct Binding<'a> {
    queue: &'a str,
    exchange: &'a str,
    routing_key: String,
}

/// After the unbind: a passive declare, answered by the queue itself, must show no
/// ready message and no consumer; then the queue is deleted (`if-empty` where the
/// queue type supports it). `Some` (messages, why) when it is in use.
async fn delete_if_unused(
    channel: &lapin::Channel,
    name: &str,
    quorum: bool,
) -> Result<Option<(u64, String)>, Box<dyn std::error::Error + Send + Sync>> {
    let asked = broker::passive_declare(channel, name);
    let now = broker::within(REPLY_TIMEOUT, "queue.declare", asked)
        .await?
        .existing(name)?;
    if let Some(why) = busy(u64::from(now.messages), 0, u64::from(now.consumers)) {
        return Ok(Some((u64::from(now.messages), why)));
    }
    let options = QueueDeleteOptions {
        if_empty: !quorum,
        ..QueueDeleteOptions::default()
    };
    let delete = channel.queue_delete(name.into(), options);
    replied("queue.delete", delete).await??;
    Ok(None)
}

/// Binds `binding` again on a fresh channel and reports the queue as kept for `why`;
/// says so when the bind fails too (the queue is then left unbound: nothing of this
/// prefix routes to an orphan tier any more, and a later prune looks at it again).
async fn rebound(conn: &Connection, binding: &Binding<'_>, messages: u64, why: String) -> Kept {
    let bound = async {
        let channel = open(conn).await?;
        let bind = channel.queue_bind(
            binding.queue.into(),
            binding.exchange.into(),
            binding.routing_key.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        );
        let result = replied("queue.bind", bind).await;
        close(&channel).await;
        result?.map_err(BrokerError::amqp("queue.bind"))
    }
    .await;
    let why = match bound {
        Ok(()) => why,
        Err(e) => format!("{why}; binding it again failed too ({e}): it is left unbound"),
    };
    Kept {
        queue: binding.queue.to_string(),
        messages,
        why,
    }
}

/// Deletes wait queues of this prefix that the topology no longer has, if empty.
///
/// A candidate must parse as one of lapse's tier queues (`orphan_tier`). Then:
/// 1. the management API's view (which counts unacknowledged messages and consumers)
///    must show no messages of any kind and no consumer;
/// 2. the queue is unbound from the delay exchange, so a publish to its tier now goes
///    to the alternate exchange (parked) instead of into the queue;
/// 3. a passive declare, answered by the queue itself after the unbind, must show
///    no ready message and no consumer; then the queue is deleted (with `if-empty`
///    where the queue type supports it, i.e. not quorum). Otherwise, or when that
///    check or the delete fails, it is bound again and kept, and the other
///    candidates are still looked at.
///
/// A queue without statistics in the management API yet (its counts absent) is kept:
/// unknown is not empty.
///
/// What remains: a consumer that attaches between step 3 and the delete, on a wait
/// queue no deployment of this prefix routes to any more. Lapse never consumes from
/// wait queues; an operator's consumer there would lose only what it had not acked.
pub async fn prune(
    conn: &Connection,
    management: &Management,
    vhost: &str,
    names: &Names,
    topology: &Topology,
) -> Result<PruneReport, Box<dyn std::error::Error + Send + Sync>> {
    let wait_prefix = names.wait_queue_prefix();
    let delay = names.delay_exchange();
    let mut report = PruneReport::default();
    for q in management.queues(vhost).await? {
        let Some(tier) = orphan_tier(&wait_prefix, &q.name) else {
            continue;
        };
        if topology.queue(&q.name).is_some() {
            continue;
        }
        if let Err((messages, why)) =
            unused_in_stats(q.messages, q.messages_unacknowledged, q.consumers)
        {
            report.kept.push(Kept {
                queue: q.name.clone(),
                messages,
                why,
            });
            continue;
        }
        let quorum = q.arguments.get("x-queue-type").and_then(|v| v.as_str()) == Some("quorum");
        let binding = Binding {
            queue: q.name.as_str(),
            exchange: delay.as_str(),
            routing_key: tier.name(),
        };
        // Whatever goes wrong from the unbind on (an unbind the broker made but
        // answered too late included), the queue is bound again (on a fresh channel:
        // an error closes this one) and kept; the other orphans are still looked at.
        let channel = open(conn).await?;
        let unbind = channel.queue_unbind(
            binding.queue.into(),
            binding.exchange.into(),
            binding.routing_key.as_str().into(),
            FieldTable::default(),
        );
        let unbound = match replied("queue.unbind", unbind).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(BrokerError::amqp("queue.unbind")(e).into()),
            Err(e) => Err(e.into()),
        };
        let checked = match unbound {
            Ok(()) => delete_if_unused(&channel, binding.queue, quorum).await,
            Err(e) => Err(e),
        };
        match checked {
            Ok(None) => report.deleted.push(q.name.clone()),
            Ok(Some((messages, why))) => {
                report
                    .kept
                    .push(rebound(conn, &binding, messages, why).await);
            }
            Err(e) => {
                let why = format!("unbinding it or the check after failed ({e})");
                report.kept.push(rebound(conn, &binding, 0, why).await);
            }
        }
        close(&channel).await;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_orphan_is_unused_only_when_every_count_is_known_and_zero() {
        assert_eq!(unused_in_stats(Some(0), Some(0), Some(0)), Ok(()));
        let (n, why) = unused_in_stats(Some(0), Some(3), Some(0)).unwrap_err();
        assert_eq!((n, why.as_str()), (0, "3 unacknowledged"));
        let (_, why) = unused_in_stats(Some(2), Some(0), Some(1)).unwrap_err();
        assert_eq!(why, "2 messages, 1 consumers");
        for absent in [
            (None, Some(0), Some(0)),
            (Some(0), None, Some(0)),
            (Some(0), Some(0), None),
        ] {
            let (_, why) = unused_in_stats(absent.0, absent.1, absent.2).unwrap_err();
            assert!(why.contains("no statistics"), "{why}");
        }
    }

    #[test]
    fn only_a_canonical_tier_name_after_the_wait_prefix_is_an_orphan_candidate() {
        let p = "P.wait.";
        assert_eq!(
            orphan_tier(p, "P.wait.30m").map(Tier::name),
            Some("30m".into())
        );
        assert_eq!(
            orphan_tier(p, "P.wait.1h30m").map(Tier::name),
            Some("1h30m".into())
        );
        // A neighbour whose prefix is `P.wait.x`, and other spellings.
        for other in [
            "P.wait.x.due",
            "P.wait.x.parked",
            "P.wait.x.stock.release",
            "P.wait.x.wait.1s",
            "P.wait.90m",
            "P.wait.1s.due",
            "P.wait.",
            "P.wait.0s",
            "P.due",
            "Q.wait.1s",
        ] {
            assert_eq!(orphan_tier(p, other), None, "{other}");
        }
    }

    #[test]
    fn busy_names_every_reason() {
        assert_eq!(busy(0, 0, 0), None);
        assert_eq!(
            busy(3, 2, 1).unwrap(),
            "3 messages, 2 unacknowledged, 1 consumers"
        );
    }
}

//! `topology apply`: declare every object of a [`Topology`] and report argument drift
//! instead of stopping at the first (`--prune` is [`super::prune`]).
//!
//! Invariant: idempotent (a second run declares the same objects with the same
//! arguments and changes nothing).

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ExchangeKind as LapinKind};
use serde::Serialize;

use super::{
    ArgValue, CREATE_ONLY_ARGS, ExchangeKind, ExchangeSpec, GROUP_SIZE_ARG, QueueSpec, Topology,
};
use crate::amqp::broker::{self, BrokerError};

/// An object that exists with other properties than the topology wants.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Drift {
    pub object: String,
    pub argument: String,
    pub expected: String,
    pub actual: String,
}

impl std::fmt::Display for Drift {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} is {} on the broker, the tier file wants {}",
            self.object, self.argument, self.actual, self.expected
        )
    }
}

#[derive(Debug, Default, Serialize)]
pub struct ApplyReport {
    pub declared: Vec<String>,
    pub drifts: Vec<Drift>,
    pub failures: Vec<String>,
}

impl ApplyReport {
    pub fn ok(&self) -> bool {
        self.drifts.is_empty() && self.failures.is_empty()
    }
}

/// Parses RabbitMQ's 406 text: "inequivalent arg 'x-message-ttl' for queue 'q' in
/// vhost '/': received the value '2000' of type 'long' but current is the value
/// '1000' of type 'long'" into a [`Drift`] (expected = received, actual = current).
/// How a drift shows an argument the existing object does not have.
const ABSENT: &str = "(absent)";

pub fn parse_inequivalent(object: &str, text: &str) -> Drift {
    let argument = between(text, "inequivalent arg '", "'").unwrap_or("(unknown)");
    let received = between(text, "received ", " but current is ").unwrap_or("(unknown)");
    let current = text.split(" but current is ").nth(1).unwrap_or("(unknown)");
    Drift {
        object: object.to_string(),
        argument: argument.to_string(),
        expected: shown_value(received),
        actual: shown_value(current),
    }
}

fn between<'a>(text: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let rest = &text[text.find(start)? + start.len()..];
    Some(&rest[..rest.find(end)?])
}

/// "the value '1000' of type 'long'" -> "1000"; "none" -> "(absent)"; "'fanout'" -> "fanout".
fn shown_value(text: &str) -> String {
    let text = text.trim();
    if let Some(v) = between(text, "the value '", "'") {
        return v.to_string();
    }
    if text == "none" {
        return ABSENT.to_string();
    }
    text.trim_matches('\'').to_string()
}

fn lapin_kind(kind: ExchangeKind) -> LapinKind {
    match kind {
        ExchangeKind::Direct => LapinKind::Direct,
        ExchangeKind::Fanout => LapinKind::Fanout,
    }
}

/// Outcome of declaring one object on a fresh channel.
pub(crate) enum Declared {
    Ok,
    Drift(Drift),
    Missing,
}

/// Declares an exchange (or only checks it exists when `passive`).
pub(crate) async fn declare_exchange(
    conn: &Connection,
    e: &ExchangeSpec,
    passive: bool,
) -> Result<Declared, BrokerError> {
    let channel = open(conn).await?;
    let options = ExchangeDeclareOptions {
        durable: true,
        passive,
        ..Default::default()
    };
    let declared = channel.exchange_declare(
        e.name.as_str().into(),
        lapin_kind(e.kind),
        options,
        super::field_table(&e.arguments),
    );
    let result = replied("exchange.declare", declared).await?;
    finish(channel, &e.name, result.map(|_| ())).await
}

/// Declares a queue (or only checks it exists when `passive`).
pub(crate) async fn declare_queue(
    conn: &Connection,
    q: &QueueSpec,
    passive: bool,
) -> Result<Declared, BrokerError> {
    declare_queue_keeping(conn, q, passive, Vec::new()).await
}

/// [`declare_queue`]; `kept` lists the create-only arguments already taken from the
/// existing queue (each is taken once: a broker that objects to the same one again
/// gets the drift reported, not another declare).
async fn declare_queue_keeping(
    conn: &Connection,
    q: &QueueSpec,
    passive: bool,
    mut kept: Vec<String>,
) -> Result<Declared, BrokerError> {
    let channel = open(conn).await?;
    let options = QueueDeclareOptions {
        durable: true,
        passive,
        ..Default::default()
    };
    let args = if passive {
        FieldTable::default()
    } else {
        super::field_table(&q.arguments)
    };
    let declared = channel.queue_declare(q.name.as_str().into(), options, args);
    let result = replied("queue.declare", declared).await?;
    match finish(channel, &q.name, result.map(|_| ())).await? {
        // The group size and the leader locator only matter when the queue is
        // created: declare again with what the existing queue has, so that the other
        // arguments are still compared.
        Declared::Drift(d) if !kept.contains(&d.argument) => match existing_value(q, &d) {
            Some(value) => {
                let mut again = q.clone();
                match value {
                    Some(v) => again.arguments.insert(d.argument.clone(), v),
                    None => again.arguments.remove(&d.argument),
                };
                kept.push(d.argument);
                Box::pin(declare_queue_keeping(conn, &again, passive, kept)).await
            }
            None => Ok(Declared::Drift(d)),
        },
        other => Ok(other),
    }
}

/// What to declare a create-only argument as so that an existing queue is accepted:
/// `Some(None)` to leave it out, `Some(Some(v))` for the broker's value, `None` when
/// the drift is a real one. Accepted: any group size (it grows by operator action,
/// docs/topology.md) and an absent leader locator (queues created before lapse set
/// it); a leader locator other than ours is reported. A topology built without a
/// group size (`lapse status`, which does not ask the cluster for its size) accepts
/// the size the queue was created with.
fn existing_value(q: &QueueSpec, d: &Drift) -> Option<Option<ArgValue>> {
    if super::parked_without_limit(q, &d.argument, d.actual == ABSENT) {
        return Some(None);
    }
    if d.argument == GROUP_SIZE_ARG {
        if d.actual == ABSENT {
            return Some(None);
        }
        return d.actual.parse::<i64>().ok().map(|n| Some(ArgValue::Int(n)));
    }
    if !CREATE_ONLY_ARGS.contains(&d.argument.as_str()) || !q.arguments.contains_key(&d.argument) {
        return None;
    }
    (d.actual == ABSENT).then_some(None)
}

async fn finish(
    channel: lapin::Channel,
    object: &str,
    result: Result<(), lapin::Error>,
) -> Result<Declared, BrokerError> {
    let outcome = match result {
        Ok(()) => Declared::Ok,
        Err(e) => {
            if let Some(text) = broker::precondition_failed(&e) {
                Declared::Drift(parse_inequivalent(object, &text))
            } else if broker::not_found(&e) {
                Declared::Missing
            } else {
                return Err(BrokerError::amqp("declare")(e));
            }
        }
    };
    close(&channel).await;
    Ok(outcome)
}

/// How long each of the broker's replies to a declare, a binding or a channel opening
/// is waited for. Declaring even a new quorum queue on a cluster answers within
/// seconds; a broker gone silent after the connect fails `topology apply`, `verify`
/// and `lapse status --check` instead of hanging them (the management API's requests
/// have bounds of their own).
pub const REPLY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

pub(super) async fn open(conn: &Connection) -> Result<lapin::Channel, BrokerError> {
    broker::open_channel_within(conn, REPLY_TIMEOUT).await
}

/// The broker's reply to `step` within [`REPLY_TIMEOUT`] (see [`broker::replied`]).
pub(super) async fn replied<T>(
    op: &'static str,
    step: impl std::future::Future<Output = lapin::Result<T>>,
) -> Result<lapin::Result<T>, BrokerError> {
    broker::replied(REPLY_TIMEOUT, op, step).await
}

pub(super) async fn close(channel: &lapin::Channel) {
    broker::close_channel_quietly(channel, "done").await;
}

/// Declares everything; drift on one object does not stop the others.
pub async fn apply(conn: &Connection, topology: &Topology) -> Result<ApplyReport, BrokerError> {
    let mut report = ApplyReport::default();
    let mut record = |name: &str, outcome: Declared| match outcome {
        Declared::Ok => report.declared.push(name.to_string()),
        Declared::Drift(d) => report.drifts.push(d),
        Declared::Missing => report.failures.push(format!("{name}: not found")),
    };
    for e in &topology.exchanges {
        record(&e.name, declare_exchange(conn, e, false).await?);
    }
    for q in &topology.queues {
        record(&q.name, declare_queue(conn, q, false).await?);
    }
    let mut channel = open(conn).await?;
    for b in &topology.bindings {
        if !channel.status().connected() {
            channel = open(conn).await?;
        }
        let binding = channel.queue_bind(
            b.queue.as_str().into(),
            b.exchange.as_str().into(),
            b.routing_key.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        );
        let bound = replied("queue.bind", binding).await?;
        if let Err(e) = bound {
            // A queue or exchange that failed above cannot be bound; say so and go on.
            report.failures.push(format!(
                "binding {} --[{}]--> {}: {e}",
                b.exchange, b.routing_key, b.queue
            ));
        }
    }
    close(&channel).await;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_brokers_406_text() {
        let text = "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'p.wait.1s' in vhost '/': received the value '1000' of type 'signedint' but current is the value '2000' of type 'signedint'";
        let d = parse_inequivalent("p.wait.1s", text);
        assert_eq!(d.argument, "x-message-ttl");
        assert_eq!(d.expected, "1000");
        assert_eq!(d.actual, "2000");
        let text = "PRECONDITION_FAILED - inequivalent arg 'x-overflow' for queue 'q' in vhost '/': received the value 'reject-publish' of type 'longstr' but current is none";
        let d = parse_inequivalent("q", text);
        assert_eq!(d.actual, "(absent)");
    }
}

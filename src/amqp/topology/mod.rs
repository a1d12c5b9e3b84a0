//! Topology as data: the exchanges, queues and bindings one deployment needs,
//! derived from the name prefix and the tier file. The same [`Topology`] value
//! drives `plan` (print it), `apply` (declare it) and `verify` (compare it with the
//! live broker).
//!
//! Invariants: every name starts with `<prefix>.`; each wait queue is quorum with an
//! integer `x-message-ttl`, dead-letters at-least-once into `<prefix>.due`, and
//! rejects publishes when full (at-least-once dead-lettering silently degrades to
//! at-most-once without `x-overflow=reject-publish`).

mod apply;
mod prune;
mod verify;

pub use apply::{ApplyReport, Drift, REPLY_TIMEOUT, apply};
pub use prune::{PruneReport, prune};
pub use verify::{Check, CheckStatus, VerifyReport, verify};

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

use crate::names::{DUE_ROUTING_KEY, Names, STOCK_RELEASE_ROUTING_KEY};
use crate::tier_file::TierFile;

/// A queue or exchange argument value as RabbitMQ stores it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum ArgValue {
    Int(i64),
    Str(String),
}

impl fmt::Display for ArgValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArgValue::Int(n) => write!(f, "{n}"),
            ArgValue::Str(s) => write!(f, "{s}"),
        }
    }
}

pub type Arguments = BTreeMap<String, ArgValue>;

/// `args` as the AMQP field table a declare sends.
pub fn field_table(args: &Arguments) -> lapin::types::FieldTable {
    use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
    let mut table = FieldTable::default();
    for (key, value) in args {
        let value = match value {
            ArgValue::Int(n) => AMQPValue::LongLongInt(*n),
            ArgValue::Str(s) => AMQPValue::LongString(LongString::from(s.as_str())),
        };
        table.insert(ShortString::from(key.as_str()), value);
    }
    table
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ExchangeKind {
    Direct,
    Fanout,
}

impl ExchangeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Fanout => "fanout",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExchangeSpec {
    pub name: String,
    pub kind: ExchangeKind,
    pub arguments: Arguments,
}

/// What a queue is for; wait queues carry their tier.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "role", content = "tier")]
pub enum QueueRole {
    Wait(String),
    Due,
    Parked,
    StockRelease,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct QueueSpec {
    pub name: String,
    #[serde(flatten)]
    pub role: QueueRole,
    pub arguments: Arguments,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BindingSpec {
    pub exchange: String,
    pub queue: String,
    pub routing_key: String,
}

/// Everything one deployment declares.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Topology {
    pub prefix: String,
    /// The tiers, smallest first, and where they came from (the built-in default or a
    /// file's path).
    pub tiers: Vec<String>,
    pub tiers_from: String,
    pub exchanges: Vec<ExchangeSpec>,
    pub queues: Vec<QueueSpec>,
    pub bindings: Vec<BindingSpec>,
    /// Replicas each quorum queue should have (see [`Topology::with_group_size`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_size: Option<u32>,
}

/// The queue argument that sets how many nodes a new quorum queue is replicated on.
/// The broker uses it only when it creates the queue, and refuses a redeclare with
/// another value. So `apply` (and the redeclare of `verify`) accepts an existing queue
/// with any value of it or none: it declares again with the broker's value, or without
/// the argument. `verify` compares the live members with the target instead; with the
/// management API the stored argument is not compared either.
pub const GROUP_SIZE_ARG: &str = "x-quorum-initial-group-size";

/// The queue argument that places a new quorum queue's leader; `balanced` puts it on
/// the node with the fewest leaders, so that on a cluster the tiers, the due queue and
/// the stock-release queue (each one leader process, each its own dead-letter or
/// consumer load) spread over the nodes instead of all landing on the node `apply`
/// happened to connect to. It only counts at creation too, but unlike the group size
/// only its absence is accepted: `apply` and `verify` take an existing queue without it
/// as it is (created before lapse set it; it keeps its leader, and `rabbitmq-queues
/// rebalance quorum` moves those), and report any value other than
/// [`LEADER_LOCATOR`] as drift.
pub const LEADER_LOCATOR_ARG: &str = "x-queue-leader-locator";
pub const LEADER_LOCATOR: &str = "balanced";

/// The queue argument that bounds how often a quorum queue hands out one message.
pub const DELIVERY_LIMIT_ARG: &str = "x-delivery-limit";

/// The delivery limit of `<P>.parked`. Set, because RabbitMQ 4.x gives every quorum
/// queue without one a limit of 20, and the parked queue has no dead-letter exchange:
/// a parked message returned 21 times (interrupted `lapse parked` commands, an
/// outside consumer) would be dropped. As high as the argument goes, so that on 3.x
/// (where a missing limit is unlimited, and `-1` would dead-letter at the first
/// return) and 4.x alike nothing parked is ever dropped for being returned. A parked
/// queue created before lapse set it is accepted without it by `apply` and `verify`
/// (docs/operations.md, "Compatibility").
pub const PARKED_DELIVERY_LIMIT: i64 = i32::MAX as i64;

/// True for the parked queue's delivery limit missing on a queue created before lapse
/// set it: accepted as it is (see [`PARKED_DELIVERY_LIMIT`]).
pub(crate) fn parked_without_limit(q: &QueueSpec, argument: &str, absent: bool) -> bool {
    absent && argument == DELIVERY_LIMIT_ARG && q.role == QueueRole::Parked
}

/// Arguments that only count when the broker creates the queue (see above for what an
/// existing queue may have of each).
pub const CREATE_ONLY_ARGS: [&str; 2] = [GROUP_SIZE_ARG, LEADER_LOCATOR_ARG];

/// The default group size: every node of the cluster, at most this many.
pub const DEFAULT_MAX_GROUP_SIZE: u32 = 3;

/// The group size when `topology.quorum_group_size` is unset, for a cluster of `nodes`.
pub fn default_group_size(nodes: usize) -> u32 {
    (nodes.max(1) as u32).min(DEFAULT_MAX_GROUP_SIZE)
}

fn str_arg(s: impl Into<String>) -> ArgValue {
    ArgValue::Str(s.into())
}

impl Topology {
    /// Derives the whole graph from a prefix and a validated tier file.
    // Over 60 lines on purpose: the broker objects as data, in the order `apply` declares them; read top to bottom it is the topology.
    pub fn new(names: &Names, file: &TierFile) -> Self {
        let parked = names.parked();
        let exchange = |name: String, kind, arguments| ExchangeSpec {
            name,
            kind,
            arguments,
        };
        let exchanges = vec![
            exchange(
                names.delay_exchange(),
                ExchangeKind::Direct,
                // An unknown tier is parked, not dropped.
                Arguments::from([("alternate-exchange".into(), str_arg(&parked))]),
            ),
            exchange(names.due_exchange(), ExchangeKind::Direct, Arguments::new()),
            exchange(parked.clone(), ExchangeKind::Fanout, Arguments::new()),
            exchange(
                names.events_exchange(),
                ExchangeKind::Direct,
                Arguments::new(),
            ),
        ];

        let mut queues = Vec::new();
        let mut bindings = Vec::new();
        let bind = |exchange: String, queue: &str, key: &str| BindingSpec {
            exchange,
            queue: queue.to_string(),
            routing_key: key.to_string(),
        };
        for tier in file.tiers.iter() {
            let name = names.wait_queue(tier);
            let mut arguments = Arguments::from([
                ("x-queue-type".into(), str_arg("quorum")),
                ("x-message-ttl".into(), ArgValue::Int(tier.ttl_ms() as i64)),
                (
                    "x-dead-letter-exchange".into(),
                    str_arg(names.due_exchange()),
                ),
                ("x-dead-letter-routing-key".into(), str_arg(DUE_ROUTING_KEY)),
                ("x-dead-letter-strategy".into(), str_arg("at-least-once")),
                ("x-overflow".into(), str_arg("reject-publish")),
            ]);
            if let Some(max) = file.max_length {
                arguments.insert("x-max-length".into(), ArgValue::Int(max as i64));
            }
            bindings.push(bind(names.delay_exchange(), &name, &tier.name()));
            queues.push(QueueSpec {
                name,
                role: QueueRole::Wait(tier.name()),
                arguments,
            });
        }
        // Consumed queues: a message delivered too often is dead-lettered to parked.
        let consumed = |name: String, role| QueueSpec {
            name,
            role,
            arguments: Arguments::from([
                ("x-queue-type".into(), str_arg("quorum")),
                (
                    DELIVERY_LIMIT_ARG.into(),
                    ArgValue::Int(i64::from(file.delivery_limit)),
                ),
                ("x-dead-letter-exchange".into(), str_arg(&parked)),
                ("x-dead-letter-strategy".into(), str_arg("at-least-once")),
                ("x-overflow".into(), str_arg("reject-publish")),
            ]),
        };
        queues.push(consumed(names.due_queue(), QueueRole::Due));
        bindings.push(bind(
            names.due_exchange(),
            &names.due_queue(),
            DUE_ROUTING_KEY,
        ));
        queues.push(QueueSpec {
            name: parked.clone(),
            role: QueueRole::Parked,
            arguments: Arguments::from([
                ("x-queue-type".into(), str_arg("quorum")),
                (
                    DELIVERY_LIMIT_ARG.into(),
                    ArgValue::Int(PARKED_DELIVERY_LIMIT),
                ),
            ]),
        });
        bindings.push(bind(parked.clone(), &parked, ""));
        queues.push(consumed(
            names.stock_release_queue(),
            QueueRole::StockRelease,
        ));
        bindings.push(bind(
            names.events_exchange(),
            &names.stock_release_queue(),
            STOCK_RELEASE_ROUTING_KEY,
        ));
        for q in &mut queues {
            q.arguments
                .insert(LEADER_LOCATOR_ARG.into(), str_arg(LEADER_LOCATOR));
        }
        Self {
            prefix: names.prefix.clone(),
            tiers: file.tiers.iter().map(|t| t.name()).collect(),
            tiers_from: file.source.to_string(),
            exchanges,
            queues,
            bindings,
            group_size: None,
        }
    }

    /// Every queue (all are quorum queues) created with `size` replicas.
    pub fn with_group_size(mut self, size: u32) -> Self {
        for q in &mut self.queues {
            q.arguments
                .insert(GROUP_SIZE_ARG.into(), ArgValue::Int(i64::from(size)));
        }
        self.group_size = Some(size);
        self
    }

    pub fn queue(&self, name: &str) -> Option<&QueueSpec> {
        self.queues.iter().find(|q| q.name == name)
    }

    /// A readable table of what would be declared.
    pub fn render_table(&self) -> String {
        let mut out = format!(
            "TIERS {} (from {})\n",
            self.tiers.join(" "),
            self.tiers_from
        );
        out.push_str("EXCHANGES\n");
        for e in &self.exchanges {
            out.push_str(&format!(
                "  {:<40} {:<7} {}\n",
                e.name,
                e.kind.as_str(),
                render_args(&e.arguments)
            ));
        }
        out.push_str("QUEUES\n");
        for q in &self.queues {
            out.push_str(&format!("  {:<40} {}\n", q.name, render_args(&q.arguments)));
        }
        out.push_str("BINDINGS\n");
        for b in &self.bindings {
            out.push_str(&format!(
                "  {:<28} --[{}]--> {}\n",
                b.exchange, b.routing_key, b.queue
            ));
        }
        out
    }
}

pub fn render_args(args: &Arguments) -> String {
    args.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_queues_carry_the_spec_arguments() {
        let file = TierFile::parse("tiers = [\"30m\", \"1s\"]").unwrap();
        let topo = Topology::new(&Names::new("shop"), &file);
        let q = topo.queue("shop.wait.30m").unwrap();
        assert_eq!(q.arguments["x-message-ttl"], ArgValue::Int(1_800_000));
        assert_eq!(q.arguments["x-dead-letter-exchange"], str_arg("shop.due"));
        assert_eq!(
            q.arguments["x-dead-letter-strategy"],
            str_arg("at-least-once")
        );
        assert_eq!(q.arguments["x-overflow"], str_arg("reject-publish"));
        assert_eq!(q.arguments.len(), 7);
        // Every queue's leader is placed where the fewest leaders are.
        assert!(
            topo.queues
                .iter()
                .all(|q| q.arguments[LEADER_LOCATOR_ARG] == str_arg("balanced"))
        );
        assert!(topo.bindings.iter().any(|b| b.exchange == "shop.delay"
            && b.routing_key == "1s"
            && b.queue == "shop.wait.1s"));
        assert!(topo.queues.iter().all(|q| q.name.starts_with("shop.")));
    }
}

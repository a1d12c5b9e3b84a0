//! `<P>.parked`: reading, replaying and purging the messages lapse (or the broker)
//! parked, without ever losing one.
//!
//! Every command is one pass over the queue: `basic.get` the messages that were ready
//! when the pass began, decide each ([`Plan`]), publish with confirms, and only then
//! acknowledge. A message that stays parked is not given back to the queue (a
//! `basic.nack` or a closed channel would count as a failed delivery: a quorum queue
//! with a delivery limit — RabbitMQ 4 sets one by default, a policy can set one on
//! 3.x — drops a message returned too often, and `<P>.parked` has nowhere further to
//! dead-letter it). Instead a copy is published back to `<P>.parked` and the original
//! acknowledged after the copy's confirm: listing a message any number of times never
//! spends a delivery, and the copy goes to the back of the queue, behind the messages
//! not read yet, so the pass reads each message once. A replayed message is published
//! to its destination and acknowledged only after that confirm; a purged one is
//! acknowledged. Whatever fails is left unacknowledged and returns to the queue when
//! the pass's channel closes: an interrupted pass loses nothing and at worst leaves a
//! duplicate (same ID; the database guards absorb a duplicate replay).
//!
//! One pass at a time per prefix: a pass holds an exclusive queue `<P>.parked.lock`
//! (deleted by the broker when the pass's connection ends), so two operators never
//! read each other's copies.

mod entry;
mod route;

pub use entry::{Entry, Kind, ReasonSource, headers_json, rfc3339};
pub use route::Router;

use lapin::message::Delivery;
use lapin::options::{BasicGetOptions, QueueDeclareOptions};

use crate::amqp::batch::ack;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ErrorKind};
use serde::Serialize;

use crate::amqp::broker::{self, BrokerError, Endpoint, Publisher, QueueState};
use crate::amqp::publishing::Outgoing;
use crate::names::Names;

/// Messages read, published and acknowledged together.
const CHUNK: usize = 100;

/// What a pass does with one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    Keep,
    Replay,
    Purge,
}

/// What happened to one message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    Kept,
    Replayed {
        to: String,
    },
    WouldReplay {
        to: String,
    },
    Purged,
    /// The message stays parked; `error` says why it was not replayed.
    Failed {
        error: String,
    },
}

/// One message of a pass, with its properties and body for `parked show`.
#[derive(Clone, Debug, Serialize)]
pub struct Item {
    #[serde(flatten)]
    pub entry: Entry,
    #[serde(flatten)]
    pub outcome: Outcome,
    #[serde(skip)]
    pub properties: BasicProperties,
    #[serde(skip)]
    pub body: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum ParkedError {
    #[error(transparent)]
    Broker(#[from] BrokerError),
    #[error("the parked queue `{0}` does not exist: run `lapse topology apply` first")]
    NoQueue(String),
    #[error(
        "stopped: {0}; the messages of the unfinished chunk stay parked (earlier chunks are done); \
         run `lapse parked list` once the broker accepts publishes again"
    )]
    Stalled(String),
    #[error(
        "another `lapse parked` command is working on `{0}` right now; try again when it has finished"
    )]
    Busy(String),
}

impl ParkedError {
    /// True when the broker could not be reached at all, or stopped answering.
    pub fn unreachable(&self) -> bool {
        matches!(
            self,
            ParkedError::Broker(
                BrokerError::Connect(_)
                    | BrokerError::CertificateRejected { .. }
                    | BrokerError::ConnectTimeout { .. }
                    | BrokerError::ReplyTimeout { .. }
                    | BrokerError::AckTimeout { .. }
            )
        )
    }
}

/// One pass over `<P>.parked`.
pub struct Pass {
    pub endpoint: Endpoint,
    pub names: Names,
    /// Where replayed messages go; needed only when the plan replays.
    pub router: Option<Router>,
    /// Replays only say where they would go; purges keep the message.
    pub dry_run: bool,
}

impl Pass {
    /// Reads every message ready when the pass starts, in queue order, and carries out
    /// `plan` for each.
    pub async fn run(
        &self,
        mut plan: impl FnMut(&Entry) -> Plan,
    ) -> Result<Vec<Item>, ParkedError> {
        let conn = self.endpoint.connect("lapse parked").await?;
        let result = self.pass(&conn, &mut plan).await;
        broker::close_quietly(&conn, "parked pass done").await;
        result
    }

    // Over 60 lines on purpose: one pass over parked messages: read a chunk, settle it, stop at the first chunk the broker does not confirm.
    async fn pass(
        &self,
        conn: &Connection,
        plan: &mut impl FnMut(&Entry) -> Plan,
    ) -> Result<Vec<Item>, ParkedError> {
        let queue = self.names.parked();
        let lock = format!("{queue}.lock");
        // Each reply waited for at most the confirm timeout: a broker gone silent fails
        // the pass (nothing is acknowledged before its copy is confirmed).
        let after = self.endpoint.confirm_timeout;
        let lock_channel = broker::open_channel_within(conn, after).await?;
        let exclusive = QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..Default::default()
        };
        let declared =
            lock_channel.queue_declare(lock.as_str().into(), exclusive, FieldTable::default());
        if let Err(e) = broker::replied(after, "queue.declare", declared).await? {
            return Err(if resource_locked(&e) {
                ParkedError::Busy(queue)
            } else {
                BrokerError::amqp("queue.declare")(e).into()
            });
        }
        let reader = broker::open_channel_within(conn, after).await?;
        let asked = broker::passive_declare(&reader, &queue);
        let total = match broker::within(after, "queue.declare", asked).await? {
            QueueState::Exists(counts) => counts.messages,
            QueueState::Missing => return Err(ParkedError::NoQueue(queue)),
        };
        let publisher = self.endpoint.publisher(conn).await?;
        let mut items = Vec::new();
        let mut taken = 0;
        while taken < total {
            let mut chunk = Vec::new();
            while chunk.len() < CHUNK && taken < total {
                let get =
                    reader.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false });
                let got = broker::replied(after, "basic.get", get)
                    .await?
                    .map_err(BrokerError::amqp("basic.get"))?;
                match got {
                    Some(m) => {
                        chunk.push(m.delivery);
                        taken += 1;
                    }
                    None => taken = total,
                }
            }
            items.extend(self.settle(conn, &publisher, chunk, plan).await?);
        }
        // Unacknowledged messages (failures) return to the queue here.
        for c in [&reader, publisher.channel(), &lock_channel] {
            broker::close_channel_quietly(c, "parked pass done").await;
        }
        Ok(items)
    }

    /// Decides, publishes and acknowledges one chunk.
    // Over 60 lines on purpose: one chunk: its publishes, then the acknowledgements in order and the retried copies; the pending list spans all three.
    async fn settle(
        &self,
        conn: &Connection,
        publisher: &Publisher,
        chunk: Vec<Delivery>,
        plan: &mut impl FnMut(&Entry) -> Plan,
    ) -> Result<Vec<Item>, ParkedError> {
        let entries: Vec<(Delivery, Entry, Plan)> = chunk
            .into_iter()
            .map(|d| {
                let entry = Entry::read(&d, &self.names);
                let p = plan(&entry);
                (d, entry, p)
            })
            .collect();
        let replays: Vec<&Entry> = entries
            .iter()
            .filter(|(_, _, p)| *p == Plan::Replay)
            .map(|(_, e, _)| e)
            .collect();
        let targets = match &self.router {
            Some(router) => router.targets(conn, &replays).await?,
            None => replays
                .iter()
                .map(|_| Err("replay needs the tier file".to_string()))
                .collect(),
        };
        let mut targets = targets.into_iter();
        let mut first = Vec::new();
        let mut pending = Vec::new();
        for (delivery, entry, p) in entries {
            let keep = self.keep_copy(&delivery, &entry);
            let (outgoing, outcome) = match p {
                Plan::Keep => (Some(keep), Outcome::Kept),
                Plan::Purge if self.dry_run => (Some(keep), Outcome::Kept),
                Plan::Purge => (None, Outcome::Purged),
                Plan::Replay => match targets.next() {
                    Some(Ok(target)) if self.dry_run => {
                        (Some(keep), Outcome::WouldReplay { to: target.to() })
                    }
                    Some(Ok(target)) => {
                        let to = target.to();
                        (Some(target.outgoing()), Outcome::Replayed { to })
                    }
                    Some(Err(error)) => (Some(keep), Outcome::Failed { error }),
                    None => (Some(keep), Outcome::Kept),
                },
            };
            if let Some(o) = outgoing {
                first.push(o);
            }
            pending.push((delivery, entry, outcome));
        }
        let results = publisher.publish_all(first).await;
        // No confirm at all (a broker alarm blocks publishing): stop before the next
        // chunk waits too; nothing of this chunk is acknowledged, so all of it returns.
        if let Some(Err(e)) = results.iter().find(|r| {
            matches!(
                r,
                Err(BrokerError::ConfirmTimeout { .. } | BrokerError::Blocked { .. })
            )
        }) {
            return Err(ParkedError::Stalled(e.to_string()));
        }
        let mut results = results.into_iter();
        let mut items = Vec::with_capacity(pending.len());
        let mut retry = Vec::new();
        for (delivery, entry, outcome) in pending {
            let result = match outcome {
                Outcome::Purged => Ok(()),
                _ => results.next().unwrap_or(Err(BrokerError::ConnectionLost)),
            };
            match (result, outcome) {
                (Ok(()), outcome) => {
                    ack(&delivery).await?;
                    items.push(item(delivery, entry, outcome));
                }
                // The destination did not confirm: keep it parked, saying why.
                (Err(e), Outcome::Replayed { to }) => {
                    let error = format!("not replayed to {to}: {e}");
                    retry.push((self.keep_copy(&delivery, &entry), delivery, entry, error));
                }
                (Err(e), outcome) => {
                    // Not acknowledged: it returns to the queue when the pass ends.
                    let outcome = match outcome {
                        Outcome::Failed { error } => Outcome::Failed { error },
                        _ => Outcome::Failed {
                            error: format!("left in parked: {e}"),
                        },
                    };
                    items.push(item(delivery, entry, outcome));
                }
            }
        }
        let (copies, rest): (Vec<Outgoing>, Vec<_>) = retry
            .into_iter()
            .map(|(copy, d, e, error)| (copy, (d, e, error)))
            .unzip();
        let results = publisher.publish_all(copies).await;
        for ((delivery, entry, error), result) in rest.into_iter().zip(results) {
            if result.is_ok() {
                ack(&delivery).await?;
            }
            items.push(item(delivery, entry, Outcome::Failed { error }));
        }
        Ok(items)
    }

    /// The copy that keeps a message parked.
    fn keep_copy(&self, delivery: &Delivery, entry: &Entry) -> Outgoing {
        Outgoing::new(
            self.names.parked(),
            delivery.routing_key.to_string(),
            delivery.data.clone(),
            entry::kept_properties(&delivery.properties, entry),
        )
    }
}

fn item(delivery: Delivery, entry: Entry, outcome: Outcome) -> Item {
    Item {
        entry,
        outcome,
        properties: delivery.properties,
        body: delivery.data,
    }
}

fn resource_locked(err: &lapin::Error) -> bool {
    matches!(
        err.kind(),
        ErrorKind::ProtocolError(e)
            if matches!(e.kind(), AMQPErrorKind::Soft(AMQPSoftError::RESOURCELOCKED))
    )
}

//! What the broker says about one queue: a passive `queue.declare`, which answers
//! with the queue's ready messages and consumers, or 404 when it does not exist.
//!
//! A 404 closes the channel it ran on (never the connection). [`queue_state`] therefore
//! asks on a throwaway channel of its own; [`passive_declare`] asks on the caller's
//! channel, for a caller that goes on using that channel when the queue exists (a
//! consumer's own channel, a reader that takes messages next).

use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

use super::{BrokerError, not_found};

/// The counts of a queue that exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueCounts {
    /// Ready messages (not those delivered and unacknowledged).
    pub messages: u32,
    pub consumers: u32,
}

/// The broker's answer to a passive declare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueState {
    Exists(QueueCounts),
    /// 404: no such queue. The channel the declare ran on is closed.
    Missing,
}

impl QueueState {
    pub fn counts(self) -> Option<QueueCounts> {
        match self {
            Self::Exists(counts) => Some(counts),
            Self::Missing => None,
        }
    }

    /// The counts, or [`BrokerError::QueueNotFound`] naming `queue`.
    pub fn existing(self, queue: &str) -> Result<QueueCounts, BrokerError> {
        self.counts().ok_or_else(|| BrokerError::QueueNotFound {
            queue: queue.to_string(),
        })
    }
}

/// Opens a channel on `conn` (not bounded: see [`open_channel_within`]).
pub async fn open_channel(conn: &Connection) -> Result<Channel, BrokerError> {
    conn.create_channel()
        .await
        .map_err(BrokerError::amqp("channel.open"))
}

/// A passive declare of `queue` on `channel`. After [`QueueState::Missing`] the
/// broker has closed `channel`; any other failure is an error.
pub async fn passive_declare(channel: &Channel, queue: &str) -> Result<QueueState, BrokerError> {
    let options = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await
    {
        Ok(q) => Ok(QueueState::Exists(QueueCounts {
            messages: q.message_count(),
            consumers: q.consumer_count(),
        })),
        Err(e) if not_found(&e) => Ok(QueueState::Missing),
        Err(e) => Err(BrokerError::amqp("queue.declare")(e)),
    }
}

/// A passive declare of `queue` on a channel of its own, closed afterwards: a
/// missing queue costs that channel only. Not bounded (callers bound it, e.g. with
/// [`queue_state_within`]), except the closing of the channel (2 s).
pub async fn queue_state(conn: &Connection, queue: &str) -> Result<QueueState, BrokerError> {
    let channel = open_channel(conn).await?;
    let state = passive_declare(&channel, queue).await?;
    close_channel_quietly(&channel, "asked").await;
    Ok(state)
}

/// Whether `exchange` exists: a passive declare on a channel of its own (a 404 closes
/// only that channel), waiting at most `after` for each reply.
pub async fn exchange_exists_within(
    conn: &Connection,
    exchange: &str,
    after: Duration,
) -> Result<bool, BrokerError> {
    let channel = open_channel_within(conn, after).await?;
    let options = lapin::options::ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let declared = channel.exchange_declare(
        exchange.into(),
        lapin::ExchangeKind::Direct,
        options,
        FieldTable::default(),
    );
    let exists = match super::replied(after, "exchange.declare", declared).await? {
        Ok(()) => true,
        Err(e) if not_found(&e) => false,
        Err(e) => return Err(BrokerError::amqp("exchange.declare")(e)),
    };
    close_channel_quietly(&channel, "asked").await;
    Ok(exists)
}

/// [`queue_state`] waiting at most `after` for each of the broker's replies
/// ([`BrokerError::ReplyTimeout`] naming the step).
pub async fn queue_state_within(
    conn: &Connection,
    queue: &str,
    after: Duration,
) -> Result<QueueState, BrokerError> {
    let channel = open_channel_within(conn, after).await?;
    let state = super::within(after, "queue.declare", passive_declare(&channel, queue)).await?;
    close_channel_quietly(&channel, "asked").await;
    Ok(state)
}

/// Opens a channel on `conn`, waiting at most `after` for the broker's reply.
pub async fn open_channel_within(
    conn: &Connection,
    after: Duration,
) -> Result<Channel, BrokerError> {
    super::within(after, "channel.open", open_channel(conn)).await
}

/// Closes a channel that is still open, waiting at most 2 s (a broker gone silent
/// never answers `channel.close`; its unacknowledged deliveries return to their queue
/// when the connection goes).
pub async fn close_channel_quietly(channel: &Channel, reason: &str) {
    if channel.status().connected() {
        let close = channel.close(200, reason.into());
        let _ = tokio::time::timeout(Duration::from_secs(2), close).await;
    }
}

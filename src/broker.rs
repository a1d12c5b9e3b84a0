//! The AMQP side: connecting, converting topology arguments to field tables,
//! reading the broker's error replies, and publishing with confirms.
//!
//! Invariant: a publish counts only once the broker confirmed it (`ack`); a nack, a
//! `reject-publish` overflow or a lost channel is an error the caller retries.

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ErrorKind};

use crate::config::Secret;
use crate::topology::{ArgValue, Arguments};

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("cannot connect to the broker: {0}")]
    Connect(#[source] lapin::Error),
    #[error("broker operation `{op}` failed: {source}")]
    Amqp {
        op: &'static str,
        #[source]
        source: lapin::Error,
    },
    #[error("the broker cancelled the consumer (queue deleted?)")]
    ConsumerEnded,
    #[error("the broker connection was lost")]
    ConnectionLost,
    #[error("the broker refused the publish to `{exchange}` (routing key `{routing_key}`): nack")]
    Nacked {
        exchange: String,
        routing_key: String,
    },
}

impl BrokerError {
    pub fn amqp(op: &'static str) -> impl FnOnce(lapin::Error) -> Self {
        move |source| Self::Amqp { op, source }
    }
}

impl crate::backoff::SessionError for BrokerError {
    /// The broker refused the credentials, the virtual host or a permission: every
    /// reconnect would be refused the same way, so it is a configuration error.
    fn is_fatal(&self) -> bool {
        let error = match self {
            Self::Connect(e) | Self::Amqp { source: e, .. } => e,
            _ => return false,
        };
        let ErrorKind::ProtocolError(e) = error.kind() else {
            return false;
        };
        matches!(
            e.kind(),
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
                | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
        )
    }
}

/// Opens a connection named `name` (shown in the management UI).
pub async fn connect(url: &Secret, name: &str) -> Result<Connection, BrokerError> {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    Connection::connect(url.expose(), properties)
        .await
        .map_err(BrokerError::Connect)
}

/// Like [`connect`], retrying with back-off until `give_up` has passed.
pub async fn connect_with_retry(
    url: &Secret,
    name: &str,
    give_up: Duration,
) -> Result<Connection, BrokerError> {
    let started = std::time::Instant::now();
    let mut delay = Duration::from_millis(100);
    loop {
        match connect(url, name).await {
            Ok(conn) => return Ok(conn),
            Err(e) if started.elapsed() < give_up => {
                tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "broker connection failed");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e),
        }
    }
}

pub fn field_table(args: &Arguments) -> FieldTable {
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

fn soft_error(err: &lapin::Error) -> Option<(AMQPSoftError, String)> {
    match err.kind() {
        ErrorKind::ProtocolError(e) => match e.kind() {
            AMQPErrorKind::Soft(soft) => Some((soft.clone(), e.get_message().to_string())),
            AMQPErrorKind::Hard(_) => None,
        },
        _ => None,
    }
}

/// The broker's text when `err` is a 406 PRECONDITION_FAILED.
pub fn precondition_failed(err: &lapin::Error) -> Option<String> {
    soft_error(err)
        .filter(|(kind, _)| *kind == AMQPSoftError::PRECONDITIONFAILED)
        .map(|(_, text)| text)
}

/// True when `err` is a 404 NOT_FOUND (e.g. a passive declare of a missing queue).
pub fn not_found(err: &lapin::Error) -> bool {
    matches!(soft_error(err), Some((AMQPSoftError::NOTFOUND, _)))
}

/// A channel in confirm mode.
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
}

impl Publisher {
    pub async fn new(conn: &Connection) -> Result<Self, BrokerError> {
        let channel = conn
            .create_channel()
            .await
            .map_err(BrokerError::amqp("channel.open"))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(BrokerError::amqp("confirm.select"))?;
        Ok(Self { channel })
    }

    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    pub fn is_usable(&self) -> bool {
        self.channel.status().connected()
    }

    /// Publishes and waits for the broker's confirm.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), BrokerError> {
        let confirm = self
            .channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                body,
                properties,
            )
            .await
            .map_err(BrokerError::amqp("basic.publish"))?
            .await
            .map_err(BrokerError::amqp("confirm"))?;
        if confirm.is_nack() {
            return Err(BrokerError::Nacked {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
            });
        }
        Ok(())
    }

    /// Publishes many messages, pipelining their confirms; the result of each in order.
    pub async fn publish_all(
        &self,
        messages: Vec<(String, String, Vec<u8>, BasicProperties)>,
    ) -> Vec<Result<(), BrokerError>> {
        let mut pending = Vec::with_capacity(messages.len());
        for (exchange, routing_key, body, properties) in messages {
            let sent = self
                .channel
                .basic_publish(
                    exchange.as_str().into(),
                    routing_key.as_str().into(),
                    BasicPublishOptions::default(),
                    &body,
                    properties,
                )
                .await
                .map_err(BrokerError::amqp("basic.publish"));
            pending.push((exchange, routing_key, sent));
        }
        let mut results = Vec::with_capacity(pending.len());
        for (exchange, routing_key, sent) in pending {
            let result = match sent {
                Err(e) => Err(e),
                Ok(confirm) => match confirm.await {
                    Err(e) => Err(BrokerError::amqp("confirm")(e)),
                    Ok(c) if c.is_nack() => Err(BrokerError::Nacked {
                        exchange,
                        routing_key,
                    }),
                    Ok(_) => Ok(()),
                },
            };
            results.push(result);
        }
        results
    }
}

/// The virtual host named by an AMQP URL (`/` when the URL names none).
pub fn vhost(url: &Secret) -> String {
    use std::str::FromStr;
    lapin::uri::AMQPUri::from_str(url.expose())
        .map(|u| u.vhost)
        .unwrap_or_else(|_| "/".to_string())
}

/// Closes a connection at the end of a session without ever hanging on a connection
/// the broker already dropped.
pub async fn close_quietly(conn: &Connection, reason: &str) {
    if conn.status().connected() {
        let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, reason.into())).await;
    }
}

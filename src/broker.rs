//! The AMQP side: connecting, converting topology arguments to field tables,
//! reading the broker's error replies, and publishing with confirms.
//!
//! Invariant: a publish counts only once the broker confirmed it (`ack`) AND routed
//! it to a queue; a nack, a `reject-publish` overflow, a lost channel or a confirm
//! that does not arrive within `broker.confirm_timeout` is an error the caller
//! retries. Every publish is `mandatory`: when no queue is bound for it (a queue
//! deleted by an operator) the broker returns the message with the confirm, and the
//! publish is [`BrokerError::Unroutable`], never delivered. (An exchange with an
//! alternate exchange, like `<P>.delay`, routes such a message there instead.)
//! `amqps://` always means TLS with a verified server certificate (see [`crate::tls`]).

use std::future::Future;
use std::time::Duration;

use lapin::message::BasicReturnMessage;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties,
    DefaultConnectionBuilder, ErrorKind,
};
use tokio::time::Instant;

use crate::config::{BrokerConfig, Secret};
use crate::tls::{self, TlsError, TlsFiles};
use crate::topology::{ArgValue, Arguments};

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("cannot connect to the broker: {0}")]
    Connect(#[source] lapin::Error),
    #[error(
        "cannot connect to the broker: TLS certificate verification failed ({detail}); \
         if the broker's certificate is signed by a private CA, set broker.tls.ca_file"
    )]
    CertificateRejected { detail: String },
    #[error("no confirm from the broker within {after:?} (publishing blocked by a broker alarm?)")]
    ConfirmTimeout { after: Duration },
    #[error("the broker blocks publishing on this connection: {reason}")]
    Blocked { reason: String },
    #[error("publishing is unavailable: {reason}")]
    Unavailable { reason: String },
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
    #[error(
        "unroutable: no queue is bound to `{exchange}` for routing key `{routing_key}` (the broker returned the publish)"
    )]
    Unroutable {
        exchange: String,
        routing_key: String,
    },
    #[error(
        "unroutable: the wait queue `{queue}` does not exist, so a publish to its tier would land in parked; not published (`lapse topology apply` re-creates it)"
    )]
    MissingTier { queue: String },
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

/// The confirm timeout of a [`Publisher`] made with [`Publisher::new`].
pub const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(15);

/// How lapse reaches the broker: the URL, the TLS material for `amqps://` and the
/// confirm timeout of its publishers.
#[derive(Clone, Debug)]
pub struct Endpoint {
    pub url: Secret,
    pub tls: TlsFiles,
    pub confirm_timeout: Duration,
}

impl Endpoint {
    /// `url` with the system's root certificates and the default confirm timeout.
    pub fn new(url: Secret) -> Self {
        Self {
            url,
            tls: TlsFiles::default(),
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
        }
    }

    /// The `[broker]` section: URL, `tls.*` files (read now) and `confirm_timeout`.
    pub fn from_config(broker: &BrokerConfig) -> Result<Self, TlsError> {
        let t = &broker.tls;
        Ok(Self {
            url: broker.url.clone(),
            tls: TlsFiles::load(
                t.ca_file.as_deref(),
                t.cert_file.as_deref(),
                t.key_file.as_deref(),
            )?,
            confirm_timeout: broker.confirm_timeout,
        })
    }

    /// Opens a connection named `name` (shown in the management UI).
    pub async fn connect(&self, name: &str) -> Result<Connection, BrokerError> {
        let properties = ConnectionProperties::default().with_connection_name(name.into());
        DefaultConnectionBuilder::new()
            .map_err(BrokerError::Connect)?
            .with_uri_str(self.url.expose().to_string())
            .with_properties(properties)
            .with_tls_config(self.tls.amqp())
            .connect()
            .await
            .map_err(connect_error)
    }

    /// A confirm channel on `conn` that waits at most `confirm_timeout` per publish.
    pub async fn publisher(&self, conn: &Connection) -> Result<Publisher, BrokerError> {
        Ok(Publisher::new(conn)
            .await?
            .with_confirm_timeout(self.confirm_timeout))
    }
}

/// A rejected server certificate gets its own error, saying what to configure.
fn connect_error(err: lapin::Error) -> BrokerError {
    if let ErrorKind::IOError(io) = err.kind()
        && tls::is_certificate_error(io.as_ref())
    {
        return BrokerError::CertificateRejected {
            detail: io.to_string(),
        };
    }
    BrokerError::Connect(err)
}

/// Opens a connection named `name` to `url` (system roots for `amqps://`).
pub async fn connect(url: &Secret, name: &str) -> Result<Connection, BrokerError> {
    Endpoint::new(url.clone()).connect(name).await
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

/// Waits for one step of a publish — handing its frames to the connection, or the
/// broker's confirm — until `deadline`. A publish not confirmed by then counts as not
/// delivered; the caller retries it, on a fresh channel (this one's state is unknown:
/// the frames may still go out later, which at worst makes a duplicate).
async fn by_deadline<T>(
    deadline: Instant,
    after: Duration,
    op: &'static str,
    step: impl Future<Output = lapin::Result<T>>,
) -> Result<T, BrokerError> {
    match tokio::time::timeout_at(deadline, step).await {
        Ok(result) => result.map_err(BrokerError::amqp(op)),
        Err(_) => Err(BrokerError::ConfirmTimeout { after }),
    }
}

/// A channel in confirm mode.
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
    confirm_timeout: Duration,
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
        Ok(Self {
            channel,
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
        })
    }

    /// How long each publish may wait for its confirm (`broker.confirm_timeout`).
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    pub fn is_usable(&self) -> bool {
        self.channel.status().connected()
    }

    /// Publishes (mandatory) and waits (at most the confirm timeout) for the broker's
    /// confirm.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), BrokerError> {
        let deadline = Instant::now() + self.confirm_timeout;
        let sent = self.channel.basic_publish(
            exchange.into(),
            routing_key.into(),
            MANDATORY,
            body,
            properties,
        );
        let sent = by_deadline(deadline, self.confirm_timeout, "basic.publish", sent).await?;
        let confirm = by_deadline(deadline, self.confirm_timeout, "confirm", sent).await?;
        let (result, returned) = outcome(exchange, routing_key, confirm);
        match returned {
            Some(_) => Err(BrokerError::Unroutable {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
            }),
            None => result,
        }
    }

    /// Publishes many messages (mandatory), pipelining their confirms; the result of
    /// each in order. All of them share one confirm timeout, counted from the call.
    pub async fn publish_all(
        &self,
        messages: Vec<(String, String, Vec<u8>, BasicProperties)>,
    ) -> Vec<Result<(), BrokerError>> {
        let (after, deadline) = (self.confirm_timeout, Instant::now() + self.confirm_timeout);
        let mut pending = Vec::with_capacity(messages.len());
        for (exchange, routing_key, body, properties) in messages {
            if Instant::now() >= deadline {
                // Out of time: do not hand more frames to a connection that is stuck.
                pending.push((
                    exchange,
                    routing_key,
                    body,
                    Err(BrokerError::ConfirmTimeout { after }),
                ));
                continue;
            }
            let sent = self.channel.basic_publish(
                exchange.as_str().into(),
                routing_key.as_str().into(),
                MANDATORY,
                &body,
                properties,
            );
            let sent = by_deadline(deadline, after, "basic.publish", sent).await;
            pending.push((exchange, routing_key, body, sent));
        }
        let mut results = Vec::with_capacity(pending.len());
        let mut returned = Vec::new();
        let mut sent = Vec::with_capacity(pending.len());
        for (exchange, routing_key, body, confirm) in pending {
            let result = match confirm {
                Err(e) => Err(e),
                Ok(confirm) => match by_deadline(deadline, after, "confirm", confirm).await {
                    Err(e) => Err(e),
                    Ok(c) => {
                        let (result, message) = outcome(&exchange, &routing_key, c);
                        returned.extend(message);
                        result
                    }
                },
            };
            results.push(result);
            sent.push((exchange, routing_key, body));
        }
        attribute_returns(&sent, &mut results, returned);
        results
    }
}

/// Every publish asks the broker to return what it cannot route.
const MANDATORY: BasicPublishOptions = BasicPublishOptions {
    mandatory: true,
    immediate: false,
};

/// A confirm's verdict, and the message the broker returned with it, if any.
fn outcome(
    exchange: &str,
    routing_key: &str,
    confirm: Confirmation,
) -> (Result<(), BrokerError>, Option<BasicReturnMessage>) {
    let result = if confirm.is_nack() {
        Err(BrokerError::Nacked {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        })
    } else {
        Ok(())
    };
    (result, confirm.take_message())
}

/// Marks as unroutable the publish each returned message came from. lapin hands a
/// return to whichever confirm of a multiple-ack completes first, which need not be
/// the returned publish's own, so the match is by content: exchange, routing key and
/// body (identical publishes are interchangeable).
fn attribute_returns(
    sent: &[(String, String, Vec<u8>)],
    results: &mut [Result<(), BrokerError>],
    returned: Vec<BasicReturnMessage>,
) {
    for message in returned {
        let d = &message.delivery;
        let matching = sent.iter().zip(results.iter()).position(|((e, k, b), r)| {
            !matches!(r, Err(BrokerError::Unroutable { .. }))
                && d.exchange.as_str() == e
                && d.routing_key.as_str() == k
                && d.data == *b
        });
        match matching {
            Some(i) => {
                results[i] = Err(BrokerError::Unroutable {
                    exchange: sent[i].0.clone(),
                    routing_key: sent[i].1.clone(),
                })
            }
            None => tracing::error!(
                exchange = %d.exchange,
                routing_key = %d.routing_key,
                "the broker returned a publish that matches none just sent"
            ),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::message::Delivery;

    fn returned(exchange: &str, key: &str, body: &[u8]) -> BasicReturnMessage {
        BasicReturnMessage {
            delivery: Delivery::mock(0, exchange.into(), key.into(), false, body.to_vec()),
            reply_code: 312,
            reply_text: "NO_ROUTE".into(),
        }
    }

    fn sent(exchange: &str, key: &str, body: &[u8]) -> (String, String, Vec<u8>) {
        (exchange.into(), key.into(), body.to_vec())
    }

    #[test]
    fn a_return_marks_the_publish_it_came_from_whichever_confirm_carried_it() {
        let published = [
            sent("p.events", "stock.release", b"a"),
            sent("p.due", "due", b"b"),
            sent("p.events", "stock.release", b"c"),
            sent("p.events", "stock.release", b"c"),
        ];
        let mut results: Vec<Result<(), BrokerError>> = (0..4).map(|_| Ok(())).collect();
        results[1] = Err(BrokerError::Nacked {
            exchange: "p.due".into(),
            routing_key: "due".into(),
        });
        let returns = vec![
            returned("p.events", "stock.release", b"c"),
            returned("p.events", "stock.release", b"c"),
        ];
        attribute_returns(&published, &mut results, returns);
        assert!(results[0].is_ok());
        assert!(matches!(results[1], Err(BrokerError::Nacked { .. })));
        for r in &results[2..] {
            assert!(
                matches!(r, Err(BrokerError::Unroutable { exchange, routing_key })
                    if exchange == "p.events" && routing_key == "stock.release"),
                "{r:?}"
            );
        }
    }

    #[test]
    fn a_return_that_matches_nothing_changes_nothing() {
        let published = [sent("p.events", "stock.release", b"a")];
        let mut results = vec![Ok(())];
        attribute_returns(
            &published,
            &mut results,
            vec![returned("p.events", "stock.release", b"other")],
        );
        assert!(results[0].is_ok());
    }
}

//! The AMQP side: connecting, reading the broker's error replies, and publishing with
//! confirms. It knows nothing of lapse's configuration or topology: callers hand it
//! plain values (a URL, TLS material, a timeout, field tables).
//!
//! Invariant: a publish counts only once the broker confirmed it (`ack`) AND routed
//! it to a queue; a nack, a `reject-publish` overflow, a lost channel or a confirm
//! that does not arrive within `broker.confirm_timeout` is an error the caller
//! retries. Every publish is `mandatory`: when no queue is bound for it (a queue
//! deleted by an operator) the broker returns the message with the confirm, and the
//! publish is [`BrokerError::Unroutable`], never delivered. (An exchange with an
//! alternate exchange, like `<P>.delay`, routes such a message there instead.)
//! `amqps://` always means TLS with a verified server certificate (see [`crate::tls`]).

use std::time::Duration;

use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::{Connection, ConnectionProperties, DefaultConnectionBuilder, ErrorKind};

mod addresses;
mod publisher;
mod queue;

pub use publisher::{Outgoing, Publisher};
pub use queue::{
    QueueCounts, QueueState, close_channel_quietly, exchange_exists_within, open_channel,
    open_channel_within, passive_declare, queue_state, queue_state_within,
};

use crate::config::split_addresses;
use crate::redact::Secret;
use crate::tls::{self, TlsFiles};

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("cannot connect to the broker: {0}")]
    Connect(#[source] lapin::Error),
    #[error(
        "cannot connect to the broker: TLS certificate verification failed ({detail}); \
         if the broker's certificate is signed by a private CA, set broker.tls.ca_file"
    )]
    CertificateRejected { detail: String },
    #[error(
        "the broker accepted the TCP connection but did not finish the AMQP handshake within {after:?} (a node still starting or stopping?)"
    )]
    ConnectTimeout { after: Duration },
    #[error("no confirm from the broker within {after:?} (publishing blocked by a broker alarm?)")]
    ConfirmTimeout { after: Duration },
    #[error(
        "no reply to `{op}` from the broker within {after:?} (the queue's leader moving, the node overloaded or gone silent?)"
    )]
    ReplyTimeout { op: &'static str, after: Duration },
    #[error(
        "an acknowledgement was not handed to the connection within {after:?} (the connection died as it was queued?)"
    )]
    AckTimeout { after: Duration },
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
    #[error(
        "the consumer of `{queue}` received nothing for two idle checks while the queue held {ready} ready messages; attaching again"
    )]
    ConsumerSilent { queue: String, ready: u32 },
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
    #[error(
        "the exchange `{exchange}` does not exist: the event waits in the outbox until the shop declares it"
    )]
    MissingExchange { exchange: String },
    #[error("the queue `{queue}` does not exist (`lapse topology apply` creates it)")]
    QueueNotFound { queue: String },
}

impl BrokerError {
    pub fn amqp(op: &'static str) -> impl FnOnce(lapin::Error) -> Self {
        move |source| Self::Amqp { op, source }
    }
}

/// Waits for a broker reply for at most `after`: a method the broker never answers
/// (a channel stuck behind a quorum queue whose leader died) must end the session
/// rather than stall it.
pub async fn within<T>(
    after: Duration,
    op: &'static str,
    reply: impl std::future::Future<Output = Result<T, BrokerError>>,
) -> Result<T, BrokerError> {
    tokio::time::timeout(after, reply)
        .await
        .unwrap_or(Err(BrokerError::ReplyTimeout { op, after }))
}

/// Like [`within`] for a lapin call whose own error the caller reads (a 404, a 406, a
/// locked queue): the broker's answer as lapin gave it, or
/// [`BrokerError::ReplyTimeout`] when none came within `after`.
pub async fn replied<T>(
    after: Duration,
    op: &'static str,
    reply: impl std::future::Future<Output = lapin::Result<T>>,
) -> Result<lapin::Result<T>, BrokerError> {
    tokio::time::timeout(after, reply)
        .await
        .map_err(|_| BrokerError::ReplyTimeout { op, after })
}

impl crate::runtime::backoff::SessionError for BrokerError {
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

/// How long one connection attempt to one address may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The confirm timeout of a [`Publisher`] made with [`Publisher::new`].
pub const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(15);

/// How lapse reaches the broker: the URL (one address or several, comma-separated),
/// the TLS material for `amqps://` and the confirm timeout of its publishers.
/// Clones share which address worked last (see `broker::addresses`).
#[derive(Clone, Debug)]
pub struct Endpoint {
    pub url: Secret,
    pub tls: TlsFiles,
    pub confirm_timeout: Duration,
    /// The longest a consumer keeps a delivery unacknowledged (half the broker's
    /// consumer timeout): past it the delivery is replaced by a fresh copy.
    pub hold_limit: Duration,
    cursor: addresses::Cursor,
}

impl Endpoint {
    /// `url` with the system's root certificates and the default confirm timeout.
    pub fn new(url: Secret) -> Self {
        Self {
            url,
            tls: TlsFiles::default(),
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
            hold_limit: crate::config::DEFAULT_CONSUMER_TIMEOUT / 2,
            cursor: addresses::Cursor::default(),
        }
    }

    /// The same endpoint with another `url` (e.g. with a heartbeat added).
    pub fn with_url(self, url: Secret) -> Self {
        Self { url, ..self }
    }

    /// Opens a connection named `name` (shown in the management UI) to the first
    /// address that answers, starting at the one that worked last; the error of the
    /// last address tried when none does.
    pub async fn connect(&self, name: &str) -> Result<Connection, BrokerError> {
        let all = split_addresses(&self.url);
        let mut last = None;
        for index in self.cursor.order(all.len()) {
            // Bounded: a node that is booting or shutting down can accept the TCP
            // connection and never answer the handshake.
            let attempt = tokio::time::timeout(CONNECT_TIMEOUT, self.connect_to(&all[index], name));
            let result = attempt.await.unwrap_or(Err(BrokerError::ConnectTimeout {
                after: CONNECT_TIMEOUT,
            }));
            match result {
                Ok(conn) => {
                    self.cursor.worked(index);
                    return Ok(conn);
                }
                Err(e) => {
                    if all.len() > 1 {
                        tracing::warn!(address = %shown_address(&all[index]), error = %e, "broker node did not accept a connection; trying the next");
                    }
                    if crate::runtime::backoff::SessionError::is_fatal(&e) {
                        return Err(e);
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or(BrokerError::ConnectionLost))
    }

    async fn connect_to(&self, url: &Secret, name: &str) -> Result<Connection, BrokerError> {
        let properties = ConnectionProperties::default().with_connection_name(name.into());
        DefaultConnectionBuilder::new()
            .map_err(BrokerError::Connect)?
            .with_uri_str(url.expose().to_string())
            .with_properties(properties)
            .with_tls_config(self.tls.amqp())
            .connect()
            .await
            .map_err(connect_error)
    }

    /// A confirm channel on `conn` that waits at most `confirm_timeout` per publish.
    /// Opening it waits at most `confirm_timeout` too: a connection whose node is
    /// stopping, or that a broker alarm blocks, can leave `channel.open` or
    /// `confirm.select` unanswered, and the caller must end its session rather than
    /// stall in it.
    pub async fn publisher(&self, conn: &Connection) -> Result<Publisher, BrokerError> {
        let after = self.confirm_timeout;
        let channel = open_channel_within(conn, after).await?;
        let publisher = within(after, "confirm.select", Publisher::on(channel)).await?;
        Ok(publisher.with_confirm_timeout(after))
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

/// The virtual host named by an AMQP URL (`/` when the URL names none); of the first
/// address when `url` names several (validation makes them agree).
pub fn vhost(url: &Secret) -> String {
    use std::str::FromStr;
    let first = split_addresses(url).swap_remove(0);
    lapin::uri::AMQPUri::from_str(first.expose())
        .map(|u| u.vhost)
        .unwrap_or_else(|_| "/".to_string())
}

/// `host:port` of an AMQP URL, without credentials, for messages (`h1:p1, h2:p2`
/// when `url` names several addresses).
pub fn shown_address(url: &Secret) -> String {
    use std::str::FromStr;
    split_addresses(url)
        .iter()
        .map(|a| match lapin::uri::AMQPUri::from_str(a.expose()) {
            Ok(u) => format!("{}:{}", u.authority.host, u.authority.port),
            Err(_) => "(broker.url)".to_string(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Closes a connection at the end of a session without ever hanging on a connection
/// the broker already dropped.
pub async fn close_quietly(conn: &Connection, reason: &str) {
    if conn.status().connected() {
        let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, reason.into())).await;
    }
}

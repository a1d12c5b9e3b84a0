//! The publishing side of a consuming component (the worker's consumer, the stock
//! releaser): a broker connection of its own, separate from the one that consumes
//! and acknowledges.
//!
//! Why separate: a broker memory or disk alarm blocks every connection that
//! publishes, and a blocked connection carries nothing at all — acknowledgements
//! included. With publishing on its own connection, deliveries that need no publish
//! (due orders closed) are still acknowledged during an alarm.
//!
//! Invariants: a publish is never waited on for longer than `broker.confirm_timeout`;
//! after a timeout or a channel error the confirm channel is replaced before the next
//! publish; while the broker says the connection is blocked, publishes fail at once
//! (the caller keeps its deliveries and retries later) instead of piling up; a lost
//! connection is reopened on the next publish. Blocked and unblocked notices are
//! logged and shown on `/health`.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::{Connection, Event};
use tokio::task::JoinHandle;

pub use crate::amqp::broker::Outgoing;
use crate::amqp::broker::{self, BrokerError, Endpoint, Publisher};
use crate::amqp::tier_check::TierCheck;
use crate::message::parked_properties;
use crate::runtime::health::Health;
use crate::tier::Tier;

/// The copy of `delivery` that parks it on `parked_exchange` with `reason` (every
/// component parks this way).
pub fn parked_copy(
    parked_exchange: String,
    delivery: &Delivery,
    cause: &str,
    reason: &str,
) -> Outgoing {
    Outgoing::new(
        parked_exchange,
        String::new(),
        delivery.data.clone(),
        parked_properties(&delivery.properties, cause, reason),
    )
}

/// Follows a connection's blocked/unblocked notices: logs them, shows them on
/// `/health` and remembers the broker's reason. Stops when dropped, and then clears
/// the block it showed: the connection it watched is gone (a replacement starts
/// unblocked and would never hear an "unblocked" for the old one).
pub struct BlockedWatch {
    task: JoinHandle<()>,
    reason: Arc<Mutex<Option<String>>>,
    health: Health,
    component: &'static str,
}

impl BlockedWatch {
    pub fn start(conn: &Connection, name: &str, component: &'static str, health: &Health) -> Self {
        let reason = Arc::new(Mutex::new(None));
        let mut events = conn.events_listener();
        let (name, watcher, shared) = (name.to_string(), health.clone(), reason.clone());
        let task = tokio::spawn(async move {
            while let Some(event) = events.next().await {
                let now = match event {
                    Event::ConnectionBlocked(why) => {
                        tracing::warn!(connection = %name, reason = %why, "the broker blocks publishing on this connection (resource alarm)");
                        Some(why)
                    }
                    Event::ConnectionUnblocked => {
                        tracing::info!(connection = %name, "the broker unblocked publishing");
                        None
                    }
                    _ => continue,
                };
                if let Ok(mut r) = shared.lock() {
                    r.clone_from(&now);
                }
                watcher.blocked(component, now);
            }
        });
        Self {
            task,
            reason,
            health: health.clone(),
            component,
        }
    }

    /// The broker's reason for the current block, if it gave one.
    pub fn reason(&self) -> Option<String> {
        self.reason.lock().ok().and_then(|r| r.clone())
    }
}

impl Drop for BlockedWatch {
    fn drop(&mut self) {
        self.task.abort();
        self.health.blocked(self.component, None);
    }
}

/// A publishing connection with a replaceable confirm channel.
pub struct PublishingConnection {
    endpoint: Endpoint,
    name: String,
    component: &'static str,
    health: Health,
    conn: Connection,
    /// Set when the connection did not answer the opening of a confirm channel: it is
    /// replaced before the next publish (it may stay open and silent for a long time).
    silent: bool,
    publisher: Option<Publisher>,
    watch: BlockedWatch,
}

impl PublishingConnection {
    /// Connects as `name` and opens a confirm channel (each step has its bound: see
    /// [`Endpoint::connect`] and [`Endpoint::publisher`]).
    pub async fn open(
        endpoint: &Endpoint,
        name: &str,
        component: &'static str,
        health: &Health,
    ) -> Result<Self, BrokerError> {
        let conn = endpoint.connect(name).await?;
        let watch = BlockedWatch::start(&conn, name, component, health);
        let publisher = match endpoint.publisher(&conn).await {
            Ok(p) => Some(p),
            Err(e) => {
                broker::close_quietly(&conn, "confirm channel failed to open").await;
                return Err(e);
            }
        };
        Ok(Self {
            endpoint: endpoint.clone(),
            name: name.to_string(),
            component,
            health: health.clone(),
            conn,
            silent: false,
            publisher,
            watch,
        })
    }

    /// True while the broker blocks this connection.
    pub fn blocked(&self) -> bool {
        self.conn.status().blocked()
    }

    /// Publishes `messages` with confirms; the result of each, in order. Fails all of
    /// them at once, without waiting, when the connection is blocked or cannot be
    /// (re)opened.
    pub async fn publish_all(&mut self, messages: Vec<Outgoing>) -> Vec<Result<(), BrokerError>> {
        if messages.is_empty() {
            return Vec::new();
        }
        let publisher = match self.ready().await {
            Ok(p) => p,
            Err(e) => {
                let text = e.to_string();
                let mut results = vec![Err(e)];
                results.extend((1..messages.len()).map(|_| {
                    Err(BrokerError::Unavailable {
                        reason: text.clone(),
                    })
                }));
                return results;
            }
        };
        let results = publisher.publish_all(messages).await;
        if results.iter().any(|r| {
            matches!(
                r,
                Err(BrokerError::ConfirmTimeout { .. } | BrokerError::Amqp { .. })
            )
        }) {
            // The channel's state is unknown (frames may be stuck behind a block): use a
            // fresh one next time.
            self.publisher = None;
        }
        results
    }

    /// Publishes one message (see [`Self::publish_all`]).
    pub async fn publish(&mut self, message: Outgoing) -> Result<(), BrokerError> {
        self.publish_all(vec![message])
            .await
            .pop()
            .unwrap_or(Err(BrokerError::ConnectionLost))
    }

    /// The tiers among `tiers` whose wait queue does not exist (see [`TierCheck`]),
    /// asked on this connection. Fails at once, like a publish, when the connection is
    /// blocked or cannot be (re)opened.
    pub async fn missing_tiers(
        &mut self,
        check: &TierCheck,
        tiers: impl IntoIterator<Item = Tier>,
    ) -> Result<BTreeSet<Tier>, BrokerError> {
        self.ready().await?;
        check.missing(&self.conn, tiers).await
    }

    /// A usable confirm channel: reconnects and reopens as needed, each step bounded
    /// by the confirm timeout; refuses at once while the broker blocks publishing. A
    /// connection that left the opening of a confirm channel unanswered is replaced.
    async fn ready(&mut self) -> Result<Publisher, BrokerError> {
        if self.silent || !self.conn.status().connected() {
            self.publisher = None;
            let conn = bounded(&self.endpoint, self.endpoint.connect(&self.name)).await?;
            self.watch = BlockedWatch::start(&conn, &self.name, self.component, &self.health);
            self.health.blocked(self.component, None);
            self.conn = conn;
            self.silent = false;
        }
        if self.blocked() {
            return Err(BrokerError::Blocked {
                reason: self
                    .watch
                    .reason()
                    .unwrap_or_else(|| "resource alarm".into()),
            });
        }
        match &self.publisher {
            Some(p) if p.is_usable() => Ok(p.clone()),
            _ => {
                let p =
                    self.endpoint.publisher(&self.conn).await.inspect_err(|e| {
                        self.silent = matches!(e, BrokerError::ReplyTimeout { .. })
                    })?;
                self.publisher = Some(p.clone());
                Ok(p)
            }
        }
    }

    pub async fn close(self) {
        self.health.blocked(self.component, None);
        broker::close_quietly(&self.conn, "publisher stopping").await;
    }
}

/// Runs a reconnect for at most the confirm timeout: each address has its own bound,
/// and this one caps them together so a publish never waits through every address.
async fn bounded<T>(
    endpoint: &Endpoint,
    step: impl Future<Output = Result<T, BrokerError>>,
) -> Result<T, BrokerError> {
    let after = endpoint.confirm_timeout;
    tokio::time::timeout(after, step)
        .await
        .unwrap_or(Err(BrokerError::ConfirmTimeout { after }))
}

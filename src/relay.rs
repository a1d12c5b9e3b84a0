//! The outbox relay: moves outbox rows to the broker with publisher confirms and
//! deletes a row only after its confirm.
//!
//! Timeout intents go to the tier chosen from the database clock (or straight to the
//! due queue when shorter than the smallest tier), allowing as slack only the lag
//! since the intent was written; stock-release events go to
//! `<P>.events`. Several relays may run at once: each round locks its rows with
//! `FOR UPDATE SKIP LOCKED`. Woken by `NOTIFY lapse_outbox`, with a polling fallback.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use deadpool_postgres::Pool;
use futures_util::StreamExt;
use lapin::BasicProperties;
use lapin::types::ShortString;
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::broker::{self, BrokerError, Endpoint, Publisher};
use crate::config::{Config, Secret};
use crate::db::{self, DbError};
use crate::health::Health;
use crate::message::{Route, TimeoutMessage, parked_properties};
use crate::publishing::BlockedWatch;
use crate::stats::{Outcome, Stats};
use crate::tier::TierSet;
use crate::topology::{Names, STOCK_RELEASE_ROUTING_KEY};

/// The channel the outbox trigger notifies.
pub const OUTBOX_CHANNEL: &str = "lapse_outbox";

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

impl From<tokio_postgres::Error> for RelayError {
    fn from(e: tokio_postgres::Error) -> Self {
        Self::Db(e.into())
    }
}

impl From<deadpool_postgres::PoolError> for RelayError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        Self::Db(e.into())
    }
}

/// What one round did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelayOutcome {
    /// Nothing to publish.
    Idle,
    /// Rows published and deleted; `refused` rows were nacked and stay for later.
    Published { sent: usize, refused: usize },
}

#[derive(Clone)]
pub struct Relay {
    pub pool: Pool,
    pub names: Names,
    pub tiers: TierSet,
    pub tolerance: Duration,
    pub batch_size: i64,
    pub stats: Stats,
}

struct Outgoing {
    outbox_id: i64,
    order_id: i64,
    exchange: String,
    routing_key: String,
    body: Vec<u8>,
    properties: BasicProperties,
    hop: Option<Value>,
}

impl Relay {
    pub fn new(config: &Config, pool: Pool, tiers: TierSet, stats: Stats) -> Self {
        Self {
            pool,
            names: config.names(),
            tiers,
            tolerance: config.worker.tier_tolerance,
            batch_size: config.relay.batch_size,
            stats,
        }
    }

    /// How much longer than the remaining time a first hop's tier may be: the time
    /// the relay itself took since the intent's transaction began (plus 1 ms for the
    /// deadline's truncation to milliseconds), capped by `worker.tier_tolerance`. A
    /// deadline equal to a tier then takes one hop, and the tier choice adds no more
    /// lateness than the relay's own lag.
    fn slack(&self, lag: Duration) -> Duration {
        (lag + Duration::from_millis(1)).min(self.tolerance)
    }

    /// One round: lock a batch, publish it with confirms, delete what was confirmed.
    pub async fn run_once(&self, publisher: &Publisher) -> Result<RelayOutcome, RelayError> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let rows = tx
            .query(
                "SELECT id, kind, order_id, payload, now(), created_at FROM outbox
                  ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
                &[&self.batch_size],
            )
            .await?;
        if rows.is_empty() {
            return Ok(RelayOutcome::Idle);
        }
        let outgoing: Vec<Outgoing> = rows
            .iter()
            .map(|r| {
                let (db_now, written): (DateTime<Utc>, DateTime<Utc>) = (r.get(4), r.get(5));
                let lag = (db_now - written).to_std().unwrap_or_default();
                self.outgoing(r.get(0), r.get(1), r.get(2), r.get(3), db_now, lag)
            })
            .collect();
        let messages = outgoing
            .iter()
            .map(|o| {
                (
                    o.exchange.clone(),
                    o.routing_key.clone(),
                    o.body.clone(),
                    o.properties.clone(),
                )
            })
            .collect();
        let results = publisher.publish_all(messages).await;
        let mut sent_ids = Vec::new();
        let mut hop_orders = Vec::new();
        let mut hop_details = Vec::new();
        let mut refused = 0;
        let mut broken = None;
        for (o, result) in outgoing.iter().zip(results) {
            match result {
                Ok(()) => {
                    sent_ids.push(o.outbox_id);
                    if let Some(detail) = &o.hop {
                        hop_orders.push(o.order_id);
                        hop_details.push(detail.clone());
                        self.stats.hop(detail["tier"].as_str());
                    }
                }
                Err(BrokerError::Nacked { .. }) => refused += 1,
                Err(e) => broken = Some(e),
            }
        }
        tx.execute("DELETE FROM outbox WHERE id = ANY($1)", &[&sent_ids])
            .await?;
        tx.execute(
            "INSERT INTO order_events (order_id, event, detail)
             SELECT * FROM unnest($1::bigint[], array_fill('hop'::text, ARRAY[cardinality($1)]), $2::jsonb[])",
            &[&hop_orders, &hop_details],
        )
        .await?;
        tx.commit().await?;
        self.stats.record(Outcome::Relayed, sent_ids.len() as u64);
        self.stats.record(Outcome::PublishRefused, refused as u64);
        if let Some(e) = broken {
            return Err(e.into());
        }
        Ok(RelayOutcome::Published {
            sent: sent_ids.len(),
            refused,
        })
    }

    fn outgoing(
        &self,
        outbox_id: i64,
        kind: String,
        order_id: i64,
        payload: Value,
        db_now: DateTime<Utc>,
        lag: Duration,
    ) -> Outgoing {
        if kind == "stock.release" {
            return Outgoing {
                outbox_id,
                order_id,
                exchange: self.names.events_exchange(),
                routing_key: STOCK_RELEASE_ROUTING_KEY.into(),
                body: payload.to_string().into_bytes(),
                properties: BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_content_type(ShortString::from("application/json"))
                    .with_message_id(ShortString::from(format!("release-{order_id}"))),
                hop: None,
            };
        }
        let mut with_version = payload.clone();
        with_version["v"] = json!(crate::message::MESSAGE_VERSION);
        match serde_json::from_value::<TimeoutMessage>(with_version) {
            Ok(mut message) => {
                let route = Route::for_remaining(
                    &self.names,
                    &self.tiers,
                    message.remaining(db_now),
                    self.slack(lag),
                );
                message.hops = u32::from(route.tier.is_some());
                let tier = route.tier.map(|t| t.name()).unwrap_or_else(|| "due".into());
                Outgoing {
                    outbox_id,
                    order_id,
                    hop: Some(
                        json!({"tier": tier, "by": "relay", "deadline_version": message.deadline_version}),
                    ),
                    exchange: route.exchange,
                    routing_key: route.routing_key,
                    body: message.encode(),
                    properties: message.properties(),
                }
            }
            // Cannot happen for rows written by lapse's functions; never lose it.
            Err(e) => Outgoing {
                outbox_id,
                order_id,
                exchange: self.names.parked(),
                routing_key: String::new(),
                body: payload.to_string().into_bytes(),
                properties: parked_properties(
                    &BasicProperties::default().with_delivery_mode(2),
                    &format!("relay: outbox row {outbox_id} is not a timeout intent: {e}"),
                ),
                hop: None,
            },
        }
    }

    /// Runs rounds until `token` is cancelled, reconnecting to the broker as needed.
    pub async fn run(
        self,
        broker: Endpoint,
        db_url: Secret,
        poll: Duration,
        health: Health,
        token: CancellationToken,
    ) {
        let wake = Arc::new(Notify::new());
        let listener = tokio::spawn(listen(db_url, wake.clone(), token.clone()));
        crate::backoff::reconnecting("relay", &health, &token, || {
            self.session(&broker, &health, &wake, poll, &token)
        })
        .await;
        let _ = listener.await;
    }

    /// Rounds on one broker connection; returns on a broker error (to reconnect) or
    /// when cancelled.
    async fn session(
        &self,
        broker: &Endpoint,
        health: &Health,
        wake: &Notify,
        poll: Duration,
        token: &CancellationToken,
    ) -> Result<(), BrokerError> {
        let name = format!("lapse relay {}", self.names.prefix);
        let conn = broker.connect(&name).await?;
        let _blocked = BlockedWatch::start(&conn, &name, "relay", health);
        let publisher = broker.publisher(&conn).await?;
        let mut backoff = Backoff::new();
        let result = loop {
            if token.is_cancelled() {
                break Ok(());
            }
            // Notice a dropped connection while idle, not only at the next publish.
            if !publisher.is_usable() {
                break Err(BrokerError::ConnectionLost);
            }
            // A broker alarm blocks this connection: wait it out rather than publish into
            // it (a publish that gets stuck anyway ends in a confirm timeout; its rows stay).
            if conn.status().blocked() {
                backoff.sleep(token).await;
                continue;
            }
            match self.run_once(&publisher).await {
                Ok(RelayOutcome::Published { sent, refused: 0 }) => {
                    backoff.reset();
                    if sent < self.batch_size as usize {
                        wait(wake, poll, token).await;
                    }
                }
                Ok(RelayOutcome::Published { refused, .. }) => {
                    tracing::warn!(
                        refused,
                        "relay: broker refused publishes (queue full?); backing off"
                    );
                    backoff.sleep(token).await;
                }
                Ok(RelayOutcome::Idle) => wait(wake, poll, token).await,
                Err(RelayError::Broker(e)) => break Err(e),
                Err(RelayError::Db(e)) => {
                    tracing::warn!(error = %e, "relay: database error; retrying");
                    backoff.sleep(token).await;
                }
            }
        };
        broker::close_quietly(&conn, "relay stopping").await;
        result
    }
}

async fn wait(wake: &Notify, poll: Duration, token: &CancellationToken) {
    tokio::select! {
        _ = wake.notified() => {}
        _ = tokio::time::sleep(poll) => {}
        _ = token.cancelled() => {}
    }
}

/// Keeps a LISTEN connection open and turns notifications into wake-ups.
async fn listen(db_url: Secret, wake: Arc<Notify>, token: CancellationToken) {
    let mut backoff = Backoff::new();
    while !token.is_cancelled() {
        let config = match db::pg_config(&db_url) {
            Ok(c) => c,
            Err(_) => return,
        };
        let (client, mut connection) = match db::connect(&config).await {
            Ok(pair) => pair,
            Err(e) => {
                tracing::debug!(error = %e, "relay: LISTEN connection failed; polling meanwhile");
                backoff.sleep(&token).await;
                continue;
            }
        };
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        let statement = format!("LISTEN {OUTBOX_CHANNEL}");
        let listen = client.batch_execute(&statement);
        tokio::pin!(listen);
        let mut listening = false;
        loop {
            tokio::select! {
                _ = token.cancelled() => return,
                done = &mut listen, if !listening => {
                    listening = true;
                    if done.is_err() { break; }
                    backoff.reset();
                    wake.notify_one();
                }
                message = messages.next() => match message {
                    Some(Ok(tokio_postgres::AsyncMessage::Notification(_))) => wake.notify_one(),
                    Some(Ok(_)) => {}
                    Some(Err(_)) | None => break,
                },
            }
        }
        backoff.sleep(&token).await;
    }
}

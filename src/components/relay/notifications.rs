//! The relay's wake-ups: a LISTEN connection on the outbox channel, and a check that
//! notifications really arrive on it.
//!
//! A connection pooler in transaction mode (PgBouncer's `pool_mode = transaction`)
//! accepts `LISTEN` and then loses the notifications without an error: the server
//! connection that listened is handed to other clients. The relay then publishes only
//! when its poll comes round (`relay.poll_interval`). So the listener sends a probe
//! notification through the pool (another connection) whenever it heard nothing for
//! [`PROBE_EVERY`]; a probe not heard within [`PROBE_WAIT`] is logged as a warning,
//! shown by the gauge `lapse_relay_notifications` and by `lapse status`, and points to
//! `relay.listen_url`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::Secret;
use crate::db::{self, DbError, Pool};
use crate::observe::metric_catalog as m;
use crate::runtime::backoff::Backoff;

/// The channel the outbox trigger notifies on.
pub const OUTBOX_CHANNEL: &str = "lapse_outbox";

/// The payload of a probe (the trigger's notifications carry none or [`GATHER_PAYLOAD`]).
const PROBE_PAYLOAD: &str = "lapse-probe";

/// The trigger's payload when a statement wrote only intents due more than 2 seconds
/// later (migration V15): they may wait `relay.gather` in the outbox for others of
/// their route. Any other payload wakes the relay at once.
pub const GATHER_PAYLOAD: &str = "gather";

/// What the listener wakes the relay with: `now` (an event, a release, an intent due
/// soon: run a round at once) or `gather` (only intents due later: run one within
/// `relay.gather`).
#[derive(Debug, Default)]
pub struct Wakes {
    pub now: Notify,
    pub gather: Notify,
}

/// How long the listener may hear nothing before it probes.
pub const PROBE_EVERY: Duration = Duration::from_secs(30);

/// How long a probe may take to arrive before notifications count as lost.
pub const PROBE_WAIT: Duration = Duration::from_secs(5);

/// What `lapse status` and the worker's log tell a user whose notifications are lost.
pub const LOST_ADVICE: &str = "notifications on the outbox channel are not arriving (a connection pooler in transaction mode?): the relay publishes only every relay.poll_interval; point relay.listen_url at the database server directly (docs/operations.md, \"Behind a connection pooler\")";

/// Sends one probe notification through `pool`.
async fn send_probe(pool: &Pool) -> Result<(), DbError> {
    let client = pool.get().await?;
    client
        .batch_execute(&format!("NOTIFY {OUTBOX_CHANNEL}, '{PROBE_PAYLOAD}'"))
        .await?;
    Ok(())
}

/// Keeps a LISTEN connection to `listen_url` open and turns notifications into
/// wake-ups; probes it through `pool` when it has been quiet ([`PROBE_EVERY`]).
/// `shard` labels the gauge with database.shards.
pub async fn listen(
    listen_url: Secret,
    pool: Pool,
    shard: Option<String>,
    wake: Arc<Wakes>,
    token: CancellationToken,
) {
    let gauge = match &shard {
        Some(shard) => metrics::gauge!(m::RELAY_NOTIFICATIONS, "shard" => shard.clone()),
        None => metrics::gauge!(m::RELAY_NOTIFICATIONS),
    };
    let mut backoff = Backoff::new();
    let mut lost = false;
    while !token.is_cancelled() {
        let config = match db::pg_config(&listen_url) {
            Ok(c) => c,
            Err(_) => return,
        };
        let (client, mut connection) = match db::connect(&config).await {
            Ok(pair) => pair,
            Err(e) => {
                gauge.set(0.0);
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
        let mut heard = Instant::now();
        let mut probe_sent: Option<Instant> = None;
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = token.cancelled() => return,
                done = &mut listen, if !listening => {
                    listening = true;
                    if done.is_err() { break; }
                    backoff.reset();
                    wake.now.notify_one();
                    // Probed at once: a pooler that loses notifications is named
                    // at start, not after the first quiet period.
                    heard = Instant::now().checked_sub(PROBE_EVERY).unwrap_or_else(Instant::now);
                }
                message = messages.next() => match message {
                    Some(Ok(tokio_postgres::AsyncMessage::Notification(n))) => {
                        heard = Instant::now();
                        probe_sent = None;
                        if lost {
                            lost = false;
                            tracing::info!("relay: notifications on the outbox channel arrive again");
                        }
                        gauge.set(1.0);
                        match n.payload() {
                            PROBE_PAYLOAD => {}
                            GATHER_PAYLOAD => wake.gather.notify_one(),
                            _ => wake.now.notify_one(),
                        }
                    }
                    Some(Ok(_)) => {}
                    Some(Err(_)) | None => break,
                },
                _ = tick.tick(), if listening => {
                    match probe_sent {
                        Some(at) if at.elapsed() >= PROBE_WAIT => {
                            if !lost {
                                lost = true;
                                tracing::warn!("relay: {LOST_ADVICE}");
                            }
                            gauge.set(0.0);
                            probe_sent = None;
                            heard = Instant::now();
                        }
                        Some(_) => {}
                        None if heard.elapsed() >= PROBE_EVERY => {
                            // Bounded: notifications wait in the socket meanwhile.
                            match tokio::time::timeout(PROBE_WAIT, send_probe(&pool)).await {
                                Ok(Ok(())) => probe_sent = Some(Instant::now()),
                                // Tried again after another quiet period, not every tick.
                                Ok(Err(e)) => {
                                    heard = Instant::now();
                                    tracing::debug!(error = %e, "relay: could not send a probe notification");
                                }
                                Err(_) => {
                                    heard = Instant::now();
                                    tracing::debug!("relay: sending a probe notification took too long");
                                }
                            }
                        }
                        None => {}
                    }
                }
            }
        }
        gauge.set(0.0);
        backoff.sleep(&token).await;
    }
}

/// Whether a notification sent through `pool` arrives on a LISTEN connection to
/// `listen_url` within [`PROBE_WAIT`] (what `lapse status` asks).
pub async fn arrive(listen_url: &Secret, pool: &Pool) -> Result<bool, DbError> {
    let config = db::pg_config(listen_url)?;
    let (client, mut connection) = db::bounded_connect(&config).await?;
    let (heard_tx, heard_rx) = tokio::sync::oneshot::channel();
    let driver = tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        let mut heard_tx = Some(heard_tx);
        while let Some(Ok(message)) = messages.next().await {
            if let tokio_postgres::AsyncMessage::Notification(n) = message
                && n.payload() == PROBE_PAYLOAD
                && let Some(tx) = heard_tx.take()
            {
                let _ = tx.send(());
            }
        }
    });
    client
        .batch_execute(&format!("LISTEN {OUTBOX_CHANNEL}"))
        .await?;
    send_probe(pool).await?;
    let heard = tokio::time::timeout(PROBE_WAIT, heard_rx).await.is_ok();
    drop(client);
    driver.abort();
    Ok(heard)
}

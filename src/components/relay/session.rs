//! The relay's loop: rounds on one broker connection, reconnecting as needed, woken by
//! the outbox's notifications (at once, or within `relay.gather` for intents due
//! later) with a polling fallback.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::amqp::broker::{self, BrokerError, Endpoint};
use crate::amqp::publishing::BlockedWatch;
use crate::config::Secret;
use crate::runtime::backoff::Backoff;
use crate::runtime::health::Health;
use crate::runtime::supervisor::Fatal;

use super::notifications::{self, Wakes};
use super::{Relay, RelayError, RelayOutcome, backlog};

impl Relay {
    /// Runs rounds until `token` is cancelled, reconnecting to the broker as needed.
    pub async fn run(
        self,
        broker: Endpoint,
        listen_url: Secret,
        poll: Duration,
        health: Health,
        token: CancellationToken,
    ) -> Result<(), Fatal> {
        let wake = Arc::new(Wakes::default());
        // The LISTEN connection and the backlog gauge belong to this instance: they
        // stop with `token`, and dropping the set (the supervisor abandoning this
        // instance at the drain limit) aborts them.
        let mut helpers = JoinSet::new();
        helpers.spawn(notifications::listen(
            listen_url,
            self.pool.clone(),
            self.shard_label.clone(),
            wake.clone(),
            token.clone(),
        ));
        helpers.spawn(backlog::run(
            self.pool.clone(),
            self.shard_label.clone(),
            token.clone(),
        ));
        let result = crate::runtime::backoff::reconnecting(self.component, &health, &token, || {
            self.session(&broker, &wake, poll, &health, &token)
        })
        .await;
        helpers.shutdown().await;
        result
    }

    /// Rounds on one broker connection; returns on a broker error (to reconnect) or
    /// when cancelled.
    async fn session(
        &self,
        broker: &Endpoint,
        wake: &Wakes,
        poll: Duration,
        health: &Health,
        token: &CancellationToken,
    ) -> Result<(), BrokerError> {
        let name = match self.shard_label {
            Some(_) => format!("lapse relay {} shard {}", self.names.prefix, self.shard),
            None => format!("lapse relay {}", self.names.prefix),
        };
        let busy = health.busy(self.component);
        let conn = broker.connect(&name).await?;
        let _blocked = BlockedWatch::start(&conn, &name, self.component, health);
        let publisher = broker.publisher(&conn).await?;
        drop(busy);
        health.up(self.component);
        let mut backoff = Backoff::new();
        let mut waited = Duration::ZERO;
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
            let busy = health.busy(self.component);
            // A full round goes on at once with the same `waited`: its rows waited too.
            let round = self.round(&conn, &publisher, waited).await;
            drop(busy);
            match round {
                // Refused and returned rows were rescheduled: no reason to slow down
                // the rows behind them.
                Ok(RelayOutcome::Published {
                    sent,
                    refused,
                    returned,
                }) => {
                    backoff.reset();
                    if sent + refused + returned < self.batch_size as usize {
                        waited = wait(wake, poll, self.gather, token).await;
                    }
                }
                Ok(RelayOutcome::Idle) => waited = wait(wake, poll, self.gather, token).await,
                Err(RelayError::Broker(e)) => break Err(e),
                Err(RelayError::Db(e)) => {
                    waited = Duration::ZERO;
                    tracing::warn!(component = self.component, error = %e, "relay: database error; retrying");
                    backoff.sleep(token).await;
                }
            }
        };
        broker::close_quietly(&conn, "relay stopping").await;
        result
    }
}

/// Until the next round is due: at once on an urgent wake-up, within `gather` of a
/// wake-up for intents due later (more of their route meet in the outbox meanwhile,
/// and every row due by then leaves in that round), at the poll interval otherwise.
/// Returns how long it waited on purpose (gathering).
async fn wait(
    wake: &Wakes,
    poll: Duration,
    gather: Duration,
    token: &CancellationToken,
) -> Duration {
    tokio::select! {
        _ = wake.now.notified() => Duration::ZERO,
        _ = wake.gather.notified() => {
            let since = tokio::time::Instant::now();
            tokio::select! {
                _ = wake.now.notified() => {}
                _ = tokio::time::sleep(gather) => {}
                _ = token.cancelled() => {}
            }
            since.elapsed()
        }
        _ = tokio::time::sleep(poll) => Duration::ZERO,
        _ = token.cancelled() => Duration::ZERO,
    }
}

//! A consuming session: the consuming connection with its [`BatchSource`], and a
//! publishing connection for what handling a batch publishes (renewed copies, parked
//! copies, re-delays).

use lapin::message::Delivery;

use super::BatchSource;
use crate::amqp::broker::{self, BrokerError, Endpoint};
use crate::amqp::publishing::{Outgoing, PublishingConnection, parked_copy};
use crate::amqp::redelivery::{requeued_properties, returns_so_far};
use crate::runtime::health::Health;

/// What one consuming session holds: a consuming connection with the batch source,
/// and a separate publishing connection for the publishes its work needs (so that a
/// broker alarm, which blocks publishing connections, never stops its
/// acknowledgements). Opening and closing it is the same for every consumer; only the
/// handling of a batch differs.
pub struct ConsumerSession {
    conn: lapin::Connection,
    pub publishing: PublishingConnection,
    pub source: BatchSource,
}

impl ConsumerSession {
    /// Connects twice — `lapse <role> consume <prefix>` and `lapse <role> publish
    /// <prefix>` (the names shown in the management UI) — and starts consuming `queue`.
    /// `component` names the component on `/health`.
    pub async fn open(
        endpoint: &Endpoint,
        role: &str,
        prefix: &str,
        component: &'static str,
        health: &Health,
        queue: &str,
        prefetch: u16,
    ) -> Result<Self, BrokerError> {
        // Opening is a unit of work for the liveness check (a connect that never
        // returns is a stall); waiting for deliveries afterwards is not.
        let _opening = health.busy(component);
        let publish_name = format!("lapse {role} publish {prefix}");
        let publishing =
            PublishingConnection::open(endpoint, &publish_name, component, health).await?;
        let conn = endpoint
            .connect(&format!("lapse {role} consume {prefix}"))
            .await?;
        let source = match BatchSource::open(
            &conn,
            queue,
            prefetch,
            endpoint.confirm_timeout,
            endpoint.hold_limit,
        )
        .await
        {
            Ok(source) => source,
            Err(e) => {
                publishing.close().await;
                broker::close_quietly(&conn, "consumer failed to start").await;
                return Err(e);
            }
        };
        tracing::info!(%queue, prefetch, "consuming");
        health.up(component);
        Ok(Self {
            conn,
            publishing,
            source,
        })
    }

    /// Stops consuming and closes both connections; unacknowledged deliveries return
    /// to the queue.
    pub async fn close(self) {
        self.source.close().await;
        broker::close_quietly(&self.conn, "consumer stopping").await;
        self.publishing.close().await;
    }
}

impl ConsumerSession {
    /// Replaces each delivery a hold would have kept past the hold limit by a fresh
    /// copy of itself in the same queue (through the default exchange, confirmed, the
    /// broker's delivery count carried in lapse's returns header), then acknowledges
    /// the original; the copy is decided like any delivery when it arrives. A copy
    /// that cannot be published (a broker alarm, a full queue) leaves one way that
    /// does not cost the whole channel: the original is given back with `basic.nack`.
    /// Returns how many were renewed and how many given back.
    pub async fn renew_overdue(&mut self) -> Result<(usize, usize), BrokerError> {
        let overdue = std::mem::take(&mut self.source.overdue);
        if overdue.is_empty() {
            return Ok((0, 0));
        }
        let copies = overdue
            .iter()
            .map(|delivery| {
                let returns = returns_so_far(&delivery.properties);
                let properties = requeued_properties(&delivery.properties, returns);
                Outgoing::new("", &self.source.queue, delivery.data.clone(), properties)
            })
            .collect();
        // All copies at once: a silent broker costs one confirm timeout, not one each.
        let results = self.publishing.publish_all(copies).await;
        let (mut renewed, mut given_back) = (Vec::new(), Vec::new());
        for (delivery, result) in overdue.into_iter().zip(results) {
            match result {
                Ok(()) => renewed.push(delivery),
                Err(e) => {
                    tracing::warn!(error = %e, queue = %self.source.queue,
                        "could not renew a delivery kept as long as the broker's consumer \
                         timeout allows; giving it back to the queue");
                    given_back.push(delivery);
                }
            }
        }
        self.source.ack_all(&renewed).await?;
        for delivery in &given_back {
            self.source.requeue(delivery).await?;
        }
        if !renewed.is_empty() || !given_back.is_empty() {
            tracing::info!(renewed = renewed.len(), given_back = given_back.len(),
                queue = %self.source.queue,
                "deliveries kept as long as the broker's consumer timeout allows were renewed");
        }
        Ok((renewed.len(), given_back.len()))
    }

    /// Publishes a parked copy of `delivery` with `reason` on `parked_exchange`, then
    /// acknowledges it; on error nothing was acknowledged.
    pub async fn park(
        &mut self,
        parked_exchange: String,
        delivery: &Delivery,
        cause: &str,
        reason: &str,
    ) -> Result<(), BrokerError> {
        self.publishing
            .publish(parked_copy(parked_exchange, delivery, cause, reason))
            .await?;
        self.source.ack(delivery).await
    }
}

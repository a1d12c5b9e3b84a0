//! The stock releaser: consumes `<P>.stock.release` and returns a closed order's
//! reserved stock. The ledger's primary key (order, sku, 'release') makes a repeated
//! event a no-op; ledger rows and stock changes commit in one statement. The order
//! lines come from the database, not from the message. Stock rows are locked in SKU
//! order, like every other writer of stock, so releases never deadlock with orders.

use std::time::Duration;

use deadpool_postgres::Pool;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::batch::ConsumerSession;
use crate::broker::{BrokerError, Endpoint};
use crate::db::DbError;
use crate::health::Health;
use crate::message::parked_properties;
use crate::publishing::PublishingConnection;
use crate::stats::{Outcome, Stats};
use crate::topology::Names;

#[derive(Deserialize)]
struct ReleaseEvent {
    order_id: i64,
}

const RELEASE_SQL: &str = "
WITH released AS (
    INSERT INTO stock_ledger (order_id, sku, kind, qty)
    SELECT l.order_id, l.sku, 'release', l.qty
      FROM order_lines l JOIN orders o ON o.id = l.order_id
     WHERE l.order_id = ANY($1) AND o.status = 'CLOSED'
    ON CONFLICT DO NOTHING
    RETURNING sku, qty
),
restocked AS (
    UPDATE stock s
       SET available = s.available + r.qty, reserved = s.reserved - r.qty
      FROM (SELECT sku, sum(qty) AS qty FROM released GROUP BY sku) r
     WHERE s.sku = r.sku
    RETURNING 1
)
SELECT (SELECT count(*) FROM released), (SELECT count(*) FROM restocked)";

#[derive(Clone)]
pub struct Releaser {
    pub pool: Pool,
    pub names: Names,
    pub stats: Stats,
    pub prefetch: u16,
    pub batch_size: usize,
    pub batch_window: Duration,
}

impl Releaser {
    /// Applies the releases of these orders; returns how many (order, sku) rows were new.
    pub async fn release(&self, order_ids: &[i64]) -> Result<i64, DbError> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        // Lock the stock rows in SKU order first, as every writer of stock does.
        tx.execute(
            "SELECT 1 FROM stock WHERE sku IN
                    (SELECT sku FROM order_lines WHERE order_id = ANY($1))
              ORDER BY sku FOR UPDATE",
            &[&order_ids],
        )
        .await?;
        let row = tx.query_one(RELEASE_SQL, &[&order_ids]).await?;
        tx.commit().await?;
        Ok(row.get(0))
    }

    /// Consumes until `token` is cancelled, reconnecting with back-off.
    pub async fn run(self, broker: Endpoint, health: Health, token: CancellationToken) {
        crate::backoff::reconnecting("releaser", &health, &token, || {
            self.session(&broker, &health, &token)
        })
        .await;
    }

    async fn session(
        &self,
        broker: &Endpoint,
        health: &Health,
        token: &CancellationToken,
    ) -> Result<(), BrokerError> {
        let queue = self.names.stock_release_queue();
        let mut session = ConsumerSession::open(
            broker,
            "releaser",
            &self.names.prefix,
            "releaser",
            health,
            &queue,
            self.prefetch,
        )
        .await?;
        let result = loop {
            match session
                .source
                .next(self.batch_size, self.batch_window, token)
                .await
            {
                Ok(Some(batch)) => {
                    if let Err(e) = self.process(batch, &mut session.publishing).await {
                        break Err(e);
                    }
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        session.close().await;
        result
    }

    async fn process(
        &self,
        batch: Vec<Delivery>,
        publishing: &mut PublishingConnection,
    ) -> Result<(), BrokerError> {
        let mut ids = Vec::new();
        let mut good = Vec::new();
        for delivery in batch {
            match serde_json::from_slice::<ReleaseEvent>(&delivery.data) {
                Ok(event) => {
                    ids.push(event.order_id);
                    good.push(delivery);
                }
                Err(e) => {
                    let reason = format!("not a stock-release event: {e}");
                    tracing::warn!(%reason, "releaser: parking a message");
                    let properties = parked_properties(&delivery.properties, &reason);
                    publishing
                        .publish(&self.names.parked(), "", &delivery.data, properties)
                        .await?;
                    self.ack(&delivery).await?;
                    self.stats.record(Outcome::Parked, 1);
                }
            }
        }
        if good.is_empty() {
            return Ok(());
        }
        match self.release(&ids).await {
            Ok(applied) => {
                self.stats.record(Outcome::Released, applied as u64);
                for d in &good {
                    self.ack(d).await?;
                }
            }
            Err(e) => {
                // Deadlock or outage: the broker redelivers (the delivery limit parks a poison one).
                tracing::warn!(error = %e, "releaser: database error; returning deliveries to the queue");
                for d in &good {
                    let _ = d
                        .acker
                        .nack(BasicNackOptions {
                            requeue: true,
                            ..Default::default()
                        })
                        .await;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        Ok(())
    }

    async fn ack(&self, d: &Delivery) -> Result<(), BrokerError> {
        d.acker
            .ack(BasicAckOptions::default())
            .await
            .map(|_| ())
            .map_err(BrokerError::amqp("basic.ack"))
    }
}

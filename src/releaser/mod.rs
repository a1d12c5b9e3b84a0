//! The stock releaser: consumes `<P>.stock.release` and returns a closed order's
//! reserved stock. The ledger's primary key (order, sku, 'release') makes a repeated
//! event a no-op; ledger rows and stock changes commit in one statement. The order
//! lines come from the database, not from the message. Stock rows are locked in SKU
//! order, like every other writer of stock, so releases never deadlock with orders.
//! The same transaction stamps `orders.released_at`, which the reconciler relies on.
//!
//! Failure handling: a transient database error (outage, deadlock, serialization
//! failure) never gives a delivery back to the broker — that would spend its
//! `x-delivery-limit` budget and park a release that only needed a retry. The batch
//! stays unacknowledged and the transaction is retried with back-off until it
//! commits or shutdown. A permanent error (bad data) splits the batch until the
//! failing event is alone; only that one is parked, after lapse's own bounded tries.

use std::time::Duration;

use deadpool_postgres::Pool;
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::batch::ConsumerSession;
use crate::broker::{BrokerError, Endpoint};
use crate::db::DbError;
use crate::health::{Busy, Health};
use crate::message::parked_properties;
use crate::publishing::PublishingConnection;
use crate::stats::{Outcome, Stats};
use crate::supervisor::Fatal;
use crate::topology::Names;

#[derive(Deserialize)]
struct ReleaseEvent {
    order_id: i64,
}

/// Tries of one release that fails with a permanent (non-transient) error before it
/// is parked. lapse's own bound: the broker's delivery count is never spent on it.
pub const PERMANENT_ATTEMPTS: u32 = 3;

/// A decoded event held unacknowledged until its release commits or it is parked.
struct Pending {
    delivery: Delivery,
    order_id: i64,
    failures: u32,
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
        // What the reconciler looks for: CLOSED orders without this stamp.
        tx.execute(
            "UPDATE orders SET released_at = clock_timestamp()
              WHERE id = ANY($1) AND status = 'CLOSED' AND released_at IS NULL",
            &[&order_ids],
        )
        .await?;
        tx.commit().await?;
        Ok(row.try_get(0)?)
    }

    /// Consumes until `token` is cancelled, reconnecting with back-off.
    pub async fn run(
        self,
        broker: Endpoint,
        health: Health,
        token: CancellationToken,
    ) -> Result<(), Fatal> {
        crate::backoff::reconnecting("releaser", &health, &token, || {
            self.session(&broker, &health, &token)
        })
        .await
    }

    async fn session(
        &self,
        broker: &Endpoint,
        health: &Health,
        token: &CancellationToken,
    ) -> Result<(), BrokerError> {
        let queue = self.names.stock_release_queue();
        let busy = health.busy("releaser");
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
        drop(busy);
        let result = loop {
            match session
                .source
                .next(self.batch_size, self.batch_window, token)
                .await
            {
                Ok(Some(batch)) => {
                    let busy = health.busy("releaser");
                    if let Err(e) = self.process(batch, &mut session.publishing, token, &busy).await {
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

    /// Releases one batch. Undecodable events are parked at once. A transient
    /// database error keeps the deliveries unacknowledged and retries with back-off
    /// until the release commits or `token` is cancelled (then they return to the
    /// queue when the channel closes): an outage never spends a delivery's budget.
    /// A permanent error splits the batch until the one event that fails is alone;
    /// that event is tried [`PERMANENT_ATTEMPTS`] times, then parked with the reason.
    async fn process(
        &self,
        batch: Vec<Delivery>,
        publishing: &mut PublishingConnection,
        token: &CancellationToken,
        busy: &Busy,
    ) -> Result<(), BrokerError> {
        let mut good = Vec::new();
        for delivery in batch {
            match serde_json::from_slice::<ReleaseEvent>(&delivery.data) {
                Ok(event) => good.push(Pending {
                    delivery,
                    order_id: event.order_id,
                    failures: 0,
                }),
                Err(e) => {
                    let reason = format!("not a stock-release event: {e}");
                    self.park(publishing, &delivery, &reason).await?;
                }
            }
        }
        let mut work = vec![good];
        let mut backoff = Backoff::new();
        while let Some(mut chunk) = work.pop() {
            if chunk.is_empty() {
                continue;
            }
            let ids: Vec<i64> = chunk.iter().map(|p| p.order_id).collect();
            match self.release(&ids).await {
                Ok(applied) => {
                    backoff.reset();
                    self.stats
                        .record(Outcome::Released, u64::try_from(applied).unwrap_or(0));
                    for p in &chunk {
                        self.ack(&p.delivery).await?;
                    }
                }
                Err(e) if e.is_transient() => {
                    tracing::warn!(error = %e.detail(), held = chunk.len(),
                        "releaser: database unavailable; holding the deliveries and retrying");
                    self.stats
                        .record(Outcome::ReleaseRetried, chunk.len() as u64);
                    // Waiting out an outage is not a stall.
                    busy.idle_while(backoff.sleep(token)).await;
                    if token.is_cancelled() {
                        return Ok(());
                    }
                    work.push(chunk);
                }
                Err(e) if chunk.len() > 1 => {
                    // Narrow down to the event that fails; the others go through.
                    tracing::debug!(error = %e.detail(), size = chunk.len(),
                        "releaser: permanent error; splitting the batch");
                    let right = chunk.split_off(chunk.len() / 2);
                    work.push(right);
                    work.push(chunk);
                }
                Err(e) => {
                    let Some(mut one) = chunk.pop() else { continue };
                    one.failures += 1;
                    if one.failures < PERMANENT_ATTEMPTS {
                        tracing::warn!(error = %e.detail(), order_id = one.order_id,
                            attempt = one.failures, "releaser: release failed; trying again");
                        // Waiting out an outage is not a stall.
                        busy.idle_while(backoff.sleep(token)).await;
                        if token.is_cancelled() {
                            return Ok(());
                        }
                        work.push(vec![one]);
                    } else {
                        let reason = format!(
                            "stock release of order {} failed {} times: {}",
                            one.order_id,
                            one.failures,
                            e.detail()
                        );
                        self.park(publishing, &one.delivery, &reason).await?;
                    }
                }
            }
        }
        Ok(())
    }

    async fn park(
        &self,
        publishing: &mut PublishingConnection,
        delivery: &Delivery,
        reason: &str,
    ) -> Result<(), BrokerError> {
        tracing::warn!(%reason, "releaser: parking a message");
        let properties = parked_properties(&delivery.properties, reason);
        publishing
            .publish(&self.names.parked(), "", &delivery.data, properties)
            .await?;
        self.ack(delivery).await?;
        self.stats.record(Outcome::Parked, 1);
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

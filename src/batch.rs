//! Gathering deliveries into batches: wait for the first, then take whatever else
//! arrives within a short window, up to a size. Used by every consumer so that one
//! database round trip serves many deliveries.

use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::broker::{self, BrokerError, Endpoint};
use crate::health::Health;
use crate::publishing::PublishingConnection;

/// How long a consumer waits without any delivery before it checks whether its queue
/// holds ready messages nonetheless.
pub const IDLE_CHECK: Duration = Duration::from_secs(10);

/// A consumer on one queue plus a side channel of deliveries handed back for later
/// (held timeouts).
pub struct BatchSource {
    consumer: lapin::Consumer,
    queue: String,
    returned: mpsc::UnboundedReceiver<Delivery>,
    pub return_to: mpsc::UnboundedSender<Delivery>,
    pub channel: lapin::Channel,
}

impl BatchSource {
    /// Opens a channel with `prefetch` and starts consuming `queue`.
    pub async fn open(
        conn: &lapin::Connection,
        queue: &str,
        prefetch: u16,
    ) -> Result<Self, BrokerError> {
        let channel = conn
            .create_channel()
            .await
            .map_err(BrokerError::amqp("channel.open"))?;
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(BrokerError::amqp("basic.qos"))?;
        let consumer = channel
            .basic_consume(
                queue.into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(BrokerError::amqp("basic.consume"))?;
        let (return_to, returned) = mpsc::unbounded_channel();
        Ok(Self {
            consumer,
            queue: queue.to_string(),
            returned,
            return_to,
            channel,
        })
    }

    /// The next batch; `Ok(None)` once `token` is cancelled.
    pub async fn next(
        &mut self,
        size: usize,
        window: Duration,
        token: &CancellationToken,
    ) -> Result<Option<Vec<Delivery>>, BrokerError> {
        let mut idle_with_ready = 0;
        let first = loop {
            tokio::select! {
                biased;
                _ = token.cancelled() => return Ok(None),
                Some(d) = self.returned.recv() => break d,
                next = self.consumer.next() => break Self::unwrap(next)?,
                _ = tokio::time::sleep(IDLE_CHECK) => {
                    // Nothing arrived for a while: is the queue holding ready messages
                    // the broker does not deliver (a consumer attached while a quorum
                    // queue's leader changed can stay silent)? Twice in a row: re-attach.
                    let ready = self.ready().await?;
                    idle_with_ready = if ready > 0 { idle_with_ready + 1 } else { 0 };
                    if idle_with_ready >= 2 {
                        return Err(BrokerError::ConsumerSilent { queue: self.queue.clone(), ready });
                    }
                }
            }
        };
        let mut batch = vec![first];
        let until = tokio::time::Instant::now() + window;
        while batch.len() < size {
            tokio::select! {
                biased;
                Some(d) = self.returned.recv() => batch.push(d),
                next = self.consumer.next() => batch.push(Self::unwrap(next)?),
                _ = tokio::time::sleep_until(until) => break,
            }
        }
        Ok(Some(batch))
    }

    /// Messages ready in the consumed queue (a passive declare on this channel).
    async fn ready(&self) -> Result<u32, BrokerError> {
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let declared = self
            .channel
            .queue_declare(self.queue.as_str().into(), passive, FieldTable::default())
            .await
            .map_err(BrokerError::amqp("queue.declare (passive)"))?;
        Ok(declared.message_count())
    }

    fn unwrap(next: Option<lapin::Result<Delivery>>) -> Result<Delivery, BrokerError> {
        match next {
            Some(Ok(d)) => Ok(d),
            Some(Err(e)) => Err(BrokerError::amqp("consume")(e)),
            None => Err(BrokerError::ConsumerEnded),
        }
    }

    /// Stops consuming and closes the channel; unacknowledged deliveries go back to
    /// the queue.
    pub async fn close(self) {
        if self.channel.status().connected() {
            let close = self.channel.close(200, "shutting down".into());
            let _ = tokio::time::timeout(Duration::from_secs(2), close).await;
        }
    }
}

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
        let source = match BatchSource::open(&conn, queue, prefetch).await {
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

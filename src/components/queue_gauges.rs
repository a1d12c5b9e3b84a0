//! Queue depths and consumer counts of lapse's own queues (due, parked, every wait
//! tier) as gauges, so that dashboards and alerts need nothing but lapse's `/metrics`
//! (the broker's Prometheus plugin is not required). Sampled every
//! [`SAMPLE_EVERY`] with a passive `queue.declare` per queue, which answers with
//! both counts; one connection per worker, named `lapse queue gauges <prefix>`.
//!
//! Every worker that uses the broker samples: several workers export the same
//! values, so dashboards take `max by (queue, tier)`.

use std::time::Duration;

use lapin::Connection;
use tokio_util::sync::CancellationToken;

use crate::amqp::broker::{self, BrokerError, Endpoint, QueueState};
use crate::names::Names;
use crate::observe::metric_catalog as m;
use crate::runtime::health::Health;
use crate::runtime::supervisor::Fatal;
use crate::tier::TierSet;

pub const COMPONENT: &str = "queues";
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// Bounds one passive declare, so that a hung broker is a reconnect, not a stall.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// One sampled queue: what it is to lapse, and its name on the broker.
struct Sampled {
    queue: &'static str,
    tier: String,
    name: String,
}

fn sampled(names: &Names, tiers: &TierSet) -> Vec<Sampled> {
    let mut all = vec![
        Sampled {
            queue: "due",
            tier: String::new(),
            name: names.due_queue(),
        },
        Sampled {
            queue: "parked",
            tier: String::new(),
            name: names.parked(),
        },
    ];
    all.extend(tiers.iter().map(|t| Sampled {
        queue: "tier",
        tier: t.name(),
        name: names.wait_queue(t),
    }));
    all
}

/// Samples until `token` is cancelled, reconnecting with back-off.
pub async fn run(
    broker: Endpoint,
    names: Names,
    tiers: TierSet,
    health: Health,
    token: CancellationToken,
) -> Result<(), Fatal> {
    let queues = sampled(&names, &tiers);
    crate::runtime::backoff::reconnecting(COMPONENT, &health, &token, || {
        session(&broker, &names, &queues, &health, &token)
    })
    .await
}

async fn session(
    broker: &Endpoint,
    names: &Names,
    queues: &[Sampled],
    health: &Health,
    token: &CancellationToken,
) -> Result<(), BrokerError> {
    let opening = health.busy(COMPONENT);
    let conn = broker
        .connect(&format!("lapse queue gauges {}", names.prefix))
        .await?;
    drop(opening);
    health.up(COMPONENT);
    let result = loop {
        let busy = health.busy(COMPONENT);
        let round = sample_all(&conn, queues).await;
        drop(busy);
        if let Err(e) = round {
            break Err(e);
        }
        tokio::select! {
            _ = token.cancelled() => break Ok(()),
            _ = tokio::time::sleep(SAMPLE_EVERY) => {}
        }
    };
    broker::close_quietly(&conn, "queue gauges stopping").await;
    result
}

async fn sample_all(conn: &Connection, queues: &[Sampled]) -> Result<(), BrokerError> {
    for q in queues {
        // A channel of its own per ask: a 404 closes the channel it ran on.
        let state = tokio::time::timeout(ASK_TIMEOUT, broker::queue_state(conn, &q.name))
            .await
            .unwrap_or(Err(BrokerError::ConfirmTimeout { after: ASK_TIMEOUT }))?;
        let labels = [("queue", q.queue.to_string()), ("tier", q.tier.clone())];
        match state {
            QueueState::Exists(counts) => {
                metrics::gauge!(m::QUEUE_MESSAGES, &labels).set(f64::from(counts.messages));
                metrics::gauge!(m::QUEUE_CONSUMERS, &labels).set(f64::from(counts.consumers));
            }
            QueueState::Missing => {
                // A missing queue has no messages and no consumers: the alert on a
                // due queue without consumers fires, `lapse topology verify` says why.
                tracing::debug!(queue = %q.name, "queue gauges: queue not found");
                metrics::gauge!(m::QUEUE_MESSAGES, &labels).set(0.0);
                metrics::gauge!(m::QUEUE_CONSUMERS, &labels).set(0.0);
            }
        }
    }
    Ok(())
}

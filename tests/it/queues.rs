//! Looking at a test's queues from outside: depth, deletion, and the reasons on
//! parked messages.

use std::time::Duration;

use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapse::message::{header_text, park_reason};

/// Ready messages in `queue`, or `None` when it does not exist.
pub async fn depth(conn: &lapin::Connection, queue: &str) -> Option<u32> {
    let channel = conn.create_channel().await.unwrap();
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let found = channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .ok()?;
    let _ = channel.close(200, "done".into()).await;
    Some(found.message_count())
}

/// Deletes `queue` (quorum queues refuse `if-empty`: callers delete it while idle).
pub async fn delete(conn: &lapin::Connection, queue: &str) {
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
}

/// Takes every message from `queue` (waiting up to `limit` for the first `expect`),
/// acknowledging them; returns each one's reason: lapse's park reason header, else
/// the broker's `x-first-death-reason`, else "".
pub async fn drain_reasons(
    conn: &lapin::Connection,
    queue: &str,
    expect: usize,
    limit: Duration,
) -> Vec<String> {
    let channel = conn.create_channel().await.unwrap();
    let started = std::time::Instant::now();
    let mut reasons = Vec::new();
    loop {
        let got = channel
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .unwrap();
        match got {
            Some(message) => {
                let headers = message.delivery.properties.headers().as_ref();
                let reason = park_reason(headers)
                    .or_else(|| header_text(headers, "x-first-death-reason"))
                    .unwrap_or_default();
                reasons.push(reason);
                message
                    .delivery
                    .ack(BasicAckOptions::default())
                    .await
                    .unwrap();
            }
            None if reasons.len() >= expect || started.elapsed() > limit => break,
            None => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    reasons
}

//! Moving parked messages from `<P>.parked` into the parked book, once each.
//!
//! Per chunk of up to [`CHUNK`]: the database is asked first — a probe row inserted and
//! rolled back (a message taken while the rows cannot be written would only go back,
//! and each return counts as a delivery) — then the messages
//! are taken with `basic.get`, their rows inserted and committed, and only then
//! acknowledged. A failure before the commit closes the channel, so what was taken goes
//! back at once. An acknowledgement lost after the commit brings a message back once
//! more: its fingerprint — SHA-256 of its body, reason, park time, origin and headers,
//! leaving out the counts the broker changes on every redelivery — makes the second
//! insert a no-op.

use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::BasicGetOptions;
use lapin::{Channel, Connection};
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio_postgres::types::Type;

use super::entry::{headers_json, rfc3339};
use super::{Entry, ParkedError};
use crate::amqp::batch::ack;
use crate::amqp::broker::{self, BrokerError, QueueState};
use crate::db::{DbError, Pool};
use crate::names::Names;

/// Messages moved per transaction.
pub const CHUNK: usize = 100;

/// Headers the broker rewrites when it delivers a message again: left out of the
/// fingerprint, so a redelivered message is recognised.
const VOLATILE_HEADERS: [&str; 2] = ["x-delivery-count", "x-acquired-count"];

/// Moves the messages ready in `<P>.parked` into the book, a chunk at a time, calling
/// `next_chunk` before each (it returns false to stop: a shutdown, a round's cap);
/// returns how many were moved. The channel is closed whatever happens, so a message
/// taken but not archived goes back to the queue at once.
pub async fn archive(
    conn: &Connection,
    names: &Names,
    pool: &Pool,
    reply_timeout: Duration,
    next_chunk: &mut (dyn FnMut() -> bool + Send),
) -> Result<usize, ParkedError> {
    let channel = broker::open_channel_within(conn, reply_timeout).await?;
    let moved = take(&channel, names, pool, reply_timeout, next_chunk).await;
    broker::close_channel_quietly(&channel, "parked messages archived").await;
    moved
}

async fn take(
    channel: &Channel,
    names: &Names,
    pool: &Pool,
    reply_timeout: Duration,
    next_chunk: &mut (dyn FnMut() -> bool + Send),
) -> Result<usize, ParkedError> {
    let queue = names.parked();
    let asked = broker::passive_declare(channel, &queue);
    let total = match broker::within(reply_timeout, "queue.declare", asked).await? {
        QueueState::Exists(counts) => counts.messages,
        QueueState::Missing => return Err(ParkedError::NoQueue(queue)),
    };
    let mut moved = 0;
    let mut taken = 0;
    while taken < total && next_chunk() {
        // The database first: nothing is taken while it cannot take the rows.
        can_insert(pool, &names.prefix).await?;
        let mut chunk: Vec<Delivery> = Vec::new();
        while chunk.len() < CHUNK && taken < total {
            let get = channel.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false });
            let got = broker::replied(reply_timeout, "basic.get", get)
                .await?
                .map_err(BrokerError::amqp("basic.get"))?;
            match got {
                Some(m) => {
                    chunk.push(m.delivery);
                    taken += 1;
                }
                None => taken = total,
            }
        }
        if chunk.is_empty() {
            break;
        }
        insert(pool, names, &chunk).await?;
        for delivery in &chunk {
            ack(delivery).await?;
        }
        moved += chunk.len();
    }
    Ok(moved)
}

/// Whether a row can be inserted now: a probe row, rolled back. A database that
/// answers but cannot take the rows (the table not migrated yet, a read-only server
/// during a failover, no INSERT privilege) fails here, before any message is taken.
async fn can_insert(pool: &Pool, prefix: &str) -> Result<(), DbError> {
    let mut client = pool.get().await?;
    let tx = crate::db::begin_short(&mut client, pool.limits(), None).await?;
    tx.execute_typed(
        "INSERT INTO lapse_parked (prefix, fingerprint, id, kind, cause, reason,
                                   reason_source, exchange, routing_key, body)
         VALUES ($1, 'probe', 'probe', 'unreadable', 'probe', 'probe', 'unknown', '', '', '')",
        &[(&prefix, Type::TEXT)],
    )
    .await?;
    tx.rollback().await?;
    Ok(())
}

const INSERT_SQL: &str = "
INSERT INTO lapse_parked (prefix, fingerprint, id, kind, cause, order_id, shard, deadline,
                          deadline_version, attempts, reason, reason_source, parked_at,
                          exchange, routing_key, message_id, headers, body)
SELECT $18, * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[],
                     $6::int[], $7::timestamptz[], $8::int[], $9::bigint[], $10::text[],
                     $11::text[], $12::timestamptz[], $13::text[], $14::text[],
                     $15::text[], $16::jsonb[], $17::bytea[])
ON CONFLICT (prefix, fingerprint) DO NOTHING";

/// Inserts one chunk's rows in one transaction.
// Over 60 lines on purpose: one column array per field of the row, filled in one pass.
async fn insert(pool: &Pool, names: &Names, chunk: &[Delivery]) -> Result<(), DbError> {
    let mut fingerprint = Vec::new();
    let mut id = Vec::new();
    let mut kind = Vec::new();
    let mut cause = Vec::new();
    let mut order_id = Vec::new();
    let mut shard = Vec::new();
    let mut deadline = Vec::new();
    let mut version = Vec::new();
    let mut attempts = Vec::new();
    let mut reason = Vec::new();
    let mut source = Vec::new();
    let mut parked_at = Vec::new();
    let mut exchange = Vec::new();
    let mut routing_key = Vec::new();
    let mut message_id = Vec::new();
    let mut headers = Vec::new();
    let mut body = Vec::new();
    for d in chunk {
        let e = Entry::read(d, names);
        let h = headers_json(d.properties.headers().as_ref());
        fingerprint.push(fingerprint_of(&d.data, &e, &h));
        id.push(text(&e.id));
        kind.push(word(&e.kind));
        cause.push(text(&e.cause));
        order_id.push(e.order_id);
        shard.push(e.shard.map(i32::from));
        deadline.push(e.deadline);
        version.push(e.deadline_version);
        attempts.push(i64::from(e.attempts));
        reason.push(text(&e.reason));
        source.push(word(&e.reason_source));
        parked_at.push(e.parked_at);
        exchange.push(text(&e.exchange));
        routing_key.push(text(&e.routing_key));
        message_id.push(d.properties.message_id().as_ref().map(|m| text(m.as_str())));
        headers.push(json(h));
        body.push(d.data.clone());
    }
    let mut client = pool.get().await?;
    let tx = crate::db::begin_short(&mut client, pool.limits(), None).await?;
    tx.execute_typed(
        INSERT_SQL,
        &[
            (&fingerprint, Type::TEXT_ARRAY),
            (&id, Type::TEXT_ARRAY),
            (&kind, Type::TEXT_ARRAY),
            (&cause, Type::TEXT_ARRAY),
            (&order_id, Type::INT8_ARRAY),
            (&shard, Type::INT4_ARRAY),
            (&deadline, Type::TIMESTAMPTZ_ARRAY),
            (&version, Type::INT4_ARRAY),
            (&attempts, Type::INT8_ARRAY),
            (&reason, Type::TEXT_ARRAY),
            (&source, Type::TEXT_ARRAY),
            (&parked_at, Type::TIMESTAMPTZ_ARRAY),
            (&exchange, Type::TEXT_ARRAY),
            (&routing_key, Type::TEXT_ARRAY),
            (&message_id, Type::TEXT_ARRAY),
            (&headers, Type::JSONB_ARRAY),
            (&body, Type::BYTEA_ARRAY),
            (&names.prefix, Type::TEXT),
        ],
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// What makes two deliveries the same parking: the body, the reason and park time,
/// where it was published, and the headers without the broker's delivery counts.
pub fn fingerprint_of(body: &[u8], entry: &Entry, headers: &Value) -> String {
    let mut stable = headers.clone();
    if let Some(map) = stable.as_object_mut() {
        for volatile in VOLATILE_HEADERS {
            map.remove(volatile);
        }
    }
    let mut hash = Sha256::new();
    for part in [
        body,
        entry.reason.as_bytes(),
        entry.parked_at.map(rfc3339).unwrap_or_default().as_bytes(),
        entry.exchange.as_bytes(),
        entry.routing_key.as_bytes(),
        stable.to_string().as_bytes(),
    ] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Text PostgreSQL accepts: a NUL (which a text column refuses) becomes U+FFFD.
fn text(s: &str) -> String {
    s.replace('\0', "\u{FFFD}")
}

/// The same for every string in a JSON value (jsonb refuses `\u0000` too).
fn json(value: Value) -> Value {
    match value {
        Value::String(s) => Value::String(text(&s)),
        Value::Array(items) => Value::Array(items.into_iter().map(json).collect()),
        Value::Object(map) => {
            Value::Object(map.into_iter().map(|(k, v)| (text(&k), json(v))).collect())
        }
        other => other,
    }
}

/// A serde unit variant's name (`timeout`, `lapse`).
fn word<T: Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::BasicProperties;
    use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

    fn delivery(headers: &[(&str, AMQPValue)]) -> Delivery {
        let mut d = Delivery::mock(
            0,
            "t.parked".into(),
            "".into(),
            false,
            b"\xff body".to_vec(),
        );
        let mut table = FieldTable::default();
        table.insert(
            ShortString::from("x-lapse-park-reason"),
            AMQPValue::LongString(LongString::from("undecodable\0 with a NUL")),
        );
        for (k, v) in headers {
            table.insert(ShortString::from(*k), v.clone());
        }
        d.properties = BasicProperties::default().with_headers(table);
        d
    }

    fn print(d: &Delivery) -> String {
        let names = Names::new("t");
        let e = Entry::read(d, &names);
        fingerprint_of(&d.data, &e, &headers_json(d.properties.headers().as_ref()))
    }

    #[test]
    fn a_redelivered_message_keeps_its_fingerprint_and_another_does_not() {
        let first = delivery(&[]);
        let again = delivery(&[
            ("x-delivery-count", AMQPValue::LongLongInt(3)),
            ("x-acquired-count", AMQPValue::LongLongInt(4)),
        ]);
        assert_eq!(print(&first), print(&again));
        let other = delivery(&[(
            "x-lapse-parked-at",
            AMQPValue::LongString(LongString::from("2026-12-07T00:00:00.000Z")),
        )]);
        assert_ne!(print(&first), print(&other));
        assert_eq!(print(&first).len(), 64);
    }

    #[test]
    fn nul_characters_become_replacement_characters_in_text_and_json() {
        assert_eq!(text("a\0b"), "a\u{FFFD}b");
        let v = json(serde_json::json!({"k\u{0}": ["x\u{0}", {"y": "z\u{0}"}], "n": 1}));
        assert_eq!(
            v,
            serde_json::json!({"k\u{FFFD}": ["x\u{FFFD}", {"y": "z\u{FFFD}"}], "n": 1})
        );
    }
}

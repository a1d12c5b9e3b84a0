//! The parked book (`lapse_parked`): parked messages as rows, moved out of `<P>.parked`
//! once by [`archive`] and read, counted, replayed and purged here, never by reading
//! the queue again. Rows live in the first order database.
//!
//! Moving a message: `basic.get` it, insert its row (with its body, headers and what
//! [`Entry::read`] made of them) and commit, then acknowledge. A failure before the
//! commit leaves the message in the queue; an acknowledgement lost after the commit
//! brings the message back once more, and its fingerprint (the body, the park time and
//! reason, where it came from) makes that second insert a no-op. Nothing is ever given
//! back to the queue on purpose, so no delivery limit is spent.

use chrono::{DateTime, Utc};
use lapin::Connection;
use lapin::message::Delivery;
use lapin::options::BasicGetOptions;
use serde::Serialize;
use serde_json::Value;
use tokio_postgres::types::Type;

use super::entry::{Kind, ReasonSource, fnv1a, headers_json, rfc3339};
use super::{Entry, ParkedError};
use crate::amqp::batch::ack;
use crate::amqp::broker::{self, BrokerError, QueueState};
use crate::db::{DbError, Pool, column};
use crate::message::TimeoutMessage;
use crate::names::Names;

/// Messages moved per transaction.
pub const CHUNK: usize = 100;

/// One row of the book: the entry, and what `show` prints besides.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// The row's place in the book: the order in which messages were archived, and
    /// the cursor of `lapse parked list --after`.
    pub seq: i64,
    #[serde(flatten)]
    pub entry: Entry,
    pub archived_at: DateTime<Utc>,
    #[serde(skip)]
    pub message_id: Option<String>,
    #[serde(skip)]
    pub headers: Value,
    #[serde(skip)]
    pub body: Vec<u8>,
}

/// Which rows a command acts on.
#[derive(Clone, Debug, Default)]
pub struct Selection {
    /// IDs from `lapse parked list`; every copy of each.
    pub ids: Vec<String>,
    pub all: bool,
    /// Rows whose reason contains this text, or whose cause is it (case-insensitive).
    pub reason: Option<String>,
}

impl Selection {
    /// The rows' filter as SQL over `$1` (ids), `$2` (all), `$3` (reason).
    const SQL: &'static str = "(id = ANY($1) OR $2
        OR ($3::text IS NOT NULL AND (strpos(lower(reason), lower($3)) > 0 OR lower(cause) = lower($3))))";
}

/// Moves every message ready in `<P>.parked` into the book; returns how many. The
/// channel is closed whatever happens, so a message taken but not archived (the
/// database away) goes back to the queue at once.
pub async fn archive(
    conn: &Connection,
    names: &Names,
    pool: &Pool,
    reply_timeout: std::time::Duration,
) -> Result<usize, ParkedError> {
    let channel = broker::open_channel_within(conn, reply_timeout).await?;
    let moved = take(&channel, names, pool, reply_timeout).await;
    broker::close_channel_quietly(&channel, "parked messages archived").await;
    moved
}

async fn take(
    channel: &lapin::Channel,
    names: &Names,
    pool: &Pool,
    reply_timeout: std::time::Duration,
) -> Result<usize, ParkedError> {
    let queue = names.parked();
    let asked = broker::passive_declare(channel, &queue);
    let total = match broker::within(reply_timeout, "queue.declare", asked).await? {
        QueueState::Exists(counts) => counts.messages,
        QueueState::Missing => return Err(ParkedError::NoQueue(queue)),
    };
    let mut moved = 0;
    let mut taken = 0;
    while taken < total {
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
        let mut print = d.data.clone();
        for part in [
            e.reason.as_str(),
            &e.parked_at.map(rfc3339).unwrap_or_default(),
            &e.exchange,
            &e.routing_key,
            &h.to_string(),
        ] {
            print.push(0);
            print.extend_from_slice(part.as_bytes());
        }
        fingerprint.push(format!("{:016x}-{}", fnv1a(&print), d.data.len()));
        id.push(e.id.clone());
        kind.push(word(&e.kind));
        cause.push(e.cause.clone());
        order_id.push(e.order_id);
        shard.push(e.shard.map(i32::from));
        deadline.push(e.deadline);
        version.push(e.deadline_version);
        attempts.push(i64::from(e.attempts));
        reason.push(e.reason.clone());
        source.push(word(&e.reason_source));
        parked_at.push(e.parked_at);
        exchange.push(e.exchange.clone());
        routing_key.push(e.routing_key.clone());
        message_id.push(d.properties.message_id().as_ref().map(|m| m.to_string()));
        headers.push(h);
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

/// A serde unit variant's name (`timeout`, `lapse`).
fn word<T: Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

fn from_word<T: serde::de::DeserializeOwned>(text: String) -> Option<T> {
    serde_json::from_value(Value::String(text)).ok()
}

const COLUMNS: &str = "seq, id, kind, cause, order_id, shard, deadline, deadline_version,
    attempts, reason, reason_source, parked_at, archived_at, exchange, routing_key,
    message_id, headers, body";

fn row(r: &tokio_postgres::Row) -> Result<Row, DbError> {
    let body: Vec<u8> = column(r, "body")?;
    let kind: Kind = from_word(column(r, "kind")?).unwrap_or(Kind::Unreadable);
    let timeout = match kind {
        Kind::Timeout => TimeoutMessage::decode(&body).ok(),
        _ => None,
    };
    let shard: Option<i32> = column(r, "shard")?;
    let attempts: i64 = column(r, "attempts")?;
    Ok(Row {
        seq: column(r, "seq")?,
        entry: Entry {
            id: column(r, "id")?,
            kind,
            order_id: column(r, "order_id")?,
            shard: shard.and_then(|s| u16::try_from(s).ok()),
            deadline: column(r, "deadline")?,
            deadline_version: column(r, "deadline_version")?,
            attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
            reason: column(r, "reason")?,
            cause: column(r, "cause")?,
            reason_source: from_word(column(r, "reason_source")?).unwrap_or(ReasonSource::Unknown),
            parked_at: column(r, "parked_at")?,
            exchange: column(r, "exchange")?,
            routing_key: column(r, "routing_key")?,
            timeout,
        },
        archived_at: column(r, "archived_at")?,
        message_id: column(r, "message_id")?,
        headers: column(r, "headers")?,
        body,
    })
}

/// Up to `limit` rows after `after` (a `seq`), in book order, optionally only those of
/// `selection`; and whether more follow.
pub async fn page(
    pool: &Pool,
    prefix: &str,
    selection: Option<&Selection>,
    after: i64,
    limit: i64,
) -> Result<(Vec<Row>, bool), DbError> {
    let client = pool.get().await?;
    let filter = if selection.is_some() {
        Selection::SQL
    } else {
        "true"
    };
    let sel = selection.cloned().unwrap_or_default();
    let rows = client
        .query_typed(
            &format!(
                "SELECT {COLUMNS} FROM lapse_parked
                  WHERE prefix = $6 AND seq > $4 AND {filter}
                  ORDER BY seq LIMIT $5"
            ),
            &[
                (&sel.ids, Type::TEXT_ARRAY),
                (&sel.all, Type::BOOL),
                (&sel.reason, Type::TEXT),
                (&after, Type::INT8),
                (&limit.saturating_add(1), Type::INT8),
                (&prefix, Type::TEXT),
            ],
        )
        .await?;
    let more = i64::try_from(rows.len()).unwrap_or(i64::MAX) > limit;
    let rows = rows
        .iter()
        .take(usize::try_from(limit).unwrap_or(usize::MAX))
        .map(row)
        .collect::<Result<Vec<_>, _>>()?;
    Ok((rows, more))
}

/// Rows per cause.
#[derive(Clone, Debug, Serialize)]
pub struct Count {
    pub cause: String,
    pub count: i64,
    pub oldest_parked_at: Option<DateTime<Utc>>,
    pub newest_parked_at: Option<DateTime<Utc>>,
    /// The reason of the newest row, as an example.
    pub example: String,
}

pub async fn counts(pool: &Pool, prefix: &str) -> Result<Vec<Count>, DbError> {
    let client = pool.get().await?;
    let rows = client
        .query_typed(
            "SELECT cause, count(*) AS count, min(coalesce(parked_at, archived_at)) AS oldest,
                    max(coalesce(parked_at, archived_at)) AS newest,
                    (array_agg(reason ORDER BY seq DESC))[1] AS example
               FROM lapse_parked WHERE prefix = $1
              GROUP BY cause ORDER BY count(*) DESC, cause",
            &[(&prefix, Type::TEXT)],
        )
        .await?;
    rows.iter()
        .map(|r| {
            Ok(Count {
                cause: column(r, "cause")?,
                count: column(r, "count")?,
                oldest_parked_at: column(r, "oldest")?,
                newest_parked_at: column(r, "newest")?,
                example: column(r, "example")?,
            })
        })
        .collect()
}

/// How many rows the book holds for `prefix`.
pub async fn total<C: tokio_postgres::GenericClient>(db: &C, prefix: &str) -> Result<i64, DbError> {
    let row = db
        .query_typed_one(
            "SELECT count(*) AS n FROM lapse_parked WHERE prefix = $1",
            &[(&prefix, Type::TEXT)],
        )
        .await?;
    column(&row, "n")
}

/// The selected rows, locked for this transaction (rows another operator's command
/// holds are skipped), in book order.
pub async fn select_for_update(
    tx: &tokio_postgres::Transaction<'_>,
    prefix: &str,
    selection: &Selection,
) -> Result<Vec<Row>, DbError> {
    let rows = tx
        .query_typed(
            &format!(
                "SELECT {COLUMNS} FROM lapse_parked WHERE prefix = $4 AND {}
                  ORDER BY seq FOR UPDATE SKIP LOCKED",
                Selection::SQL
            ),
            &[
                (&selection.ids, Type::TEXT_ARRAY),
                (&selection.all, Type::BOOL),
                (&selection.reason, Type::TEXT),
                (&prefix, Type::TEXT),
            ],
        )
        .await?;
    rows.iter().map(row).collect()
}

/// Deletes rows by `seq`.
pub async fn delete(tx: &tokio_postgres::Transaction<'_>, seqs: &[i64]) -> Result<u64, DbError> {
    Ok(tx
        .execute_typed(
            "DELETE FROM lapse_parked WHERE seq = ANY($1)",
            &[(&seqs, Type::INT8_ARRAY)],
        )
        .await?)
}

//! The parked book (`lapse_parked`): parked messages as rows, moved out of `<P>.parked`
//! once ([`super::archive`]) and read, counted, replayed and purged here, never by
//! reading the queue again. Rows live in the first order database, each under the
//! broker prefix it came from.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use tokio_postgres::types::Type;

use super::Entry;
use super::entry::{Kind, ReasonSource};
use crate::db::{DbError, Pool, column};

/// One row of the book: the entry, and what `show` prints besides.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// The row's place in the book: the order in which messages were archived, and
    /// the cursor of `lapse parked list --after`.
    pub seq: i64,
    #[serde(flatten)]
    pub entry: Entry,
    pub archived_at: DateTime<Utc>,
    /// While a replay holds the row: until when.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub claimed_until: Option<DateTime<Utc>>,
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

    /// Every row.
    fn all() -> Self {
        Self {
            all: true,
            ..Default::default()
        }
    }
}

/// A row that no replay holds now.
const UNCLAIMED: &str = "(claimed_until IS NULL OR claimed_until < clock_timestamp())";

/// The rows of `prefix` that `selection` picks and `rest` says more about: `rest` is
/// SQL after the filter (conditions, order, limit, locks) over `$5` and on, which
/// `more` binds.
async fn selected(
    db: &impl tokio_postgres::GenericClient,
    prefix: &str,
    selection: &Selection,
    rest: &str,
    more: &[(&(dyn tokio_postgres::types::ToSql + Sync), Type)],
) -> Result<Vec<Row>, DbError> {
    let mut params: Vec<(&(dyn tokio_postgres::types::ToSql + Sync), Type)> = vec![
        (&selection.ids, Type::TEXT_ARRAY),
        (&selection.all, Type::BOOL),
        (&selection.reason, Type::TEXT),
        (&prefix, Type::TEXT),
    ];
    params.extend_from_slice(more);
    let rows = db
        .query_typed(
            &format!(
                "SELECT {COLUMNS} FROM lapse_parked WHERE prefix = $4 AND {} {rest}",
                Selection::SQL
            ),
            &params,
        )
        .await?;
    rows.iter().map(row).collect()
}

fn from_word<T: serde::de::DeserializeOwned>(text: String) -> Option<T> {
    serde_json::from_value(Value::String(text)).ok()
}

const COLUMNS: &str = "seq, id, kind, cause, order_id, shard, deadline, deadline_version,
    attempts, reason, reason_source, parked_at, archived_at, claimed_until, exchange,
    routing_key, message_id, headers, body";

fn row(r: &tokio_postgres::Row) -> Result<Row, DbError> {
    let body: Vec<u8> = column(r, "body")?;
    let mut kind: Kind = from_word(column(r, "kind")?).unwrap_or(Kind::Unreadable);
    // A body an older worker archived as unreadable (a pack, a deadline of a kind)
    // that this one reads is a timeout.
    let (timeout, pack) = match kind {
        Kind::Timeout | Kind::Unreadable => super::entry::timeouts(&body),
        Kind::Release => (None, Vec::new()),
    };
    if kind == Kind::Unreadable && timeout.is_some() {
        kind = Kind::Timeout;
    }
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
            pack,
        },
        archived_at: column(r, "archived_at")?,
        claimed_until: column(r, "claimed_until")?,
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
    let mut client = pool.get().await?;
    let tx = crate::db::begin_short(&mut client, pool.limits(), None).await?;
    let selection = selection.cloned().unwrap_or_else(Selection::all);
    let mut rows = selected(
        &tx,
        prefix,
        &selection,
        "AND seq > $5 ORDER BY seq LIMIT $6",
        &[(&after, Type::INT8), (&limit.saturating_add(1), Type::INT8)],
    )
    .await?;
    tx.commit().await?;
    let more = i64::try_from(rows.len()).unwrap_or(i64::MAX) > limit;
    rows.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
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
    let mut client = pool.get().await?;
    let tx = crate::db::begin_short(&mut client, pool.limits(), None).await?;
    let rows = tx
        .query_typed(
            "SELECT c.cause, c.count, c.oldest, c.newest,
                    (SELECT reason FROM lapse_parked p
                      WHERE p.prefix = $1 AND p.cause = c.cause
                      ORDER BY p.seq DESC LIMIT 1) AS example
               FROM (SELECT cause, count(*) AS count,
                            min(coalesce(parked_at, archived_at)) AS oldest,
                            max(coalesce(parked_at, archived_at)) AS newest
                       FROM lapse_parked WHERE prefix = $1 GROUP BY cause) c
              ORDER BY c.count DESC, c.cause",
            &[(&prefix, Type::TEXT)],
        )
        .await?;
    tx.commit().await?;
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
/// holds, or a replay has claimed, are skipped), in book order.
pub async fn select_for_update(
    tx: &tokio_postgres::Transaction<'_>,
    prefix: &str,
    selection: &Selection,
) -> Result<Vec<Row>, DbError> {
    selected(
        tx,
        prefix,
        selection,
        &format!("AND {UNCLAIMED} ORDER BY seq FOR UPDATE SKIP LOCKED"),
        &[],
    )
    .await
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

/// How long a replay's claim on its rows lasts: a replay that died mid-way leaves its
/// rows to the next one after this.
pub fn claim_for(confirm_timeout: Duration) -> Duration {
    confirm_timeout
        .saturating_mul(4)
        .max(Duration::from_secs(60))
}

/// The newest row of `prefix` now: a replay takes nothing archived after it starts
/// (a message it replays that comes straight back to parked is not replayed again).
pub async fn last_seq(pool: &Pool, prefix: &str) -> Result<i64, DbError> {
    let mut client = pool.get().await?;
    let tx = crate::db::begin_short(&mut client, pool.limits(), None).await?;
    let row = tx
        .query_typed_one(
            "SELECT coalesce(max(seq), 0) AS seq FROM lapse_parked WHERE prefix = $1",
            &[(&prefix, Type::TEXT)],
        )
        .await?;
    tx.commit().await?;
    column(&row, "seq")
}

/// The selected rows (up to `upto`) a replay holds right now.
pub async fn held(
    pool: &Pool,
    prefix: &str,
    selection: &Selection,
    upto: i64,
) -> Result<Vec<Row>, DbError> {
    let mut client = pool.get().await?;
    let tx = crate::db::begin_short(&mut client, pool.limits(), None).await?;
    let rows = selected(
        &tx,
        prefix,
        selection,
        "AND seq <= $5 AND claimed_until >= clock_timestamp() ORDER BY seq",
        &[(&upto, Type::INT8)],
    )
    .await?;
    tx.commit().await?;
    Ok(rows)
}

/// A replay's claim: its token and how long it lasts.
pub struct Claim {
    pub token: String,
    pub lasts: Duration,
}

impl Claim {
    pub fn new(confirm_timeout: Duration) -> Self {
        Self {
            token: format!("{:016x}-{}", fastrand::u64(..), std::process::id()),
            lasts: claim_for(confirm_timeout),
        }
    }
}

/// Claims up to `limit` selected rows in `(after, upto]` that no other replay holds, in
/// book order — in a short transaction of its own, so nothing is held open while the
/// broker is asked. With `dry_run` nothing is claimed.
#[allow(clippy::too_many_arguments)]
pub async fn claim(
    pool: &Pool,
    prefix: &str,
    selection: &Selection,
    after: i64,
    upto: i64,
    limit: i64,
    claim: &Claim,
    dry_run: bool,
) -> Result<Vec<Row>, DbError> {
    let mut client = pool.get().await?;
    let tx = crate::db::begin_short(&mut client, pool.limits(), None).await?;
    let rows = selected(
        &tx,
        prefix,
        selection,
        &format!(
            "AND seq > $5 AND seq <= $6 AND {UNCLAIMED} ORDER BY seq LIMIT $7 FOR UPDATE SKIP LOCKED"
        ),
        &[(&after, Type::INT8), (&upto, Type::INT8), (&limit, Type::INT8)],
    )
    .await?;
    if !dry_run && !rows.is_empty() {
        let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
        let ms = i64::try_from(claim.lasts.as_millis()).unwrap_or(i64::MAX);
        tx.execute_typed(
            "UPDATE lapse_parked
                SET claimed_until = clock_timestamp() + $2::bigint * interval '1 millisecond',
                    claimed_by = $3
              WHERE seq = ANY($1)",
            &[
                (&seqs, Type::INT8_ARRAY),
                (&ms, Type::INT8),
                (&claim.token, Type::TEXT),
            ],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(rows)
}

/// Settles a replayed chunk under its claim: the rows whose destination confirmed
/// leave the book, the others are freed. A row whose claim passed and that another
/// replay claimed since is left to that replay.
pub async fn settle(pool: &Pool, claim: &Claim, done: &[i64], kept: &[i64]) -> Result<(), DbError> {
    let mut client = pool.get().await?;
    let tx = crate::db::begin_short(&mut client, pool.limits(), None).await?;
    tx.execute_typed(
        "DELETE FROM lapse_parked WHERE seq = ANY($1) AND claimed_by = $2",
        &[(&done, Type::INT8_ARRAY), (&claim.token, Type::TEXT)],
    )
    .await?;
    tx.execute_typed(
        "UPDATE lapse_parked SET claimed_until = NULL, claimed_by = NULL
          WHERE seq = ANY($1) AND claimed_by = $2",
        &[(&kept, Type::INT8_ARRAY), (&claim.token, Type::TEXT)],
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

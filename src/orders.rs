//! The application side: create an order with its timeout intent, extend its
//! deadline, pay it, show it. Each call runs on the caller's client or transaction,
//! so the order and its intent commit together with the caller's own writes. The
//! same operations exist as SQL functions (`lapse_create_order`, ...) for any language.
//!
//! The functions live in lapse's schema (`lapse`, or `public` for an installation an
//! earlier version made): call these on a transaction opened with [`crate::db::begin`]
//! (which puts the schema on its search path, also behind a pooler in transaction
//! mode), or on a connection whose search path includes `lapse`
//! ([`crate::db::app_pool`], or `ALTER ROLE app SET search_path = "$user", public, lapse`).

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use tokio_postgres::GenericClient;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

use crate::db::{DbError, column};
use crate::deadline::ceil_millis;

/// An order's id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct OrderId(pub i64);

impl fmt::Display for OrderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// One order line: `qty` units of `sku`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Line {
    pub sku: String,
    pub qty: i32,
}

impl std::str::FromStr for Line {
    type Err = String;
    /// Parses `SKU:QTY` (QTY a positive integer).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (sku, qty) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("`{s}` is not SKU:QTY"))?;
        let qty: i32 = qty
            .parse()
            .map_err(|_| format!("`{qty}` in `{s}` is not a whole number"))?;
        if sku.is_empty() || qty <= 0 {
            return Err(format!("`{s}` needs a SKU and a quantity of at least 1"));
        }
        Ok(Self {
            sku: sku.to_string(),
            qty,
        })
    }
}

/// When an order expires: an absolute instant, or a duration from the database's now.
/// The database checks it as it enters (finite, not in the past by more than 5 s,
/// within `orders.deadline_horizon`) and rounds it up to the millisecond; a refused
/// deadline is [`DbError::InvalidDeadline`].
#[derive(Clone, Copy, Debug)]
pub enum Deadline {
    At(DateTime<Utc>),
    In(Duration),
}

impl Deadline {
    /// `(absolute, milliseconds from now)`; a duration is rounded up, never down, and
    /// one that does not fit in milliseconds is refused rather than wrapped.
    fn sql_params(&self) -> Result<(Option<DateTime<Utc>>, i64), DbError> {
        match self {
            Deadline::At(t) => Ok((Some(*t), 0)),
            Deadline::In(d) => Ok((None, ceil_millis(*d).map_err(invalid)?)),
        }
    }
}

fn invalid(e: crate::deadline::DeadlineError) -> DbError {
    DbError::InvalidDeadline(e.to_string())
}

/// Errors of a statement whose only date arithmetic is the deadline: an overflow there
/// (SQLSTATE 22008, e.g. now() + 300000 years) is an invalid deadline too.
fn deadline_error(e: tokio_postgres::Error) -> DbError {
    if e.code() == Some(&SqlState::DATETIME_FIELD_OVERFLOW) {
        let detail = e.as_db_error().map_or("out of range", |d| d.message());
        return DbError::InvalidDeadline(format!("invalid deadline: {detail}"));
    }
    crate::db::refusal(e)
}

/// `$1` absolute or `now() + $2 ms`, evaluated by the database clock.
const DEADLINE_SQL: &str =
    "COALESCE($1::timestamptz, now() + $2::bigint * interval '1 millisecond')";

/// Gives each SKU `initial` units unless it already has a stock row.
pub async fn ensure_stock<C: GenericClient>(
    client: &C,
    skus: &[String],
    initial: i64,
) -> Result<(), DbError> {
    client
        .execute_typed(
            "INSERT INTO stock (sku, available) SELECT unnest($1::text[]), $2 ON CONFLICT DO NOTHING",
            &[(&skus, Type::TEXT_ARRAY), (&initial, Type::INT8)],
        )
        .await?;
    Ok(())
}

/// Creates an UNPAID order, reserves its lines and writes its timeout intent.
/// [`DbError::Refused`] when a SKU is unknown or short of stock,
/// [`DbError::InvalidDeadline`] when the deadline is refused.
pub async fn create<C: GenericClient>(
    client: &C,
    deadline: Deadline,
    lines: &[Line],
) -> Result<OrderId, DbError> {
    let (at, in_ms) = deadline.sql_params()?;
    let lines = json!(lines);
    let row = client
        .query_typed_one(
            &format!("SELECT lapse_create_order({DEADLINE_SQL}, $3::jsonb) AS id"),
            &[
                (&at, Type::TIMESTAMPTZ),
                (&in_ms, Type::INT8),
                (&lines, Type::JSONB),
            ],
        )
        .await
        .map_err(deadline_error)?;
    Ok(OrderId(column(&row, "id")?))
}

/// Moves the deadline of an UNPAID order whose deadline has not passed (by the real
/// clock) to a later one; returns the new deadline version, or `None` when refused
/// (not found, not UNPAID, deadline passed). A new deadline that is not later than the
/// current one is [`DbError::Refused`]; an invalid one [`DbError::InvalidDeadline`].
pub async fn extend<C: GenericClient>(
    client: &C,
    id: OrderId,
    deadline: Deadline,
) -> Result<Option<i32>, DbError> {
    let (at, in_ms) = deadline.sql_params()?;
    let row = client
        .query_typed_one(
            &format!("SELECT lapse_extend_deadline($3, {DEADLINE_SQL}) AS version"),
            &[
                (&at, Type::TIMESTAMPTZ),
                (&in_ms, Type::INT8),
                (&id.0, Type::INT8),
            ],
        )
        .await
        .map_err(deadline_error)?;
    column(&row, "version")
}

/// What a payment did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum PayOutcome {
    /// Accepted: the order was UNPAID and before its deadline.
    Paid,
    AlreadyPaid,
    /// Refused: the deadline passed (by the real clock); the close has not happened
    /// yet. Recorded once as a late payment to refund.
    Expired,
    /// Refused: the order was closed; recorded once as a late payment to refund.
    Late,
    NotFound,
}

/// Pays an order. An order whose stored deadline lies outside the range lapse handles
/// (a row older than the deadline rules) is refused with [`DbError::Refused`] (SQLSTATE
/// LP003) and nothing changes.
pub async fn pay<C: GenericClient>(client: &C, id: OrderId) -> Result<PayOutcome, DbError> {
    let row = client
        .query_typed_one(
            "SELECT lapse_pay_order($1) AS outcome",
            &[(&id.0, Type::INT8)],
        )
        .await
        .map_err(crate::db::refusal)?;
    let outcome: String = column(&row, "outcome")?;
    Ok(match outcome.as_str() {
        "PAID" => PayOutcome::Paid,
        "ALREADY_PAID" => PayOutcome::AlreadyPaid,
        "EXPIRED" => PayOutcome::Expired,
        "LATE" => PayOutcome::Late,
        _ => PayOutcome::NotFound,
    })
}

/// An order with its lines, ledger and timeline.
#[derive(Debug, Serialize)]
pub struct OrderView {
    pub id: OrderId,
    pub status: String,
    pub created_at: DateTime<Utc>,
    pub expire_at: DateTime<Utc>,
    pub deadline_version: i32,
    pub paid_at: Option<DateTime<Utc>>,
    pub closed_at: Option<DateTime<Utc>>,
    pub close_reason: Option<String>,
    pub lines: Vec<Line>,
    pub ledger: Vec<Value>,
    pub late_payments: i64,
    pub timeline: Vec<Value>,
}

/// An order as stored. [`DbError::Unreadable`] when a value cannot be decoded (e.g. a
/// deadline written before the deadline rules existed): the message names the raw value.
// Over 60 lines on purpose: one read and one struct literal; the length is the fields.
pub async fn show<C: GenericClient>(client: &C, id: OrderId) -> Result<Option<OrderView>, DbError> {
    let Some(row) = client
        .query_typed_opt(
            "SELECT status, created_at, expire_at, deadline_version, paid_at, closed_at, close_reason,
                    (SELECT count(*) FROM late_payments WHERE order_id = $1) AS late_payments,
                    expire_at::text AS raw
               FROM orders WHERE id = $1",
            &[(&id.0, Type::INT8)],
        )
        .await?
    else {
        return Ok(None);
    };
    let expire_at = column(&row, "expire_at")
        .and_then(|t| crate::deadline::checked(t).map_err(|e| DbError::Unreadable(e.to_string())))
        .map_err(|_| {
            let raw: String = column(&row, "raw").unwrap_or_else(|_| "?".into());
            DbError::Unreadable(format!(
                "order {id} has a deadline lapse cannot handle ({raw}); \
                 see \"Orders with an unreadable deadline\" in docs/operations.md"
            ))
        })?;
    let lines = client
        .query_typed(
            "SELECT sku, qty FROM order_lines WHERE order_id = $1 ORDER BY sku",
            &[(&id.0, Type::INT8)],
        )
        .await?
        .iter()
        .map(|r| {
            Ok(Line {
                sku: column(r, "sku")?,
                qty: column(r, "qty")?,
            })
        })
        .collect::<Result<_, DbError>>()?;
    let ledger = json_rows(
        client,
        "SELECT jsonb_build_object('sku', sku, 'kind', kind, 'qty', qty, 'at', at) AS entry
           FROM stock_ledger WHERE order_id = $1 ORDER BY at, sku",
        id,
    )
    .await?;
    let timeline = json_rows(
        client,
        "SELECT jsonb_build_object('at', at, 'event', event) || detail AS entry
           FROM order_events WHERE order_id = $1 ORDER BY at",
        id,
    )
    .await?;
    Ok(Some(OrderView {
        id,
        status: column(&row, "status")?,
        created_at: column(&row, "created_at")?,
        expire_at,
        deadline_version: column(&row, "deadline_version")?,
        paid_at: column(&row, "paid_at")?,
        closed_at: column(&row, "closed_at")?,
        close_reason: column(&row, "close_reason")?,
        late_payments: column(&row, "late_payments")?,
        lines,
        ledger,
        timeline,
    }))
}

async fn json_rows<C: GenericClient>(
    client: &C,
    sql: &str,
    id: OrderId,
) -> Result<Vec<Value>, DbError> {
    client
        .query_typed(sql, &[(&id.0, Type::INT8)])
        .await?
        .iter()
        .map(|r| column(r, "entry"))
        .collect()
}

/// Moves the deadline `by` later than it is now (see [`extend`]); `by` is rounded up
/// to the millisecond, and one too large to add is [`DbError::InvalidDeadline`].
pub async fn extend_by<C: GenericClient>(
    client: &C,
    id: OrderId,
    by: Duration,
) -> Result<Option<i32>, DbError> {
    let by_ms = ceil_millis(by).map_err(invalid)?;
    let row = client
        .query_typed_opt(
            "SELECT lapse_extend_deadline(id, expire_at + $2::bigint * interval '1 millisecond') AS version
               FROM orders WHERE id = $1",
            &[(&id.0, Type::INT8), (&by_ms, Type::INT8)],
        )
        .await
        .map_err(deadline_error)?;
    match row {
        Some(row) => column(&row, "version"),
        None => Ok(None),
    }
}

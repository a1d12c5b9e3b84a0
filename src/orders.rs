//! The application side: create an order with its timeout intent, extend its
//! deadline, pay it, show it. Each call runs on the caller's client or transaction,
//! so the order and its intent commit together with the caller's own writes. The
//! same operations exist as SQL functions (`lapse_create_order`, ...) for any language.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use tokio_postgres::GenericClient;

use crate::db::DbError;

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
#[derive(Clone, Copy, Debug)]
pub enum Deadline {
    At(DateTime<Utc>),
    In(Duration),
}

impl Deadline {
    fn sql_params(&self) -> (Option<DateTime<Utc>>, i64) {
        match self {
            Deadline::At(t) => (Some(*t), 0),
            Deadline::In(d) => (None, d.as_millis() as i64),
        }
    }
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
        .execute(
            "INSERT INTO stock (sku, available) SELECT unnest($1::text[]), $2 ON CONFLICT DO NOTHING",
            &[&skus, &initial],
        )
        .await?;
    Ok(())
}

/// Creates an UNPAID order, reserves its lines and writes its timeout intent.
/// [`DbError::Refused`] when a SKU is unknown or short of stock.
pub async fn create<C: GenericClient>(
    client: &C,
    deadline: Deadline,
    lines: &[Line],
) -> Result<OrderId, DbError> {
    let (at, in_ms) = deadline.sql_params();
    let lines = json!(lines);
    let row = client
        .query_one(
            &format!("SELECT lapse_create_order({DEADLINE_SQL}, $3::jsonb)"),
            &[&at, &in_ms, &lines],
        )
        .await
        .map_err(crate::db::refusal)?;
    Ok(OrderId(row.get(0)))
}

/// Moves the deadline of an UNPAID order whose deadline has not passed; returns the
/// new deadline version, or `None` when refused.
pub async fn extend<C: GenericClient>(
    client: &C,
    id: OrderId,
    deadline: Deadline,
) -> Result<Option<i32>, DbError> {
    let (at, in_ms) = deadline.sql_params();
    let row = client
        .query_one(
            &format!("SELECT lapse_extend_deadline($3, {DEADLINE_SQL})"),
            &[&at, &in_ms, &id.0],
        )
        .await?;
    Ok(row.get(0))
}

/// What a payment did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum PayOutcome {
    /// Accepted: the order was UNPAID and before its deadline.
    Paid,
    AlreadyPaid,
    /// Refused: the deadline passed; the close has not happened yet.
    Expired,
    /// Refused: the order was closed; recorded as a late payment to refund.
    Late,
    NotFound,
}

pub async fn pay<C: GenericClient>(client: &C, id: OrderId) -> Result<PayOutcome, DbError> {
    let row = client
        .query_one("SELECT lapse_pay_order($1)", &[&id.0])
        .await?;
    let outcome: String = row.get(0);
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

pub async fn show<C: GenericClient>(client: &C, id: OrderId) -> Result<Option<OrderView>, DbError> {
    let Some(row) = client
        .query_opt(
            "SELECT status, created_at, expire_at, deadline_version, paid_at, closed_at, close_reason,
                    (SELECT count(*) FROM late_payments WHERE order_id = $1)
               FROM orders WHERE id = $1",
            &[&id.0],
        )
        .await?
    else {
        return Ok(None);
    };
    let lines = client
        .query(
            "SELECT sku, qty FROM order_lines WHERE order_id = $1 ORDER BY sku",
            &[&id.0],
        )
        .await?
        .iter()
        .map(|r| Line {
            sku: r.get(0),
            qty: r.get(1),
        })
        .collect();
    let ledger = client
        .query(
            "SELECT jsonb_build_object('sku', sku, 'kind', kind, 'qty', qty, 'at', at)
               FROM stock_ledger WHERE order_id = $1 ORDER BY at, sku",
            &[&id.0],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let timeline = client
        .query(
            "SELECT jsonb_build_object('at', at, 'event', event) || detail
               FROM order_events WHERE order_id = $1 ORDER BY at",
            &[&id.0],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    Ok(Some(OrderView {
        id,
        status: row.get(0),
        created_at: row.get(1),
        expire_at: row.get(2),
        deadline_version: row.get(3),
        paid_at: row.get(4),
        closed_at: row.get(5),
        close_reason: row.get(6),
        late_payments: row.get(7),
        lines,
        ledger,
        timeline,
    }))
}

/// Moves the deadline `by` later than it is now (see [`extend`]).
pub async fn extend_by<C: GenericClient>(
    client: &C,
    id: OrderId,
    by: Duration,
) -> Result<Option<i32>, DbError> {
    let row = client
        .query_one(
            "SELECT lapse_extend_deadline($1,
                    (SELECT expire_at FROM orders WHERE id = $1) + $2::bigint * interval '1 millisecond')",
            &[&id.0, &(by.as_millis() as i64)],
        )
        .await?;
    Ok(row.get(0))
}

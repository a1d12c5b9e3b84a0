//! The demo's verdict, read from the database (the only source of truth): how every
//! order ended, whether any closed before its deadline, whether stock came back, and
//! the lateness of each close (`closed_at - expire_at`, both written by the
//! database: the same measure as `lapse_close_lateness_seconds` and `lapse status`).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::db::DbError;

/// One SKU's stock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StockRow {
    pub sku: String,
    pub available: i64,
    pub reserved: i64,
    pub sold: i64,
}

pub async fn stock<C: GenericClient>(client: &C) -> Result<Vec<StockRow>, DbError> {
    let rows = client
        .query_typed(
            "SELECT sku, available, reserved, sold FROM stock ORDER BY sku",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| StockRow {
            sku: r.get(0),
            available: r.get(1),
            reserved: r.get(2),
            sold: r.get(3),
        })
        .collect())
}

/// Units per SKU on the lines of PAID orders: what `sold` must have grown by.
pub async fn paid_units<C: GenericClient>(client: &C) -> Result<BTreeMap<String, i64>, DbError> {
    let rows = client
        .query_typed(
            "SELECT l.sku, sum(l.qty)::int8 AS units
               FROM order_lines l JOIN orders o ON o.id = l.order_id
              WHERE o.status = 'PAID' GROUP BY l.sku",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get("sku"), r.get("units")))
        .collect())
}

/// Orders not yet settled (UNPAID) and units still reserved.
pub async fn unsettled<C: GenericClient>(client: &C) -> Result<(i64, i64), DbError> {
    let row = client
        .query_typed_one(
            "SELECT (SELECT count(*) FROM orders WHERE status = 'UNPAID'),
                    (SELECT COALESCE(sum(reserved), 0)::bigint FROM stock)",
            &[],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// Milliseconds at the 50th, 90th and 99th percentile (nearest rank) and the maximum.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Lateness {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Lateness {
    pub fn of(sorted: &[f64]) -> Option<Self> {
        let rank = |q: f64| {
            let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
            sorted[i - 1]
        };
        (!sorted.is_empty()).then(|| Self {
            p50: rank(0.5),
            p90: rank(0.9),
            p99: rank(0.99),
            max: sorted[sorted.len() - 1],
        })
    }
}

/// Every close, for the picture: seconds from the start to the deadline and to the
/// close, and the lateness in milliseconds.
#[derive(Clone, Debug, Default)]
pub struct Closes {
    pub due_s: Vec<f64>,
    pub closed_s: Vec<f64>,
    /// Sorted ascending.
    pub lateness_ms: Vec<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub orders: u64,
    pub duration_s: f64,
    pub prefix: String,
    pub database: String,
    pub closed: i64,
    pub closed_by_timeout: i64,
    pub closed_by_sweeper: i64,
    pub paid: i64,
    /// Still UNPAID at the end: lost (must be 0).
    pub open: i64,
    pub extended: i64,
    /// Payments made after the deadline, refused and recorded for a refund.
    pub late_payments_refused: i64,
    /// Payments made after the deadline and accepted (must be 0).
    pub late_payments_accepted: u64,
    /// Closed before the deadline (must be 0).
    pub early: i64,
    pub stock_consistent: bool,
    pub stock_start: Vec<StockRow>,
    pub stock_end: Vec<StockRow>,
    /// Close lateness in milliseconds; null when nothing closed.
    pub lateness_ms: Option<Lateness>,
    /// Closes by the number of wait-queue hops their message took (0: the sweeper).
    pub hops: BTreeMap<i32, i64>,
    /// Early payments or extensions that ran after the deadline on a slow machine.
    pub actions_too_late: u64,
    /// Payments or extensions that failed with an error.
    pub action_errors: u64,
    pub svg: Option<String>,
    pub kept: bool,
    /// What is wrong (empty when all is well): any makes the exit status 1.
    pub problems: Vec<String>,
}

/// Reads the final state. `start` is the database's clock when the run began.
pub async fn gather<C: GenericClient>(
    client: &C,
    start: DateTime<Utc>,
) -> Result<(Partial, Closes), DbError> {
    let row = client
        .query_typed_one(
            "SELECT count(*) FILTER (WHERE status = 'CLOSED'),
                    count(*) FILTER (WHERE status = 'CLOSED' AND close_reason = 'timeout'),
                    count(*) FILTER (WHERE status = 'CLOSED' AND close_reason = 'sweeper'),
                    count(*) FILTER (WHERE status = 'PAID'),
                    count(*) FILTER (WHERE status = 'UNPAID'),
                    count(*) FILTER (WHERE deadline_version > 1),
                    count(*) FILTER (WHERE closed_at < expire_at),
                    (SELECT count(*) FROM late_payments),
                    count(*)
               FROM orders",
            &[],
        )
        .await?;
    let partial = Partial {
        closed: row.get(0),
        closed_by_timeout: row.get(1),
        closed_by_sweeper: row.get(2),
        paid: row.get(3),
        open: row.get(4),
        extended: row.get(5),
        early: row.get(6),
        late_payments_refused: row.get(7),
        total: row.get(8),
        hops: hops(client).await?,
    };
    let rows = client
        .query_typed(
            "SELECT extract(epoch FROM expire_at - $1)::float8,
                    extract(epoch FROM closed_at - $1)::float8,
                    extract(epoch FROM closed_at - expire_at)::float8 * 1000
               FROM orders WHERE status = 'CLOSED' ORDER BY closed_at",
            &[(&start, tokio_postgres::types::Type::TIMESTAMPTZ)],
        )
        .await?;
    let mut closes = Closes::default();
    for r in &rows {
        closes.due_s.push(r.get(0));
        closes.closed_s.push(r.get(1));
        closes.lateness_ms.push(r.get(2));
    }
    closes.lateness_ms.sort_by(f64::total_cmp);
    Ok((partial, closes))
}

async fn hops<C: GenericClient>(client: &C) -> Result<BTreeMap<i32, i64>, DbError> {
    let rows = client
        .query_typed(
            "SELECT COALESCE((detail->>'hops')::int, 0), count(*)
               FROM order_events WHERE event = 'closed' GROUP BY 1 ORDER BY 1",
            &[],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// The counts read by [`gather`].
#[derive(Clone, Debug, Default)]
pub struct Partial {
    pub closed: i64,
    pub closed_by_timeout: i64,
    pub closed_by_sweeper: i64,
    pub paid: i64,
    pub open: i64,
    pub extended: i64,
    pub early: i64,
    pub late_payments_refused: i64,
    pub total: i64,
    pub hops: BTreeMap<i32, i64>,
}

/// Stock is consistent when nothing stays reserved beyond the start's reservations,
/// every unit is either available or sold, as at the start, and exactly the units of
/// the paid orders' lines were sold (`paid`: units per SKU).
pub fn stock_consistent(
    start: &[StockRow],
    end: &[StockRow],
    paid: &BTreeMap<String, i64>,
) -> bool {
    start.len() == end.len()
        && start.iter().zip(end).all(|(s, e)| {
            s.sku == e.sku
                && e.reserved == s.reserved
                && e.available + e.sold == s.available + s.sold
                && e.sold - s.sold == paid.get(&s.sku).copied().unwrap_or(0)
        })
}

impl Report {
    /// Fills `problems` from the counts; true when there is none.
    pub fn judge(&mut self) -> bool {
        let mut problems = Vec::new();
        if self.early > 0 {
            problems.push(format!(
                "{} order(s) closed before their deadline",
                self.early
            ));
        }
        if self.open > 0 {
            problems.push(format!("{} order(s) still open at the end", self.open));
        }
        let settled = self.closed + self.paid;
        if settled != self.orders as i64 {
            problems.push(format!(
                "{settled} order(s) closed or paid, {} scheduled",
                self.orders
            ));
        }
        if !self.stock_consistent {
            problems.push("stock is not back to its starting values".into());
        }
        if self.late_payments_accepted > 0 {
            problems.push(format!(
                "{} payment(s) after the deadline were accepted",
                self.late_payments_accepted
            ));
        }
        problems.extend(std::mem::take(&mut self.problems));
        self.problems = problems;
        self.problems.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let l = Lateness::of(&v).unwrap();
        assert_eq!((l.p50, l.p90, l.p99, l.max), (50.0, 90.0, 99.0, 100.0));
        assert_eq!(Lateness::of(&[]), None);
        assert_eq!(Lateness::of(&[3.0]).unwrap().p50, 3.0);
    }

    #[test]
    fn stock_is_consistent_only_when_reservations_return() {
        let row = |available, reserved, sold| StockRow {
            sku: "apple".into(),
            available,
            reserved,
            sold,
        };
        let paid = |n| BTreeMap::from([("apple".to_string(), n)]);
        assert!(stock_consistent(
            &[row(10, 0, 0)],
            &[row(7, 0, 3)],
            &paid(3)
        ));
        assert!(!stock_consistent(
            &[row(10, 0, 0)],
            &[row(7, 1, 2)],
            &paid(2)
        ));
        assert!(!stock_consistent(
            &[row(10, 0, 0)],
            &[row(8, 0, 3)],
            &paid(3)
        ));
        // Units conserved, but sold for orders that were not paid (or paid but unsold).
        assert!(!stock_consistent(
            &[row(10, 0, 0)],
            &[row(7, 0, 3)],
            &paid(2)
        ));
        assert!(stock_consistent(
            &[row(10, 0, 0)],
            &[row(10, 0, 0)],
            &BTreeMap::new()
        ));
    }
}

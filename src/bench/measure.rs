//! Reading what happened from the database, the one clock that decides: lateness is
//! `closed_at - expire_at` as PostgreSQL recorded it.

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use super::progress::Progress;
use super::report::{Lateness, ScenarioReport};

/// Waits until no order is UNPAID and every closed order's stock is released, or
/// `limit` passed. Returns the orders still open or unreleased (lost if non-zero).
///
/// The poll counts only what is still pending, through the two partial indexes lapse
/// keeps for it (`UNPAID` orders and closed orders without `released_at`), instead of
/// joining every order to the ledger five times a second, so it takes little of the
/// database's CPU from the drain it measures, and less as the drain goes on. The answer then
/// comes from the ledger itself, once: a closed order without its `release` rows is
/// lost whatever its stamp says.
pub async fn wait_settled(
    db: &Client,
    total: u64,
    limit: Duration,
    progress: &Progress,
) -> anyhow::Result<u64> {
    let until = Instant::now() + limit;
    loop {
        let row = db
            .query_one(
                "SELECT (SELECT count(*) FROM orders WHERE status = 'UNPAID'),
                        (SELECT count(*) FROM orders WHERE status = 'CLOSED' AND released_at IS NULL)",
                &[],
            )
            .await?;
        let (open, unstamped): (i64, i64) = (row.get(0), row.get(1));
        progress.set(total.saturating_sub(open as u64));
        if open + unstamped == 0 || Instant::now() >= until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let row = db
        .query_one(
            "SELECT (SELECT count(*) FROM orders WHERE status = 'UNPAID'),
                    (SELECT count(*) FROM orders o WHERE status = 'CLOSED' AND NOT EXISTS
                       (SELECT 1 FROM stock_ledger l WHERE l.order_id = o.id AND l.kind = 'release'))",
            &[],
        )
        .await?;
    let (open, unreleased): (i64, i64) = (row.get(0), row.get(1));
    Ok((open + unreleased) as u64)
}

/// Fills lateness, early count, hops, paths and closes/s over time from the closes
/// of orders whose id is above `after_id` (orders of earlier phases excluded).
pub async fn closes(db: &Client, report: &mut ScenarioReport, after_id: i64) -> anyhow::Result<()> {
    let rows = db
        .query(
            "SELECT extract(epoch FROM o.closed_at - o.expire_at)::float8 * 1000,
                    extract(epoch FROM o.closed_at)::float8,
                    coalesce(o.close_reason, '?'),
                    coalesce((SELECT (e.detail->>'hops')::int FROM order_events e
                               WHERE e.order_id = o.id AND e.event = 'closed' LIMIT 1), 0)
               FROM orders o WHERE o.status = 'CLOSED' AND o.id > $1",
            &[&after_id],
        )
        .await?;
    let mut lateness = Vec::with_capacity(rows.len());
    let mut at = Vec::with_capacity(rows.len());
    for r in &rows {
        let ms: f64 = r.get(0);
        if ms < 0.0 {
            report.early += 1;
        }
        lateness.push(ms);
        at.push(r.get::<_, f64>(1));
        *report.closed_by.entry(r.get::<_, String>(2)).or_default() += 1;
        let hops: i32 = r.get(3);
        *report.hops.entry(hops.max(0) as u32).or_default() += 1;
    }
    report.lateness_ms = Lateness::of(&mut lateness);
    report.samples = lateness;
    report.closes_per_s = per_100ms(&mut at);
    if let (Some(first), Some(last)) = (at.first(), at.last()) {
        let span = last - first;
        report.figure("first_to_last_close_s", span);
        if span > 0.0 {
            report.figure("closes_per_s", (at.len() - 1) as f64 / span);
        }
    }
    Ok(())
}

/// Closes per second in 100 ms buckets from the first close.
fn per_100ms(at: &mut [f64]) -> Vec<f64> {
    at.sort_by(|a, b| a.total_cmp(b));
    let Some(first) = at.first().copied() else {
        return Vec::new();
    };
    let mut buckets: Vec<f64> = Vec::new();
    for t in at.iter() {
        let i = ((t - first) * 10.0) as usize;
        if buckets.len() <= i {
            buckets.resize(i + 1, 0.0);
        }
        buckets[i] += 10.0;
    }
    buckets
}

/// The highest order id so far (0 for none).
pub async fn last_id(db: &Client) -> anyhow::Result<i64> {
    Ok(db
        .query_one("SELECT coalesce(max(id), 0) FROM orders", &[])
        .await?
        .get(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_count_closes_per_second() {
        let mut at = vec![10.0, 10.05, 10.15, 10.31];
        assert_eq!(per_100ms(&mut at), vec![20.0, 10.0, 0.0, 10.0]);
    }
}

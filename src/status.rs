//! `lapse status`: one look at the health of a deployment — tier and queue depths
//! from the broker, overdue UNPAID orders and the outbox from the database, the
//! lateness of recent closes, and the stock releases the reconciler had to repair.
//!
//! Consumer counts and depths come from a passive queue declare (AMQP alone, no
//! management API). [`check`] turns a status into the problems a monitoring script
//! acts on; [`watch`] follows the backlog's drain rate between refreshes.

pub mod check;
pub mod watch;

use std::time::Duration;

use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::amqp::broker::{self, BrokerError};
use crate::amqp::topology::{QueueRole, Topology};
use crate::db::{DbError, column};

#[derive(Debug, Serialize)]
pub struct QueueDepth {
    pub queue: String,
    /// `wait <tier>`, `due`, `parked` or `stock release`.
    pub role: String,
    /// Ready messages; `None` when the queue does not exist.
    pub messages: Option<u32>,
    /// Consumers attached; `None` when the queue does not exist.
    pub consumers: Option<u32>,
}

#[derive(Debug, Serialize)]
pub struct Status {
    pub queues: Vec<QueueDepth>,
    pub overdue_unpaid: i64,
    pub oldest_overdue_ms: Option<f64>,
    /// UNPAID orders whose deadline lies outside the range lapse handles (written
    /// before the deadline rules existed): never closed until repaired.
    pub unreadable_deadlines: i64,
    pub outbox_rows: i64,
    pub oldest_outbox_ms: Option<f64>,
    /// Outbox rows the broker refused (a full tier) or returned (no queue bound),
    /// waiting for their retry.
    pub outbox_retrying: i64,
    pub recent_window_minutes: i64,
    pub recent_closes: i64,
    pub recent_sweeper_closes: i64,
    /// Orders whose lost stock release the reconciler emitted again within the
    /// window (should be 0).
    pub recent_release_repairs: i64,
    /// Re-emissions ever (should be 0).
    pub release_repairs_total: i64,
    /// CLOSED orders whose stock release has not happened `release_grace_ms` after the
    /// close (the reconciler re-emits them; should be 0).
    pub releases_missing: i64,
    pub oldest_missing_release_ms: Option<f64>,
    pub release_grace_ms: u64,
    /// Of those, orders the reconciler gave up on after every re-emission.
    pub releases_exhausted: i64,
    pub lateness_p50_ms: Option<f64>,
    pub lateness_p99_ms: Option<f64>,
    pub lateness_max_ms: Option<f64>,
}

/// Closes in this many minutes count as recent.
const RECENT_MINUTES: i64 = 5;

/// [`collect_with_grace`] with the default `sweeper.release_grace`.
pub async fn collect<C: GenericClient>(
    conn: &lapin::Connection,
    db: &C,
    topology: &Topology,
) -> Result<Status, StatusError> {
    let grace = crate::config::Config::default().sweeper.release_grace;
    collect_with_grace(conn, db, topology, grace).await
}

/// The status; a release counts as missing `release_grace` after its order closed.
// Over 60 lines on purpose: one query per figure `lapse status` shows, then one struct literal.
pub async fn collect_with_grace<C: GenericClient>(
    conn: &lapin::Connection,
    db: &C,
    topology: &Topology,
    release_grace: Duration,
) -> Result<Status, StatusError> {
    let mut queues = Vec::new();
    for q in &topology.queues {
        let counts = broker::queue_state(conn, &q.name).await?.counts();
        queues.push(QueueDepth {
            queue: q.name.clone(),
            role: role_name(&q.role),
            messages: counts.map(|c| c.messages),
            consumers: counts.map(|c| c.consumers),
        });
    }
    let sane = crate::deadline::in_range_sql("expire_at");
    let overdue = db
        .query_one(
            &format!(
                "SELECT count(*) FILTER (WHERE {sane}) AS overdue,
                        extract(epoch FROM now() - min(expire_at) FILTER (WHERE {sane}))::float8 * 1000 AS oldest_ms,
                        count(*) FILTER (WHERE NOT {sane}) AS unreadable
                   FROM orders WHERE status = 'UNPAID' AND (expire_at <= now() OR NOT {sane})"
            ),
            &[],
        )
        .await
        .map_err(DbError::from)?;
    let outbox = db
        .query_one(
            "SELECT count(*) AS waiting,
                    extract(epoch FROM clock_timestamp() - min(created_at))::float8 * 1000 AS oldest_ms,
                    count(*) FILTER (WHERE attempts > 0) AS retrying
               FROM outbox",
            &[],
        )
        .await
        .map_err(DbError::from)?;
    let recent = db
        .query_one(
            &format!(
                "SELECT count(*) AS closes, count(*) FILTER (WHERE close_reason = 'sweeper') AS swept,
                        percentile_cont(0.5) WITHIN GROUP (ORDER BY ms) AS p50_ms,
                        percentile_cont(0.99) WITHIN GROUP (ORDER BY ms) AS p99_ms, max(ms) AS max_ms
                   FROM (SELECT close_reason, extract(epoch FROM closed_at - expire_at)::float8 * 1000 AS ms
                           FROM orders
                          WHERE closed_at > now() - $1::bigint * interval '1 minute' AND {sane}) r"
            ),
            &[&RECENT_MINUTES],
        )
        .await
        .map_err(DbError::from)?;
    let (recent_release_repairs, release_repairs_total) =
        crate::components::reconciler::repairs(db, RECENT_MINUTES).await?;
    let grace_ms = i64::try_from(release_grace.as_millis()).unwrap_or(i64::MAX);
    // Served by the small partial index `orders_unreleased`.
    let missing = db
        .query_one(
            "SELECT count(*) AS missing, extract(epoch FROM now() - min(closed_at))::float8 * 1000 AS oldest_ms,
                    count(*) FILTER (WHERE release_repairs >= $2) AS exhausted
               FROM orders
              WHERE status = 'CLOSED' AND released_at IS NULL
                AND closed_at < now() - $1::bigint * interval '1 millisecond'",
            &[&grace_ms, &crate::components::reconciler::MAX_REPAIRS],
        )
        .await
        .map_err(DbError::from)?;
    Ok(Status {
        queues,
        overdue_unpaid: column(&overdue, "overdue")?,
        oldest_overdue_ms: column(&overdue, "oldest_ms")?,
        unreadable_deadlines: column(&overdue, "unreadable")?,
        outbox_rows: column(&outbox, "waiting")?,
        oldest_outbox_ms: column(&outbox, "oldest_ms")?,
        outbox_retrying: column(&outbox, "retrying")?,
        recent_window_minutes: RECENT_MINUTES,
        recent_closes: column(&recent, "closes")?,
        recent_sweeper_closes: column(&recent, "swept")?,
        recent_release_repairs,
        release_repairs_total,
        releases_missing: column(&missing, "missing")?,
        oldest_missing_release_ms: column(&missing, "oldest_ms")?,
        release_grace_ms: u64::try_from(grace_ms).unwrap_or(u64::MAX),
        releases_exhausted: column(&missing, "exhausted")?,
        lateness_p50_ms: column(&recent, "p50_ms")?,
        lateness_p99_ms: column(&recent, "p99_ms")?,
        lateness_max_ms: column(&recent, "max_ms")?,
    })
}

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error(transparent)]
    Broker(#[from] BrokerError),
    #[error(transparent)]
    Db(#[from] DbError),
}

fn role_name(role: &QueueRole) -> String {
    match role {
        QueueRole::Wait(tier) => format!("wait {tier}"),
        QueueRole::Due => "due".into(),
        QueueRole::Parked => "parked".into(),
        QueueRole::StockRelease => "stock release".into(),
    }
}

impl Status {
    /// The queue of `role` (`due`, `parked`, `stock release`).
    pub fn queue(&self, role: &str) -> Option<&QueueDepth> {
        self.queues.iter().find(|q| q.role == role)
    }

    /// Timeouts not yet decided: ready messages in the wait tiers and the due queue.
    pub fn backlog(&self) -> u64 {
        self.queues
            .iter()
            .filter(|q| q.role == "due" || q.role.starts_with("wait "))
            .filter_map(|q| q.messages)
            .map(u64::from)
            .sum()
    }

    pub fn render(&self) -> String {
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1} ms"));
        let mut out = String::new();
        for q in &self.queues {
            if q.consumers == Some(0) && matches!(q.role.as_str(), "due" | "stock release") {
                out.push_str(&format!(
                    "NO CONSUMER on {} ({}): no worker is running for this prefix\n",
                    q.queue, q.role
                ));
            }
        }
        out.push_str(&format!(
            "QUEUES\n  {:<40} {:<14} {:>9} {:>9}\n",
            "name", "role", "messages", "consumers"
        ));
        for q in &self.queues {
            let depth = q.messages.map_or("MISSING".to_string(), |n| n.to_string());
            let consumers = q.consumers.map_or("-".to_string(), |n| n.to_string());
            out.push_str(&format!(
                "  {:<40} {:<14} {depth:>9} {consumers:>9}\n",
                q.queue, q.role
            ));
        }
        out.push_str(&format!(
            "ORDERS\n  overdue UNPAID     {} (oldest {})\n  outbox rows        {} (oldest {}, {} refused or unroutable)\n",
            self.overdue_unpaid,
            ms(self.oldest_overdue_ms),
            self.outbox_rows,
            ms(self.oldest_outbox_ms),
            self.outbox_retrying,
        ));
        if self.unreadable_deadlines > 0 {
            out.push_str(&format!(
                "  UNREADABLE         {} UNPAID orders with a deadline lapse cannot handle (docs/operations.md)\n",
                self.unreadable_deadlines
            ));
        }
        out.push_str(&format!(
            "CLOSES (last {} min)\n  closed             {} ({} by the sweeper)\n  release repairs    {} ({} ever)\n  lateness           p50 {}, p99 {}, max {}\n",
            self.recent_window_minutes,
            self.recent_closes,
            self.recent_sweeper_closes,
            self.recent_release_repairs,
            self.release_repairs_total,
            ms(self.lateness_p50_ms),
            ms(self.lateness_p99_ms),
            ms(self.lateness_max_ms),
        ));
        out.push_str(&format!(
            "RELEASES\n  missing            {} closed more than {} ago without a stock release (oldest {}, {} given up by the reconciler)\n",
            self.releases_missing,
            humantime::format_duration(Duration::from_millis(self.release_grace_ms)),
            ms(self.oldest_missing_release_ms),
            self.releases_exhausted,
        ));
        out
    }
}

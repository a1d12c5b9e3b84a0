//! `lapse status`: one look at the health of a deployment — tier and queue depths
//! from the broker, overdue UNPAID orders and the outbox from the database, the
//! lateness of recent closes, and the stock releases the reconciler had to repair.
//!
//! Consumer counts and depths come from a passive queue declare (AMQP alone, no
//! management API). [`check`] turns a status into the problems a monitoring script
//! acts on; [`watch`] follows the backlog's drain rate between refreshes.

pub mod check;
mod render;
pub mod watch;

use std::time::Duration;

use serde::Serialize;
use tokio_postgres::GenericClient;
use tokio_postgres::types::Type;

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
    /// Parked messages already moved into the parked book (`lapse parked counts`);
    /// those still in the parked queue are its depth.
    pub parked_entries: i64,
    /// Rows retention pruned ever (timeline, ledger, settled late payments).
    pub retention_pruned: i64,
    /// How long ago the last retention batch ran; `None` before the first.
    pub retention_last_ms: Option<f64>,
    /// Pending deadlines of each kind (docs/adopting.md), all shards together; left
    /// out when there are none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kinds: Vec<crate::kinds::status::KindFigures>,
    /// With `database.shards`: each shard's own figures (the fields above are then
    /// all shards together: counts summed, the oldest of each, the worst lateness).
    /// Empty, and left out, with one database.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<ShardStatus>,
}

/// One order database's figures, as `lapse status` shows them per shard.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ShardStatus {
    pub shard: u16,
    pub overdue_unpaid: i64,
    pub oldest_overdue_ms: Option<f64>,
    pub unreadable_deadlines: i64,
    pub outbox_rows: i64,
    pub oldest_outbox_ms: Option<f64>,
    pub outbox_retrying: i64,
    pub recent_closes: i64,
    pub recent_sweeper_closes: i64,
    pub recent_release_repairs: i64,
    pub release_repairs_total: i64,
    pub releases_missing: i64,
    pub oldest_missing_release_ms: Option<f64>,
    pub releases_exhausted: i64,
    pub lateness_p50_ms: Option<f64>,
    pub lateness_p99_ms: Option<f64>,
    pub lateness_max_ms: Option<f64>,
    pub parked_entries: i64,
    pub retention_pruned: i64,
    pub retention_last_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kinds: Vec<crate::kinds::status::KindFigures>,
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

/// The status of one database; a release counts as missing `release_grace` after its
/// order closed.
pub async fn collect_with_grace<C: GenericClient>(
    conn: &lapin::Connection,
    db: &C,
    topology: &Topology,
    release_grace: Duration,
) -> Result<Status, StatusError> {
    let queues = queue_depths(conn, topology, broker::DEFAULT_CONFIRM_TIMEOUT).await?;
    let orders = order_figures(db, &topology.prefix, 0, release_grace).await?;
    Ok(Status::new(queues, vec![orders], release_grace, false))
}

/// Depth and consumers of every queue of `topology` (passive declares, each reply
/// waited for at most `reply_timeout`: a silent broker fails the status, it does not
/// hang it).
pub async fn queue_depths(
    conn: &lapin::Connection,
    topology: &Topology,
    reply_timeout: Duration,
) -> Result<Vec<QueueDepth>, StatusError> {
    let mut queues = Vec::new();
    for q in &topology.queues {
        let counts = broker::queue_state_within(conn, &q.name, reply_timeout)
            .await?
            .counts();
        queues.push(QueueDepth {
            queue: q.name.clone(),
            role: role_name(&q.role),
            messages: counts.map(|c| c.messages),
            consumers: counts.map(|c| c.consumers),
        });
    }
    Ok(queues)
}

/// One shard's figures from its database.
// Over 60 lines on purpose: one query per figure `lapse status` shows, then one struct literal.
pub async fn order_figures<C: GenericClient>(
    db: &C,
    prefix: &str,
    shard: u16,
    release_grace: Duration,
) -> Result<ShardStatus, StatusError> {
    let sane = crate::deadline::in_range_sql("expire_at");
    let overdue = db
        .query_typed_one(
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
        .query_typed_one(
            "SELECT count(*) AS waiting,
                    extract(epoch FROM clock_timestamp() - min(created_at))::float8 * 1000 AS oldest_ms,
                    count(*) FILTER (WHERE attempts > 0) AS retrying
               FROM outbox",
            &[],
        )
        .await
        .map_err(DbError::from)?;
    let recent = db
        .query_typed_one(
            &format!(
                "SELECT count(*) AS closes, count(*) FILTER (WHERE close_reason = 'sweeper') AS swept,
                        percentile_cont(0.5) WITHIN GROUP (ORDER BY ms) AS p50_ms,
                        percentile_cont(0.99) WITHIN GROUP (ORDER BY ms) AS p99_ms, max(ms) AS max_ms
                   FROM (SELECT close_reason, extract(epoch FROM closed_at - expire_at)::float8 * 1000 AS ms
                           FROM orders
                          WHERE closed_at > now() - $1::bigint * interval '1 minute' AND {sane}) r"
            ),
            &[(&RECENT_MINUTES, Type::INT8)],
        )
        .await
        .map_err(DbError::from)?;
    let (recent_release_repairs, release_repairs_total) =
        crate::components::reconciler::repairs(db, RECENT_MINUTES).await?;
    let grace_ms = i64::try_from(release_grace.as_millis()).unwrap_or(i64::MAX);
    // Served by the small partial index `orders_unreleased`.
    let missing = db
        .query_typed_one(
            "SELECT count(*) AS missing, extract(epoch FROM now() - min(closed_at))::float8 * 1000 AS oldest_ms,
                    count(*) FILTER (WHERE release_repairs >= $2) AS exhausted
               FROM orders
              WHERE status = 'CLOSED' AND released_at IS NULL
                AND closed_at < now() - $1::bigint * interval '1 millisecond'",
            &[
                (&grace_ms, Type::INT8),
                (&crate::components::reconciler::MAX_REPAIRS, Type::INT4),
            ],
        )
        .await
        .map_err(DbError::from)?;
    let (retention_pruned, retention_last_ms) = crate::components::retention::pruned(db).await?;
    let parked_entries = crate::parked::book::total(db, prefix).await?;
    let kinds = crate::kinds::status::figures(db).await?;
    let (kind_rows, kind_oldest_ms, kind_retrying) = crate::kinds::status::outbox(db).await?;
    Ok(ShardStatus {
        shard,
        overdue_unpaid: column(&overdue, "overdue")?,
        oldest_overdue_ms: column(&overdue, "oldest_ms")?,
        unreadable_deadlines: column(&overdue, "unreadable")?,
        outbox_rows: column::<i64>(&outbox, "waiting")? + kind_rows,
        oldest_outbox_ms: worst(column(&outbox, "oldest_ms")?, kind_oldest_ms),
        outbox_retrying: column::<i64>(&outbox, "retrying")? + kind_retrying,
        recent_closes: column(&recent, "closes")?,
        recent_sweeper_closes: column(&recent, "swept")?,
        recent_release_repairs,
        release_repairs_total,
        releases_missing: column(&missing, "missing")?,
        oldest_missing_release_ms: column(&missing, "oldest_ms")?,
        releases_exhausted: column(&missing, "exhausted")?,
        lateness_p50_ms: column(&recent, "p50_ms")?,
        lateness_p99_ms: column(&recent, "p99_ms")?,
        lateness_max_ms: column(&recent, "max_ms")?,
        parked_entries,
        retention_pruned,
        retention_last_ms,
        kinds,
    })
}

/// The larger of two optional figures.
fn worst(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

impl Status {
    /// The status of `shards` together; with `sharded`, each one's figures are kept too.
    pub fn new(
        queues: Vec<QueueDepth>,
        shards: Vec<ShardStatus>,
        release_grace: Duration,
        sharded: bool,
    ) -> Self {
        let mut all = ShardStatus::default();
        for s in &shards {
            all.overdue_unpaid += s.overdue_unpaid;
            all.oldest_overdue_ms = worst(all.oldest_overdue_ms, s.oldest_overdue_ms);
            all.unreadable_deadlines += s.unreadable_deadlines;
            all.outbox_rows += s.outbox_rows;
            all.oldest_outbox_ms = worst(all.oldest_outbox_ms, s.oldest_outbox_ms);
            all.outbox_retrying += s.outbox_retrying;
            all.recent_closes += s.recent_closes;
            all.recent_sweeper_closes += s.recent_sweeper_closes;
            all.recent_release_repairs += s.recent_release_repairs;
            all.release_repairs_total += s.release_repairs_total;
            all.releases_missing += s.releases_missing;
            all.oldest_missing_release_ms =
                worst(all.oldest_missing_release_ms, s.oldest_missing_release_ms);
            all.releases_exhausted += s.releases_exhausted;
            all.lateness_p50_ms = worst(all.lateness_p50_ms, s.lateness_p50_ms);
            all.lateness_p99_ms = worst(all.lateness_p99_ms, s.lateness_p99_ms);
            all.lateness_max_ms = worst(all.lateness_max_ms, s.lateness_max_ms);
            all.retention_pruned += s.retention_pruned;
            all.parked_entries += s.parked_entries;
            // The most recent batch of any shard: the smallest age.
            all.retention_last_ms = match (all.retention_last_ms, s.retention_last_ms) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        Status {
            queues,
            overdue_unpaid: all.overdue_unpaid,
            oldest_overdue_ms: all.oldest_overdue_ms,
            unreadable_deadlines: all.unreadable_deadlines,
            outbox_rows: all.outbox_rows,
            oldest_outbox_ms: all.oldest_outbox_ms,
            outbox_retrying: all.outbox_retrying,
            recent_window_minutes: RECENT_MINUTES,
            recent_closes: all.recent_closes,
            recent_sweeper_closes: all.recent_sweeper_closes,
            recent_release_repairs: all.recent_release_repairs,
            release_repairs_total: all.release_repairs_total,
            releases_missing: all.releases_missing,
            oldest_missing_release_ms: all.oldest_missing_release_ms,
            release_grace_ms: u64::try_from(release_grace.as_millis()).unwrap_or(u64::MAX),
            releases_exhausted: all.releases_exhausted,
            lateness_p50_ms: all.lateness_p50_ms,
            lateness_p99_ms: all.lateness_p99_ms,
            lateness_max_ms: all.lateness_max_ms,
            parked_entries: all.parked_entries,
            retention_pruned: all.retention_pruned,
            retention_last_ms: all.retention_last_ms,
            kinds: crate::kinds::status::merge(shards.iter().flat_map(|s| s.kinds.clone())),
            shards: if sharded { shards } else { Vec::new() },
        }
    }
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

    /// Parked messages: those in the parked book and those still in the parked queue.
    pub fn parked(&self) -> i64 {
        let queued = self
            .queue("parked")
            .and_then(|q| q.messages)
            .map_or(0, i64::from);
        self.parked_entries + queued
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
}

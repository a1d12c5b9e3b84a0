//! `lapse status`: one look at the health of a deployment — tier and queue depths
//! from the broker, overdue UNPAID orders and the outbox from the database, the
//! lateness of recent closes, and the stock releases the reconciler had to repair.

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::broker::BrokerError;
use crate::db::{DbError, column};
use crate::topology::{QueueRole, Topology};

#[derive(Debug, Serialize)]
pub struct QueueDepth {
    pub queue: String,
    /// Ready messages; `None` when the queue does not exist.
    pub messages: Option<u32>,
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
    pub lateness_p50_ms: Option<f64>,
    pub lateness_p99_ms: Option<f64>,
    pub lateness_max_ms: Option<f64>,
}

/// Closes in this many minutes count as recent.
const RECENT_MINUTES: i64 = 5;

pub async fn collect<C: GenericClient>(
    conn: &lapin::Connection,
    db: &C,
    topology: &Topology,
) -> Result<Status, StatusError> {
    let mut queues = Vec::new();
    for q in &topology.queues {
        let channel = conn
            .create_channel()
            .await
            .map_err(BrokerError::amqp("channel.open"))?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let messages = match channel
            .queue_declare(q.name.as_str().into(), passive, FieldTable::default())
            .await
        {
            Ok(found) => {
                let _ = channel.close(200, "done".into()).await;
                Some(found.message_count())
            }
            Err(e) if crate::broker::not_found(&e) => None,
            Err(e) => return Err(BrokerError::amqp("queue.declare")(e).into()),
        };
        queues.push(QueueDepth {
            queue: q.name.clone(),
            messages,
        });
    }
    let sane = crate::deadline::in_range_sql("expire_at");
    let overdue = db
        .query_one(
            &format!(
                "SELECT count(*) FILTER (WHERE {sane}),
                        extract(epoch FROM now() - min(expire_at) FILTER (WHERE {sane}))::float8 * 1000,
                        count(*) FILTER (WHERE NOT {sane})
                   FROM orders WHERE status = 'UNPAID' AND (expire_at <= now() OR NOT {sane})"
            ),
            &[],
        )
        .await
        .map_err(DbError::from)?;
    let outbox = db
        .query_one(
            "SELECT count(*), extract(epoch FROM clock_timestamp() - min(created_at))::float8 * 1000,
                    count(*) FILTER (WHERE attempts > 0)
               FROM outbox",
            &[],
        )
        .await
        .map_err(DbError::from)?;
    let recent = db
        .query_one(
            &format!(
                "SELECT count(*), count(*) FILTER (WHERE close_reason = 'sweeper'),
                        percentile_cont(0.5) WITHIN GROUP (ORDER BY ms),
                        percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), max(ms)
                   FROM (SELECT close_reason, extract(epoch FROM closed_at - expire_at)::float8 * 1000 AS ms
                           FROM orders
                          WHERE closed_at > now() - $1::bigint * interval '1 minute' AND {sane}) r"
            ),
            &[&RECENT_MINUTES],
        )
        .await
        .map_err(DbError::from)?;
    let (recent_release_repairs, release_repairs_total) =
        crate::reconciler::repairs(db, RECENT_MINUTES).await?;
    Ok(Status {
        queues,
        overdue_unpaid: column(&overdue, 0)?,
        oldest_overdue_ms: column(&overdue, 1)?,
        unreadable_deadlines: column(&overdue, 2)?,
        outbox_rows: column(&outbox, 0)?,
        oldest_outbox_ms: column(&outbox, 1)?,
        outbox_retrying: column(&outbox, 2)?,
        recent_window_minutes: RECENT_MINUTES,
        recent_closes: column(&recent, 0)?,
        recent_sweeper_closes: column(&recent, 1)?,
        recent_release_repairs,
        release_repairs_total,
        lateness_p50_ms: column(&recent, 2)?,
        lateness_p99_ms: column(&recent, 3)?,
        lateness_max_ms: column(&recent, 4)?,
    })
}

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error(transparent)]
    Broker(#[from] BrokerError),
    #[error(transparent)]
    Db(#[from] DbError),
}

impl Status {
    pub fn render(&self, topology: &Topology) -> String {
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1} ms"));
        let mut out = String::from("QUEUES\n");
        for (q, spec) in self.queues.iter().zip(&topology.queues) {
            let role = match &spec.role {
                QueueRole::Wait(tier) => format!("wait {tier}"),
                QueueRole::Due => "due".into(),
                QueueRole::Parked => "parked".into(),
                QueueRole::StockRelease => "stock release".into(),
            };
            let depth = q.messages.map_or("MISSING".to_string(), |n| n.to_string());
            out.push_str(&format!("  {:<40} {:<14} {depth}\n", q.queue, role));
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
        out
    }
}

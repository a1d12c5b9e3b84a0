//! What a load cost the broker and the database, as they count it: messages that
//! entered lapse's queues and were delivered from them (the management API's
//! per-queue counters), and transactions (`pg_stat_database`) and statements
//! (`pg_stat_statements`, where installed) of the benchmark's database. Divided by
//! the orders of the load: the generator's own transactions are included.

use std::time::Duration;

use tokio_postgres::Client;

use super::env::BenchEnv;
use super::report::ScenarioReport;
use crate::amqp::management::Management;

/// The counters at one moment; `None` where they cannot be read.
#[derive(Clone, Copy, Debug, Default)]
pub struct Traffic {
    publishes: Option<u64>,
    deliveries: Option<u64>,
    transactions: Option<u64>,
    statements: Option<u64>,
}

/// How long the management plugin may take to show what happened (its statistics
/// are collected every 5 s by default).
const STATISTICS_LAG: Duration = Duration::from_millis(5_500);

impl Traffic {
    /// The counters now. With `settle`, first waits until the broker's and the
    /// database's statistics include what just happened.
    pub async fn sample(env: &BenchEnv, db: &Client, settle: bool) -> Self {
        if settle {
            tokio::time::sleep(STATISTICS_LAG).await;
        }
        let (publishes, deliveries) = broker(env).await.unzip();
        Self {
            publishes,
            deliveries,
            transactions: transactions(db).await,
            statements: statements(db).await,
        }
    }

    /// Puts the counts per order between `self` and `after` into `report`.
    pub fn record(self, after: Self, report: &mut ScenarioReport, orders: u64) {
        if orders == 0 {
            return;
        }
        let per =
            |a: Option<u64>, b: Option<u64>| Some(b?.saturating_sub(a?) as f64 / orders as f64);
        let publishes = per(self.publishes, after.publishes);
        let deliveries = per(self.deliveries, after.deliveries);
        for (name, value) in [
            ("broker_publishes_per_order", publishes),
            ("broker_deliveries_per_order", deliveries),
            (
                "broker_messages_per_order",
                publishes.zip(deliveries).map(|(p, d)| p + d),
            ),
            (
                "db_transactions_per_order",
                per(self.transactions, after.transactions),
            ),
            (
                "db_statements_per_order",
                per(self.statements, after.statements),
            ),
        ] {
            if let Some(v) = value {
                report.figure(name, v);
            }
        }
    }
}

/// Messages that entered the queues under the benchmark's prefix (published or
/// dead-lettered into them) and were delivered from them, summed.
async fn broker(env: &BenchEnv) -> Option<(u64, u64)> {
    let url = env.config.broker.management_url.as_ref()?;
    let queues = Management::new(url).ok()?.queues("/").await.ok()?;
    let prefix = format!("{}.", env.names.prefix);
    let mine = queues.iter().filter(|q| q.name.starts_with(&prefix));
    Some(mine.fold((0, 0), |(p, d), q| {
        let stats = q.message_stats.as_ref();
        (
            p + stats.and_then(|s| s.publish).unwrap_or(0),
            d + stats.and_then(|s| s.deliver_get).unwrap_or(0),
        )
    }))
}

async fn transactions(db: &Client) -> Option<u64> {
    let row = db
        .query_one(
            "SELECT (xact_commit + xact_rollback)::bigint AS n FROM pg_stat_database
              WHERE datname = current_database()",
            &[],
        )
        .await
        .ok()?;
    u64::try_from(row.get::<_, i64>("n")).ok()
}

/// Statements run in the benchmark's database, when `pg_stat_statements` is there.
async fn statements(db: &Client) -> Option<u64> {
    let row = db
        .query_one(
            "SELECT sum(calls)::bigint AS n FROM pg_stat_statements
              WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
            &[],
        )
        .await
        .ok()?;
    row.get::<_, Option<i64>>("n")
        .and_then(|n| u64::try_from(n).ok())
}

//! Creating orders the way an application does: `lapse_create_order` inside its own
//! statement, from several connections, at a constant rate.
//!
//! The steady generator's orders each take one unit of one of [`SKUS`] products, in
//! turn: a shop sells more than one product, and a single stock row that every
//! order's reservation and every close's release must lock in turn measured that
//! row's lock, not lapse (with one SKU, a quarter to a half of the releases at
//! 1,000/s found it locked and left as events, and the generator itself stalled on
//! it near 1,600-2,000 orders/s).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio_postgres::Client;

use super::env::{BenchEnv, SKUS};
use super::progress::Progress;

/// Orders per statement, as an application batching a little would send them.
pub const PER_STATEMENT: usize = 5;

/// One line of stock per order, from the benchmark's own SKU (pending deadlines, which
/// are never closed while measured).
pub const LINES: &str = r#"[{"sku": "bench", "qty": 1}]"#;

/// The SKU of the steady generator's `n`th product (zero-padded: text order is
/// number order, so every statement locks its stock rows in one global order).
pub fn sku(n: usize) -> String {
    format!("bench-{:04}", n % SKUS)
}

/// The statement creating the steady generator's orders: one per (deadline in
/// milliseconds from the statement's clock, lines) pair, in the pairs' order.
const CREATE_SQL: &str = "SELECT count(*) FROM (
        SELECT lapse_create_order(clock_timestamp() + d * interval '1 ms', l)
          FROM unnest($1::int[], $2::jsonb[]) WITH ORDINALITY AS x(d, l, n) ORDER BY n) created";

/// A constant-rate order generator.
#[derive(Clone, Debug)]
pub struct Steady {
    pub rate: u32,
    pub duration: Duration,
    pub connections: usize,
    /// Deadlines after creation, cycled through.
    pub deadlines: Vec<Duration>,
}

impl Steady {
    pub fn total(&self) -> u64 {
        (f64::from(self.rate) * self.duration.as_secs_f64()).round() as u64
    }

    /// Runs the generator to the end; returns the orders created.
    /// Opens the generator's connections (before the clock starts).
    pub async fn connect(&self, env: &BenchEnv) -> anyhow::Result<Vec<Client>> {
        let mut clients = Vec::with_capacity(self.connections);
        for _ in 0..self.connections {
            clients.push(env.client().await?);
        }
        Ok(clients)
    }

    /// Runs the generator on `clients` to the end; returns the orders created and
    /// when the last of them was (from the start: the pacing's trailing sleeps of
    /// connections with nothing left to send do not count).
    ///
    /// Also returns the CPU seconds the generator's own database sessions spent (their
    /// server processes, read from /proc before they end), so that a report can tell
    /// the application's share of PostgreSQL's CPU from lapse's.
    pub async fn run(
        &self,
        clients: Vec<Client>,
        progress: &Progress,
    ) -> anyhow::Result<(u64, Duration, f64)> {
        let total = self.total();
        let statements = total.div_ceil(PER_STATEMENT as u64);
        let per_connection = statements.div_ceil(self.connections as u64);
        let period = Duration::from_secs_f64(
            PER_STATEMENT as f64 * self.connections as f64 / f64::from(self.rate),
        );
        let deadlines: Arc<Vec<i32>> = Arc::new(
            self.deadlines
                .iter()
                .map(|d| d.as_millis().min(i32::MAX as u128) as i32)
                .collect(),
        );
        let created = Arc::new(AtomicU64::new(0));
        let last_ns = Arc::new(AtomicU64::new(0));
        let mut backends = Vec::with_capacity(clients.len());
        for db in &clients {
            let pid: i32 = db.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
            let pid = u32::try_from(pid).unwrap_or(0);
            backends.push((pid, super::cpu::of_pid(pid)));
        }
        let backend_cpu = Arc::new(std::sync::Mutex::new(0.0_f64));
        let started = tokio::time::Instant::now();
        let mut tasks = Vec::new();
        for (c, db) in clients.into_iter().enumerate() {
            // With fewer statements than connections, the extra ones have nothing to
            // send: they do not sleep their stagger either.
            if c as u64 >= statements {
                break;
            }
            let deadlines = deadlines.clone();
            let created = created.clone();
            let last_ns = last_ns.clone();
            let (backend, cpu_before) = backends[c];
            let backend_cpu = backend_cpu.clone();
            let stagger = period.mul_f64(c as f64 / self.connections as f64);
            let connections = self.connections;
            tasks.push(tokio::spawn(async move {
                let statement = db.prepare(CREATE_SQL).await?;
                tokio::time::sleep(stagger).await;
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                for s in 0..per_connection {
                    if created.load(Ordering::Relaxed) >= total {
                        break;
                    }
                    tick.tick().await;
                    // Another connection may have sent the last orders meanwhile.
                    let left = total.saturating_sub(created.load(Ordering::Relaxed));
                    let n = PER_STATEMENT.min(usize::try_from(left).unwrap_or(usize::MAX));
                    if n == 0 {
                        break;
                    }
                    let first = (s as usize * connections + c) * PER_STATEMENT;
                    let ds: Vec<i32> = (0..n)
                        .map(|i| deadlines[(c + s as usize * PER_STATEMENT + i) % deadlines.len()])
                        .collect();
                    // Products in ascending order within a statement (see `sku`).
                    let mut skus: Vec<usize> = (0..n).map(|i| (first + i) % SKUS).collect();
                    skus.sort_unstable();
                    let lines: Vec<serde_json::Value> = skus
                        .into_iter()
                        .map(|k| serde_json::json!([{"sku": sku(k), "qty": 1}]))
                        .collect();
                    db.execute(&statement, &[&ds, &lines]).await?;
                    created.fetch_add(n as u64, Ordering::Relaxed);
                    let at = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    last_ns.fetch_max(at, Ordering::Relaxed);
                }
                // Read while the session still exists (its process ends with `db`).
                let spent = super::cpu::of_pid(backend) - cpu_before;
                if let Ok(mut total) = backend_cpu.lock() {
                    *total += spent.max(0.0);
                }
                anyhow::Ok(())
            }));
        }
        let watcher = {
            let created = created.clone();
            let bar = progress.clone_handle();
            tokio::spawn(async move {
                loop {
                    bar.set_position(created.load(Ordering::Relaxed));
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
        };
        for t in tasks {
            t.await??;
        }
        watcher.abort();
        let backend_cpu = backend_cpu.lock().map(|t| *t).unwrap_or(0.0);
        Ok((
            created.load(Ordering::Relaxed),
            Duration::from_nanos(last_ns.load(Ordering::Relaxed)),
            backend_cpu,
        ))
    }
}

/// Creates `n` orders sharing the absolute deadline `at` (chunks of 5,000 per
/// statement), or, with `at` `None`, each chunk due 2 s before its statement began
/// (already overdue, within what `lapse_create_order` accepts). Each takes one unit
/// of the steady generator's products in turn (see [`sku`]).
pub async fn create_at(
    db: &Client,
    n: u64,
    at: Option<chrono::DateTime<chrono::Utc>>,
    progress: &Progress,
) -> anyhow::Result<()> {
    let skus = SKUS as i64;
    let mut left = n;
    while left > 0 {
        let chunk = left.min(5_000) as i64;
        db.execute(
            "SELECT count(lapse_create_order(coalesce($1, now() - interval '2 s'),
                          jsonb_build_array(jsonb_build_object(
                              'sku', 'bench-' || lpad((g % $3)::text, 4, '0'), 'qty', 1))))
               FROM generate_series(1, $2::bigint) g",
            &[&at, &chunk, &skus],
        )
        .await?;
        left -= chunk as u64;
        progress.inc(chunk as u64);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skus_sort_as_their_numbers_and_wrap() {
        let names: Vec<String> = (0..SKUS + 2).map(sku).collect();
        assert_eq!(names[0], "bench-0000");
        assert_eq!(names[SKUS - 1], "bench-0999");
        assert_eq!(names[SKUS], names[0], "the products are taken in turn");
        let mut sorted = names[..SKUS].to_vec();
        sorted.sort();
        assert_eq!(sorted, names[..SKUS], "text order is number order");
    }
}

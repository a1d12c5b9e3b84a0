//! Live progress while the demo runs: orders scheduled, messages waiting per tier,
//! closed, paid, refused late payments and the lateness so far. Drawn with a progress
//! bar on a terminal; elsewhere one plain line every few seconds (or nothing).

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::db::Pool;
use tokio_util::sync::CancellationToken;

use super::workload::Counters;
use crate::amqp::broker::{self, Endpoint, QueueState};
use crate::names::Names;
use crate::tier::TierSet;

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Display {
    /// A bar on the terminal (stderr).
    Bar,
    /// A plain line on stderr every few seconds.
    Lines,
    Silent,
}

impl Display {
    /// A bar when stderr is a terminal, plain lines otherwise, nothing when `quiet`.
    pub fn detect(quiet: bool) -> Self {
        match (quiet, std::io::stderr().is_terminal()) {
            (_, true) => Display::Bar,
            (true, false) => Display::Silent,
            (false, false) => Display::Lines,
        }
    }
}

/// One reading of the database and the wait queues.
#[derive(Debug, Default)]
struct Snapshot {
    closed: i64,
    paid: i64,
    refused_late: i64,
    p99_ms: Option<f64>,
    max_ms: Option<f64>,
    waiting: Vec<(String, u32)>,
}

pub struct Progress {
    pub orders: u64,
    pub pool: Pool,
    pub endpoint: Endpoint,
    pub names: Names,
    pub tiers: TierSet,
    pub counters: Arc<Counters>,
}

impl Progress {
    /// Shows progress until `token` is cancelled; failures to read are shown, not fatal.
    pub async fn run(self, display: Display, token: CancellationToken) {
        if display == Display::Silent {
            return;
        }
        let bar = match display {
            Display::Bar => {
                let bar = indicatif::ProgressBar::new(self.orders);
                bar.set_style(
                    indicatif::ProgressStyle::with_template(
                        "{elapsed:>4} [{bar:30}] {pos}/{len} settled (paid or closed)\n{msg}",
                    )
                    .expect("a valid template")
                    .progress_chars("=> "),
                );
                Some(bar)
            }
            _ => None,
        };
        let every = if bar.is_some() {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(5)
        };
        let mut conn = None;
        let mut tick = tokio::time::interval(every);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = token.cancelled() => break,
            }
            if conn.is_none() {
                conn = self.endpoint.connect("lapse demo progress").await.ok();
            }
            let snap = self.snapshot(conn.as_ref()).await;
            let line = self.line(&snap);
            match &bar {
                Some(bar) => {
                    // Each setter may draw (rate-limited); draw both together.
                    bar.set_message(line);
                    bar.set_position((snap.closed + snap.paid).max(0) as u64);
                    bar.force_draw();
                }
                None => eprintln!("demo: {}", line.replace('\n', "  ")),
            }
        }
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        if let Some(conn) = conn {
            crate::amqp::broker::close_quietly(&conn, "done").await;
        }
    }

    fn line(&self, s: &Snapshot) -> String {
        let scheduled = self.counters.scheduled.load(Ordering::Relaxed);
        let waiting: Vec<String> = s.waiting.iter().map(|(t, n)| format!("{t}:{n}")).collect();
        let lateness = match (s.p99_ms, s.max_ms) {
            (Some(p99), Some(max)) => format!("lateness p99 {p99:.1} max {max:.1} ms"),
            _ => "lateness -".into(),
        };
        let waiting = if waiting.is_empty() {
            "-".to_string()
        } else {
            waiting.join(" ")
        };
        format!(
            "closed {}  paid {}  late pay refused {}  {lateness}\nscheduled {scheduled}/{}  waiting per tier {waiting}",
            s.closed, s.paid, s.refused_late, self.orders,
        )
    }

    async fn snapshot(&self, conn: Option<&lapin::Connection>) -> Snapshot {
        let mut snap = Snapshot::default();
        if let Ok(client) = self.pool.get().await {
            let row = client
                .query_typed_one(
                    "SELECT count(*) FILTER (WHERE status = 'CLOSED'),
                            count(*) FILTER (WHERE status = 'PAID'),
                            (SELECT count(*) FROM late_payments),
                            percentile_cont(0.99) WITHIN GROUP (ORDER BY
                                extract(epoch FROM closed_at - expire_at)::float8 * 1000),
                            max(extract(epoch FROM closed_at - expire_at)::float8 * 1000)
                       FROM orders",
                    &[],
                )
                .await;
            if let Ok(row) = row {
                snap.closed = row.get(0);
                snap.paid = row.get(1);
                snap.refused_late = row.get(2);
                snap.p99_ms = row.get(3);
                snap.max_ms = row.get(4);
            }
        }
        if let Some(conn) = conn
            && let Ok(channel) = conn.create_channel().await
        {
            for tier in self.tiers.iter() {
                let name = self.names.wait_queue(tier);
                match broker::passive_declare(&channel, &name).await {
                    Ok(QueueState::Exists(counts)) => {
                        snap.waiting.push((tier.name(), counts.messages))
                    }
                    Ok(QueueState::Missing) | Err(_) => break,
                }
            }
            let _ = channel.close(200, "done".into()).await;
        }
        snap.waiting.retain(|(_, n)| *n > 0);
        snap
    }
}

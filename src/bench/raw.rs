//! `raw`: the broker alone, through the shape lapse gives it — publish with confirms
//! to a quorum wait queue with a queue TTL, at-least-once dead-lettering into a quorum
//! due queue, consume, ack — and no database. Two phases: paced messages on a 1 s tier
//! (their lateness is the floor any timer on this broker pays), then a burst on a tier
//! long enough to hold the whole burst (the dead-letter rate the broker sustains).

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use lapin::BasicProperties;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::sync::mpsc;

use super::cpu;
use super::env::BenchEnv;
use super::progress::Progress;
use super::report::{CpuPerThousand, Lateness, ScenarioReport};
use crate::amqp::topology::Topology;
use crate::names::Names;
use crate::tier::{Tier, TierSet};
use crate::tier_file::TierFile;

/// How the raw phases run.
#[derive(Clone, Copy, Debug)]
pub struct RawOptions {
    /// Paced messages per second, and for how long.
    pub rate: u32,
    pub duration: Duration,
    /// Messages in the burst phase.
    pub burst: u64,
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos()
}

pub async fn run(env: &mut BenchEnv, options: RawOptions) -> anyhow::Result<ScenarioReport> {
    let started = Instant::now();
    let mut report = ScenarioReport::new("raw");
    report.param("rate", options.rate);
    report.param("duration", humantime::format_duration(options.duration));
    report.param("burst", options.burst);
    let (names, paced_tier, burst_tier) = declare(env, options.burst).await?;

    let conn = super::env::connect(env, "lapse bench raw").await?;
    let consumer_conn = super::env::connect(env, "lapse bench raw consumer").await?;
    let (reader, rx) = spawn_reader(&consumer_conn, &names).await?;

    let cpu_before = cpu::sample();
    let me_before = cpu::of_pid(std::process::id());
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await?;
    let mut phases = Phases {
        channel,
        exchange: names.delay_exchange(),
        rx,
        received: HashMap::new(),
    };
    let paced_total = phases.paced(paced_tier, options).await?;
    phases.burst(burst_tier, options.burst).await?;
    let me = cpu::of_pid(std::process::id()) - me_before;
    let cpu_after = cpu::sample();
    reader.abort();
    let _ = conn.close(200, "done".into()).await;
    let _ = consumer_conn.close(200, "done".into()).await;

    tally(&mut report, phases.received, paced_total, options);
    report.cpu_per_1000 = CpuPerThousand::between(cpu_before, cpu_after, me, report.orders);
    report.elapsed_s = started.elapsed().as_secs_f64();
    report.load_average = cpu::load_average();
    Ok(report)
}

/// One message as the reader saw it: phase, lateness (ms), arrival time (ns).
type Arrival = (u8, f64, u128);

/// What arrived, by phase: each message's lateness (ms) and arrival time (ns).
type Received = HashMap<u8, Vec<(f64, u128)>>;

/// Declares the run's own topology with its two tiers: 1 s for the paced phase, and
/// for the burst one long enough that the publisher finishes before the first message
/// expires (assuming at least 5,000 confirmed publishes per second). Returns the names
/// and the paced and burst tiers.
async fn declare(env: &mut BenchEnv, burst: u64) -> anyhow::Result<(Names, Tier, Tier)> {
    let paced_tier = Tier::from_duration(Duration::from_secs(1))?;
    let burst_tier = Tier::from_duration(Duration::from_secs(2 + burst / 5_000))?;
    let names = Names::new(format!("{}-raw", env.names.prefix));
    let file = TierFile {
        tiers: TierSet::new(vec![paced_tier, burst_tier]),
        delivery_limit: 10,
        max_length: None,
        source: crate::tier_file::TierSource::Inline,
    };
    env.declare(Topology::new(&names, &file)).await?;
    Ok((names, paced_tier, burst_tier))
}

/// Consumes the due queue: acks each message and sends its [`Arrival`] on the
/// returned channel.
async fn spawn_reader(
    consumer_conn: &lapin::Connection,
    names: &Names,
) -> anyhow::Result<(
    tokio::task::JoinHandle<()>,
    mpsc::UnboundedReceiver<Arrival>,
)> {
    let (tx, rx) = mpsc::unbounded_channel::<Arrival>();
    let consume = consumer_conn.create_channel().await?;
    consume.basic_qos(1000, BasicQosOptions::default()).await?;
    let mut consumer = consume
        .basic_consume(
            names.due_queue().as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let reader = tokio::spawn(async move {
        while let Some(Ok(delivery)) = consumer.next().await {
            let arrived = now_ns();
            let text = String::from_utf8_lossy(&delivery.data).to_string();
            let mut parts = text.split(' ');
            let phase = parts.next().and_then(|p| p.parse::<u8>().ok()).unwrap_or(9);
            let due = parts
                .next()
                .and_then(|p| p.parse::<u128>().ok())
                .unwrap_or(arrived);
            let late_ms = (arrived as f64 - due as f64) / 1e6;
            let _ = delivery.ack(BasicAckOptions::default()).await;
            if tx.send((phase, late_ms, arrived)).is_err() {
                break;
            }
        }
    });
    Ok((reader, rx))
}

/// The publishing side of both phases and what came back.
struct Phases {
    /// In confirm mode.
    channel: lapin::Channel,
    exchange: String,
    rx: mpsc::UnboundedReceiver<Arrival>,
    received: Received,
}

impl Phases {
    /// Phase 0: `rate` messages a second for `duration` on the 1 s tier, each
    /// confirmed, then waits for them to arrive. Returns how many were sent.
    async fn paced(&mut self, tier: Tier, options: RawOptions) -> anyhow::Result<u64> {
        let paced_total =
            (u64::from(options.rate) * options.duration.as_millis() as u64 / 1000).max(1);
        let progress = Progress::new("raw: paced", paced_total);
        let mut tick =
            tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(options.rate)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut confirms = Vec::new();
        for _ in 0..paced_total {
            tick.tick().await;
            let body = format!("0 {}", now_ns() + tier.duration().as_nanos());
            let channel = self.channel.clone();
            let (exchange, key) = (self.exchange.clone(), tier.name());
            confirms.push(tokio::spawn(async move {
                channel
                    .basic_publish(
                        exchange.as_str().into(),
                        key.as_str().into(),
                        BasicPublishOptions::default(),
                        body.as_bytes(),
                        BasicProperties::default(),
                    )
                    .await?
                    .await
            }));
            progress.inc(1);
        }
        for c in confirms {
            c.await??;
        }
        let limit = Duration::from_secs(30);
        collect(&mut self.rx, &mut self.received, 0, paced_total, limit).await;
        progress.finish();
        Ok(paced_total)
    }

    /// Phase 1: `burst` messages as fast as confirms allow (up to 1,000 in flight) on
    /// the burst tier, then waits for them to arrive.
    async fn burst(&mut self, tier: Tier, burst: u64) -> anyhow::Result<()> {
        let progress = Progress::new("raw: burst", burst);
        let mut pending = Vec::with_capacity(1000);
        for _ in 0..burst {
            let body = format!("1 {}", now_ns() + tier.duration().as_nanos());
            pending.push(
                self.channel
                    .basic_publish(
                        self.exchange.as_str().into(),
                        tier.name().as_str().into(),
                        BasicPublishOptions::default(),
                        body.as_bytes(),
                        BasicProperties::default(),
                    )
                    .await?,
            );
            if pending.len() == 1000 {
                for c in pending.drain(..) {
                    c.await?;
                }
                progress.inc(1000);
            }
        }
        for c in pending.drain(..) {
            c.await?;
        }
        let limit = tier.duration() + Duration::from_secs(30 + burst / 1000);
        collect(&mut self.rx, &mut self.received, 1, burst, limit).await;
        progress.finish();
        Ok(())
    }
}

/// The broker keeps a message's enqueue time and its expiry in whole milliseconds, so
/// on a fast loopback a message can come up to 1 ms before the nanosecond-precise due
/// time the bench stamped before publishing (seen: 2 of 3,000). That is the broker's
/// rounding, not an early timer: only arrivals more than 1 ms ahead count as early;
/// the others are counted apart. (lapse's own closes are never early by the database
/// clock: the guarded UPDATE checks `expire_at <= now()`.)
fn broker_early(lateness_ms: &[f64]) -> (u64, u64) {
    let early = lateness_ms.iter().filter(|l| **l < -1.0).count() as u64;
    let within = lateness_ms
        .iter()
        .filter(|l| (-1.0..0.0).contains(*l))
        .count() as u64;
    (early, within)
}

/// Counts, losses and lateness from the paced phase; the dead-letter rate and the
/// arrivals per 100 ms from the burst.
fn tally(
    report: &mut ScenarioReport,
    mut received: Received,
    paced_total: u64,
    options: RawOptions,
) {
    let paced = received.remove(&0).unwrap_or_default();
    let burst = received.remove(&1).unwrap_or_default();
    report.orders = paced_total + options.burst;
    report.lost = paced_total.saturating_sub(paced.len() as u64)
        + options.burst.saturating_sub(burst.len() as u64);
    let mut lateness: Vec<f64> = paced.iter().map(|(l, _)| *l).collect();
    let (early, within) = broker_early(&lateness);
    report.early = early;
    report.figure("ahead_by_less_than_1ms", within as f64);
    report.lateness_ms = Lateness::of(&mut lateness);
    report.samples = lateness;
    report.figure("paced_per_s", f64::from(options.rate));
    let mut arrivals: Vec<u128> = burst.iter().map(|(_, a)| *a).collect();
    arrivals.sort();
    if let (Some(first), Some(last)) = (arrivals.first(), arrivals.last()) {
        let span = (*last - *first) as f64 / 1e9;
        if span > 0.0 {
            report.figure("dead_letter_per_s", (arrivals.len() - 1) as f64 / span);
        }
        report.closes_per_s = arrivals.iter().fold(Vec::new(), |mut b: Vec<f64>, a| {
            let i = ((*a - *first) / 100_000_000) as usize;
            if b.len() <= i {
                b.resize(i + 1, 0.0);
            }
            b[i] += 10.0;
            b
        });
    }
}

/// Receives until `want` messages of `phase` arrived or `limit` passed.
async fn collect(
    rx: &mut mpsc::UnboundedReceiver<Arrival>,
    received: &mut Received,
    phase: u8,
    want: u64,
    limit: Duration,
) {
    let until = tokio::time::Instant::now() + limit;
    while (received.get(&phase).map_or(0, Vec::len) as u64) < want {
        match tokio::time::timeout_at(until, rx.recv()).await {
            Ok(Some((p, late, at))) => received.entry(p).or_default().push((late, at)),
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_more_than_a_millisecond_ahead_is_early() {
        assert_eq!(
            broker_early(&[3.0, 0.0, -0.2, -0.99, -1.0, -1.01, -40.0]),
            (2, 3)
        );
        assert_eq!(broker_early(&[]), (0, 0));
    }
}

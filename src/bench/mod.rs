//! `lapse bench`: lateness, throughput and cost of lapse on the user's own broker and
//! database, next to the broker alone (`raw`) measured in the same run.
//!
//! Each run creates its own database and broker prefix ([`env::BenchEnv`]), starts
//! `lapse worker` processes against them, and removes everything afterwards. Lateness
//! is read from the database (`closed_at - expire_at`); CPU from /proc.

pub mod cpu;
mod drain;
pub mod env;
mod load;
mod measure;
mod pending;
mod progress;
mod raw;
pub mod report;
mod saturation;
mod steady;
pub mod svg;
mod traffic;

use std::time::{Duration, Instant};

pub use load::Steady;
pub use raw::RawOptions;
use report::{CpuPerThousand, Report, ScenarioReport};

use env::BenchEnv;

/// The scenarios `lapse bench` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// The broker alone through lapse's topology shape (no database, no worker).
    Raw,
    /// Orders at a constant rate from several connections.
    Steady,
    /// The highest steady rate with lateness p99 within 100 ms, found by rising loads.
    Saturation,
    /// N orders sharing one deadline.
    Burst,
    /// N orders already overdue when K workers start.
    Backlog,
    /// N orders scheduled hours ahead: memory, disk, time to schedule.
    Pending,
    /// lapse_create_order against a plain insert, per order.
    Schedule,
    /// SIGKILL the worker during a steady load, restart it after a gap.
    Crash,
    /// Every scenario above, raw first.
    All,
}

/// Everything a run needs besides the environment.
#[derive(Clone, Debug)]
pub struct Options {
    pub steady: Steady,
    /// The highest rate `saturation` tries.
    pub max_rate: u32,
    /// Orders for burst, backlog, pending and schedule (each has its own default
    /// when `None`).
    pub orders: Option<u64>,
    pub workers: u32,
    pub gap: Duration,
    pub raw: RawOptions,
}

impl Options {
    fn orders(&self, default: u64) -> u64 {
        self.orders.unwrap_or(default)
    }
}

/// CPU meter over one scenario: the services' processes and lapse's workers.
pub struct Meter {
    cpu: cpu::CpuSample,
    workers: f64,
    started: Instant,
}

impl Meter {
    pub fn start(env: &BenchEnv) -> Self {
        Self {
            cpu: cpu::sample(),
            workers: env.worker_cpu(),
            started: Instant::now(),
        }
    }

    pub fn stop(self, env: &BenchEnv, report: &mut ScenarioReport, units: u64) {
        let lapse = env.worker_cpu() - self.workers;
        report.cpu_per_1000 = CpuPerThousand::between(self.cpu, cpu::sample(), lapse, units);
        report.elapsed_s = self.started.elapsed().as_secs_f64();
        report.load_average = cpu::load_average();
    }
}

/// How long to wait for a steady load's orders to close: its duration, its longest
/// deadline, and a minute.
pub fn settle_limit(load: &Steady) -> Duration {
    load.duration
        + load.deadlines.iter().max().copied().unwrap_or_default()
        + Duration::from_secs(60)
}

/// Runs `scenario` (raw first for every other one) and returns the report.
pub async fn run(
    env: &mut BenchEnv,
    scenario: Scenario,
    options: &Options,
) -> anyhow::Result<Report> {
    let mut report = Report {
        lapse_version: env!("CARGO_PKG_VERSION").to_string(),
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        scenarios: Vec::new(),
    };
    let raw = raw::run(env, options.raw).await?;
    report.scenarios.push(raw.clone());
    if scenario == Scenario::Raw {
        return Ok(report);
    }
    let wanted = |s: Scenario| scenario == s || scenario == Scenario::All;
    let drain_vs_raw = [("closes_per_s", "dead_letter_per_s")];
    if wanted(Scenario::Steady) {
        let mut s = steady::steady(env, &options.steady).await?;
        s.compare(&raw, true, &[]);
        report.scenarios.push(s);
    }
    if wanted(Scenario::Saturation) {
        let search = saturation::Search {
            load: options.steady.clone(),
            max_rate: options.max_rate,
        };
        let mut s = saturation::saturation(env, &search).await?;
        s.compare(&raw, true, &[]);
        report.scenarios.push(s);
    }
    if wanted(Scenario::Burst) {
        let mut s = drain::burst(env, options.orders(20_000)).await?;
        s.compare(&raw, false, &drain_vs_raw);
        report.scenarios.push(s);
    }
    if wanted(Scenario::Backlog) {
        let mut s = drain::backlog(env, options.orders(20_000), options.workers).await?;
        s.compare(&raw, false, &drain_vs_raw);
        report.scenarios.push(s);
    }
    if wanted(Scenario::Pending) {
        let s = pending::pending(env, options.orders(100_000)).await?;
        report.scenarios.push(s);
    }
    if wanted(Scenario::Schedule) {
        let s = pending::schedule(env, options.orders(2_000).min(100_000)).await?;
        report.scenarios.push(s);
    }
    if wanted(Scenario::Crash) {
        let mut s = steady::crash(env, &options.steady, options.gap).await?;
        s.compare(&raw, true, &[]);
        report.scenarios.push(s);
    }
    for s in &mut report.scenarios {
        cpu_ratio(s, &raw);
    }
    Ok(report)
}

/// CPU per order across the three against raw's CPU per message.
fn cpu_ratio(s: &mut ScenarioReport, raw: &ScenarioReport) {
    if s.scenario != "raw" && raw.cpu_per_1000.total > 0.0 && s.cpu_per_1000.total > 0.0 {
        let r = s.cpu_per_1000.total / raw.cpu_per_1000.total;
        s.vs_raw
            .insert("cpu_per_order".into(), (r * 100.0).round() / 100.0);
    }
}

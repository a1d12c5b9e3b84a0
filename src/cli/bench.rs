//! `lapse bench`: measure lapse on the user's own broker and database, next to the
//! broker alone, with its own database and prefix, and clean up afterwards (also when
//! a scenario fails or Ctrl-C or SIGTERM interrupts it).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::{ExitStatus, help};
use crate::bench::{self, Options, RawOptions, Scenario, Steady};
use crate::config::Config;

const DEFAULT_DEADLINES: &str = "5s,15s,6300ms,7770ms,9010ms,11500ms,13250ms,16900ms,18040ms,20s";

#[derive(Debug, Args)]
#[command(after_help = help::after(
    &[
        "lapse bench raw",
        "lapse bench steady --rate 500 --duration 60s",
        "lapse bench saturation --rate 200 --duration 10s",
        "lapse bench burst --orders 100000 --json",
        "lapse bench backlog --orders 100000 --workers 2",
        "lapse bench crash --gap 5s",
        "lapse bench all --svg docs/img",
    ],
    &[
        (0, "the run finished and every order closed, none early"),
        (1, "an order closed early or was lost (or the broker alone lost a raw message), a worker exited, or Ctrl-C or SIGTERM interrupted the run; raw messages the broker delivers early are a warning"),
        help::USAGE,
        help::UNREACHABLE,
    ],
))]
pub struct BenchArgs {
    /// What to measure; every scenario but `raw` runs `raw` first and reports ratios.
    #[arg(value_enum, value_name = "SCENARIO")]
    scenario: Scenario,
    /// Orders created per second by steady and crash, saturation's first rate (and
    /// messages per second by raw).
    #[arg(long, value_name = "R", default_value_t = 200,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    rate: u32,
    /// The highest rate saturation tries (it starts at --rate).
    #[arg(long, value_name = "R", default_value_t = 100_000,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    max_rate: u32,
    /// How long steady and crash create orders (and each of saturation's loads), e.g. 60s.
    #[arg(long, value_name = "D", default_value = "20s", value_parser = positive_duration)]
    duration: Duration,
    /// Database connections creating orders in steady and crash.
    #[arg(long, value_name = "C", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    connections: u32,
    /// Deadlines of steady and crash orders after their creation, cycled through
    /// (comma-separated durations; the default has some equal to default tiers).
    #[arg(long, value_name = "LIST", default_value = DEFAULT_DEADLINES,
          value_parser = deadline_list)]
    deadlines: DeadlineList,
    /// Orders for burst, backlog, pending and schedule (defaults: 20000, 20000,
    /// 100000, 2000).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    orders: Option<u64>,
    /// Worker processes started by backlog.
    #[arg(long, value_name = "K", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=16))]
    workers: u32,
    /// How long crash leaves the killed worker down before starting another.
    #[arg(long, value_name = "G", default_value = "2s", value_parser = positive_duration)]
    gap: Duration,
    /// How long raw paces messages (at --rate).
    #[arg(long, value_name = "D", default_value = "5s", value_parser = positive_duration)]
    raw_duration: Duration,
    /// Messages raw publishes at once to measure the broker's dead-letter rate.
    #[arg(long, value_name = "N", default_value_t = 20_000,
          value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    raw_burst: u64,
    /// Broker name prefix of the run's own topology (default: lapse-bench-<pid>).
    #[arg(long, value_name = "NAME")]
    prefix: Option<String>,
    /// Name of the run's own database, created next to database.url and dropped at
    /// the end (default: lapse_bench_<pid>).
    #[arg(long, value_name = "DB", value_parser = database_name)]
    database: Option<String>,
    /// Run this lapse executable as the worker instead of this one (to compare two
    /// builds against the same load generator).
    #[arg(long, value_name = "FILE")]
    worker_exe: Option<PathBuf>,
    /// The workers reach the run's database through a connection pooler listening at
    /// HOST:PORT (e.g. PgBouncer in transaction mode, with the same user and database
    /// names); their relays LISTEN directly (`relay.listen_url`). The generator and
    /// the measurements connect directly, as the shop's application would.
    #[arg(long, value_name = "HOST:PORT")]
    worker_pooler: Option<String>,
    /// Print the report as JSON on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// Write the lateness CDF and closes/s pictures of each scenario into DIR.
    #[arg(long, value_name = "DIR")]
    svg: Option<PathBuf>,
}

#[derive(Clone, Debug)]
pub struct DeadlineList(Vec<Duration>);

fn positive_duration(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text.trim())
        .map_err(|e| format!("`{text}` is not a duration ({e}); write it like 500ms, 20s, 2m"))?;
    if d.is_zero() {
        return Err(format!("`{text}` is zero; it must be longer than zero"));
    }
    Ok(d)
}

fn deadline_list(text: &str) -> Result<DeadlineList, String> {
    let list: Vec<Duration> = text
        .split(',')
        .map(positive_duration)
        .collect::<Result<_, _>>()?;
    if let Some(d) = list.iter().find(|d| **d > Duration::from_secs(86_400)) {
        return Err(format!(
            "{d:?} is longer than a day; a benchmark waits for it"
        ));
    }
    Ok(DeadlineList(list))
}

fn database_name(text: &str) -> Result<String, String> {
    let ok = !text.is_empty()
        && text.len() <= 63
        && text
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(text.to_string())
    } else {
        Err(format!(
            "`{text}` is not a database name lapse creates: use lowercase letters, digits and _"
        ))
    }
}

pub async fn run(
    config: &Config,
    config_file: Option<PathBuf>,
    args: BenchArgs,
) -> anyhow::Result<ExitStatus> {
    let pid = std::process::id();
    let prefix = args
        .prefix
        .clone()
        .unwrap_or_else(|| format!("lapse-bench-{pid}"));
    let database = args
        .database
        .clone()
        .unwrap_or_else(|| format!("lapse_bench_{pid}"));
    let options = options(&args);
    check_worker_exe(&args)?;
    // SIGTERM too (a `timeout`, a CI runner, a service manager): cleaned up like Ctrl-C.
    // Both handlers are in place before anything is created.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let interrupt = tokio::signal::ctrl_c();
    let mut env = bench::env::BenchEnv::create(config, config_file, &prefix, &database).await?;
    env.worker_exe = args.worker_exe.clone();
    if let Some(pooler) = &args.worker_pooler
        && let Err(e) = env.through_pooler(pooler)
    {
        let _ = env.cleanup().await;
        return Err(e);
    }
    let outcome = tokio::select! {
        biased;
        _ = interrupt => None,
        _ = term.recv() => None,
        r = bench::run(&mut env, args.scenario, &options) => Some(r),
    };
    let cleaned = env.cleanup().await;
    if let Err(e) = &cleaned {
        eprintln!("warning: cleaning up after the benchmark: {e}");
    }
    let report = match outcome {
        None if cleaned.is_ok() => {
            eprintln!("interrupted: the benchmark's workers, queues and database were removed");
            return Ok(ExitStatus::Failed);
        }
        None => {
            eprintln!("interrupted");
            return Ok(ExitStatus::Failed);
        }
        Some(r) => r?,
    };
    output(&report, &args)
}

/// The scenarios' options from the command line.
fn options(args: &BenchArgs) -> Options {
    Options {
        steady: Steady {
            rate: args.rate,
            duration: args.duration,
            connections: args.connections as usize,
            deadlines: args.deadlines.0.clone(),
        },
        max_rate: args.max_rate,
        orders: args.orders,
        workers: args.workers,
        gap: args.gap,
        raw: RawOptions {
            rate: args.rate,
            duration: args.raw_duration,
            burst: args.raw_burst,
        },
    }
}

/// `--worker-exe`, when given, must be a file (checked before anything is created).
fn check_worker_exe(args: &BenchArgs) -> anyhow::Result<()> {
    if let Some(exe) = &args.worker_exe
        && !exe.is_file()
    {
        return Err(crate::config::ConfigError {
            key: "--worker-exe".into(),
            problem: format!("{} is not a file", exe.display()),
        }
        .into());
    }
    Ok(())
}

/// Writes the charts and prints the report; the exit status says whether every
/// order closed in time and none early.
fn output(report: &bench::report::Report, args: &BenchArgs) -> anyhow::Result<ExitStatus> {
    if let Some(dir) = &args.svg {
        for path in bench::svg::write(report, dir)? {
            eprintln!("wrote {}", path.display());
        }
    }
    if args.json {
        super::print_json(report)?;
    } else {
        print!("{}", report.table());
    }
    if let Some((early, of, p50)) = report.broker_early() {
        eprintln!(
            "warning: raw: the broker alone delivered {early} of {of} paced messages more than \
             1 ms before their TTL ran out (p50 {p50:.1} ms): its timers run fast, e.g. while \
             the Erlang VM corrects a step of the system clock. lapse checks deadlines against \
             the database clock, so its closes stay on time; the broker's early messages cost \
             it a hold or a re-delay each"
        );
    }
    if report.correct() {
        Ok(ExitStatus::Ok)
    } else {
        eprintln!(
            "error: an order closed early or was not closed and released in time, or the \
             broker alone lost a raw message"
        );
        Ok(ExitStatus::Failed)
    }
}

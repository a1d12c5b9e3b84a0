//! `lapse demo`: the main job on local services, with live progress, a report and a
//! picture (see `crate::demo`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::{ExitStatus, help, print_json};
use crate::config::Config;
use crate::demo::{self, Interrupted, Options, progress::Display, report::Report};

/// Most orders one run may schedule.
pub const MAX_ORDERS: u32 = 100_000;
/// Longest run.
pub const MAX_DURATION: Duration = Duration::from_secs(3600);

#[derive(Debug, Args)]
#[command(after_help = help::after(
    &[
        "lapse demo",
        "lapse demo --orders 150 --duration 5s --json",
        "lapse demo --orders 10000 --duration 2m --svg big-run.svg",
        "lapse demo --keep",
    ],
    &[
        (0, "every order was paid or closed, none early, no late payment accepted, stock \
             back to its starting values, and everything the demo created was removed \
             (unless --keep)"),
        (1, "a promise was broken (an early close, a lost order, inconsistent stock), the \
             cleanup failed, or the run was interrupted (SIGINT/SIGTERM; it still cleans up)"),
        (2, "bad arguments (--orders, --duration) or configuration, including refused \
             credentials"),
        help::UNREACHABLE,
    ],
))]
pub struct DemoArgs {
    /// How many orders to schedule (1 to 100000).
    #[arg(long, value_name = "N", default_value_t = 3000,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_ORDERS)))]
    orders: u32,
    /// How long the run lasts: orders are created and fall due within it (e.g. 60s, 2m;
    /// more than 0, at most 1h). Waiting for the last close comes on top.
    #[arg(long = "duration", value_name = "DURATION", default_value = "60s",
          allow_hyphen_values = true, value_parser = parse_duration)]
    run_time: Duration,
    /// Keep the demo's queues, exchanges and database afterwards (their names are in
    /// the report) instead of removing them.
    #[arg(long)]
    keep: bool,
    /// Print the report as JSON on stdout (no progress is drawn unless stderr is a
    /// terminal).
    #[arg(long)]
    json: bool,
    /// Where to write the SVG picture (lateness distribution, closes over time).
    #[arg(long, value_name = "PATH", default_value = "lapse-demo.svg")]
    svg: PathBuf,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    if text.trim_start().starts_with('-') {
        return Err("must be more than 0, not negative".into());
    }
    let d = humantime::parse_duration(text).map_err(|e| format!("{e} (e.g. 60s, 2m)"))?;
    if d.is_zero() {
        return Err("must be more than 0".into());
    }
    if d > MAX_DURATION {
        return Err("must be at most 1h".into());
    }
    Ok(d)
}

pub async fn run(config: Config, args: DemoArgs) -> anyhow::Result<ExitStatus> {
    let token = crate::runtime::shutdown::on_signal();
    let keep = args.keep;
    let options = Options {
        orders: args.orders,
        duration: args.run_time,
        keep,
        svg: args.svg,
        display: Display::detect(args.json),
        seed: fastrand::u64(..),
    };
    if !args.json {
        eprintln!(
            "lapse demo: {} orders over {}; Ctrl-C stops it and cleans up",
            options.orders,
            humantime::format_duration(options.duration)
        );
    }
    let report = match demo::run(&config, options, token).await {
        Ok(report) => report,
        Err(e) if e.is::<Interrupted>() => {
            if keep {
                eprintln!(
                    "interrupted; the demo's queues, exchanges and database were kept (--keep)"
                );
            } else {
                eprintln!(
                    "interrupted; the demo removed what it could of its queues, exchanges and database (see the lines above for any it could not)"
                );
            }
            return Ok(ExitStatus::Failed);
        }
        Err(e) => return Err(e),
    };
    if args.json {
        print_json(&report)?;
    } else {
        print_report(&report);
    }
    Ok(if report.problems.is_empty() {
        ExitStatus::Ok
    } else {
        ExitStatus::Failed
    })
}

fn print_report(r: &Report) {
    println!("lapse demo: {} orders over {} s", r.orders, r.duration_s);
    println!(
        "  closed                 {} (at their deadline by a message: {}, by the sweeper: {})",
        r.closed, r.closed_by_timeout, r.closed_by_sweeper
    );
    println!("  paid                   {}", r.paid);
    println!("  extended               {}", r.extended);
    println!(
        "  late payments refused  {} (recorded for a refund)",
        r.late_payments_refused
    );
    println!("  early                  {}", r.early);
    println!("  still open (lost)      {}", r.open);
    println!(
        "  stock consistent       {}",
        if r.stock_consistent {
            "yes (reservations back to their start, sold = the paid orders' units)"
        } else {
            "NO"
        }
    );
    match &r.lateness_ms {
        Some(l) => println!(
            "  lateness               p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            l.p50, l.p90, l.p99, l.max
        ),
        None => println!("  lateness               - (nothing closed)"),
    }
    let hops: Vec<String> = r.hops.iter().map(|(h, n)| format!("{h}: {n}")).collect();
    println!("  hops (closes)          {}", hops.join(", "));
    if r.actions_too_late + r.action_errors > 0 {
        println!(
            "  workload               {} payment(s)/extension(s) ran after their deadline, {} failed",
            r.actions_too_late, r.action_errors
        );
    }
    if let Some(svg) = &r.svg {
        println!("  picture                {svg}");
    }
    if r.kept {
        println!(
            "  kept                   prefix {}, database {}",
            r.prefix, r.database
        );
    } else {
        println!(
            "  removed                prefix {}, database {}",
            r.prefix, r.database
        );
    }
    for p in &r.problems {
        println!("  PROBLEM: {p}");
    }
}

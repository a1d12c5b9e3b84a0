//! `saturation`: the highest steady rate whose lateness p99 stays within 100 ms.
//!
//! One worker, steady loads one after the other at rising rates: from `--rate`, doubled
//! while a load keeps the bound, then halved between the last rate that kept it and the
//! first that did not, until the two are within 10 % of each other. A load keeps the
//! bound when none of its orders closed early, none was lost, p99 lateness was at most
//! 100 ms, and the generator reached at least 95 % of the asked rate (it runs on the
//! same machine: a rate it cannot reach is one the machine cannot sustain; each load's
//! created rate is in the report).

use super::env::BenchEnv;
use super::load::Steady;
use super::report::ScenarioReport;
use super::steady::step;

/// Lateness p99 a rate must keep, in milliseconds.
pub const P99_BOUND_MS: f64 = 100.0;

/// Loads run at most (start, doublings, halvings), so a run ends in bounded time.
const MAX_LOADS: usize = 10;

/// The search's options: the steady load (its rate is the first one tried) and the
/// highest rate to try.
#[derive(Clone, Debug)]
pub struct Search {
    pub load: Steady,
    pub max_rate: u32,
}

/// Whether a load at `rate` kept the bound: nothing early or lost, p99 within the
/// bound, and the orders created at 95 % of the rate or more. The generator runs on
/// the same machine as everything else, so a rate it cannot reach is a rate the
/// machine cannot sustain, and counts as missed.
fn kept(s: &ScenarioReport, rate: u32) -> bool {
    let created = s.figures.get("created_per_s").copied().unwrap_or(0.0);
    s.early == 0
        && s.lost == 0
        && s.lateness_ms.p99 <= P99_BOUND_MS
        && created >= 0.95 * f64::from(rate)
}

/// The next rate to try after `kept` (highest that kept the bound, 0 for none) and
/// `missed` (lowest that did not, `None` for none yet), or `None` when the search is
/// done.
fn next_rate(kept: u32, missed: Option<u32>, first: u32, max_rate: u32) -> Option<u32> {
    match missed {
        None if kept == 0 => Some(first.min(max_rate)),
        None if kept >= max_rate => None,
        None => Some(kept.saturating_mul(2).min(max_rate)),
        Some(m) if kept == 0 => (m > 1).then_some(m / 2),
        Some(m) => {
            if m <= kept.saturating_add(1) || f64::from(m) <= f64::from(kept) * 1.1 {
                None
            } else {
                Some(kept + (m - kept) / 2)
            }
        }
    }
}

/// The search's state after `loads`: the rate of the last load that kept the bound
/// (0 for none) and of the last that missed it. Each rate tried lies between the two,
/// so these are the highest kept and the lowest missed.
fn bounds(loads: &[(u32, ScenarioReport)]) -> (u32, Option<u32>) {
    let kept_rate = loads
        .iter()
        .rev()
        .find(|(rate, s)| kept(s, *rate))
        .map_or(0, |(rate, _)| *rate);
    let missed = loads
        .iter()
        .rev()
        .find(|(rate, s)| !kept(s, *rate))
        .map(|(rate, _)| *rate);
    (kept_rate, missed)
}

/// Runs the search and sums it up with [`summary`].
pub async fn saturation(env: &mut BenchEnv, search: &Search) -> anyhow::Result<ScenarioReport> {
    env.reset().await?;
    env.start_ready(&[], 1).await?;
    let mut loads: Vec<(u32, ScenarioReport)> = Vec::new();
    while loads.len() < MAX_LOADS {
        let (kept_rate, missed) = bounds(&loads);
        let Some(rate) = next_rate(kept_rate, missed, search.load.rate, search.max_rate) else {
            break;
        };
        let load = Steady {
            rate,
            ..search.load.clone()
        };
        let s = step(env, &load, &format!("saturation {rate}/s")).await?;
        let broke = s.early > 0 || s.lost > 0;
        loads.push((rate, s));
        if broke {
            break;
        }
    }
    env.stop_workers().await;
    env.forget_stopped();
    Ok(summary(loads, search))
}

/// One report for the search from its loads, in the order they ran. Its orders,
/// lateness, hops and CPU are those of the load at the highest rate that kept the
/// bound (of the last load when none did); its early and lost counts add up every
/// load; its figures hold each load's p99 and created rate, the orders of all loads,
/// and whether the search converged (it ends early at the 10th load, or at an order
/// early or lost).
fn summary(loads: Vec<(u32, ScenarioReport)>, search: &Search) -> ScenarioReport {
    let (kept_rate, missed) = bounds(&loads);
    let (mut early, mut lost, mut orders) = (0, 0, 0);
    let mut per_load = Vec::new();
    let (mut best, mut last) = (None, None);
    for (rate, s) in loads {
        early += s.early;
        lost += s.lost;
        orders += s.orders;
        per_load.push((
            rate,
            s.lateness_ms.p99,
            s.figures.get("created_per_s").copied(),
        ));
        if kept(&s, rate) {
            best = Some(s);
        } else {
            last = Some(s);
        }
    }
    let converged = next_rate(kept_rate, missed, search.load.rate, search.max_rate).is_none();
    let mut report = best.or(last).unwrap_or_default();
    report.scenario = "saturation".into();
    report.parameters.remove("rate");
    report.param("first_rate", search.load.rate);
    report.param("max_rate", search.max_rate);
    report.param("p99_bound_ms", P99_BOUND_MS);
    report.early = early;
    report.lost = lost;
    report.figure("orders_all_loads", orders as f64);
    report.figure("saturation_rate_per_s", f64::from(kept_rate));
    report.figure("loads", per_load.len() as f64);
    report.figure("converged", if converged { 1.0 } else { 0.0 });
    for (rate, p99, created) in &per_load {
        report.figure(&format!("at_{rate:06}_p99_ms"), *p99);
        if let Some(c) = created {
            report.figure(&format!("at_{rate:06}_created_per_s"), *c);
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plays the search against a system that keeps the bound up to `limit`.
    fn rates_tried(first: u32, max_rate: u32, limit: u32) -> (Vec<u32>, u32) {
        let (mut kept, mut missed, mut tried) = (0, None, Vec::new());
        while tried.len() < MAX_LOADS {
            let Some(r) = next_rate(kept, missed, first, max_rate) else {
                break;
            };
            tried.push(r);
            if r <= limit {
                kept = r;
            } else {
                missed = Some(r);
            }
        }
        (tried, kept)
    }

    #[test]
    fn doubles_then_halves_to_within_ten_percent() {
        let (tried, kept) = rates_tried(200, 100_000, 560);
        assert_eq!(tried, vec![200, 400, 800, 600, 500, 550]);
        assert_eq!(kept, 550);
    }

    #[test]
    fn a_first_rate_that_misses_searches_downwards() {
        let (tried, kept) = rates_tried(200, 100_000, 70);
        assert_eq!(tried, vec![200, 100, 50, 75, 62, 68, 71]);
        assert_eq!(kept, 68);
    }

    #[test]
    fn stops_at_the_highest_rate_allowed() {
        let (tried, kept) = rates_tried(20, 40, 1_000);
        assert_eq!(tried, vec![20, 40]);
        assert_eq!(kept, 40);
    }

    #[test]
    fn never_tries_a_rate_twice() {
        for (first, limit) in [(4, 9), (3, 6), (1, 1), (2, 3), (7, 12)] {
            let (tried, kept) = rates_tried(first, 100, limit);
            let mut unique = tried.clone();
            unique.sort();
            unique.dedup();
            assert_eq!(unique.len(), tried.len(), "{first} {limit}: {tried:?}");
            assert_eq!(kept, limit, "{first} {limit}: {tried:?}");
        }
    }

    /// A load at `rate` that created `created` orders at `created_per_s`, with this
    /// p99 and these early and lost counts.
    fn load(
        rate: u32,
        created_per_s: f64,
        p99: f64,
        early: u64,
        lost: u64,
    ) -> (u32, ScenarioReport) {
        let mut s = ScenarioReport::new("saturation");
        s.param("rate", rate);
        s.orders = u64::from(rate) * 10;
        s.early = early;
        s.lost = lost;
        s.lateness_ms.p99 = p99;
        s.figure("created_per_s", created_per_s);
        (rate, s)
    }

    fn search(first: u32, max_rate: u32) -> Search {
        Search {
            load: Steady {
                rate: first,
                duration: std::time::Duration::from_secs(10),
                connections: 4,
                deadlines: vec![std::time::Duration::from_secs(5)],
            },
            max_rate,
        }
    }

    #[test]
    fn the_summary_is_the_best_loads_with_every_loads_counts() {
        let loads = vec![
            load(200, 200.0, 12.0, 0, 0),
            load(400, 399.0, 30.0, 0, 0),
            load(800, 790.0, 150.0, 0, 0), // p99 over the bound
            load(600, 500.0, 40.0, 0, 0),  // the generator fell behind
            load(500, 499.0, 60.0, 0, 0),
            load(550, 549.0, 90.0, 0, 0),
        ];
        let r = summary(loads, &search(200, 100_000));
        assert_eq!(r.figures["saturation_rate_per_s"], 550.0);
        assert_eq!(r.orders, 5_500, "the orders of the load at 550/s");
        assert_eq!(r.lateness_ms.p99, 90.0);
        assert_eq!(r.figures["orders_all_loads"], 30_500.0);
        assert_eq!(r.figures["loads"], 6.0);
        assert_eq!(r.figures["converged"], 1.0, "600 is within 10 % of 550");
        assert_eq!(r.figures["at_000800_p99_ms"], 150.0);
        assert_eq!(r.figures["at_000600_created_per_s"], 500.0);
        assert!(!r.parameters.contains_key("rate"));
        assert_eq!((r.early, r.lost), (0, 0));
    }

    #[test]
    fn early_or_lost_in_any_load_is_in_the_summary() {
        let loads = vec![load(200, 200.0, 12.0, 0, 0), load(400, 400.0, 30.0, 1, 2)];
        let r = summary(loads, &search(200, 100_000));
        assert_eq!((r.early, r.lost), (1, 2));
        assert_eq!(r.figures["saturation_rate_per_s"], 200.0);
        assert_eq!(r.figures["converged"], 0.0, "the search was cut short");
    }

    #[test]
    fn with_no_rate_kept_the_summary_shows_the_last_miss() {
        let loads = vec![
            load(4, 4.0, 300.0, 0, 0),
            load(2, 2.0, 250.0, 0, 0),
            load(1, 1.0, 200.0, 0, 0),
        ];
        let r = summary(loads, &search(4, 100));
        assert_eq!(r.figures["saturation_rate_per_s"], 0.0);
        assert_eq!(r.lateness_ms.p99, 200.0, "not zeros that look perfect");
        assert_eq!(r.orders, 10);
        assert_eq!(r.figures["converged"], 1.0);
    }

    #[test]
    fn nothing_keeps_the_bound() {
        let (tried, kept) = rates_tried(4, 100, 0);
        assert_eq!(tried, vec![4, 2, 1]);
        assert_eq!(kept, 0);
    }
}

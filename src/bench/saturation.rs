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

/// Runs the search. The report's orders, lateness, hops and CPU are those of the load
/// at the highest rate that kept the bound (of the last load when none did); its
/// early and lost counts add up every load; its figures hold each load's p99 and
/// created rate, the orders of all loads, and whether the search converged (it ends
/// early at the 10th load, or at an order early or lost).
pub async fn saturation(env: &mut BenchEnv, search: &Search) -> anyhow::Result<ScenarioReport> {
    env.reset().await?;
    env.start_ready(&[], 1).await?;
    let (mut best, mut last): (Option<ScenarioReport>, Option<ScenarioReport>) = (None, None);
    let (mut kept_rate, mut missed) = (0u32, None::<u32>);
    let (mut early, mut lost, mut orders) = (0, 0, 0);
    let mut loads = Vec::new();
    while loads.len() < MAX_LOADS {
        let Some(rate) = next_rate(kept_rate, missed, search.load.rate, search.max_rate) else {
            break;
        };
        let load = Steady {
            rate,
            ..search.load.clone()
        };
        let s = step(env, &load, &format!("saturation {rate}/s")).await?;
        early += s.early;
        lost += s.lost;
        orders += s.orders;
        let created = s.figures.get("created_per_s").copied();
        loads.push((rate, s.lateness_ms.p99, created));
        if kept(&s, rate) {
            kept_rate = rate;
            best = Some(s);
        } else {
            missed = Some(rate);
            last = Some(s);
        }
        if early > 0 || lost > 0 {
            break;
        }
    }
    env.stop_workers().await;
    env.forget_stopped();
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
    report.figure("loads", loads.len() as f64);
    report.figure("converged", if converged { 1.0 } else { 0.0 });
    for (rate, p99, created) in &loads {
        report.figure(&format!("at_{rate:05}_p99_ms"), *p99);
        if let Some(c) = created {
            report.figure(&format!("at_{rate:05}_created_per_s"), *c);
        }
    }
    Ok(report)
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

    #[test]
    fn nothing_keeps_the_bound() {
        let (tried, kept) = rates_tried(4, 100, 0);
        assert_eq!(tried, vec![4, 2, 1]);
        assert_eq!(kept, 0);
    }
}

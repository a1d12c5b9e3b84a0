//! What a scenario measured, as one serializable record: lateness percentiles,
//! correctness counts, throughput, CPU per 1,000 orders, and ratios to `raw`.

use std::collections::BTreeMap;

use serde::Serialize;

use super::cpu::CpuSample;

/// Lateness percentiles in milliseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Lateness {
    pub count: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl Lateness {
    /// Percentiles of `ms` (sorted in place); all zero for no samples.
    pub fn of(ms: &mut [f64]) -> Self {
        ms.sort_by(|a, b| a.total_cmp(b));
        let at = |q: f64| -> f64 {
            if ms.is_empty() {
                return 0.0;
            }
            let i = ((ms.len() as f64 * q).ceil() as usize).clamp(1, ms.len()) - 1;
            ms[i]
        };
        Self {
            count: ms.len(),
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            p999: at(0.999),
            max: ms.last().copied().unwrap_or(0.0),
        }
    }
}

/// CPU seconds per 1,000 orders (or messages, for `raw`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct CpuPerThousand {
    pub lapse: f64,
    pub postgres: f64,
    pub rabbitmq: f64,
    pub total: f64,
    /// Busy CPU seconds of the whole machine per 1,000, to compare with the sum: the
    /// difference is the load generator and whatever else ran meanwhile.
    pub machine: f64,
}

impl CpuPerThousand {
    pub fn between(before: CpuSample, after: CpuSample, lapse: f64, units: u64) -> Self {
        let per = |secs: f64| {
            if units == 0 {
                0.0
            } else {
                (secs.max(0.0) * 1000.0 / units as f64 * 1000.0).round() / 1000.0
            }
        };
        // A service process that exits meanwhile takes its time with it: never below 0.
        let (lapse, pg, mq) = (
            lapse.max(0.0),
            (after.postgres - before.postgres).max(0.0),
            (after.rabbitmq - before.rabbitmq).max(0.0),
        );
        Self {
            lapse: per(lapse),
            postgres: per(pg),
            rabbitmq: per(mq),
            total: per(lapse + pg + mq),
            machine: per(after.machine - before.machine),
        }
    }
}

/// One scenario's result.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ScenarioReport {
    pub scenario: String,
    /// The options it ran with, as text.
    pub parameters: BTreeMap<String, String>,
    /// Orders (or messages) created.
    pub orders: u64,
    /// Closed before their deadline (must be 0); for `raw`, messages the broker
    /// delivered more than 1 ms before their TTL (a warning).
    pub early: u64,
    /// Not closed (or not released) within the wait limit (must be 0).
    pub lost: u64,
    pub lateness_ms: Lateness,
    /// Orders closed by number of hops.
    pub hops: BTreeMap<u32, u64>,
    /// Orders closed by path (`timeout`, `sweeper`).
    pub closed_by: BTreeMap<String, u64>,
    /// Scenario figures (closes/s, RSS, bytes per order, ...), by name.
    pub figures: BTreeMap<String, f64>,
    /// This figure divided by the same figure of `raw` in the same run.
    pub vs_raw: BTreeMap<String, f64>,
    pub cpu_per_1000: CpuPerThousand,
    /// Seconds the scenario took.
    pub elapsed_s: f64,
    /// One-minute load average when it ended (other work on the machine).
    pub load_average: f64,
    /// Closes per second, one value per 100 ms from the first close.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub closes_per_s: Vec<f64>,
    /// Every lateness sample (ms), for the CDF; not in the JSON.
    #[serde(skip)]
    pub samples: Vec<f64>,
}

impl ScenarioReport {
    pub fn new(scenario: &str) -> Self {
        Self {
            scenario: scenario.to_string(),
            ..Self::default()
        }
    }

    pub fn param(&mut self, key: &str, value: impl ToString) {
        self.parameters.insert(key.to_string(), value.to_string());
    }

    pub fn figure(&mut self, key: &str, value: f64) {
        self.figures
            .insert(key.to_string(), (value * 1000.0).round() / 1000.0);
    }

    /// Ratios of the named figures against `raw`, and of lateness when `lateness`
    /// (scenarios whose orders are due at their deadline, not overdue by design).
    pub fn compare(&mut self, raw: &ScenarioReport, lateness: bool, figures: &[(&str, &str)]) {
        let mut put = |key: String, mine: f64, theirs: f64| {
            if theirs > 0.0 {
                self.vs_raw
                    .insert(key, (mine / theirs * 100.0).round() / 100.0);
            }
        };
        if lateness && self.lateness_ms.count > 0 {
            put("p50".into(), self.lateness_ms.p50, raw.lateness_ms.p50);
            put("p99".into(), self.lateness_ms.p99, raw.lateness_ms.p99);
        }
        for (mine, theirs) in figures {
            if let (Some(a), Some(b)) = (self.figures.get(*mine), raw.figures.get(*theirs)) {
                put(format!("{mine}/{theirs}"), *a, *b);
            }
        }
    }
}

/// The whole run.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub lapse_version: String,
    pub cores: usize,
    pub scenarios: Vec<ScenarioReport>,
}

impl Report {
    /// True when every scenario kept the promises: nothing lost, and no order closed
    /// early. `raw`'s early arrivals are the broker's own timers running fast (see
    /// [`Self::broker_early`]), not a close: they do not fail the run.
    pub fn correct(&self) -> bool {
        self.scenarios
            .iter()
            .all(|s| s.lost == 0 && (s.early == 0 || s.scenario == "raw"))
    }

    /// `raw`'s messages that the broker alone delivered more than 1 ms before their
    /// TTL ran out, how many paced messages it timed, and their median lateness, when
    /// there are any.
    pub fn broker_early(&self) -> Option<(u64, usize, f64)> {
        self.scenarios
            .iter()
            .find(|s| s.scenario == "raw" && s.early > 0)
            .map(|s| (s.early, s.lateness_ms.count, s.lateness_ms.p50))
    }

    /// The human table printed at the end.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:<9} {:>8} {:>5} {:>4} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7} {:>6}\n",
            "scenario",
            "orders",
            "early",
            "lost",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "p99.9",
            "max ms",
            "cpu lap",
            "cpu pg",
            "cpu mq",
            "load"
        );
        for s in &self.scenarios {
            let l = &s.lateness_ms;
            let c = &s.cpu_per_1000;
            out.push_str(&format!(
                "{:<9} {:>8} {:>5} {:>4} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>7.3} {:>7.3} {:>7.3} {:>6.2}\n",
                s.scenario,
                s.orders,
                s.early,
                s.lost,
                l.p50,
                l.p90,
                l.p99,
                l.p999,
                l.max,
                c.lapse,
                c.postgres,
                c.rabbitmq,
                s.load_average
            ));
        }
        out.push_str(
            "(cpu: CPU seconds per 1,000 orders; PostgreSQL and RabbitMQ are machine-wide)\n",
        );
        for s in &self.scenarios {
            let mut parts: Vec<String> =
                s.figures.iter().map(|(k, v)| format!("{k} {v}")).collect();
            parts.extend(s.vs_raw.iter().map(|(k, v)| format!("{k} vs raw x{v}")));
            if !s.hops.is_empty() {
                let hops: Vec<String> = s.hops.iter().map(|(h, n)| format!("{h}:{n}")).collect();
                parts.push(format!("hops {}", hops.join(" ")));
            }
            if !s.closed_by.is_empty() {
                let by: Vec<String> = s
                    .closed_by
                    .iter()
                    .map(|(k, n)| format!("{k} {n}"))
                    .collect();
                parts.push(format!("closed by {}", by.join(", ")));
            }
            out.push_str(&format!("{}: {}\n", s.scenario, parts.join("; ")));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut ms: Vec<f64> = (1..=1000).map(f64::from).collect();
        let l = Lateness::of(&mut ms);
        assert_eq!(
            (l.p50, l.p90, l.p99, l.p999, l.max),
            (500.0, 900.0, 990.0, 999.0, 1000.0)
        );
        assert_eq!(Lateness::of(&mut []).count, 0);
    }

    fn run_with(scenario: &str, early: u64, lost: u64) -> Report {
        let mut raw = ScenarioReport::new("raw");
        raw.lateness_ms.count = 400;
        let mut other = ScenarioReport::new(scenario);
        other.early = early;
        other.lost = lost;
        Report {
            scenarios: vec![raw, other],
            ..Report::default()
        }
    }

    #[test]
    fn an_early_close_or_a_loss_fails_the_run_but_the_broker_s_own_early_arrivals_do_not() {
        assert!(run_with("steady", 0, 0).correct());
        assert!(!run_with("steady", 1, 0).correct());
        assert!(!run_with("backlog", 0, 1).correct());
        let mut report = run_with("steady", 0, 0);
        report.scenarios[0].early = 400;
        report.scenarios[0].lateness_ms.p50 = -7.8;
        assert!(report.correct());
        assert_eq!(report.broker_early(), Some((400, 400, -7.8)));
        report.scenarios[0].lost = 1;
        assert!(
            !report.correct(),
            "the broker losing messages still fails the run"
        );
        assert_eq!(run_with("steady", 0, 0).broker_early(), None);
    }
}

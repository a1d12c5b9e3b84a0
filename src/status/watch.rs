//! `lapse status --watch`: the backlog (timeouts in the wait tiers and the due queue)
//! between refreshes, its drain rate over the last few and an estimate of when it is
//! empty at that rate.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Serialize;

/// Refreshes the rate is measured over (the oldest kept sample to the newest).
pub const RATE_WINDOW: usize = 5;

/// The backlog's last samples.
#[derive(Debug, Default)]
pub struct Drain {
    samples: VecDeque<(Instant, u64)>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DrainRate {
    pub backlog: u64,
    /// Messages per second leaving the backlog (negative: it grows); `None` before
    /// the second sample.
    pub per_second: Option<f64>,
    /// Over how long the rate was measured.
    pub over_seconds: f64,
    /// Seconds until empty at this rate; `None` when it does not drain.
    pub eta_seconds: Option<f64>,
}

impl Drain {
    /// Records `backlog` seen at `at`; returns the rate over the kept samples.
    pub fn sample(&mut self, at: Instant, backlog: u64) -> DrainRate {
        self.samples.push_back((at, backlog));
        while self.samples.len() > RATE_WINDOW + 1 {
            self.samples.pop_front();
        }
        let (first_at, first) = self.samples[0];
        let elapsed = at.saturating_duration_since(first_at).as_secs_f64();
        let per_second = (self.samples.len() > 1 && elapsed > 0.0)
            .then(|| (first as f64 - backlog as f64) / elapsed);
        let eta_seconds = match per_second {
            _ if backlog == 0 => Some(0.0),
            Some(rate) if rate > 0.0 => Some(backlog as f64 / rate),
            _ => None,
        };
        DrainRate {
            backlog,
            per_second,
            over_seconds: elapsed,
            eta_seconds,
        }
    }
}

impl DrainRate {
    /// `backlog 120; draining 12.0/s over the last 10s; empty in about 10s`.
    pub fn line(&self) -> String {
        let over =
            humantime::format_duration(Duration::from_secs(self.over_seconds.round() as u64));
        let rate = match self.per_second {
            None => "rate: measuring (needs a second refresh)".to_string(),
            Some(r) if r > 0.0 => format!("draining {r:.1}/s over the last {over}"),
            Some(r) if r < 0.0 => format!("growing {:.1}/s over the last {over}", -r),
            Some(_) => format!("steady over the last {over}"),
        };
        let eta = match self.eta_seconds {
            Some(_) if self.backlog == 0 => "empty".to_string(),
            Some(s) => format!(
                "ETA empty in about {}",
                humantime::format_duration(Duration::from_secs(s.ceil() as u64))
            ),
            None => "ETA: none at this rate".to_string(),
        };
        format!("BACKLOG {}; {rate}; {eta}", self.backlog)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_and_eta_follow_the_kept_samples() {
        let start = Instant::now();
        let mut drain = Drain::default();
        let first = drain.sample(start, 100);
        assert_eq!(first.per_second, None);
        assert_eq!(first.eta_seconds, None);
        let second = drain.sample(start + Duration::from_secs(10), 80);
        assert_eq!(second.per_second, Some(2.0));
        assert_eq!(second.eta_seconds, Some(40.0));
        assert!(
            second.line().contains("draining 2.0/s"),
            "{}",
            second.line()
        );
        assert!(second.line().contains("ETA empty in about 40s"));
        let growing = drain.sample(start + Duration::from_secs(20), 120);
        assert_eq!(growing.per_second, Some(-1.0));
        assert_eq!(growing.eta_seconds, None);
    }

    #[test]
    fn only_the_last_window_counts() {
        let start = Instant::now();
        let mut drain = Drain::default();
        drain.sample(start, 1000);
        for i in 1..=RATE_WINDOW as u64 + 1 {
            drain.sample(start + Duration::from_secs(i), 10);
        }
        let last = drain.sample(start + Duration::from_secs(RATE_WINDOW as u64 + 2), 10);
        assert_eq!(last.per_second, Some(0.0));
        assert_eq!(last.over_seconds, RATE_WINDOW as f64);
    }
}

//! `lapse status --check`: the problems in a [`Status`], one line each, for cron and
//! monitoring scripts. A due queue without a consumer comes first: nothing closes
//! orders then.

use std::time::Duration;

use serde::Serialize;

use super::Status;
use crate::amqp::topology::{CheckStatus, VerifyReport};

/// What counts as a problem; the defaults suit a worker under normal load.
#[derive(Clone, Copy, Debug)]
pub struct Thresholds {
    /// An UNPAID order overdue for longer than this is a problem.
    pub overdue: Duration,
    /// An outbox row older than this is a problem.
    pub outbox: Duration,
    /// More parked messages than this is a problem.
    pub parked: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// A stable name for scripts: `no_consumer`, `missing_queue`, `drift`, `parked`,
    /// `overdue`, `outbox`, `releases_missing`, `unreadable_deadlines`, `unreachable`.
    pub kind: &'static str,
    pub message: String,
}

impl Problem {
    pub fn new(kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// The line printed for it: `KIND: message`.
    pub fn line(&self) -> String {
        format!("{}: {}", self.kind.to_ascii_uppercase(), self.message)
    }
}

fn age(ms: Option<f64>) -> String {
    let ms = ms.unwrap_or(0.0).max(0.0);
    // Whole seconds read better than milliseconds in an alert.
    humantime::format_duration(Duration::from_secs((ms / 1000.0) as u64)).to_string()
}

fn over(ms: Option<f64>, limit: Duration) -> bool {
    ms.is_some_and(|ms| ms > limit.as_secs_f64() * 1000.0)
}

/// The problems of `status` (and of `drift`, the AMQP-only topology check, when given).
// Over 60 lines on purpose: one check per problem `--check` reports, in the documented order.
pub fn problems(
    status: &Status,
    drift: Option<&VerifyReport>,
    limits: &Thresholds,
) -> Vec<Problem> {
    let mut out = Vec::new();
    for role in ["due", "stock release"] {
        let Some(q) = status.queue(role) else {
            continue;
        };
        match (q.consumers, q.messages) {
            (Some(0), Some(messages)) => {
                let what = if role == "due" {
                    "no worker is closing orders"
                } else {
                    "no worker is applying stock releases"
                };
                out.push(Problem::new(
                    "no_consumer",
                    format!(
                        "the {role} queue {} has no consumer ({messages} messages waiting): {what}; start `lapse worker`",
                        q.queue
                    ),
                ));
            }
            (None, _) if drift.is_none() => out.push(Problem::new(
                "missing_queue",
                format!(
                    "the {role} queue {} does not exist; run `lapse topology apply`",
                    q.queue
                ),
            )),
            _ => {}
        }
    }
    if let Some(report) = drift {
        for c in report
            .checks
            .iter()
            .filter(|c| c.status == CheckStatus::Failed)
        {
            out.push(Problem::new(
                "drift",
                format!(
                    "{} {}: {} (`lapse topology verify` for details)",
                    c.subject, c.check, c.detail
                ),
            ));
        }
    }
    let parked = status.parked();
    if parked > i64::from(limits.parked) {
        out.push(Problem::new(
            "parked",
            format!(
                "{parked} messages parked (more than {}); `lapse parked counts` says why",
                limits.parked
            ),
        ));
    }
    if status.overdue_unpaid > 0 && over(status.oldest_overdue_ms, limits.overdue) {
        out.push(Problem::new(
            "overdue",
            format!(
                "{} UNPAID orders past their deadline, the oldest by {} (more than {}): closes are behind or not running",
                status.overdue_unpaid,
                age(status.oldest_overdue_ms),
                humantime::format_duration(limits.overdue)
            ),
        ));
    }
    for k in &status.kinds {
        if k.overdue > 0 && over(k.oldest_overdue_ms, limits.overdue) {
            out.push(Problem::new(
                "overdue",
                format!(
                    "{} deadlines of kind {} past their instant, the oldest by {} (more than {}): firing is behind or not running",
                    k.overdue,
                    k.kind,
                    age(k.oldest_overdue_ms),
                    humantime::format_duration(limits.overdue)
                ),
            ));
        }
    }
    if status.outbox_rows > 0 && over(status.oldest_outbox_ms, limits.outbox) {
        out.push(Problem::new(
            "outbox",
            format!(
                "{} outbox rows, the oldest {} old (more than {}), {} refused or unroutable: the relay is behind or not running",
                status.outbox_rows,
                age(status.oldest_outbox_ms),
                humantime::format_duration(limits.outbox),
                status.outbox_retrying
            ),
        ));
    }
    if status.releases_missing > 0 {
        out.push(Problem::new(
            "releases_missing",
            format!(
                "{} closed orders have no stock release {} after their close, the oldest closed {} ago; {} given up by the reconciler",
                status.releases_missing,
                humantime::format_duration(Duration::from_millis(status.release_grace_ms)),
                age(status.oldest_missing_release_ms),
                status.releases_exhausted
            ),
        ));
    }
    if status.unreadable_deadlines > 0 {
        out.push(Problem::new(
            "unreadable_deadlines",
            format!(
                "{} UNPAID orders have a deadline lapse cannot handle and are never closed; repair them (docs/operations.md)",
                status.unreadable_deadlines
            ),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::QueueDepth;

    fn status(due_consumers: u32, parked: u32) -> Status {
        let q = |queue: &str, role: &str, messages, consumers| QueueDepth {
            queue: queue.into(),
            role: role.into(),
            messages: Some(messages),
            consumers: Some(consumers),
        };
        Status {
            queues: vec![
                q("p.wait.1s", "wait 1s", 4, 0),
                q("p.due", "due", 2, due_consumers),
                q("p.parked", "parked", parked, 0),
                q("p.stock.release", "stock release", 0, 1),
            ],
            overdue_unpaid: 0,
            oldest_overdue_ms: None,
            unreadable_deadlines: 0,
            outbox_rows: 0,
            oldest_outbox_ms: None,
            outbox_retrying: 0,
            recent_window_minutes: 5,
            recent_closes: 0,
            recent_sweeper_closes: 0,
            recent_release_repairs: 0,
            release_repairs_total: 0,
            releases_missing: 0,
            oldest_missing_release_ms: None,
            release_grace_ms: 60_000,
            releases_exhausted: 0,
            parked_entries: 0,
            retention_pruned: 0,
            retention_last_ms: None,
            kinds: Vec::new(),
            lateness_p50_ms: None,
            lateness_p99_ms: None,
            lateness_max_ms: None,
            shards: Vec::new(),
        }
    }

    const LIMITS: Thresholds = Thresholds {
        overdue: Duration::from_secs(60),
        outbox: Duration::from_secs(60),
        parked: 0,
    };

    #[test]
    fn a_healthy_status_has_no_problem() {
        assert_eq!(problems(&status(1, 0), None, &LIMITS), vec![]);
        assert_eq!(status(1, 0).backlog(), 6);
    }

    #[test]
    fn a_due_queue_without_consumer_comes_first() {
        let found = problems(&status(0, 3), None, &LIMITS);
        let kinds: Vec<&str> = found.iter().map(|p| p.kind).collect();
        assert_eq!(kinds, ["no_consumer", "parked"]);
        assert!(
            found[0]
                .line()
                .starts_with("NO_CONSUMER: the due queue p.due")
        );
    }

    #[test]
    fn thresholds_are_exclusive_limits() {
        let mut s = status(1, 2);
        s.overdue_unpaid = 3;
        s.oldest_overdue_ms = Some(59_000.0);
        let limits = Thresholds {
            parked: 2,
            ..LIMITS
        };
        assert_eq!(problems(&s, None, &limits), vec![]);
        s.oldest_overdue_ms = Some(61_000.0);
        let found = problems(&s, None, &limits);
        assert_eq!(found.len(), 1);
        assert!(
            found[0].message.contains("the oldest by 1m 1s"),
            "{found:?}"
        );
    }
}

//! The text `lapse status` prints: queues, orders, closes, releases, and with
//! shards one line per shard.

use std::time::Duration;

use super::Status;

impl Status {
    pub fn render(&self) -> String {
        let mut out = String::new();
        self.render_missing_consumers(&mut out);
        self.render_queues(&mut out);
        self.render_orders(&mut out);
        self.render_closes(&mut out);
        self.render_releases(&mut out);
        self.render_shards(&mut out);
        out
    }

    /// A warning line for each due or stock release queue nobody consumes.
    fn render_missing_consumers(&self, out: &mut String) {
        for q in &self.queues {
            if q.consumers == Some(0) && matches!(q.role.as_str(), "due" | "stock release") {
                out.push_str(&format!(
                    "NO CONSUMER on {} ({}): no worker is running for this prefix\n",
                    q.queue, q.role
                ));
            }
        }
    }

    fn render_queues(&self, out: &mut String) {
        out.push_str(&format!(
            "QUEUES\n  {:<40} {:<14} {:>9} {:>9}\n",
            "name", "role", "messages", "consumers"
        ));
        for q in &self.queues {
            let depth = q.messages.map_or("MISSING".to_string(), |n| n.to_string());
            let consumers = q.consumers.map_or("-".to_string(), |n| n.to_string());
            out.push_str(&format!(
                "  {:<40} {:<14} {depth:>9} {consumers:>9}\n",
                q.queue, q.role
            ));
        }
    }

    fn render_orders(&self, out: &mut String) {
        out.push_str(&format!(
            "ORDERS\n  overdue UNPAID     {} (oldest {})\n  outbox rows        {} (oldest {}, {} refused or unroutable)\n",
            self.overdue_unpaid,
            ms(self.oldest_overdue_ms),
            self.outbox_rows,
            ms(self.oldest_outbox_ms),
            self.outbox_retrying,
        ));
        let queued = self.parked() - self.parked_entries;
        out.push_str(&format!(
            "  parked             {} in the parked book, {} still in the queue (`lapse parked counts`)\n",
            self.parked_entries, queued,
        ));
        if self.unreadable_deadlines > 0 {
            out.push_str(&format!(
                "  UNREADABLE         {} UNPAID orders with a deadline lapse cannot handle (docs/operations.md)\n",
                self.unreadable_deadlines
            ));
        }
    }

    fn render_closes(&self, out: &mut String) {
        out.push_str(&format!(
            "CLOSES (last {} min)\n  closed             {} ({} by the sweeper)\n  release repairs    {} ({} ever)\n  lateness           p50 {}, p99 {}, max {}\n",
            self.recent_window_minutes,
            self.recent_closes,
            self.recent_sweeper_closes,
            self.recent_release_repairs,
            self.release_repairs_total,
            ms(self.lateness_p50_ms),
            ms(self.lateness_p99_ms),
            ms(self.lateness_max_ms),
        ));
    }

    fn render_releases(&self, out: &mut String) {
        out.push_str(&format!(
            "RELEASES\n  missing            {} closed more than {} ago without a stock release (oldest {}, {} given up by the reconciler)\n",
            self.releases_missing,
            humantime::format_duration(Duration::from_millis(self.release_grace_ms)),
            ms(self.oldest_missing_release_ms),
            self.releases_exhausted,
        ));
        let last = match self.retention_last_ms {
            Some(_) => format!("last batch {} ago", ms(self.retention_last_ms)),
            None => "nothing old enough yet".to_string(),
        };
        out.push_str(&format!(
            "RETENTION\n  pruned             {} rows of finished orders ({last})\n",
            self.retention_pruned,
        ));
        for k in &self.kinds {
            out.push_str(&format!(
                "KIND {}
  pending            {} ({} waiting in the database for their range), {} overdue (oldest {}), {} failing (parked: action_failed)
",
                k.kind,
                k.pending,
                k.in_database,
                k.overdue,
                ms(k.oldest_overdue_ms),
                k.failing,
            ));
        }
    }

    /// One line per shard; nothing without shards.
    fn render_shards(&self, out: &mut String) {
        if self.shards.is_empty() {
            return;
        }
        out.push_str(&format!(
            "SHARDS\n  {:<6} {:>8} {:>14} {:>7} {:>14} {:>7} {:>9} {:>12}\n",
            "shard", "overdue", "oldest", "outbox", "oldest", "closed", "missing", "lateness p99"
        ));
        for s in &self.shards {
            out.push_str(&format!(
                "  {:<6} {:>8} {:>14} {:>7} {:>14} {:>7} {:>9} {:>12}\n",
                s.shard,
                s.overdue_unpaid,
                ms(s.oldest_overdue_ms),
                s.outbox_rows,
                ms(s.oldest_outbox_ms),
                s.recent_closes,
                s.releases_missing,
                ms(s.lateness_p99_ms),
            ));
        }
    }
}

/// A duration given in milliseconds, as a person reads it: `12.3 ms` below a second,
/// `4.2 s` below a minute, then `2h 5m 3s`; `-` when there is none.
fn ms(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() && v.abs() < 1_000.0 => format!("{v:.1} ms"),
        Some(v) if v.is_finite() && v.abs() < 60_000.0 => format!("{:.1} s", v / 1_000.0),
        Some(v) if v.is_finite() => {
            humantime::format_duration(Duration::from_secs((v / 1_000.0).max(0.0) as u64))
                .to_string()
        }
        _ => "-".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::ms;

    #[test]
    fn durations_read_as_a_person_would_say_them() {
        assert_eq!(ms(None), "-");
        assert_eq!(ms(Some(f64::NAN)), "-");
        assert_eq!(ms(Some(12.34)), "12.3 ms");
        assert_eq!(ms(Some(4_200.0)), "4.2 s");
        assert_eq!(ms(Some(7_200_000.0)), "2h");
        assert_eq!(ms(Some(7_383_000.0)), "2h 3m 3s");
        assert_eq!(ms(Some(3.0 * 86_400_000.0)), "3days");
    }
}

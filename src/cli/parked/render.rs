//! The text `lapse parked` prints: a table of rows (with each one's outcome after a
//! replay or purge) and JSON values as plain text.

use crate::parked::{Outcome, Row, rfc3339};

/// A JSON value as plain text (strings unquoted, null as `-`).
pub(super) fn text(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => "-".into(),
        other => other.to_string(),
    }
}

pub(super) fn table<'a>(
    rows: impl Iterator<Item = (&'a Row, Option<&'a Outcome>)>,
    count: usize,
) -> String {
    let dash = || "-".to_string();
    let mut out = String::new();
    let mut header = true;
    for (r, outcome) in rows {
        if header {
            out.push_str(&format!(
                "{:>6} {:<26} {:<10} {:>8} {:<24} {:>3} {:>4} {:<24} {:<22} REASON{}\n",
                "SEQ",
                "ID",
                "KIND",
                "ORDER",
                "DEADLINE",
                "V",
                "ATT",
                "PARKED AT",
                "CAUSE",
                if outcome.is_some() { " / OUTCOME" } else { "" }
            ));
            header = false;
        }
        let e = &r.entry;
        let kind = serde_json::to_value(e.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        out.push_str(&format!(
            "{:>6} {:<26} {:<10} {:>8} {:<24} {:>3} {:>4} {:<24} {:<22} {}",
            r.seq,
            e.id,
            kind,
            e.order_id.map_or_else(dash, |o| o.to_string()),
            e.deadline.map_or_else(dash, rfc3339),
            e.deadline_version.map_or_else(dash, |v| v.to_string()),
            e.attempts,
            e.parked_at.map_or_else(dash, rfc3339),
            e.cause,
            e.reason,
        ));
        if let Some(o) = outcome {
            let o = match o {
                Outcome::Kept => "kept".to_string(),
                Outcome::Replayed { to } => format!("replayed to {to}"),
                Outcome::WouldReplay { to } => format!("would replay to {to}"),
                Outcome::Purged => "purged".to_string(),
                Outcome::Failed { error } => format!("stays parked: {error}"),
            };
            out.push_str(&format!(" / {o}"));
        }
        out.push('\n');
    }
    out.push_str(&format!("{count} message(s)\n"));
    out
}

//! `[retention]`: how long lapse keeps what it records about finished orders. The
//! sweeper's leader prunes older rows in small batches
//! (the retention component).

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::ConfigError;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// Timeline events (`order_events`) of finished orders.
    pub timeline: Keep,
    /// Stock ledger rows of finished orders (paid, or closed with their stock released).
    pub ledger: Keep,
    /// Late payments whose refund is settled (not PENDING).
    pub late_payments: Keep,
    /// Rows deleted per transaction.
    pub batch_size: i64,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            timeline: Keep::For(Duration::from_secs(30 * 86_400)),
            ledger: Keep::For(Duration::from_secs(90 * 86_400)),
            late_payments: Keep::For(Duration::from_secs(400 * 86_400)),
            batch_size: 1000,
        }
    }
}

/// Shortest age a retention may have: pruning what is minutes old would take the
/// timeline away from the people reading it.
pub const MIN_KEEP: Duration = Duration::from_secs(3600);

/// How long rows are kept: a duration (`"30d"`, `"12h"`) or `"forever"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    For(Duration),
    Forever,
}

impl Keep {
    /// The age after which rows go, in milliseconds; `None` for forever.
    pub fn millis(self) -> Option<i64> {
        match self {
            Keep::For(d) => Some(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
            Keep::Forever => None,
        }
    }
}

impl std::fmt::Display for Keep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Keep::For(d) => write!(f, "{}", humantime::format_duration(*d)),
            Keep::Forever => f.write_str("forever"),
        }
    }
}

impl Serialize for Keep {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Keep {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let text = text.trim();
        if text.eq_ignore_ascii_case("forever") {
            return Ok(Keep::Forever);
        }
        humantime::parse_duration(text).map(Keep::For).map_err(|e| {
            serde::de::Error::custom(format!(
                "{text:?} is neither a duration (e.g. \"30d\") nor \"forever\": {e}"
            ))
        })
    }
}

pub fn validate(retention: &RetentionConfig) -> Result<(), ConfigError> {
    for (key, keep) in [
        ("retention.timeline", retention.timeline),
        ("retention.ledger", retention.ledger),
        ("retention.late_payments", retention.late_payments),
    ] {
        if let Keep::For(d) = keep {
            if d < MIN_KEEP {
                return Err(ConfigError::new(
                    key,
                    format!(
                        "must be at least 1h (or \"forever\"), not {}",
                        humantime::format_duration(d)
                    ),
                ));
            }
            // Past this the cut-off would lie before any timestamp PostgreSQL holds.
            if d > Duration::from_secs(100 * 366 * 86_400) {
                return Err(ConfigError::new(
                    key,
                    "must be at most 100 years; use \"forever\" to keep everything",
                ));
            }
        }
    }
    if !(1..=100_000).contains(&retention.batch_size) {
        return Err(ConfigError::new(
            "retention.batch_size",
            format!("must be between 1 and 100000, not {}", retention.batch_size),
        ));
    }
    Ok(())
}

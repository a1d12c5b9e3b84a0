//! Delay tiers: a fixed wait duration, its canonical name, and the rule that picks
//! which tier a timeout travels through next.
//!
//! Invariant: a tier is strictly positive and at most RabbitMQ's TTL maximum
//! (2^32-1 ms); its name is derived from its duration, so two spellings of the same
//! duration ("90m", "1h30m") are one tier.

use std::fmt;
use std::time::Duration;

/// RabbitMQ rejects `x-message-ttl` above 2^32-1 milliseconds.
pub const MAX_TTL_MS: u64 = u32::MAX as u64;

/// One delay tier, e.g. `30m`. Ordered by duration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tier(Duration);

/// Why a duration string cannot be a tier.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TierError {
    #[error("`{0}` is not a duration ({1}); write it like \"250ms\", \"30s\", \"1h30m\"")]
    Unparsable(String, String),
    #[error("`{0}` is zero; a tier must be longer than zero")]
    Zero(String),
    #[error("`{0}` is not a whole number of milliseconds")]
    SubMillisecond(String),
    #[error("`{0}` exceeds RabbitMQ's TTL maximum of {MAX_TTL_MS} ms (about 49.7 days)")]
    TooLong(String),
}

impl Tier {
    /// Parses a human duration such as `"250ms"` or `"1h30m"`.
    pub fn parse(text: &str) -> Result<Self, TierError> {
        let duration = humantime::parse_duration(text.trim())
            .map_err(|e| TierError::Unparsable(text.to_string(), e.to_string()))?;
        Self::from_duration(duration).map_err(|e| match e {
            TierError::Zero(_) => TierError::Zero(text.to_string()),
            TierError::SubMillisecond(_) => TierError::SubMillisecond(text.to_string()),
            TierError::TooLong(_) => TierError::TooLong(text.to_string()),
            other => other,
        })
    }

    /// Checks that `duration` is a valid tier.
    pub fn from_duration(duration: Duration) -> Result<Self, TierError> {
        let shown = format!("{duration:?}");
        if duration.is_zero() {
            return Err(TierError::Zero(shown));
        }
        if !duration.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(TierError::SubMillisecond(shown));
        }
        if duration.as_millis() > u128::from(MAX_TTL_MS) {
            return Err(TierError::TooLong(shown));
        }
        Ok(Self(duration))
    }

    pub fn duration(self) -> Duration {
        self.0
    }

    /// The queue-level TTL in milliseconds (fits in RabbitMQ's 32-bit limit).
    pub fn ttl_ms(self) -> u64 {
        self.0.as_millis() as u64
    }

    /// Canonical name: the largest units first, no spaces (`1h30m`, `250ms`).
    pub fn name(self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut ms = self.ttl_ms();
        for (unit, size) in [
            ("d", 86_400_000),
            ("h", 3_600_000),
            ("m", 60_000),
            ("s", 1_000),
            ("ms", 1),
        ] {
            if ms >= size {
                write!(f, "{}{unit}", ms / size)?;
                ms %= size;
            }
        }
        Ok(())
    }
}

/// The tiers of one deployment, sorted ascending, no duplicates, never empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierSet(Vec<Tier>);

/// The next step for a timeout with `remaining` time until its deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NextHop {
    /// Publish to this tier's wait queue.
    Wait(Tier),
    /// Shorter than the smallest tier: wait this long in the worker, then decide.
    Hold(Duration),
    /// The deadline has passed (or is within the tolerance): decide now.
    Due,
}

impl TierSet {
    /// Builds a set; the caller has already rejected duplicates and emptiness.
    pub fn new(mut tiers: Vec<Tier>) -> Self {
        tiers.sort();
        tiers.dedup();
        assert!(!tiers.is_empty(), "a tier set is never empty");
        Self(tiers)
    }

    pub fn iter(&self) -> impl Iterator<Item = Tier> + '_ {
        self.0.iter().copied()
    }

    pub fn smallest(&self) -> Tier {
        self.0[0]
    }

    pub fn largest(&self) -> Tier {
        self.0[self.0.len() - 1]
    }

    pub fn contains(&self, tier: Tier) -> bool {
        self.0.binary_search(&tier).is_ok()
    }

    /// The tier rule (docs/pipeline.md): the largest tier `t` with `t <= remaining + tolerance`.
    ///
    /// The tolerance lets a deadline equal to a tier take one hop although the relay
    /// publishes a few milliseconds after the order was written. It can only make a
    /// message arrive up to `tolerance` before its deadline, and the worker then holds
    /// it, so no close is ever early.
    pub fn next_hop(&self, remaining: Duration, tolerance: Duration) -> NextHop {
        let reach = remaining + tolerance;
        match self.0.iter().rev().find(|t| t.duration() <= reach) {
            Some(tier) => NextHop::Wait(*tier),
            None if remaining.is_zero() => NextHop::Due,
            None => NextHop::Hold(remaining),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Tier {
        Tier::parse(s).unwrap()
    }

    #[test]
    fn names_are_canonical() {
        assert_eq!(t("250ms").name(), "250ms");
        assert_eq!(t("90m").name(), "1h30m");
        assert_eq!(t("1h 30m").name(), "1h30m");
        assert_eq!(t("1s 500ms").name(), "1s500ms");
        assert_eq!(t("2days").name(), "2d");
        assert_eq!(t("30m").ttl_ms(), 1_800_000);
    }

    #[test]
    fn rejects_bad_tiers() {
        assert!(matches!(
            Tier::parse("soon"),
            Err(TierError::Unparsable(..))
        ));
        assert!(matches!(Tier::parse("0s"), Err(TierError::Zero(_))));
        assert!(matches!(
            Tier::parse("1us"),
            Err(TierError::SubMillisecond(_))
        ));
        assert!(matches!(Tier::parse("50days"), Err(TierError::TooLong(_))));
        assert!(Tier::parse("49days").is_ok());
    }

    #[test]
    fn picks_largest_tier_within_tolerance() {
        let set = TierSet::new(vec![t("30m"), t("5m"), t("10m")]);
        let tol = Duration::from_millis(50);
        let ms = Duration::from_millis;
        // A deadline equal to a tier, published a little late, still takes that tier.
        assert_eq!(
            set.next_hop(ms(1_800_000 - 20), tol),
            NextHop::Wait(t("30m"))
        );
        // 45 minutes hops 30m first.
        assert_eq!(set.next_hop(ms(2_700_000), tol), NextHop::Wait(t("30m")));
        // Beyond the largest tier: hop through it repeatedly.
        assert_eq!(set.next_hop(ms(36_000_000), tol), NextHop::Wait(t("30m")));
        // Below the smallest tier: hold.
        assert_eq!(set.next_hop(ms(1_000), tol), NextHop::Hold(ms(1_000)));
        assert_eq!(set.next_hop(Duration::ZERO, tol), NextHop::Due);
    }
}

//! What a deadline may be, shared by everything that reads or writes one.
//!
//! Invariants: a deadline lapse accepts is a finite instant in [`EARLIEST`, `LATEST`)
//! (the range every component decodes and a message carries as RFC 3339 with a
//! four-digit year; the `orders_expire_at_in_range` constraint holds the same range),
//! with millisecond precision, and never earlier than the instant asked for: rounding
//! goes up. The SQL function `lapse_checked_deadline` also enforces the past allowance
//! and the horizon, against the database clock (see docs/pipeline.md).

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

/// SQLSTATE raised by lapse's SQL functions for an invalid deadline.
pub const INVALID_DEADLINE_SQLSTATE: &str = "LP001";
/// SQLSTATE raised by `lapse_extend_deadline` when the new deadline is not later.
pub const NOT_LATER_SQLSTATE: &str = "LP002";
/// SQLSTATE raised by `lapse_pay_order` for an order whose stored deadline lies outside
/// the range lapse handles (a row older than the deadline rules): it cannot be updated.
pub const UNREADABLE_DEADLINE_SQLSTATE: &str = "LP003";

/// The earliest deadline lapse can carry: 1970-01-01T00:00:00Z.
pub const EARLIEST_UNIX_SECONDS: i64 = 0;
/// The first instant lapse cannot carry: 10000-01-01T00:00:00Z.
pub const LATEST_UNIX_SECONDS: i64 = 253_402_300_800;

/// Why a deadline is not acceptable or not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeadlineError {
    #[error("invalid deadline: a duration of {0:?} does not fit in milliseconds")]
    DurationTooLarge(Duration),
    #[error("deadline {0} is outside the range lapse handles (1970-01-01 to 9999-12-31, UTC)")]
    OutOfRange(DateTime<Utc>),
}

/// True when `t` lies in the range every component can carry and decode.
pub fn in_range(t: DateTime<Utc>) -> bool {
    (EARLIEST_UNIX_SECONDS..LATEST_UNIX_SECONDS).contains(&t.timestamp())
}

/// SQL condition: `column` lies in the carried range (the same bounds as [`in_range`]).
pub fn in_range_sql(column: &str) -> String {
    format!(
        "({column} >= to_timestamp({EARLIEST_UNIX_SECONDS}) AND {column} < to_timestamp({LATEST_UNIX_SECONDS}))"
    )
}

/// `t` if it lies in the carried range (see [`in_range`]).
pub fn checked(t: DateTime<Utc>) -> Result<DateTime<Utc>, DeadlineError> {
    if in_range(t) {
        Ok(t)
    } else {
        Err(DeadlineError::OutOfRange(t))
    }
}

/// `t` rounded up to the next whole millisecond (unchanged when already whole).
pub fn round_up_to_millis(t: DateTime<Utc>) -> Result<DateTime<Utc>, DeadlineError> {
    let sub_milli = i64::from(t.timestamp_subsec_nanos() % 1_000_000);
    if sub_milli == 0 {
        return Ok(t);
    }
    t.checked_add_signed(TimeDelta::nanoseconds(1_000_000 - sub_milli))
        .ok_or(DeadlineError::OutOfRange(t))
}

/// `d` in whole milliseconds, rounded up, or an error when it does not fit an `i64`.
pub fn ceil_millis(d: Duration) -> Result<i64, DeadlineError> {
    let millis = d.as_nanos().div_ceil(1_000_000);
    i64::try_from(millis).map_err(|_| DeadlineError::DurationTooLarge(d))
}

/// `d` in whole milliseconds for a bound taken from configuration (a grace period, an
/// age threshold): saturates instead of wrapping, so a huge value stays huge.
pub fn saturating_millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .unwrap()
            .with_timezone(&Utc)
    }

    #[test]
    fn the_range_is_1970_to_the_end_of_9999() {
        assert!(in_range(at("1970-01-01T00:00:00Z")));
        assert!(in_range(at("9999-12-31T23:59:59.999Z")));
        assert!(!in_range(at("1969-12-31T23:59:59.999Z")));
        let far = DateTime::<Utc>::from_timestamp(LATEST_UNIX_SECONDS, 0).unwrap();
        assert_eq!(far.to_rfc3339(), "+10000-01-01T00:00:00+00:00");
        assert!(!in_range(far));
        let bc = DateTime::<Utc>::from_timestamp(-62_198_755_200, 0).unwrap();
        assert!(!in_range(bc), "{bc}");
        assert!(checked(bc).is_err());
    }

    #[test]
    fn rounding_goes_up_never_down() {
        assert_eq!(
            round_up_to_millis(at("2026-12-02T10:15:00.123000Z")).unwrap(),
            at("2026-12-02T10:15:00.123Z")
        );
        assert_eq!(
            round_up_to_millis(at("2026-12-02T10:15:00.123000001Z")).unwrap(),
            at("2026-12-02T10:15:00.124Z")
        );
        assert_eq!(
            round_up_to_millis(at("2026-12-02T10:15:00.999999Z")).unwrap(),
            at("2026-12-02T10:15:01Z")
        );
        assert!(round_up_to_millis(DateTime::<Utc>::MAX_UTC).is_err());
    }

    #[test]
    fn durations_convert_checked_and_rounded_up() {
        assert_eq!(ceil_millis(Duration::from_micros(1500)), Ok(2));
        assert_eq!(ceil_millis(Duration::from_millis(30)), Ok(30));
        assert_eq!(ceil_millis(Duration::ZERO), Ok(0));
        // 2^64 ms - 60 s used to wrap to "60 s earlier".
        let wraps = Duration::from_millis(u64::MAX - 59_999);
        assert_eq!(
            ceil_millis(wraps),
            Err(DeadlineError::DurationTooLarge(wraps))
        );
        assert!(ceil_millis(Duration::MAX).is_err());
        assert_eq!(saturating_millis(Duration::MAX), i64::MAX);
        assert_eq!(saturating_millis(Duration::from_secs(10)), 10_000);
    }
}

//! When the relay tries an outbox row again after the broker refused it (a full tier,
//! `reject-publish`) or returned it (no queue bound): exponential back-off per row,
//! never later than the moment the row's route would change.

use std::time::Duration;

/// Back-off after the first refusal of a row; doubles with each further one.
pub const FIRST_RETRY: Duration = Duration::from_millis(250);
/// Upper bound of the back-off.
pub const MAX_RETRY: Duration = Duration::from_secs(60);
/// Lower bound, so a row whose route is about to change is not retried in a spin.
pub const MIN_RETRY: Duration = Duration::from_millis(100);

/// How long to leave a refused row alone. `attempts` counts earlier refusals;
/// `reroute_after` is how soon the row would be routed elsewhere (a timeout whose
/// remaining time drops below its tier goes to a smaller tier, which is not the one
/// refusing), so a back-off never makes a deadline late.
pub fn retry_delay(attempts: u32, reroute_after: Option<Duration>) -> Duration {
    let backoff = FIRST_RETRY
        .checked_mul(2u32.saturating_pow(attempts.min(16)))
        .unwrap_or(MAX_RETRY)
        .min(MAX_RETRY);
    match reroute_after {
        Some(reroute) => backoff.min(reroute.max(MIN_RETRY)),
        None => backoff,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_the_first_retry_up_to_the_cap() {
        assert_eq!(retry_delay(0, None), Duration::from_millis(250));
        assert_eq!(retry_delay(1, None), Duration::from_millis(500));
        assert_eq!(retry_delay(3, None), Duration::from_secs(2));
        assert_eq!(retry_delay(8, None), MAX_RETRY);
        assert_eq!(retry_delay(u32::MAX, None), MAX_RETRY);
    }

    #[test]
    fn never_later_than_a_change_of_route_and_never_a_spin() {
        let soon = Some(Duration::from_millis(700));
        assert_eq!(retry_delay(10, soon), Duration::from_millis(700));
        assert_eq!(retry_delay(0, soon), Duration::from_millis(250));
        assert_eq!(retry_delay(10, Some(Duration::ZERO)), MIN_RETRY);
    }
}

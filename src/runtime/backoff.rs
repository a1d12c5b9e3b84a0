//! Exponential back-off for reconnect and retry loops, cut short by shutdown.
//!
//! Reconnects are jittered: after a broker restart every worker's sessions fail at
//! the same instant, and without jitter they would all reconnect in lock-step, each
//! attempt a thundering herd. Each reconnect delay is drawn from `[d/2, d]` of the
//! exponential step `d` ("equal jitter"): never more than the plain back-off, never
//! less than half of it.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::runtime::health::Health;
use crate::runtime::supervisor::Fatal;

/// An error that ends a session: reconnecting may cure it, unless it is fatal
/// (refused credentials: every reconnect would be refused the same way).
pub trait SessionError: std::fmt::Display {
    fn is_fatal(&self) -> bool;
}

/// Exponential back-off from 100 ms to 5 s, cut short by cancellation; optionally
/// jittered.
pub struct Backoff {
    next: Duration,
    jitter: Option<fastrand::Rng>,
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

impl Backoff {
    pub fn new() -> Self {
        Self {
            next: Duration::from_millis(100),
            jitter: None,
        }
    }

    /// A back-off whose every delay is spread over `[d/2, d]` (see the module docs).
    pub fn jittered() -> Self {
        Self::jittered_with(fastrand::Rng::new())
    }

    /// [`Self::jittered`] with a given random source (tests use a seed).
    pub fn jittered_with(rng: fastrand::Rng) -> Self {
        Self {
            jitter: Some(rng),
            ..Self::new()
        }
    }

    pub fn reset(&mut self) {
        self.next = Duration::from_millis(100);
    }

    pub async fn sleep(&mut self, token: &CancellationToken) {
        let delay = self.next_delay();
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = token.cancelled() => {}
        }
    }

    /// The delay to wait now; the next step doubles (up to 5 s).
    pub fn next_delay(&mut self) -> Duration {
        let step = self.next;
        self.next = (self.next * 2).min(Duration::from_secs(5));
        match &mut self.jitter {
            Some(rng) => step / 2 + step.mul_f64(rng.f64() / 2.0),
            None => step,
        }
    }
}

/// A session that lasted this long was healthy: the failure that ended it starts the
/// back-off from its first step again, instead of where an outage hours ago left it.
pub const HEALTHY_SESSION: Duration = Duration::from_secs(10);

/// Runs `session` until it returns `Ok` (a clean stop) or `token` is cancelled;
/// after each error, logs it, reports the component down and waits with back-off
/// before the next session. A fatal error ends the loop with [`Fatal`].
///
/// The component is down until a session reports it up (once its connection is
/// open): a component that is still connecting, or reconnecting after an error,
/// is not up, and keeps showing its last error meanwhile.
pub async fn reconnecting<E, F, Fut>(
    component: &'static str,
    health: &Health,
    token: &CancellationToken,
    mut session: F,
) -> Result<(), Fatal>
where
    E: SessionError,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), E>>,
{
    let mut backoff = Backoff::jittered();
    health.connecting(component);
    while !token.is_cancelled() {
        let began = tokio::time::Instant::now();
        match session().await {
            Ok(()) => break,
            Err(e) if e.is_fatal() => return Err(Fatal(format!("{component}: {e}"))),
            Err(e) => {
                tracing::warn!(component, error = %e, "session ended; reconnecting");
                health.down(component, e.to_string());
                metrics::counter!(crate::observe::metric_catalog::RECONNECTS, "component" => component)
                    .increment(1);
                if began.elapsed() >= HEALTHY_SESSION {
                    backoff.reset();
                }
                backoff.sleep(token).await;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Transient;
    impl std::fmt::Display for Transient {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("connection reset")
        }
    }
    impl SessionError for Transient {
        fn is_fatal(&self) -> bool {
            false
        }
    }

    /// Six quick failures grow the back-off past 1.6 s; then a session runs for
    /// a minute and fails: the next attempt comes after the first step (<= 100 ms),
    /// not after seconds.
    #[tokio::test(start_paused = true)]
    async fn a_long_healthy_session_starts_the_back_off_again() {
        let health = Health::new(Duration::from_secs(60));
        let token = CancellationToken::new();
        let starts = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let calls = starts.clone();
        reconnecting("test", &health, &token, move || {
            let calls = calls.clone();
            async move {
                let n = {
                    let mut c = calls.lock().unwrap();
                    c.push(tokio::time::Instant::now());
                    c.len()
                };
                match n {
                    1..=6 => Err(Transient),
                    7 => {
                        tokio::time::sleep(Duration::from_secs(60)).await;
                        Err(Transient)
                    }
                    _ => Ok(()),
                }
            }
        })
        .await
        .unwrap();
        let starts = starts.lock().unwrap();
        assert_eq!(starts.len(), 8);
        let gap = |i: usize| starts[i] - starts[i - 1];
        assert!(
            gap(6) >= Duration::from_millis(1600),
            "grown by then: {:?}",
            gap(6)
        );
        let after_long = gap(7) - Duration::from_secs(60);
        assert!(after_long <= Duration::from_millis(100), "{after_long:?}");
    }

    #[test]
    fn plain_back_off_doubles_up_to_five_seconds() {
        let mut b = Backoff::new();
        let delays: Vec<u64> = (0..8).map(|_| b.next_delay().as_millis() as u64).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
    }

    /// Twenty workers lose the broker at the same instant: their reconnect attempts
    /// spread over each step instead of landing together, and none waits longer
    /// than the plain back-off or less than half of it.
    #[test]
    fn workers_reconnecting_together_spread_out() {
        const WORKERS: u64 = 20;
        let mut workers: Vec<Backoff> = (0..WORKERS)
            .map(|seed| Backoff::jittered_with(fastrand::Rng::with_seed(seed)))
            .collect();
        let mut plain = Backoff::new();
        for attempt in 0..8 {
            let step = plain.next_delay();
            let delays: Vec<Duration> = workers.iter_mut().map(Backoff::next_delay).collect();
            for d in &delays {
                assert!(
                    *d >= step / 2 && *d <= step,
                    "attempt {attempt}: {d:?} vs {step:?}"
                );
            }
            let (min, max) = (delays.iter().min().unwrap(), delays.iter().max().unwrap());
            assert!(
                *max - *min >= step / 4,
                "attempt {attempt}: {WORKERS} workers within {:?} of each other",
                *max - *min
            );
            let mut distinct = delays.clone();
            distinct.sort();
            distinct.dedup();
            assert!(
                distinct.len() as u64 > WORKERS / 2,
                "attempt {attempt}: {delays:?}"
            );
        }
    }
}

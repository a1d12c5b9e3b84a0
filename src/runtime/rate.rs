//! A token bucket bounding closes per second, so a backlog drains at the configured
//! rate rather than at whatever rate the broker can dump it. Callers pay for what they
//! closed after closing it (the bucket may go into debt); the next caller waits the
//! debt off. Charging only real closes keeps duplicates, stale messages and orders the
//! other path already closed from eating the budget.
//!
//! A wait can be long (a backlog at a low `worker.closes_per_second`): callers that must
//! stop on shutdown wait with [`RateLimiter::acquire_or_cancelled`].

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

#[derive(Clone)]
pub struct RateLimiter {
    /// `None` means unlimited.
    inner: Option<Arc<Mutex<Bucket>>>,
}

struct Bucket {
    per_second: f64,
    tokens: f64,
    updated: Instant,
}

impl RateLimiter {
    /// `per_second == 0` disables the limit.
    pub fn new(per_second: u32) -> Self {
        Self {
            inner: (per_second > 0).then(|| {
                Arc::new(Mutex::new(Bucket {
                    per_second: f64::from(per_second),
                    // A burst of at most a tenth of a second.
                    tokens: f64::from(per_second) / 10.0,
                    updated: Instant::now(),
                }))
            }),
        }
    }

    /// True when there is a limit.
    pub fn is_limited(&self) -> bool {
        self.inner.is_some()
    }

    /// Waits until `n` units may proceed.
    pub async fn acquire(&self, n: usize) {
        let Some(inner) = &self.inner else { return };
        if n == 0 {
            return;
        }
        let started = Instant::now();
        let mut bucket = inner.lock().await;
        let now = Instant::now();
        let burst = (bucket.per_second / 10.0).max(1.0);
        bucket.tokens = (bucket.tokens
            + now.duration_since(bucket.updated).as_secs_f64() * bucket.per_second)
            .min(burst);
        bucket.updated = now;
        bucket.tokens -= n as f64;
        if bucket.tokens < 0.0 {
            let wait = Duration::from_secs_f64(-bucket.tokens / bucket.per_second);
            // Holding the lock while waiting keeps callers in order.
            tokio::time::sleep(wait).await;
        }
        drop(bucket);
        // Time spent in the queue for the lock counts too: it is waiting for the limit.
        metrics::histogram!(crate::observe::metric_catalog::LIMITER_WAIT)
            .record(started.elapsed().as_secs_f64());
    }

    /// Like [`RateLimiter::acquire`], but gives up as soon as `token` is cancelled
    /// (shutdown): returns false then, true once `n` units may proceed. What was
    /// already charged stays charged; the bucket stays usable.
    #[must_use = "false means shutdown was requested: stop instead of proceeding"]
    pub async fn acquire_or_cancelled(&self, n: usize, token: &CancellationToken) -> bool {
        tokio::select! {
            biased;
            _ = token.cancelled() => false,
            _ = self.acquire(n) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_long_wait_for_the_limit_ends_at_once_on_shutdown() {
        let limiter = RateLimiter::new(1);
        let token = CancellationToken::new();
        let started = Instant::now();
        // 100 closes at 1 per second: their caller waits about 100 s.
        let waiter = {
            let (limiter, token) = (limiter.clone(), token.clone());
            tokio::spawn(async move { limiter.acquire_or_cancelled(100, &token).await })
        };
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(!waiter.is_finished(), "the debt is still being waited off");
        token.cancel();
        assert!(!waiter.await.unwrap(), "cancelled, not acquired");
        assert!(started.elapsed() < Duration::from_secs(5));
        // The charge stays: the next caller waits the rest of the debt off.
        let fresh = CancellationToken::new();
        let before = Instant::now();
        assert!(limiter.acquire_or_cancelled(1, &fresh).await);
        assert!(before.elapsed() >= Duration::from_secs(90));
    }
}

//! A token bucket bounding closes per second, so a backlog drains at the configured
//! rate rather than at whatever rate the broker can dump it. Callers pay for what they
//! closed after closing it (the bucket may go into debt); the next caller waits the
//! debt off. Charging only real closes keeps duplicates, stale messages and orders the
//! other path already closed from eating the budget.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

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

    /// Waits until `n` units may proceed.
    pub async fn acquire(&self, n: usize) {
        let Some(inner) = &self.inner else { return };
        if n == 0 {
            return;
        }
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
    }
}

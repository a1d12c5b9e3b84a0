//! Exponential back-off for reconnect and retry loops, cut short by shutdown.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Exponential back-off from 100 ms to 5 s, cut short by cancellation.
pub struct Backoff {
    next: Duration,
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
        }
    }

    pub fn reset(&mut self) {
        self.next = Duration::from_millis(100);
    }

    pub async fn sleep(&mut self, token: &CancellationToken) {
        tokio::select! {
            _ = tokio::time::sleep(self.next) => {}
            _ = token.cancelled() => {}
        }
        self.next = (self.next * 2).min(Duration::from_secs(5));
    }
}

//! Exponential back-off for reconnect and retry loops, cut short by shutdown.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::health::Health;
use crate::supervisor::Fatal;

/// An error that ends a session: reconnecting may cure it, unless it is fatal
/// (refused credentials: every reconnect would be refused the same way).
pub trait SessionError: std::fmt::Display {
    fn is_fatal(&self) -> bool;
}

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
        let delay = self.next_delay();
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = token.cancelled() => {}
        }
    }

    /// The delay to wait now; the next one doubles (up to 5 s).
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(Duration::from_secs(5));
        delay
    }
}

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
    let mut backoff = Backoff::new();
    health.connecting(component);
    while !token.is_cancelled() {
        match session().await {
            Ok(()) => break,
            Err(e) if e.is_fatal() => return Err(Fatal(format!("{component}: {e}"))),
            Err(e) => {
                tracing::warn!(component, error = %e, "session ended; reconnecting");
                health.down(component, e.to_string());
                metrics::counter!(crate::metric_catalog::RECONNECTS, "component" => component)
                    .increment(1);
                backoff.sleep(token).await;
            }
        }
    }
    Ok(())
}

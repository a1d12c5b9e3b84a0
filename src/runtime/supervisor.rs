//! Supervision of long-running components, generic over their futures.
//!
//! Each component is started from a factory, in its own task, with its own child
//! cancellation token (cancelled when that instance ends, so whatever it spawned on
//! the token stops with it). What happens when an instance ends:
//! - it panicked, or returned while no shutdown was asked for: a failure. It is shown
//!   as down on `/health` with the reason (the panic message) and restarted after a
//!   jittered exponential back-off; the other components carry on.
//! - it returned [`Fatal`]: something no restart can fix (the broker refuses the
//!   credentials). The supervisor stops everything and reports it, so the process
//!   exits with a non-zero status.
//! - shutdown was asked for (the root token): it stopped as asked.
//!
//! Every task has an owner: all instances live in one `JoinSet` that
//! [`Supervisor::drain`] empties (or aborts at the drain limit).

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::task::{Id, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::runtime::health::Health;

/// A failure no restart can fix; stops the whole service.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Fatal(pub String);

/// One running instance of a component.
pub type ComponentFuture = Pin<Box<dyn Future<Output = Result<(), Fatal>> + Send>>;

/// Starts a fresh instance of a component, stopping when the token is cancelled.
pub type Factory = Box<dyn Fn(CancellationToken) -> ComponentFuture + Send + Sync>;

/// Why the supervisor stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Shutdown was asked for (SIGINT/SIGTERM, or the owner cancelled the token).
    Requested,
    /// A component failed in a way no restart can fix.
    Fatal {
        component: &'static str,
        reason: String,
    },
}

/// Restart pacing: `first`, doubling per consecutive failure up to `max`, each delay
/// drawn between half and all of that (jitter, so components failing together do not
/// restart in lockstep). A component that ran for `reset_after` before failing starts
/// again from `first`.
#[derive(Clone, Copy, Debug)]
pub struct RestartPolicy {
    pub first: Duration,
    pub max: Duration,
    pub reset_after: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            first: Duration::from_millis(200),
            max: Duration::from_secs(30),
            reset_after: Duration::from_secs(60),
        }
    }
}

impl RestartPolicy {
    /// The delay before restart number `failures` (1 for the first failure in a row).
    pub fn delay(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(20);
        let ceiling = self.first.saturating_mul(1u32 << exp).min(self.max);
        let half = ceiling / 2;
        half + half.mul_f64(fastrand::f64())
    }
}

struct Spec {
    name: &'static str,
    factory: Factory,
    failures: u32,
    started: Instant,
}

/// What a task of the set returns: which component, and how its instance ended.
type Exit = (usize, Result<(), Fatal>);

pub struct Supervisor {
    specs: Vec<Spec>,
    tasks: JoinSet<Exit>,
    ids: HashMap<Id, usize>,
    health: Health,
    token: CancellationToken,
    policy: RestartPolicy,
}

impl Supervisor {
    pub fn new(health: Health, token: CancellationToken, policy: RestartPolicy) -> Self {
        Self {
            specs: Vec::new(),
            tasks: JoinSet::new(),
            ids: HashMap::new(),
            health,
            token,
            policy,
        }
    }

    /// Starts `name` now; it is restarted on failure until shutdown.
    pub fn add(&mut self, name: &'static str, factory: Factory) {
        self.specs.push(Spec {
            name,
            factory,
            failures: 0,
            started: Instant::now(),
        });
        self.health.started(name);
        // The series exists from the start at 0, so `increase()` sees the first restart.
        metrics::counter!(crate::observe::metric_catalog::RESTARTS, "component" => name)
            .increment(0);
        self.spawn(self.specs.len() - 1, Duration::ZERO);
    }

    fn spawn(&mut self, index: usize, delay: Duration) {
        let spec = &mut self.specs[index];
        let instance = self.token.child_token();
        let future = (spec.factory)(instance.clone());
        let (name, health) = (spec.name, self.health.clone());
        spec.started = Instant::now() + delay;
        let handle = self.tasks.spawn(async move {
            // Whatever this instance started on its token stops when it ends.
            let _stop = instance.clone().drop_guard();
            if !delay.is_zero() {
                tokio::select! {
                    _ = instance.cancelled() => return (index, Ok(())),
                    _ = tokio::time::sleep(delay) => {}
                }
                health.started(name);
            }
            (index, future.await)
        });
        self.ids.insert(handle.id(), index);
    }

    /// Runs until shutdown is asked for or a component fails fatally, restarting
    /// failed components meanwhile. On a fatal failure the root token is cancelled.
    pub async fn run(&mut self) -> Stop {
        loop {
            let joined = tokio::select! {
                biased;
                _ = self.token.cancelled() => return Stop::Requested,
                Some(joined) = self.tasks.join_next_with_id() => joined,
            };
            let (index, reason) = match joined {
                Ok((id, (index, result))) => {
                    self.ids.remove(&id);
                    match result {
                        Err(Fatal(reason)) => {
                            let component = self.specs[index].name;
                            tracing::error!(component, %reason, "fatal failure; stopping");
                            self.health.down(component, reason.clone());
                            self.token.cancel();
                            return Stop::Fatal { component, reason };
                        }
                        Ok(()) if self.token.is_cancelled() => return Stop::Requested,
                        Ok(()) => (index, "stopped unexpectedly".to_string()),
                    }
                }
                Err(e) => {
                    let Some(index) = self.ids.remove(&e.id()) else {
                        continue;
                    };
                    if !e.is_panic() {
                        continue;
                    }
                    (
                        index,
                        format!("panicked: {}", panic_message(e.into_panic())),
                    )
                }
            };
            self.restart(index, reason);
        }
    }

    fn restart(&mut self, index: usize, reason: String) {
        let spec = &mut self.specs[index];
        if spec.started.elapsed() >= self.policy.reset_after {
            spec.failures = 0;
        }
        spec.failures = spec.failures.saturating_add(1);
        let delay = self.policy.delay(spec.failures);
        tracing::error!(
            component = spec.name,
            %reason,
            restart_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            "component failed; restarting it"
        );
        metrics::counter!(crate::observe::metric_catalog::RESTARTS, "component" => spec.name)
            .increment(1);
        self.health.restarting(spec.name, reason);
        self.spawn(index, delay);
    }

    /// After [`run`](Self::run) returned: waits for every instance to stop, up to
    /// `limit`, then aborts the rest. Returns the components that had to be abandoned.
    pub async fn drain(mut self, limit: Duration) -> Vec<&'static str> {
        self.token.cancel();
        let deadline = Instant::now() + limit;
        while !self.tasks.is_empty() {
            match tokio::time::timeout_at(deadline, self.tasks.join_next_with_id()).await {
                Ok(Some(Ok((id, (index, _))))) => {
                    self.ids.remove(&id);
                    tracing::info!(component = self.specs[index].name, "stopped");
                }
                Ok(Some(Err(e))) => {
                    let name = self.ids.remove(&e.id()).map(|i| self.specs[i].name);
                    if e.is_panic() {
                        let message = panic_message(e.into_panic());
                        tracing::error!(component = ?name, %message, "panicked while stopping");
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    let left: Vec<&'static str> =
                        self.ids.values().map(|&i| self.specs[i].name).collect();
                    tracing::warn!(
                        ?left,
                        "drain limit reached; abandoning in-flight work (unacknowledged deliveries return to their queues)"
                    );
                    self.tasks.abort_all();
                    return left;
                }
            }
        }
        Vec::new()
    }
}

fn panic_message(payload: Box<dyn Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

#[cfg(test)]
mod tests;

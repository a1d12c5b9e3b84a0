//! Component health and liveness, for `GET /health` and `GET /livez`.
//!
//! Two questions, kept apart:
//! - **Up** (health): not currently waiting to retry after a failure (broker or database
//!   away, a restart after a panic). A component that works over a broker connection
//!   is up only once that connection is open, so it is down while it connects or
//!   reconnects. A component that is down is still alive: it is retrying on its own.
//!   Its `last_error` stays while it is down and is cleared once it reports up again
//!   (recovered); a component the supervisor restarted keeps the panic message
//!   until then.
//! - **Live** (liveness): every component is making progress. A component marks each
//!   unit of work (a batch, a relay round, a sweep, opening a session) with a [`Busy`]
//!   guard; waiting for work is not busy. A component busy for longer than the stall
//!   limit without progress is *stalled*: an await that never returns (a hung
//!   connection, a lock nobody releases). Restarting the process is the only cure a
//!   process cannot apply to itself, so `/livez` fails and a supervisor restarts it.
//!
//! A broker alarm blocking a component's publishing connection is shown
//! (`broker_blocked`, the broker's reason) but does not make it down: restarting lapse
//! would not clear the broker's alarm.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

/// What `/health` shows for one component.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ComponentState {
    pub up: bool,
    pub last_error: Option<String>,
    /// Times the supervisor restarted it after a panic or an unexpected return.
    pub restarts: u32,
    /// How long its current unit of work has been running without progress.
    pub busy_ms: Option<u64>,
    /// True when `busy_ms` is over the stall limit.
    pub stalled: bool,
    /// Set while the broker blocks this component's publishing connection.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub broker_blocked: Option<String>,
}

#[derive(Default)]
struct Entry {
    up: bool,
    last_error: Option<String>,
    restarts: u32,
    busy_since: Option<Instant>,
    broker_blocked: Option<String>,
}

/// Shared health of all components; cheap to clone.
#[derive(Clone)]
pub struct Health {
    components: Arc<Mutex<BTreeMap<&'static str, Entry>>>,
    stall_limit: Duration,
}

impl Default for Health {
    fn default() -> Self {
        Self::new(Duration::from_secs(60))
    }
}

impl Health {
    /// A component busy for longer than `stall_limit` without progress is stalled.
    pub fn new(stall_limit: Duration) -> Self {
        Self {
            components: Arc::default(),
            stall_limit,
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<&'static str, Entry>> {
        // A panic while holding this lock cannot leave an entry half-written (every
        // update is a plain field store), so a poisoned lock is still usable.
        self.components
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers a running component as up. A component that is up has recovered:
    /// its last error is cleared (the logs keep it).
    pub fn up(&self, component: &'static str) {
        let mut map = self.lock();
        let state = map.entry(component).or_default();
        state.up = true;
        state.last_error = None;
        export_up(component, true);
    }

    /// Registers a component the supervisor (re)started as up, keeping its last
    /// error: being started again is not yet having recovered. A component that
    /// proves it works (its connection opened, a sweep succeeded) reports
    /// [`Health::up`], which clears it.
    pub fn started(&self, component: &'static str) {
        self.lock().entry(component).or_default().up = true;
        export_up(component, true);
    }

    /// Marks a component as not up until it reports [`Health::up`] again (it is
    /// opening its connection); its last error, if any, stays visible.
    pub fn connecting(&self, component: &'static str) {
        self.lock().entry(component).or_default().up = false;
        export_up(component, false);
    }

    /// Marks a component as failing with `error` (it is backing off).
    pub fn down(&self, component: &'static str, error: String) {
        let mut map = self.lock();
        let state = map.entry(component).or_default();
        state.up = false;
        state.last_error = Some(error);
        export_up(component, false);
    }

    /// Marks a component as failed and about to be restarted by the supervisor.
    pub fn restarting(&self, component: &'static str, reason: String) {
        let mut map = self.lock();
        let state = map.entry(component).or_default();
        state.up = false;
        state.last_error = Some(reason);
        state.restarts = state.restarts.saturating_add(1);
        // The failed instance's work is gone with it.
        state.busy_since = None;
        export_up(component, false);
    }

    /// Records that the broker blocks (`Some(reason)`) or no longer blocks (`None`)
    /// the publishing connection of `component`.
    pub fn blocked(&self, component: &'static str, reason: Option<String>) {
        self.lock().entry(component).or_default().broker_blocked = reason;
    }

    /// Starts a unit of work of `component`; it ends when the guard is dropped.
    pub fn busy(&self, component: &'static str) -> Busy {
        self.lock().entry(component).or_default().busy_since = Some(Instant::now());
        Busy {
            health: self.clone(),
            component,
        }
    }

    pub fn stall_limit(&self) -> Duration {
        self.stall_limit
    }

    pub fn snapshot(&self) -> BTreeMap<&'static str, ComponentState> {
        let now = Instant::now();
        self.lock()
            .iter()
            .map(|(name, e)| {
                let busy = e
                    .busy_since
                    .map(|since| now.saturating_duration_since(since));
                let state = ComponentState {
                    up: e.up,
                    last_error: e.last_error.clone(),
                    restarts: e.restarts,
                    busy_ms: busy.map(|b| u64::try_from(b.as_millis()).unwrap_or(u64::MAX)),
                    stalled: busy.is_some_and(|b| b > self.stall_limit),
                    broker_blocked: e.broker_blocked.clone(),
                };
                (*name, state)
            })
            .collect()
    }

    /// The components busy for longer than the stall limit, with how long.
    pub fn stalled(&self) -> Vec<(&'static str, Duration)> {
        let now = Instant::now();
        self.lock()
            .iter()
            .filter_map(|(name, e)| {
                let busy = now.saturating_duration_since(e.busy_since?);
                (busy > self.stall_limit).then_some((*name, busy))
            })
            .collect()
    }

    /// True while no component is stalled (`GET /livez`).
    pub fn live(&self) -> bool {
        self.stalled().is_empty()
    }

    /// True when every registered component is up and none is stalled (`GET /health`).
    pub fn healthy(&self) -> bool {
        self.snapshot().values().all(|s| s.up && !s.stalled)
    }
}

fn export_up(component: &'static str, up: bool) {
    metrics::gauge!(crate::observe::metric_catalog::COMPONENT_UP, "component" => component)
        .set(if up { 1.0 } else { 0.0 });
}

/// A unit of work in progress; dropping it ends the unit.
pub struct Busy {
    health: Health,
    component: &'static str,
}

impl Busy {
    /// Reports progress within a long unit of work (e.g. one batch of a sweep).
    pub fn progress(&self) {
        if let Some(e) = self.health.lock().get_mut(self.component) {
            e.busy_since = Some(Instant::now());
        }
    }

    /// Awaits `wait` as deliberate idleness (rate limiting, a pause), which is not a
    /// stall; progress is reported when it ends.
    pub async fn idle_while<F: Future>(&self, wait: F) -> F::Output {
        if let Some(e) = self.health.lock().get_mut(self.component) {
            e.busy_since = None;
        }
        let output = wait.await;
        self.progress();
        output
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(e) = self.health.lock().get_mut(self.component) {
            e.busy_since = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_unit_of_work_longer_than_the_limit_is_a_stall_and_idleness_is_not() {
        let health = Health::new(Duration::from_secs(5));
        health.up("relay");
        health.up("consumer");
        // Idle for a long time: not stalled.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(health.live());
        let busy = health.busy("relay");
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(health.live(), "within the limit");
        busy.progress();
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(health.live(), "progress restarts the clock");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(health.stalled().len(), 1);
        assert_eq!(health.stalled()[0].0, "relay");
        assert!(!health.healthy());
        assert!(health.snapshot()["relay"].stalled);
        assert!(!health.snapshot()["consumer"].stalled);
        busy.idle_while(tokio::time::sleep(Duration::from_secs(30)))
            .await;
        assert!(health.live(), "a deliberate wait is not a stall");
        drop(busy);
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(health.live() && health.healthy());
    }

    #[test]
    fn a_restart_is_counted_and_shown_as_down_with_the_reason() {
        let health = Health::default();
        health.up("sweeper");
        health.restarting("sweeper", "panicked: boom".into());
        let state = &health.snapshot()["sweeper"];
        assert!(!state.up);
        assert_eq!(state.restarts, 1);
        assert_eq!(state.last_error.as_deref(), Some("panicked: boom"));
        assert!(!health.healthy());
        assert!(health.live(), "down is not dead");
    }

    #[test]
    fn a_recovered_component_no_longer_shows_its_last_error() {
        let health = Health::default();
        health.up("relay");
        health.down("relay", "connection refused".into());
        assert_eq!(
            health.snapshot()["relay"].last_error.as_deref(),
            Some("connection refused")
        );
        health.connecting("relay");
        assert!(
            health.snapshot()["relay"].last_error.is_some(),
            "still shown while reconnecting"
        );
        health.up("relay");
        let state = &health.snapshot()["relay"];
        assert!(state.up);
        assert_eq!(state.last_error, None);
        assert!(health.healthy());
    }
}

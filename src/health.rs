//! Component health for `GET /health`: each supervised component reports whether it
//! is working or backing off after a failure, with the last error.
//!
//! "Up" means: not currently waiting to retry after a failed session (broker or
//! database). A component that has never failed is up. A broker alarm blocking a
//! component's publishing connection is shown (`broker_blocked`, the broker's reason)
//! but does not make it down: restarting lapse would not clear the broker's alarm.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::Serialize;

#[derive(Clone, Debug, Default, Serialize)]
pub struct ComponentState {
    pub up: bool,
    pub last_error: Option<String>,
    /// Set while the broker blocks this component's publishing connection.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub broker_blocked: Option<String>,
}

/// Shared health of all components; cheap to clone.
#[derive(Clone, Default)]
pub struct Health {
    components: Arc<Mutex<BTreeMap<&'static str, ComponentState>>>,
}

impl Health {
    /// Registers a running component as up.
    pub fn up(&self, component: &'static str) {
        let mut map = self.components.lock().expect("health lock");
        map.entry(component).or_default().up = true;
    }

    /// Marks a component as failing with `error` (it is backing off).
    pub fn down(&self, component: &'static str, error: String) {
        let mut map = self.components.lock().expect("health lock");
        let state = map.entry(component).or_default();
        state.up = false;
        state.last_error = Some(error);
    }

    /// Records that the broker blocks (`Some(reason)`) or no longer blocks (`None`)
    /// the publishing connection of `component`.
    pub fn blocked(&self, component: &'static str, reason: Option<String>) {
        let mut map = self.components.lock().expect("health lock");
        map.entry(component).or_default().broker_blocked = reason;
    }

    pub fn snapshot(&self) -> BTreeMap<&'static str, ComponentState> {
        self.components.lock().expect("health lock").clone()
    }

    /// True when every registered component is up.
    pub fn healthy(&self) -> bool {
        self.snapshot().values().all(|s| s.up)
    }
}

//! Component health for `GET /health`: each supervised component reports whether it
//! is working or backing off after a failure, with the last error.
//!
//! "Up" means: not currently waiting to retry after a failed session (broker or
//! database). A component that has never failed is up.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::Serialize;

#[derive(Clone, Debug, Default, Serialize)]
pub struct ComponentState {
    pub up: bool,
    pub last_error: Option<String>,
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

    pub fn snapshot(&self) -> BTreeMap<&'static str, ComponentState> {
        self.components.lock().expect("health lock").clone()
    }

    /// True when every registered component is up.
    pub fn healthy(&self) -> bool {
        self.snapshot().values().all(|s| s.up)
    }
}

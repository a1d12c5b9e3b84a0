//! Process plumbing: shutdown, supervision, back-off, the close rate, health and
//! readiness, the start-up migrations, and the service that starts the components.

pub mod backoff;
pub mod health;
pub mod migrations;
pub mod rate;
pub mod readiness;
pub mod service;
pub mod shutdown;
pub mod supervisor;

//! Process plumbing: shutdown, supervision, back-off, the close rate, health and
//! readiness, the start-up migrations, and the service that starts the components
//! (and the errors that stop it from starting).

pub mod backoff;
pub mod error;
pub mod health;
pub mod migrations;
pub mod rate;
pub mod readiness;
pub mod service;
pub mod shutdown;
pub mod supervisor;

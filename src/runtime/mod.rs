//! Process plumbing every layer may use: shutdown, supervision, back-off, the close
//! rate, health and readiness, and the HTTP endpoint that serves them with the
//! metrics. It names no component: the service that starts them is the worker's
//! composition root, `service/`.

pub mod backoff;
pub mod health;
pub mod http;
pub mod rate;
pub mod readiness;
pub mod shutdown;
pub mod supervisor;

//! # lapse
//!
//! Closes unpaid orders when their payment deadline passes and releases their stock,
//! using RabbitMQ fixed delay tiers as the timer and PostgreSQL as the single source
//! of truth.
//!
//! # Layout
//! - [`config`]: the typed configuration tree (defaults, TOML, `LAPSE_` env) and its validation.
//! - [`tier`]: delay tiers and the rule that picks the next hop for a deadline.
//! - [`topology`]: the broker objects as data, and `plan` / `apply` / `verify`.
//! - [`broker`]: AMQP connections, argument tables, publishing with confirms.
//! - [`management`]: the RabbitMQ management HTTP API (listings, policies, feature flags).
//! - [`telemetry`]: structured logs.
//! - [`cli`]: the command line.

pub mod broker;
pub mod cli;
pub mod config;
pub mod management;
pub mod telemetry;
pub mod tier;
pub mod topology;

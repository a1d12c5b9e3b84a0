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
//! - [`broker`]: AMQP connections (to the next cluster node when one fails), argument tables, publishing with confirms (bounded by a timeout).
//! - [`tls`]: certificate verification and client certificates for `amqps://` and `https://`.
//! - [`publishing`]: a consumer's separate publishing connection; broker blocked notices.
//! - [`queue_gauges`]: depths and consumer counts of lapse's queues, as gauges.
//! - [`tier_check`]: whether the wait queues a publish is about to use exist.
//! - [`redelivery`]: lapse's own bound on giving a message back to its queue.
//! - [`management`]: the RabbitMQ management HTTP API (listings, policies, feature flags).
//! - [`db`]: PostgreSQL pools, database creation, migrations (`migrations/`).
//! - [`deadline`]: what a deadline may be (range, rounding up, checked durations).
//! - [`orders`]: create / extend / pay / show an order (Rust API over the SQL functions).
//! - [`message`]: the timeout message, its encoding and its next route.
//! - [`parked`]: `lapse parked` — list, show, replay and purge parked messages without losing one.
//! - [`close`]: the one guarded close path, shared by worker and sweeper.
//! - [`worker`]: the due-queue consumer and its decision table.
//! - [`relay`]: outbox -> broker with publisher confirms.
//! - [`releaser`]: stock-release events -> ledger and stock, idempotently.
//! - [`sweeper`]: the backstop scan of overdue UNPAID orders.
//! - [`reconciler`]: re-emits stock releases lost after a close (run by the sweeper's leader).
//! - [`service`]: `lapse worker` — starts the components under the supervisor.
//! - [`supervisor`]: restarts failed components with back-off; stops on a fatal failure.
//! - [`batch`], [`rate`], [`backoff`]: delivery batching, the closes-per-second bucket, retry pacing.
//! - [`stats`]: outcome counters and the lateness histogram.
//! - [`metric_catalog`]: every exported metric's name, help text and buckets.
//! - [`health`], [`http`], [`readiness`]: component health and liveness, and the
//!   `/metrics`, `/livez`, `/readyz`, `/health` endpoint.
//! - [`status`]: `lapse status` — depths and consumers, overdue orders, outbox, recent
//!   lateness, missing releases; the problems `--check` reports and `--watch`'s drain rate.
//! - [`shutdown`]: the root cancellation token (SIGINT/SIGTERM).
//! - [`redact`]: masks passwords in every error, log line and panic message.
//! - [`telemetry`]: structured logs.
//! - [`cli`]: the command line.

pub mod backoff;
pub mod batch;
pub mod broker;
pub mod cli;
pub mod close;
pub mod config;
pub mod db;
pub mod deadline;
pub mod health;
pub mod http;
pub mod management;
pub mod message;
pub mod metric_catalog;
pub mod orders;
pub mod parked;
pub mod publishing;
pub mod queue_gauges;
pub mod rate;
pub mod readiness;
pub mod reconciler;
pub mod redact;
pub mod redelivery;
pub mod relay;
pub mod releaser;
pub mod service;
pub mod shutdown;
pub mod stats;
pub mod status;
pub mod supervisor;
pub mod sweeper;
pub mod telemetry;
pub mod tier;
pub mod tier_check;
pub mod tls;
pub mod topology;
pub mod worker;

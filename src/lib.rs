//! # lapse
//!
//! Closes unpaid orders when their payment deadline passes and releases their stock,
//! using RabbitMQ fixed delay tiers as the timer and PostgreSQL as the single source
//! of truth.
//!
//! # Layout
//! Domain files sit at the top; adapters, components, plumbing and observability each
//! have their own directory. Lower layers never import higher ones (see
//! `docs/architecture.md`, "Layers").
//!
//! Domain and shared ground:
//! - [`config`]: the typed configuration tree (defaults, TOML, `LAPSE_` env) and its
//!   validation; the split of a multi-address `broker.url`; the logging variables' names.
//! - [`tier`]: delay tiers, the rule that picks the next hop for a deadline, the longest hold.
//! - [`tier_file`]: the tier file (`topology/*.toml`), parsed and validated whole.
//! - [`names`]: the broker object names of one prefix and the routing keys that join them.
//! - [`deadline`]: what a deadline may be (range, rounding up, checked durations).
//! - [`message`]: the timeout message, its encoding and its next route.
//! - [`orders`]: create / extend / pay / show an order (Rust API over the SQL functions).
//! - [`close`]: the one guarded close path, shared by the consumer and the sweeper.
//! - [`kinds`]: deadline kinds over the shop's own tables: their check against the
//!   live database and the fire path (a kind's action in a savepoint, its event).
//! - [`timeline`]: the one writer of hop events on an order's timeline.
//! - [`db`]: the order store: PostgreSQL pools (one per shard with `database.shards`), database
//!   creation, migrations (`migrations/`) of every shard.
//! - [`redact`]: [`redact::Secret`] and the masking of passwords in every error, log line
//!   and panic message (a leaf: every layer may hold a secret).
//! - [`tls`]: certificate verification and client certificates for `amqps://`, `https://`
//!   and PostgreSQL (shared by the broker adapters and [`db`]).
//!
//! [`amqp`] — the broker adapters ([`amqp::endpoint`] builds the broker endpoint from
//! the `[broker]` section):
//! - [`amqp::broker`]: connections (to the next cluster node when one fails), argument tables, publishing with confirms (bounded by a timeout), and the one passive queue declare (counts, or missing).
//! - [`amqp::publishing`]: a consumer's separate publishing connection; broker blocked notices.
//! - [`amqp::redelivery`]: lapse's own bound on giving a message back to its queue.
//! - [`amqp::batch`]: the one consumer plumbing — session loop, batching, held deliveries, ack, park.
//! - [`amqp::topology`]: the broker objects as data, and `plan` / `apply` / `verify`.
//! - [`amqp::tier_check`]: whether the wait queues a publish is about to use exist.
//! - [`amqp::management`]: the RabbitMQ management HTTP API (listings, policies, feature flags).
//!
//! [`components`] — what `lapse worker` runs:
//! - [`components::consumer`]: the due-queue consumer: its decision table, the pure plan of
//!   each delivery, and their execution.
//! - [`components::relay`]: outbox -> broker with publisher confirms.
//! - [`components::releaser`]: stock-release events -> ledger and stock, idempotently.
//! - [`components::sweeper`]: the backstop scan of overdue UNPAID orders.
//! - [`components::reconciler`]: re-emits stock releases lost after a close (run by the
//!   sweeper's leader).
//! - [`components::queue_gauges`]: depths and consumer counts of lapse's queues, as gauges.
//!
//! [`service`]: `lapse worker` as a library — migrates the order databases, then starts
//! the components under the supervisor (the composition root, with `cli/`).
//!
//! [`runtime`] — process plumbing:
//! - [`runtime::supervisor`]: restarts failed components with back-off; stops on a fatal failure.
//! - [`runtime::rate`], [`runtime::backoff`]: the closes-per-second bucket; retry pacing and
//!   jittered reconnects.
//! - [`runtime::health`], [`runtime::readiness`]: component health and liveness; readiness.
//! - [`runtime::http`]: the `/metrics`, `/livez`, `/readyz`, `/health` endpoint (axum).
//! - [`runtime::shutdown`]: the root cancellation token (SIGINT/SIGTERM).
//!
//! [`observe`] — what lapse tells the outside:
//! - [`observe::telemetry`]: structured logs (`LAPSE_LOG`, `LAPSE_LOG_FORMAT`).
//! - [`observe::metric_catalog`]: every exported metric's name, help text and buckets.
//! - [`observe::stats`]: outcome counters and the lateness histogram.
//!
//! Commands:
//! - [`cli`]: the command line, one file per command.
//! - [`demo`]: `lapse demo` — a realistic run on local services in its own prefix and
//!   database, with progress, a report and an SVG picture.
//! - [`parked`]: `lapse parked` — list, show, replay and purge parked messages without losing one.
//! - [`status`]: `lapse status` — depths and consumers, overdue orders, outbox, recent
//!   lateness, missing releases; the problems `--check` reports and `--watch`'s drain rate.

pub mod amqp;
pub mod bench;
pub mod cli;
pub mod close;
pub mod components;
pub mod config;
pub mod db;
pub mod deadline;
pub mod demo;
pub mod kinds;
pub mod message;
pub mod names;
pub mod observe;
pub mod orders;
pub mod pack;
pub mod parked;
pub mod redact;
pub mod runtime;
pub mod service;
pub mod status;
pub mod tier;
pub mod tier_file;
pub mod timeline;
pub mod tls;

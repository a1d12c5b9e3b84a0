//! What lapse tells the outside: structured logs, the metric catalog, outcome
//! counters, and the HTTP endpoint.

pub mod http;
pub mod metric_catalog;
pub mod stats;
pub mod telemetry;

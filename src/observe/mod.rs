//! What lapse tells the outside: structured logs, the metric catalog and outcome
//! counters (served by the HTTP endpoint, `runtime::http`).

pub mod metric_catalog;
pub mod stats;
pub mod telemetry;

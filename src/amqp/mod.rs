//! The broker adapters: connections, publishing with confirms, the consume session,
//! the topology as data and its apply/verify, the management HTTP client, TLS.

pub mod batch;
pub mod broker;
pub mod management;
pub mod publishing;
pub mod tier_check;
pub mod tls;
pub mod topology;

//! The broker adapters: connections, publishing with confirms, the consume session,
//! the topology as data and its apply/verify, the management HTTP client (TLS is
//! [`crate::tls`], shared with the database connections).

pub mod batch;
pub mod broker;
pub mod management;
pub mod publishing;
pub mod redelivery;
pub mod tier_check;
pub mod topology;

use crate::config::{BrokerConfig, BrokerTlsConfig};
use crate::tls;

/// The broker as the `[broker]` section describes it: URL (one or several addresses),
/// `tls.*` files (read now), `confirm_timeout` and the hold limit that
/// `consumer_timeout` sets.
pub fn endpoint(config: &BrokerConfig) -> Result<broker::Endpoint, tls::TlsError> {
    let mut endpoint = broker::Endpoint::new(config.url.clone());
    endpoint.tls = tls_files(&config.tls)?;
    endpoint.confirm_timeout = config.confirm_timeout;
    endpoint.hold_limit = config.hold_limit();
    Ok(endpoint)
}

/// The files `broker.tls.*` names, read and checked.
pub fn tls_files(config: &BrokerTlsConfig) -> Result<tls::TlsFiles, tls::TlsError> {
    tls::TlsFiles::load(
        config.ca_file.as_deref(),
        config.cert_file.as_deref(),
        config.key_file.as_deref(),
    )
}

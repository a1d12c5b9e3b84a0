//! Why the service could not start: the errors of its start-up (the configuration, the
//! broker's TLS settings, the order databases and their migrations).

use crate::db::{self, DbError};

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Db(#[from] DbError),
    /// An error of one of several order databases, naming `database.shards[i]`.
    #[error("{0}")]
    Shard(#[from] db::InShard),
    #[error("invalid configuration: {0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("invalid configuration: broker.tls: {0}")]
    Tls(#[from] crate::tls::TlsError),
}

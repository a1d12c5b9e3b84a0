//! PostgreSQL: connection pools, database creation and schema migrations.
//!
//! Invariant: migrations run under an advisory lock, so several workers starting at
//! once apply each migration exactly once.

use std::str::FromStr;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::NoTls;

use crate::config::{DatabaseConfig, Secret};

refinery::embed_migrations!("migrations");

/// Advisory lock key serialising migrations ("lapse" in ASCII).
const MIGRATION_LOCK: i64 = 0x006c_6170_7365;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("database error: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("database pool error: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("database configuration error: {0}")]
    Config(String),
    #[error("migration failed: {0}")]
    Migration(#[from] refinery::Error),
    /// The database refused the operation by rule (e.g. insufficient stock).
    #[error("refused: {0}")]
    Refused(String),
}

/// Turns an exception raised by lapse's SQL functions (SQLSTATE P0001) into
/// [`DbError::Refused`]; other errors pass through.
pub fn refusal(e: tokio_postgres::Error) -> DbError {
    match e.as_db_error() {
        Some(db) if *db.code() == tokio_postgres::error::SqlState::RAISE_EXCEPTION => {
            DbError::Refused(db.message().to_string())
        }
        _ => DbError::Postgres(e),
    }
}

impl DbError {
    /// True when retrying later may succeed (connection trouble, not a bad query).
    pub fn is_transient(&self) -> bool {
        match self {
            DbError::Pool(_) => true,
            DbError::Postgres(e) => {
                use tokio_postgres::error::SqlState;
                // A statement or lock timeout: the same call may well succeed later.
                let timed_out = matches!(
                    e.code(),
                    Some(&SqlState::QUERY_CANCELED | &SqlState::LOCK_NOT_AVAILABLE)
                );
                e.is_closed() || e.code().is_none() || timed_out
            }
            _ => false,
        }
    }
}

pub fn pg_config(url: &Secret) -> Result<tokio_postgres::Config, DbError> {
    tokio_postgres::Config::from_str(url.expose())
        .map_err(|_| DbError::Config("database.url is not a valid PostgreSQL URL".into()))
}

/// A pool of `size` connections to `database.url`; connections are opened lazily.
///
/// Every connection runs with `statement_timeout` and
/// `idle_in_transaction_session_timeout` set to `database.statement_timeout`: a
/// database call that hangs ends with an error instead of stalling its loop, and a
/// frozen lapse process cannot hold row locks inside an open transaction for longer.
pub fn pool(database: &DatabaseConfig, size: usize) -> Result<Pool, DbError> {
    let mut config = pg_config(&database.url)?;
    config.connect_timeout(std::time::Duration::from_secs(5));
    let millis = database.statement_timeout.as_millis().max(1);
    let timeouts =
        format!("-c statement_timeout={millis} -c idle_in_transaction_session_timeout={millis}");
    let options = match config.get_options() {
        Some(own) if !own.trim().is_empty() => format!("{own} {timeouts}"),
        _ => timeouts,
    };
    config.options(options);
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        .wait_timeout(Some(std::time::Duration::from_secs(10)))
        .create_timeout(Some(std::time::Duration::from_secs(5)))
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .map_err(|e| DbError::Config(e.to_string()))
}

/// One connection outside any pool (for LISTEN and administration).
pub async fn connect(
    config: &tokio_postgres::Config,
) -> Result<
    (
        tokio_postgres::Client,
        tokio_postgres::Connection<tokio_postgres::Socket, tokio_postgres::tls::NoTlsStream>,
    ),
    DbError,
> {
    Ok(config.connect(NoTls).await?)
}

/// Creates the database named in `url` when it does not exist (connecting to the
/// `postgres` database of the same server to do so).
pub async fn ensure_database(url: &Secret) -> Result<(), DbError> {
    let config = pg_config(url)?;
    let Some(name) = config.get_dbname().map(str::to_string) else {
        return Ok(());
    };
    if connect(&config).await.is_ok() {
        return Ok(());
    }
    let mut admin = config.clone();
    admin.dbname("postgres");
    let (client, connection) = connect(&admin).await?;
    tokio::spawn(connection);
    let exists = client
        .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&name])
        .await?
        .is_some();
    if !exists {
        let quoted = format!("\"{}\"", name.replace('"', "\"\""));
        client
            .batch_execute(&format!("CREATE DATABASE {quoted}"))
            .await?;
        tracing::info!(database = %name, "created database");
    }
    Ok(())
}

/// Applies pending migrations; returns how many were applied.
pub async fn migrate(url: &Secret) -> Result<usize, DbError> {
    ensure_database(url).await?;
    let (mut client, connection) = connect(&pg_config(url)?).await?;
    let driver = tokio::spawn(connection);
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    let report = migrations::runner().run_async(&mut client).await;
    let _ = client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
        .await;
    drop(client);
    let _ = driver.await;
    Ok(report?.applied_migrations().len())
}

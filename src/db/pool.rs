//! The connection pools of lapse's components, and the transactions they open.
//!
//! Invariant: nothing lapse does on a pooled connection needs the session to outlive
//! one transaction, so the pools work through a connection pooler in transaction mode
//! (PgBouncer's `pool_mode = transaction`) as well as directly:
//! - no startup options and no session settings: the timeouts are set with
//!   `SET LOCAL` at the start of every transaction ([`begin`], [`begin_short`]);
//! - every statement is sent unnamed with its parameter types (`query_typed`,
//!   `execute_typed`): a named one lives as long as any row read through it, so it
//!   could outlive its transaction and stay on a server connection another client
//!   gets next;
//! - leadership is a lease row ([`super::Lease`]); migrations run in one transaction
//!   under a transaction-level advisory lock ([`super::migrate`]).

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, RecyclingMethod};

use super::{DbError, detect_dead_peers, pg_config};
use crate::config::DatabaseConfig;

/// The bounds every transaction of a pool runs under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// `statement_timeout`, and `idle_in_transaction_session_timeout` unless the
    /// transaction is short ([`SHORT_TRANSACTION_IDLE`]): `database.statement_timeout`.
    pub statement: Duration,
}

impl Limits {
    pub fn of(database: &DatabaseConfig) -> Self {
        Self {
            statement: database.statement_timeout,
        }
    }
}

/// A pool of connections to one database, with the [`Limits`] its transactions run
/// under. Derefs to the driver's pool (`get()`, `status()`).
#[derive(Clone)]
pub struct Pool {
    inner: deadpool_postgres::Pool,
    limits: Limits,
}

impl std::ops::Deref for Pool {
    type Target = deadpool_postgres::Pool;
    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}

impl Pool {
    pub fn limits(&self) -> Limits {
        self.limits
    }
}

/// A pool of `size` connections to `database.url`; connections are opened lazily.
///
/// Every transaction opened with [`begin`] runs with `statement_timeout` and
/// `idle_in_transaction_session_timeout` set to `database.statement_timeout`: a
/// database call that hangs ends with an error instead of stalling its loop, and a
/// frozen lapse process cannot hold row locks inside an open transaction for longer.
/// A server that vanished is noticed by TCP keepalives and a user timeout.
pub fn pool(database: &DatabaseConfig, size: usize) -> Result<Pool, DbError> {
    build(database, size, false)
}

/// A pool whose sessions find lapse's objects outside any transaction too, as an
/// application's would with `lapse` on its `search_path` (the demo's simulated shop
/// and the benchmark's load): a startup option, so for direct connections only, not
/// through a pooler in transaction mode.
pub fn app_pool(database: &DatabaseConfig, size: usize) -> Result<Pool, DbError> {
    build(database, size, true)
}

/// `config` with lapse's search path as a startup option (after any options the URL
/// gives).
pub fn with_search_path(config: &mut tokio_postgres::Config) {
    let path = format!("-c search_path={}", super::SEARCH_PATH.replace(' ', ""));
    let options = match config.get_options() {
        Some(given) if !given.trim().is_empty() => format!("{given} {path}"),
        _ => path,
    };
    config.options(options);
}

fn build(database: &DatabaseConfig, size: usize, app: bool) -> Result<Pool, DbError> {
    let mut config = pg_config(&database.url)?;
    if app {
        with_search_path(&mut config);
    }
    config.connect_timeout(Duration::from_secs(5));
    detect_dead_peers(&mut config);
    let connector = config.connector()?;
    let manager = Manager::from_config(
        config.config,
        connector,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let inner = deadpool_postgres::Pool::builder(manager)
        .max_size(size)
        .wait_timeout(Some(Duration::from_secs(10)))
        .create_timeout(Some(Duration::from_secs(5)))
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .map_err(|e| DbError::Config(e.to_string()))?;
    Ok(Pool {
        inner,
        limits: Limits::of(database),
    })
}

/// How long one of lapse's short transactions (a close, a stock release, a sweeper or
/// reconciler page) may sit idle waiting for lapse's next statement before the server
/// ends it. They hold order rows locked: a worker frozen or cut off inside one must
/// not keep those rows from the other workers for `database.statement_timeout`, which
/// the relay's transactions need, since they wait for the broker's confirms.
pub const SHORT_TRANSACTION_IDLE: Duration = Duration::from_secs(5);

/// Opens a transaction under `limits`: one round trip for `BEGIN`, one for the
/// `SET LOCAL`s.
pub async fn begin(
    client: &mut tokio_postgres::Client,
    limits: Limits,
) -> Result<tokio_postgres::Transaction<'_>, DbError> {
    let tx = client.transaction().await?;
    set_local(&tx, Some(limits.statement), limits.statement, None).await?;
    Ok(tx)
}

/// [`begin`] for a short transaction ([`SHORT_TRANSACTION_IDLE`]), with waits for a
/// lock other than a skipped row lock bounded by `lock_timeout` when given.
pub async fn begin_short(
    client: &mut tokio_postgres::Client,
    limits: Limits,
    lock_timeout: Option<Duration>,
) -> Result<tokio_postgres::Transaction<'_>, DbError> {
    let tx = client.transaction().await?;
    set_local(
        &tx,
        Some(limits.statement),
        SHORT_TRANSACTION_IDLE,
        lock_timeout,
    )
    .await?;
    Ok(tx)
}

/// Marks the transaction `tx` runs in as short ([`SHORT_TRANSACTION_IDLE`]), with
/// waits for a lock other than a skipped row lock bounded by `lock_timeout` when
/// given; its statement timeout stays as it was.
pub async fn short_transaction(
    tx: &tokio_postgres::Transaction<'_>,
    lock_timeout: Option<Duration>,
) -> Result<(), DbError> {
    set_local(tx, None, SHORT_TRANSACTION_IDLE, lock_timeout).await
}

/// A transaction without lapse's timeouts whose statements find lapse's objects
/// (`SET LOCAL search_path`, [`super::SEARCH_PATH`]): for the few questions lapse asks
/// outside a pool (a migration's position, the list of databases).
pub async fn begin_plain(
    client: &mut tokio_postgres::Client,
) -> Result<tokio_postgres::Transaction<'_>, DbError> {
    let tx = client.transaction().await?;
    tx.batch_execute(&format!("SET LOCAL search_path = {}", super::SEARCH_PATH))
        .await?;
    Ok(tx)
}

/// One simple-protocol round trip; the values are numbers lapse formats itself.
async fn set_local(
    tx: &tokio_postgres::Transaction<'_>,
    statement: Option<Duration>,
    idle: Duration,
    lock_timeout: Option<Duration>,
) -> Result<(), DbError> {
    let ms = |d: Duration| d.as_millis().clamp(1, i32::MAX.unsigned_abs().into());
    let mut sql = format!(
        "SET LOCAL idle_in_transaction_session_timeout = {}; SET LOCAL search_path = {}",
        ms(idle),
        super::SEARCH_PATH
    );
    if let Some(statement) = statement {
        sql += &format!("; SET LOCAL statement_timeout = {}", ms(statement));
    }
    if let Some(lock_timeout) = lock_timeout {
        sql += &format!("; SET LOCAL lock_timeout = {}", ms(lock_timeout));
    }
    tx.batch_execute(&sql).await?;
    Ok(())
}

//! PostgreSQL: connection pools, database creation and schema migrations.
//!
//! Invariant: migrations run in one transaction under a transaction-level advisory
//! lock, so several workers starting at once apply each migration exactly once,
//! directly or through a connection pooler in transaction mode.

use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::config::Secret;

refinery::embed_migrations!("migrations");

mod lease;
mod migrate;
mod pool;
mod position;
mod settings;
mod shards;
pub mod tls;
pub use lease::Lease;
pub use migrate::{migrate, migrate_shard, migrate_with_settings};
pub use pool::{
    Limits, Pool, SHORT_TRANSACTION_IDLE, app_pool, begin, begin_plain, begin_short, pool,
    short_transaction, with_search_path,
};
pub use position::{
    SchemaState, check as check_position, check_list, recorded_position, schema_state,
};
pub use settings::{Settings, write_settings};
pub use shards::{InShard, Pools, Schemas, check_shard_list, migrate_shards, shard_key};

/// The schema of lapse's own objects (docs/adopting.md): its tables, functions and
/// migration history. An installation made before it existed keeps them in `public`.
pub const SCHEMA: &str = "lapse";

/// The search path of every lapse transaction (`SET LOCAL`, so a pooler in
/// transaction mode keeps it to the transaction): lapse's schema, then `public` where
/// an earlier installation keeps its objects. A kind's action runs with
/// `database.shop_search_path` instead ([`crate::kinds::fire`]).
pub const SEARCH_PATH: &str = "lapse, public";

/// Advisory lock key serialising migrations ("lapse" in ASCII).
pub const MIGRATION_LOCK: i64 = 0x006c_6170_7365;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// Shown with the server's own message and SQLSTATE when there is one (the
    /// driver's `Display` of a server error is only "db error").
    #[error("database error: {}", postgres_detail(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// A connection the pool could not open shows the server's message and SQLSTATE.
    #[error("database pool error: {}", pool_detail(.0))]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("database configuration error: {0}")]
    Config(String),
    #[error("migration failed: {0}")]
    Migration(#[from] refinery::Error),
    /// The database refused the operation by rule (e.g. insufficient stock, a new
    /// deadline that is not later than the current one).
    #[error("refused: {0}")]
    Refused(String),
    /// A deadline that lapse does not accept (not finite, out of range, in the past,
    /// beyond the horizon, or a duration that overflows): SQLSTATE LP001.
    #[error("{0}")]
    InvalidDeadline(String),
    /// A value read from the database that lapse cannot use (e.g. an order deadline
    /// written before the deadline rules existed).
    #[error("unreadable value: {0}")]
    Unreadable(String),
    /// A shard this worker has not migrated yet (it did not answer at start; its
    /// migrations are retried in the background): treated like a database that is
    /// away, so nothing touches its orders on an old schema.
    #[error("{} is not migrated yet (worker.migrate_on_start retries it)", shard_key(*.0))]
    NotMigrated(u16),
    /// A server that accepted the connection but did not answer in time (a frozen
    /// server, a proxy in front of a dead one); `step` says what it did not do.
    #[error("the database server did not {step} within {after:?}")]
    NoAnswer { step: &'static str, after: Duration },
    /// The database was first migrated at another position of the list of order
    /// databases than the one the configuration gives it now (a reordered
    /// `database.shards`).
    #[error(
        "this database was first migrated as shard {recorded} ({}), but the configuration makes it shard {position}: timeout messages name their shard by its position, so the order of database.shards must never change (restore it; docs/scaling.md, \"Changing the number of shards\")",
        shard_key(u16::try_from(*recorded).unwrap_or(u16::MAX))
    )]
    ShardMoved { recorded: i32, position: u16 },
    /// Not migrated because other databases of the same list were moved: nothing of
    /// the list is migrated or recorded until it is restored.
    #[error(
        "not migrated: {} of the same list {} not where {} first migrated, so nothing is migrated or recorded until the order of database.shards is restored",
        moved.iter().map(|i| shard_key(*i)).collect::<Vec<_>>().join(", "),
        if moved.len() == 1 { "is" } else { "are" },
        if moved.len() == 1 { "it was" } else { "they were" }
    )]
    ListMoved { moved: Vec<u16> },
    /// A database that was migrated, for the same `broker.prefix`, in another list of
    /// order databases: two deployments sharing the prefix (and so the due queue)
    /// would judge each other's timeouts in the wrong database.
    #[error(
        "this database was migrated for broker.prefix {prefix:?} in another list of order databases: there, database.shards[{position}] is another database than in this configuration. Deployments that share a prefix share its due queue, so a timeout of one would be judged in the other's database: give each deployment its own broker.prefix, or the same database.shards list (docs/scaling.md, \"Changing the number of shards\")"
    )]
    OtherList { prefix: String, position: usize },
}

/// Turns an exception raised by lapse's SQL functions into a typed error: LP001 into
/// [`DbError::InvalidDeadline`], LP002, LP003 and P0001 into [`DbError::Refused`];
/// other errors pass through.
pub fn refusal(e: tokio_postgres::Error) -> DbError {
    let Some(db) = e.as_db_error() else {
        return DbError::Postgres(e);
    };
    match db.code().code() {
        crate::deadline::INVALID_DEADLINE_SQLSTATE => {
            DbError::InvalidDeadline(db.message().to_string())
        }
        crate::deadline::NOT_LATER_SQLSTATE | crate::deadline::UNREADABLE_DEADLINE_SQLSTATE => {
            DbError::Refused(db.message().to_string())
        }
        _ if *db.code() == tokio_postgres::error::SqlState::RAISE_EXCEPTION => {
            DbError::Refused(db.message().to_string())
        }
        _ => DbError::Postgres(e),
    }
}

/// Decodes column `idx` of `row`, as a typed error instead of a panic.
pub fn column<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a tokio_postgres::Row,
    name: &str,
) -> Result<T, DbError> {
    row.try_get(name)
        .map_err(|e| DbError::Unreadable(format!("column {name}: {e}")))
}

impl DbError {
    /// True when the database named does not exist (yet).
    pub fn is_missing_database(&self) -> bool {
        matches!(self, DbError::Postgres(e)
            if e.code() == Some(&tokio_postgres::error::SqlState::INVALID_CATALOG_NAME))
    }

    /// True when the list of order databases was reordered ([`DbError::ShardMoved`],
    /// [`DbError::ListMoved`]): a configuration error.
    pub fn is_reordered_list(&self) -> bool {
        matches!(
            self,
            DbError::ShardMoved { .. } | DbError::ListMoved { .. } | DbError::OtherList { .. }
        )
    }

    /// True when retrying the same work later may succeed: the connection or the
    /// server was away, or the transaction lost a race (deadlock, serialization
    /// failure, lock or statement timeout). False for what would fail again: a
    /// constraint violated by the data, a value that does not decode, a refusal.
    pub fn is_transient(&self) -> bool {
        match self {
            DbError::Pool(_) | DbError::NotMigrated(_) | DbError::NoAnswer { .. } => true,
            DbError::Postgres(e) => postgres_transient(e),
            // A migration whose connection failed (refinery wraps the driver's error).
            DbError::Migration(e) => std::error::Error::source(e)
                .and_then(|s| s.downcast_ref::<tokio_postgres::Error>())
                .is_some_and(postgres_transient),
            _ => false,
        }
    }
}

fn postgres_transient(e: &tokio_postgres::Error) -> bool {
    match e.code() {
        Some(code) => transient_sqlstate(code.code()),
        // A certificate the server presents is rejected again on every try.
        None if crate::tls::is_certificate_error(e) => false,
        None => e.is_closed() || caused_by_io(e) || is_client_timeout(e),
    }
}

impl DbError {
    /// The error as logs and park reasons show it (the server's message and SQLSTATE
    /// are part of the `Display` of every variant that has them).
    pub fn detail(&self) -> String {
        self.to_string()
    }
}

fn pool_detail(e: &deadpool_postgres::PoolError) -> String {
    match e {
        deadpool_postgres::PoolError::Backend(e) => postgres_detail(e),
        other => other.to_string(),
    }
}

/// A driver error with the server's message and SQLSTATE, or the cause of a client-side
/// error (an I/O error, a TLS failure), instead of the driver's bare "db error".
fn postgres_detail(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => match std::error::Error::source(e) {
            Some(cause) => format!("{e}: {cause}"),
            None => e.to_string(),
        },
    }
}

/// SQLSTATEs that describe the moment, not the work: connection exceptions (08),
/// transaction rollbacks such as serialization failure and deadlock (40),
/// insufficient resources (53), operator intervention such as a server shutting
/// down or starting up (57P), system errors (58), `lock_not_available` (55P03),
/// `query_canceled` (57014, e.g. `statement_timeout`) and `read_only_sql_transaction`
/// (25006: a standby, or a primary demoted during a failover, refuses writes until the
/// pool reaches the new primary), and the prepared-statement errors a connection
/// pooler in transaction mode causes when another client leaves a named statement on
/// a server connection (26000 `invalid_sql_statement_name`, 42P05
/// `duplicate_prepared_statement`: the next try gets another connection). The rest of class 25 describes the caller's own
/// transaction (e.g. 25P02, a failed transaction), which a retry does not change.
pub fn transient_sqlstate(code: &str) -> bool {
    ["08", "40", "53", "57P", "58"]
        .iter()
        .any(|class| code.starts_with(class))
        || matches!(code, "55P03" | "57014" | "25006" | "26000" | "42P05")
}

fn caused_by_io(e: &tokio_postgres::Error) -> bool {
    std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>())
}

/// tokio-postgres reports its own connect timeout only through its message.
fn is_client_timeout(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().is_none() && e.to_string() == "timeout waiting for server"
}

/// Where and how to connect to one database: the driver's settings (reached through
/// `Deref`) and the TLS the URL asked for ([`tls`]).
#[derive(Clone)]
pub struct PgTarget {
    config: tokio_postgres::Config,
    tls: tls::PgTls,
    /// Built on first use and shared by every connection made from this target.
    connector: Arc<OnceLock<tokio_postgres_rustls::MakeRustlsConnect>>,
}

impl std::ops::Deref for PgTarget {
    type Target = tokio_postgres::Config;
    fn deref(&self) -> &Self::Target {
        &self.config
    }
}

impl std::ops::DerefMut for PgTarget {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.config
    }
}

impl PgTarget {
    /// The TLS connector of this target (plain TCP is used when `sslmode` is
    /// `disable`, the default).
    pub fn connector(&self) -> Result<tokio_postgres_rustls::MakeRustlsConnect, DbError> {
        if let Some(built) = self.connector.get() {
            return Ok(built.clone());
        }
        let built = tls::connector(&self.tls)
            .map_err(|e| DbError::Config(format!("TLS (sslmode, sslrootcert): {e}")))?;
        Ok(self.connector.get_or_init(|| built).clone())
    }
}

/// The settings of `url`, with `sslmode` and `sslrootcert` taken out for lapse's own
/// TLS ([`tls::split`]).
pub fn pg_config(url: &Secret) -> Result<PgTarget, DbError> {
    let (rest, tls) = tls::split(url.expose())
        .map_err(|problem| DbError::Config(format!("database.url: {problem}")))?;
    let mut config = tokio_postgres::Config::from_str(&rest)
        .map_err(|_| DbError::Config("database.url is not a valid PostgreSQL URL".into()))?;
    config.ssl_mode(tls.mode.driver());
    Ok(PgTarget {
        config,
        tls,
        connector: Arc::default(),
    })
}

/// The driver half of a connection made outside a pool: spawn it to drive the client.
pub type Connection = tokio_postgres::Connection<
    tokio_postgres::Socket,
    <tokio_postgres_rustls::MakeRustlsConnect as tokio_postgres::tls::MakeTlsConnect<
        tokio_postgres::Socket,
    >>::Stream,
>;

/// One connection outside any pool (for LISTEN and administration).
pub async fn connect(target: &PgTarget) -> Result<(tokio_postgres::Client, Connection), DbError> {
    Ok(target.config.connect(target.connector()?).await?)
}

/// How long creating, migrating or checking a database waits for the TCP connect to
/// one host.
const MIGRATION_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a login may take once connected (a start-up check, a migration).
pub const LOGIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The connection settings of `url` for creating, migrating and checking its database
/// (outside the pools): a server
/// that does not answer at all (packets dropped) fails within
/// `MIGRATION_CONNECT_TIMEOUT` instead of the system's connect timeout, and one that
/// vanishes mid-way (no ACKs) within a minute through TCP keepalives and the user
/// timeout, so a worker's start does not wait minutes for one shard. A migration that
/// runs long, or waits for another worker's migration lock, is not cut short.
pub fn bounded_config(url: &Secret) -> Result<PgTarget, DbError> {
    let mut config = pg_config(url)?;
    config.connect_timeout(MIGRATION_CONNECT_TIMEOUT);
    detect_dead_peers(&mut config);
    Ok(config)
}

/// TCP keepalives (first probe after 15 s idle, then every 5 s, 3 tries) and a 60 s
/// user timeout (data unacknowledged that long): a server that vanished (a failover,
/// a cut network) is noticed within about a minute, on idle and busy connections
/// alike, instead of the system's two hours or more.
pub(super) fn detect_dead_peers(config: &mut tokio_postgres::Config) {
    config
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(15))
        .keepalives_interval(Duration::from_secs(5))
        .keepalives_retries(3)
        .tcp_user_timeout(Duration::from_secs(60));
}

/// [`connect`] for creating, migrating or checking a database: the login, too, is bounded (a
/// server that accepts the connection and then says nothing), by
/// `MIGRATION_CONNECT_TIMEOUT` for each host the driver may try in turn plus
/// [`LOGIN_TIMEOUT`].
pub async fn bounded_connect(
    config: &PgTarget,
) -> Result<(tokio_postgres::Client, Connection), DbError> {
    let hosts = u32::try_from(config.get_hosts().len().max(1)).unwrap_or(u32::MAX);
    let after = MIGRATION_CONNECT_TIMEOUT.saturating_mul(hosts) + LOGIN_TIMEOUT;
    tokio::time::timeout(after, connect(config))
        .await
        .unwrap_or(Err(DbError::NoAnswer {
            step: "complete the login",
            after,
        }))
}

/// Creates the database named in `url` when it does not exist (connecting to the
/// `postgres` database of the same server to do so).
pub async fn ensure_database(url: &Secret) -> Result<(), DbError> {
    let config = bounded_config(url)?;
    let Some(name) = config.get_dbname().map(str::to_string) else {
        return Ok(());
    };
    match bounded_connect(&config).await {
        Ok(_) => return Ok(()),
        // Only a missing database is created; any other failure (no answer, refused
        // login) would fail the admin connection the same way, after its own wait.
        Err(DbError::Postgres(e))
            if e.code() == Some(&tokio_postgres::error::SqlState::INVALID_CATALOG_NAME) => {}
        Err(e) => return Err(e),
    }
    let mut admin = config.clone();
    admin.dbname("postgres");
    let (client, connection) = bounded_connect(&admin).await?;
    tokio::spawn(connection);
    let exists = client
        .query_typed_opt(
            "SELECT 1 FROM pg_database WHERE datname = $1",
            &[(&name, tokio_postgres::types::Type::TEXT)],
        )
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

#[cfg(test)]
mod tests {
    use super::transient_sqlstate;

    #[test]
    fn races_and_outages_are_transient_bad_data_is_not() {
        for code in [
            "40001", "40P01", "08006", "08001", "57P01", "57P03", "53300", "55P03", "57014",
            "25006", "26000", "42P05",
        ] {
            assert!(transient_sqlstate(code), "{code} should be transient");
        }
        for code in [
            "23514", "23505", "22003", "22P02", "42P01", "P0001", "XX000", "25P02",
        ] {
            assert!(!transient_sqlstate(code), "{code} should be permanent");
        }
    }
}

//! Schema migrations: all pending migrations of a database, the settings and the
//! recorded position in one transaction, under a transaction-level advisory lock.
//!
//! One transaction, so that a pooler in transaction mode keeps the lock, the
//! migrations and the release of the lock on one server connection; a lapse process
//! that dies mid-way (or loses its connection) leaves nothing half-applied and no lock
//! behind; and a migration needs one server connection, not two. A migrator waiting
//! for another one waits for the lock a second at a time (visible in `pg_locks`) and
//! gives its server connection back between tries.

use std::time::Duration;

use refinery::AsyncMigrate;
use refinery::Migration;
use refinery_core::traits::r#async::{AsyncQuery, AsyncTransaction};
use tokio_postgres::types::Type;

use super::{
    DbError, MIGRATION_LOCK, Settings, bounded_config, bounded_connect, ensure_database,
    migrations, position, recorded_position, shards, write_settings,
};
use crate::config::Secret;

/// Applies pending migrations; returns how many were applied. Leaves
/// `lapse_settings` as it is (see [`migrate_with_settings`]).
pub async fn migrate(url: &Secret) -> Result<usize, DbError> {
    run_migrations(url, None).await
}

/// Applies pending migrations to the one order database (`database.url`, shard 0),
/// then writes `settings` and checks its position (see [`migrate_shard`]).
pub async fn migrate_with_settings(url: &Secret, settings: &Settings) -> Result<usize, DbError> {
    let lone = [crate::config::Shard {
        index: 0,
        url: url.clone(),
    }];
    // A database recorded at another position first (the more specific refusal), then
    // another deployment's list under the same prefix: refused before anything changes.
    if let Ok(recorded) = recorded_position(url).await {
        position::check(recorded, 0)?;
    }
    shards::bind_list(&lone, &settings.prefix, false)
        .await
        .map_err(|(_, e)| e)?;
    let applied = migrate_shard(url, settings, 0).await?;
    shards::bind_list(&lone, &settings.prefix, true)
        .await
        .map_err(|(_, e)| e)?;
    Ok(applied)
}

/// Applies pending migrations to the order database at `position` of the list, then
/// writes `settings` and records the position. A database whose first migration
/// recorded another position is refused before anything changes
/// ([`DbError::ShardMoved`]). What `lapse migrate` and a starting worker do.
pub async fn migrate_shard(
    url: &Secret,
    settings: &Settings,
    position: u16,
) -> Result<usize, DbError> {
    run_migrations(url, Some((settings, position))).await
}

/// How long the migration transaction may sit idle between two of lapse's statements.
const MIGRATION_IDLE: Duration = Duration::from_secs(60);

/// How long one try waits for the migration lock (shown in `pg_locks` meanwhile).
const LOCK_WAIT: Duration = Duration::from_secs(1);

/// The longest pause between two tries for the migration lock, holding no server
/// connection.
const LOCK_RETRY_MAX: Duration = Duration::from_secs(1);

async fn run_migrations(
    url: &Secret,
    settings: Option<(&Settings, u16)>,
) -> Result<usize, DbError> {
    ensure_database(url).await?;
    let (mut client, connection) = bounded_connect(&bounded_config(url)?).await?;
    let driver = tokio::spawn(connection);
    let result = migrate_locked(&mut client, settings).await;
    drop(client);
    let _ = driver.await;
    result
}

async fn migrate_locked(
    client: &mut tokio_postgres::Client,
    settings: Option<(&Settings, u16)>,
) -> Result<usize, DbError> {
    let mut pause = Duration::from_millis(100);
    let mut waited = Duration::ZERO;
    let tx = loop {
        // Read committed whatever the server's default: a migrator that waited for
        // the lock must see the history the one before it committed.
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
            .start()
            .await?;
        // lapse sends a migration's statements back to back, so a minute idle means
        // a frozen or cut-off migrator: its lock must not stop every other one for
        // as long as TCP takes to notice. The wait for the lock is bounded too, so
        // that a waiter gives its server connection back between tries.
        tx.batch_execute(&format!(
            "SET LOCAL idle_in_transaction_session_timeout = {}; SET LOCAL lock_timeout = {}",
            MIGRATION_IDLE.as_millis(),
            LOCK_WAIT.as_millis()
        ))
        .await?;
        let locked = tx
            .execute_typed(
                "SELECT pg_advisory_xact_lock($1)",
                &[(&MIGRATION_LOCK, Type::INT8)],
            )
            .await;
        match locked {
            Ok(_) => {
                // The migrations themselves wait for locks as long as they need.
                tx.batch_execute("SET LOCAL lock_timeout TO DEFAULT")
                    .await?;
                break tx;
            }
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {}
            Err(e) => return Err(e.into()),
        }
        drop(tx);
        waited += LOCK_WAIT + pause;
        if waited.as_secs() / 10 != (waited - LOCK_WAIT - pause).as_secs() / 10 {
            tracing::info!(
                waited = ?waited,
                "another process is migrating this database; waiting for it"
            );
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(LOCK_RETRY_MAX);
    };
    choose_layout(&tx).await?;
    // A database recorded at another position is refused before anything changes.
    if let Some((_, position)) = settings {
        let state = position::schema_state(&tx).await?;
        position::check(state.position, position)?;
    }
    let mut within = InTransaction(tx);
    let report = migrations::runner().run_async(&mut within).await?;
    let tx = within.0;
    tx.batch_execute("SET LOCAL lock_timeout TO DEFAULT")
        .await?;
    if let Some((settings, position)) = settings {
        write_settings(&tx, settings).await?;
        position::record(&tx, position).await?;
    }
    tx.commit().await?;
    Ok(report.applied_migrations().len())
}

/// Where this database keeps lapse's objects, set as the migration transaction's
/// search path so that the migrations' unqualified names land there: the schema
/// `lapse` (created if needed), or `public` for an installation an earlier version made
/// (lapse's migration history in `public`), which keeps working where it is. Every
/// lapse transaction looks in `lapse` first, then `public` ([`super::SEARCH_PATH`]).
async fn choose_layout(tx: &tokio_postgres::Transaction<'_>) -> Result<(), DbError> {
    tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {}", super::SCHEMA))
        .await?;
    // An earlier installation: a migration history, in a schema other than `lapse`,
    // whose first migration is lapse's (`V1__orders`) and whose schema holds lapse's
    // outbox (another tool's history alone is not ours). Any version: the settings
    // table came only with V5.
    let rows = tx
        .query_typed(
            "SELECT n.nspname AS schema FROM pg_class h
               JOIN pg_namespace n ON n.oid = h.relnamespace
              WHERE h.relname = 'refinery_schema_history' AND h.relkind = 'r'
                AND n.nspname <> 'lapse'
                AND EXISTS (SELECT 1 FROM pg_class o
                             WHERE o.relname = 'outbox' AND o.relnamespace = n.oid)
                AND to_regclass('lapse.refinery_schema_history') IS NULL
              ORDER BY n.nspname",
            &[],
        )
        .await?;
    let mut earlier = Vec::new();
    for row in &rows {
        let schema: String = super::column(row, "schema")?;
        let quoted = format!("\"{}\"", schema.replace('"', "\"\""));
        let ours = tx
            .query_typed_one(
                &format!(
                    "SELECT EXISTS (SELECT 1 FROM {quoted}.refinery_schema_history
                                     WHERE version = 1 AND name = 'orders') AS ours"
                ),
                &[],
            )
            .await?;
        if super::column::<bool>(&ours, "ours")? {
            earlier.push(schema);
        }
    }
    let schema = match earlier.as_slice() {
        [] => super::SCHEMA.to_string(),
        [public] if public == "public" => public.clone(),
        found => {
            return Err(DbError::Config(format!(
                "an earlier installation of lapse is in schema {}: this version finds its \
                 objects in `lapse` or, for an earlier installation, `public` \
                 (docs/adopting.md, \"What is where\"), and nothing is installed beside \
                 it; keep running the earlier version there, or move every object to \
                 `public` (ALTER ... SET SCHEMA, and ALTER FUNCTION ... SET search_path = \
                 pg_catalog, public, pg_temp for each lapse_* function) and migrate again",
                found.join(", ")
            )));
        }
    };
    // The migrations' own notices (`schema "lapse" already exists, skipping`) are noise.
    tx.batch_execute(&format!(
        "SET LOCAL search_path = {schema}; SET LOCAL client_min_messages = warning"
    ))
    .await?;
    Ok(())
}

/// refinery's runner inside lapse's migration transaction: every migration, and the
/// history rows it writes, in that one transaction.
struct InTransaction<'a>(tokio_postgres::Transaction<'a>);

impl AsyncTransaction for InTransaction<'_> {
    type Error = tokio_postgres::Error;

    async fn execute<'a, T: Iterator<Item = &'a str> + Send + 'a>(
        &'a mut self,
        queries: T,
    ) -> Result<usize, tokio_postgres::Error> {
        // Each migration starts with the server's lock timeout: a `SET LOCAL` of an
        // earlier migration in this transaction does not bound the next one.
        self.0
            .batch_execute("SET LOCAL lock_timeout TO DEFAULT")
            .await?;
        let mut count = 0;
        for query in queries {
            self.0.batch_execute(query).await?;
            count += 1;
        }
        Ok(count)
    }
}

impl AsyncQuery<Vec<Migration>> for InTransaction<'_> {
    async fn query<'a>(
        &'a mut self,
        query: &'a str,
    ) -> Result<Vec<Migration>, tokio_postgres::Error> {
        // The history as refinery writes it: version, name, applied_on (RFC 3339) and
        // checksum (a u64 as text). A value that is missing or does not parse is read
        // as the epoch, an empty name or checksum 0: refinery then reports the
        // migration as divergent, instead of the panic of its own reader.
        let rows = self.0.query_typed(query, &[]).await?;
        let text = |row: &tokio_postgres::Row, i: usize| -> String {
            row.try_get::<_, Option<String>>(i)
                .ok()
                .flatten()
                .unwrap_or_default()
        };
        rows.iter()
            .map(|row| {
                Ok(Migration::applied(
                    row.try_get(0)?,
                    text(row, 1),
                    time::OffsetDateTime::parse(
                        &text(row, 2),
                        &time::format_description::well_known::Rfc3339,
                    )
                    .unwrap_or(time::OffsetDateTime::UNIX_EPOCH),
                    text(row, 3).parse().unwrap_or(0),
                ))
            })
            .collect()
    }
}

impl AsyncMigrate for InTransaction<'_> {}

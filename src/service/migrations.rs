//! `worker.migrate_on_start`: every order database is migrated before the components
//! start, except, with several, a shard whose database does not answer. That one is
//! migrated in the background (component `migrate.s<i>`, retried with back-off), and
//! nothing works on it until its migrations committed: its relay and sweeper wait for
//! them, and the consumer and the releaser treat it as a shard that is away
//! ([`Schemas`], [`crate::db::Pools::ready`]). So no order of a shard is ever read,
//! closed or released on a schema older than this version expects.

use tokio_util::sync::CancellationToken;

use crate::config::{Config, Shard};
use crate::db::{self, InShard, Schemas};
use crate::runtime::backoff::Backoff;
use crate::runtime::health::Health;
use crate::runtime::supervisor::Fatal;
use crate::service::error::ServiceError;

/// What the start-up migrations left: which shards are migrated, and those to migrate
/// in the background.
pub struct AtStart {
    pub schemas: Schemas,
    pub pending: Vec<Shard>,
}

/// Migrates every order database, all at once, when `worker.migrate_on_start` is set.
/// With one database any failure stops the start (`lapse worker` waited for it to
/// answer already). With several, a shard whose database does not answer (a transient
/// error) is left pending and the others' components start; any other failure (refused
/// credentials, a failed migration) stops the start, naming `database.shards[i]`.
///
/// A shutdown requested meanwhile ends the wait: every shard not yet migrated is then
/// left pending, and the components, started with a cancelled token, stop at once.
pub async fn at_start(config: &Config, token: &CancellationToken) -> Result<AtStart, ServiceError> {
    let database = &config.database;
    let shards = database.shard_list().len();
    if !config.worker.migrate_on_start {
        return Ok(AtStart {
            schemas: Schemas::migrated(shards),
            pending: Vec::new(),
        });
    }
    let settings = db::Settings::from_config(config);
    let results = tokio::select! {
        results = db::migrate_shards(database, &settings) => results,
        () = token.cancelled() => {
            let all: Vec<u16> = (0..shards).filter_map(|i| u16::try_from(i).ok()).collect();
            return Ok(AtStart {
                schemas: Schemas::with_pending(shards, &all),
                pending: Vec::new(),
            });
        }
    };
    let (mut pending, mut failed) = (Vec::new(), None);
    for (shard, result) in results {
        let key = db::shard_key(shard.index);
        match result {
            Ok(_) => {}
            Err(e) if !database.sharded() => return Err(e.into()),
            Err(e) if e.is_transient() => {
                tracing::warn!(database = %key, error = %e.detail(),
                    "the shard's migrations failed transiently (not answering, a lock or \
                     statement timeout, a read-only server); starting without it: it is \
                     migrated in the background, and its relay and sweeper wait until then");
                pending.push(shard);
            }
            Err(e) => {
                tracing::error!(database = %key, error = %e.detail(), "migrations failed");
                failed.get_or_insert(InShard::new(shard.index, e));
            }
        }
    }
    if let Some(e) = failed {
        return Err(e.into());
    }
    let indices: Vec<u16> = pending.iter().map(|s| s.index).collect();
    Ok(AtStart {
        schemas: Schemas::with_pending(shards, &indices),
        pending,
    })
}

/// Migrates `shard` in the background: retries with back-off while its database does
/// not answer (shown down on `/health` meanwhile), then marks it migrated in `schemas`,
/// which starts its components, and idles until shutdown (a component that returns
/// would be restarted). Any other failure is fatal, naming the shard: it would have
/// stopped the start had the shard answered then.
pub async fn migrate_later(
    shard: Shard,
    settings: db::Settings,
    schemas: Schemas,
    component: &'static str,
    health: Health,
    token: CancellationToken,
) -> Result<(), Fatal> {
    let key = db::shard_key(shard.index);
    let mut backoff = Backoff::jittered();
    while !schemas.is_migrated(shard.index) {
        health.connecting(component);
        let attempt = tokio::select! {
            result = db::migrate_shard(&shard.url, &settings, shard.index) => result,
            () = token.cancelled() => return Ok(()),
        };
        match attempt {
            Ok(applied) => {
                tracing::info!(database = %key, applied, "migrated; its components start");
                schemas.set_migrated(shard.index);
            }
            Err(e) if e.is_transient() => {
                tracing::warn!(database = %key, error = %e.detail(),
                    "the shard's migrations failed transiently; they are tried again");
                health.down(component, e.detail());
                backoff.sleep(&token).await;
                if token.is_cancelled() {
                    return Ok(());
                }
            }
            Err(e) => return Err(Fatal(format!("{key}: {}", e.detail()))),
        }
    }
    health.up(component);
    token.cancelled().await;
    Ok(())
}

/// Waits until `shard` is migrated, showing `component` down meanwhile; false when
/// `token` is cancelled first.
pub async fn wait_migrated(
    schemas: &Schemas,
    shard: u16,
    component: &'static str,
    health: &Health,
    token: &CancellationToken,
) -> bool {
    if schemas.is_migrated(shard) {
        return true;
    }
    let key = db::shard_key(shard);
    health.down(component, format!("waiting for the migrations of {key}"));
    tokio::select! {
        () = schemas.wait(shard) => true,
        () = token.cancelled() => false,
    }
}

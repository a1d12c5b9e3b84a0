//! Several order databases: one pool per shard, migrations applied to each, and errors
//! that name the shard's key.

use std::sync::Arc;

use crate::db::Pool;
use tokio::sync::watch;

use super::{DbError, Settings};
use crate::config::{DatabaseConfig, Shard};

/// One pool per order database, indexed by shard (`database.shards[i]`, or
/// `database.url` alone as shard 0), and whether each shard's schema is migrated.
#[derive(Clone)]
pub struct Pools {
    pools: Arc<Vec<Pool>>,
    schemas: Schemas,
}

impl Pools {
    /// A pool of `size` connections (opened lazily) for every shard of `database`; a
    /// shard counts as migrated once `schemas` says so.
    pub fn open(
        database: &DatabaseConfig,
        size: usize,
        schemas: &Schemas,
    ) -> Result<Self, DbError> {
        let pools = database
            .shard_list()
            .iter()
            .map(|shard| super::pool(&database.for_shard(shard), size))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            pools: Arc::new(pools),
            schemas: schemas.clone(),
        })
    }

    /// The one database of a configuration without shards (shard 0), migrated.
    pub fn single(pool: Pool) -> Self {
        Self {
            pools: Arc::new(vec![pool]),
            schemas: Schemas::migrated(1),
        }
    }

    /// The same pools, migrated as `schemas` says.
    pub fn with_schemas(self, schemas: Schemas) -> Self {
        Self { schemas, ..self }
    }

    /// The pool to work on `shard`'s orders with: an error when this configuration has
    /// no such shard, or [`DbError::NotMigrated`] (transient) while its schema is not
    /// migrated yet.
    pub fn ready(&self, shard: u16) -> Result<&Pool, DbError> {
        let pool = self
            .get(shard)
            .ok_or_else(|| DbError::Config(format!("no database for shard {shard}")))?;
        match self.schemas.is_migrated(shard) {
            true => Ok(pool),
            false => Err(DbError::NotMigrated(shard)),
        }
    }

    /// The pool of `shard`; `None` when this configuration has no such shard.
    pub fn get(&self, shard: u16) -> Option<&Pool> {
        self.pools.get(usize::from(shard))
    }

    /// How many shards there are.
    pub fn len(&self) -> usize {
        self.pools.len()
    }

    /// Always false: a configuration has at least one database.
    pub fn is_empty(&self) -> bool {
        self.pools.is_empty()
    }
}

/// Whether each shard's schema is migrated: all of them unless the worker is still
/// migrating some in the background (`worker.migrate_on_start` with a shard that did not
/// answer at start). A shard's components wait for it ([`Schemas::wait`]); the consumer
/// and the releaser treat a shard that is not migrated as away ([`Pools::ready`]).
#[derive(Clone)]
pub struct Schemas {
    migrated: Arc<Vec<watch::Sender<bool>>>,
}

impl Schemas {
    /// `shards` shards, all migrated.
    pub fn migrated(shards: usize) -> Self {
        Self::with_pending(shards, &[])
    }

    /// `shards` shards, migrated except those in `pending`.
    pub fn with_pending(shards: usize, pending: &[u16]) -> Self {
        let flags = (0..shards)
            .map(|i| watch::Sender::new(!pending.iter().any(|p| usize::from(*p) == i)))
            .collect();
        Self {
            migrated: Arc::new(flags),
        }
    }

    /// True once `shard` is migrated (false for a shard there is no database for).
    pub fn is_migrated(&self, shard: u16) -> bool {
        self.migrated
            .get(usize::from(shard))
            .is_some_and(|flag| *flag.borrow())
    }

    /// Records that `shard` is migrated, waking whatever waits for it.
    pub fn set_migrated(&self, shard: u16) {
        if let Some(flag) = self.migrated.get(usize::from(shard)) {
            flag.send_replace(true);
        }
    }

    /// Returns once `shard` is migrated (never for a shard there is no database for).
    pub async fn wait(&self, shard: u16) {
        let Some(flag) = self.migrated.get(usize::from(shard)) else {
            return std::future::pending().await;
        };
        let mut seen = flag.subscribe();
        // The sender lives as long as `self`: waiting cannot fail.
        let _ = seen.wait_for(|migrated| *migrated).await;
    }
}

/// Applies pending migrations to every shard, all at once, then writes `settings` into
/// each; returns each shard's result (how many migrations it applied, or why not).
///
/// First, without changing anything, every shard that answers is asked for its
/// recorded position: when any was first migrated at another position (a reordered
/// list), no shard is migrated and no position recorded, so a database new to the
/// list is not recorded at a wrong position while the list is wrong. A shard that did
/// not answer that question (a transient error) is not migrated in this round: its
/// result is that error, so a silent server costs one bound, not two.
pub async fn migrate_shards(
    database: &DatabaseConfig,
    settings: &Settings,
) -> Vec<(Shard, Result<usize, DbError>)> {
    let shards = database.shard_list();
    let asked = shards
        .iter()
        .map(|shard| super::recorded_position(&shard.url));
    let recorded = futures_util::future::join_all(asked).await;
    let moved: Vec<(u16, i32)> = shards
        .iter()
        .zip(&recorded)
        .filter_map(|(shard, r)| match r {
            Ok(Some(p)) if *p != i32::from(shard.index) => Some((shard.index, *p)),
            _ => None,
        })
        .collect();
    if !moved.is_empty() {
        let keys: Vec<u16> = moved.iter().map(|(index, _)| *index).collect();
        return shards
            .into_iter()
            .map(|shard| {
                let error = match moved.iter().find(|(index, _)| *index == shard.index) {
                    Some((_, recorded)) => DbError::ShardMoved {
                        recorded: *recorded,
                        position: shard.index,
                    },
                    None => DbError::ListMoved {
                        moved: keys.clone(),
                    },
                };
                (shard, Err(error))
            })
            .collect();
    }
    // Another deployment's list under the same prefix: refused before anything changes.
    if let Err((shard, e)) = bind_list(&shards, &settings.prefix, false).await {
        let key = shard_key(shards[shard].index);
        let detail = e.to_string();
        let mut e = Some(e);
        return shards
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let error = match e.take().filter(|_| i == shard) {
                    Some(e) => e,
                    None => DbError::Config(format!("not migrated: {key}: {detail}")),
                };
                (s, Err(error))
            })
            .collect();
    }
    let runs = shards
        .iter()
        .zip(recorded)
        .map(|(shard, recorded)| async move {
            match recorded {
                Err(e) if e.is_transient() => Err(e),
                _ => super::migrate_shard(&shard.url, settings, shard.index).await,
            }
        });
    let mut results = futures_util::future::join_all(runs).await;
    if results.iter().all(Result::is_ok)
        && let Err((shard, e)) = bind_list(&shards, &settings.prefix, true).await
    {
        results[shard] = Err(e);
    }
    shards.into_iter().zip(results).collect()
}

/// Checks the list of order databases against the list each of them recorded for
/// `prefix` (see [`super::check_list`]); read-only. A database that does not answer is
/// left out of the check (the position checks and migrations meet it later). What a
/// starting worker runs.
/// The error names the shard (its `database.shards` index) whose record disagrees.
pub async fn check_shard_list(
    database: &DatabaseConfig,
    prefix: &str,
) -> Result<(), (u16, DbError)> {
    let shards = database.shard_list();
    bind_list(&shards, prefix, false)
        .await
        .map_err(|(shard, e)| (shards[shard].index, e))
}

/// Reads every shard's membership and checks the list; with `record`, and when every
/// shard answered with its identity, records the list in each. The error names the
/// entry (its index in `shards`) whose record disagrees, or that failed to record.
pub(super) async fn bind_list(
    shards: &[Shard],
    prefix: &str,
    record: bool,
) -> Result<(), (usize, DbError)> {
    let asked = shards
        .iter()
        .map(|shard| super::position::read_membership(&shard.url, prefix));
    let answers = futures_util::future::join_all(asked).await;
    let mut known = Vec::with_capacity(answers.len());
    for (i, answer) in answers.into_iter().enumerate() {
        known.push(match answer {
            Ok(membership) => membership,
            // Not answering now, or not created yet: left out of this check, met by a
            // later one.
            Err(e) if e.is_transient() || e.is_missing_database() => {
                super::position::Membership::default()
            }
            Err(e) => return Err((i, e)),
        });
    }
    let configured: Vec<Option<String>> = known.iter().map(|m| m.id.clone()).collect();
    let recorded: Vec<Option<Vec<String>>> = known.iter().map(|m| m.list.clone()).collect();
    super::check_list(&configured, &recorded).map_err(|(shard, position)| {
        (
            shard,
            DbError::OtherList {
                prefix: prefix.to_string(),
                position,
            },
        )
    })?;
    if !record {
        return Ok(());
    }
    let Some(ids) = configured.into_iter().collect::<Option<Vec<String>>>() else {
        return Ok(()); // not every database answered: recorded at a later migration
    };
    for (i, (shard, membership)) in shards.iter().zip(&known).enumerate() {
        let list = super::position::list_to_record(&ids, membership.list.as_ref());
        super::position::record_list_at(&shard.url, prefix, membership.list.as_ref(), &list)
            .await
            .map_err(|e| (i, e))?;
    }
    Ok(())
}

/// The configuration key of shard `index`: what an error names (the URL is a secret).
pub fn shard_key(index: u16) -> String {
    format!("database.shards[{index}]")
}

/// An error of one of several order databases, naming it by its key
/// (`database.shards[i]`) instead of `database.url`.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {source}")]
pub struct InShard {
    pub key: String,
    #[source]
    pub source: DbError,
}

impl InShard {
    pub fn new(shard: u16, source: DbError) -> Self {
        Self {
            key: shard_key(shard),
            source,
        }
    }
}

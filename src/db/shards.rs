//! Several order databases: one pool per shard, migrations applied to each, and errors
//! that name the shard's key.

use std::sync::Arc;

use deadpool_postgres::Pool;

use super::{DbError, Settings};
use crate::config::{DatabaseConfig, Shard};

/// One pool per order database, indexed by shard (`database.shards[i]`, or
/// `database.url` alone as shard 0).
#[derive(Clone)]
pub struct Pools {
    pools: Arc<Vec<Pool>>,
}

impl Pools {
    /// A pool of `size` connections (opened lazily) for every shard of `database`.
    pub fn open(database: &DatabaseConfig, size: usize) -> Result<Self, DbError> {
        let pools = database
            .shard_list()
            .iter()
            .map(|shard| super::pool(&database.for_shard(shard), size))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            pools: Arc::new(pools),
        })
    }

    /// The one database of a configuration without shards (shard 0).
    pub fn single(pool: Pool) -> Self {
        Self {
            pools: Arc::new(vec![pool]),
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

/// Applies pending migrations to every shard, all at once, then writes `settings` into
/// each; returns each shard's result (how many migrations it applied, or why not).
pub async fn migrate_shards(
    database: &DatabaseConfig,
    settings: &Settings,
) -> Vec<(Shard, Result<usize, DbError>)> {
    let shards = database.shard_list();
    let runs = shards
        .iter()
        .map(|shard| super::migrate_with_settings(&shard.url, settings));
    let results = futures_util::future::join_all(runs).await;
    shards.into_iter().zip(results).collect()
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

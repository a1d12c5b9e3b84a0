//! Several order databases (shards) with the same schema: `database.shards`, a list of
//! URLs, shard `i` being `shards[i]`. Without it `database.url` is the one database,
//! shard 0, and nothing is named after shards (components, metrics, `lapse status`
//! look as they always did).

use std::collections::HashMap;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::{ConfigError, DatabaseConfig, Secret};

/// The most shards a configuration may list (a message carries its shard as a small
/// number; 256 databases is far beyond what one worker process should hold pools for).
pub const MAX_SHARDS: usize = 256;

/// `relay.listen_url`: one URL for `database.url`, or one per shard.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ListenUrls {
    One(Secret),
    Each(Vec<Secret>),
}

/// The URL the relay of `shard` LISTENs on: `relay.listen_url` when set, else the
/// shard's own URL.
pub fn listen_url(listen: Option<&ListenUrls>, shard: &Shard) -> Secret {
    match listen {
        Some(ListenUrls::One(url)) => url.clone(),
        Some(ListenUrls::Each(urls)) => urls
            .get(usize::from(shard.index))
            .cloned()
            .unwrap_or_else(|| shard.url.clone()),
        None => shard.url.clone(),
    }
}

/// `relay.listen_url`: one valid URL per order database.
pub(super) fn validate_listen_urls(
    database: &DatabaseConfig,
    listen: Option<&ListenUrls>,
) -> Result<(), ConfigError> {
    let key = "relay.listen_url";
    let urls: Vec<&Secret> = match (listen, &database.shards) {
        (None, _) => return Ok(()),
        (Some(ListenUrls::One(url)), None) => vec![url],
        (Some(ListenUrls::Each(urls)), Some(shards)) if urls.len() == shards.len() => {
            urls.iter().collect()
        }
        (Some(ListenUrls::Each(urls)), None) if urls.len() == 1 => urls.iter().collect(),
        (Some(ListenUrls::One(url)), Some(shards)) if shards.len() == 1 => vec![url],
        (Some(_), Some(shards)) => {
            return Err(ConfigError::new(
                key,
                format!(
                    "database.shards lists {} databases: give a list of as many URLs, in the same order",
                    shards.len()
                ),
            ));
        }
        (Some(ListenUrls::Each(_)), None) => {
            return Err(ConfigError::new(
                key,
                "one URL (database.url is the only order database)",
            ));
        }
    };
    for url in urls {
        let (rest, _) =
            super::pg_tls::split(url.expose()).map_err(|problem| ConfigError::new(key, problem))?;
        tokio_postgres::Config::from_str(&rest).map_err(|_| {
            ConfigError::new(key, "not a valid postgres:// URL or key=value string")
        })?;
    }
    Ok(())
}

/// One order database: its index (what a message carries) and its URL.
#[derive(Clone, Debug)]
pub struct Shard {
    pub index: u16,
    pub url: Secret,
}

impl DatabaseConfig {
    /// True when `database.shards` is set (even with one entry): components and
    /// metrics are then named per shard.
    pub fn sharded(&self) -> bool {
        self.shards.is_some()
    }

    /// Every order database: `database.shards` in order, or `database.url` alone as
    /// shard 0.
    pub fn shard_list(&self) -> Vec<Shard> {
        match &self.shards {
            Some(urls) => urls
                .iter()
                .enumerate()
                .map(|(i, url)| Shard {
                    index: u16::try_from(i).unwrap_or(u16::MAX),
                    url: url.clone(),
                })
                .collect(),
            None => vec![Shard {
                index: 0,
                url: self.url.clone(),
            }],
        }
    }

    /// What `name` (a component, e.g. `relay`) is called for `shard`: `name` itself
    /// without shards, `name.s<shard>` with them.
    pub fn per_shard(&self, name: &str, shard: u16) -> String {
        if self.sharded() {
            format!("{name}.s{shard}")
        } else {
            name.to_string()
        }
    }

    /// A copy of this configuration whose `url` is `shard`'s (for code that opens a
    /// pool from `url`).
    pub fn for_shard(&self, shard: &Shard) -> DatabaseConfig {
        DatabaseConfig {
            url: shard.url.clone(),
            shards: None,
            ..self.clone()
        }
    }
}

/// Where a database is: hosts, ports, database name.
type Place = (Vec<String>, Vec<u16>, Option<String>);

/// `database.shards`: at least one, at most [`MAX_SHARDS`], each a valid URL, no
/// database twice (compared by host, port and database name, so that two spellings of
/// one database are caught too). Errors never show a URL.
pub(super) fn validate(database: &DatabaseConfig) -> Result<(), ConfigError> {
    let Some(urls) = &database.shards else {
        return Ok(());
    };
    let bad = |problem: String| Err(ConfigError::new("database.shards", problem));
    if urls.is_empty() {
        return bad(
            "must list at least one database (or leave it out and set database.url)".into(),
        );
    }
    if urls.len() > MAX_SHARDS {
        return bad(format!(
            "lists {} databases; at most {MAX_SHARDS}",
            urls.len()
        ));
    }
    let mut seen: HashMap<Place, usize> = HashMap::new();
    for (i, url) in urls.iter().enumerate() {
        let rest = match super::pg_tls::split(url.expose()) {
            Ok((rest, _)) => rest,
            Err(problem) => return bad(format!("shard {i}: {problem}")),
        };
        let Ok(pg) = tokio_postgres::Config::from_str(&rest) else {
            return bad(format!(
                "shard {i} is not a valid postgres:// URL or key=value string"
            ));
        };
        let hosts = pg.get_hosts().iter().map(|h| format!("{h:?}")).collect();
        let ports = match pg.get_ports() {
            [] => vec![5432],
            ports => ports.to_vec(),
        };
        let key = (hosts, ports, pg.get_dbname().map(str::to_string));
        if let Some(first) = seen.insert(key, i) {
            return bad(format!(
                "shard {i} names the same database as shard {first}; each shard is its own database"
            ));
        }
    }
    Ok(())
}

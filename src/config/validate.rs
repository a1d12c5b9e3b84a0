//! [`Config::validate`]: what the types cannot check (URLs, the prefix, the tier file,
//! ranges, keys that constrain each other), each error naming its key.

use std::str::FromStr;

use super::{
    Config, ConfigError, MAX_DEADLINE_HORIZON, MAX_GATHER, broker, kinds, packs, pg_tls, retention,
    shards,
};

impl Config {
    /// Checks what the types cannot: URLs, the prefix, the tier file, ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        broker::validate(&self.broker)?;
        validate_prefix(&self.broker.prefix)?;
        let (rest, _) = pg_tls::split(self.database.url.expose())
            .map_err(|problem| ConfigError::new("database.url", problem))?;
        tokio_postgres::Config::from_str(&rest).map_err(|_| {
            ConfigError::new(
                "database.url",
                "not a valid postgres:// URL or key=value string",
            )
        })?;
        shards::validate(&self.database)?;
        shards::validate_listen_urls(&self.database, self.relay.listen_url.as_ref())?;
        positive("database.pool_size", self.database.pool_size as u64)?;
        positive("worker.prefetch", u64::from(self.worker.prefetch))?;
        if let Some(address) = &self.worker.metrics_listen {
            listen_address(address).map_err(|p| ConfigError::new("worker.metrics_listen", p))?;
        }
        positive("worker.batch_size", self.worker.batch_size as u64)?;
        positive("worker.max_attempts", u64::from(self.worker.max_attempts))?;
        positive("relay.batch_size", self.relay.batch_size.max(0) as u64)?;
        positive("sweeper.batch_size", self.sweeper.batch_size.max(0) as u64)?;
        retention::validate(&self.retention)?;
        kinds::validate(&self.kinds)?;
        packs::validate(&self.packs)?;
        if self.relay.gather > MAX_GATHER {
            return Err(ConfigError::new(
                "relay.gather",
                "must be at most 1s (only intents due more than 2s later wait for it)",
            ));
        }
        kinds::validate_shop_search_path(&self.database.shop_search_path)?;
        if self.topology.quorum_group_size == Some(0) {
            return Err(ConfigError::new(
                "topology.quorum_group_size",
                "must be at least 1 (leave it out for every node, at most 3)",
            ));
        }
        self.validate_intervals()?;
        // The reconciler re-emits releases older than release_grace; a release still
        // in flight or waiting in the releaser's window must not count as lost.
        if self.sweeper.release_grace <= self.worker.release_batch_window {
            return Err(ConfigError::new(
                "sweeper.release_grace",
                "must be greater than 0 and than worker.release_batch_window (releases \
                 still in flight would be emitted again)",
            ));
        }
        if self.orders.initial_stock < 0 {
            return Err(ConfigError::new(
                "orders.initial_stock",
                "must not be negative",
            ));
        }
        if self.orders.deadline_horizon.is_zero()
            || self.orders.deadline_horizon > MAX_DEADLINE_HORIZON
        {
            return Err(ConfigError::new(
                "orders.deadline_horizon",
                "must be more than 0s and at most 36525days (100 years)",
            ));
        }
        let tiers = self.tier_file()?;
        // A remainder shorter than the smallest tier is waited out unacknowledged: it
        // must fit in what the broker's consumer timeout allows.
        let smallest = tiers.tiers.smallest();
        let limit = self.broker.hold_limit();
        if smallest.duration() > limit {
            return Err(ConfigError::new(
                "broker.consumer_timeout",
                format!(
                    "is {}, so a delivery is kept unacknowledged at most {}, but the smallest \
                     tier of {} is {}: remainders shorter than it are waited out \
                     unacknowledged; add a smaller tier or raise the broker's consumer_timeout \
                     (and this key)",
                    humantime::format_duration(self.broker.consumer_timeout),
                    humantime::format_duration(limit),
                    tiers.source,
                    smallest.name()
                ),
            ));
        }
        Ok(())
    }
}

fn positive(key: &str, value: u64) -> Result<(), ConfigError> {
    if value == 0 {
        return Err(ConfigError::new(key, "must be at least 1"));
    }
    Ok(())
}

/// `HOST:PORT` of a listener (an IPv6 address in brackets), checked for its form; the
/// host is resolved when the listener is bound.
pub fn listen_address(address: &str) -> Result<(), String> {
    let bad = || format!("{address:?} is not HOST:PORT (e.g. 127.0.0.1:9464 or localhost:9464)");
    let (host, port) = address.trim().rsplit_once(':').ok_or_else(bad)?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() || host.contains(':') && !address.trim().starts_with('[') {
        return Err(bad());
    }
    port.parse::<u16>().map_err(|_| bad())?;
    Ok(())
}

/// A prefix becomes the first component of every queue and exchange name.
pub fn validate_prefix(prefix: &str) -> Result<(), ConfigError> {
    let bad = |problem: &str| Err(ConfigError::new("broker.prefix", problem));
    if prefix.is_empty() {
        return bad("must not be empty");
    }
    if prefix.len() > 100 {
        return bad("must be at most 100 characters (queue names are limited to 255 bytes)");
    }
    if let Some(c) = prefix
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return bad(&format!(
            "contains {c:?}; use only ASCII letters, digits, '-', '_' and '.'"
        ));
    }
    if prefix.starts_with('.') || prefix.ends_with('.') || prefix.contains("..") {
        return bad("must not start or end with '.' or contain an empty component");
    }
    if prefix.starts_with("amq.") {
        return bad("names starting with 'amq.' are reserved by the broker");
    }
    Ok(())
}

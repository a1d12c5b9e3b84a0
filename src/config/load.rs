//! Where a configuration comes from: named defaults, then the TOML file, then the
//! `LAPSE_` environment (with [`super::MOVED_KEYS`] applied), and how a parser's error
//! becomes a [`ConfigError`] naming its key without echoing a secret.

use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};

use super::{Config, ConfigError, moved_keys};

impl Config {
    /// Loads defaults, then `file` (required to exist when `explicit`), then the
    /// environment, and validates the result.
    pub fn load(file: &Path, explicit: bool) -> Result<Self, ConfigError> {
        if explicit && !file.is_file() {
            return Err(ConfigError::new(
                "--config",
                format!("no such file: {}", file.display()),
            ));
        }
        let user = Figment::new().merge(Toml::file(file)).merge(env());
        if user.find_value("database.url").is_ok() && user.find_value("database.shards").is_ok() {
            return Err(ConfigError::new(
                "database.url",
                "set together with database.shards; with shards, list every database in \
                 database.shards (shard 0 first) and leave database.url out",
            ));
        }
        let (user, warnings) = moved_keys(user);
        for warning in &warnings {
            tracing::warn!("{warning}");
        }
        let figment = Figment::from(Serialized::defaults(Config::default())).merge(user);
        Self::from_figment(figment)
    }

    pub fn from_figment(figment: Figment) -> Result<Self, ConfigError> {
        let config: Config = figment.extract().map_err(figment_error)?;
        config.validate()?;
        Ok(config)
    }
}

/// The log filter variable.
pub const LOG_VAR: &str = "LAPSE_LOG";
/// The log format variable: `text` or `json`.
pub const LOG_FORMAT_VAR: &str = "LAPSE_LOG_FORMAT";
/// The log filter of the workers `lapse bench` starts (default `error`).
pub const BENCH_WORKER_LOG_VAR: &str = "LAPSE_BENCH_WORKER_LOG";
/// The `LAPSE_` variables that belong to logging, not to the configuration tree; the
/// telemetry setup (and `lapse bench`, for its workers) reads them.
pub const LOG_ENV_VARS: [&str; 3] = [LOG_VAR, LOG_FORMAT_VAR, BENCH_WORKER_LOG_VAR];

/// The configuration file, like `--config` (which wins).
pub const CONFIG_VAR: &str = "LAPSE_CONFIG";

/// The `LAPSE_<SECTION>__<KEY>` overrides: every `LAPSE_` variable except the logging
/// ones ([`LOG_ENV_VARS`]) and [`CONFIG_VAR`].
pub fn env() -> Env {
    Env::prefixed("LAPSE_")
        .filter(|key| {
            !LOG_ENV_VARS
                .iter()
                .chain([&CONFIG_VAR])
                .any(|var| var.strip_prefix("LAPSE_").is_some_and(|v| key == v))
        })
        .split("__")
}

fn figment_error(error: figment::Error) -> ConfigError {
    use figment::error::Kind;
    let mut path = error.path.clone();
    let problem = match &error.kind {
        Kind::UnknownField(field, _) => {
            if path.last() != Some(field) {
                path.push(field.clone());
            }
            "unknown key".to_string()
        }
        Kind::MissingField(field) => {
            if path.last().map(String::as_str) != Some(field.as_ref()) {
                path.push(field.to_string());
            }
            "missing key".to_string()
        }
        kind => without_source_lines(&kind.to_string()),
    };
    let key = if path.is_empty() {
        "(top level)".to_string()
    } else {
        path.join(".")
    };
    ConfigError::new(key, crate::redact::redact(&problem))
}

/// A parser's message without the source excerpt it quotes (`2 | url = "..."` and
/// its caret line): the offending line may hold a password, and the line and column
/// numbers already say where the problem is.
fn without_source_lines(message: &str) -> String {
    let is_excerpt = |line: &str| {
        let t = line.trim_start();
        let digits = t.trim_start_matches(|c: char| c.is_ascii_digit());
        t.is_empty()
            || t.starts_with('|')
            || (digits.len() < t.len() && digits.trim_start().starts_with('|'))
    };
    message
        .lines()
        .filter(|line| !is_excerpt(line))
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(": ")
}

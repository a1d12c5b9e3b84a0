//! Structured logs on stderr, so command output stays clean on stdout, through
//! [`crate::redact`], so no log line can carry a password.
//!
//! Two environment variables, which are not configuration keys:
//! - `LAPSE_LOG`: the filter (`info` by default, `warn` for `lapse demo`; `RUST_LOG` is
//!   read when it is unset),
//!   e.g. `warn`, `lapse=debug`, `lapse::components::relay=trace,info`.
//! - `LAPSE_LOG_FORMAT`: `text` (default) or `json` (one JSON object per line).
//!
//! The AMQP client's own log events are off unless the filter names `lapin`: it logs
//! every channel the broker closes as an error, including the answers lapse expects
//! (a 404 to a passive declare, a 406 to a drift check), and every failure that
//! matters reaches lapse as a result, which lapse reports itself. Colours only when
//! stderr is a terminal and `NO_COLOR` is unset.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::{ConfigError, LOG_FORMAT_VAR, LOG_VAR};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
}

/// What the variables ask for: the filter directives and the format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub filter: String,
    pub format: Format,
}

impl Settings {
    /// Reads `LAPSE_LOG` (else `RUST_LOG`) and `LAPSE_LOG_FORMAT` through `var`; an
    /// unknown format or an unparsable filter is an error naming the variable.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let (name, filter) = match (var(LOG_VAR), var("RUST_LOG")) {
            (Some(f), _) => (LOG_VAR, f),
            (None, Some(f)) => ("RUST_LOG", f),
            (None, None) => (LOG_VAR, "info".to_string()),
        };
        let mut filter = filter.trim().to_string();
        if filter.is_empty() {
            filter = "info".into();
        }
        EnvFilter::try_new(&filter).map_err(|e| ConfigError {
            key: name.into(),
            problem: format!("not a log filter ({e}); e.g. info, warn, lapse=debug"),
        })?;
        if !filter.contains("lapin") {
            filter.push_str(",lapin=off");
        }
        let format = match var(LOG_FORMAT_VAR).as_deref().map(str::trim) {
            None | Some("") | Some("text") => Format::Text,
            Some("json") => Format::Json,
            Some(other) => {
                return Err(ConfigError {
                    key: LOG_FORMAT_VAR.into(),
                    problem: format!("{other:?} is not a log format; use text or json"),
                });
            }
        };
        Ok(Self { filter, format })
    }
}

/// Sets up logging from the environment; an invalid variable is an error (exit 2).
/// A second call (tests) keeps the first subscriber.
pub fn try_init() -> Result<(), ConfigError> {
    let settings = Settings::from_vars(|name| std::env::var(name).ok())?;
    install(&settings);
    Ok(())
}

/// Like [`try_init`], with `level` as the filter when neither `LAPSE_LOG` nor
/// `RUST_LOG` is set.
pub fn try_init_with_default(level: &str) -> Result<(), ConfigError> {
    let unset = std::env::var_os(LOG_VAR).is_none() && std::env::var_os("RUST_LOG").is_none();
    let settings = Settings::from_vars(|name| match name {
        LOG_VAR if unset => Some(level.to_string()),
        _ => std::env::var(name).ok(),
    })?;
    install(&settings);
    Ok(())
}

/// Like [`try_init`], falling back to `info` text logs when a variable is invalid.
pub fn init() {
    let settings = Settings::from_vars(|name| std::env::var(name).ok()).unwrap_or(Settings {
        filter: "info,lapin=off".into(),
        format: Format::Text,
    });
    install(&settings);
}

fn install(settings: &Settings) {
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::new(&settings.filter))
        .with_ansi(colour)
        .with_writer(|| crate::redact::RedactingStderr);
    let _ = match settings.format {
        Format::Json => builder.json().try_init(),
        Format::Text => builder.try_init(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Result<Settings, ConfigError> {
        Settings::from_vars(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn defaults_to_info_text_without_the_amqp_clients_own_events() {
        let s = settings(&[]).unwrap();
        assert_eq!(s.filter, "info,lapin=off");
        assert_eq!(s.format, Format::Text);
    }

    #[test]
    fn lapse_log_wins_over_rust_log_and_naming_lapin_keeps_its_events() {
        let s = settings(&[("LAPSE_LOG", "warn"), ("RUST_LOG", "trace")]).unwrap();
        assert_eq!(s.filter, "warn,lapin=off");
        let s = settings(&[("RUST_LOG", "debug")]).unwrap();
        assert_eq!(s.filter, "debug,lapin=off");
        let s = settings(&[("LAPSE_LOG", "info,lapin=debug")]).unwrap();
        assert_eq!(s.filter, "info,lapin=debug");
    }

    #[test]
    fn a_bad_variable_is_an_error_naming_it() {
        let e = settings(&[("LAPSE_LOG_FORMAT", "xml")]).unwrap_err();
        assert_eq!(e.key, "LAPSE_LOG_FORMAT");
        let e = settings(&[("LAPSE_LOG", "lapse=notalevel")]).unwrap_err();
        assert_eq!(e.key, "LAPSE_LOG");
        assert_eq!(
            settings(&[("LAPSE_LOG_FORMAT", "json")]).unwrap().format,
            Format::Json
        );
    }
}

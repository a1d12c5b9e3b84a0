//! Validation of the `[broker]` section: URLs, TLS and the confirm timeout.
//!
//! Invariant: what lapse cannot honour is refused here, never silently dropped — a
//! URL query parameter lapin would ignore (such as RabbitMQ's `verify` or
//! `cacertfile`), TLS files next to a plain `amqp://` URL, a certificate without its
//! key. Errors never echo a URL.

use std::str::FromStr;
use std::time::Duration;

use super::{BrokerConfig, ConfigError};
use crate::redact::Secret;

/// Query parameters of an AMQP URL that lapin reads; anything else would be ignored.
const AMQP_QUERY_KEYS: [&str; 5] = [
    "heartbeat",
    "connection_timeout",
    "channel_max",
    "frame_max",
    "auth_mechanism",
];

pub(super) fn validate(broker: &BrokerConfig) -> Result<(), ConfigError> {
    let all = super::split_addresses(&broker.url);
    let mut first: Option<lapin::uri::AMQPUri> = None;
    for (i, address) in all.iter().enumerate() {
        // With several addresses the problem says which one (never the URL itself).
        let which = if all.len() > 1 {
            format!("address {} of {}: ", i + 1, all.len())
        } else {
            String::new()
        };
        let amqp = validate_address(address)
            .map_err(|problem| ConfigError::new("broker.url", format!("{which}{problem}")))?;
        if let Some(first) = &first {
            if amqp.scheme != first.scheme {
                return Err(ConfigError::new(
                    "broker.url",
                    format!("{which}mixes amqp:// and amqps:// (all addresses share broker.tls)"),
                ));
            }
            if amqp.vhost != first.vhost {
                return Err(ConfigError::new(
                    "broker.url",
                    format!(
                        "{which}names another virtual host than address 1 (all addresses are nodes of one cluster)"
                    ),
                ));
            }
        } else {
            first = Some(amqp);
        }
    }
    let amqp = first.expect("split yields at least one address");
    let tls = &broker.tls;
    let tls_configured = tls.ca_file.is_some() || tls.cert_file.is_some() || tls.key_file.is_some();
    if tls_configured && amqp.scheme == lapin::uri::AMQPScheme::AMQP {
        return Err(ConfigError::new(
            "broker.tls",
            "is set, but broker.url is amqp:// (no TLS); use amqps://",
        ));
    }
    if broker.confirm_timeout == Duration::ZERO {
        return Err(ConfigError::new(
            "broker.confirm_timeout",
            "must be longer than 0s",
        ));
    }
    if let Some(mgmt) = &broker.management_url {
        let url = url::Url::parse(mgmt.expose()).map_err(|e| {
            ConfigError::new("broker.management_url", format!("not a valid URL ({e})"))
        })?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ConfigError::new(
                "broker.management_url",
                "must be an http:// or https:// URL",
            ));
        }
    }
    Ok(())
}

/// One AMQP URL of `broker.url`: parsed, with only query parameters lapin reads.
fn validate_address(address: &Secret) -> Result<lapin::uri::AMQPUri, String> {
    let invalid = || {
        if address.expose().is_empty() {
            "is empty (two commas in a row, or a trailing comma?)".to_string()
        } else {
            "not a valid amqp:// or amqps:// URL".to_string()
        }
    };
    let amqp = lapin::uri::AMQPUri::from_str(address.expose()).map_err(|_| invalid())?;
    let parsed = url::Url::parse(address.expose()).map_err(|_| invalid())?;
    if let Some((key, _)) = parsed
        .query_pairs()
        .find(|(key, _)| !AMQP_QUERY_KEYS.contains(&key.as_ref()))
    {
        return Err(format!(
            "query parameter `{key}` is not supported (lapse reads only {}); \
             TLS settings go in [broker.tls]",
            AMQP_QUERY_KEYS.join(", ")
        ));
    }
    Ok(amqp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, Secret};

    fn broker(url: &str) -> BrokerConfig {
        let mut b = Config::default().broker;
        b.url = Secret::new(url);
        b
    }

    #[test]
    fn plain_and_tls_urls_without_files_are_fine() {
        validate(&broker("amqp://u:secret@h:5672/%2f?heartbeat=10")).unwrap();
        validate(&broker("amqps://u:secret@h:5671/%2f")).unwrap();
    }

    #[test]
    fn a_query_parameter_lapse_would_ignore_is_refused_without_echoing_the_url() {
        let err = validate(&broker("amqps://u:hunter2@h/%2f?verify=verify_none")).unwrap_err();
        assert_eq!(err.key, "broker.url");
        assert!(err.problem.contains("`verify`"), "{err}");
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert!(!err.to_string().contains("verify_none"), "{err}");
    }

    #[test]
    fn tls_files_with_a_plain_url_are_refused() {
        let mut b = broker("amqp://u:hunter2@h/%2f");
        b.tls.ca_file = Some("/nonexistent/ca.pem".into());
        let err = validate(&b).unwrap_err();
        assert_eq!(err.key, "broker.tls");
        assert!(err.problem.contains("amqps://"), "{err}");
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    #[test]
    fn several_addresses_are_each_checked_and_named_by_position() {
        validate(&broker("amqp://u:p@h1:5701/%2f, amqp://u:p@h2:5702/%2f")).unwrap();
        let err = validate(&broker("amqp://u:hunter2@h1/%2f,http://u:hunter2@h2")).unwrap_err();
        assert_eq!(err.key, "broker.url");
        assert!(err.problem.starts_with("address 2 of 2:"), "{err}");
        assert!(!err.to_string().contains("hunter2"), "{err}");
        let err = validate(&broker("amqp://h1/%2f,")).unwrap_err();
        assert!(err.problem.contains("address 2 of 2: is empty"), "{err}");
        let err = validate(&broker("amqp://h1/%2f,amqps://h2/%2f")).unwrap_err();
        assert!(err.problem.contains("mixes amqp:// and amqps://"), "{err}");
        let err = validate(&broker("amqp://h1/a,amqp://h2/b")).unwrap_err();
        assert!(err.problem.contains("another virtual host"), "{err}");
    }

    #[test]
    fn a_zero_confirm_timeout_is_refused() {
        let mut b = broker("amqp://h");
        b.confirm_timeout = Duration::ZERO;
        assert_eq!(validate(&b).unwrap_err().key, "broker.confirm_timeout");
    }
}

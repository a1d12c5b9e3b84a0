//! `[kinds.<name>]`: the kinds of deadline lapse fires over the shop's own tables
//! (docs/adopting.md). Each has a key type, the guarded action run at its deadline and
//! the event published when the action fired.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// The kinds, by name.
pub type Kinds = BTreeMap<String, KindConfig>;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KindConfig {
    /// The SQL type of the key, bound to the action as `$1`.
    #[serde(default)]
    pub key_type: KeyType,
    /// One statement of the shop's, with the key as `$1` and a `RETURNING` clause: run
    /// at the deadline in the transaction that records the deadline as done. 0 rows:
    /// nothing to do; 1 row: fired; more: rolled back and parked.
    pub action: String,
    /// Published (at least once, through the outbox) when the action fired.
    #[serde(default)]
    pub event: Option<EventConfig>,
    /// A second SQL statement of the shop's, with the key as `$1`, run right after the
    /// action fired, in the same savepoint: an effect in the same database (e.g. a
    /// stock release). If it fails, the action is rolled back with it.
    #[serde(default)]
    pub effect: Option<String>,
}

/// Where a fired deadline's event goes: the shop's exchange and routing key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventConfig {
    pub exchange: String,
    pub routing_key: String,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyType {
    #[default]
    Text,
    Bigint,
    Uuid,
}

impl KeyType {
    pub fn as_str(self) -> &'static str {
        match self {
            KeyType::Text => "text",
            KeyType::Bigint => "bigint",
            KeyType::Uuid => "uuid",
        }
    }
}

impl fmt::Display for KeyType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The longest kind name (PostgreSQL's identifier length, as `lapse.kinds` checks).
const MAX_NAME: usize = 63;

/// Checks what the types cannot: names, a non-empty single action, event names.
pub fn validate(kinds: &Kinds) -> Result<(), ConfigError> {
    for (name, kind) in kinds {
        let key = |field: &str| format!("kinds.{name}.{field}");
        let valid_name = name.len() <= MAX_NAME
            && name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !valid_name {
            return Err(ConfigError::new(
                format!("kinds.{name}"),
                "a kind's name is a lower-case letter followed by lower-case letters, digits \
                 or _ (at most 63)",
            ));
        }
        let action = statement(&kind.action);
        if action.is_empty() {
            return Err(ConfigError::new(key("action"), "must not be empty"));
        }
        if action.contains(';') && !action.contains('\'') && !action.contains('"') {
            return Err(ConfigError::new(
                key("action"),
                "must be one statement (no ';' inside it)",
            ));
        }
        if let Some(effect) = &kind.effect {
            let effect = statement(effect);
            if effect.is_empty() {
                return Err(ConfigError::new(
                    key("effect"),
                    "must not be empty (leave it out for none)",
                ));
            }
            if effect.contains(';') && !effect.contains('\'') && !effect.contains('"') {
                return Err(ConfigError::new(
                    key("effect"),
                    "must be one statement (no ';' inside it)",
                ));
            }
        }
        if let Some(event) = &kind.event {
            if event.routing_key.len() > 255 {
                return Err(ConfigError::new(
                    key("event.routing_key"),
                    "must be at most 255 bytes (AMQP)",
                ));
            }
            if event.exchange.is_empty() || event.exchange.len() > 255 {
                return Err(ConfigError::new(
                    key("event.exchange"),
                    "must be a name of 1 to 255 bytes (the default exchange cannot route \
                     events by routing key to a queue of another name)",
                ));
            }
        }
    }
    Ok(())
}

/// `database.shop_search_path` when not set: the shop's tables in `public`.
pub fn default_shop_search_path() -> String {
    "public".into()
}

/// A list of schema names (plain identifiers or `"$user"`), without lapse's own
/// schema: a kind's action must never resolve a name into lapse's tables (the example
/// shop has an `orders` table too).
pub fn validate_shop_search_path(path: &str) -> Result<(), ConfigError> {
    let key = "database.shop_search_path";
    for schema in path.split(',').map(str::trim) {
        // Plain lower-case identifiers only: what lapse pastes into `SET LOCAL
        // search_path` must mean exactly what it says (no quoting, no `$`).
        let identifier = schema.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && schema.len() <= 63
            && schema
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !identifier {
            return Err(ConfigError::new(
                key,
                format!(
                    "{schema:?} is not a schema name: a comma-separated list of lower-case \
                     names (letters, digits, _), e.g. \"public\" or \"shop, public\""
                ),
            ));
        }
        if schema == "lapse" {
            return Err(ConfigError::new(
                key,
                "must not name lapse: a kind's action would then find lapse's own tables \
                 (its example shop has `orders`, `stock`, ...) before the shop's",
            ));
        }
    }
    Ok(())
}

/// The action as it is run: without surrounding blanks and trailing semicolons.
pub fn statement(action: &str) -> &str {
    action.trim().trim_end_matches(';').trim_end()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(action: &str) -> KindConfig {
        KindConfig {
            key_type: KeyType::Text,
            action: action.into(),
            event: None,
            effect: None,
        }
    }

    #[test]
    fn names_and_actions_are_checked_with_their_key() {
        let ok = Kinds::from([(
            "order_close".into(),
            kind("UPDATE t SET a = 1 WHERE k = $1 RETURNING k;"),
        )]);
        validate(&ok).unwrap();
        let bad_name = Kinds::from([("Order-Close".into(), kind("SELECT 1"))]);
        assert_eq!(validate(&bad_name).unwrap_err().key, "kinds.Order-Close");
        let empty = Kinds::from([("a".into(), kind("  ; "))]);
        assert_eq!(validate(&empty).unwrap_err().key, "kinds.a.action");
        let two = Kinds::from([("a".into(), kind("UPDATE t SET a = 1; DELETE FROM t"))]);
        assert_eq!(validate(&two).unwrap_err().key, "kinds.a.action");
    }

    #[test]
    fn the_shop_search_path_never_names_lapse() {
        validate_shop_search_path("public").unwrap();
        validate_shop_search_path("shop, public").unwrap();
        for bad in [
            "lapse",
            "public, lapse",
            "\"$user\", public",
            "",
            "public;drop",
            "a,,b",
        ] {
            let e = validate_shop_search_path(bad).unwrap_err();
            assert_eq!(e.key, "database.shop_search_path", "{bad}");
        }
    }

    #[test]
    fn the_statement_loses_trailing_semicolons_only() {
        assert_eq!(statement("  SELECT ';' ;; \n"), "SELECT ';'");
    }
}

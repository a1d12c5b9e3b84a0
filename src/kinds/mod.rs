//! Deadline kinds over the shop's own tables (docs/adopting.md): the kinds the
//! configuration declares, ready to run ([`Catalog`]); their check against the live
//! database ([`check`]); the fire path the worker takes for a kind's timeout
//! ([`fire`]); and the promoter that hands far deadlines to the broker when they come
//! within range, with the backstop for lost timeouts ([`promote`]).
//!
//! Invariants: a kind's action runs only in the transaction that marks its deadline
//! fired, inside a savepoint, so an action that fails or changes more than one row
//! leaves nothing behind and parks only its own deadline; a deadline fires at most
//! once per version (its row is locked and its state checked in that transaction).

pub mod check;
pub mod fire;
pub mod promote;
pub mod status;

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio_postgres::types::{ToSql, Type};

use crate::config::{EventConfig, KeyType, Kinds};

/// One kind, ready to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kind {
    pub name: String,
    pub key_type: KeyType,
    /// The action without trailing semicolons.
    pub action: String,
    pub event: Option<EventConfig>,
    /// The effect in the same database, without trailing semicolons.
    pub effect: Option<String>,
}

impl Kind {
    /// The effect as lapse runs it: inside a WITH, so only a data statement can be
    /// one (never a COMMIT or a SET that would end or change the firing transaction).
    pub fn wrapped_effect(&self) -> Option<String> {
        self.effect
            .as_ref()
            .map(|effect| format!("WITH lapse_effect AS (\n{effect}\n) SELECT 1"))
    }

    /// The action as lapse runs it: every row it returns as one JSON object, so that
    /// the count decides (0, 1, more) and the row goes into the event.
    pub fn wrapped(&self) -> String {
        format!(
            "WITH lapse_action AS (\n{}\n) SELECT to_jsonb(lapse_action) AS row FROM lapse_action",
            self.action
        )
    }
}

/// The configured kinds by name, and the search path their actions run with
/// (`database.shop_search_path`); cheap to clone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Catalog(Arc<(BTreeMap<String, Kind>, String)>);

impl Default for Catalog {
    fn default() -> Self {
        Self::new(
            &Kinds::new(),
            &crate::config::kinds::default_shop_search_path(),
        )
    }
}

impl Catalog {
    pub fn new(kinds: &Kinds, shop_search_path: &str) -> Self {
        let kinds = kinds
            .iter()
            .map(|(name, k)| {
                let kind = Kind {
                    name: name.clone(),
                    key_type: k.key_type,
                    action: crate::config::kinds::statement(&k.action).to_string(),
                    event: k.event.clone(),
                    effect: k
                        .effect
                        .as_deref()
                        .map(|e| crate::config::kinds::statement(e).to_string()),
                };
                (name.clone(), kind)
            })
            .collect();
        Self(Arc::new((kinds, shop_search_path.to_string())))
    }

    pub fn get(&self, name: &str) -> Option<&Kind> {
        self.0.0.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Kind> {
        self.0.0.values()
    }

    pub fn is_empty(&self) -> bool {
        self.0.0.is_empty()
    }

    /// `SET LOCAL search_path` to the shop's schemas (validated names), `pg_temp` last
    /// so that a temporary table never shadows the shop's.
    pub fn shop_path_sql(&self) -> String {
        format!("SET LOCAL search_path = {}, pg_temp", self.0.1)
    }
}

/// A key bound as its kind's SQL type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Key {
    Text(String),
    Bigint(i64),
    Uuid(uuid::Uuid),
}

impl Key {
    /// `key` (as `lapse.deadlines` stores it) as a value of `key_type`.
    pub fn parse(key_type: KeyType, key: &str) -> Result<Self, String> {
        match key_type {
            KeyType::Text => Ok(Key::Text(key.to_string())),
            KeyType::Bigint => key
                .parse()
                .map(Key::Bigint)
                .map_err(|_| format!("key {key:?} is not a bigint")),
            KeyType::Uuid => key
                .parse()
                .map(Key::Uuid)
                .map_err(|_| format!("key {key:?} is not a uuid")),
        }
    }

    pub fn sql_type(key_type: KeyType) -> Type {
        match key_type {
            KeyType::Text => Type::TEXT,
            KeyType::Bigint => Type::INT8,
            KeyType::Uuid => Type::UUID,
        }
    }

    pub fn value(&self) -> &(dyn ToSql + Sync) {
        match self {
            Key::Text(k) => k,
            Key::Bigint(k) => k,
            Key::Uuid(k) => k,
        }
    }
}

/// How far ahead a kind's deadline goes to the broker: the top tier. Further ones wait
/// in the database for the promoter.
pub fn promote_within(config: &crate::config::Config) -> std::time::Duration {
    config
        .tier_file()
        .map(|f| f.tiers.largest().duration())
        .unwrap_or(std::time::Duration::from_secs(3600))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_as_their_type_or_say_why_not() {
        assert_eq!(Key::parse(KeyType::Bigint, "42"), Ok(Key::Bigint(42)));
        assert!(
            Key::parse(KeyType::Bigint, "SO-1")
                .unwrap_err()
                .contains("bigint")
        );
        assert!(
            Key::parse(KeyType::Uuid, "nope")
                .unwrap_err()
                .contains("uuid")
        );
        assert_eq!(
            Key::parse(KeyType::Text, "SO-1"),
            Ok(Key::Text("SO-1".into()))
        );
    }
}

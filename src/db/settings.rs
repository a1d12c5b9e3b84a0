//! What lapse's SQL functions enforce on their own, written from the configuration
//! inside the migrations' transaction: the deadline horizon (`lapse_settings`) and
//! the kinds `lapse.schedule` accepts (`lapse.kinds`).

use std::time::Duration;

use tokio_postgres::types::Type;

use super::{DbError, column};
use crate::kinds::Catalog;

/// What the SQL functions enforce on their own (the one row of `lapse_settings`),
/// written by [`super::migrate_with_settings`] from the configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// How far ahead a deadline may be (`orders.deadline_horizon`).
    pub deadline_horizon: Duration,
    /// `broker.prefix`: the list of order databases is recorded per prefix.
    pub prefix: String,
    /// The kinds `lapse.schedule` accepts (`[kinds]`), recorded in `lapse.kinds`.
    pub kinds: Catalog,
    /// How far ahead a kind's deadline goes to the broker: the top tier. Further ones
    /// wait in the database for the promoter.
    pub promote_within: Duration,
}

impl Settings {
    pub fn from_config(config: &crate::config::Config) -> Self {
        Self {
            deadline_horizon: config.orders.deadline_horizon,
            prefix: config.broker.prefix.clone(),
            kinds: Catalog::new(&config.kinds, &config.database.shop_search_path),
            promote_within: crate::kinds::promote_within(config),
        }
    }
}

/// Writes `settings` into `lapse_settings` and the kinds into `lapse.kinds`.
pub async fn write_settings<C: tokio_postgres::GenericClient>(
    client: &C,
    settings: &Settings,
) -> Result<(), DbError> {
    let horizon_ms = crate::deadline::ceil_millis(settings.deadline_horizon)
        .map_err(|e| DbError::Config(format!("orders.deadline_horizon: {e}")))?;
    client
        .execute_typed(
            "UPDATE lapse_settings
                SET deadline_horizon = justify_hours($1::bigint * interval '1 millisecond')",
            &[(&horizon_ms, tokio_postgres::types::Type::INT8)],
        )
        .await?;
    register_kinds(client, &settings.kinds, settings.promote_within).await?;
    Ok(())
}

/// Records the kinds in `lapse.kinds` with how far ahead their deadlines go to the
/// broker (`promote_within`, the top tier): added or changed, never deleted (the
/// deadlines of a kind taken out of the configuration stay, and are parked as
/// `unknown_kind`).
async fn register_kinds<C: tokio_postgres::GenericClient>(
    client: &C,
    catalog: &Catalog,
    promote_within: Duration,
) -> Result<(), DbError> {
    if catalog.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = catalog.iter().map(|k| k.name.clone()).collect();
    let types: Vec<String> = catalog
        .iter()
        .map(|k| k.key_type.as_str().to_string())
        .collect();
    let within_ms = crate::deadline::saturating_millis(promote_within).max(1);
    // Keys are stored in the canonical form of their type: a kind with deadlines
    // ever recorded keeps its key type.
    let changed = client
        .query_typed(
            "SELECT k.name, k.key_type FROM lapse.kinds k
               JOIN unnest($1::text[], $2::text[]) AS c(name, key_type) ON c.name = k.name
              WHERE c.key_type <> k.key_type
                AND EXISTS (SELECT 1 FROM lapse.deadlines d WHERE d.kind = k.name)",
            &[(&names, Type::TEXT_ARRAY), (&types, Type::TEXT_ARRAY)],
        )
        .await?;
    if let Some(row) = changed.first() {
        let name: String = column(row, "name")?;
        let was: String = column(row, "key_type")?;
        return Err(DbError::Config(format!(
            "kinds.{name}.key_type: the kind has deadlines whose keys are {was}s; its key type \
             cannot change (declare a kind of another name)"
        )));
    }
    client
        .execute_typed(
            "INSERT INTO lapse.kinds (name, key_type, promote_within)
             SELECT k.name, k.key_type, $3::bigint * interval '1 millisecond'
               FROM unnest($1::text[], $2::text[]) AS k(name, key_type)
             ON CONFLICT (name) DO UPDATE
                SET key_type = EXCLUDED.key_type, promote_within = EXCLUDED.promote_within",
            &[
                (&names, Type::TEXT_ARRAY),
                (&types, Type::TEXT_ARRAY),
                (&within_ms, Type::INT8),
            ],
        )
        .await?;
    Ok(())
}

//! What a batch of fired deadlines leaves behind: their state (fired, with what the
//! action returned, or the reason it failed) and the event of each that fired, in two
//! statements; and the per-kind counter.

use std::collections::HashMap;

use tokio_postgres::Transaction;
use tokio_postgres::types::Type;

use super::{DeadlineRow, Verdict};
use crate::db::{self, DbError};
use crate::kinds::Catalog;

/// The deadlines of a batch that fired or failed, written in two statements.
#[derive(Default)]
pub(super) struct Done {
    ids: Vec<i64>,
    versions: Vec<i32>,
    outcomes: Vec<String>,
    rows: Vec<serde_json::Value>,
    failed_ids: Vec<i64>,
    errors: Vec<String>,
}

impl Done {
    pub(super) fn push(
        &mut self,
        id: i64,
        version: i32,
        outcome: &str,
        row: Option<serde_json::Value>,
    ) {
        self.ids.push(id);
        self.versions.push(version);
        self.outcomes.push(outcome.to_string());
        self.rows.push(row.unwrap_or(serde_json::Value::Null));
    }

    pub(super) fn failed(&mut self, id: i64, reason: &str) {
        self.failed_ids.push(id);
        self.errors.push(reason.to_string());
    }

    /// Marks what fired (and writes the events of those whose action changed a row);
    /// records why the others failed.
    pub(super) async fn record(
        self,
        tx: &Transaction<'_>,
        catalog: &Catalog,
    ) -> Result<HashMap<i64, Verdict>, DbError> {
        let (mut kinds, mut exchanges, mut routing_keys) = (Vec::new(), Vec::new(), Vec::new());
        for kind in catalog.iter() {
            if let Some(event) = &kind.event {
                kinds.push(kind.name.clone());
                exchanges.push(event.exchange.clone());
                routing_keys.push(event.routing_key.clone());
            }
        }
        let fired = tx
            .query_typed(
                FIRED_SQL,
                &[
                    (&self.ids, Type::INT8_ARRAY),
                    (&self.outcomes, Type::TEXT_ARRAY),
                    (&self.rows, Type::JSONB_ARRAY),
                    (&kinds, Type::TEXT_ARRAY),
                    (&exchanges, Type::TEXT_ARRAY),
                    (&routing_keys, Type::TEXT_ARRAY),
                    (&self.versions, Type::INT4_ARRAY),
                ],
            )
            .await?;
        let mut verdicts = HashMap::new();
        for row in &fired {
            let id: i64 = db::column(row, "id")?;
            let verdict = match db::column::<String>(row, "outcome")?.as_str() {
                "fired" => Verdict::Fired {
                    expire_at: db::column(row, "expire_at")?,
                    fired_at: db::column(row, "settled_at")?,
                },
                _ => Verdict::Nothing,
            };
            verdicts.insert(id, verdict);
        }
        if !self.failed_ids.is_empty() {
            tx.execute_typed(
                "UPDATE lapse.deadlines d SET last_error = x.error, failed_at = clock_timestamp()
                   FROM unnest($1::bigint[], $2::text[]) AS x(id, error) WHERE d.id = x.id",
                &[
                    (&self.failed_ids, Type::INT8_ARRAY),
                    (&self.errors, Type::TEXT_ARRAY),
                ],
            )
            .await?;
        }
        Ok(verdicts)
    }
}

/// Marks deadlines fired (`outcome` fired or nothing) and writes the event of each one
/// that fired and whose kind has one: `{kind, key, deadline, version, fired_at, row}`.
/// The rows were locked pending by this transaction, so only the action itself changed
/// them meanwhile: a shop trigger that calls `lapse.cancel` when the row leaves its
/// open state is recorded as fired all the same; one that armed the deadline again
/// (a new version) keeps the new version pending.
const FIRED_SQL: &str = "
WITH f AS (
    UPDATE lapse.deadlines d
       SET state = 'fired', outcome = x.outcome, settled_at = clock_timestamp(),
           last_error = NULL, failed_at = NULL
      FROM unnest($1::bigint[], $2::text[], $3::jsonb[], $7::int[]) AS x(id, outcome, r, v)
     WHERE d.id = x.id AND d.version = x.v
    RETURNING d.id, d.kind, d.key, d.version, d.expire_at, d.settled_at, x.outcome, x.r
),
events AS (
    INSERT INTO lapse.kind_outbox (kind, deadline_id, payload)
    SELECT 'event', f.id, jsonb_build_object(
               'exchange', e.exchange, 'routing_key', e.routing_key,
               'body', jsonb_build_object(
                   'kind', f.kind, 'key', f.key, 'version', f.version,
                   'deadline', to_char(f.expire_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'),
                   'fired_at', to_char(f.settled_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'),
                   'row', f.r))
      FROM f JOIN unnest($4::text[], $5::text[], $6::text[]) AS e(kind, exchange, routing_key)
        ON e.kind = f.kind
     WHERE f.outcome = 'fired'
)
SELECT id, outcome, expire_at, settled_at FROM f";

/// `lapse_kind_fires_total` for the actions that ran (counted once the statements of
/// the batch are written; a batch whose commit then fails is counted all the same).
pub(super) fn count(
    rows: &HashMap<i64, Result<DeadlineRow, String>>,
    verdicts: &HashMap<i64, Verdict>,
) {
    for (id, verdict) in verdicts {
        let outcome = match verdict {
            Verdict::Fired { .. } => "fired",
            Verdict::Nothing => "nothing",
            Verdict::Park(_) => "failed",
            Verdict::Locked => continue,
        };
        if let Some(Ok(row)) = rows.get(id) {
            metrics::counter!(
                crate::observe::metric_catalog::KIND_FIRES,
                "kind" => row.kind.clone(),
                "outcome" => outcome
            )
            .increment(1);
        }
    }
}

//! Each kind's pending deadlines as `lapse status` shows them: how many, how many still
//! wait in the database for the promoter, how many are overdue (and the oldest), and
//! how many failed their last firing (parked with `action_failed`).

use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::db::{DbError, column};

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct KindFigures {
    pub kind: String,
    pub pending: i64,
    /// Further away than the top tier: not handed to the broker yet.
    pub in_database: i64,
    pub overdue: i64,
    pub oldest_overdue_ms: Option<f64>,
    /// Whose last firing failed (`lapse.deadlines.last_error`).
    pub failing: i64,
}

/// The pending deadlines of every kind in this database (the partial index of pending
/// deadlines serves it, however many have fired).
/// None before migration V14 (a database an older version migrated).
pub async fn figures<C: GenericClient>(db: &C) -> Result<Vec<KindFigures>, DbError> {
    let migrated: bool = column(
        &db.query_typed_one(
            "SELECT to_regclass('lapse.deadlines') IS NOT NULL AS migrated",
            &[],
        )
        .await?,
        "migrated",
    )?;
    if !migrated {
        return Ok(Vec::new());
    }
    let rows = db
        .query_typed(
            "SELECT kind, count(*) AS pending,
                    count(*) FILTER (WHERE NOT in_tiers) AS in_database,
                    count(*) FILTER (WHERE expire_at <= now()) AS overdue,
                    extract(epoch FROM now() - min(expire_at) FILTER (WHERE expire_at <= now()))::float8 * 1000 AS oldest_ms,
                    count(*) FILTER (WHERE last_error IS NOT NULL) AS failing
               FROM lapse.deadlines WHERE state = 'pending'
              GROUP BY kind ORDER BY kind",
            &[],
        )
        .await?;
    rows.iter()
        .map(|r| {
            Ok(KindFigures {
                kind: column(r, "kind")?,
                pending: column(r, "pending")?,
                in_database: column(r, "in_database")?,
                overdue: column(r, "overdue")?,
                oldest_overdue_ms: column(r, "oldest_ms")?,
                failing: column(r, "failing")?,
            })
        })
        .collect()
}

/// The figures of several databases, added up per kind.
pub fn merge(all: impl IntoIterator<Item = KindFigures>) -> Vec<KindFigures> {
    let mut by_kind: std::collections::BTreeMap<String, KindFigures> = Default::default();
    for f in all {
        let into = by_kind
            .entry(f.kind.clone())
            .or_insert_with(|| KindFigures {
                kind: f.kind.clone(),
                ..Default::default()
            });
        into.pending += f.pending;
        into.in_database += f.in_database;
        into.overdue += f.overdue;
        into.failing += f.failing;
        into.oldest_overdue_ms = match (into.oldest_overdue_ms, f.oldest_overdue_ms) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
    by_kind.into_values().collect()
}

/// The kinds' outbox (`lapse.kind_outbox`): rows waiting, the oldest's age, and how
/// many the broker refused or returned (an event whose exchange is missing); zeros
/// before migration V14.
pub async fn outbox<C: GenericClient>(db: &C) -> Result<(i64, Option<f64>, i64), DbError> {
    let row = db
        .query_typed_one(
            "SELECT to_regclass('lapse.kind_outbox') IS NOT NULL AS migrated",
            &[],
        )
        .await?;
    if !column::<bool>(&row, "migrated")? {
        return Ok((0, None, 0));
    }
    let row = db
        .query_typed_one(
            "SELECT count(*) AS waiting,
                    extract(epoch FROM clock_timestamp() - min(created_at))::float8 * 1000 AS oldest_ms,
                    count(*) FILTER (WHERE attempts > 0) AS retrying
               FROM lapse.kind_outbox",
            &[],
        )
        .await?;
    Ok((
        column(&row, "waiting")?,
        column(&row, "oldest_ms")?,
        column(&row, "retrying")?,
    ))
}

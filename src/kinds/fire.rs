//! Firing the due deadlines of kinds in the worker's transaction: lock the deadline
//! rows still pending, of the message's version and due by the database clock (`SKIP
//! LOCKED`: a deadline another worker is firing is retried, never waited for); run each
//! kind's action inside a savepoint with the key as `$1`; mark what fired and write
//! its event to the outbox in the same transaction.
//!
//! One deadline's verdict never decides another's: an action that fails, or changes
//! more than one row, is rolled back to its savepoint and parks only its own delivery;
//! an action that waits for a row lock the shop holds gives up after
//! [`ACTION_LOCK_WAIT`] and is retried after `worker.lock_retry`.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::Transaction;
use tokio_postgres::types::Type;

use super::{Catalog, Key};
use record::{Done, count};

mod record;
use crate::db::{self, DbError};
use crate::deadline;

/// How long a kind's action waits for a row lock before its deadline is retried later
/// (the shop's own transaction holds the row, e.g. a payment in progress): the rest of
/// the batch does not wait behind it.
pub const ACTION_LOCK_WAIT: Duration = Duration::from_millis(50);

/// A deadline as the decision sees it. `expire_at` is an error (the reason) when it
/// cannot be decoded.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadlineRow {
    pub kind: String,
    pub key: String,
    pub state: String,
    pub version: i32,
    pub expire_at: Result<DateTime<Utc>, String>,
}

/// Reads the deadlines `ids`.
pub async fn read(
    tx: &Transaction<'_>,
    ids: &[i64],
) -> Result<HashMap<i64, Result<DeadlineRow, String>>, DbError> {
    let rows = tx
        .query_typed(
            "SELECT id, kind, key, state, version, expire_at, expire_at::text AS raw
               FROM lapse.deadlines WHERE id = ANY($1)",
            &[(&ids, Type::INT8_ARRAY)],
        )
        .await?;
    let mut read = HashMap::new();
    for row in &rows {
        let id: i64 = db::column(row, "id")?;
        let fields = || -> Result<DeadlineRow, DbError> {
            let expire_at = db::column(row, "expire_at")
                .map_err(|e| e.to_string())
                .and_then(|t| deadline::checked(t).map_err(|e| e.to_string()))
                .map_err(|e| {
                    let raw: String = db::column(row, "raw").unwrap_or_else(|_| "?".into());
                    format!("deadline {id} has an instant lapse cannot handle ({raw}): {e}")
                });
            Ok(DeadlineRow {
                kind: db::column(row, "kind")?,
                key: db::column(row, "key")?,
                state: db::column(row, "state")?,
                version: db::column(row, "version")?,
                expire_at,
            })
        };
        read.insert(id, fields().map_err(|e| format!("deadline {id}: {e}")));
    }
    Ok(read)
}

/// A deadline to fire: its id and the version its message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Due {
    pub id: i64,
    pub version: i32,
}

/// What firing one deadline did.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// The action changed its row; the event (if any) is in the outbox.
    Fired {
        expire_at: DateTime<Utc>,
        fired_at: DateTime<Utc>,
    },
    /// The action changed no row (the shop settled it meanwhile): done, no event.
    Nothing,
    /// Its deadline row, or a row the action needs, is locked by another transaction:
    /// decide again shortly.
    Locked,
    /// The action failed or changed more than one row: rolled back; park with this
    /// reason (the deadline stays pending).
    Park(String),
}

/// Fires every deadline of `due` whose row is still pending, of that version and due
/// by the database clock, in `tx`. One that could not be locked as such (another
/// transaction holds it, or it was settled or moved since it was read) is `Locked`:
/// decided again shortly, when the read shows what became of it. `lock_timeout` is the transaction's
/// own bound, put back after the actions ran.
pub async fn fire(
    tx: &Transaction<'_>,
    catalog: &Catalog,
    rows: &HashMap<i64, Result<DeadlineRow, String>>,
    due: &[Due],
    lock_timeout: Duration,
) -> Result<HashMap<i64, Verdict>, DbError> {
    let wanted: BTreeMap<i64, i32> = due.iter().map(|d| (d.id, d.version)).collect();
    let ids: Vec<i64> = wanted.keys().copied().collect();
    let versions: Vec<i32> = wanted.values().copied().collect();
    let locked_rows = tx
        .query_typed(
            "SELECT d.id FROM lapse.deadlines d
               JOIN unnest($1::bigint[], $2::int[]) AS x(id, v) ON d.id = x.id
              WHERE d.state = 'pending' AND d.version = x.v AND d.expire_at <= now()
              ORDER BY d.id FOR UPDATE OF d SKIP LOCKED",
            &[(&ids, Type::INT8_ARRAY), (&versions, Type::INT4_ARRAY)],
        )
        .await?;
    let mine: Vec<i64> = locked_rows
        .iter()
        .map(|r| db::column(r, "id"))
        .collect::<Result<_, _>>()?;
    let mut verdicts: HashMap<i64, Verdict> = ids
        .iter()
        .filter(|id| !mine.contains(id))
        .map(|id| (*id, Verdict::Locked))
        .collect();
    if mine.is_empty() {
        return Ok(verdicts);
    }
    set_lock_timeout(tx, ACTION_LOCK_WAIT).await?;
    let mut done = Done::default();
    for id in mine {
        let Some(Ok(row)) = rows.get(&id) else {
            continue;
        };
        let verdict = run_action(tx, catalog, row).await?;
        match &verdict {
            Outcome::Fired(json) => done.push(id, row.version, "fired", Some(json.clone())),
            Outcome::Nothing => done.push(id, row.version, "nothing", None),
            Outcome::Locked => {
                verdicts.insert(id, Verdict::Locked);
            }
            Outcome::Failed(reason) => {
                done.failed(id, reason);
                verdicts.insert(id, Verdict::Park(reason.clone()));
            }
        }
    }
    set_lock_timeout(tx, lock_timeout).await?;
    tx.batch_execute(&format!("SET LOCAL search_path = {}", db::SEARCH_PATH))
        .await?;
    verdicts.extend(done.record(tx, catalog).await?);
    count(rows, &verdicts);
    Ok(verdicts)
}

async fn set_lock_timeout(tx: &Transaction<'_>, wait: Duration) -> Result<(), DbError> {
    let ms = wait.as_millis().clamp(1, i32::MAX.unsigned_abs().into());
    tx.batch_execute(&format!("SET LOCAL lock_timeout = {ms}"))
        .await?;
    Ok(())
}

/// Which of a kind's statements failed.
enum Failure {
    Action(tokio_postgres::Error),
    Effect(tokio_postgres::Error),
}

impl Failure {
    fn error(&self) -> &tokio_postgres::Error {
        match self {
            Failure::Action(e) | Failure::Effect(e) => e,
        }
    }

    fn into_error(self) -> tokio_postgres::Error {
        match self {
            Failure::Action(e) | Failure::Effect(e) => e,
        }
    }

    fn part(&self) -> &'static str {
        match self {
            Failure::Action(_) => "action",
            Failure::Effect(_) => "effect",
        }
    }
}

enum Outcome {
    Fired(serde_json::Value),
    Nothing,
    Locked,
    Failed(String),
}

/// Runs one deadline's action in a savepoint. An error that ends the transaction
/// (the connection lost) is returned; the action's own errors become a verdict.
async fn run_action(
    tx: &Transaction<'_>,
    catalog: &Catalog,
    row: &DeadlineRow,
) -> Result<Outcome, DbError> {
    let what = format!("kind {} key {:?}", row.kind, row.key);
    let Some(kind) = catalog.get(&row.kind) else {
        return Ok(Outcome::Failed(format!(
            "{what}: unknown kind (not under [kinds] of this worker's configuration)"
        )));
    };
    let key = match Key::parse(kind.key_type, &row.key) {
        Ok(key) => key,
        Err(e) => return Ok(Outcome::Failed(format!("{what}: {e}"))),
    };
    // The shop's statement sees the shop's schemas (`database.shop_search_path`), set
    // again for every action: one that changed it must not steer the next.
    tx.batch_execute(&format!(
        "SAVEPOINT lapse_action; {}",
        catalog.shop_path_sql()
    ))
    .await?;
    let ran = tx
        .query_typed(
            &kind.wrapped(),
            &[(key.value(), Key::sql_type(kind.key_type))],
        )
        .await;
    // Deferred constraints of the shop's (a deferrable foreign key, a constraint
    // trigger) are checked here, inside the savepoint, not at the batch's commit where
    // they would roll back every other deadline and close with it.
    // A fired action's effect in the same database runs in the same savepoint: both
    // or neither.
    let effect = kind.wrapped_effect();
    let ran = match (ran, &effect) {
        (Ok(rows), Some(effect)) if rows.len() == 1 => tx
            .execute_typed(effect, &[(key.value(), Key::sql_type(kind.key_type))])
            .await
            .map(|_| rows)
            .map_err(Failure::Effect),
        (ran, _) => ran.map_err(Failure::Action),
    };
    // A deferred constraint that fails now was broken by the effect when one ran.
    let ran = match ran {
        Ok(rows) if rows.len() <= 1 => {
            let effect_ran = effect.is_some() && rows.len() == 1;
            tx.batch_execute("SET CONSTRAINTS ALL IMMEDIATE")
                .await
                .map(|()| rows)
                .map_err(|e| {
                    if effect_ran {
                        Failure::Effect(e)
                    } else {
                        Failure::Action(e)
                    }
                })
        }
        other => other,
    };
    let outcome = match ran {
        Ok(rows) if rows.len() <= 1 => {
            tx.batch_execute("RELEASE SAVEPOINT lapse_action").await?;
            return Ok(match rows.first() {
                None => Outcome::Nothing,
                Some(r) => Outcome::Fired(db::column(r, "row")?),
            });
        }
        Ok(rows) => Outcome::Failed(format!(
            "{what}: the action changed {} rows (at most 1 expected); rolled back",
            rows.len()
        )),
        Err(failure) if failure.error().is_closed() || failure.error().code().is_none() => {
            return Err(failure.into_error().into());
        }
        Err(failure) => {
            let part = failure.part();
            let e = failure.into_error();
            let code = e.code().map(|c| c.code()).unwrap_or_default();
            // A lock the shop holds, or a race lost: try again shortly. A statement
            // timeout is the action's own slowness: parked, with the reason.
            if matches!(code, "55P03" | "40P01" | "40001") {
                Outcome::Locked
            } else {
                Outcome::Failed(format!(
                    "{what}: the {part} failed: {}",
                    DbError::from(e).detail()
                ))
            }
        }
    };
    tx.batch_execute("ROLLBACK TO SAVEPOINT lapse_action; RELEASE SAVEPOINT lapse_action")
        .await?;
    Ok(outcome)
}

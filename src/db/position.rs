//! A database's position in the list of order databases (`database.shards[i]`; 0 for
//! a lone `database.url`), recorded in `lapse_settings.shard_position` by its first
//! migration and compared with the configuration by every later migration and by a
//! worker's start. Timeout messages name their shard by that position, so a reordered
//! list would make them name the wrong database.

use super::{DbError, LOGIN_TIMEOUT, bounded_config, bounded_connect, column};
use crate::config::Secret;
use tokio_postgres::types::Type;

/// Whether a database has lapse's schema, and the position recorded in it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchemaState {
    pub schema: bool,
    /// `None` where nothing is recorded: no schema, a schema migrated only by versions
    /// that did not record positions, or no row in `lapse_settings`.
    pub position: Option<i32>,
}

/// Reads the schema state on `client`, changing nothing.
pub async fn schema_state<C: tokio_postgres::GenericClient>(
    client: &C,
) -> Result<SchemaState, DbError> {
    let row = client
        .query_typed_one(
            "SELECT to_regclass('lapse_settings') IS NOT NULL AS has_schema",
            &[],
        )
        .await?;
    if !column::<bool>(&row, "has_schema")? {
        return Ok(SchemaState::default());
    }
    // Through to_jsonb: the column does not exist before this version's migrations.
    let row = client
        .query_typed_opt(
            "SELECT (to_jsonb(s) ->> 'shard_position')::int AS recorded FROM lapse_settings s",
            &[],
        )
        .await?;
    let position = match row {
        Some(row) => column::<Option<i32>>(&row, "recorded")?,
        None => None,
    };
    Ok(SchemaState {
        schema: true,
        position,
    })
}

/// The position recorded in the database at `url` (read-only, connect and login
/// bounded, the questions bounded by the login timeout).
pub async fn recorded_position(url: &Secret) -> Result<Option<i32>, DbError> {
    let (mut client, connection) = bounded_connect(&bounded_config(url)?).await?;
    let driver = tokio::spawn(connection);
    let state = tokio::time::timeout(LOGIN_TIMEOUT, async {
        let tx = super::begin_plain(&mut client).await?;
        schema_state(&tx).await
    })
    .await
    .unwrap_or(Err(DbError::NoAnswer {
        step: "answer whether its position is recorded",
        after: LOGIN_TIMEOUT,
    }));
    drop(client);
    match state {
        Ok(state) => {
            let _ = driver.await;
            Ok(state.position)
        }
        // A question still unanswered would keep the connection waiting for it.
        Err(e) => {
            driver.abort();
            Err(e)
        }
    }
}

/// Records `position` unless one is recorded already, and checks the one recorded.
pub(super) async fn record<C: tokio_postgres::GenericClient>(
    client: &C,
    position: u16,
) -> Result<(), DbError> {
    let row = client
        .query_typed_opt(
            "UPDATE lapse_settings SET shard_position = coalesce(shard_position, $1)
             RETURNING shard_position",
            &[(&i32::from(position), Type::INT4)],
        )
        .await?
        .ok_or_else(|| {
            DbError::Unreadable(
                "lapse_settings holds no row (lapse keeps its settings in its one row): \
                 restore it with `INSERT INTO lapse_settings DEFAULT VALUES`, then run \
                 `lapse migrate` again; the row gets a new database identity, so clear the \
                 other databases' record of the list first (docs/scaling.md)"
                    .into(),
            )
        })?;
    check(column(&row, "shard_position")?, position)
}

/// [`DbError::ShardMoved`] when a position is recorded and is not `position`.
pub fn check(recorded: Option<i32>, position: u16) -> Result<(), DbError> {
    match recorded {
        Some(recorded) if recorded != i32::from(position) => {
            Err(DbError::ShardMoved { recorded, position })
        }
        _ => Ok(()),
    }
}

/// What one database says of the list of order databases it belongs to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Membership {
    /// Its identity; `None` before this version's migrations.
    pub id: Option<String>,
    /// The identities of the list it was migrated in, for one prefix; `None` when none
    /// is recorded.
    pub list: Option<Vec<String>>,
}

/// Reads `prefix`'s membership on `client`, changing nothing (through `to_jsonb`: the
/// columns do not exist before this version's migrations).
pub async fn membership<C: tokio_postgres::GenericClient>(
    client: &C,
    prefix: &str,
) -> Result<Membership, DbError> {
    let row = client
        .query_typed_opt(
            "SELECT to_jsonb(s) ->> 'database_id' AS id,
                    to_jsonb(s) -> 'shard_lists' -> $1 AS list
               FROM lapse_settings s",
            &[(&prefix, Type::TEXT)],
        )
        .await?;
    let Some(row) = row else {
        return Ok(Membership::default());
    };
    let list: Option<serde_json::Value> = column(&row, "list")?;
    let list = match list {
        None => None,
        Some(value) => Some(serde_json::from_value(value).map_err(|e| {
            DbError::Unreadable(format!("lapse_settings.shard_lists for {prefix:?}: {e}"))
        })?),
    };
    Ok(Membership {
        id: column(&row, "id")?,
        list,
    })
}

/// Checks the configured list (each entry's identity, `None` where unknown: a database
/// that did not answer or is not migrated yet) against the list each entry recorded:
/// at every position both know, they must name the same database. A recorded list
/// may be shorter (the list grew at its end) or longer (this configuration names only
/// its beginning). Returns the first disagreement as `(shard, position)`.
pub fn check_list(
    configured: &[Option<String>],
    recorded: &[Option<Vec<String>>],
) -> Result<(), (usize, usize)> {
    for (shard, list) in recorded.iter().enumerate() {
        let Some(list) = list else { continue };
        for (position, (theirs, ours)) in list.iter().zip(configured).enumerate() {
            if ours.as_ref().is_some_and(|ours| ours != theirs) {
                return Err((shard, position));
            }
        }
    }
    Ok(())
}

/// The list to record in a database: the configured one, unless the database recorded
/// a longer one that agrees with it (this configuration names only its beginning).
pub fn list_to_record(configured: &[String], recorded: Option<&Vec<String>>) -> Vec<String> {
    match recorded {
        Some(recorded) if recorded.len() > configured.len() => recorded.clone(),
        _ => configured.to_vec(),
    }
}

/// `prefix`'s membership as the database at `url` records it (read-only, connect and
/// login bounded, the question bounded by the login timeout).
pub async fn read_membership(url: &Secret, prefix: &str) -> Result<Membership, DbError> {
    let (mut client, connection) = bounded_connect(&bounded_config(url)?).await?;
    let driver = tokio::spawn(connection);
    let answer = tokio::time::timeout(LOGIN_TIMEOUT, async {
        let tx = super::begin_plain(&mut client).await?;
        let state = schema_state(&tx).await?;
        if !state.schema {
            return Ok(Membership::default());
        }
        membership(&tx, prefix).await
    })
    .await
    .unwrap_or(Err(DbError::NoAnswer {
        step: "answer which list of databases it belongs to",
        after: LOGIN_TIMEOUT,
    }));
    drop(client);
    if answer.is_ok() {
        let _ = driver.await;
    } else {
        driver.abort();
    }
    answer
}

/// [`record_list`] on the database at `url`.
pub async fn record_list_at(
    url: &Secret,
    prefix: &str,
    read: Option<&Vec<String>>,
    list: &[String],
) -> Result<(), DbError> {
    let (mut client, connection) = bounded_connect(&bounded_config(url)?).await?;
    let driver = tokio::spawn(connection);
    let done = tokio::time::timeout(LOGIN_TIMEOUT, async {
        let tx = super::begin_plain(&mut client).await?;
        record_list(&tx, prefix, read, list).await?;
        tx.commit().await?;
        Ok(())
    })
    .await
    .unwrap_or(Err(DbError::NoAnswer {
        step: "record its list of databases",
        after: LOGIN_TIMEOUT,
    }));
    drop(client);
    if done.is_ok() {
        let _ = driver.await;
    } else {
        driver.abort();
    }
    done
}

/// Records `list` as `prefix`'s list in the database `client` is connected to, if
/// the record is still `read` (what the check saw) or already `list`: two migrations
/// with different lists, each checked before the other wrote, cannot both record
/// theirs, while two with the same list (two `lapse migrate` at once) both succeed.
pub async fn record_list<C: tokio_postgres::GenericClient>(
    client: &C,
    prefix: &str,
    read: Option<&Vec<String>>,
    list: &[String],
) -> Result<(), DbError> {
    let value = serde_json::to_value(list).expect("a list of strings serialises");
    let read = read.map(|r| serde_json::to_value(r).expect("a list of strings serialises"));
    let written = client
        .execute_typed(
            "UPDATE lapse_settings
                SET shard_lists = jsonb_set(shard_lists, ARRAY[$1::text], $2::jsonb)
              WHERE (shard_lists -> $1::text) IS NOT DISTINCT FROM $3::jsonb
                 OR (shard_lists -> $1::text) = $2::jsonb",
            &[
                (&prefix, Type::TEXT),
                (&value, Type::JSONB),
                (&read, Type::JSONB),
            ],
        )
        .await?;
    if written == 0 {
        return Err(DbError::Refused(format!(
            "the list of order databases recorded for broker.prefix {prefix:?} changed while \
             this one was checked (another migration or worker start): run it again"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_that_disagrees_at_a_known_position_is_refused() {
        let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let some = |v: &[&str]| v.iter().map(|s| Some(s.to_string())).collect::<Vec<_>>();
        // Nothing recorded, or the same list: fine.
        assert_eq!(check_list(&some(&["x", "y"]), &[None, None]), Ok(()));
        let xy = Some(ids(&["x", "y"]));
        assert_eq!(
            check_list(&some(&["x", "y"]), &[xy.clone(), xy.clone()]),
            Ok(())
        );
        // Grown at its end, or only its beginning configured: fine.
        assert_eq!(
            check_list(&some(&["x", "y", "w"]), &[xy.clone(), xy.clone(), None]),
            Ok(())
        );
        assert_eq!(check_list(&some(&["x"]), std::slice::from_ref(&xy)), Ok(()));
        // Another deployment's list [x, z] where x recorded [x, y]: shard 0, position 1.
        assert_eq!(
            check_list(&some(&["x", "z"]), &[xy.clone(), None]),
            Err((0, 1))
        );
        // An unknown entry is not judged.
        assert_eq!(
            check_list(&[Some("x".into()), None], &[xy.clone(), None]),
            Ok(())
        );
        // Reordered.
        assert_eq!(
            check_list(&some(&["y", "x"]), &[xy.clone(), xy.clone()]),
            Err((0, 0))
        );
        assert_eq!(list_to_record(&ids(&["x"]), xy.as_ref()), ids(&["x", "y"]));
        assert_eq!(
            list_to_record(&ids(&["x", "y", "w"]), xy.as_ref()),
            ids(&["x", "y", "w"])
        );
        assert_eq!(list_to_record(&ids(&["x"]), None), ids(&["x"]));
    }

    #[test]
    fn only_a_different_recorded_position_is_refused() {
        assert!(check(None, 3).is_ok(), "nothing recorded yet");
        assert!(check(Some(3), 3).is_ok());
        let e = check(Some(1), 0).unwrap_err();
        assert!(matches!(
            e,
            DbError::ShardMoved {
                recorded: 1,
                position: 0
            }
        ));
        let text = e.to_string();
        assert!(
            text.contains("first migrated as shard 1 (database.shards[1])")
                && text.contains("makes it shard 0"),
            "{text}"
        );
    }

    #[test]
    fn the_rest_of_a_moved_list_names_what_moved() {
        let one = DbError::ListMoved { moved: vec![2] }.to_string();
        assert!(
            one.contains("database.shards[2] of the same list is not where it was first migrated"),
            "{one}"
        );
        let two = DbError::ListMoved { moved: vec![0, 1] }.to_string();
        assert!(
            two.contains("database.shards[0], database.shards[1] of the same list are not where they were first migrated"),
            "{two}"
        );
    }
}

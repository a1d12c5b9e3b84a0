//! A database's position in the list of order databases (`database.shards[i]`; 0 for
//! a lone `database.url`), recorded in `lapse_settings.shard_position` by its first
//! migration and compared with the configuration by every later migration and by a
//! worker's start. Timeout messages name their shard by that position, so a reordered
//! list would make them name the wrong database.

use super::{DbError, LOGIN_TIMEOUT, bounded_config, bounded_connect, column};
use crate::config::Secret;

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
        .query_one(
            "SELECT to_regclass('lapse_settings') IS NOT NULL AS has_schema",
            &[],
        )
        .await?;
    if !column::<bool>(&row, "has_schema")? {
        return Ok(SchemaState::default());
    }
    // Through to_jsonb: the column does not exist before this version's migrations.
    let row = client
        .query_opt(
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
    let (client, connection) = bounded_connect(&bounded_config(url)?).await?;
    let driver = tokio::spawn(connection);
    let state = tokio::time::timeout(LOGIN_TIMEOUT, schema_state(&client))
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
        .query_opt(
            "UPDATE lapse_settings SET shard_position = coalesce(shard_position, $1)
             RETURNING shard_position",
            &[&i32::from(position)],
        )
        .await?
        .ok_or_else(|| {
            DbError::Unreadable(
                "lapse_settings holds no row (lapse keeps its settings in its one row): \
                 restore it with `INSERT INTO lapse_settings DEFAULT VALUES`, then run \
                 `lapse migrate` again"
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

#[cfg(test)]
mod tests {
    use super::*;

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

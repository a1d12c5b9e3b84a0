//! Checks every kind against the live database before anything runs it (`lapse kinds
//! check`, and a starting worker): the action prepares, takes exactly one parameter —
//! the key, bindable as the kind's key type — and returns named columns. Nothing is
//! executed: the statements are only prepared, in a transaction that is rolled back.

use tokio_postgres::types::Type;

use super::{Catalog, Key, Kind};
use crate::db::DbError;

/// What is wrong with one kind, naming the key to fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("kinds.{kind}.{field}: {problem}")]
pub struct Problem {
    pub kind: String,
    pub field: &'static str,
    pub problem: String,
}

/// What a kind's action returns, once checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checked {
    pub kind: String,
    pub columns: Vec<String>,
}

/// Checks every kind of `catalog` on `client`; one result per kind, in name order. An
/// error of the connection itself is returned as such.
pub async fn check(
    client: &mut tokio_postgres::Client,
    catalog: &Catalog,
) -> Result<Vec<Result<Checked, Problem>>, DbError> {
    let tx = client.transaction().await?;
    // Prepared as they run: with the shop's schemas on the search path.
    tx.batch_execute(&catalog.shop_path_sql()).await?;
    let mut results = Vec::new();
    for kind in catalog.iter() {
        tx.batch_execute("SAVEPOINT lapse_check").await?;
        let result = check_one(&tx, kind).await;
        tx.batch_execute("ROLLBACK TO SAVEPOINT lapse_check")
            .await?;
        results.push(result?);
    }
    tx.rollback().await?;
    Ok(results)
}

async fn check_one(
    tx: &tokio_postgres::Transaction<'_>,
    kind: &Kind,
) -> Result<Result<Checked, Problem>, DbError> {
    let problem = |problem: String| {
        Ok(Err(Problem {
            kind: kind.name.clone(),
            field: "action",
            problem,
        }))
    };
    let plain = match tx.prepare(&kind.action).await {
        Ok(statement) => statement,
        Err(e) if e.code().is_some() => {
            return problem(format!("does not prepare: {}", DbError::from(e).detail()));
        }
        Err(e) => return Err(e.into()),
    };
    match plain.params() {
        [_] => {}
        [] => return problem("does not use $1 (the deadline's key)".into()),
        more => {
            return problem(format!(
                "takes {} parameters; an action takes exactly one, the key as $1",
                more.len()
            ));
        }
    }
    let inferred = plain.params()[0].clone();
    let columns: Vec<String> = plain
        .columns()
        .iter()
        .map(|c| c.name().to_string())
        .collect();
    if columns.is_empty() {
        return problem(
            "returns no columns: end it with RETURNING (the row goes into the event, and \
             the number of rows says whether it fired)"
                .into(),
        );
    }
    if let Some(bad) = columns.iter().find(|c| c.as_str() == "?column?") {
        return problem(format!(
            "returns a column without a name ({bad}): name it with AS"
        ));
    }
    let mut sorted = columns.clone();
    sorted.sort();
    if let Some(twice) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return problem(format!("returns the column {} twice", twice[0]));
    }
    let wanted = Key::sql_type(kind.key_type);
    if let Err(e) = tx
        .prepare_typed(&kind.action, std::slice::from_ref(&wanted))
        .await
    {
        if e.code().is_none() {
            return Err(e.into());
        }
        return Ok(Err(Problem {
            kind: kind.name.clone(),
            field: "key_type",
            problem: format!(
                "is {}, but the action does not take $1 as {} (it reads $1 as {}): {}",
                kind.key_type,
                wanted,
                type_name(&inferred),
                DbError::from(e).detail()
            ),
        }));
    }
    // lapse runs it inside a WITH, to count and return its rows.
    if let Err(e) = tx
        .prepare_typed(&kind.wrapped(), std::slice::from_ref(&wanted))
        .await
    {
        if e.code().is_none() {
            return Err(e.into());
        }
        return problem(format!(
            "cannot run as a data-modifying WITH query (WITH x AS (<action>) SELECT ...): {}",
            DbError::from(e).detail()
        ));
    }
    if let Err(problem) = check_effect(tx, kind, &wanted).await? {
        return Ok(Err(problem));
    }
    Ok(Ok(Checked {
        kind: kind.name.clone(),
        columns,
    }))
}

/// The effect prepares as lapse runs it (inside a WITH: a data statement), with at
/// most one parameter, the key as the kind's type.
async fn check_effect(
    tx: &tokio_postgres::Transaction<'_>,
    kind: &Kind,
    wanted: &Type,
) -> Result<Result<(), Problem>, DbError> {
    let problem = |problem: String| {
        Ok(Err(Problem {
            kind: kind.name.clone(),
            field: "effect",
            problem,
        }))
    };
    let Some(wrapped) = kind.wrapped_effect() else {
        return Ok(Ok(()));
    };
    match tx
        .prepare_typed(&wrapped, std::slice::from_ref(wanted))
        .await
    {
        Ok(typed) if typed.params().len() > 1 => problem(format!(
            "takes {} parameters; an effect takes at most one, the key as $1",
            typed.params().len()
        )),
        Ok(_) => Ok(Ok(())),
        Err(e) if e.code().is_some() => problem(format!(
            "does not prepare as one data statement (INSERT, UPDATE, DELETE) with $1 as {wanted}: {}",
            DbError::from(e).detail()
        )),
        Err(e) => Err(e.into()),
    }
}

fn type_name(t: &Type) -> String {
    t.name().to_string()
}

/// Checks the kinds on the database at `url` (one connection of its own, bounded like
/// a migration's): the first problem, if any.
pub async fn first_problem(
    url: &crate::config::Secret,
    catalog: &Catalog,
) -> Result<Option<Problem>, DbError> {
    if catalog.is_empty() {
        return Ok(None);
    }
    let target = crate::db::bounded_config(url)?;
    let (mut client, connection) = crate::db::bounded_connect(&target).await?;
    let driver = tokio::spawn(connection);
    let results = check(&mut client, catalog).await;
    drop(client);
    let _ = driver.await;
    Ok(results?.into_iter().find_map(Result::err))
}

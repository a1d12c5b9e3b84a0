//! Replaying and purging rows of the parked book.
//!
//! A replay takes the selected rows that exist when it starts, 100 at a time: it claims
//! a chunk (a short transaction; its token and a time limit on the rows), publishes each
//! row to its destination with a confirm, then deletes the rows confirmed and frees the
//! others — under its own token, so a row another replay claimed since is left to it. No
//! transaction stays open while the broker is asked. On an error after a claim the
//! chunk is freed at once; a replay that dies leaves its rows claimed until the time
//! passes ([`book::claim_for`]). Rows another replay holds are reported, not skipped in
//! silence. A purge deletes the selected rows no replay holds and reports the others.

use std::collections::BTreeSet;

use lapin::Connection;

use super::book::{self, Claim};
use super::{Entry, Item, Outcome, ParkedError, Router, Row, Selection};
use crate::amqp::broker::{BrokerError, Publisher};
use crate::db::{DbError, Pool};

/// Rows published per batch of confirms.
const CHUNK: i64 = 100;

/// What a replay did; `stalled` when the broker stopped confirming part-way (a
/// resource alarm): the rows not confirmed stay, each item says what happened.
#[derive(Debug)]
pub struct Replayed {
    pub items: Vec<Item>,
    pub stalled: Option<String>,
}

/// Replays the selected rows (or, with `dry_run`, says where each would go).
#[allow(clippy::too_many_arguments)]
pub async fn replay(
    conn: &Connection,
    pool: &Pool,
    router: &Router,
    prefix: &str,
    selection: &Selection,
    dry_run: bool,
    confirm_timeout: std::time::Duration,
) -> Result<Replayed, ParkedError> {
    let publisher = Publisher::new(conn)
        .await?
        .with_confirm_timeout(confirm_timeout);
    let claim = Claim::new(confirm_timeout);
    let upto = book::last_seq(pool, prefix).await?;
    let mut items: Vec<Item> = book::held(pool, prefix, selection, upto)
        .await?
        .into_iter()
        .map(held)
        .collect();
    let mut after = 0;
    loop {
        let chunk =
            book::claim(pool, prefix, selection, after, upto, CHUNK, &claim, dry_run).await?;
        let Some(last) = chunk.last() else { break };
        after = last.seq;
        match publish(conn, &publisher, router, &chunk, dry_run).await {
            Ok(done) => {
                if !dry_run {
                    book::settle(pool, &claim, &done.replayed, &done.kept).await?;
                }
                items.extend(done.items);
                if done.stalled.is_some() {
                    return Ok(Replayed {
                        items,
                        stalled: done.stalled,
                    });
                }
            }
            Err(e) => {
                if !dry_run {
                    let all: Vec<i64> = chunk.iter().map(|r| r.seq).collect();
                    // Best effort: if this fails too, the claim passes on its own.
                    let _ = book::settle(pool, &claim, &[], &all).await;
                }
                return Err(e);
            }
        }
    }
    Ok(Replayed {
        items,
        stalled: None,
    })
}

/// One chunk's publishes and what became of each row.
struct Chunk {
    items: Vec<Item>,
    replayed: Vec<i64>,
    kept: Vec<i64>,
    stalled: Option<String>,
}

async fn publish(
    conn: &Connection,
    publisher: &Publisher,
    router: &Router,
    rows: &[Row],
    dry_run: bool,
) -> Result<Chunk, ParkedError> {
    let entries: Vec<&Entry> = rows.iter().map(|r| &r.entry).collect();
    let targets = router.targets(conn, &entries).await?;
    let mut outgoing = Vec::new();
    let mut planned = Vec::with_capacity(rows.len());
    for (row, target) in rows.iter().zip(targets) {
        planned.push(match target {
            Ok(target) if dry_run => (row, Outcome::WouldReplay { to: target.to() }),
            Ok(target) => {
                let to = target.to();
                outgoing.push(target.outgoing());
                (row, Outcome::Replayed { to })
            }
            Err(error) => (row, Outcome::Failed { error }),
        });
    }
    let results = publisher.publish_all(outgoing).await;
    // No confirm (a broker alarm blocks publishing): what was confirmed is done, the
    // rest stays, and the replay stops after this chunk.
    let stalled = results.iter().find_map(|r| match r {
        Err(e @ (BrokerError::ConfirmTimeout { .. } | BrokerError::Blocked { .. })) => {
            Some(e.to_string())
        }
        _ => None,
    });
    let mut results = results.into_iter();
    let mut chunk = Chunk {
        items: Vec::with_capacity(rows.len()),
        replayed: Vec::new(),
        kept: Vec::new(),
        stalled,
    };
    for (row, outcome) in planned {
        let outcome = match outcome {
            Outcome::Replayed { to } => {
                match results.next().unwrap_or(Err(BrokerError::ConnectionLost)) {
                    Ok(()) => Outcome::Replayed { to },
                    Err(e) => Outcome::Failed {
                        error: format!("not replayed to {to}: {e}"),
                    },
                }
            }
            other => other,
        };
        match outcome {
            Outcome::Replayed { .. } => chunk.replayed.push(row.seq),
            _ => chunk.kept.push(row.seq),
        }
        chunk.items.push(Item {
            row: row.clone(),
            outcome,
        });
    }
    Ok(chunk)
}

/// A row another replay holds, reported as not done by this command.
fn held(row: Row) -> Item {
    let until = row
        .claimed_until
        .map(super::rfc3339)
        .unwrap_or_else(|| "-".into());
    Item {
        row,
        outcome: Outcome::Failed {
            error: format!(
                "held by another replay until {until}; try again after that if it is still listed"
            ),
        },
    }
}

/// Deletes the selected rows no replay holds (or, with `dry_run`, only lists them);
/// the held ones are reported as not purged.
pub async fn purge(
    pool: &Pool,
    prefix: &str,
    selection: &Selection,
    dry_run: bool,
) -> Result<Vec<Item>, ParkedError> {
    purge_where(pool, prefix, selection, dry_run, |_| true).await
}

/// Deletes exactly the rows `seqs` among the selected (what an operator confirmed),
/// not rows that arrived since.
pub async fn purge_rows(
    pool: &Pool,
    prefix: &str,
    selection: &Selection,
    seqs: &BTreeSet<i64>,
) -> Result<Vec<Item>, ParkedError> {
    purge_where(pool, prefix, selection, false, |r| seqs.contains(&r.seq)).await
}

async fn purge_where(
    pool: &Pool,
    prefix: &str,
    selection: &Selection,
    dry_run: bool,
    chosen: impl Fn(&Row) -> bool,
) -> Result<Vec<Item>, ParkedError> {
    let upto = book::last_seq(pool, prefix).await?;
    let mut items: Vec<Item> = book::held(pool, prefix, selection, upto)
        .await?
        .into_iter()
        .filter(|r| chosen(r))
        .map(held)
        .collect();
    let mut client = pool.get().await.map_err(DbError::from)?;
    let tx = crate::db::begin(&mut client, pool.limits()).await?;
    let rows: Vec<Row> = book::select_for_update(&tx, prefix, selection)
        .await?
        .into_iter()
        .filter(|r| chosen(r))
        .collect();
    let outcome = if dry_run {
        Outcome::Kept
    } else {
        let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
        book::delete(&tx, &seqs).await?;
        Outcome::Purged
    };
    tx.commit().await.map_err(DbError::from)?;
    items.extend(rows.into_iter().map(|row| Item {
        row,
        outcome: outcome.clone(),
    }));
    Ok(items)
}

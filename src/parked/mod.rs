//! Parked messages: what lapse (or the broker) parked in `<P>.parked`, and the
//! operator's commands over them.
//!
//! A parked message is read from the queue once: it is moved into the parked book
//! ([`book`], the table `lapse_parked` of the first order database) by every worker
//! (every few seconds) and by each `lapse parked` command before it reads. From then
//! on listing, counting, paging and showing read the table, and touch the queue no
//! more: listing never spends a delivery (a read with requeue counts towards a quorum
//! queue's delivery limit), never reorders anything, and pages with a cursor.
//!
//! A replay publishes the selected rows to their destinations with confirms and
//! deletes each row only after its destination confirmed, in the transaction that
//! locked the rows (`FOR UPDATE SKIP LOCKED`: two operators never replay one row
//! twice at once). A purge deletes rows. A replay interrupted at any point leaves the
//! row, at worst next to a copy already on its way: the same ID, absorbed by the
//! database's guards.

pub mod archiver;
pub mod book;
mod entry;
mod route;

pub use book::{Count, Row, Selection};
pub use entry::{Entry, Kind, ReasonSource, headers_json, rfc3339};
pub use route::Router;

use lapin::Connection;
use serde::Serialize;

use crate::amqp::broker::{BrokerError, Publisher};
use crate::db::{DbError, Pool};

/// What happened to one message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    Kept,
    Replayed {
        to: String,
    },
    WouldReplay {
        to: String,
    },
    Purged,
    /// The message stays parked; `error` says why it was not replayed.
    Failed {
        error: String,
    },
}

/// What a replay or purge did with one row.
#[derive(Clone, Debug, Serialize)]
pub struct Item {
    #[serde(flatten)]
    pub row: Row,
    #[serde(flatten)]
    pub outcome: Outcome,
}

#[derive(Debug, thiserror::Error)]
pub enum ParkedError {
    #[error(transparent)]
    Broker(#[from] BrokerError),
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("the parked queue `{0}` does not exist: run `lapse topology apply` first")]
    NoQueue(String),
    #[error(
        "stopped: {0}; the messages of the unfinished chunk stay parked (earlier chunks are done); \
         run `lapse parked list` once the broker accepts publishes again"
    )]
    Stalled(String),
}

impl ParkedError {
    /// True when the broker or the database could not be reached at all, or stopped
    /// answering.
    pub fn unreachable(&self) -> bool {
        match self {
            ParkedError::Broker(
                BrokerError::Connect(_)
                | BrokerError::CertificateRejected { .. }
                | BrokerError::ConnectTimeout { .. }
                | BrokerError::ReplyTimeout { .. }
                | BrokerError::AckTimeout { .. },
            ) => true,
            ParkedError::Db(e) => e.is_transient(),
            _ => false,
        }
    }
}

/// Rows published per batch of confirms.
const REPLAY_CHUNK: usize = 100;

/// Replays the selected rows (or, with `dry_run`, says where each would go). Each row
/// leaves the book only once its destination confirmed it; a row that cannot be
/// replayed stays, with the reason in its outcome.
pub async fn replay(
    conn: &Connection,
    pool: &Pool,
    router: &Router,
    prefix: &str,
    selection: &Selection,
    dry_run: bool,
) -> Result<Vec<Item>, ParkedError> {
    let mut client = pool.get().await.map_err(DbError::from)?;
    let tx = crate::db::begin(&mut client, pool.limits()).await?;
    let rows = book::select_for_update(&tx, prefix, selection).await?;
    let publisher = Publisher::new(conn).await?;
    let mut items = Vec::with_capacity(rows.len());
    let mut done = Vec::new();
    for chunk in rows.chunks(REPLAY_CHUNK) {
        let entries: Vec<&Entry> = chunk.iter().map(|r| &r.entry).collect();
        let targets = router.targets(conn, &entries).await?;
        let mut outgoing = Vec::new();
        let mut planned = Vec::with_capacity(chunk.len());
        for (row, target) in chunk.iter().zip(targets) {
            match target {
                Ok(target) if dry_run => {
                    planned.push((row, Some(Outcome::WouldReplay { to: target.to() })))
                }
                Ok(target) => {
                    planned.push((row, Some(Outcome::Replayed { to: target.to() })));
                    outgoing.push(target.outgoing());
                }
                Err(error) => planned.push((row, Some(Outcome::Failed { error }))),
            }
        }
        let results = publisher.publish_all(outgoing).await;
        // No confirm at all (a broker alarm blocks publishing): stop; the rows of this
        // chunk and after stay (the transaction is not committed for them).
        if let Some(Err(e)) = results.iter().find(|r| {
            matches!(
                r,
                Err(BrokerError::ConfirmTimeout { .. } | BrokerError::Blocked { .. })
            )
        }) {
            let stalled = ParkedError::Stalled(e.to_string());
            // What earlier chunks replayed is confirmed: it leaves the book.
            book::delete(&tx, &done).await?;
            tx.commit().await.map_err(DbError::from)?;
            return Err(stalled);
        }
        let mut results = results.into_iter();
        for (row, outcome) in planned {
            let outcome = match outcome {
                Some(Outcome::Replayed { to }) => {
                    match results.next().unwrap_or(Err(BrokerError::ConnectionLost)) {
                        Ok(()) => {
                            done.push(row.seq);
                            Outcome::Replayed { to }
                        }
                        Err(e) => Outcome::Failed {
                            error: format!("not replayed to {to}: {e}"),
                        },
                    }
                }
                Some(other) => other,
                None => Outcome::Kept,
            };
            items.push(Item {
                row: row.clone(),
                outcome,
            });
        }
    }
    book::delete(&tx, &done).await?;
    tx.commit().await.map_err(DbError::from)?;
    Ok(items)
}

/// Deletes the selected rows (or, with `dry_run`, only lists them).
pub async fn purge(
    pool: &Pool,
    prefix: &str,
    selection: &Selection,
    dry_run: bool,
) -> Result<Vec<Item>, ParkedError> {
    let mut client = pool.get().await.map_err(DbError::from)?;
    let tx = crate::db::begin(&mut client, pool.limits()).await?;
    let rows = book::select_for_update(&tx, prefix, selection).await?;
    let outcome = if dry_run {
        Outcome::Kept
    } else {
        let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
        book::delete(&tx, &seqs).await?;
        Outcome::Purged
    };
    tx.commit().await.map_err(DbError::from)?;
    Ok(rows
        .into_iter()
        .map(|row| Item {
            row,
            outcome: outcome.clone(),
        })
        .collect())
}

/// Deletes exactly the rows `seqs` among the selected (what an operator confirmed),
/// not rows that arrived since.
pub async fn purge_rows(
    pool: &Pool,
    prefix: &str,
    selection: &Selection,
    seqs: &std::collections::BTreeSet<i64>,
) -> Result<Vec<Item>, ParkedError> {
    let mut client = pool.get().await.map_err(DbError::from)?;
    let tx = crate::db::begin(&mut client, pool.limits()).await?;
    let rows: Vec<Row> = book::select_for_update(&tx, prefix, selection)
        .await?
        .into_iter()
        .filter(|r| seqs.contains(&r.seq))
        .collect();
    let chosen: Vec<i64> = rows.iter().map(|r| r.seq).collect();
    book::delete(&tx, &chosen).await?;
    tx.commit().await.map_err(DbError::from)?;
    Ok(rows
        .into_iter()
        .map(|row| Item {
            row,
            outcome: Outcome::Purged,
        })
        .collect())
}

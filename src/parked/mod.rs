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

pub mod archive;
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
const REPLAY_CHUNK: i64 = 100;

/// Replays the selected rows (or, with `dry_run`, says where each would go), a chunk
/// at a time: claim the chunk's rows (a short transaction; a concurrent replay skips
/// them), publish with confirms, then delete the rows whose destination confirmed and
/// free the others. No transaction stays open while the broker is asked, so a slow
/// broker cannot outlast the database's idle limit. A replay that dies mid-chunk leaves
/// its rows claimed for [`book::claim_for`]; the next replay after that takes them.
// Over 60 lines on purpose: one chunk: claim, plan, publish, settle, stop on a stall.
pub async fn replay(
    conn: &Connection,
    pool: &Pool,
    router: &Router,
    prefix: &str,
    selection: &Selection,
    dry_run: bool,
    confirm_timeout: std::time::Duration,
) -> Result<Vec<Item>, ParkedError> {
    let publisher = Publisher::new(conn).await?;
    let claim = book::claim_for(confirm_timeout);
    let mut items = Vec::new();
    let mut after = 0;
    loop {
        let chunk =
            book::claim(pool, prefix, selection, after, REPLAY_CHUNK, claim, dry_run).await?;
        let Some(last) = chunk.last() else { break };
        after = last.seq;
        let entries: Vec<&Entry> = chunk.iter().map(|r| &r.entry).collect();
        let targets = router.targets(conn, &entries).await?;
        let mut outgoing = Vec::new();
        let mut planned = Vec::with_capacity(chunk.len());
        for (row, target) in chunk.iter().zip(targets) {
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
        // No confirm at all (a broker alarm blocks publishing): stop; this chunk's
        // rows are freed, what earlier chunks replayed is gone from the book.
        if let Some(Err(e)) = results.iter().find(|r| {
            matches!(
                r,
                Err(BrokerError::ConfirmTimeout { .. } | BrokerError::Blocked { .. })
            )
        }) {
            let stalled = ParkedError::Stalled(e.to_string());
            let all: Vec<i64> = chunk.iter().map(|r| r.seq).collect();
            book::settle(pool, &[], &all).await?;
            return Err(stalled);
        }
        let mut results = results.into_iter();
        let (mut done, mut kept) = (Vec::new(), Vec::new());
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
                Outcome::Replayed { .. } => done.push(row.seq),
                _ => kept.push(row.seq),
            }
            items.push(Item {
                row: row.clone(),
                outcome,
            });
        }
        if !dry_run {
            book::settle(pool, &done, &kept).await?;
        }
    }
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

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
//! A replay ([`replay`]) claims rows a chunk at a time, publishes them to their
//! destinations with confirms, and deletes each row only after its destination
//! confirmed. A purge deletes rows no replay holds. A replay interrupted at any point
//! leaves the row, at worst next to a copy already on its way: the same ID, absorbed by
//! the database's guards.

pub mod archive;
pub mod archiver;
pub mod book;
mod entry;
mod replay;
mod route;

pub use book::{Count, Row, Selection};
pub use entry::{Entry, Kind, ReasonSource, headers_json, rfc3339};
pub use replay::{Replayed, purge, purge_rows, replay};
pub use route::Router;

use serde::Serialize;

use crate::amqp::broker::BrokerError;
use crate::db::DbError;

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

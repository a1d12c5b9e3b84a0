//! The worker's parked archiver: every [`ARCHIVE_EVERY`] it moves what arrived in
//! `<P>.parked` into the parked book ([`super::book`]) and exports the book's size by
//! cause (`lapse_parked_entries{cause}`). Every worker runs one (`worker.parked_archive`);
//! concurrent archivers take different messages, and a message archived twice is one
//! row. A database that is away leaves the messages in the queue until it is back.

use std::collections::BTreeSet;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{ParkedError, archive, book};
use crate::amqp::broker::{self, Endpoint};
use crate::db::Pool;
use crate::names::Names;
use crate::observe::metric_catalog as m;
use crate::runtime::health::{Busy, Health};
use crate::runtime::supervisor::Fatal;

pub const COMPONENT: &str = "parked";
pub const ARCHIVE_EVERY: Duration = Duration::from_secs(5);
/// Chunks (of [`archive::CHUNK`] messages) one round moves at most.
pub const CHUNKS_PER_ROUND: usize = 50;

/// A session's end: the broker's errors decide whether to reconnect; the database's
/// never stop the component.
#[derive(Debug)]
struct Ended(ParkedError);

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl crate::runtime::backoff::SessionError for Ended {
    /// Never: a worker whose broker user may not read `<P>.parked` still closes
    /// deadlines; the archiver reports itself down and tries again.
    fn is_fatal(&self) -> bool {
        false
    }
}

/// Archives until `token` is cancelled, reconnecting with back-off.
pub async fn run(
    broker: Endpoint,
    names: Names,
    pool: Pool,
    health: Health,
    token: CancellationToken,
) -> Result<(), Fatal> {
    let seen = std::sync::Mutex::new(BTreeSet::new());
    crate::runtime::backoff::reconnecting(COMPONENT, &health, &token, || {
        session(&broker, &names, &pool, &health, &token, &seen)
    })
    .await
}

async fn session(
    broker: &Endpoint,
    names: &Names,
    pool: &Pool,
    health: &Health,
    token: &CancellationToken,
    seen: &std::sync::Mutex<BTreeSet<String>>,
) -> Result<(), Ended> {
    let opening = health.busy(COMPONENT);
    let conn = broker
        .connect(&format!("lapse parked archiver {}", names.prefix))
        .await
        .map_err(|e| Ended(e.into()))?;
    drop(opening);
    health.up(COMPONENT);
    let result = loop {
        let busy = health.busy(COMPONENT);
        let round = round(
            &conn,
            names,
            pool,
            broker.confirm_timeout,
            seen,
            &busy,
            token,
        )
        .await;
        drop(busy);
        match round {
            Ok(()) => health.up(COMPONENT),
            // The queue not declared yet (`topology apply` comes later) or the database
            // away: said on /health, tried again next round.
            Err(e @ (ParkedError::NoQueue(_) | ParkedError::Db(_))) => {
                health.down(COMPONENT, e.to_string());
            }
            Err(e) => break Err(Ended(e)),
        }
        tokio::select! {
            _ = token.cancelled() => break Ok(()),
            _ = tokio::time::sleep(ARCHIVE_EVERY) => {}
        }
    };
    broker::close_quietly(&conn, "parked archiver stopping").await;
    result
}

/// One round: at most [`CHUNKS_PER_ROUND`] chunks moved (progress reported after
/// each, so a long backlog is not a stall; shutdown stops it between chunks), then
/// the book counted for the gauge.
async fn round(
    conn: &lapin::Connection,
    names: &Names,
    pool: &Pool,
    reply_timeout: Duration,
    seen: &std::sync::Mutex<BTreeSet<String>>,
    busy: &Busy,
    token: &CancellationToken,
) -> Result<(), ParkedError> {
    let mut chunks = 0;
    let mut next_chunk = || {
        busy.progress();
        chunks += 1;
        chunks <= CHUNKS_PER_ROUND && !token.is_cancelled()
    };
    let moved = archive::archive(conn, names, pool, reply_timeout, &mut next_chunk).await?;
    if moved > 0 {
        tracing::info!(moved, "parked messages moved into the parked book");
    }
    let counts = book::counts(pool, &names.prefix).await?;
    let now: BTreeSet<String> = counts.iter().map(|c| c.cause.clone()).collect();
    for c in &counts {
        metrics::gauge!(m::PARKED_ENTRIES, "cause" => c.cause.clone()).set(c.count as f64);
    }
    // A cause whose rows were all replayed or purged reads 0, not its last count.
    let mut seen = seen.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for gone in seen.difference(&now) {
        metrics::gauge!(m::PARKED_ENTRIES, "cause" => gone.clone()).set(0.0);
    }
    seen.extend(now);
    Ok(())
}

//! One round of tries over a batch's work: release what commits, split what fails
//! permanently, hold back locked rows, and with several shards set aside the chunks of
//! a shard whose database is away (held, then tried again in a later batch).

use std::collections::HashMap;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Locked, Pending, Releaser};
use crate::amqp::batch::{BatchSource, ConsumerSession};
use crate::amqp::broker::BrokerError;
use crate::observe::stats::Outcome;
use crate::runtime::backoff::Backoff;
use crate::runtime::health::Busy;

/// What is left of a batch after one round of tries.
#[derive(Default)]
pub(super) struct Round {
    /// Single events that failed with a permanent error, with the error.
    pub failed: Vec<(Pending, String)>,
    /// Events whose order row another transaction held.
    pub held: Vec<Pending>,
    /// Orders (shard, id) whose release committed in this round.
    pub released_orders: Vec<(u16, i64)>,
    /// True when at least one release transaction committed.
    pub succeeded: bool,
    /// With several shards: chunks whose database was away, to hold and try again
    /// in a later batch (so that the other shards' releases go on meanwhile).
    pub away: Vec<Vec<Pending>>,
    /// Shards with a release transaction that committed.
    pub released: Vec<u16>,
}

/// Holds the deliveries of shards whose database was away, each shard after its own
/// back-off (100 ms doubling to 5 s, reset once one of its releases commits); they
/// come back with a later batch.
pub(super) fn hold_away(
    chunks: Vec<Vec<Pending>>,
    session: &mut ConsumerSession,
    away: &mut HashMap<u16, Backoff>,
) {
    let mut delays: HashMap<u16, Duration> = HashMap::new();
    for chunk in chunks {
        for p in chunk {
            let delay = *delays
                .entry(p.shard)
                .or_insert_with(|| away.entry(p.shard).or_default().next_delay());
            session
                .source
                .hold(p.delivery, tokio::time::Instant::now() + delay);
        }
    }
}

/// Holds each event whose order row another transaction held in the session's delay
/// queue, after that order's own back-off (100 ms doubling to 5 s), so the releaser
/// goes on with the next batch meanwhile. `Outcome::Locked` counts each order once per
/// session, when it is first met locked, not each retry.
pub(super) fn hold_locked(
    held: Vec<Pending>,
    session: &mut ConsumerSession,
    locked: &mut Locked,
    stats: &crate::observe::stats::Stats,
) {
    if locked.len() > MAX_LOCKED_TRACKED {
        // Orders parked or settled elsewhere leave their entry behind; forget them all
        // rather than grow without bound (the worst is a recount and a shorter wait).
        locked.clear();
    }
    for p in held {
        let backoff = locked.entry((p.shard, p.order_id)).or_insert_with(|| {
            stats.by("releaser").record(Outcome::Locked, 1);
            Backoff::new()
        });
        let until = tokio::time::Instant::now() + backoff.next_delay();
        session.source.hold(p.delivery, until);
    }
}

/// Locked orders whose back-off the releaser remembers, at most.
const MAX_LOCKED_TRACKED: usize = 100_000;

impl Releaser {
    /// Tries `work` once: releases what it can (acknowledging those deliveries),
    /// splits chunks that fail permanently down to single events, retries transient
    /// errors with back-off. Returns what is left.
    // Over 60 lines on purpose: one try of each chunk with its three answers (released, transient, permanent), each with its counters.
    pub(super) async fn round(
        &self,
        mut work: Vec<Vec<Pending>>,
        source: &mut BatchSource,
        token: &CancellationToken,
        busy: &Busy,
        backoff: &mut Backoff,
    ) -> Result<Round, BrokerError> {
        let mut round = Round::default();
        while let Some(mut chunk) = work.pop() {
            if chunk.is_empty() {
                continue;
            }
            // A chunk is released in one shard's database: one holding events of
            // several shards (order ids repeat across shards) is split first.
            let shard = chunk[0].shard;
            if chunk.iter().any(|p| p.shard != shard) {
                work.extend(super::group_by_shard(chunk));
                continue;
            }
            let ids: Vec<i64> = chunk.iter().map(|p| p.order_id).collect();
            match self.release(shard, &ids).await {
                Ok(outcome) => {
                    backoff.reset();
                    round.succeeded = true;
                    round.released.push(shard);
                    self.stats.by("releaser").record(
                        Outcome::Released,
                        u64::try_from(outcome.applied).unwrap_or(0),
                    );
                    let (held, released): (Vec<Pending>, Vec<Pending>) = chunk
                        .into_iter()
                        .partition(|p| outcome.held.contains(&p.order_id));
                    source.ack_all(released.iter().map(|p| &p.delivery)).await?;
                    round
                        .released_orders
                        .extend(released.iter().map(|p| (p.shard, p.order_id)));
                    round.held.extend(held);
                    if !outcome.held.is_empty() {
                        tracing::debug!(orders = ?outcome.held,
                            "releaser: order rows locked by another transaction; holding them back");
                    }
                }
                // With several shards the others go on meanwhile; near the broker's
                // consumer timeout the batch gives way: held (and renewed at its limit)
                // instead of retried in place.
                Err(e)
                    if e.is_transient()
                        && (self.pools.len() > 1 || source.limit_near(super::RETRY_MARGIN)) =>
                {
                    tracing::warn!(error = %e.detail(), held = chunk.len(), shard,
                        "releaser: database unavailable; holding these deliveries and going on with the rest");
                    self.stats.by("releaser").record(
                        Outcome::ReleaseRetried,
                        u64::try_from(chunk.len()).unwrap_or(0),
                    );
                    round.away.push(chunk);
                }
                Err(e) if e.is_transient() => {
                    tracing::warn!(error = %e.detail(), held = chunk.len(),
                        "releaser: database unavailable; holding the deliveries and retrying");
                    self.stats.by("releaser").record(
                        Outcome::ReleaseRetried,
                        u64::try_from(chunk.len()).unwrap_or(0),
                    );
                    // Waiting out an outage is not a stall.
                    busy.idle_while(backoff.sleep(token)).await;
                    if token.is_cancelled() {
                        return Ok(round);
                    }
                    work.push(chunk);
                }
                Err(e) if chunk.len() > 1 => {
                    // Narrow down to the events that fail; the others go through.
                    tracing::debug!(error = %e.detail(), size = chunk.len(),
                        "releaser: permanent error; splitting the batch");
                    let right = chunk.split_off(chunk.len() / 2);
                    work.push(right);
                    work.push(chunk);
                }
                Err(e) => {
                    if let Some(one) = chunk.pop() {
                        round.failed.push((one, e.detail()));
                    }
                }
            }
        }
        Ok(round)
    }
}

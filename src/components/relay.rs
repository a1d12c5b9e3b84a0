//! The outbox relay: moves outbox rows to the broker with publisher confirms and
//! deletes a row only after its confirm.
//!
//! Timeout intents go to the tier chosen from the database clock (or straight to the
//! due queue when shorter than the smallest tier), allowing as slack the lag since
//! the intent was written, and the hop slack only where the hop budget or a long
//! hold needs it (`TierSet::planned_hop`); stock-release events go to
//! `<P>.events`. Several relays may run at once: each round locks its rows with
//! `FOR UPDATE SKIP LOCKED`. Woken by `NOTIFY lapse_outbox`, with a polling fallback.
//!
//! A row the broker refuses (a full tier, `reject-publish`) or returns (`mandatory`:
//! no queue bound, e.g. deleted by an operator), and a timeout whose wait tier has no
//! queue (checked before publishing, see [`crate::amqp::tier_check`]: `<P>.delay` would
//! route it to parked and confirm it), is never deleted: it is rescheduled
//! (`not_before`, with exponential back-off per row, see [`retry`]) and the round
//! takes rows by `(not_before, id)`, so a refused destination waits alone while every
//! other row — other tiers, stock releases — flows past it.

pub mod backlog;
pub mod notifications;
mod outgoing;
mod packing;
pub mod retry;
mod session;
mod sources;

use std::collections::BTreeSet;
use std::time::Duration;

use crate::db::Pool;
use lapin::Connection;

use crate::amqp::broker::{self, BrokerError, Publisher};
use crate::amqp::tier_check::TierCheck;
use crate::config::Config;
use crate::db::DbError;
use crate::names::Names;
use crate::observe::stats::{Outcome, Stats};
use crate::tier::{Tier, TierSet};
use outgoing::RowPublish;
pub use sources::KindOutbox;
use sources::{Later, Source};

/// The channel the outbox trigger notifies.
pub use notifications::OUTBOX_CHANNEL;

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

impl From<tokio_postgres::Error> for RelayError {
    fn from(e: tokio_postgres::Error) -> Self {
        Self::Db(e.into())
    }
}

impl From<deadpool_postgres::PoolError> for RelayError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        Self::Db(e.into())
    }
}

/// What one round did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelayOutcome {
    /// Nothing to publish.
    Idle,
    /// Rows published and deleted; `refused` rows were nacked (a full tier) and
    /// `returned` ones unroutable (returned by the broker, or for a tier without a
    /// queue): both stay, rescheduled for later.
    Published {
        sent: usize,
        refused: usize,
        returned: usize,
    },
}

/// Which rows a round takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Round {
    /// Every row due, after waiting `waited` on purpose (gathering): that wait is not
    /// counted as the relay's lag when a first tier is chosen.
    All { waited: Duration },
    /// Only what cannot wait (see [`URGENT_ONLY`]), while a gathering round is pending:
    /// an event or an intent due soon leaves at once without taking the gathering
    /// intents along, which would cut their packs short. `waited` as for `All`: an
    /// intent that waited for the gathering and is now due within 2 s is among them.
    Urgent { waited: Duration },
}

/// The claim's extra condition in an urgent round: everything but an intent (a
/// timeout or a kind's deadline) due more than 2 seconds from now, the test of the
/// outbox's wake-up (migration V15) made at the round's own clock. A row whose
/// deadline cannot be read counts as urgent, as there.
const URGENT_ONLY: &str = r#"
                        AND NOT (kind IN ('timeout', 'deadline')
                                 AND coalesce((payload->>'expire_at')
                                     ~ '^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}[.][0-9]{3}Z$'
                                     AND (payload->>'expire_at') COLLATE "C"
                                         > to_char((now() + interval '2 seconds') AT TIME ZONE 'UTC',
                                                   'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') COLLATE "C",
                                     false))"#;

#[derive(Clone)]
pub struct Relay {
    pub pool: Pool,
    pub names: Names,
    pub tiers: TierSet,
    pub tolerance: Duration,
    pub batch_size: i64,
    pub stats: Stats,
    pub tier_check: TierCheck,
    /// The shard whose outbox this relay drains: stamped on every message it
    /// publishes (0, the only database without shards, is not written).
    pub shard: u16,
    /// Its name on `/health` and in logs: `relay`, or `relay.s<shard>` with shards.
    pub component: &'static str,
    /// The `shard` label of its database gauges; `None` without shards.
    pub shard_label: Option<String>,
    /// Whether this database has the kinds' outbox yet.
    pub kind_outbox: KindOutbox,
    /// Packs: the most timeouts per message, and how far apart their deadlines may be.
    pub pack_max: usize,
    pub pack_window: Duration,
    /// How long intents due more than 2 seconds later may wait in the outbox for
    /// others of their route (`relay.gather`; 0: not at all).
    pub gather: Duration,
}

impl Relay {
    pub fn new(config: &Config, pool: Pool, tiers: TierSet, stats: Stats) -> Self {
        Self {
            pool,
            shard: 0,
            component: "relay",
            shard_label: None,
            kind_outbox: KindOutbox::default(),
            tier_check: TierCheck::new(config.names(), config.broker.confirm_timeout),
            names: config.names(),
            tiers,
            tolerance: config.relay.tier_tolerance,
            batch_size: config.relay.batch_size,
            pack_max: config.packs.max_entries,
            pack_window: config.packs.window,
            gather: config.relay.gather,
            stats,
        }
    }

    /// One round: lock a batch of due rows, check that the wait tiers they go to
    /// exist (asked on `conn`, the publisher's connection), publish the rest with
    /// confirms, delete what was confirmed and routed, reschedule what was refused or
    /// returned or had no tier queue.
    // Over 60 lines on purpose: one round is one transaction (read, check tiers, publish, delete, reschedule, record hops, commit); pieces would pass the transaction and its collections around.
    pub async fn run_once(
        &self,
        conn: &Connection,
        publisher: &Publisher,
    ) -> Result<RelayOutcome, RelayError> {
        self.round(
            conn,
            publisher,
            Round::All {
                waited: Duration::ZERO,
            },
        )
        .await
    }

    /// One round of `kind` (see [`Round`]).
    async fn round(
        &self,
        conn: &Connection,
        publisher: &Publisher,
        kind: Round,
    ) -> Result<RelayOutcome, RelayError> {
        let (waited, filter) = match kind {
            Round::All { waited } => (waited, ""),
            Round::Urgent { waited } => (waited, URGENT_ONLY),
        };
        let mut client = self.pool.get().await?;
        let tx = crate::db::begin(&mut client, self.pool.limits()).await?;
        let rows = tx
            .query_typed(
                &format!(
                    "SELECT id, kind, order_id, payload, now() AS db_now, created_at, attempts FROM outbox
                      WHERE not_before <= now(){filter}
                      ORDER BY not_before, id LIMIT $1 FOR UPDATE SKIP LOCKED"
                ),
                &[(&self.batch_size, tokio_postgres::types::Type::INT8)],
            )
            .await?;
        // Kinds' intents and events wait in an outbox of their own (once this database
        // has it: a worker may run before `lapse migrate` brought migration V14).
        // What the round has room for, and at least a quarter of a batch so that a
        // busy outbox never starves the kinds': at most 1.25 batches per round.
        let room = self.batch_size - i64::try_from(rows.len()).unwrap_or(i64::MAX);
        let kind_limit = room.max(self.batch_size / 4).max(1);
        let kind_rows = if !self.kind_outbox.exists(&tx).await? {
            Vec::new()
        } else {
            tx.query_typed(
                &format!(
                    "SELECT id, kind, deadline_id AS order_id, payload, now() AS db_now, created_at, attempts
                       FROM lapse.kind_outbox
                      WHERE not_before <= now(){filter}
                      ORDER BY not_before, id LIMIT $1 FOR UPDATE SKIP LOCKED"
                ),
                &[(&kind_limit, tokio_postgres::types::Type::INT8)],
            )
            .await?
        };
        if rows.is_empty() && kind_rows.is_empty() {
            return Ok(RelayOutcome::Idle);
        }
        let outgoing: Vec<RowPublish> = rows
            .iter()
            .map(|r| self.decode(r, Source::Outbox, waited))
            .chain(
                kind_rows
                    .iter()
                    .map(|r| self.decode(r, Source::Kinds, waited)),
            )
            .collect::<Result<_, DbError>>()?;
        let tiers: BTreeSet<Tier> = outgoing.iter().filter_map(|o| o.tier).collect();
        let missing = if tiers.is_empty() {
            BTreeSet::new()
        } else {
            self.tier_check.missing(conn, tiers).await?
        };
        let exchanges: BTreeSet<&str> = outgoing
            .iter()
            .filter_map(|o| o.shop_exchange.as_deref())
            .collect();
        let mut no_exchange = BTreeSet::new();
        for exchange in exchanges {
            let after = self.tier_check.timeout();
            // No answer holds only that exchange's events back, for this round.
            match broker::exchange_exists_within(conn, exchange, after).await {
                Ok(true) => {}
                Ok(false) | Err(_) => {
                    no_exchange.insert(exchange.to_string());
                }
            }
        }
        let mut later = Later::default();
        let (held, ready): (Vec<&RowPublish>, Vec<&RowPublish>) = outgoing.iter().partition(|o| {
            o.tier.is_some_and(|t| missing.contains(&t))
                || o.shop_exchange
                    .as_ref()
                    .is_some_and(|e| no_exchange.contains(e))
        });
        for o in held {
            match &o.shop_exchange {
                Some(exchange) => later.add(
                    o,
                    &BrokerError::MissingExchange {
                        exchange: exchange.clone(),
                    },
                ),
                None => {
                    let queue = o.tier.map(|t| self.names.wait_queue(t)).unwrap_or_default();
                    later.add(o, &BrokerError::MissingTier { queue });
                }
            }
        }
        let packs = packing::packs(ready, self.pack_window, self.pack_max);
        let (messages, members): (Vec<_>, Vec<_>) = packs.into_iter().unzip();
        let results = publisher.publish_all(messages).await;
        let mut sent_ids = Vec::new();
        let mut sent_kind_ids = Vec::new();
        let mut hops = Vec::new();
        let mut broken = None;
        for (rows, result) in members.into_iter().zip(results) {
            match result {
                Ok(()) => {
                    for o in rows {
                        match o.source {
                            Source::Outbox => sent_ids.push(o.outbox_id),
                            Source::Kinds => sent_kind_ids.push(o.outbox_id),
                        }
                        if let Some(hop) = &o.hop {
                            self.stats.hop(Some(hop.tier.as_str()));
                            hops.push(hop.clone());
                        }
                    }
                }
                Err(e @ (BrokerError::Nacked { .. } | BrokerError::Unroutable { .. })) => {
                    for o in rows {
                        later.add(o, &e);
                    }
                }
                Err(e) => broken = Some(e),
            }
        }
        for (table, ids) in [("outbox", &sent_ids), ("lapse.kind_outbox", &sent_kind_ids)] {
            if !ids.is_empty() {
                tx.execute_typed(
                    &format!("DELETE FROM {table} WHERE id = ANY($1)"),
                    &[(ids, tokio_postgres::types::Type::INT8_ARRAY)],
                )
                .await?;
            }
        }
        for (table, source) in [
            ("outbox", Source::Outbox),
            ("lapse.kind_outbox", Source::Kinds),
        ] {
            let (ids, delay_ms, errors) = later.of(source);
            if ids.is_empty() {
                continue;
            }
            tx.execute_typed(
                &format!(
                    "UPDATE {table} o
                        SET attempts = o.attempts + 1, last_error = r.error,
                            not_before = now() + r.ms * interval '1 millisecond'
                       FROM unnest($1::bigint[], $2::bigint[], $3::text[]) AS r(id, ms, error)
                      WHERE o.id = r.id"
                ),
                &[
                    (&ids, tokio_postgres::types::Type::INT8_ARRAY),
                    (&delay_ms, tokio_postgres::types::Type::INT8_ARRAY),
                    (&errors, tokio_postgres::types::Type::TEXT_ARRAY),
                ],
            )
            .await?;
        }
        crate::timeline::record_hops(&tx, &hops).await?;
        tx.commit().await?;
        let stats = self.stats.by("relay");
        let sent = sent_ids.len() + sent_kind_ids.len();
        stats.record(Outcome::Relayed, sent as u64);
        stats.record(Outcome::PublishRefused, later.refused as u64);
        stats.record(Outcome::Unroutable, later.returned as u64);
        if let Some(error) = later.errors.first() {
            tracing::warn!(
                refused = later.refused,
                returned = later.returned,
                %error,
                "relay: the broker did not take some rows; rescheduled with back-off"
            );
        }
        if let Some(e) = broken {
            return Err(e.into());
        }
        Ok(RelayOutcome::Published {
            sent,
            refused: later.refused,
            returned: later.returned,
        })
    }
}

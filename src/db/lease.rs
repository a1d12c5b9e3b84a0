//! Leadership as a lease row judged by the database clock: one holder at a time, for a
//! bounded time unless renewed.
//!
//! Why not a session advisory lock: a leader frozen (SIGSTOP) or cut off keeps a
//! session lock for as long as its connection lives, which can be forever (a stopped
//! process's kernel still answers TCP keepalives), and a pooler in transaction mode
//! hands the lock and its unlock to different server connections.
//!
//! How: [`Lease::acquire`] takes the lease when it is free, expired or already ours; a
//! new holder (or ours again after it lapsed) starts a new epoch. The holder renews it
//! with [`Lease::fence`] inside each unit of work's transaction: the renewal succeeds
//! only while the lease is still ours, in our epoch (a takeover needs it expired, and
//! changes both), and it locks the
//! lease row until the transaction ends, so a contender cannot take over between the
//! check and the commit. A unit whose fence fails writes nothing and the holder stops.
//!
//! Bound: a holder that stops renewing loses the lease `ttl` after its last committed
//! renewal; one frozen inside a unit's transaction holds the row lock until the server
//! ends that transaction ([`super::SHORT_TRANSACTION_IDLE`]), which rolls its renewal
//! back.

use std::time::Duration;

use tokio_postgres::types::Type;

use super::{DbError, column};

/// How long taking over waits for the lease row's lock (a leader inside a unit's
/// transaction holds it briefly): past that, someone is leading.
const TAKEOVER_LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// One worker's claim on a named lease.
#[derive(Clone, Debug)]
pub struct Lease {
    name: &'static str,
    holder: String,
    ttl: Duration,
    epoch: Option<i64>,
}

impl Lease {
    /// A claim on lease `name`, under a holder name unique to this claim.
    pub fn new(name: &'static str, ttl: Duration) -> Self {
        Self {
            name,
            holder: format!(
                "pid {} claim {:016x}",
                std::process::id(),
                fastrand::u64(..)
            ),
            ttl,
            epoch: None,
        }
    }

    fn ttl_ms(&self) -> i64 {
        i64::try_from(self.ttl.as_millis()).unwrap_or(i64::MAX)
    }

    /// The epoch held, if any.
    pub fn epoch(&self) -> Option<i64> {
        self.epoch
    }

    /// Takes the lease when it is free, expired or already ours (renewing it); returns
    /// whether we hold it now. A live lease of another holder is not waited for.
    pub async fn acquire(
        &mut self,
        client: &mut tokio_postgres::Client,
        limits: super::Limits,
    ) -> Result<bool, DbError> {
        let tx = super::begin_short(client, limits, Some(TAKEOVER_LOCK_TIMEOUT)).await?;
        let current = tx
            .query_typed_opt(
                "SELECT holder, expires_at > clock_timestamp() AS live
                   FROM lapse_leader_leases WHERE name = $1",
                &[(&self.name, Type::TEXT)],
            )
            .await?;
        if let Some(row) = &current {
            let holder: String = column(row, "holder")?;
            if column::<bool>(row, "live")? && holder != self.holder {
                self.epoch = None;
                return Ok(false);
            }
        }
        let taken = tx
            .query_typed_opt(
                "INSERT INTO lapse_leader_leases AS l (name, holder, epoch, expires_at)
                 VALUES ($1, $2, 1, clock_timestamp() + $3::bigint * interval '1 millisecond')
                 ON CONFLICT (name) DO UPDATE
                    SET holder = EXCLUDED.holder,
                        epoch = CASE WHEN l.holder = EXCLUDED.holder
                                      AND l.expires_at > clock_timestamp()
                                     THEN l.epoch ELSE l.epoch + 1 END,
                        expires_at = EXCLUDED.expires_at
                  WHERE l.holder = EXCLUDED.holder OR l.expires_at <= clock_timestamp()
                 RETURNING epoch",
                &[
                    (&self.name, Type::TEXT),
                    (&self.holder, Type::TEXT),
                    (&self.ttl_ms(), Type::INT8),
                ],
            )
            .await;
        let taken = match taken {
            Ok(row) => row,
            // The row is locked: its holder is inside a unit of work, so it leads.
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
                self.epoch = None;
                return Ok(false);
            }
            Err(e) => return Err(e.into()),
        };
        tx.commit().await?;
        self.epoch = taken.map(|row| column(&row, "epoch")).transpose()?;
        Ok(self.epoch.is_some())
    }

    /// Inside `tx` (one unit of the leader's work): makes it a short transaction
    /// ([`super::short_transaction`]), renews the lease and locks its row until `tx`
    /// ends. False when the lease is no longer ours in our epoch (taken over after it
    /// expired, or a takeover holds its row): the caller must roll back and stop
    /// leading.
    pub async fn fence(
        &mut self,
        tx: &tokio_postgres::Transaction<'_>,
        then_lock_timeout: Option<Duration>,
    ) -> Result<bool, DbError> {
        let Some(epoch) = self.epoch else {
            return Ok(false);
        };
        super::short_transaction(tx, Some(TAKEOVER_LOCK_TIMEOUT)).await?;
        // Ours while the holder and the epoch are: a takeover needs the lease expired,
        // changes the holder and moves the epoch on, all under the row lock taken here.
        // A lease that expired while this leader worked slowly (a paced batch, a slow
        // page query) with nobody taking over is still ours, and renewed.
        let renewed = tx
            .query_typed_opt(
                "UPDATE lapse_leader_leases
                    SET expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond'
                  WHERE name = $1 AND holder = $2 AND epoch = $3
                 RETURNING epoch",
                &[
                    (&self.name, Type::TEXT),
                    (&self.holder, Type::TEXT),
                    (&epoch, Type::INT8),
                    (&self.ttl_ms(), Type::INT8),
                ],
            )
            .await;
        let renewed = match renewed {
            Ok(row) => row.is_some(),
            // A contender holds the row inside its takeover: not ours this round (the
            // transaction is aborted; the caller rolls it back).
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
                false
            }
            Err(e) => return Err(e.into()),
        };
        if !renewed {
            self.epoch = None;
            return Ok(false);
        }
        // The rest of the unit waits for locks as long as the caller says.
        let rest = match then_lock_timeout {
            Some(limit) => format!(
                "SET LOCAL lock_timeout = {}",
                limit.as_millis().clamp(1, i32::MAX.unsigned_abs().into())
            ),
            None => "SET LOCAL lock_timeout TO DEFAULT".into(),
        };
        tx.batch_execute(&rest).await?;
        Ok(true)
    }

    /// Gives the lease up (on shutdown), so another worker can lead at once.
    pub async fn release(
        &mut self,
        client: &mut tokio_postgres::Client,
        limits: super::Limits,
    ) -> Result<(), DbError> {
        if let Some(epoch) = self.epoch.take() {
            let tx = super::begin_short(client, limits, Some(TAKEOVER_LOCK_TIMEOUT)).await?;
            tx.execute_typed(
                "UPDATE lapse_leader_leases SET expires_at = clock_timestamp()
                      WHERE name = $1 AND holder = $2 AND epoch = $3",
                &[
                    (&self.name, Type::TEXT),
                    (&self.holder, Type::TEXT),
                    (&epoch, Type::INT8),
                ],
            )
            .await?;
            tx.commit().await?;
        }
        Ok(())
    }
}

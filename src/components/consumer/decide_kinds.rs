//! The decision for the timeout of a kind's deadline (docs/adopting.md): the same
//! table as an order's, with the deadline's state in place of the order's status and
//! the verdict of the kind's action (run by [`crate::kinds::fire`]) in place of the
//! guarded close.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};

use super::{Action, Decider, Snapshot, park};
use crate::db::DbError;
use crate::kinds::fire::{self, DeadlineRow, Due, Verdict};
use crate::message::TimeoutMessage;
use crate::observe::stats::Outcome;

impl Decider {
    /// Reads the deadlines of kinds `messages` name and fires those due, in `tx`.
    pub(super) async fn fire_due(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        messages: &[&TimeoutMessage],
        db_now: DateTime<Utc>,
    ) -> Result<
        (
            HashMap<i64, Result<DeadlineRow, String>>,
            HashMap<i64, Verdict>,
        ),
        DbError,
    > {
        if messages.is_empty() {
            return Ok(Default::default());
        }
        let ids: Vec<i64> = messages.iter().map(|m| m.order_id).collect();
        let rows = fire::read(tx, &ids).await?;
        let due: Vec<Due> = messages
            .iter()
            .filter(|m| {
                rows.get(&m.order_id).is_some_and(|r| {
                    r.as_ref().is_ok_and(|r| {
                        r.state == "pending"
                            && r.version == m.deadline_version
                            && m.deadline().is_some_and(|(kind, _)| kind == r.kind)
                            && r.expire_at.as_ref().is_ok_and(|t| *t <= db_now)
                    })
                })
            })
            .map(|m| Due {
                id: m.order_id,
                version: m.deadline_version,
            })
            .collect();
        let verdicts = if due.is_empty() {
            HashMap::new()
        } else {
            fire::fire(tx, &self.kinds, &rows, &due, self.lock_timeout).await?
        };
        Ok((rows, verdicts))
    }

    /// [`Decider::classify`] for the timeout of a kind's deadline: the same table, with
    /// the deadline's state and the verdict of its action. `fired_ids` holds the
    /// deadlines of this batch already credited to a delivery (a duplicate is settled).
    pub(super) fn classify_deadline(
        &self,
        m: &TimeoutMessage,
        snap: &Snapshot,
        fired_ids: &mut HashSet<i64>,
    ) -> Action {
        let row = match snap.deadlines.get(&m.order_id) {
            None => return Action::Ack(Outcome::Missing),
            Some(Err(reason)) => return park(reason, "bad_deadline"),
            Some(Ok(row)) => row,
        };
        if m.deadline().is_none_or(|(kind, _)| kind != row.kind) {
            return park(
                &format!(
                    "the message names deadline {} of kind {:?}, but that deadline is of kind {:?}",
                    m.order_id,
                    m.kind.as_deref().unwrap_or_default(),
                    row.kind
                ),
                "bad_deadline",
            );
        }
        if row.version != m.deadline_version {
            return Action::Ack(Outcome::Stale);
        }
        if row.state != "pending" {
            return Action::Ack(Outcome::Settled);
        }
        let expire_at = match &row.expire_at {
            Ok(t) => *t,
            Err(reason) => return park(reason, "bad_deadline"),
        };
        if expire_at > snap.db_now {
            return self.wait_more(m, expire_at, snap.db_now);
        }
        match snap.verdicts.get(&m.order_id) {
            Some(Verdict::Fired { .. }) if fired_ids.insert(m.order_id) => {
                Action::Ack(Outcome::Closed)
            }
            Some(Verdict::Nothing) if fired_ids.insert(m.order_id) => Action::Ack(Outcome::Raced),
            Some(Verdict::Fired { .. } | Verdict::Nothing) => Action::Ack(Outcome::Settled),
            Some(Verdict::Locked) => Action::Locked(self.lock_retry),
            Some(Verdict::Park(reason)) => park(reason, "action_failed"),
            // Pending and due at the read, gone when locked: settled meanwhile.
            None => Action::Ack(Outcome::Settled),
        }
    }
}

pub(super) fn unknown_kind(m: &TimeoutMessage) -> String {
    format!(
        "the deadline's kind {:?} is not under [kinds] of this worker's configuration (taken out \
         while its deadlines were in flight?): replay it once the kind is back",
        m.kind.as_deref().unwrap_or_default()
    )
}

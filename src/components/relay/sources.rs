//! The relay's two outboxes — lapse's own and the kinds' (`lapse.kind_outbox`,
//! which a relay of an earlier version never reads) — and the rows of a round to try
//! again later, each back to its own table.

use std::sync::Arc;

use crate::amqp::broker::BrokerError;
use crate::db::DbError;

use super::outgoing::RowPublish;
use super::retry;

/// Whether `lapse.kind_outbox` exists, asked each round until it does, then
/// remembered (a table lapse created is not dropped under a running worker).
#[derive(Clone, Default)]
pub struct KindOutbox(Arc<std::sync::atomic::AtomicBool>);

impl KindOutbox {
    pub(super) async fn exists(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
    ) -> Result<bool, DbError> {
        use std::sync::atomic::Ordering;
        if self.0.load(Ordering::Relaxed) {
            return Ok(true);
        }
        let row = tx
            .query_typed_one(
                "SELECT to_regclass('lapse.kind_outbox') IS NOT NULL AS present",
                &[],
            )
            .await?;
        let present: bool = crate::db::column(&row, "present")?;
        self.0.store(present, Ordering::Relaxed);
        Ok(present)
    }
}

/// Which outbox a row came from: lapse's (timeouts, stock releases) or the kinds'
/// (`lapse.kind_outbox`: deadline intents, events). Their ids are apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    Outbox,
    Kinds,
}

/// Rows to try again later, with why and when.
#[derive(Default)]
pub(super) struct Later {
    pub(super) ids: Vec<i64>,
    pub(super) sources: Vec<Source>,
    pub(super) delay_ms: Vec<i64>,
    pub(super) errors: Vec<String>,
    pub(super) refused: usize,
    pub(super) returned: usize,
}

impl Later {
    /// The ids, delays and errors of the rows of one outbox.
    pub(super) fn of(&self, source: Source) -> (Vec<i64>, Vec<i64>, Vec<String>) {
        let mut of = (Vec::new(), Vec::new(), Vec::new());
        for (i, s) in self.sources.iter().enumerate() {
            if *s == source {
                of.0.push(self.ids[i]);
                of.1.push(self.delay_ms[i]);
                of.2.push(self.errors[i].clone());
            }
        }
        of
    }

    pub(super) fn add(&mut self, o: &RowPublish, error: &BrokerError) {
        let delay = retry::retry_delay(o.attempts, o.reroute_after);
        self.ids.push(o.outbox_id);
        self.sources.push(o.source);
        self.delay_ms
            .push(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
        self.errors.push(error.to_string());
        match error {
            BrokerError::Unroutable { .. }
            | BrokerError::MissingTier { .. }
            | BrokerError::MissingExchange { .. } => self.returned += 1,
            _ => self.refused += 1,
        }
    }
}

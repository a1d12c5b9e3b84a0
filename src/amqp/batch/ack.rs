//! Acknowledging a batch source's deliveries in as few frames as is safe: a
//! `multiple` acknowledgement covers every unacknowledged delivery of the channel up
//! to its tag, so the source records what it handed out and groups only runs with
//! nothing held, kept or undecided below or among them.

use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::BasicAckOptions;

use super::BatchSource;
use crate::amqp::broker::BrokerError;

impl BatchSource {
    /// Acknowledges one delivery of this source (see [`Self::ack_all`]).
    pub async fn ack(&mut self, delivery: &Delivery) -> Result<(), BrokerError> {
        self.ack_all([delivery]).await
    }

    /// True while `delivery` (handed out by this source) is not acknowledged.
    pub fn is_unacked(&self, delivery: &Delivery) -> bool {
        self.unacked.contains_key(&delivery.delivery_tag)
    }

    /// Acknowledges `deliveries` of this source in as few frames as is safe: the
    /// lowest ones in one `multiple` acknowledgement, as long as no other
    /// unacknowledged delivery of the channel (one held, kept or still being decided)
    /// lies below or among them; the rest one by one. Errors as [`ack`]; what was
    /// acknowledged before an error is no longer [`Self::is_unacked`].
    pub async fn ack_all<'a>(
        &mut self,
        deliveries: impl IntoIterator<Item = &'a Delivery>,
    ) -> Result<(), BrokerError> {
        let mut sorted: Vec<&Delivery> = deliveries.into_iter().collect();
        sorted.sort_by_key(|d| d.delivery_tag);
        debug_assert!(
            sorted
                .iter()
                .all(|d| self.unacked.contains_key(&d.delivery_tag)),
            "acknowledging a delivery this source did not hand out, or one already acknowledged"
        );
        let covered = covered_prefix(self.unacked.keys(), sorted.iter().map(|d| d.delivery_tag));
        let singles = if covered >= 2 {
            ack_with(sorted[covered - 1], true).await?;
            for d in &sorted[..covered] {
                self.settle(d.delivery_tag);
            }
            &sorted[covered..]
        } else {
            &sorted[..]
        };
        for d in singles {
            ack_with(d, false).await?;
            self.settle(d.delivery_tag);
        }
        Ok(())
    }
}

/// How long an acknowledgement may take to be handed to the connection. lapin
/// completes an ack once its frame is written, normally within microseconds. An ack
/// queued just as the connection dies can land in lapin's internal command queue
/// behind the command that stops it: it is then neither run nor failed, and without a
/// bound the session would wait for it forever (seen when a node was SIGKILLed
/// mid-batch: the consumer stayed busy in that batch, its queue without a consumer,
/// until the process was restarted).
pub const ACK_TIMEOUT: Duration = Duration::from_secs(10);

/// Acknowledges one delivery taken without a [`BatchSource`] (a `basic.get`); a
/// batch source's deliveries go through [`BatchSource::ack`], which knows what a
/// `multiple` acknowledgement may cover.
/// An acker lapin reports as unusable (its channel is gone) is a lost connection: the
/// session ends and the broker hands the delivery out again, instead of lapse counting
/// it as done and publishing or parking it a second time. An ack not handed to the
/// connection within [`ACK_TIMEOUT`] ends the session the same way (if it did reach
/// the broker after all, nothing is delivered twice; if not, the delivery comes back
/// and is decided again, which the guarded close makes harmless).
pub async fn ack(delivery: &Delivery) -> Result<(), BrokerError> {
    ack_with(delivery, false).await
}

/// Acknowledges `delivery`, with every unacknowledged delivery of its channel
/// below it when `multiple`.
async fn ack_with(delivery: &Delivery, multiple: bool) -> Result<(), BrokerError> {
    let options = BasicAckOptions { multiple };
    let acked = tokio::time::timeout(ACK_TIMEOUT, delivery.acker.ack(options))
        .await
        .map_err(|_| BrokerError::AckTimeout { after: ACK_TIMEOUT })?
        .map_err(BrokerError::amqp("basic.ack"))?;
    if acked {
        Ok(())
    } else {
        Err(BrokerError::ConnectionLost)
    }
}

/// How many of `tags` (ascending) a `multiple` acknowledgement of the last of them
/// may cover: the longest run from the lowest unacknowledged tag on in which every
/// unacknowledged tag is one of `tags`. Zero when the lowest unacknowledged delivery is
/// not among them.
fn covered_prefix<'a>(
    unacked: impl Iterator<Item = &'a u64>,
    tags: impl Iterator<Item = u64>,
) -> usize {
    unacked
        .zip(tags)
        .take_while(|(held, tag)| **held == *tag)
        .count()
}

#[cfg(test)]
mod tests {
    use super::covered_prefix;
    use std::collections::BTreeSet;

    fn covered(unacked: &[u64], tags: &[u64]) -> usize {
        let unacked: BTreeSet<u64> = unacked.iter().copied().collect();
        covered_prefix(unacked.iter(), tags.iter().copied())
    }

    #[test]
    fn a_multiple_ack_covers_only_a_run_without_other_unacked_deliveries() {
        // The whole batch and nothing else outstanding: all of it.
        assert_eq!(covered(&[5, 6, 7], &[5, 6, 7]), 3);
        // A held delivery below the batch: none of it.
        assert_eq!(covered(&[2, 5, 6, 7], &[5, 6, 7]), 0);
        // One in the middle kept back (held, failed publish): up to it.
        assert_eq!(covered(&[5, 6, 7, 8], &[5, 6, 8]), 2);
        // Held ones above the batch do not matter.
        assert_eq!(covered(&[5, 6, 9], &[5, 6]), 2);
        // A tag the source does not know stops the run (never over-acknowledge).
        assert_eq!(covered(&[5, 7], &[5, 6, 7]), 1);
        assert_eq!(covered(&[], &[1, 2]), 0);
        assert_eq!(covered(&[1, 2], &[]), 0);
    }
}

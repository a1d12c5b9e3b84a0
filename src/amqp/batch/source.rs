//! One consumer and the deliveries it holds back: [`BatchSource::next`] waits for the
//! first delivery, takes whatever else arrives within the window, and polls the held
//! ones (due again at a moment) together with the broker's. It keeps the hold limit's
//! invariant (see the module above): a hold that would end past it is refused and the
//! delivery listed as overdue for the session to renew.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::time::DelayQueue;

use super::ACK_TIMEOUT;
use crate::amqp::broker::{self, BrokerError};

/// A consumer on one queue plus the deliveries held back until a moment (held
/// timeouts, kept publishes).
pub struct BatchSource {
    consumer: lapin::Consumer,
    pub(super) queue: String,
    prefetch: u16,
    held: DelayQueue<Delivery>,
    /// The tags of every delivery handed out and not acknowledged yet (held ones
    /// included), each with when it arrived: what a `multiple` acknowledgement may
    /// cover, and how long each has been kept.
    pub(super) unacked: BTreeMap<u64, Instant>,
    /// The longest a delivery is kept unacknowledged ([`Endpoint::hold_limit`]).
    hold_limit: Duration,
    /// The last moment lapin's buffer of this consumer was seen empty: every delivery
    /// read since arrived no earlier, so its age is counted from here (a delivery can
    /// wait in that buffer, behind a prefetch's worth of others, before it is read).
    empty_at: Instant,
    /// When each of the latest settlements (acknowledgements, nacks) happened, by its
    /// running number: the broker sends delivery `n` only once `n - prefetch` of them
    /// were made, which bounds its arrival from below in a backlog too.
    settled: std::collections::VecDeque<(u64, Instant)>,
    settlements: u64,
    /// Deliveries a hold would have kept past `hold_limit`: to renew.
    pub(super) overdue: Vec<Delivery>,
    /// How long any reply of the broker on this channel is waited for.
    reply_timeout: Duration,
    pub channel: lapin::Channel,
}

/// See [`BatchSource::arrived`]; over the fields it reads, so that it can be used
/// while the delay queue is borrowed.
fn arrival(
    settled: &mut std::collections::VecDeque<(u64, Instant)>,
    empty_at: Instant,
    prefetch: u16,
    tag: u64,
) -> Instant {
    let mut at = empty_at;
    if let Some(needed) = tag.checked_sub(u64::from(prefetch)) {
        while settled.front().is_some_and(|(n, _)| *n < needed) {
            settled.pop_front();
        }
        if let Some((n, when)) = settled.front()
            && *n == needed
        {
            at = at.max(*when);
        }
    }
    at
}

/// A delivery whose hold limit is closer than this is renewed rather than held.
const MIN_HOLD_BEFORE_RENEWAL: Duration = Duration::from_millis(100);

/// How long a consumer waits without any delivery before it checks whether its queue
/// holds ready messages nonetheless.
pub const IDLE_CHECK: Duration = Duration::from_secs(10);

impl BatchSource {
    /// Opens a channel with `prefetch` and starts consuming `queue`; each step waits
    /// at most `reply_timeout` for the broker's reply. No delivery is held past
    /// `hold_limit` from its arrival.
    pub async fn open(
        conn: &lapin::Connection,
        queue: &str,
        prefetch: u16,
        reply_timeout: Duration,
        hold_limit: Duration,
    ) -> Result<Self, BrokerError> {
        // Before anything is asked: no delivery can have arrived earlier.
        let opened_at = Instant::now();
        let channel = broker::open_channel_within(conn, reply_timeout).await?;
        let qos = channel.basic_qos(prefetch, BasicQosOptions::default());
        broker::within(reply_timeout, "basic.qos", async {
            qos.await.map_err(BrokerError::amqp("basic.qos"))
        })
        .await?;
        let consume = channel.basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        );
        let consumer = broker::within(reply_timeout, "basic.consume", async {
            consume.await.map_err(BrokerError::amqp("basic.consume"))
        })
        .await?;
        Ok(Self {
            consumer,
            queue: queue.to_string(),
            prefetch,
            held: DelayQueue::new(),
            unacked: BTreeMap::new(),
            hold_limit,
            empty_at: opened_at,
            settled: std::collections::VecDeque::new(),
            settlements: 0,
            overdue: Vec::new(),
            reply_timeout,
            channel,
        })
    }

    /// Keeps `delivery` unacknowledged and hands it out again with a batch at `until`,
    /// unless that is past the hold limit counted from its arrival: then it is set
    /// aside for [`super::ConsumerSession::renew_overdue`], which the session loop runs after
    /// each batch.
    pub fn hold(&mut self, delivery: Delivery, until: Instant) {
        let last = self.kept_until(&delivery);
        if until <= last {
            self.held.insert_at(delivery, until);
        } else if last > Instant::now() + MIN_HOLD_BEFORE_RENEWAL {
            // Held as long as it may be, then decided again: only a delivery at its
            // limit is renewed, so a long back-off never renews one again and again.
            self.held.insert_at(delivery, last);
        } else {
            self.overdue.push(delivery);
        }
    }

    /// The last moment `delivery` may still be unacknowledged.
    fn kept_until(&self, delivery: &Delivery) -> Instant {
        let arrived = self
            .unacked
            .get(&delivery.delivery_tag)
            .copied()
            .unwrap_or_else(Instant::now);
        arrived + self.hold_limit
    }

    /// True when some delivery of this source (in the batch at hand, held, or kept)
    /// reaches its hold limit within `margin`: a handler retrying in place must hand
    /// its deliveries back to the session (hold them) instead of waiting longer.
    /// The margin is at most a quarter of the hold limit, so a delivery that arrived
    /// fresh is always worked on for three quarters of it first.
    pub fn limit_near(&self, margin: Duration) -> bool {
        let margin = margin.min(self.hold_limit / 4);
        self.unacked
            .values()
            .min()
            .is_some_and(|oldest| Instant::now() + margin >= *oldest + self.hold_limit)
    }

    /// The earliest moment delivery `tag` can have arrived: after lapin's buffer was
    /// last seen empty, and after the settlement that gave the broker room to send it.
    fn arrived(&mut self, tag: u64) -> Instant {
        arrival(&mut self.settled, self.empty_at, self.prefetch, tag)
    }

    /// Records that `tag` was settled (acknowledged or given back) now.
    pub(super) fn settle(&mut self, tag: u64) {
        self.unacked.remove(&tag);
        self.settlements += 1;
        self.settled.push_back((self.settlements, Instant::now()));
        // Only the last prefetch's worth can still matter.
        while self.settled.len() > usize::from(self.prefetch) + 1 {
            self.settled.pop_front();
        }
    }

    /// Gives `delivery` back to the queue (`basic.nack`, requeue): the last resort for
    /// an overdue delivery whose copy could not be published. It costs the message a
    /// delivery, where the broker's consumer timeout would cost one to every
    /// unacknowledged delivery of the channel.
    pub(super) async fn requeue(&mut self, delivery: &Delivery) -> Result<(), BrokerError> {
        let options = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        let nacked = tokio::time::timeout(ACK_TIMEOUT, delivery.acker.nack(options))
            .await
            .map_err(|_| BrokerError::AckTimeout { after: ACK_TIMEOUT })?
            .map_err(BrokerError::amqp("basic.nack"))?;
        if !nacked {
            return Err(BrokerError::ConnectionLost);
        }
        self.settle(delivery.delivery_tag);
        Ok(())
    }

    /// How many deliveries are held.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The next batch; `Ok(None)` once `token` is cancelled.
    pub async fn next(
        &mut self,
        size: usize,
        window: Duration,
        token: &CancellationToken,
    ) -> Result<Option<Vec<Delivery>>, BrokerError> {
        // An empty delay queue answers `None` at once: that branch is then disabled
        // for this `select!`, and nothing is held meanwhile (holds are added between
        // batches, by the caller).
        // Shutdown first, whatever is buffered (it goes back to the queue on close).
        if token.is_cancelled() {
            return Ok(None);
        }
        let mut idle_with_ready = 0;
        // Whether lapin's buffer is empty now (then whatever is read later arrived
        // later); the clock is read before the look, so the stamp is never too new.
        let looked_at = Instant::now();
        let ready_now = self.consumer.next().now_or_never();
        if ready_now.is_none() {
            self.empty_at = looked_at;
        }
        let first = match ready_now {
            Some(next) => {
                let d = Self::unwrap(next)?;
                let arrived = self.arrived(d.delivery_tag);
                self.unacked.insert(d.delivery_tag, arrived);
                Some(d)
            }
            None => None,
        };
        let first = if let Some(d) = first {
            d
        } else {
            loop {
                let held = &mut self.held;
                tokio::select! {
                    biased;
                    _ = token.cancelled() => return Ok(None),
                    Some(d) = std::future::poll_fn(|cx| held.poll_expired(cx)) => break d.into_inner(),
                    next = self.consumer.next() => {
                        let d = Self::unwrap(next)?;
                        let arrived = self.arrived(d.delivery_tag);
                    self.unacked.insert(d.delivery_tag, arrived);
                        break d;
                    }
                    _ = tokio::time::sleep(IDLE_CHECK) => {
                        self.empty_at = Instant::now();
                        // Nothing arrived for a while although there is room in prefetch:
                        // does the queue hold ready messages the broker does not deliver
                        // (a consumer attached while a quorum queue's leader changed can
                        // stay silent)? Twice in a row: the session ends and re-attaches.
                        if self.held.len() >= usize::from(self.prefetch) {
                            idle_with_ready = 0;
                            continue;
                        }
                        // Shutdown is watched meanwhile (the declare may wait up to the
                        // reply timeout).
                        let ready = tokio::select! {
                            _ = token.cancelled() => return Ok(None),
                            ready = self.ready() => ready?,
                        };
                        idle_with_ready = if ready > 0 { idle_with_ready + 1 } else { 0 };
                        if idle_with_ready >= 2 {
                            return Err(BrokerError::ConsumerSilent { queue: self.queue.clone(), ready });
                        }
                    }
                }
            }
        };
        let held = &mut self.held;
        let mut batch = vec![first];
        let until = Instant::now() + window;
        while batch.len() < size {
            tokio::select! {
                biased;
                Some(d) = std::future::poll_fn(|cx| held.poll_expired(cx)) => batch.push(d.into_inner()),
                next = self.consumer.next() => {
                    let d = Self::unwrap(next)?;
                    let arrived =
                        arrival(&mut self.settled, self.empty_at, self.prefetch, d.delivery_tag);
                    self.unacked.insert(d.delivery_tag, arrived);
                    batch.push(d);
                }
                _ = tokio::time::sleep_until(until) => {
                    // The consumer was polled first and had nothing: its buffer is empty.
                    self.empty_at = Instant::now();
                    break;
                }
                // A long window (up to 10 s) must not hold up a shutdown: what has
                // arrived is handled now.
                _ = token.cancelled() => break,
            }
        }
        Ok(Some(batch))
    }

    /// Messages ready in the consumed queue (a passive declare on this channel).
    async fn ready(&self) -> Result<u32, BrokerError> {
        let declare = broker::passive_declare(&self.channel, &self.queue);
        let state = broker::within(self.reply_timeout, "queue.declare", declare).await?;
        Ok(state.existing(&self.queue)?.messages)
    }

    fn unwrap(next: Option<lapin::Result<Delivery>>) -> Result<Delivery, BrokerError> {
        match next {
            Some(Ok(d)) => Ok(d),
            Some(Err(e)) => Err(BrokerError::amqp("consume")(e)),
            None => Err(BrokerError::ConsumerEnded),
        }
    }

    /// Stops consuming and closes the channel; unacknowledged deliveries go back to
    /// the queue.
    pub async fn close(self) {
        broker::close_channel_quietly(&self.channel, "shutting down").await;
    }
}

#[cfg(test)]
mod tests {
    use super::arrival;
    use std::collections::VecDeque;
    use std::time::Duration;
    use tokio::time::Instant;

    #[test]
    fn a_delivery_arrived_no_earlier_than_the_settlement_that_made_room_for_it() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        // Prefetch 2; settlements 1..=3 at 10, 20, 30 ms; the buffer last seen empty
        // at 5 ms.
        let mut settled: VecDeque<(u64, Instant)> = [(1, at(10)), (2, at(20)), (3, at(30))].into();
        // Deliveries 1 and 2 fit in the prefetch: only the empty buffer bounds them.
        assert_eq!(arrival(&mut settled, at(5), 2, 2), at(5));
        // Delivery 4 needed the second settlement.
        assert_eq!(arrival(&mut settled, at(5), 2, 4), at(20));
        // Delivery 5 the third; older settlements are dropped on the way.
        assert_eq!(arrival(&mut settled, at(5), 2, 5), at(30));
        assert_eq!(settled.len(), 1);
        // A buffer seen empty later wins.
        assert_eq!(arrival(&mut settled, at(40), 2, 5), at(40));
        // A settlement not recorded (forgotten): the empty buffer's bound alone.
        assert_eq!(arrival(&mut settled, at(5), 2, 9), at(5));
    }
}

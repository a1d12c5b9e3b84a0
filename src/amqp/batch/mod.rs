//! Gathering deliveries into batches: wait for the first, then take whatever else
//! arrives within a short window, up to a size. Used by every consumer so that one
//! database round trip serves many deliveries.
//!
//! Held deliveries (a timeout shorter than the smallest tier, a locked row, a publish
//! to retry) stay in the source's own delay queue, polled by `next` together with the
//! broker's deliveries: no task outlives the session, and closing the session (or
//! cancelling its token) drops them unacknowledged, so the broker delivers them again.
//!
//! Invariant: no delivery stays unacknowledged longer than the endpoint's hold limit
//! (half the broker's consumer timeout, past which the broker would close the channel
//! and hand every unacknowledged delivery of it out again, each one's delivery count
//! raised). A hold that would end later is refused; the session then replaces the
//! delivery by a fresh copy of itself in the same queue, confirmed before the original
//! is acknowledged ([`ConsumerSession::renew_overdue`]).

use std::time::Duration;

use lapin::message::Delivery;
use tokio_util::sync::CancellationToken;

use crate::amqp::broker::{BrokerError, Endpoint};
use crate::observe::stats::{Outcome, Stats};
use crate::runtime::health::{Busy, Health};

mod ack;
mod session;
mod source;
pub use ack::{ACK_TIMEOUT, ack};
pub use session::ConsumerSession;
pub use source::BatchSource;

/// What a consuming component does with each batch; the session loop around it is
/// [`consume`], the same for every consumer.
pub(crate) trait BatchHandler {
    /// Handles one batch. `busy` marks the unit of work for the liveness check (wrap
    /// waits that are not a stall in `busy.idle_while`). An error ends the session;
    /// unacknowledged deliveries then return to the queue.
    async fn handle(
        &mut self,
        batch: Vec<Delivery>,
        session: &mut ConsumerSession,
        token: &CancellationToken,
        busy: &Busy,
    ) -> Result<(), BrokerError>;
}

/// How a component takes deliveries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batching {
    pub prefetch: u16,
    pub batch_size: usize,
    pub batch_window: Duration,
}

impl Batching {
    /// From `[worker]`; a batch is never larger than the prefetch.
    pub fn from_config(w: &crate::config::WorkerConfig) -> Self {
        Self {
            prefetch: w.prefetch,
            batch_size: w.batch_size.min(usize::from(w.prefetch)),
            batch_window: w.batch_window,
        }
    }

    /// The stock releaser's: `[worker]`'s sizes with `worker.release_batch_window`.
    pub fn for_releaser(w: &crate::config::WorkerConfig) -> Self {
        Self {
            batch_window: w.release_batch_window,
            ..Self::from_config(w)
        }
    }
}

/// Where and how a component consumes.
pub struct Consuming<'a> {
    pub endpoint: &'a Endpoint,
    /// `worker` or `releaser`: the connection names' role.
    pub role: &'a str,
    pub prefix: &'a str,
    /// The component's name on `/health`.
    pub component: &'static str,
    pub queue: String,
    pub batching: Batching,
    /// Counts the deliveries renewed or given back at the hold limit.
    pub stats: Stats,
}

/// Consumes as `how` says until `token` is cancelled, reconnecting with back-off
/// ([`crate::runtime::backoff::reconnecting`]); each session gets a fresh handler
/// from `handler`. The whole `run` of the consumer and of the releaser.
pub(crate) async fn consume_reconnecting<H, F>(
    how: Consuming<'_>,
    health: &Health,
    token: &CancellationToken,
    mut handler: F,
) -> Result<(), crate::runtime::supervisor::Fatal>
where
    H: BatchHandler,
    F: FnMut() -> H,
{
    let how = &how;
    crate::runtime::backoff::reconnecting(how.component, health, token, || {
        let mut batches = handler();
        async move { consume(how, health, token, &mut batches).await }
    })
    .await
}

/// One consuming session: opens it, hands each batch to `handler` until `token` is
/// cancelled or something fails, then closes it (held and unacknowledged deliveries
/// return to the queue). Run it under [`crate::runtime::backoff::reconnecting`].
pub(crate) async fn consume<H: BatchHandler>(
    how: &Consuming<'_>,
    health: &Health,
    token: &CancellationToken,
    handler: &mut H,
) -> Result<(), BrokerError> {
    let mut session = ConsumerSession::open(
        how.endpoint,
        how.role,
        how.prefix,
        how.component,
        health,
        &how.queue,
        how.batching.prefetch,
    )
    .await?;
    let result = loop {
        let batch = match session
            .source
            .next(how.batching.batch_size, how.batching.batch_window, token)
            .await
        {
            Ok(Some(batch)) => batch,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        let busy = health.busy(how.component);
        if let Err(e) = handler.handle(batch, &mut session, token, &busy).await {
            break Err(e);
        }
        // On shutdown the close gives every unacknowledged delivery back anyway.
        if token.is_cancelled() {
            continue;
        }
        match session.renew_overdue().await {
            Ok((renewed, given_back)) => {
                let n = |count: usize| u64::try_from(count).unwrap_or(u64::MAX);
                how.stats.record(Outcome::Renewed, n(renewed));
                how.stats.record(Outcome::GivenBack, n(given_back));
            }
            Err(e) => break Err(e),
        }
    };
    session.close().await;
    result
}

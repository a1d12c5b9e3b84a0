//! The relay's loop: rounds on one broker connection, reconnecting as needed, woken by
//! the outbox's notifications (at once, or within `relay.gather` for intents due
//! later) with a polling fallback.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::amqp::broker::{self, BrokerError, Endpoint};
use crate::amqp::publishing::BlockedWatch;
use crate::config::Secret;
use crate::runtime::backoff::Backoff;
use crate::runtime::health::Health;
use crate::runtime::supervisor::Fatal;

use super::notifications::{self, Wakes};
use super::{Relay, RelayError, RelayOutcome, Round, backlog};

impl Relay {
    /// Runs rounds until `token` is cancelled, reconnecting to the broker as needed.
    pub async fn run(
        self,
        broker: Endpoint,
        listen_url: Secret,
        poll: Duration,
        health: Health,
        token: CancellationToken,
    ) -> Result<(), Fatal> {
        let wake = Arc::new(Wakes::default());
        // A gathering round pending when a session ended (when it began): the next
        // session's first round counts that wait as waited, not as lag.
        let carried: Mutex<Option<Instant>> = Mutex::new(None);
        // The LISTEN connection and the backlog gauge belong to this instance: they
        // stop with `token`, and dropping the set (the supervisor abandoning this
        // instance at the drain limit) aborts them.
        let mut helpers = JoinSet::new();
        helpers.spawn(notifications::listen(
            listen_url,
            self.pool.clone(),
            self.shard_label.clone(),
            wake.clone(),
            token.clone(),
        ));
        helpers.spawn(backlog::run(
            self.pool.clone(),
            self.shard_label.clone(),
            token.clone(),
        ));
        let result = crate::runtime::backoff::reconnecting(self.component, &health, &token, || {
            self.session(&broker, &wake, &carried, poll, &health, &token)
        })
        .await;
        helpers.shutdown().await;
        result
    }

    /// Rounds on one broker connection; returns on a broker error (to reconnect) or
    /// when cancelled.
    async fn session(
        &self,
        broker: &Endpoint,
        wake: &Wakes,
        carried: &Mutex<Option<Instant>>,
        poll: Duration,
        health: &Health,
        token: &CancellationToken,
    ) -> Result<(), BrokerError> {
        let name = match self.shard_label {
            Some(_) => format!("lapse relay {} shard {}", self.names.prefix, self.shard),
            None => format!("lapse relay {}", self.names.prefix),
        };
        let busy = health.busy(self.component);
        let conn = broker.connect(&name).await?;
        let _blocked = BlockedWatch::start(&conn, &name, self.component, health);
        let publisher = broker.publisher(&conn).await?;
        drop(busy);
        health.up(self.component);
        let mut backoff = Backoff::new();
        // When the pending gathering round began (a `gather` wake-up), if one is pending.
        let mut gathering: Option<Instant> = None;
        // A session starts with a round of everything.
        let mut next = Round::All {
            waited: since(take(carried)),
        };
        let result = loop {
            if token.is_cancelled() {
                break Ok(());
            }
            // Notice a dropped connection while idle, not only at the next publish.
            if !publisher.is_usable() {
                break Err(BrokerError::ConnectionLost);
            }
            // A broker alarm blocks this connection: wait it out rather than publish into
            // it (a publish that gets stuck anyway ends in a confirm timeout; its rows stay).
            if conn.status().blocked() {
                backoff.sleep(token).await;
                continue;
            }
            // The gathering round is due: it goes first, whatever else is going on
            // (a run of full urgent rounds included).
            if let Some(began) = gathering.filter(|b| b.elapsed() >= self.gather) {
                next = Round::All {
                    waited: began.elapsed(),
                };
                gathering = None;
            }
            let busy = health.busy(self.component);
            let round = self.round(&conn, &publisher, next).await;
            drop(busy);
            match round {
                // Refused and returned rows were rescheduled: no reason to slow down
                // the rows behind them. A full round goes on at once, of the same kind
                // (its rows waited too).
                Ok(RelayOutcome::Published {
                    sent,
                    refused,
                    returned,
                }) => {
                    backoff.reset();
                    if sent + refused + returned < self.batch_size as usize {
                        next = wait(wake, poll, self.gather, &mut gathering, token).await;
                    }
                }
                Ok(RelayOutcome::Idle) => {
                    next = wait(wake, poll, self.gather, &mut gathering, token).await
                }
                Err(RelayError::Broker(e)) => break Err(e),
                Err(RelayError::Db(e)) => {
                    // The next round takes everything: whatever waited, waited long enough.
                    next = Round::All {
                        waited: since(gathering.take()),
                    };
                    tracing::warn!(component = self.component, error = %e, "relay: database error; retrying");
                    backoff.sleep(token).await;
                }
            }
        };
        if let Ok(mut carried) = carried.lock() {
            *carried = gathering;
        }
        broker::close_quietly(&conn, "relay stopping").await;
        result
    }
}

/// What `carried` holds, leaving `None`.
fn take(carried: &Mutex<Option<Instant>>) -> Option<Instant> {
    carried.lock().ok().and_then(|mut c| c.take())
}

/// How long ago a gathering began (none: nothing waited on purpose).
fn since(began: Option<Instant>) -> Duration {
    began.map_or(Duration::ZERO, |b| b.elapsed())
}

/// Until the next round is due, and which rows it takes: everything at once on an
/// urgent wake-up; everything within `gather` of a wake-up for intents due later (more
/// of their route meet in the outbox meanwhile, and every row due by then leaves in
/// that round); everything at the poll interval otherwise. An urgent wake-up while a
/// gathering round is pending (`gathering`: when it began) is answered at once with a
/// round of the urgent rows only, and the gathering round stays due when it was.
async fn wait(
    wake: &Wakes,
    poll: Duration,
    gather: Duration,
    gathering: &mut Option<Instant>,
    token: &CancellationToken,
) -> Round {
    let began = match *gathering {
        Some(began) => began,
        None => {
            tokio::select! {
                // A gathering wake-up first: when both kinds are pending (heard in one
                // read, while a round ran), the gathering begins and the urgent wake-up
                // is answered below by a round of the urgent rows only. Taken the other
                // way, a round of everything would cut the gathering's packs short.
                biased;
                _ = wake.gather.notified() => {}
                _ = wake.now.notified() => return Round::All { waited: Duration::ZERO },
                _ = tokio::time::sleep(poll) => return Round::All { waited: Duration::ZERO },
                _ = token.cancelled() => return Round::All { waited: Duration::ZERO },
            }
            Instant::now()
        }
    };
    *gathering = Some(began);
    tokio::select! {
        // Due first: an urgent wake-up stored meanwhile must not put it off.
        biased;
        _ = tokio::time::sleep_until(began + gather) => {}
        _ = token.cancelled() => {}
        _ = wake.now.notified() => return Round::Urgent { waited: began.elapsed() },
    }
    *gathering = None;
    Round::All {
        waited: began.elapsed(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLL: Duration = Duration::from_secs(30);

    /// Both wake-ups pending when the relay comes to wait (heard in one read while a
    /// round ran): the gathering begins and the urgent rows leave alone, at once.
    #[tokio::test(start_paused = true)]
    async fn an_urgent_and_a_gathering_wake_up_together_begin_a_gathering_and_an_urgent_round() {
        let token = CancellationToken::new();
        let gather = Duration::from_secs(1);
        for _ in 0..20 {
            let wake = Wakes::default();
            wake.gather.notify_one();
            wake.now.notify_one();
            let mut gathering = None;
            let round = wait(&wake, POLL, gather, &mut gathering, &token).await;
            // At once: the urgent round waited for nothing.
            assert_eq!(
                round,
                Round::Urgent {
                    waited: Duration::ZERO
                }
            );
            assert!(gathering.is_some(), "the gathering stays pending");
            // And the gathering round comes when it is due, not later.
            let began = gathering.unwrap();
            let round = wait(&wake, POLL, gather, &mut gathering, &token).await;
            assert!(matches!(round, Round::All { .. }), "{round:?}");
            assert!(gathering.is_none());
            assert_eq!(began.elapsed(), gather);
        }
    }

    /// An urgent wake-up alone, nothing gathering: a round of everything at once.
    #[tokio::test(start_paused = true)]
    async fn an_urgent_wake_up_alone_runs_a_round_of_everything_at_once() {
        let token = CancellationToken::new();
        let wake = Wakes::default();
        wake.now.notify_one();
        let mut gathering = None;
        let started = Instant::now();
        let gather = Duration::from_secs(1);
        let round = wait(&wake, POLL, gather, &mut gathering, &token).await;
        assert_eq!(
            round,
            Round::All {
                waited: Duration::ZERO
            }
        );
        assert!(gathering.is_none());
        assert_eq!(started.elapsed(), Duration::ZERO);
    }
}

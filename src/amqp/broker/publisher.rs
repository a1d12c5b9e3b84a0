//! Publishing with confirms: a confirm channel whose every publish is `mandatory` and
//! bounded by the confirm timeout, and the attribution of the broker's returns to the
//! publishes they came from.

use std::future::Future;
use std::time::Duration;

use lapin::message::BasicReturnMessage;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio::time::Instant;

use super::{BrokerError, DEFAULT_CONFIRM_TIMEOUT};

/// Waits for one step of a publish — handing its frames to the connection, or the
/// broker's confirm — until `deadline`. A publish not confirmed by then counts as not
/// delivered; the caller retries it, on a fresh channel (this one's state is unknown:
/// the frames may still go out later, which at worst makes a duplicate).
async fn by_deadline<T>(
    deadline: Instant,
    after: Duration,
    op: &'static str,
    step: impl Future<Output = lapin::Result<T>>,
) -> Result<T, BrokerError> {
    match tokio::time::timeout_at(deadline, step).await {
        Ok(result) => result.map_err(BrokerError::amqp(op)),
        Err(_) => Err(BrokerError::ConfirmTimeout { after }),
    }
}

/// One message to publish: where to, its body and its properties. Every publish lapse
/// makes (relay, consumer, releaser, parked replays) is one of these.
#[derive(Clone, Debug)]
pub struct Outgoing {
    pub exchange: String,
    pub routing_key: String,
    pub body: Vec<u8>,
    pub properties: BasicProperties,
}

impl Outgoing {
    pub fn new(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        body: impl Into<Vec<u8>>,
        properties: BasicProperties,
    ) -> Self {
        Self {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            body: body.into(),
            properties,
        }
    }
}

/// A channel in confirm mode.
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
    confirm_timeout: Duration,
}

impl Publisher {
    /// A confirm channel opened on `conn` (neither step bounded: see
    /// [`super::Endpoint::publisher`] for the bounded way).
    pub async fn new(conn: &Connection) -> Result<Self, BrokerError> {
        Self::on(super::open_channel(conn).await?).await
    }

    /// Puts `channel` in confirm mode.
    pub async fn on(channel: Channel) -> Result<Self, BrokerError> {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(BrokerError::amqp("confirm.select"))?;
        Ok(Self {
            channel,
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
        })
    }

    /// How long each publish may wait for its confirm (`broker.confirm_timeout`).
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    pub fn is_usable(&self) -> bool {
        self.channel.status().connected()
    }

    /// Publishes (mandatory) and waits (at most the confirm timeout) for the broker's
    /// confirm.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), BrokerError> {
        let deadline = Instant::now() + self.confirm_timeout;
        let sent = self.channel.basic_publish(
            exchange.into(),
            routing_key.into(),
            MANDATORY,
            body,
            properties,
        );
        let sent = by_deadline(deadline, self.confirm_timeout, "basic.publish", sent).await?;
        let confirm = by_deadline(deadline, self.confirm_timeout, "confirm", sent).await?;
        let (result, returned) = outcome(exchange, routing_key, confirm);
        match returned {
            Some(_) => Err(BrokerError::Unroutable {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
            }),
            None => result,
        }
    }

    /// Publishes many messages (mandatory), pipelining their confirms; the result of
    /// each in order. All of them share one confirm timeout, counted from the call.
    pub async fn publish_all(&self, messages: Vec<Outgoing>) -> Vec<Result<(), BrokerError>> {
        let (after, deadline) = (self.confirm_timeout, Instant::now() + self.confirm_timeout);
        let mut pending = Vec::with_capacity(messages.len());
        for message in messages {
            let Outgoing {
                exchange,
                routing_key,
                body,
                properties,
            } = message;
            if Instant::now() >= deadline {
                // Out of time: do not hand more frames to a connection that is stuck.
                pending.push((
                    exchange,
                    routing_key,
                    body,
                    Err(BrokerError::ConfirmTimeout { after }),
                ));
                continue;
            }
            let sent = self.channel.basic_publish(
                exchange.as_str().into(),
                routing_key.as_str().into(),
                MANDATORY,
                &body,
                properties,
            );
            let sent = by_deadline(deadline, after, "basic.publish", sent).await;
            pending.push((exchange, routing_key, body, sent));
        }
        let mut results = Vec::with_capacity(pending.len());
        let mut returned = Vec::new();
        let mut sent = Vec::with_capacity(pending.len());
        for (exchange, routing_key, body, confirm) in pending {
            let result = match confirm {
                Err(e) => Err(e),
                Ok(confirm) => match by_deadline(deadline, after, "confirm", confirm).await {
                    Err(e) => Err(e),
                    Ok(c) => {
                        let (result, message) = outcome(&exchange, &routing_key, c);
                        returned.extend(message);
                        result
                    }
                },
            };
            results.push(result);
            sent.push((exchange, routing_key, body));
        }
        attribute_returns(&sent, &mut results, returned);
        results
    }
}

/// Every publish asks the broker to return what it cannot route.
const MANDATORY: BasicPublishOptions = BasicPublishOptions {
    mandatory: true,
    immediate: false,
};

/// A confirm's verdict, and the message the broker returned with it, if any.
fn outcome(
    exchange: &str,
    routing_key: &str,
    confirm: Confirmation,
) -> (Result<(), BrokerError>, Option<BasicReturnMessage>) {
    let result = if confirm.is_nack() {
        Err(BrokerError::Nacked {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        })
    } else {
        Ok(())
    };
    (result, confirm.take_message())
}

/// Marks as unroutable the publish each returned message came from. lapin hands a
/// return to whichever confirm of a multiple-ack completes first, which need not be
/// the returned publish's own, so the match is by content: exchange, routing key and
/// body (identical publishes are interchangeable).
fn attribute_returns(
    sent: &[(String, String, Vec<u8>)],
    results: &mut [Result<(), BrokerError>],
    returned: Vec<BasicReturnMessage>,
) {
    for message in returned {
        let d = &message.delivery;
        let matching = sent.iter().zip(results.iter()).position(|((e, k, b), r)| {
            !matches!(r, Err(BrokerError::Unroutable { .. }))
                && d.exchange.as_str() == e
                && d.routing_key.as_str() == k
                && d.data == *b
        });
        match matching {
            Some(i) => {
                results[i] = Err(BrokerError::Unroutable {
                    exchange: sent[i].0.clone(),
                    routing_key: sent[i].1.clone(),
                })
            }
            None => tracing::error!(
                exchange = %d.exchange,
                routing_key = %d.routing_key,
                "the broker returned a publish that matches none just sent"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::message::Delivery;

    fn returned(exchange: &str, key: &str, body: &[u8]) -> BasicReturnMessage {
        BasicReturnMessage {
            delivery: Delivery::mock(0, exchange.into(), key.into(), false, body.to_vec()),
            reply_code: 312,
            reply_text: "NO_ROUTE".into(),
        }
    }

    fn sent(exchange: &str, key: &str, body: &[u8]) -> (String, String, Vec<u8>) {
        (exchange.into(), key.into(), body.to_vec())
    }

    #[test]
    fn a_return_marks_the_publish_it_came_from_whichever_confirm_carried_it() {
        let published = [
            sent("p.events", "stock.release", b"a"),
            sent("p.due", "due", b"b"),
            sent("p.events", "stock.release", b"c"),
            sent("p.events", "stock.release", b"c"),
        ];
        let mut results: Vec<Result<(), BrokerError>> = (0..4).map(|_| Ok(())).collect();
        results[1] = Err(BrokerError::Nacked {
            exchange: "p.due".into(),
            routing_key: "due".into(),
        });
        let returns = vec![
            returned("p.events", "stock.release", b"c"),
            returned("p.events", "stock.release", b"c"),
        ];
        attribute_returns(&published, &mut results, returns);
        assert!(results[0].is_ok());
        assert!(matches!(results[1], Err(BrokerError::Nacked { .. })));
        for r in &results[2..] {
            assert!(
                matches!(r, Err(BrokerError::Unroutable { exchange, routing_key })
                    if exchange == "p.events" && routing_key == "stock.release"),
                "{r:?}"
            );
        }
    }

    #[test]
    fn a_return_that_matches_nothing_changes_nothing() {
        let published = [sent("p.events", "stock.release", b"a")];
        let mut results = vec![Ok(())];
        attribute_returns(
            &published,
            &mut results,
            vec![returned("p.events", "stock.release", b"other")],
        );
        assert!(results[0].is_ok());
    }
}

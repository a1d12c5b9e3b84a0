//! Acknowledgements in flight when the broker connection is reset (a node killed
//! under a consumer). lapin leaves some of them unresolved for good: without a bound a
//! consumer would wait in its batch forever, attached to nothing. Every ack lapse
//! makes ends within [`ACK_TIMEOUT`], with success or an error that ends the session.

use std::str::FromStr;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapse::amqp::batch::{ACK_TIMEOUT, ack};
use lapse::amqp::broker::{BrokerError, Endpoint, Publisher};
use lapse::config::Secret;
use tokio_util::sync::CancellationToken;

use crate::helpers::{amqp_url, unique};
use crate::tcp_proxy::{Mode, TcpProxy};

const MESSAGES: usize = 3_000;
/// Rounds of a race that lapin loses now and then (in one to five rounds of twenty
/// here; each such round waits out the bound).
const ROUNDS: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_in_flight_when_the_connection_is_reset_all_end_within_the_bound() {
    let direct = lapse::amqp::broker::connect(&Secret::new(amqp_url()), "lapse test acks")
        .await
        .unwrap();
    let publisher = Publisher::new(&direct).await.unwrap();
    let uri = lapin::uri::AMQPUri::from_str(&amqp_url()).unwrap();
    let upstream = (uri.authority.host.clone(), uri.authority.port);
    let (mut acked, mut failed, mut timed_out) = (0, 0, 0);
    for round in 0..ROUNDS {
        let queue = unique("acks");
        let setup = direct.create_channel().await.unwrap();
        // Gone a minute after its last use, also when this test fails mid-round.
        let mut arguments = FieldTable::default();
        arguments.insert("x-expires".into(), AMQPValue::LongInt(60_000));
        setup
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::default(),
                arguments,
            )
            .await
            .unwrap();
        for _ in 0..MESSAGES {
            publisher
                .channel()
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    Default::default(),
                    b"x",
                    Default::default(),
                )
                .await
                .unwrap();
        }

        let cut = CancellationToken::new();
        let proxy = TcpProxy::start(0, upstream.clone(), Mode::CutOn(cut.clone()));
        let url = format!(
            "amqp://{}:{}@127.0.0.1:{}/%2f",
            uri.authority.userinfo.username, uri.authority.userinfo.password, proxy.port
        );
        let conn = Endpoint::new(Secret::new(url))
            .connect("lapse test acks consumer")
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        channel
            .basic_qos(MESSAGES as u16, BasicQosOptions::default())
            .await
            .unwrap();
        let mut deliveries = channel
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        // Each delivery acknowledged at once, concurrently; the connection is reset
        // part-way (at a different point each round).
        let mut acks = tokio::task::JoinSet::new();
        let reset_after = 1_000 + round * 97;
        let mut received = 0;
        // Bounded too: a stream that neither delivers nor ends fails the test.
        while let Some(Ok(delivery)) =
            tokio::time::timeout(Duration::from_secs(60), deliveries.next())
                .await
                .expect("deliveries stopped without the stream ending")
        {
            received += 1;
            // Past the bound and some slack, the ack is taken for hung (and the test
            // fails) rather than waited for.
            acks.spawn(async move {
                tokio::time::timeout(ACK_TIMEOUT + Duration::from_secs(5), ack(&delivery)).await
            });
            if received == reset_after {
                cut.cancel();
            }
            if received == MESSAGES {
                break;
            }
        }
        while let Some(joined) = acks.join_next().await {
            match joined.unwrap() {
                Ok(Ok(())) => acked += 1,
                Ok(Err(BrokerError::AckTimeout { .. })) => timed_out += 1,
                Ok(Err(_)) => failed += 1,
                Err(_) => panic!("round {round}: an ack did not end within its bound"),
            }
        }
        drop(proxy);
        let _ = setup
            .queue_delete(queue.as_str().into(), Default::default())
            .await;
    }
    eprintln!(
        "{ROUNDS} rounds: {acked} acks done, {failed} failed at once, {timed_out} ended by the bound"
    );
    assert!(acked > 0 && failed > 0, "the resets happened mid-stream");
    lapse::amqp::broker::close_quietly(&direct, "done").await;
}

//! A broker that goes silent in the middle of a connection, as a frozen host does: the
//! TCP connection stays open and no reply comes. Every broker reply a session waits
//! for is bounded (by `broker.confirm_timeout`), so the session ends with an error
//! naming the step and its component connects again, instead of waiting forever.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lapse::amqp::batch::BatchSource;
use lapse::amqp::broker::{BrokerError, Endpoint};
use lapse::amqp::publishing::{Outgoing, PublishingConnection};
use lapse::config::Secret;

use crate::helpers::amqp_url;
use crate::tcp_proxy::{Mode, TcpProxy};

/// How long the tests let lapse wait for a reply.
const REPLY_TIMEOUT: Duration = Duration::from_secs(1);
/// Far longer than the bound: a wait that reaches it did not end on its own.
const HUNG: Duration = Duration::from_secs(30);

/// A proxy to the shared broker that goes silent when the returned switch is set, and
/// an endpoint that connects through it.
fn silent_broker() -> (TcpProxy, Arc<AtomicBool>, Endpoint) {
    let uri = lapin::uri::AMQPUri::from_str(&amqp_url()).unwrap();
    let upstream = (uri.authority.host.clone(), uri.authority.port);
    let frozen = Arc::new(AtomicBool::new(false));
    let proxy = TcpProxy::start(0, upstream, Mode::FreezeOn(frozen.clone()));
    let url = format!(
        "amqp://{}:{}@127.0.0.1:{}/{}",
        uri.authority.userinfo.username,
        uri.authority.userinfo.password,
        proxy.port,
        urlencoding(&uri.vhost)
    );
    let mut endpoint = Endpoint::new(Secret::new(url));
    endpoint.confirm_timeout = REPLY_TIMEOUT;
    (proxy, frozen, endpoint)
}

/// A topology with one tier, under a prefix of its own (nothing is declared).
fn one_tier() -> lapse::amqp::topology::Topology {
    let tiers = lapse::tier_file::TierFile::parse("tiers = [\"1s\"]\n").unwrap();
    lapse::amqp::topology::Topology::new(
        &lapse::names::Names::new(crate::helpers::unique("silent")),
        &tiers,
    )
}

fn urlencoding(vhost: &str) -> String {
    vhost.replace('%', "%25").replace('/', "%2f")
}

#[tokio::test]
async fn opening_a_confirm_channel_on_a_silent_broker_ends_within_the_confirm_timeout() {
    let (_proxy, frozen, endpoint) = silent_broker();
    let conn = endpoint
        .connect("lapse test silent publisher")
        .await
        .unwrap();
    // The connection works until the broker goes silent.
    endpoint.publisher(&conn).await.unwrap();
    frozen.store(true, Ordering::SeqCst);
    let opened = tokio::time::timeout(HUNG, endpoint.publisher(&conn))
        .await
        .expect("opening a confirm channel waited without a bound");
    match opened {
        Err(BrokerError::ReplyTimeout { op, after }) => {
            assert_eq!(op, "channel.open");
            assert_eq!(after, REPLY_TIMEOUT);
        }
        Err(other) => panic!("expected a reply timeout, got {other}"),
        Ok(_) => panic!("a confirm channel opened on a silent broker"),
    }
}

#[tokio::test]
async fn attaching_a_consumer_on_a_silent_broker_ends_within_the_reply_timeout() {
    let (_proxy, frozen, endpoint) = silent_broker();
    let conn = endpoint
        .connect("lapse test silent consumer")
        .await
        .unwrap();
    frozen.store(true, Ordering::SeqCst);
    let attached = tokio::time::timeout(
        HUNG,
        BatchSource::open(
            &conn,
            "lapse-test-silent",
            10,
            REPLY_TIMEOUT,
            Duration::from_secs(60),
        ),
    )
    .await
    .expect("attaching a consumer waited without a bound");
    match attached {
        Err(BrokerError::ReplyTimeout { op, .. }) => assert_eq!(op, "channel.open"),
        Err(other) => panic!("expected a reply timeout, got {other}"),
        Ok(_) => panic!("a consumer attached on a silent broker"),
    }
}

/// A publishing connection whose broker goes silent: the publish ends with a confirm
/// timeout, the next one with a reply timeout opening a fresh confirm channel, and
/// once the broker answers again the connection is replaced (the silent one would
/// never answer) and publishing works.
#[tokio::test]
async fn a_publishing_connection_replaces_a_connection_that_went_silent() {
    let (_proxy, frozen, endpoint) = silent_broker();
    let health = lapse::runtime::health::Health::default();
    let mut publishing =
        PublishingConnection::open(&endpoint, "lapse test silent publishing", "test", &health)
            .await
            .unwrap();
    // Mandatory and bound nowhere: the broker confirms it and returns it.
    let message = || {
        Outgoing::new(
            "amq.direct",
            "lapse-test-unbound",
            b"x".to_vec(),
            Default::default(),
        )
    };
    let answered = |r: &Result<(), BrokerError>| matches!(r, Err(BrokerError::Unroutable { .. }));
    let first = publishing.publish(message()).await;
    assert!(answered(&first), "{first:?}");

    frozen.store(true, Ordering::SeqCst);
    let unconfirmed = tokio::time::timeout(HUNG, publishing.publish(message()))
        .await
        .expect("bounded");
    assert!(
        matches!(unconfirmed, Err(BrokerError::ConfirmTimeout { .. })),
        "{unconfirmed:?}"
    );
    let reopened = tokio::time::timeout(HUNG, publishing.publish(message()))
        .await
        .expect("bounded");
    assert!(
        matches!(
            reopened,
            Err(BrokerError::ReplyTimeout {
                op: "channel.open",
                ..
            })
        ),
        "{reopened:?}"
    );

    // The broker answers new connections again; the silent one stays silent, so only
    // a replaced connection publishes. A few tries: on a loaded machine a step of the
    // fresh connection may itself take longer than the 1 s bound.
    frozen.store(false, Ordering::SeqCst);
    let mut tries = Vec::new();
    for _ in 0..5 {
        let again = tokio::time::timeout(HUNG, publishing.publish(message()))
            .await
            .expect("bounded");
        let done = answered(&again);
        tries.push(again);
        if done {
            break;
        }
    }
    assert!(
        tries.last().is_some_and(answered),
        "published on a fresh connection: {tries:?}"
    );
    publishing.close().await;
}

/// `lapse status` asks the broker for each queue's depth: on a connection that went
/// silent it fails with a reply timeout instead of hanging (a `--watch` would hang
/// for good).
#[tokio::test]
async fn queue_depths_on_a_silent_broker_fail_instead_of_hanging() {
    let (_proxy, frozen, endpoint) = silent_broker();
    let topology = one_tier();
    let conn = endpoint.connect("lapse test silent status").await.unwrap();
    frozen.store(true, Ordering::SeqCst);
    let depths = tokio::time::timeout(
        HUNG,
        lapse::status::queue_depths(&conn, &topology, REPLY_TIMEOUT),
    )
    .await
    .expect("queue depths waited without a bound");
    let error = depths
        .expect_err("no depths from a silent broker")
        .to_string();
    assert!(error.contains("no reply to `channel.open`"), "{error}");
}

/// `lapse topology verify` and `lapse status --check` compare the broker with the
/// tier file over AMQP: on a connection that went silent the check fails with a reply
/// timeout naming the step, after the declare bound, instead of hanging.
#[tokio::test]
async fn a_topology_check_on_a_silent_broker_fails_instead_of_hanging() {
    let (_proxy, frozen, endpoint) = silent_broker();
    let topology = one_tier();
    let conn = endpoint.connect("lapse test silent check").await.unwrap();
    frozen.store(true, Ordering::SeqCst);
    let bound = lapse::amqp::topology::REPLY_TIMEOUT;
    let checked = tokio::time::timeout(
        bound + HUNG,
        lapse::amqp::topology::verify(&conn, None, "/", &topology),
    )
    .await
    .expect("the topology check waited without a bound");
    match checked {
        Err(BrokerError::ReplyTimeout { op, after }) => {
            assert_eq!((op, after), ("channel.open", bound));
        }
        Err(other) => panic!("expected a reply timeout, got {other}"),
        Ok(report) => panic!("a silent broker passed the check: {report:?}"),
    }
}

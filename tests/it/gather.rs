//! Gathering (docs/pipeline.md, "Gathering"): intents due more than 2 seconds later
//! wait up to `relay.gather` in the outbox so that more of one route leave as one
//! pack; anything due sooner, and every event, wakes the relay at once.

use std::time::Duration;

use lapse::orders::{self, Deadline};
use tokio::sync::mpsc;

use crate::helpers::{
    TestEnv, assert_never_early, connect_hearing, count, create_orders, eventually, wait_closed,
};

/// A LISTEN connection on the outbox channel: the payloads it hears.
async fn listen(env: &TestEnv) -> (tokio_postgres::Client, mpsc::UnboundedReceiver<String>) {
    let (client, rx) = connect_hearing(env, |m| match m {
        tokio_postgres::AsyncMessage::Notification(n) => Some(n.payload().to_string()),
        _ => None,
    })
    .await;
    client
        .batch_execute(&format!(
            "LISTEN {}",
            lapse::components::relay::OUTBOX_CHANNEL
        ))
        .await
        .unwrap();
    (client, rx)
}

async fn next(rx: &mut mpsc::UnboundedReceiver<String>) -> String {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("a notification")
        .unwrap()
}

/// How late order `id` closed, in milliseconds, once it has (within `limit`).
async fn lateness_ms(db: &tokio_postgres::Client, id: i64, limit: Duration) -> i64 {
    let closed = format!("SELECT count(*) FROM orders WHERE id = {id} AND status = 'CLOSED'");
    eventually(limit, "the near order closed", || async {
        (count(db, &closed).await == 1).then_some(())
    })
    .await;
    count(
        db,
        &format!(
            "SELECT (extract(epoch FROM closed_at - expire_at) * 1000)::bigint FROM orders WHERE id = {id}"
        ),
    )
    .await
}

#[tokio::test]
async fn the_outbox_says_which_writes_may_wait() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    let (_listener, mut heard) = listen(&env).await;
    let far = create_orders(&mut db, &[Duration::from_secs(10)], &[]).await;
    assert_eq!(next(&mut heard).await, "gather", "an intent due in 10 s");
    create_orders(&mut db, &[Duration::from_millis(500)], &[]).await;
    assert_eq!(next(&mut heard).await, "", "an intent due in 500 ms");
    // One statement writing a far and a near intent: each says what it is.
    db.batch_execute(
        "INSERT INTO outbox (kind, order_id, payload)
         SELECT 'timeout', 1, jsonb_build_object('expire_at',
                to_char((clock_timestamp() + s * interval '1 second') AT TIME ZONE 'UTC',
                        'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'))
           FROM unnest(ARRAY[10, 1]) AS s",
    )
    .await
    .unwrap();
    let mut both = vec![next(&mut heard).await, next(&mut heard).await];
    both.sort();
    assert_eq!(both, ["", "gather"], "the near one wakes the relay at once");
    // Extending to a far deadline writes a far intent.
    orders::extend(&db, far[0], Deadline::In(Duration::from_secs(60)))
        .await
        .unwrap();
    assert_eq!(next(&mut heard).await, "gather");
    // Judged when the transaction commits: due 2.5 s after the write, 1 s later at commit.
    let tx = db.transaction().await.unwrap();
    tx.batch_execute(
        "INSERT INTO outbox (kind, order_id, payload)
         SELECT 'timeout', 1, jsonb_build_object('expire_at',
                to_char((clock_timestamp() + interval '2.5 seconds') AT TIME ZONE 'UTC',
                        'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'))",
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    tx.commit().await.unwrap();
    assert_eq!(next(&mut heard).await, "", "due 1.5 s after its commit");
    // The kinds' outbox speaks the same way.
    db.batch_execute(
        "INSERT INTO lapse.kind_outbox (kind, deadline_id, payload)
         SELECT 'deadline', 1, jsonb_build_object('expire_at',
                to_char((clock_timestamp() + interval '1 hour') AT TIME ZONE 'UTC',
                        'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'))",
    )
    .await
    .unwrap();
    assert_eq!(
        next(&mut heard).await,
        "gather",
        "a kind's deadline due in an hour"
    );
    // Anything that is not an intent, and an intent whose deadline cannot be read.
    for payload in [
        "('stock.release', 1, '{}')",
        "('timeout', 1, '{\"expire_at\": 7}')",
        "('timeout', 1, '{\"expire_at\": \"9999-01-01\"}')",
    ] {
        db.batch_execute(&format!(
            "INSERT INTO outbox (kind, order_id, payload) VALUES {payload}"
        ))
        .await
        .unwrap();
        assert_eq!(next(&mut heard).await, "", "{payload}");
    }
    env.cleanup().await;
}

#[tokio::test]
async fn a_deadline_due_soon_never_waits_for_gathering() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    let mut config = env.config();
    config.relay.gather = Duration::from_secs(1);
    config.relay.poll_interval = Duration::from_secs(30);
    let worker = env.start(&config).await;
    // A far intent first, so that a gathering round is pending when the near one
    // arrives: the near one must not wait for it.
    create_orders(&mut db, &[Duration::from_secs(20)], &[]).await;
    let near = create_orders(&mut db, &[Duration::from_millis(200)], &[]).await;
    // Waiting for the gathering round would make it 800 ms late.
    let late_ms = lateness_ms(&db, near[0].0, Duration::from_secs(20)).await;
    assert!(late_ms < 500, "closed {late_ms} ms late");
    worker.stop().await;
    assert_never_early(&db).await;
    env.cleanup().await;
}

#[tokio::test]
async fn far_intents_written_apart_leave_as_one_pack_and_close_on_time() {
    let env = TestEnv::with_database(&["5s"]).await;
    let mut db = env.db().await;
    let mut config = env.config();
    config.relay.gather = Duration::from_secs(1);
    config.relay.poll_interval = Duration::from_secs(30);
    // Packs as wide as the writes are apart: what is counted is the gathering.
    config.packs.window = Duration::from_secs(5);
    let worker = env.start(&config).await;
    // The relay listening (its first round, at start, has passed).
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Ten orders, each in its own transaction, 40 ms apart, all due 7 s after creation.
    for _ in 0..10 {
        create_orders(&mut db, &[Duration::from_secs(7)], &[]).await;
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    let wait_queue = env
        .names()
        .wait_queue(lapse::tier::Tier::parse("5s").unwrap());
    eventually(Duration::from_secs(4), "the intents published", || async {
        (count(&db, "SELECT count(*) FROM outbox").await == 0).then_some(())
    })
    .await;
    let waiting = crate::queues::depth(&env.conn, &wait_queue)
        .await
        .expect("the 5s wait queue");
    // One gathering round takes them all (one more if a round ran between writes).
    assert!(
        (1..=2).contains(&waiting),
        "{waiting} messages for 10 intents in the wait queue"
    );
    wait_closed(&db, 10, Duration::from_secs(30)).await;
    worker.stop().await;
    assert_never_early(&db).await;
    let late = count(
        &db,
        "SELECT count(*) FROM orders WHERE closed_at > expire_at + interval '3 seconds'",
    )
    .await;
    assert_eq!(late, 0, "gathering made a deadline late");
    env.cleanup().await;
}

#[tokio::test]
async fn an_urgent_row_leaves_at_once_without_cutting_a_gathering_short() {
    let env = TestEnv::with_database(&["5s"]).await;
    let mut db = env.db().await;
    let mut config = env.config();
    config.relay.gather = Duration::from_secs(1);
    config.relay.poll_interval = Duration::from_secs(30);
    config.packs.window = Duration::from_secs(5);
    let worker = env.start(&config).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Five far intents (a gathering round is now pending), a near one (urgent), five
    // more far ones: the near one must leave at once, and alone, so that the ten far
    // ones still leave together when the gathering ends.
    create_orders(&mut db, &[Duration::from_secs(7); 5], &[]).await;
    let near = create_orders(&mut db, &[Duration::from_millis(300)], &[]).await;
    // The urgent round took the near intent and left the far ones gathering.
    let left = eventually(
        Duration::from_secs(5),
        "the near intent published",
        || async {
            let left = count(&db, "SELECT count(*) FROM outbox").await;
            (left < 6).then_some(left)
        },
    )
    .await;
    assert_eq!(
        left, 5,
        "far intents still gathering after the urgent round"
    );
    create_orders(&mut db, &[Duration::from_secs(7); 5], &[]).await;
    eventually(Duration::from_secs(4), "the intents published", || async {
        (count(&db, "SELECT count(*) FROM outbox").await == 0).then_some(())
    })
    .await;
    let wait_queue = env
        .names()
        .wait_queue(lapse::tier::Tier::parse("5s").unwrap());
    let waiting = crate::queues::depth(&env.conn, &wait_queue)
        .await
        .expect("the 5s wait queue");
    // One pack; two if the second five were written after the gathering round ran
    // (a slow machine): the first five left together either way, not with the near one.
    assert!(
        (1..=2).contains(&waiting),
        "{waiting} messages for the 10 far intents in the wait queue"
    );
    let late_ms = lateness_ms(&db, near[0].0, Duration::from_secs(5)).await;
    assert!(late_ms < 500, "the near order closed {late_ms} ms late");
    wait_closed(&db, 11, Duration::from_secs(30)).await;
    worker.stop().await;
    assert_never_early(&db).await;
    env.cleanup().await;
}

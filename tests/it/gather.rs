//! Gathering (docs/pipeline.md, "Gathering"): intents due more than 2 seconds later
//! wait up to `relay.gather` in the outbox so that more of one route leave as one
//! pack; anything due sooner, and every event, wakes the relay at once.

use std::time::{Duration, Instant};

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

/// How often a test that must look at the outbox within one gathering (`relay.gather`,
/// at most 1 s) tries again when a loaded machine made it look too late to tell.
const ATTEMPTS: usize = 3;

/// `relay.gather` in these tests.
const GATHER: Duration = Duration::from_secs(1);

/// How long a test waits, once the outbox is empty, before it writes what it
/// measures: a wake-up heard late, or a gathering begun meanwhile, has run its round
/// by then (a gathering plus a margin).
const SETTLE: Duration = Duration::from_secs(2);

/// A worker configuration for gathering: `GATHER`, packs 5 s wide, and no poll round
/// during a test (only wake-ups run rounds).
fn gathering(env: &TestEnv) -> lapse::config::Config {
    let mut config = env.config();
    config.relay.gather = GATHER;
    config.relay.poll_interval = Duration::from_secs(600);
    config.packs.window = Duration::from_secs(5);
    config
}

/// How many of the intents of orders `ids` are still in the outbox.
async fn in_outbox(db: &tokio_postgres::Client, ids: &[i64]) -> usize {
    let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    let n = count(
        db,
        &format!("SELECT count(*) FROM outbox WHERE order_id IN ({list})"),
    )
    .await;
    usize::try_from(n).unwrap()
}

/// Waits until order `near`'s intent has left the outbox, then says how many of the
/// `far` intents (written at `began`, due more than 2 s later) left before it was seen
/// gone. `None` when that look came `GATHER` or more after `began`: the gathering
/// round may have run by then, so the count tells nothing.
async fn left_with(
    db: &tokio_postgres::Client,
    near: i64,
    far: &[i64],
    began: Instant,
) -> Option<usize> {
    let (far_left, seen) = eventually(
        Duration::from_secs(10),
        "the near intent published",
        || async {
            let near_left = in_outbox(db, &[near]).await;
            let far_left = in_outbox(db, far).await;
            (near_left == 0).then_some((far_left, began.elapsed()))
        },
    )
    .await;
    (seen < GATHER).then_some(far.len() - far_left)
}

/// Until the worker's relay listens on the outbox channel and has taken an order's
/// intent from the outbox (its first round, at start, of everything, has passed),
/// then `SETTLE`. The orders it created (one, due in 200 ms).
async fn relay_listening(db: &mut tokio_postgres::Client) -> i64 {
    eventually(Duration::from_secs(30), "the relay listening", || async {
        let listening = count(
            db,
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND query ILIKE 'LISTEN %'
                AND state = 'idle'",
        )
        .await;
        (listening > 0).then_some(())
    })
    .await;
    create_orders(db, &[Duration::from_millis(200)], &[]).await;
    settled(db).await;
    1
}

/// Until the outbox is empty, then `SETTLE`.
async fn settled(db: &tokio_postgres::Client) {
    drained(db).await;
    tokio::time::sleep(SETTLE).await;
}

/// Writes `n` far intents (due in 16 s): which, and whether all are still in the
/// outbox right after (not: a round took some at once, a wake-up heard late, and what
/// follows would tell nothing).
async fn far_intents(db: &mut tokio_postgres::Client, n: usize) -> (Vec<i64>, bool) {
    let far = ids(&create_orders(db, &vec![Duration::from_secs(16); n], &[]).await);
    let untouched = in_outbox(db, &far).await == n;
    (far, untouched)
}

/// One try: `n` far intents, then a near one (due in `near_in`): how many of the far
/// intents left with it ([`left_with`]), and the near order; `None` when the try tells
/// nothing (a round took far intents at once, or the look came too late). Counts the
/// orders it created in `created`.
async fn near_after_far(
    db: &mut tokio_postgres::Client,
    n: usize,
    near_in: Duration,
    created: &mut i64,
) -> Option<(usize, i64)> {
    let began = Instant::now();
    let (far, untouched) = far_intents(db, n).await;
    *created += n as i64;
    if !untouched {
        return None;
    }
    let near = create_orders(db, &[near_in], &[]).await[0].0;
    *created += 1;
    left_with(db, near, &far, began)
        .await
        .map(|along| (along, near))
}

/// Once the outbox is empty: the messages in the 10 s tier's wait queue.
async fn packs_waiting(env: &TestEnv, db: &tokio_postgres::Client) -> u32 {
    drained(db).await;
    let wait_queue = env
        .names()
        .wait_queue(lapse::tier::Tier::parse("10s").unwrap());
    crate::queues::depth(&env.conn, &wait_queue)
        .await
        .expect("the 10s wait queue")
}

/// Until the outbox is empty.
async fn drained(db: &tokio_postgres::Client) {
    eventually(Duration::from_secs(10), "the intents published", || async {
        (count(db, "SELECT count(*) FROM outbox").await == 0).then_some(())
    })
    .await;
}

fn ids(orders: &[orders::OrderId]) -> Vec<i64> {
    orders.iter().map(|o| o.0).collect()
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
    let env = TestEnv::with_database(&["10s"]).await;
    let mut db = env.db().await;
    let worker = env.start(&gathering(&env)).await;
    let mut created = relay_listening(&mut db).await;
    let mut told = false;
    for _ in 0..ATTEMPTS {
        // A far intent first, so that a gathering round is pending when the near one
        // arrives: the near one must leave while the far one is still gathering.
        let near_in = Duration::from_millis(200);
        if let Some((far_along, near)) = near_after_far(&mut db, 1, near_in, &mut created).await {
            assert_eq!(
                far_along, 0,
                "the far intent left with the near one, before its gathering ended"
            );
            told = true;
            let late_ms = lateness_ms(&db, near, Duration::from_secs(20)).await;
            assert!(late_ms < 5_000, "the near order closed {late_ms} ms late");
            break;
        }
        settled(&db).await;
    }
    assert!(
        told,
        "{ATTEMPTS} tries: the near intent never left within relay.gather of the far one \
         (it waited for the gathering round, or the machine was too slow to tell)"
    );
    wait_closed(&db, created, Duration::from_secs(60)).await;
    worker.stop().await;
    assert_never_early(&db).await;
    env.cleanup().await;
}

#[tokio::test]
async fn far_intents_written_apart_leave_as_one_pack_and_close_on_time() {
    let env = TestEnv::with_database(&["10s"]).await;
    let mut db = env.db().await;
    let worker = env.start(&gathering(&env)).await;
    let before = relay_listening(&mut db).await;
    // Ten orders, each in its own transaction, 40 ms apart, all due 16 s after creation.
    let began = Instant::now();
    for _ in 0..10 {
        create_orders(&mut db, &[Duration::from_secs(16)], &[]).await;
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    let span = began.elapsed();
    let waiting = packs_waiting(&env, &db).await;
    // One gathering round takes them all; on a machine slow enough to spread the
    // writes over more than a gathering, one more per gathering they span.
    let most = 2.max(1 + span.as_millis().div_ceil(GATHER.as_millis()) as u32);
    assert!(
        (1..=most).contains(&waiting),
        "{waiting} messages for 10 intents written over {span:?} in the wait queue"
    );
    wait_closed(&db, 10 + before, Duration::from_secs(60)).await;
    worker.stop().await;
    assert_never_early(&db).await;
    let late = count(
        &db,
        "SELECT count(*) FROM orders WHERE closed_at > expire_at + interval '5 seconds'",
    )
    .await;
    assert_eq!(late, 0, "gathering made a deadline late");
    env.cleanup().await;
}

#[tokio::test]
async fn an_urgent_row_leaves_at_once_without_cutting_a_gathering_short() {
    let env = TestEnv::with_database(&["10s"]).await;
    let mut db = env.db().await;
    let worker = env.start(&gathering(&env)).await;
    let mut created = relay_listening(&mut db).await;
    let mut told = false;
    for _ in 0..ATTEMPTS {
        // Five far intents (a gathering round is now pending), a near one (urgent), five
        // more far ones: the near one must leave at once, and alone, so that the ten
        // far ones still leave together when the gathering ends.
        let began = Instant::now();
        let near_in = Duration::from_millis(300);
        let Some((far_along, near)) = near_after_far(&mut db, 5, near_in, &mut created).await
        else {
            // Closed, so that the wait queue holds only the next try's packs.
            settled(&db).await;
            wait_closed(&db, created, Duration::from_secs(60)).await;
            continue;
        };
        assert_eq!(far_along, 0, "the urgent round took far intents along");
        told = true;
        let written = Instant::now();
        create_orders(&mut db, &[Duration::from_secs(16); 5], &[]).await;
        created += 5;
        let span = written.duration_since(began) + written.elapsed();
        let waiting = packs_waiting(&env, &db).await;
        // One pack; two if the second five were written after the gathering round ran
        // (a slow machine): the first five left together either way, not with the near one.
        assert!(
            (1..=2).contains(&waiting),
            "{waiting} messages for the 10 far intents (written over {span:?}) in the wait queue"
        );
        let late_ms = lateness_ms(&db, near, Duration::from_secs(20)).await;
        assert!(late_ms < 5_000, "the near order closed {late_ms} ms late");
        break;
    }
    assert!(
        told,
        "{ATTEMPTS} tries: the near intent never left within relay.gather of the far ones \
         (it waited for their gathering round, or the machine was too slow to tell)"
    );
    wait_closed(&db, created, Duration::from_secs(60)).await;
    worker.stop().await;
    assert_never_early(&db).await;
    env.cleanup().await;
}

/// Urgent rows keep coming (every 300 ms, for 5 s) while far intents gather: they
/// leave in urgent rounds of their own, and the gathering round still comes when it was
/// due (a relay that began the gathering again after each urgent round, or forgot it,
/// would keep the far intents until the stream ends, or until its poll; one whose
/// urgent rows waited for the gathering would send them with the far ones). Judged by
/// the database's clock: when each order was created and when the relay recorded its
/// first hop.
#[tokio::test]
async fn a_stream_of_urgent_rows_does_not_put_a_gathering_off() {
    let env = TestEnv::with_database(&["10s"]).await;
    let mut db = env.db().await;
    let worker = env.start(&gathering(&env)).await;
    let mut created = relay_listening(&mut db).await;
    let stream = Duration::from_secs(5);
    let mut told = None;
    for _ in 0..ATTEMPTS {
        let began = Instant::now();
        let (far, untouched) = far_intents(&mut db, 5).await;
        created += 5;
        if !untouched {
            settled(&db).await;
            continue;
        }
        let mut near = Vec::new();
        while began.elapsed() < stream {
            near.extend(ids(&create_orders(
                &mut db,
                &[Duration::from_millis(300)],
                &[],
            )
            .await));
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        created += near.len() as i64;
        settled(&db).await;
        let times = stream_times(&db, &far, &near).await;
        // At least one urgent row written well inside the gathering, or this try tells
        // nothing about them (a machine too slow to write it in time).
        if times.near_inside > 0 {
            told = Some(times);
            break;
        }
    }
    let times = told.unwrap_or_else(|| {
        panic!("{ATTEMPTS} tries: no urgent row written inside the far intents' gathering")
    });
    // The gathering began after they were written, so its round came no sooner; and it
    // came while the urgent rows kept coming.
    assert!(
        times.far_after_ms >= GATHER.as_millis() as f64,
        "the far intents left {} ms after they were written, before their gathering ended",
        times.far_after_ms
    );
    assert!(
        times.far_before_last_near,
        "the far intents left after the stream of urgent rows ended ({} ms after they were \
         written): the urgent rounds put their gathering round off",
        times.far_after_ms
    );
    // Urgent rows written inside the gathering left well before it ended (all but a
    // straggler on a loaded machine), not with the far ones.
    assert!(
        times.near_ahead * 2 >= times.near_inside,
        "of {} urgent rows written inside the gathering, {} left ahead of the far intents",
        times.near_inside,
        times.near_ahead
    );
    wait_closed(&db, created, Duration::from_secs(60)).await;
    worker.stop().await;
    assert_never_early(&db).await;
    env.cleanup().await;
}

/// When the orders of a stream left the outbox, by the database's clock.
#[derive(Debug)]
struct StreamTimes {
    /// From the last far order's creation to the far intents' first hop.
    far_after_ms: f64,
    /// The far intents' first hop came before the last urgent order was written.
    far_before_last_near: bool,
    /// Urgent orders written 300 ms or more before the far intents' hop.
    near_inside: i64,
    /// Of those, the ones whose first hop came 100 ms or more before the far intents'.
    near_ahead: i64,
}

async fn stream_times(db: &tokio_postgres::Client, far: &[i64], near: &[i64]) -> StreamTimes {
    let row = db
        .query_one(
            "WITH hops AS (
                 SELECT o.id, o.created_at, min(e.at) AS hop FROM orders o
                   JOIN order_events e ON e.order_id = o.id AND e.event = 'hop'
                  WHERE o.id = ANY($1) OR o.id = ANY($2)
                  GROUP BY o.id, o.created_at),
             far AS (
                 SELECT min(hop) AS hop, max(created_at) AS created FROM hops
                  WHERE id = ANY($1))
             SELECT extract(epoch FROM far.hop - far.created)::float8 * 1000,
                    far.hop < (SELECT max(created_at) FROM hops WHERE id = ANY($2)),
                    count(*) FILTER (WHERE h.id = ANY($2)
                                       AND h.created_at <= far.hop - interval '300 ms'),
                    count(*) FILTER (WHERE h.id = ANY($2)
                                       AND h.created_at <= far.hop - interval '300 ms'
                                       AND h.hop <= far.hop - interval '100 ms')
               FROM far, hops h
              GROUP BY far.hop, far.created",
            &[&far, &near],
        )
        .await
        .unwrap();
    StreamTimes {
        far_after_ms: row.get(0),
        far_before_last_near: row.get(1),
        near_inside: row.get(2),
        near_ahead: row.get(3),
    }
}

//! Deadline kinds over a shop's own tables: `public.t_order` and `public.t_delivery`,
//! which lapse did not create, two kinds side by side, the shop's SQL API, events to
//! the shop's exchange applied by an inventory service in a second database, and the
//! hostile cases (an action that fails, changes three rows, waits for the shop's row
//! lock; a kind taken out of the configuration; a missing exchange).

use std::collections::BTreeSet;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapse::config::{Config, EventConfig, KeyType, KindConfig};
use lapse::message::{PARK_CAUSE_HEADER, header_text, park_reason};
use serde_json::Value;

use crate::helpers::{TestEnv, count, database_url, drop_database, eventually, stderr, stdout};

const SHOP: &str = "
CREATE TABLE public.t_order (
    order_no     text PRIMARY KEY,
    user_id      bigint NOT NULL,
    order_status smallint NOT NULL DEFAULT 0,
    expire_at    timestamptz NOT NULL,
    closed_at    timestamptz
);
CREATE TABLE public.t_delivery (
    id           bigint PRIMARY KEY,
    order_no     text NOT NULL,
    confirmed_at timestamptz
);
-- The shop's own table named like lapse's example shop, of another shape.
CREATE TABLE public.orders (ref text PRIMARY KEY, amount numeric NOT NULL, state int NOT NULL);
INSERT INTO public.orders VALUES ('R-1', 12.50, 0), ('R-2', 3, 1);";

/// The shop's `public.orders`, as text, to compare before and after.
const SHOP_ORDERS: &str =
    "SELECT string_agg(to_jsonb(o)::text, ',' ORDER BY ref) FROM public.orders o";

fn kind(key_type: KeyType, action: &str, event: Option<(&str, &str)>) -> KindConfig {
    KindConfig {
        key_type,
        action: action.into(),
        event: event.map(|(exchange, routing_key)| EventConfig {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        }),
        effect: None,
    }
}

const CLOSE: &str = "UPDATE t_order SET order_status = 4, closed_at = clock_timestamp()
     WHERE order_no = $1 AND order_status = 0 RETURNING order_no, user_id";
const CONFIRM: &str = "UPDATE t_delivery SET confirmed_at = clock_timestamp()
     WHERE id = $1 AND confirmed_at IS NULL RETURNING id AS delivery_id, order_no";

/// The shop's exchange and the inventory service's queue bound to `order.closed`.
async fn shop_exchange(env: &mut TestEnv) -> (String, String) {
    let exchange = format!("{}.shop", env.prefix);
    let queue = format!("{}.inventory", env.prefix);
    let ch = env.conn.create_channel().await.unwrap();
    ch.exchange_declare(
        exchange.as_str().into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        queue.as_str().into(),
        exchange.as_str().into(),
        "order.closed".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    env.track_exchange(exchange.clone());
    env.track_queue(queue.clone());
    (exchange, queue)
}

/// The env's database with the shop's tables, migrated with the kinds of `config`.
async fn shop_database(env: &TestEnv, config: &Config) -> tokio_postgres::Client {
    shop_database_with(env, config, "").await
}

/// [`shop_database`] with more of the shop's objects (`extra`, before the migration).
async fn shop_database_with(env: &TestEnv, config: &Config, extra: &str) -> tokio_postgres::Client {
    let db = env.db().await;
    db.batch_execute(SHOP).await.unwrap();
    if !extra.is_empty() {
        db.batch_execute(extra).await.unwrap();
    }
    lapse::db::migrate_with_settings(
        &config.database.url,
        &lapse::db::Settings::from_config(config),
    )
    .await
    .unwrap();
    db
}

/// Creates an order and schedules its close in one shop transaction.
async fn place_order(db: &mut tokio_postgres::Client, order_no: &str, in_ms: i64) {
    let tx = db.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO t_order (order_no, user_id, expire_at)
         VALUES ($1, 7, now() + $2::bigint * interval '1 millisecond')",
        &[&order_no, &in_ms],
    )
    .await
    .unwrap();
    tx.execute(
        "SELECT lapse.schedule('order_close', order_no, expire_at) FROM t_order WHERE order_no = $1",
        &[&order_no],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

/// The payment recipe of docs/adopting.md: settle the deadline first, then the
/// shop's guarded UPDATE, in one transaction; too late means rolled back.
async fn pay(db: &mut tokio_postgres::Client, order_no: &str) -> bool {
    let tx = db.transaction().await.unwrap();
    let open: Option<bool> = tx
        .query_one("SELECT lapse.settle('order_close', $1)", &[&order_no])
        .await
        .unwrap()
        .get(0);
    let paid = open == Some(true)
        && tx
            .execute(
                "UPDATE t_order SET order_status = 1 WHERE order_no = $1 AND order_status = 0",
                &[&order_no],
            )
            .await
            .unwrap()
            == 1;
    if paid {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    paid
}

async fn pending(db: &tokio_postgres::Client) -> i64 {
    count(
        db,
        "SELECT count(*) FROM lapse.deadlines WHERE state = 'pending'",
    )
    .await
}

// Over 60 lines on purpose: one end-to-end story (schedule, pay some, fire the rest, the inventory applies each event once), whose assertions need the whole of it.
#[tokio::test]
async fn two_kinds_fire_over_the_shops_own_tables_once_never_early() {
    let mut env = TestEnv::with_database(&["1s", "2s"]).await;
    let (exchange, queue) = shop_exchange(&mut env).await;
    let mut config = env.config();
    config.kinds.insert(
        "order_close".into(),
        kind(KeyType::Text, CLOSE, Some((&exchange, "order.closed"))),
    );
    config
        .kinds
        .insert("auto_confirm".into(), kind(KeyType::Bigint, CONFIRM, None));
    let mut db = shop_database(&env, &config).await;
    // Another service's database, fed only by lapse's events.
    let inventory = format!("{}_inv", env.prefix);
    lapse::db::ensure_database(&lapse::config::Secret::new(database_url(&inventory)))
        .await
        .unwrap();
    let (inv, connection) =
        tokio_postgres::connect(&database_url(&inventory), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    inv.batch_execute("CREATE TABLE released (order_no text PRIMARY KEY, version int NOT NULL)")
        .await
        .unwrap();

    let shop_orders: String = db.query_one(SHOP_ORDERS, &[]).await.unwrap().get(0);
    let running = env.start(&config).await;
    let orders: Vec<String> = (0..20).map(|i| format!("SO-{i:03}")).collect();
    for (i, order_no) in orders.iter().enumerate() {
        place_order(&mut db, order_no, 1500 + 150 * i as i64).await;
    }
    // Half are paid before their deadline, through the recipe.
    for order_no in orders.iter().step_by(2) {
        assert!(pay(&mut db, order_no).await, "{order_no} paid in time");
    }
    db.batch_execute(
        "INSERT INTO t_delivery VALUES (1, 'SO-001', NULL), (2, 'SO-003', NULL), (3, 'SO-005', now());
         SELECT lapse.schedule('auto_confirm', id::text, now() + interval '5 seconds') FROM t_delivery",
    )
    .await
    .unwrap();
    // The long kind, beyond the top tier (2s): nothing for the broker yet.
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM lapse.deadlines WHERE kind = 'auto_confirm' AND NOT in_tiers"
        )
        .await,
        3
    );

    eventually(
        Duration::from_secs(60),
        "every deadline settled",
        || async { (pending(&db).await == 0).then_some(()) },
    )
    .await;
    // Every unpaid order closed once, never before its deadline; paid ones untouched.
    assert_eq!(
        count(&db, "SELECT count(*) FROM t_order WHERE order_status = 4").await,
        10
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM t_order WHERE order_status = 1 AND closed_at IS NULL"
        )
        .await,
        10
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM t_order o
               JOIN lapse.deadlines d ON d.kind = 'order_close' AND d.key = o.order_no
              WHERE o.closed_at < d.expire_at OR o.closed_at < o.expire_at"
        )
        .await,
        0,
        "closed before its deadline"
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM lapse.deadlines d JOIN t_order o ON o.order_no = d.key
              WHERE d.kind = 'order_close'
                AND d.outcome = CASE o.order_status WHEN 4 THEN 'fired' ELSE 'cancelled' END"
        )
        .await,
        20
    );
    // The long kind: two deliveries confirmed, one already confirmed by the shop.
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM lapse.deadlines WHERE kind = 'auto_confirm' AND outcome = 'fired'"
        )
        .await,
        2
    );
    assert_eq!(
        count(&db, "SELECT count(*) FROM lapse.deadlines WHERE kind = 'auto_confirm' AND outcome = 'nothing'").await,
        1
    );

    // The inventory service applies each event idempotently by (kind, key, version).
    let ch = env.conn.create_channel().await.unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.as_str().into(),
            "inventory".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut seen = BTreeSet::new();
    while seen.len() < 10 {
        let d = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .expect("an event per closed order")
            .unwrap()
            .unwrap();
        let body: Value = serde_json::from_slice(&d.data).unwrap();
        assert_eq!(body["kind"], "order_close");
        assert_eq!(body["row"]["user_id"], 7, "{body}");
        assert_eq!(body["row"]["order_no"], body["key"], "{body}");
        let key = body["key"].as_str().unwrap().to_string();
        inv.execute(
            "INSERT INTO released VALUES ($1, $2) ON CONFLICT DO NOTHING",
            &[&key, &(body["version"].as_i64().unwrap() as i32)],
        )
        .await
        .unwrap();
        seen.insert(key);
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    let closed: BTreeSet<String> = db
        .query("SELECT order_no FROM t_order WHERE order_status = 4", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(seen, closed);
    assert_eq!(count(&inv, "SELECT count(*) FROM released").await, 10);
    eventually(Duration::from_secs(10), "both outboxes empty", || async {
        let left = count(&db, "SELECT count(*) FROM outbox").await
            + count(&db, "SELECT count(*) FROM lapse.kind_outbox").await;
        (left == 0).then_some(())
    })
    .await;

    // The shop's unrelated `public.orders` is byte-identical.
    let after: String = db.query_one(SHOP_ORDERS, &[]).await.unwrap().get(0);
    assert_eq!(shop_orders, after);
    assert!(running.stop().await.is_empty());
    drop(inv);
    drop_database(&inventory).await;
    env.cleanup().await;
}

/// Takes `n` messages from the parked queue: (cause, reason) of each, sorted.
async fn parked(env: &TestEnv, n: usize) -> Vec<(String, String)> {
    let channel = env.conn.create_channel().await.unwrap();
    let mut consumer = channel
        .basic_consume(
            env.names().parked().as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut found = Vec::new();
    for _ in 0..n {
        let d = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .expect("a parked message")
            .unwrap()
            .unwrap();
        let headers = d.properties.headers().as_ref();
        found.push((
            header_text(headers, PARK_CAUSE_HEADER).unwrap_or_default(),
            park_reason(headers).unwrap_or_default(),
        ));
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    let _ = channel.close(200, "done".into()).await;
    found.sort();
    found
}

// Over 60 lines on purpose: the hostile actions of one batch side by side, to show that none of them holds up the others.
#[tokio::test]
async fn an_action_that_fails_or_changes_three_rows_parks_only_its_deadline() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut config = env.config();
    config
        .kinds
        .insert("order_close".into(), kind(KeyType::Text, CLOSE, None));
    config.kinds.insert(
        "by_user".into(),
        kind(
            KeyType::Bigint,
            "UPDATE t_order SET order_status = 9 WHERE user_id = $1 AND order_status = 0 RETURNING order_no",
            None,
        ),
    );
    config.kinds.insert(
        "fragile".into(),
        kind(
            KeyType::Text,
            "UPDATE t_order SET user_id = user_id / (CASE WHEN order_no = 'boom' THEN 0 ELSE 1 END)
              WHERE order_no = $1 RETURNING order_no",
            None,
        ),
    );
    // Fails only at its deferred foreign key: checked inside its savepoint, not at the
    // batch's commit.
    config.kinds.insert(
        "audited".into(),
        kind(
            KeyType::Text,
            "INSERT INTO t_audit VALUES ($1 || '-missing') RETURNING order_no",
            None,
        ),
    );
    // Registered in the database, then taken out of the worker's configuration.
    config
        .kinds
        .insert("gone".into(), kind(KeyType::Text, CLOSE, None));
    let db = shop_database_with(
        &env,
        &config,
        "CREATE TABLE public.t_audit (order_no text REFERENCES public.t_order DEFERRABLE INITIALLY DEFERRED)",
    )
    .await;
    config.kinds.remove("gone");
    db.batch_execute(
        "SELECT lapse.schedule('audited', 'z', now() + interval '1 second');
         INSERT INTO t_order (order_no, user_id, expire_at) VALUES
            ('u1', 42, now()), ('u2', 42, now()), ('u3', 42, now()),
            ('boom', 1, now()), ('fine', 1, now()), ('held', 2, now()), ('other', 3, now());
         SELECT lapse.schedule('by_user', '42', now() + interval '1 second');
         SELECT lapse.schedule('fragile', 'boom', now() + interval '1 second');
         SELECT lapse.schedule('fragile', 'fine', now() + interval '1 second');
         SELECT lapse.schedule('gone', 'other', now() + interval '1 second');
         SELECT lapse.schedule('order_close', 'held', now() + interval '1 second');",
    )
    .await
    .unwrap();
    // The shop holds 'held' in its own transaction across the deadline.
    let holder = env.db().await;
    holder
        .batch_execute("BEGIN; SELECT * FROM t_order WHERE order_no = 'held' FOR UPDATE")
        .await
        .unwrap();

    let running = env.start(&config).await;
    let found = parked(&env, 4).await;
    let causes: Vec<&str> = found.iter().map(|(c, _)| c.as_str()).collect();
    assert_eq!(
        causes,
        [
            "action_failed",
            "action_failed",
            "action_failed",
            "unknown_kind"
        ],
        "{found:?}"
    );
    assert!(
        found.iter().any(|(_, r)| r.contains("foreign key")),
        "{found:?}"
    );
    assert!(
        found.iter().any(|(_, r)| r.contains("division by zero")),
        "{found:?}"
    );
    assert!(
        found.iter().any(|(_, r)| r.contains("changed 3 rows")),
        "{found:?}"
    );
    assert!(found[3].1.contains("\"gone\""), "{found:?}");
    // The others went on: 'fine' fired, while 'held' waits for the shop's lock.
    eventually(Duration::from_secs(30), "fine fired", || async {
        (count(
            &db,
            "SELECT count(*) FROM lapse.deadlines WHERE key = 'fine' AND outcome = 'fired'",
        )
        .await
            == 1)
            .then_some(())
    })
    .await;
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM t_order WHERE order_no = 'held' AND order_status = 0"
        )
        .await,
        1
    );
    // Nothing of the failed actions stayed; their deadlines stay pending with the reason.
    assert_eq!(
        count(&db, "SELECT count(*) FROM t_order WHERE order_status = 9").await,
        0
    );
    assert_eq!(
        count(&db, "SELECT count(*) FROM lapse.deadlines WHERE state = 'pending' AND last_error IS NOT NULL").await,
        3
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM lapse.deadlines WHERE kind = 'gone' AND state = 'pending'"
        )
        .await,
        1
    );
    // Once the shop lets go, 'held' closes.
    holder.batch_execute("COMMIT").await.unwrap();
    eventually(Duration::from_secs(30), "held closed", || async {
        (count(
            &db,
            "SELECT count(*) FROM t_order WHERE order_no = 'held' AND order_status = 4",
        )
        .await
            == 1)
            .then_some(())
    })
    .await;
    assert!(running.stop().await.is_empty());
    env.cleanup().await;
}

#[tokio::test]
async fn an_event_for_an_exchange_not_there_waits_in_the_outbox() {
    let mut env = TestEnv::with_database(&["1s"]).await;
    let exchange = format!("{}.shop", env.prefix);
    let mut config = env.config();
    config.kinds.insert(
        "order_close".into(),
        kind(KeyType::Text, CLOSE, Some((&exchange, "order.closed"))),
    );
    let mut db = shop_database(&env, &config).await;
    let running = env.start(&config).await;
    place_order(&mut db, "SO-1", 200).await;
    place_order(&mut db, "SO-2", 300).await;
    eventually(Duration::from_secs(30), "the event held back", || async {
        let waiting = count(
            &db,
            "SELECT count(*) FROM lapse.kind_outbox WHERE kind = 'event' AND last_error LIKE '%does not exist%'",
        )
        .await;
        (waiting == 2).then_some(())
    })
    .await;
    // Later timeouts still flow past it.
    place_order(&mut db, "SO-3", 100).await;
    eventually(Duration::from_secs(30), "SO-3 closed", || async {
        (count(&db, "SELECT count(*) FROM t_order WHERE order_status = 4").await == 3).then_some(())
    })
    .await;
    // The shop declares its exchange and queue: the events arrive.
    let (_, queue) = shop_exchange(&mut env).await;
    eventually(
        Duration::from_secs(60),
        "three events delivered",
        || async { (messages_in(&env, &queue).await == 3).then_some(()) },
    )
    .await;
    eventually(Duration::from_secs(10), "the outbox emptied", || async {
        (count(&db, "SELECT count(*) FROM lapse.kind_outbox").await == 0).then_some(())
    })
    .await;
    assert!(running.stop().await.is_empty());
    env.cleanup().await;
}

async fn sqlstate(db: &tokio_postgres::Client, sql: &str) -> String {
    let e = db.batch_execute(sql).await.expect_err(sql);
    let db_error = e.as_db_error().expect("a server error");
    format!("{} {}", db_error.code().code(), db_error.message())
}

#[tokio::test]
async fn the_sql_api_refuses_what_it_cannot_keep_and_names_why() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut config = env.config();
    config
        .kinds
        .insert("order_close".into(), kind(KeyType::Text, CLOSE, None));
    config
        .kinds
        .insert("auto_confirm".into(), kind(KeyType::Bigint, CONFIRM, None));
    let db = shop_database(&env, &config).await;
    for (sql, expected) in [
        (
            "SELECT lapse.schedule('order_close', 'a', 'infinity')",
            "LP001",
        ),
        (
            "SELECT lapse.schedule('order_close', 'a', now() + interval '1000 years')",
            "LP001",
        ),
        ("SELECT lapse.schedule('order_close', 'a', NULL)", "LP001"),
        (
            "SELECT lapse.schedule('order_close', 'a', now() - interval '1 hour')",
            "LP001",
        ),
        (
            "SELECT lapse.schedule('nope', 'a', now() + interval '1 hour')",
            "LP004",
        ),
        (
            "SELECT lapse.schedule('auto_confirm', 'SO-1', now() + interval '1 hour')",
            "LP005",
        ),
        (
            "SELECT lapse.schedule('order_close', '', now() + interval '1 hour')",
            "LP005",
        ),
        (
            "SELECT lapse.schedule('order_close', NULL, now() + interval '1 hour')",
            "LP005",
        ),
        (
            "SELECT lapse.schedule('order_close', repeat('k', 201), now() + interval '1 hour')",
            "LP005",
        ),
    ] {
        let got = sqlstate(&db, sql).await;
        assert!(got.starts_with(expected), "{sql}: {got}");
    }
    let version = |sql: &'static str| {
        let db = &db;
        async move {
            db.query_one(sql, &[])
                .await
                .unwrap()
                .get::<_, Option<i32>>(0)
        }
    };
    db.batch_execute("CREATE TEMP TABLE at AS SELECT now() + interval '1 hour' AS t")
        .await
        .unwrap();
    // Idempotent for the same instant; another instant while pending is refused.
    assert_eq!(
        version("SELECT lapse.schedule('auto_confirm', '007', (SELECT t FROM at))").await,
        Some(1)
    );
    assert_eq!(
        version("SELECT lapse.schedule('auto_confirm', '7', (SELECT t FROM at))").await,
        Some(1)
    );
    let got = sqlstate(
        &db,
        "SELECT lapse.schedule('auto_confirm', '7', (SELECT t FROM at) + interval '1 s')",
    )
    .await;
    assert!(got.starts_with("LP006"), "{got}");
    // Later only.
    let got = sqlstate(
        &db,
        "SELECT lapse.reschedule('auto_confirm', '7', (SELECT t FROM at) - interval '1 s')",
    )
    .await;
    assert!(got.starts_with("LP002"), "{got}");
    assert_eq!(
        version(
            "SELECT lapse.reschedule('auto_confirm', '7', (SELECT t FROM at) + interval '1 s')"
        )
        .await,
        Some(2)
    );
    assert_eq!(
        version(
            "SELECT lapse.reschedule('auto_confirm', '8', (SELECT t FROM at) + interval '1 s')"
        )
        .await,
        None
    );
    let open: bool = db
        .query_one("SELECT open FROM lapse.deadline('auto_confirm', '7')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(open);
    let cancelled: bool = db
        .query_one("SELECT lapse.cancel('auto_confirm', '7')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(cancelled);
    let again: bool = db
        .query_one("SELECT lapse.cancel('auto_confirm', '7')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!again);
    // Settling a key never scheduled answers NULL: the shop's own rules decide.
    let never: Option<bool> = db
        .query_one("SELECT lapse.settle('auto_confirm', '424242')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(never, None);
    // Cancelled, then armed again with the next version.
    assert_eq!(
        version("SELECT lapse.schedule('auto_confirm', '7', (SELECT t FROM at))").await,
        Some(3)
    );
    // An hour away is beyond the top tier (1s): no intent, the promoter hands it over
    // later; one within range gets its intent at once.
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM lapse.kind_outbox WHERE kind = 'deadline'"
        )
        .await,
        0
    );
    assert_eq!(
        version("SELECT lapse.schedule('auto_confirm', '9', now() + interval '500 ms')").await,
        Some(1)
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM lapse.kind_outbox WHERE kind = 'deadline' AND payload->>'key' = '9'"
        )
        .await,
        1
    );
    assert_eq!(
        count(&db, "SELECT count(*) FROM lapse.deadlines WHERE in_tiers").await,
        1
    );
    // lapse created nothing outside its schema: every table, view, sequence and
    // function outside `lapse` is the shop's.
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname NOT IN ('lapse', 'pg_catalog', 'information_schema', 'pg_toast')
                AND n.nspname NOT LIKE 'pg_temp%' AND n.nspname NOT LIKE 'pg_toast_temp%'
                AND c.relname NOT LIKE 't\\_order%' AND c.relname NOT LIKE 't\\_delivery%'
                AND c.relname NOT IN ('orders', 'orders_pkey')"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
              WHERE n.nspname NOT IN ('lapse', 'pg_catalog', 'information_schema')"
        )
        .await,
        0
    );
    // A kind with deadlines keeps its key type: its keys are stored in that form.
    let mut changed = config.clone();
    changed.kinds.get_mut("auto_confirm").unwrap().key_type = KeyType::Uuid;
    let refused = lapse::db::migrate_with_settings(
        &changed.database.url,
        &lapse::db::Settings::from_config(&changed),
    )
    .await
    .expect_err("a key type change");
    assert!(
        refused.to_string().contains("kinds.auto_confirm.key_type"),
        "{refused}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn kinds_check_and_a_starting_worker_name_the_kind_and_the_key() {
    let env = TestEnv::with_database(&["1s"]).await;
    env.db().await.batch_execute(SHOP).await.unwrap();
    // A row every action below would change if it ran.
    env.db()
        .await
        .batch_execute("INSERT INTO t_order (order_no, user_id, expire_at) VALUES ('x', 1, now())")
        .await
        .unwrap();
    let cases = [
        (
            "syntax",
            "text",
            "UPDATE t_order SET WHERE order_no = $1 RETURNING order_no",
            "kinds.syntax.action",
            "syntax error",
        ),
        (
            "column",
            "text",
            "UPDATE t_order SET order_state = 4 WHERE order_no = $1 RETURNING order_no",
            "kinds.column.action",
            "order_state",
        ),
        (
            "silent",
            "text",
            "UPDATE t_order SET order_status = 4 WHERE order_no = $1",
            "kinds.silent.action",
            "RETURNING",
        ),
        (
            "two",
            "text",
            "UPDATE t_order SET order_status = 4 WHERE order_no = $1 AND user_id = $2 RETURNING order_no",
            "kinds.two.action",
            "2 parameters",
        ),
        (
            "keyless",
            "text",
            "UPDATE t_order SET order_status = 4 WHERE false RETURNING order_no",
            "kinds.keyless.action",
            "$1",
        ),
        (
            "typed",
            "bigint",
            "UPDATE t_order SET order_status = 4 WHERE order_no = $1 RETURNING order_no",
            "kinds.typed.key_type",
            "bigint",
        ),
        (
            "anon",
            "text",
            "UPDATE t_order SET order_status = 4 WHERE order_no = $1 RETURNING order_no || 'x'",
            "kinds.anon.action",
            "AS",
        ),
    ];
    let mut toml = format!("[database]\nurl = {:?}\n", env.database_url());
    for (name, key_type, action, _, _) in &cases {
        toml += &format!("[kinds.{name}]\nkey_type = {key_type:?}\naction = {action:?}\n");
    }
    toml += &format!("[kinds.good]\naction = {CLOSE:?}\n");
    // An effect that would end lapse's transaction is not a data statement.
    toml += &format!("[kinds.committing]\naction = {CLOSE:?}\neffect = \"COMMIT\"\n");
    // Valid, and it would change the row above whatever key it ran with.
    toml += "[kinds.greedy]\naction = \"UPDATE t_order SET order_status = 7 WHERE order_no <> $1 OR true RETURNING order_no\"\n";
    env.write_config(&toml);
    let out = env.lapse(&["kinds", "check"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let (err, ok) = (stderr(&out), stdout(&out));
    for (_, _, _, key, words) in &cases {
        let line = err
            .lines()
            .find(|l| l.contains(key))
            .unwrap_or_else(|| panic!("{key} in {err}"));
        assert!(line.contains(words), "{key}: {line}");
    }
    assert!(ok.contains("kind good: returns order_no, user_id"), "{ok}");
    assert!(
        err.lines()
            .any(|l| l.contains("kinds.committing.effect") && l.contains("data statement")),
        "{err}"
    );
    assert!(ok.contains("kind greedy: returns order_no"), "{ok}");

    // A worker with one bad kind does not start, naming it.
    let mut config = env.config();
    config
        .kinds
        .insert("good".into(), kind(KeyType::Text, CLOSE, None));
    config
        .kinds
        .insert("two".into(), kind(KeyType::Text, cases[3].2, None));
    let error = lapse::service::Service::start(&config, Default::default(), Default::default())
        .await
        .err()
        .expect("refused");
    assert!(error.to_string().contains("kinds.two.action"), "{error}");
    // Nothing of the checks was executed: the row is as it was.
    assert_eq!(
        count(
            &env.db().await,
            "SELECT count(*) FROM t_order WHERE order_no = 'x' AND order_status = 0 AND user_id = 1"
        )
        .await,
        1
    );
    env.cleanup().await;
}

/// The trigger recipe of docs/adopting.md, verbatim in spirit: the shop's INSERT
/// schedules, its payment cancels, and the action's own UPDATE (which fires the same
/// trigger) still records the deadline as fired.
const TRIGGER: &str = "
CREATE FUNCTION public.shop_order_deadline() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' AND NEW.order_status = 0 THEN
        PERFORM lapse.schedule('order_close', NEW.order_no, NEW.expire_at);
    ELSIF TG_OP = 'UPDATE' AND OLD.order_status = 0 AND NEW.order_status <> 0 THEN
        PERFORM lapse.cancel('order_close', NEW.order_no);
    ELSIF TG_OP = 'UPDATE' AND NEW.order_status = 0 AND NEW.expire_at > OLD.expire_at THEN
        PERFORM lapse.reschedule('order_close', NEW.order_no, NEW.expire_at);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER t_order_deadline AFTER INSERT OR UPDATE OF order_status, expire_at
    ON public.t_order FOR EACH ROW EXECUTE FUNCTION public.shop_order_deadline();";

#[tokio::test]
async fn the_trigger_recipe_needs_no_application_change() {
    let mut env = TestEnv::with_database(&["1s"]).await;
    let (exchange, queue) = shop_exchange(&mut env).await;
    let mut config = env.config();
    config.kinds.insert(
        "order_close".into(),
        kind(KeyType::Text, CLOSE, Some((&exchange, "order.closed"))),
    );
    let db = shop_database(&env, &config).await;
    db.batch_execute(TRIGGER).await.unwrap();
    let running = env.start(&config).await;
    db.batch_execute(
        "INSERT INTO t_order (order_no, user_id, expire_at) VALUES
            ('a', 1, now() + interval '1500 ms'), ('b', 1, now() + interval '1500 ms'),
            ('c', 1, now() + interval '1 s');
         UPDATE t_order SET expire_at = expire_at + interval '1 s' WHERE order_no = 'c';
         UPDATE t_order SET order_status = 1 WHERE order_no = 'b';",
    )
    .await
    .unwrap();
    eventually(
        Duration::from_secs(30),
        "every deadline settled",
        || async { (pending(&db).await == 0).then_some(()) },
    )
    .await;
    let outcomes: Vec<(String, String, i32)> = db
        .query(
            "SELECT key, outcome, version FROM lapse.deadlines ORDER BY key",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        outcomes,
        [
            ("a".to_string(), "fired".to_string(), 1),
            ("b".into(), "cancelled".into(), 1),
            ("c".into(), "fired".into(), 2)
        ]
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM t_order WHERE order_status = 4 AND closed_at >= expire_at"
        )
        .await,
        2
    );
    eventually(Duration::from_secs(30), "two events", || async {
        (messages_in(&env, &queue).await == 2).then_some(())
    })
    .await;
    assert!(running.stop().await.is_empty());
    env.cleanup().await;
}

async fn messages_in(env: &TestEnv, queue: &str) -> u32 {
    let ch = env.conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _ = ch.close(200, "asked".into()).await;
    q.message_count()
}

#[tokio::test]
async fn a_deadline_beyond_the_top_tier_waits_in_the_database_until_within_range() {
    let env = TestEnv::with_database(&["1s", "2s"]).await;
    let mut config = env.config();
    config
        .kinds
        .insert("auto_confirm".into(), kind(KeyType::Bigint, CONFIRM, None));
    let db = shop_database(&env, &config).await;
    db.batch_execute(
        "INSERT INTO t_delivery SELECT g, 'SO-' || g, NULL FROM generate_series(1, 10000) g;
         SELECT lapse.schedule('auto_confirm', id::text, now() + interval '1 hour') FROM t_delivery WHERE id > 3;
         SELECT lapse.schedule('auto_confirm', id::text, now() + interval '5 seconds') FROM t_delivery WHERE id <= 3;",
    )
    .await
    .unwrap();
    // Nothing for the broker yet: 10,000 pending deadlines cost no message.
    assert_eq!(count(&db, "SELECT count(*) FROM outbox").await, 0);
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM lapse.deadlines WHERE NOT in_tiers"
        )
        .await,
        10_000
    );
    let running = env.start(&config).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Nothing farther than the top tier (2s) is ever handed over: not the far ones, and
    // a near one only once within range.
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM lapse.deadlines
              WHERE in_tiers AND (expire_at > clock_timestamp() + interval '2 s' OR key::bigint > 3)"
        )
        .await,
        0
    );
    let mut in_tiers = 0;
    for tier in ["1s", "2s"] {
        let queue = env
            .names()
            .wait_queue(lapse::tier::Tier::parse(tier).unwrap());
        in_tiers += messages_in(&env, &queue).await;
    }
    assert!(in_tiers <= 3, "{in_tiers} messages in the tiers");
    eventually(Duration::from_secs(30), "the near three fired", || async {
        (count(
            &db,
            "SELECT count(*) FROM t_delivery WHERE confirmed_at IS NOT NULL",
        )
        .await
            == 3)
            .then_some(())
    })
    .await;
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM lapse.deadlines d JOIN t_delivery t ON t.id::text = d.key
              WHERE d.outcome = 'fired' AND t.confirmed_at >= d.expire_at AND d.in_tiers"
        )
        .await,
        3
    );
    // The far ones were never handed over.
    assert_eq!(
        count(&db, "SELECT count(*) FROM lapse.deadlines WHERE in_tiers").await,
        3
    );
    // One near is handed over at once; a reschedule far away takes it out of the
    // tiers again, and its message in flight, now stale, fires nothing.
    db.batch_execute(
        "INSERT INTO t_delivery VALUES (10001, 'SO-10001', NULL);
         SELECT lapse.schedule('auto_confirm', '10001', now() + interval '1 second')",
    )
    .await
    .unwrap();
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM lapse.deadlines WHERE key = '10001' AND in_tiers"
        )
        .await,
        1
    );
    db.batch_execute("SELECT lapse.reschedule('auto_confirm', '10001', now() + interval '1 hour')")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM lapse.deadlines d JOIN t_delivery t ON t.id = 10001
              WHERE d.key = '10001' AND d.state = 'pending' AND NOT d.in_tiers
                AND d.version = 2 AND t.confirmed_at IS NULL"
        )
        .await,
        1
    );
    // A deadline that fired is armed again far away: back in the database only.
    db.batch_execute(
        "SELECT lapse.schedule('auto_confirm', '1', now() + interval '1 hour');
         SELECT lapse.reschedule('auto_confirm', '4', now() + interval '2 hours');",
    )
    .await
    .unwrap();
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM lapse.deadlines WHERE key IN ('1', '4') AND NOT in_tiers"
        )
        .await,
        2
    );
    // `lapse status` shows each kind's pending deadlines.
    let out = env.lapse(&["status", "--json"]);
    let status: Value = serde_json::from_str(&stdout(&out)).expect("status JSON");
    let kinds = &status["kinds"];
    assert_eq!(kinds[0]["kind"], "auto_confirm", "{kinds}");
    assert_eq!(kinds[0]["pending"], 9_999, "{kinds}");
    assert_eq!(kinds[0]["in_database"], 9_999, "{kinds}");
    assert_eq!(kinds[0]["overdue"], 0, "{kinds}");
    assert!(running.stop().await.is_empty());
    env.cleanup().await;
}

#[tokio::test]
async fn the_backstop_fires_a_deadline_whose_timeout_was_lost() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut config = env.config();
    config
        .kinds
        .insert("order_close".into(), kind(KeyType::Text, CLOSE, None));
    config.worker.sweeper = true;
    config.sweeper.grace = Duration::from_millis(500);
    config.sweeper.interval = Duration::from_millis(500);
    let mut db = shop_database(&env, &config).await;
    place_order(&mut db, "lost", 100).await;
    // The timeout never reaches the broker.
    db.batch_execute("DELETE FROM lapse.kind_outbox")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let running = env.start(&config).await;
    eventually(
        Duration::from_secs(30),
        "the lost deadline fired",
        || async {
            (count(
                &db,
                "SELECT count(*) FROM t_order WHERE order_status = 4 AND closed_at >= expire_at",
            )
            .await
                == 1)
                .then_some(())
        },
    )
    .await;
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM lapse.deadlines WHERE outcome = 'fired'"
        )
        .await,
        1
    );
    assert!(running.stop().await.is_empty());
    env.cleanup().await;
}

#[tokio::test]
async fn an_action_naming_orders_means_the_shops_orders_not_lapses_example() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut config = env.config();
    // Unqualified, as the shop's application writes it: `orders` is public.orders for
    // the shop, while lapse's own schema has an `orders` table too.
    config.kinds.insert(
        "settle_ref".into(),
        kind(
            KeyType::Text,
            "UPDATE orders SET state = 9 WHERE ref = $1 AND state = 0 RETURNING ref, amount",
            None,
        ),
    );
    // lapse's schema first on the worker's own session path (as for a role named
    // lapse, whose "$user" is its schema): the action must still see the shop's.
    config.database.url =
        lapse::config::Secret::new(crate::helpers::on_lapse_path(&env.database_url()));
    let db = shop_database(&env, &config).await;
    let catalog = lapse::kinds::Catalog::new(&config.kinds, &config.database.shop_search_path);
    let problem = lapse::kinds::check::first_problem(&config.database.url, &catalog)
        .await
        .unwrap();
    assert_eq!(problem, None, "checked against the shop's orders");
    let running = env.start(&config).await;
    db.batch_execute("SELECT lapse.schedule('settle_ref', 'R-1', now() + interval '300 ms')")
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "the shop's order settled",
        || async {
            (count(
                &db,
                "SELECT count(*) FROM public.orders WHERE ref = 'R-1' AND state = 9",
            )
            .await
                == 1)
                .then_some(())
        },
    )
    .await;
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM lapse.deadlines WHERE outcome = 'fired'"
        )
        .await,
        1
    );
    assert_eq!(count(&db, "SELECT count(*) FROM lapse.orders").await, 0);
    assert!(running.stop().await.is_empty());
    env.cleanup().await;
}

// Over 60 lines on purpose: the race itself (payments fired around each deadline) and the one check that matters, per order.
#[tokio::test]
async fn payments_racing_a_kinds_deadline_never_both_win() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let mut config = env.config();
    config
        .kinds
        .insert("order_close".into(), kind(KeyType::Text, CLOSE, None));
    let mut db = shop_database(&env, &config).await;
    let orders: Vec<String> = (0..300).map(|i| format!("R-{i:04}")).collect();
    for (i, order_no) in orders.iter().enumerate() {
        place_order(&mut db, order_no, 3_000 + 5 * i as i64).await;
    }
    let running = env.start(&config).await;
    let deadlines: Vec<(String, chrono::DateTime<chrono::Utc>)> = db
        .query(
            "SELECT key, expire_at FROM lapse.deadlines WHERE kind = 'order_close'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    // The shop's connections: a pool, as an application has (300 payments share 16).
    let pool = lapse::db::app_pool(&config.database, 16).unwrap();
    let mut payments = tokio::task::JoinSet::new();
    for (i, (order_no, expire_at)) in deadlines.into_iter().enumerate() {
        // Within ±50 ms of the deadline; every tenth well before it.
        let offset = if i % 10 == 0 {
            chrono::Duration::milliseconds(-1_000)
        } else {
            chrono::Duration::milliseconds((i as i64 * 37) % 101 - 50)
        };
        let pool = pool.clone();
        payments.spawn(async move {
            let wait = (expire_at + offset - chrono::Utc::now())
                .to_std()
                .unwrap_or_default();
            tokio::time::sleep(wait).await;
            // A wait for a connection that times out on a loaded machine: the payment
            // is simply made later (a database that stays away fails the test).
            let mut tries = 0;
            let mut client = loop {
                match pool.get().await {
                    Ok(client) => break client,
                    Err(e) if tries < 20 => {
                        tries += 1;
                        tracing::debug!(error = %e, "no connection yet");
                    }
                    Err(e) => panic!("no database connection: {e}"),
                }
            };
            let tx = client.transaction().await.unwrap();
            let row = tx
                .query_one(
                    "SELECT lapse.settle('order_close', $1) AS open, clock_timestamp() AS at",
                    &[&order_no],
                )
                .await
                .unwrap();
            let (open, at): (Option<bool>, chrono::DateTime<chrono::Utc>) =
                (row.get("open"), row.get("at"));
            let paid = open == Some(true)
                && tx
                    .execute(
                        "UPDATE t_order SET order_status = 1 WHERE order_no = $1 AND order_status = 0",
                        &[&order_no],
                    )
                    .await
                    .unwrap()
                    == 1;
            if paid {
                tx.commit().await.unwrap();
            } else {
                tx.rollback().await.unwrap();
            }
            // In time by the database clock, or not: more than 5 ms either side of the
            // deadline, the answer must follow it.
            let margin = chrono::Duration::milliseconds(5);
            if at + margin < expire_at {
                assert!(paid, "{order_no}: paid in time ({at} < {expire_at}) but refused");
            } else if at > expire_at + margin {
                assert!(!paid, "{order_no}: paid after its deadline ({at} > {expire_at}) but accepted");
            }
            (order_no.clone(), paid)
        });
    }
    let mut accepted = BTreeSet::new();
    while let Some(done) = payments.join_next().await {
        let (order_no, paid) = done.unwrap();
        if paid {
            accepted.insert(order_no);
        }
    }
    eventually(
        Duration::from_secs(60),
        "every deadline settled",
        || async { (pending(&db).await == 0).then_some(()) },
    )
    .await;
    let rows = db
        .query(
            "SELECT o.order_no, o.order_status, d.outcome FROM t_order o
               JOIN lapse.deadlines d ON d.kind = 'order_close' AND d.key = o.order_no",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), orders.len());
    let (mut paid, mut closed) = (0, 0);
    for row in &rows {
        let (order_no, status, outcome): (String, i16, String) =
            (row.get(0), row.get(1), row.get(2));
        match (status, outcome.as_str()) {
            (1, "cancelled") => {
                assert!(accepted.contains(&order_no), "{order_no} paid but refused");
                paid += 1;
            }
            (4, "fired") => {
                assert!(
                    !accepted.contains(&order_no),
                    "{order_no} closed after its payment was accepted"
                );
                closed += 1;
            }
            other => panic!("{order_no}: {other:?}: payment and timeout both or neither won"),
        }
    }
    assert!(
        paid > 0 && closed > 0,
        "the race had both outcomes: {paid} paid, {closed} closed"
    );
    assert!(running.stop().await.is_empty());
    env.cleanup().await;
}

#[tokio::test]
async fn an_effect_in_the_same_database_runs_with_its_action_or_not_at_all() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut config = env.config();
    let mut close = kind(KeyType::Text, CLOSE, None);
    close.effect = Some("INSERT INTO public.t_release (order_no) VALUES ($1);".into());
    config.kinds.insert("order_close".into(), close);
    let db = shop_database_with(
        &env,
        &config,
        "CREATE TABLE public.t_release (order_no text PRIMARY KEY CHECK (order_no <> 'veto'))",
    )
    .await;
    db.batch_execute(
        "INSERT INTO t_order (order_no, user_id, expire_at) VALUES
            ('a', 1, now()), ('paid', 1, now()), ('veto', 1, now());
         UPDATE t_order SET order_status = 1 WHERE order_no = 'paid';
         SELECT lapse.schedule('order_close', order_no, now() + interval '500 ms') FROM t_order;",
    )
    .await
    .unwrap();
    let running = env.start(&config).await;
    let found = parked(&env, 1).await;
    assert!(found[0].1.contains("the effect failed"), "{found:?}");
    eventually(Duration::from_secs(30), "the others settled", || async {
        (pending(&db).await == 1).then_some(())
    })
    .await;
    // Fired with its effect; nothing for the paid one; the vetoed one rolled back whole.
    let released: Vec<String> = db
        .query("SELECT order_no FROM public.t_release ORDER BY 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(released, ["a"]);
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM t_order WHERE order_no = 'veto' AND order_status = 0"
        )
        .await,
        1
    );
    assert!(running.stop().await.is_empty());
    env.cleanup().await;
}

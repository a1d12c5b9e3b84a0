//! An installation made by a version before the schema `lapse` (everything in
//! `public`, the migration history there too) upgraded by this one: nothing moves,
//! orders in flight across the upgrade close once and never early, and kinds work
//! there as well. A fresh installation puts everything in `lapse`, next to a shop's
//! own `public.orders` that stays byte-identical.

use std::time::Duration;

use lapse::config::{KeyType, KindConfig, Secret};

use crate::helpers::{TestEnv, count, eventually};

/// lapse's migrations, to build the schema an earlier version left.
mod earlier {
    refinery::embed_migrations!("migrations");
}

/// A test env with an empty database of its own (not migrated); its URL.
async fn fresh_database(tiers: &[&str]) -> (TestEnv, String) {
    let mut env = TestEnv::new(tiers).await;
    env.database = Some(env.prefix.clone());
    let url = env.database_url();
    lapse::db::ensure_database(&Secret::new(url.clone()))
        .await
        .unwrap();
    (env, url)
}

/// A plain connection, with the connection's own search path.
async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

/// The last migration before the schema `lapse` existed.
const BEFORE_KINDS: i32 = 13;

#[tokio::test]
async fn an_earlier_installation_keeps_its_objects_and_its_orders_in_flight_close_once() {
    let (env, url) = fresh_database(&["1s", "5s"]).await;
    // The earlier version migrated with the connection's own search path (`public`).
    let mut raw = connect(&url).await;
    earlier::migrations::runner()
        .set_target(refinery::Target::Version(BEFORE_KINDS))
        .run_async(&mut raw)
        .await
        .unwrap();
    // Its application created orders, their intents waiting in the outbox.
    raw.batch_execute(
        "INSERT INTO stock (sku, available) VALUES ('old', 100);
         SELECT lapse_create_order(now() + (g * interval '200 ms') + interval '2 s',
                                   '[{\"sku\": \"old\", \"qty\": 1}]')
           FROM generate_series(1, 10) g;",
    )
    .await
    .unwrap();

    let mut config = env.config();
    config.kinds.insert(
        "auto_confirm".into(),
        KindConfig {
            key_type: KeyType::Bigint,
            action: "UPDATE public.orders SET note = 'confirmed' WHERE id = $1 AND note IS NULL RETURNING id"
                .into(),
            event: None,
            effect: None,
        },
    );
    // The upgrade: this version's migrations and settings.
    lapse::db::migrate_with_settings(
        &config.database.url,
        &lapse::db::Settings::from_config(&config),
    )
    .await
    .unwrap();
    let report = lapse::amqp::topology::apply(&env.conn, &env.topology())
        .await
        .unwrap();
    assert!(report.ok(), "{report:?}");
    // Nothing moved: the objects and the history stay in `public`; `lapse` holds only
    // the kinds' tables.
    for (sql, expected) in [
        ("SELECT count(*) FROM public.orders", 10),
        (
            "SELECT max(version)::bigint FROM public.refinery_schema_history",
            latest_migration(),
        ),
        (
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'lapse'",
            3,
        ),
        (
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'lapse' AND tablename = 'orders'",
            0,
        ),
    ] {
        assert_eq!(count(&raw, sql).await, expected, "{sql}");
    }
    raw.batch_execute("ALTER TABLE public.orders ADD COLUMN note text")
        .await
        .unwrap();
    raw.batch_execute(
        "SELECT lapse.schedule('auto_confirm', id::text, now() + interval '1500 ms')
           FROM public.orders WHERE id <= 3",
    )
    .await
    .unwrap();

    let running = env.start(&config).await;
    eventually(
        Duration::from_secs(60),
        "every order in flight closed",
        || async {
            (count(
                &raw,
                "SELECT count(*) FROM public.orders WHERE status = 'CLOSED'",
            )
            .await
                == 10)
                .then_some(())
        },
    )
    .await;
    assert_eq!(
        count(
            &raw,
            "SELECT count(*) FROM public.orders WHERE closed_at < expire_at"
        )
        .await,
        0,
        "never early"
    );
    assert_eq!(
        count(
            &raw,
            "SELECT count(*) FROM public.order_events WHERE event = 'closed'"
        )
        .await,
        10,
        "closed once each"
    );
    eventually(Duration::from_secs(30), "the kind fired", || async {
        (count(
            &raw,
            "SELECT count(*) FROM public.orders WHERE note = 'confirmed'",
        )
        .await
            == 3)
            .then_some(())
    })
    .await;
    assert!(running.stop().await.is_empty());
    drop(raw);
    env.cleanup().await;
}

#[tokio::test]
async fn a_fresh_installation_creates_nothing_outside_its_schema() {
    let (env, url) = fresh_database(&["1s"]).await;
    let raw = connect(&url).await;
    // The shop's own tables, named like lapse's.
    raw.batch_execute(
        "CREATE TABLE public.orders (order_no text PRIMARY KEY, amount numeric, status int);
         CREATE TABLE public.outbox (id int PRIMARY KEY, body text);
         INSERT INTO public.orders VALUES ('A-1', 12.50, 0), ('A-2', 3, 1);
         INSERT INTO public.outbox VALUES (1, 'the shop''s own');",
    )
    .await
    .unwrap();
    let snapshot = "SELECT (SELECT string_agg(to_jsonb(o)::text, ',' ORDER BY order_no) FROM public.orders o)
                        || (SELECT string_agg(to_jsonb(x)::text, ',' ORDER BY id) FROM public.outbox x)";
    let before: String = raw.query_one(snapshot, &[]).await.unwrap().get(0);
    let objects = "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                    WHERE n.nspname = 'public'";
    let public_before = count(&raw, objects).await;

    lapse::db::migrate(&Secret::new(url.clone())).await.unwrap();
    // Twice: idempotent.
    lapse::db::migrate(&Secret::new(url.clone())).await.unwrap();

    let after: String = raw.query_one(snapshot, &[]).await.unwrap().get(0);
    assert_eq!(before, after, "the shop's tables are untouched");
    assert_eq!(
        count(&raw, objects).await,
        public_before,
        "nothing new in public"
    );
    assert_eq!(
        count(
            &raw,
            "SELECT count(*) FROM pg_proc WHERE pronamespace = 'public'::regnamespace"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &raw,
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'lapse'
               AND tablename IN ('orders', 'outbox', 'refinery_schema_history', 'deadlines')"
        )
        .await,
        4
    );
    drop(raw);
    env.cleanup().await;
}

#[tokio::test]
async fn an_earlier_installation_in_another_schema_is_refused_not_duplicated() {
    let (env, url) = fresh_database(&["1s"]).await;
    let admin = connect(&url).await;
    admin.batch_execute("CREATE SCHEMA shop").await.unwrap();
    // The earlier version, run by a role whose search path starts with `shop`.
    let mut raw = connect(&format!("{url}?options=-c%20search_path%3Dshop")).await;
    earlier::migrations::runner()
        .set_target(refinery::Target::Version(BEFORE_KINDS))
        .run_async(&mut raw)
        .await
        .unwrap();
    let refused = lapse::db::migrate(&Secret::new(url.clone()))
        .await
        .expect_err("an installation lapse cannot serve where it is");
    assert!(refused.to_string().contains("schema shop"), "{refused}");
    // Nothing was created beside it.
    assert_eq!(
        count(
            &admin,
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'lapse'"
        )
        .await,
        0
    );
    drop((raw, admin));
    env.cleanup().await;
}

#[tokio::test]
async fn an_installation_from_before_the_settings_table_is_served_where_it_is() {
    let (env, url) = fresh_database(&["1s"]).await;
    let mut raw = connect(&url).await;
    // V4: before lapse_settings existed (V5).
    earlier::migrations::runner()
        .set_target(refinery::Target::Version(4))
        .run_async(&mut raw)
        .await
        .unwrap();
    lapse::db::migrate(&Secret::new(url.clone())).await.unwrap();
    for (sql, expected) in [
        (
            "SELECT max(version)::bigint FROM public.refinery_schema_history",
            latest_migration(),
        ),
        (
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'lapse' AND tablename = 'orders'",
            0,
        ),
        (
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename = 'lapse_settings'",
            1,
        ),
    ] {
        assert_eq!(count(&raw, sql).await, expected, "{sql}");
    }
    drop(raw);
    env.cleanup().await;
}

/// The newest migration this version ships (`migrations/V<n>__*.sql`).
fn latest_migration() -> i64 {
    std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            name.strip_prefix('V')?.split("__").next()?.parse().ok()
        })
        .max()
        .unwrap()
}

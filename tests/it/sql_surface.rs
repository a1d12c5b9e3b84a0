//! The SQL functions applications call, against what an application's session may
//! hold: a temp table or an earlier schema shadowing lapse's tables (the schema
//! `lapse`), a role that may not create in `public`; and a refused payment retried after its refund was made.

use std::time::Duration;

use lapse::orders::{self, PayOutcome};

use crate::helpers::{TestEnv, count, create_orders, eventually};

/// Orders (by the function) whose timeout intent is in lapse's own outbox.
async fn intents_in_lapse_outbox(db: &tokio_postgres::Client, id: i64) -> i64 {
    db.query_one(
        "SELECT count(*) AS n FROM lapse.outbox WHERE order_id = $1 AND kind = 'timeout'",
        &[&id],
    )
    .await
    .unwrap()
    .get("n")
}

/// An order due in an hour, created through the SQL function inside `tx`.
async fn create_in(tx: &tokio_postgres::Transaction<'_>) -> i64 {
    tx.query_one(
        "SELECT lapse_create_order(now() + interval '1 hour') AS id",
        &[],
    )
    .await
    .unwrap()
    .get("id")
}

#[tokio::test]
async fn the_functions_write_lapses_tables_whatever_the_callers_search_path() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;

    // A temp table named like lapse's outbox: pg_temp is searched first unless named.
    let tx = db.transaction().await.unwrap();
    tx.batch_execute("CREATE TEMP TABLE outbox (LIKE lapse.outbox INCLUDING DEFAULTS)")
        .await
        .unwrap();
    let id = create_in(&tx).await;
    let shadowed: i64 = tx
        .query_one("SELECT count(*) AS n FROM pg_temp.outbox", &[])
        .await
        .unwrap()
        .get("n");
    tx.commit().await.unwrap();
    assert_eq!(shadowed, 0, "nothing went to the temp table");
    assert_eq!(intents_in_lapse_outbox(&db, id).await, 1);

    // An application schema with its own `orders` and `outbox` first in the path, and a
    // role that may not create anything in `public`.
    let role = format!("{}_app", env.prefix);
    db.batch_execute(&format!(
        "CREATE SCHEMA app;
         CREATE TABLE app.orders (id bigserial PRIMARY KEY, note text);
         CREATE TABLE app.outbox (LIKE lapse.outbox INCLUDING DEFAULTS);
         CREATE ROLE {role};
         REVOKE CREATE ON SCHEMA public FROM PUBLIC;
         GRANT USAGE, CREATE ON SCHEMA app TO {role};
         GRANT USAGE ON SCHEMA lapse TO {role};
         GRANT ALL ON ALL TABLES IN SCHEMA lapse, app TO {role};
         GRANT ALL ON ALL SEQUENCES IN SCHEMA lapse, app TO {role};"
    ))
    .await
    .unwrap();
    let tx = db.transaction().await.unwrap();
    tx.batch_execute(&format!(
        "SET LOCAL ROLE {role}; SET LOCAL search_path = app, lapse"
    ))
    .await
    .unwrap();
    let id = create_in(&tx).await;
    let paid: String = tx
        .query_one("SELECT lapse_pay_order($1) AS r", &[&id])
        .await
        .unwrap()
        .get("r");
    tx.commit().await.unwrap();
    assert_eq!(paid, "PAID");
    assert_eq!(intents_in_lapse_outbox(&db, id).await, 1);
    assert_eq!(count(&db, "SELECT count(*) FROM app.outbox").await, 0);
    assert_eq!(count(&db, "SELECT count(*) FROM app.orders").await, 0);
    assert_eq!(
        count(
            &db,
            &format!("SELECT count(*) FROM lapse.orders WHERE id = {id} AND status = 'PAID'")
        )
        .await,
        1
    );

    // Every function lapse installs carries its own search_path.
    let unpinned: Vec<String> = db
        .query(
            "SELECT p.oid::regprocedure::text AS f FROM pg_proc p
              WHERE p.pronamespace = 'lapse'::regnamespace
                AND NOT coalesce(p.proconfig::text LIKE '%search_path=pg_catalog,%', false)",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get("f"))
        .collect();
    assert!(
        unpinned.is_empty(),
        "functions without a search_path: {unpinned:?}"
    );
    let pinned = count(
        &db,
        "SELECT count(*) FROM pg_proc WHERE proname LIKE 'lapse\\_%' AND pronamespace = 'lapse'::regnamespace",
    )
    .await;
    assert!(pinned >= 3, "{pinned} lapse functions");
    drop(db);
    env.cleanup().await;
    let admin = crate::helpers::database_admin_url();
    let (c, conn) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    c.batch_execute(&format!("DROP ROLE IF EXISTS {role}"))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_refused_payment_is_recorded_once_per_order_even_after_its_refund() {
    let env = TestEnv::with_database(&["1s"]).await;
    let mut db = env.db().await;
    let id = create_orders(&mut db, &[Duration::from_millis(100)], &[]).await[0];
    let passed = format!(
        "SELECT count(*) FROM orders WHERE id = {} AND expire_at < clock_timestamp()",
        id.0
    );
    eventually(Duration::from_secs(30), "the deadline passed", || async {
        (count(&db, &passed).await == 1).then_some(())
    })
    .await;
    assert_eq!(orders::pay(&db, id).await.unwrap(), PayOutcome::Expired);
    let recorded = format!(
        "SELECT count(*) FROM late_payments WHERE order_id = {}",
        id.0
    );
    assert_eq!(count(&db, &recorded).await, 1);
    // The shop refunds it, then the customer's payment is retried.
    db.execute(
        "UPDATE late_payments SET refund = 'REFUNDED' WHERE order_id = $1",
        &[&id.0],
    )
    .await
    .unwrap();
    for _ in 0..3 {
        assert_eq!(orders::pay(&db, id).await.unwrap(), PayOutcome::Expired);
    }
    assert_eq!(count(&db, &recorded).await, 1, "one record, one refund");
    // A new row written around the function is refused by the index.
    let again = db
        .execute("INSERT INTO late_payments (order_id) VALUES ($1)", &[&id.0])
        .await;
    assert!(
        again.is_err(),
        "a second record of the same order was accepted"
    );
    env.cleanup().await;
}

/// lapse's migrations, to build the schema of an earlier version.
mod embedded {
    refinery::embed_migrations!("migrations");
}

/// A database that version 8 let collect repeated refund records (a PENDING one after
/// a processed one; two processed ones) is upgraded: the PENDING repeat goes, the
/// processed history stays (flagged), the single PENDING record stays, and from then
/// on a second record of any order is refused.
#[tokio::test]
async fn upgrading_keeps_one_refund_per_order_over_the_repeats_recorded_before() {
    let mut env = TestEnv::new(&["1s"]).await;
    env.database = Some(env.prefix.clone());
    let url = env.database_url();
    lapse::db::ensure_database(&lapse::config::Secret::new(url.clone()))
        .await
        .unwrap();
    let mut db = env.db().await;
    embedded::migrations::runner()
        .set_target(refinery::Target::Version(8))
        .run_async(&mut db)
        .await
        .unwrap();
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id: i64 = db
            .query_one(
                "SELECT lapse_create_order(now() + interval '1 hour') AS id",
                &[],
            )
            .await
            .unwrap()
            .get("id");
        ids.push(id);
    }
    let (repeated, history, single) = (ids[0], ids[1], ids[2]);
    for (order, refund) in [
        (repeated, "REFUNDED"),
        (repeated, "PENDING"),
        (history, "REFUNDED"),
        (history, "REFUNDED"),
        (single, "PENDING"),
    ] {
        db.execute(
            "INSERT INTO late_payments (order_id, refund) VALUES ($1, $2)",
            &[&order, &refund],
        )
        .await
        .unwrap();
    }

    lapse::db::migrate(&lapse::config::Secret::new(url))
        .await
        .unwrap();
    let rows = |order: i64| {
        let db = &db;
        async move {
            db.query(
                "SELECT refund, repeat_of_history FROM late_payments WHERE order_id = $1 ORDER BY id",
                &[&order],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, bool>(1)))
            .collect::<Vec<_>>()
        }
    };
    assert_eq!(rows(repeated).await, [("REFUNDED".to_string(), false)]);
    assert_eq!(
        rows(history).await,
        [
            ("REFUNDED".to_string(), false),
            ("REFUNDED".to_string(), true)
        ]
    );
    assert_eq!(rows(single).await, [("PENDING".to_string(), false)]);
    for order in [repeated, history, single] {
        let again = db
            .execute(
                "INSERT INTO late_payments (order_id, refund) VALUES ($1, 'PENDING')",
                &[&order],
            )
            .await
            .unwrap_err();
        assert_eq!(
            again.code(),
            Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION),
            "order {order}: {again}"
        );
    }
    env.cleanup().await;
}

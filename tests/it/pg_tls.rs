//! PostgreSQL over TLS: a private server that refuses plain connections, with a
//! certificate for `localhost` signed by a CA the test makes. `sslmode` and
//! `sslrootcert` in `database.url` are honoured as libpq does: `require` encrypts,
//! `verify-ca` checks the chain, `verify-full` the chain and the host name; a rejected
//! certificate is a configuration error (exit 2) naming `database.url`, for a command
//! and a starting worker alike. The pipeline runs over `verify-full`.

use std::time::Duration;

use lapse::config::Secret;
use lapse::orders::Line;

use crate::helpers::{TestEnv, count, create_orders, eventually, free_port, stderr, stdout};
use crate::private_pg::PrivatePostgres;
use crate::private_rabbit::TestCertificates;

/// `lapse migrate` against `url`: exit status and output.
fn migrate(env: &TestEnv, url: &str) -> (Option<i32>, String) {
    env.write_config(&format!("[database]\nurl = {url:?}\n"));
    let out = env.lapse(&["migrate"]);
    (
        out.status.code(),
        format!("{}{}", stdout(&out), stderr(&out)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sslmode_and_sslrootcert_are_honoured_and_the_pipeline_runs_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let certs = TestCertificates::generate_for(dir.path(), &["localhost"]);
    let pg = tokio::task::block_in_place(|| PrivatePostgres::start_tls(free_port(), &certs));
    let env = TestEnv::new(&["1s"]).await;
    let ca = certs.ca_file.display().to_string();
    let at = |host: &str, query: &str| {
        format!("postgres://postgres@{host}:{}/lapse_tls?{query}", pg.port)
    };

    // The server refuses plain connections: what lapse did before, and still does by
    // default.
    let (code, text) = migrate(&env, &at("127.0.0.1", "sslmode=disable"));
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("no encryption"), "{text}");

    // Encrypted, the certificate not checked (libpq's `require`).
    let (code, text) = migrate(&env, &at("127.0.0.1", "sslmode=require"));
    assert_eq!(code, Some(0), "{text}");

    // The chain is checked, not the name: 127.0.0.1 is not in the certificate.
    let (code, text) = migrate(
        &env,
        &at("127.0.0.1", &format!("sslmode=verify-ca&sslrootcert={ca}")),
    );
    assert_eq!(code, Some(0), "{text}");
    let (code, text) = migrate(
        &env,
        &at(
            "127.0.0.1",
            &format!("sslmode=verify-full&sslrootcert={ca}"),
        ),
    );
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("database.url"), "names the key: {text}");
    assert!(text.contains("certificate was rejected"), "{text}");
    let (code, text) = migrate(
        &env,
        &at(
            "localhost",
            &format!("sslmode=verify-full&sslrootcert={ca}"),
        ),
    );
    assert_eq!(code, Some(0), "{text}");
    // Without the CA the test made, the chain is not trusted.
    let (code, text) = migrate(&env, &at("localhost", "sslmode=verify-full"));
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("certificate was rejected"), "{text}");
    // A worker does not retry a rejected certificate for ever: it stops, exit 2.
    let child = crate::helpers::spawn_worker(&env, &[]);
    let (code, text) = crate::helpers::exit_of(child).await;
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("certificate was rejected"), "{text}");
    // verify-ca against every public CA would prove nothing: refused at start.
    let (code, text) = migrate(&env, &at("127.0.0.1", "sslmode=verify-ca"));
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("needs sslrootcert"), "{text}");
    // A CA file that is not one.
    let (code, text) = migrate(
        &env,
        &at(
            "localhost",
            "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
        ),
    );
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("sslrootcert"), "{text}");

    // The pipeline over TLS: orders close and release, every connection encrypted.
    let url = at(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    let report = lapse::amqp::topology::apply(&env.conn, &env.topology())
        .await
        .unwrap();
    assert!(report.ok(), "{report:?}");
    let mut config = env.config();
    config.database.url = Secret::new(url.clone());
    let worker = env.start(&config).await;
    let mut target = lapse::db::pg_config(&Secret::new(url)).unwrap();
    lapse::db::with_search_path(&mut target);
    let (mut db, connection) = lapse::db::connect(&target).await.unwrap();
    tokio::spawn(connection);
    let line = [Line {
        sku: "tls".into(),
        qty: 1,
    }];
    create_orders(&mut db, &[Duration::from_millis(1_500); 5], &line).await;
    eventually(
        Duration::from_secs(60),
        "the orders closed and released",
        || async {
            let released = count(
                &db,
                "SELECT count(*) FROM stock_ledger WHERE kind = 'release'",
            )
            .await;
            (released == 5).then_some(())
        },
    )
    .await;
    let plain = count(
        &db,
        "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
          WHERE a.datname = 'lapse_tls' AND NOT s.ssl AND a.backend_type = 'client backend'",
    )
    .await;
    assert_eq!(plain, 0, "every connection to the database is encrypted");
    worker.stop().await;
    drop(db);
    tokio::task::block_in_place(|| drop(pg));
    env.cleanup().await;
}

//! `amqps://` and `https://` against a private RabbitMQ node with TLS listeners and a
//! certificate this test generates: with the CA configured the pipeline runs over TLS;
//! without it the connection is refused with an error that says why and shows no
//! password; plain `amqp://` to the TLS port fails before any credentials are sent.

use std::time::Duration;

use lapse::amqp::broker::{BrokerError, Endpoint};
use lapse::amqp::management::Management;
use lapse::config::Secret;
use lapse::orders::Line;

use crate::helpers::{
    TestEnv, assert_never_early, count, create_orders, eventually, run_lapse, stderr, stdout,
    wait_released,
};
use crate::private_rabbit::{NodeOptions, PrivateRabbit, TestCertificates};

const PASSWORD: &str = "tls-Pa55word-never-shown";

struct TlsNode {
    rabbit: PrivateRabbit,
    certs: TestCertificates,
    _dir: tempfile::TempDir,
}

impl TlsNode {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let certs = TestCertificates::generate(dir.path());
        let rabbit = PrivateRabbit::start_with(NodeOptions {
            tls: Some(&certs),
            management: true,
        });
        for args in [
            vec!["add_user", "lapse", PASSWORD],
            vec!["set_user_tags", "lapse", "administrator"],
            vec!["set_permissions", "-p", "/", "lapse", ".*", ".*", ".*"],
        ] {
            let out = rabbit.ctl(&args);
            assert!(out.status.success(), "rabbitmqctl {args:?}");
        }
        Self {
            rabbit,
            certs,
            _dir: dir,
        }
    }

    fn amqps_url(&self) -> String {
        format!(
            "amqps://lapse:{PASSWORD}@127.0.0.1:{}/%2f",
            self.rabbit.tls_port
        )
    }

    fn management_url(&self) -> String {
        format!(
            "https://lapse:{PASSWORD}@127.0.0.1:{}",
            self.rabbit.management_tls_port
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_ca_file_the_pipeline_runs_over_verified_tls() {
    let env = TestEnv::with_database(&["1s"]).await;
    let node = tokio::task::block_in_place(TlsNode::start);
    let mut config = env.config();
    config.broker.url = Secret::new(node.amqps_url());
    config.broker.management_url = Some(Secret::new(node.management_url()));
    config.broker.tls.ca_file = Some(node.certs.ca_file.clone());
    config.validate().unwrap();

    let endpoint = lapse::amqp::endpoint(&config.broker).unwrap();
    let conn = endpoint.connect("lapse test").await.unwrap();
    assert!(
        lapse::amqp::topology::apply(&conn, &env.topology())
            .await
            .unwrap()
            .ok()
    );
    // The management API over HTTPS with the same CA.
    let management = Management::with_tls(
        config.broker.management_url.as_ref().unwrap(),
        &endpoint.tls,
    )
    .unwrap();
    let flags = management.feature_flags().await.unwrap();
    assert!(flags.iter().any(|f| f.name == "quorum_queue"));

    let worker = env.start(&config).await;
    let mut db = env.db().await;
    let line = vec![Line {
        sku: "tls".into(),
        qty: 1,
    }];
    create_orders(&mut db, &[Duration::from_millis(1_500); 5], &line).await;
    eventually(
        Duration::from_secs(30),
        "orders closed over TLS",
        || async {
            let open = count(&db, "SELECT count(*) FROM orders WHERE status = 'UNPAID'").await;
            (open == 0).then_some(())
        },
    )
    .await;
    assert_never_early(&db).await;
    wait_released(&db, 5).await;
    worker.stop().await;
    drop(conn);
    tokio::task::block_in_place(|| drop(node));
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_ca_the_connection_is_refused_and_nothing_is_sent_in_clear() {
    let env = TestEnv::new(&["1s"]).await;
    let node = tokio::task::block_in_place(TlsNode::start);

    // (b) System roots only: the test CA is unknown, so verification fails.
    let err = Endpoint::new(Secret::new(node.amqps_url()))
        .connect("lapse test")
        .await
        .unwrap_err();
    assert!(
        matches!(err, BrokerError::CertificateRejected { .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(text.contains("certificate verification failed"), "{text}");
    assert!(text.contains("broker.tls.ca_file"), "{text}");
    assert!(!text.contains(PASSWORD), "{text}");

    let management = Management::new(&Secret::new(node.management_url())).unwrap();
    let err = management.feature_flags().await.unwrap_err().to_string();
    assert!(err.contains("certificate verification failed"), "{err}");
    assert!(!err.contains(PASSWORD), "{err}");

    // The same through the binary: a clear error, exit non-zero, no password.
    let config = env.dir.path().join("tls.toml");
    std::fs::write(
        &config,
        format!(
            "[broker]\nurl = {:?}\nprefix = {:?}\n\n[topology]\nfile = {:?}\n",
            node.amqps_url(),
            env.prefix,
            env.tier_path().display().to_string()
        ),
    )
    .unwrap();
    let out = run_lapse(
        &["--config", config.to_str().unwrap(), "topology", "apply"],
        &[],
    );
    assert!(!out.status.success());
    let all = format!("{}{}", stdout(&out), stderr(&out));
    assert!(all.contains("certificate verification failed"), "{all}");
    assert!(!all.contains(PASSWORD), "{all}");

    // (c) Plain AMQP to the TLS port: the TLS listener never answers the AMQP
    // greeting, so the client never gets as far as sending its credentials.
    let plain = format!(
        "amqp://lapse:{PASSWORD}@127.0.0.1:{}/%2f",
        node.rabbit.tls_port
    );
    let attempt = tokio::time::timeout(
        Duration::from_secs(30),
        Endpoint::new(Secret::new(plain)).connect("lapse test"),
    )
    .await
    .expect("a plain connection to a TLS port fails, it does not hang");
    let err = attempt.unwrap_err().to_string();
    assert!(!err.contains(PASSWORD), "{err}");

    tokio::task::block_in_place(|| drop(node));
    env.cleanup().await;
}

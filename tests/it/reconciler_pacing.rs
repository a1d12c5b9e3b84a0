//! The sweeper's leader under long work: a reconciler walk over many historic
//! unstamped orders is paced progress, not a stall; shutdown ends a sweep or a walk
//! at once, even while it waits on the close rate; a releaser backlog that outlasts
//! the release grace period is not multiplied by re-emissions.

use std::time::{Duration, Instant};

use lapse::components::sweeper::Sweeper;
use lapse::orders::Line;
use lapse::runtime::health::Health;
use tokio_util::sync::CancellationToken;

use crate::helpers::{TestEnv, count, create_orders, eventually};
use crate::release_repair::closed_with_releases_queued;

fn sweeper(env: &TestEnv, per_second: u32) -> Sweeper {
    Sweeper {
        retention: Default::default(),
        pool: lapse::db::pool(&env.config().database, 2).unwrap(),
        stats: lapse::observe::stats::Stats::default(),
        config: env.config().sweeper,
        limiter: lapse::runtime::rate::RateLimiter::new(per_second),
        lock_timeout: Duration::from_secs(5),
        stock_release: env.config().worker.stock_release,
    }
}

#[tokio::test]
async fn a_long_reconciler_walk_is_progress_not_a_stall_and_stops_on_shutdown() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = env.db().await;
    // Historic CLOSED orders without lines and without the stamp, as after migration V6.
    db.batch_execute(
        "INSERT INTO orders (status, expire_at, closed_at, close_reason)
         SELECT 'CLOSED', now() - interval '2 hours', now() - interval '1 hour', 'sweeper'
           FROM generate_series(1, 4000)",
    )
    .await
    .unwrap();
    let mut sweeper = sweeper(&env, 0);
    sweeper.config.batch_size = 50; // 80 pages
    sweeper.config.pause = Duration::from_millis(500); // a walk of 40 s or more
    sweeper.config.interval = Duration::from_millis(100);
    let health = Health::new(Duration::from_secs(3));
    let token = CancellationToken::new();
    let run = tokio::spawn(sweeper.clone().run(health.clone(), token.clone()));
    let stamped = "SELECT count(*) FROM orders WHERE released_at IS NOT NULL";
    eventually(Duration::from_secs(60), "a good part stamped", || async {
        assert!(health.live(), "stalled: {:?}", health.stalled());
        (count(&db, stamped).await >= 1500).then_some(())
    })
    .await;
    token.cancel();
    let asked = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("the sweeper stops soon after shutdown is requested")
        .unwrap();
    assert!(asked.elapsed() < Duration::from_secs(10));
    assert!(count(&db, stamped).await < 4000, "stopped mid-walk");
    env.cleanup().await;
}

#[tokio::test]
async fn a_sweep_waiting_on_the_close_rate_stops_on_shutdown() {
    let env = TestEnv::with_database(&["1s"]).await;
    let db = env.db().await;
    db.batch_execute(
        "INSERT INTO orders (expire_at) SELECT now() - interval '1 hour' FROM generate_series(1, 300)",
    )
    .await
    .unwrap();
    // 100 closes at 1 per second: about 100 s of rate-limit wait after the first batch.
    let mut sweeper = sweeper(&env, 1);
    sweeper.config.batch_size = 100;
    let health = Health::default();
    let token = CancellationToken::new();
    let run = tokio::spawn(sweeper.clone().run(health, token.clone()));
    eventually(
        Duration::from_secs(30),
        "the first batch closed",
        || async {
            (count(&db, "SELECT count(*) FROM orders WHERE status = 'CLOSED'").await >= 100)
                .then_some(())
        },
    )
    .await;
    token.cancel();
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("the sweeper stops soon after shutdown is requested")
        .unwrap();
    env.cleanup().await;
}

#[tokio::test]
async fn a_releaser_backlog_is_re_emitted_with_a_growing_gap_per_order() {
    let env = TestEnv::with_database(&["250ms", "1s"]).await;
    let mut db = env.db().await;
    let line = vec![Line {
        sku: "slow".into(),
        qty: 1,
    }];
    create_orders(&mut db, &[Duration::from_millis(300); 5], &line).await;
    // No releaser: the releases wait in their queue, as during a releaser outage.
    let mut config = env.config();
    config.worker.releaser = false;
    config.worker.stock_release = lapse::close::StockRelease::Event;
    let closer = env.start(&config).await;
    closed_with_releases_queued(&env, &db, 5, 5).await;
    let mut sweeper = sweeper(&env, 0);
    let grace = Duration::from_secs(1);
    sweeper.config.release_grace = grace;
    eventually(Duration::from_secs(60), "a second re-emission", || async {
        sweeper.run_once().await.unwrap();
        (count(
            &db,
            "SELECT count(*) FROM orders WHERE release_repairs >= 2",
        )
        .await
            > 0)
        .then_some(())
    })
    .await;
    // Database times: the n-th re-emission comes at least grace * 2^(n-1) after the
    // previous one (a little less for the events' own timestamps).
    let gaps = db
        .query(
            "SELECT (detail->>'repair')::int AS repair,
                    extract(epoch FROM at - lag(at) OVER (PARTITION BY order_id ORDER BY at))::float8 AS gap_s
               FROM order_events WHERE event = 'release_repaired'",
            &[],
        )
        .await
        .unwrap();
    let mut seen = 0;
    for row in gaps {
        let (repair, gap): (i32, Option<f64>) = (row.get("repair"), row.get("gap_s"));
        if let Some(gap) = gap {
            let least = grace.as_secs_f64() * 2f64.powi(repair - 1) * 0.95;
            assert!(
                gap >= least,
                "repair {repair} came {gap} s after the previous one"
            );
            seen += 1;
        }
    }
    assert!(seen > 0);
    closer.stop().await;
    env.cleanup().await;
}

//! The supervisor driven by plain futures: no broker, no database.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use super::*;

fn policy() -> RestartPolicy {
    RestartPolicy {
        first: Duration::from_millis(100),
        max: Duration::from_secs(2),
        reset_after: Duration::from_secs(60),
    }
}

/// A component that counts its ticks until cancelled.
fn ticking(ticks: Arc<AtomicU32>) -> Factory {
    Box::new(move |token: CancellationToken| {
        let ticks = ticks.clone();
        Box::pin(async move {
            loop {
                tokio::select! {
                    _ = token.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                }
                ticks.fetch_add(1, Ordering::Relaxed);
            }
        })
    })
}

/// A component that panics shortly after every start.
fn panicking(starts: Arc<AtomicU32>) -> Factory {
    Box::new(move |_token| {
        let starts = starts.clone();
        Box::pin(async move {
            starts.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(5)).await;
            panic!("order 7 has an impossible deadline");
        })
    })
}

#[tokio::test(start_paused = true)]
async fn a_panicking_component_is_restarted_with_back_off_and_the_others_carry_on() {
    let health = Health::default();
    let token = CancellationToken::new();
    let mut supervisor = Supervisor::new(health.clone(), token.clone(), policy());
    let (ticks, starts) = (Arc::default(), Arc::<AtomicU32>::default());
    supervisor.add("ticker", ticking(Arc::clone(&ticks)));
    supervisor.add("faulty", panicking(Arc::clone(&starts)));
    let running = tokio::spawn(async move {
        let stop = supervisor.run().await;
        (stop, supervisor.drain(Duration::from_secs(1)).await)
    });

    tokio::time::sleep(Duration::from_millis(50)).await;
    let state = &health.snapshot()["faulty"];
    assert!(!state.up, "shown as down while it waits to restart");
    assert_eq!(
        state.last_error.as_deref(),
        Some("panicked: order 7 has an impossible deadline")
    );
    assert!(!health.healthy());
    assert!(health.live(), "a restarting component is not a stalled one");

    // Back-off: over 10 s at most ~100+200+400+800+1600+2000*... ms of delays fit.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let restarts = health.snapshot()["faulty"].restarts;
    let started = starts.load(Ordering::Relaxed);
    assert!(
        (3..=20).contains(&started),
        "restarted, but paced by back-off: {started} starts"
    );
    assert!(restarts + 1 >= started && restarts <= started, "{restarts}");
    assert!(
        ticks.load(Ordering::Relaxed) > 500,
        "the healthy component kept running"
    );
    assert!(health.snapshot()["ticker"].up);

    token.cancel();
    let (stop, abandoned) = running.await.unwrap();
    assert_eq!(stop, Stop::Requested);
    assert!(abandoned.is_empty(), "{abandoned:?}");
}

#[tokio::test(start_paused = true)]
async fn a_fatal_failure_stops_every_component_and_is_reported() {
    let health = Health::default();
    let token = CancellationToken::new();
    let mut supervisor = Supervisor::new(health.clone(), token.clone(), policy());
    let ticks = Arc::default();
    supervisor.add("ticker", ticking(Arc::clone(&ticks)));
    supervisor.add(
        "consumer",
        Box::new(|_token| {
            Box::pin(async {
                tokio::time::sleep(Duration::from_millis(30)).await;
                Err(Fatal("the broker refused the credentials".into()))
            })
        }),
    );
    let stop = supervisor.run().await;
    assert_eq!(
        stop,
        Stop::Fatal {
            component: "consumer",
            reason: "the broker refused the credentials".into()
        }
    );
    assert!(token.is_cancelled(), "the others are told to stop");
    assert!(supervisor.drain(Duration::from_secs(1)).await.is_empty());
    let after = ticks.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(ticks.load(Ordering::Relaxed), after, "the ticker stopped");
}

#[tokio::test(start_paused = true)]
async fn a_component_returning_on_its_own_is_a_failure_and_one_ignoring_shutdown_is_abandoned() {
    let health = Health::default();
    let token = CancellationToken::new();
    let mut supervisor = Supervisor::new(health.clone(), token.clone(), policy());
    let starts = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&starts);
    supervisor.add(
        "stubborn",
        Box::new(move |_token| {
            let counted = Arc::clone(&counted);
            Box::pin(async move {
                if counted.fetch_add(1, Ordering::Relaxed) == 0 {
                    return Ok(()); // returns although nobody asked it to stop
                }
                std::future::pending::<()>().await; // then ignores the token
                Ok(())
            })
        }),
    );
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        cancel.cancel();
    });
    assert_eq!(supervisor.run().await, Stop::Requested);
    assert_eq!(starts.load(Ordering::Relaxed), 2, "restarted once");
    assert_eq!(
        health.snapshot()["stubborn"].last_error.as_deref(),
        Some("stopped unexpectedly")
    );
    assert_eq!(
        supervisor.drain(Duration::from_millis(500)).await,
        vec!["stubborn"]
    );
}

#[test]
fn restart_delays_grow_are_capped_and_jittered() {
    let p = policy();
    for failures in 1..40 {
        let ceiling = p
            .first
            .saturating_mul(1 << (failures - 1).min(20))
            .min(p.max);
        let d = p.delay(failures);
        assert!(d >= ceiling / 2 && d <= ceiling, "{failures}: {d:?}");
    }
    let draws: std::collections::HashSet<Duration> = (0..20).map(|_| p.delay(5)).collect();
    assert!(draws.len() > 1, "jittered");
}

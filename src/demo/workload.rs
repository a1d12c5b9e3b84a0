//! The demo's customers: a plan of orders (when each is created, its deadline, what
//! happens to it before or after the deadline) and its execution against the
//! database, through the same calls an application makes (`orders::create`, `pay`,
//! `extend_by`).
//!
//! The mix: orders are created during the first 45 % of the run, with deadlines up to
//! 45 % of the run — half of them exactly a tier's length (when such tiers fit), the
//! others in between; a third are paid before their deadline, a tenth are extended
//! halfway, and one in fourteen is paid just after its deadline (refused and recorded
//! for a refund). The rest are left to close.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::db::Pool;
use chrono::Utc;
use futures_util::StreamExt;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::orders::{self, Deadline, Line, OrderId, PayOutcome};
use crate::tier::TierSet;

/// The SKUs the demo sells.
pub const SKUS: [&str; 3] = ["apple", "pear", "plum"];
/// At most this many units per line (stock is sized from it).
pub const MAX_QTY: i32 = 3;
/// Orders being created at once.
const IN_FLIGHT: usize = 4;

/// What happens to an order after it is created.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Left to close at its deadline.
    Nothing,
    /// Paid at this fraction of the time to its deadline.
    PayEarly(f64),
    /// Extended halfway to its deadline, by this much.
    Extend(Duration),
    /// Paid this long after its deadline: must be refused.
    PayLate(Duration),
}

#[derive(Clone, Debug)]
pub struct PlannedOrder {
    /// From the start of the run.
    pub create_at: Duration,
    pub expires_in: Duration,
    pub lines: Vec<Line>,
    pub action: Action,
}

/// The whole run's orders, by creation time.
pub fn plan(orders: u32, duration: Duration, tiers: &TierSet, seed: u64) -> Vec<PlannedOrder> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let window = duration.mul_f64(0.45);
    let longest = window.max(Duration::from_millis(500));
    let shortest = Duration::from_millis(300).min(longest);
    let on_tier: Vec<Duration> = tiers
        .iter()
        .map(|t| t.duration())
        .filter(|d| *d >= shortest && *d <= longest)
        .collect();
    let extension_max = duration.mul_f64(0.05).max(Duration::from_millis(200));
    let mut planned: Vec<PlannedOrder> = (0..orders)
        .map(|_| {
            let create_at = window.mul_f64(rng.f64());
            let expires_in = if !on_tier.is_empty() && rng.bool() {
                on_tier[rng.usize(..on_tier.len())]
            } else {
                // Whole milliseconds between the bounds: practically never a tier.
                let span = (longest - shortest).as_millis() as u64;
                (shortest + Duration::from_millis(rng.u64(0..=span) | 1)).min(longest)
            };
            let action = match rng.u32(0..42) {
                0..14 => Action::PayEarly(0.2 + 0.4 * rng.f64()),
                14..18 => Action::Extend(extension_max.mul_f64(0.2 + 0.8 * rng.f64())),
                18..21 => Action::PayLate(Duration::from_millis(rng.u64(50..400))),
                _ => Action::Nothing,
            };
            let lines = lines(&mut rng);
            PlannedOrder {
                create_at,
                expires_in,
                lines,
                action,
            }
        })
        .collect();
    planned.sort_by_key(|o| o.create_at);
    planned
}

fn lines(rng: &mut fastrand::Rng) -> Vec<Line> {
    let first = rng.usize(..SKUS.len());
    let count = rng.usize(1..=2);
    (0..count)
        .map(|i| Line {
            sku: SKUS[(first + i) % SKUS.len()].to_string(),
            qty: rng.i32(1..=MAX_QTY),
        })
        .collect()
}

/// What the workload did so far (read by the progress display and the report).
#[derive(Debug, Default)]
pub struct Counters {
    pub scheduled: AtomicU64,
    pub paid: AtomicU64,
    pub extended: AtomicU64,
    /// Payments made after the deadline and refused (EXPIRED or LATE).
    pub late_refused: AtomicU64,
    /// Payments made after the deadline and accepted: must stay 0.
    pub late_accepted: AtomicU64,
    /// Early payments or extensions refused because the deadline had passed by the
    /// time they ran (a slow machine); the order then closes.
    pub too_slow: AtomicU64,
    /// Payments or extensions that failed with a database error.
    pub errors: AtomicU64,
}

fn add(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Creates the planned orders on time and runs their actions; returns when the last
/// action ran, or at once when `token` is cancelled. An order that cannot be created
/// is an error; a failed payment or extension is counted.
///
/// Each order is created in its own transaction, as an application would, a few at
/// a time, with an absolute deadline: the actions are timed from that deadline, so a
/// payment "just after the deadline" is after it whatever the creation took.
pub async fn run(
    plan: Vec<PlannedOrder>,
    pool: Pool,
    counters: Arc<Counters>,
    token: CancellationToken,
) -> anyhow::Result<()> {
    let start = Instant::now();
    let mut actions = JoinSet::new();
    let mut next = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    while next < plan.len() {
        tokio::select! {
            _ = tick.tick() => {}
            () = token.cancelled() => return Ok(()),
        }
        let now = start.elapsed();
        let due = plan[next..].partition_point(|o| o.create_at <= now);
        let created: Vec<anyhow::Result<(OrderId, Instant)>> =
            futures_util::stream::iter(&plan[next..next + due])
                .map(|order| create_one(&pool, order))
                .buffered(IN_FLIGHT)
                .collect()
                .await;
        for (order, created) in plan[next..next + due].iter().zip(created) {
            let (id, deadline) = created?;
            counters.scheduled.fetch_add(1, Ordering::Relaxed);
            if order.action != Action::Nothing {
                let (pool, counters) = (pool.clone(), counters.clone());
                actions.spawn(act(order.clone(), id, deadline, pool, counters));
            }
        }
        next += due;
        while actions.try_join_next().is_some() {}
    }
    loop {
        tokio::select! {
            joined = actions.join_next() => if joined.is_none() { return Ok(()) },
            () = token.cancelled() => return Ok(()),
        }
    }
}

/// Creates one order due `expires_in` from now; returns its id and its deadline on
/// this process's clock (the database rounds the deadline up to the millisecond).
async fn create_one(pool: &Pool, order: &PlannedOrder) -> anyhow::Result<(OrderId, Instant)> {
    let client = pool.get().await?;
    let deadline = Instant::now() + order.expires_in;
    let at = Utc::now() + chrono::Duration::from_std(order.expires_in)?;
    let id = orders::create(&**client, Deadline::At(at), &order.lines).await?;
    Ok((id, deadline))
}

async fn act(
    order: PlannedOrder,
    id: OrderId,
    deadline: Instant,
    pool: Pool,
    counters: Arc<Counters>,
) {
    let before = |f: f64| deadline - order.expires_in.mul_f64(1.0 - f);
    let at = match &order.action {
        Action::Nothing => return,
        Action::PayEarly(f) => before(*f),
        Action::Extend(_) => before(0.5),
        Action::PayLate(after) => deadline + *after,
    };
    tokio::time::sleep_until(at).await;
    let client = match pool.get().await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(order = %id, error = %e, "demo: no database connection for an action");
            return add(&counters.errors);
        }
    };
    match order.action {
        Action::Nothing => {}
        Action::PayEarly(_) | Action::PayLate(_) => {
            let late = matches!(order.action, Action::PayLate(_));
            match orders::pay(&**client, id).await {
                Ok(PayOutcome::Paid) if late => add(&counters.late_accepted),
                Ok(PayOutcome::Paid) => add(&counters.paid),
                Ok(PayOutcome::Expired | PayOutcome::Late) if late => add(&counters.late_refused),
                Ok(PayOutcome::Expired | PayOutcome::Late) => add(&counters.too_slow),
                Ok(other) => {
                    tracing::warn!(order = %id, outcome = ?other, "demo: unexpected payment outcome");
                    add(&counters.errors)
                }
                Err(e) => {
                    tracing::warn!(order = %id, error = %e.detail(), "demo: payment failed");
                    add(&counters.errors)
                }
            }
        }
        Action::Extend(by) => match orders::extend_by(&**client, id, by).await {
            Ok(Some(_)) => add(&counters.extended),
            Ok(None) => add(&counters.too_slow),
            Err(e) => {
                tracing::warn!(order = %id, error = %e.detail(), "demo: extension failed");
                add(&counters.errors)
            }
        },
    }
}

/// When the last deadline of the plan falls, from the start (extensions included).
pub fn last_deadline(plan: &[PlannedOrder]) -> Duration {
    plan.iter()
        .map(|o| {
            let extra = match &o.action {
                Action::Extend(by) => *by,
                Action::PayLate(after) => *after,
                _ => Duration::ZERO,
            };
            o.create_at + o.expires_in + extra
        })
        .max()
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::Tier;

    fn tiers() -> TierSet {
        TierSet::new(
            ["1s", "5s", "15s", "1m"]
                .map(|t| Tier::parse(t).unwrap())
                .to_vec(),
        )
    }

    #[test]
    fn the_mix_has_every_kind_of_order_and_deadlines_on_and_between_tiers() {
        let plan = plan(3000, Duration::from_secs(60), &tiers(), 7);
        assert_eq!(plan.len(), 3000);
        let count = |f: &dyn Fn(&PlannedOrder) -> bool| plan.iter().filter(|o| f(o)).count();
        let early = count(&|o| matches!(o.action, Action::PayEarly(_)));
        assert!((800..1200).contains(&early), "{early} paid early");
        assert!(count(&|o| matches!(o.action, Action::Extend(_))) > 100);
        assert!(count(&|o| matches!(o.action, Action::PayLate(_))) > 50);
        let on_tier = count(&|o| [1, 5, 15].map(Duration::from_secs).contains(&o.expires_in));
        assert!(on_tier > 1000 && on_tier < 2000, "{on_tier} on a tier");
        assert!(plan.iter().all(|o| o.create_at <= Duration::from_secs(27)));
        assert!(plan.iter().all(|o| o.expires_in <= Duration::from_secs(27)));
        assert!(plan.windows(2).all(|w| w[0].create_at <= w[1].create_at));
        assert!(last_deadline(&plan) <= Duration::from_secs(60));
    }

    #[test]
    fn a_short_run_keeps_its_deadlines_short() {
        let plan = plan(150, Duration::from_secs(5), &tiers(), 1);
        assert!(
            plan.iter()
                .all(|o| o.expires_in >= Duration::from_millis(300)
                    && o.expires_in <= Duration::from_millis(2250))
        );
    }
}

//! The release reconciler: finds CLOSED orders whose stock release never happened
//! and emits it again. Run by the sweeper's leader after each sweep.
//!
//! A release can be lost after its close committed: its event parked (a delivery
//! limit spent by an older lapse or a broker outage), purged, or dropped with a
//! deleted queue. The database knows: the releaser stamps `orders.released_at` in
//! the transaction that writes the `release` ledger rows, so "CLOSED, unstamped,
//! closed more than `sweeper.release_grace` ago" is a small partial index
//! (`orders_unreleased`) walked by keyset pagination in bounded pages.
//!
//! For each such order, in one transaction per page: if it has no lines or already
//! has `release` ledger rows, only the stamp is missing and it is set; otherwise, unless a
//! `stock.release` outbox row is still pending, a new one is written (the same
//! payload as the close path's) and counted in `release_repairs`. Idempotent: the
//! ledger's primary key makes a duplicate release a no-op. Bounded: an order is
//! re-emitted at most [`MAX_REPAIRS`] times, the n-th time only `release_grace * 2^(n-1)`
//! after the previous one, so a releaser backlog that outlasts the grace period (an
//! outage) is not multiplied by duplicates, and a release that can never succeed
//! (parked by the releaser for bad data) is not re-emitted forever. What it repairs is
//! counted (`release_repaired`): it should be 0.
//!
//! A row whose deadline lies outside the range lapse handles (written before the
//! deadline rules existed) cannot be updated while `orders_expire_at_in_range` exists,
//! even `NOT VALID`: it is skipped, counted and logged with its value, never allowed to
//! fail the page (docs/operations.md says how to repair it).
//!
//! Paced: a pass handles at most [`PAGES_PER_PASS`] pages and continues where it
//! stopped on the next pass ([`Cursor`]); it reports progress after each page, the pause
//! between pages is idleness, not a stall, and shutdown ends it between pages. The first
//! pass over a database with many historic unstamped orders is a long, paced walk.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;
use tokio_util::sync::CancellationToken;

use crate::config::SweeperConfig;
use crate::db::{DbError, Lease, column};
use crate::deadline;
use crate::observe::stats::{Outcome, Stats};
use crate::runtime::health::Busy;

/// Re-emissions of one order's release before the reconciler leaves it to a person.
pub const MAX_REPAIRS: i32 = 3;

/// Pages one pass handles at most; the next pass continues after the last one.
pub const PAGES_PER_PASS: usize = 20;

/// What one reconciler pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Unstamped CLOSED orders past the grace period that were looked at.
    pub scanned: usize,
    /// Orders that had nothing (left) to release: stamped, nothing emitted.
    pub stamped: usize,
    /// Orders whose lost release was emitted again.
    pub repaired: usize,
    /// Orders still unreleased after [`MAX_REPAIRS`] re-emissions.
    pub exhausted: usize,
    /// Orders skipped because their deadline lies outside the range lapse handles.
    pub unreadable: usize,
    /// True when the pass stopped at [`PAGES_PER_PASS`] (or shutdown) before the end
    /// of the index; the next pass continues from there.
    pub more: bool,
    /// True when the sweeper's lease was lost part-way: the pass stopped there.
    pub lost_lead: bool,
}

/// Where the walk over the unreleased index stands between passes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    after: Option<(DateTime<Utc>, i64)>,
}

const STAMP_SQL: &str = "
UPDATE orders o SET released_at = clock_timestamp()
 WHERE o.id = ANY($1) AND o.status = 'CLOSED' AND o.released_at IS NULL
   AND (NOT EXISTS (SELECT 1 FROM order_lines l WHERE l.order_id = o.id)
        OR EXISTS (SELECT 1 FROM stock_ledger s WHERE s.order_id = o.id AND s.kind = 'release'))";

/// The n-th re-emission waits `release_grace * 2^(n-1)` after the previous one (the
/// exponent is capped so the interval stays finite whatever an operator writes).
const REEMIT_SQL: &str = concat!(
    "
WITH pending AS MATERIALIZED (
    -- One pass over the outbox per page, whatever the planner thinks of it.
    SELECT DISTINCT order_id FROM outbox WHERE kind = 'stock.release' AND order_id = ANY($1)
),
lost AS (
    UPDATE orders o
       SET release_repairs = o.release_repairs + 1, release_repaired_at = clock_timestamp()
     WHERE o.id = ANY($1) AND o.status = 'CLOSED' AND o.released_at IS NULL
       AND o.release_repairs < $2
       AND (o.release_repaired_at IS NULL
            OR o.release_repaired_at < now() - $3::bigint * interval '1 millisecond'
                                          * power(2, least(greatest(o.release_repairs, 0), 20)))
       AND NOT EXISTS (SELECT 1 FROM stock_ledger s WHERE s.order_id = o.id AND s.kind = 'release')
       AND NOT EXISTS (SELECT 1 FROM pending p WHERE p.order_id = o.id)
    RETURNING o.id, o.release_repairs
),
emitted AS (
    ",
    crate::close::release_outbox_insert!("lost"),
    "
),
events AS (
    INSERT INTO order_events (order_id, event, detail)
    SELECT id, 'release_repaired', jsonb_build_object('by', 'reconciler', 'repair', release_repairs)
      FROM lost
)
SELECT count(*) AS repaired FROM lost"
);

const EXHAUSTED_SQL: &str = "
SELECT count(*) AS exhausted FROM orders
 WHERE id = ANY($1) AND released_at IS NULL AND release_repairs >= $2";

/// One reconciler pass: at most [`PAGES_PER_PASS`] pages from `cursor`, which is left
/// where the next pass continues (back at the start once the index is walked). `busy`
/// (when given) hears of progress after every page; `token` ends the pass between
/// pages and cuts the pause short.
// Over 60 lines on purpose: one keyset-paged pass (page, stamp, re-emit, count); the cursor and the counters span the loop.
#[allow(clippy::too_many_arguments)] // The connection and its limits, the lease, the settings, the metrics, the cursor, the watchdog and shutdown: each used on every page.
pub async fn run_pass(
    client: &mut deadpool_postgres::Client,
    limits: crate::db::Limits,
    lease: &mut Lease,
    config: &SweeperConfig,
    stats: &Stats,
    cursor: &mut Cursor,
    busy: Option<&Busy>,
    token: &CancellationToken,
) -> Result<ReconcileReport, DbError> {
    let mut report = ReconcileReport::default();
    let grace_ms = millis(config.release_grace);
    let mut unreadable = Vec::new();
    let select = format!(
        "SELECT id, closed_at, {} AS readable, expire_at::text AS raw FROM orders
          WHERE status = 'CLOSED' AND released_at IS NULL
            AND closed_at < now() - $1::bigint * interval '1 millisecond'
            AND ($2::timestamptz IS NULL OR (closed_at, id) > ($2, $3))
          ORDER BY closed_at, id
          LIMIT $4",
        deadline::in_range_sql("expire_at")
    );
    let mut pages = 0;
    loop {
        if pages >= PAGES_PER_PASS || token.is_cancelled() {
            report.more = true;
            break;
        }
        pages += 1;
        let (after_at, after_id) = cursor.after.map_or((None, 0), |(at, id)| (Some(at), id));
        // The page is read in the transaction that stamps it: every statement of a
        // pooled connection runs in a transaction opened under the pool's limits.
        let tx = crate::db::begin_short(client, limits, None).await?;
        let rows = tx
            .query_typed(
                &select,
                &[
                    (&grace_ms, tokio_postgres::types::Type::INT8),
                    (&after_at, tokio_postgres::types::Type::TIMESTAMPTZ),
                    (&after_id, tokio_postgres::types::Type::INT8),
                    (&config.batch_size, tokio_postgres::types::Type::INT8),
                ],
            )
            .await?;
        let Some(last) = rows.last() else {
            *cursor = Cursor::default();
            break;
        };
        cursor.after = Some((column(last, "closed_at")?, column(last, "id")?));
        let mut ids = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: i64 = column(row, "id")?;
            if column::<bool>(row, "readable")? {
                ids.push(id);
            } else {
                let raw: String = column(row, "raw").unwrap_or_else(|_| "?".into());
                unreadable.push(format!("order {id} ({raw})"));
            }
        }
        if !lease.fence(&tx, None).await? {
            report.lost_lead = true;
            break;
        }
        let stamped = tx
            .execute_typed(
                STAMP_SQL,
                &[(&ids, tokio_postgres::types::Type::INT8_ARRAY)],
            )
            .await?;
        let repaired: i64 = column(
            &tx.query_typed_one(
                REEMIT_SQL,
                &[
                    (&ids, tokio_postgres::types::Type::INT8_ARRAY),
                    (&MAX_REPAIRS, tokio_postgres::types::Type::INT4),
                    (&grace_ms, tokio_postgres::types::Type::INT8),
                ],
            )
            .await?,
            "repaired",
        )?;
        let exhausted: i64 = column(
            &tx.query_typed_one(
                EXHAUSTED_SQL,
                &[
                    (&ids, tokio_postgres::types::Type::INT8_ARRAY),
                    (&MAX_REPAIRS, tokio_postgres::types::Type::INT4),
                ],
            )
            .await?,
            "exhausted",
        )?;
        tx.commit().await?;
        report.scanned += rows.len();
        report.stamped += usize::try_from(stamped).unwrap_or(usize::MAX);
        report.repaired += usize::try_from(repaired).unwrap_or(0);
        report.exhausted += usize::try_from(exhausted).unwrap_or(0);
        if let Some(busy) = busy {
            busy.progress();
        }
        if i64::try_from(rows.len()).unwrap_or(i64::MAX) < config.batch_size {
            *cursor = Cursor::default();
            break;
        }
        // Pacing is deliberate idleness, not a stall; shutdown cuts it short.
        let pause = async {
            tokio::select! {
                _ = tokio::time::sleep(config.pause) => {}
                _ = token.cancelled() => {}
            }
        };
        match busy {
            Some(busy) => busy.idle_while(pause).await,
            None => pause.await,
        }
    }
    report.unreadable = unreadable.len();
    stats.record(
        Outcome::ReleaseRepaired,
        u64::try_from(report.repaired).unwrap_or(u64::MAX),
    );
    if report.repaired > 0 {
        tracing::warn!(
            repaired = report.repaired,
            "reconciler emitted stock releases again that were lost after their close"
        );
    }
    if report.exhausted > 0 {
        tracing::error!(
            orders = report.exhausted,
            max_repairs = MAX_REPAIRS,
            "closed orders are still unreleased after every re-emission: see <P>.parked for the reason"
        );
    }
    if !unreadable.is_empty() {
        tracing::error!(
            orders = unreadable.len(),
            first = %unreadable.iter().take(5).cloned().collect::<Vec<_>>().join("; "),
            "reconciler skipped closed orders whose deadline lapse cannot handle (their row cannot be stamped); repair them (docs/operations.md)"
        );
    }
    Ok(report)
}

/// A duration in whole milliseconds for SQL, saturating.
fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Re-emitted releases (should be 0): in the last `window_minutes`, and ever.
pub async fn repairs<C: GenericClient>(db: &C, window_minutes: i64) -> Result<(i64, i64), DbError> {
    let row = db
        .query_typed_one(
            "SELECT count(*) FILTER (WHERE release_repaired_at > now() - $1::bigint * interval '1 minute') AS recent,
                    coalesce(sum(release_repairs), 0)::bigint AS total
               FROM orders WHERE release_repaired_at IS NOT NULL",
            &[(&window_minutes, tokio_postgres::types::Type::INT8)],
        )
        .await?;
    Ok((column(&row, "recent")?, column(&row, "total")?))
}

//! Every metric lapse exports: its name, type, unit and help text, in one place.
//! `docs/metrics.md` documents the same list with a PromQL example for each.
//!
//! Names say one thing each and carry their base unit (`_seconds`, `_total` for
//! counters); labels have few values.

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};

pub const CLOSE_LATENESS: &str = "lapse_close_lateness_seconds";
pub const CLOSES: &str = "lapse_closes_total";
pub const DECISIONS: &str = "lapse_decisions_total";
pub const REDELAYS: &str = "lapse_redelays_total";
pub const REDELAYS_REFUSED: &str = "lapse_redelays_refused_total";
pub const HOLDS: &str = "lapse_holds_total";
pub const PARKED: &str = "lapse_parked_total";
pub const UNROUTABLE: &str = "lapse_unroutable_total";
pub const RENEWALS: &str = "lapse_renewals_total";
pub const TIER_HOPS: &str = "lapse_tier_hops_total";
pub const RELAY_PUBLISHED: &str = "lapse_relay_published_total";
pub const RELAY_REFUSED: &str = "lapse_relay_refused_total";
pub const OUTBOX_ROWS: &str = "lapse_outbox_rows";
pub const RELAY_NOTIFICATIONS: &str = "lapse_relay_notifications";
pub const ORDERS_OVERDUE: &str = "lapse_orders_overdue";
pub const ORDERS_OVERDUE_OLDEST_AGE: &str = "lapse_orders_overdue_oldest_seconds";
pub const OUTBOX_OLDEST_AGE: &str = "lapse_outbox_oldest_age_seconds";
pub const OUTBOX_STUCK: &str = "lapse_outbox_stuck_rows";
pub const RELEASES: &str = "lapse_releases_total";
pub const RELEASE_RETRIES: &str = "lapse_release_retries_total";
pub const RELEASES_DEFERRED: &str = "lapse_releases_deferred_total";
pub const RELEASES_LOCKED: &str = "lapse_releases_locked_total";
pub const RECONCILER_REPAIRS: &str = "lapse_reconciler_repairs_total";
pub const SWEEPER_LOCKED: &str = "lapse_sweeper_locked_total";
pub const UNREADABLE_DEADLINES: &str = "lapse_orders_unreadable_deadline";
pub const RECONNECTS: &str = "lapse_reconnects_total";
pub const RESTARTS: &str = "lapse_component_restarts_total";
pub const LIMITER_WAIT: &str = "lapse_limiter_wait_seconds";
pub const COMPONENT_UP: &str = "lapse_component_up";
pub const QUEUE_MESSAGES: &str = "lapse_queue_messages";
pub const QUEUE_CONSUMERS: &str = "lapse_queue_consumers";
pub const BUILD_INFO: &str = "lapse_build_info";
pub const RETENTION_PRUNED: &str = "lapse_retention_pruned_total";
/// The `table` label values of [`RETENTION_PRUNED`] (`components::retention` names its
/// tables with them).
pub const RETENTION_TABLES: [&str; 3] = ["timeline", "ledger", "late_payments"];
pub const PARKED_ENTRIES: &str = "lapse_parked_entries";
pub const KIND_FIRES: &str = "lapse_kind_fires_total";
/// The `outcome` label values of [`KIND_FIRES`].
pub const KIND_FIRE_OUTCOMES: [&str; 3] = ["fired", "nothing", "failed"];

/// Histogram buckets of [`CLOSE_LATENESS`] and [`LIMITER_WAIT`]: 1 ms to 60 s.
pub const LATENESS_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
];

/// Registers the help text of every metric, and `lapse_build_info`; call once, after
/// the recorder is installed.
pub fn describe() {
    describe_all();
    // Counters whose labels are known in advance exist from the start at 0: a rate or
    // an increase over them is 0, not "no data", until the first event.
    metrics::counter!(RELEASES).increment(0);
    for reason in ["not_due", "database_retry"] {
        metrics::counter!(REDELAYS, "reason" => reason).increment(0);
    }
    for reason in ["not_due", "locked"] {
        metrics::counter!(HOLDS, "reason" => reason).increment(0);
    }
    for path in ["timeout", "sweeper"] {
        metrics::counter!(CLOSES, "path" => path).increment(0);
    }
    for table in RETENTION_TABLES {
        metrics::counter!(RETENTION_PRUNED, "table" => table).increment(0);
    }
}

/// Starts the per-kind counters at 0 for the kinds a worker knows.
pub fn describe_kinds<'a>(kinds: impl IntoIterator<Item = &'a str>) {
    for kind in kinds {
        for outcome in KIND_FIRE_OUTCOMES {
            metrics::counter!(KIND_FIRES, "kind" => kind.to_string(), "outcome" => outcome)
                .increment(0);
        }
    }
}

// Over 60 lines on purpose: one describe call per metric: it is the catalogue itself.
fn describe_all() {
    describe_histogram!(
        CLOSE_LATENESS,
        Unit::Seconds,
        "Close time minus deadline of each closed order, by path (timeout: the due-queue consumer; sweeper: the backstop scan)."
    );
    describe_counter!(
        CLOSES,
        Unit::Count,
        "Orders closed, by path (timeout or sweeper)."
    );
    describe_counter!(
        DECISIONS,
        Unit::Count,
        "Timeout deliveries the worker decided, by outcome (closed, missing, settled, stale, raced, redelayed, held, locked, retried, parked, gave_up, unroutable)."
    );
    describe_counter!(
        REDELAYS,
        Unit::Count,
        "Timeouts the worker published to a wait tier again, by reason (not_due; database_retry: the database was unavailable)."
    );
    describe_counter!(
        REDELAYS_REFUSED,
        Unit::Count,
        "Re-delays the broker refused (a full wait tier); the delivery is kept and decided again."
    );
    describe_counter!(
        HOLDS,
        Unit::Count,
        "Timeouts the worker held back in memory, by reason (not_due: shorter than the smallest tier; locked: the order row was locked)."
    );
    describe_counter!(
        PARKED,
        Unit::Count,
        "Messages copied to the parked queue, by component and reason (undecodable, bad_deadline, unknown_shard, unknown_kind, action_failed, database_unavailable, unroutable, release_failed)."
    );
    describe_counter!(
        UNROUTABLE,
        Unit::Count,
        "Publishes whose queue was missing, by component; the relay keeps the row, the worker keeps or parks the delivery."
    );
    describe_counter!(
        RENEWALS,
        Unit::Count,
        "Deliveries kept unacknowledged as long as the broker's consumer timeout allows (half of broker.consumer_timeout), by component and result (renewed: replaced by a fresh copy; given_back: the copy could not be published, basic.nack)."
    );
    describe_counter!(
        TIER_HOPS,
        Unit::Count,
        "Timeout messages published to a wait tier or to the due queue (tier=\"due\"), by relay and worker."
    );
    describe_counter!(
        RELAY_PUBLISHED,
        Unit::Count,
        "Outbox rows the relay published (confirmed) and deleted."
    );
    describe_counter!(
        RELAY_REFUSED,
        Unit::Count,
        "Outbox rows whose publish the broker refused (a full wait tier); retried later."
    );
    describe_gauge!(
        ORDERS_OVERDUE,
        Unit::Count,
        "UNPAID orders whose deadline has passed (database clock), counted up to 100,000, sampled every 5 s by every relay (by shard, with database.shards)."
    );
    describe_gauge!(
        ORDERS_OVERDUE_OLDEST_AGE,
        Unit::Seconds,
        "How long the oldest UNPAID order is past its deadline (0 when none), sampled every 5 s by every relay (by shard, with database.shards)."
    );
    describe_gauge!(
        RELAY_NOTIFICATIONS,
        Unit::Count,
        "1 while notifications of new outbox rows arrive on the relay's LISTEN connection, 0 when a probe was lost (a connection pooler in transaction mode: set relay.listen_url) or the connection is down; the relay then publishes every relay.poll_interval (by shard, with database.shards)."
    );
    describe_gauge!(
        OUTBOX_ROWS,
        Unit::Count,
        "Rows waiting in the outbox, sampled by every relay (by shard, with database.shards)."
    );
    describe_gauge!(
        OUTBOX_OLDEST_AGE,
        Unit::Seconds,
        "Age of the oldest outbox row (0 when empty), sampled by every relay (by shard, with database.shards)."
    );
    describe_gauge!(
        OUTBOX_STUCK,
        Unit::Count,
        "Outbox rows older than sweeper.stuck_outbox_after, at the sweeper leader's last sweep."
    );
    describe_counter!(
        RELEASES,
        Unit::Count,
        "Stock releases applied, one per (order, sku): by the releaser or in the close's transaction."
    );
    describe_counter!(
        RELEASES_DEFERRED,
        Unit::Count,
        "Closed orders whose stock release the close could not apply in its transaction (a stock row held, a table lock, a release the data refused): sent to the releaser as an event."
    );
    describe_counter!(
        RELEASE_RETRIES,
        Unit::Count,
        "Release deliveries held and retried after a transient database error."
    );
    describe_counter!(
        RELEASES_LOCKED,
        Unit::Count,
        "Release deliveries held back because their order row was locked."
    );
    describe_counter!(
        RECONCILER_REPAIRS,
        Unit::Count,
        "Stock releases the reconciler emitted again for closed orders whose release was lost."
    );
    describe_counter!(
        SWEEPER_LOCKED,
        Unit::Count,
        "Overdue orders the sweeper skipped because their row was locked."
    );
    describe_gauge!(
        UNREADABLE_DEADLINES,
        Unit::Count,
        "Overdue orders with a deadline lapse cannot handle, at the last sweep."
    );
    describe_gauge!(
        PARKED_ENTRIES,
        Unit::Count,
        "Parked messages in the parked book (lapse_parked), by cause, sampled every 5 s by every worker's archiver; `lapse parked counts` lists them."
    );
    describe_counter!(
        KIND_FIRES,
        Unit::Count,
        "Deadlines of kinds whose action ran, by kind and outcome (fired: it changed its row; nothing: it changed none; failed: rolled back and parked)."
    );
    describe_counter!(
        RETENTION_PRUNED,
        Unit::Count,
        "Rows the sweeper's leader deleted under retention.*, by table (timeline, ledger, late_payments)."
    );
    describe_counter!(
        RECONNECTS,
        Unit::Count,
        "Sessions that ended with an error and were reconnected, by component."
    );
    describe_counter!(
        RESTARTS,
        Unit::Count,
        "Components the supervisor restarted after a panic or an unexpected stop, by component."
    );
    describe_histogram!(
        LIMITER_WAIT,
        Unit::Seconds,
        "Time each batch of closes waited for the closes-per-second limit (worker.closes_per_second); only with a limit set."
    );
    describe_gauge!(
        COMPONENT_UP,
        Unit::Count,
        "1 while a component is up (its connection open, not backing off), 0 otherwise."
    );
    describe_gauge!(
        QUEUE_MESSAGES,
        Unit::Count,
        "Messages in a lapse queue (due, parked, or a wait tier), sampled with a passive declare."
    );
    describe_gauge!(
        QUEUE_CONSUMERS,
        Unit::Count,
        "Consumers of a lapse queue (due, parked, or a wait tier), sampled with a passive declare."
    );
    describe_gauge!(
        BUILD_INFO,
        Unit::Count,
        "Always 1; the version and commit labels say which lapse is running."
    );
    metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION"), "commit" => env!("BUILD_GIT_COMMIT")).set(1.0);
    // Series that exist from the start (at zero), so that rates and alerts see them.
    for path in ["timeout", "sweeper"] {
        metrics::counter!(CLOSES, "path" => path).increment(0);
    }
    for name in [
        RELAY_PUBLISHED,
        RELAY_REFUSED,
        RELEASES,
        RELEASES_DEFERRED,
        RECONCILER_REPAIRS,
    ] {
        metrics::counter!(name).increment(0);
    }
}

-- Release reconciliation: the stock releaser stamps `released_at` in the transaction
-- that writes the release ledger rows, so "CLOSED and never released" is a small
-- partial index however many closed orders exist. The reconciler (run by the
-- sweeper's leader) walks that index by (closed_at, id), stamps orders that have
-- nothing (left) to release, and re-emits the release of the others, counting each
-- re-emission in `release_repairs` / `release_repaired_at`.
--
-- Orders closed before this migration are in the index until the first reconciler
-- pass stamps them (a paced, one-time walk: no table rewrite here).
-- As in V5: fail fast rather than hold the tables' exclusive lock behind a long
-- application transaction.
SET LOCAL lock_timeout = '5s';

ALTER TABLE orders
    ADD COLUMN released_at         timestamptz,
    ADD COLUMN release_repairs     integer NOT NULL DEFAULT 0,
    ADD COLUMN release_repaired_at timestamptz;

CREATE INDEX orders_unreleased ON orders (closed_at, id)
    WHERE status = 'CLOSED' AND released_at IS NULL;

-- Serves `lapse status` (repairs should be 0, so this index stays tiny).
CREATE INDEX orders_release_repaired ON orders (release_repaired_at)
    WHERE release_repaired_at IS NOT NULL;

-- Outbox retry: a row the broker refused (a full tier) or returned (no queue bound)
-- is not deleted but rescheduled: `not_before` moves forward with exponential
-- back-off per row, so a refused destination waits alone while rows behind it flow.
-- New rows are due at once (`now()`, the writing transaction's start, like
-- `created_at`).
ALTER TABLE outbox
    ADD COLUMN not_before timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN attempts   integer     NOT NULL DEFAULT 0,
    ADD COLUMN last_error text;

CREATE INDEX outbox_due ON outbox (not_before, id);

-- The worker's close and the stock release in the close as functions
-- (docs/pipeline.md, "The close in the database"): the statements that run for every
-- batch of closes were sent as text each time, so the server parsed, analyzed and
-- planned them at every close transaction, more CPU than running them. A PL/pgSQL function
-- keeps its statements' plans for the life of the server connection, whoever uses it,
-- so this works through a connection pooler in transaction mode as directly; the
-- worker sends a one-line call. What the statements do is unchanged.
--
-- A kept plan is a generic one, made without the batch's size: every table is reached
-- from the batch by key (LATERAL ... OFFSET 0 lookups, `= ANY(ARRAY(...))`), never by
-- a join the planner could turn into a scan of the whole table when its statistics
-- are old or missing (tables never analyzed, a burst since the last analyze).
-- Internal to the worker: applications do not call these.

SET LOCAL lock_timeout = '5s';

-- Closes every candidate (order, deadline version, hops) that is still UNPAID, of the
-- same version and due by the database clock, locking with SKIP LOCKED; returns the
-- closed orders with their deadline and close time, and the due ones another
-- transaction held (NULL times). With p_event, also writes their stock-release outbox
-- rows (the event path).
CREATE FUNCTION lapse_close_orders(p_ids bigint[], p_versions int[], p_hops int[],
                                   p_reason text, p_event boolean)
RETURNS TABLE (r_id bigint, r_expire_at timestamptz, r_closed_at timestamptz)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    WITH due AS (
        SELECT DISTINCT ON (d.id) d.id, d.v, d.hops
          FROM unnest(p_ids, p_versions, p_hops) AS d(id, v, hops)
    ),
    eligible AS (
        SELECT o.id FROM due d CROSS JOIN LATERAL (
            SELECT o.id FROM orders o
             WHERE o.id = d.id AND o.paid_at IS NULL AND o.closed_at IS NULL
               AND o.deadline_version = d.v AND o.expire_at <= now()
            OFFSET 0) o
    ),
    locked AS (
        SELECT o.id, d.v, d.hops FROM due d CROSS JOIN LATERAL (
            SELECT o.id FROM orders o
             WHERE o.id = d.id AND o.paid_at IS NULL AND o.closed_at IS NULL
               AND o.deadline_version = d.v AND o.expire_at <= now()
            OFFSET 0 FOR NO KEY UPDATE OF o SKIP LOCKED) o
    ),
    closed AS (
        UPDATE orders o
           SET status = 'CLOSED', closed_at = clock_timestamp(), close_reason = p_reason
          FROM locked l
         WHERE o.id = ANY(ARRAY(SELECT k.id FROM locked k)) AND o.id = l.id
           AND o.paid_at IS NULL AND o.closed_at IS NULL
           AND o.deadline_version = l.v AND o.expire_at <= now()
        RETURNING o.id, o.expire_at, o.closed_at, l.hops
    ),
    release AS (
        INSERT INTO outbox (kind, order_id, payload)
        SELECT 'stock.release', c.id, jsonb_build_object('order_id', c.id, 'lines',
               jsonb_agg(jsonb_build_object('sku', l.sku, 'qty', l.qty)))
          FROM closed c CROSS JOIN LATERAL (
               SELECT l.sku, l.qty FROM order_lines l WHERE l.order_id = c.id OFFSET 0) l
         WHERE p_event
         GROUP BY c.id
    ),
    events AS (
        INSERT INTO order_events (order_id, event, detail)
        SELECT c.id, 'closed', jsonb_build_object('by', p_reason, 'hops', c.hops,
               'late_ms', round(extract(epoch FROM c.closed_at - c.expire_at) * 1000, 3))
          FROM closed c
    )
    SELECT c.id, c.expire_at, c.closed_at FROM closed c
    UNION ALL
    SELECT e.id, NULL::timestamptz, NULL::timestamptz FROM eligible e
     WHERE e.id NOT IN (SELECT k.id FROM locked k);
END $$;

-- Releases the stock of orders this transaction just closed: locks their stock rows
-- in SKU order with FOR NO KEY UPDATE SKIP LOCKED (never waits for a row lock), writes
-- the ledger rows (idempotent by key), restocks, stamps released_at. An order one of
-- whose stock rows another transaction holds gets a stock-release outbox row instead.
-- Table locks are waited for at most p_table_lock_wait; a release the database refuses
-- (that wait, a constraint or trigger of the shop's) is undone alone (a subtransaction)
-- and every order of the call gets its outbox row: `refused` says why. The caller's
-- lock_timeout is restored either way.
CREATE FUNCTION lapse_release_closed_stock(p_ids bigint[], p_table_lock_wait text,
                                           OUT applied bigint, OUT deferred bigint,
                                           OUT refused text)
LANGUAGE plpgsql AS $$
DECLARE
    v_restore text := current_setting('lock_timeout');
BEGIN
    applied := 0;
    deferred := 0;
    PERFORM set_config('lock_timeout', p_table_lock_wait, true);
    BEGIN
        WITH lines AS MATERIALIZED (
            SELECT c.id AS order_id, l.sku, l.qty FROM unnest(p_ids) AS c(id)
             CROSS JOIN LATERAL (
                   SELECT l.sku, l.qty FROM order_lines l WHERE l.order_id = c.id OFFSET 0) l
        ),
        held AS MATERIALIZED (
            SELECT s.sku FROM stock s
             WHERE s.sku = ANY(ARRAY(SELECT DISTINCT x.sku FROM lines x))
             ORDER BY s.sku FOR NO KEY UPDATE SKIP LOCKED
        ),
        held_back AS MATERIALIZED (
            SELECT DISTINCT l.order_id AS id FROM lines l CROSS JOIN LATERAL (
                   SELECT 1 FROM stock s WHERE s.sku = l.sku OFFSET 0) s
             WHERE l.sku NOT IN (SELECT h.sku FROM held h)
        ),
        in_place AS (
            SELECT c.id FROM unnest(p_ids) AS c(id)
             WHERE c.id NOT IN (SELECT b.id FROM held_back b)
        ),
        released AS (
            INSERT INTO stock_ledger (order_id, sku, kind, qty)
            SELECT l.order_id, l.sku, 'release', l.qty FROM lines l
             WHERE l.order_id IN (SELECT i.id FROM in_place i)
            ON CONFLICT DO NOTHING
            RETURNING sku, qty
        ),
        restocked AS (
            UPDATE stock s
               SET available = s.available + r.qty, reserved = s.reserved - r.qty
              FROM (SELECT x.sku, sum(x.qty) AS qty FROM released x GROUP BY x.sku) r
             WHERE s.sku = ANY(ARRAY(SELECT x.sku FROM released x)) AND s.sku = r.sku
            RETURNING 1
        ),
        stamped AS (
            UPDATE orders o SET released_at = clock_timestamp()
             WHERE o.id = ANY(ARRAY(SELECT i.id FROM in_place i)) AND o.status = 'CLOSED'
            RETURNING 1
        ),
        outboxed AS (
            INSERT INTO outbox (kind, order_id, payload)
            SELECT 'stock.release', c.id, jsonb_build_object('order_id', c.id, 'lines',
                   jsonb_agg(jsonb_build_object('sku', l.sku, 'qty', l.qty)))
              FROM held_back c JOIN lines l ON l.order_id = c.id
             GROUP BY c.id
            RETURNING 1
        )
        -- restocked, stamped and outboxed run to completion unreferenced, as every
        -- data-modifying WITH does.
        SELECT (SELECT count(*) FROM released), (SELECT count(*) FROM held_back)
          INTO applied, deferred;
    EXCEPTION WHEN OTHERS OR query_canceled THEN
        -- query_canceled too (a statement timeout during the release): the closes
        -- commit and the releases go to the event path, as for any other refusal.
        refused := SQLSTATE || ': ' || SQLERRM;
    END;
    PERFORM set_config('lock_timeout', v_restore, true);
    -- After a statement timeout caught above, the server's timer has fired for this
    -- call: the fallback insert is bounded by the close's lock timeout only.
    IF refused IS NOT NULL THEN
        applied := 0;
        INSERT INTO outbox (kind, order_id, payload)
        SELECT 'stock.release', c.id, jsonb_build_object('order_id', c.id, 'lines',
               jsonb_agg(jsonb_build_object('sku', l.sku, 'qty', l.qty)))
          FROM unnest(p_ids) AS c(id) CROSS JOIN LATERAL (
               SELECT l.sku, l.qty FROM order_lines l WHERE l.order_id = c.id OFFSET 0) l
         GROUP BY c.id;
        GET DIAGNOSTICS deferred = ROW_COUNT;
    END IF;
END $$;

-- Pinned search paths, as every lapse function's (V9): pg_catalog first, lapse's own
-- schema (the one these migrations run in), pg_temp last.
DO $$
DECLARE
    v_fn regprocedure;
BEGIN
    FOR v_fn IN
        SELECT p.oid::regprocedure FROM pg_proc p
          JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = current_schema()
           AND p.proname IN ('lapse_close_orders', 'lapse_release_closed_stock')
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = pg_catalog, %I, pg_temp',
                       v_fn, current_schema());
    END LOOP;
END $$;

-- Generic plans, always: the planner would otherwise plan the statements afresh at
-- every call whenever a plan for the exact batch looks cheaper than one for any batch
-- (small batches), the cost these functions exist to save. The generic plans reach each
-- row by key whatever the batch. The setting holds for everything that runs during the
-- call (triggers on the tables written, foreign-key checks).
ALTER FUNCTION lapse_close_orders(bigint[], int[], int[], text, boolean)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION lapse_release_closed_stock(bigint[], text)
    SET plan_cache_mode = force_generic_plan;

-- The close of a large batch without a join between two of its steps (docs/pipeline.md,
-- "The close in the database"). V16's close joined the orders it updates with the
-- candidates it had locked; in the kept generic plan the planner, which cannot know a
-- batch's size, estimates 10 candidates and joins by nested loop: every updated order
-- against every candidate. Unnoticed at a steady rate (a few orders per batch), it
-- cost 0.25 s per call for a batch of 1,000 (a backlog, a sweep): 999,000 rows
-- compared and thrown away. The versions and hops now travel as one value, a map by
-- order id, read once per updated order. Nothing else changes.

SET LOCAL lock_timeout = '5s';

CREATE OR REPLACE FUNCTION lapse_close_orders(p_ids bigint[], p_versions int[], p_hops int[],
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
    -- One row: each locked candidate's version and hops by id, read per order below
    -- instead of a join with `locked` (see the head of this file); built once.
    looked_up AS MATERIALIZED (
        SELECT jsonb_object_agg(k.id::text, jsonb_build_array(k.v, k.hops)) AS m FROM locked k
    ),
    -- The map is read as a value (computed once), not joined: a row joined in an
    -- UPDATE's FROM is copied along with every row updated.
    closed AS (
        UPDATE orders o
           SET status = 'CLOSED', closed_at = clock_timestamp(), close_reason = p_reason
         WHERE o.id = ANY(ARRAY(SELECT k.id FROM locked k))
           AND o.paid_at IS NULL AND o.closed_at IS NULL
           AND o.deadline_version = (((SELECT x.m FROM looked_up x) -> o.id::text) ->> 0)::int
           AND o.expire_at <= now()
        RETURNING o.id, o.expire_at, o.closed_at,
                  (((SELECT x.m FROM looked_up x) -> o.id::text) ->> 1)::int AS hops
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

-- CREATE OR REPLACE resets a function's settings: the same as V16's again.
DO $$
DECLARE
    v_fn regprocedure;
BEGIN
    FOR v_fn IN
        SELECT p.oid::regprocedure FROM pg_proc p
          JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = current_schema() AND p.proname = 'lapse_close_orders'
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = pg_catalog, %I, pg_temp',
                       v_fn, current_schema());
    END LOOP;
END $$;

ALTER FUNCTION lapse_close_orders(bigint[], int[], int[], text, boolean)
    SET plan_cache_mode = force_generic_plan;

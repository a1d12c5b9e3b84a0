-- Two fixes of the SQL surface applications call (docs/reliability.md):
--
-- 1. Every function lapse installs runs with a pinned search_path: pg_catalog, then
--    lapse's own schema (the one these migrations run in), then pg_temp LAST. Before,
--    the functions followed the caller's search_path, so a temp table named `outbox`
--    (pg_temp is searched first unless named) or an application schema with its own
--    `orders` or `outbox` earlier in the path silently received lapse's writes: an
--    order committed with no timeout intent.
-- 2. A refused payment is recorded once per order, whatever its refund's state. The
--    unique index covered only PENDING rows: pay -> EXPIRED, mark the refund done, pay
--    again -> a second PENDING row, a second refund. A PENDING row of an order that
--    already has an earlier row is such a repeat and is removed; older repeats that
--    were already processed stay as history, flagged, outside the uniqueness.

SET LOCAL lock_timeout = '5s';

-- No payment may record a row between the clean-up and the new index (workers migrate
-- while applications pay).
LOCK TABLE late_payments IN SHARE ROW EXCLUSIVE MODE;

DELETE FROM late_payments l
 USING late_payments e
 WHERE e.order_id = l.order_id AND e.id < l.id AND l.refund = 'PENDING';
ALTER TABLE late_payments ADD COLUMN repeat_of_history boolean NOT NULL DEFAULT false;
UPDATE late_payments l SET repeat_of_history = true
 WHERE l.refund <> 'PENDING' AND EXISTS (SELECT 1 FROM late_payments e WHERE e.order_id = l.order_id AND e.id < l.id);
DROP INDEX late_payments_one_pending_per_order;
CREATE UNIQUE INDEX late_payments_once_per_order ON late_payments (order_id)
    WHERE NOT repeat_of_history;

-- Pays an order (return values and rules as in V7); a refused payment of an order
-- that has any late_payments row already records nothing new.
CREATE OR REPLACE FUNCTION lapse_pay_order(p_order_id bigint)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
    v_expire timestamptz;
    v_now    timestamptz;
BEGIN
    SELECT status, expire_at INTO v_status, v_expire FROM orders WHERE id = p_order_id FOR UPDATE;
    IF v_status IS NULL THEN
        RETURN 'NOT_FOUND';
    ELSIF v_status = 'PAID' THEN
        RETURN 'ALREADY_PAID';
    END IF;
    v_now := clock_timestamp();
    IF v_status = 'UNPAID' AND v_expire > v_now THEN
        IF NOT (v_expire >= timestamptz '1970-01-01 00:00:00+00'
                AND v_expire < timestamptz '10000-01-01 00:00:00+00') THEN
            RAISE EXCEPTION 'unreadable deadline: order % has a deadline lapse cannot handle (%); repair the row before it can be paid',
                p_order_id, v_expire USING ERRCODE = 'LP003';
        END IF;
        UPDATE orders SET status = 'PAID', paid_at = v_now WHERE id = p_order_id;
        PERFORM 1 FROM stock WHERE sku IN (SELECT sku FROM order_lines WHERE order_id = p_order_id)
          ORDER BY sku FOR UPDATE;
        UPDATE stock s SET reserved = s.reserved - l.qty, sold = s.sold + l.qty
          FROM order_lines l WHERE l.order_id = p_order_id AND s.sku = l.sku;
        INSERT INTO stock_ledger (order_id, sku, kind, qty)
        SELECT order_id, sku, 'sale', qty FROM order_lines WHERE order_id = p_order_id;
        INSERT INTO order_events (order_id, event) VALUES (p_order_id, 'paid');
        RETURN 'PAID';
    END IF;
    INSERT INTO late_payments (order_id, received_at) VALUES (p_order_id, v_now)
        ON CONFLICT (order_id) WHERE NOT repeat_of_history DO NOTHING;
    IF FOUND THEN
        INSERT INTO order_events (order_id, event)
        VALUES (p_order_id, CASE v_status WHEN 'CLOSED' THEN 'late_payment'
                                          ELSE 'payment_refused_expired' END);
    END IF;
    RETURN CASE v_status WHEN 'CLOSED' THEN 'LATE' ELSE 'EXPIRED' END;
END $$;

-- Pin the search_path of every lapse function; a later migration that adds a function
-- pins it the same way (the suite checks that none is left unpinned).
DO $$
DECLARE
    v_fn regprocedure;
BEGIN
    FOR v_fn IN
        SELECT p.oid::regprocedure FROM pg_proc p
          JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = current_schema()
           AND p.proname LIKE 'lapse\_%'
    LOOP
        -- pg_catalog first, so nothing in lapse's schema can shadow a built-in
        -- (clock_timestamp, now), and pg_temp last.
        EXECUTE format('ALTER FUNCTION %s SET search_path = pg_catalog, %I, pg_temp',
                       v_fn, current_schema());
    END LOOP;
END $$;

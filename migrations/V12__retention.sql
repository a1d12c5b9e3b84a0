-- Retention (retention.* in the configuration): the sweeper's leader prunes, in small
-- batches, what lapse keeps about finished orders once it is older than the configured
-- age — timeline events, stock ledger rows, settled late payments — and never what an
-- open deadline or an unapplied effect still needs. These indexes let each batch start
-- at the oldest rows; `lapse_retention` counts what was pruned, for `lapse status`.

SET LOCAL lock_timeout = '5s';

-- On a large installation build them first, without blocking writes, under the same
-- names (`CREATE INDEX CONCURRENTLY order_events_by_time ON order_events (at)`, ...,
-- docs/operations.md "Retention"); then these find them and take no time.
-- An index left INVALID by an interrupted CREATE INDEX CONCURRENTLY would be taken as
-- built by IF NOT EXISTS and never used: refuse it, naming it.
DO $$
DECLARE
    v_bad text;
BEGIN
    SELECT string_agg(c.relname, ', ') INTO v_bad
      FROM pg_index i
      JOIN pg_class c ON c.oid = i.indexrelid
      JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE n.nspname = current_schema() AND NOT i.indisvalid
       AND c.relname IN ('order_events_by_time', 'stock_ledger_by_time',
                         'late_payments_settled_by_time');
    IF v_bad IS NOT NULL THEN
        RAISE EXCEPTION 'index % is invalid (an interrupted CREATE INDEX CONCURRENTLY): DROP INDEX CONCURRENTLY it and build it again', v_bad;
    END IF;
END $$;

CREATE INDEX IF NOT EXISTS order_events_by_time ON order_events (at);
CREATE INDEX IF NOT EXISTS stock_ledger_by_time ON stock_ledger (at);
CREATE INDEX IF NOT EXISTS late_payments_settled_by_time ON late_payments (received_at)
    WHERE refund <> 'PENDING';

-- A pruned late payment still counts for "one refund per order": the order remembers it.
-- (A constant default: no table rewrite.)
ALTER TABLE orders ADD COLUMN late_payment_pruned boolean NOT NULL DEFAULT false;

CREATE TABLE lapse_retention (
    table_name     text        PRIMARY KEY,
    pruned         bigint      NOT NULL DEFAULT 0,
    last_pruned_at timestamptz
);

-- As in V9, and a payment refused for an order whose earlier late payment was pruned
-- records nothing new either.
CREATE OR REPLACE FUNCTION lapse_pay_order(p_order_id bigint)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
    v_expire timestamptz;
    v_pruned boolean;
    v_now    timestamptz;
BEGIN
    SELECT status, expire_at, late_payment_pruned INTO v_status, v_expire, v_pruned
      FROM orders WHERE id = p_order_id FOR UPDATE;
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
    IF NOT v_pruned THEN
        INSERT INTO late_payments (order_id, received_at) VALUES (p_order_id, v_now)
            ON CONFLICT (order_id) WHERE NOT repeat_of_history DO NOTHING;
        IF FOUND THEN
            INSERT INTO order_events (order_id, event)
            VALUES (p_order_id, CASE v_status WHEN 'CLOSED' THEN 'late_payment'
                                              ELSE 'payment_refused_expired' END);
        END IF;
    END IF;
    RETURN CASE v_status WHEN 'CLOSED' THEN 'LATE' ELSE 'EXPIRED' END;
END $$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION lapse_pay_order(bigint) SET search_path = pg_catalog, %I, pg_temp',
                   current_schema());
END $$;

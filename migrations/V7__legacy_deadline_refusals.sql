-- A payment of an order whose stored deadline lies outside the range lapse handles (a
-- row written before orders_expire_at_in_range existed, e.g. 'infinity'): accepting it
-- would UPDATE the row, which the NOT VALID constraint still checks, so the caller got
-- a check violation (SQLSTATE 23514) that says nothing about the cause. It is now
-- refused with SQLSTATE LP003 naming the order and its value, before anything changes;
-- docs/operations.md "Orders with an unreadable deadline" says how to repair the row.
-- Every other case behaves exactly as in V5 (an expired or closed order's refusal
-- never updates the row, so it is recorded for a refund as before).
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
        ON CONFLICT (order_id) WHERE refund = 'PENDING' DO NOTHING;
    IF FOUND THEN
        INSERT INTO order_events (order_id, event)
        VALUES (p_order_id, CASE v_status WHEN 'CLOSED' THEN 'late_payment'
                                          ELSE 'payment_refused_expired' END);
    END IF;
    RETURN CASE v_status WHEN 'CLOSED' THEN 'LATE' ELSE 'EXPIRED' END;
END $$;

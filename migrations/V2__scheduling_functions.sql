-- Scheduling, extension and payment as SQL functions: any language calls them inside
-- its own transaction, so the order and its timeout intent commit (or roll back)
-- together. The Rust API (lapse::orders) calls the same functions.
--
-- Lock order: every statement that changes several stock rows locks them in SKU order
-- (here, in the stock releaser and in payment), so concurrent reservations, payments
-- and releases never deadlock.

-- A timeout intent for the relay; expire_at in ms precision.
CREATE FUNCTION lapse_timeout_intent(p_order_id bigint, p_expire_at timestamptz, p_version integer)
RETURNS void LANGUAGE sql AS $$
    INSERT INTO outbox (kind, order_id, payload)
    VALUES ('timeout', p_order_id, jsonb_build_object(
        'order_id', p_order_id,
        'expire_at', to_char(p_expire_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'),
        'deadline_version', p_version));
$$;

-- Creates an UNPAID order with its lines, reserves their stock and writes its timeout
-- intent. p_lines: '[{"sku": "A", "qty": 2}, ...]'. Raises 'insufficient stock' (SQLSTATE
-- P0001) when a SKU is missing or short. Returns the order id.
CREATE FUNCTION lapse_create_order(p_expire_at timestamptz, p_lines jsonb DEFAULT '[]')
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_id     bigint;
    v_expire timestamptz := date_trunc('milliseconds', p_expire_at);
    v_line   record;
BEGIN
    INSERT INTO orders (expire_at) VALUES (v_expire) RETURNING id INTO v_id;
    FOR v_line IN SELECT * FROM jsonb_to_recordset(p_lines) AS l(sku text, qty integer) ORDER BY sku LOOP
        INSERT INTO order_lines (order_id, sku, qty) VALUES (v_id, v_line.sku, v_line.qty);
        UPDATE stock SET available = available - v_line.qty, reserved = reserved + v_line.qty
         WHERE sku = v_line.sku AND available >= v_line.qty;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'insufficient stock for sku %', v_line.sku;
        END IF;
        INSERT INTO stock_ledger (order_id, sku, kind, qty) VALUES (v_id, v_line.sku, 'reserve', v_line.qty);
    END LOOP;
    PERFORM lapse_timeout_intent(v_id, v_expire, 1);
    INSERT INTO order_events (order_id, event, detail)
    VALUES (v_id, 'created', jsonb_build_object('expire_at', v_expire, 'deadline_version', 1));
    RETURN v_id;
END $$;

-- Moves an UNPAID order's deadline (before it passed) and writes a new intent; the
-- previous message becomes stale. Returns the new deadline version, or NULL when
-- refused (not found, not UNPAID, or the deadline already passed).
CREATE FUNCTION lapse_extend_deadline(p_order_id bigint, p_new_expire_at timestamptz)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_version integer;
    v_expire  timestamptz := date_trunc('milliseconds', p_new_expire_at);
BEGIN
    UPDATE orders SET expire_at = v_expire, deadline_version = deadline_version + 1
     WHERE id = p_order_id AND status = 'UNPAID' AND expire_at > now()
    RETURNING deadline_version INTO v_version;
    IF v_version IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM lapse_timeout_intent(p_order_id, v_expire, v_version);
    INSERT INTO order_events (order_id, event, detail)
    VALUES (p_order_id, 'extended', jsonb_build_object('expire_at', v_expire, 'deadline_version', v_version));
    RETURN v_version;
END $$;

-- Pays an order. Returns one of:
--   'PAID'         accepted: the order was UNPAID and its deadline had not passed
--   'ALREADY_PAID' nothing changed
--   'EXPIRED'      refused: the deadline passed, the close has not happened yet
--   'LATE'         refused: the order is CLOSED; recorded in late_payments for a refund
--   'NOT_FOUND'
CREATE FUNCTION lapse_pay_order(p_order_id bigint)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
BEGIN
    UPDATE orders SET status = 'PAID', paid_at = now()
     WHERE id = p_order_id AND status = 'UNPAID' AND expire_at > now();
    IF FOUND THEN
        PERFORM 1 FROM stock WHERE sku IN (SELECT sku FROM order_lines WHERE order_id = p_order_id)
          ORDER BY sku FOR UPDATE;
        UPDATE stock s SET reserved = s.reserved - l.qty, sold = s.sold + l.qty
          FROM order_lines l WHERE l.order_id = p_order_id AND s.sku = l.sku;
        INSERT INTO stock_ledger (order_id, sku, kind, qty)
        SELECT order_id, sku, 'sale', qty FROM order_lines WHERE order_id = p_order_id;
        INSERT INTO order_events (order_id, event) VALUES (p_order_id, 'paid');
        RETURN 'PAID';
    END IF;
    SELECT status INTO v_status FROM orders WHERE id = p_order_id FOR UPDATE;
    IF v_status IS NULL THEN
        RETURN 'NOT_FOUND';
    ELSIF v_status = 'PAID' THEN
        RETURN 'ALREADY_PAID';
    ELSIF v_status = 'CLOSED' THEN
        INSERT INTO late_payments (order_id) VALUES (p_order_id);
        INSERT INTO order_events (order_id, event) VALUES (p_order_id, 'late_payment');
        RETURN 'LATE';
    ELSE
        INSERT INTO order_events (order_id, event) VALUES (p_order_id, 'payment_refused_expired');
        RETURN 'EXPIRED';
    END IF;
END $$;

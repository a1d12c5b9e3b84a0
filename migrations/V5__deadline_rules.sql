-- Deadline rules and honest payment timing (docs/pipeline.md "Deadline rules" and
-- "Payment"):
-- * every deadline that enters through lapse's functions is a finite instant, not in the
--   past by more than 5 seconds, not beyond the configured horizon, and rounded UP to
--   the millisecond (never earlier than asked); otherwise SQLSTATE LP001;
-- * extend only moves a deadline later (otherwise SQLSTATE LP002);
-- * pay and extend judge the deadline by the real clock (clock_timestamp()), not by the
--   start of the caller's transaction; the close guard keeps now() (never early);
-- * every refused payment of a real order is recorded once in late_payments.

-- Never queue behind an application's long transaction while holding the orders
-- table's exclusive lock (every create, pay and close would wait behind this
-- migration): give up after a few seconds instead; `lapse migrate` can run again.
SET LOCAL lock_timeout = '5s';

-- Settings the SQL functions enforce on their own, so callers in any language get the
-- same rules. Exactly one row; `lapse migrate` writes it from the configuration
-- (orders.deadline_horizon).
CREATE TABLE lapse_settings (
    singleton        boolean  PRIMARY KEY DEFAULT true CHECK (singleton),
    deadline_horizon interval NOT NULL DEFAULT interval '366 days'
                     CHECK (deadline_horizon > interval '0'
                            AND deadline_horizon <= interval '36525 days')
);
INSERT INTO lapse_settings DEFAULT VALUES;

-- The instants lapse can carry in a message and decode in every component (RFC 3339
-- with a four-digit year). NOT VALID: rows written before this migration stay readable
-- as they are; new rows and updates must satisfy it. src/deadline.rs holds the same
-- range; components skip (and count) an older row outside it instead of failing.
ALTER TABLE orders ADD CONSTRAINT orders_expire_at_in_range
    CHECK (expire_at >= timestamptz '1970-01-01 00:00:00+00'
           AND expire_at < timestamptz '10000-01-01 00:00:00+00') NOT VALID;

-- Checks a deadline as it enters and returns it rounded up to the millisecond.
-- "Past" and the horizon count from the caller's transaction start (now()): a deadline
-- computed as now() + d is judged as the caller meant it however long the transaction
-- has run, and 5 seconds absorb an application clock that runs a little behind.
CREATE FUNCTION lapse_checked_deadline(p_expire_at timestamptz)
RETURNS timestamptz LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_horizon interval;
    v_expire  timestamptz;
BEGIN
    IF p_expire_at IS NULL THEN
        RAISE EXCEPTION 'invalid deadline: NULL' USING ERRCODE = 'LP001';
    END IF;
    IF NOT isfinite(p_expire_at) THEN
        RAISE EXCEPTION 'invalid deadline: % is not a finite instant', p_expire_at
            USING ERRCODE = 'LP001';
    END IF;
    IF p_expire_at < now() - interval '5 seconds' THEN
        RAISE EXCEPTION 'invalid deadline: % is in the past (more than 5 s before %)',
            p_expire_at, now() USING ERRCODE = 'LP001';
    END IF;
    SELECT deadline_horizon INTO v_horizon FROM lapse_settings;
    v_horizon := coalesce(v_horizon, interval '366 days');
    IF p_expire_at > now() + v_horizon THEN
        RAISE EXCEPTION 'invalid deadline: % is beyond the horizon of % from now (orders.deadline_horizon)',
            p_expire_at, v_horizon USING ERRCODE = 'LP001';
    END IF;
    v_expire := date_trunc('milliseconds', p_expire_at);
    IF v_expire < p_expire_at THEN
        v_expire := v_expire + interval '1 millisecond';
    END IF;
    RETURN v_expire;
END $$;

CREATE OR REPLACE FUNCTION lapse_create_order(p_expire_at timestamptz, p_lines jsonb DEFAULT '[]')
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_id     bigint;
    v_expire timestamptz := lapse_checked_deadline(p_expire_at);
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

-- Moves an UNPAID order's deadline later, before it passed (by the real clock), and
-- writes a new intent. Returns the new deadline version, or NULL when refused (not
-- found, not UNPAID, or the deadline already passed). Raises LP001 for an invalid
-- deadline and LP002 when the new deadline is not later than the current one.
CREATE OR REPLACE FUNCTION lapse_extend_deadline(p_order_id bigint, p_new_expire_at timestamptz)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_expire  timestamptz := lapse_checked_deadline(p_new_expire_at);
    v_status  text;
    v_current timestamptz;
    v_version integer;
BEGIN
    -- Lock first, then read the clock: a wait for the lock counts against the deadline.
    SELECT status, expire_at INTO v_status, v_current FROM orders WHERE id = p_order_id FOR UPDATE;
    IF v_status IS DISTINCT FROM 'UNPAID' OR v_current <= clock_timestamp() THEN
        RETURN NULL;
    END IF;
    IF v_expire <= v_current THEN
        RAISE EXCEPTION 'deadline not later: order % expires at %; % would not move it later',
            p_order_id, v_current, v_expire USING ERRCODE = 'LP002';
    END IF;
    UPDATE orders SET expire_at = v_expire, deadline_version = deadline_version + 1
     WHERE id = p_order_id
    RETURNING deadline_version INTO v_version;
    PERFORM lapse_timeout_intent(p_order_id, v_expire, v_version);
    INSERT INTO order_events (order_id, event, detail)
    VALUES (p_order_id, 'extended', jsonb_build_object('expire_at', v_expire, 'deadline_version', v_version));
    RETURN v_version;
END $$;

-- At most one PENDING refund record per order: the repeats of a retried call are one
-- refund to make, not several. Records already processed (refund other than PENDING)
-- are history and are never touched; of several PENDING ones, the earliest stays.
DELETE FROM late_payments l
 USING (SELECT id, row_number() OVER (PARTITION BY order_id ORDER BY id) AS n
          FROM late_payments WHERE refund = 'PENDING') d
 WHERE l.id = d.id AND d.n > 1;
CREATE UNIQUE INDEX late_payments_one_pending_per_order ON late_payments (order_id)
    WHERE refund = 'PENDING';

-- Pays an order. Returns one of:
--   'PAID'         accepted: the order was UNPAID and its deadline had not passed
--   'ALREADY_PAID' nothing changed
--   'EXPIRED'      refused: the deadline passed, the close has not happened yet
--   'LATE'         refused: the order is CLOSED
--   'NOT_FOUND'
-- EXPIRED and LATE record the payment once in late_payments for a refund; a retried
-- call records nothing new while that refund is PENDING. The deadline is judged by the real clock at the moment the
-- row lock is held, which is also paid_at: a payment inside a long transaction that
-- began before the deadline is still refused after it.
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

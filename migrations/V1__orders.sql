-- lapse schema: orders with an absolute deadline and a deadline version, their lines,
-- stock with a per-(order, sku, kind) ledger, late payments, the outbox, and a timeline.

CREATE TABLE orders (
    id               bigserial   PRIMARY KEY,
    status           text        NOT NULL DEFAULT 'UNPAID'
                                 CHECK (status IN ('UNPAID', 'PAID', 'CLOSED')),
    created_at       timestamptz NOT NULL DEFAULT now(),
    -- The absolute deadline, millisecond precision (the message carries the same value).
    expire_at        timestamptz NOT NULL,
    -- Bumped when the deadline changes; narrower than a row version on purpose:
    -- only a deadline change makes an earlier timeout message stale.
    deadline_version integer     NOT NULL DEFAULT 1,
    paid_at          timestamptz,
    closed_at        timestamptz,
    -- 'timeout' (closed by the worker from a message) or 'sweeper' (the backstop).
    close_reason     text,
    CHECK ((status = 'CLOSED') = (closed_at IS NOT NULL)),
    CHECK ((status = 'PAID') = (paid_at IS NOT NULL)),
    CHECK (status <> 'CLOSED' OR closed_at >= expire_at)
);

-- Serves "UNPAID and overdue" for the sweeper and `lapse status`.
CREATE INDEX orders_unpaid_by_deadline ON orders (expire_at, id) WHERE status = 'UNPAID';

CREATE TABLE order_lines (
    order_id bigint  NOT NULL REFERENCES orders (id),
    sku      text    NOT NULL,
    qty      integer NOT NULL CHECK (qty > 0),
    PRIMARY KEY (order_id, sku)
);

CREATE TABLE stock (
    sku       text   PRIMARY KEY,
    available bigint NOT NULL CHECK (available >= 0),
    reserved  bigint NOT NULL DEFAULT 0 CHECK (reserved >= 0),
    sold      bigint NOT NULL DEFAULT 0 CHECK (sold >= 0)
);

-- One row per effect on stock; the primary key makes a repeated release a no-op.
CREATE TABLE stock_ledger (
    order_id bigint      NOT NULL REFERENCES orders (id),
    sku      text        NOT NULL,
    kind     text        NOT NULL CHECK (kind IN ('reserve', 'release', 'sale')),
    qty      integer     NOT NULL,
    at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (order_id, sku, kind)
);

-- Payments that arrived after the order was closed: to be refunded, never accepted.
CREATE TABLE late_payments (
    id          bigserial   PRIMARY KEY,
    order_id    bigint      NOT NULL REFERENCES orders (id),
    received_at timestamptz NOT NULL DEFAULT now(),
    refund      text        NOT NULL DEFAULT 'PENDING'
);

-- Transactional outbox: timeout intents and stock-release events, published by the
-- relay with publisher confirms and deleted only after the broker confirmed them.
CREATE TABLE outbox (
    id         bigserial   PRIMARY KEY,
    kind       text        NOT NULL CHECK (kind IN ('timeout', 'stock.release')),
    order_id   bigint      NOT NULL,
    payload    jsonb       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE FUNCTION lapse_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('lapse_outbox', '');
    RETURN NULL;
END $$;

CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION lapse_outbox_notify();

-- What happened to an order, for `lapse order show`.
CREATE TABLE order_events (
    order_id bigint      NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    event    text        NOT NULL,
    detail   jsonb       NOT NULL DEFAULT '{}'
);
CREATE INDEX order_events_by_order ON order_events (order_id, at);

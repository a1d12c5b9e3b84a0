-- The parked book: messages lapse (or the broker) parked, moved out of `<P>.parked`
-- into this table once, read from here by `lapse parked` (list with paging, counts by
-- cause, show, replay, purge) without touching the queue again. Kept in the first
-- order database (`database.url`, or `database.shards[0]`); the other shards hold the
-- table empty.

CREATE TABLE lapse_parked (
    seq              bigserial   PRIMARY KEY,
    -- The broker prefix whose `<P>.parked` it came from: deployments sharing a
    -- database never see (or replay) each other's.
    prefix           text        NOT NULL,
    -- The same parking archived twice (an acknowledgement lost after the insert) is
    -- one row: SHA-256 of the body, the reason and park time, where it came from and
    -- its headers without the delivery counts the broker rewrites.
    fingerprint      text        NOT NULL,
    id               text        NOT NULL,
    kind             text        NOT NULL,
    cause            text        NOT NULL,
    order_id         bigint,
    shard            integer,
    deadline         timestamptz,
    deadline_version integer,
    attempts         bigint      NOT NULL DEFAULT 0,
    reason           text        NOT NULL,
    reason_source    text        NOT NULL,
    parked_at        timestamptz,
    archived_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- A replay in progress holds its rows until then, under its own token (a replay
    -- that died frees them when the time passes; a purge leaves held rows alone).
    claimed_until    timestamptz,
    claimed_by       text,
    exchange         text        NOT NULL,
    routing_key      text        NOT NULL,
    message_id       text,
    headers          jsonb       NOT NULL DEFAULT '{}',
    body             bytea       NOT NULL
);
CREATE UNIQUE INDEX lapse_parked_fingerprint ON lapse_parked (prefix, fingerprint);
CREATE INDEX lapse_parked_by_id ON lapse_parked (prefix, id);
CREATE INDEX lapse_parked_by_cause ON lapse_parked (prefix, cause, seq);

-- Deadlines over the shop's own tables (docs/adopting.md): kinds of deadline declared in
-- the configuration, one row per (kind, key) in `lapse.deadlines`, and the SQL API a
-- shop calls from its own transaction. Everything new lives in the schema `lapse`; the
-- shop's tables are never created or changed by lapse.
--
-- SQLSTATEs raised here: LP001 invalid deadline (lapse_checked_deadline), LP002 not
-- later (reschedule), LP004 unknown kind, LP005 key not of the kind's type, LP006
-- already scheduled at another instant.

-- Never queue behind an application's long transaction while holding a lock others
-- need: give up after a few seconds instead; `lapse migrate` can run again.
SET LOCAL lock_timeout = '5s';

CREATE SCHEMA IF NOT EXISTS lapse;

-- The kinds the configuration declares, written by `lapse migrate` and a starting
-- worker (kinds are only ever added or changed here, never deleted: a kind taken out
-- of the configuration keeps its deadlines, which the worker parks as unknown_kind).
-- A deadline further away than `promote_within` (the top tier, written with the kind) is
-- kept only here until it comes within range: no broker message for weeks.
CREATE TABLE lapse.kinds (
    name     text PRIMARY KEY CHECK (name ~ '^[a-z][a-z0-9_]{0,62}$'),
    key_type text NOT NULL CHECK (key_type IN ('text', 'bigint', 'uuid')),
    promote_within interval NOT NULL DEFAULT interval '1 hour'
                   CHECK (promote_within > interval '0')
);

-- One deadline per (kind, key): the key as text in its canonical form (a bigint
-- without leading zeros, a lower-case uuid), the instant, and a version that every
-- reschedule (and every re-arm after it fired or was cancelled) increases, so a
-- message for an earlier version is stale.
CREATE TABLE lapse.deadlines (
    id          bigserial   PRIMARY KEY,
    kind        text        NOT NULL REFERENCES lapse.kinds (name),
    key         text        NOT NULL CHECK (length(key) BETWEEN 1 AND 200),
    expire_at   timestamptz NOT NULL
                CHECK (expire_at >= timestamptz '1970-01-01 00:00:00+00'
                       AND expire_at < timestamptz '10000-01-01 00:00:00+00'),
    version     integer     NOT NULL DEFAULT 1 CHECK (version >= 1),
    state       text        NOT NULL DEFAULT 'pending'
                CHECK (state IN ('pending', 'fired', 'cancelled')),
    -- fired: the action changed its row; nothing: it changed none (already paid,
    -- confirmed, closed by the shop); cancelled: lapse.cancel.
    outcome     text        CHECK (outcome IN ('fired', 'nothing', 'cancelled')),
    scheduled_at timestamptz NOT NULL DEFAULT now(),
    settled_at  timestamptz,
    -- Why the last attempt to fire did not (a statement error, too many rows), and when.
    last_error  text,
    failed_at   timestamptz,
    -- Handed to the broker (an intent written); false while it waits for the promoter.
    in_tiers    boolean     NOT NULL DEFAULT true,
    UNIQUE (kind, key),
    CHECK ((state = 'pending') = (outcome IS NULL))
);
CREATE INDEX deadlines_pending_by_time ON lapse.deadlines (expire_at, id) WHERE state = 'pending';
CREATE INDEX deadlines_to_promote ON lapse.deadlines (expire_at, id)
    WHERE state = 'pending' AND NOT in_tiers;

-- Deadline intents and the shop's events: an outbox of their own, which a relay of an
-- earlier version never reads (it would take an intent for an order's timeout). The
-- relay drains both; the same trigger wakes it.
CREATE TABLE lapse.kind_outbox (
    id          bigserial   PRIMARY KEY,
    kind        text        NOT NULL CHECK (kind IN ('deadline', 'event')),
    deadline_id bigint      NOT NULL,
    payload     jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    not_before  timestamptz NOT NULL DEFAULT now(),
    attempts    integer     NOT NULL DEFAULT 0,
    last_error  text
);
CREATE INDEX kind_outbox_due ON lapse.kind_outbox (not_before, id);
CREATE TRIGGER kind_outbox_notify AFTER INSERT ON lapse.kind_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION lapse_outbox_notify();

-- The key in canonical form, or LP004 (unknown kind) / LP005 (not of its type).
CREATE FUNCTION lapse.checked_key(p_kind text, p_key text)
RETURNS text LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_type text;
BEGIN
    SELECT key_type INTO v_type FROM lapse.kinds WHERE name = p_kind;
    IF v_type IS NULL THEN
        RAISE EXCEPTION 'unknown deadline kind %: declare it under [kinds] and run lapse migrate',
            coalesce(quote_literal(p_kind), 'NULL') USING ERRCODE = 'LP004';
    END IF;
    IF p_key IS NULL OR p_key = '' OR length(p_key) > 200 THEN
        RAISE EXCEPTION 'a deadline of kind % needs a key of 1 to 200 characters (got %)', p_kind,
            coalesce(quote_literal(left(p_key, 100)), 'NULL') USING ERRCODE = 'LP005';
    END IF;
    BEGIN
        RETURN CASE v_type
            WHEN 'bigint' THEN p_key::bigint::text
            WHEN 'uuid' THEN p_key::uuid::text
            ELSE p_key END;
    EXCEPTION WHEN data_exception THEN
        RAISE EXCEPTION 'key % of kind % is not a %', quote_literal(left(p_key, 100)),
            p_kind, v_type USING ERRCODE = 'LP005';
    END;
END $$;

-- The relay's intent for one deadline version, when it lies within its kind's range;
-- returns whether it was written (the promoter writes the others later).
CREATE FUNCTION lapse.intent(p_id bigint, p_kind text, p_key text,
                             p_expire_at timestamptz, p_version integer)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF p_expire_at > now() + (SELECT promote_within FROM lapse.kinds WHERE name = p_kind) THEN
        RETURN false;
    END IF;
    INSERT INTO lapse.kind_outbox (kind, deadline_id, payload)
    VALUES ('deadline', p_id, jsonb_build_object(
        'order_id', p_id, 'kind', p_kind, 'key', p_key,
        'expire_at', to_char(p_expire_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'),
        'deadline_version', p_version));
    RETURN true;
END $$;

-- Schedules the deadline of (kind, key) at expire_at, in the caller's transaction;
-- returns its version. Idempotent for the same instant while pending; another instant
-- while pending is refused (LP006: lapse.reschedule moves it). A deadline that fired
-- or was cancelled is armed again with the next version.
CREATE FUNCTION lapse.schedule(p_kind text, p_key text, p_expire_at timestamptz)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_key     text := lapse.checked_key(p_kind, p_key);
    v_expire  timestamptz := lapse_checked_deadline(p_expire_at);
    v_id      bigint;
    v_version integer;
    v_current timestamptz;
BEGIN
    INSERT INTO lapse.deadlines AS d (kind, key, expire_at)
    VALUES (p_kind, v_key, v_expire)
    ON CONFLICT (kind, key) DO UPDATE
       SET expire_at = EXCLUDED.expire_at, version = d.version + 1, state = 'pending',
           outcome = NULL, scheduled_at = now(), settled_at = NULL, last_error = NULL,
           failed_at = NULL
     WHERE d.state <> 'pending'
    RETURNING id, version INTO v_id, v_version;
    IF v_id IS NULL THEN
        SELECT version, expire_at INTO v_version, v_current
          FROM lapse.deadlines WHERE kind = p_kind AND key = v_key;
        IF v_current = v_expire THEN
            RETURN v_version;
        END IF;
        RAISE EXCEPTION 'deadline % % is already scheduled at % (lapse.reschedule moves it later, lapse.cancel ends it)',
            p_kind, quote_literal(v_key), v_current USING ERRCODE = 'LP006';
    END IF;
    UPDATE lapse.deadlines SET in_tiers = lapse.intent(v_id, p_kind, v_key, v_expire, v_version)
     WHERE id = v_id;
    RETURN v_version;
END $$;

-- Moves a pending deadline later, before it passed (by the real clock); returns the
-- new version, or NULL when there is nothing pending to move or it already passed.
-- An instant not later than the current one is refused (LP002).
CREATE FUNCTION lapse.reschedule(p_kind text, p_key text, p_expire_at timestamptz)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_key     text := lapse.checked_key(p_kind, p_key);
    v_expire  timestamptz := lapse_checked_deadline(p_expire_at);
    v_id      bigint;
    v_version integer;
    v_current timestamptz;
BEGIN
    SELECT id, expire_at INTO v_id, v_current FROM lapse.deadlines
     WHERE kind = p_kind AND key = v_key AND state = 'pending' AND expire_at > clock_timestamp()
       FOR UPDATE;
    IF v_id IS NULL THEN
        RETURN NULL;
    END IF;
    IF v_expire <= v_current THEN
        RAISE EXCEPTION 'deadline % % is at %: a reschedule must be later (got %)',
            p_kind, quote_literal(v_key), v_current, v_expire USING ERRCODE = 'LP002';
    END IF;
    UPDATE lapse.deadlines
       SET expire_at = v_expire, version = version + 1, last_error = NULL, failed_at = NULL
     WHERE id = v_id RETURNING version INTO v_version;
    UPDATE lapse.deadlines SET in_tiers = lapse.intent(v_id, p_kind, v_key, v_expire, v_version)
     WHERE id = v_id;
    RETURN v_version;
END $$;

-- Ends a pending deadline (the payment or confirmation happened): its timeout becomes
-- stale. True when a pending deadline was cancelled.
CREATE FUNCTION lapse.cancel(p_kind text, p_key text)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    UPDATE lapse.deadlines
       SET state = 'cancelled', outcome = 'cancelled', settled_at = clock_timestamp()
     WHERE kind = p_kind AND key = lapse.checked_key(p_kind, p_key) AND state = 'pending';
    RETURN FOUND;
END $$;

-- The payment side of "payment and timeout never both win" (docs/adopting.md): locks
-- the deadline first (the order the firing transaction takes its locks in), and
-- cancels it only while it is pending and its instant has not passed by the real
-- clock. True: the caller may accept the payment in the same transaction; false: too
-- late (or already settled), refuse it; NULL: no deadline was ever scheduled for this
-- key (an order from before lapse was adopted): the shop's own rules decide.
CREATE FUNCTION lapse.settle(p_kind text, p_key text)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
BEGIN
    SELECT id INTO v_id FROM lapse.deadlines
     WHERE kind = p_kind AND key = lapse.checked_key(p_kind, p_key)
       FOR UPDATE;
    IF v_id IS NULL THEN
        RETURN NULL;
    END IF;
    UPDATE lapse.deadlines
       SET state = 'cancelled', outcome = 'cancelled', settled_at = clock_timestamp()
     WHERE id = v_id AND state = 'pending' AND expire_at > clock_timestamp();
    RETURN FOUND;
END $$;

-- The deadline of (kind, key) as the shop's own guarded statements read it: `open` is
-- true while it is pending and its instant has not passed by the real clock. No row
-- when none was ever scheduled.
CREATE FUNCTION lapse.deadline(p_kind text, p_key text,
    OUT state text, OUT expire_at timestamptz, OUT version integer, OUT open boolean)
RETURNS SETOF record LANGUAGE sql STABLE AS $$
    SELECT d.state, d.expire_at, d.version,
           d.state = 'pending' AND d.expire_at > clock_timestamp()
      FROM lapse.deadlines d
     WHERE d.kind = p_kind AND d.key = lapse.checked_key(p_kind, p_key);
$$;

-- Pinned search paths: pg_catalog first (nothing shadows a built-in), lapse, then the
-- schema holding lapse's deadline rules, pg_temp last.
DO $$
DECLARE
    v_fn regprocedure;
BEGIN
    FOR v_fn IN
        SELECT p.oid::regprocedure FROM pg_proc p
          JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'lapse'
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = pg_catalog, lapse, %I, pg_temp',
                       v_fn, current_schema());
    END LOOP;
END $$;

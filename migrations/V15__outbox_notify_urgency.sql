-- The outbox's wake-up says whether it can wait (docs/pipeline.md, "Gathering"): a
-- statement that wrote only timeout or deadline intents due more than 2 seconds from
-- now notifies with the payload 'gather'; anything else (an event, a stock release, an
-- intent due within 2 seconds, a row whose deadline cannot be read) with '' as before.
-- The relay runs at once for '', and within `relay.gather` (at most 1 second) for
-- 'gather', so more intents of one route leave in one pack; an intent that waits is
-- still more than a second from its deadline when it is planned, so waiting costs no
-- lateness. A relay of an earlier version wakes for either payload.
--
-- The deadline is compared as the text the intent functions write (UTC, fixed width,
-- byte order is time order under COLLATE "C"); a row whose `expire_at` is missing or
-- written otherwise counts as urgent.

SET LOCAL lock_timeout = '5s';

CREATE FUNCTION lapse.outbox_notify() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_far text := to_char((clock_timestamp() + interval '2 seconds') AT TIME ZONE 'UTC',
                          'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"');
BEGIN
    IF EXISTS (SELECT 1 FROM inserted
                WHERE kind NOT IN ('timeout', 'deadline')
                   OR NOT coalesce((payload->>'expire_at') ~ '^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$'
                                   AND (payload->>'expire_at') COLLATE "C" > v_far COLLATE "C", false)) THEN
        PERFORM pg_notify('lapse_outbox', '');
    ELSE
        PERFORM pg_notify('lapse_outbox', 'gather');
    END IF;
    RETURN NULL;
END $$;

DROP TRIGGER outbox_notify ON outbox;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION lapse.outbox_notify();

DROP TRIGGER kind_outbox_notify ON lapse.kind_outbox;
CREATE TRIGGER kind_outbox_notify AFTER INSERT ON lapse.kind_outbox
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION lapse.outbox_notify();

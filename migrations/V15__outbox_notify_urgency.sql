-- The outbox's wake-up says whether it can wait (docs/pipeline.md, "Gathering"): a
-- timeout or deadline intent due more than 2 seconds after its transaction commits
-- notifies with the payload 'gather'; anything else (an event, a stock release, an
-- intent due within 2 seconds, a row whose deadline cannot be read) with '' as before.
-- The relay runs at once for '', and within `relay.gather` (at most 1 second) for
-- 'gather', so more intents of one route leave in one pack; an intent that waits is
-- still more than a second from its deadline when it is planned, so waiting costs no
-- lateness. A relay of an earlier version wakes for either payload.
--
-- Judged at commit (a deferred constraint trigger): an application's transaction may
-- run for seconds after it wrote the intent. The deadline is compared as the text the
-- intent functions write (UTC, fixed width: byte order is time order under COLLATE
-- "C"); a row whose `expire_at` is missing or written otherwise counts as urgent.
-- Notifications of one transaction with the same payload are sent once.

SET LOCAL lock_timeout = '5s';

CREATE FUNCTION lapse.outbox_notify() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.kind IN ('timeout', 'deadline')
       AND coalesce((NEW.payload->>'expire_at')
                        ~ '^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}[.][0-9]{3}Z$'
                    AND (NEW.payload->>'expire_at') COLLATE "C"
                        > to_char((clock_timestamp() + interval '2 seconds') AT TIME ZONE 'UTC',
                                  'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') COLLATE "C",
                    false) THEN
        PERFORM pg_notify('lapse_outbox', 'gather');
    ELSE
        PERFORM pg_notify('lapse_outbox', '');
    END IF;
    RETURN NULL;
END $$;

DROP TRIGGER outbox_notify ON outbox;
CREATE CONSTRAINT TRIGGER outbox_notify AFTER INSERT ON outbox
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION lapse.outbox_notify();

DROP TRIGGER kind_outbox_notify ON lapse.kind_outbox;
CREATE CONSTRAINT TRIGGER kind_outbox_notify AFTER INSERT ON lapse.kind_outbox
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION lapse.outbox_notify();

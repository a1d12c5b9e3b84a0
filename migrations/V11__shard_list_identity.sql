-- Two deployments with the same broker.prefix share one due queue: a timeout one of
-- them published is judged by whichever worker takes it. With the same list of order
-- databases that is harmless; with two lists that share a database at the same
-- position (A: [X, Y], B: [X, Z]) every position check passes, but a timeout of A's
-- shard 1 taken by B is judged in Z. Each database now has an identity, and records,
-- per prefix, the list of database identities it was migrated in; a migration or a
-- worker whose list disagrees with a recorded one (at any position both know) is
-- refused. The list may grow at its end. (md5 of random and the clock rather than
-- gen_random_uuid(), which PostgreSQL has built in only from version 13.)
ALTER TABLE lapse_settings
    ADD COLUMN database_id text NOT NULL DEFAULT md5(random()::text || clock_timestamp()::text),
    ADD COLUMN shard_lists jsonb NOT NULL DEFAULT '{}'::jsonb
        CHECK (jsonb_typeof(shard_lists) = 'object');

-- Which position this database holds in the worker's list of order databases
-- (database.shards[i]; 0 for a lone database.url). A timeout message names its shard by
-- that position, so a list whose entries were reordered would make messages name the
-- wrong database. The first migration that knows the position records it; every later
-- one, and every worker's start, compares it with the configuration and refuses a
-- mismatch. NULL: not recorded yet (migrated only by versions that did not record it).
ALTER TABLE lapse_settings
    ADD COLUMN shard_position integer CHECK (shard_position >= 0);

-- Leadership of the sweeper (and the reconciler it runs) as a lease judged by the
-- database clock, instead of a session advisory lock. A frozen or partitioned leader
-- kept the advisory lock for as long as its TCP connection lived (a stopped process's
-- kernel still answers keepalives), so no other worker swept; a pooler in transaction
-- mode loses session locks altogether. A lease expires unless its holder renews it,
-- and the holder renews it inside each page's transaction, which also fences the
-- page's writes: a leader whose lease expired or was taken over (the epoch moved on)
-- writes nothing.
CREATE TABLE lapse_leader_leases (
    name       text PRIMARY KEY,
    holder     text NOT NULL,
    epoch      bigint NOT NULL CHECK (epoch > 0),
    expires_at timestamptz NOT NULL
);

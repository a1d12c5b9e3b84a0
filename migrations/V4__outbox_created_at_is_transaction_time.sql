-- An intent's age counts from the start of the transaction that wrote it: a deadline
-- written as "now() + 30 min" is 30 min from that same instant, so the relay can tell
-- exactly how much of the deadline its own lag has used (see the relay's tier choice).
ALTER TABLE outbox ALTER COLUMN created_at SET DEFAULT now();

-- See migrations/pg (the same file name). The embedded store has no index
-- of labels: a list filtered by labels walks the ledger newest first
-- (one process, a small ledger).

ALTER TABLE operations ADD COLUMN labels TEXT;
CREATE INDEX operations_created ON operations (created_at, seq);

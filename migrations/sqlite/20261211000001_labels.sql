-- See migrations/pg (the same file name). The embedded store keeps no
-- index of labels: a list filtered by labels checks them on its walk
-- newest first (one process, a small ledger).

ALTER TABLE operations ADD COLUMN labels TEXT;

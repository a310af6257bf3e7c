-- The ledger at the price of a naive one, as in migrations/pg (the same
-- file name): what each write costs, the guarantees the same.
--
-- 1. No whole-ledger gauge: the row triggers that kept counts by state on
--    every write go. Decisions are counted as they commit
--    (`volume_reconciler_decisions_total`), open work is read at scrape
--    from the open operations' index, and `ops stats` counts the ledger on
--    demand (one GROUP BY). The embedded store runs in one process, so
--    no replica of the previous release runs beside this one (as on
--    PostgreSQL, where the table stays for them): the table goes too.
DROP TRIGGER IF EXISTS operation_counts_insert;
DROP TRIGGER IF EXISTS operation_counts_update;
DROP TRIGGER IF EXISTS operation_counts_delete;
DROP TABLE operation_counts;

-- 2. The reconcile log, one row per write instead of one per event: the
--    events of a write as one JSON array, each with how long before the
--    write it happened. The intent writes no row of its own: its
--    `recorded` event is rendered from the operation's columns and
--    `intent`. A write made twice logs once (its key). The rowid keeps
--    the order the rows were written in. No row outlives its operation
--    (the foreign key: one writer, so it costs no contention here). Events
--    of operations recorded before stay in `operation_events`, read with
--    these.
CREATE TABLE operation_log (
    operation_id TEXT NOT NULL REFERENCES operations (id),
    write_id     TEXT NOT NULL,
    at           INTEGER NOT NULL,
    replica      TEXT NOT NULL,
    events       TEXT NOT NULL,
    UNIQUE (operation_id, write_id)
);
ALTER TABLE operations ADD COLUMN intent TEXT;

-- Operations by state and resolution without scanning the ledger (the
-- /metrics gauge, the UNKNOWN backlog): every statement that inserts,
-- updates or deletes operations adds one delta row per (state,
-- resolution) it changed, from a statement-level trigger (once per
-- statement, so a group-committed batch of decisions adds a row or two,
-- not one per operation; a statement that changes no state, such as a
-- lease claim, adds none). Inserts only: no row every writer must lock.
-- A scrape sums the deltas and folds them into one row per pair (see the
-- store's `operation_count_by_state`). A trigger, not the application's
-- statements: no write path can forget it (operator resolutions, claims,
-- the reconciler, a future statement).
CREATE TABLE operation_counts (
    state      TEXT NOT NULL,
    resolution TEXT,
    n          BIGINT NOT NULL
);

CREATE FUNCTION operation_counts_delta() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO operation_counts (state, resolution, n)
        SELECT state, resolution, count(*) FROM new_rows GROUP BY state, resolution;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO operation_counts (state, resolution, n)
        SELECT state, resolution, -count(*) FROM old_rows GROUP BY state, resolution;
    ELSE
        INSERT INTO operation_counts (state, resolution, n)
        SELECT state, resolution, sum(d) FROM (
            SELECT state, resolution, 1 AS d FROM new_rows
            UNION ALL
            SELECT state, resolution, -1 AS d FROM old_rows
        ) c
        GROUP BY state, resolution HAVING sum(d) <> 0;
    END IF;
    RETURN NULL;
END
$$;

-- Created before the initial count: CREATE TRIGGER locks out writers (of
-- replicas still running the previous version) until this commits, so no
-- write falls between the count and the trigger.
CREATE TRIGGER operation_counts_insert AFTER INSERT ON operations
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION operation_counts_delta();
CREATE TRIGGER operation_counts_update AFTER UPDATE ON operations
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION operation_counts_delta();
CREATE TRIGGER operation_counts_delete AFTER DELETE ON operations
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION operation_counts_delta();

INSERT INTO operation_counts (state, resolution, n)
SELECT state, resolution, count(*) FROM operations GROUP BY state, resolution;

-- The oldest UNKNOWN operation (the backlog alert) is found among the open
-- ones through their partial index (operations_open_by_lease): they are
-- few, whatever the size of the ledger.

-- Less work per operation (measured per statement: BENCHMARKS.md). Every
-- intent and every decision (which changes indexed columns, so is never a
-- HOT update) writes an entry into each index of `operations`, and every
-- event one into each index of `operation_events`:
-- - operations_state (state, seq) served no query: listings by state walk
--   `seq` backwards (a terminal state) or the open operations' partial
--   index (an open one), as does the oldest-UNKNOWN query.
-- - operation_events' primary key (id) served no query: the log is read
--   by operation, in order, through operation_events_by_operation
--   (operation_id, id), which keeps the order; ids stay unique (an
--   identity column, never written by the application).
DROP INDEX operations_state;
ALTER TABLE operation_events DROP CONSTRAINT operation_events_pkey;

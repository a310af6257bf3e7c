-- See migrations/pg: operations by state and resolution kept as they
-- change, so /metrics never scans the ledger. The embedded store has one
-- writer (one process), so a row per pair updated by row triggers costs
-- no contention. Resolution '' stands for none (a key column).
CREATE TABLE operation_counts (
    state      TEXT NOT NULL,
    resolution TEXT NOT NULL DEFAULT '',
    n          INTEGER NOT NULL,
    PRIMARY KEY (state, resolution)
);

INSERT INTO operation_counts (state, resolution, n)
SELECT state, COALESCE(resolution, ''), count(*) FROM operations GROUP BY state, COALESCE(resolution, '');

CREATE TRIGGER operation_counts_insert AFTER INSERT ON operations
BEGIN
    INSERT OR IGNORE INTO operation_counts (state, resolution, n) VALUES (NEW.state, COALESCE(NEW.resolution, ''), 0);
    UPDATE operation_counts SET n = n + 1 WHERE state = NEW.state AND resolution = COALESCE(NEW.resolution, '');
END;

CREATE TRIGGER operation_counts_update AFTER UPDATE OF state, resolution ON operations
WHEN OLD.state IS NOT NEW.state OR OLD.resolution IS NOT NEW.resolution
BEGIN
    UPDATE operation_counts SET n = n - 1 WHERE state = OLD.state AND resolution = COALESCE(OLD.resolution, '');
    INSERT OR IGNORE INTO operation_counts (state, resolution, n) VALUES (NEW.state, COALESCE(NEW.resolution, ''), 0);
    UPDATE operation_counts SET n = n + 1 WHERE state = NEW.state AND resolution = COALESCE(NEW.resolution, '');
END;

CREATE TRIGGER operation_counts_delete AFTER DELETE ON operations
BEGIN
    UPDATE operation_counts SET n = n - 1 WHERE state = OLD.state AND resolution = COALESCE(OLD.resolution, '');
END;

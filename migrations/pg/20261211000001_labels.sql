-- Operating a fleet (docs/api.md: labels).
--
-- An expand step: replicas of the previous release keep working against
-- this schema (they write no labels; the column is NULL for their rows).

-- 1. An operation's labels, set by its caller when it asked and never
--    changed: a JSON object of at most 8 short strings, NULL when there
--    are none.
ALTER TABLE operations ADD COLUMN labels JSONB;

-- 2. A list filtered by a label, newest first, walks this table's entries
--    of that label backwards (its primary key: key, value, then the
--    operation's seq) and stops once a page is full, however many
--    operations carry the label: a GIN index of `labels` finds the
--    matching rows but not in order, and a page of a common label would
--    sort them all first. Kept by triggers whose WHEN clause is evaluated
--    without a call: an operation without labels (the previous release's,
--    and most) costs nothing more to insert or delete, and writes no more
--    WAL; labels never change, so no update touches this table.
CREATE TABLE operation_labels (
    key    TEXT NOT NULL,
    value  TEXT NOT NULL,
    op_seq BIGINT NOT NULL,
    op_id  UUID NOT NULL,
    PRIMARY KEY (key, value, op_seq)
);

CREATE FUNCTION operations_labels_index() RETURNS trigger
    LANGUAGE plpgsql
    AS $$ BEGIN
        IF TG_OP = 'INSERT' THEN
            INSERT INTO operation_labels (key, value, op_seq, op_id)
            SELECT l.key, l.value, NEW.seq, NEW.id FROM jsonb_each_text(NEW.labels) AS l;
        ELSE
            DELETE FROM operation_labels t USING jsonb_each_text(OLD.labels) AS l
            WHERE t.key = l.key AND t.value = l.value AND t.op_seq = OLD.seq;
        END IF;
        RETURN NULL;
    END $$;

CREATE TRIGGER operations_labels_insert
    AFTER INSERT ON operations
    FOR EACH ROW WHEN (NEW.labels IS NOT NULL)
    EXECUTE FUNCTION operations_labels_index();

CREATE TRIGGER operations_labels_delete
    AFTER DELETE ON operations
    FOR EACH ROW WHEN (OLD.labels IS NOT NULL)
    EXECUTE FUNCTION operations_labels_index();

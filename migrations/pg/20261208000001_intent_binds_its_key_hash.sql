-- The intent binds its key's hash (BENCHMARKS.md "The lean intent").
--
-- `key_hash` was a generated column: PostgreSQL planned and ran the SQL
-- function `volume_reconciler_key_hash` for every insert (~30 µs of CPU
-- per intent at one caller, a plan each time: a generated column's
-- expression is not inlined). The service computes the same 16 bytes for
-- the tombstone probe anyway (`store::rows::key_hash`, tested equal to
-- the SQL function), and now binds them.
--
-- An expand step: a replica of the previous release inserts without the
-- column. For its rows (and anyone's that leave it out) a trigger computes
-- the hash as before, so a key stays unique per caller whoever inserts.
-- Its WHEN clause is evaluated without calling the function: the rows
-- this release writes pay nothing for it. No rewrite of the table:
-- dropping a generation expression keeps every stored value.
ALTER TABLE operations ALTER COLUMN key_hash DROP EXPRESSION;

CREATE FUNCTION operations_fill_key_hash() RETURNS trigger
    LANGUAGE plpgsql
    AS $$ BEGIN
        NEW.key_hash := volume_reconciler_key_hash(NEW.caller, NEW.idempotency_key);
        RETURN NEW;
    END $$;

CREATE TRIGGER operations_fill_key_hash
    BEFORE INSERT ON operations
    FOR EACH ROW WHEN (NEW.key_hash IS NULL)
    EXECUTE FUNCTION operations_fill_key_hash();

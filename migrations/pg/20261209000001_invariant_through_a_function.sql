-- The decided invariant (terminal ⇔ decided time ⇔ resolution), still one
-- CHECK, now calling a PL/pgSQL function instead of holding the expression.
--
-- PostgreSQL turns a CHECK's stored expression back into a tree, plans it
-- and compiles it at every statement that writes the table; the tree of
-- the expression cost ~78,000 instructions per operation at one caller on
-- top of what any CHECK costs (BENCHMARKS.md, "The invariant through a
-- function"). A call of a function is a tree of four nodes; PL/pgSQL plans
-- the function's body once per connection. Measured by `COUNT=1
-- scripts/pgprice`: 819,079 → 764,544 instructions per operation.
--
-- The same rows pass and fail as before, for every writer (the previous
-- release's included: it writes the same columns and reads the same
-- constraint name). The new constraint is added NOT VALID in the same
-- transaction that drops the old one, so no moment is unguarded and
-- writes wait only for the swap; the next migration validates the rows
-- already there without blocking writes.
CREATE FUNCTION operations_decided_ok(state TEXT, completed_at TIMESTAMPTZ, resolution TEXT)
    RETURNS BOOLEAN
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    AS $$ BEGIN
        RETURN (state IN ('succeeded', 'failed')) = (completed_at IS NOT NULL)
           AND (completed_at IS NOT NULL) = (resolution IS NOT NULL);
    END $$;

ALTER TABLE operations DROP CONSTRAINT operations_decided_invariant;
ALTER TABLE operations ADD CONSTRAINT operations_decided_invariant
    CHECK (operations_decided_ok(state, completed_at, resolution)) NOT VALID;

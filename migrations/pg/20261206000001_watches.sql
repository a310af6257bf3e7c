-- Who waits for a decision (BENCHMARKS.md "A NOTIFY only for operations
-- somebody watches"). A decision used to NOTIFY for every operation it
-- decided; at one caller that is one notification per operation, which the
-- committing backend, the LISTEN backend and every replica's listener all
-- pay for, while somebody waits on another replica's decision only rarely:
-- a replayed key whose first call is still running, `ReconcileOperation`
-- waiting out a live holder, a `WatchOperation` stream. Those register
-- here first (an upsert up to when they wait), and a decision notifies the
-- operations it decided that have a row here. Waiters on the replica that
-- decided are woken in-process, and every waiter re-reads the operation
-- at least every few seconds: a notification is a hint, never the only
-- way to learn of a change, so losing this table (UNLOGGED: emptied by a
-- crash, not replicated) costs latency, never correctness.
CREATE UNLOGGED TABLE operation_watches (
    operation_id UUID PRIMARY KEY,
    until        TIMESTAMPTZ NOT NULL
);
-- Expired rows are removed a few at a time by each registration.
CREATE INDEX operation_watches_until ON operation_watches (until);

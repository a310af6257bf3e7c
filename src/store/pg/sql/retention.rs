//! A retention round's statements; `pg::retention` runs them, in two
//! steps (mark, then delete once no older snapshot can miss the
//! tombstones), and says there why.

/// Marks up to `$2` decided operations older than the cutoff (`now()`
/// minus `$1` ms), oldest first, by the index of decision time
/// (`operations_decided`): a tombstone per key (committed by this
/// statement); their ids back. An operation with no key of its own to
/// keep (an Ensure call's, or one whose key a replay handed on) leaves
/// none.
pub(in crate::store::pg) const MARK: &str = "WITH victims AS (
        SELECT id, key_hash, completed_at, ensure, key_retired_at FROM operations
        WHERE completed_at IS NOT NULL AND completed_at < now() - $1 * interval '1 millisecond'
        ORDER BY completed_at LIMIT $2
     ), marked AS (
        INSERT INTO idempotency_tombstones (key_hash, decided_at, pruned_at)
        SELECT key_hash, completed_at, now() FROM victims
        WHERE NOT ensure AND key_retired_at IS NULL
        ON CONFLICT (key_hash) DO NOTHING
        RETURNING 1
     )
     SELECT id, (SELECT count(*) FROM marked) AS marked FROM victims";

/// The first transaction id no snapshot taken now can see running: every
/// session whose snapshot is older than this commit has an xmin below it.
pub(in crate::store::pg) const HORIZON: &str =
    "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::int8";

/// Other client sessions of this database holding a snapshot older than
/// `$1` (an xid8, compared as the 32-bit xid `backend_xmin` is).
pub(in crate::store::pg) const OLDER_SNAPSHOTS: &str = "SELECT count(*) FROM pg_stat_activity
     WHERE datname = current_database() AND backend_type = 'client backend'
       AND pid <> pg_backend_pid() AND backend_xmin IS NOT NULL
       AND age(backend_xmin) > age(($1 % 4294967296)::text::xid)";

/// Deletes marked operations (still decided); their ids.
pub(in crate::store::pg) const DELETE_OPERATIONS: &str =
    "DELETE FROM operations WHERE id = ANY($1) AND completed_at IS NOT NULL RETURNING id";

/// Deletes the events of deleted operations. A statement of its own, after
/// `DELETE_OPERATIONS` in the same transaction: its snapshot is newer, so
/// it also finds an event appended while the operations were being
/// deleted (an append holds its operation FOR KEY SHARE, so the delete
/// waited for it to commit). No event outlives its operation.
pub(in crate::store::pg) const DELETE_EVENTS: &str =
    "WITH old AS (DELETE FROM operation_events WHERE operation_id = ANY($1) RETURNING 1),
          new AS (DELETE FROM operation_log WHERE operation_id = ANY($1) RETURNING 1)
     SELECT (SELECT count(*) FROM old) + (SELECT count(*) FROM new)";

/// Deletes up to `$2` tombstones of keys decided before `now()` minus `$1` ms.
pub(in crate::store::pg) const EXPIRE: &str = "WITH gone AS (
        SELECT key_hash FROM idempotency_tombstones
        WHERE decided_at < now() - $1 * interval '1 millisecond' LIMIT $2
     )
     DELETE FROM idempotency_tombstones t USING gone WHERE t.key_hash = gone.key_hash";

/// Takes the retention rounds' advisory lock (`$1`) if it is free.
pub(in crate::store::pg) const LOCK: &str = "SELECT pg_try_advisory_lock($1)";

/// Releases the retention rounds' advisory lock (`$1`).
pub(in crate::store::pg) const UNLOCK: &str = "SELECT pg_advisory_unlock($1)";

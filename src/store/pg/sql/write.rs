//! The group commit's statements: every intent, decision and appended event
//! of a batch in one multi-row statement each (arrays unnested; a batch of
//! one row, as every write is when writes do not overlap, binds plain
//! parameters in their place instead). `bind` binds a batch to them;
//! `tooling` shows them, with their parameter types, to plan tests and
//! `scripts/bench`.

use std::sync::LazyLock;

use super::NOTIFY_CHANNEL;

/// Intent rows of a batch, inserted by one statement (`CREATE_MANY`; a
/// batch of one, `CREATE_ONE`, the same with its parameters in place,
/// `params_in_place`); a row that hits a unique
/// constraint (key replayed, volume busy, or its own id: a re-run whose
/// first run committed) or a pruned key's tombstone (refused, never run
/// again) is skipped and reported as `None` (its caller looks up why).
///
/// The intent writes no log row: its `recorded` event lives in the row
/// (`intent`, with what the columns do not say), and only events beyond it
/// (Cinder's word before sending) get a log row, under the operation's id
/// as its write id. The key's hash (`$16`, the per-caller key's
/// uniqueness and the tombstone probe) is computed by the service and
/// bound (the database computes it only for writers that leave it out,
/// the previous release). Returns what the database assigned: the caller
/// has the rest. Not notified: nobody can be waiting on an operation whose
/// id has not been handed out yet.
///
/// Written first without `ON CONFLICT` (`CREATE_*_LEAN`): a conflicting
/// row then fails the statement (unique violation) and is learnt from the
/// error, instead of every insert paying for speculative insertion (a
/// probe of each unique index before the insert, and a WAL record to
/// confirm it): measured at one caller with the hash bound, 126 µs less
/// of PostgreSQL's CPU per operation. A batch of one that failed so
/// skipped its row; a batch of several is written
/// again with `ON CONFLICT DO NOTHING` (`CREATE_MANY`), which skips only
/// the rows that conflict: a conflict costs its batch one round trip more.
///
/// A batch of one binds plain parameters straight into the insert
/// (`create_one_sql`), and only an intent with events beyond `recorded`
/// (`_LOGGED`) has the log row's insert in its statement at all.
pub(in crate::store::pg) static CREATE_MANY: LazyLock<String> = LazyLock::new(|| create_sql(true));
pub(in crate::store::pg) static CREATE_ONE: LazyLock<String> =
    LazyLock::new(|| create_one_sql(true, false));
pub(in crate::store::pg) static CREATE_ONE_LOGGED: LazyLock<String> =
    LazyLock::new(|| create_one_sql(true, true));
pub(in crate::store::pg) static CREATE_MANY_LEAN: LazyLock<String> =
    LazyLock::new(|| create_sql(false));
pub(in crate::store::pg) static CREATE_ONE_LEAN: LazyLock<String> =
    LazyLock::new(|| create_one_sql(false, false));
pub(in crate::store::pg) static CREATE_ONE_LEAN_LOGGED: LazyLock<String> =
    LazyLock::new(|| create_one_sql(false, true));

/// An intent row's parameters, in order: name and type.
pub(in crate::store::pg) const INTENT_COLUMNS: [(&str, &str); 21] = [
    ("id", "uuid"),
    ("key", "text"),
    ("fp", "text"),
    ("action", "text"),
    ("state", "text"),
    ("server_id", "uuid"),
    ("volume_id", "uuid"),
    ("request", "jsonb"),
    ("attempts", "int4"),
    ("deadline_ms", "float8"),
    ("lease_owner", "text"),
    ("lease_ms", "float8"),
    ("caller", "text"),
    ("trace_parent", "text"),
    ("trace_state", "text"),
    ("key_hash", "uuid"),
    ("record_by", "timestamptz"),
    ("ensure", "bool"),
    ("labels", "jsonb"),
    ("intent", "jsonb"),
    ("events", "jsonb"),
];

/// A decision row's parameters, in order: name and type.
pub(in crate::store::pg) const DECISION_COLUMNS: [(&str, &str); 18] = [
    ("id", "uuid"),
    ("epoch", "int8"),
    ("state", "text"),
    ("resolution", "text"),
    ("attachment", "jsonb"),
    ("add_attempt", "int4"),
    ("set_error", "bool"),
    ("last_error", "jsonb"),
    ("request_sent", "bool"),
    ("release", "bool"),
    ("next_attempt_ms", "float8"),
    ("verify_expect", "bool"),
    ("write_id", "uuid"),
    ("escalation", "text"),
    ("replica", "text"),
    ("unsent_seen", "bool"),
    ("mark_unsent", "bool"),
    ("events", "jsonb"),
];

/// What a decision returns: the columns the database sets (the caller has
/// the rest of the row).
const DECIDED_COLUMNS: &str = "o.id, o.attempts, o.last_request_at, o.updated_at, \
    o.completed_at, o.lease_owner, o.lease_expires_at, o.escalated_at";

/// What an intent returns: the columns the database sets.
const INTENDED_COLUMNS: &str = "id, created_at, deadline_at, last_request_at, lease_expires_at";

/// Where a batch's rows come from, as `u`: unnested from one array
/// parameter per column (`$1`…).
fn rows_from(columns: &[(&str, &str)]) -> String {
    let names: Vec<&str> = columns.iter().map(|(n, _)| *n).collect();
    let params: Vec<String> = columns
        .iter()
        .enumerate()
        .map(|(i, (_, t))| format!("${}::{t}[]", i + 1))
        .collect();
    format!("unnest({}) AS u({})", params.join(", "), names.join(", "))
}

/// A batch of one binds plain parameters where the batch's statement
/// reads `u.name`: `u.name` becomes `$i::type`. No row source, no join
/// with one, no CTE that only carries parameters: measured with callgrind
/// (`COUNT=1 scripts/pgprice`), 69,000 instructions of PostgreSQL's per
/// intent and ~10,000 per decision fewer than the one-row subquery they
/// replace, and that is every write when writes do not overlap.
fn params_in_place(sql: &str, columns: &[(&str, &str)]) -> String {
    let mut out = sql.to_string();
    // Longest names first, so `u.lease_owner` is not eaten by `u.lease`.
    let mut cols: Vec<(usize, &str, &str)> = columns
        .iter()
        .enumerate()
        .map(|(i, (n, t))| (i + 1, *n, *t))
        .collect();
    cols.sort_by_key(|(_, n, _)| std::cmp::Reverse(n.len()));
    for (i, name, ty) in cols {
        out = replace_word(&out, &format!("u.{name}"), &format!("${i}::{ty}"));
    }
    debug_assert!(!out.contains(" u."), "a column of u left in place: {out}");
    out
}

/// `from` replaced by `to` where it is a whole name (not followed by a
/// name's character).
fn replace_word(s: &str, from: &str, to: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find(from) {
        let after = &rest[at + from.len()..];
        let whole = !after.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
        let before_ok = !rest[..at].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
        out.push_str(&rest[..at]);
        out.push_str(if whole && before_ok { to } else { from });
        rest = after;
    }
    out.push_str(rest);
    out
}

/// The parameter types of a statement over `columns` (one row or arrays),
/// as `PREPARE` takes them.
pub(in crate::store::pg) fn parameter_types(columns: &[(&str, &str)], one: bool) -> String {
    columns
        .iter()
        .map(|(_, t)| if one { t.to_string() } else { format!("{t}[]") })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The intent's insert, reading its row from `u`.
fn insert_sql(guarded: bool) -> String {
    format!(
        "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id, volume_id,
            request, attempts, deadline_at, last_request_at, lease_owner, lease_expires_at, caller,
            trace_parent, trace_state, intent, key_hash, ensure, labels)
        SELECT u.id, u.key, u.fp, u.action, u.state, u.server_id, u.volume_id, u.request, u.attempts,
            now() + u.deadline_ms * interval '1 millisecond', CASE WHEN u.attempts > 0 THEN now() END,
            u.lease_owner, now() + u.lease_ms * interval '1 millisecond', u.caller, u.trace_parent,
            u.trace_state, u.intent, u.key_hash, u.ensure, u.labels
        {from}WHERE NOT EXISTS (SELECT 1 FROM idempotency_tombstones t WHERE t.key_hash = u.key_hash)
          AND now() < u.record_by
        {conflict}RETURNING {INTENDED_COLUMNS}",
        from = "FROM u\n        ",
        conflict = if guarded { "ON CONFLICT DO NOTHING\n        " } else { "" },
    )
}

/// The log row of an intent's events beyond `recorded`, under the
/// operation's id as its write id.
const INTENT_LOG: &str = "INSERT INTO operation_log (operation_id, write_id, at, replica, events)
        SELECT u.id, u.id, clock_timestamp(), u.lease_owner, u.events
        FROM u JOIN ins ON ins.id = u.id
        WHERE u.events IS NOT NULL";

/// A batch of one: its insert with the parameters in place; `logged`, with
/// the log row of its events (the last parameter), else without either.
fn create_one_sql(guarded: bool, logged: bool) -> String {
    let insert = insert_sql(guarded).replace("FROM u\n        ", "");
    if !logged {
        return params_in_place(&insert, &INTENT_COLUMNS[..INTENT_COLUMNS.len() - 1]);
    }
    let log = INTENT_LOG
        .replace("FROM u JOIN ins ON ins.id = u.id", "FROM ins")
        .replace("u.id, u.id", "ins.id, ins.id");
    params_in_place(
        &format!(
            "WITH ins AS (
        {insert}
     ), lg AS (
        {log}
     )
     SELECT {INTENDED_COLUMNS} FROM ins"
        ),
        &INTENT_COLUMNS,
    )
}

fn create_sql(guarded: bool) -> String {
    format!(
        "WITH u AS (SELECT * FROM {rows}),
     ins AS (
        {insert}
     ), lg AS (
        {INTENT_LOG}
     )
     SELECT {INTENDED_COLUMNS} FROM ins",
        insert = insert_sql(guarded),
        rows = rows_from(&INTENT_COLUMNS),
    )
}

/// Log rows appended to existing operations (verifications), by one
/// statement: one row per write; a write already logged (a re-run whose
/// first run committed) is not logged again (its key). Each operation is
/// held (FOR KEY SHARE) while its row goes in, and one that is gone
/// (pruned) gets none: no event outlives its operation (the log has no
/// foreign key). Returns the ids of the operations held; an append whose
/// operation is not among them is refused.
pub(in crate::store::pg) static APPEND_MANY: LazyLock<String> = LazyLock::new(|| {
    "WITH u AS (SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::jsonb[])
                  AS u(id, write_id, replica, events)),
          held AS (
            SELECT o.id FROM operations o WHERE o.id IN (SELECT id FROM u) FOR KEY SHARE
         ), lg AS (
            INSERT INTO operation_log (operation_id, write_id, at, replica, events)
            SELECT u.id, u.write_id, clock_timestamp(), u.replica, u.events
            FROM u JOIN held ON held.id = u.id
            ON CONFLICT DO NOTHING
         )
         SELECT id FROM held"
        .to_string()
});

/// Retires a key (`Operation::frees_key`): the FAILED operation `$1`
/// whose key's hash is `$3` gives it up for `$2` (one no key can have,
/// `KeyHash::unkeyed`), with a log row (`$4` its write, `$5` the replica,
/// `$6` its events). Its id back, or nothing when another replay retired it
/// first. Made in the transaction that inserts the new operation under the
/// key: the unique index then sees the key free.
pub(in crate::store::pg) const RETIRE_KEY: &str = "WITH old AS (
        UPDATE operations SET key_hash = $2, key_retired_at = now()
        WHERE id = $1 AND key_hash = $3 AND state = 'failed'
        RETURNING id
     ), lg AS (
        INSERT INTO operation_log (operation_id, write_id, at, replica, events)
        SELECT id, $4, clock_timestamp(), $5, $6 FROM old
     )
     SELECT id FROM old";

/// Decisions of a batch, by one statement, each fenced by its epoch, each
/// with one log row of its events.
///
/// "Not decided yet" is written `completed_at IS NULL` (the same thing, by
/// the `operations_decided_invariant` constraint), not as a test on
/// `state`: the state test matches the predicate of the partial index of
/// open operations, and a generic plan made while that set was small then
/// scans all of it for every row of the batch (measured: 454 ms for 128
/// decisions with 10,000 operations open, as after a Nova outage, exactly
/// when the reconciler must be fast). Rows are found by primary key.
///
/// Each decision names its write (`last_write`): run again (a re-run whose
/// first run committed, its acknowledgement lost), it finds itself there
/// and changes nothing, logs nothing, counts no attempt, notifies nobody,
/// and returns no row, like a fenced write: the caller reads the row
/// (`decided_again`) and tells the two apart.
///
/// It notifies (one NOTIFY for the batch) only the operations somebody
/// registered a watch for (`operation_watches`: waiters on other replicas;
/// the deciding replica wakes its own in-process): at one caller a NOTIFY
/// for every decision cost ~0.1 ms of latency and ~180 µs of CPU per
/// operation, for waiters that are rare. It returns only what the database
/// set (`DECIDED_COLUMNS`): the caller has the rest of the row.
pub(in crate::store::pg) static TRANSITION_MANY: LazyLock<String> =
    LazyLock::new(|| transition_sql(false));
pub(in crate::store::pg) static TRANSITION_ONE: LazyLock<String> =
    LazyLock::new(|| transition_sql(true));

fn transition_sql(one: bool) -> String {
    let update = "UPDATE operations o SET
            state = u.state,
            resolution = u.resolution,
            attachment = COALESCE(u.attachment, o.attachment),
            attempts = o.attempts + u.add_attempt,
            last_error = CASE WHEN u.set_error THEN u.last_error ELSE o.last_error END,
            last_request_at = CASE WHEN u.request_sent THEN now() ELSE o.last_request_at END,
            completed_at = CASE WHEN u.state IN ('succeeded', 'failed') THEN now() END,
            lease_owner = CASE WHEN u.release THEN NULL ELSE o.lease_owner END,
            lease_expires_at = CASE WHEN u.release THEN NULL ELSE o.lease_expires_at END,
            next_attempt_at = CASE WHEN o.unsent_attempt = o.attempts AND NOT u.unsent_seen THEN now()
                ELSE now() + u.next_attempt_ms * interval '1 millisecond' END,
            unsent_attempt = CASE WHEN u.mark_unsent THEN o.attempts + u.add_attempt
                ELSE o.unsent_attempt END,
            verify_expect = u.verify_expect,
            escalated_at = CASE WHEN u.escalation IS NOT NULL THEN now() ELSE o.escalated_at END,
            escalation = COALESCE(u.escalation, o.escalation),
            updated_at = now(),
            last_write = u.write_id";
    // The epoch is the lease's identity: each is given out once (a claim
    // or an operator's decision moves it on under the row's lock), so a
    // write under any but the newest changes nothing.
    let fence = "o.id = u.id AND o.lease_epoch = u.epoch AND o.completed_at IS NULL
          AND o.last_write IS DISTINCT FROM u.write_id";
    let watched = "EXISTS (SELECT 1 FROM operation_watches w
                     WHERE w.operation_id = upd.id AND w.until > now())";
    if !one {
        return format!(
            "WITH u AS (
        SELECT * FROM {rows}
     ), upd AS (
        {update}
        FROM u
        WHERE {fence}
        RETURNING {DECIDED_COLUMNS}
     ), lg AS (
        INSERT INTO operation_log (operation_id, write_id, at, replica, events)
        SELECT upd.id, u.write_id, clock_timestamp(), u.replica, u.events
        FROM upd JOIN u ON u.id = upd.id
        WHERE u.events IS NOT NULL
     ), n AS (
        SELECT pg_notify('{NOTIFY_CHANNEL}', string_agg(upd.id::text, ',')) FROM upd
        WHERE {watched}
        HAVING count(*) > 0
     )
     SELECT upd.* FROM upd LEFT JOIN n ON true",
            rows = rows_from(&DECISION_COLUMNS),
        );
    }
    // One row: the parameters in place, and its NOTIFY (if it is watched)
    // sent by its own RETURNING (`notified`) instead of by a CTE that
    // aggregates the batch and is joined in only to be run: 63,000
    // instructions of PostgreSQL's per decision less.
    params_in_place(
        &format!(
            "WITH upd AS (
        {update}
        WHERE {fence}
        RETURNING {DECIDED_COLUMNS},
            CASE WHEN {watched_row} THEN pg_notify('{NOTIFY_CHANNEL}', o.id::text) IS NOT NULL
                 ELSE false END AS notified
     ), lg AS (
        INSERT INTO operation_log (operation_id, write_id, at, replica, events)
        SELECT upd.id, u.write_id, clock_timestamp(), u.replica, u.events
        FROM upd
        WHERE u.events IS NOT NULL
     )
     SELECT * FROM upd",
            watched_row = watched.replace("upd.id", "o.id"),
        ),
        &DECISION_COLUMNS,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parameters a statement reads: `$i` for each i, in order of
    /// first appearance sorted.
    fn params(sql: &str) -> Vec<usize> {
        let mut out: Vec<usize> = sql
            .split('$')
            .skip(1)
            .filter_map(|s| {
                let digits: String = s.chars().take_while(char::is_ascii_digit).collect();
                digits.parse().ok()
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    #[test]
    fn one_row_statements_read_every_parameter_in_place_and_no_row_source() {
        let unlogged = INTENT_COLUMNS.len() - 1;
        for (name, sql, n) in [
            ("intend_one", CREATE_ONE.as_str(), unlogged),
            ("intend_one_lean", CREATE_ONE_LEAN.as_str(), unlogged),
            (
                "intend_one_logged",
                CREATE_ONE_LOGGED.as_str(),
                INTENT_COLUMNS.len(),
            ),
            (
                "intend_one_lean_logged",
                CREATE_ONE_LEAN_LOGGED.as_str(),
                INTENT_COLUMNS.len(),
            ),
            (
                "decide_one",
                TRANSITION_ONE.as_str(),
                DECISION_COLUMNS.len(),
            ),
        ] {
            assert_eq!(params(sql), (1..=n).collect::<Vec<_>>(), "{name}: {sql}");
            for w in sql.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.')) {
                assert!(
                    !w.starts_with("u."),
                    "{name} reads {w} of a row source: {sql}"
                );
            }
            assert!(!sql.contains("unnest"), "{name}: {sql}");
        }
        assert!(!CREATE_ONE.contains("operation_log"));
        assert!(CREATE_ONE_LOGGED.contains("operation_log"));
        assert!(CREATE_ONE.contains("ON CONFLICT DO NOTHING"));
        assert!(!CREATE_ONE_LEAN.contains("ON CONFLICT"));
        assert!(TRANSITION_ONE.contains("pg_notify"));
    }

    #[test]
    fn a_name_is_replaced_only_where_it_is_whole() {
        assert_eq!(
            replace_word("u.lease_owner, u.lease, menu.lease", "u.lease", "$1"),
            "u.lease_owner, $1, menu.lease"
        );
    }
}

//! What plan tests, the ledger-cost test and the benchmark scripts read of
//! the PostgreSQL store, and nothing the service runs by: each index with
//! a statement that reads through it, the writers' statements as they
//! prepare them with their parameter types and session settings, and the
//! service's write pattern as a pgbench script. Its callers name it
//! (`store::pg::tooling`); the store's own face is `PgStore`.

use uuid::Uuid;

use super::sql::{self, write::*};
use crate::store::OperationFilter;
use crate::store::rows;

pub use super::connect::WRITER_SETTINGS;
pub use super::sql::verification_statement;

/// The list statement PostgreSQL runs for `filter` (`query::list`), for
/// plan tests.
pub fn list_statement(
    filter: &OperationFilter,
    after: Option<crate::store::ListCursor>,
    limit: u32,
) -> String {
    crate::store::query::list(filter, after, limit, crate::store::query::Dialect::Postgres).sql
}

/// Every index of `operations`, with a statement of the service's that
/// reads through it (its parameter types, as `PREPARE` takes them): each
/// index earns its place by a query, and a plan test
/// (`tests/store/store_conformance.rs`) holds each statement to its index and the
/// table to exactly these indexes.
pub fn index_queries() -> Vec<(&'static str, String, &'static str)> {
    vec![
        // Reads and decisions by id.
        ("operations_pkey", rows::by_id_sql(), "uuid"),
        // Pages of the whole ledger, newest first (keyset on `seq`).
        (
            "operations_seq_key",
            list_statement(&OperationFilter::default(), Some(cursor()), 50),
            "bigint",
        ),
        // A caller's key: replays, and why an intent was not inserted.
        ("operations_key", sql::BY_KEY.clone(), "uuid, text, text"),
        // The open operations: one per volume (the guarantee), the gauge
        // of open work, the oldest UNKNOWN one, the reconciler's claims.
        ("operations_open", sql::OPEN_BY_STATE.clone(), ""),
        // Pages by server, and by volume (also the verifier's per-volume
        // probe of later operations).
        (
            "operations_server",
            list_statement(
                &OperationFilter {
                    server_id: Some(Uuid::nil()),
                    ..Default::default()
                },
                None,
                50,
            ),
            "uuid",
        ),
        (
            "operations_volume",
            list_statement(
                &OperationFilter {
                    volume_id: Some(Uuid::nil()),
                    ..Default::default()
                },
                None,
                50,
            ),
            "uuid",
        ),
        // Decisions by time: the verifier's cursor, retention's oldest.
        (
            "operations_decided",
            verification_statement(),
            "timestamptz, uuid, float8, bigint",
        ),
    ]
}

/// A page's end, for statements read after one.
pub fn cursor() -> crate::store::ListCursor {
    crate::store::ListCursor { seq: 10 }
}

/// The writers' statements as they prepare them, for plan tests: name,
/// parameter types (as `PREPARE` takes them) and text; for batches of
/// several rows (arrays), then of one (plain parameters, `rows_from`).
pub fn writer_statements() -> [(&'static str, String, String); 8] {
    let unlogged = &INTENT_COLUMNS[..INTENT_COLUMNS.len() - 1];
    [
        (
            "decide",
            parameter_types(&DECISION_COLUMNS, false),
            TRANSITION_MANY.clone(),
        ),
        (
            "intend",
            parameter_types(&INTENT_COLUMNS, false),
            CREATE_MANY.clone(),
        ),
        (
            "decide_one",
            parameter_types(&DECISION_COLUMNS, true),
            TRANSITION_ONE.clone(),
        ),
        (
            "intend_one",
            parameter_types(unlogged, true),
            CREATE_ONE.clone(),
        ),
        (
            "intend_one_logged",
            parameter_types(&INTENT_COLUMNS, true),
            CREATE_ONE_LOGGED.clone(),
        ),
        (
            "intend_lean",
            parameter_types(&INTENT_COLUMNS, false),
            CREATE_MANY_LEAN.clone(),
        ),
        (
            "intend_one_lean",
            parameter_types(unlogged, true),
            CREATE_ONE_LEAN.clone(),
        ),
        (
            "intend_one_lean_logged",
            parameter_types(&INTENT_COLUMNS, true),
            CREATE_ONE_LEAN_LOGGED.clone(),
        ),
    ]
}

/// A statement with one operation's values in place of its parameters, on
/// one line (pgbench reads a statement per line).
fn substitute(sql: &str, values: &[&str]) -> String {
    let mut out = sql.to_string();
    // Highest first, so $1 does not eat the start of $12.
    for (i, v) in values.iter().enumerate().rev() {
        out = out.replace(&format!("${}", i + 1), v);
    }
    // The operation's id, the same in both statements, and the decision's
    // write id, made from two pgbench random numbers (pgbench variables
    // are numbers only).
    out = out
        .replace(
            "__OPID__",
            "(lpad(to_hex(:hi::int8), 16, '0') || lpad(to_hex(:lo::int8), 16, '0'))::uuid",
        )
        .replace(
            "__WRITEID__",
            "(lpad(to_hex(:lo::int8), 16, '0') || lpad(to_hex(:hi::int8), 16, '0'))::uuid",
        );
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The service's per-operation write pattern as a pgbench script: the very
/// writers' statements in their one-row form (intent, then decision, each its
/// own durable autocommit statement, as with one caller), with one
/// operation's values in place of the parameters. `scripts/bench` runs it as the database's ceiling.
pub fn pgbench_script() -> String {
    let create = substitute(
        &CREATE_ONE_LEAN,
        &[
            "__OPID__",
            "'pgbench-' || :n || '-' || random()",
            "'fingerprint'",
            "'attach'",
            "'in_progress'",
            "gen_random_uuid()",
            "gen_random_uuid()",
            "'{}'::jsonb",
            "1",
            "30000::float8",
            "'pgbench'",
            "3000::float8",
            "NULL::text",
            "'00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'",
            "NULL::text",
            // The key's hash (the key is random: so is its hash).
            "gen_random_uuid()",
            // The time past which it may no longer be recorded.
            "(now() + interval '10 seconds')",
            // A keyed call's, not an Ensure call's.
            "false",
            // No labels.
            "NULL::jsonb",
            "'{\"replica\":\"pgbench\",\"metadata\":{\"caller_deadline_ms\":\"30000\",\"deadline_from_caller\":\"true\",\"caller_span_id\":\"-\"},\"derived\":[\"idempotency_key\",\"caller\",\"trace_id\",\"traceparent\"]}'::jsonb",
            // No events beyond `recorded`: the statement without the log row.
        ],
    );
    let decide = substitute(
        &TRANSITION_ONE,
        &[
            "__OPID__",
            "1::int8",
            "'succeeded'",
            "'response'",
            "'{\"id\": \"a\", \"device\": \"/dev/vdb\", \"tag\": null, \"delete_on_termination\": false}'::jsonb",
            "0",
            "true",
            "NULL::jsonb",
            "false",
            "true",
            "NULL::float8",
            "true",
            "__WRITEID__",
            "NULL::text",
            "'pgbench'",
            // The row was read without an unsent mark, and marks none.
            "false",
            "false",
            "'[{\"kind\":\"request_sent\",\"detail\":\"POST attach request #1\",\"metadata\":{\"attempt\":\"1\",\"outbound_deadline_ms\":\"23500\"},\"ago_ms\": 1.5},{\"kind\":\"response\",\"detail\":\"Nova answered 200: attachment created\",\"metadata\":{\"status\":\"200\"},\"ago_ms\": 1},{\"kind\":\"resolved\",\"detail\":\"attached\",\"metadata\":{\"state\":\"succeeded\"},\"ago_ms\": 0}]'::jsonb",
        ],
    );
    format!(
        "\\set n random(1, 2000000000)\n\\set hi random(1, 9000000000000000000)\n\\set lo random(1, 9000000000000000000)\n{create};\n{decide};\n"
    )
}

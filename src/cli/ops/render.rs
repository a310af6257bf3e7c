//! How `ops` shows operations: tables and text for people, JSON (with
//! RFC 3339 timestamps) for scripts.

use chrono::{DateTime, SecondsFormat, TimeZone, Utc};

use crate::cli::output::{align_right, plain_table};
use crate::grpc::pb;

fn time(t: &Option<prost_types::Timestamp>) -> Option<DateTime<Utc>> {
    t.as_ref().and_then(|t| {
        Utc.timestamp_opt(t.seconds, u32::try_from(t.nanos).unwrap_or(0))
            .single()
    })
}

/// For people: `2026-11-30 09:56:43.952Z` (UTC, and it says so), or `-`.
pub fn ts(t: &Option<prost_types::Timestamp>) -> String {
    time(t)
        .map(|d| d.format("%Y-%m-%d %H:%M:%S%.3fZ").to_string())
        .unwrap_or_else(|| "-".into())
}

/// For scripts: RFC 3339 in UTC with milliseconds, or null.
pub fn ts_json(t: &Option<prost_types::Timestamp>) -> serde_json::Value {
    time(t)
        .map(|d| d.to_rfc3339_opts(SecondsFormat::Millis, true).into())
        .unwrap_or(serde_json::Value::Null)
}

fn enum_name(s: &str, prefix: &str) -> String {
    s.trim_start_matches(prefix).to_ascii_lowercase()
}

pub fn state_name(v: i32) -> String {
    pb::State::try_from(v)
        .map(|s| enum_name(s.as_str_name(), "STATE_"))
        .unwrap_or_else(|_| v.to_string())
}

pub fn resolution_name(v: i32) -> String {
    match pb::Resolution::try_from(v) {
        Ok(pb::Resolution::Unspecified) => "-".into(),
        Ok(r) => enum_name(r.as_str_name(), "RESOLUTION_"),
        Err(_) => v.to_string(),
    }
}

pub fn action_name(v: i32) -> String {
    pb::Action::try_from(v)
        .map(|s| enum_name(s.as_str_name(), "ACTION_"))
        .unwrap_or_else(|_| v.to_string())
}

pub fn op_json(op: &pb::Operation) -> serde_json::Value {
    serde_json::json!({
        "id": op.id,
        "idempotency_key": op.idempotency_key,
        "action": action_name(op.action),
        "state": state_name(op.state),
        "resolution": resolution_name(op.resolution),
        "server_id": op.server_id,
        "volume_id": op.volume_id,
        "attempts": op.attempts,
        "attachment": op.attachment.as_ref().map(|a| serde_json::json!({
            "id": a.id, "device": a.device, "tag": a.tag, "delete_on_termination": a.delete_on_termination})),
        "last_error": op.last_error.as_ref().map(|e| serde_json::json!({
            "reason": e.reason, "message": e.message, "metadata": e.metadata})),
        "caller": (!op.caller.is_empty()).then_some(&op.caller),
        "created_at": ts_json(&op.created_at),
        "updated_at": ts_json(&op.updated_at),
        "completed_at": ts_json(&op.completed_at),
        "drifted": op.drifted,
    })
}

pub fn print_op(op: &pb::Operation) {
    println!("operation   {}", op.id);
    println!("key         {}", op.idempotency_key);
    println!(
        "action      {} volume {} on server {}",
        action_name(op.action),
        op.volume_id,
        op.server_id
    );
    println!(
        "state       {} ({}){}",
        state_name(op.state),
        resolution_name(op.resolution),
        if op.drifted {
            "  DRIFTED: a later observation disagrees"
        } else {
            ""
        }
    );
    println!("attempts    {}", op.attempts);
    if !op.caller.is_empty() {
        println!("caller      {}", op.caller);
    }
    if let Some(a) = &op.attachment {
        println!(
            "attachment  {} device {}",
            a.id,
            if a.device.is_empty() { "-" } else { &a.device }
        );
    }
    if let Some(e) = &op.last_error {
        println!("last error  {}: {}", e.reason, e.message);
    }
    println!(
        "created     {}   completed {}",
        ts(&op.created_at),
        ts(&op.completed_at)
    );
}

const EVENT_KEYS: &[&str] = &[
    "attempt",
    "outbound_deadline_ms",
    "http_status",
    "stage",
    "error_class",
    "reason",
    "nova_fault",
    "nova_message",
    "elapsed_ms",
    "present",
    "state",
    "resolution",
    "pause_ms",
    "caller",
    "cause",
];

/// An event's request ids: the global one the service sent
/// (`X-OpenStack-Request-ID`, `req-<operation id>`) and the one Nova
/// answered under, each when recorded.
fn event_ids(e: &pb::OperationEvent) -> (Option<&str>, Option<&str>) {
    let id = |k: &str| {
        e.metadata
            .get(k)
            .map(String::as_str)
            .filter(|v| !v.is_empty() && *v != "-")
    };
    (id("request_id"), id("nova_request_id"))
}

/// The request ids an operation's events carry: the global ones (one per
/// operation, normally) and Nova's own, each once, in order.
pub fn request_ids(events: &[pb::OperationEvent]) -> (Vec<String>, Vec<String>) {
    let (mut global, mut nova) = (Vec::new(), Vec::new());
    for e in events {
        let (g, n) = event_ids(e);
        for (id, into) in [(g, &mut global), (n, &mut nova)] {
            if let Some(id) = id
                && !into.iter().any(|x| x == id)
            {
                into.push(id.to_string());
            }
        }
    }
    (global, nova)
}

/// The operation's trace, as its intent recorded it: (trace id, the
/// caller's span when the caller sent a `traceparent`).
pub fn trace_of(events: &[pb::OperationEvent]) -> Option<(String, Option<String>)> {
    let e = events
        .iter()
        .find(|e| e.metadata.contains_key("trace_id"))?;
    let caller_span = e
        .metadata
        .get("caller_span_id")
        .filter(|s| !s.is_empty() && *s != "-")
        .cloned();
    Some((e.metadata["trace_id"].clone(), caller_span))
}

/// The reconcile log: one row per event, its detail, its notable fields,
/// and the request ids that find it in Nova's logs.
pub fn print_events(events: &[pb::OperationEvent]) {
    if let Some((trace_id, caller_span)) = trace_of(events) {
        println!();
        println!(
            "trace id  {trace_id}  ({}; in every log line and as traceparent on every request)",
            match caller_span {
                Some(span) => format!("the caller's, from its span {span}"),
                None => "begun here: the caller sent no usable traceparent".to_string(),
            }
        );
    }
    let (global, nova) = request_ids(events);
    if !global.is_empty() || !nova.is_empty() {
        println!();
        println!("request ids (to find them in Nova's logs):");
        let none = || "-".to_string();
        println!(
            "  global  {}  (X-OpenStack-Request-ID sent with every Nova request)",
            if global.is_empty() {
                none()
            } else {
                global.join(", ")
            }
        );
        println!(
            "  nova    {}  (Nova's own, one per answer)",
            if nova.is_empty() {
                none()
            } else {
                nova.join(", ")
            }
        );
    }
    println!();
    println!("reconcile log:");
    let mut table = plain_table(["AT", "REPLICA", "EVENT", "DETAIL"]);
    for e in events {
        let mut lines = vec![e.detail.clone()];
        let extras: Vec<String> = EVENT_KEYS
            .iter()
            .filter_map(|k| e.metadata.get(*k).map(|v| format!("{k}={v}")))
            .collect();
        if !extras.is_empty() {
            lines.push(extras.join(" "));
        }
        let (global, nova) = event_ids(e);
        if let Some(g) = global {
            lines.push(format!("global request id {g}"));
        }
        if let Some(n) = nova {
            lines.push(format!("Nova's request id {n}"));
        }
        table.add_row([
            ts(&e.at),
            e.replica.clone(),
            e.kind.clone(),
            lines.join("\n"),
        ]);
    }
    for line in table.lines() {
        println!(" {}", line.trim_end());
    }
}

/// An event as JSON.
pub fn event_json(e: &pb::OperationEvent) -> serde_json::Value {
    serde_json::json!({
        "at": ts_json(&e.at), "kind": e.kind, "detail": e.detail,
        "metadata": e.metadata, "replica": e.replica,
    })
}

/// The `ops list` table: one row per operation.
pub fn list_table(ops: &[pb::Operation]) -> comfy_table::Table {
    let mut table = plain_table([
        "ID",
        "ACTION",
        "STATE",
        "RESOLUTION",
        "TRY",
        "SERVER",
        "VOLUME",
        "CALLER",
        "CREATED",
        "REASON",
    ]);
    for op in ops {
        let reason = op
            .last_error
            .as_ref()
            .map(|e| e.reason.as_str())
            .unwrap_or("");
        let caller = if op.caller.is_empty() {
            "-"
        } else {
            &op.caller
        };
        table.add_row([
            op.id.clone(),
            action_name(op.action),
            state_name(op.state),
            resolution_name(op.resolution),
            op.attempts.to_string(),
            op.server_id.clone(),
            op.volume_id.clone(),
            caller.to_string(),
            ts(&op.created_at),
            format!("{reason}{}", if op.drifted { " DRIFTED" } else { "" }),
        ]);
    }
    align_right(&mut table, &[4]);
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: &str, meta: &[(&str, &str)]) -> pb::OperationEvent {
        pb::OperationEvent {
            kind: kind.into(),
            metadata: meta
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn request_ids_are_collected_once_each_in_order() {
        let events = [
            event("request_sent", &[("request_id", "req-op")]),
            event("request_failed", &[("nova_request_id", "req-n1")]),
            event("observed", &[("nova_request_id", "-")]),
            event("request_sent", &[("request_id", "req-op")]),
            event("response", &[("nova_request_id", "req-n2")]),
        ];
        assert_eq!(
            request_ids(&events),
            (
                vec!["req-op".to_string()],
                vec!["req-n1".to_string(), "req-n2".to_string()]
            )
        );
    }

    #[test]
    fn json_timestamps_are_rfc3339_in_utc() {
        let t = Some(prost_types::Timestamp {
            seconds: 1_764_496_603,
            nanos: 952_000_000,
        });
        assert_eq!(ts_json(&t), serde_json::json!("2025-11-30T09:56:43.952Z"));
        assert_eq!(ts_json(&None), serde_json::Value::Null);
        assert_eq!(ts(&t), "2025-11-30 09:56:43.952Z");
    }
}

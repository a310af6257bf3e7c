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
        "labels": op.labels.iter().collect::<std::collections::BTreeMap<_, _>>(),
    })
}

/// An operation's labels for people: `k=v,k2=v2`, keys in order.
pub fn labels_text(op: &pb::Operation) -> String {
    let sorted: std::collections::BTreeMap<_, _> = op.labels.iter().collect();
    sorted
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// One operation for people: a line per field.
pub fn op_text(op: &pb::Operation) -> String {
    let mut out = format!("operation   {}\n", op.id);
    out += &format!("key         {}\n", op.idempotency_key);
    out += &format!(
        "action      {} volume {} on server {}\n",
        action_name(op.action),
        op.volume_id,
        op.server_id
    );
    out += &format!(
        "state       {} ({}){}\n",
        state_name(op.state),
        resolution_name(op.resolution),
        if op.drifted {
            "  DRIFTED: a later observation disagrees"
        } else {
            ""
        }
    );
    out += &format!("attempts    {}\n", op.attempts);
    if !op.caller.is_empty() {
        out += &format!("caller      {}\n", op.caller);
    }
    if !op.labels.is_empty() {
        out += &format!("labels      {}\n", labels_text(op));
    }
    if let Some(a) = &op.attachment {
        out += &format!(
            "attachment  {} device {}\n",
            a.id,
            if a.device.is_empty() { "-" } else { &a.device }
        );
    }
    if let Some(e) = &op.last_error {
        out += &format!("last error  {}: {}\n", e.reason, e.message);
    }
    out += &format!(
        "created     {}   completed {}\n",
        ts(&op.created_at),
        ts(&op.completed_at)
    );
    out
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

/// The trace and the request ids of an operation, for people.
fn ids_text(events: &[pb::OperationEvent]) -> String {
    let mut out = String::new();
    if let Some((trace_id, caller_span)) = trace_of(events) {
        out += &format!(
            "\ntrace id  {trace_id}  ({}; in every log line and as traceparent on every request)\n",
            match caller_span {
                Some(span) => format!("the caller's, from its span {span}"),
                None => "begun here: the caller sent no usable traceparent".to_string(),
            }
        );
    }
    let (global, nova) = request_ids(events);
    if !global.is_empty() || !nova.is_empty() {
        let list = |ids: Vec<String>| {
            if ids.is_empty() {
                "-".to_string()
            } else {
                ids.join(", ")
            }
        };
        out += "\nrequest ids (to find them in Nova's logs):\n";
        out += &format!(
            "  global  {}  (X-OpenStack-Request-ID sent with every Nova request)\n",
            list(global)
        );
        out += &format!("  nova    {}  (Nova's own, one per answer)\n", list(nova));
    }
    out
}

/// The reconcile log: one row per event, its detail, its notable fields
/// (`wide`: every field), and the request ids that find it in Nova's logs.
pub fn events_text(events: &[pb::OperationEvent], wide: bool) -> String {
    let mut out = ids_text(events);
    out += "\nreconcile log:\n";
    let mut table = plain_table(["AT", "REPLICA", "EVENT", "DETAIL"]);
    for e in events {
        let mut lines = vec![e.detail.clone()];
        let extras: Vec<String> = if wide {
            let mut keys: Vec<_> = e.metadata.iter().collect();
            keys.sort();
            keys.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
        } else {
            EVENT_KEYS
                .iter()
                .filter_map(|k| e.metadata.get(*k).map(|v| format!("{k}={v}")))
                .collect()
        };
        if !extras.is_empty() {
            lines.push(extras.join(" "));
        }
        let (global, nova) = event_ids(e);
        if let Some(g) = global.filter(|_| !wide) {
            lines.push(format!("global request id {g}"));
        }
        if let Some(n) = nova.filter(|_| !wide) {
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
        out += &format!(" {}\n", line.trim_end());
    }
    out
}

/// An operation and its log as one document (`ops show -o json|yaml`).
pub fn op_with_events_json(op: &pb::Operation, events: &[pb::OperationEvent]) -> serde_json::Value {
    let evs: Vec<_> = events.iter().map(event_json).collect();
    let (global, nova) = request_ids(events);
    let trace_id = trace_of(events).map(|(t, _)| t);
    serde_json::json!({
        "operation": op_json(op),
        "trace_id": trace_id,
        "request_ids": {"global": global, "nova": nova},
        "events": evs,
    })
}

/// An event as JSON.
pub fn event_json(e: &pb::OperationEvent) -> serde_json::Value {
    serde_json::json!({
        "at": ts_json(&e.at), "kind": e.kind, "detail": e.detail,
        "metadata": e.metadata, "replica": e.replica,
    })
}

/// The `ops list` table: one row per operation; `wide` adds the key,
/// the attachment's device, when it was last updated and decided.
pub fn list_table(ops: &[pb::Operation], wide: bool) -> comfy_table::Table {
    let mut header = vec![
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
    ];
    if wide {
        header.extend(["KEY", "DEVICE", "UPDATED", "COMPLETED", "LABELS"]);
    }
    let mut table = plain_table(header);
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
        let mut row = vec![
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
        ];
        if wide {
            let device = op
                .attachment
                .as_ref()
                .map(|a| a.device.as_str())
                .filter(|d| !d.is_empty())
                .unwrap_or("-");
            row.extend([
                op.idempotency_key.clone(),
                device.to_string(),
                ts(&op.updated_at),
                ts(&op.completed_at),
                labels_text(op),
            ]);
        }
        table.add_row(row);
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

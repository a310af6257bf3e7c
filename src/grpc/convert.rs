//! Domain ⇄ protobuf conversions.

use chrono::{DateTime, Utc};

use super::pb;
use crate::domain::{Action, InvalidField, Operation, OperationEvent, Resolution, State};
use crate::store::ListCursor;

pub fn timestamp(t: DateTime<Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: t.timestamp(),
        nanos: t.timestamp_subsec_nanos() as i32,
    }
}

pub fn state_to_pb(s: State) -> pb::State {
    match s {
        State::Pending => pb::State::Pending,
        State::InProgress => pb::State::InProgress,
        State::Unknown => pb::State::Unknown,
        State::Succeeded => pb::State::Succeeded,
        State::Failed => pb::State::Failed,
    }
}

pub fn state_from_pb(s: pb::State) -> Option<State> {
    match s {
        pb::State::Unspecified => None,
        pb::State::Pending => Some(State::Pending),
        pb::State::InProgress => Some(State::InProgress),
        pb::State::Unknown => Some(State::Unknown),
        pb::State::Succeeded => Some(State::Succeeded),
        pb::State::Failed => Some(State::Failed),
    }
}

fn resolution_to_pb(r: Option<Resolution>) -> pb::Resolution {
    match r {
        None => pb::Resolution::Unspecified,
        Some(Resolution::Response) => pb::Resolution::Response,
        Some(Resolution::Reobserved) => pb::Resolution::Reobserved,
        Some(Resolution::Reconciler) => pb::Resolution::Reconciler,
        Some(Resolution::Operator) => pb::Resolution::Operator,
        Some(Resolution::Cancelled) => pb::Resolution::Cancelled,
    }
}

pub fn operation_to_pb(op: &Operation) -> pb::Operation {
    pb::Operation {
        id: op.id.to_string(),
        idempotency_key: op.idempotency_key.clone(),
        action: match op.action {
            Action::Attach => pb::Action::Attach,
            Action::Detach => pb::Action::Detach,
        } as i32,
        state: state_to_pb(op.state) as i32,
        resolution: resolution_to_pb(op.resolution) as i32,
        server_id: op.server_id.to_string(),
        volume_id: op.volume_id.to_string(),
        attachment: op.attachment.as_ref().map(|a| pb::Attachment {
            id: a.id.clone(),
            device: a.device.clone().unwrap_or_default(),
            tag: a.tag.clone().unwrap_or_default(),
            delete_on_termination: a.delete_on_termination,
        }),
        attempts: op.attempts.max(0) as u32,
        last_error: op.last_error.as_ref().map(|e| pb::OperationError {
            reason: e.reason.to_string(),
            message: e.message.clone(),
            metadata: e.metadata.clone().into_iter().collect(),
        }),
        created_at: Some(timestamp(op.created_at)),
        updated_at: Some(timestamp(op.updated_at)),
        completed_at: op.completed_at.map(timestamp),
        drifted: op.drifted,
        caller: op.caller.clone().unwrap_or_default(),
        escalated_at: op.escalated_at.map(timestamp),
        escalation: op.escalation.clone().unwrap_or_default(),
        ensure: op.ensure,
        labels: op
            .labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

/// The ledger's counts by state and resolution.
pub fn stats_to_pb(counts: &[crate::store::StateCount]) -> pb::OperationStats {
    let counts: Vec<pb::StateCount> = counts
        .iter()
        .map(|c| pb::StateCount {
            state: State::parse(&c.state).map_or(pb::State::Unspecified, state_to_pb) as i32,
            resolution: resolution_to_pb(
                c.resolution
                    .as_deref()
                    .and_then(crate::domain::Resolution::parse),
            ) as i32,
            count: c.count,
        })
        .collect();
    pb::OperationStats {
        total: counts.iter().map(|c| c.count).sum(),
        counts,
    }
}

pub fn event_to_pb(e: &OperationEvent) -> pb::OperationEvent {
    pb::OperationEvent {
        at: Some(timestamp(e.at)),
        kind: e.kind.clone(),
        detail: e.detail.clone(),
        metadata: e.metadata.clone().into_iter().collect(),
        replica: e.replica.clone(),
    }
}

/// A caller's name in a request (`GetOperationRequest.caller`,
/// `ListOperationsRequest.caller`): `None` when empty, else a name as
/// callers are named (1..=255 bytes, no control characters: a NUL would
/// reach the database's query and fail there, as UNAVAILABLE).
pub fn caller_filter(field: &'static str, value: &str) -> Result<Option<String>, InvalidField> {
    if value.is_empty() {
        return Ok(None);
    }
    super::auth::check_name(value)
        .map(|()| Some(value.to_string()))
        .map_err(|why| InvalidField::new(field, why))
}

/// The reason of an operator's decision, trimmed: required, at most
/// [`MAX_REASON_LEN`](super::MAX_REASON_LEN) bytes, and no control
/// characters but tabs and line breaks (the ledger keeps it in its events,
/// where a NUL cannot be written; logs print it).
pub fn resolve_reason(value: &str) -> Result<&str, InvalidField> {
    const FIELD: &str = "reason";
    let reason = value.trim();
    if reason.is_empty() {
        return Err(InvalidField::new(
            FIELD,
            "is required: say why you know better than the cloud shows",
        ));
    }
    if reason.len() > super::MAX_REASON_LEN {
        return Err(InvalidField::new(
            FIELD,
            format!("exceeds {} bytes", super::MAX_REASON_LEN),
        ));
    }
    if let Some(c) = reason
        .chars()
        .find(|c| c.is_control() && !matches!(c, '\t' | '\n'))
    {
        return Err(InvalidField::new(
            FIELD,
            format!(
                "contains the control character {c:?}; only printable text, tabs and line breaks are allowed"
            ),
        ));
    }
    Ok(reason)
}

/// Page tokens are opaque to clients: a versioned, hex-encoded position
/// (the last row's `seq`).
pub fn encode_page_token(c: ListCursor) -> String {
    format!("v1.{}", hex(format!("seq:{}", c.seq).as_bytes()))
}

pub fn decode_page_token(token: &str) -> Option<ListCursor> {
    let body = token.strip_prefix("v1.")?;
    if body.len() % 2 != 0 || body.len() > 64 {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..body.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&body[i..i + 2], 16).ok())
        .collect();
    let text = String::from_utf8(bytes?).ok()?;
    let seq = text
        .strip_prefix("seq:")?
        .parse()
        .ok()
        .filter(|n: &i64| *n > 0)?;
    Some(ListCursor { seq })
}

/// A timestamp of a request, as the domain reads it; `field` names it when
/// it is out of range.
pub fn timestamp_from_pb(
    field: &'static str,
    t: &prost_types::Timestamp,
) -> Result<DateTime<Utc>, InvalidField> {
    u32::try_from(t.nanos)
        .ok()
        .and_then(|n| DateTime::from_timestamp(t.seconds, n))
        .ok_or_else(|| InvalidField::new(field, format!("{t:?} is not a valid timestamp")))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_text_fields_refuse_control_characters_naming_the_field() {
        assert_eq!(caller_filter("caller", ""), Ok(None));
        assert_eq!(caller_filter("caller", "ci-a"), Ok(Some("ci-a".into())));
        for bad in ["a\0b", "a\u{1b}[31m", &"c".repeat(256)] {
            assert_eq!(caller_filter("caller", bad).unwrap_err().field, "caller");
        }
        assert_eq!(
            resolve_reason("  seen on the hypervisor\n\tby hand  "),
            Ok("seen on the hypervisor\n\tby hand")
        );
        for bad in ["", "  ", "why\0", "a\rb", "\u{7}", &"r".repeat(1025)] {
            assert_eq!(resolve_reason(bad).unwrap_err().field, "reason", "{bad:?}");
        }
    }

    #[test]
    fn page_tokens_round_trip_and_reject_garbage() {
        let t = encode_page_token(ListCursor { seq: 12345 });
        assert_eq!(decode_page_token(&t), Some(ListCursor { seq: 12345 }));
        for bad in [
            "",
            "v1.",
            "v1.zz",
            "v2.7365713a31",
            "seq:1",
            "v1.7365713a2d31",
        ] {
            assert_eq!(decode_page_token(bad), None, "{bad}");
        }
    }
}

//! What an OpenStack answer's body says when it is not the value asked
//! for: Nova's fault (and Cinder's, which has the same shape), the auth
//! middleware's 401, and what Nova's refusal messages mean. Lenient where
//! a body is only quoted, strict where it decides ([`nova_fault`]).

use super::Rejection;

/// A fault body, parsed: `{"<faultName>": {"code", "message"}}` from Nova,
/// `{"error": {...}}` from keystonemiddleware or Keystone, or not JSON at
/// all (a proxy's page). Lenient: it reads whatever a body says, for
/// messages; whether the body is Nova's own is [`nova_fault`]'s question.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub name: Option<String>,
    pub message: Option<String>,
}

/// Text from an answer as it may go into the ledger: PostgreSQL's `text`
/// and `jsonb` refuse U+0000, so a NUL (raw, or `\u0000` in JSON) becomes
/// U+FFFD here, where the text is built, and a row stays writable.
pub fn clean_text(s: &str) -> String {
    s.replace('\0', "\u{FFFD}")
}

/// At most `max` characters of `body` as text (lossy UTF-8, NUL-free,
/// trimmed), for an error that quotes what came back.
pub fn body_excerpt(body: &[u8], max: usize) -> String {
    let text = String::from_utf8_lossy(body);
    clean_text(&text.trim().chars().take(max).collect::<String>())
}

pub fn parse_fault(body: &[u8]) -> Fault {
    if let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(body)
        && let Some((name, inner)) = map.iter().next()
    {
        let message = inner
            .get("message")
            .and_then(|m| m.as_str())
            .map(clean_text);
        return Fault {
            name: Some(clean_text(name)),
            message,
        };
    }
    let text = body_excerpt(body, 300);
    Fault {
        name: None,
        message: if text.is_empty() { None } else { Some(text) },
    }
}

/// The key Nova's fault body has for `status` (nova/api/openstack/wsgi.py,
/// `Fault._fault_names`; any other status is a `computeFault`).
pub fn fault_name(status: u16) -> &'static str {
    match status {
        400 => "badRequest",
        401 => "unauthorized",
        403 => "forbidden",
        404 => "itemNotFound",
        405 => "badMethod",
        409 => "conflictingRequest",
        413 | 429 => "overLimit",
        415 => "badMediaType",
        501 => "notImplemented",
        503 => "serviceUnavailable",
        _ => "computeFault",
    }
}

/// `body` as Nova's own fault for `status`, or `None` when it is not one:
/// a JSON object with exactly one key, the name Nova gives that status,
/// holding `code` (the status itself) and a `message` string — what
/// nova-api's `Fault` renders for every refusal. A proxy's or an ingress's
/// page, a JSON body cut short, another service's error, or a fault whose
/// name or code disagrees with the status is not Nova's word.
pub fn nova_fault(status: u16, body: &[u8]) -> Option<Fault> {
    let serde_json::Value::Object(map) = serde_json::from_slice(body).ok()? else {
        return None;
    };
    let (name, inner) = map.iter().next().filter(|_| map.len() == 1)?;
    if name != fault_name(status) || inner.get("code")?.as_u64()? != u64::from(status) {
        return None;
    }
    let message = inner.get("message")?.as_str()?;
    Some(Fault {
        name: Some(name.clone()),
        message: Some(clean_text(message)),
    })
}

/// Whether `body` is keystonemiddleware's 401, `{"error": {"code": 401,
/// "title": "Unauthorized", "message": ...}}`: the auth middleware in front
/// of Nova (and Cinder) refused the token, so the request never reached the
/// service's handler and may be replayed with a new token. A 401 of any
/// other shape (a proxy's own login wall) proves nothing of the kind.
pub fn keystone_refusal(body: &[u8]) -> bool {
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(body)
    else {
        return false;
    };
    map.len() == 1
        && map.get("error").is_some_and(|e| {
            e.get("code").and_then(|c| c.as_u64()) == Some(401)
                && e.get("message").is_some_and(|m| m.is_string())
        })
}

/// Whether Nova's "Instance {id} could not be found." names `server`:
/// the uuid between the words, parsed whole. A 404 naming another
/// instance (an answer routed or relayed for another request, a proxy
/// replaying a cached fault) says nothing about this server.
pub fn names_instance(message: &str, server: uuid::Uuid) -> bool {
    message
        .strip_prefix("Instance ")
        .and_then(|rest| rest.strip_suffix(" could not be found."))
        .and_then(|id| uuid::Uuid::parse_str(id).ok())
        == Some(server)
}

/// What Nova's refusal means, by its status and message (the body being
/// Nova's own fault: see [`nova_fault`]).
pub fn classify_refusal(status: u16, fault: &Fault) -> Rejection {
    let msg = fault.message.as_deref().unwrap_or("");
    match status {
        400 => {
            if let Some(pos) = msg.find("already attached to instances:") {
                let rest = &msg[pos + "already attached to instances:".len()..];
                let servers = rest
                    .split(|c: char| c.is_whitespace() || c == ',' || c == '.')
                    .filter(|s| s.len() == 36)
                    .map(str::to_string)
                    .collect();
                Rejection::AlreadyAttached { servers }
            } else if msg.contains("already attached") {
                Rejection::AlreadyAttached {
                    servers: Vec::new(),
                }
            } else if msg.contains("Unable to detach volume") || msg.contains("detaching") {
                Rejection::Detaching
            } else if let Some(pos) = msg.find("status must be available") {
                // Cinder's reserve: the volume is creating, downloading or
                // reserved — the create-then-attach race, transient.
                let status = msg[pos..]
                    .split("status is ")
                    .nth(1)
                    .map(|s| s.split(['.', ' ', ')']).next().unwrap_or("").to_string())
                    .unwrap_or_default();
                Rejection::VolumeNotReady { status }
            } else {
                Rejection::BadRequest
            }
        }
        401 => Rejection::Unauthorized,
        403 => Rejection::Forbidden,
        // Only the three 404s Nova's attachment calls give mean something;
        // any other ("The resource could not be found.", Nova's router's
        // answer to a path it has no route for) is not about the server.
        404 => {
            if msg.contains("is not attached to volume") {
                Rejection::NotAttached
            } else if msg.starts_with("Volume ") && msg.contains("could not be found") {
                Rejection::VolumeNotFound
            } else if msg.starts_with("Instance ") && msg.contains("could not be found") {
                Rejection::ServerNotFound
            } else {
                Rejection::Other
            }
        }
        409 if msg.contains("device path") && msg.contains("in use") => Rejection::DeviceInUse,
        409 => Rejection::Conflict,
        413 | 429 => Rejection::Throttled,
        500..=599 => Rejection::ServerError,
        _ => Rejection::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fault(body: &str) -> Fault {
        parse_fault(body.as_bytes())
    }

    #[test]
    fn classifies_the_contracts_real_messages() {
        let f = fault(
            r#"{"badRequest": {"code": 400, "message": "Invalid volume: volume a07f71dc-8151-4e7d-a0cc-cd24a3f11113 is already attached to instances: 7ebed2ce-85b3-40b5-84ae-8cc725c37ed2"}}"#,
        );
        assert_eq!(f.name.as_deref(), Some("badRequest"));
        assert_eq!(
            classify_refusal(400, &f),
            Rejection::AlreadyAttached {
                servers: vec!["7ebed2ce-85b3-40b5-84ae-8cc725c37ed2".into()]
            }
        );
        let f = fault(
            r#"{"conflictingRequest": {"message": "Cannot 'attach_volume' instance b2f72dcc while it is in task_state resize_finish", "code": 409}}"#,
        );
        assert_eq!(classify_refusal(409, &f), Rejection::Conflict);
        let f = fault(
            r#"{"itemNotFound": {"code": 404, "message": "Instance 7ebed2ce-85b3-40b5-84ae-8cc725c37ed2 could not be found."}}"#,
        );
        assert_eq!(classify_refusal(404, &f), Rejection::ServerNotFound);
        let f = fault(
            r#"{"itemNotFound": {"code": 404, "message": "Volume a07f71dc could not be found."}}"#,
        );
        assert_eq!(classify_refusal(404, &f), Rejection::VolumeNotFound);
        let f = fault(
            r#"{"itemNotFound": {"code": 404, "message": "Instance x is not attached to volume y"}}"#,
        );
        assert_eq!(classify_refusal(404, &f), Rejection::NotAttached);
        let f = fault(
            r#"{"forbidden": {"code": 403, "message": "The maximum allowed number of disk devices (26) to attach to a single instance has been exceeded."}}"#,
        );
        assert_eq!(classify_refusal(403, &f), Rejection::Forbidden);
        let f = fault(
            r#"{"badRequest": {"code": 400, "message": "Invalid volume: Invalid input received: Invalid volume: Unable to detach volume. Volume status must be 'in-use' and attach_status must be 'attached' to detach. (HTTP 400)"}}"#,
        );
        assert_eq!(classify_refusal(400, &f), Rejection::Detaching);
        let f = fault(
            r#"{"badRequest": {"message": "Invalid input received: Invalid volume: Volume status must be available to reserve, but the status is creating. (HTTP 400) (Request-ID: req-1)", "code": 400}}"#,
        );
        assert_eq!(
            classify_refusal(400, &f),
            Rejection::VolumeNotReady {
                status: "creating".into()
            }
        );
        let f = fault(
            r#"{"badRequest": {"message": "Invalid input received: Invalid volume: Volume a07f status must be available or downloading to reserve, but the current status is reserved. (HTTP 400) (Request-ID: req-2)", "code": 400}}"#,
        );
        assert_eq!(
            classify_refusal(400, &f),
            Rejection::VolumeNotReady {
                status: "reserved".into()
            }
        );
        let f = fault(
            r#"{"conflictingRequest": {"code": 409, "message": "The supplied device path (/dev/vdb) is in use."}}"#,
        );
        assert_eq!(classify_refusal(409, &f), Rejection::DeviceInUse);
        let f = fault(
            r#"{"error": {"code": 401, "title": "Unauthorized", "message": "The request you have made requires authentication."}}"#,
        );
        assert_eq!(f.name.as_deref(), Some("error"));
        assert_eq!(classify_refusal(401, &f), Rejection::Unauthorized);
        let f = fault("Gateway Timeout");
        assert_eq!(f.name, None);
        assert_eq!(f.message.as_deref(), Some("Gateway Timeout"));
        assert_eq!(classify_refusal(504, &f), Rejection::ServerError);
        let f = fault(r#"{"computeFault": {"code": 500, "message": "Unexpected API Error."}}"#);
        assert_eq!(classify_refusal(500, &f), Rejection::ServerError);
        // Nova's router's 404 for a path it does not serve is about no
        // server: not "server not found".
        let f = fault(
            r#"{"itemNotFound": {"code": 404, "message": "The resource could not be found."}}"#,
        );
        assert_eq!(classify_refusal(404, &f), Rejection::Other);
    }

    #[test]
    fn novas_fault_shape_is_its_name_for_the_status_with_the_status_as_code() {
        for (status, body) in [
            (
                400,
                r#"{"badRequest": {"code": 400, "message": "Invalid input"}}"#,
            ),
            (
                404,
                r#"{"itemNotFound": {"message": "Instance x could not be found.", "code": 404}}"#,
            ),
            (
                409,
                r#"{"conflictingRequest": {"code": 409, "message": "Instance x is locked"}}"#,
            ),
            (
                413,
                r#"{"overLimit": {"code": 413, "message": "Over limit", "retryAfter": "5"}}"#,
            ),
            (
                406,
                r#"{"computeFault": {"code": 406, "message": "Version 2.105 is not supported by the API."}}"#,
            ),
            (
                500,
                r#"{"computeFault": {"code": 500, "message": "Unexpected API Error."}}"#,
            ),
            (
                503,
                r#"{"serviceUnavailable": {"code": 503, "message": "Service Unavailable"}}"#,
            ),
        ] {
            assert!(
                nova_fault(status, body.as_bytes()).is_some(),
                "{status} {body}"
            );
        }
        for (status, body) in [
            (404, "<html><body>404 Not Found</body></html>"),
            (
                404,
                r#"{"itemNotFound": {"code": 404, "message": "x"}, "extra": 1}"#,
            ),
            (404, r#"{"computeFault": {"code": 404, "message": "x"}}"#),
            (404, r#"{"itemNotFound": {"code": "404", "message": "x"}}"#),
            (404, r#"{"itemNotFound": {"code": 404}}"#),
            (404, r#"{"itemNotFound": {"code": 404, "message": "x"#),
            (
                401,
                r#"{"error": {"code": 401, "title": "Unauthorized", "message": "m"}}"#,
            ),
            (502, "Bad Gateway"),
        ] {
            assert!(
                nova_fault(status, body.as_bytes()).is_none(),
                "{status} {body}"
            );
        }
        assert!(keystone_refusal(
            br#"{"error": {"code": 401, "title": "Unauthorized", "message": "The request you have made requires authentication."}}"#
        ));
        assert!(!keystone_refusal(
            b"<html>401 Authorization Required</html>"
        ));
        assert!(!keystone_refusal(br#"{"message": "Unauthorized"}"#));
        assert!(!keystone_refusal(
            br#"{"error": {"code": 403, "message": "m"}}"#
        ));
    }

    #[test]
    fn no_nul_leaves_an_answer_for_the_ledger() {
        // PostgreSQL's text and jsonb refuse U+0000: raw in a page, or
        // escaped in JSON, it becomes U+FFFD where the text is built.
        let f = fault("Bad\0Gateway");
        assert_eq!(f.message.as_deref(), Some("Bad\u{FFFD}Gateway"));
        let f = fault(
            r#"{"itemNotFound\u0000": {"code": 404, "message": "Instance \u0000 could not be found."}}"#,
        );
        assert_eq!(f.name.as_deref(), Some("itemNotFound\u{FFFD}"));
        assert_eq!(
            f.message.as_deref(),
            Some("Instance \u{FFFD} could not be found.")
        );
        let f = nova_fault(
            409,
            br#"{"conflictingRequest": {"code": 409, "message": "locked\u0000"}}"#,
        )
        .unwrap();
        assert_eq!(f.message.as_deref(), Some("locked\u{FFFD}"));
        assert_eq!(body_excerpt(b"a\0b\xff", 10), "a\u{FFFD}b\u{FFFD}");
        assert_eq!(clean_text("ok"), "ok");
    }
}

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

/// `s` parsed whole as a uuid, equal to `id`.
fn is_id(s: &str, id: uuid::Uuid) -> bool {
    uuid::Uuid::parse_str(s).ok() == Some(id)
}

/// Whether Nova's "Instance {id} could not be found." names `server`:
/// the uuid between the words, parsed whole. A 404 naming another
/// instance (an answer routed or relayed for another request, a proxy
/// replaying a cached fault) says nothing about this server.
pub fn names_instance(message: &str, server: uuid::Uuid) -> bool {
    message
        .strip_prefix("Instance ")
        .and_then(|rest| rest.strip_suffix(" could not be found."))
        .is_some_and(|id| is_id(id, server))
}

/// The id in Nova's "Volume {id} could not be found." (one word: not
/// "Volume attachment {id} could not be found.", another fault).
fn volume_not_found(message: &str) -> Option<&str> {
    message
        .strip_prefix("Volume ")
        .and_then(|rest| rest.strip_suffix(" could not be found."))
        .filter(|id| !id.contains(char::is_whitespace))
}

/// Whether Nova's "Volume {id} could not be found." names `volume`.
pub fn names_volume(message: &str, volume: uuid::Uuid) -> bool {
    volume_not_found(message).is_some_and(|id| is_id(id, volume))
}

/// The two ids in Nova's "Instance {server} is not attached to volume
/// {volume}" (the controller's text for a volume with no block device
/// mapping on the server, the server first; no full stop).
fn not_attached(message: &str) -> Option<(&str, &str)> {
    let (server, volume) = message
        .strip_prefix("Instance ")?
        .split_once(" is not attached to volume ")?;
    let one_word = |s: &str| !s.is_empty() && !s.contains(char::is_whitespace);
    (one_word(server) && one_word(volume)).then_some((server, volume))
}

/// Whether Nova's "Instance {server} is not attached to volume {volume}"
/// names both this server and this volume, each in its place.
pub fn names_attachment(message: &str, server: uuid::Uuid, volume: uuid::Uuid) -> bool {
    not_attached(message).is_some_and(|(s, v)| is_id(s, server) && is_id(v, volume))
}

/// Whether Nova's "volume {id} is already attached to instances: ..." (or,
/// for a multiattach volume, "volume {id} already attached") names
/// `volume`.
pub fn names_volume_attached(message: &str, volume: uuid::Uuid) -> bool {
    message
        .split_once("volume ")
        .and_then(|(_, rest)| {
            rest.split_once(" is already attached")
                .or_else(|| rest.split_once(" already attached"))
        })
        .is_some_and(|(id, _)| is_id(id, volume))
}

/// Nova's 400s that are final whatever the moment, by the words of its
/// messages (nova/exception.py, the volume-attachment controller, schema
/// validation): the request itself cannot be taken, now or later.
const FINAL_400: &[&str] = &[
    // Schema validation of the request's body.
    "Invalid input for field/attribute ",
    "API Version String ",
    "Multiattach volumes are only supported starting with compute API version ",
    "Attaching multiattach volumes is not supported for shelved-offloaded instances.",
    "Tagged volume attachment is not supported for ",
    "The supplied device path (",
    "Cannot detach a root device volume",
];

/// What a 400 of Nova's means, by its message; `Unread` when it is none
/// the service knows.
fn bad_request(msg: &str) -> Rejection {
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
    } else if FINAL_400.iter().any(|p| msg.starts_with(p))
        || msg.contains("are not in the same availability_zone")
    {
        Rejection::BadRequest
    } else {
        Rejection::Unread { status: 400 }
    }
}

/// What Nova's refusal means, by its status and message (the body being
/// Nova's own fault: see [`nova_fault`]). Only messages the service knows
/// in Nova's words decide by their meaning: a message translated into the
/// request's `Accept-Language`, or any other text, is `Unread` (400, 403)
/// or about nothing known (404: `Other`). Whether the ids a message names
/// are the request's is `answer.rs`'s question.
pub fn classify_refusal(status: u16, fault: &Fault) -> Rejection {
    let msg = fault.message.as_deref().unwrap_or("");
    match status {
        400 => bad_request(msg),
        401 => Rejection::Unauthorized,
        403 if msg.starts_with("The maximum allowed number of disk devices (")
            && msg.ends_with(") to attach to a single instance has been exceeded.") =>
        {
            Rejection::TooManyDisks
        }
        403 if msg.starts_with("Policy doesn't allow ") => Rejection::Forbidden,
        403 => Rejection::Unread { status },
        // Only the three 404s Nova's attachment calls give mean something;
        // any other ("The resource could not be found.", Nova's router's
        // answer to a path it has no route for) is not about the server.
        404 => {
            if not_attached(msg).is_some() {
                Rejection::NotAttached
            } else if volume_not_found(msg).is_some() {
                Rejection::VolumeNotFound
            } else if msg.starts_with("Instance ") && msg.contains("could not be found") {
                Rejection::ServerNotFound
            } else {
                Rejection::Other
            }
        }
        // Locked, in a task_state, or a text not read: each is a conflict
        // that may clear (retried); only the device path is final.
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
        assert_eq!(classify_refusal(403, &f), Rejection::TooManyDisks);
        let f = fault(
            r#"{"forbidden": {"code": 403, "message": "Policy doesn't allow os_compute_api:os-volumes-attachments:create to be performed."}}"#,
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
    fn final_400s_are_read_by_novas_words_and_any_other_text_is_not_read() {
        for msg in [
            "Invalid input for field/attribute volumeAttachment. Value: {'volumeId': 'x'}. Additional properties are not allowed ('tag' was unexpected)",
            "Multiattach volumes are only supported starting with compute API version 2.60.",
            "The supplied device path (/dev/sdz9) is invalid.",
            "Invalid volume: Instance 7ebed2ce-85b3-40b5-84ae-8cc725c37ed2 and volume a07f71dc-8151-4e7d-a0cc-cd24a3f11113 are not in the same availability_zone. Instance is in nova. Volume is in az1",
            "Cannot detach a root device volume",
            "Tagged volume attachment is not supported for this server instance.",
        ] {
            let f = Fault {
                name: Some("badRequest".into()),
                message: Some(msg.into()),
            };
            assert_eq!(classify_refusal(400, &f), Rejection::BadRequest, "{msg}");
        }
        // Cinder's "not ready", translated (German, and the simulator's
        // pseudo-translation), and a text nobody wrote here: not read.
        for (status, msg) in [
            (
                400,
                "Ungültige Eingabe empfangen: Ungültiger Datenträger: Der Status des Datenträgers muss verfügbar sein.",
            ),
            (
                400,
                "dilavnI tupni :deviecer dilavnI :emulov emuloV a07f71dc-8151-4e7d-a0cc-cd24a3f11113 sutats",
            ),
            (400, "Something else went wrong."),
            (
                403,
                "Die maximal zulässige Anzahl von Plattengeräten (26) wurde überschritten.",
            ),
        ] {
            let f = Fault {
                name: None,
                message: Some(msg.into()),
            };
            assert_eq!(
                classify_refusal(status, &f),
                Rejection::Unread { status },
                "{msg}"
            );
        }
    }

    #[test]
    fn a_messages_ids_are_read_whole_and_in_their_places() {
        let (s, v) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        let other = uuid::Uuid::new_v4();
        assert!(names_volume(&format!("Volume {v} could not be found."), v));
        for m in [
            format!("Volume {other} could not be found."),
            format!("Volume {v}0 could not be found."),
            format!("Volume attachment {v} could not be found."),
            format!("Volume {v} could not be found"),
        ] {
            assert!(!names_volume(&m, v), "{m}");
        }
        assert!(names_attachment(
            &format!("Instance {s} is not attached to volume {v}"),
            s,
            v
        ));
        for m in [
            format!("Instance {other} is not attached to volume {v}"),
            format!("Instance {s} is not attached to volume {other}"),
            format!("Instance {v} is not attached to volume {s}"),
            format!("Instance {s} is not attached to volume {v}."),
        ] {
            assert!(!names_attachment(&m, s, v), "{m}");
        }
        assert!(names_volume_attached(
            &format!("Invalid volume: volume {v} is already attached to instances: {s}"),
            v
        ));
        assert!(names_volume_attached(
            &format!("Invalid volume: volume {v} already attached"),
            v
        ));
        assert!(!names_volume_attached(
            &format!("Invalid volume: volume {other} is already attached to instances: {s}"),
            v
        ));
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

//! Nova's wire shapes, as in the contract and the shared samples.

use serde::{Deserialize, Serialize};

use crate::domain::AttachmentInfo;

/// One attachment as Nova lists or returns it. Up to 2.88 items carry `id`
/// (= the volume id); from 2.89 `attachment_id` and `bdm_uuid` instead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NovaAttachment {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "volumeId")]
    pub volume_id: String,
    #[serde(rename = "serverId")]
    pub server_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete_on_termination: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachment_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bdm_uuid: Option<String>,
}

impl NovaAttachment {
    /// The best identifier this microversion gives.
    pub fn best_id(&self) -> String {
        self.attachment_id
            .clone()
            .or_else(|| self.id.clone())
            .unwrap_or_else(|| self.volume_id.clone())
    }

    pub fn to_info(&self) -> AttachmentInfo {
        AttachmentInfo {
            id: self.best_id(),
            device: self.device.clone(),
            tag: self.tag.clone(),
            delete_on_termination: self.delete_on_termination.unwrap_or(false),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct AttachmentEnvelope {
    #[serde(rename = "volumeAttachment")]
    pub volume_attachment: NovaAttachment,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct AttachmentList {
    #[serde(rename = "volumeAttachments")]
    pub volume_attachments: Vec<NovaAttachment>,
}

/// The body of an attach request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AttachBody {
    #[serde(rename = "volumeAttachment")]
    pub volume_attachment: AttachSpec,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AttachSpec {
    #[serde(rename = "volumeId")]
    pub volume_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete_on_termination: Option<bool>,
}

/// A server as `GET /servers/{id}` answers it; only its id is read (the
/// look asks whether it exists, and the answer must be about it).
#[derive(Debug, Clone, Deserialize)]
pub struct ServerEnvelope {
    pub server: ServerBody,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ServerBody {
    pub id: String,
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn fault(body: &str) -> Fault {
        parse_fault(body.as_bytes())
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

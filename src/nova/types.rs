//! Nova's wire shapes, as in the contract and the shared samples.

use serde::{Deserialize, Serialize};

use super::error::Rejection;
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

/// A fault body, parsed: `{"<faultName>": {"code", "message"}}` from Nova,
/// `{"error": {...}}` from keystonemiddleware or Keystone, or not JSON at
/// all (a proxy's page).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub name: Option<String>,
    pub message: Option<String>,
}

pub fn parse_fault(body: &[u8]) -> Fault {
    if let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(body)
        && let Some((name, inner)) = map.iter().next()
    {
        let message = inner
            .get("message")
            .and_then(|m| m.as_str())
            .map(str::to_string);
        return Fault {
            name: Some(name.clone()),
            message,
        };
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    Fault {
        name: None,
        message: if text.is_empty() {
            None
        } else {
            Some(text.chars().take(300).collect())
        },
    }
}

/// Classifies a non-2xx answer by what it means.
pub fn classify(status: u16, fault: &Fault) -> Rejection {
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
        404 => {
            if msg.contains("is not attached to volume") {
                Rejection::NotAttached
            } else if msg.starts_with("Volume") {
                Rejection::VolumeNotFound
            } else {
                Rejection::ServerNotFound
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
            classify(400, &f),
            Rejection::AlreadyAttached {
                servers: vec!["7ebed2ce-85b3-40b5-84ae-8cc725c37ed2".into()]
            }
        );
        let f = fault(
            r#"{"conflictingRequest": {"message": "Cannot 'attach_volume' instance b2f72dcc while it is in task_state resize_finish", "code": 409}}"#,
        );
        assert_eq!(classify(409, &f), Rejection::Conflict);
        let f = fault(
            r#"{"itemNotFound": {"code": 404, "message": "Instance 7ebed2ce-85b3-40b5-84ae-8cc725c37ed2 could not be found."}}"#,
        );
        assert_eq!(classify(404, &f), Rejection::ServerNotFound);
        let f = fault(
            r#"{"itemNotFound": {"code": 404, "message": "Volume a07f71dc could not be found."}}"#,
        );
        assert_eq!(classify(404, &f), Rejection::VolumeNotFound);
        let f = fault(
            r#"{"itemNotFound": {"code": 404, "message": "Instance x is not attached to volume y"}}"#,
        );
        assert_eq!(classify(404, &f), Rejection::NotAttached);
        let f = fault(
            r#"{"forbidden": {"code": 403, "message": "The maximum allowed number of disk devices (26) to attach to a single instance has been exceeded."}}"#,
        );
        assert_eq!(classify(403, &f), Rejection::Forbidden);
        let f = fault(
            r#"{"badRequest": {"code": 400, "message": "Invalid volume: Invalid input received: Invalid volume: Unable to detach volume. Volume status must be 'in-use' and attach_status must be 'attached' to detach. (HTTP 400)"}}"#,
        );
        assert_eq!(classify(400, &f), Rejection::Detaching);
        let f = fault(
            r#"{"badRequest": {"message": "Invalid input received: Invalid volume: Volume status must be available to reserve, but the status is creating. (HTTP 400) (Request-ID: req-1)", "code": 400}}"#,
        );
        assert_eq!(
            classify(400, &f),
            Rejection::VolumeNotReady {
                status: "creating".into()
            }
        );
        let f = fault(
            r#"{"badRequest": {"message": "Invalid input received: Invalid volume: Volume a07f status must be available or downloading to reserve, but the current status is reserved. (HTTP 400) (Request-ID: req-2)", "code": 400}}"#,
        );
        assert_eq!(
            classify(400, &f),
            Rejection::VolumeNotReady {
                status: "reserved".into()
            }
        );
        let f = fault(
            r#"{"conflictingRequest": {"code": 409, "message": "The supplied device path (/dev/vdb) is in use."}}"#,
        );
        assert_eq!(classify(409, &f), Rejection::DeviceInUse);
        let f = fault(
            r#"{"error": {"code": 401, "title": "Unauthorized", "message": "The request you have made requires authentication."}}"#,
        );
        assert_eq!(f.name.as_deref(), Some("error"));
        assert_eq!(classify(401, &f), Rejection::Unauthorized);
        let f = fault("Gateway Timeout");
        assert_eq!(f.name, None);
        assert_eq!(f.message.as_deref(), Some("Gateway Timeout"));
        assert_eq!(classify(504, &f), Rejection::ServerError);
        let f = fault(r#"{"computeFault": {"code": 500, "message": "Unexpected API Error."}}"#);
        assert_eq!(classify(500, &f), Rejection::ServerError);
    }
}

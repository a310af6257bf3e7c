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

//! The Cinder client: `GET /v3/{project_id}/volumes/{id}`, to confirm an
//! attach or detach the way cinder-csi does (an attach is done when Cinder
//! lists the volume as attached to the server; a detach when it no longer
//! does). It shares Nova's machinery (`http.rs`): each request under the
//! caller's outbound deadline, no transport timeout but connection setup,
//! the same stages and clocks in its errors, Keystone's token and one
//! replay after a 401.
//!
//! What Cinder shows (cinder/api/v3/views/volumes.py): `status`, and in
//! `attachments` only the attachments whose attach_status is `attached` —
//! one being reserved or attaching is not listed; one being detached still
//! is (the volume is `detaching`) until Cinder deletes it.
//!
//! Its errors (`CinderError`) are the adapters' shared core with Cinder's
//! kinds (`error/cinder.rs`); what an answer means is here.

use std::fmt;

use reqwest::Method;
use serde::Deserialize;
use tokio::time::Instant;
use uuid::Uuid;

use super::error::fault::parse_fault;
use super::error::{CinderError, CinderErrorKind, Stage};
use super::http::Exchange;
use super::http::RequestId;
use super::http::{Failure, FailureKind, Service};

/// A volume's `status`, as Cinder reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeStatus {
    Creating,
    /// Being filled from an image; Nova may still reserve it.
    Downloading,
    Available,
    /// Nova created an attachment for a server; the attach has not started.
    Reserved,
    Attaching,
    InUse,
    Detaching,
    /// The attach failed in Cinder (connection setup or the driver).
    ErrorAttaching,
    ErrorDetaching,
    Error,
    Deleting,
    /// Any other status (`maintenance`, `backing-up`, `extending`, ...).
    Other(String),
}

impl VolumeStatus {
    pub fn parse(s: &str) -> Self {
        match s {
            "creating" => Self::Creating,
            "downloading" => Self::Downloading,
            "available" => Self::Available,
            "reserved" => Self::Reserved,
            "attaching" => Self::Attaching,
            "in-use" => Self::InUse,
            "detaching" => Self::Detaching,
            "error_attaching" => Self::ErrorAttaching,
            "error_detaching" => Self::ErrorDetaching,
            "error" => Self::Error,
            "deleting" => Self::Deleting,
            other => Self::Other(other.to_string()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            Self::Creating => "creating",
            Self::Downloading => "downloading",
            Self::Available => "available",
            Self::Reserved => "reserved",
            Self::Attaching => "attaching",
            Self::InUse => "in-use",
            Self::Detaching => "detaching",
            Self::ErrorAttaching => "error_attaching",
            Self::ErrorDetaching => "error_detaching",
            Self::Error => "error",
            Self::Deleting => "deleting",
            Self::Other(s) => s,
        }
    }

    /// An attach is under way (not listed in `attachments` yet).
    pub fn attaching(&self) -> bool {
        matches!(self, Self::Reserved | Self::Attaching)
    }

    /// Any `error*` status.
    pub fn is_error(&self) -> bool {
        matches!(
            self,
            Self::ErrorAttaching | Self::ErrorDetaching | Self::Error
        ) || matches!(self, Self::Other(s) if s.starts_with("error"))
    }
}

impl fmt::Display for VolumeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One attachment Cinder lists (attach_status `attached`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CinderAttachment {
    /// The server (Nova instance) it belongs to; `None` for a consumer that
    /// is not a server (e.g. Glance).
    pub server_id: Option<String>,
    /// Cinder's attachment id (Nova lists it as `attachment_id` from 2.89).
    pub attachment_id: String,
    pub device: Option<String>,
}

impl CinderAttachment {
    pub fn belongs_to(&self, server: Uuid) -> bool {
        self.server_id
            .as_deref()
            .and_then(|s| Uuid::parse_str(s).ok())
            == Some(server)
    }
}

/// Where an attach of the volume to one server stands, by Cinder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachProgress {
    /// Listed as attached to the server: the attach is done and usable
    /// (cinder-csi's WaitDiskAttached ends here).
    Attached,
    /// Not listed, and an attach is under way (`reserved`, `attaching`):
    /// wait.
    Attaching,
    /// Not listed and nothing under way: the attach has not been made (not
    /// started yet at 2.101+, or rolled back by Nova after the hypervisor
    /// failed, or refused by Cinder).
    NotAttached,
}

/// Where a detach of the volume from one server stands, by Cinder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DetachProgress {
    /// Not listed as attached to the server: the detach is done
    /// (cinder-csi's WaitDiskDetached waits for this).
    Detached,
    /// Still listed, and the volume is `detaching`: wait.
    Detaching,
    /// Still listed and nothing under way: not detached (not started yet,
    /// or the guest refused and Nova rolled the volume back to `in-use`).
    Attached,
}

/// What Cinder says about a volume: the small typed view the executor
/// decides on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeView {
    pub id: Uuid,
    pub status: VolumeStatus,
    pub multiattach: bool,
    /// Attachments whose attach_status is `attached`.
    pub attachments: Vec<CinderAttachment>,
    /// Cinder's own id of the request that read this.
    pub cinder_request_id: Option<String>,
}

impl VolumeView {
    /// The attachment to `server`, when Cinder lists one.
    pub fn attached_to(&self, server: Uuid) -> Option<&CinderAttachment> {
        self.attachments.iter().find(|a| a.belongs_to(server))
    }

    /// How an attach to `server` stands.
    pub fn attach_progress(&self, server: Uuid) -> AttachProgress {
        if self.attached_to(server).is_some() {
            AttachProgress::Attached
        } else if self.status.attaching() {
            AttachProgress::Attaching
        } else {
            AttachProgress::NotAttached
        }
    }

    /// How a detach from `server` stands.
    pub fn detach_progress(&self, server: Uuid) -> DetachProgress {
        if self.attached_to(server).is_none() {
            DetachProgress::Detached
        } else if self.status == VolumeStatus::Detaching {
            DetachProgress::Detaching
        } else {
            DetachProgress::Attached
        }
    }
}

#[derive(Deserialize)]
struct VolumeEnvelope {
    volume: VolumeBody,
}

/// The fields read from a volume; `status` and `attachments` are required
/// (a body without them must not read as "nothing attached").
#[derive(Deserialize)]
struct VolumeBody {
    id: String,
    status: String,
    /// Always present; `null` for volumes from before the field existed.
    #[serde(default)]
    multiattach: Option<bool>,
    attachments: Vec<AttachmentBody>,
}

#[derive(Deserialize)]
struct AttachmentBody {
    #[serde(default)]
    server_id: Option<String>,
    attachment_id: String,
    #[serde(default)]
    device: Option<String>,
}

impl From<Failure> for CinderError {
    fn from(f: Failure) -> Self {
        f.map_kind(|kind| match kind {
            FailureKind::DeadlineExceeded => CinderErrorKind::DeadlineExceeded,
            FailureKind::ConnectFailed => CinderErrorKind::ConnectFailed,
            FailureKind::ResponseLost => CinderErrorKind::ResponseLost,
            FailureKind::AuthFailed => CinderErrorKind::AuthFailed,
            FailureKind::NoEndpoint => CinderErrorKind::NoEndpoint,
            // Not read whole: nothing is known from it (the cause names
            // the cap); asking again may be answered.
            FailureKind::TooLarge => CinderErrorKind::Undecodable,
            // Cinder's reads have no gate.
            FailureKind::Withheld => CinderErrorKind::ConnectFailed,
        })
    }
}

/// The Cinder client (made by `NovaClient`, which it shares Keystone and
/// the connection pool with).
pub struct CinderClient {
    service: Service,
}

impl CinderClient {
    pub(crate) fn new(service: Service) -> Self {
        Self { service }
    }

    /// Cinder's v3 base URL now: the direct one, or the catalog's (`None`
    /// when the catalog has none). In catalog mode this needs a token.
    pub async fn endpoint(&self, deadline: Instant) -> Result<Option<String>, CinderError> {
        self.service
            .endpoint(deadline)
            .await
            .map_err(CinderError::from)
    }

    /// Cinder requests waiting for or holding a slot right now.
    pub fn slots_in_use(&self) -> usize {
        self.service.slots_in_use()
    }

    /// `GET /volumes/{id}` under a fresh request id.
    pub async fn volume(
        &self,
        volume_id: Uuid,
        deadline: Instant,
    ) -> Result<VolumeView, CinderError> {
        self.volume_as(&RequestId::fresh(), volume_id, deadline)
            .await
    }

    /// `GET /volumes/{id}` under `rid` (an operation's global request id).
    pub async fn volume_as(
        &self,
        rid: &RequestId,
        volume_id: Uuid,
        deadline: Instant,
    ) -> Result<VolumeView, CinderError> {
        let path = format!("/volumes/{volume_id}");
        let started = Instant::now();
        let (url, raw) = self
            .service
            .execute::<()>(
                rid.as_str(),
                Method::GET,
                &path,
                None,
                deadline,
                &super::gate::Open,
            )
            .await?;
        let answer = Exchange {
            method: "GET",
            url,
            raw: &raw,
            started,
            deadline,
        };
        if raw.status != 200 {
            return Err(refusal(&answer));
        }
        let mut view = decode(&raw.body, volume_id)
            .map_err(|cause| answer.error(CinderErrorKind::Undecodable, Stage::Decode, cause))?;
        view.cinder_request_id = raw.request_id.clone();
        Ok(view)
    }
}

/// Reads a volume show's body: it must be about `volume_id`, with a status
/// and the attachments list.
fn decode(body: &[u8], volume_id: Uuid) -> Result<VolumeView, String> {
    let body = serde_json::from_slice::<VolumeEnvelope>(body)
        .map_err(|e| format!("the body does not match the contract: {e}"))?
        .volume;
    if Uuid::parse_str(&body.id).ok() != Some(volume_id) {
        return Err(format!(
            "the answer is about volume {:?}, not {volume_id}",
            body.id
        ));
    }
    Ok(VolumeView {
        id: volume_id,
        status: VolumeStatus::parse(&body.status),
        multiattach: body.multiattach.unwrap_or(false),
        attachments: body
            .attachments
            .into_iter()
            .map(|a| CinderAttachment {
                server_id: a.server_id,
                attachment_id: a.attachment_id,
                device: a.device,
            })
            .collect(),
        cinder_request_id: None,
    })
}

/// What an answer that is not a 200 means. Cinder's faults have Nova's
/// shape (`{"itemNotFound": {"code", "message"}}`); a 404 is the volume's
/// only when it says so, since a wrong endpoint answers 404 too.
fn refusal(answer: &Exchange<'_>) -> CinderError {
    let status = answer.raw.status;
    let fault = parse_fault(&answer.raw.body);
    let message = fault.message.as_deref().unwrap_or("");
    let kind = match status {
        404 if message.starts_with("Volume ") && message.contains("could not be found") => {
            CinderErrorKind::VolumeNotFound
        }
        406 => CinderErrorKind::MicroversionUnsupported,
        _ => CinderErrorKind::Rejected,
    };
    let mut e = answer.error(kind, Stage::ReadBody, format!("HTTP {status}"));
    e.fault = fault.name;
    e.message = fault.message;
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nova::http::RawResponse;

    fn view(status: &str, attached: &[Uuid]) -> VolumeView {
        VolumeView {
            id: Uuid::new_v4(),
            status: VolumeStatus::parse(status),
            multiattach: attached.len() > 1,
            attachments: attached
                .iter()
                .map(|s| CinderAttachment {
                    server_id: Some(s.to_string()),
                    attachment_id: Uuid::new_v4().to_string(),
                    device: Some("/dev/vdb".into()),
                })
                .collect(),
            cinder_request_id: None,
        }
    }

    #[test]
    fn statuses_read_back_as_written() {
        for s in [
            "creating",
            "downloading",
            "available",
            "reserved",
            "attaching",
            "in-use",
            "detaching",
            "error_attaching",
            "error_detaching",
            "error",
            "deleting",
            "maintenance",
        ] {
            assert_eq!(VolumeStatus::parse(s).as_str(), s);
        }
        assert_eq!(
            VolumeStatus::parse("backing-up"),
            VolumeStatus::Other("backing-up".into())
        );
        assert!(VolumeStatus::parse("error_extending").is_error());
        assert!(!VolumeStatus::InUse.is_error());
    }

    #[test]
    fn progress_follows_what_cinder_lists_not_the_status_alone() {
        let (me, other) = (Uuid::new_v4(), Uuid::new_v4());
        use AttachProgress as A;
        use DetachProgress as D;
        // Attach: listed is done; reserved/attaching is under way.
        assert_eq!(view("in-use", &[me]).attach_progress(me), A::Attached);
        assert_eq!(view("reserved", &[]).attach_progress(me), A::Attaching);
        assert_eq!(view("attaching", &[]).attach_progress(me), A::Attaching);
        assert_eq!(view("available", &[]).attach_progress(me), A::NotAttached);
        assert_eq!(
            view("error_attaching", &[]).attach_progress(me),
            A::NotAttached
        );
        // In use, but by another server.
        assert_eq!(view("in-use", &[other]).attach_progress(me), A::NotAttached);
        // Multiattach: ours is listed while another attach runs.
        assert_eq!(
            view("attaching", &[other, me]).attach_progress(me),
            A::Attached
        );
        // Detach: gone from the list is done, whatever else holds it.
        assert_eq!(view("available", &[]).detach_progress(me), D::Detached);
        assert_eq!(view("in-use", &[other]).detach_progress(me), D::Detached);
        assert_eq!(view("detaching", &[me]).detach_progress(me), D::Detaching);
        // Rolled back to in-use: still attached.
        assert_eq!(view("in-use", &[me]).detach_progress(me), D::Attached);
    }

    #[test]
    fn the_upstream_samples_decode_and_a_body_without_attachments_does_not() {
        let sample = Uuid::parse_str("f7223234-1afc-4d19-bfa3-d19deb6235ef").unwrap();
        for raw in [
            include_str!("../../tests/fixtures/cinder/volumes/volume-show-response.json"),
            include_str!("../../tests/fixtures/cinder/volumes/v3.69/volume-show-response.json"),
        ] {
            let v = decode(raw.as_bytes(), sample).unwrap();
            assert_eq!(v.status, VolumeStatus::Creating);
            assert!(!v.multiattach && v.attachments.is_empty());
            assert!(
                decode(raw.as_bytes(), Uuid::new_v4())
                    .unwrap_err()
                    .contains("not")
            );
        }
        let id = Uuid::new_v4();
        let server = Uuid::new_v4();
        // As cinder/api/v3/views/volumes.py lists an attachment; a
        // consumer that is not a server has no server_id.
        let body = serde_json::json!({"volume": {"id": id, "status": "in-use", "multiattach": null,
            "attachments": [
                {"id": id, "attachment_id": "a1", "volume_id": id, "server_id": server,
                 "host_name": null, "device": "/dev/vdb", "attached_at": "2026-11-30T10:00:00.000000"},
                {"id": id, "attachment_id": "a2", "volume_id": id, "server_id": null,
                 "host_name": null, "device": null, "attached_at": null}]}});
        let v = decode(body.to_string().as_bytes(), id).unwrap();
        assert_eq!(v.attached_to(server).unwrap().attachment_id, "a1");
        assert!(!v.multiattach, "null reads as not multiattach");
        // Without `attachments` (or `status`) nothing may read as detached.
        for missing in ["attachments", "status"] {
            let mut body = body.clone();
            body["volume"].as_object_mut().unwrap().remove(missing);
            let e = decode(body.to_string().as_bytes(), id).unwrap_err();
            assert!(e.contains(missing), "{e}");
        }
    }

    #[test]
    fn only_a_volume_404_is_volume_not_found() {
        let raw = |status: u16, body: &str| RawResponse {
            status,
            body: bytes::Bytes::from(body.to_string()),
            request_id: Some("req-1".into()),
            content_type: None,
            api_version: None,
            location: None,
        };
        let kind = |r: &RawResponse| {
            refusal(&Exchange {
                method: "GET",
                url: "u".into(),
                raw: r,
                started: Instant::now(),
                deadline: Instant::now(),
            })
            .kind
        };
        assert_eq!(
            kind(&raw(
                404,
                r#"{"itemNotFound": {"code": 404, "message": "Volume 5aa119a8-d25b-45a7-8d1b-88e127885635 could not be found."}}"#
            )),
            CinderErrorKind::VolumeNotFound
        );
        // A wrong endpoint (no project id, a proxy) is not a missing volume.
        assert_eq!(
            kind(&raw(
                404,
                r#"{"itemNotFound": {"code": 404, "message": "The resource could not be found."}}"#
            )),
            CinderErrorKind::Rejected
        );
        assert_eq!(kind(&raw(404, "Not Found")), CinderErrorKind::Rejected);
        assert_eq!(
            kind(&raw(
                406,
                r#"{"computeFault": {"code": 406, "message": "Version 3.99 is not supported by the API. Minimum is 3.0 and maximum is 3.71."}}"#
            )),
            CinderErrorKind::MicroversionUnsupported
        );
    }
}

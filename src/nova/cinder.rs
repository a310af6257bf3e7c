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
//! Why it is long: a fifth of it is tests; the rest is the client, the volume
//! view and the error type with its clocks, which change together.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use reqwest::Method;
use serde::Deserialize;
use tokio::time::Instant;
use uuid::Uuid;

use super::error::Stage;
use super::http::RequestId;
use super::http::{Failure, FailureKind, RawResponse, Service};
use super::types::{clean_text, parse_fault};

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

/// Which clock fired, or what else ended a Cinder request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CinderErrorKind {
    /// The outbound deadline (derived from the caller's) expired.
    DeadlineExceeded,
    /// Could not connect (TCP or TLS): the request was never sent.
    ConnectFailed,
    /// Sent, but no complete answer came (reset, closed, truncated body).
    ResponseLost,
    /// 404 "Volume X could not be found.": deleted, or not in this project.
    VolumeNotFound,
    /// 406: the cloud does not serve `--cinder-microversion`.
    MicroversionUnsupported,
    /// Any other error status (401 after re-authenticating, 403, 400, a 404
    /// that is not about the volume, 413/429, 5xx, a proxy's page).
    Rejected,
    /// A 2xx whose body does not fit the contract (or is about another
    /// volume).
    Undecodable,
    /// Keystone did not give us a token.
    AuthFailed,
    /// The Keystone catalog has no block-storage (or volumev3) endpoint.
    NoEndpoint,
}

impl CinderErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::ConnectFailed => "connect_failed",
            Self::ResponseLost => "response_lost",
            Self::VolumeNotFound => "volume_not_found",
            Self::MicroversionUnsupported => "microversion_unsupported",
            Self::Rejected => "rejected",
            Self::Undecodable => "undecodable",
            Self::AuthFailed => "auth_failed",
            Self::NoEndpoint => "no_endpoint",
        }
    }
}

/// A Cinder request that gave no volume, with all the context to explain
/// it (the same as a Nova error's).
#[derive(Debug, Clone)]
pub struct CinderError {
    pub kind: CinderErrorKind,
    pub stage: Stage,
    pub method: &'static str,
    pub url: String,
    pub status: Option<u16>,
    /// Cinder's own id of the request, when an answer (even an error) came.
    pub cinder_request_id: Option<String>,
    pub cinder_fault: Option<String>,
    pub cinder_message: Option<String>,
    pub elapsed: Duration,
    /// The time the request was given (its deadline minus its start).
    pub budget: Duration,
    pub cause: String,
}

impl CinderError {
    /// Whether asking again (with time left) may give an answer: transport
    /// failures, Keystone, throttling, 5xx. Not: the volume is gone, the
    /// configuration is wrong, or access is refused.
    pub fn transient(&self) -> bool {
        match self.kind {
            CinderErrorKind::DeadlineExceeded
            | CinderErrorKind::ConnectFailed
            | CinderErrorKind::ResponseLost
            | CinderErrorKind::Undecodable
            | CinderErrorKind::AuthFailed => true,
            CinderErrorKind::Rejected => {
                matches!(self.status, Some(409 | 413 | 429 | 500..=599))
            }
            CinderErrorKind::VolumeNotFound
            | CinderErrorKind::MicroversionUnsupported
            | CinderErrorKind::NoEndpoint => false,
        }
    }

    /// Every piece of context, as `ErrorInfo`/event metadata (free of NUL,
    /// which a ledger row cannot hold: see `types::clean_text`).
    pub fn metadata(&self) -> BTreeMap<String, String> {
        let mut m = self.raw_metadata();
        for v in m.values_mut() {
            if v.contains('\0') {
                *v = clean_text(v);
            }
        }
        m
    }

    fn raw_metadata(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        m.insert("service".into(), "cinder".into());
        m.insert("method".into(), self.method.to_string());
        m.insert("url".into(), self.url.clone());
        m.insert("stage".into(), self.stage.as_str().into());
        m.insert("error_class".into(), self.kind.as_str().into());
        if let Some(s) = self.status {
            m.insert("http_status".into(), s.to_string());
        }
        if let Some(id) = &self.cinder_request_id {
            m.insert("cinder_request_id".into(), id.clone());
        }
        if let Some(f) = &self.cinder_fault {
            m.insert("cinder_fault".into(), f.clone());
        }
        if let Some(msg) = &self.cinder_message {
            m.insert("cinder_message".into(), msg.clone());
        }
        m.insert("elapsed_ms".into(), self.elapsed.as_millis().to_string());
        m.insert(
            "outbound_budget_ms".into(),
            self.budget.as_millis().to_string(),
        );
        m.insert("cause".into(), self.cause.clone());
        m
    }

    /// Which clock fired, in words, for people.
    pub fn clock(&self) -> &'static str {
        match (self.kind, self.stage) {
            (CinderErrorKind::DeadlineExceeded, Stage::AcquireSlot) => {
                "the caller's deadline expired waiting for a connection slot to Cinder"
            }
            (CinderErrorKind::DeadlineExceeded, Stage::ReadBody) => {
                "the caller's deadline expired while reading Cinder's response body"
            }
            (CinderErrorKind::DeadlineExceeded, Stage::Authenticate) => {
                "the caller's deadline expired waiting for a Keystone token"
            }
            (CinderErrorKind::DeadlineExceeded, _) => {
                "the caller's deadline expired waiting for Cinder's response headers"
            }
            (CinderErrorKind::ConnectFailed, _) => {
                "could not connect to Cinder (the request was never sent)"
            }
            (CinderErrorKind::ResponseLost, Stage::ReadBody) => {
                "Cinder's response body was cut off"
            }
            (CinderErrorKind::ResponseLost, _) => "the request was sent but Cinder did not answer",
            (CinderErrorKind::VolumeNotFound, _) => "Cinder does not know the volume",
            (CinderErrorKind::MicroversionUnsupported, _) => {
                "Cinder does not serve the requested microversion"
            }
            (CinderErrorKind::Rejected, _) => "Cinder answered with an error",
            (CinderErrorKind::Undecodable, _) => "Cinder's answer did not fit the contract",
            (CinderErrorKind::AuthFailed, _) => "Keystone refused or failed to issue a token",
            (CinderErrorKind::NoEndpoint, _) => {
                "the Keystone catalog has no block-storage endpoint"
            }
        }
    }
}

impl fmt::Display for CinderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}: {} (stage {}, after {} ms of a {} ms budget",
            self.method,
            self.url,
            self.clock(),
            self.stage.as_str(),
            self.elapsed.as_millis(),
            self.budget.as_millis()
        )?;
        if let Some(s) = self.status {
            write!(f, ", HTTP {s}")?;
        }
        if let Some(fault) = &self.cinder_fault {
            write!(f, ", {fault}")?;
        }
        if let Some(m) = &self.cinder_message {
            write!(f, ": {m:?}")?;
        }
        if let Some(id) = &self.cinder_request_id {
            write!(f, ", request {id}")?;
        }
        write!(f, "): {}", self.cause)
    }
}

impl std::error::Error for CinderError {}

impl From<Failure> for CinderError {
    fn from(f: Failure) -> Self {
        CinderError {
            kind: match f.kind {
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
            },
            stage: f.stage,
            method: f.method,
            url: f.url,
            status: f.status,
            cinder_request_id: f.request_id,
            cinder_fault: None,
            cinder_message: None,
            elapsed: f.elapsed,
            budget: f.budget,
            cause: f.cause,
        }
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
                &super::http::Open,
            )
            .await?;
        let answer = Answer {
            url,
            raw: &raw,
            started,
            deadline,
        };
        if raw.status != 200 {
            return Err(answer.rejection());
        }
        let mut view = decode(&raw.body, volume_id).map_err(|cause| answer.undecodable(cause))?;
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

/// An answer that came whole, for the errors made of it.
struct Answer<'a> {
    url: String,
    raw: &'a RawResponse,
    started: Instant,
    deadline: Instant,
}

impl Answer<'_> {
    fn error(&self, kind: CinderErrorKind, stage: Stage, cause: String) -> CinderError {
        CinderError {
            kind,
            stage,
            method: "GET",
            url: self.url.clone(),
            status: Some(self.raw.status),
            cinder_request_id: self.raw.request_id.clone(),
            cinder_fault: None,
            cinder_message: None,
            elapsed: self.started.elapsed(),
            budget: self.deadline.saturating_duration_since(self.started),
            // A decode error may quote the body.
            cause: clean_text(&cause),
        }
    }

    fn undecodable(&self, cause: String) -> CinderError {
        self.error(CinderErrorKind::Undecodable, Stage::Decode, cause)
    }

    /// Cinder's faults have Nova's shape (`{"itemNotFound": {"code",
    /// "message"}}`); a 404 is the volume's only when it says so, since a
    /// wrong endpoint answers 404 too.
    fn rejection(&self) -> CinderError {
        let status = self.raw.status;
        let fault = parse_fault(&self.raw.body);
        let message = fault.message.as_deref().unwrap_or("");
        let kind = match status {
            404 if message.starts_with("Volume ") && message.contains("could not be found") => {
                CinderErrorKind::VolumeNotFound
            }
            406 => CinderErrorKind::MicroversionUnsupported,
            _ => CinderErrorKind::Rejected,
        };
        let mut e = self.error(kind, Stage::ReadBody, format!("HTTP {status}"));
        e.cinder_fault = fault.name;
        e.cinder_message = fault.message;
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        };
        let kind = |r: &RawResponse| {
            Answer {
                url: "u".into(),
                raw: r,
                started: Instant::now(),
                deadline: Instant::now(),
            }
            .rejection()
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

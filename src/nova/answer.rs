//! What one of Nova's answers means, and first whether it is Nova's at all.
//!
//! Anything can stand between the service and nova-api: a load balancer,
//! an ingress that lost its route, a captive proxy, a gateway with its own
//! login wall. Their pages carry statuses that would decide an operation if
//! they were Nova's (a 404 on a detach reads "the server is gone"; a 200
//! on an attach reads "attached"). So a status decides only with Nova's own
//! body for it:
//!
//! - a refusal only with Nova's fault shape, `{"itemNotFound": {"code":
//!   404, "message": ...}}` (the name Nova gives that status, the status as
//!   `code`; `error::fault::nova_fault`), or keystonemiddleware's `{"error":
//!   {...}}` for a 401;
//! - a success only with the body Nova gives for that call at the
//!   microversion spoken: an attach 200 with the attachment (about this
//!   volume and server) up to 2.100, 202 with an empty body from 2.101; a
//!   detach 202 with an empty body;
//! - anything else is `Foreign` (an error status) or `Undecodable` (a
//!   success): of unknown effect, like a lost response, so the executor
//!   looks before it decides.
//!
//! Why it is one file: past its tests (two fifths of it), it is one table —
//! status × body shape × call → decision — read in one place, so that no
//! call's reading drifts from the others'.

// `NovaError` is the client's error, returned as it is by every one of its
// async calls (which this lint does not see); these are the same results
// one step earlier, made once per answer. Boxing it here alone would only
// add an allocation and a conversion.
#![allow(clippy::result_large_err)]

#[cfg(test)]
use tokio::time::Instant;
use uuid::Uuid;

use super::error::fault::{
    body_excerpt, classify_refusal, keystone_refusal, names_attachment, names_instance,
    names_volume, names_volume_attached, nova_fault, parse_fault,
};
use super::error::{NovaError, NovaErrorKind, Rejection, Stage};
pub(crate) use super::http::Exchange;
#[cfg(test)]
use super::http::RawResponse;
use super::types::{AttachmentEnvelope, AttachmentList, NovaAttachment, ServerEnvelope};

/// What an attach answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttachAnswer {
    /// 200 (microversion <= 2.100): Nova created its record.
    Attached(NovaAttachment),
    /// 202 (microversion >= 2.101): accepted; only the list can tell.
    Accepted,
}

/// How much of a body an error quotes.
const EXCERPT_CHARS: usize = 200;

/// How Nova answers an attach that it took, at the microversion spoken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AttachShape {
    /// 2.1–2.100: 200 with the attachment.
    Attached,
    /// 2.101 and later: 202 with an empty body.
    Accepted,
    /// Not known (`latest` before it was resolved, and an answer that does
    /// not say its microversion): either of Nova's.
    Either,
}

impl AttachShape {
    pub fn at(microversion: (u32, u32)) -> Self {
        if microversion >= (2, 101) {
            AttachShape::Accepted
        } else {
            AttachShape::Attached
        }
    }

    /// From the microversion Nova says it answered with
    /// (`OpenStack-API-Version: compute 2.N`).
    pub fn from_header(header: Option<&str>) -> Self {
        let version = header
            .and_then(|h| h.trim().strip_prefix("compute "))
            .and_then(|v| v.trim().split_once('.'))
            .and_then(|(major, minor)| Some((major.parse().ok()?, minor.parse().ok()?)));
        match version {
            Some(v) => AttachShape::at(v),
            None => AttachShape::Either,
        }
    }
}

fn blank(body: &[u8]) -> bool {
    body.iter().all(u8::is_ascii_whitespace)
}

fn same_id(text: &str, id: Uuid) -> bool {
    Uuid::parse_str(text).ok() == Some(id)
}

/// What a fault naming a volume that is not `volume` names, for a cause.
fn another_volume(volume: Option<Uuid>) -> String {
    match volume {
        Some(v) => format!("another volume, not {v}"),
        None => "a volume, and this call is about none".into(),
    }
}

/// Nova's reading of an answer (the core's `Exchange`: see `error/mod.rs`).
impl Exchange<'_> {
    /// `text/html, 162 bytes: "<html>..."`: what came back, for people.
    fn body_said(&self) -> String {
        format!(
            "{}, {} bytes: {:?}",
            self.raw
                .content_type
                .as_deref()
                .unwrap_or("no content type"),
            self.raw.body.len(),
            body_excerpt(&self.raw.body, EXCERPT_CHARS)
        )
    }

    /// A success status whose body is not what Nova answers there.
    pub fn undecodable(&self, cause: impl Into<String>) -> NovaError {
        self.error(NovaErrorKind::Undecodable, Stage::Decode, cause.into())
    }

    fn not_novas_success(&self, what: &str) -> NovaError {
        self.undecodable(format!(
            "HTTP {}, but {what}: not Nova's answer ({})",
            self.raw.status,
            self.body_said()
        ))
    }

    /// What an answer that is not a success means: Nova's refusal, by its
    /// meaning, when the body is Nova's fault for the status; the auth
    /// middleware's refusal for its 401; else `Foreign`, of unknown effect.
    pub fn refusal(&self) -> NovaError {
        let status = self.raw.status;
        if let Some(fault) = nova_fault(status, &self.raw.body) {
            let rejection = classify_refusal(status, &fault);
            let mut e = self.error(
                NovaErrorKind::Rejected(rejection.clone()),
                Stage::ReadBody,
                format!("HTTP {status}"),
            );
            e.may_have_reached = !matches!(rejection, Rejection::Unauthorized);
            e.fault = fault.name;
            e.message = fault.message;
            return e;
        }
        if status == 401 && keystone_refusal(&self.raw.body) {
            let fault = parse_fault(&self.raw.body);
            let mut e = self.error(
                NovaErrorKind::Rejected(Rejection::Unauthorized),
                Stage::ReadBody,
                "HTTP 401 from the auth middleware (keystonemiddleware): the request never reached Nova".into(),
            );
            e.may_have_reached = false;
            e.fault = fault.name;
            e.message = fault.message;
            return e;
        }
        if (300..400).contains(&status) {
            return self.error(
                NovaErrorKind::Foreign,
                Stage::Decode,
                format!(
                    "HTTP {status}, a redirect to {}, not followed: Nova's API does not redirect, so something in front of it answered (a proxy, or a URL to correct, such as http for https); whether the request reached Nova is unknown",
                    self.raw.location.as_deref().unwrap_or("nowhere (no Location)")
                ),
            );
        }
        self.error(
            NovaErrorKind::Foreign,
            Stage::Decode,
            format!(
                "HTTP {status} whose body is not Nova's fault ({}); what it means, and whether the request reached Nova, is unknown",
                self.body_said()
            ),
        )
    }

    /// [`Self::refusal`] of a request about `server` (and `volume`, for a
    /// call on one attachment): a refusal that names what it is about
    /// decides only when it names this request's server and volume, each
    /// uuid parsed whole and in its place. One naming another — an answer
    /// routed or relayed for another request, a proxy replaying a cached
    /// fault — is no word about this one: a 404 ("Instance … could not be
    /// found.", "Volume … could not be found.", "Instance … is not attached
    /// to volume …") is then of unknown effect, like a 404 about nothing
    /// Nova's attachment calls know (`Rejection::Other`); a 400 "volume …
    /// is already attached" is a refusal whose reason is not known
    /// (`Rejection::Unread`).
    pub fn refusal_about(&self, server: Uuid, volume: Option<Uuid>) -> NovaError {
        let mut e = self.refusal();
        let message = e.message.as_deref().unwrap_or("");
        let about_volume = |names: &dyn Fn(Uuid) -> bool| volume.is_some_and(names);
        let (ours, what) = match e.rejection() {
            Some(Rejection::ServerNotFound) => (
                names_instance(message, server),
                format!("another instance, not server {server}"),
            ),
            Some(Rejection::VolumeNotFound) => (
                about_volume(&|v| names_volume(message, v)),
                another_volume(volume),
            ),
            Some(Rejection::NotAttached) => (
                about_volume(&|v| names_attachment(message, server, v)),
                match volume {
                    Some(v) => format!("other ids than server {server} and volume {v}"),
                    None => "an attachment, and this call is about none".into(),
                },
            ),
            Some(Rejection::AlreadyAttached { .. }) => (
                about_volume(&|v| names_volume_attached(message, v)),
                another_volume(volume),
            ),
            _ => return e,
        };
        if ours {
            return e;
        }
        let status = e.status.unwrap_or(0);
        if status == 404 {
            e.kind = NovaErrorKind::Rejected(Rejection::Other);
            e.cause = format!(
                "HTTP 404: Nova's fault names {what}: it says nothing about this request, so its effect is unknown"
            );
        } else {
            e.kind = NovaErrorKind::Rejected(Rejection::Unread { status });
            e.cause = format!(
                "HTTP {status}: Nova's fault names {what}: a refusal of this request whose reason is not known"
            );
        }
        e
    }

    /// An attach's answer, `shape` being how Nova answers one it took.
    pub fn attach(
        &self,
        shape: AttachShape,
        server: Uuid,
        volume: Uuid,
    ) -> Result<AttachAnswer, NovaError> {
        match (self.raw.status, shape) {
            (200, AttachShape::Attached | AttachShape::Either) => {
                self.attachment(server, volume).map(AttachAnswer::Attached)
            }
            (202, AttachShape::Accepted | AttachShape::Either) if blank(&self.raw.body) => {
                Ok(AttachAnswer::Accepted)
            }
            (202, AttachShape::Accepted | AttachShape::Either) => {
                Err(self.not_novas_success("Nova's 202 to an attach has an empty body"))
            }
            (200, AttachShape::Accepted) => Err(self.not_novas_success(
                "from microversion 2.101 Nova answers an attach 202 with an empty body",
            )),
            (202, AttachShape::Attached) => Err(self.not_novas_success(
                "below microversion 2.101 Nova answers an attach 200 with the attachment",
            )),
            (200..=299, _) => Err(self
                .not_novas_success("Nova answers an attach 200 (below 2.101) or 202 (from 2.101)")),
            _ => Err(self.attach_refusal(server, volume)),
        }
    }

    /// An attach's refusal: as [`Self::refusal_about`], and "not attached",
    /// which Nova does not answer an attach, is no word about it either.
    fn attach_refusal(&self, server: Uuid, volume: Uuid) -> NovaError {
        let mut e = self.refusal_about(server, Some(volume));
        if e.rejection() == Some(&Rejection::NotAttached) {
            e.kind = NovaErrorKind::Rejected(Rejection::Other);
            e.cause = "HTTP 404 \"not attached\": Nova does not answer an attach so; its effect is unknown".into();
        }
        e
    }

    /// A detach's answer (of `volume` from `server`): Nova's is 202 with
    /// an empty body.
    pub fn detach(&self, server: Uuid, volume: Uuid) -> Result<(), NovaError> {
        match self.raw.status {
            202 if blank(&self.raw.body) => Ok(()),
            202 => Err(self.not_novas_success("Nova's 202 to a detach has an empty body")),
            200..=299 => Err(self.not_novas_success("Nova answers a detach 202")),
            _ => Err(self.refusal_about(server, Some(volume))),
        }
    }

    /// `{"volumeAttachment": ...}` about this volume on this server.
    fn attachment(&self, server: Uuid, volume: Uuid) -> Result<NovaAttachment, NovaError> {
        let att = serde_json::from_slice::<AttachmentEnvelope>(&self.raw.body)
            .map_err(|e| {
                self.undecodable(format!(
                    "the body does not match the contract: {e} ({})",
                    self.body_said()
                ))
            })?
            .volume_attachment;
        if !same_id(&att.volume_id, volume) || !same_id(&att.server_id, server) {
            return Err(self.undecodable(format!(
                "the answer is about volume {:?} on server {:?}, not {volume} on {server}",
                att.volume_id, att.server_id
            )));
        }
        Ok(att)
    }

    /// A list of the server's attachments: every item must be the server's.
    pub fn list(&self, server: Uuid) -> Result<Vec<NovaAttachment>, NovaError> {
        if self.raw.status != 200 {
            return Err(self.refusal_about(server, None));
        }
        let items = serde_json::from_slice::<AttachmentList>(&self.raw.body)
            .map_err(|e| {
                self.undecodable(format!(
                    "the body does not match the contract: {e} ({})",
                    self.body_said()
                ))
            })?
            .volume_attachments;
        if let Some(other) = items.iter().find(|a| !same_id(&a.server_id, server)) {
            return Err(self.undecodable(format!(
                "the list names server {:?}, not {server}",
                other.server_id
            )));
        }
        Ok(items)
    }

    /// One attachment, shown.
    pub fn show(&self, server: Uuid, volume: Uuid) -> Result<NovaAttachment, NovaError> {
        match self.raw.status {
            200 => self.attachment(server, volume),
            _ => Err(self.refusal_about(server, Some(volume))),
        }
    }

    /// `GET /servers/{id}`: `true` when Nova shows the server, `false` only
    /// for Nova's own 404 for it ("Instance {id} could not be found.");
    /// anything else is an error (the look failed).
    pub fn server(&self, server: Uuid) -> Result<bool, NovaError> {
        match self.raw.status {
            200 => {
                let body =
                    serde_json::from_slice::<ServerEnvelope>(&self.raw.body).map_err(|e| {
                        self.undecodable(format!(
                            "the body does not match the contract: {e} ({})",
                            self.body_said()
                        ))
                    })?;
                if same_id(&body.server.id, server) {
                    Ok(true)
                } else {
                    Err(self.undecodable(format!(
                        "the answer is about server {:?}, not {server}",
                        body.server.id
                    )))
                }
            }
            _ => {
                let e = self.refusal_about(server, None);
                if e.rejection() == Some(&Rejection::ServerNotFound) {
                    Ok(false)
                } else {
                    Err(e)
                }
            }
        }
    }
}

/// A list answered Nova's 404 naming its server (`listed`), and `look` is
/// what `GET /servers/{id}` then said: the list's 404 stands ("the server
/// is gone") only when the look agrees, Nova's own 404 naming the server
/// again. The server shown, or a look that failed, leaves a list that
/// told nothing: a failed look (`Rejection::Other`), decided later.
pub(crate) fn gone_if_shown_gone(
    mut listed: NovaError,
    look: Result<bool, NovaError>,
) -> NovaError {
    let why = match look {
        Ok(false) => {
            listed
                .cause
                .push_str("; GET /servers/{id} agrees: the server is gone");
            return listed;
        }
        Ok(true) => {
            "GET /servers/{id} shows the server: the 404 was not the server's word".to_string()
        }
        Err(e) => format!(
            "the look at the server (GET /servers/{{id}}) failed ({e}): the 404 alone decides nothing"
        ),
    };
    listed.kind = NovaErrorKind::Rejected(Rejection::Other);
    listed.cause = format!("{}; {why}", listed.cause);
    listed
}

/// Which call a judged answer answers (for tests elsewhere in the crate).
#[cfg(test)]
#[derive(Debug, Clone, Copy)]
pub(crate) enum Judged {
    Attach(AttachShape),
    Detach,
}

/// An answer of Nova's as the tests write it: status, content type, body.
#[cfg(test)]
fn sample_raw(status: u16, content_type: &str, body: &str) -> RawResponse {
    RawResponse {
        status,
        body: bytes::Bytes::from(body.to_string()),
        request_id: Some("req-sample".into()),
        content_type: Some(content_type.into()),
        api_version: None,
        location: None,
    }
}

/// The error the client makes of one answer to `call` (which must not be
/// one the call takes): the classification table's test feeds
/// docs/design.md's rows answers as they come over the wire.
#[cfg(test)]
pub(crate) fn judged(
    call: Judged,
    status: u16,
    content_type: &str,
    body: &str,
    server: Uuid,
    volume: Uuid,
) -> NovaError {
    let raw = sample_raw(status, content_type, body);
    let (method, path) = match call {
        Judged::Attach(_) => ("POST", format!("/servers/{server}/os-volume_attachments")),
        Judged::Detach => (
            "DELETE",
            format!("/servers/{server}/os-volume_attachments/{volume}"),
        ),
    };
    let ex = Exchange {
        method,
        url: format!("http://nova:8774/v2.1{path}"),
        raw: &raw,
        started: Instant::now(),
        deadline: Instant::now(),
    };
    let result = match call {
        Judged::Attach(shape) => ex.attach(shape, server, volume).map(drop),
        Judged::Detach => ex.detach(server, volume),
    };
    match result {
        Err(e) => e,
        Ok(()) => panic!("{status} {body:?} is an answer the call takes"),
    }
}

/// `read` of one answer (status, content type, body) to a GET about
/// `server`: the looks table's test reads a list and a look at the server
/// as they come over the wire.
#[cfg(test)]
pub(crate) fn read_answer<T>(
    status: u16,
    content_type: &str,
    body: &str,
    read: impl FnOnce(&Exchange<'_>) -> T,
) -> T {
    let raw = sample_raw(status, content_type, body);
    read(&Exchange {
        method: "GET",
        url: "http://nova:8774/v2.1/servers/sample".into(),
        raw: &raw,
        started: Instant::now(),
        deadline: Instant::now(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(status: u16, content_type: &str, body: &str) -> RawResponse {
        RawResponse {
            status,
            body: bytes::Bytes::from(body.to_string()),
            request_id: Some("req-1".into()),
            content_type: Some(content_type.into()),
            api_version: None,
            location: None,
        }
    }

    fn exchange(raw: &RawResponse) -> Exchange<'_> {
        Exchange {
            method: "DELETE",
            url: "http://nova/v2.1/servers/s/os-volume_attachments/v".into(),
            raw,
            started: Instant::now(),
            deadline: Instant::now(),
        }
    }

    const JSON: &str = "application/json; charset=UTF-8";
    const NGINX_404: &str = "<html>\r\n<head><title>404 Not Found</title></head>\r\n<body>\r\n<center><h1>404 Not Found</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n";

    #[test]
    fn only_novas_fault_shape_is_novas_refusal() {
        let s = Uuid::new_v4();
        let nova_404 = format!(
            r#"{{"itemNotFound": {{"code": 404, "message": "Instance {s} could not be found."}}}}"#
        );
        let e = exchange(&raw(404, JSON, &nova_404)).refusal();
        assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::ServerNotFound));
        assert_eq!(e.fault.as_deref(), Some("itemNotFound"));
        // A proxy's page, JSON of another shape, a fault whose name or code
        // is not the status's, a cut body: none is Nova's word.
        for (status, body) in [
            (404, NGINX_404.to_string()),
            (
                404,
                r#"{"message": "no Route matched with those values"}"#.to_string(),
            ),
            (404, nova_404.replace("itemNotFound", "computeFault")),
            (404, nova_404.replace("404,", "400,")),
            (404, nova_404[..nova_404.len() - 3].to_string()),
            (404, String::new()),
            (409, r#"{"conflictingRequest": {"code": 409}}"#.to_string()),
            (
                502,
                "<html><body><h1>502 Bad Gateway</h1></body></html>".to_string(),
            ),
            (401, "<html>401 Authorization Required</html>".to_string()),
            (
                403,
                r#"{"error": {"code": 403, "message": "Forbidden by WAF"}}"#.to_string(),
            ),
        ] {
            let e = exchange(&raw(status, "text/html", &body)).refusal();
            assert_eq!(e.kind, NovaErrorKind::Foreign, "{status} {body:?}: {e}");
            assert!(e.outcome_unknown() && e.may_have_reached, "{e}");
            assert_eq!(e.stage, Stage::Decode);
            assert!(e.cause.contains(&format!("HTTP {status}")), "{}", e.cause);
        }
        // Nova's router's 404 for a path it does not serve: Nova's, but
        // not about the server.
        let e = exchange(&raw(
            404,
            JSON,
            r#"{"itemNotFound": {"code": 404, "message": "The resource could not be found."}}"#,
        ))
        .refusal();
        assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::Other));
        assert!(e.outcome_unknown());
        // keystonemiddleware's 401: never reached Nova.
        let e = exchange(&raw(
            401,
            JSON,
            r#"{"error": {"code": 401, "title": "Unauthorized", "message": "The request you have made requires authentication."}}"#,
        ))
        .refusal();
        assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::Unauthorized));
        assert!(!e.may_have_reached && !e.outcome_unknown());
        // overLimit carries retryAfter beside code and message.
        let e = exchange(&raw(
            429,
            JSON,
            r#"{"overLimit": {"code": 429, "message": "This request was rate-limited.", "retryAfter": "0"}}"#,
        ))
        .refusal();
        assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::Throttled));
    }

    #[test]
    fn a_success_decides_only_in_the_shape_nova_gives_at_the_microversion() {
        let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
        let envelope = format!(
            r#"{{"volumeAttachment": {{"device": "/dev/vdb", "id": "{v}", "serverId": "{s}", "volumeId": "{v}"}}}}"#
        );
        let attach =
            |status, body: &str, shape| exchange(&raw(status, JSON, body)).attach(shape, s, v);
        use AttachShape::*;
        assert!(matches!(
            attach(200, &envelope, Attached),
            Ok(AttachAnswer::Attached(_))
        ));
        assert_eq!(attach(202, "", Accepted).unwrap(), AttachAnswer::Accepted);
        assert_eq!(attach(202, "", Either).unwrap(), AttachAnswer::Accepted);
        assert!(attach(200, &envelope, Either).is_ok());
        for (status, body, shape) in [
            // A captive proxy's 200 page at 2.89.
            (200, "<html><body>Please log in</body></html>", Attached),
            // 200 where Nova answers 202 (2.101+), even with a fine body.
            (200, envelope.as_str(), Accepted),
            // 202 where Nova answers 200 (below 2.101).
            (202, "", Attached),
            // Nova's 202 is empty.
            (202, "<html>Accepted</html>", Accepted),
            (204, "", Either),
            // About another volume.
            (
                200,
                &envelope.replace(&v.to_string(), &Uuid::new_v4().to_string()),
                Attached,
            ),
        ] {
            let e = attach(status, body, shape).unwrap_err();
            assert_eq!(e.kind, NovaErrorKind::Undecodable, "{status} {body:?}");
            assert!(e.outcome_unknown(), "{e}");
        }
        let detach = |status, body: &str| exchange(&raw(status, "text/html", body)).detach(s, v);
        assert!(detach(202, "").is_ok());
        for (status, body) in [(200, "<html>ok</html>"), (204, ""), (202, "<html/>")] {
            let e = detach(status, body).unwrap_err();
            assert_eq!(e.kind, NovaErrorKind::Undecodable, "{status} {body:?}");
            assert!(e.outcome_unknown());
        }
        assert_eq!(
            detach(404, NGINX_404).unwrap_err().kind,
            NovaErrorKind::Foreign
        );
    }

    #[test]
    fn the_microversion_nova_answered_with_tells_the_attach_shape() {
        assert_eq!(
            AttachShape::from_header(Some("compute 2.101")),
            AttachShape::Accepted
        );
        assert_eq!(
            AttachShape::from_header(Some("compute 2.89")),
            AttachShape::Attached
        );
        assert_eq!(AttachShape::from_header(None), AttachShape::Either);
        assert_eq!(
            AttachShape::from_header(Some("volume 3.27")),
            AttachShape::Either
        );
    }

    #[test]
    fn a_look_at_the_server_says_gone_only_with_novas_404_naming_it() {
        let s = Uuid::new_v4();
        let look = |status, body: &str| exchange(&raw(status, JSON, body)).server(s);
        assert!(
            look(
                200,
                &format!(r#"{{"server": {{"id": "{s}", "status": "ACTIVE"}}}}"#)
            )
            .unwrap()
        );
        assert!(
            !look(
                404,
                &format!(
                    r#"{{"itemNotFound": {{"code": 404, "message": "Instance {s} could not be found."}}}}"#
                )
            )
            .unwrap()
        );
        // Another server's 404, a proxy's 404, another server shown: the
        // look failed.
        let other = Uuid::new_v4();
        assert!(
            look(
                404,
                &format!(
                    r#"{{"itemNotFound": {{"code": 404, "message": "Instance {other} could not be found."}}}}"#
                )
            )
            .is_err()
        );
        assert!(look(404, NGINX_404).is_err());
        assert!(look(200, &format!(r#"{{"server": {{"id": "{other}"}}}}"#)).is_err());
        assert!(look(200, "<html/>").is_err());
    }

    #[test]
    fn a_404_naming_another_instance_is_not_about_this_server() {
        let (s, v, other) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let not_found = |id: &dyn std::fmt::Display| {
            format!(
                r#"{{"itemNotFound": {{"code": 404, "message": "Instance {id} could not be found."}}}}"#
            )
        };
        let ours = not_found(&s);
        // The uuid is read whole: another's, one with ours inside it, or a
        // message that only mentions ours elsewhere is not ours.
        for body in [
            not_found(&other),
            not_found(&format!("{s}0")),
            not_found(&format!("x{s}")),
            format!(
                r#"{{"itemNotFound": {{"code": 404, "message": "Instance {other} could not be found. (asked for {s})"}}}}"#
            ),
        ] {
            let ex_raw = raw(404, JSON, &body);
            let ex = exchange(&ex_raw);
            for e in [
                ex.detach(s, v).unwrap_err(),
                ex.attach(AttachShape::Either, s, v).unwrap_err(),
                ex.list(s).unwrap_err(),
                ex.show(s, v).unwrap_err(),
                ex.server(s).unwrap_err(),
            ] {
                assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::Other), "{body}");
                assert!(e.outcome_unknown(), "{e}");
                assert!(e.cause.contains("names another instance"), "{}", e.cause);
            }
        }
        let ex_raw = raw(404, JSON, &ours);
        let ex = exchange(&ex_raw);
        for e in [ex.detach(s, v).unwrap_err(), ex.list(s).unwrap_err()] {
            assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::ServerNotFound));
        }
        assert!(!ex.server(s).unwrap());
    }

    #[test]
    fn a_404_about_a_volume_or_an_attachment_decides_only_naming_this_ones_ids() {
        let (s, v, other) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let fault = |m: String| format!(r#"{{"itemNotFound": {{"code": 404, "message": "{m}"}}}}"#);
        let rejection = |e: NovaError| e.rejection().cloned();
        let gone = raw(404, JSON, &fault(format!("Volume {v} could not be found.")));
        let ex = exchange(&gone);
        for e in [
            ex.detach(s, v).unwrap_err(),
            ex.attach(AttachShape::Either, s, v).unwrap_err(),
        ] {
            assert_eq!(rejection(e), Some(Rejection::VolumeNotFound));
        }
        let not_attached = raw(
            404,
            JSON,
            &fault(format!("Instance {s} is not attached to volume {v}")),
        );
        let ex = exchange(&not_attached);
        for e in [ex.detach(s, v).unwrap_err(), ex.show(s, v).unwrap_err()] {
            assert_eq!(rejection(e), Some(Rejection::NotAttached));
        }
        // Nova does not answer an attach "not attached": no word about it.
        let e = ex.attach(AttachShape::Either, s, v).unwrap_err();
        assert!(e.outcome_unknown(), "{e}");
        assert_eq!(rejection(e), Some(Rejection::Other));
        // Another volume, another server, the two swapped: of unknown
        // effect on every call about this attachment.
        for m in [
            format!("Volume {other} could not be found."),
            format!("Instance {other} is not attached to volume {v}"),
            format!("Instance {s} is not attached to volume {other}"),
            format!("Instance {v} is not attached to volume {s}"),
        ] {
            let answer = raw(404, JSON, &fault(m.clone()));
            let ex = exchange(&answer);
            for e in [
                ex.detach(s, v).unwrap_err(),
                ex.attach(AttachShape::Either, s, v).unwrap_err(),
                ex.show(s, v).unwrap_err(),
            ] {
                assert!(e.outcome_unknown(), "{m}: {e}");
                assert!(e.cause.contains("names"), "{m}: {}", e.cause);
                assert_eq!(rejection(e), Some(Rejection::Other), "{m}");
            }
        }
        // A call about no volume: a volume's 404 is not about it.
        let e = exchange(&gone).list(s).unwrap_err();
        assert_eq!(rejection(e), Some(Rejection::Other));
    }

    #[test]
    fn already_attached_naming_another_volume_is_a_refusal_not_read() {
        let (s, v, other) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let body = |volume: Uuid| {
            format!(
                r#"{{"badRequest": {{"code": 400, "message": "Invalid volume: volume {volume} is already attached to instances: {s}"}}}}"#
            )
        };
        let ours = raw(400, JSON, &body(v));
        let e = exchange(&ours)
            .attach(AttachShape::Either, s, v)
            .unwrap_err();
        assert!(matches!(
            e.rejection(),
            Some(Rejection::AlreadyAttached { .. })
        ));
        let theirs = raw(400, JSON, &body(other));
        let e = exchange(&theirs)
            .attach(AttachShape::Either, s, v)
            .unwrap_err();
        assert_eq!(e.rejection(), Some(&Rejection::Unread { status: 400 }));
        assert!(!e.outcome_unknown(), "refused: nothing took effect");
        assert_eq!(e.reason(), crate::domain::Reason::NovaBadRequest);
    }

    #[test]
    fn a_lists_404_stands_only_when_the_look_at_the_server_agrees() {
        let s = Uuid::new_v4();
        let body = format!(
            r#"{{"itemNotFound": {{"code": 404, "message": "Instance {s} could not be found."}}}}"#
        );
        let listed = || exchange(&raw(404, JSON, &body)).list(s).unwrap_err();
        let looks_failed = exchange(&raw(502, "text/html", "<html>502</html>")).server(s);
        let e = gone_if_shown_gone(listed(), Ok(false));
        assert_eq!(e.rejection(), Some(&Rejection::ServerNotFound));
        for (look, why) in [(Ok(true), "shows the server"), (looks_failed, "failed")] {
            let e = gone_if_shown_gone(listed(), look);
            assert_eq!(e.rejection(), Some(&Rejection::Other), "{why}");
            assert!(e.cause.contains(why), "{}", e.cause);
        }
    }

    #[test]
    fn an_answers_text_reaches_the_ledger_without_nul() {
        let e = exchange(&raw(404, "text/html", "Not\0Found")).refusal();
        assert!(
            !e.cause.contains('\0') && e.cause.contains("Not\u{FFFD}Found"),
            "{}",
            e.cause
        );
        let e = exchange(&raw(
            409,
            JSON,
            r#"{"conflictingRequest": {"code": 409, "message": "Instance x is locked\u0000"}}"#,
        ))
        .refusal();
        assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::Conflict));
        assert_eq!(e.message.as_deref(), Some("Instance x is locked\u{FFFD}"));
        for (k, v) in e.metadata() {
            assert!(!v.contains('\0'), "{k}: {v:?}");
        }
        assert!(!e.to_string().contains('\0'));
    }
}

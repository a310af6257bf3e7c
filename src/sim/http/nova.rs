//! The compute API's handlers: attach, list, show, detach. Every answer
//! carries Nova's request ids; attach and detach are recorded in the
//! request log with the global id the client sent.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Response};
use uuid::Uuid;

use super::wire::after_effect;
use super::{AppState, abort, bad_request, json, microversion, parse_id, render, unauthorized};
use crate::sim::{Answer, AttachParams, Cause, DetachEnd, Fault, FaultOp, RequestRecord, Sim};

fn token_of(h: &HeaderMap) -> Option<&str> {
    h.get("x-auth-token").and_then(|v| v.to_str().ok())
}

/// The request's ids: the global one the client sent (kept only when
/// well-formed, as oslo.middleware does) and a new local one.
fn request_ids(h: &HeaderMap) -> (Option<String>, String) {
    let global = h
        .get("x-openstack-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            v.strip_prefix("req-")
                .is_some_and(|u| Uuid::parse_str(u).is_ok())
        })
        .map(str::to_string);
    (global, format!("req-{}", Uuid::new_v4()))
}

fn with_request_id(mut r: Response<Body>, local: &str) -> Response<Body> {
    if let Ok(v) = HeaderValue::from_str(local) {
        r.headers_mut().insert("x-openstack-request-id", v.clone());
        r.headers_mut().insert("x-compute-request-id", v);
    }
    r
}

/// Marks a recorded request ended when the handler returns or is dropped
/// (the client went away).
struct Recorded {
    sim: Arc<Sim>,
    index: Option<usize>,
    status: u16,
}

impl Drop for Recorded {
    fn drop(&mut self) {
        if let Some(i) = self.index {
            self.sim.end_request(i, self.status);
        }
    }
}

/// What a mutating request is, for the parts attach and detach share.
struct Mutation {
    op: FaultOp,
    server: Uuid,
    volume: Uuid,
    mv: (u32, u32),
    /// Nova's name for the call in its conflict message.
    action: &'static str,
}

#[derive(serde::Deserialize)]
struct AttachBody {
    #[serde(rename = "volumeAttachment")]
    volume_attachment: AttachSpec,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct AttachSpec {
    #[serde(rename = "volumeId")]
    volume_id: String,
    #[serde(default)]
    device: Option<String>,
    #[serde(default)]
    tag: Option<String>,
    #[serde(default)]
    delete_on_termination: Option<bool>,
}

pub(super) async fn attach_p(
    s: State<AppState>,
    Path((_p, server)): Path<(String, String)>,
    h: HeaderMap,
    body: axum::body::Bytes,
) -> Response<Body> {
    attach(s, Path(server), h, body).await
}

pub(super) async fn attach(
    State(st): State<AppState>,
    Path(server): Path<String>,
    h: HeaderMap,
    body: axum::body::Bytes,
) -> Response<Body> {
    let mv = microversion(&h);
    let server = match parse_id("server", &server, mv) {
        Ok(s) => s,
        Err(r) => return r,
    };
    if !st.sim.token_ok(token_of(&h)) {
        return unauthorized();
    }
    let spec = match serde_json::from_slice::<AttachBody>(&body) {
        Ok(b) => b.volume_attachment,
        Err(e) => {
            return bad_request(
                format!("Invalid input for field/attribute volumeAttachment. {e}"),
                mv,
            );
        }
    };
    let volume = match parse_id("volume", &spec.volume_id, mv) {
        Ok(v) => v,
        Err(r) => return r,
    };
    for (field, given, since) in [
        ("tag", spec.tag.is_some(), (2, 49)),
        (
            "delete_on_termination",
            spec.delete_on_termination.is_some(),
            (2, 79),
        ),
    ] {
        if given && mv < since {
            return bad_request(
                format!(
                    "Invalid input for field/attribute volumeAttachment. Value: {}. Additional properties are not allowed ('{field}' was unexpected)",
                    python_repr_of(&body, "volumeAttachment")
                ),
                mv,
            );
        }
    }
    let m = Mutation {
        op: FaultOp::Attach,
        server,
        volume,
        mv,
        action: "attach_volume",
    };
    let mut r = mutate(&st.sim, m, &h, move |sim, cause, fault| {
        sim.attach(
            server,
            volume,
            AttachParams {
                device: spec.device,
                tag: spec.tag,
                delete_on_termination: spec.delete_on_termination.unwrap_or(false),
                roll_back: fault == Some(Fault::RollBack),
            },
            mv,
            cause,
        )
    })
    .await;
    // The 2.101+ attach's empty 202 is webob's default response.
    if r.status() == 202 {
        r.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=UTF-8"),
        );
    }
    r
}

/// A JSON value read with its objects' members in the order they were
/// sent (serde_json's maps sort them), printed as Python's `repr` prints
/// the dict json.loads makes: Nova's schema errors quote the offending
/// value that way.
enum Py {
    None,
    Bool(bool),
    Number(serde_json::Number),
    Str(String),
    List(Vec<Py>),
    Dict(Vec<(String, Py)>),
}

impl<'de> serde::Deserialize<'de> for Py {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Py;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("JSON")
            }
            fn visit_unit<E>(self) -> Result<Py, E> {
                Ok(Py::None)
            }
            fn visit_bool<E>(self, b: bool) -> Result<Py, E> {
                Ok(Py::Bool(b))
            }
            fn visit_i64<E>(self, n: i64) -> Result<Py, E> {
                Ok(Py::Number(n.into()))
            }
            fn visit_u64<E>(self, n: u64) -> Result<Py, E> {
                Ok(Py::Number(n.into()))
            }
            fn visit_f64<E>(self, n: f64) -> Result<Py, E> {
                Ok(serde_json::Number::from_f64(n).map_or(Py::None, Py::Number))
            }
            fn visit_str<E>(self, s: &str) -> Result<Py, E> {
                Ok(Py::Str(s.to_string()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Py, A::Error> {
                let mut out = Vec::new();
                while let Some(v) = a.next_element()? {
                    out.push(v);
                }
                Ok(Py::List(out))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<Py, A::Error> {
                let mut out = Vec::new();
                while let Some(kv) = m.next_entry()? {
                    out.push(kv);
                }
                Ok(Py::Dict(out))
            }
        }
        d.deserialize_any(V)
    }
}

impl std::fmt::Display for Py {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let quoted = |s: &str| format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"));
        match self {
            Py::None => f.write_str("None"),
            Py::Bool(true) => f.write_str("True"),
            Py::Bool(false) => f.write_str("False"),
            Py::Number(n) => write!(f, "{n}"),
            Py::Str(s) => f.write_str(&quoted(s)),
            Py::List(items) => {
                let items: Vec<String> = items.iter().map(Py::to_string).collect();
                write!(f, "[{}]", items.join(", "))
            }
            Py::Dict(members) => {
                let members: Vec<String> = members
                    .iter()
                    .map(|(k, v)| format!("{}: {v}", quoted(k)))
                    .collect();
                write!(f, "{{{}}}", members.join(", "))
            }
        }
    }
}

/// Python's `repr` of the member `key` of the JSON object `body`.
fn python_repr_of(body: &[u8], key: &str) -> String {
    match serde_json::from_slice::<Py>(body) {
        Ok(Py::Dict(members)) => members
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.to_string())
            .unwrap_or_default(),
        _ => String::new(),
    }
}

pub(super) async fn detach_p(
    s: State<AppState>,
    Path((_p, server, volume)): Path<(String, String, String)>,
    h: HeaderMap,
) -> Response<Body> {
    detach(s, Path((server, volume)), h).await
}

pub(super) async fn detach(
    State(st): State<AppState>,
    Path((server, volume)): Path<(String, String)>,
    h: HeaderMap,
) -> Response<Body> {
    let (mv, server, volume) = match admit_pair(&st, &h, &server, &volume) {
        Ok(admitted) => admitted,
        Err(r) => return r,
    };
    let m = Mutation {
        op: FaultOp::Detach,
        server,
        volume,
        mv,
        action: "detach_volume",
    };
    mutate(&st.sim, m, &h, move |sim, cause, fault| {
        let end = match fault {
            Some(Fault::DetachRefused) => DetachEnd::Refused,
            _ => DetachEnd::Detached,
        };
        sim.detach(server, volume, cause, end)
    })
    .await
}

/// An attach or detach: recorded, then its fault (if any) decides what
/// Nova does and what goes back on the wire. `work` runs Nova's part in its
/// own task (a client that goes away does not stop Nova), with the cause to
/// record if it takes effect now (`None`: checks only).
async fn mutate<W>(sim: &Arc<Sim>, m: Mutation, h: &HeaderMap, work: W) -> Response<Body>
where
    W: FnOnce(&Arc<Sim>, Option<Cause>, Option<Fault>) -> Answer + Send + 'static,
{
    let (global, local) = request_ids(h);
    let index = sim.begin_request(RequestRecord {
        op: if m.op == FaultOp::Attach {
            "attach"
        } else {
            "detach"
        }
        .into(),
        server_id: m.server,
        volume_id: m.volume,
        global_id: global.clone(),
        local_id: local.clone(),
        received_at: chrono::Utc::now(),
        ended_at: None,
        status: 0,
    });
    let mut record = Recorded {
        sim: sim.clone(),
        index,
        status: 0,
    };
    let fault = sim.take_fault(m.op, Some(m.server), Some(m.volume));
    let cause = Cause::Request { request_id: global };
    // Nova looks the attachment up before it checks the server's state: a
    // detach of a volume that is not attached is 404, whatever the lock.
    let fault = match fault {
        Some(Fault::Conflict)
            if m.op == FaultOp::Detach && !sim.is_attached(m.server, m.volume) =>
        {
            None
        }
        other => other,
    };
    let resp = match early_answer(&m, &fault) {
        Some(r) => {
            if let Some(Fault::LateEffect { ms }) = fault {
                late_effect(sim, ms, cause, work);
            }
            r
        }
        None => run(sim, &m, fault, cause, work).await,
    };
    record.status = if resp.extensions().get::<super::AbortConnection>().is_some() {
        0
    } else {
        resp.status().as_u16()
    };
    with_request_id(resp, &local)
}

/// The faults that answer before Nova does anything.
fn early_answer(m: &Mutation, fault: &Option<Fault>) -> Option<Response<Body>> {
    let (status, name, message) = match fault {
        Some(Fault::Unauthorized) => return Some(unauthorized()),
        Some(Fault::Conflict) => (
            409,
            "conflictingRequest",
            format!(
                "Cannot '{}' instance {} while it is in task_state {}",
                m.action,
                m.server,
                if m.op == FaultOp::Attach {
                    "resize_finish"
                } else {
                    "migrating"
                }
            ),
        ),
        Some(Fault::ServerNotFound) => (
            404,
            "itemNotFound",
            format!("Instance {} could not be found.", m.server),
        ),
        Some(Fault::VolumeNotFound { volume_id }) => (
            404,
            "itemNotFound",
            format!(
                "Volume {} could not be found.",
                volume_id.unwrap_or(m.volume)
            ),
        ),
        Some(Fault::NotAttached {
            server_id,
            volume_id,
        }) => (
            404,
            "itemNotFound",
            format!(
                "Instance {} is not attached to volume {}",
                server_id.unwrap_or(m.server),
                volume_id.unwrap_or(m.volume)
            ),
        ),
        Some(Fault::DeviceInUse) => (
            409,
            "conflictingRequest",
            "The supplied device path (/dev/vdb) is in use.".to_string(),
        ),
        Some(Fault::VolumeNotReady { status }) => (
            400,
            "badRequest",
            format!(
                "Invalid input received: Invalid volume: Volume {} status must be available or downloading to reserve, but the current status is {status}. (HTTP 400) (Request-ID: req-{})",
                m.volume,
                Uuid::new_v4()
            ),
        ),
        Some(Fault::LateEffect { .. }) => {
            return Some(
                Response::builder()
                    .status(504)
                    .header("content-type", "text/html")
                    .body(Body::from("Gateway Timeout"))
                    .unwrap_or_else(|_| Response::new(Body::empty())),
            );
        }
        _ => return None,
    };
    Some(render(
        Answer::Fault {
            status,
            name,
            message,
        },
        m.mv,
    ))
}

/// Nova goes on after the proxy answered: the request takes effect later.
fn late_effect<W>(sim: &Arc<Sim>, ms: u64, cause: Cause, work: W)
where
    W: FnOnce(&Arc<Sim>, Option<Cause>, Option<Fault>) -> Answer + Send + 'static,
{
    let sim = sim.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        // What Nova would have answered is lost with the first response.
        drop(work(&sim, Some(cause), None));
    });
}

async fn run<W>(
    sim: &Arc<Sim>,
    m: &Mutation,
    fault: Option<Fault>,
    cause: Cause,
    work: W,
) -> Response<Body>
where
    W: FnOnce(&Arc<Sim>, Option<Cause>, Option<Fault>) -> Answer + Send + 'static,
{
    let effect = !fault.as_ref().is_some_and(Fault::blocks_effect);
    let before = match &fault {
        Some(Fault::DelayBeforeEffect { ms }) => Duration::from_millis(*ms),
        _ => Duration::ZERO,
    };
    let task_sim = sim.clone();
    let task_fault = fault.clone();
    let task = tokio::spawn(async move {
        if !before.is_zero() {
            tokio::time::sleep(before).await;
        }
        work(&task_sim, effect.then_some(cause), task_fault)
    });
    let answer = match task.await {
        Ok(a) => a,
        Err(e) => {
            return json(
                500,
                serde_json::json!({"computeFault": {"code": 500, "message": format!("simulator task failed: {e}")}}),
                m.mv,
            );
        }
    };
    if matches!(fault, Some(Fault::CloseBeforeEffect)) {
        return abort();
    }
    let ok = matches!(answer, Answer::Ok(_) | Answer::Accepted);
    let resp = render(answer, m.mv);
    if ok {
        after_effect(fault, resp, m.mv).await
    } else {
        resp
    }
}

pub(super) async fn list_p(
    s: State<AppState>,
    Path((_p, server)): Path<(String, String)>,
    h: HeaderMap,
) -> Response<Body> {
    list(s, Path(server), h).await
}

pub(super) async fn list(
    State(st): State<AppState>,
    Path(server): Path<String>,
    h: HeaderMap,
) -> Response<Body> {
    let mv = microversion(&h);
    let server = match parse_id("server", &server, mv) {
        Ok(s) => s,
        Err(r) => return r,
    };
    if !st.sim.token_ok(token_of(&h)) {
        return unauthorized();
    }
    let (_, local) = request_ids(&h);
    let fault = st.sim.take_fault(FaultOp::List, Some(server), None);
    if let Some(Fault::DelayBeforeEffect { ms }) = fault {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    match fault {
        Some(Fault::Unauthorized) => return unauthorized(),
        Some(Fault::CloseBeforeEffect) => return abort(),
        _ => {}
    }
    let resp = render(st.sim.list(server, mv), mv);
    with_request_id(after_effect(fault, resp, mv).await, &local)
}

pub(super) async fn show_p(
    s: State<AppState>,
    Path((_p, server, volume)): Path<(String, String, String)>,
    h: HeaderMap,
) -> Response<Body> {
    show(s, Path((server, volume)), h).await
}

pub(super) async fn show(
    State(st): State<AppState>,
    Path((server, volume)): Path<(String, String)>,
    h: HeaderMap,
) -> Response<Body> {
    let (mv, server, volume) = match admit_pair(&st, &h, &server, &volume) {
        Ok(admitted) => admitted,
        Err(r) => return r,
    };
    let (_, local) = request_ids(&h);
    let fault = st.sim.take_fault(FaultOp::Show, Some(server), Some(volume));
    let resp = render(st.sim.show(server, volume, mv), mv);
    with_request_id(after_effect(fault, resp, mv).await, &local)
}

/// The microversion and the two ids of a request on
/// `/servers/{server}/os-volume_attachments/{volume}`, once they parse and
/// its token is good (the ids are judged before the token).
// The error is the answer itself; handlers return it as is.
#[allow(clippy::result_large_err)]
fn admit_pair(
    st: &AppState,
    h: &HeaderMap,
    server: &str,
    volume: &str,
) -> Result<((u32, u32), Uuid, Uuid), Response<Body>> {
    let mv = microversion(h);
    let server = parse_id("server", server, mv)?;
    let volume = parse_id("volume", volume, mv)?;
    if !st.sim.token_ok(token_of(h)) {
        return Err(unauthorized());
    }
    Ok((mv, server, volume))
}

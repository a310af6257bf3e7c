//! Cinder's v3 API as real clients use it: version discovery at `/v3/`,
//! volumes under `/v3/{project_id}/volumes` (and, from microversion 3.67,
//! `/v3/volumes`): show, list, create, delete. Microversions are
//! negotiated as Cinder does (`OpenStack-API-Version: volume 3.N`; none is
//! 3.0; out of range is 406), every answer carries Cinder's request ids
//! and the negotiated version, faults have Cinder's shape (Nova's). Faults
//! for `FaultOp::Cinder` hit the volume show.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Response, StatusCode};
use uuid::Uuid;

use super::wire::after_effect;
use super::{AppState, abort, unauthorized};
use crate::sim::{Answer, CinderRead, CinderVolume, Fault, FaultOp, PROJECT_ID, VolumeSpec};

/// The microversions served (cinder/api/openstack/api_version_request.py).
const MIN_VERSION: (u32, u32) = (3, 0);
const MAX_VERSION: (u32, u32) = (3, 71);

fn token_ok(st: &AppState, h: &HeaderMap) -> bool {
    st.sim
        .token_ok(h.get("x-auth-token").and_then(|v| v.to_str().ok()))
}

/// The global request id the client sent, kept only when well-formed
/// (`req-<uuid>`), as oslo.middleware does.
fn global_request_id(h: &HeaderMap) -> Option<String> {
    h.get("x-openstack-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            v.strip_prefix("req-")
                .is_some_and(|u| Uuid::parse_str(u).is_ok())
        })
        .map(str::to_string)
}

fn show_version(v: (u32, u32)) -> String {
    format!("{}.{}", v.0, v.1)
}

/// An answer with Cinder's headers: its request ids (both names, as the
/// request-id middleware and Cinder's own fault set them) and, once
/// negotiated, the microversion.
fn respond(status: u16, body: Option<serde_json::Value>, mv: Option<(u32, u32)>) -> Response<Body> {
    let mut r = Response::builder().status(status);
    if body.is_some() {
        r = r.header("content-type", "application/json");
    }
    let mut resp = r
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
        .unwrap_or_else(|_| Response::new(Body::empty()));
    stamp(&mut resp, mv);
    resp
}

/// Adds the request ids and the version to an answer that lacks them.
fn stamp(resp: &mut Response<Body>, mv: Option<(u32, u32)>) {
    let local = format!("req-{}", Uuid::new_v4());
    let headers = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&local) {
        for name in ["x-openstack-request-id", "x-compute-request-id"] {
            if !headers.contains_key(name) {
                headers.insert(name, v.clone());
            }
        }
    }
    if let Some(mv) = mv
        && let Ok(v) = HeaderValue::from_str(&format!("volume {}", show_version(mv)))
    {
        headers.insert("openstack-api-version", v);
        headers.insert("vary", HeaderValue::from_static("OpenStack-API-Version"));
    }
}

fn fault_body(status: u16, message: &str) -> serde_json::Value {
    let name = match status {
        400 => "badRequest",
        401 => "unauthorized",
        403 => "forbidden",
        404 => "itemNotFound",
        405 => "badMethod",
        409 => "conflictingRequest",
        413 => "overLimit",
        415 => "badMediaType",
        501 => "notImplemented",
        503 => "serviceUnavailable",
        _ => "computeFault",
    };
    serde_json::json!({ name: {"code": status, "message": message} })
}

fn render(answer: Answer, mv: (u32, u32)) -> Response<Body> {
    match answer {
        Answer::Ok(v) => respond(200, Some(v), Some(mv)),
        Answer::Accepted => respond(202, None, Some(mv)),
        Answer::Fault {
            status, message, ..
        } => respond(status, Some(fault_body(status, &message)), Some(mv)),
    }
}

/// The microversion a request asks for, as Cinder negotiates it
/// (cinder/api/openstack/wsgi.py `set_api_version_request`).
// The error is the answer itself; handlers return it as is.
#[allow(clippy::result_large_err)]
fn negotiate(h: &HeaderMap) -> Result<(u32, u32), Response<Body>> {
    let Some(header) = h.get("openstack-api-version") else {
        return Ok(MIN_VERSION);
    };
    let text = header.to_str().unwrap_or("");
    let asked = text.split(',').find_map(|part| {
        let mut words = part.split_whitespace();
        match (words.next(), words.next()) {
            (Some("volume"), Some(v)) => Some(v.to_string()),
            _ => None,
        }
    });
    let Some(asked) = asked else {
        return Err(respond(
            404,
            Some(fault_body(
                404,
                "API version 'None' is not supported on this method.",
            )),
            None,
        ));
    };
    if asked == "latest" {
        return Ok(MAX_VERSION);
    }
    let parsed = asked
        .split_once('.')
        .and_then(|(a, b)| Some((a.parse::<u32>().ok()?, b.parse::<u32>().ok()?)));
    let Some(v) = parsed else {
        return Err(respond(
            400,
            Some(fault_body(
                400,
                &format!(
                    "API Version String {asked} is of invalid format. Must be of format MajorNum.MinorNum."
                ),
            )),
            None,
        ));
    };
    if v < MIN_VERSION || v > MAX_VERSION {
        return Err(respond(
            406,
            Some(fault_body(
                406,
                &format!(
                    "Version {} is not supported by the API. Minimum is {} and maximum is {}.",
                    show_version(v),
                    show_version(MIN_VERSION),
                    show_version(MAX_VERSION)
                ),
            )),
            None,
        ));
    }
    Ok(v)
}

/// Checks what every volume request needs: the token (keystonemiddleware
/// runs first), then the microversion.
// The error is the answer itself; handlers return it as is.
#[allow(clippy::result_large_err)]
fn admit(st: &AppState, h: &HeaderMap) -> Result<(u32, u32), Response<Body>> {
    if !token_ok(st, h) {
        let mut r = unauthorized();
        stamp(&mut r, None);
        return Err(r);
    }
    negotiate(h)
}

/// Cinder's timestamps: ISO 8601 without a zone, microseconds.
fn timestamp(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%S%.6f").to_string()
}

fn links(base_url: &str, id: Uuid) -> serde_json::Value {
    serde_json::json!([
        {"href": format!("{base_url}/v3/{PROJECT_ID}/volumes/{id}"), "rel": "self"},
        {"href": format!("{base_url}/{PROJECT_ID}/volumes/{id}"), "rel": "bookmark"},
    ])
}

/// A volume's detail, shaped by microversion
/// (cinder/api/v3/views/volumes.py `detail`).
fn volume_view(v: &CinderVolume, mv: (u32, u32), base_url: &str) -> serde_json::Value {
    let created = timestamp(v.created_at);
    let attachments: Vec<_> = v
        .attachments
        .iter()
        .map(|a| {
            serde_json::json!({
                "id": v.id.to_string(),
                "attachment_id": a.attachment_id.to_string(),
                "volume_id": v.id.to_string(),
                "server_id": a.server_id.to_string(),
                "host_name": null,
                "device": a.device,
                "attached_at": null,
            })
        })
        .collect();
    let mut m = serde_json::json!({
        "id": v.id.to_string(),
        "status": v.status,
        "size": v.size,
        "availability_zone": "nova",
        "created_at": created,
        "updated_at": created,
        "name": v.name,
        "description": v.description,
        "volume_type": "__DEFAULT__",
        "snapshot_id": null,
        "source_volid": null,
        "metadata": {},
        "links": links(base_url, v.id),
        "user_id": crate::sim::cinder::USER_ID,
        "bootable": "false",
        "encrypted": false,
        "replication_status": null,
        "consistencygroup_id": null,
        "multiattach": v.multiattach,
        "attachments": attachments,
        "os-vol-tenant-attr:tenant_id": PROJECT_ID,
    });
    if mv >= (3, 13) {
        m["group_id"] = serde_json::Value::Null;
    }
    if mv >= (3, 48) {
        m["shared_targets"] = serde_json::json!(true);
        m["service_uuid"] = serde_json::json!("2f6b6f6e-1c5b-4bd1-8c9e-0f1f2e3d4c5b");
    }
    if mv >= (3, 63) {
        m["volume_type_id"] = serde_json::json!("5fed9d7c-401d-46e2-8e80-f30c70cb7e1d");
    }
    if mv >= (3, 65) {
        m["consumes_quota"] = serde_json::json!(true);
    }
    m
}

fn not_found(volume: &str, mv: (u32, u32)) -> Response<Body> {
    respond(
        404,
        Some(fault_body(
            404,
            &format!("Volume {volume} could not be found."),
        )),
        Some(mv),
    )
}

/// `GET /v3` and `GET /v3/`: Cinder's version document
/// (api-ref/source/v3/samples/versions/version-show-response.json).
pub(super) async fn versions(State(st): State<AppState>) -> Response<Body> {
    respond(
        200,
        Some(serde_json::json!({"versions": [{
            "id": "v3.0",
            "links": [
                {"href": "https://docs.openstack.org/", "rel": "describedby", "type": "text/html"},
                {"href": format!("{}/v3/", st.base_url), "rel": "self"},
            ],
            "media-types": [{"base": "application/json",
                "type": "application/vnd.openstack.volume+json;version=3"}],
            "min_version": show_version(MIN_VERSION),
            "status": "CURRENT",
            "updated": "2023-08-31T00:00:00Z",
            "version": show_version(MAX_VERSION),
        }]})),
        None,
    )
}

pub(super) async fn show_p(
    s: State<AppState>,
    Path((_project, volume)): Path<(String, String)>,
    h: HeaderMap,
) -> Response<Body> {
    show_volume(s, volume, h, true).await
}

/// `GET /v3/volumes/{id}`: the project id may be left out from 3.67.
pub(super) async fn show(
    s: State<AppState>,
    Path(volume): Path<String>,
    h: HeaderMap,
) -> Response<Body> {
    show_volume(s, volume, h, false).await
}

async fn show_volume(
    State(st): State<AppState>,
    volume: String,
    h: HeaderMap,
    with_project: bool,
) -> Response<Body> {
    let mv = match admit(&st, &h) {
        Ok(mv) => mv,
        Err(r) => return r,
    };
    if !with_project && mv < (3, 67) {
        return respond(
            404,
            Some(fault_body(404, "The resource could not be found.")),
            Some(mv),
        );
    }
    let Ok(id) = Uuid::parse_str(&volume) else {
        return not_found(&volume, mv);
    };
    st.sim.record_cinder_read(CinderRead {
        volume_id: id,
        global_id: global_request_id(&h),
        microversion: show_version(mv),
        at: chrono::Utc::now(),
    });
    let fault = st.sim.take_fault(FaultOp::Cinder, None, Some(id));
    match &fault {
        Some(Fault::DelayBeforeEffect { ms }) => {
            tokio::time::sleep(Duration::from_millis(*ms)).await;
        }
        Some(Fault::Unauthorized) => {
            let mut r = unauthorized();
            stamp(&mut r, None);
            return r;
        }
        Some(Fault::CloseBeforeEffect) => return abort(),
        _ => {}
    }
    let resp = match st.sim.cinder_volume(id) {
        Some(v) => respond(
            200,
            Some(serde_json::json!({"volume": volume_view(&v, mv, &st.base_url)})),
            Some(mv),
        ),
        None => not_found(&volume, mv),
    };
    // A proxy's page carries none of Cinder's headers.
    let proxied = matches!(fault, Some(Fault::ProxyError { .. }));
    let mut resp = after_effect(fault, resp, (0, 0)).await;
    if !proxied {
        stamp(&mut resp, Some(mv));
    }
    resp
}

/// `GET /v3/{project}/volumes`: id, name and links of every volume.
pub(super) async fn list_p(
    State(st): State<AppState>,
    Path(_project): Path<String>,
    h: HeaderMap,
) -> Response<Body> {
    volumes(&st, &h, |v, _| {
        serde_json::json!({"id": v.id.to_string(), "name": v.name,
            "links": links(&st.base_url, v.id)})
    })
}

/// `GET /v3/{project}/volumes/detail`.
pub(super) async fn detail_p(
    State(st): State<AppState>,
    Path(_project): Path<String>,
    h: HeaderMap,
) -> Response<Body> {
    volumes(&st, &h, |v, mv| volume_view(v, mv, &st.base_url))
}

#[derive(serde::Deserialize)]
struct CreateBody {
    volume: CreateSpec,
}

#[derive(serde::Deserialize)]
struct CreateSpec {
    size: serde_json::Value,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    multiattach: Option<bool>,
    #[serde(default, rename = "imageRef")]
    image_ref: Option<String>,
}

/// `POST /v3/{project}/volumes`: 202 with the volume `creating`.
pub(super) async fn create_p(
    State(st): State<AppState>,
    Path(_project): Path<String>,
    h: HeaderMap,
    body: axum::body::Bytes,
) -> Response<Body> {
    let mv = match admit(&st, &h) {
        Ok(mv) => mv,
        Err(r) => return r,
    };
    let spec = match serde_json::from_slice::<CreateBody>(&body) {
        Ok(b) => b.volume,
        Err(e) => {
            return respond(
                400,
                Some(fault_body(
                    400,
                    &format!("Invalid input for field/attribute volume. {e}"),
                )),
                Some(mv),
            );
        }
    };
    // Cinder accepts an integer or a string of one.
    let size = match &spec.size {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::String(s) => s.parse().ok(),
        _ => None,
    };
    let Some(size) = size.filter(|s| *s >= 1) else {
        return respond(
            400,
            Some(fault_body(
                400,
                &format!(
                    "Invalid input for field/attribute size. Value: {}. It must be an integer of at least 1.",
                    spec.size
                ),
            )),
            Some(mv),
        );
    };
    let v = st.sim.create_volume(VolumeSpec {
        name: spec.name,
        description: spec.description,
        size,
        multiattach: spec.multiattach.unwrap_or(false),
        from_image: spec.image_ref.is_some(),
    });
    respond(
        202,
        Some(serde_json::json!({"volume": volume_view(&v, mv, &st.base_url)})),
        Some(mv),
    )
}

/// `DELETE /v3/{project}/volumes/{id}`: 202, then `deleting`, then gone.
pub(super) async fn delete_p(
    State(st): State<AppState>,
    Path((_project, volume)): Path<(String, String)>,
    h: HeaderMap,
) -> Response<Body> {
    let mv = match admit(&st, &h) {
        Ok(mv) => mv,
        Err(r) => return r,
    };
    let Ok(id) = Uuid::parse_str(&volume) else {
        return not_found(&volume, mv);
    };
    match st.sim.delete_volume(id) {
        Ok(()) => render(Answer::Accepted, mv),
        Err(refusal) => render(refusal, mv),
    }
}

#[derive(serde::Deserialize)]
pub(super) struct ForcedStatus {
    status: Option<String>,
}

/// `POST /sim/cinder/volumes/{id}/status` `{"status": "error"}` (or
/// `null` to go back to the derived status): what `cinder reset-state`
/// does, for tests.
pub(super) async fn force_status(
    State(st): State<AppState>,
    Path(volume): Path<String>,
    axum::Json(body): axum::Json<ForcedStatus>,
) -> StatusCode {
    match Uuid::parse_str(&volume) {
        Ok(v) => {
            st.sim.force_volume_status(v, body.status);
            StatusCode::NO_CONTENT
        }
        Err(_) => StatusCode::BAD_REQUEST,
    }
}

/// A listing of every volume, each as `view` renders it at the request's
/// microversion.
fn volumes(
    st: &AppState,
    h: &HeaderMap,
    view: impl Fn(&CinderVolume, (u32, u32)) -> serde_json::Value,
) -> Response<Body> {
    let mv = match admit(st, h) {
        Ok(mv) => mv,
        Err(r) => return r,
    };
    let items: Vec<_> = st
        .sim
        .cinder_volumes()
        .iter()
        .map(|v| view(v, mv))
        .collect();
    respond(200, Some(serde_json::json!({"volumes": items})), Some(mv))
}

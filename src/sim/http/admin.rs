//! Version discovery, Keystone's token endpoint, and the `/sim` admin API
//! (faults, truth, configuration, lifecycle of servers and volumes).

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{Response, StatusCode};
use axum::routing::{get, post};
use uuid::Uuid;

use super::{AppState, json};
use crate::sim::{Fault, FaultOp, FaultRule, SimConfig, Truth};

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/sim/faults", post(add_fault).delete(clear_faults))
        .route("/sim/truth", get(truth))
        .route("/sim/attachments", post(seed_attachments))
        .route("/sim/reset", post(reset))
        .route("/sim/config", get(get_config).put(put_config))
        .route("/sim/servers/{server_id}/lock", post(lock).delete(unlock))
        .route(
            "/sim/servers/{server_id}/max_disk_devices_to_attach",
            post(max_disk_devices),
        )
        .route(
            "/sim/servers/{server_id}",
            axum::routing::delete(remove_server),
        )
        .route(
            "/sim/volumes/{volume_id}",
            axum::routing::delete(remove_volume),
        )
        .route("/sim/volumes/{volume_id}/multiattach", post(multiattach))
        .route("/sim/tokens/expire", post(expire_tokens))
}

/// Nova's version documents (doc/api_samples/versions/), pointing at this
/// simulator: `GET /` lists the versions, `GET /v2.1[/]` is v2.1's.
fn nova_v21(base_url: &str) -> serde_json::Value {
    serde_json::json!({
        "id": "v2.1",
        "links": [
            {"href": format!("{base_url}/v2.1/"), "rel": "self"},
            {"href": "http://docs.openstack.org/", "rel": "describedby", "type": "text/html"},
        ],
        "media-types": [{"base": "application/json",
            "type": "application/vnd.openstack.compute+json;version=2.1"}],
        "status": "CURRENT",
        "version": "2.104",
        "min_version": "2.1",
        "updated": "2013-07-23T11:33:21Z",
    })
}

pub(super) async fn versions(State(st): State<AppState>) -> Response<Body> {
    let mut v21 = nova_v21(&st.base_url);
    // The list's entries carry only the self link.
    v21["links"] = serde_json::json!([{"href": format!("{}/v2.1/", st.base_url), "rel": "self"}]);
    if let Some(m) = v21.as_object_mut() {
        m.remove("media-types");
    }
    json(
        200,
        serde_json::json!({"versions": [
            {"id": "v2.0", "links": [{"href": format!("{}/v2/", st.base_url), "rel": "self"}],
             "status": "DEPRECATED", "version": "", "min_version": "",
             "updated": "2025-07-04T12:00:00Z"},
            v21,
        ]}),
        (0, 0),
    )
}

/// `GET /v2.1[/]`: served by a versioned resource, so its answer carries
/// the negotiated microversion (2.1 unless asked).
pub(super) async fn version_v21(
    State(st): State<AppState>,
    h: axum::http::HeaderMap,
) -> Response<Body> {
    json(
        200,
        serde_json::json!({ "version": nova_v21(&st.base_url) }),
        super::microversion(&h),
    )
}

/// Keystone's v3 version document (what keystoneauth reads at the auth URL
/// before it authenticates).
fn identity_v3(base_url: &str) -> serde_json::Value {
    serde_json::json!({
        "id": "v3.14",
        "status": "stable",
        "updated": "2020-04-07T00:00:00Z",
        "links": [{"rel": "self", "href": format!("{base_url}/identity/v3/")}],
        "media-types": [{"base": "application/json",
            "type": "application/vnd.openstack.identity-v3+json"}],
    })
}

pub(super) async fn identity_version(State(st): State<AppState>) -> Response<Body> {
    json(
        200,
        serde_json::json!({ "version": identity_v3(&st.base_url) }),
        (0, 0),
    )
}

/// `GET /identity`: Keystone answers its version list with 300.
pub(super) async fn identity_versions(State(st): State<AppState>) -> Response<Body> {
    json(
        300,
        serde_json::json!({"versions": {"values": [identity_v3(&st.base_url)]}}),
        (0, 0),
    )
}

pub(super) async fn issue_token(
    State(st): State<AppState>,
    body: axum::body::Bytes,
) -> Response<Body> {
    match st.sim.take_fault(FaultOp::Auth, None, None) {
        Some(Fault::DelayBeforeEffect { ms }) => {
            tokio::time::sleep(Duration::from_millis(ms)).await
        }
        Some(Fault::Status { code, .. }) => {
            return json(
                code,
                serde_json::json!({"error": {"code": code, "title": "Service Unavailable", "message": "Keystone is unavailable"}}),
                (0, 0),
            );
        }
        _ => {}
    }
    // A body that is not JSON names no credential: refused below (401).
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let cfg = st.sim.config();
    let (name, password, by_credential) = match user_of(&v, &cfg) {
        Ok(u) => u,
        Err(refused) => return refused,
    };
    let Some((token, expires)) = st.sim.issue_token(&name, &password) else {
        return unauthorized_token("The request you have made requires authentication.");
    };
    let catalog = catalog(&st.base_url, &cfg);
    let mut body = serde_json::json!({"token": {
        "methods": [if by_credential { "application_credential" } else { "password" }],
        "expires_at": expires.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        "issued_at": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        "project": {"domain": {"id": "default", "name": "Default"}, "id": crate::sim::PROJECT_ID, "name": cfg.project_name},
        "user": {"domain": {"id": "default", "name": "Default"}, "id": crate::sim::cinder::USER_ID, "name": name},
        "roles": [{"id": "51cc68287d524c759f47c811e6463340", "name": "member"},
                  {"id": "8f1b0b1c2e3d4c5b9a8e7f6d5c4b3a29", "name": "reader"}],
        "audit_ids": ["3T2dc1CGQxyJsHdDu1xkcw"],
        "is_domain": false,
        "catalog": catalog,
    }});
    if let Some((id, name, _)) = cfg
        .application_credential
        .as_ref()
        .filter(|_| by_credential)
    {
        body["token"]["application_credential"] =
            serde_json::json!({"id": id, "name": name, "restricted": true});
    }
    let mut r = json(201, body, (0, 0));
    if let Ok(v) = token.parse() {
        r.headers_mut().insert("x-subject-token", v);
    }
    r
}

/// The user a token request names and whether it came by application
/// credential; Keystone's 401 when the request cannot be answered at all.
#[allow(clippy::result_large_err)] // the refusal is the response itself
fn user_of(
    v: &serde_json::Value,
    cfg: &crate::sim::SimConfig,
) -> Result<(String, String, bool), Response<Body>> {
    let identity = &v["auth"]["identity"];
    let by_credential = identity["methods"]
        .as_array()
        .is_some_and(|m| m.iter().any(|m| m == "application_credential"));
    if !by_credential {
        let user = &identity["password"]["user"];
        return Ok((
            user["name"].as_str().unwrap_or("").to_string(),
            user["password"].as_str().unwrap_or("").to_string(),
            false,
        ));
    }
    // Keystone: "Application credentials cannot request a scope."
    if v["auth"].get("scope").is_some() {
        return Err(unauthorized_token(
            "Application credentials cannot request a scope.",
        ));
    }
    // The credential stands for its user: the token is the user's.
    let ac = &identity["application_credential"];
    let accepted = cfg
        .application_credential
        .as_ref()
        .is_some_and(|(id, name, secret)| {
            let user = &ac["user"];
            let owner = user["name"] == cfg.username.as_str()
                && (user["domain"]["name"] == "Default" || user["domain"]["id"] == "default");
            ac["secret"] == secret.as_str()
                && (ac["id"] == id.as_str() || (ac["name"] == name.as_str() && owner))
        });
    Ok(if accepted {
        (cfg.username.clone(), cfg.password.clone(), true)
    } else {
        // Counted as a refused request, like a wrong password.
        (String::new(), String::new(), true)
    })
}

/// The service catalog of a token: Nova, and Cinder v3 under its official
/// type or the older alias (or absent, as configured).
fn catalog(base_url: &str, cfg: &crate::sim::SimConfig) -> Vec<serde_json::Value> {
    let endpoint = |iface: &str, url: &str| {
        serde_json::json!({"id": Uuid::new_v4().simple().to_string(), "interface": iface,
        "region": "RegionOne", "region_id": "RegionOne", "url": url})
    };
    let service = |kind: &str, name: &str, id: &str, url: String| {
        serde_json::json!({"type": kind, "name": name, "id": id,
            "endpoints": [endpoint("public", &url), endpoint("internal", &url), endpoint("admin", &url)]})
    };
    let mut catalog = vec![service(
        "compute",
        "nova",
        "a226b3eeb5594f50bf8b6df94636ed28",
        format!("{base_url}/v2.1"),
    )];
    if cfg.catalog_block_storage != "none" {
        catalog.push(service(
            &cfg.catalog_block_storage,
            "cinder",
            "5c5e0e3c9bb34c5c9e0b3e8e0e2f2b6d",
            format!("{base_url}/v3/{}", crate::sim::PROJECT_ID),
        ));
    }
    catalog
}

/// Keystone's 401 for a token request.
fn unauthorized_token(message: &str) -> Response<Body> {
    json(
        401,
        serde_json::json!({"error": {"code": 401, "title": "Unauthorized", "message": message}}),
        (0, 0),
    )
}

async fn add_fault(
    State(st): State<AppState>,
    axum::Json(rule): axum::Json<FaultRule>,
) -> StatusCode {
    st.sim.add_fault(rule);
    StatusCode::NO_CONTENT
}

#[derive(serde::Deserialize)]
struct Seed {
    server_id: Uuid,
    volume_id: Uuid,
}

/// Puts attachments in place as if made long ago (benchmarks, set-ups).
async fn seed_attachments(
    State(st): State<AppState>,
    axum::Json(seeds): axum::Json<Vec<Seed>>,
) -> StatusCode {
    for s in seeds {
        st.sim.seed_attachment(s.server_id, s.volume_id);
    }
    StatusCode::NO_CONTENT
}

async fn reset(State(st): State<AppState>) -> StatusCode {
    st.sim.reset();
    StatusCode::NO_CONTENT
}

async fn clear_faults(State(st): State<AppState>) -> StatusCode {
    st.sim.clear_faults();
    StatusCode::NO_CONTENT
}

async fn truth(State(st): State<AppState>) -> axum::Json<Truth> {
    axum::Json(st.sim.truth())
}

async fn get_config(State(st): State<AppState>) -> axum::Json<SimConfig> {
    axum::Json(st.sim.config())
}

async fn put_config(
    State(st): State<AppState>,
    axum::Json(cfg): axum::Json<SimConfig>,
) -> StatusCode {
    st.sim.set_config(cfg);
    StatusCode::NO_CONTENT
}

fn admin_id(s: &str) -> Result<Uuid, StatusCode> {
    Uuid::parse_str(s).map_err(|_| StatusCode::BAD_REQUEST)
}

async fn lock(State(st): State<AppState>, Path(server): Path<String>) -> StatusCode {
    match admin_id(&server) {
        Ok(s) => {
            st.sim.lock_server(s, true);
            StatusCode::NO_CONTENT
        }
        Err(c) => c,
    }
}

async fn unlock(State(st): State<AppState>, Path(server): Path<String>) -> StatusCode {
    match admin_id(&server) {
        Ok(s) => {
            st.sim.lock_server(s, false);
            StatusCode::NO_CONTENT
        }
        Err(c) => c,
    }
}

/// `{"max_disk_devices_to_attach": N}`: Nova's option of that name for
/// the server's compute host (-1: unlimited).
#[derive(serde::Deserialize)]
struct MaxDiskDevices {
    max_disk_devices_to_attach: i64,
}

async fn max_disk_devices(
    State(st): State<AppState>,
    Path(server): Path<String>,
    axum::Json(body): axum::Json<MaxDiskDevices>,
) -> StatusCode {
    match admin_id(&server) {
        // Nova's option is -1 or more.
        Ok(_) if body.max_disk_devices_to_attach < -1 => StatusCode::BAD_REQUEST,
        Ok(s) => {
            st.sim
                .set_max_disk_devices(s, body.max_disk_devices_to_attach);
            StatusCode::NO_CONTENT
        }
        Err(c) => c,
    }
}

async fn remove_server(State(st): State<AppState>, Path(server): Path<String>) -> StatusCode {
    match admin_id(&server) {
        Ok(s) => {
            st.sim.remove_server(s);
            StatusCode::NO_CONTENT
        }
        Err(c) => c,
    }
}

async fn remove_volume(State(st): State<AppState>, Path(volume): Path<String>) -> StatusCode {
    match admin_id(&volume) {
        Ok(v) => {
            st.sim.remove_volume(v);
            StatusCode::NO_CONTENT
        }
        Err(c) => c,
    }
}

async fn multiattach(State(st): State<AppState>, Path(volume): Path<String>) -> StatusCode {
    match admin_id(&volume) {
        Ok(v) => {
            st.sim.set_multiattach(v);
            StatusCode::NO_CONTENT
        }
        Err(c) => c,
    }
}

async fn expire_tokens(State(st): State<AppState>) -> StatusCode {
    st.sim.expire_tokens();
    StatusCode::NO_CONTENT
}

//! The servers part of the compute API clients need around volume
//! attachments: `GET /servers`, `/servers/detail` (with a `name` filter)
//! and `/servers/{id}`, as openstacksdk calls them to find a server before
//! a detach. Servers the simulator knows are listed; any other id exists
//! unless removed (404 then, as for a name that is not an id). Fault rules
//! with `"op": "server"` hit `GET /servers/{id}`.

use std::collections::HashMap;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Response, StatusCode};
use uuid::Uuid;

use super::wire::after_effect;
use super::{AppState, abort, json, microversion, unauthorized};
use crate::sim::{Fault, FaultOp};

fn with_request_id(mut r: Response<Body>) -> Response<Body> {
    if let Ok(v) = HeaderValue::from_str(&format!("req-{}", Uuid::new_v4())) {
        r.headers_mut().insert("x-openstack-request-id", v.clone());
        r.headers_mut().insert("x-compute-request-id", v);
    }
    r
}

fn admitted(st: &AppState, h: &HeaderMap) -> bool {
    st.sim
        .token_ok(h.get("x-auth-token").and_then(|v| v.to_str().ok()))
}

/// `GET /v2.1/servers` and `/v2.1/servers/detail` (`detail` in the path).
async fn list(
    st: AppState,
    h: HeaderMap,
    query: HashMap<String, String>,
    detail: bool,
) -> Response<Body> {
    if !admitted(&st, &h) {
        return unauthorized();
    }
    let mv = microversion(&h);
    let name = query.get("name");
    let items: Vec<_> = st
        .sim
        .server_list()
        .iter()
        // Nova matches `name` as a regular expression; a substring is
        // what clients rely on.
        .filter(|s| name.is_none_or(|n| s.name.contains(n.as_str())))
        .map(|s| {
            if detail {
                s.detail(&st.base_url)
            } else {
                s.summary(&st.base_url)
            }
        })
        .collect();
    with_request_id(json(200, serde_json::json!({ "servers": items }), mv))
}

pub(super) async fn index(
    State(st): State<AppState>,
    h: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response<Body> {
    list(st, h, q, false).await
}

pub(super) async fn index_p(
    State(st): State<AppState>,
    Path(_project): Path<String>,
    h: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response<Body> {
    list(st, h, q, false).await
}

pub(super) async fn detail(
    State(st): State<AppState>,
    h: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response<Body> {
    list(st, h, q, true).await
}

pub(super) async fn detail_p(
    State(st): State<AppState>,
    Path(_project): Path<String>,
    h: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response<Body> {
    list(st, h, q, true).await
}

/// `GET /v2.1/servers/{id}`.
pub(super) async fn show(
    State(st): State<AppState>,
    Path(server): Path<String>,
    h: HeaderMap,
) -> Response<Body> {
    show_server(st, server, h).await
}

pub(super) async fn show_p(
    State(st): State<AppState>,
    Path((_project, server)): Path<(String, String)>,
    h: HeaderMap,
) -> Response<Body> {
    show_server(st, server, h).await
}

async fn show_server(st: AppState, server: String, h: HeaderMap) -> Response<Body> {
    if !admitted(&st, &h) {
        return unauthorized();
    }
    let mv = microversion(&h);
    let id = Uuid::parse_str(&server).ok();
    let fault = id.and_then(|id| st.sim.take_fault(FaultOp::Server, Some(id), None));
    match fault {
        Some(Fault::DelayBeforeEffect { ms }) => {
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
        Some(Fault::CloseBeforeEffect) => return abort(),
        _ => {}
    }
    let found = id.and_then(|id| st.sim.server(id));
    let resp = match found {
        Some(s) => json(
            200,
            serde_json::json!({ "server": s.detail(&st.base_url) }),
            mv,
        ),
        None => json(
            404,
            serde_json::json!({"itemNotFound": {"code": 404,
                "message": format!("Instance {server} could not be found.")}}),
            mv,
        ),
    };
    with_request_id(after_effect(fault, resp, mv).await)
}

#[derive(serde::Deserialize)]
pub(super) struct NewServer {
    #[serde(default)]
    id: Option<Uuid>,
    name: String,
}

/// `POST /sim/servers` `{"name": "web-1"}` (optionally `"id"`): registers a
/// server so that it is listed; answers its id.
pub(super) async fn register(
    State(st): State<AppState>,
    axum::Json(body): axum::Json<NewServer>,
) -> (StatusCode, axum::Json<serde_json::Value>) {
    let id = body.id.unwrap_or_else(Uuid::new_v4);
    st.sim.add_server(id, &body.name);
    (
        StatusCode::CREATED,
        axum::Json(serde_json::json!({ "id": id.to_string() })),
    )
}

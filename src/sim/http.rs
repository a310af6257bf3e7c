//! The simulator's HTTP face: Nova under `/v2.1`, Keystone under
//! `/identity/v3`, and an admin API under `/sim` for faults and truth.
//! Served by its own accept loop so a fault can close a connection without
//! answering, the way a lost response looks on the wire.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Response, StatusCode};
use axum::routing::{get, post};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;
use uuid::Uuid;

use super::{Answer, Fault, FaultOp, FaultRule, Sim, SimConfig};

/// Marks a response whose connection must be closed instead of answered.
#[derive(Clone, Copy)]
struct AbortConnection;

#[derive(Clone)]
struct AppState {
    sim: Arc<Sim>,
    base_url: String,
}

/// A running simulator.
pub struct SimHandle {
    pub sim: Arc<Sim>,
    pub addr: SocketAddr,
    /// e.g. `http://127.0.0.1:8774`
    pub base_url: String,
    /// The compute endpoint for `--nova-url`: `{base_url}/v2.1`.
    pub nova_url: String,
    /// The Keystone endpoint for `OS_AUTH_URL`: `{base_url}/identity/v3`.
    pub auth_url: String,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl SimHandle {
    pub async fn stop(self) {
        self.stop.cancel();
        // The accept loop ends on the token; a join error would be a panic
        // in it, which the test using it reports on its own.
        if let Err(e) = self.task.await {
            tracing::warn!(error = %e, "simulator task ended abnormally");
        }
    }
}

pub async fn start(listen: SocketAddr, cfg: SimConfig) -> anyhow::Result<SimHandle> {
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("nova-sim cannot listen on {listen}: {e}"))?;
    let addr = listener.local_addr()?;
    let base_url = format!("http://{addr}");
    let sim = Sim::new(cfg);
    let state = AppState {
        sim: sim.clone(),
        base_url: base_url.clone(),
    };
    let router = router(state);
    let stop = CancellationToken::new();
    let task = tokio::spawn(accept_loop(listener, router, stop.clone()));
    Ok(SimHandle {
        sim,
        addr,
        nova_url: format!("{base_url}/v2.1"),
        auth_url: format!("{base_url}/identity/v3"),
        base_url,
        stop,
        task,
    })
}

async fn accept_loop(listener: TcpListener, router: Router, stop: CancellationToken) {
    loop {
        let (stream, _) = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "nova-sim accept failed");
                    continue;
                }
            },
        };
        let router = router.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let svc =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let router = router.clone();
                    async move {
                        let resp = match router.oneshot(req.map(Body::new)).await {
                            Ok(r) => r,
                            Err(never) => match never {},
                        };
                        if resp.extensions().get::<AbortConnection>().is_some() {
                            return Err(std::io::Error::other(
                                "simulated lost response: connection closed",
                            ));
                        }
                        Ok::<_, std::io::Error>(resp)
                    }
                });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    // Closed connections are the point of some faults.
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "nova-sim connection ended");
                    }
                }
                _ = stop.cancelled() => {}
            }
        });
    }
}

fn router(state: AppState) -> Router {
    Router::new()
        .route("/", get(versions))
        .route(
            "/v2.1/servers/{server_id}/os-volume_attachments",
            post(attach).get(list),
        )
        .route(
            "/v2.1/servers/{server_id}/os-volume_attachments/{volume_id}",
            get(show).delete(detach),
        )
        // openstacksdk with a project-scoped endpoint override puts the
        // project id in the path; accept that form too.
        .route(
            "/v2.1/{project}/servers/{server_id}/os-volume_attachments",
            post(attach_p).get(list_p),
        )
        .route(
            "/v2.1/{project}/servers/{server_id}/os-volume_attachments/{volume_id}",
            get(show_p).delete(detach_p),
        )
        .route("/identity/v3/auth/tokens", post(issue_token))
        .route("/sim/faults", post(add_fault).delete(clear_faults))
        .route("/sim/truth", get(truth))
        .route("/sim/attachments", post(seed_attachments))
        .route("/sim/reset", post(reset))
        .route("/sim/config", get(get_config).put(put_config))
        .route("/sim/servers/{server_id}/lock", post(lock).delete(unlock))
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
        .with_state(state)
}

fn json(status: u16, v: serde_json::Value, mv: (u32, u32)) -> Response<Body> {
    let mut r = Response::builder()
        .status(status)
        .header("content-type", "application/json; charset=UTF-8")
        .header("x-compute-request-id", format!("req-{}", Uuid::new_v4()));
    if mv != (0, 0) {
        let v = format!("{}.{}", mv.0, mv.1);
        r = r
            .header("OpenStack-API-Version", format!("compute {v}"))
            .header("X-OpenStack-Nova-API-Version", v);
    }
    r.body(Body::from(v.to_string()))
        .unwrap_or_else(|_| Response::new(Body::empty()))
}

fn empty(status: u16, mv: (u32, u32)) -> Response<Body> {
    let mut r = json(status, serde_json::Value::Null, mv);
    *r.body_mut() = Body::empty();
    r
}

fn unauthorized() -> Response<Body> {
    let mut r = json(
        401,
        serde_json::json!({"error": {"code": 401, "title": "Unauthorized",
            "message": "The request you have made requires authentication."}}),
        (0, 0),
    );
    if let Ok(v) = "Keystone uri=\"http://keystone/identity\"".parse() {
        r.headers_mut().insert("www-authenticate", v);
    }
    r
}

fn abort() -> Response<Body> {
    let mut r = Response::new(Body::empty());
    r.extensions_mut().insert(AbortConnection);
    r
}

fn microversion(h: &HeaderMap) -> (u32, u32) {
    let parse = |s: &str| {
        let mut it = s.trim().split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        (it.next().unwrap_or(2), it.next().unwrap_or(1))
    };
    if let Some(v) = h.get("openstack-api-version").and_then(|v| v.to_str().ok())
        && let Some(rest) = v.trim().strip_prefix("compute ")
    {
        return parse(rest);
    }
    h.get("x-openstack-nova-api-version")
        .and_then(|v| v.to_str().ok())
        .map(parse)
        .unwrap_or((2, 1))
}

fn bad_request(msg: String, mv: (u32, u32)) -> Response<Body> {
    json(
        400,
        serde_json::json!({"badRequest": {"code": 400, "message": msg}}),
        mv,
    )
}

// The error is the answer itself; handlers return it as is.
#[allow(clippy::result_large_err)]
fn parse_id(what: &str, s: &str, mv: (u32, u32)) -> Result<Uuid, Response<Body>> {
    Uuid::parse_str(s).map_err(|_| {
        if what == "server" {
            json(404, serde_json::json!({"itemNotFound": {"code": 404, "message": format!("Instance {s} could not be found.")}}), mv)
        } else {
            bad_request(format!("Invalid input for field/attribute volumeId. Value: {s}. '{s}' is not a 'uuid'"), mv)
        }
    })
}

fn render(answer: Answer, mv: (u32, u32)) -> Response<Body> {
    match answer {
        Answer::Ok(v) => json(200, v, mv),
        Answer::Accepted => empty(202, mv),
        Answer::Fault {
            status,
            name,
            message,
        } => json(
            status,
            serde_json::json!({ name: {"code": status, "message": message} }),
            mv,
        ),
    }
}

/// Applies a fault that acts after processing (or instead of it).
async fn after_effect(fault: Option<Fault>, ok: Response<Body>, mv: (u32, u32)) -> Response<Body> {
    match fault {
        Some(Fault::DelayAfterEffect { ms }) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            ok
        }
        Some(Fault::CloseAfterEffect) => abort(),
        Some(Fault::StallBody { ms, .. }) => stalled(ok, Duration::from_millis(ms)).await,
        Some(Fault::TruncateBody { .. }) => truncated(ok).await,
        Some(Fault::GarbageBody) => Response::builder()
            .status(200)
            .header("content-type", "application/json")
            .body(Body::from("<html><body>Service temporarily rewritten by a proxy</body></html>"))
            .unwrap_or_else(|_| Response::new(Body::empty())),
        Some(Fault::Status { code, .. }) => render(
            Answer::Fault {
                status: code,
                name: if code == 503 { "serviceUnavailable" } else { "computeFault" },
                message: "Unexpected API Error. Please report this at http://bugs.launchpad.net/nova/ and attach the Nova API log if possible.".into(),
            },
            mv,
        ),
        Some(Fault::ProxyError { code, .. }) => Response::builder()
            .status(code)
            .header("content-type", "text/html")
            .body(Body::from(if code == 504 { "Gateway Timeout" } else { "Bad Gateway" }))
            .unwrap_or_else(|_| Response::new(Body::empty())),
        _ => ok,
    }
}

/// Sends the headers and half the body, stalls, then the rest.
async fn stalled(ok: Response<Body>, stall: Duration) -> Response<Body> {
    let (parts, body) = ok.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let bytes = if bytes.is_empty() {
        bytes::Bytes::from_static(b"{\"volumeAttachments\": []}")
    } else {
        bytes
    };
    let half = bytes.len() / 2;
    let (a, b) = (bytes.slice(..half), bytes.slice(half..));
    let stream = futures_util::stream::unfold(0u8, move |step| {
        let (a, b) = (a.clone(), b.clone());
        async move {
            match step {
                0 => Some((Ok::<_, std::io::Error>(a), 1)),
                1 => {
                    tokio::time::sleep(stall).await;
                    Some((Ok(b), 2))
                }
                _ => None,
            }
        }
    });
    let mut parts = parts;
    parts.headers.remove("content-length");
    Response::from_parts(parts, Body::from_stream(stream))
}

/// Sends the headers and half the body, then fails the stream: the
/// connection is cut mid-body.
async fn truncated(ok: Response<Body>) -> Response<Body> {
    let (mut parts, body) = ok.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let bytes = if bytes.is_empty() {
        bytes::Bytes::from_static(b"{\"volumeAttachments\": []}")
    } else {
        bytes
    };
    let half = bytes.slice(..bytes.len() / 2);
    // The headers and the first half go out; then the connection is cut.
    let stream = futures_util::stream::unfold(0u8, move |step| {
        let half = half.clone();
        async move {
            match step {
                0 => Some((Ok::<_, std::io::Error>(half), 1)),
                1 => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Some((
                        Err(std::io::Error::other("simulated connection cut mid-body")),
                        2,
                    ))
                }
                _ => None,
            }
        }
    });
    parts.headers.remove("content-length");
    Response::from_parts(parts, Body::from_stream(stream))
}

/// Whether a fault takes the effect away.
fn blocks_effect(f: &Option<Fault>) -> bool {
    matches!(
        f,
        Some(Fault::CloseBeforeEffect)
            | Some(Fault::Status { effect: false, .. })
            | Some(Fault::ProxyError { effect: false, .. })
            | Some(Fault::StallBody { effect: false, .. })
            | Some(Fault::TruncateBody { effect: false })
    )
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

fn token_of(h: &HeaderMap) -> Option<&str> {
    h.get("x-auth-token").and_then(|v| v.to_str().ok())
}

async fn attach_p(
    s: State<AppState>,
    Path((_p, server)): Path<(String, String)>,
    h: HeaderMap,
    body: axum::body::Bytes,
) -> Response<Body> {
    attach(s, Path(server), h, body).await
}

async fn attach(
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
    if spec.tag.is_some() && mv < (2, 49) {
        return bad_request("Invalid input for field/attribute volumeAttachment. Additional properties are not allowed ('tag' was unexpected)".into(), mv);
    }
    if spec.delete_on_termination.is_some() && mv < (2, 79) {
        return bad_request("Invalid input for field/attribute volumeAttachment. Additional properties are not allowed ('delete_on_termination' was unexpected)".into(), mv);
    }
    st.sim.count_request(FaultOp::Attach, Some(volume));
    let fault = st
        .sim
        .take_fault(FaultOp::Attach, Some(server), Some(volume));
    match fault {
        Some(Fault::Unauthorized) => return unauthorized(),
        Some(Fault::Conflict) => {
            return render(
                Answer::Fault {
                    status: 409,
                    name: "conflictingRequest",
                    message: format!(
                        "Cannot 'attach_volume' instance {server} while it is in task_state resize_finish"
                    ),
                },
                mv,
            );
        }
        _ => {}
    }
    let effect = !blocks_effect(&fault);
    let before = match &fault {
        Some(Fault::DelayBeforeEffect { ms }) => Duration::from_millis(*ms),
        _ => Duration::ZERO,
    };
    // The work runs in its own task: a client that goes away does not stop
    // Nova from finishing what it started.
    let sim = st.sim.clone();
    let work = tokio::spawn(async move {
        if !before.is_zero() {
            tokio::time::sleep(before).await;
        }
        sim.attach(
            server,
            volume,
            super::AttachParams {
                device: spec.device,
                tag: spec.tag,
                delete_on_termination: spec.delete_on_termination.unwrap_or(false),
            },
            mv,
            effect,
        )
    });
    let answer = match work.await {
        Ok(a) => a,
        Err(e) => {
            return json(
                500,
                serde_json::json!({"computeFault": {"code": 500, "message": format!("simulator task failed: {e}")}}),
                mv,
            );
        }
    };
    if matches!(fault, Some(Fault::CloseBeforeEffect)) {
        return abort();
    }
    let ok = matches!(answer, Answer::Ok(_) | Answer::Accepted);
    let resp = render(answer, mv);
    if ok {
        after_effect(fault, resp, mv).await
    } else {
        resp
    }
}

async fn list_p(
    s: State<AppState>,
    Path((_p, server)): Path<(String, String)>,
    h: HeaderMap,
) -> Response<Body> {
    list(s, Path(server), h).await
}

async fn list(
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
    after_effect(fault, resp, mv).await
}

async fn show_p(
    s: State<AppState>,
    Path((_p, server, volume)): Path<(String, String, String)>,
    h: HeaderMap,
) -> Response<Body> {
    show(s, Path((server, volume)), h).await
}

async fn show(
    State(st): State<AppState>,
    Path((server, volume)): Path<(String, String)>,
    h: HeaderMap,
) -> Response<Body> {
    let mv = microversion(&h);
    let (server, volume) = match (
        parse_id("server", &server, mv),
        parse_id("volume", &volume, mv),
    ) {
        (Ok(s), Ok(v)) => (s, v),
        (Err(r), _) | (_, Err(r)) => return r,
    };
    if !st.sim.token_ok(token_of(&h)) {
        return unauthorized();
    }
    let fault = st.sim.take_fault(FaultOp::Show, Some(server), Some(volume));
    let resp = render(st.sim.show(server, volume, mv), mv);
    after_effect(fault, resp, mv).await
}

async fn detach_p(
    s: State<AppState>,
    Path((_p, server, volume)): Path<(String, String, String)>,
    h: HeaderMap,
) -> Response<Body> {
    detach(s, Path((server, volume)), h).await
}

async fn detach(
    State(st): State<AppState>,
    Path((server, volume)): Path<(String, String)>,
    h: HeaderMap,
) -> Response<Body> {
    let mv = microversion(&h);
    let (server, volume) = match (
        parse_id("server", &server, mv),
        parse_id("volume", &volume, mv),
    ) {
        (Ok(s), Ok(v)) => (s, v),
        (Err(r), _) | (_, Err(r)) => return r,
    };
    if !st.sim.token_ok(token_of(&h)) {
        return unauthorized();
    }
    st.sim.count_request(FaultOp::Detach, Some(volume));
    let fault = st
        .sim
        .take_fault(FaultOp::Detach, Some(server), Some(volume));
    match fault {
        Some(Fault::Unauthorized) => return unauthorized(),
        Some(Fault::Conflict) => {
            return render(
                Answer::Fault {
                    status: 409,
                    name: "conflictingRequest",
                    message: format!(
                        "Cannot 'detach_volume' instance {server} while it is in task_state migrating"
                    ),
                },
                mv,
            );
        }
        _ => {}
    }
    let effect = !blocks_effect(&fault);
    let before = match &fault {
        Some(Fault::DelayBeforeEffect { ms }) => Duration::from_millis(*ms),
        _ => Duration::ZERO,
    };
    let sim = st.sim.clone();
    let work = tokio::spawn(async move {
        if !before.is_zero() {
            tokio::time::sleep(before).await;
        }
        sim.detach(server, volume, effect)
    });
    let answer = match work.await {
        Ok(a) => a,
        Err(e) => {
            return json(
                500,
                serde_json::json!({"computeFault": {"code": 500, "message": format!("simulator task failed: {e}")}}),
                mv,
            );
        }
    };
    if matches!(fault, Some(Fault::CloseBeforeEffect)) {
        return abort();
    }
    let ok = matches!(answer, Answer::Accepted);
    let resp = render(answer, mv);
    if ok {
        after_effect(fault, resp, mv).await
    } else {
        resp
    }
}

async fn versions(State(st): State<AppState>) -> Response<Body> {
    json(
        200,
        serde_json::json!({"versions": [{
            "id": "v2.1", "status": "CURRENT", "version": "2.104", "min_version": "2.1",
            "updated": "2013-07-23T11:33:21Z",
            "links": [{"href": format!("{}/v2.1/", st.base_url), "rel": "self"}]
        }]}),
        (0, 0),
    )
}

async fn issue_token(State(st): State<AppState>, body: axum::body::Bytes) -> Response<Body> {
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
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let user = &v["auth"]["identity"]["password"]["user"];
    let name = user["name"].as_str().unwrap_or("");
    let password = user["password"].as_str().unwrap_or("");
    let Some((token, expires)) = st.sim.issue_token(name, password) else {
        return json(
            401,
            serde_json::json!({"error": {"code": 401, "title": "Unauthorized",
                "message": "The request you have made requires authentication."}}),
            (0, 0),
        );
    };
    let compute = format!("{}/v2.1", st.base_url);
    let endpoint = |iface: &str| {
        serde_json::json!({"id": Uuid::new_v4().simple().to_string(), "interface": iface,
        "region": "RegionOne", "region_id": "RegionOne", "url": compute})
    };
    let body = serde_json::json!({"token": {
        "methods": ["password"],
        "expires_at": expires.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        "issued_at": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        "project": {"domain": {"id": "default", "name": "Default"}, "id": "a6944d763bf64ee6a275f1263fae0352", "name": st.sim.config().project_name},
        "user": {"domain": {"id": "default", "name": "Default"}, "id": "ee4dfb6e5540447cb3741905149d9b6e", "name": name},
        "audit_ids": ["3T2dc1CGQxyJsHdDu1xkcw"],
        "catalog": [{"type": "compute", "name": "nova", "id": "a226b3eeb5594f50bf8b6df94636ed28",
            "endpoints": [endpoint("public"), endpoint("internal"), endpoint("admin")]}],
    }});
    let mut r = json(201, body, (0, 0));
    if let Ok(v) = token.parse() {
        r.headers_mut().insert("x-subject-token", v);
    }
    r
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

async fn truth(State(st): State<AppState>) -> axum::Json<super::Truth> {
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

//! The simulator's HTTP face: Nova under `/v2.1`, Cinder under `/v3`,
//! Keystone under `/identity/v3`, and an admin API under `/sim` for faults
//! and truth. Served by its own accept loop so a fault can close a
//! connection without answering, the way a lost response looks on the wire.
//! One listener serves all three, each at the paths a real cloud's
//! catalog and version documents point clients to.
//!
//! - `nova.rs`: the compute API's volume-attachment handlers.
//! - `servers.rs`: the compute API's server lookups and lists.
//! - `cinder.rs`: the block-storage v3 API (volumes, version discovery).
//! - `wire.rs`: faults applied on the wire (stalls, cuts, proxy pages).
//! - `version.rs`: around every versioned call: microversion negotiation,
//!   request ids, `Vary`.
//! - `admin.rs`: version discovery, Keystone, the `/sim` admin API.
//! - `i18n.rs`: Nova's fault messages in the request's language.

mod admin;
mod cinder;
mod i18n;
mod nova;
mod servers;
mod version;
mod wire;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Response};
use axum::routing::{get, post};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;
use uuid::Uuid;

use super::{Answer, Sim, SimConfig};

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
    /// Cinder's v3 endpoint for `--cinder-url`: `{base_url}/v3/{project_id}`.
    pub cinder_url: String,
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
    let task = tokio::spawn(accept_loop(listener, router, sim.clone(), stop.clone()));
    Ok(SimHandle {
        sim,
        addr,
        nova_url: format!("{base_url}/v2.1"),
        auth_url: format!("{base_url}/identity/v3"),
        cinder_url: format!("{base_url}/v3/{}", super::PROJECT_ID),
        base_url,
        stop,
        task,
    })
}

async fn accept_loop(
    listener: TcpListener,
    router: Router,
    sim: Arc<Sim>,
    stop: CancellationToken,
) {
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
        tokio::spawn(serve_connection(
            stream,
            router.clone(),
            sim.clone(),
            stop.clone(),
        ));
    }
}

async fn serve_connection(
    stream: tokio::net::TcpStream,
    router: Router,
    sim: Arc<Sim>,
    stop: CancellationToken,
) {
    let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let router = router.clone();
        sim.record_http(&req);
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
    let conn =
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc);
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
}

fn router(state: AppState) -> Router {
    // Nova's versioned API, behind what Nova does around every call.
    let compute = Router::new()
        .route("/v2.1", get(admin::version_v21))
        .route("/v2.1/", get(admin::version_v21))
        .route("/v2.1/servers", get(servers::index))
        .route("/v2.1/servers/detail", get(servers::detail))
        .route("/v2.1/servers/{server_id}", get(servers::show))
        .route("/v2.1/{project}/servers", get(servers::index_p))
        .route("/v2.1/{project}/servers/detail", get(servers::detail_p))
        .route("/v2.1/{project}/servers/{server_id}", get(servers::show_p))
        .route(
            "/v2.1/servers/{server_id}/os-volume_attachments",
            post(nova::attach).get(nova::list),
        )
        .route(
            "/v2.1/servers/{server_id}/os-volume_attachments/{volume_id}",
            get(nova::show).delete(nova::detach),
        )
        // openstacksdk with a project-scoped endpoint override puts the
        // project id in the path; accept that form too.
        .route(
            "/v2.1/{project}/servers/{server_id}/os-volume_attachments",
            post(nova::attach_p).get(nova::list_p),
        )
        .route(
            "/v2.1/{project}/servers/{server_id}/os-volume_attachments/{volume_id}",
            get(nova::show_p).delete(nova::detach_p),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            version::layer,
        ));
    Router::new()
        .route("/", get(admin::versions))
        .merge(compute)
        .route("/identity/v3/auth/tokens", post(admin::issue_token))
        .route("/identity", get(admin::identity_versions))
        .route("/identity/", get(admin::identity_versions))
        .route("/identity/v3", get(admin::identity_version))
        .route("/identity/v3/", get(admin::identity_version))
        .route("/v3", get(cinder::versions))
        .route("/v3/", get(cinder::versions))
        .route("/v3/volumes/{volume_id}", get(cinder::show))
        .route(
            "/v3/{project}/volumes",
            get(cinder::list_p).post(cinder::create_p),
        )
        .route("/v3/{project}/volumes/detail", get(cinder::detail_p))
        .route(
            "/v3/{project}/volumes/{volume_id}",
            get(cinder::show_p).delete(cinder::delete_p),
        )
        .route(
            "/sim/cinder/volumes/{volume_id}/status",
            post(cinder::force_status),
        )
        .route("/sim/servers", post(servers::register))
        .merge(admin::routes())
        .with_state(state)
}

/// A JSON answer with Nova's headers: the microversion, when one was
/// negotiated (the request ids and `Vary` are `version.rs`'s). Nova's own
/// answers say `application/json`; its faults (and keystonemiddleware's
/// 401) add the charset. A fault of Nova's carries its body as
/// `i18n::NovaFault`, for `version.rs` to translate.
fn json(status: u16, v: serde_json::Value, mv: (u32, u32)) -> Response<Body> {
    let content_type = if status < 400 {
        "application/json"
    } else {
        "application/json; charset=UTF-8"
    };
    let mut r = Response::builder()
        .status(status)
        .header("content-type", content_type);
    if mv != (0, 0) {
        let v = format!("{}.{}", mv.0, mv.1);
        r = r
            .header("OpenStack-API-Version", format!("compute {v}"))
            .header("X-OpenStack-Nova-API-Version", v);
    }
    if let Some(fault) = i18n::NovaFault::of(status, &v) {
        r = r.extension(fault);
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
            json(
                404,
                serde_json::json!({"itemNotFound": {"code": 404, "message": format!("Instance {s} could not be found.")}}),
                mv,
            )
        } else {
            bad_request(
                format!("Invalid input for field/attribute volumeId. Value: {s}. '{s}' is not a 'uuid'"),
                mv,
            )
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

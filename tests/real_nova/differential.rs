//! The differential test: the same requests to real Nova and to the
//! project's simulator (`nova-sim`), at several microversions, and their
//! answers compared — status, body (field sets by microversion, fault keys
//! and messages, ids mapped to names), and the headers a client reads
//! (content type, microversion headers, `Vary`, request ids,
//! `WWW-Authenticate`). Every difference must be one of `KEPT` (on
//! purpose, with the reason; docs/testing.md's "Real Nova in the suite" lists
//! them too), and every kept difference must still be seen, so the list
//! cannot rot.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde_json::{Value, json};
use uuid::Uuid;
use volume_reconciler::sim::{self, SimConfig};

use super::support::real_nova::{Api, MULTIATTACH_VOLUME};

/// A difference kept on purpose: the request (a substring of its label),
/// the aspect, and why.
struct Kept {
    request: &'static str,
    aspect: &'static str,
    why: &'static str,
}

/// The differences kept on purpose. Each must still occur.
const KEPT: &[Kept] = &[
    Kept {
        request: "list of a server nobody made",
        aspect: "status",
        why: "the simulator serves any server id it was not told is gone (tests and the demo \
              name servers freely, without creating them); Nova knows only the servers it \
              created. The simulator answers 404 for a server once `remove_server` named it",
    },
    Kept {
        request: "list of a server nobody made",
        aspect: "body",
        why: "the same: an empty list instead of Nova's itemNotFound",
    },
    Kept {
        request: "list of a server nobody made",
        aspect: "content-type",
        why: "the same: a success's content type instead of a fault's",
    },
    Kept {
        request: "detach tagged",
        aspect: "effect",
        why: "Nova 34's compute cannot detach a tagged volume from a fake-driver server \
              (`_delete_disk_metadata` reads device metadata only a real hypervisor driver \
              writes: AttributeError, the mapping stays after the 202); the simulator detaches \
              it, as Nova on libvirt does",
    },
];

/// An answer, as a client reads it.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: BTreeMap<String, String>,
    body: Value,
}

/// What is compared of an answer.
fn aspects(a: &Answer, names: &HashMap<String, String>) -> BTreeMap<&'static str, String> {
    let mut m = BTreeMap::new();
    m.insert("status", a.status.to_string());
    let h = |k: &str| a.headers.get(k).cloned().unwrap_or_else(|| "-".into());
    m.insert("content-type", h("content-type"));
    m.insert("openstack-api-version", h("openstack-api-version"));
    m.insert(
        "x-openstack-nova-api-version",
        h("x-openstack-nova-api-version"),
    );
    m.insert("vary", h("vary"));
    let req_id = |k: &str| match a.headers.get(k) {
        None => "-".to_string(),
        Some(v) if is_req_id(v) => "req-<uuid>".into(),
        Some(v) => format!("malformed {v}"),
    };
    m.insert("x-openstack-request-id", req_id("x-openstack-request-id"));
    m.insert("x-compute-request-id", req_id("x-compute-request-id"));
    m.insert(
        "www-authenticate",
        a.headers
            .get("www-authenticate")
            .map(|v| {
                if v.starts_with("Keystone uri=") {
                    "Keystone uri=<keystone>".into()
                } else {
                    v.clone()
                }
            })
            .unwrap_or_else(|| "-".into()),
    );
    m.insert("body", normalize(&a.body, names, None).to_string());
    m
}

fn is_req_id(v: &str) -> bool {
    v.strip_prefix("req-")
        .is_some_and(|u| Uuid::parse_str(u).is_ok())
}

/// The body with what differs by nature replaced: ids by the test's names
/// for them (or `<uuid>`), devices by `<device>`, URLs' hosts by `<host>`.
fn normalize(v: &Value, names: &HashMap<String, String>, key: Option<&str>) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, v)| (k.clone(), normalize(v, names, Some(k))))
                .collect(),
        ),
        Value::Array(a) => {
            let mut items: Vec<Value> = a.iter().map(|v| normalize(v, names, key)).collect();
            // A list's order is the store's: Nova's database ids against
            // the simulator's insertion order.
            if key == Some("volumeAttachments") {
                items.sort_by_key(|v| v.to_string());
            }
            Value::Array(items)
        }
        Value::String(s) if key == Some("device") && s.starts_with("/dev/") => {
            Value::String("<device>".into())
        }
        Value::String(s) if key == Some("href") => Value::String(match s.split_once("://") {
            Some((scheme, rest)) => match rest.split_once('/') {
                Some((host, path)) if host.starts_with("127.0.0.1") => {
                    format!("{scheme}://<host>/{path}")
                }
                _ => s.clone(),
            },
            None => s.clone(),
        }),
        Value::String(s) => Value::String(names_in(s, names)),
        other => other.clone(),
    }
}

/// Replaces every UUID in `s` by its name (or `<uuid>`).
fn names_in(s: &str, names: &HashMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while !rest.is_empty() {
        if rest.len() >= 36
            && rest.is_char_boundary(36)
            && Uuid::parse_str(&rest[..36]).is_ok()
            && rest.as_bytes()[8] == b'-'
        {
            let id = &rest[..36];
            out.push_str(names.get(id).map(String::as_str).unwrap_or("<uuid>"));
            rest = &rest[36..];
        } else {
            let c = rest.chars().next().expect("not empty");
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// One side of the comparison.
struct Side {
    http: reqwest::Client,
    /// Up to the host: `http://127.0.0.1:port`.
    base: String,
    token: String,
}

impl Side {
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&Value>,
        authed: bool,
    ) -> Answer {
        let mut req = self
            .http
            .request(method.clone(), format!("{}{path}", self.base));
        if authed {
            req = req.header("X-Auth-Token", &self.token);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        let r = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {}{path}: {e}", self.base));
        let status = r.status().as_u16();
        // A header sent more than once (Nova's two `Vary`s) reads as one
        // list.
        let mut headers: BTreeMap<String, String> = BTreeMap::new();
        for (k, v) in r.headers() {
            let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
            headers
                .entry(k.as_str().to_ascii_lowercase())
                .and_modify(|e| {
                    e.push_str(", ");
                    e.push_str(&v);
                })
                .or_insert(v);
        }
        headers.remove("date");
        headers.remove("server");
        let text = r.text().await.expect("a body");
        let body = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        Answer {
            status,
            headers,
            body,
        }
    }
}

struct Differential {
    nova: Side,
    sim: Side,
    names: HashMap<String, String>,
    /// (request, aspect, Nova's, the simulator's)
    diffs: Vec<(String, String, String, String)>,
    requests: usize,
}

impl Differential {
    fn name(&mut self, id: Uuid, name: &str) {
        self.names.insert(id.to_string(), name.to_string());
    }

    /// Sends one request to both and records how their answers differ;
    /// returns Nova's status.
    async fn both(
        &mut self,
        label: &str,
        method: reqwest::Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
        authed: bool,
    ) -> u16 {
        self.requests += 1;
        let n = self
            .nova
            .send(method.clone(), path, headers, body.as_ref(), authed)
            .await;
        let s = self
            .sim
            .send(method, path, headers, body.as_ref(), authed)
            .await;
        let (an, as_) = (aspects(&n, &self.names), aspects(&s, &self.names));
        for (k, nv) in &an {
            let sv = &as_[k];
            if nv != sv {
                self.diffs
                    .push((label.to_string(), k.to_string(), nv.clone(), sv.clone()));
            }
        }
        n.status
    }

    /// A request at microversion `mv` (the header clients send from 2.27;
    /// below it the legacy one).
    async fn at(
        &mut self,
        mv: &str,
        label: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> u16 {
        let legacy = mv != "latest" && minor(mv) < 27;
        let header = if legacy {
            ("X-OpenStack-Nova-API-Version", mv.to_string())
        } else {
            ("OpenStack-API-Version", format!("compute {mv}"))
        };
        let label = format!("{mv} {label}");
        self.both(
            &label,
            method,
            path,
            &[(header.0, header.1.as_str())],
            body,
            true,
        )
        .await
    }
}

fn minor(mv: &str) -> u32 {
    mv.split_once('.')
        .and_then(|(_, m)| m.parse().ok())
        .unwrap_or(u32::MAX)
}

fn attach_body(v: Uuid) -> Value {
    json!({"volumeAttachment": {"volumeId": v.to_string()}})
}

#[tokio::test]
async fn real_nova_and_the_simulator_answer_alike_but_for_the_kept_differences() {
    let api = Api::new().await;
    let servers = api.servers(2).await;
    let (s1, s2) = (servers[0], servers[1]);
    let h = sim::start(
        "127.0.0.1:0".parse().unwrap(),
        SimConfig {
            require_auth: true,
            ..SimConfig::default()
        },
    )
    .await
    .expect("the simulator starts");
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let sim_token = {
        let r = http
            .post(format!("{}/auth/tokens", h.auth_url))
            .json(
                &json!({"auth": {"identity": {"methods": ["password"], "password": {"user": {
                "name": "demo", "domain": {"name": "Default"}, "password": "secret"}}},
                "scope": {"project": {"name": "demo", "domain": {"name": "Default"}}}}}),
            )
            .send()
            .await
            .unwrap();
        r.headers()["x-subject-token"].to_str().unwrap().to_string()
    };
    let mut d = Differential {
        nova: Side {
            http: http.clone(),
            base: api.nova.base_url.clone(),
            token: api.token("tester", &api.project).await,
        },
        sim: Side {
            http: http.clone(),
            base: h.base_url.clone(),
            token: sim_token,
        },
        names: HashMap::new(),
        diffs: Vec::new(),
        requests: 0,
    };
    d.name(s1, "s1");
    d.name(s2, "s2");
    let ghost = Uuid::new_v4();
    d.name(ghost, "ghost");
    h.sim.remove_server(ghost);
    let multi: Uuid = MULTIATTACH_VOLUME.parse().unwrap();
    d.name(multi, "multi");
    h.sim.set_multiattach(multi);

    // Version documents and negotiation.
    use reqwest::Method as M;
    d.both("GET /", M::GET, "/", &[], None, false).await;
    d.both("GET /v2.1/", M::GET, "/v2.1/", &[], None, false)
        .await;
    let list1 = format!("/v2.1/servers/{s1}/os-volume_attachments");
    for (label, headers) in [
        ("no version header", vec![]),
        ("latest", vec![("OpenStack-API-Version", "compute latest")]),
        ("2.105", vec![("OpenStack-API-Version", "compute 2.105")]),
        ("abc", vec![("OpenStack-API-Version", "compute abc")]),
        ("legacy 2.5", vec![("X-OpenStack-Nova-API-Version", "2.5")]),
        (
            "both headers",
            vec![
                ("X-OpenStack-Nova-API-Version", "2.5"),
                ("OpenStack-API-Version", "compute 2.60"),
            ],
        ),
    ] {
        d.both(
            &format!("list, {label}"),
            M::GET,
            &list1,
            &headers,
            None,
            true,
        )
        .await;
    }
    d.both("list, no token", M::GET, &list1, &[], None, false)
        .await;

    for mv in ["2.1", "2.60", "2.79", "2.89", "2.100", "2.101", "latest"] {
        let (v1, v2, v3) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        d.name(v1, "v1");
        d.name(v2, "v2");
        d.name(v3, "v3");
        let list = |s: Uuid| format!("/v2.1/servers/{s}/os-volume_attachments");
        let one = |s: Uuid, v: Uuid| format!("/v2.1/servers/{s}/os-volume_attachments/{v}");
        let status = d
            .at(mv, "attach", M::POST, &list(s1), Some(attach_body(v1)))
            .await;
        settle(
            &mut d,
            &format!("{mv} v1"),
            &api,
            &h,
            (s1, v1, true),
            status,
        )
        .await;
        d.at(mv, "list", M::GET, &list(s1), None).await;
        d.at(mv, "show", M::GET, &one(s1, v1), None).await;
        d.at(
            mv,
            "attach again",
            M::POST,
            &list(s1),
            Some(attach_body(v1)),
        )
        .await;
        d.at(
            mv,
            "attach elsewhere",
            M::POST,
            &list(s2),
            Some(attach_body(v1)),
        )
        .await;
        if minor(mv) < 49 {
            d.at(
                mv,
                "attach with a tag",
                M::POST,
                &list(s1),
                Some(json!({"volumeAttachment": {"volumeId": v2.to_string(), "tag": "t1"}})),
            )
            .await;
        }
        if minor(mv) >= 79 {
            let status = d
                .at(
                    mv,
                    "attach with tag and delete_on_termination",
                    M::POST,
                    &list(s1),
                    Some(json!({"volumeAttachment": {"volumeId": v2.to_string(),
                        "tag": "t1", "delete_on_termination": true}})),
                )
                .await;
            settle(
                &mut d,
                &format!("{mv} v2"),
                &api,
                &h,
                (s1, v2, true),
                status,
            )
            .await;
            // Left attached: Nova 34's compute cannot detach a tagged
            // volume from a fake-driver server (`_delete_disk_metadata`
            // reads device metadata only a real hypervisor driver writes:
            // AttributeError, and the mapping stays).
            d.at(mv, "show tagged", M::GET, &one(s1, v2), None).await;
        }
        let status = d.at(mv, "detach", M::DELETE, &one(s1, v1), None).await;
        settle(
            &mut d,
            &format!("{mv} v1"),
            &api,
            &h,
            (s1, v1, false),
            status,
        )
        .await;
        d.at(mv, "detach again", M::DELETE, &one(s1, v1), None)
            .await;
        d.at(mv, "show detached", M::GET, &one(s1, v1), None).await;
        d.at(
            mv,
            "attach to ghost",
            M::POST,
            &list(ghost),
            Some(attach_body(v3)),
        )
        .await;
        d.at(mv, "list of ghost", M::GET, &list(ghost), None).await;
        d.at(mv, "detach from ghost", M::DELETE, &one(ghost, v3), None)
            .await;
        d.at(
            mv,
            "attach a volumeId that is no uuid",
            M::POST,
            &list(s1),
            Some(json!({"volumeAttachment": {"volumeId": "abc"}})),
        )
        .await;
        api.lock(s2, true).await;
        h.sim.lock_server(s2, true);
        d.at(
            mv,
            "attach to a locked server",
            M::POST,
            &list(s2),
            Some(attach_body(v3)),
        )
        .await;
        api.lock(s2, false).await;
        h.sim.lock_server(s2, false);
        let status = d
            .at(
                mv,
                "attach multiattach",
                M::POST,
                &list(s1),
                Some(attach_body(multi)),
            )
            .await;
        if status < 300 {
            settle(
                &mut d,
                &format!("{mv} multi"),
                &api,
                &h,
                (s1, multi, true),
                status,
            )
            .await;
            let status = d
                .at(mv, "detach multiattach", M::DELETE, &one(s1, multi), None)
                .await;
            settle(
                &mut d,
                &format!("{mv} multi"),
                &api,
                &h,
                (s1, multi, false),
                status,
            )
            .await;
        }
    }

    // What the simulator does not model on purpose (see KEPT), last: the
    // two sides' states part here.
    let nobody = Uuid::new_v4();
    d.both(
        "list of a server nobody made",
        M::GET,
        &format!("/v2.1/servers/{nobody}/os-volume_attachments"),
        &[("OpenStack-API-Version", "compute 2.89")],
        None,
        true,
    )
    .await;
    let tagged = Uuid::new_v4();
    d.name(tagged, "tagged");
    let list = format!("/v2.1/servers/{s1}/os-volume_attachments");
    let status = d
        .at(
            "2.89",
            "attach tagged",
            M::POST,
            &list,
            Some(json!({"volumeAttachment": {"volumeId": tagged.to_string(), "tag": "t2"}})),
        )
        .await;
    settle(
        &mut d,
        "2.89 attach tagged",
        &api,
        &h,
        (s1, tagged, true),
        status,
    )
    .await;
    let status = d
        .at(
            "2.89",
            "detach tagged",
            M::DELETE,
            &format!("{list}/{tagged}"),
            None,
        )
        .await;
    assert_eq!(status, 202, "Nova accepts the detach");
    // Nova's compute fails it at once; the simulator's detach is done.
    super::support::eventually(
        Duration::from_secs(10),
        "the simulator detaches",
        || async { !h.sim.is_attached(s1, tagged) },
    )
    .await;
    super::support::eventually(
        Duration::from_secs(20),
        "Nova's compute records the failed detach",
        || async {
            api.actions(s1).await.into_iter().any(|a| {
                a["action"] == "detach_volume"
                    && a["events"]
                        .as_array()
                        .is_some_and(|e| e.iter().any(|e| e["result"] == "Error"))
            })
        },
    )
    .await;
    if api.is_attached(s1, tagged).await {
        d.diffs.push((
            "2.89 detach tagged".into(),
            "effect".into(),
            "attached=true".into(),
            "attached=false".into(),
        ));
    }

    // Every difference kept on purpose, and every kept one still seen.
    let mut unexplained = Vec::new();
    let mut seen = vec![false; KEPT.len()];
    for (req, aspect, nova, simv) in &d.diffs {
        match KEPT
            .iter()
            .position(|k| req.contains(k.request) && aspect == k.aspect)
        {
            Some(i) => seen[i] = true,
            None => unexplained.push(format!(
                "{req} — {aspect}:\n    nova: {nova}\n    sim:  {simv}"
            )),
        }
    }
    let stale: Vec<_> = KEPT
        .iter()
        .zip(&seen)
        .filter(|(_, s)| !**s)
        .map(|(k, _)| format!("{} / {}: {}", k.request, k.aspect, k.why))
        .collect();
    assert!(
        unexplained.is_empty() && stale.is_empty(),
        "{} requests compared; differences not kept on purpose:\n{}\n\nkept differences no longer seen:\n{}",
        d.requests,
        unexplained.join("\n"),
        stale.join("\n")
    );
    h.stop().await;
}

/// After an accepted (202) or answered change, waits until Nova shows it
/// (`attached` or not) and the simulator agrees, so the next request meets
/// the same state on both; a simulator that does not follow is a
/// difference (its effect).
async fn settle(
    d: &mut Differential,
    label: &str,
    api: &Api,
    h: &sim::SimHandle,
    (s, v, attached): (Uuid, Uuid, bool),
    status: u16,
) {
    if status >= 300 {
        return;
    }
    let what = format!("Nova settles after {label} (attached: {attached})");
    super::support::eventually(Duration::from_secs(30), &what, || async {
        api.is_attached(s, v).await == attached
    })
    .await;
    // The simulator's asynchronous attach takes 50 ms.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while h.sim.is_attached(s, v) != attached {
        if tokio::time::Instant::now() >= deadline {
            d.diffs.push((
                label.to_string(),
                "effect".into(),
                format!("attached={attached}"),
                format!("attached={}", !attached),
            ));
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

//! `nova-sim`: a Nova and Keystone simulator for tests and demos. An honest
//! in-memory model of servers, volumes and attachments that answers with
//! the contract's real bodies and messages, with fault injection per request
//! pattern and count, and its ground truth exposed so tests can compare what
//! the service recorded with what really happened.
//!
//! Like a real Nova worker, it finishes processing a request whose client
//! has gone away: the effect runs in its own task.

mod http;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

pub use http::{SimHandle, start};

/// Which requests a fault rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultOp {
    Attach,
    Detach,
    List,
    Show,
    /// Keystone token requests.
    Auth,
    Any,
}

/// What goes wrong.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// Wait before the request takes effect.
    DelayBeforeEffect { ms: u64 },
    /// Take effect, then wait before sending the headers (the lost-response
    /// case when the client gives up first).
    DelayAfterEffect { ms: u64 },
    /// Take effect, then close the connection without answering.
    CloseAfterEffect,
    /// Close the connection without answering and without effect.
    CloseBeforeEffect,
    /// Send the headers and part of the body, then stall for `ms`.
    StallBody { ms: u64, effect: bool },
    /// Send the headers and part of the body, then close the connection.
    TruncateBody { effect: bool },
    /// Answer 200 with a body that is not the contract's JSON.
    GarbageBody,
    /// Answer a Nova fault with this status (500 computeFault, 503 ...).
    Status { code: u16, effect: bool },
    /// Answer a proxy's non-JSON page (502/504).
    ProxyError { code: u16, effect: bool },
    /// Answer 401 from the auth middleware (token expired).
    Unauthorized,
    /// Answer 409 "while it is in task_state ...".
    Conflict,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultRule {
    pub op: FaultOp,
    #[serde(default)]
    pub server_id: Option<Uuid>,
    #[serde(default)]
    pub volume_id: Option<Uuid>,
    /// How many matching requests it hits; `None`: all of them.
    #[serde(default)]
    pub count: Option<u32>,
    pub fault: Fault,
}

impl FaultRule {
    pub fn new(op: FaultOp, fault: Fault) -> Self {
        Self {
            op,
            server_id: None,
            volume_id: None,
            count: Some(1),
            fault,
        }
    }
    pub fn volume(mut self, v: Uuid) -> Self {
        self.volume_id = Some(v);
        self
    }
    pub fn server(mut self, s: Uuid) -> Self {
        self.server_id = Some(s);
        self
    }
    pub fn times(mut self, n: u32) -> Self {
        self.count = Some(n);
        self
    }
    pub fn always(mut self) -> Self {
        self.count = None;
        self
    }
}

/// Behaviour knobs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct SimConfig {
    /// How long a detach takes after its 202 before the attachment is gone.
    pub detach_delay_ms: u64,
    /// At microversion >= 2.101, how long after the 202 the attach appears.
    pub async_attach_delay_ms: u64,
    /// Share (0..1) of attaches that fail later "in the hypervisor" and
    /// vanish from the list, as Nova rolls them back.
    pub rollback_share: f64,
    pub rollback_delay_ms: u64,
    /// Require a Keystone token on Nova requests.
    pub require_auth: bool,
    pub token_ttl_secs: u64,
    pub username: String,
    pub password: String,
    pub project_name: String,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            detach_delay_ms: 0,
            async_attach_delay_ms: 50,
            rollback_share: 0.0,
            rollback_delay_ms: 100,
            require_auth: false,
            token_ttl_secs: 3600,
            username: "demo".into(),
            password: "secret".into(),
            project_name: "demo".into(),
        }
    }
}

/// One attachment as the simulator holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimAttachment {
    pub server_id: Uuid,
    pub volume_id: Uuid,
    pub attachment_id: Uuid,
    pub bdm_uuid: Uuid,
    pub device: String,
    pub tag: Option<String>,
    pub delete_on_termination: bool,
    #[serde(default)]
    pub detaching: bool,
}

/// What really happened, for tests to compare the ledger with.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Truth {
    pub attachments: Vec<SimAttachment>,
    /// Attach requests that took effect (created an attachment), by volume.
    pub attach_effects: HashMap<Uuid, u32>,
    /// Attach requests received, by volume.
    pub attach_requests: HashMap<Uuid, u32>,
    /// Detach requests that took effect, by volume.
    pub detach_effects: HashMap<Uuid, u32>,
    pub detach_requests: HashMap<Uuid, u32>,
    pub list_requests: u64,
    pub token_requests: u64,
    pub rolled_back: u64,
}

/// Attachments indexed by volume and by server, so a simulator holding
/// hundreds of thousands (benchmarks) answers in constant time.
#[derive(Default)]
struct Attachments {
    by_volume: HashMap<Uuid, Vec<SimAttachment>>,
    by_server: HashMap<Uuid, Vec<Uuid>>,
}

impl Attachments {
    fn push(&mut self, a: SimAttachment) {
        self.by_server
            .entry(a.server_id)
            .or_default()
            .push(a.volume_id);
        self.by_volume.entry(a.volume_id).or_default().push(a);
    }

    fn holders(&self, volume: Uuid) -> Vec<Uuid> {
        self.by_volume
            .get(&volume)
            .map(|v| v.iter().map(|a| a.server_id).collect())
            .unwrap_or_default()
    }

    fn find(&self, server: Uuid, volume: Uuid) -> Option<&SimAttachment> {
        self.by_volume
            .get(&volume)?
            .iter()
            .find(|a| a.server_id == server)
    }

    fn find_mut(&mut self, server: Uuid, volume: Uuid) -> Option<&mut SimAttachment> {
        self.by_volume
            .get_mut(&volume)?
            .iter_mut()
            .find(|a| a.server_id == server)
    }

    /// Removes one attachment by its id; true when it was there.
    fn remove(&mut self, volume: Uuid, attachment_id: Uuid) -> bool {
        let Some(list) = self.by_volume.get_mut(&volume) else {
            return false;
        };
        let Some(pos) = list.iter().position(|a| a.attachment_id == attachment_id) else {
            return false;
        };
        let a = list.remove(pos);
        if list.is_empty() {
            self.by_volume.remove(&volume);
        }
        if let Some(vols) = self.by_server.get_mut(&a.server_id)
            && let Some(i) = vols.iter().position(|v| *v == volume)
        {
            vols.remove(i);
        }
        true
    }

    fn of_server(&self, server: Uuid) -> Vec<&SimAttachment> {
        self.by_server
            .get(&server)
            .map(|vols| vols.iter().filter_map(|v| self.find(server, *v)).collect())
            .unwrap_or_default()
    }

    fn all(&self) -> Vec<SimAttachment> {
        self.by_volume.values().flatten().cloned().collect()
    }
}

#[derive(Default)]
struct World {
    attachments: Attachments,
    removed_servers: HashSet<Uuid>,
    removed_volumes: HashSet<Uuid>,
    locked_servers: HashSet<Uuid>,
    multiattach: HashSet<Uuid>,
    faults: Vec<FaultRule>,
    tokens: HashMap<String, chrono::DateTime<chrono::Utc>>,
    expire_all_tokens: bool,
    /// Every token ever issued (tests scan outputs for them).
    issued: Vec<String>,
    truth: Truth,
    next_device: HashMap<Uuid, u32>,
}

/// The simulator's state, shared by its handlers and by tests.
pub struct Sim {
    world: Mutex<World>,
    cfg: Mutex<SimConfig>,
}

/// What an attach request asked for.
pub(crate) struct AttachParams {
    pub device: Option<String>,
    pub tag: Option<String>,
    pub delete_on_termination: bool,
}

/// The outcome of processing an attach or detach, before faults on the way
/// back are applied.
#[derive(Debug, Clone)]
pub(crate) enum Answer {
    Ok(serde_json::Value),
    Accepted,
    Fault {
        status: u16,
        name: &'static str,
        message: String,
    },
}

fn fault(status: u16, message: String) -> Answer {
    let name = match status {
        400 => "badRequest",
        401 => "unauthorized",
        403 => "forbidden",
        404 => "itemNotFound",
        409 => "conflictingRequest",
        413 | 429 => "overLimit",
        503 => "serviceUnavailable",
        _ => "computeFault",
    };
    Answer::Fault {
        status,
        name,
        message,
    }
}

impl Sim {
    pub fn new(cfg: SimConfig) -> Arc<Self> {
        Arc::new(Self {
            world: Mutex::new(World::default()),
            cfg: Mutex::new(cfg),
        })
    }

    fn world(&self) -> std::sync::MutexGuard<'_, World> {
        // A poisoned lock means a handler panicked; the data is still the
        // simulator's best knowledge, keep serving it.
        self.world.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn config(&self) -> SimConfig {
        self.cfg.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_config(&self, cfg: SimConfig) {
        *self.cfg.lock().unwrap_or_else(|p| p.into_inner()) = cfg;
    }

    /// Forgets every attachment, fault and count (benchmark rounds start
    /// from the same empty cloud). Removed/locked servers are forgotten too.
    pub fn reset(&self) {
        *self.world() = World::default();
    }

    pub fn add_fault(&self, rule: FaultRule) {
        self.world().faults.push(rule);
    }

    pub fn clear_faults(&self) {
        self.world().faults.clear();
    }

    pub fn lock_server(&self, server: Uuid, locked: bool) {
        let mut w = self.world();
        if locked {
            w.locked_servers.insert(server);
        } else {
            w.locked_servers.remove(&server);
        }
    }

    pub fn remove_server(&self, server: Uuid) {
        self.world().removed_servers.insert(server);
    }

    pub fn remove_volume(&self, volume: Uuid) {
        self.world().removed_volumes.insert(volume);
    }

    pub fn set_multiattach(&self, volume: Uuid) {
        self.world().multiattach.insert(volume);
    }

    /// Makes every issued token invalid (401 on its next use).
    pub fn expire_tokens(&self) {
        let mut w = self.world();
        w.tokens.clear();
        w.expire_all_tokens = true;
    }

    /// Puts an attachment in place as if it had been made long ago.
    pub fn seed_attachment(&self, server: Uuid, volume: Uuid) {
        let mut w = self.world();
        let device = next_device(&mut w, server);
        w.attachments.push(SimAttachment {
            server_id: server,
            volume_id: volume,
            attachment_id: Uuid::new_v4(),
            bdm_uuid: Uuid::new_v4(),
            device,
            tag: None,
            delete_on_termination: false,
            detaching: false,
        });
    }

    /// Every Keystone token this simulator has issued.
    pub fn issued_tokens(&self) -> Vec<String> {
        self.world().issued.clone()
    }

    pub fn truth(&self) -> Truth {
        let w = self.world();
        let mut t = w.truth.clone();
        t.attachments = w.attachments.all();
        t
    }

    pub fn is_attached(&self, server: Uuid, volume: Uuid) -> bool {
        self.world().attachments.find(server, volume).is_some()
    }

    pub fn attach_effects(&self, volume: Uuid) -> u32 {
        self.world()
            .truth
            .attach_effects
            .get(&volume)
            .copied()
            .unwrap_or(0)
    }

    pub fn attach_requests(&self, volume: Uuid) -> u32 {
        self.world()
            .truth
            .attach_requests
            .get(&volume)
            .copied()
            .unwrap_or(0)
    }

    pub fn detach_requests(&self, volume: Uuid) -> u32 {
        self.world()
            .truth
            .detach_requests
            .get(&volume)
            .copied()
            .unwrap_or(0)
    }

    pub fn list_requests(&self) -> u64 {
        self.world().truth.list_requests
    }

    /// Takes the first matching fault rule, counting it down.
    pub(crate) fn take_fault(
        &self,
        op: FaultOp,
        server: Option<Uuid>,
        volume: Option<Uuid>,
    ) -> Option<Fault> {
        let mut w = self.world();
        let idx = w.faults.iter().position(|r| {
            (r.op == op || r.op == FaultOp::Any)
                && r.server_id.is_none_or(|s| Some(s) == server)
                && r.volume_id.is_none_or(|v| Some(v) == volume)
                && r.count != Some(0)
        })?;
        let rule = &mut w.faults[idx];
        let fault = rule.fault.clone();
        if let Some(n) = rule.count.as_mut() {
            *n -= 1;
            if *n == 0 {
                w.faults.remove(idx);
            }
        }
        Some(fault)
    }

    pub(crate) fn issue_token(
        &self,
        username: &str,
        password: &str,
    ) -> Option<(String, chrono::DateTime<chrono::Utc>)> {
        let cfg = self.config();
        let mut w = self.world();
        w.truth.token_requests += 1;
        if username != cfg.username || password != cfg.password {
            return None;
        }
        let token = format!("gAAAA{}", Uuid::new_v4().simple());
        let expires = chrono::Utc::now() + chrono::Duration::seconds(cfg.token_ttl_secs as i64);
        w.tokens.insert(token.clone(), expires);
        w.issued.push(token.clone());
        w.expire_all_tokens = false;
        Some((token, expires))
    }

    /// Whether a request with this token passes the auth middleware.
    pub(crate) fn token_ok(&self, token: Option<&str>) -> bool {
        let require = self.config().require_auth;
        let w = self.world();
        match token {
            None => !require,
            Some(t) => w.tokens.get(t).is_some_and(|exp| *exp > chrono::Utc::now()),
        }
    }

    fn check_server(w: &World, server: Uuid) -> Option<Answer> {
        if w.removed_servers.contains(&server) {
            return Some(fault(404, format!("Instance {server} could not be found.")));
        }
        None
    }

    /// The synchronous checks of an attach, then (below 2.101) its effect.
    pub(crate) fn attach(
        self: &Arc<Self>,
        server: Uuid,
        volume: Uuid,
        params: AttachParams,
        mv: (u32, u32),
        effect: bool,
    ) -> Answer {
        let AttachParams {
            device,
            tag,
            delete_on_termination,
        } = params;
        let cfg = self.config();
        let mut w = self.world();
        if let Some(a) = Self::check_server(&w, server) {
            return a;
        }
        if w.locked_servers.contains(&server) {
            return fault(409, format!("Instance {server} is locked"));
        }
        if w.removed_volumes.contains(&volume) {
            return fault(404, format!("Volume {volume} could not be found."));
        }
        let holders: Vec<Uuid> = w.attachments.holders(volume);
        if !holders.is_empty() {
            if !w.multiattach.contains(&volume) {
                let list = holders
                    .iter()
                    .map(Uuid::to_string)
                    .collect::<Vec<_>>()
                    .join(" ");
                return fault(
                    400,
                    format!(
                        "Invalid volume: volume {volume} is already attached to instances: {list}"
                    ),
                );
            }
            if holders.contains(&server) {
                return fault(
                    400,
                    format!("Invalid volume: volume {volume} already attached"),
                );
            }
        }
        if !effect {
            return Answer::Accepted;
        }
        let device = device.unwrap_or_else(|| next_device(&mut w, server));
        let att = SimAttachment {
            server_id: server,
            volume_id: volume,
            attachment_id: Uuid::new_v4(),
            bdm_uuid: Uuid::new_v4(),
            device,
            tag,
            delete_on_termination,
            detaching: false,
        };
        let asynchronous = mv >= (2, 101);
        if asynchronous {
            // 202 now; the BDM appears later, as conductor gets to it.
            let sim = self.clone();
            let delay = Duration::from_millis(cfg.async_attach_delay_ms);
            drop(w);
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                sim.materialize(att);
            });
            return Answer::Accepted;
        }
        let body = attach_view(&att, mv);
        drop(w);
        self.materialize(att);
        Answer::Ok(body)
    }

    fn materialize(self: &Arc<Self>, att: SimAttachment) {
        let cfg = self.config();
        let mut w = self.world();
        let volume = att.volume_id;
        if w.attachments.find(att.server_id, volume).is_some() {
            return;
        }
        w.attachments.push(att.clone());
        *w.truth.attach_effects.entry(volume).or_default() += 1;
        drop(w);
        if cfg.rollback_share > 0.0 && rand::random::<f64>() < cfg.rollback_share {
            let sim = self.clone();
            let delay = Duration::from_millis(cfg.rollback_delay_ms);
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let mut w = sim.world();
                if w.attachments.remove(att.volume_id, att.attachment_id) {
                    w.truth.rolled_back += 1;
                }
            });
        }
    }

    pub(crate) fn detach(self: &Arc<Self>, server: Uuid, volume: Uuid, effect: bool) -> Answer {
        let cfg = self.config();
        let mut w = self.world();
        if let Some(a) = Self::check_server(&w, server) {
            return a;
        }
        if w.removed_volumes.contains(&volume) {
            return fault(404, format!("Volume {volume} could not be found."));
        }
        let Some((id, detaching)) = w
            .attachments
            .find(server, volume)
            .map(|a| (a.attachment_id, a.detaching))
        else {
            return fault(
                404,
                format!("Instance {server} is not attached to volume {volume}"),
            );
        };
        if w.locked_servers.contains(&server) {
            return fault(409, format!("Instance {server} is locked"));
        }
        if detaching {
            return fault(
                400,
                "Invalid volume: Invalid input received: Invalid volume: Unable to detach volume. Volume status must be 'in-use' and attach_status must be 'attached' to detach. (HTTP 400)".into(),
            );
        }
        if !effect {
            return Answer::Accepted;
        }
        *w.truth.detach_effects.entry(volume).or_default() += 1;
        if cfg.detach_delay_ms == 0 {
            w.attachments.remove(volume, id);
        } else {
            if let Some(a) = w.attachments.find_mut(server, volume) {
                a.detaching = true;
            }
            let sim = self.clone();
            let delay = Duration::from_millis(cfg.detach_delay_ms);
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                sim.world().attachments.remove(volume, id);
            });
        }
        Answer::Accepted
    }

    pub(crate) fn list(&self, server: Uuid, mv: (u32, u32)) -> Answer {
        let mut w = self.world();
        w.truth.list_requests += 1;
        if let Some(a) = Self::check_server(&w, server) {
            return a;
        }
        let items: Vec<_> = w
            .attachments
            .of_server(server)
            .into_iter()
            .map(|a| list_view(a, mv))
            .collect();
        Answer::Ok(serde_json::json!({ "volumeAttachments": items }))
    }

    pub(crate) fn show(&self, server: Uuid, volume: Uuid, mv: (u32, u32)) -> Answer {
        let w = self.world();
        if let Some(a) = Self::check_server(&w, server) {
            return a;
        }
        match w.attachments.find(server, volume) {
            Some(a) => Answer::Ok(serde_json::json!({ "volumeAttachment": list_view(a, mv) })),
            None => fault(
                404,
                format!("Instance {server} is not attached to volume {volume}"),
            ),
        }
    }

    pub(crate) fn count_request(&self, op: FaultOp, volume: Option<Uuid>) {
        let mut w = self.world();
        if let Some(v) = volume {
            match op {
                FaultOp::Attach => *w.truth.attach_requests.entry(v).or_default() += 1,
                FaultOp::Detach => *w.truth.detach_requests.entry(v).or_default() += 1,
                _ => {}
            }
        }
    }
}

fn next_device(w: &mut World, server: Uuid) -> String {
    let n = w.next_device.entry(server).or_insert(0);
    *n += 1;
    let letter = (b'b' + ((*n - 1) % 25) as u8) as char;
    format!("/dev/vd{letter}")
}

/// The POST 200 body: `id` == volume id at every microversion (2.89 was
/// never applied to POST).
fn attach_view(a: &SimAttachment, mv: (u32, u32)) -> serde_json::Value {
    let mut m = serde_json::json!({
        "device": a.device,
        "id": a.volume_id.to_string(),
        "serverId": a.server_id.to_string(),
        "volumeId": a.volume_id.to_string(),
    });
    if mv >= (2, 70) {
        m["tag"] = serde_json::json!(a.tag);
    }
    if mv >= (2, 79) {
        m["delete_on_termination"] = serde_json::json!(a.delete_on_termination);
    }
    serde_json::json!({ "volumeAttachment": m })
}

/// A list/show item, shaped by microversion.
fn list_view(a: &SimAttachment, mv: (u32, u32)) -> serde_json::Value {
    let mut m = serde_json::json!({
        "device": a.device,
        "serverId": a.server_id.to_string(),
        "volumeId": a.volume_id.to_string(),
    });
    if mv < (2, 89) {
        m["id"] = serde_json::json!(a.volume_id.to_string());
    } else {
        m["attachment_id"] = serde_json::json!(a.attachment_id.to_string());
        m["bdm_uuid"] = serde_json::json!(a.bdm_uuid.to_string());
    }
    if mv >= (2, 70) {
        m["tag"] = serde_json::json!(a.tag);
    }
    if mv >= (2, 79) {
        m["delete_on_termination"] = serde_json::json!(a.delete_on_termination);
    }
    m
}

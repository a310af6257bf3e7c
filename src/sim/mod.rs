//! `nova-sim`: a Nova and Keystone simulator for tests and demos. An honest
//! in-memory model of servers, volumes and attachments that answers with
//! the contract's real bodies and messages, with fault injection per request
//! pattern and count, and its ground truth exposed so tests can compare what
//! the service recorded with what really happened — down to every effect's
//! instant and cause.
//!
//! Like a real Nova worker, it finishes processing a request whose client
//! has gone away: the effect runs in its own task.
//!
//! - `faults.rs`: what can go wrong, per request.
//! - `world.rs`: the state and the ground truth (effects, requests).
//! - `compute.rs`: Nova's behaviour, call by call.
//! - `cinder.rs`: Cinder's view of the volumes (derived from the world),
//!   volumes created and deleted through Cinder.
//! - `servers.rs`: the servers clients can look up and list.
//! - `http/`: the HTTP face (Nova, Cinder, Keystone, the `/sim` admin API).
//! - `netfault.rs`: a TCP fault proxy (silent, reset, refused connections)
//!   to put in front of what the service stands on, PostgreSQL above all.

mod cinder;
mod compute;
mod faults;
mod http;
pub mod netfault;
mod servers;
mod world;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

pub use cinder::{CinderAttachmentView, CinderRead, CinderVolume, PROJECT_ID, VolumeSpec};
pub use faults::{Fault, FaultOp, FaultRule};
pub use http::{SimHandle, start};
pub use servers::ServerView;
pub use world::{
    AttachState, Cause, Change, Effect, HttpRecord, RequestRecord, SimAttachment, Truth,
};

pub(crate) use compute::{AttachParams, DetachEnd};
use world::World;

/// Behaviour knobs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct SimConfig {
    /// How long a detach takes after its 202 before the attachment is gone.
    pub detach_delay_ms: u64,
    /// At microversion >= 2.101, how long after the 202 the attach appears.
    pub async_attach_delay_ms: u64,
    /// How long the hypervisor attach takes after the BDM exists (the
    /// volume is `attaching` meanwhile: a detach is refused with 400).
    pub attach_complete_ms: u64,
    /// Share (0..1) of attaches that fail later "in the hypervisor" and
    /// vanish from the list, as Nova rolls them back.
    pub rollback_share: f64,
    pub rollback_delay_ms: u64,
    /// What Cinder shows after a rolled-back attach: `available` (Nova
    /// deleted the attachment), or e.g. `error_attaching`, which sticks
    /// (and refuses the next reservation) until the status is reset.
    pub rollback_status: String,
    /// How long a volume created through Cinder stays `creating`.
    pub cinder_create_ms: u64,
    /// How long a volume created from an image then stays `downloading`.
    pub cinder_download_ms: u64,
    /// How long a deleted volume stays `deleting` before it is gone.
    pub cinder_delete_ms: u64,
    /// The catalog type of Cinder's endpoint in tokens: `block-storage`,
    /// `volumev3`, or `none` (a cloud without Cinder v3 in its catalog).
    pub catalog_block_storage: String,
    /// Keep every effect and request (`Truth::effects`, `requests`): for
    /// tests that check histories; off by default so a long-running
    /// simulator (benchmarks) stays bounded.
    pub record_history: bool,
    /// Require a Keystone token on Nova requests.
    pub require_auth: bool,
    pub token_ttl_secs: u64,
    pub username: String,
    pub password: String,
    pub project_name: String,
    /// An application credential of `username` Keystone also accepts: (id, name, secret).
    pub application_credential: Option<(String, String, String)>,
    /// The languages the simulated Nova has translations for: a request
    /// whose `Accept-Language` picks one (`de-DE` picks `de`) gets Nova's
    /// fault messages translated into it (`http/i18n.rs`), as Nova's
    /// oslo.i18n translates them. Empty (the default): English only,
    /// whatever a request asks for.
    pub locales: Vec<String>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            detach_delay_ms: 0,
            async_attach_delay_ms: 50,
            attach_complete_ms: 0,
            rollback_share: 0.0,
            rollback_delay_ms: 100,
            rollback_status: "available".into(),
            cinder_create_ms: 0,
            cinder_download_ms: 0,
            cinder_delete_ms: 0,
            catalog_block_storage: "block-storage".into(),
            record_history: false,
            require_auth: false,
            token_ttl_secs: 3600,
            username: "demo".into(),
            password: "secret".into(),
            project_name: "demo".into(),
            application_credential: None,
            locales: Vec::new(),
        }
    }
}

/// The simulator's state, shared by its handlers and by tests.
pub struct Sim {
    world: Mutex<World>,
    cfg: Mutex<SimConfig>,
    /// Cinder's own state (lock after the world, never before).
    cinder: Mutex<cinder::CinderState>,
    /// Servers registered by name (lock after the world, never before).
    servers: Mutex<servers::Servers>,
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

pub(crate) fn fault(status: u16, message: String) -> Answer {
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
        let world = World {
            history: cfg.record_history,
            ..World::default()
        };
        Arc::new(Self {
            world: Mutex::new(world),
            cfg: Mutex::new(cfg),
            cinder: Mutex::default(),
            servers: Mutex::default(),
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
        self.world().history = cfg.record_history;
        *self.cfg.lock().unwrap_or_else(|p| p.into_inner()) = cfg;
    }

    /// Forgets every attachment, fault and count (benchmark rounds start
    /// from the same empty cloud). Removed/locked servers are forgotten too,
    /// and so are Cinder's volumes and the servers registered by name.
    pub fn reset(&self) {
        let history = self.config().record_history;
        *self.world() = World {
            history,
            ..World::default()
        };
        self.cinder_reset();
        self.servers_reset();
    }

    /// Logs a request's method, path and tracing headers (with
    /// `record_history`).
    pub(crate) fn record_http<B>(&self, req: &hyper::Request<B>) {
        let mut w = self.world();
        if !w.history {
            return;
        }
        let header = |name: &str| {
            req.headers()
                .get(name)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        };
        let record = world::HttpRecord {
            method: req.method().to_string(),
            path: req.uri().path().to_string(),
            request_id: header("x-openstack-request-id"),
            traceparent: header("traceparent"),
            tracestate: header("tracestate"),
            accept_language: header("accept-language"),
        };
        w.truth.http.push(record);
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

    /// Deletes a server: Nova detaches its volumes with it.
    pub fn remove_server(&self, server: Uuid) {
        let mut w = self.world();
        w.removed_servers.insert(server);
        let volumes: Vec<Uuid> = w
            .attachments
            .of_server(server)
            .iter()
            .map(|a| a.volume_id)
            .collect();
        for v in volumes {
            w.detach(server, v, Cause::ServerDeleted);
        }
    }

    /// Deletes a volume (force-detached from every server first).
    pub fn remove_volume(&self, volume: Uuid) {
        let mut w = self.world();
        for server in w.attachments.holders(volume) {
            w.detach(server, volume, Cause::VolumeDeleted);
        }
        w.removed_volumes.insert(volume);
    }

    pub fn set_multiattach(&self, volume: Uuid) {
        self.world().multiattach.insert(volume);
    }

    /// Nova's `[compute] max_disk_devices_to_attach` for the host of
    /// `server`: past `max` volumes on it, an attach is refused with 403
    /// TooManyDiskDevices. Negative (Nova's -1): unlimited, the default.
    pub fn set_max_disk_devices(&self, server: Uuid, max: i64) {
        let mut w = self.world();
        match u32::try_from(max) {
            Ok(max) => w.max_disk_devices.insert(server, max),
            Err(_) => w.max_disk_devices.remove(&server),
        };
    }

    /// Attaches a volume behind the service's back (another tool, an
    /// admin); false when Nova would refuse it.
    pub fn attach_out_of_band(&self, server: Uuid, volume: Uuid) -> bool {
        let mut w = self.world();
        let free = w.attachments.holders(volume).is_empty() || w.multiattach.contains(&volume);
        if w.removed_servers.contains(&server) || w.removed_volumes.contains(&volume) || !free {
            return false;
        }
        let device = w.next_device(server);
        w.attach(
            SimAttachment {
                server_id: server,
                volume_id: volume,
                attachment_id: Uuid::new_v4(),
                bdm_uuid: Uuid::new_v4(),
                device,
                tag: None,
                delete_on_termination: false,
                state: AttachState::InUse,
            },
            Cause::OutOfBand,
        )
    }

    /// Detaches a volume behind the service's back; false when it was not
    /// attached there, or not in use yet: as in Nova, only an attachment
    /// that is in use can be detached (Cinder's begin_detaching refuses a
    /// volume still attaching).
    pub fn detach_out_of_band(&self, server: Uuid, volume: Uuid) -> bool {
        let mut w = self.world();
        let in_use = w
            .attachments
            .find(server, volume)
            .is_some_and(|a| a.state == AttachState::InUse);
        in_use && w.detach(server, volume, Cause::OutOfBand)
    }

    /// Makes every issued token invalid (401 on its next use).
    pub fn expire_tokens(&self) {
        let mut w = self.world();
        w.tokens.clear();
        w.expire_all_tokens = true;
    }

    /// Puts an attachment in place as if it had been made long ago (not an
    /// effect: no history is recorded for it).
    pub fn seed_attachment(&self, server: Uuid, volume: Uuid) {
        let mut w = self.world();
        let device = w.next_device(server);
        w.attachments.push(SimAttachment {
            server_id: server,
            volume_id: volume,
            attachment_id: Uuid::new_v4(),
            bdm_uuid: Uuid::new_v4(),
            device,
            tag: None,
            delete_on_termination: false,
            state: AttachState::InUse,
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

    /// The effects and the attach/detach requests about `volumes`, in
    /// order, picked out under the lock: unlike `truth()`, no copy of the
    /// whole record (a long chaos run holds hundreds of thousands of
    /// entries, and copying them all for each history held the lock long
    /// enough to slow every request in flight).
    pub fn truth_of(&self, volumes: &HashSet<Uuid>) -> (Vec<Effect>, Vec<RequestRecord>) {
        let w = self.world();
        let effects = w
            .truth
            .effects
            .iter()
            .filter(|e| volumes.contains(&e.volume_id))
            .cloned()
            .collect();
        let requests = w
            .truth
            .requests
            .iter()
            .filter(|r| volumes.contains(&r.volume_id))
            .cloned()
            .collect();
        (effects, requests)
    }

    /// Drops the fault rules aimed at `servers` or `volumes` that no
    /// request used up (a finished chaos history's): every request scans
    /// the rules, and they would pile up over a long run.
    pub fn forget_faults_of(&self, servers: &HashSet<Uuid>, volumes: &HashSet<Uuid>) {
        self.world().faults.retain(|r| {
            !r.server_id.is_some_and(|s| servers.contains(&s))
                && !r.volume_id.is_some_and(|v| volumes.contains(&v))
        });
    }

    pub fn is_attached(&self, server: Uuid, volume: Uuid) -> bool {
        self.world().attachments.find(server, volume).is_some()
    }

    pub fn attach_effects(&self, volume: Uuid) -> u32 {
        let w = self.world();
        w.truth.attach_effects.get(&volume).copied().unwrap_or(0)
    }

    /// Attaches of `volume` that took effect and were then rolled back.
    pub fn rollbacks(&self, volume: Uuid) -> u32 {
        let w = self.world();
        w.truth.rollbacks.get(&volume).copied().unwrap_or(0)
    }

    pub fn attach_requests(&self, volume: Uuid) -> u32 {
        let w = self.world();
        w.truth.attach_requests.get(&volume).copied().unwrap_or(0)
    }

    pub fn detach_requests(&self, volume: Uuid) -> u32 {
        let w = self.world();
        w.truth.detach_requests.get(&volume).copied().unwrap_or(0)
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
        let idx = w
            .faults
            .iter()
            .position(|r| r.matches(op, server, volume))?;
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

    /// Counts an attach or detach request and, when history is on, records
    /// it; returns its index in the request log.
    pub(crate) fn begin_request(&self, record: RequestRecord) -> Option<usize> {
        let history = self.config().record_history;
        let mut w = self.world();
        let counts = match record.op.as_str() {
            "attach" => &mut w.truth.attach_requests,
            _ => &mut w.truth.detach_requests,
        };
        *counts.entry(record.volume_id).or_default() += 1;
        if !history {
            return None;
        }
        w.truth.requests.push(record);
        Some(w.truth.requests.len() - 1)
    }

    /// Marks a recorded request ended, with the status it was answered with
    /// (0: the connection was closed or the client went away).
    pub(crate) fn end_request(&self, index: usize, status: u16) {
        let mut w = self.world();
        if let Some(r) = w.truth.requests.get_mut(index) {
            r.ended_at = Some(chrono::Utc::now());
            r.status = status;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sim_with(servers: &[Uuid]) -> Arc<Sim> {
        let sim = Sim::new(SimConfig {
            record_history: true,
            ..SimConfig::default()
        });
        for (i, s) in servers.iter().enumerate() {
            sim.add_server(*s, &format!("s{i}"));
        }
        sim
    }

    #[test]
    fn truth_of_picks_the_effects_of_the_volumes_asked_for_in_order() {
        let (s, v1, v2) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let sim = sim_with(&[s]);
        assert!(sim.attach_out_of_band(s, v1));
        assert!(sim.attach_out_of_band(s, v2));
        assert!(sim.detach_out_of_band(s, v1));
        let (effects, requests) = sim.truth_of(&HashSet::from([v1]));
        let changes: Vec<(Change, Uuid)> =
            effects.iter().map(|e| (e.change, e.volume_id)).collect();
        assert_eq!(changes, [(Change::Attached, v1), (Change::Detached, v1)]);
        assert!(requests.is_empty(), "no request was sent");
        assert_eq!(
            sim.truth().effects.len(),
            3,
            "the whole record is untouched"
        );
    }

    #[test]
    fn forget_faults_of_drops_only_the_rules_aimed_at_those_servers_or_volumes() {
        let (s1, s2, v1, v2) = (
            Uuid::new_v4(),
            Uuid::new_v4(),
            Uuid::new_v4(),
            Uuid::new_v4(),
        );
        let sim = sim_with(&[s1, s2]);
        let fault = Fault::Status {
            code: 500,
            effect: false,
        };
        sim.add_fault(FaultRule::new(FaultOp::Attach, fault.clone()).volume(v1));
        sim.add_fault(FaultRule::new(FaultOp::List, fault.clone()).server(s1));
        sim.add_fault(FaultRule::new(FaultOp::Attach, fault.clone()).volume(v2));
        sim.add_fault(FaultRule::new(FaultOp::List, fault.clone()).server(s2));
        sim.forget_faults_of(&HashSet::from([s1]), &HashSet::from([v1]));
        assert!(
            sim.take_fault(FaultOp::Attach, Some(s1), Some(v1))
                .is_none()
        );
        assert!(sim.take_fault(FaultOp::List, Some(s1), None).is_none());
        assert!(
            sim.take_fault(FaultOp::Attach, Some(s2), Some(v2))
                .is_some()
        );
        assert!(sim.take_fault(FaultOp::List, Some(s2), None).is_some());
    }
}

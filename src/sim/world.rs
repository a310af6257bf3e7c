//! The simulated cloud's state: servers, volumes and attachments, and the
//! ground truth tests compare the ledger with — counts, every effect with
//! its instant and cause, and every mutating request with its ids.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::faults::FaultRule;

/// Where an attachment is in its life (Cinder's view, which Nova's list
/// does not show: the BDM is listed from the start).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttachState {
    /// The BDM exists; the hypervisor attach is still running.
    Attaching,
    InUse,
    /// A detach was accepted and runs.
    Detaching,
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
    pub state: AttachState,
}

/// A change of the attachment of a volume to a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Change {
    Attached,
    Detached,
}

/// What made a change happen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Cause {
    /// An API request; `request_id` is the global request id the client
    /// sent (`X-OpenStack-Request-ID`), if any.
    Request { request_id: Option<String> },
    /// Someone else's hand (another tool, an admin), not through the
    /// service.
    OutOfBand,
    /// The hypervisor attach failed and Nova removed the attachment.
    RolledBack,
    /// The server was deleted, and its volumes with it.
    ServerDeleted,
    /// The volume was deleted (detached first).
    VolumeDeleted,
}

/// One change that took effect, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Effect {
    pub at: DateTime<Utc>,
    pub change: Change,
    pub server_id: Uuid,
    pub volume_id: Uuid,
    pub cause: Cause,
}

/// One attach or detach request as the API saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// `attach` or `detach`.
    pub op: String,
    pub server_id: Uuid,
    pub volume_id: Uuid,
    /// The id the client sent (`X-OpenStack-Request-ID`), if any.
    pub global_id: Option<String>,
    /// The id the simulator answered with (`x-openstack-request-id`).
    pub local_id: String,
    pub received_at: DateTime<Utc>,
    /// When its handler ended: answered, or dropped because the client
    /// went away. `None` while it runs.
    pub ended_at: Option<DateTime<Utc>>,
    /// The HTTP status answered, 0 when the connection was closed instead.
    pub status: u16,
}

/// One HTTP request of any kind (Nova, Cinder, Keystone, version
/// documents) with the headers that tie it to its caller's logs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HttpRecord {
    pub method: String,
    pub path: String,
    /// `X-OpenStack-Request-ID`, if sent.
    pub request_id: Option<String>,
    /// W3C `traceparent` and `tracestate`, if sent.
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    /// `Accept-Language`, if sent (the service never sends one; something
    /// in front of Nova may add it).
    #[serde(default)]
    pub accept_language: Option<String>,
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
    /// Attaches the hypervisor failed and Nova rolled back, by volume.
    pub rollbacks: HashMap<Uuid, u32>,
    /// Every change, in order.
    pub effects: Vec<Effect>,
    /// Every attach and detach request, in the order received.
    pub requests: Vec<RequestRecord>,
    /// Every HTTP request, in the order received (with `record_history`).
    #[serde(default)]
    pub http: Vec<HttpRecord>,
}

/// Attachments indexed by volume and by server, so a simulator holding
/// hundreds of thousands (benchmarks) answers in constant time.
#[derive(Default)]
pub(crate) struct Attachments {
    by_volume: HashMap<Uuid, Vec<SimAttachment>>,
    by_server: HashMap<Uuid, Vec<Uuid>>,
}

impl Attachments {
    pub fn push(&mut self, a: SimAttachment) {
        self.by_server
            .entry(a.server_id)
            .or_default()
            .push(a.volume_id);
        self.by_volume.entry(a.volume_id).or_default().push(a);
    }

    pub fn holders(&self, volume: Uuid) -> Vec<Uuid> {
        self.by_volume
            .get(&volume)
            .map(|v| v.iter().map(|a| a.server_id).collect())
            .unwrap_or_default()
    }

    pub fn find(&self, server: Uuid, volume: Uuid) -> Option<&SimAttachment> {
        self.by_volume
            .get(&volume)?
            .iter()
            .find(|a| a.server_id == server)
    }

    pub fn find_by_id_mut(
        &mut self,
        volume: Uuid,
        attachment_id: Uuid,
    ) -> Option<&mut SimAttachment> {
        self.by_volume
            .get_mut(&volume)?
            .iter_mut()
            .find(|a| a.attachment_id == attachment_id)
    }

    /// Removes one attachment by its id.
    pub fn remove(&mut self, volume: Uuid, attachment_id: Uuid) -> Option<SimAttachment> {
        let list = self.by_volume.get_mut(&volume)?;
        let pos = list.iter().position(|a| a.attachment_id == attachment_id)?;
        let a = list.remove(pos);
        if list.is_empty() {
            self.by_volume.remove(&volume);
        }
        if let Some(vols) = self.by_server.get_mut(&a.server_id)
            && let Some(i) = vols.iter().position(|v| *v == volume)
        {
            vols.remove(i);
        }
        Some(a)
    }

    pub fn of_server(&self, server: Uuid) -> Vec<&SimAttachment> {
        self.by_server
            .get(&server)
            .map(|vols| vols.iter().filter_map(|v| self.find(server, *v)).collect())
            .unwrap_or_default()
    }

    pub fn all(&self) -> Vec<SimAttachment> {
        self.by_volume.values().flatten().cloned().collect()
    }
}

#[derive(Default)]
pub(crate) struct World {
    pub attachments: Attachments,
    pub removed_servers: HashSet<Uuid>,
    pub removed_volumes: HashSet<Uuid>,
    pub locked_servers: HashSet<Uuid>,
    pub multiattach: HashSet<Uuid>,
    /// `max_disk_devices_to_attach` by server, where one is set.
    pub max_disk_devices: HashMap<Uuid, u32>,
    pub faults: Vec<FaultRule>,
    pub tokens: HashMap<String, DateTime<Utc>>,
    pub expire_all_tokens: bool,
    /// Every token ever issued (tests scan outputs for them).
    pub issued: Vec<String>,
    pub truth: Truth,
    pub next_device: HashMap<Uuid, u32>,
    /// Whether effects are kept in `truth.effects` (`record_history`).
    pub history: bool,
}

impl World {
    /// Creates an attachment and records the effect; false when the volume
    /// is already attached there.
    pub fn attach(&mut self, att: SimAttachment, cause: Cause) -> bool {
        let volume = att.volume_id;
        // An attach still running when its server (or volume) is deleted
        // does not land: Nova's delete cleans up the block device mappings.
        if self.attachments.find(att.server_id, volume).is_some()
            || self.removed_servers.contains(&att.server_id)
            || self.removed_volumes.contains(&volume)
        {
            return false;
        }
        if matches!(cause, Cause::Request { .. }) {
            *self.truth.attach_effects.entry(volume).or_default() += 1;
        }
        self.record(Change::Attached, att.server_id, volume, cause);
        self.attachments.push(att);
        true
    }

    /// Removes the attachment of `volume` to `server`, recording why;
    /// false when there was none.
    pub fn detach(&mut self, server: Uuid, volume: Uuid, cause: Cause) -> bool {
        let Some(id) = self
            .attachments
            .find(server, volume)
            .map(|a| a.attachment_id)
        else {
            return false;
        };
        self.detach_by_id(volume, id, cause)
    }

    /// Removes one attachment by its id (not a later one of the same pair).
    pub fn detach_by_id(&mut self, volume: Uuid, attachment_id: Uuid, cause: Cause) -> bool {
        let Some(a) = self.attachments.remove(volume, attachment_id) else {
            return false;
        };
        if matches!(cause, Cause::RolledBack) {
            self.truth.rolled_back += 1;
            *self.truth.rollbacks.entry(volume).or_default() += 1;
        }
        self.record(Change::Detached, a.server_id, volume, cause);
        true
    }

    fn record(&mut self, change: Change, server_id: Uuid, volume_id: Uuid, cause: Cause) {
        if !self.history {
            return;
        }
        self.truth.effects.push(Effect {
            at: Utc::now(),
            change,
            server_id,
            volume_id,
            cause,
        });
    }

    pub fn next_device(&mut self, server: Uuid) -> String {
        let n = self.next_device.entry(server).or_insert(0);
        *n += 1;
        let letter = (b'b' + ((*n - 1) % 25) as u8) as char;
        format!("/dev/vd{letter}")
    }
}

/// The POST 200 body: `id` == volume id at every microversion (2.89 was
/// never applied to POST).
pub(crate) fn attach_view(a: &SimAttachment, mv: (u32, u32)) -> serde_json::Value {
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
pub(crate) fn list_view(a: &SimAttachment, mv: (u32, u32)) -> serde_json::Value {
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

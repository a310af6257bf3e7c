//! The servers the simulator knows, for clients that look them up or list
//! them (openstacksdk does before a detach): those registered by name
//! (`POST /sim/servers`) and those holding an attachment. Any other id is
//! a server that exists (tests use fresh ids everywhere) unless removed.
//!
//! Lock order: the world, then this state.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::Sim;
use super::cinder::{PROJECT_ID, USER_ID};

#[derive(Debug, Clone)]
struct ServerRecord {
    name: String,
    created_at: DateTime<Utc>,
}

#[derive(Default)]
pub(crate) struct Servers {
    named: BTreeMap<Uuid, ServerRecord>,
}

/// A server as Nova shows it (the fields clients read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerView {
    pub id: Uuid,
    pub name: String,
    pub locked: bool,
    /// Volumes attached to it (Nova's block-device mappings).
    pub volumes: Vec<(Uuid, bool)>,
    pub created_at: DateTime<Utc>,
}

impl Sim {
    fn servers(&self) -> std::sync::MutexGuard<'_, Servers> {
        // A poisoned lock means a handler panicked; the data is still the
        // simulator's best knowledge, keep serving it.
        self.servers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a server by name (it exists anyway; now it is listed).
    pub fn add_server(&self, id: Uuid, name: &str) {
        self.servers().named.insert(
            id,
            ServerRecord {
                name: name.to_string(),
                created_at: Utc::now(),
            },
        );
    }

    /// The server as Nova shows it; `None` when it was removed.
    pub fn server(&self, id: Uuid) -> Option<ServerView> {
        let w = self.world();
        if w.removed_servers.contains(&id) {
            return None;
        }
        let volumes = w
            .attachments
            .of_server(id)
            .iter()
            .map(|a| (a.volume_id, a.delete_on_termination))
            .collect();
        let locked = w.locked_servers.contains(&id);
        let record = self.servers().named.get(&id).cloned();
        drop(w);
        Some(ServerView {
            id,
            name: record.as_ref().map_or_else(
                || format!("server-{}", &id.simple().to_string()[..8]),
                |r| r.name.clone(),
            ),
            locked,
            volumes,
            created_at: record.map_or(DateTime::UNIX_EPOCH, |r| r.created_at),
        })
    }

    /// The servers listed: registered ones and those holding an attachment,
    /// by id.
    pub fn server_list(&self) -> Vec<ServerView> {
        let mut ids: Vec<Uuid> = self
            .world()
            .attachments
            .all()
            .iter()
            .map(|a| a.server_id)
            .collect();
        ids.extend(self.servers().named.keys().copied());
        ids.sort_unstable();
        ids.dedup();
        ids.into_iter().filter_map(|id| self.server(id)).collect()
    }

    pub(crate) fn servers_reset(&self) {
        self.servers().named.clear();
    }
}

impl ServerView {
    /// `GET /servers/{id}`'s `server` (and `/servers/detail`'s items).
    pub(crate) fn detail(&self, base_url: &str) -> serde_json::Value {
        let created = self
            .created_at
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        serde_json::json!({
            "id": self.id.to_string(),
            "name": self.name,
            "status": "ACTIVE",
            "tenant_id": PROJECT_ID,
            "user_id": USER_ID,
            "created": created,
            "updated": created,
            "hostId": "",
            "addresses": {},
            "accessIPv4": "",
            "accessIPv6": "",
            "image": "",
            "flavor": {"id": "1", "links": [{"href": format!("{base_url}/flavors/1"), "rel": "bookmark"}]},
            "metadata": {},
            "key_name": null,
            "locked": self.locked,
            "progress": 0,
            "config_drive": "",
            "OS-DCF:diskConfig": "MANUAL",
            "OS-EXT-STS:vm_state": "active",
            "OS-EXT-STS:task_state": null,
            "OS-EXT-STS:power_state": 1,
            "os-extended-volumes:volumes_attached": self.volumes.iter().map(|(v, dot)| serde_json::json!({
                "id": v.to_string(), "delete_on_termination": dot,
            })).collect::<Vec<_>>(),
            "links": self.links(base_url),
        })
    }

    /// `GET /servers`'s items.
    pub(crate) fn summary(&self, base_url: &str) -> serde_json::Value {
        serde_json::json!({
            "id": self.id.to_string(),
            "name": self.name,
            "links": self.links(base_url),
        })
    }

    fn links(&self, base_url: &str) -> serde_json::Value {
        serde_json::json!([
            {"href": format!("{base_url}/v2.1/servers/{}", self.id), "rel": "self"},
            {"href": format!("{base_url}/servers/{}", self.id), "rel": "bookmark"},
        ])
    }
}

//! Cinder's view of the simulated cloud, derived from the attachments Nova
//! holds (`world.rs`): a volume with no attachment is `available`; one whose
//! attachment is still attaching is `attaching` (the attachment not listed
//! yet); `in-use` once attached; `detaching` while a detach runs (still
//! listed, as Cinder lists every attachment whose attach_status is
//! `attached`); a removed volume is not found. What Nova does not hold is
//! kept here: volumes created through Cinder's API (`creating`, then
//! `downloading` when made from an image, then ready, each for a configured
//! time, so the create-then-attach race exists), their deletion
//! (`deleting`, then gone), and a status set by hand or by a failed attach
//! (`error_attaching`), which Cinder shows until it is reset.
//!
//! Volumes the simulator has never heard of exist and are available (tests
//! use fresh ids everywhere), unless removed.
//!
//! Lock order: the world, then this state (never the other way round).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;
use uuid::Uuid;

use super::world::{AttachState, World};
use super::{Answer, Sim, fault};

/// The project every token is scoped to, and the one in Cinder's URLs.
pub const PROJECT_ID: &str = "a6944d763bf64ee6a275f1263fae0352";
/// The user every token belongs to.
pub(crate) const USER_ID: &str = "ee4dfb6e5540447cb3741905149d9b6e";

/// A volume Cinder knows more about than Nova does.
#[derive(Debug, Clone)]
struct VolumeRecord {
    name: Option<String>,
    description: Option<String>,
    size: u64,
    created_at: DateTime<Utc>,
    /// `creating` until then.
    created: Instant,
    /// `downloading` (from an image) until then, after `created`.
    downloaded: Instant,
    /// Set by a delete; the volume is removed when it completes.
    deleting: bool,
    /// A status set by hand (`os-reset_status`) or by a failed attach
    /// (`error_attaching`, when configured), with the attachments as they
    /// were then: shown until they change, as Cinder's next transition
    /// overwrites a reset status.
    forced: Option<(String, Snapshot)>,
}

/// A volume's attachments and their states, in attachment-id order.
type Snapshot = Vec<(Uuid, AttachState)>;

fn snapshot(w: &World, volume: Uuid) -> Snapshot {
    let mut snap: Snapshot = w
        .attachments
        .holders(volume)
        .into_iter()
        .filter_map(|s| w.attachments.find(s, volume))
        .map(|a| (a.attachment_id, a.state))
        .collect();
    snap.sort_unstable_by_key(|(id, _)| *id);
    snap
}

#[derive(Default)]
pub(crate) struct CinderState {
    volumes: HashMap<Uuid, VolumeRecord>,
    /// Volume shows received, by volume.
    read_counts: HashMap<Uuid, u32>,
    /// Every volume show, when history is kept (`record_history`).
    reads: Vec<CinderRead>,
}

/// One volume show as Cinder received it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CinderRead {
    pub volume_id: Uuid,
    /// The global request id the client sent (`X-OpenStack-Request-ID`),
    /// when well-formed.
    pub global_id: Option<String>,
    /// The microversion negotiated.
    pub microversion: String,
    pub at: DateTime<Utc>,
}

/// What a create asks for (`POST /v3/{project}/volumes`).
#[derive(Debug, Clone, Default)]
pub struct VolumeSpec {
    pub name: Option<String>,
    pub description: Option<String>,
    pub size: u64,
    pub multiattach: bool,
    /// Made from an image: `downloading` after `creating`.
    pub from_image: bool,
}

/// One attachment as Cinder lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CinderAttachmentView {
    pub server_id: Uuid,
    pub attachment_id: Uuid,
    pub device: String,
}

/// A volume as Cinder shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CinderVolume {
    pub id: Uuid,
    pub name: Option<String>,
    pub description: Option<String>,
    pub size: u64,
    pub status: String,
    pub multiattach: bool,
    /// Only attachments whose attach_status is `attached`.
    pub attachments: Vec<CinderAttachmentView>,
    pub created_at: DateTime<Utc>,
}

impl VolumeRecord {
    /// A volume made long ago (one Cinder learns of by a delete or a
    /// status set by hand).
    fn old() -> Self {
        let now = Instant::now();
        Self {
            name: None,
            description: None,
            size: 1,
            created_at: Utc::now(),
            created: now,
            downloaded: now,
            deleting: false,
            forced: None,
        }
    }

    /// A status set by hand that still holds for attachments `now`.
    fn forced(&self, now: &Snapshot) -> Option<&str> {
        match &self.forced {
            Some((status, then)) if then == now => Some(status),
            _ => None,
        }
    }

    /// The status that does not follow from the attachments, if any:
    /// deleting, set by hand (while they are as they were), or still being
    /// made.
    fn own_status(&self, now: Instant, attachments: &Snapshot) -> Option<&str> {
        if self.deleting {
            Some("deleting")
        } else if let Some(s) = self.forced(attachments) {
            Some(s)
        } else if now < self.created {
            Some("creating")
        } else if now < self.downloaded {
            Some("downloading")
        } else {
            None
        }
    }
}

impl Sim {
    fn cinder(&self) -> std::sync::MutexGuard<'_, CinderState> {
        // A poisoned lock means a handler panicked; the data is still the
        // simulator's best knowledge, keep serving it.
        self.cinder.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The volume as Cinder shows it now; `None` when it does not exist.
    pub fn cinder_volume(&self, volume: Uuid) -> Option<CinderVolume> {
        let w = self.world();
        if w.removed_volumes.contains(&volume) {
            return None;
        }
        let held: Vec<_> = w
            .attachments
            .holders(volume)
            .into_iter()
            .filter_map(|s| w.attachments.find(s, volume).cloned())
            .collect();
        let multiattach = w.multiattach.contains(&volume);
        let snap = snapshot(&w, volume);
        let c = self.cinder();
        drop(w);
        let record = c.volumes.get(&volume);
        let from_attachments = if held.iter().any(|a| a.state == AttachState::Attaching) {
            Some("attaching")
        } else if held.iter().any(|a| a.state == AttachState::Detaching) {
            Some("detaching")
        } else if !held.is_empty() {
            Some("in-use")
        } else {
            None
        };
        // A deletion or a status set by hand wins; then what the attachments
        // say; then a volume still being made; else it is available.
        let now = Instant::now();
        let pinned = record
            .filter(|r| r.deleting || r.forced(&snap).is_some())
            .and_then(|r| r.own_status(now, &snap));
        let status = pinned
            .or(from_attachments)
            .or_else(|| record.and_then(|r| r.own_status(now, &snap)))
            .unwrap_or("available")
            .to_string();
        Some(CinderVolume {
            id: volume,
            name: record.and_then(|r| r.name.clone()),
            description: record.and_then(|r| r.description.clone()),
            size: record.map_or(1, |r| r.size),
            status,
            multiattach,
            attachments: held
                .iter()
                .filter(|a| a.state != AttachState::Attaching)
                .map(|a| CinderAttachmentView {
                    server_id: a.server_id,
                    attachment_id: a.attachment_id,
                    device: a.device.clone(),
                })
                .collect(),
            created_at: record.map_or(DateTime::UNIX_EPOCH, |r| r.created_at),
        })
    }

    /// Every volume Cinder knows of: those created through it and those
    /// Nova holds attachments of.
    pub fn cinder_volumes(&self) -> Vec<CinderVolume> {
        let mut ids: Vec<Uuid> = self
            .world()
            .attachments
            .all()
            .iter()
            .map(|a| a.volume_id)
            .collect();
        ids.extend(self.cinder().volumes.keys().copied());
        ids.sort_unstable();
        ids.dedup();
        ids.into_iter()
            .filter_map(|v| self.cinder_volume(v))
            .collect()
    }

    /// Creates a volume: `creating` for `cinder_create_ms`, then (from an
    /// image) `downloading` for `cinder_download_ms`, then `available`.
    pub fn create_volume(&self, spec: VolumeSpec) -> CinderVolume {
        let cfg = self.config();
        let id = Uuid::new_v4();
        if spec.multiattach {
            self.set_multiattach(id);
        }
        let now = Instant::now();
        let created = now + Duration::from_millis(cfg.cinder_create_ms);
        let downloaded = if spec.from_image {
            created + Duration::from_millis(cfg.cinder_download_ms)
        } else {
            created
        };
        self.cinder().volumes.insert(
            id,
            VolumeRecord {
                name: spec.name,
                description: spec.description,
                size: spec.size.max(1),
                created_at: Utc::now(),
                created,
                downloaded,
                deleting: false,
                forced: None,
            },
        );
        // The id is fresh and not returned yet: nobody can have removed it.
        self.cinder_volume(id).expect("a volume created now exists")
    }

    /// Cinder's delete: refused while anything holds the volume or it is in
    /// a status that forbids it; `deleting` for `cinder_delete_ms`, then
    /// gone (Nova then answers 404 for it too).
    pub(crate) fn delete_volume(self: &Arc<Self>, volume: Uuid) -> Result<(), Answer> {
        let Some(v) = self.cinder_volume(volume) else {
            return Err(fault(404, format!("Volume {volume} could not be found.")));
        };
        const DELETABLE: &[&str] = &[
            "available",
            "error",
            "error_restoring",
            "error_extending",
            "error_managing",
        ];
        if !v.attachments.is_empty() || !DELETABLE.contains(&v.status.as_str()) {
            return Err(fault(
                400,
                format!(
                    "Invalid volume: Volume status must be {} and must not be migrating, attached, belong to a group, have snapshots, awaiting a transfer, or be disassociated from snapshots after volume transfer.",
                    DELETABLE.join(" or ")
                ),
            ));
        }
        let delay = Duration::from_millis(self.config().cinder_delete_ms);
        {
            let mut c = self.cinder();
            c.volumes
                .entry(volume)
                .or_insert_with(VolumeRecord::old)
                .deleting = true;
        }
        if delay.is_zero() {
            self.finish_delete(volume);
        } else {
            let sim = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                sim.finish_delete(volume);
            });
        }
        Ok(())
    }

    fn finish_delete(&self, volume: Uuid) {
        self.remove_volume(volume);
        self.cinder().volumes.remove(&volume);
    }

    /// Sets the status Cinder shows for `volume` (as `os-reset_status`
    /// does) until its attachments change, or with `None` goes back to the
    /// derived one.
    pub fn force_volume_status(&self, volume: Uuid, status: Option<String>) {
        let w = self.world();
        self.set_forced(&w, volume, status);
    }

    fn set_forced(&self, w: &World, volume: Uuid, status: Option<String>) {
        let snap = snapshot(w, volume);
        self.cinder()
            .volumes
            .entry(volume)
            .or_insert_with(VolumeRecord::old)
            .forced = status.map(|s| (s, snap));
    }

    /// Cinder's refusal to reserve the volume for an attach (what Nova
    /// relays as 400 below 2.101): its own status must be available or
    /// downloading (and in-use for a multiattach volume, which the
    /// attachments decide). Called with the world locked.
    pub(crate) fn cinder_reserve_refusal(&self, w: &World, volume: Uuid) -> Option<Answer> {
        let multiattach = w.multiattach.contains(&volume);
        let snap = snapshot(w, volume);
        let c = self.cinder();
        let status = c.volumes.get(&volume)?.own_status(Instant::now(), &snap)?;
        let allowed: &[&str] = if multiattach {
            &["available", "in-use", "downloading"]
        } else {
            &["available", "downloading"]
        };
        if allowed.contains(&status) {
            return None;
        }
        let allowed = allowed.join(" or ");
        Some(fault(
            400,
            format!(
                "Invalid input received: Invalid volume: Volume {volume} status must be {allowed} to reserve, but the current status is {status}. (HTTP 400) (Request-ID: req-{})",
                Uuid::new_v4()
            ),
        ))
    }

    /// The hypervisor attach failed and Nova removed the attachment: Cinder
    /// shows `rollback_status` (`available` by default; `error_attaching`
    /// sticks until reset or the next attach). Called with the world
    /// locked, after the attachment was removed.
    pub(crate) fn cinder_attach_failed(&self, w: &World, volume: Uuid) {
        let status = self.config().rollback_status;
        if status != "available" {
            self.set_forced(w, volume, Some(status));
        }
    }

    pub(crate) fn cinder_reset(&self) {
        *self.cinder() = CinderState::default();
    }

    /// Counts (and, with history on, records) a volume show.
    pub(crate) fn record_cinder_read(&self, read: CinderRead) {
        let history = self.config().record_history;
        let mut c = self.cinder();
        *c.read_counts.entry(read.volume_id).or_default() += 1;
        if history {
            c.reads.push(read);
        }
    }

    /// How many times Cinder was asked for `volume`.
    pub fn cinder_read_count(&self, volume: Uuid) -> u32 {
        self.cinder().read_counts.get(&volume).copied().unwrap_or(0)
    }

    /// Every volume show received (with `record_history`), in order.
    pub fn cinder_reads(&self) -> Vec<CinderRead> {
        self.cinder().reads.clone()
    }
}

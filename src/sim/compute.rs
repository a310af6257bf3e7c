//! Nova's behaviour: the synchronous checks of each call in the order Nova
//! makes them, the effect, and what runs after the answer (the hypervisor
//! attach, a rollback, a slow detach) — with the contract's real messages.

use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use super::world::{AttachState, Cause, SimAttachment, World, attach_view, list_view};
use super::{Answer, Sim, fault};

/// What an attach request asked for.
pub(crate) struct AttachParams {
    pub device: Option<String>,
    pub tag: Option<String>,
    pub delete_on_termination: bool,
    /// The hypervisor fails this attach (`Fault::RollBack`).
    pub roll_back: bool,
}

/// How the detach of an accepted request ends.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum DetachEnd {
    Detached,
    /// The guest refused: the volume is in use again, the attachment stays.
    Refused,
}

const NOT_IN_USE: &str = "Invalid volume: Invalid input received: Invalid volume: Unable to detach volume. Volume status must be 'in-use' and attach_status must be 'attached' to detach. (HTTP 400)";

fn check_server(w: &World, server: Uuid) -> Option<Answer> {
    w.removed_servers
        .contains(&server)
        .then(|| fault(404, format!("Instance {server} could not be found.")))
}

impl Sim {
    /// The synchronous checks of an attach, then (below 2.101) its effect.
    pub(crate) fn attach(
        self: &Arc<Self>,
        server: Uuid,
        volume: Uuid,
        params: AttachParams,
        mv: (u32, u32),
        cause: Option<Cause>,
    ) -> Answer {
        let mut w = self.world();
        if let Some(refused) = attach_refusal(&w, server, volume) {
            return refused;
        }
        // Nova's reservation checks the caller can see multiattach
        // volumes (compute API 2.60).
        if w.multiattach.contains(&volume) && mv < (2, 60) {
            return fault(
                400,
                "Multiattach volumes are only supported starting with compute API version 2.60."
                    .into(),
            );
        }
        // Below 2.101 the compute host's device reservation, then Cinder's,
        // run before the answer.
        if mv < (2, 101)
            && let Some(refused) =
                too_many_disks(&w, server).or_else(|| self.cinder_reserve_refusal(&w, volume))
        {
            return refused;
        }
        let Some(cause) = cause else {
            return Answer::Accepted;
        };
        let cfg = self.config();
        let roll_back = params.roll_back;
        let device = params.device.unwrap_or_else(|| w.next_device(server));
        let att = SimAttachment {
            server_id: server,
            volume_id: volume,
            attachment_id: Uuid::new_v4(),
            bdm_uuid: Uuid::new_v4(),
            device,
            tag: params.tag,
            delete_on_termination: params.delete_on_termination,
            state: AttachState::Attaching,
        };
        drop(w);
        if mv >= (2, 101) {
            // 202 now; the BDM appears later, as conductor gets to it.
            let sim = self.clone();
            let delay = Duration::from_millis(cfg.async_attach_delay_ms);
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                // When conductor's own checks fail nothing happens: Nova's
                // asynchronous attach reports nothing back.
                let refused = {
                    let w = sim.world();
                    attach_refusal(&w, server, volume).is_some()
                        || too_many_disks(&w, server).is_some()
                        || sim.cinder_reserve_refusal(&w, volume).is_some()
                };
                if !refused {
                    sim.materialize(att, cause, roll_back);
                }
            });
            return Answer::Accepted;
        }
        let body = attach_view(&att, mv);
        self.materialize(att, cause, roll_back);
        Answer::Ok(body)
    }

    /// The BDM exists from now; the hypervisor attach then completes or
    /// fails (and Nova removes the BDM again): when `roll_back`, or by
    /// chance (`rollback_share`).
    pub(crate) fn materialize(self: &Arc<Self>, att: SimAttachment, cause: Cause, roll_back: bool) {
        let cfg = self.config();
        let (volume, id) = (att.volume_id, att.attachment_id);
        if !self.world().attach(att, cause) {
            return;
        }
        let rollback =
            roll_back || (cfg.rollback_share > 0.0 && rand::random::<f64>() < cfg.rollback_share);
        let delay = if rollback {
            cfg.rollback_delay_ms.max(cfg.attach_complete_ms)
        } else {
            cfg.attach_complete_ms
        };
        let sim = self.clone();
        let complete = move || {
            let mut w = sim.world();
            if rollback {
                w.detach_by_id(volume, id, Cause::RolledBack);
                sim.cinder_attach_failed(&w, volume);
            } else if let Some(a) = w.attachments.find_by_id_mut(volume, id) {
                a.state = AttachState::InUse;
            }
        };
        if delay == 0 {
            complete();
        } else {
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(delay)).await;
                complete();
            });
        }
    }

    /// The synchronous checks of a detach, then its start; the attachment
    /// goes after the detach delay (or stays, when `end` is `Refused`).
    pub(crate) fn detach(
        self: &Arc<Self>,
        server: Uuid,
        volume: Uuid,
        cause: Option<Cause>,
        end: DetachEnd,
    ) -> Answer {
        let cfg = self.config();
        let mut w = self.world();
        if let Some(a) = check_server(&w, server) {
            return a;
        }
        if w.removed_volumes.contains(&volume) {
            return fault(404, format!("Volume {volume} could not be found."));
        }
        let Some((id, state)) = w
            .attachments
            .find(server, volume)
            .map(|a| (a.attachment_id, a.state))
        else {
            return fault(
                404,
                format!("Instance {server} is not attached to volume {volume}"),
            );
        };
        if w.locked_servers.contains(&server) {
            return fault(409, format!("Instance {server} is locked"));
        }
        if state != AttachState::InUse {
            // Cinder's begin_detaching: only an in-use, attached volume.
            return fault(400, NOT_IN_USE.into());
        }
        let Some(cause) = cause else {
            return Answer::Accepted;
        };
        if cfg.detach_delay_ms == 0 && end == DetachEnd::Detached {
            *w.truth.detach_effects.entry(volume).or_default() += 1;
            w.detach_by_id(volume, id, cause);
            return Answer::Accepted;
        }
        if let Some(a) = w.attachments.find_by_id_mut(volume, id) {
            a.state = AttachState::Detaching;
        }
        drop(w);
        let sim = self.clone();
        let delay = Duration::from_millis(cfg.detach_delay_ms);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let mut w = sim.world();
            match end {
                DetachEnd::Detached => {
                    if w.detach_by_id(volume, id, cause) {
                        *w.truth.detach_effects.entry(volume).or_default() += 1;
                    }
                }
                DetachEnd::Refused => {
                    if let Some(a) = w.attachments.find_by_id_mut(volume, id) {
                        a.state = AttachState::InUse;
                    }
                }
            }
        });
        Answer::Accepted
    }

    pub(crate) fn list(&self, server: Uuid, mv: (u32, u32)) -> Answer {
        let mut w = self.world();
        w.truth.list_requests += 1;
        if let Some(a) = check_server(&w, server) {
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
        if let Some(a) = check_server(&w, server) {
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
}

/// The compute host's refusal to reserve one more device name on `server`
/// (`reserve_block_device_name`): Nova's 403 TooManyDiskDevices once the
/// server holds `max_disk_devices_to_attach` volumes (Nova counts its root
/// and ephemeral disks too; the simulator's servers have none).
fn too_many_disks(w: &World, server: Uuid) -> Option<Answer> {
    let max = *w.max_disk_devices.get(&server)?;
    (w.attachments.of_server(server).len() >= max as usize).then(|| {
        fault(
            403,
            format!(
                "The maximum allowed number of disk devices ({max}) to attach to a single instance has been exceeded."
            ),
        )
    })
}

/// Nova's synchronous refusals of an attach, in its order: the server, the
/// lock, the volume, then a volume already attached.
fn attach_refusal(w: &World, server: Uuid, volume: Uuid) -> Option<Answer> {
    if let Some(a) = check_server(w, server) {
        return Some(a);
    }
    if w.locked_servers.contains(&server) {
        return Some(fault(409, format!("Instance {server} is locked")));
    }
    if w.removed_volumes.contains(&volume) {
        return Some(fault(404, format!("Volume {volume} could not be found.")));
    }
    let holders = w.attachments.holders(volume);
    if holders.is_empty() {
        return None;
    }
    if !w.multiattach.contains(&volume) {
        let list = holders
            .iter()
            .map(Uuid::to_string)
            .collect::<Vec<_>>()
            .join(" ");
        return Some(fault(
            400,
            format!("Invalid volume: volume {volume} is already attached to instances: {list}"),
        ));
    }
    holders.contains(&server).then(|| {
        fault(
            400,
            format!("Invalid volume: volume {volume} already attached"),
        )
    })
}

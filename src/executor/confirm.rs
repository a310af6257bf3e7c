//! Confirming with Cinder, as cinder-csi does (`--confirm-with cinder`, the
//! default when Cinder can be found):
//!
//! - before the first request (`precheck`): a volume already attached to
//!   the server is SUCCEEDED and one attached elsewhere FAILED, without a
//!   request; a volume still being created waits (within the budget); one
//!   in an error status, being deleted or unknown to Cinder is FAILED;
//! - after the table decided SUCCEEDED (`confirm`): an attach is SUCCEEDED
//!   only once Cinder lists the volume attached to the server (`in-use`),
//!   watched while it is `reserved`/`attaching`; one that went back to
//!   `available` with Nova's mapping gone, or to `error_attaching`, was
//!   rolled back: FAILED `ATTACH_ROLLED_BACK`. A detach is SUCCEEDED once
//!   Cinder no longer lists it attached to the server. Not confirmed by the
//!   answer-by instant: UNKNOWN, and the reconciler confirms.
//!
//! Nova's attachment list stays the way to re-observe a lost response: it
//! shows the mapping from the reservation on, so it tells whether a request
//! took effect; Cinder tells whether that effect is a usable attachment.
//! Without Cinder (`--confirm-with nova-list`, or none found) none of this
//! runs and Nova's list decides alone.
//!
//! Why it is one file: a fifth of it is tests; the rest is one protocol,
//! the precheck and the confirmation reading the same Cinder views into the
//! same decisions.

use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;

use crate::domain::{
    Action, AttachmentInfo, Budget, NewEvent, OperationError, Reason, Resolution, State, event,
};
use crate::nova::{
    AttachProgress, CinderClient, CinderError, CinderErrorKind, Confirmation, DetachProgress,
    RequestId, VolumeStatus, VolumeView,
};
use crate::store::NewOperation;

use super::Executor;
use super::observe::{Precheck, push_observation};
use super::run::{Decision, Run, Seen};

/// The longest a pre-check may take: it only spares a request, so a slow
/// Cinder is not waited for long (a quarter of the budget, at most this).
const PRECHECK_MAX: Duration = Duration::from_secs(10);

/// What one look at Cinder says about an operation's volume and server.
pub(crate) enum CinderSays {
    /// Attached to the server (attach) or no longer (detach): confirmed.
    Confirmed(Option<AttachmentInfo>),
    /// Under way (`reserved`, `attaching`, `detaching`, or not started).
    Pending(VolumeStatus),
    /// Back to not attached after an attach (see `confirm`), or in an
    /// error status.
    NotAttached(VolumeStatus),
    /// Cinder does not know the volume (deleted).
    VolumeGone,
    /// The look failed.
    Failed(CinderError),
    /// No Cinder to ask (`--confirm-with nova-list`, or none found).
    NotAsked,
}

impl Executor {
    /// A Cinder read, timed into `cinder_request_duration_seconds` under
    /// what it is for (`what`) and its outcome.
    pub(crate) async fn cinder_timed<T>(
        &self,
        what: &'static str,
        read: impl std::future::Future<Output = Result<T, CinderError>>,
    ) -> Result<T, CinderError> {
        let started = Instant::now();
        let result = read.await;
        let outcome = match &result {
            Ok(_) => "ok",
            Err(e) => e.kind.as_str(),
        };
        self.metrics
            .nova
            .cinder(what, outcome, started.elapsed().as_secs_f64());
        result
    }

    /// The Cinder client when attaches and detaches are confirmed with it.
    /// A mode that cannot be known now (no Keystone token) is logged in the
    /// run and treated as "no Cinder": Nova's list decides.
    pub(crate) async fn cinder(
        &self,
        events: &mut Vec<NewEvent>,
        until: Instant,
    ) -> Option<&CinderClient> {
        match self.nova.confirmation(until).await {
            Ok(Confirmation::Cinder(c)) => Some(c),
            Ok(Confirmation::NovaList) => None,
            Err(e) => {
                events.push(
                    NewEvent::new(
                        event::OBSERVED,
                        format!(
                            "could not tell whether Cinder confirms: {}; Nova's list decides",
                            e.clock()
                        ),
                    )
                    .with_all(&e.metadata()),
                );
                None
            }
        }
    }

    /// cinder-csi's check before the first request of a new operation; its
    /// events go with the intent. A decided or waiting operation is
    /// recorded `pending` with no attempt: nothing has been sent.
    pub(crate) async fn precheck(&self, new: &mut NewOperation, budget: &Budget) -> Precheck {
        let now = Instant::now();
        let until = now + (budget.send_by.saturating_duration_since(now) / 4).min(PRECHECK_MAX);
        let Some(cinder) = self.cinder(&mut new.events, until).await else {
            // An Ensure call asks for a state, not a request: Nova's list
            // tells whether the world is so already.
            return if new.ensure() {
                self.precheck_by_list(new, until).await
            } else {
                Precheck::Send
            };
        };
        let rid = RequestId::for_operation(new.id);
        let (pre, ev) = match self
            .cinder_timed("precheck", cinder.volume_as(&rid, new.volume_id, until))
            .await
        {
            Ok(v) => {
                let pre = match new.action {
                    Action::Attach => precheck_attach(new.id, new.server_id, &v),
                    Action::Detach => precheck_detach(new.server_id, &v),
                };
                let mut ev = volume_event("before sending", &v, new.server_id);
                if let (Action::Detach, Some(a)) = (new.action, v.attached_to(new.server_id)) {
                    ev = ev.with(DETACH_TARGET, &a.attachment_id);
                }
                (pre, ev)
            }
            Err(e) if e.kind == CinderErrorKind::VolumeNotFound => {
                let pre = match new.action {
                    Action::Attach => Precheck::Decided(Decision::failed(
                        Resolution::Reobserved,
                        OperationError::new(
                            Reason::NovaVolumeNotFound,
                            format!(
                                "Cinder does not know volume {}: nothing sent",
                                new.volume_id
                            ),
                        )
                        .with("operation_id", new.id),
                    )),
                    Action::Detach => Precheck::Decided(Decision::succeeded(
                        Resolution::Reobserved,
                        None,
                        "Cinder does not know the volume: nothing is attached; nothing sent",
                    )),
                };
                (pre, cinder_failed_event("before sending", &e))
            }
            // Nova is asked anyway and decides; Cinder confirms later.
            Err(e) => (Precheck::Send, cinder_failed_event("before sending", &e)),
        };
        new.events.push(ev);
        if !matches!(pre, Precheck::Send) {
            new.state = State::Pending;
            new.attempts = 0;
        }
        pre
    }

    /// Waits (within the send-by instant) for a volume being created or
    /// downloaded to be ready; `None` when it is, else the decision.
    pub(crate) async fn wait_ready(&self, run: &mut Run) -> Option<Decision> {
        let until = run.budget.send_by;
        let mut pause = self.settings.observe_interval;
        let mut last = VolumeStatus::Creating;
        loop {
            // No Cinder to ask any more: Nova decides.
            let cinder = self.cinder(&mut run.events, until).await?;
            let rid = RequestId::for_operation(run.op.id);
            match self
                .cinder_timed(
                    "wait_ready",
                    cinder.volume_as(&rid, run.op.volume_id, until),
                )
                .await
            {
                Ok(v)
                    if !matches!(v.status, VolumeStatus::Creating | VolumeStatus::Downloading) =>
                {
                    push_observation(
                        run,
                        volume_event("waiting for the volume", &v, run.op.server_id),
                    );
                    return None;
                }
                Ok(v) => {
                    push_observation(
                        run,
                        volume_event("waiting for the volume", &v, run.op.server_id),
                    );
                    last = v.status;
                }
                Err(e) => push_observation(run, cinder_failed_event("waiting for the volume", &e)),
            }
            let next = Instant::now() + pause;
            if next >= until {
                let err = OperationError::new(
                    Reason::NovaVolumeNotReady,
                    format!("the volume was still {last} at the deadline: nothing sent"),
                )
                .with("operation_id", run.op.id)
                .with("volume_status", last.as_str());
                return Some(Decision::failed(Resolution::Reobserved, err));
            }
            tokio::time::sleep_until(next).await;
            pause = (pause * 2).min(self.settings.observe_interval_max);
        }
    }

    /// One look at Cinder for `run`'s operation, logged in the run.
    pub(crate) async fn cinder_says(&self, run: &mut Run, until: Instant) -> CinderSays {
        let Some(cinder) = self.cinder(&mut run.events, until).await else {
            return CinderSays::NotAsked;
        };
        let rid = RequestId::for_operation(run.op.id);
        let server = run.op.server_id;
        match self
            .cinder_timed("confirm", cinder.volume_as(&rid, run.op.volume_id, until))
            .await
        {
            Ok(v) => {
                push_observation(run, volume_event("confirming", &v, server));
                match run.op.action {
                    Action::Attach => match v.attach_progress(server) {
                        AttachProgress::Attached => {
                            CinderSays::Confirmed(v.attached_to(server).map(|a| AttachmentInfo {
                                id: a.attachment_id.clone(),
                                device: a.device.clone(),
                                tag: None,
                                delete_on_termination: false,
                            }))
                        }
                        AttachProgress::Attaching => CinderSays::Pending(v.status),
                        AttachProgress::NotAttached => CinderSays::NotAttached(v.status),
                    },
                    Action::Detach => match v.detach_progress(server) {
                        DetachProgress::Detached => CinderSays::Confirmed(None),
                        DetachProgress::Detaching | DetachProgress::Attached => {
                            CinderSays::Pending(v.status)
                        }
                    },
                }
            }
            Err(e) if e.kind == CinderErrorKind::VolumeNotFound => {
                push_observation(run, cinder_failed_event("confirming", &e));
                CinderSays::VolumeGone
            }
            Err(e) => {
                push_observation(run, cinder_failed_event("confirming", &e));
                CinderSays::Failed(e)
            }
        }
    }

    /// The id of the attachment of `run`'s volume to its server, as Cinder
    /// names it now (`None`: not attached there); `Err` says why it could
    /// not be told.
    pub(crate) async fn cinder_attachment_here(
        &self,
        run: &mut Run,
        until: Instant,
    ) -> Result<Option<String>, String> {
        let Some(cinder) = self.cinder(&mut run.events, until).await else {
            return Err("no Cinder to ask which attachment it is".into());
        };
        let rid = RequestId::for_operation(run.op.id);
        let server = run.op.server_id;
        match self
            .cinder_timed(
                "name_attachment",
                cinder.volume_as(&rid, run.op.volume_id, until),
            )
            .await
        {
            Ok(v) => {
                push_observation(run, volume_event("naming the attachment", &v, server));
                Ok(v.attached_to(server).map(|a| a.attachment_id.clone()))
            }
            Err(e) => {
                push_observation(run, cinder_failed_event("naming the attachment", &e));
                Err(format!(
                    "Cinder could not name the attachment: {}",
                    e.clock()
                ))
            }
        }
    }

    /// A SUCCEEDED decision, confirmed with Cinder (see the module's
    /// comment); any other decision, or no Cinder, is returned as it is.
    pub(crate) async fn confirm(&self, run: &mut Run, d: Decision) -> Decision {
        if d.state != State::Succeeded {
            return d;
        }
        let until = run.budget.observe_by();
        let mut pause = self.settings.observe_interval;
        loop {
            let last = match self.cinder_says(run, until).await {
                CinderSays::NotAsked => return d,
                CinderSays::Confirmed(att) => return confirmed(run, d, att),
                CinderSays::VolumeGone => return gone(run, d),
                CinderSays::NotAttached(status) if status.is_error() => {
                    return rolled_back(run, &status);
                }
                CinderSays::NotAttached(status) => {
                    // Nova's mapping comes before Cinder's reservation:
                    // only with the mapping gone was it rolled back.
                    match self.observe(run, until).await {
                        Ok(Seen::Absent) => return rolled_back(run, &status),
                        Ok(Seen::ServerGone) => return server_gone(run),
                        Ok(Seen::Attached(_)) | Err(_) => {}
                    }
                    status.to_string()
                }
                CinderSays::Pending(status) => status.to_string(),
                CinderSays::Failed(e) => format!("unknown: {}", e.clock()),
            };
            let next = Instant::now() + pause;
            if next >= until {
                return not_confirmed(run, &last);
            }
            tokio::time::sleep_until(next).await;
            pause = (pause * 2).min(self.settings.observe_interval_max);
        }
    }
}

/// The attach pre-check's verdict on what Cinder shows.
fn precheck_attach(id: Uuid, server: Uuid, v: &VolumeView) -> Precheck {
    // Attached here and `in-use`: done. One `detaching` from here is on its
    // way out (Nova may have removed it already): Nova decides.
    if let Some(a) = v.attached_to(server)
        && v.status == VolumeStatus::InUse
    {
        let d = Decision::succeeded(
            Resolution::Reobserved,
            Some(AttachmentInfo {
                id: a.attachment_id.clone(),
                device: a.device.clone(),
                tag: None,
                delete_on_termination: false,
            }),
            "Cinder shows the volume attached to this server already: nothing sent",
        );
        return Precheck::Decided(d);
    }
    if v.attached_to(server).is_some() {
        return Precheck::Send;
    }
    if !v.multiattach && !v.attachments.is_empty() {
        let servers: Vec<String> = v
            .attachments
            .iter()
            .filter_map(|a| a.server_id.clone())
            .collect();
        let err = OperationError::new(
            Reason::AlreadyAttachedElsewhere,
            format!(
                "Cinder shows volume {} attached to another server: {}; nothing sent",
                v.id,
                servers.join(" ")
            ),
        )
        .with("attached_to", servers.join(" "))
        .with("operation_id", id);
        return Precheck::Decided(Decision::failed(Resolution::Reobserved, err));
    }
    match &v.status {
        VolumeStatus::Creating | VolumeStatus::Downloading => Precheck::WaitReady,
        s if s.is_error() || *s == VolumeStatus::Deleting => {
            let err = OperationError::new(
                Reason::VolumeInError,
                format!(
                    "Cinder shows volume {} {s}: nothing sent; an operator resets it first",
                    v.id
                ),
            )
            .with("volume_status", s.as_str())
            .with("operation_id", id);
            Precheck::Decided(Decision::failed(Resolution::Reobserved, err))
        }
        _ => Precheck::Send,
    }
}

/// The detach pre-check: nothing is sent when Cinder shows the volume
/// detached from the server for good — `available` with no attachment at
/// all, or (not multiattach) `in-use` on other servers only, where Cinder
/// refuses any attachment to this one (as cinder-csi answers success). Any
/// other status may hide an attachment to this server on its way
/// (`reserved`/`attaching`), which a skipped detach would leave behind.
fn precheck_detach(server: Uuid, v: &VolumeView) -> Precheck {
    let detail = if v.status == VolumeStatus::Available && v.attachments.is_empty() {
        "Cinder shows the volume available and attached nowhere: nothing to detach; nothing sent"
    } else if v.status == VolumeStatus::InUse
        && !v.multiattach
        && !v.attachments.is_empty()
        && v.attached_to(server).is_none()
    {
        "Cinder shows the volume in-use on another server only: not attached to this one; nothing sent"
    } else {
        return Precheck::Send;
    };
    Precheck::Decided(Decision::succeeded(Resolution::Reobserved, None, detail))
}

fn confirmed(run: &Run, mut d: Decision, att: Option<AttachmentInfo>) -> Decision {
    d.detail = format!(
        "{}; confirmed by Cinder ({})",
        d.detail,
        match run.op.action {
            Action::Attach => "in-use, attached to the server",
            Action::Detach => "no longer attached to the server",
        }
    );
    if run.op.action == Action::Attach && d.attachment.is_none() {
        d.attachment = att;
    }
    d
}

/// Cinder no longer knows the volume: nothing is attached; an attach is
/// over.
fn gone(run: &Run, d: Decision) -> Decision {
    match run.op.action {
        Action::Detach => d,
        Action::Attach => Decision::failed(
            Resolution::Reobserved,
            OperationError::new(
                Reason::NovaVolumeNotFound,
                "the volume was deleted before Cinder showed it attached",
            )
            .with("operation_id", run.op.id),
        ),
    }
}

/// Rolled back: decided FAILED, and what a later look should find is the
/// volume not on the server (an attach that shows up later is drift).
fn rolled_back(run: &mut Run, status: &VolumeStatus) -> Decision {
    run.last_seen = Some(false);
    let err = OperationError::new(
        Reason::AttachRolledBack,
        format!(
            "Nova accepted the attach, then rolled it back: Cinder shows the volume {status} and not attached to the server"
        ),
    )
    .with("operation_id", run.op.id)
    .with("volume_status", status.as_str())
    .with("attempts", run.op.attempts);
    Decision::failed(Resolution::Reobserved, err)
}

/// The server was deleted while its attach was under way: never usable.
fn server_gone(run: &mut Run) -> Decision {
    run.last_seen = Some(false);
    let err = OperationError::new(
        Reason::NovaServerNotFound,
        "the server was deleted before Cinder showed the volume attached to it",
    )
    .with("operation_id", run.op.id)
    .with("attempts", run.op.attempts);
    Decision::failed(Resolution::Reobserved, err)
}

fn not_confirmed(run: &Run, last: &str) -> Decision {
    let message = match run.op.action {
        Action::Attach => format!(
            "Nova reported the attach, but Cinder had not shown the volume attached to the server by the deadline (last: {last})"
        ),
        Action::Detach => format!(
            "Nova no longer lists the volume, but Cinder still showed it attached to the server at the deadline (last: {last})"
        ),
    };
    let err = OperationError::new(Reason::OutcomeUnknown, message)
        .with("operation_id", run.op.id)
        .with("attempts", run.op.attempts)
        .with("volume_status", last);
    Decision::unknown(err)
}

/// A look at Cinder, as an event.
pub(crate) fn volume_event(when: &str, v: &VolumeView, server: Uuid) -> NewEvent {
    let here = v.attached_to(server);
    let ev = NewEvent::new(
        event::OBSERVED,
        format!(
            "Cinder {when}: the volume is {}{}",
            v.status,
            if here.is_some() {
                ", attached to the server"
            } else {
                ", not attached to the server"
            }
        ),
    )
    .with("service", "cinder")
    .with("volume_status", v.status.as_str())
    .with("attached_here", here.is_some())
    .with("attachments", v.attachments.len())
    .with(
        "cinder_request_id",
        v.cinder_request_id.as_deref().unwrap_or("-"),
    );
    // Which attachment: a detach's successor tells by it whether the one
    // it was asked to remove is gone (`reconciler/pass.rs`).
    match here {
        Some(a) => ev.with(ATTACHMENT_ID, &a.attachment_id),
        None => ev,
    }
}

/// The event field naming the attachment Cinder showed on the server.
const ATTACHMENT_ID: &str = "attachment_id";

/// The intent's event field naming the attachment a detach was asked to
/// remove (Cinder's id, seen before the first request).
pub(crate) const DETACH_TARGET: &str = "detach_target";

pub(crate) fn cinder_failed_event(when: &str, e: &CinderError) -> NewEvent {
    NewEvent::new(event::OBSERVED, format!("Cinder {when}: {}", e.clock())).with_all(&e.metadata())
}

#[cfg(test)]
mod tests {
    //! docs/design.md's "before the first request" table, row by row,
    //! against the pre-check (the rows about a failed or 404 look are I/O,
    //! tested in tests/adapter/cinder_decisions.rs).
    use super::*;
    use crate::nova::CinderAttachment;

    const SERVER: Uuid = Uuid::from_u128(1);
    const OTHER: Uuid = Uuid::from_u128(2);

    fn view(status: &str, attached_to: &[Uuid], multiattach: bool) -> VolumeView {
        VolumeView {
            id: Uuid::from_u128(3),
            status: VolumeStatus::parse(status),
            multiattach,
            attachments: attached_to
                .iter()
                .map(|s| CinderAttachment {
                    server_id: Some(s.to_string()),
                    attachment_id: Uuid::new_v4().to_string(),
                    device: Some("/dev/vdb".into()),
                })
                .collect(),
            cinder_request_id: None,
        }
    }

    /// Samples of what each row's "Cinder shows" cell names.
    fn samples(shows: &str) -> Option<Vec<VolumeView>> {
        Some(match shows {
            "attached to this server, `in-use`" => vec![
                view("in-use", &[SERVER], false),
                view("in-use", &[OTHER, SERVER], true),
            ],
            "attached to another server, not multiattach" => vec![view("in-use", &[OTHER], false)],
            "`creating` or `downloading`" => {
                vec![
                    view("creating", &[], false),
                    view("downloading", &[], false),
                ]
            }
            "an `error*` status, or `deleting`" => vec![
                view("error", &[], false),
                view("error_attaching", &[], false),
                view("error_extending", &[], false),
                view("deleting", &[], false),
            ],
            "`available`, attached nowhere" => vec![view("available", &[], false)],
            "`in-use` on other servers only, not multiattach" => {
                vec![view("in-use", &[OTHER], false)]
            }
            "anything else, or the look failed" => vec![
                view("available", &[], false),
                view("reserved", &[], false),
                view("attaching", &[], false),
                view("in-use", &[OTHER], true),
                view("detaching", &[SERVER], false),
                view("attaching", &[SERVER], false),
                view("maintenance", &[], false),
            ],
            "no such volume (404)" => return None,
            other => {
                panic!("docs/design.md names a Cinder view the test has no sample of: {other:?}")
            }
        })
    }

    fn step(p: &Precheck) -> String {
        match p {
            Precheck::Send => "send".into(),
            Precheck::WaitReady => "wait".into(),
            Precheck::Decided(d) => match (&d.state, &d.error) {
                (State::Succeeded, _) => "`SUCCEEDED/REOBSERVED`".into(),
                (_, Some(e)) => format!("`FAILED {}`", e.reason),
                _ => "?".into(),
            },
        }
    }

    #[test]
    fn every_precheck_row_in_the_design_doc_is_what_the_precheck_does() {
        let doc = include_str!("../../docs/design.md");
        let start = doc
            .find("<!-- cinder: before the first request -->")
            .expect("docs/design.md has the Cinder table");
        let mut rows = 0;
        for line in doc[start..]
            .lines()
            .skip(3)
            .take_while(|l| l.starts_with('|'))
        {
            let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
            let [action, shows, expected] = cells[..] else {
                panic!("row {line:?}")
            };
            let Some(views) = samples(shows) else {
                continue;
            };
            for v in views {
                for a in match action {
                    "attach" => vec![Action::Attach],
                    "detach" => vec![Action::Detach],
                    _ => vec![Action::Attach, Action::Detach],
                } {
                    // "anything else" is about what no earlier row names.
                    if action == "any" && a == Action::Detach && v.status == VolumeStatus::Available
                    {
                        continue;
                    }
                    let got = match a {
                        Action::Attach => precheck_attach(Uuid::nil(), SERVER, &v),
                        Action::Detach => precheck_detach(SERVER, &v),
                    };
                    assert!(
                        expected.starts_with(&step(&got)),
                        "{a:?} with {} attached to {:?}: docs/design.md says {expected:?}, the pre-check {}",
                        v.status,
                        v.attachments.len(),
                        step(&got)
                    );
                }
            }
            rows += 1;
        }
        assert!(rows >= 6, "{rows} rows checked");
    }
}

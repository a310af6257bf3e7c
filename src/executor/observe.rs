//! Looking at Nova: the server's attachment list, once or until it shows
//! the wanted state, and the server itself. I/O only; what a look means is
//! decided in `classify.rs` (and, for an Ensure call's look before its
//! first request, here: what the list shows is the whole verdict).

use tokio::time::Instant;

use crate::domain::{Action, NewEvent, OperationError, Reason, Resolution, State, event};
use crate::nova::{NovaError, RequestId};
use crate::store::NewOperation;

use super::Executor;
use super::classify::Presence;
use super::run::{Decision, Run, Seen};

/// What the pre-check found.
pub(crate) enum Precheck {
    /// Send the request (Cinder sees nothing against it, or could not be
    /// asked: Nova decides).
    Send,
    /// Decided without a request.
    Decided(Decision),
    /// The volume is being created: wait for it before the first request.
    WaitReady,
}

impl Executor {
    /// Lists the server's attachments (bounded by `until`) and reports
    /// whether the volume is there. A server that no longer exists (Nova's
    /// 404 naming it, for the list and for a look at the server) holds
    /// nothing: the volume is not on it.
    pub(crate) async fn observe(&self, run: &mut Run, until: Instant) -> Result<Seen, NovaError> {
        let started = Instant::now();
        let rid = RequestId::for_operation(run.op.id);
        match self.nova.list_as(&rid, run.op.server_id, until).await {
            Ok(answered) => {
                let items = answered.value;
                self.metrics
                    .nova
                    .request("list", "ok", started.elapsed().as_secs_f64());
                let seen = Seen::in_list(&items, run.op.volume_id);
                let detail = match &seen {
                    Seen::Attached(_) => "the volume is in the server's attachment list",
                    Seen::Absent | Seen::ServerGone => {
                        "the volume is not in the server's attachment list"
                    }
                };
                let present = seen.present();
                run.last_seen = Some(present);
                let ev = NewEvent::new(event::OBSERVED, detail)
                    .with("attachments_listed", items.len())
                    .with("present", present)
                    .with(
                        "nova_request_id",
                        answered.nova_request_id.as_deref().unwrap_or("-"),
                    );
                push_observation(run, ev);
                Ok(seen)
            }
            Err(e) if e.rejection() == Some(&crate::nova::Rejection::ServerNotFound) => {
                self.metrics
                    .nova
                    .request("list", "server_gone", e.elapsed.as_secs_f64());
                run.last_seen = Some(false);
                let ev = NewEvent::new(
                    event::OBSERVED,
                    "the server no longer exists (Nova's 404 naming it, for the list and for GET /servers/{id}): the volume is not on it",
                )
                .with("present", false)
                .with_all(&e.metadata());
                push_observation(run, ev);
                Ok(Seen::ServerGone)
            }
            Err(e) => {
                self.metrics
                    .nova
                    .request("list", e.kind.as_str(), e.elapsed.as_secs_f64());
                // Counted on the previous line when it failed the same
                // way: an outage watched for an hour is one line, not one
                // per look (each held in memory until the decision).
                push_observation(
                    run,
                    NewEvent::new(
                        event::OBSERVED,
                        format!("observation failed: {}", e.clock()),
                    )
                    .with("reason", e.reason())
                    .with_all(&e.metadata()),
                );
                Err(e)
            }
        }
    }

    /// Looks at the server itself (bounded by `until`): `Ok(false)` only
    /// for Nova's own 404 naming it (then nothing is on it), `Ok(true)` when
    /// Nova shows it, `Err` when the look failed (any other answer).
    pub(crate) async fn look_at_server(
        &self,
        run: &mut Run,
        until: Instant,
    ) -> Result<bool, NovaError> {
        let started = Instant::now();
        let rid = RequestId::for_operation(run.op.id);
        match self
            .nova
            .server_exists_as(&rid, run.op.server_id, until)
            .await
        {
            Ok(answered) => {
                let exists = answered.value;
                self.metrics.nova.request(
                    "show_server",
                    if exists { "ok" } else { "server_gone" },
                    started.elapsed().as_secs_f64(),
                );
                let detail = if exists {
                    "the server exists (GET /servers/{id}): Nova's 404 for it was not the server's word"
                } else {
                    "the server no longer exists (GET /servers/{id} answered Nova's 404): the volume is not on it"
                };
                if !exists {
                    run.last_seen = Some(false);
                }
                let ev = NewEvent::new(event::OBSERVED, detail)
                    .with("server_exists", exists)
                    .with(
                        "nova_request_id",
                        answered.nova_request_id.as_deref().unwrap_or("-"),
                    );
                push_observation(run, ev);
                Ok(exists)
            }
            Err(e) => {
                self.metrics
                    .nova
                    .request("show_server", e.kind.as_str(), e.elapsed.as_secs_f64());
                push_observation(
                    run,
                    NewEvent::new(
                        event::OBSERVED,
                        format!("the look at the server failed: {}", e.clock()),
                    )
                    .with("reason", e.reason())
                    .with_all(&e.metadata()),
                );
                Err(e)
            }
        }
    }

    /// Observes until the volume shows `want`, or `until`; pauses grow
    /// from `observe_interval` to `observe_interval_max`.
    pub(crate) async fn observe_until(
        &self,
        run: &mut Run,
        want: Presence,
        until: Instant,
    ) -> Option<Seen> {
        let mut pause = self.settings.observe_interval;
        loop {
            match (want, self.observe(run, until).await) {
                (Presence::Attached, Ok(seen @ Seen::Attached(_)))
                | (Presence::Detached, Ok(seen @ (Seen::Absent | Seen::ServerGone))) => {
                    return Some(seen);
                }
                _ => {}
            }
            let next = Instant::now() + pause;
            if next >= until {
                return None;
            }
            tokio::time::sleep_until(next).await;
            pause = (pause * 2).min(self.settings.observe_interval_max);
        }
    }
}

/// Logs an observation; one that says what the previous one said only
/// counts itself there (`times`, and how long after the first the last
/// came), so an hour of watching holds and writes one line per change,
/// not thousands.
pub(super) fn push_observation(run: &mut Run, ev: NewEvent) {
    if let Some(last) = run.events.last_mut()
        && last.kind == ev.kind
        && last.detail == ev.detail
    {
        let times = last
            .metadata
            .iter()
            .find(|(k, _)| k == "times")
            .and_then(|(_, v)| v.parse::<u64>().ok())
            .unwrap_or(1);
        let since_first = match (last.happened, ev.happened) {
            (Some(first), Some(now)) => now.saturating_duration_since(first).as_millis(),
            _ => 0,
        };
        let counted = std::mem::replace(last, NewEvent::new(ev.kind, String::new()))
            .with("times", times + 1)
            .with("last_ms_after_first", since_first);
        *last = counted;
        return;
    }
    run.events.push(ev);
}

impl Executor {
    /// An Ensure call's look before its first request where no Cinder
    /// confirms: the server's attachment list. The volume there for an
    /// attach, or not there (or the server gone) for a detach: decided,
    /// nothing sent. The server gone for an attach: FAILED. Anything else
    /// (the look failed included): send, and the tables decide.
    pub(super) async fn precheck_by_list(
        &self,
        new: &mut NewOperation,
        until: Instant,
    ) -> Precheck {
        let rid = RequestId::for_operation(new.id);
        let listed = self
            .nova
            .list_as(&rid, new.server_id, until)
            .await
            .map(|a| a.value);
        let (pre, ev) = match (new.action, Seen::by_list(&listed, new.volume_id)) {
            (Action::Attach, Ok(Seen::Attached(att))) => (
                Precheck::Decided(Decision::succeeded(
                    Resolution::Reobserved,
                    Some(att),
                    "Nova lists the volume attached to this server already: nothing sent",
                )),
                NewEvent::new(
                    event::OBSERVED,
                    "before sending: the volume is in the server's attachment list",
                )
                .with("present", true),
            ),
            (Action::Detach, Ok(Seen::Absent)) => (
                Precheck::Decided(Decision::succeeded(
                    Resolution::Reobserved,
                    None,
                    "Nova does not list the volume on this server: nothing to detach; nothing sent",
                )),
                NewEvent::new(
                    event::OBSERVED,
                    "before sending: the volume is not in the server's attachment list",
                )
                .with("present", false),
            ),
            (action, Ok(Seen::ServerGone)) => {
                let pre = match action {
                    Action::Attach => Precheck::Decided(Decision::failed(
                        Resolution::Reobserved,
                        OperationError::new(
                            Reason::NovaServerNotFound,
                            format!("server {} does not exist (Nova's 404 naming it, for the list and for GET /servers/{{id}}): nothing sent", new.server_id),
                        )
                        .with("operation_id", new.id),
                    )),
                    Action::Detach => Precheck::Decided(Decision::succeeded(
                        Resolution::Reobserved,
                        None,
                        "the server no longer exists: the volume is not attached to it; nothing sent",
                    )),
                };
                (
                    pre,
                    NewEvent::new(event::OBSERVED, "before sending: the server no longer exists (Nova's 404 naming it, for the list and for GET /servers/{id})")
                        .with("present", false),
                )
            }
            (_, Ok(seen)) => (
                Precheck::Send,
                NewEvent::new(
                    event::OBSERVED,
                    if seen.present() {
                        "before sending: the volume is in the server's attachment list"
                    } else {
                        "before sending: the volume is not in the server's attachment list"
                    },
                )
                .with("present", seen.present()),
            ),
            (_, Err(e)) => (
                Precheck::Send,
                NewEvent::new(
                    event::OBSERVED,
                    format!(
                        "before sending: observation failed: {}; the request decides",
                        e.clock()
                    ),
                )
                .with("reason", e.reason())
                .with_all(&e.metadata()),
            ),
        };
        new.events.push(ev);
        if !matches!(pre, Precheck::Send) {
            new.state = State::Pending;
            new.attempts = 0;
        }
        pre
    }
}

//! What each of Nova's answers means, as one pure table: (action, the
//! answer, which attempts may have reached Nova) → the next step. No I/O:
//! the send loop (`flow.rs`) carries the steps out.
//!
//! docs/design.md's "How an outcome is decided" is the specification: the
//! test at the bottom reads its table and checks every row against
//! [`classify_answer`], [`refuse`] and [`out_of_time`]. Adding a Nova behaviour is one arm here
//! and one row there.

use std::fmt;

use uuid::Uuid;

use crate::domain::{Action, Reason, Resolution};
use crate::nova::{NovaError, NovaErrorKind, Rejection};

/// What came back from one request.
#[derive(Debug)]
pub(crate) enum Answer<'a> {
    /// 200 with the attachment (attach at microversion ≤ 2.100).
    Done,
    /// 202: accepted; the effect follows (attach ≥ 2.101, every detach).
    Accepted,
    Failed(&'a NovaError),
}

/// Which requests so far may have taken effect (their answer was lost or
/// ambiguous, or accepted); a refused request cannot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct History {
    /// An attempt before this one may have taken effect.
    pub earlier: bool,
    /// This attempt may have taken effect.
    pub this: bool,
}

impl History {
    pub fn any(self) -> bool {
        self.earlier || self.this
    }
}

/// The state of the volume a watch waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Presence {
    Attached,
    Detached,
}

/// Where a look or a watch must end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Until {
    /// A slice before the answer-by instant (`Budget::observe_by`).
    ObserveBy,
    /// The answer-by instant, and at least 1 s from now: a last look that
    /// must happen even at the end of the budget.
    AnswerByAtLeast1s,
}

/// A decision, before the data it carries (attachment, error context) is
/// filled in from the answer and the observations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    Succeeded {
        resolution: Resolution,
        detail: &'static str,
        /// A lost or ambiguous answer was recovered by looking (counted).
        recovered: bool,
    },
    /// Nova's refusal decided it, or the fixed reason does.
    Failed { reason: Reason },
    /// Attached to another server, which Nova named.
    FailedElsewhere,
    /// Not known: the reconciler resolves it.
    Unknown { message: &'static str },
}

/// The next step after an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Next {
    Decide(Verdict),
    /// Look at the server's attachments once, then follow the branch.
    Observe {
        until: Until,
        attached: Box<Next>,
        absent: Box<Next>,
        error: Box<Next>,
    },
    /// Look at the server itself (`GET /servers/{id}`) once: Nova's own
    /// 404 for it is `gone`; the server shown is `present`; anything else
    /// is `error`.
    LookServer {
        until: Until,
        gone: Box<Next>,
        present: Box<Next>,
        error: Box<Next>,
    },
    /// Look until the volume shows `want`, or `until`.
    Watch {
        want: Presence,
        until: Until,
        found: Verdict,
        otherwise: Box<Next>,
    },
    /// Send again after a backoff, if another request still fits.
    Retry {
        why: &'static str,
        otherwise: Box<Next>,
    },
    /// A refusal that decides FAILED, unless an earlier attempt may have
    /// taken effect (see [`refuse`]).
    Refuse(Reason),
    /// No time to send again: decide from what can still be seen (see
    /// [`out_of_time`]).
    OutOfTime,
}

fn succeeded(resolution: Resolution, detail: &'static str, recovered: bool) -> Verdict {
    Verdict::Succeeded {
        resolution,
        detail,
        recovered,
    }
}

fn decide(v: Verdict) -> Box<Next> {
    Box::new(Next::Decide(v))
}

fn unknown(message: &'static str) -> Box<Next> {
    decide(Verdict::Unknown { message })
}

/// Watch for `action`'s effect until the answer is due: seen, it
/// succeeded (`found`, recovered from a lost answer or not); not seen,
/// `otherwise`.
fn watch_for(
    action: Action,
    found: &'static str,
    recovered: bool,
    otherwise: &'static str,
) -> Next {
    Next::Watch {
        want: match action {
            Action::Attach => Presence::Attached,
            Action::Detach => Presence::Detached,
        },
        until: Until::ObserveBy,
        found: succeeded(Resolution::Reobserved, found, recovered),
        otherwise: unknown(otherwise),
    }
}

/// The watch after an accepted (202) request or a detach already running.
fn watch(action: Action) -> Next {
    match action {
        Action::Attach => watch_for(
            action,
            "attached (observed after 202)",
            false,
            "Nova accepted the attach (202) but it did not appear before the deadline",
        ),
        Action::Detach => watch_for(
            action,
            "detached (observed gone)",
            false,
            "the detach was accepted but the volume was still listed at the deadline",
        ),
    }
}

/// The answer was lost or ambiguous: the request may still take effect,
/// so nothing is sent again (see `no_resend`); watch for its effect until
/// the answer is due, and leave what is not seen to the settle window.
fn lost(action: Action) -> Next {
    let why = "the response was lost and the effect was not observed in time";
    let found = match action {
        Action::Attach => "response lost; the attachment was observed",
        Action::Detach => "response lost; the volume was observed detached",
    };
    watch_for(action, found, true, why)
}

/// The next step after `answer` to a request for `action` on `server`.
pub(crate) fn classify_answer(action: Action, server: Uuid, answer: &Answer<'_>) -> Next {
    match (action, answer) {
        (Action::Attach, Answer::Done) => Next::Decide(succeeded(
            Resolution::Response,
            "attached (Nova's response)",
            false,
        )),
        (_, Answer::Done | Answer::Accepted) => watch(action),
        (_, Answer::Failed(e)) => classify_failure(action, server, e),
    }
}

fn classify_failure(action: Action, server: Uuid, e: &NovaError) -> Next {
    match &e.kind {
        NovaErrorKind::Rejected(Rejection::AlreadyAttached { servers })
            if action == Action::Attach =>
        {
            already_attached(server, servers)
        }
        // Naming this server and this volume (`nova::answer` reads the
        // ids; an attach is never answered so).
        NovaErrorKind::Rejected(Rejection::NotAttached) if action == Action::Detach => {
            Next::Decide(succeeded(
                Resolution::Reobserved,
                "Nova reports the volume is not attached",
                false,
            ))
        }
        NovaErrorKind::Rejected(Rejection::Detaching) if action == Action::Detach => {
            detach_not_in_use()
        }
        // The server is gone, Nova says: a detach is done — once a look at
        // the server agrees (a 404 from a Nova that is not the server's, a
        // request routed to another cell or region, must not finalize it).
        NovaErrorKind::Rejected(Rejection::ServerNotFound) if action == Action::Detach => {
            detach_server_not_found()
        }
        // The volume no longer exists (Nova asked Cinder): nothing is
        // attached; an attach cannot be made.
        NovaErrorKind::Rejected(Rejection::VolumeNotFound) if action == Action::Detach => {
            Next::Decide(succeeded(
                Resolution::Response,
                "the volume no longer exists: nothing is attached",
                false,
            ))
        }
        NovaErrorKind::Rejected(Rejection::ServerNotFound | Rejection::VolumeNotFound) => {
            Next::Decide(Verdict::Failed { reason: e.reason() })
        }
        // An error status (`error_attaching`) stays until an operator
        // resets it: waiting does not cure it.
        NovaErrorKind::Rejected(Rejection::VolumeNotReady { status })
            if status.starts_with("error") =>
        {
            Next::Refuse(e.reason())
        }
        NovaErrorKind::Rejected(Rejection::VolumeNotReady { .. }) => Next::Retry {
            why: "the volume is not ready yet (creating, downloading or reserved)",
            otherwise: Box::new(Next::Refuse(e.reason())),
        },
        NovaErrorKind::Rejected(Rejection::Unread { .. }) => unread_refusal(action, e.reason()),
        NovaErrorKind::Rejected(Rejection::Conflict | Rejection::Throttled) => Next::Retry {
            why: "Nova reported a transient conflict",
            otherwise: Box::new(Next::Refuse(Reason::NovaConflict)),
        },
        NovaErrorKind::ConnectFailed | NovaErrorKind::AuthFailed => Next::Retry {
            why: "the request was never sent",
            otherwise: Box::new(Next::Refuse(e.reason())),
        },
        NovaErrorKind::DeadlineExceeded if !e.may_have_reached => Next::Refuse(e.reason()),
        // Kept from leaving: its lease may be another's now (a write of
        // this run will be fenced then), or the database cannot confirm it.
        NovaErrorKind::Withheld => Next::Refuse(Reason::NotSent),
        NovaErrorKind::Rejected(_) if !e.outcome_unknown() => Next::Refuse(e.reason()),
        _ => lost(action),
    }
}

/// An attach refused as already attached: maybe ours (a retry of an
/// attach that took effect), so look. Listed here: done; listed on another
/// server: FAILED; listed nowhere: a rollback raced us, try again.
fn already_attached(server: Uuid, servers: &[String]) -> Next {
    let ours = server.to_string();
    let elsewhere = servers.iter().any(|s| *s != ours);
    Next::Observe {
        until: Until::ObserveBy,
        attached: decide(succeeded(
            Resolution::Reobserved,
            "already attached to this server (observed)",
            true,
        )),
        absent: if elsewhere {
            decide(Verdict::FailedElsewhere)
        } else {
            Box::new(Next::Retry {
                why: "already-attached but not listed",
                otherwise: Box::new(Next::OutOfTime),
            })
        },
        error: unknown("volume reported attached, observation failed"),
    }
}

/// A refusal whose message is not read (translated, unknown, or about
/// another volume): Nova refused this request, so nothing took effect,
/// but why is not known — it may be transient ("volume not ready"), or say
/// the volume is already where the caller wants it ("already attached",
/// "not in use"). So look: the wanted state there decides (by the look,
/// not the message); else ask again, and only a refusal still standing
/// when no request fits any more decides, by its status (`reason`).
fn unread_refusal(action: Action, reason: Reason) -> Next {
    let again = || {
        Box::new(Next::Retry {
            why: "Nova refused with a message not read: nothing took effect",
            otherwise: Box::new(Next::Refuse(reason)),
        })
    };
    let done = match action {
        Action::Attach => "attached to this server (observed after a refusal not read)",
        Action::Detach => "detached (observed after a refusal not read)",
    };
    let done = decide(succeeded(Resolution::Reobserved, done, true));
    let (attached, absent) = match action {
        Action::Attach => (done, again()),
        Action::Detach => (again(), done),
    };
    Next::Observe {
        until: Until::ObserveBy,
        attached,
        absent,
        error: again(),
    }
}

/// A detach answered with Nova's 404 "Instance … could not be found": the
/// server and its attachments are gone, if `GET /servers/{id}` agrees.
/// Shown after all, the 404 was not the server's word: its effect is
/// unknown, so watch the attachment list as after a lost answer; the look
/// failed: the same (nothing is decided on the 404 alone).
fn detach_server_not_found() -> Next {
    let watch = || {
        Box::new(watch_for(
            Action::Detach,
            "detached (observed gone after a 404 for a server that exists)",
            true,
            "Nova answered 404 for a server a look could not confirm gone, and the volume was still listed at the deadline",
        ))
    };
    Next::LookServer {
        until: Until::ObserveBy,
        gone: decide(succeeded(
            Resolution::Response,
            "the server no longer exists (Nova's 404, and a look at the server agrees): nothing is attached",
            false,
        )),
        present: watch(),
        error: watch(),
    }
}

/// A detach refused as "not in use": a detach runs (maybe our own lost
/// one), or an attach has not finished. Gone: done; still there: ask again.
fn detach_not_in_use() -> Next {
    Next::Observe {
        until: Until::ObserveBy,
        attached: Box::new(Next::Retry {
            why: "the volume is not in use yet (attaching or detaching)",
            otherwise: unknown("the volume was still attached and not in use at the deadline"),
        }),
        absent: decide(succeeded(
            Resolution::Reobserved,
            "detached (observed gone)",
            false,
        )),
        error: unknown("refused as not in use, and the observation failed"),
    }
}

/// What a refusal becomes: FAILED, unless an earlier attempt may have
/// reached Nova — that one may have worked, or may still be working (a
/// lost attach can take effect long after its 504), so one look decides
/// only a success; not seen, it is UNKNOWN and the settle window decides.
pub(crate) fn refuse(action: Action, history: History, reason: Reason) -> Next {
    if !history.earlier {
        return Next::Decide(Verdict::Failed { reason });
    }
    let took_effect = Next::Decide(succeeded(
        Resolution::Reobserved,
        "an earlier attempt took effect (observed)",
        true,
    ));
    let not_yet = Next::Decide(Verdict::Unknown {
        message: "refused now; an earlier request may still take effect",
    });
    let (attached, absent) = match action {
        Action::Attach => (took_effect, not_yet),
        Action::Detach => (not_yet, took_effect),
    };
    Next::Observe {
        until: Until::AnswerByAtLeast1s,
        attached: Box::new(attached),
        absent: Box::new(absent),
        error: unknown(
            "refused now, but an earlier attempt may have worked and the observation failed",
        ),
    }
}

/// Whether a step may send again: never while a request of the operation
/// may still take effect (Nova does not deduplicate: a second request could
/// be a second attachment, or detach a later one). Then, instead, it
/// watches for that request's effect until the answer is due; not seen,
/// the settle window decides. `None`: sending again is safe.
pub(crate) fn no_resend(action: Action, history: History) -> Option<Next> {
    if !history.any() {
        return None;
    }
    let why = "a request may still take effect; not sending another";
    let found = match action {
        Action::Attach => "attached (observed)",
        Action::Detach => "detached (observed)",
    };
    Some(watch_for(action, found, true, why))
}

/// No time left for another request: decide from one last look, if any
/// request may have taken effect.
pub(crate) fn out_of_time(action: Action, history: History) -> Next {
    if !history.any() {
        return Next::Decide(Verdict::Failed {
            reason: Reason::BudgetExhausted,
        });
    }
    const NOT_SEEN: &str = "no time left to send again and the effect was not observed";
    let (attached, absent) = match action {
        Action::Attach => (
            decide(succeeded(
                Resolution::Reobserved,
                "attached (observed)",
                false,
            )),
            unknown(NOT_SEEN),
        ),
        Action::Detach => (
            unknown(NOT_SEEN),
            decide(succeeded(
                Resolution::Reobserved,
                "detached (observed)",
                false,
            )),
        ),
    };
    Next::Observe {
        until: Until::ObserveBy,
        attached,
        absent,
        error: unknown(NOT_SEEN),
    }
}

// The notation of docs/design.md's table: a step that contains other steps is
// written in parentheses when nested.
impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Succeeded { resolution, .. } => {
                write!(f, "SUCCEEDED/{}", resolution.as_str().to_uppercase())
            }
            Verdict::Failed { reason } => write!(f, "FAILED/RESPONSE {reason}"),
            Verdict::FailedElsewhere => {
                write!(f, "FAILED/RESPONSE {}", Reason::AlreadyAttachedElsewhere)
            }
            Verdict::Unknown { .. } => f.write_str("UNKNOWN"),
        }
    }
}

impl Next {
    fn nested(&self) -> String {
        match self {
            Next::Observe { .. }
            | Next::LookServer { .. }
            | Next::Watch { .. }
            | Next::Retry { .. } => format!("({self})"),
            _ => self.to_string(),
        }
    }
}

impl fmt::Display for Until {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Until::ObserveBy => Ok(()),
            Until::AnswerByAtLeast1s => f.write_str(" (at least 1 s)"),
        }
    }
}

impl fmt::Display for Next {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Next::Decide(v) => v.fmt(f),
            Next::Observe {
                until,
                attached,
                absent,
                error,
            } => write!(
                f,
                "look{until}: attached → {}; absent → {}; error → {}",
                attached.nested(),
                absent.nested(),
                error.nested()
            ),
            Next::LookServer {
                until,
                gone,
                present,
                error,
            } => write!(
                f,
                "look at the server{until}: gone → {}; present → {}; error → {}",
                gone.nested(),
                present.nested(),
                error.nested()
            ),
            Next::Watch {
                want,
                until,
                found,
                otherwise,
            } => write!(
                f,
                "watch until {}{until}: {found}, else {}",
                match want {
                    Presence::Attached => "attached",
                    Presence::Detached => "detached",
                },
                otherwise.nested()
            ),
            Next::Retry { otherwise, .. } => write!(f, "retry, else {}", otherwise.nested()),
            Next::Refuse(reason) => write!(f, "refuse {reason}"),
            Next::OutOfTime => f.write_str("out of time"),
        }
    }
}

#[cfg(test)]
mod tests;

//! What a handler reads of a request besides its message, as the layers
//! in front of it left it: the deadline (`deadline`), the authenticated
//! caller and so whose operations it reads (`auth`), its place under
//! `--max-inflight-mutations` (`overload`), and the caller's trace context
//! from its metadata.

use tonic::{Request, Status};
use uuid::Uuid;

use super::{auth, overload, status};
use crate::domain::{Caller, Deadline, Operation, TraceContext};

pub(super) fn deadline_of<T>(req: &Request<T>) -> Deadline {
    // The deadline layer is always in the chain that `startup` builds; a
    // request without it has no bound from us (tonic's own timer remains).
    req.extensions()
        .get::<Deadline>()
        .copied()
        .unwrap_or_else(Deadline::none)
}

/// The authenticated caller ([`Caller::ANONYMOUS`] when auth is off).
pub(super) fn caller_of<T>(req: &Request<T>) -> Caller {
    req.extensions()
        .get::<auth::Caller>()
        .map_or(Caller::ANONYMOUS, |c| Caller::named(c.name.clone()))
}

/// The request's place under `--max-inflight-mutations`, which the
/// overload layer left in its extensions for the operation's task to hold
/// (see `overload`).
pub(super) fn inflight_of<T>(req: &Request<T>) -> Option<crate::executor::InFlight> {
    req.extensions()
        .get::<overload::MutationPermit>()
        .and_then(overload::MutationPermit::take)
}

/// The caller's W3C trace context (metadata `traceparent`, `tracestate`),
/// continued under a span of this service's. A malformed one is ignored —
/// never an error to the caller, as the specification says — with a debug
/// line, and the operation begins a trace of its own, as it does without
/// one.
pub(super) fn trace_of<T>(req: &Request<T>) -> TraceContext {
    let md = req.metadata();
    let values = |name: &str| -> Vec<&str> {
        md.get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap_or("(not ASCII)"))
            .collect()
    };
    let (ctx, problem) = TraceContext::accept(&values("traceparent"), &values("tracestate"));
    if let Some(p) = problem {
        tracing::debug!(trace_id = %ctx.trace_id(), problem = %p, "caller's trace context ignored");
    }
    ctx
}

/// Whose operations a caller reads: every caller's for an operator and
/// for the anonymous caller (no authentication configured: one caller,
/// everything visible), its own for an orchestrator. Another caller's
/// operation is, to an orchestrator, an operation that does not exist:
/// the same `NOT_FOUND`, through the same path, as an id nobody has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Scope {
    All,
    Own(String),
}

impl Scope {
    pub(super) fn of<T>(req: &Request<T>) -> Self {
        match req.extensions().get::<auth::Caller>() {
            Some(c) if c.role != auth::Role::Operator => Scope::Own(c.name.clone()),
            _ => Scope::All,
        }
    }

    fn sees(&self, op: &Operation) -> bool {
        match self {
            Scope::All => true,
            Scope::Own(name) => op.caller.as_deref() == Some(name.as_str()),
        }
    }

    /// `found` as this caller may know it: another caller's operation is
    /// none.
    pub(super) fn visible(&self, found: Option<Operation>) -> Option<Operation> {
        found.filter(|op| self.sees(op))
    }

    /// For an orchestrator, whether `id` names one of its operations (one
    /// read by primary key); always for the others, without reading.
    /// Called before work that names the operation to anyone else (a wait
    /// registered for it, a look at Nova), so another caller's id costs
    /// no more than an id nobody has.
    pub(super) async fn admits(
        &self,
        store: &dyn crate::store::Store,
        id: Uuid,
    ) -> Result<(), Status> {
        if *self == Scope::All {
            return Ok(());
        }
        match store.operation_get(id).await {
            Ok(Some(op)) if self.sees(&op) => Ok(()),
            Ok(_) => Err(status::from_store(crate::store::StoreError::NotFound(id))),
            Err(e) => Err(status::from_store(e)),
        }
    }
}

/// What a mutating call reads of its request besides the message: its
/// deadline, caller, scope, trace and in-flight place, read before the
/// message is taken out of it.
pub(super) struct Mutation {
    pub deadline: Deadline,
    pub caller: Caller,
    pub scope: Scope,
    pub trace: TraceContext,
    pub inflight: Option<crate::executor::InFlight>,
}

impl Mutation {
    pub(super) fn of<T>(req: &Request<T>) -> Self {
        Self {
            deadline: deadline_of(req),
            caller: caller_of(req),
            scope: Scope::of(req),
            trace: trace_of(req),
            inflight: inflight_of(req),
        }
    }
}

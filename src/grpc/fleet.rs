//! The calls that act on operations without starting one:
//! `CancelOperation` (an orchestrator's own, or an operator's), and the
//! operators' bulk calls by filter, `ReconcileOperations` and
//! `ResolveOperations` (`reconciler::bulk` runs them).

use std::collections::BTreeMap;
use std::time::Duration;

use tonic::{Request, Status};

use super::request::{Scope, caller_of, deadline_of};
use super::{Api, convert, filter, op_id, pb, status};
use crate::domain::{InvalidField, Reason, State};
use crate::reconciler::bulk::{
    BulkAction, BulkOutcome, BulkRequest, DEFAULT_MAX_COUNT, DEFAULT_RATE, ItemOutcome, MAX_COUNT,
    MAX_RATE,
};
use crate::store::{Cancelled, StoreError};

impl Api {
    /// `CancelOperation`: one compare-and-set (`Executor::cancel`).
    pub(super) async fn cancel(
        &self,
        request: Request<pb::CancelOperationRequest>,
    ) -> Result<pb::Operation, Status> {
        let caller = caller_of(&request);
        let scope = Scope::of(&request);
        let r = request.into_inner();
        let id = op_id("operation_id", &r.operation_id)?;
        let why = if r.reason.trim().is_empty() {
            format!("asked by {caller}")
        } else {
            let reason = convert::resolve_reason(&r.reason).map_err(status::invalid)?;
            format!("asked by {caller}: {reason}")
        };
        // Another caller's operation is, to an orchestrator, none.
        scope.admits(self.store.as_ref(), id).await?;
        let done = self
            .exec
            .cancel(id, &caller, &why)
            .await
            .map_err(status::from_store)?;
        match done {
            Cancelled::Done(op) => {
                tracing::info!(operation_id = %op.id, caller = %caller, "operation cancelled");
                Ok(convert::operation_to_pb(&op))
            }
            Cancelled::NotFound => Err(status::from_store(StoreError::NotFound(id))),
            Cancelled::Not(op) if op.state.is_terminal() => {
                Err(status::from_store(StoreError::AlreadyTerminal {
                    id,
                    state: op.state.as_str(),
                }))
            }
            Cancelled::Not(op) => {
                let mut m = BTreeMap::new();
                m.insert("operation_id".to_string(), id.to_string());
                m.insert("state".to_string(), op.state.as_str().to_string());
                m.insert("attempts".to_string(), op.attempts.to_string());
                Err(status::status(
                    Reason::CancelTooLate,
                    format!(
                        "operation {id} is {} with attempt {} that may be leaving or may have left: \
                         it is not cancelled and goes on (only a detach undoes an attach)",
                        op.state.as_str(),
                        op.attempts
                    ),
                    m,
                ))
            }
        }
    }

    /// `ReconcileOperations` (operators only: the auth layer's table).
    pub(super) async fn reconcile_many(
        &self,
        request: Request<pb::ReconcileOperationsRequest>,
    ) -> Result<pb::BulkResult, Status> {
        let (parts, r) = Parts::of(request);
        let bulk = parts.request(
            r.filter.as_ref(),
            BulkAction::Reconcile,
            r.dry_run,
            r.max_count,
            r.rate_per_second,
        )?;
        self.run_bulk(bulk).await
    }

    /// `ResolveOperations` (operators only: the auth layer's table).
    pub(super) async fn resolve_many(
        &self,
        request: Request<pb::ResolveOperationsRequest>,
    ) -> Result<pb::BulkResult, Status> {
        let (parts, r) = Parts::of(request);
        let state = match pb::State::try_from(r.state)
            .ok()
            .and_then(convert::state_from_pb)
        {
            Some(s @ (State::Succeeded | State::Failed)) => s,
            _ => {
                return Err(status::invalid(InvalidField::new(
                    "state",
                    "must be STATE_SUCCEEDED or STATE_FAILED",
                )));
            }
        };
        let reason = convert::resolve_reason(&r.reason)
            .map_err(status::invalid)?
            .to_string();
        let bulk = parts.request(
            r.filter.as_ref(),
            BulkAction::Resolve { state, reason },
            r.dry_run,
            r.max_count,
            r.rate_per_second,
        )?;
        self.run_bulk(bulk).await
    }

    async fn run_bulk(&self, bulk: BulkRequest) -> Result<pb::BulkResult, Status> {
        let out = self
            .reconciler
            .bulk(bulk)
            .await
            .map_err(status::from_store)?;
        Ok(bulk_to_pb(out))
    }
}

/// What a bulk call reads of its request besides its message.
struct Parts {
    scope: Scope,
    caller: crate::domain::Caller,
    deadline: crate::domain::Deadline,
}

impl Parts {
    fn of<T>(request: Request<T>) -> (Self, T) {
        let parts = Self {
            scope: Scope::of(&request),
            caller: caller_of(&request),
            deadline: deadline_of(&request),
        };
        (parts, request.into_inner())
    }

    fn request(
        self,
        f: Option<&pb::OperationFilter>,
        action: BulkAction,
        dry_run: bool,
        max_count: u32,
        rate: f64,
    ) -> Result<BulkRequest, Status> {
        let filter = filter::of_bulk(f, &self.scope)?;
        let max_count = match max_count {
            0 => DEFAULT_MAX_COUNT,
            n if n > MAX_COUNT => {
                return Err(status::invalid(InvalidField::new(
                    "max_count",
                    format!("{n} is more than {MAX_COUNT}"),
                )));
            }
            n => n,
        };
        let rate = match rate {
            0.0 => DEFAULT_RATE,
            r if r.is_finite() && r > 0.0 && r <= MAX_RATE => r,
            r => {
                return Err(status::invalid(InvalidField::new(
                    "rate_per_second",
                    format!("{r} is not in (0, {MAX_RATE}]"),
                )));
            }
        };
        // The answer leaves before the deadline layer's: a tenth of the
        // time left and a second.
        let now = tokio::time::Instant::now();
        let left = self.deadline.at.saturating_duration_since(now);
        let until = self.deadline.at - (left / 10 + Duration::from_secs(1)).min(left);
        Ok(BulkRequest {
            filter_text: filter.to_string(),
            filter,
            action,
            dry_run,
            max_count,
            rate,
            who: self.caller,
            until,
        })
    }
}

fn bulk_to_pb(out: BulkOutcome) -> pb::BulkResult {
    pb::BulkResult {
        bulk_id: out.id.to_string(),
        dry_run: out.dry_run,
        matched: out.items.len() as u32,
        more: out.more,
        interrupted: out.interrupted,
        items: out
            .items
            .into_iter()
            .map(|i| {
                let (outcome, error) = match i.outcome {
                    ItemOutcome::WouldAct => (pb::BulkOutcome::WouldAct, None),
                    ItemOutcome::Acted => (pb::BulkOutcome::Acted, None),
                    ItemOutcome::NoLongerMatches => (pb::BulkOutcome::NoLongerMatches, None),
                    ItemOutcome::NotReached => (pb::BulkOutcome::NotReached, None),
                    ItemOutcome::Failed(e) => (
                        pb::BulkOutcome::Failed,
                        Some(pb::OperationError {
                            reason: e.reason.to_string(),
                            message: e.message,
                            metadata: e.metadata.into_iter().collect(),
                        }),
                    ),
                };
                pb::BulkItem {
                    operation_id: i.op.id.to_string(),
                    outcome: outcome as i32,
                    operation: Some(convert::operation_to_pb(&i.op)),
                    error,
                }
            })
            .collect(),
    }
}

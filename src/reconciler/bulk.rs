//! Bulk calls by filter (`ReconcileOperations`, `ResolveOperations`): an
//! operator acts on a fleet, not one operation. The set is pinned when
//! the call starts (the ids the filter matches then, newest first, at
//! most `max_count`; a resolve's, open operations only), so a dry run
//! lists exactly what a real run would act on, and a real run acts on
//! nothing else: each pinned operation is taken at most `rate` a second
//! and acted on only if it still matches then (the same filter's query,
//! narrowed to its id: one place says what matches). Interrupted (its
//! deadline), the same call again acts on what still matches: a resolve
//! never decides anything twice, a reconcile looks again. Audited: a
//! line in the service's log for the call (who, the filter, how many)
//! and each operation's own event, naming the call.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;

use super::Reconciler;
use crate::domain::{Caller, NewEvent, Operation, OperationError, Reason, State, event};
use crate::store::{OperationFilter, StoreError};

/// Operations pinned when `max_count` is 0, and at most.
pub const DEFAULT_MAX_COUNT: u32 = 100;
pub const MAX_COUNT: u32 = 10_000;

/// Operations a second when `rate_per_second` is 0, and at most.
pub const DEFAULT_RATE: f64 = 10.0;
pub const MAX_RATE: f64 = 1000.0;

/// What a bulk call does with each operation.
#[derive(Debug, Clone)]
pub enum BulkAction {
    /// Re-observe it, as `ReconcileOperation` does (one pass, or a look
    /// for drift once decided), never waiting for a live holder.
    Reconcile,
    /// Decide it, as `ResolveOperation` does.
    Resolve { state: State, reason: String },
}

impl BulkAction {
    fn name(&self) -> &'static str {
        match self {
            BulkAction::Reconcile => "reconcile",
            BulkAction::Resolve { .. } => "resolve",
        }
    }
}

/// A bulk call, parsed.
#[derive(Debug, Clone)]
pub struct BulkRequest {
    pub filter: OperationFilter,
    /// The filter as the caller gave it, for the audit.
    pub filter_text: String,
    pub action: BulkAction,
    pub dry_run: bool,
    pub max_count: u32,
    pub rate: f64,
    pub who: Caller,
    /// The call answers by then: no operation is taken after it leaves
    /// less than one operation's bound.
    pub until: Instant,
}

/// What was done with one pinned operation.
#[derive(Debug, Clone)]
pub enum ItemOutcome {
    /// A dry run: a real run would act on it.
    WouldAct,
    Acted,
    NoLongerMatches,
    Failed(OperationError),
    /// The call ended before its turn.
    NotReached,
}

#[derive(Debug, Clone)]
pub struct BulkItem {
    /// As it stands after the call (as pinned, if untouched).
    pub op: Operation,
    pub outcome: ItemOutcome,
}

/// What a bulk call did.
#[derive(Debug, Clone)]
pub struct BulkOutcome {
    pub id: Uuid,
    pub dry_run: bool,
    /// More matched than `max_count`.
    pub more: bool,
    /// The call's end came before every pinned operation's turn.
    pub interrupted: bool,
    pub items: Vec<BulkItem>,
}

/// Operations read per page while pinning.
const PAGE: usize = 500;

/// The longest one operation's turn takes: a pass's look (its bound) and
/// its writes; a resolve, a write.
const TURN: Duration = Duration::from_secs(2);

impl Reconciler {
    /// Runs a bulk call (see the module's doc).
    pub async fn bulk(self: &Arc<Self>, req: BulkRequest) -> Result<BulkOutcome, StoreError> {
        let id = Uuid::now_v7();
        let mut filter = req.filter.clone();
        if matches!(req.action, BulkAction::Resolve { .. }) {
            // Only an open operation can be decided: a decided one is not
            // "touched", so it is never pinned.
            filter.open_only = true;
        }
        let (pinned, more) = self.pin(&filter, req.max_count).await?;
        tracing::info!(bulk_id = %id, action = req.action.name(), caller = %req.who,
            filter = %req.filter_text, matched = pinned.len(), more, dry_run = req.dry_run,
            "bulk call: operations pinned");
        let mut out = BulkOutcome {
            id,
            dry_run: req.dry_run,
            more,
            interrupted: false,
            items: Vec::with_capacity(pinned.len()),
        };
        if req.dry_run {
            out.items = pinned
                .into_iter()
                .map(|op| BulkItem {
                    op,
                    outcome: ItemOutcome::WouldAct,
                })
                .collect();
            return Ok(out);
        }
        let turn = match req.action {
            BulkAction::Reconcile => self.settings.observe_timeout + TURN,
            BulkAction::Resolve { .. } => TURN,
        };
        let every = Duration::from_secs_f64(1.0 / req.rate.clamp(0.001, MAX_RATE));
        let mut next = Instant::now();
        for op in pinned {
            if out.interrupted || next.max(Instant::now()) + turn > req.until {
                out.interrupted = true;
                out.items.push(BulkItem {
                    op,
                    outcome: ItemOutcome::NotReached,
                });
                continue;
            }
            tokio::time::sleep_until(next).await;
            next = Instant::now() + every;
            out.items.push(self.turn(&req, &filter, id, op).await);
        }
        let count =
            |f: fn(&ItemOutcome) -> bool| out.items.iter().filter(|i| f(&i.outcome)).count();
        tracing::info!(bulk_id = %id, action = req.action.name(), caller = %req.who,
            acted = count(|o| matches!(o, ItemOutcome::Acted)),
            no_longer_matched = count(|o| matches!(o, ItemOutcome::NoLongerMatches)),
            failed = count(|o| matches!(o, ItemOutcome::Failed(_))),
            not_reached = count(|o| matches!(o, ItemOutcome::NotReached)),
            "bulk call: done");
        Ok(out)
    }

    /// The ids `filter` matches now, newest first, at most `max`; and
    /// whether more matched.
    async fn pin(
        &self,
        filter: &OperationFilter,
        max: u32,
    ) -> Result<(Vec<Operation>, bool), StoreError> {
        let mut pinned = Vec::new();
        let mut after = None;
        loop {
            let want = (max as usize - pinned.len()).min(PAGE);
            let page = self
                .store
                .operation_list(filter, after, want as u32)
                .await?;
            pinned.extend(page.operations);
            match page.next_cursor {
                None => return Ok((pinned, false)),
                Some(_) if pinned.len() >= max as usize => return Ok((pinned, true)),
                Some(c) => after = Some(c),
            }
        }
    }

    /// One pinned operation's turn: acted on if it still matches.
    async fn turn(
        self: &Arc<Self>,
        req: &BulkRequest,
        filter: &OperationFilter,
        bulk: Uuid,
        pinned: Operation,
    ) -> BulkItem {
        let id = pinned.id;
        let audit = vec![
            ("bulk_id".to_string(), bulk.to_string()),
            ("filter".to_string(), req.filter_text.clone()),
        ];
        let still = OperationFilter {
            id: Some(id),
            ..filter.clone()
        };
        let matched = match self.store.operation_list(&still, None, 1).await {
            Ok(page) => page.operations.into_iter().next(),
            Err(e) => return failed(pinned, &e),
        };
        let Some(op) = matched else {
            return self
                .as_it_stands(pinned, ItemOutcome::NoLongerMatches)
                .await;
        };
        let acted = match &req.action {
            BulkAction::Resolve { state, reason } => {
                let who = req.who.name();
                let mut d = self.exec.operator_decision(id, *state, reason, who);
                d.expect = filter.state;
                d.audit = audit;
                self.exec.resolve_audited(d).await
            }
            BulkAction::Reconcile => match self.reconcile_unless_held(op).await {
                Ok(Some(op)) => {
                    let ev = NewEvent::new(
                        event::BULK,
                        format!("reconciled by bulk call {bulk} of {}", req.who),
                    )
                    .with("caller", &req.who)
                    .with_all(&audit.into_iter().collect());
                    match self
                        .store
                        .operation_append_events(id, &self.replica, vec![ev])
                        .await
                    {
                        Ok(()) => Ok(op),
                        Err(e) => Err(e),
                    }
                }
                Ok(None) => {
                    let err = OperationError::new(
                        Reason::OperationInProgress,
                        "a live run holds it (its holder decides it); left alone",
                    )
                    .with("operation_id", id);
                    return BulkItem {
                        op: pinned,
                        outcome: ItemOutcome::Failed(err),
                    };
                }
                Err(e) => Err(e),
            },
        };
        match acted {
            Ok(_) => self.as_it_stands(pinned, ItemOutcome::Acted).await,
            Err(StoreError::AlreadyTerminal { .. } | StoreError::NotInState { .. }) => {
                self.as_it_stands(pinned, ItemOutcome::NoLongerMatches)
                    .await
            }
            Err(e) => failed(pinned, &e),
        }
    }

    /// One pass over `op` now, unless a live run holds it (`None`): never
    /// waits for a holder, as `reconcile_now` does for one caller. A
    /// decided one is looked at for drift. The row after it.
    async fn reconcile_unless_held(
        self: &Arc<Self>,
        op: Operation,
    ) -> Result<Option<Operation>, StoreError> {
        if op.state.is_terminal() {
            self.verify_one(op.clone()).await?;
            return Ok(Some(op));
        }
        if self.exec.held().contains(&op.id) {
            return Ok(None);
        }
        let Some(claimed) = self
            .store
            .operation_claim_one(op.id, &self.replica, self.lease)
            .await?
        else {
            return Ok(None);
        };
        let hold = self.exec.hold(super::lease_of(&claimed));
        let db_now = self.store.now().await?;
        let seen = self
            .observe_server(claimed.server_id, super::look_trace([&claimed]))
            .await;
        self.pass_traced(claimed, &seen, db_now).await;
        drop(hold);
        Ok(Some(op))
    }

    /// `pinned` as it stands now (as pinned, if it cannot be read).
    async fn as_it_stands(&self, pinned: Operation, outcome: ItemOutcome) -> BulkItem {
        let op = match self.store.operation_get(pinned.id).await {
            Ok(Some(op)) => op,
            Ok(None) => pinned,
            Err(e) => {
                tracing::debug!(operation_id = %pinned.id, error = %e, "re-reading a bulk call's operation");
                pinned
            }
        };
        BulkItem { op, outcome }
    }
}

/// A turn that failed on the ledger.
fn failed(op: Operation, e: &StoreError) -> BulkItem {
    let reason = match e {
        StoreError::NotFound(_) => Reason::OperationNotFound,
        StoreError::DeadlineExceeded { .. } => Reason::DatabaseDeadline,
        StoreError::Corrupt { .. } => Reason::LedgerRowUnreadable,
        StoreError::Overloaded { .. } => Reason::LedgerOverloaded,
        _ => Reason::DatabaseUnavailable,
    };
    let err = OperationError::new(reason, e.to_string()).with("operation_id", op.id);
    BulkItem {
        op,
        outcome: ItemOutcome::Failed(err),
    }
}

//! The only place that sees protobuf types: the `VolumeReconciler` service,
//! its conversions and the mapping of errors to `Status`. Requests are
//! parsed into domain types here (rule 1).
//!
//! The layers of the server chain, outermost first (`startup` stacks them):
//! - [`metrics`]: counts and times every answer.
//! - [`deadline`]: the caller's deadline, and the backstop before it.
//! - [`auth`]: who the caller is, and what its role may do.
//! - [`overload`]: load shedding per class of RPC and per caller.
//! - [`message_limit`]: a message past `--max-message-bytes` is refused.
//!
//! And around the handlers:
//! - `request`: what a handler reads of a request besides its message.
//! - [`convert`]: domain ⇄ protobuf conversions.
//! - [`status`]: the one mapping to `tonic::Status`.
//! - `watch`: `WatchOperation`'s stream.
//! - `filter`: a list's or a bulk call's filter, and a list's page.
//! - `fleet`: `CancelOperation` and the bulk calls.
//! - `early`: a layer's early answer waits for the request's body.
//! - [`pb`]: the generated protobuf types and their descriptor set.
//! - [`methods`]: one table of the RPCs: each one's role, shed class and
//!   kind, read by the layers above.
//!
//! Why it is one file: past its tests (a fifth of it), it is the
//! `VolumeReconciler` implementation, one method per RPC, each a parse, a
//! call and a conversion; the rest of the boundary is in the files above.

pub mod auth;
pub mod convert;
pub mod deadline;
mod early;
mod filter;
mod fleet;
pub mod message_limit;
pub mod methods;
pub mod metrics;
pub mod overload;
mod request;
pub mod status;
mod watch;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use uuid::Uuid;

use crate::domain::validate::parse_uuid;
use crate::domain::{
    Action, Caller, CallerKey, Deadline, DevicePath, IdempotencyKey, InvalidField, Labels, OpKey,
    RequestParams, State, Tag,
};
use crate::executor::{ExecError, Executor, OpRequest};
use crate::reconciler::Reconciler;
use crate::store::StoreError;
use request::{Mutation, Scope, caller_of, deadline_of};

pub mod pb {
    #![allow(clippy::all, clippy::pedantic)]
    tonic::include_proto!("volume_reconciler.v1");
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("volume_reconciler_descriptor");
}

use pb::volume_reconciler_server::VolumeReconciler;

pub const DEFAULT_PAGE_SIZE: u32 = 50;
pub const MAX_PAGE_SIZE: u32 = 500;
pub const MAX_REASON_LEN: usize = 1024;

pub struct Api {
    pub exec: Arc<Executor>,
    /// The ledger, read by the methods that only read it.
    pub store: Arc<dyn crate::store::Store>,
    pub reconciler: Arc<Reconciler>,
    /// The longest a watch waits for its next message.
    pub watch_idle: Duration,
}

fn op_id(field: &'static str, value: &str) -> Result<Uuid, Status> {
    parse_uuid(field, value).map_err(status::invalid)
}

fn optional<T>(
    value: &str,
    parse: impl Fn(&str) -> Result<T, InvalidField>,
) -> Result<Option<T>, Status> {
    if value.is_empty() {
        Ok(None)
    } else {
        parse(value).map(Some).map_err(status::invalid)
    }
}

impl Api {
    /// The answer of a unary method. Requests are counted and timed by
    /// `metrics::GrpcMetricsLayer` (outermost in the server chain, so it
    /// also sees the answers of the layers in front of the handlers), not
    /// here: `method` names the call for the reader only.
    fn done<T>(&self, _method: &str, r: Result<T, Status>) -> Result<Response<T>, Status> {
        r.map(Response::new)
    }

    /// Runs a parsed AttachVolume/DetachVolume. The submit future is made
    /// here (the request moves into it), so the returned future holds only
    /// that and the method name.
    fn mutate<'a>(
        &'a self,
        method: &'static str,
        parsed: Result<Parsed, Status>,
        m: Mutation,
    ) -> Pin<Box<dyn Future<Output = Result<Response<pb::Operation>, Status>> + Send + 'a>> {
        let Mutation {
            deadline,
            scope,
            trace,
            inflight,
            ..
        } = m;
        match parsed {
            Err(s) => Box::pin(std::future::ready(self.done(method, Err(s)))),
            Ok(p) => {
                let req = OpRequest {
                    action: p.action,
                    key: p.key,
                    server_id: p.server_id,
                    volume_id: p.volume_id,
                    params: p.params,
                    labels: p.labels,
                    trace,
                    inflight,
                };
                use futures_util::FutureExt as _;
                use futures_util::future::Either;
                // A combinator, not an async block: a block would keep the
                // captured future and the awaited one in separate slots
                // (twice its size, in each of thousands of waiting calls).
                Box::pin(
                    self.exec
                        .submit(req, deadline)
                        .then(move |done| match done {
                            // Whose operation holds the volume decides what the
                            // answer may say (a read, on this rare path only).
                            Err(ExecError::Store(StoreError::VolumeBusy {
                                volume_id,
                                operation_id,
                            })) => Either::Left(Box::pin(async move {
                                let named = self.names_holder(&scope, operation_id, deadline).await;
                                let busy =
                                    status::volume_busy(volume_id, named.then_some(operation_id));
                                self.done(method, Err(busy))
                            })),
                            done => {
                                let result = done
                                    .map_err(status::from_exec)
                                    .and_then(status::from_operation)
                                    .map(|op| convert::operation_to_pb(&op));
                                Either::Right(std::future::ready(self.done(method, result)))
                            }
                        }),
                )
            }
        }
    }

    /// Whether VOLUME_BUSY may name `holder` (the operation holding the
    /// volume) to a caller of `scope`: to one who reads every caller's, or
    /// to the holder's own caller. To anyone else the volume is busy and
    /// nothing more; when the holder cannot be read in time, the answer
    /// does not name it either (it says less, never more).
    async fn names_holder(&self, scope: &Scope, holder: Uuid, deadline: Deadline) -> bool {
        if *scope == Scope::All {
            return true;
        }
        let read = crate::store::within(
            deadline.at,
            "read the operation holding the volume",
            self.store.operation_get(holder),
        )
        .await;
        match read {
            Ok(found) => scope.visible(found).is_some(),
            Err(e) => {
                tracing::warn!(operation_id = %holder, error = %e, "could not read the operation holding the volume; VOLUME_BUSY does not name it");
                false
            }
        }
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::Operation, Status>> + Send>>;

/// A mutating call's message, parsed (the rest of its request is its
/// `Mutation`).
struct Parsed {
    action: Action,
    key: OpKey,
    server_id: Uuid,
    volume_id: Uuid,
    params: RequestParams,
    labels: Labels,
}

/// A request's labels, checked (field `labels`).
fn labels(map: HashMap<String, String>) -> Result<Labels, Status> {
    Labels::parse("labels", map).map_err(status::invalid)
}

/// An attach's fields, parsed (AttachVolume, EnsureAttached).
fn attach_request(
    key: OpKey,
    server_id: &str,
    volume_id: &str,
    device: &str,
    tag: &str,
    delete_on_termination: Option<bool>,
    labelled: HashMap<String, String>,
) -> Result<Parsed, Status> {
    let server_id = op_id("server_id", server_id)?;
    let volume_id = op_id("volume_id", volume_id)?;
    let device = optional(device, DevicePath::parse)?;
    let tag = optional(tag, Tag::parse)?;
    Ok(Parsed {
        action: Action::Attach,
        key,
        server_id,
        volume_id,
        params: RequestParams {
            device: device.map(|d| d.as_str().to_string()),
            tag: tag.map(|t| t.as_str().to_string()),
            delete_on_termination,
        },
        labels: labels(labelled)?,
    })
}

/// A detach's fields, parsed (DetachVolume, EnsureDetached).
fn detach_request(
    key: OpKey,
    server_id: &str,
    volume_id: &str,
    labelled: HashMap<String, String>,
) -> Result<Parsed, Status> {
    Ok(Parsed {
        action: Action::Detach,
        key,
        server_id: op_id("server_id", server_id)?,
        volume_id: op_id("volume_id", volume_id)?,
        params: RequestParams::default(),
        labels: labels(labelled)?,
    })
}

#[tonic::async_trait]
impl VolumeReconciler for Api {
    // The mutating calls are written out (not `async fn`): the request is
    // parsed before the future is made, so each of the thousands of calls
    // that can wait at once holds only the operation it waits on, not the
    // request it came with.
    fn attach_volume<'life0, 'async_trait>(
        &'life0 self,
        request: Request<pb::AttachVolumeRequest>,
    ) -> Pin<Box<dyn Future<Output = Result<Response<pb::Operation>, Status>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        let m = Mutation::of(&request);
        let r = request.into_inner();
        let parsed = IdempotencyKey::parse(&r.idempotency_key)
            .map_err(status::invalid)
            .and_then(|key| {
                let key = OpKey::Keyed(CallerKey::new(m.caller.clone(), key));
                attach_request(
                    key,
                    &r.server_id,
                    &r.volume_id,
                    &r.device,
                    &r.tag,
                    r.delete_on_termination,
                    r.labels,
                )
            });
        self.mutate("AttachVolume", parsed, m)
    }

    fn detach_volume<'life0, 'async_trait>(
        &'life0 self,
        request: Request<pb::DetachVolumeRequest>,
    ) -> Pin<Box<dyn Future<Output = Result<Response<pb::Operation>, Status>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        let m = Mutation::of(&request);
        let r = request.into_inner();
        let parsed = IdempotencyKey::parse(&r.idempotency_key)
            .map_err(status::invalid)
            .and_then(|key| {
                let key = OpKey::Keyed(CallerKey::new(m.caller.clone(), key));
                detach_request(key, &r.server_id, &r.volume_id, r.labels)
            });
        self.mutate("DetachVolume", parsed, m)
    }

    fn ensure_attached<'life0, 'async_trait>(
        &'life0 self,
        request: Request<pb::EnsureAttachedRequest>,
    ) -> Pin<Box<dyn Future<Output = Result<Response<pb::Operation>, Status>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        let m = Mutation::of(&request);
        let r = request.into_inner();
        let key = OpKey::Ensure(m.caller.clone());
        let parsed = attach_request(
            key,
            &r.server_id,
            &r.volume_id,
            &r.device,
            &r.tag,
            r.delete_on_termination,
            r.labels,
        );
        self.mutate("EnsureAttached", parsed, m)
    }

    fn ensure_detached<'life0, 'async_trait>(
        &'life0 self,
        request: Request<pb::EnsureDetachedRequest>,
    ) -> Pin<Box<dyn Future<Output = Result<Response<pb::Operation>, Status>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        let m = Mutation::of(&request);
        let r = request.into_inner();
        let parsed = detach_request(
            OpKey::Ensure(m.caller.clone()),
            &r.server_id,
            &r.volume_id,
            r.labels,
        );
        self.mutate("EnsureDetached", parsed, m)
    }

    async fn get_operation(
        &self,
        request: Request<pb::GetOperationRequest>,
    ) -> Result<Response<pb::Operation>, Status> {
        let own = caller_of(&request);
        let scope = Scope::of(&request);
        let r = request.into_inner();
        let store = &self.store;
        let result = async {
            let op = match (r.operation_id.is_empty(), r.idempotency_key.is_empty()) {
                (false, true) => {
                    let id = op_id("operation_id", &r.operation_id)?;
                    // Another caller's: as if there were none.
                    scope.visible(store.operation_get(id).await.map_err(status::from_store)?)
                }
                (true, false) => {
                    let key = IdempotencyKey::parse(&r.idempotency_key).map_err(status::invalid)?;
                    let named =
                        convert::caller_filter("caller", &r.caller).map_err(status::invalid)?;
                    // Keys are per caller: a caller reads its own; an
                    // operator may name whose.
                    let whose = match (named, scope == Scope::All) {
                        (None, _) => own.clone(),
                        (Some(c), true) => Caller::named(c),
                        (Some(c), false) if own.as_str() == c => own.clone(),
                        (Some(_), false) => {
                            return Err(status::invalid(InvalidField::new(
                                "caller",
                                "only an operator may look up another caller's key",
                            )));
                        }
                    };
                    let key = CallerKey::new(whose, key);
                    let found = store
                        .operation_get_by_key(&key)
                        .await
                        .map_err(status::from_store)?;
                    if found.is_none()
                        && let Some(pruned_at) = store
                            .operation_key_expired(&key)
                            .await
                            .map_err(status::from_store)?
                    {
                        // Pruned by retention: say so, not "no such key".
                        return Err(status::from_store(crate::store::StoreError::KeyExpired {
                            key: key.key().as_str().to_string(),
                            pruned_at,
                        }));
                    }
                    found
                }
                _ => {
                    return Err(status::invalid(InvalidField::new(
                        "operation_id",
                        "give exactly one of operation_id and idempotency_key",
                    )));
                }
            };
            let op = op.ok_or_else(|| {
                let mut m = std::collections::BTreeMap::new();
                m.insert("operation_id".to_string(), r.operation_id.clone());
                m.insert("idempotency_key".to_string(), r.idempotency_key.clone());
                status::status(
                    crate::domain::Reason::OperationNotFound,
                    "no such operation",
                    m,
                )
            })?;
            Ok(convert::operation_to_pb(&op))
        }
        .await;
        self.done("GetOperation", result)
    }

    async fn list_operations(
        &self,
        request: Request<pb::ListOperationsRequest>,
    ) -> Result<Response<pb::ListOperationsResponse>, Status> {
        let scope = Scope::of(&request);
        let r = request.into_inner();
        let result = async {
            let filter = filter::of_list(&r, &scope)?;
            let (limit, after) = filter::page(r.page_size, &r.page_token)?;
            let page = self
                .store
                .operation_list(&filter, after, limit)
                .await
                .map_err(status::from_store)?;
            Ok(pb::ListOperationsResponse {
                operations: page
                    .operations
                    .iter()
                    .map(convert::operation_to_pb)
                    .collect(),
                next_page_token: page
                    .next_cursor
                    .map(convert::encode_page_token)
                    .unwrap_or_default(),
            })
        }
        .await;
        self.done("ListOperations", result)
    }

    type WatchOperationStream = WatchStream;

    async fn watch_operation(
        &self,
        request: Request<pb::WatchOperationRequest>,
    ) -> Result<Response<Self::WatchOperationStream>, Status> {
        let deadline = deadline_of(&request);
        let scope = Scope::of(&request);
        let r = request.into_inner();
        let id = match op_id("operation_id", &r.operation_id) {
            Ok(id) => id,
            Err(s) => return self.done("WatchOperation", Err(s)),
        };
        let store = self.store.clone();
        // Another caller's operation registers no wait, as one nobody has.
        if let Err(s) = scope.admits(store.as_ref(), id).await {
            return self.done("WatchOperation", Err(s));
        }
        // Subscribe, and register for other replicas' decisions, before
        // the first read, so no change falls in between (see `Store::watch`
        // for the one that still may, and the stream's re-reads).
        let changes = store.subscribe();
        crate::store::watch_within(
            store.as_ref(),
            id,
            watch::next_message_by(self.watch_idle, deadline)
                .saturating_duration_since(tokio::time::Instant::now()),
            watch::RECHECK,
        )
        .await;
        let first = match store
            .operation_get(id)
            .await
            .map(|found| scope.visible(found))
        {
            Ok(Some(op)) => op,
            Ok(None) => {
                return self.done(
                    "WatchOperation",
                    Err(status::from_store(crate::store::StoreError::NotFound(id))),
                );
            }
            Err(e) => return self.done("WatchOperation", Err(status::from_store(e))),
        };
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(watch::follow(
            store,
            first,
            changes,
            tx,
            self.watch_idle,
            deadline,
        ));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn reconcile_operation(
        &self,
        request: Request<pb::ReconcileOperationRequest>,
    ) -> Result<Response<pb::Operation>, Status> {
        let deadline = deadline_of(&request);
        let scope = Scope::of(&request);
        let r = request.into_inner();
        let result = async {
            let id = op_id("operation_id", &r.operation_id)?;
            // Only operators pass the auth layer here; should another role
            // ever, another caller's operation is none of its business.
            scope.admits(self.store.as_ref(), id).await?;
            let op = self
                .reconciler
                .reconcile_now(id, deadline)
                .await
                .map_err(status::from_store)?;
            Ok(convert::operation_to_pb(&op))
        }
        .await;
        self.done("ReconcileOperation", result)
    }

    async fn list_operation_events(
        &self,
        request: Request<pb::ListOperationEventsRequest>,
    ) -> Result<Response<pb::ListOperationEventsResponse>, Status> {
        let scope = Scope::of(&request);
        let r = request.into_inner();
        let result = async {
            let id = op_id("operation_id", &r.operation_id)?;
            let store = &self.store;
            let found = store.operation_get(id).await.map_err(status::from_store)?;
            if scope.visible(found).is_none() {
                return Err(status::from_store(crate::store::StoreError::NotFound(id)));
            }
            let events = store
                .operation_events(id)
                .await
                .map_err(status::from_store)?;
            Ok(pb::ListOperationEventsResponse {
                events: events.iter().map(convert::event_to_pb).collect(),
            })
        }
        .await;
        self.done("ListOperationEvents", result)
    }

    async fn get_operation_stats(
        &self,
        _request: Request<pb::GetOperationStatsRequest>,
    ) -> Result<Response<pb::OperationStats>, Status> {
        // Only operators pass the auth layer here.
        let result = async {
            let counts = self
                .store
                .operation_count_by_state()
                .await
                .map_err(status::from_store)?;
            Ok(convert::stats_to_pb(&counts))
        }
        .await;
        self.done("GetOperationStats", result)
    }

    async fn resolve_operation(
        &self,
        request: Request<pb::ResolveOperationRequest>,
    ) -> Result<Response<pb::Operation>, Status> {
        let caller = caller_of(&request);
        let scope = Scope::of(&request);
        let r = request.into_inner();
        let result = async {
            let id = op_id("operation_id", &r.operation_id)?;
            let state = match pb::State::try_from(r.state).ok().and_then(convert::state_from_pb) {
                Some(s @ (State::Succeeded | State::Failed)) => s,
                _ => return Err(status::invalid(InvalidField::new("state", "must be STATE_SUCCEEDED or STATE_FAILED"))),
            };
            let reason = convert::resolve_reason(&r.reason).map_err(status::invalid)?;
            // Only operators pass the auth layer here (see ReconcileOperation).
            scope.admits(self.store.as_ref(), id).await?;
            let op = self
                .exec
                .resolve_by_operator(id, state, reason, caller.name())
                .await
                .map_err(status::from_store)?;
            tracing::info!(operation_id = %op.id, state = state.as_str(), reason, "operation resolved by an operator");
            Ok(convert::operation_to_pb(&op))
        }
        .await;
        self.done("ResolveOperation", result)
    }

    async fn cancel_operation(
        &self,
        request: Request<pb::CancelOperationRequest>,
    ) -> Result<Response<pb::Operation>, Status> {
        let result = self.cancel(request).await;
        self.done("CancelOperation", result)
    }

    async fn reconcile_operations(
        &self,
        request: Request<pb::ReconcileOperationsRequest>,
    ) -> Result<Response<pb::BulkResult>, Status> {
        let result = self.reconcile_many(request).await;
        self.done("ReconcileOperations", result)
    }

    async fn resolve_operations(
        &self,
        request: Request<pb::ResolveOperationsRequest>,
    ) -> Result<Response<pb::BulkResult>, Status> {
        let result = self.resolve_many(request).await;
        self.done("ResolveOperations", result)
    }
}

#[cfg(test)]
mod size_probe {
    //! Thousands of AttachVolume calls can wait at once: the handler parses
    //! the request before making its future, so each holds only the
    //! operation it waits on (see also the executor's size probe).
    use super::*;
    use crate::domain::BudgetPolicy;
    use crate::executor::ExecSettings;
    use crate::executor::metrics::ExecutorMetrics;
    use crate::reconciler::metrics::ReconcilerMetrics;
    use pb::volume_reconciler_server::VolumeReconciler;

    /// The service's methods over `store` and `nova`, as `startup` wires
    /// them, with the default settings.
    pub(super) fn api_over(
        store: Arc<dyn crate::store::Store>,
        nova: Arc<crate::nova::NovaClient>,
    ) -> Api {
        let exec = Executor::new(
            store.clone(),
            nova.clone(),
            BudgetPolicy::default(),
            "r".into(),
            ExecSettings::default(),
            ExecutorMetrics::unscraped(),
        );
        let deps = crate::reconciler::Deps {
            store: store.clone(),
            nova,
            policy: BudgetPolicy::default(),
            replica: "r".into(),
            lease: ExecSettings::default().lease,
            metrics: ReconcilerMetrics::unscraped(),
            failures: exec.failures().clone(),
        };
        Api {
            reconciler: Reconciler::new(exec.clone(), deps, Default::default()),
            exec,
            store,
            watch_idle: Duration::from_secs(1),
        }
    }

    #[tokio::test]
    async fn a_waiting_attach_handler_stays_small() {
        let store: Arc<dyn crate::store::Store> = Arc::new(
            crate::store::SqliteStore::connect("sqlite::memory:")
                .await
                .unwrap(),
        );
        let nova = Arc::new(crate::nova::NovaClient::new(
            crate::nova::NovaConfig::default(),
        ));
        let api = api_over(store, nova);
        let f = api.attach_volume(tonic::Request::new(pb::AttachVolumeRequest {
            idempotency_key: "k".into(),
            server_id: Uuid::from_u128(1).to_string(),
            volume_id: Uuid::from_u128(2).to_string(),
            ..Default::default()
        }));
        assert!(
            std::mem::size_of_val(&*f) <= 900,
            "attach_volume handler: {}",
            std::mem::size_of_val(&*f)
        );
    }
}

#[cfg(test)]
mod scope_tests {
    //! The handlers' own scoping of ReconcileOperation and
    //! ResolveOperation, behind the auth layer's role check (which no
    //! orchestrator passes for them today): another caller's operation is
    //! none, as an id nobody has.
    use super::size_probe::api_over;
    use super::*;
    use crate::domain::{NewEvent, request_fingerprint};
    use crate::store::{CreateOutcome, NewOperation, Store};
    use pb::volume_reconciler_server::VolumeReconciler;

    async fn api_with_an_operation_of(caller: &str) -> (Api, Uuid) {
        let store: Arc<dyn Store> = Arc::new(
            crate::store::SqliteStore::connect("sqlite::memory:")
                .await
                .unwrap(),
        );
        let (server, volume) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let params = RequestParams::default();
        let new = NewOperation {
            id: Uuid::now_v7(),
            key: crate::domain::CallerKey::parse(Some(caller), "k")
                .unwrap()
                .into(),
            fingerprint: request_fingerprint(
                Action::Attach,
                server,
                volume,
                &params,
                &crate::domain::Labels::none(),
            ),
            action: Action::Attach,
            server_id: server,
            volume_id: volume,
            params,
            labels: crate::domain::Labels::none(),
            state: State::Pending,
            attempts: 0,
            deadline_in: Duration::from_secs(60),
            lease_owner: "nobody".into(),
            lease_for: Duration::ZERO,
            trace: None,
            replica: "r".into(),
            events: vec![NewEvent::new("recorded", "pending")],
            record_by: None,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let CreateOutcome::Created(op) = store.operation_create(new, deadline).await.unwrap()
        else {
            unreachable!("a fresh key")
        };
        let nova = Arc::new(crate::nova::NovaClient::new(
            crate::nova::NovaConfig::default(),
        ));
        let api = api_over(store, nova);
        (api, op.id)
    }

    fn as_orchestrator<T>(name: &str, msg: T) -> Request<T> {
        let mut r = Request::new(msg);
        r.extensions_mut().insert(auth::Caller {
            name: name.into(),
            role: auth::Role::Orchestrator,
        });
        r
    }

    #[tokio::test]
    async fn reconcile_and_resolve_of_another_callers_operation_are_not_found() {
        let (api, id) = api_with_an_operation_of("ci-a").await;
        let missing = Uuid::now_v7();
        let mut answers = Vec::new();
        for asked in [id, missing] {
            let reconcile = api
                .reconcile_operation(as_orchestrator(
                    "ci-b",
                    pb::ReconcileOperationRequest {
                        operation_id: asked.to_string(),
                    },
                ))
                .await
                .unwrap_err();
            let resolve = api
                .resolve_operation(as_orchestrator(
                    "ci-b",
                    pb::ResolveOperationRequest {
                        operation_id: asked.to_string(),
                        state: pb::State::Failed as i32,
                        reason: "why".into(),
                    },
                ))
                .await
                .unwrap_err();
            let blank = |s: &Status| (s.code(), s.message().replace(&asked.to_string(), "<id>"));
            answers.push((blank(&reconcile), blank(&resolve)));
        }
        assert_eq!(answers[0].0.0, tonic::Code::NotFound, "{answers:?}");
        assert_eq!(
            answers[0], answers[1],
            "another caller's is as one nobody has"
        );
        let row = api.store.operation_get(id).await.unwrap().unwrap();
        assert_eq!(row.state, State::Pending, "nothing was decided");
    }
}

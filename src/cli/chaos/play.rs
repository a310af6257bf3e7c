//! Plays one history against the replicas and the simulator: each client's
//! calls in order (faults installed just before each, on the call's own
//! volume), the happenings at their instants; then waits until every
//! operation of the history is decided and its verification window has
//! passed, and gathers what the checker reads.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::RngExt;
use tokio::time::Instant;
use tonic::metadata::MetadataValue;
use uuid::Uuid;

use super::cluster::{Cluster, OPERATOR, caller_name, token_of};
use super::dbfaults::DbFaults;
use super::history::{Call, Happening, History, KeyChoice};
use super::windows::{Windows, decision_bound};
use crate::domain::{Action, Operation, OperationEvent, State};
use crate::grpc::pb;
use crate::grpc::pb::volume_reconciler_client::VolumeReconcilerClient;
use crate::sim::{FaultOp, FaultRule, Sim};
use crate::store::{OperationFilter, Store};

/// What a caller was answered.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// The operation, as answered (SUCCEEDED).
    Decided { op_id: Uuid, state: State },
    /// An error status; `op_id` and `state` from its `ErrorInfo`.
    Refused {
        code: tonic::Code,
        reason: String,
        op_id: Option<Uuid>,
        state: Option<String>,
        message: String,
        /// Its `ErrorInfo` metadata.
        meta: BTreeMap<String, String>,
    },
    /// The caller gave up before an answer.
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct Answer {
    pub call: usize,
    /// The replica that answered (the last one tried).
    pub replica: Option<String>,
    pub caller: String,
    pub key: String,
    pub sent_at: DateTime<Utc>,
    pub answered_at: DateTime<Utc>,
    pub outcome: Outcome,
}

/// One operation of the history, with its reconcile log.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub op: Operation,
    pub events: Vec<OperationEvent>,
}

/// Everything the checker reads about one played history.
pub struct Played {
    pub history: History,
    pub answers: Vec<Answer>,
    pub ops: Vec<Recorded>,
    /// The simulator's truth, only this history's volumes.
    pub effects: Vec<crate::sim::Effect>,
    pub requests: Vec<crate::sim::RequestRecord>,
    /// Operations still open when the wait for them ended.
    pub open_at_end: usize,
    /// The run's database faults until the history was gathered.
    pub outages: Vec<super::dbfaults::DbOutage>,
}

pub struct Context {
    pub cluster: Arc<Cluster>,
    pub sim: Arc<Sim>,
    pub store: Arc<dyn Store>,
    pub windows: Windows,
    /// The database faults (PostgreSQL only).
    pub db: Option<Arc<DbFaults>>,
}

/// How long the checker's own reads of the ledger are tried while the
/// database is away (a crash and its restart take seconds).
const LEDGER_READ_WITHIN: Duration = Duration::from_secs(120);

/// The key a call sends.
pub fn key_of(h: &History, n: usize) -> String {
    match h.calls[n].key {
        KeyChoice::Fresh => format!("chaos-{}-{}-{n}", h.seed, h.run),
        KeyChoice::Replay(m) | KeyChoice::Foreign(m) => key_of(h, m),
    }
}

fn client(url: &str) -> anyhow::Result<VolumeReconcilerClient<tonic::transport::Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())?
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy();
    Ok(VolumeReconcilerClient::new(channel))
}

fn request<T>(msg: T, caller: &str, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    if let Ok(v) = MetadataValue::try_from(format!("Bearer {}", token_of(caller))) {
        r.metadata_mut().insert("authorization", v);
    }
    r
}

fn outcome_of(result: Result<pb::Operation, tonic::Status>) -> Outcome {
    match result {
        Ok(op) => Outcome::Decided {
            op_id: op.id.parse().unwrap_or_default(),
            state: match pb::State::try_from(op.state) {
                Ok(pb::State::Succeeded) => State::Succeeded,
                Ok(pb::State::Failed) => State::Failed,
                Ok(pb::State::Unknown) => State::Unknown,
                Ok(pb::State::Pending) => State::Pending,
                _ => State::InProgress,
            },
        },
        Err(s) => {
            use tonic_types::StatusExt;
            let details = s.get_error_details();
            let info = details.error_info();
            let meta = |k: &str| info.and_then(|i| i.metadata.get(k).cloned());
            Outcome::Refused {
                code: s.code(),
                reason: info.map(|i| i.reason.clone()).unwrap_or_default(),
                op_id: meta("operation_id").and_then(|v| v.parse().ok()),
                state: meta("state"),
                message: s.message().to_string(),
                meta: info
                    .map(|i| i.metadata.clone().into_iter().collect())
                    .unwrap_or_default(),
            }
        }
    }
}

/// Runs a call beside its operator's action and returns the call's
/// outcome with the instant it came. The operator's call (a reconcile, a
/// resolve) can end seconds after the answer; the answer is timed when it
/// arrives, for the checks that hold it to its decision
/// (`answer-follows-decision`) and to the database's outages.
async fn answered_beside<T>(
    call: impl std::future::Future<Output = T>,
    operator: impl std::future::Future<Output = ()>,
) -> (T, DateTime<Utc>) {
    let call = async {
        let out = call.await;
        (out, Utc::now())
    };
    let (answered, ()) = tokio::join!(call, operator);
    answered
}

impl Context {
    /// Sends one call to a live replica, moving to another when one is
    /// unreachable (with the same key), within the call's deadline; the
    /// answer, and which replica gave it.
    async fn send(&self, h: &History, n: usize) -> (Outcome, Option<String>) {
        let c = &h.calls[n];
        let caller = caller_name(c.client);
        let deadline = Instant::now() + Duration::from_millis(c.deadline_ms);
        let key = key_of(h, n);
        let (server, volume) = (
            h.servers[c.server].to_string(),
            h.volumes[c.volume].to_string(),
        );
        let mut tried = None;
        loop {
            let live = self.cluster.live_named();
            let now = Instant::now();
            if live.is_empty() || now >= deadline {
                let refused = Outcome::Refused {
                    code: tonic::Code::Unavailable,
                    reason: "NO_REPLICA".into(),
                    op_id: None,
                    state: None,
                    message: "no replica answered before the deadline".into(),
                    meta: BTreeMap::new(),
                };
                return (refused, tried);
            }
            let (name, url) = &live[rand::rng().random_range(0..live.len())];
            tried = Some(name.clone());
            let Ok(mut grpc) = client(url) else { continue };
            let remaining = deadline - now;
            let result = match c.action {
                Action::Attach => grpc
                    .attach_volume(request(
                        pb::AttachVolumeRequest {
                            idempotency_key: key.clone(),
                            server_id: server.clone(),
                            volume_id: volume.clone(),
                            ..Default::default()
                        },
                        &caller,
                        remaining,
                    ))
                    .await
                    .map(|r| r.into_inner()),
                Action::Detach => grpc
                    .detach_volume(request(
                        pb::DetachVolumeRequest {
                            idempotency_key: key.clone(),
                            server_id: server.clone(),
                            volume_id: volume.clone(),
                            ..Default::default()
                        },
                        &caller,
                        remaining,
                    ))
                    .await
                    .map(|r| r.into_inner()),
            };
            match result {
                Err(s) if crate::client::is_transport_failure(&s, deadline) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => return (outcome_of(other), tried),
            }
        }
    }

    fn install_faults(&self, h: &History, c: &Call) {
        for pf in &c.faults {
            let rule = FaultRule::new(pf.op, pf.fault.clone()).times(pf.times);
            let rule = match pf.op {
                FaultOp::List => rule.server(h.servers[c.server]),
                _ => rule.volume(h.volumes[c.volume]),
            };
            self.sim.add_fault(rule);
        }
    }

    /// One client's calls, in order.
    async fn client_calls(&self, h: &History, client: usize) -> Vec<Answer> {
        let mut answers = Vec::new();
        for (n, c) in h
            .calls
            .iter()
            .enumerate()
            .filter(|(_, c)| c.client == client)
        {
            tokio::time::sleep(Duration::from_millis(c.pause_ms)).await;
            self.install_faults(h, c);
            let sent_at = Utc::now();
            let call = async {
                match c.cancel_after_ms {
                    Some(ms) => {
                        tokio::select! {
                            o = self.send(h, n) => o,
                            _ = tokio::time::sleep(Duration::from_millis(ms)) => (Outcome::Cancelled, None),
                        }
                    }
                    None => self.send(h, n).await,
                }
            };
            let operator = async {
                if let Some((after, resolve)) = c.operator {
                    tokio::time::sleep(Duration::from_millis(after)).await;
                    self.operator(h, n, resolve).await;
                }
            };
            let ((outcome, replica), answered_at) = answered_beside(call, operator).await;
            answers.push(Answer {
                call: n,
                replica,
                caller: caller_name(client),
                key: key_of(h, n),
                sent_at,
                answered_at,
                outcome,
            });
        }
        answers
    }

    async fn operator(&self, h: &History, n: usize, resolve: Option<State>) {
        let key = key_of(h, n);
        // The operator finds the operation by the caller's key.
        let caller = caller_name(h.calls[n].client);
        let Ok(key) = crate::domain::CallerKey::parse(Some(&caller), &key) else {
            tracing::debug!(key, "chaos: an operator's key that is no key");
            return;
        };
        let op = match self.store.operation_get_by_key(&key).await {
            Ok(Some(op)) => op,
            // Nothing to act on (yet): no call made it; an operator would
            // find nothing either.
            Ok(None) => return,
            // The database is away: the operator's look failed, as an
            // operator's would; nothing is judged of it.
            Err(e) => {
                tracing::debug!(error = %e, "chaos: the operator could not find the operation");
                return;
            }
        };
        let live = self.cluster.live();
        let Some(url) = live.first() else { return };
        let Ok(mut grpc) = client(url) else { return };
        let timeout = Duration::from_secs(5);
        // Answers to the operator are not judged here: the ledger and the
        // callers' answers are.
        let answered = match resolve {
            None => grpc
                .reconcile_operation(request(
                    pb::ReconcileOperationRequest {
                        operation_id: op.id.to_string(),
                    },
                    OPERATOR,
                    timeout,
                ))
                .await
                .map(drop),
            Some(state) => grpc
                .resolve_operation(request(
                    pb::ResolveOperationRequest {
                        operation_id: op.id.to_string(),
                        state: crate::grpc::convert::state_to_pb(state) as i32,
                        reason: "chaos: an operator's decision".into(),
                    },
                    OPERATOR,
                    timeout,
                ))
                .await
                .map(drop),
        };
        if let Err(s) = answered {
            tracing::debug!(code = ?s.code(), message = s.message(), "operator call refused");
        }
    }

    /// The happenings at their instants; a database fault runs on while
    /// the next ones come, and the history waits for its faults to end.
    async fn happenings(&self, h: &History) {
        let start = Instant::now();
        let mut faults = Vec::new();
        for t in &h.happenings {
            tokio::time::sleep_until(start + Duration::from_millis(t.at_ms)).await;
            match &t.what {
                Happening::DeleteServer(s) => self.sim.remove_server(h.servers[*s]),
                Happening::DeleteVolume(v) => self.sim.remove_volume(h.volumes[*v]),
                Happening::AttachOutOfBand { server, volume } => {
                    self.sim
                        .attach_out_of_band(h.servers[*server], h.volumes[*volume]);
                }
                Happening::DetachOutOfBand { server, volume } => {
                    self.sim
                        .detach_out_of_band(h.servers[*server], h.volumes[*volume]);
                }
                Happening::Reconcile(n) => self.operator(h, *n, None).await,
                Happening::Resolve(n, state) => self.operator(h, *n, Some(*state)).await,
                Happening::Db(fault) => match &self.db {
                    Some(db) => {
                        let (db, fault) = (db.clone(), fault.clone());
                        let cluster = self.cluster.clone();
                        faults.push(tokio::spawn(async move { db.play(&fault, &cluster).await }));
                    }
                    None => tracing::debug!("chaos: a database fault without a database to fault"),
                },
            }
        }
        for f in faults {
            if let Err(e) = f.await {
                tracing::warn!(error = %e, "chaos: a database fault's task failed");
            }
        }
    }

    /// A read of the ledger by the checker itself (not through a replica's
    /// proxy), tried again while the database is away, for up to
    /// `LEDGER_READ_WITHIN`.
    async fn ledger<T, F, Fut>(&self, what: &str, read: F) -> anyhow::Result<T>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, crate::store::StoreError>>,
    {
        let until = Instant::now() + LEDGER_READ_WITHIN;
        loop {
            match read().await {
                Ok(v) => return Ok(v),
                Err(e) if Instant::now() < until => {
                    tracing::debug!(error = %e, "chaos: reading {what} again");
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => anyhow::bail!(
                    "reading {what}: the database did not answer for {} s: {e}",
                    LEDGER_READ_WITHIN.as_secs()
                ),
            }
        }
    }

    /// The database faults so far (none without a database to fault).
    pub fn outages(&self) -> Vec<super::dbfaults::DbOutage> {
        self.db.as_ref().map(|d| d.outages()).unwrap_or_default()
    }

    /// Every operation on the history's volumes.
    async fn operations(&self, h: &History) -> anyhow::Result<Vec<Operation>> {
        let mut ops = Vec::new();
        for v in h.volumes {
            let filter = OperationFilter {
                volume_id: Some(v),
                ..Default::default()
            };
            let page = self
                .ledger("the operations of a volume", || {
                    self.store.operation_list(&filter, None, 500)
                })
                .await?;
            ops.extend(page.operations);
        }
        Ok(ops)
    }

    /// Plays `h` and gathers what the checker needs.
    pub async fn play(&self, h: History) -> anyhow::Result<Played> {
        let clients = h.calls.iter().map(|c| c.client).max().map_or(0, |m| m + 1);
        let calls = futures_util::future::join_all((0..clients).map(|c| self.client_calls(&h, c)));
        let (answers, ()) = tokio::join!(calls, self.happenings(&h));
        let answers: Vec<Answer> = answers.into_iter().flatten().collect();
        // The last instant an intent may still commit: a write is not
        // started past its caller's deadline, and one under way then ends
        // within a round trip.
        let intents_by = answers
            .iter()
            .map(|a| a.sent_at + chrono::Duration::milliseconds(h.calls[a.call].deadline_ms as i64))
            .max()
            .unwrap_or_else(Utc::now)
            + chrono::Duration::from_std(self.windows.db_round_trip + Duration::from_millis(500))
                .unwrap_or_default();
        let open_at_end = self.settle(&h, intents_by).await?;
        let ops = self.operations(&h).await?;
        let mut recorded = Vec::new();
        for op in ops {
            let events = self
                .ledger("an operation's log", || self.store.operation_events(op.id))
                .await?;
            recorded.push(Recorded { op, events });
        }
        let volumes: HashSet<Uuid> = h.volumes.iter().copied().collect();
        let servers: HashSet<Uuid> = h.servers.iter().copied().collect();
        self.sim.forget_faults_of(&servers, &volumes);
        let (effects, requests) = self.sim.truth_of(&volumes);
        Ok(Played {
            effects,
            requests,
            history: h,
            answers,
            ops: recorded,
            open_at_end,
            outages: self.outages(),
        })
    }

    /// Waits until every operation is decided (bounded by its deadline,
    /// the settle window and the slack, and past each database outage it
    /// met by the outage and the recovery from it: see
    /// `windows::decision_bound`), then until the last one's verification
    /// window has passed. Returns how many stayed open.
    async fn settle(&self, h: &History, intents_by: DateTime<Utc>) -> anyhow::Result<usize> {
        let w = self.windows;
        let verify = chrono::Duration::from_std(w.verify_window + Duration::from_millis(500))
            .unwrap_or_default();
        loop {
            let ops = self.operations(h).await?;
            let outages = self.outages();
            let now = Utc::now();
            // Open and not handed to people (escalated is settled too).
            let open: Vec<&Operation> = ops
                .iter()
                .filter(|o| !o.state.is_terminal() && o.escalated_at.is_none())
                .collect();
            let overdue = open.iter().all(|o| decision_bound(o, w, &outages) < now);
            // Read again until quiet: an intent held up by the database
            // may commit after its caller left, and then the
            // operation is waited for like the others.
            let verified = ops
                .iter()
                .filter_map(|o| o.completed_at)
                .max()
                .is_none_or(|last| now >= last + verify);
            if (open.is_empty() || overdue) && now >= intents_by && verified {
                return Ok(open.len());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An operator's action that ends after the answer does not move the
    /// answer's instant (it did: a reconcile that took 3.7 s under load
    /// made an answer given at once look 6.1 s late to
    /// `answer-follows-decision`).
    #[tokio::test]
    async fn an_answer_is_timed_when_it_comes_not_when_its_operator_is_done() {
        let operator_done = std::sync::Mutex::new(None);
        let operator = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            *operator_done.lock().expect("not poisoned") = Some(Utc::now());
        };
        let (out, answered_at) = answered_beside(async { "answer" }, operator).await;
        assert_eq!(out, "answer", "the call's own outcome comes back");
        let operator_done = operator_done
            .lock()
            .expect("not poisoned")
            .expect("the operator ran to its end");
        assert!(
            answered_at < operator_done,
            "answered at {answered_at}, the operator done at {operator_done}: the answer was timed after its operator"
        );
    }
}

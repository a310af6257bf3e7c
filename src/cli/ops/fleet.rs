//! `ops cancel`, and `ops reconcile`/`ops resolve` by filter (the bulk
//! calls): the same filter flags as `ops list`, `--dry-run` to see what
//! a real run would touch, `--max-count` and `--rate`.

use clap::Args;

use super::filter::FilterArgs;
use super::render::{op_json, resolution_name, state_name};
use super::{Ops, StateArg, Verdict, state_filter};
use crate::cli::output::{emit, plain_table};
use crate::grpc::pb;

/// `ops cancel`: an operation before anything that may take effect left.
#[derive(Debug, Clone, Args)]
pub struct CancelArgs {
    /// The operation's id.
    pub id: String,
    /// Why (kept in its last error and reconcile log).
    #[arg(long)]
    pub reason: Option<String>,
}

/// How a bulk call goes.
#[derive(Debug, Clone, Args)]
pub struct BulkArgs {
    /// List what a real run would act on; touch nothing.
    #[arg(long, help_heading = "Bulk")]
    pub dry_run: bool,
    /// At most this many operations (the server's default: 100; at most
    /// 10000). The same call again goes on with what still matches.
    #[arg(long, value_name = "N", help_heading = "Bulk")]
    pub max_count: Option<u32>,
    /// At most this many operations a second (the server's default: 10).
    #[arg(long, value_name = "PER_SECOND", help_heading = "Bulk")]
    pub rate: Option<f64>,
}

/// `ops reconcile`: one operation, or every one a filter matches.
#[derive(Debug, Clone, Args)]
pub struct ReconcileArgs {
    /// The operation's id; without it, the filter flags choose (at least
    /// one).
    pub id: Option<String>,
    /// Only operations in this state.
    #[arg(long, value_enum, help_heading = "Filters", conflicts_with = "id")]
    pub state: Option<StateArg>,
    #[command(flatten)]
    pub filter: FilterArgs,
    #[command(flatten)]
    pub bulk: BulkArgs,
}

/// `ops resolve`: one operation, or every open one a filter matches.
#[derive(Debug, Clone, Args)]
pub struct ResolveArgs {
    /// The operation's id; without it, the filter flags choose (at least
    /// one).
    pub id: Option<String>,
    /// The decision.
    #[arg(long, value_enum)]
    pub state: Verdict,
    /// Why you know better than the cloud shows (required; audited).
    #[arg(long)]
    pub reason: String,
    /// Only operations in this (open) state.
    #[arg(long, value_enum, help_heading = "Filters", conflicts_with = "id")]
    pub in_state: Option<StateArg>,
    #[command(flatten)]
    pub filter: FilterArgs,
    #[command(flatten)]
    pub bulk: BulkArgs,
}

fn verdict(v: Verdict) -> pb::State {
    match v {
        Verdict::Succeeded => pb::State::Succeeded,
        Verdict::Failed => pb::State::Failed,
    }
}

impl Ops {
    pub(super) async fn cancel(&self, a: CancelArgs) -> anyhow::Result<()> {
        let op = self
            .client
            .raw()
            .cancel_operation(self.req(pb::CancelOperationRequest {
                operation_id: a.id,
                reason: a.reason.unwrap_or_default(),
            }))
            .await
            .map_err(|e| self.fail(e))?
            .into_inner();
        self.print_one(&op)
    }

    pub(super) async fn reconcile(&self, a: ReconcileArgs) -> anyhow::Result<()> {
        let Some(id) = a.id else {
            let state = state_filter(a.state);
            a.filter.narrowing("reconcile", state)?;
            let result = self
                .client
                .raw()
                .reconcile_operations(self.req(pb::ReconcileOperationsRequest {
                    filter: Some(a.filter.to_pb(state)),
                    dry_run: a.bulk.dry_run,
                    max_count: a.bulk.max_count.unwrap_or(0),
                    rate_per_second: a.bulk.rate.unwrap_or(0.0),
                }))
                .await
                .map_err(|e| self.fail(e))?
                .into_inner();
            return self.print_bulk("reconcile", &result);
        };
        let op = self
            .client
            .raw()
            .reconcile_operation(self.req(pb::ReconcileOperationRequest { operation_id: id }))
            .await
            .map_err(|e| self.fail(e))?
            .into_inner();
        self.print_one(&op)
    }

    pub(super) async fn resolve(&self, a: ResolveArgs) -> anyhow::Result<()> {
        let state = verdict(a.state);
        let Some(id) = a.id else {
            a.filter.narrowing("resolve", state_filter(a.in_state))?;
            let result = self
                .client
                .raw()
                .resolve_operations(self.req(pb::ResolveOperationsRequest {
                    filter: Some(a.filter.to_pb(state_filter(a.in_state))),
                    state: state as i32,
                    reason: a.reason,
                    dry_run: a.bulk.dry_run,
                    max_count: a.bulk.max_count.unwrap_or(0),
                    rate_per_second: a.bulk.rate.unwrap_or(0.0),
                }))
                .await
                .map_err(|e| self.fail(e))?
                .into_inner();
            return self.print_bulk("resolve", &result);
        };
        let op = self
            .client
            .raw()
            .resolve_operation(self.req(pb::ResolveOperationRequest {
                operation_id: id,
                state: state as i32,
                reason: a.reason,
            }))
            .await
            .map_err(|e| self.fail(e))?
            .into_inner();
        self.print_one(&op)
    }

    /// A bulk call's result: a line per operation and a summary; JSON
    /// and YAML as the API has it; the ids alone for `name`.
    fn print_bulk(&self, what: &str, r: &pb::BulkResult) -> anyhow::Result<()> {
        let json = || {
            let items: Vec<serde_json::Value> = r
                .items
                .iter()
                .map(|i| {
                    serde_json::json!({
                        "operation_id": i.operation_id,
                        "outcome": outcome_name(i.outcome),
                        "operation": i.operation.as_ref().map(op_json),
                        "error": i.error.as_ref().map(|e| serde_json::json!({
                            "reason": e.reason, "message": e.message, "metadata": e.metadata})),
                    })
                })
                .collect();
            serde_json::json!({
                "bulk_id": r.bulk_id, "dry_run": r.dry_run, "matched": r.matched,
                "more": r.more, "interrupted": r.interrupted, "items": items,
            })
        };
        if let Some(doc) = self.output.document(&json()) {
            return Ok(emit(&doc)?);
        }
        if self.output == super::Output::Name {
            let ids: String = r
                .items
                .iter()
                .map(|i| format!("{}\n", i.operation_id))
                .collect();
            return Ok(emit(&ids)?);
        }
        let mut table = plain_table(["OPERATION", "OUTCOME", "STATE", "RESOLUTION", "ERROR"]);
        for i in &r.items {
            let (state, resolution) = i
                .operation
                .as_ref()
                .map_or(("-".to_string(), "-".to_string()), |op| {
                    (state_name(op.state), resolution_name(op.resolution))
                });
            table.add_row(vec![
                i.operation_id.clone(),
                outcome_name(i.outcome),
                state,
                resolution,
                i.error.as_ref().map_or(String::new(), |e| e.reason.clone()),
            ]);
        }
        let mut out = format!("{}\n", table.trim_fmt());
        out += &format!(
            "{what} {}{}: {} matched{}{}\n",
            r.bulk_id,
            if r.dry_run {
                " (dry run: nothing touched)"
            } else {
                ""
            },
            r.matched,
            if r.more {
                "; more match: run it again for the next ones"
            } else {
                ""
            },
            if r.interrupted {
                "; interrupted by its deadline: run it again to go on"
            } else {
                ""
            },
        );
        Ok(emit(&out)?)
    }
}

fn outcome_name(v: i32) -> String {
    pb::BulkOutcome::try_from(v)
        .map(|o| {
            o.as_str_name()
                .trim_start_matches("BULK_OUTCOME_")
                .to_ascii_lowercase()
        })
        .unwrap_or_else(|_| v.to_string())
}

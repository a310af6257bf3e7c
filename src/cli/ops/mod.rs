//! `volume-reconciler ops ...`: list (paged), show (with the event
//! timeline), reconcile, watch and resolve, over gRPC with the client
//! options of [`ClientArgs`](crate::cli::client_args::ClientArgs). Plain
//! tables for people, `--output json` for scripts.

mod render;

use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use tokio_stream::StreamExt;

use super::client_args::ClientArgs;
use crate::client::{CallError, Client};
use crate::config::duration;
use crate::grpc::pb;
use render::{
    event_json, list_table, op_json, print_events, print_op, request_ids, resolution_name,
    state_name, ts,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct OpsArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    #[arg(long, value_enum, default_value = "table", global = true)]
    pub output: Output,
    /// Deadline of each call.
    #[arg(long, value_parser = duration, default_value = "30s", global = true)]
    pub timeout: Duration,
    #[command(subcommand)]
    pub command: OpsCommand,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StateArg {
    Pending,
    InProgress,
    Unknown,
    Succeeded,
    Failed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Verdict {
    Succeeded,
    Failed,
}

/// Filters and paging of `ops list`.
#[derive(Debug, Clone, Args)]
pub struct ListArgs {
    #[arg(long, value_enum)]
    pub state: Option<StateArg>,
    #[arg(long)]
    pub server_id: Option<String>,
    #[arg(long)]
    pub volume_id: Option<String>,
    /// Only operations whose later observation disagreed.
    #[arg(long)]
    pub drifted: bool,
    /// Only operations handed to people (not decidable in time).
    #[arg(long)]
    pub escalated: bool,
    /// Only this caller's operations.
    #[arg(long)]
    pub caller: Option<String>,
    /// Operations per page (the server caps it at 500).
    #[arg(long, default_value_t = 50)]
    pub limit: i32,
    /// Start at this page (the `next_page_token` of an earlier page).
    #[arg(long, conflicts_with = "all")]
    pub page_token: Option<String>,
    /// Every page, not just the first.
    #[arg(long)]
    pub all: bool,
}

/// Which operation `ops show` prints.
#[derive(Debug, Clone, Args)]
pub struct ShowArgs {
    /// The operation's id.
    #[arg(required_unless_present = "idempotency_key")]
    pub id: Option<String>,
    /// Or the idempotency key its caller sent (`--key` is the TLS key).
    #[arg(long, conflicts_with = "id")]
    pub idempotency_key: Option<String>,
    /// Whose key it is (keys are per caller; default: the caller this
    /// client authenticates as). Naming another caller needs an operator.
    #[arg(long, requires = "idempotency_key")]
    pub caller: Option<String>,
}

#[derive(Debug, Clone, Subcommand)]
pub enum OpsCommand {
    /// List operations, newest first.
    List(ListArgs),
    /// An operation and its reconcile log, by id or by idempotency key.
    Show(ShowArgs),
    /// Re-observe an operation now and record the finding.
    Reconcile { id: String },
    /// Follow an operation until it is decided.
    Watch { id: String },
    /// Decide an operation by hand (audited).
    Resolve {
        id: String,
        #[arg(long, value_enum)]
        state: Verdict,
        #[arg(long)]
        reason: String,
    },
}

/// Prints `value` as pretty JSON.
fn print_json(value: &serde_json::Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

fn state_filter(state: Option<StateArg>) -> pb::State {
    match state {
        None => pb::State::Unspecified,
        Some(StateArg::Pending) => pb::State::Pending,
        Some(StateArg::InProgress) => pb::State::InProgress,
        Some(StateArg::Unknown) => pb::State::Unknown,
        Some(StateArg::Succeeded) => pb::State::Succeeded,
        Some(StateArg::Failed) => pb::State::Failed,
    }
}

/// One `ops` invocation: the client and the output settings.
struct Ops {
    client: Client,
    /// The server as given, for errors that never reached it.
    server: String,
    json: bool,
    timeout: Duration,
}

impl Ops {
    /// A failed call as an error the caller can act on (code, reason and
    /// metadata kept for `--output json`); one that never reached the
    /// server names it.
    fn fail(&self, status: tonic::Status) -> anyhow::Error {
        let mut e = CallError::from_status(&status, 0);
        if e.code == tonic::Code::Unavailable && e.reason.is_none() {
            e.message = format!("cannot reach {}: {}", self.server, e.message);
        }
        anyhow::Error::new(e)
    }

    fn req<T>(&self, msg: T) -> tonic::Request<T> {
        self.client.request(msg, Some(self.timeout))
    }

    /// The first page, the page at `--page-token`, or every page (`--all`).
    async fn list(&self, f: ListArgs) -> anyhow::Result<()> {
        let mut request = pb::ListOperationsRequest {
            state: state_filter(f.state) as i32,
            server_id: f.server_id.unwrap_or_default(),
            volume_id: f.volume_id.unwrap_or_default(),
            page_size: f.limit,
            page_token: f.page_token.unwrap_or_default(),
            drifted_only: f.drifted,
            escalated_only: f.escalated,
            caller: f.caller.unwrap_or_default(),
        };
        let mut ops = Vec::new();
        let next = loop {
            let resp = self
                .client
                .raw()
                .list_operations(self.req(request.clone()))
                .await
                .map_err(|e| self.fail(e))?
                .into_inner();
            ops.extend(resp.operations);
            if !f.all || resp.next_page_token.is_empty() {
                break resp.next_page_token;
            }
            request.page_token = resp.next_page_token;
        };
        if self.json {
            let ops: Vec<_> = ops.iter().map(op_json).collect();
            return print_json(&serde_json::json!({"operations": ops, "next_page_token": next}));
        }
        println!("{}", list_table(&ops).trim_fmt());
        if !next.is_empty() {
            println!("more: --page-token {next} (or --all)");
        }
        Ok(())
    }

    async fn show(&self, which: ShowArgs) -> anyhow::Result<()> {
        let mut c = self.client.raw();
        let op = c
            .get_operation(self.req(pb::GetOperationRequest {
                operation_id: which.id.unwrap_or_default(),
                idempotency_key: which.idempotency_key.unwrap_or_default(),
                caller: which.caller.unwrap_or_default(),
            }))
            .await
            .map_err(|e| self.fail(e))?
            .into_inner();
        let events = c
            .list_operation_events(self.req(pb::ListOperationEventsRequest {
                operation_id: op.id.clone(),
            }))
            .await
            .map_err(|e| self.fail(e))?
            .into_inner()
            .events;
        if self.json {
            let evs: Vec<_> = events.iter().map(event_json).collect();
            let (global, nova) = request_ids(&events);
            let trace_id = render::trace_of(&events).map(|(t, _)| t);
            return print_json(&serde_json::json!({
                "operation": op_json(&op),
                "trace_id": trace_id,
                "request_ids": {"global": global, "nova": nova},
                "events": evs,
            }));
        }
        print_op(&op);
        print_events(&events);
        Ok(())
    }

    async fn watch(&self, id: String) -> anyhow::Result<()> {
        // A watch has no deadline of its own: it ends when decided.
        let mut stream = self
            .client
            .raw()
            .watch_operation(
                self.client
                    .request(pb::WatchOperationRequest { operation_id: id }, None),
            )
            .await
            .map_err(|e| self.fail(e))?
            .into_inner();
        while let Some(item) = stream.next().await {
            let op = item.map_err(|e| self.fail(e))?;
            if self.json {
                println!("{}", serde_json::to_string(&op_json(&op))?);
            } else {
                println!(
                    "{}  {} ({}) attempts={}",
                    ts(&op.updated_at),
                    state_name(op.state),
                    resolution_name(op.resolution),
                    op.attempts
                );
            }
        }
        Ok(())
    }

    /// Prints one operation the way the output format asks.
    fn print_one(&self, op: &pb::Operation) -> anyhow::Result<()> {
        if self.json {
            return print_json(&op_json(op));
        }
        print_op(op);
        Ok(())
    }

    async fn reconcile(&self, id: String) -> anyhow::Result<()> {
        let op = self
            .client
            .raw()
            .reconcile_operation(self.req(pb::ReconcileOperationRequest { operation_id: id }))
            .await
            .map_err(|e| self.fail(e))?
            .into_inner();
        self.print_one(&op)
    }

    async fn resolve(&self, id: String, state: Verdict, reason: String) -> anyhow::Result<()> {
        let state = match state {
            Verdict::Succeeded => pb::State::Succeeded,
            Verdict::Failed => pb::State::Failed,
        };
        let op = self
            .client
            .raw()
            .resolve_operation(self.req(pb::ResolveOperationRequest {
                operation_id: id,
                state: state as i32,
                reason,
            }))
            .await
            .map_err(|e| self.fail(e))?
            .into_inner();
        self.print_one(&op)
    }
}

pub async fn run(args: OpsArgs) -> anyhow::Result<()> {
    let ops = Ops {
        client: Client::connect(&args.client.connect_options()?)?,
        server: args.client.server.clone(),
        json: args.output == Output::Json,
        timeout: args.timeout,
    };
    match args.command {
        OpsCommand::List(f) => ops.list(f).await,
        OpsCommand::Show(which) => ops.show(which).await,
        OpsCommand::Watch { id } => ops.watch(id).await,
        OpsCommand::Reconcile { id } => ops.reconcile(id).await,
        OpsCommand::Resolve { id, state, reason } => ops.resolve(id, state, reason).await,
    }
}

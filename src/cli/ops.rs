//! `volume-reconciler ops ...`: list, show (with the event timeline),
//! reconcile, watch and resolve, over gRPC. Plain tables for people,
//! `--output json` for scripts.

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use clap::{Args, Subcommand, ValueEnum};
use tokio_stream::StreamExt;

use super::output::{align_right, plain_table};
use crate::client::{CallError, Client};
use crate::config::duration;
use crate::grpc::pb;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct OpsArgs {
    /// The server to talk to.
    #[arg(
        long,
        env = "VOLUME_RECONCILER_SERVER",
        default_value = format!("http://{}", crate::config::DEFAULT_LISTEN),
        global = true
    )]
    pub server: String,
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

#[derive(Debug, Clone, Subcommand)]
pub enum OpsCommand {
    /// List operations, newest first.
    List {
        #[arg(long, value_enum)]
        state: Option<StateArg>,
        #[arg(long)]
        server_id: Option<String>,
        #[arg(long)]
        volume_id: Option<String>,
        /// Only operations whose later observation disagreed.
        #[arg(long)]
        drifted: bool,
        #[arg(long, default_value_t = 50)]
        limit: i32,
    },
    /// An operation and its reconcile log.
    Show { id: String },
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

fn ts(t: &Option<prost_types::Timestamp>) -> String {
    t.as_ref()
        .and_then(|t| Utc.timestamp_opt(t.seconds, t.nanos.max(0) as u32).single())
        .map(|d: DateTime<Utc>| d.format("%Y-%m-%d %H:%M:%S%.3f").to_string())
        .unwrap_or_else(|| "-".into())
}

fn enum_name(s: &str, prefix: &str) -> String {
    s.trim_start_matches(prefix).to_ascii_lowercase()
}

fn state_name(v: i32) -> String {
    pb::State::try_from(v)
        .map(|s| enum_name(s.as_str_name(), "STATE_"))
        .unwrap_or_else(|_| v.to_string())
}

fn resolution_name(v: i32) -> String {
    match pb::Resolution::try_from(v) {
        Ok(pb::Resolution::Unspecified) => "-".into(),
        Ok(r) => enum_name(r.as_str_name(), "RESOLUTION_"),
        Err(_) => v.to_string(),
    }
}

fn action_name(v: i32) -> String {
    pb::Action::try_from(v)
        .map(|s| enum_name(s.as_str_name(), "ACTION_"))
        .unwrap_or_else(|_| v.to_string())
}

fn op_json(op: &pb::Operation) -> serde_json::Value {
    serde_json::json!({
        "id": op.id,
        "idempotency_key": op.idempotency_key,
        "action": action_name(op.action),
        "state": state_name(op.state),
        "resolution": resolution_name(op.resolution),
        "server_id": op.server_id,
        "volume_id": op.volume_id,
        "attempts": op.attempts,
        "attachment": op.attachment.as_ref().map(|a| serde_json::json!({
            "id": a.id, "device": a.device, "tag": a.tag, "delete_on_termination": a.delete_on_termination})),
        "last_error": op.last_error.as_ref().map(|e| serde_json::json!({
            "reason": e.reason, "message": e.message, "metadata": e.metadata})),
        "created_at": ts(&op.created_at),
        "updated_at": ts(&op.updated_at),
        "completed_at": ts(&op.completed_at),
        "drifted": op.drifted,
    })
}

fn print_op(op: &pb::Operation) {
    println!("operation   {}", op.id);
    println!("key         {}", op.idempotency_key);
    println!(
        "action      {} volume {} on server {}",
        action_name(op.action),
        op.volume_id,
        op.server_id
    );
    println!(
        "state       {} ({}){}",
        state_name(op.state),
        resolution_name(op.resolution),
        if op.drifted {
            "  DRIFTED: a later observation disagrees"
        } else {
            ""
        }
    );
    println!("attempts    {}", op.attempts);
    if let Some(a) = &op.attachment {
        println!(
            "attachment  {} device {}",
            a.id,
            if a.device.is_empty() { "-" } else { &a.device }
        );
    }
    if let Some(e) = &op.last_error {
        println!("last error  {}: {}", e.reason, e.message);
    }
    println!(
        "created     {}   completed {}",
        ts(&op.created_at),
        ts(&op.completed_at)
    );
}

const EVENT_KEYS: &[&str] = &[
    "attempt",
    "outbound_deadline_ms",
    "http_status",
    "stage",
    "error_class",
    "reason",
    "nova_fault",
    "nova_message",
    "elapsed_ms",
    "present",
    "state",
    "resolution",
    "pause_ms",
    "caller",
    "cause",
];

fn print_events(events: &[pb::OperationEvent]) {
    println!();
    println!("reconcile log:");
    let mut table = plain_table(["AT", "REPLICA", "EVENT", "DETAIL"]);
    for e in events {
        let extras: Vec<String> = EVENT_KEYS
            .iter()
            .filter_map(|k| e.metadata.get(*k).map(|v| format!("{k}={v}")))
            .collect();
        let detail = if extras.is_empty() {
            e.detail.clone()
        } else {
            format!("{}\n{}", e.detail, extras.join(" "))
        };
        table.add_row([ts(&e.at), e.replica.clone(), e.kind.clone(), detail]);
    }
    for line in table.lines() {
        println!(" {}", line.trim_end());
    }
}

fn fail(e: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{}", CallError::from_status(&e, 0))
}

fn req<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    r
}

type Raw =
    crate::grpc::pb::volume_reconciler_client::VolumeReconcilerClient<tonic::transport::Channel>;

/// Prints `value` as pretty JSON.
fn print_json(value: &serde_json::Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Filters of `ops list`.
#[derive(Debug, Clone, Default)]
struct ListFilter {
    state: Option<StateArg>,
    server_id: Option<String>,
    volume_id: Option<String>,
    drifted: bool,
    limit: i32,
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

async fn list(c: &mut Raw, f: ListFilter, args: &OpsArgs) -> anyhow::Result<()> {
    let resp = c
        .list_operations(req(
            pb::ListOperationsRequest {
                state: state_filter(f.state) as i32,
                server_id: f.server_id.unwrap_or_default(),
                volume_id: f.volume_id.unwrap_or_default(),
                page_size: f.limit,
                page_token: String::new(),
                drifted_only: f.drifted,
            },
            args.timeout,
        ))
        .await
        .map_err(fail)?
        .into_inner();
    if args.output == Output::Json {
        let ops: Vec<_> = resp.operations.iter().map(op_json).collect();
        return print_json(
            &serde_json::json!({"operations": ops, "next_page_token": resp.next_page_token}),
        );
    }
    let mut table = plain_table([
        "ID",
        "ACTION",
        "STATE",
        "RESOLUTION",
        "TRY",
        "VOLUME",
        "CREATED",
        "REASON",
    ]);
    for op in &resp.operations {
        let reason = op
            .last_error
            .as_ref()
            .map(|e| e.reason.as_str())
            .unwrap_or("");
        table.add_row([
            op.id.clone(),
            action_name(op.action),
            state_name(op.state),
            resolution_name(op.resolution),
            op.attempts.to_string(),
            op.volume_id.clone(),
            ts(&op.created_at),
            format!("{reason}{}", if op.drifted { " DRIFTED" } else { "" }),
        ]);
    }
    align_right(&mut table, &[4]);
    println!("{}", table.trim_fmt());
    if !resp.next_page_token.is_empty() {
        println!("(more: raise --limit or filter)");
    }
    Ok(())
}

async fn show(c: &mut Raw, id: String, args: &OpsArgs) -> anyhow::Result<()> {
    let op = c
        .get_operation(req(
            pb::GetOperationRequest {
                operation_id: id.clone(),
                idempotency_key: String::new(),
            },
            args.timeout,
        ))
        .await
        .map_err(fail)?
        .into_inner();
    let events = c
        .list_operation_events(req(
            pb::ListOperationEventsRequest { operation_id: id },
            args.timeout,
        ))
        .await
        .map_err(fail)?
        .into_inner()
        .events;
    if args.output == Output::Json {
        let evs: Vec<_> = events
            .iter()
            .map(|e| serde_json::json!({"at": ts(&e.at), "kind": e.kind, "detail": e.detail, "metadata": e.metadata, "replica": e.replica}))
            .collect();
        return print_json(&serde_json::json!({"operation": op_json(&op), "events": evs}));
    }
    print_op(&op);
    print_events(&events);
    Ok(())
}

async fn watch(c: &mut Raw, id: String, args: &OpsArgs) -> anyhow::Result<()> {
    // A watch has no deadline of its own: it ends when decided.
    let mut stream = c
        .watch_operation(pb::WatchOperationRequest { operation_id: id })
        .await
        .map_err(fail)?
        .into_inner();
    while let Some(item) = stream.next().await {
        let op = item.map_err(fail)?;
        if args.output == Output::Json {
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
fn print_one(op: &pb::Operation, args: &OpsArgs) -> anyhow::Result<()> {
    if args.output == Output::Json {
        return print_json(&op_json(op));
    }
    print_op(op);
    Ok(())
}

pub async fn run(args: OpsArgs) -> anyhow::Result<()> {
    let client = Client::connect_lazy(&args.server)?;
    let mut c = client.raw();
    match args.command.clone() {
        OpsCommand::List {
            state,
            server_id,
            volume_id,
            drifted,
            limit,
        } => {
            let filter = ListFilter {
                state,
                server_id,
                volume_id,
                drifted,
                limit,
            };
            list(&mut c, filter, &args).await
        }
        OpsCommand::Show { id } => show(&mut c, id, &args).await,
        OpsCommand::Watch { id } => watch(&mut c, id, &args).await,
        OpsCommand::Reconcile { id } => {
            let op = c
                .reconcile_operation(req(
                    pb::ReconcileOperationRequest { operation_id: id },
                    args.timeout,
                ))
                .await
                .map_err(fail)?
                .into_inner();
            print_one(&op, &args)
        }
        OpsCommand::Resolve { id, state, reason } => {
            let state = match state {
                Verdict::Succeeded => pb::State::Succeeded,
                Verdict::Failed => pb::State::Failed,
            };
            let op = c
                .resolve_operation(req(
                    pb::ResolveOperationRequest {
                        operation_id: id,
                        state: state as i32,
                        reason,
                    },
                    args.timeout,
                ))
                .await
                .map_err(fail)?
                .into_inner();
            print_one(&op, &args)
        }
    }
}

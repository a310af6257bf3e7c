//! `volume-reconciler ops ...`: attach and detach, list (paged), show
//! (with the event timeline), reconcile, watch and resolve, over gRPC with
//! the client options of [`ClientArgs`](crate::cli::client_args::ClientArgs).
//! Plain tables for people, `-o json|yaml|name` for scripts.
//!
//! - `render`: how an operation is shown, as tables, text or JSON.
//! - `mutate`: `ops attach` and `ops detach`.
//! - `filter`: the filter flags `list`, `reconcile` and `resolve` share.
//! - `fleet`: `ops cancel`, and `reconcile`/`resolve` by filter.

mod filter;
mod fleet;
mod mutate;
mod render;

use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use tokio_stream::StreamExt;

use super::client_args::ClientArgs;
pub use super::format::Output;
use super::format::{Ending, yaml};
use super::output::emit;
use crate::client::Client;
use crate::domain::parse::duration;
use crate::grpc::pb;
pub use filter::FilterArgs;
pub use fleet::{BulkArgs, CancelArgs, ReconcileArgs, ResolveArgs};
pub use mutate::{AttachArgs, DetachArgs};
use render::{
    events_text, list_table, op_json, op_text, op_with_events_json, resolution_name, state_name, ts,
};

#[derive(Debug, Clone, Args)]
#[command(after_help = super::format::EXIT_HELP)]
pub struct OpsArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// How to print: table, wide, json, yaml or name (the ids alone).
    #[arg(
        short = 'o',
        long,
        value_enum,
        default_value = "table",
        global = true,
        help_heading = "Output"
    )]
    pub output: Output,
    /// Deadline of each call (default 30s); of `ops attach` and `ops
    /// detach`, the caller's deadline sent with the call, however long
    /// (e.g. 1h); of `ops watch`, how long to follow before giving up
    /// (default: until decided).
    #[arg(long, value_parser = duration, global = true, help_heading = "Connection")]
    pub timeout: Option<Duration>,
    #[command(subcommand)]
    pub command: OpsCommand,
}

/// How long connecting (TCP, TLS, HTTP/2) may take.
const CONNECT_WITHIN: Duration = Duration::from_secs(5);

/// A call's deadline when `--timeout` is not given.
const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);

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

/// The largest page the server gives (`ListOperations`' page_size).
const MAX_PAGE: i32 = 500;

/// Filters and paging of `ops list`.
#[derive(Debug, Clone, Args)]
pub struct ListArgs {
    /// Only operations in this state.
    #[arg(long, value_enum, help_heading = "Filters")]
    pub state: Option<StateArg>,
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Operations per page, 1 to 500 (the server's own limit).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i32).range(1..=i64::from(MAX_PAGE)), help_heading = "Paging")]
    pub limit: i32,
    /// Start at this page (the `next_page_token` of an earlier page).
    #[arg(long, conflicts_with = "all", help_heading = "Paging")]
    pub page_token: Option<String>,
    /// Every page, not just the first.
    #[arg(long, help_heading = "Paging")]
    pub all: bool,
}

/// Which operation `ops show` prints.
#[derive(Debug, Clone, Args)]
pub struct ShowArgs {
    /// The operation's id.
    #[arg(required_unless_present = "idempotency_key")]
    pub id: Option<String>,
    /// Or the idempotency key its caller sent.
    #[arg(long, conflicts_with = "id")]
    pub idempotency_key: Option<String>,
    /// Whose key it is (keys are per caller; default: the caller this
    /// client authenticates as). Naming another caller needs an operator.
    #[arg(long, requires = "idempotency_key")]
    pub caller: Option<String>,
}

#[derive(Debug, Clone, Subcommand)]
pub enum OpsCommand {
    /// Attach a volume to a server, once per idempotency key; waits for
    /// the decision and prints the operation and its reconcile log.
    Attach(AttachArgs),
    /// Detach a volume from a server, once per idempotency key; waits for
    /// the decision and prints the operation and its reconcile log.
    Detach(DetachArgs),
    /// List operations, newest first.
    List(ListArgs),
    /// An operation and its reconcile log, by id or by idempotency key.
    Show(ShowArgs),
    /// Re-observe an operation now and record the finding; or, with
    /// filter flags instead of an id, every operation they match (at
    /// `--rate`, at most `--max-count`; `--dry-run` lists them).
    Reconcile(ReconcileArgs),
    /// Follow an operation until it is decided (or `--timeout` passes:
    /// then exit 75, the retry status: it goes on, watch again), a line per
    /// change of state.
    Watch {
        /// The operation's id.
        id: String,
    },
    /// Every operation of the ledger by state and resolution (one pass over
    /// the whole ledger: on demand, for operators).
    Stats,
    /// Decide an operation by hand (audited); or, with filter flags
    /// instead of an id, every open operation they match (`--in-state`
    /// for the state filter; `--dry-run` lists what a real run decides).
    Resolve(ResolveArgs),
    /// Cancel an operation before anything that may take effect was sent
    /// for it (FAILED, resolution cancelled; otherwise refused
    /// CANCEL_TOO_LATE: only a detach undoes an attach).
    Cancel(CancelArgs),
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
    /// How the client connects, for errors that never reached the server.
    connect: crate::client::ConnectOptions,
    output: Output,
    timeout: Option<Duration>,
}

impl Ops {
    /// A failed call as an error the caller can act on (code, reason and
    /// metadata kept for `--output json`); one that never reached the
    /// server names it.
    fn fail(&self, status: tonic::Status) -> anyhow::Error {
        anyhow::Error::new(crate::client::explain(&status, &self.connect, 0))
    }

    fn req<T>(&self, msg: T) -> tonic::Request<T> {
        self.client
            .request(msg, Some(self.timeout.unwrap_or(DEFAULT_CALL_TIMEOUT)))
    }

    /// The first page, the page at `--page-token`, or every page (`--all`).
    async fn list(&self, f: ListArgs) -> anyhow::Result<()> {
        let mut request = pb::ListOperationsRequest {
            page_size: f.limit,
            page_token: f.page_token.unwrap_or_default(),
            filter: Some(f.filter.to_pb(state_filter(f.state))),
            ..Default::default()
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
        let json = || {
            let ops: Vec<_> = ops.iter().map(op_json).collect();
            serde_json::json!({"operations": ops, "next_page_token": next})
        };
        if let Some(doc) = self.output.document(&json()) {
            return Ok(emit(&doc)?);
        }
        if self.output == Output::Name {
            return Ok(emit(
                &ops.iter()
                    .map(|op| format!("{}\n", op.id))
                    .collect::<String>(),
            )?);
        }
        let mut out = format!(
            "{}\n",
            list_table(&ops, self.output == Output::Wide).trim_fmt()
        );
        if !next.is_empty() {
            out += &format!("more: --page-token {next} (or --all)\n");
        }
        Ok(emit(&out)?)
    }

    async fn show(&self, which: ShowArgs) -> anyhow::Result<()> {
        let op = self
            .client
            .raw()
            .get_operation(self.req(pb::GetOperationRequest {
                operation_id: which.id.unwrap_or_default(),
                idempotency_key: which.idempotency_key.unwrap_or_default(),
                caller: which.caller.unwrap_or_default(),
            }))
            .await
            .map_err(|e| self.fail(e))?
            .into_inner();
        let events = self.events_of(&op.id).await?;
        Ok(emit(&self.op_and_events(&op, &events))?)
    }

    /// The reconcile log of an operation.
    async fn events_of(&self, id: &str) -> anyhow::Result<Vec<pb::OperationEvent>> {
        Ok(self
            .client
            .raw()
            .list_operation_events(self.req(pb::ListOperationEventsRequest {
                operation_id: id.to_string(),
            }))
            .await
            .map_err(|e| self.fail(e))?
            .into_inner()
            .events)
    }

    /// An operation and its log the way the output format asks.
    fn op_and_events(&self, op: &pb::Operation, events: &[pb::OperationEvent]) -> String {
        if let Some(doc) = self.output.document(&op_with_events_json(op, events)) {
            return doc;
        }
        match self.output {
            Output::Name => format!("{}\n", op.id),
            wide => op_text(op) + &events_text(events, wide == Output::Wide),
        }
    }

    /// Follows the operation: a line per change of what it is (state,
    /// resolution, attempts, error, drift), not per update of its row;
    /// ends when it is decided, or fails when `--timeout` passes first.
    async fn watch(&self, id: String) -> anyhow::Result<()> {
        // The last state seen, kept outside the stream's future: a timeout
        // drops that future.
        let seen: std::cell::Cell<Option<i32>> = std::cell::Cell::new(None);
        let follow = async {
            // The deadline, when there is one, is the server's too.
            let request = self.client.request(
                pb::WatchOperationRequest {
                    operation_id: id.clone(),
                },
                self.timeout,
            );
            let mut stream = self
                .client
                .raw()
                .watch_operation(request)
                .await
                .map_err(|e| self.fail(e))?
                .into_inner();
            let mut last: Option<(i32, i32, u32, String, bool)> = None;
            while let Some(item) = stream.next().await {
                let op = match item {
                    Ok(op) => op,
                    // The server ends the stream at our deadline: that is
                    // the timeout, said below, not a failed call.
                    Err(s) if s.code() == tonic::Code::DeadlineExceeded => break,
                    Err(s) => return Err(self.fail(s)),
                };
                let now = (
                    op.state,
                    op.resolution,
                    op.attempts,
                    op.last_error
                        .as_ref()
                        .map(|e| e.reason.clone())
                        .unwrap_or_default(),
                    op.drifted,
                );
                if last.as_ref() != Some(&now) {
                    emit(&watch_line(self.output, &op)?)?;
                    last = Some(now);
                }
                seen.set(Some(op.state));
            }
            Ok::<_, anyhow::Error>(())
        };
        match self.timeout {
            // Past the deadline the state is what was last seen: the
            // stream's future is dropped, and the error below says so.
            Some(t) => {
                if let Ok(followed) = tokio::time::timeout(t, follow).await {
                    followed?;
                }
            }
            None => follow.await?,
        }
        let decided = matches!(
            seen.get().map(pb::State::try_from),
            Some(Ok(pb::State::Succeeded | pb::State::Failed))
        );
        match seen.get() {
            _ if decided && self.output == Output::Name => Ok(emit(&format!("{id}\n"))?),
            _ if decided => Ok(()),
            other => {
                let t = self.timeout.map(crate::domain::parse::render_duration);
                Err(Ending::Retry(format!(
                    "operation {id} was not decided {}{}; it goes on without this watch: `ops show {id}`, or watch again with a longer --timeout",
                    match &t {
                        Some(t) => format!("within --timeout {t}"),
                        None => "before the server ended the stream".to_string(),
                    },
                    other
                        .map(|state| format!(" (still {})", state_name(state)))
                        .unwrap_or_default()
                ))
                .into())
            }
        }
    }

    /// Prints one operation the way the output format asks.
    pub(super) fn print_one(&self, op: &pb::Operation) -> anyhow::Result<()> {
        if let Some(doc) = self.output.document(&op_json(op)) {
            return Ok(emit(&doc)?);
        }
        Ok(emit(&match self.output {
            Output::Name => format!("{}\n", op.id),
            _ => op_text(op),
        })?)
    }

    async fn stats(&self) -> anyhow::Result<()> {
        let stats = self
            .client
            .raw()
            .get_operation_stats(self.req(pb::GetOperationStatsRequest {}))
            .await
            .map_err(|e| self.fail(e))?
            .into_inner();
        let name = |state: i32, resolution: i32| {
            let state = pb::State::try_from(state).map_or("?".to_string(), |s| {
                s.as_str_name().trim_start_matches("STATE_").to_lowercase()
            });
            let resolution = pb::Resolution::try_from(resolution)
                .ok()
                .filter(|r| *r != pb::Resolution::Unspecified)
                .map(|r| {
                    r.as_str_name()
                        .trim_start_matches("RESOLUTION_")
                        .to_lowercase()
                });
            (state, resolution)
        };
        if self.output == Output::Name {
            return Err(Ending::Usage(
                "ops stats has no names to print: -o table, json or yaml".into(),
            )
            .into());
        }
        let json = || {
            let counts: Vec<serde_json::Value> = stats
                .counts
                .iter()
                .map(|c| {
                    let (state, resolution) = name(c.state, c.resolution);
                    serde_json::json!({"state": state, "resolution": resolution, "count": c.count})
                })
                .collect();
            serde_json::json!({"counts": counts, "total": stats.total})
        };
        if let Some(doc) = self.output.document(&json()) {
            return Ok(emit(&doc)?);
        }
        let mut out = format!(
            "{:<12} {:<11} {:>12}\n",
            "STATE", "RESOLUTION", "OPERATIONS"
        );
        for c in &stats.counts {
            let (state, resolution) = name(c.state, c.resolution);
            out += &format!(
                "{state:<12} {:<11} {:>12}\n",
                resolution.as_deref().unwrap_or("-"),
                c.count
            );
        }
        out += &format!("{:<12} {:<11} {:>12}\n", "total", "", stats.total);
        Ok(emit(&out)?)
    }
}

/// One line (or document) of `ops watch` per change of the operation:
/// a line for people, a JSON line, a YAML document; nothing for `name`,
/// which prints the id once it is decided.
fn watch_line(output: Output, op: &pb::Operation) -> anyhow::Result<String> {
    Ok(match output {
        Output::Json => format!("{}\n", serde_json::to_string(&op_json(op))?),
        Output::Yaml => format!("---\n{}", yaml(&op_json(op))),
        Output::Name => String::new(),
        Output::Table | Output::Wide => format!(
            "{}  {} ({}) attempts={}{}\n",
            ts(&op.updated_at),
            state_name(op.state),
            resolution_name(op.resolution),
            op.attempts,
            op.last_error
                .as_ref()
                .map(|e| format!("  {}", e.reason))
                .unwrap_or_default()
        ),
    })
}

pub async fn run(args: OpsArgs) -> anyhow::Result<()> {
    let connect = args.client.connect_options()?;
    let ops = Ops {
        client: Client::connect_within(&connect, CONNECT_WITHIN).await?,
        connect,
        output: args.output,
        timeout: args.timeout,
    };
    match args.command {
        OpsCommand::Attach(a) => ops.attach(a).await,
        OpsCommand::Detach(d) => ops.detach(d).await,
        OpsCommand::List(f) => ops.list(f).await,
        OpsCommand::Show(which) => ops.show(which).await,
        OpsCommand::Watch { id } => ops.watch(id).await,
        OpsCommand::Reconcile(a) => ops.reconcile(a).await,
        OpsCommand::Resolve(a) => ops.resolve(a).await,
        OpsCommand::Cancel(a) => ops.cancel(a).await,
        OpsCommand::Stats => ops.stats().await,
    }
}

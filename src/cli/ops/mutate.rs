//! `ops attach` and `ops detach`: one call through the Rust client (which
//! retries a transport failure with the same key, within the deadline),
//! under the caller's idempotency key or one made here and printed, and
//! the caller's deadline (`--timeout`, sent as the gRPC deadline however
//! long it is: the service works until the decision or that deadline).
//! The answer is the decided operation, printed with its reconcile log; a
//! failed or undecided operation is printed too (except with `-o name`,
//! whose stdout holds an id only on success), and its error, with every
//! key of the server's `ErrorInfo`, goes to stderr.

use std::io::Write;

use clap::Args;

use super::{DEFAULT_CALL_TIMEOUT, Ops, Output};
use crate::cli::format::{exit, exit_status};
use crate::cli::output::emit;
use crate::client::{AttachOptions, CallError, explain_refusal};
use crate::grpc::pb;

/// `ops attach`: which volume on which server, under which key.
#[derive(Debug, Clone, Args)]
#[command(after_help = crate::cli::format::EXIT_HELP)]
pub struct AttachArgs {
    #[command(flatten)]
    pub target: Target,
    /// The device Nova should give the volume (e.g. /dev/vdb; default:
    /// Nova's choice).
    #[arg(long)]
    pub device: Option<String>,
    /// A tag for the attachment (Nova's device tag).
    #[arg(long)]
    pub tag: Option<String>,
    /// Whether deleting the server deletes the volume (default: Nova's).
    #[arg(long, value_name = "true|false")]
    pub delete_on_termination: Option<bool>,
}

/// `ops detach`: which volume from which server, under which key.
#[derive(Debug, Clone, Args)]
#[command(after_help = crate::cli::format::EXIT_HELP)]
pub struct DetachArgs {
    #[command(flatten)]
    pub target: Target,
}

/// The server, the volume and the idempotency key of a call.
#[derive(Debug, Clone, Args)]
pub struct Target {
    /// The Nova server (its UUID).
    #[arg(long, value_name = "UUID")]
    pub server_id: String,
    /// The volume (its UUID).
    #[arg(long, value_name = "UUID")]
    pub volume_id: String,
    /// The idempotency key: the same key asks again for the same operation
    /// and never makes a second one (default: a new key, printed on
    /// stderr so that the call can be asked again).
    #[arg(long, value_name = "KEY")]
    pub idempotency_key: Option<String>,
    /// A label of the operation (KEY=VALUE; again for more, at most 8):
    /// part of the request, shown with it, filtered on by `ops list
    /// --label`. Not for secrets.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = super::filter::label)]
    pub labels: Vec<(String, String)>,
}

impl Target {
    /// The key given, or a new one, said on stderr.
    fn key(&self, action: &str) -> String {
        if let Some(key) = &self.idempotency_key {
            return key.clone();
        }
        let key = format!("cli-{action}-{}", uuid::Uuid::new_v4());
        // Only a hint: a stderr nobody reads must not stop the call.
        let _ = writeln!(
            std::io::stderr(),
            "idempotency key {key} (made here; to ask again for this operation: --idempotency-key {key})"
        );
        key
    }
}

impl Ops {
    pub(super) async fn attach(&self, a: AttachArgs) -> anyhow::Result<()> {
        let key = a.target.key("attach");
        let opts = AttachOptions {
            device: a.device,
            tag: a.tag,
            delete_on_termination: a.delete_on_termination,
            labels: a.target.labels.iter().cloned().collect(),
        };
        let t = &a.target;
        let answer = self
            .client
            .attach(&key, &t.server_id, &t.volume_id, opts, self.deadline())
            .await;
        self.decided("attach", &a.target, &key, answer).await
    }

    pub(super) async fn detach(&self, d: DetachArgs) -> anyhow::Result<()> {
        let key = d.target.key("detach");
        let t = &d.target;
        let answer = self
            .client
            .detach_labelled(
                &key,
                &t.server_id,
                &t.volume_id,
                t.labels.iter().cloned().collect(),
                self.deadline(),
            )
            .await;
        self.decided("detach", &d.target, &key, answer).await
    }

    /// The caller's deadline: `--timeout` as given, with no cap.
    fn deadline(&self) -> std::time::Duration {
        self.timeout.unwrap_or(DEFAULT_CALL_TIMEOUT)
    }

    /// Prints the operation and its log; a failed or undecided one too,
    /// then returns its error with what to do next.
    async fn decided(
        &self,
        action: &str,
        t: &Target,
        key: &str,
        answer: Result<pb::Operation, CallError>,
    ) -> anyhow::Result<()> {
        let e = match answer {
            Ok(op) => {
                let events = self.events_of(&op.id).await?;
                return Ok(emit(&self.op_and_events(&op, &events))?);
            }
            Err(e) => explain_refusal(e),
        };
        // `-o name` prints an id only when the command succeeded, so that
        // `id=$(ops attach ... -o name)` is empty on any failure (a refused
        // replay names the key's first operation, not one of this call's);
        // the error on stderr names the operation either way.
        if let Some(id) = e.operation_id()
            && self.output != Output::Name
        {
            self.print_after_error(id).await?;
        }
        let what = format!(
            "{action} of volume {} {} server {} under idempotency key {key}",
            t.volume_id,
            if action == "attach" { "to" } else { "from" },
            t.server_id
        );
        let e = anyhow::Error::new(e);
        let next = if exit_status(&e) == exit::RETRY {
            format!("; ask again with --idempotency-key {key} (the same operation, never a second)")
        } else {
            String::new()
        };
        Err(e.context(format!("{what}{next}")))
    }

    /// The operation an error names and its log so far, when they can be
    /// read: the error itself is what the command reports either way.
    async fn print_after_error(&self, id: &str) -> anyhow::Result<()> {
        let op = self
            .client
            .raw()
            .get_operation(self.req(pb::GetOperationRequest {
                operation_id: id.to_string(),
                ..Default::default()
            }))
            .await;
        // Unreadable now (the server went away): the call's error says it.
        let Ok(op) = op.map(tonic::Response::into_inner) else {
            return Ok(());
        };
        // As above: the log is extra, the call's error is the answer.
        let Ok(events) = self.events_of(&op.id).await else {
            return Ok(());
        };
        Ok(emit(&self.op_and_events(&op, &events))?)
    }
}

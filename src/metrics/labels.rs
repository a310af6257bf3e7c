//! The label sets of the service's metric families, one struct each, and
//! the canonical name a gRPC code is labelled with. Every value comes from
//! a bounded set (method names the server registers, states, reasons,
//! kinds), never an id.

use prometheus_client::encoding::EncodeLabelSet;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcLabels {
    /// The full service name (`volume_reconciler.v1.VolumeReconciler`,
    /// `grpc.health.v1.Health`, ...) or `unknown`. Not `service`: scrapes
    /// through a Kubernetes Service add a `service` target label, which
    /// would rename ours to `exported_service`.
    pub grpc_service: String,
    pub method: String,
    /// Canonical code name: `OK`, `DEADLINE_EXCEEDED`, ...
    pub code: String,
}

/// go-grpc-prometheus' labels of a method (`grpc_server_started_total`,
/// `grpc_server_handling_seconds`), the names every generic gRPC dashboard
/// reads.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcMethodLabels {
    /// `unary`, `client_stream`, `server_stream` or `bidi_stream`.
    pub grpc_type: &'static str,
    pub grpc_service: String,
    pub grpc_method: String,
}

/// go-grpc-prometheus' labels of a finished call (`grpc_server_handled_total`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcHandledLabels {
    pub grpc_type: &'static str,
    pub grpc_service: String,
    pub grpc_method: String,
    /// Canonical code name: `OK`, `DEADLINE_EXCEEDED`, ...
    pub grpc_code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NovaLabels {
    pub operation: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecidedLabels {
    pub action: String,
    pub state: String,
    pub resolution: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpenLabels {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub decision: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// `first` (`--verify-after`) or `last` (the end of `--verify-window`).
    pub stage: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TableLabels {
    /// `operations`, `events` or `tombstones`.
    pub table: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DbLabels {
    /// The kind of round trip (`intent`, `decision`, `read`, `lease`, ...).
    pub kind: String,
    /// `ok`, `error` or `timeout`.
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// The `ErrorInfo.reason` of the answer (`OVERLOADED`, ...).
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabels {
    /// `mutation` (attach/detach), `read` (unary reads), `watch` (streams).
    pub class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: String,
    pub git_sha: String,
}

/// The canonical name of a gRPC status code, as the gRPC specification
/// spells it (and every other implementation labels it).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_its_canonical_name() {
        for (n, name) in [
            (0, "OK"),
            (1, "CANCELLED"),
            (2, "UNKNOWN"),
            (3, "INVALID_ARGUMENT"),
            (4, "DEADLINE_EXCEEDED"),
            (5, "NOT_FOUND"),
            (6, "ALREADY_EXISTS"),
            (7, "PERMISSION_DENIED"),
            (8, "RESOURCE_EXHAUSTED"),
            (9, "FAILED_PRECONDITION"),
            (10, "ABORTED"),
            (11, "OUT_OF_RANGE"),
            (12, "UNIMPLEMENTED"),
            (13, "INTERNAL"),
            (14, "UNAVAILABLE"),
            (15, "DATA_LOSS"),
            (16, "UNAUTHENTICATED"),
        ] {
            assert_eq!(code_name(tonic::Code::from_i32(n)), name);
        }
    }
}

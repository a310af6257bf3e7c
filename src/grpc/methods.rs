//! One table of the API's methods: each RPC of `VolumeReconciler` with the
//! role it needs, the class it is shed in and its kind. The auth layer
//! (`auth::required_role`), the load-shedding layer (`overload`) and the
//! metrics layer read it; a test holds it to the proto's descriptor set,
//! so an RPC added to the proto without a row here fails the build's
//! tests instead of defaulting silently.

/// What a caller may do: each method needs one (the auth layer reads
/// the caller's from its token or certificate).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    Orchestrator,
    Operator,
}

impl Role {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "orchestrator" => Some(Role::Orchestrator),
            "operator" => Some(Role::Operator),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Orchestrator => "orchestrator",
            Role::Operator => "operator",
        }
    }
}

/// The service's full name, as paths carry it.
pub const SERVICE: &str = "volume_reconciler.v1.VolumeReconciler";

/// Which cap of the load-shedding layer a method counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// `--max-inflight-mutations`, the per-caller buckets and the caller
    /// table's quotas: calls that start an operation.
    Mutation,
    /// `--max-inflight-reads`: short unary calls.
    Read,
    /// `--max-watch-streams`.
    Watch,
    /// Never shed: an operator's, needed most in an incident.
    Never,
}

/// What a method does, as the metrics label it (`kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Starts (or joins) an operation that may call Nova.
    Mutation,
    /// Changes an operation without calling Nova (a cancel).
    Control,
    /// Reads the ledger.
    Read,
    /// Streams an operation's changes.
    Watch,
    /// An operator's call.
    Operator,
}

impl Kind {
    pub const ALL: [Kind; 5] = [
        Kind::Mutation,
        Kind::Control,
        Kind::Read,
        Kind::Watch,
        Kind::Operator,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Mutation => "mutation",
            Kind::Control => "control",
            Kind::Read => "read",
            Kind::Watch => "watch",
            Kind::Operator => "operator",
        }
    }
}

/// One RPC of the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Method {
    pub name: &'static str,
    pub role: Role,
    pub shed: Shed,
    pub kind: Kind,
}

const fn m(name: &'static str, role: Role, shed: Shed, kind: Kind) -> Method {
    Method {
        name,
        role,
        shed,
        kind,
    }
}

use Role::{Operator as Op, Orchestrator as Orch};

/// Every RPC of the service, in the proto's order.
pub const METHODS: &[Method] = &[
    m("AttachVolume", Orch, Shed::Mutation, Kind::Mutation),
    m("DetachVolume", Orch, Shed::Mutation, Kind::Mutation),
    m("GetOperation", Orch, Shed::Read, Kind::Read),
    m("ListOperations", Orch, Shed::Read, Kind::Read),
    m("WatchOperation", Orch, Shed::Watch, Kind::Watch),
    m("ReconcileOperation", Op, Shed::Never, Kind::Operator),
    m("ListOperationEvents", Orch, Shed::Read, Kind::Read),
    m("ResolveOperation", Op, Shed::Never, Kind::Operator),
    m("GetOperationStats", Op, Shed::Never, Kind::Operator),
    m("EnsureAttached", Orch, Shed::Mutation, Kind::Mutation),
    m("EnsureDetached", Orch, Shed::Mutation, Kind::Mutation),
    // One compare-and-set, sending nothing: as short as a read.
    m("CancelOperation", Orch, Shed::Read, Kind::Control),
    m("ReconcileOperations", Op, Shed::Never, Kind::Operator),
    m("ResolveOperations", Op, Shed::Never, Kind::Operator),
];

/// The method a request path (`/package.Service/Method`) names, if it is
/// one of the service's.
pub fn of(path: &str) -> Option<&'static Method> {
    let name = path
        .strip_prefix('/')?
        .strip_prefix(SERVICE)?
        .strip_prefix('/')?;
    METHODS.iter().find(|m| m.name == name)
}

/// The names of the methods shed in `shed`, for refusal messages.
pub fn names_in(shed: Shed) -> String {
    METHODS
        .iter()
        .filter(|m| m.shed == shed)
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    /// The table has exactly the service's RPCs, in the proto's order: an
    /// RPC added to the proto without its row (its role, class and kind)
    /// fails here.
    #[test]
    fn the_table_has_every_rpc_of_the_proto_and_no_other() {
        let set = prost_types::FileDescriptorSet::decode(super::super::pb::FILE_DESCRIPTOR_SET)
            .expect("the descriptor set decodes");
        let mut in_proto = Vec::new();
        for file in &set.file {
            for service in &file.service {
                if format!("{}.{}", file.package(), service.name()) == SERVICE {
                    in_proto.extend(service.method.iter().map(|m| m.name().to_string()));
                }
            }
        }
        let in_table: Vec<String> = METHODS.iter().map(|m| m.name.to_string()).collect();
        assert_eq!(in_table, in_proto);
    }

    #[test]
    fn paths_name_the_services_methods_only() {
        let path = |m: &str| format!("/{SERVICE}/{m}");
        assert_eq!(of(&path("AttachVolume")).unwrap().shed, Shed::Mutation);
        assert_eq!(of(&path("ResolveOperations")).unwrap().role, Role::Operator);
        assert!(of(&path("NoSuchMethod")).is_none());
        assert!(of("/grpc.health.v1.Health/Check").is_none());
        assert!(of(&format!("/{SERVICE}X/AttachVolume")).is_none());
    }

    /// Operators' calls are never shed and need the operator's role; every
    /// call that starts an operation counts against the mutations' cap.
    #[test]
    fn roles_classes_and_kinds_agree() {
        for m in METHODS {
            assert_eq!(m.kind == Kind::Operator, m.role == Role::Operator, "{m:?}");
            if m.role == Role::Operator {
                assert_eq!(m.shed, Shed::Never, "{m:?}");
            }
            assert_eq!(m.kind == Kind::Mutation, m.shed == Shed::Mutation, "{m:?}");
        }
    }
}

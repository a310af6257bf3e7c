//! Fault injection: which requests a rule hits, what goes wrong, and how
//! many times.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Which requests a fault rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultOp {
    Attach,
    Detach,
    List,
    Show,
    /// Keystone token requests.
    Auth,
    /// Cinder's volume show (`GET /v3/{project_id}/volumes/{id}`).
    Cinder,
    /// Nova's server show (`GET /v2.1/servers/{id}`), the look that must
    /// agree before a detach's 404 decides anything.
    Server,
    Any,
}

/// What goes wrong.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// Wait before the request takes effect.
    DelayBeforeEffect { ms: u64 },
    /// Take effect, then wait before sending the headers (the lost-response
    /// case when the client gives up first).
    DelayAfterEffect { ms: u64 },
    /// Take effect, then answer Nova's fault `code` `ms` later (an RPC
    /// that timed out in nova-api while the compute host went on: the
    /// answer says nothing of the effect, and comes long after it).
    LateStatus { ms: u64, code: u16 },
    /// Take effect, then close the connection without answering.
    CloseAfterEffect,
    /// Close the connection without answering and without effect.
    CloseBeforeEffect,
    /// Send the headers and part of the body, then stall for `ms`.
    StallBody { ms: u64, effect: bool },
    /// Send the headers and part of the body, then close the connection.
    TruncateBody { effect: bool },
    /// Answer 200 with a body that is not the contract's JSON.
    GarbageBody,
    /// Answer a Nova fault with this status (500 computeFault, 503 ...).
    Status { code: u16, effect: bool },
    /// Answer a proxy's non-JSON page (502/504).
    ProxyError { code: u16, effect: bool },
    /// Answer what something in front of Nova answers instead of Nova's
    /// answer: any status, content type and body (an ingress that lost its
    /// route answers 404 with its HTML page, a captive proxy 200, a gateway
    /// 401 with its login wall, a proxy a JSON body cut short). With
    /// `effect`, Nova did the work first.
    Page {
        code: u16,
        content_type: String,
        body: String,
        effect: bool,
    },
    /// Answer Nova's own 404 "Instance S could not be found." although the
    /// server exists (a request routed to a cell or region that does not
    /// hold it), without effect.
    ServerNotFound,
    /// Answer Nova's own 404 "Volume V could not be found." naming
    /// `volume_id` (the request's when not given), without effect: with
    /// another volume's id, an answer routed or relayed for another
    /// request.
    VolumeNotFound {
        #[serde(default)]
        volume_id: Option<Uuid>,
    },
    /// Answer Nova's own 404 "Instance S is not attached to volume V"
    /// naming `server_id` and `volume_id` (the request's where not given),
    /// without effect.
    NotAttached {
        #[serde(default)]
        server_id: Option<Uuid>,
        #[serde(default)]
        volume_id: Option<Uuid>,
    },
    /// Answer as usual (after the effect) with a body of `bytes` bytes
    /// instead of Nova's: with `Content-Length` when `announced`, else
    /// streamed in chunks without it.
    HugeBody { bytes: usize, announced: bool },
    /// A load balancer answers 504 at once while Nova goes on: the request
    /// takes effect `ms` later (an attach below 2.101 waits on conductor up
    /// to `long_rpc_timeout`).
    LateEffect { ms: u64 },
    /// Answer 401 from the auth middleware (token expired).
    Unauthorized,
    /// Answer 409 "while it is in task_state ...".
    Conflict,
    /// Answer 409 "The supplied device path (...) is in use." (permanent).
    DeviceInUse,
    /// Answer 400 "... status must be available or downloading to reserve,
    /// but the current status is `status`." (the create-then-attach race).
    VolumeNotReady { status: String },
    /// A detach is accepted (202) but the guest refuses it: after the
    /// detach delay the volume is back in use and the attachment stays.
    DetachRefused,
    /// An attach is answered as usual (the mapping made, Cinder's volume
    /// reserved), then the hypervisor fails it: after `rollback_delay_ms`
    /// Nova removes the mapping and Cinder shows `rollback_status`.
    RollBack,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultRule {
    pub op: FaultOp,
    #[serde(default)]
    pub server_id: Option<Uuid>,
    #[serde(default)]
    pub volume_id: Option<Uuid>,
    /// How many matching requests it hits; `None`: all of them.
    #[serde(default)]
    pub count: Option<u32>,
    pub fault: Fault,
}

impl FaultRule {
    pub fn new(op: FaultOp, fault: Fault) -> Self {
        Self {
            op,
            server_id: None,
            volume_id: None,
            count: Some(1),
            fault,
        }
    }
    pub fn volume(mut self, v: Uuid) -> Self {
        self.volume_id = Some(v);
        self
    }
    pub fn server(mut self, s: Uuid) -> Self {
        self.server_id = Some(s);
        self
    }
    pub fn times(mut self, n: u32) -> Self {
        self.count = Some(n);
        self
    }
    pub fn always(mut self) -> Self {
        self.count = None;
        self
    }

    pub(crate) fn matches(&self, op: FaultOp, server: Option<Uuid>, volume: Option<Uuid>) -> bool {
        (self.op == op || self.op == FaultOp::Any)
            && self.server_id.is_none_or(|s| Some(s) == server)
            && self.volume_id.is_none_or(|v| Some(v) == volume)
            && self.count != Some(0)
    }
}

impl Fault {
    /// Whether the fault takes the request's effect away (now).
    pub(crate) fn blocks_effect(&self) -> bool {
        matches!(
            self,
            Fault::CloseBeforeEffect
                | Fault::Status { effect: false, .. }
                | Fault::ProxyError { effect: false, .. }
                | Fault::Page { effect: false, .. }
                | Fault::StallBody { effect: false, .. }
                | Fault::TruncateBody { effect: false }
                | Fault::LateEffect { .. }
        )
    }
}

//! The only place with HTTP to OpenStack: the Nova client (the adapter's
//! front), the Cinder client it owns, Keystone authentication, the HTTP
//! machinery both share, Nova's wire types and the adapters' errors.
//!
//! - `http.rs`: one request under one deadline (slots, token, replay,
//!   request ids, stages and clocks), shared by Nova and Cinder; it
//!   imports neither client.
//! - `client.rs`: Nova's calls, the HTTP client's connection policy; how an
//!   attach or detach is confirmed.
//! - `answer.rs`: what an answer means, and first whether it is Nova's at
//!   all (a proxy's page decides nothing).
//! - `cinder.rs`: Cinder's view of a volume, and what its answers mean.
//! - `error/`: the adapters' errors — one core (what failed, which clock
//!   fired, the metadata a caller is given) with Nova's and Cinder's kinds
//!   — and the reading of the fault bodies OpenStack answers with.
//! - `types.rs`: Nova's wire shapes.
//! - `auth.rs`: Keystone tokens and the service catalog.
//! - `body.rs`: a response body read under a deadline and a size cap.
//! - `gate.rs`: a request's send gate asked again once its connection is
//!   ready (a layer on reqwest's connector).
//! - `fair.rs`: the per-host slots, shared by caller rows by weight when
//!   contended.
//! - `error.rs`: the adapter's error, and what a refusal means (`Rejection`).
//! - `types.rs`: Nova's wire shapes.
//! - `metrics.rs`: the room's metric families (requests, reachability,
//!   the Keystone token).
//! - `version.rs`: microversions asked for and supported, and discovery.
//! - `trace.rs`: the trace context every request to OpenStack carries.

pub(crate) mod answer;
pub mod auth;
mod body;
pub mod cinder;
pub mod client;
pub mod error;
mod fair;
mod gate;
mod http;
pub mod metrics;
mod trace;
pub mod types;
mod version;

pub use answer::AttachAnswer;
pub use auth::{Credential, KeystoneConfig, Secret};
pub use cinder::{
    AttachProgress, CinderAttachment, CinderClient, DetachProgress, VolumeStatus, VolumeView,
};
pub use client::{
    Answered, CaBundle, ConfirmWith, Confirmation, Microversion, NovaClient, NovaConfig,
    NovaEndpoint, Reached, RequestId, SendGate, TlsTrust, VersionRange, build_http_client,
};
pub use error::{
    CinderError, CinderErrorKind, Clock, ErrorKind, NovaError, NovaErrorKind, Rejection, Stage,
    Upstream, UpstreamError,
};
pub use types::NovaAttachment;

//! The only place with HTTP to OpenStack: the Nova client, Keystone
//! authentication, Nova's wire types and the adapter's error.

pub mod auth;
pub mod client;
pub mod error;
pub mod types;

pub use auth::{Credential, KeystoneConfig, Secret};
pub use client::{
    Answered, AttachAnswer, CaBundle, Microversion, NovaClient, NovaConfig, NovaEndpoint,
    RequestId, TlsTrust, VersionRange, build_http_client,
};
pub use error::{NovaError, NovaErrorKind, Rejection, Stage};
pub use types::NovaAttachment;

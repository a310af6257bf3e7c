//! The only place with HTTP to OpenStack: the Nova client, Keystone
//! authentication, Nova's wire types and the adapter's error.

pub mod auth;
pub mod client;
pub mod error;
pub mod types;

pub use auth::{KeystoneConfig, Secret};
pub use client::{
    Answered, AttachAnswer, NovaClient, NovaConfig, NovaEndpoint, RequestId, build_http_client,
};
pub use error::{NovaError, NovaErrorKind, Rejection, Stage};
pub use types::NovaAttachment;

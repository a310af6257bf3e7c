//! Operator commands: they talk gRPC to a running server.

pub mod ops;

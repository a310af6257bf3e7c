//! Operator commands (they talk gRPC to a running server) and the demo.

pub mod bench;
pub mod demo;
pub mod ops;
pub mod settings;

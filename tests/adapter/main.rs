//! The service against Nova, Cinder and Keystone: the Nova adapter over
//! real sockets, the fault matrix through the real server, Cinder's state
//! machine and its confirmation's decisions, Keystone mode, and a real
//! OpenStack client (openstacksdk) against the simulator; what Nova's
//! refusals say (the ids they name, messages translated, too many disks).
//! One test binary, one PostgreSQL cluster, a database of its own for each
//! test (docs/testing.md, "Where a new test goes").

#[path = "../support/mod.rs"]
mod support;

mod cinder;
mod cinder_decisions;
mod fault_matrix;
mod keystone;
mod nova_adapter;
mod nova_messages;
mod openstacksdk;

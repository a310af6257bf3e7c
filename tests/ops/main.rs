//! What an operator meets: the binary's CLI (`ops`, `bench`, `dev`,
//! completions), its log in proportion, starting up, day-to-day operation,
//! metrics and the dashboard's and alerts' expressions, the deployment
//! files and the production kit, and the docs' links. One test binary, one
//! PostgreSQL cluster, a database of its own for each test
//! (docs/testing.md, "Where a new test goes").

#[path = "../support/mod.rs"]
mod support;

mod deployment;
mod docs;
mod observability;
mod observability_files;
mod operating;
mod operator_cli;
mod operator_logs;
mod production_kit;
mod reasons;
mod startup;

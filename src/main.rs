//! Thin: parse the command line, set up logging, run one command.

use std::process::ExitCode;

use volume_reconciler::{cli, telemetry};

/// mimalloc instead of glibc's malloc: the service allocates per call
/// (request and response bodies, rows, events), and glibc's allocator was
/// a fifth of its CPU under load (callgrind and perf at 64 callers).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let invocation = cli::parse();
    let (format, filter) = invocation.logging();
    match invocation.log_file() {
        Some(path) => telemetry::init_to_file(format, &filter, &path),
        None if invocation.holds_logs() => telemetry::init_held(format, &filter),
        None => telemetry::init(format, &filter),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let errors = cli::ErrorStyle::of(&invocation.cli.command);
    match runtime.block_on(cli::run(invocation)) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of stdout stopped reading (`ops list | head -1`): it
        // has what it wanted; end quietly, as a filter would.
        Err(e) if cli::format::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            errors.report(&e);
            cli::format::exit_code(&e)
        }
    }
}

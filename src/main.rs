//! The `lapse` binary: parse the command line, set up telemetry, dispatch, and turn
//! an error into its exit status (see `lapse --help`) and a message saying what to do.

use std::process::ExitCode;

use clap::Parser;
use lapse::cli::{Cli, ExitStatus};
use lapse::redact::redact;

#[tokio::main]
async fn main() -> ExitCode {
    restore_sigpipe();
    lapse::redact::install_panic_hook();
    let cli = Cli::parse();
    if let Err(error) = lapse::observe::telemetry::try_init_with_default(cli.default_log_level()) {
        eprintln!("error: {}", redact(&error.to_string()));
        return ExitCode::from(ExitStatus::Usage as u8);
    }
    match lapse::cli::run(cli).await {
        Ok(status) => ExitCode::from(status as u8),
        Err(error) => {
            let failure = lapse::cli::explain(&error);
            eprintln!("error: {}", failure.message);
            ExitCode::from(failure.status as u8)
        }
    }
}

/// Rust ignores SIGPIPE, so printing into a pipe whose reader is gone
/// (`lapse order show 7 | head -1`) fails, and `println!` panics. A command-line
/// tool should end quietly there, as other Unix tools do: restore the default action.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: called first thing in `main`, before any other thread exists; setting a
    // signal's disposition to its default has no other precondition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

//! The `lapse` binary: parse the command line, set up telemetry, dispatch.

use std::process::ExitCode;

use clap::Parser;
use lapse::cli::{Cli, ExitStatus};
use lapse::config::ConfigError;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    lapse::telemetry::init();
    match lapse::cli::run(cli).await {
        Ok(status) => ExitCode::from(status as u8),
        Err(error) => {
            if let Some(config) = error.downcast_ref::<ConfigError>() {
                eprintln!("error: {config}");
                return ExitCode::from(ExitStatus::Usage as u8);
            }
            eprintln!("error: {error:#}");
            ExitCode::from(ExitStatus::Failed as u8)
        }
    }
}

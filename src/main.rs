//! The `lapse` binary: parse the command line, set up telemetry, dispatch.

use std::process::ExitCode;

use clap::Parser;
use lapse::cli::{Cli, ExitStatus};
use lapse::config::ConfigError;
use lapse::redact::redact;

#[tokio::main]
async fn main() -> ExitCode {
    lapse::redact::install_panic_hook();
    let cli = Cli::parse();
    lapse::telemetry::init();
    match lapse::cli::run(cli).await {
        Ok(status) => ExitCode::from(status as u8),
        Err(error) => {
            if let Some(config) = error.downcast_ref::<ConfigError>() {
                eprintln!("error: {}", redact(&config.to_string()));
                return ExitCode::from(ExitStatus::Usage as u8);
            }
            eprintln!("error: {}", redact(&format!("{error:#}")));
            ExitCode::from(ExitStatus::Failed as u8)
        }
    }
}

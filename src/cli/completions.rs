//! `lapse completions bash|zsh|fish`: a completion script generated from the command
//! definitions, so it never lags behind them.

use clap::{Args, CommandFactory};
use clap_complete::Shell;

use super::{Cli, ExitStatus, help};

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell to complete for: bash, zsh, fish, elvish or powershell.
    #[arg(value_name = "SHELL")]
    shell: Shell,
}

pub fn after_help() -> String {
    help::after(
        &[
            "lapse completions bash > /etc/bash_completion.d/lapse",
            "lapse completions zsh > \"${fpath[1]}/_lapse\"",
            "lapse completions fish > ~/.config/fish/completions/lapse.fish",
        ],
        &[help::OK, (2, "an unknown shell")],
    )
}

/// Writes the script on stdout; needs no configuration.
pub fn run(args: &CompletionsArgs) -> anyhow::Result<ExitStatus> {
    let mut command = Cli::command();
    clap_complete::generate(args.shell, &mut command, "lapse", &mut std::io::stdout());
    Ok(ExitStatus::Ok)
}

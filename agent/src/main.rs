//! `tartan-agent`: a thin entry point. It parses the command line, sets up logging and hands each
//! subcommand to the `run` function of its own module. An error ends up as one log line and a
//! non-zero exit code; nothing below `main` exits the process.
//!
//! To add a subcommand: a module with `pub struct XArgs` (`#[derive(clap::Args)]`) and
//! `pub fn run(args: XArgs) -> anyhow::Result<()>`, a variant in [`Command`], and an arm in
//! [`dispatch`].

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod cli_journal;

#[derive(Parser)]
#[command(name = "tartan-agent", version, about = "Runs macOS builds for Tekton in throw-away tart VMs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the host journal of a state directory (read-only; safe while the agent runs).
    Journal(cli_journal::JournalArgs),
}

fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Journal(args) => cli_journal::run(args),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    match dispatch(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // `{:#}` prints the whole context chain on one line.
            tracing::error!("{err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr (filter with `RUST_LOG`, default `info`), and on macOS also to unified logging.
fn init_tracing() {
    use tracing_subscriber::{EnvFilter, fmt, layer::SubscriberExt, util::SubscriberInitExt};

    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(fmt::layer().with_writer(std::io::stderr));
    #[cfg(target_os = "macos")]
    let registry = registry.with(tracing_oslog::OsLogger::new("dev.tartan", "agent"));
    registry.init();
}

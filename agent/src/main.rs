//! `tartan-agent`: a thin entry point. It parses the command line, sets up logging and hands each
//! subcommand to the `run` function of its own module. An error ends up as one log line and a
//! non-zero exit code; nothing below `main` exits the process.
//!
//! To add a subcommand: a module with `pub struct XArgs` (`#[derive(clap::Args)]`) and
//! `pub fn run(args: XArgs) -> anyhow::Result<()>`, a variant in [`Command`], and an arm in
//! [`dispatch`].

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::process::ExitCode;

mod cli_doctor;
mod cli_journal;
mod cli_run;
mod cli_watchdog;

#[derive(Parser)]
#[command(
    name = "tartan-agent",
    version = tartan_agent::VERSION,
    about = "Runs macOS builds for Tekton in throw-away tart VMs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How log lines are written to stderr.
    #[arg(long, global = true, value_enum, default_value = "text", env = "TARTAN_LOG_FORMAT")]
    log_format: tartan_agent::logging::LogFormat,
}

#[derive(Subcommand)]
enum Command {
    /// Run the build agent: claim MacBuilds, drive tart, keep the journal (the first LaunchAgent).
    Run(cli_run::RunArgs),
    /// Print the host journal of a state directory (read-only; safe while the agent runs).
    Journal(cli_journal::JournalArgs),
    /// Install the agent and watchdog LaunchAgents for this user and (re)start them (macOS).
    Install(tartan_agent::service::InstallArgs),
    /// Stop the agent and watchdog LaunchAgents and remove their plists (macOS).
    Uninstall(tartan_agent::service::UninstallArgs),
    /// Show what launchd reports for the agent and watchdog LaunchAgents (macOS).
    ServiceStatus(tartan_agent::service::StatusArgs),
    /// Delete VMs past their host execution deadline plus a grace, from the deadline files alone
    /// (never the journal or the agent's lock).
    Watchdog(cli_watchdog::WatchdogArgs),
    /// Check this Mac as the agent will use it (tart, disk, journal, watchdog folder, mounts,
    /// LaunchAgents, the API server, the clock, the Lease): one line per check with its fix; exits
    /// 1 if any fails.
    Doctor(cli_doctor::DoctorArgs),
    /// Print one agent's ServiceAccount, Roles and bindings as YAML (for `kubectl apply -f -`): it
    /// may renew only its own Lease.
    Rbac(tartan_agent::rbac::RbacArgs),
}

fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run(args) => cli_run::run(args),
        Command::Journal(args) => cli_journal::run(args),
        Command::Install(args) => tartan_agent::service::install(args),
        Command::Uninstall(args) => tartan_agent::service::uninstall(args),
        Command::ServiceStatus(args) => tartan_agent::service::status(args),
        Command::Watchdog(args) => cli_watchdog::run(args),
        Command::Rbac(args) => tartan_agent::rbac::run(args),
        Command::Doctor(args) => cli_doctor::run(args),
    }
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    // The unified-logging category: the watchdog logs as itself, everything else as the agent.
    let program = match matches.subcommand_name() {
        Some("watchdog") => "watchdog",
        _ => "agent",
    };
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|err| err.exit());
    tartan_agent::logging::init(program, cli.log_format.is_json());
    match dispatch(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // `{:#}` prints the whole context chain on one line.
            tracing::error!("{err:#}");
            ExitCode::FAILURE
        }
    }
}

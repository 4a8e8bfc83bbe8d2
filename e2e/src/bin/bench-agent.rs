//! `scripts/bench-agent`: one agent's idle cost, recovery and redelivery; see
//! [`tartan_e2e::agentbench`].

use clap::Parser;
use std::path::PathBuf;
use std::time::Duration;
use tartan_e2e::agentbench::{self, AgentBenchOptions};

#[derive(Parser, Debug)]
#[command(
    about = "One real agent on the emulator: idle CPU/RSS with 0 and 1,000 foreign finished MacBuilds, recovery with few and ~1,400 journal records, redelivery of 200 refused statuses after a restart with the longest Lease renewal gap"
)]
struct Args {
    /// The `tartan-agent` to measure (default: the workspace's release build).
    #[arg(long)]
    agent_bin: Option<PathBuf>,
    /// Also measure this `tartan-agent` first and print both side by side ("before" / "after").
    #[arg(long)]
    compare: Option<PathBuf>,
    /// Seconds the agent is watched idle for each idle figure.
    #[arg(long, default_value_t = 30.0)]
    idle_secs: f64,
    /// Finished MacBuilds held by another agent in the agent's namespace.
    #[arg(long, default_value_t = 1000)]
    foreign: usize,
    /// Journal records wanted for the large recovery figure (builds are run until there are).
    #[arg(long, default_value_t = 1400)]
    records: usize,
    /// Terminal statuses refused by the API, then redelivered after a restart.
    #[arg(long, default_value_t = 200)]
    redeliver: usize,
    /// Restarts measured per recovery figure.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Before each figure, wait (up to 2 min) for the 1-minute load to drop below this.
    #[arg(long, default_value_t = 4.0)]
    max_load: f64,
    /// Skip the idle figure with `namespaces = []`.
    #[arg(long)]
    no_all_namespaces: bool,
    /// Keep each run's files (journals, agent logs) and print where.
    #[arg(long)]
    keep: bool,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let opts = AgentBenchOptions {
        idle: Duration::from_secs_f64(args.idle_secs),
        foreign: args.foreign,
        records: args.records,
        redeliver: args.redeliver,
        repeats: args.repeats.max(1),
        max_load: args.max_load,
        all_namespaces: !args.no_all_namespaces,
        keep: args.keep,
    };
    let mut reports = vec![];
    if let Some(before) = &args.compare {
        reports.push(agentbench::run("before", Some(before.clone()), &opts).await);
    }
    let label = if args.compare.is_some() { "after" } else { "agent" };
    reports.push(agentbench::run(label, args.agent_bin.clone(), &opts).await);
    agentbench::print(&reports);
}

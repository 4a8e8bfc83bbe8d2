//! `scripts/bench-fleet`: N agents racing for M MacBuilds; see [`tartan_e2e::fleet`].

use clap::Parser;
use std::time::Duration;
use tartan_e2e::fleet::{self, FleetOptions};

#[derive(Parser, Debug)]
#[command(
    about = "N real agents (2 slots each) racing for M MacBuilds on the emulator; prints claim latency, losing claims, requests, RSS, idle CPU, spread and load"
)]
struct Args {
    /// Agents (separate `tartan-agent run` processes with their own state dirs and tart homes).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u16).range(1..=50))]
    agents: u16,
    /// MacBuilds created.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u16).range(1..=500))]
    builds: u16,
    /// MacBuilds created per second.
    #[arg(long, default_value_t = 5.0)]
    rate: f64,
    /// Seconds from `tart run` until the guest answers (tart-double).
    #[arg(long, default_value_t = 0.1)]
    boot_secs: f64,
    /// Seconds the build's one step sleeps.
    #[arg(long, default_value_t = 0.3)]
    step_secs: f64,
    /// Agents holding the build's image at the start (the first ones); default: all.
    #[arg(long)]
    holders: Option<u16>,
    /// The agents' `timing.claim_spread` (0s: every free agent claims at once, as before it existed).
    #[arg(long, default_value = "500ms")]
    claim_spread: String,
    /// The agents' `timing.uncached_claim_delay`.
    #[arg(long, default_value = "5s")]
    uncached_claim_delay: String,
    /// Seconds the agents are watched idle after the last build.
    #[arg(long, default_value_t = 5.0)]
    idle_secs: f64,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    fleet::run(FleetOptions {
        agents: args.agents.into(),
        builds: args.builds.into(),
        rate: args.rate,
        boot_secs: args.boot_secs,
        step_secs: args.step_secs,
        holders: args.holders.map_or(args.agents, |h| h.min(args.agents)).into(),
        // Written into each agent's config, which lives as long as the run.
        claim_spread: Box::leak(args.claim_spread.into_boxed_str()),
        uncached_claim_delay: Box::leak(args.uncached_claim_delay.into_boxed_str()),
        idle: Duration::from_secs_f64(args.idle_secs),
    })
    .await;
}

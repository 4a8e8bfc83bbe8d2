//! `scripts/bench-pool`: the warm pool's start times and cost; see [`tartan_e2e::poolbench`].

use clap::Parser;
use std::time::Duration;
use tartan_e2e::poolbench::{self, PoolBenchOptions};

#[derive(Parser, Debug)]
#[command(
    about = "One 2-slot agent on the emulator with tart-double (boot 20 s, clone 2 s): CustomRun created to first step, cold vs warm, and the slot-time warm VMs hold idle, for arrival rates x pool sizes"
)]
struct Args {
    /// Arrival rates, builds per hour (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [30.0, 60.0, 120.0])]
    rates: Vec<f64>,
    /// Pool sizes, 0 to 2 (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [0u8, 1, 2])]
    pools: Vec<u8>,
    /// Builds per cell.
    #[arg(long, default_value_t = 6)]
    builds: usize,
    /// Seconds of the builds' one step.
    #[arg(long, default_value_t = 20.0)]
    step_secs: f64,
    /// tart-double: seconds from `tart run` until the guest answers.
    #[arg(long, default_value_t = 20.0)]
    boot_secs: f64,
    /// tart-double: seconds a `tart clone` takes.
    #[arg(long, default_value_t = 2.0)]
    clone_secs: f64,
    /// Seed of the arrival times.
    #[arg(long, default_value_t = 2701)]
    seed: u64,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    if let Some(p) = args.pools.iter().find(|p| **p > 2) {
        eprintln!("--pools: {p} is more than the host's 2 slots");
        std::process::exit(2);
    }
    let opts = PoolBenchOptions {
        rates: args.rates,
        pools: args.pools,
        builds: args.builds.max(1),
        step: Duration::from_secs_f64(args.step_secs),
        boot: Duration::from_secs_f64(args.boot_secs),
        clone: Duration::from_secs_f64(args.clone_secs),
        seed: args.seed,
    };
    let cells = poolbench::run(&opts).await;
    poolbench::print(&opts, &cells);
}

//! `scripts/chaos`: the whole local stack under a seeded random fault schedule, then every check.
//! Exits 0 when every check passed, 1 when one failed (the work directory is kept), 2 on a usage
//! error.

use clap::Parser;
use std::time::Duration;
use tartan_e2e::chaos::{Options, plan::Sizes};
use tartan_e2e::{AgentOptions, ControllerOptions};

#[derive(Parser, Debug)]
#[command(about = "Run Tartan's local stack under a seeded random fault schedule and check every invariant")]
struct Args {
    /// The schedule's seed (the same seed and sizes give the same schedule); default: from the clock.
    #[arg(long)]
    seed: Option<u64>,
    /// CustomRuns to create.
    #[arg(long, default_value_t = 8)]
    builds: usize,
    /// Agent hosts (each with its own state dir, TART_HOME and watchdog, as separate Macs).
    #[arg(long, default_value_t = 2)]
    hosts: usize,
    /// Minutes over which builds start and faults strike (the healing phase comes after).
    #[arg(long, default_value_t = 1.0)]
    minutes: f64,
    /// Faults to draw (default: 1.5 per build, at least 6).
    #[arg(long)]
    faults: Option<usize>,
    /// Slots per host.
    #[arg(long, default_value_t = 2)]
    slots: u8,
    /// The longest the healing phase waits for every run to end and every VM to go, in seconds.
    #[arg(long, default_value_t = 120)]
    heal_secs: u64,
    /// Agent Lease duration (and the controller's), shortened for speed.
    #[arg(long, default_value = "4s")]
    lease_duration: String,
    /// Agent Lease renewal interval.
    #[arg(long, default_value = "1s")]
    lease_renew: String,
    /// Agent API call timeout.
    #[arg(long, default_value = "900ms")]
    api_timeout: String,
    /// The agent's retry window (a retry needs this much time left before the deadline).
    #[arg(long, default_value = "10s")]
    retry_min_window: String,
    /// The controller's grace after a CustomRun's timeout.
    #[arg(long, default_value = "3s")]
    controller_grace: String,
    /// The watchdog's grace after a VM's deadline.
    #[arg(long, default_value = "3s")]
    watchdog_grace: String,
    /// Keep the work directory even when every check passes.
    #[arg(long)]
    keep: bool,
}

/// Option strings live as long as the run (the harness's options borrow `'static` text).
fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    if args.hosts == 0 || args.builds == 0 || args.slots == 0 || !args.minutes.is_finite() || args.minutes <= 0.0 {
        eprintln!("chaos: --hosts, --builds, --slots and --minutes must be positive");
        std::process::exit(2);
    }
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let lease_duration = leak(args.lease_duration);
    let opts = Options {
        sizes: Sizes {
            seed,
            builds: args.builds,
            hosts: args.hosts,
            window: Duration::from_secs_f64(args.minutes * 60.0),
            faults: args.faults.unwrap_or((args.builds * 3 / 2).max(6)),
        },
        slots: args.slots,
        heal: Duration::from_secs(args.heal_secs),
        agent: AgentOptions {
            lease_renew: leak(args.lease_renew),
            lease_duration,
            api_timeout: leak(args.api_timeout),
            retry_min_window: leak(args.retry_min_window),
            watchdog_grace: leak(args.watchdog_grace),
            ..AgentOptions::default()
        },
        controller: ControllerOptions {
            grace: leak(args.controller_grace),
            lease_duration,
            ..ControllerOptions::default()
        },
        keep: args.keep,
    };
    let passed = tartan_e2e::chaos::run(opts).await;
    std::process::exit(if passed { 0 } else { 1 });
}

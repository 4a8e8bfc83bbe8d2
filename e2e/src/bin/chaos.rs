//! `scripts/chaos`: the whole local stack under a seeded random fault schedule, then every check.
//! Exits 0 when every check passed, 1 when one failed (the work directory is kept), 2 on a usage
//! error. Stopped by SIGTERM or SIGINT (or on a panic) it kills every process it started before it
//! exits (143, 130; 101), found by the marker of `tartan_e2e::chaos::reaper`.

use clap::Parser;
use std::time::Duration;
use tartan_e2e::chaos::{Options, plan::Sizes, reaper};
use tartan_e2e::{AgentOptions, ControllerOptions};

#[derive(Parser, Debug)]
#[command(
    about = "Run Tartan's local stack under a seeded random fault schedule and check every invariant",
    args_override_self = true
)]
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
    /// Add the fleet-level faults: a rack (a random 20 % of the hosts) cut off from the API in
    /// each third of the window, the API saturated for a quarter of it, a rolling agent upgrade,
    /// the leading controller replica killed as each rack returns.
    #[arg(long)]
    fleet: bool,
    /// At most one drawn cluster-wide fault (controller kill, API outage, refusal or latency,
    /// terminal status refused, watch stall or restart) per this many seconds of the window; the
    /// others drawn become faults of one host or build. Default: drawn like every other kind.
    #[arg(long)]
    cluster_fault_every: Option<f64>,
    /// Controller processes: 1 runs without leader election; 2 or more run as replicas under it
    /// with the source's timings (lease 15 s), the leader killed in `--fleet` runs. Default: 2
    /// with --fleet, else 1.
    #[arg(long)]
    controller_replicas: Option<usize>,
    /// The niceness of every host's processes (agent, watchdog, tart-double, guest shells): one
    /// machine plays a fleet of Macs and its API server, where real Macs have CPUs of their own.
    /// At 100 hosts the hosts keep ~100 processes runnable; at niceness 10 the API server, idle
    /// 80 % of the time, still answered a GET in 0.03-2.9 s (its threads were preempted more
    /// often than they slept) and the controller fell behind; at 19 it answers in milliseconds.
    /// Default: 19 with --fleet, else 0.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=19))]
    host_nice: Option<u8>,
    /// Slots per host.
    #[arg(long, default_value_t = 2)]
    slots: u8,
    /// The first this many hosts keep a warm pool of one VM of the builds' image.
    #[arg(long, default_value_t = 0)]
    pool_hosts: usize,
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
    /// How often an agent polls a running step's guest job (`timing.step_poll`; each poll is a
    /// `tart exec`, the largest CPU cost of a run with many hosts; the agent's own default is 1s).
    #[arg(long, default_value = "200ms")]
    step_poll: String,
    /// How often the runner samples every host (VMs on disk, processes that exited), in ms.
    #[arg(long, default_value_t = 300)]
    sample_ms: u64,
    /// Keep the work directory even when every check passes.
    #[arg(long)]
    keep: bool,
}

/// Option strings live as long as the run (the harness's options borrow `'static` text).
fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

fn main() {
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
            fleet: args.fleet,
            cluster_every: args
                .cluster_fault_every
                .filter(|s| s.is_finite() && *s > 0.0)
                .and_then(|s| Duration::try_from_secs_f64(s).ok()),
        },
        slots: args.slots,
        pool_hosts: args.pool_hosts,
        heal: Duration::from_secs(args.heal_secs),
        agent: AgentOptions {
            lease_renew: leak(args.lease_renew),
            lease_duration,
            api_timeout: leak(args.api_timeout),
            retry_min_window: leak(args.retry_min_window),
            watchdog_grace: leak(args.watchdog_grace),
            step_poll: leak(args.step_poll),
            nice: args.host_nice.unwrap_or(if args.fleet { 19 } else { 0 }),
            ..AgentOptions::default()
        },
        controller: ControllerOptions {
            grace: leak(args.controller_grace),
            lease_duration,
            ..ControllerOptions::default()
        },
        controller_replicas: args.controller_replicas.unwrap_or(if args.fleet { 2 } else { 1 }),
        keep: args.keep,
        sample_every: Duration::from_millis(args.sample_ms.max(50)),
    };
    let marker = reaper::marker_value();
    // SAFETY: no other thread exists yet (the runtime is built below), so nothing reads the
    // environment concurrently; every process the run starts inherits the marker.
    unsafe { std::env::set_var(reaper::RUN_MARKER, &marker) };
    // Before the run starts anything, so no signal finds the run without its handler.
    stop_on_signal(marker.clone());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("the chaos runner's tokio runtime starts");
    let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runtime.block_on(async { if tartan_e2e::chaos::run(opts).await { 0 } else { 1 } })
    }))
    .unwrap_or_else(|_| {
        eprintln!("chaos: the runner panicked; killing every process of the run");
        101
    });
    let left = reaper::kill_marked(&marker, Duration::from_secs(10));
    if !left.is_empty() {
        eprintln!("chaos: processes of the run still there after SIGKILL for 10 s: {left:?}");
    }
    std::process::exit(code);
}

/// On SIGTERM or SIGINT, SIGKILLs every process of the run and exits 128 + the signal, from a
/// thread and a runtime of its own: the run's code may keep its threads busy for longer than the
/// outer `timeout` of scripts/chaos waits before its SIGKILL (10 s), as a 100-host run's healing
/// phase did (seed 70019: the runner never saw the signal and left 200 processes up). Returns
/// once the handlers are installed.
fn stop_on_signal(marker: String) {
    use tokio::signal::unix::{SignalKind, signal};
    let (installed, ready) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("the chaos runner's signal runtime starts");
        let code = runtime.block_on(async {
            let mut term = signal(SignalKind::terminate()).expect("a SIGTERM handler installs");
            let mut int = signal(SignalKind::interrupt()).expect("a SIGINT handler installs");
            installed.send(()).expect("the runner waits for its handlers");
            tokio::select! {
                _ = term.recv() => 143,
                _ = int.recv() => 130,
            }
        });
        eprintln!("chaos: stopped by a signal; killing every process of the run");
        let left = reaper::kill_marked(&marker, Duration::from_secs(5));
        if !left.is_empty() {
            eprintln!("chaos: processes of the run still there after SIGKILL for 5 s: {left:?}");
        }
        std::process::exit(code);
    });
    ready.recv().expect("the signal handlers install");
}

//! `tartan-agent watchdog`: deletes VMs well past their host execution deadline, from the deadline
//! files alone. It never opens the journal and never takes the agent's lock, so it keeps working
//! while the agent is paused, dead or holding the lock. The work is in `tartan-watchdog`.

use anyhow::Context;
use std::path::PathBuf;
use std::time::Duration;
use tartan_watchdog::{Config, parse_duration, parse_std_duration};

#[derive(clap::Args, Debug)]
pub struct WatchdogArgs {
    /// The agent's state directory; only `<DIR>/deadlines/` is read, and `<DIR>/watchdog.jsonl` written.
    #[arg(long, value_name = "DIR", env = "TARTAN_STATE_DIR")]
    pub state_dir: PathBuf,
    /// How long after a VM's host execution deadline it is deleted (e.g. 60s, 2m, 1m30s).
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    pub grace: k8s_openapi::jiff::SignedDuration,
    /// The tart program (a name on PATH or an absolute path). tart's home is `$TART_HOME`, else `~/.tart`.
    #[arg(long, value_name = "PATH", default_value = "tart", env = "TARTAN_TART")]
    pub tart: PathBuf,
    /// How often the deadline folder is listed for new and removed files (at most 1s).
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_std_duration)]
    pub rescan: Duration,
    /// How many overdue VMs are stopped and deleted at the same time.
    #[arg(long, value_name = "N", default_value_t = tartan_watchdog::run::DEFAULT_CONCURRENCY)]
    pub concurrency: usize,
    /// The wait before the first retry of a failed delete; doubled per failure up to --retry-cap.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = parse_std_duration)]
    pub retry_base: Duration,
    /// The longest wait between retries of a failed delete.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_std_duration)]
    pub retry_cap: Duration,
}

pub fn run(args: WatchdogArgs) -> anyhow::Result<()> {
    if args.rescan.is_zero() || args.rescan > Duration::from_secs(1) {
        anyhow::bail!("--rescan must be more than 0 and at most 1s, got {:?}", args.rescan);
    }
    let mut config = Config::new(&args.state_dir);
    config.grace = args.grace;
    config.tart_program = args.tart;
    config.rescan = args.rescan;
    config.concurrency = args.concurrency;
    config.retry_base = args.retry_base;
    config.retry_cap = args.retry_cap;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the watchdog's async runtime")?;
    runtime
        .block_on(tartan_watchdog::run(config, tartan_watchdog::terminated()))
        .with_context(|| format!("watchdog for {}", args.state_dir.display()))
}

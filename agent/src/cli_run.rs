//! `tartan-agent run --config FILE`: the build agent (the first LaunchAgent).

use anyhow::Context;
use std::path::PathBuf;
use tartan_agent::config::Config;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The agent's TOML config file (see `agent/examples/agent.toml` for every key and default).
    #[arg(long, value_name = "FILE", env = "TARTAN_AGENT_CONFIG")]
    pub config: PathBuf,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let config = Config::load(&args.config)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the agent's async runtime")?;
    runtime.block_on(tartan_agent::runtime::run(config))
}

//! `tartan-agent journal`: print the host journal in the source document's form.

use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct JournalArgs {
    /// The agent's state directory (the journal lives in `<DIR>/journal/`).
    #[arg(long, value_name = "DIR", env = "TARTAN_STATE_DIR")]
    pub state_dir: PathBuf,
    /// Keep printing records as they are appended (read-only; works while the agent runs).
    #[arg(long)]
    pub follow: bool,
    /// Print each record as one line of JSON instead of the human form.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: JournalArgs) -> anyhow::Result<()> {
    anyhow::bail!(
        "reading the journal in {} is not available in this build yet",
        args.state_dir.display()
    )
}

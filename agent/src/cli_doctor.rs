//! `tartan-agent doctor --config FILE [--json]`: checks this Mac as the agent will use it
//! (`tartan_agent::doctor`), one line per check; exits non-zero when any check fails.

use anyhow::Context;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct DoctorArgs {
    /// The agent's TOML config file, as `tartan-agent run` is given it.
    #[arg(long, value_name = "FILE", env = "TARTAN_AGENT_CONFIG")]
    pub config: PathBuf,
    /// Print `{"ok": bool, "checks": [{name, verdict, detail, fix}]}` instead of lines.
    #[arg(long)]
    pub json: bool,
}

/// The report is printed; a failed check is the error (so the exit code is 1).
pub fn run(args: DoctorArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start doctor's async runtime")?;
    let report = runtime.block_on(tartan_agent::doctor::run(&args.config));
    let text = if args.json {
        format!("{}\n", report.to_json())
    } else {
        report.render_text()
    };
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes()).context("writing the report to stdout")?;
    out.flush().context("writing the report to stdout")?;
    if !report.ok() {
        let failed: Vec<&str> = report
            .checks
            .iter()
            .filter(|c| c.verdict == tartan_agent::doctor::Verdict::Fail)
            .map(|c| c.name.as_str())
            .collect();
        anyhow::bail!("doctor: failed: {}", failed.join(", "));
    }
    Ok(())
}

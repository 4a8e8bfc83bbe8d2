//! `tartan-agent install | uninstall | service-status`: the two LaunchAgents (`dev.tartan.agent`,
//! `dev.tartan.watchdog`) in the logged-in user's GUI domain, through `launchctl`.
//!
//! These work only on macOS, except `--dry-run`, which prints the plists and the commands anywhere.
//!
//! Environment:
//! - `HOME`: the LaunchAgents directory is `$HOME/Library/LaunchAgents`; defaults live under it.
//! - `TARTAN_LAUNCHCTL`: the `launchctl` program (default `/bin/launchctl`).
//! - `TARTAN_ALLOW_LAUNCHCTL_ON_LINUX=1`: for tests only; lets the launchctl-running paths run off
//!   macOS, against a fake `TARTAN_LAUNCHCTL`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use tartan_launchd::launchctl::{Bootout, Field, Launchctl, ProcessRunner, Status, shell_quote};
use tartan_launchd::tartan::{self, AGENT_EXIT_TIMEOUT_SECS, Layout};
use tartan_launchd::{AGENT_LABEL, WATCHDOG_LABEL, files};

/// Environment variable naming the `launchctl` program.
pub const LAUNCHCTL_ENV: &str = "TARTAN_LAUNCHCTL";
/// Test-only: set to `1` to run launchctl commands off macOS.
pub const ALLOW_OFF_MACOS_ENV: &str = "TARTAN_ALLOW_LAUNCHCTL_ON_LINUX";

/// How long a `bootout` may take to stop a job: the agent's ExitTimeOut plus a margin.
const BOOTOUT_WAIT: Duration = Duration::from_secs(AGENT_EXIT_TIMEOUT_SECS as u64 + 10);

#[derive(clap::Args, Debug)]
pub struct InstallArgs {
    /// The agent's config file, passed to `tartan-agent run --config` (made absolute; must exist
    /// unless --dry-run) [default: ~/.config/tartan/agent.toml]
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The agent's state directory, passed to `tartan-agent watchdog --state-dir` [default: the
    /// config's `state_dir`; without a config (dry run only): ~/Library/Application Support/Tartan]
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Print the plists and the launchctl commands instead of writing and running them.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(clap::Args, Debug)]
pub struct UninstallArgs {
    /// Print the launchctl commands and the files to remove instead of doing it.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(clap::Args, Debug)]
pub struct StatusArgs {}

/// What the commands need from the environment; built once so tests of the pieces stay pure.
struct Host {
    home: PathBuf,
    uid: u32,
    launchctl: PathBuf,
}

impl Host {
    fn from_env() -> anyhow::Result<Self> {
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .filter(|h| h.is_absolute())
            .context("HOME is unset or not an absolute path; it locates ~/Library/LaunchAgents, so set it")?;
        let launchctl = std::env::var_os(LAUNCHCTL_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| tartan_launchd::launchctl::DEFAULT_LAUNCHCTL.into());
        Ok(Host {
            home,
            uid: nix::unistd::getuid().as_raw(),
            launchctl,
        })
    }

    fn launch_agents_dir(&self) -> PathBuf {
        files::launch_agents_dir(&self.home)
    }

    fn launchctl(&self) -> Launchctl<ProcessRunner> {
        Launchctl::new(ProcessRunner::new(&self.launchctl), self.uid)
    }
}

/// launchd exists only on macOS; tests opt in to a fake launchctl elsewhere.
fn require_launchd(command: &str, dry_run_hint: bool) -> anyhow::Result<()> {
    if cfg!(target_os = "macos") || std::env::var_os(ALLOW_OFF_MACOS_ENV).is_some_and(|v| v == "1") {
        return Ok(());
    }
    let hint = if dry_run_hint {
        format!("; `tartan-agent {command} --dry-run` shows what it would do")
    } else {
        String::new()
    };
    bail!(
        "`tartan-agent {command}` manages launchd LaunchAgents and works only on macOS (this is {}){hint}",
        std::env::consts::OS
    )
}

fn layout(host: &Host, args: &InstallArgs) -> anyhow::Result<Layout> {
    let binary = std::env::current_exe()
        .and_then(|exe| exe.canonicalize())
        .context("could not find the path of this tartan-agent binary, which the plists must name")?;
    let config = args
        .config
        .clone()
        .unwrap_or_else(|| host.home.join(".config/tartan/agent.toml"));
    let config = if args.dry_run {
        std::path::absolute(&config).with_context(|| format!("could not make {} absolute", config.display()))?
    } else {
        config.canonicalize().with_context(|| {
            format!(
                "the config file {} cannot be read; write it first (docs/install-on-mac.md) or pass --config FILE",
                config.display()
            )
        })?
    };
    // The watchdog must watch the agent's own state directory: take it from the config, which is
    // also checked here so a broken config never gets installed. A dry run works without one.
    let configured = match crate::config::Config::load(&config) {
        Ok(c) => Some(c.state_dir),
        Err(_) if args.dry_run && !config.exists() => None,
        Err(e) => return Err(e).context("the config file must be valid before the LaunchAgents are installed"),
    };
    let state_dir = match (args.state_dir.clone(), configured) {
        (Some(given), Some(configured)) if std::path::absolute(&given).ok().as_ref() != Some(&configured) => bail!(
            "--state-dir {} differs from state_dir {} in {}; the watchdog must watch the agent's state directory",
            given.display(),
            configured.display(),
            config.display()
        ),
        (_, Some(configured)) => configured,
        (Some(given), None) => given,
        (None, None) => Layout::default_state_dir(&host.home),
    };
    let state_dir =
        std::path::absolute(&state_dir).with_context(|| format!("could not make {} absolute", state_dir.display()))?;
    Ok(Layout {
        binary,
        config,
        state_dir,
        log_dir: Layout::default_log_dir(&host.home),
    })
}

/// `tartan-agent install`
pub fn install(args: InstallArgs) -> anyhow::Result<()> {
    let host = Host::from_env()?;
    if !args.dry_run {
        require_launchd("install", true)?;
    }
    let layout = layout(&host, &args)?;
    let jobs = tartan::jobs(&layout)?;
    let dir = host.launch_agents_dir();
    let mut launchctl = host.launchctl();
    if args.dry_run {
        print!("{}", install_plan(&launchctl, &dir, &layout, &jobs)?);
        return Ok(());
    }
    if cfg!(target_os = "macos") && !tartan::PATH.split(':').any(|d| Path::new(d).join("tart").is_file()) {
        tracing::warn!(
            "tart is in none of {} (the PATH the LaunchAgents get); builds will fail until \
             `brew install cirruslabs/cli/tart` puts it there",
            tartan::PATH
        );
    }
    for d in [&layout.log_dir, &layout.state_dir] {
        std::fs::create_dir_all(d).with_context(|| format!("could not create {}", d.display()))?;
    }
    let installed = files::install(&mut launchctl, &dir, &jobs, BOOTOUT_WAIT)?;
    for job in installed {
        let how = match job.previous {
            Bootout::Removed => "replaced the loaded job",
            Bootout::NotLoaded => "loaded",
        };
        println!(
            "{}: wrote {}, {how} in {}",
            job.label,
            job.plist.display(),
            launchctl.domain()
        );
        tracing::info!(label = %job.label, plist = %job.plist.display(), "installed LaunchAgent");
    }
    println!(
        "logs: {}; check with `tartan-agent service-status`",
        layout.log_dir.display()
    );
    Ok(())
}

/// The dry run of `install`: each plist, then the commands that would run.
fn install_plan<R: tartan_launchd::launchctl::Runner>(
    launchctl: &Launchctl<R>,
    dir: &Path,
    layout: &Layout,
    jobs: &[tartan_launchd::LaunchAgent],
) -> anyhow::Result<String> {
    let mut out = String::from("# dry run: nothing is written and launchctl is not run\n");
    for job in jobs {
        let xml = tartan::render(job)?;
        let _ = writeln!(out, "# {}", dir.join(job.file_name()).display());
        out.push_str(&String::from_utf8(xml).context("the generated plist is not UTF-8")?);
    }
    out.push_str("# commands\n");
    let _ = writeln!(
        out,
        "mkdir -p {} {} {}",
        shell_quote(&dir.display().to_string()),
        shell_quote(&layout.log_dir.display().to_string()),
        shell_quote(&layout.state_dir.display().to_string())
    );
    for job in jobs {
        let _ = writeln!(
            out,
            "{}  # \"not loaded\" is fine",
            launchctl.command_line(&launchctl.bootout_args(&job.label))
        );
        let _ = writeln!(
            out,
            "{}",
            launchctl.command_line(&launchctl.bootstrap_args(&dir.join(job.file_name())))
        );
    }
    Ok(out)
}

/// `tartan-agent uninstall`
pub fn uninstall(args: UninstallArgs) -> anyhow::Result<()> {
    let host = Host::from_env()?;
    let dir = host.launch_agents_dir();
    let mut launchctl = host.launchctl();
    let labels = [AGENT_LABEL, WATCHDOG_LABEL];
    if args.dry_run {
        println!("# dry run: launchctl is not run and nothing is removed");
        for label in labels {
            println!("{}", launchctl.command_line(&launchctl.bootout_args(label)));
            println!(
                "rm -f {}",
                shell_quote(&dir.join(format!("{label}.plist")).display().to_string())
            );
        }
        return Ok(());
    }
    require_launchd("uninstall", true)?;
    for job in files::uninstall(&mut launchctl, &dir, &labels, BOOTOUT_WAIT)? {
        let stopped = match job.bootout {
            Bootout::Removed => "stopped and unloaded",
            Bootout::NotLoaded => "was not loaded",
        };
        let file = if job.removed_file {
            "removed"
        } else {
            "was already absent"
        };
        println!("{}: {stopped}; {} {file}", job.label, job.plist.display());
        tracing::info!(label = %job.label, "uninstalled LaunchAgent");
    }
    Ok(())
}

/// `tartan-agent service-status`: what `launchctl print` says of each job. Fails unless both run.
pub fn status(_args: StatusArgs) -> anyhow::Result<()> {
    require_launchd("service-status", false)?;
    let host = Host::from_env()?;
    let dir = host.launch_agents_dir();
    let mut launchctl = host.launchctl();
    let mut problems = Vec::new();
    for label in [AGENT_LABEL, WATCHDOG_LABEL] {
        let plist = dir.join(format!("{label}.plist"));
        let file = if plist.exists() { "present" } else { "missing" };
        match launchctl.print(label)? {
            Status::NotLoaded => {
                println!(
                    "{label}: not loaded in {} (plist {} {file})",
                    launchctl.domain(),
                    plist.display()
                );
                problems.push(format!("{label} is not loaded"));
            }
            Status::Loaded(p) => {
                let state = match &p.state {
                    Field::Missing => "unknown (no `state = ` line in `launchctl print`)".to_owned(),
                    other => other.to_string(),
                };
                println!(
                    "{label}: state {state}, pid {}, last exit code {} (plist {} {file})",
                    p.pid,
                    p.last_exit_code,
                    plist.display()
                );
                match &p.state {
                    Field::Value(s) if s == "running" => {}
                    _ => problems.push(format!("{label} is not running (state {state})")),
                }
            }
        }
    }
    if !problems.is_empty() {
        bail!(
            "{}; see ~/Library/Logs/Tartan/, `log show --last 10m --predicate 'subsystem == \"dev.tartan\"'`, \
             or reinstall with `tartan-agent install`",
            problems.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tartan_launchd::launchctl::{Output, Runner};

    struct NoRun;
    impl Runner for NoRun {
        fn run(&mut self, args: &[String]) -> std::io::Result<Output> {
            panic!("a dry run must not run launchctl {args:?}")
        }
        fn program(&self) -> &Path {
            Path::new("/bin/launchctl")
        }
    }

    #[test]
    fn the_install_plan_lists_both_plists_and_the_commands_in_order() {
        let home = Path::new("/Users/a b");
        let layout = Layout {
            binary: "/opt/homebrew/bin/tartan-agent".into(),
            config: "/Users/a b/.config/tartan/agent.toml".into(),
            state_dir: Layout::default_state_dir(home),
            log_dir: Layout::default_log_dir(home),
        };
        let jobs = tartan::jobs(&layout).unwrap();
        let plan = install_plan(
            &Launchctl::new(NoRun, 501),
            &files::launch_agents_dir(home),
            &layout,
            &jobs,
        )
        .unwrap();
        let commands: Vec<_> = plan.lines().skip_while(|l| *l != "# commands").skip(1).collect();
        assert_eq!(
            commands,
            [
                "mkdir -p '/Users/a b/Library/LaunchAgents' '/Users/a b/Library/Logs/Tartan' \
                 '/Users/a b/Library/Application Support/Tartan'",
                "/bin/launchctl bootout gui/501/dev.tartan.agent  # \"not loaded\" is fine",
                "/bin/launchctl bootstrap gui/501 '/Users/a b/Library/LaunchAgents/dev.tartan.agent.plist'",
                "/bin/launchctl bootout gui/501/dev.tartan.watchdog  # \"not loaded\" is fine",
                "/bin/launchctl bootstrap gui/501 '/Users/a b/Library/LaunchAgents/dev.tartan.watchdog.plist'",
            ]
        );
        assert_eq!(plan.matches("<plist version=\"1.0\">").count(), 2, "{plan}");
    }
}

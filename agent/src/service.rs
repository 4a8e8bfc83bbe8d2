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
    /// Replace an installed agent that is newer than this binary, or whose version cannot be read
    /// (without it, `install` refuses: a downgrade must be deliberate).
    #[arg(long)]
    pub allow_downgrade: bool,
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
    let replacing = installed_agent(&dir, &layout.binary)?;
    let line = replacement_line(&replacing, &layout.binary, args.allow_downgrade)?;
    let mut launchctl = host.launchctl();
    if args.dry_run {
        println!("# {line}");
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
    println!("{line}");
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

/// A release as `--version` prints it: `MAJOR.MINOR.PATCH[-PRE]`, ordered as semver orders them
/// (a pre-release before its release; pre-release tags compare as text, enough for ours).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Release {
    numbers: [u64; 3],
    pre: Option<String>,
}

impl Release {
    fn parse(text: &str) -> Option<Release> {
        let (core, pre) = match text.split_once('-') {
            Some((core, pre)) => (core, Some(pre.to_owned())),
            None => (text, None),
        };
        let mut parts = core.split('.').map(|n| n.parse::<u64>().ok());
        let numbers = [parts.next()??, parts.next()??, parts.next()??];
        parts.next().is_none().then_some(Release { numbers, pre })
    }
}

impl Ord for Release {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        use std::cmp::Ordering::{Greater, Less};
        self.numbers
            .cmp(&other.numbers)
            .then_with(|| match (&self.pre, &other.pre) {
                (None, None) => std::cmp::Ordering::Equal,
                (None, Some(_)) => Greater,
                (Some(_), None) => Less,
                (Some(a), Some(b)) => a.cmp(b),
            })
    }
}

impl PartialOrd for Release {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// The release in the output of `tartan-agent --version`: `tartan-agent 0.2.0 (commit abc…)`
/// (releases before 0.2 print no commit).
fn release_of_version_output(stdout: &str) -> Option<Release> {
    let rest = stdout.trim().strip_prefix("tartan-agent ")?;
    Release::parse(rest.split_whitespace().next()?)
}

/// The agent an install would replace: the binary named by the installed agent plist.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Installed {
    /// No agent plist: a first install.
    Nothing,
    /// The plist names this very binary (replaced in place, e.g. by a package manager): the
    /// running agent's version cannot be asked of the file any more.
    SameFile { binary: PathBuf },
    /// Another binary, and what its `--version` printed (trimmed) or why it could not be run.
    Other {
        binary: PathBuf,
        version: Result<String, String>,
    },
}

/// Reads `<dir>/dev.tartan.agent.plist` and asks the binary it names for its `--version`.
fn installed_agent(dir: &Path, ours: &Path) -> anyhow::Result<Installed> {
    let plist = dir.join(format!("{}.plist", tartan_launchd::AGENT_LABEL));
    let bytes = match std::fs::read(&plist) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Installed::Nothing),
        Err(e) => return Err(e).with_context(|| format!("reading the installed agent plist {}", plist.display())),
    };
    let job = tartan_launchd::LaunchAgent::from_bytes(&bytes, &plist.display().to_string()).with_context(|| {
        format!(
            "the installed agent plist {} does not parse, so the agent it runs is unknown; \
             `tartan-agent uninstall` removes it",
            plist.display()
        )
    })?;
    let Some(binary) = job.program_arguments.first().map(PathBuf::from) else {
        bail!(
            "the installed agent plist {} names no program; `tartan-agent uninstall` removes it",
            plist.display()
        );
    };
    if binary.canonicalize().is_ok_and(|b| b == ours) {
        return Ok(Installed::SameFile { binary });
    }
    let version = match std::process::Command::new(&binary).arg("--version").output() {
        Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned()),
        Ok(out) => Err(format!(
            "`{} --version` failed ({}): {}",
            binary.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Err(format!("could not run `{} --version`: {e}", binary.display())),
    };
    Ok(Installed::Other { binary, version })
}

/// What `install` prints about the agent it replaces, or why it refuses to: never a silent
/// downgrade, and never over a binary whose version it cannot read, without `allow_downgrade`.
fn replacement_line(installed: &Installed, ours: &Path, allow_downgrade: bool) -> anyhow::Result<String> {
    let this = format!("tartan-agent {} at {}", crate::VERSION, ours.display());
    let (binary, version) = match installed {
        Installed::Nothing => return Ok(format!("installing {this} (no agent was installed)")),
        Installed::SameFile { binary } => {
            return Ok(format!(
                "installing {this}; the installed plist already names {} (the binary was replaced in \
                 place), so the running agent's version is not known",
                binary.display()
            ));
        }
        Installed::Other { binary, version } => (binary, version),
    };
    let hint = "pass --allow-downgrade to replace it anyway (docs/upgrading.md)";
    let at = binary.display();
    let text = match version {
        Ok(text) => text,
        // The plist names a binary that is gone: there is nothing newer left to protect.
        Err(why) if !binary.exists() => {
            return Ok(format!(
                "installing {this}; the installed plist names {at}, which is gone ({why})"
            ));
        }
        Err(why) if allow_downgrade => {
            return Ok(format!(
                "replacing the agent at {at} of unknown version ({why}) with {this} (--allow-downgrade)"
            ));
        }
        Err(why) => {
            bail!("refusing to replace the installed agent at {at}: {why}, so it may be newer than {this}; {hint}")
        }
    };
    let ours = Release::parse(env!("CARGO_PKG_VERSION")).expect("the crate version is semver");
    match release_of_version_output(text) {
        Some(theirs) if theirs <= ours => Ok(format!("replacing {text} at {at} with {this}")),
        Some(_) if allow_downgrade => Ok(format!("downgrading {text} at {at} to {this} (--allow-downgrade)")),
        Some(_) => bail!("refusing to downgrade: the installed agent is {text} at {at}, newer than {this}; {hint}"),
        None if allow_downgrade => Ok(format!(
            "replacing the agent at {at}, whose --version printed {text:?}, with {this} (--allow-downgrade)"
        )),
        None => bail!(
            "refusing to replace the installed agent at {at}: its --version printed {text:?}, which names no \
             release, so it may be newer than {this}; {hint}"
        ),
    }
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
    let mut problems = Vec::new();
    for (label, state) in launch_agents()? {
        match state {
            Ok(line) => println!("{label}: {line}"),
            Err((line, problem)) => {
                println!("{label}: {line}");
                problems.push(problem);
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

/// A LaunchAgent's label and its state line: `Err` when it is not loaded or not running.
pub type LaunchAgentState = (String, Result<String, String>);

/// What launchd says of each LaunchAgent, for `tartan-agent doctor`: `None` where there is no
/// launchd (off macOS, unless the test override is set), else per label its state, `Err` when it
/// is not loaded or not running.
pub fn launch_agent_states() -> Option<anyhow::Result<Vec<LaunchAgentState>>> {
    require_launchd("doctor", false).ok()?;
    Some(launch_agents().map(|states| {
        states
            .into_iter()
            .map(|(label, state)| (label.to_string(), state.map_err(|(line, _)| line)))
            .collect()
    }))
}

/// A LaunchAgent's line, or that line and the problem in a few words.
type AgentLine = Result<String, (String, String)>;

/// Each LaunchAgent's line (state, pid, last exit code, its plist), and for one not loaded or not
/// running that line and the problem in a few words.
fn launch_agents() -> anyhow::Result<Vec<(&'static str, AgentLine)>> {
    let host = Host::from_env()?;
    let dir = host.launch_agents_dir();
    // Only queries (`print`), answered in milliseconds: a launchctl that hangs fails in seconds.
    let runner = ProcessRunner::new(&host.launchctl).with_timeout(std::time::Duration::from_secs(5));
    let mut launchctl = Launchctl::new(runner, host.uid);
    let mut out = Vec::new();
    for label in [AGENT_LABEL, WATCHDOG_LABEL] {
        let plist = dir.join(format!("{label}.plist"));
        let file = if plist.exists() { "present" } else { "missing" };
        let state = match launchctl.print(label)? {
            Status::NotLoaded => Err((
                format!(
                    "not loaded in {} (plist {} {file})",
                    launchctl.domain(),
                    plist.display()
                ),
                format!("{label} is not loaded"),
            )),
            Status::Loaded(p) => {
                let state = match &p.state {
                    Field::Missing => "unknown (no `state = ` line in `launchctl print`)".to_owned(),
                    other => other.to_string(),
                };
                let line = format!(
                    "state {state}, pid {}, last exit code {} (plist {} {file})",
                    p.pid,
                    p.last_exit_code,
                    plist.display()
                );
                match &p.state {
                    Field::Value(s) if s == "running" => Ok(line),
                    _ => Err((line, format!("{label} is not running (state {state})"))),
                }
            }
        };
        out.push((label, state));
    }
    Ok(out)
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
    fn releases_order_as_semver_does() {
        let r = |s| Release::parse(s).unwrap_or_else(|| panic!("{s} should parse"));
        assert!(r("0.1.0") < r("0.2.0"));
        assert!(r("0.9.0") < r("0.10.0"), "numbers, not text");
        assert!(r("1.0.0-rc.1") < r("1.0.0"));
        assert!(r("1.0.0-alpha") < r("1.0.0-beta"));
        assert_eq!(r("1.2.3"), r("1.2.3"));
        for bad in ["", "1.2", "1.2.3.4", "v1.2.3", "1.x.3"] {
            assert_eq!(Release::parse(bad), None, "{bad:?}");
        }
        assert_eq!(
            release_of_version_output("tartan-agent 0.3.1 (commit 0123abc)\n"),
            Some(r("0.3.1"))
        );
        assert_eq!(
            release_of_version_output("tartan-agent 0.1.0\n"),
            Some(r("0.1.0")),
            "before commits were printed"
        );
        assert_eq!(release_of_version_output("tart 2.0.0"), None);
    }

    fn other(version: Result<&str, &str>, binary: &Path) -> Installed {
        Installed::Other {
            binary: binary.into(),
            version: version.map(str::to_owned).map_err(str::to_owned),
        }
    }

    #[test]
    fn a_newer_or_unreadable_installed_agent_is_replaced_only_with_allow_downgrade() {
        let ours = Path::new("/opt/new/tartan-agent");
        // An existing file stands for the installed binary: its presence matters when it cannot run.
        let exists = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        let newer = other(Ok("tartan-agent 999.0.0 (commit feed)"), &exists);
        let e = replacement_line(&newer, ours, false).unwrap_err().to_string();
        assert!(
            e.contains("refusing to downgrade") && e.contains("999.0.0") && e.contains("--allow-downgrade"),
            "{e}"
        );
        let line = replacement_line(&newer, ours, true).unwrap();
        assert!(
            line.starts_with("downgrading tartan-agent 999.0.0 (commit feed)"),
            "{line}"
        );

        let unreadable = other(Err("`x --version` failed (exit status: 2): boom"), &exists);
        let e = replacement_line(&unreadable, ours, false).unwrap_err().to_string();
        assert!(e.contains("boom") && e.contains("--allow-downgrade"), "{e}");
        assert!(replacement_line(&unreadable, ours, true).is_ok());
        let garbled = other(Ok("something else"), &exists);
        assert!(replacement_line(&garbled, ours, false).is_err());
        assert!(replacement_line(&garbled, ours, true).is_ok());
    }

    #[test]
    fn an_older_same_missing_or_absent_agent_is_replaced_and_named() {
        let ours = Path::new("/opt/new/tartan-agent");
        let exists = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        let line = replacement_line(&other(Ok("tartan-agent 0.0.1 (commit abc)"), &exists), ours, false).unwrap();
        assert_eq!(
            line,
            format!(
                "replacing tartan-agent 0.0.1 (commit abc) at {} with tartan-agent {} at /opt/new/tartan-agent",
                exists.display(),
                crate::VERSION
            )
        );
        let same = format!("tartan-agent {}", crate::VERSION);
        let line = replacement_line(&other(Ok(&same), &exists), ours, false).unwrap();
        assert!(line.starts_with(&format!("replacing {same} at ")), "{line}");
        let gone = other(Err("could not run"), Path::new("/nonexistent/tartan-agent"));
        let line = replacement_line(&gone, ours, false).unwrap();
        assert!(line.contains("/nonexistent/tartan-agent, which is gone"), "{line}");
        let line = replacement_line(&Installed::Nothing, ours, false).unwrap();
        assert!(line.ends_with("(no agent was installed)"), "{line}");
        let line = replacement_line(&Installed::SameFile { binary: ours.into() }, ours, false).unwrap();
        assert!(line.contains("replaced in place"), "{line}");
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

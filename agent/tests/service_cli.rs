//! `tartan-agent install | uninstall | service-status`, run as the real binary.
//!
//! `HOME` points into a temp dir and `TARTAN_LAUNCHCTL` at a fake `launchctl` (a shell script that
//! records its argv and answers like launchctl does). Off macOS the launchctl-running paths need
//! the documented test override `TARTAN_ALLOW_LAUNCHCTL_ON_LINUX=1`; `--dry-run` needs nothing.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tartan_launchd::LaunchAgent;

const FAKE_LAUNCHCTL: &str = r#"#!/bin/sh
# Records each call as [arg][arg]... and answers like launchctl.
for a in "$@"; do printf '[%s]' "$a"; done >> "$FAKE_DIR/calls"
echo >> "$FAKE_DIR/calls"
case "$1" in
bootout)
    if [ -e "$FAKE_DIR/loaded" ]; then exit 0; fi
    echo "Boot-out failed: 3: No such process" >&2
    exit 3 ;;
bootstrap)
    if [ -e "$FAKE_DIR/bootstrap-fails" ]; then
        echo "Bootstrap failed: 5: Input/output error" >&2
        exit 5
    fi
    exit 0 ;;
print)
    label="${2##*/}"
    if [ -f "$FAKE_DIR/print.$label" ]; then cat "$FAKE_DIR/print.$label"; exit 0; fi
    echo "Could not find service \"$label\" in domain for user gui: 501" >&2
    exit 113 ;;
esac
echo "Unrecognized subcommand: $1" >&2
exit 64
"#;

struct Fixture {
    _tmp: tempfile::TempDir,
    home: PathBuf,
    fake: PathBuf,
}

impl Fixture {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        // A space in HOME checks that paths are passed as single arguments.
        let home = tmp.path().join("home dir");
        let fake = tmp.path().join("fake");
        fs::create_dir_all(&home).unwrap();
        fs::create_dir_all(&fake).unwrap();
        let script = fake.join("launchctl");
        tartan_testkit::write_program(&script, FAKE_LAUNCHCTL);
        Fixture { _tmp: tmp, home, fake }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tartan-agent"));
        cmd.args(args)
            .env("HOME", &self.home)
            .env("TARTAN_LAUNCHCTL", self.fake.join("launchctl"))
            .env("FAKE_DIR", &self.fake)
            .env_remove("TARTAN_ALLOW_LAUNCHCTL_ON_LINUX")
            .env_remove("TARTAN_LOG_FORMAT")
            .env_remove("RUST_LOG");
        cmd
    }

    /// Run with the test override that allows a (fake) launchctl off macOS.
    fn run(&self, args: &[&str]) -> Output {
        self.command(args)
            .env("TARTAN_ALLOW_LAUNCHCTL_ON_LINUX", "1")
            .output()
            .unwrap()
    }

    fn calls(&self) -> Vec<String> {
        fs::read_to_string(self.fake.join("calls"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    fn agents_dir(&self) -> PathBuf {
        self.home.join("Library/LaunchAgents")
    }

    fn config(&self) -> PathBuf {
        let config = self.home.join("agent.toml");
        fs::write(&config, "# test config\n").unwrap();
        config
    }
}

fn uid() -> u32 {
    nix::unistd::getuid().as_raw()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn assert_ok(out: &Output) {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// The `<?xml ... </plist>` documents in a dry run's output.
fn plists_in(stdout: &str) -> Vec<String> {
    stdout
        .split("<?xml")
        .skip(1)
        .map(|rest| {
            let end = rest.find("</plist>").expect("an unterminated plist") + "</plist>".len();
            format!("<?xml{}\n", &rest[..end])
        })
        .collect()
}

fn python_plistlib_reads(path: &Path) {
    let out = Command::new("python3")
        .args(["-c", "import plistlib,sys; plistlib.load(open(sys.argv[1],'rb'))"])
        .arg(path)
        .output()
        .expect("python3 is needed to cross-check the plists");
    assert!(out.status.success(), "plistlib: {}", text(&out.stderr));
}

#[test]
fn install_dry_run_prints_two_valid_plists_and_the_launchctl_lines_and_touches_nothing() {
    let fx = Fixture::new();
    // No override: a dry run works on any OS.
    let out = fx
        .command(&["install", "--dry-run", "--config", "relative/agent.toml"])
        .current_dir(&fx.home)
        .output()
        .unwrap();
    assert_ok(&out);
    let stdout = text(&out.stdout);
    let plists = plists_in(&stdout);
    assert_eq!(plists.len(), 2, "{stdout}");
    let agent = LaunchAgent::from_bytes(plists[0].as_bytes(), "dry-run agent plist").unwrap();
    let watchdog = LaunchAgent::from_bytes(plists[1].as_bytes(), "dry-run watchdog plist").unwrap();
    assert_eq!(agent.label, "dev.tartan.agent");
    assert_eq!(watchdog.label, "dev.tartan.watchdog");
    let binary = fs::canonicalize(env!("CARGO_BIN_EXE_tartan-agent")).unwrap();
    let config = fx.home.join("relative/agent.toml");
    assert_eq!(
        agent.program_arguments,
        [binary.to_str().unwrap(), "run", "--config", config.to_str().unwrap()]
    );
    let state = fx.home.join("Library/Application Support/Tartan");
    assert_eq!(
        watchdog.program_arguments,
        [
            binary.to_str().unwrap(),
            "watchdog",
            "--state-dir",
            state.to_str().unwrap()
        ]
    );
    for (i, xml) in plists.iter().enumerate() {
        let path = fx.fake.join(format!("{i}.plist"));
        fs::write(&path, xml).unwrap();
        python_plistlib_reads(&path);
    }

    let fake = fx.fake.join("launchctl");
    let agents = fx.agents_dir();
    let q = |p: &Path| format!("'{}'", p.display());
    let uid = uid();
    for line in [
        format!("{} bootout gui/{uid}/dev.tartan.agent", fake.display()),
        format!(
            "{} bootstrap gui/{uid} {}",
            fake.display(),
            q(&agents.join("dev.tartan.agent.plist"))
        ),
        format!("{} bootout gui/{uid}/dev.tartan.watchdog", fake.display()),
        format!(
            "{} bootstrap gui/{uid} {}",
            fake.display(),
            q(&agents.join("dev.tartan.watchdog.plist"))
        ),
    ] {
        assert!(stdout.contains(&line), "missing `{line}` in:\n{stdout}");
    }
    assert!(fx.calls().is_empty(), "a dry run ran launchctl: {:?}", fx.calls());
    assert!(!fx.home.join("Library").exists(), "a dry run wrote under HOME");
}

#[cfg(not(target_os = "macos"))]
#[test]
fn without_the_test_override_the_launchd_commands_refuse_to_run_off_macos() {
    let fx = Fixture::new();
    let config = fx.config();
    for args in [
        vec!["install", "--config", config.to_str().unwrap()],
        vec!["uninstall"],
        vec!["service-status"],
    ] {
        let out = fx.command(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded off macOS");
        let stderr = text(&out.stderr);
        assert!(stderr.contains("works only on macOS"), "{args:?}: {stderr}");
        if args[0] != "service-status" {
            assert!(stderr.contains("--dry-run"), "{args:?}: {stderr}");
        }
    }
    assert!(fx.calls().is_empty(), "{:?}", fx.calls());
    assert!(!fx.agents_dir().exists());
}

#[test]
fn install_writes_both_plists_then_boots_out_and_bootstraps_each() {
    let fx = Fixture::new();
    let config = fx.config();
    let out = fx.run(&["install", "--config", config.to_str().unwrap()]);
    assert_ok(&out);
    let uid = uid();
    let agents = fx.agents_dir();
    assert_eq!(
        fx.calls(),
        [
            format!("[bootout][gui/{uid}/dev.tartan.agent]"),
            format!(
                "[bootstrap][gui/{uid}][{}]",
                agents.join("dev.tartan.agent.plist").display()
            ),
            format!("[bootout][gui/{uid}/dev.tartan.watchdog]"),
            format!(
                "[bootstrap][gui/{uid}][{}]",
                agents.join("dev.tartan.watchdog.plist").display()
            ),
        ]
    );
    let agent_plist = agents.join("dev.tartan.agent.plist");
    let agent = LaunchAgent::from_bytes(&fs::read(&agent_plist).unwrap(), "installed agent plist").unwrap();
    assert_eq!(
        agent.program_arguments[1..],
        ["run", "--config", config.canonicalize().unwrap().to_str().unwrap()]
    );
    python_plistlib_reads(&agent_plist);
    python_plistlib_reads(&agents.join("dev.tartan.watchdog.plist"));
    assert!(
        fx.home.join("Library/Logs/Tartan").is_dir(),
        "the log directory was not created"
    );
    assert!(fx.home.join("Library/Application Support/Tartan").is_dir());
    let names: Vec<_> = fs::read_dir(&agents)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names.len(), 2, "leftover temporary files: {names:?}");
    assert!(
        text(&out.stdout).contains("dev.tartan.agent: wrote"),
        "{}",
        text(&out.stdout)
    );

    // Installing again replaces the loaded jobs: bootout now succeeds.
    fs::write(fx.fake.join("loaded"), "").unwrap();
    let out = fx.run(&["install", "--config", config.to_str().unwrap()]);
    assert_ok(&out);
    assert!(
        text(&out.stdout).contains("replaced the loaded job"),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn install_without_a_config_file_fails_before_touching_anything() {
    let fx = Fixture::new();
    let out = fx.run(&["install"]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    let default = fx.home.join(".config/tartan/agent.toml");
    assert!(stderr.contains(&default.display().to_string()), "{stderr}");
    assert!(stderr.contains("--config"), "{stderr}");
    assert!(fx.calls().is_empty());
    assert!(!fx.agents_dir().exists());
}

#[test]
fn a_refused_bootstrap_fails_with_launchctl_s_message_and_a_next_step() {
    let fx = Fixture::new();
    let config = fx.config();
    fs::write(fx.fake.join("bootstrap-fails"), "").unwrap();
    let out = fx.run(&["install", "--config", config.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("Bootstrap failed: 5: Input/output error"), "{stderr}");
    assert!(stderr.contains("plutil -lint"), "{stderr}");
    // It stopped at the first failure.
    assert_eq!(fx.calls().len(), 2, "{:?}", fx.calls());
}

#[test]
fn uninstall_boots_out_both_and_removes_the_plists() {
    let fx = Fixture::new();
    let config = fx.config();
    assert_ok(&fx.run(&["install", "--config", config.to_str().unwrap()]));
    fs::remove_file(fx.fake.join("calls")).unwrap();
    fs::write(fx.fake.join("loaded"), "").unwrap();

    let dry = fx.command(&["uninstall", "--dry-run"]).output().unwrap();
    assert_ok(&dry);
    let uid = uid();
    assert!(
        text(&dry.stdout).contains(&format!("bootout gui/{uid}/dev.tartan.watchdog")),
        "{}",
        text(&dry.stdout)
    );
    assert!(fx.calls().is_empty());
    assert!(fx.agents_dir().join("dev.tartan.agent.plist").exists());

    let out = fx.run(&["uninstall"]);
    assert_ok(&out);
    assert_eq!(
        fx.calls(),
        [
            format!("[bootout][gui/{uid}/dev.tartan.agent]"),
            format!("[bootout][gui/{uid}/dev.tartan.watchdog]"),
        ]
    );
    assert_eq!(fs::read_dir(fx.agents_dir()).unwrap().count(), 0);

    // A second uninstall finds nothing loaded and no files, and still succeeds.
    fs::remove_file(fx.fake.join("loaded")).unwrap();
    let out = fx.run(&["uninstall"]);
    assert_ok(&out);
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("was not loaded") && stdout.contains("was already absent"),
        "{stdout}"
    );
}

const PRINT_RUNNING: &str = "gui/501/dev.tartan.agent = {
\tactive count = 1
\tpath = /Users/ci/Library/LaunchAgents/dev.tartan.agent.plist
\ttype = LaunchAgent
\tstate = running

\tprogram = /opt/homebrew/bin/tartan-agent
\truns = 2
\tpid = 4242
\tlast exit code = 78: EX_CONFIG
\tendpoints = {
\t\t\"x\" = {
\t\t\tstate = active
\t\t}
\t}
}
";

#[test]
fn service_status_reports_state_pid_and_last_exit_code_of_each_job() {
    let fx = Fixture::new();
    fs::write(fx.fake.join("print.dev.tartan.agent"), PRINT_RUNNING).unwrap();
    // The watchdog is not loaded: the status says so and the command fails.
    let out = fx.run(&["service-status"]);
    let stdout = text(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout.contains("dev.tartan.agent: state running, pid 4242, last exit code 78 (EX_CONFIG)"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("dev.tartan.watchdog: not loaded in gui/{}", uid())),
        "{stdout}"
    );
    assert!(
        text(&out.stderr).contains("dev.tartan.watchdog is not loaded"),
        "{}",
        text(&out.stderr)
    );
    let uid = uid();
    assert_eq!(
        fx.calls(),
        [
            format!("[print][gui/{uid}/dev.tartan.agent]"),
            format!("[print][gui/{uid}/dev.tartan.watchdog]"),
        ]
    );

    // Both running: success.
    fs::write(
        fx.fake.join("print.dev.tartan.watchdog"),
        "gui/501/dev.tartan.watchdog = {\n\tstate = running\n\tpid = 77\n\tlast exit code = (never exited)\n}\n",
    )
    .unwrap();
    let out = fx.run(&["service-status"]);
    assert_ok(&out);
    assert!(
        text(&out.stdout).contains("dev.tartan.watchdog: state running, pid 77, last exit code never exited"),
        "{}",
        text(&out.stdout)
    );

    // A format this code does not know shows up as unknown, with the raw line, and is not "running".
    fs::write(
        fx.fake.join("print.dev.tartan.watchdog"),
        "gui/501/dev.tartan.watchdog = {\n\tstatus: up\n\tpid = seventy\n}\n",
    )
    .unwrap();
    let out = fx.run(&["service-status"]);
    assert!(!out.status.success());
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("dev.tartan.watchdog: state unknown (no `state = ` line in `launchctl print`), pid unknown (\"pid = seventy\"), last exit code -"),
        "{stdout}"
    );
}

#[test]
fn json_log_format_writes_errors_as_json_lines() {
    let fx = Fixture::new();
    // `install` without a config fails early on any OS (with the override), logging one error.
    let out = fx
        .command(&["install", "--log-format", "json"])
        .env("TARTAN_ALLOW_LAUNCHCTL_ON_LINUX", "1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    let line = stderr
        .lines()
        .find(|l| l.contains("\"level\":\"ERROR\""))
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(line.starts_with('{') && line.ends_with('}'), "{line}");
    assert!(line.contains("agent.toml"), "{line}");
}

#[test]
fn the_watchdog_watches_the_state_dir_of_the_config() {
    let fx = Fixture::new();
    let config = fx.home.join("agent.toml");
    fs::write(&config, "state_dir = \"/var/tartan-state\"\n").unwrap();
    let config = config.to_str().unwrap();

    let out = fx
        .command(&["install", "--dry-run", "--config", config])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("<string>/var/tartan-state</string>"),
        "the watchdog plist should name the config's state_dir:\n{stdout}"
    );

    let out = fx
        .command(&["install", "--dry-run", "--config", config, "--state-dir", "/elsewhere"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("differs from state_dir /var/tartan-state"), "{stderr}");

    fs::write(fx.home.join("agent.toml"), "slots = 3\n").unwrap();
    let out = fx
        .command(&["install", "--dry-run", "--config", config])
        .output()
        .unwrap();
    assert!(!out.status.success(), "a broken config must not be installed");
}

/// `git rev-parse HEAD` of the checkout, if git and `.git` are there (CI clones the repository).
fn git_head() -> Option<String> {
    let out = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    out.status.success().then(|| text(&out.stdout).trim().to_owned())
}

#[test]
fn version_names_the_release_and_the_git_commit() {
    let out = Command::new(env!("CARGO_BIN_EXE_tartan-agent"))
        .arg("--version")
        .output()
        .unwrap();
    assert_ok(&out);
    let stdout = text(&out.stdout);
    let commit = git_head().unwrap_or_else(|| "unknown".into());
    assert_eq!(
        stdout,
        format!("tartan-agent {} (commit {commit})\n", env!("CARGO_PKG_VERSION"))
    );
}

impl Fixture {
    /// Points the installed agent plist at a fake `tartan-agent` whose `--version` prints
    /// `version_line`; returns the fake's path.
    fn install_fake_agent(&self, version_line: &str) -> PathBuf {
        let fake_agent = self.fake.join("old/tartan-agent");
        fs::create_dir_all(fake_agent.parent().unwrap()).unwrap();
        tartan_testkit::write_program(&fake_agent, &format!("#!/bin/sh\necho '{version_line}'\n"));
        let plist = self.agents_dir().join("dev.tartan.agent.plist");
        let mut job = LaunchAgent::from_bytes(&fs::read(&plist).unwrap(), "agent plist").unwrap();
        job.program_arguments[0] = fake_agent.display().to_string();
        fs::write(&plist, job.to_xml().unwrap()).unwrap();
        fake_agent
    }
}

#[test]
fn install_refuses_to_downgrade_a_newer_agent_unless_allowed_and_names_what_it_replaces() {
    let fx = Fixture::new();
    let config = fx.config();
    let install = ["install", "--config", config.to_str().unwrap()];
    let out = fx.run(&install);
    assert_ok(&out);
    assert!(
        text(&out.stdout).contains("(no agent was installed)"),
        "{}",
        text(&out.stdout)
    );
    let ours = PathBuf::from(env!("CARGO_BIN_EXE_tartan-agent"))
        .canonicalize()
        .unwrap();
    let this = format!(
        "tartan-agent {} (commit {}) at {}",
        env!("CARGO_PKG_VERSION"),
        git_head().unwrap_or_else(|| "unknown".into()),
        ours.display()
    );

    let newer = fx.install_fake_agent("tartan-agent 99.0.0 (commit feed)");
    let calls_before = fx.calls().len();
    let plist = fx.agents_dir().join("dev.tartan.agent.plist");
    let plist_before = fs::read(&plist).unwrap();
    let out = fx.run(&install);
    assert!(
        !out.status.success(),
        "a downgrade was installed: {}",
        text(&out.stdout)
    );
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "refusing to downgrade: the installed agent is tartan-agent 99.0.0 (commit feed) at {}, newer than {this}",
            newer.display()
        )) && stderr.contains("--allow-downgrade"),
        "{stderr}"
    );
    assert_eq!(fx.calls().len(), calls_before, "launchctl ran although install refused");
    assert_eq!(
        fs::read(&plist).unwrap(),
        plist_before,
        "the plist was rewritten although install refused"
    );

    let out = fx.run(&[&install[..], &["--allow-downgrade"]].concat());
    assert_ok(&out);
    assert!(
        text(&out.stdout).contains(&format!(
            "downgrading tartan-agent 99.0.0 (commit feed) at {} to {this} (--allow-downgrade)",
            newer.display()
        )),
        "{}",
        text(&out.stdout)
    );

    let older = fx.install_fake_agent("tartan-agent 0.0.1 (commit abc)");
    let out = fx.run(&install);
    assert_ok(&out);
    assert!(
        text(&out.stdout).contains(&format!(
            "replacing tartan-agent 0.0.1 (commit abc) at {} with {this}",
            older.display()
        )),
        "{}",
        text(&out.stdout)
    );
    // After that install the plist names this binary itself.
    let out = fx.run(&install);
    assert_ok(&out);
    assert!(text(&out.stdout).contains("replaced in place"), "{}", text(&out.stdout));
}

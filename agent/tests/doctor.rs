//! `tartan-agent doctor`, run as the real binary against tart-double (a temp TART_HOME holding one
//! local image), a temp state dir and the API emulator: a healthy set-up passes every check (exit
//! 0), and each broken set-up it claims to find fails its check (exit 1) with the fix said.
//! Off macOS the LaunchAgents check runs against a fake `launchctl` through the documented test
//! override `TARTAN_ALLOW_LAUNCHCTL_ON_LINUX=1`, and is skipped without it.

use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use tartan_testkit::EmulatorHandle;

struct Fixture {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    tart_home: PathBuf,
    kubeconfig: PathBuf,
}

const LOCAL_IMAGE: &str = "sequoia-base";

impl Fixture {
    fn new(emu: &EmulatorHandle) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        let tart_home = root.join("tart");
        fs::create_dir_all(&tart_home).unwrap();
        let cloned = Command::new(tartan_testkit::tart_double())
            .args(["clone", "ghcr.io/cirruslabs/macos-sequoia-base:latest", LOCAL_IMAGE])
            .env("TART_HOME", &tart_home)
            .env("TART_DOUBLE_DISK_SIZE_GB", "1")
            .output()
            .unwrap();
        assert!(cloned.status.success(), "{cloned:?}");
        let kubeconfig = root.join("kubeconfig");
        emu.write_kubeconfig(&kubeconfig).unwrap();
        Fixture {
            _tmp: tmp,
            root,
            tart_home,
            kubeconfig,
        }
    }

    fn state_dir(&self) -> PathBuf {
        self.root.join("state")
    }

    /// A config that passes, with `extra` appended (TOML after the top-level keys).
    fn config(&self, top: &str, extra: &str) -> PathBuf {
        let text = format!(
            "agent_id = \"mac-1\"\nstate_dir = {:?}\nnamespaces = [\"default\"]\nlease_namespace = \"default\"\n\
             tart = {:?}\ntart_home = {:?}\nkubeconfig = {:?}\nlocal_images = [{LOCAL_IMAGE:?}]\n{top}\n\
             [disk]\nmin_free_gib = 0\n[timing]\napi_timeout = \"3s\"\n{extra}",
            self.state_dir(),
            tartan_testkit::tart_double(),
            self.tart_home,
            self.kubeconfig,
        );
        let path = self.root.join("agent.toml");
        fs::write(&path, text).unwrap();
        path
    }

    /// Runs `doctor --config CONFIG --json` with `env`; its exit code and the checks by name.
    fn doctor(&self, config: &Path, env: &[(&str, &str)]) -> (i32, Vec<Value>) {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tartan-agent"));
        cmd.args(["doctor", "--json", "--config"]).arg(config);
        cmd.env_remove("TARTAN_ALLOW_LAUNCHCTL_ON_LINUX");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let report: Value = serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("{e}: stdout {stdout}, stderr {}", String::from_utf8_lossy(&out.stderr)));
        let code = out.status.code().unwrap();
        assert_eq!(report["ok"], code == 0, "{report}");
        (code, report["checks"].as_array().unwrap().clone())
    }
}

fn check<'a>(checks: &'a [Value], name: &str) -> &'a Value {
    checks
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name:?} in {checks:#?}"))
}

/// Asserts that exactly the checks `failed` failed, each naming `needle` in its detail and with a fix.
fn assert_fails(code: i32, checks: &[Value], failed: &[(&str, &str)]) {
    assert_eq!(code, 1, "{checks:#?}");
    let got: Vec<&str> = checks
        .iter()
        .filter(|c| c["verdict"] == "fail")
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    let want: Vec<&str> = failed.iter().map(|(n, _)| *n).collect();
    assert_eq!(got, want, "{checks:#?}");
    for (name, needle) in failed {
        let c = check(checks, name);
        assert!(c["detail"].as_str().unwrap().contains(needle), "{needle:?} not in {c}");
        assert!(c["fix"].as_str().is_some_and(|f| !f.is_empty()), "{c}");
    }
}

async fn emulator() -> EmulatorHandle {
    tartan_testkit::start(tartan_testkit::Options::default())
        .await
        .expect("emulator starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_mac_passes_every_check() {
    let emu = emulator().await;
    let fx = Fixture::new(&emu);
    let config = fx.config("", "");
    let (code, checks) = fx.doctor(&config, &[]);
    assert_eq!(code, 0, "{checks:#?}");
    let names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "config",
            "tart",
            "images",
            "disk state_dir",
            "disk tart_home",
            "journal writable",
            "journal replays",
            "watchdog deadlines",
            "open files",
            "LaunchAgents",
            "API server",
            "clock",
            "Lease",
            "RBAC",
        ]
    );
    assert!(
        check(&checks, "tart")["detail"]
            .as_str()
            .unwrap()
            .contains("version tart-double")
    );
    assert_eq!(check(&checks, "LaunchAgents")["verdict"], "skip");
    // The emulator does no authorization (a real API server is in agent/tests/rbac_real.rs).
    assert_eq!(check(&checks, "RBAC")["verdict"], "skip");
    assert!(
        check(&checks, "Lease")["detail"]
            .as_str()
            .unwrap()
            .contains("default/tartan-agent-mac-1 readable, not created yet")
    );
    for c in &checks {
        if c["name"] != "LaunchAgents" && c["name"] != "RBAC" {
            assert_eq!(c["verdict"], "pass", "{c}");
        }
    }
    // Nothing left behind by the write probes, and no state folder made.
    assert!(!fx.state_dir().exists());

    // The text form: one line per check, the last one the summary.
    let out = Command::new(env!("CARGO_BIN_EXE_tartan-agent"))
        .args(["doctor", "--config"])
        .arg(&config)
        .env_remove("TARTAN_ALLOW_LAUNCHCTL_ON_LINUX")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("✓ config: "), "{text}");
    assert!(text.ends_with("all checks passed\n"), "{text}");
    assert_eq!(text.lines().count(), names.len() + 1, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_agents_journal_and_lease_are_read() {
    let emu = emulator().await;
    let fx = Fixture::new(&emu);
    let config = fx.config("", "");
    // A journal written by the agent's own code, and its Lease in the cluster.
    {
        let state = fx.state_dir();
        fs::create_dir_all(&state).unwrap();
        let lock = tartan_agent::lock::StateLock::acquire(&state).unwrap();
        let (_journal, replay) =
            tartan_agent::journal::Journal::open(&lock, tartan_agent::journal::JournalOptions::default()).unwrap();
        assert!(replay.records.is_empty());
    }
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> = kube::Api::namespaced(emu.client(), "default");
    leases
        .create(
            &kube::api::PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "metadata": {"name": "tartan-agent-mac-1"},
                "spec": {"holderIdentity": "mac-1", "renewTime": "2026-10-05T02:00:00.000000Z"}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let (code, checks) = fx.doctor(&config, &[]);
    assert_eq!(code, 0, "{checks:#?}");
    assert!(
        check(&checks, "Lease")["detail"]
            .as_str()
            .unwrap()
            .contains("readable (holder mac-1, renewed 2026-10-05T02:00:00Z)"),
        "{checks:#?}"
    );
    assert!(
        check(&checks, "journal replays")["detail"]
            .as_str()
            .unwrap()
            .contains("0 record(s) read cleanly")
    );
    assert!(
        check(&checks, "journal writable")["detail"]
            .as_str()
            .unwrap()
            .starts_with("wrote and fsynced a file in ")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_broken_setup_fails_its_own_check() {
    let emu = emulator().await;
    let fx = Fixture::new(&emu);

    // The config does not parse: one failure, everything else skipped.
    let config = fx.root.join("agent.toml");
    fs::write(&config, "agent_id = \n").unwrap();
    let (code, checks) = fx.doctor(&config, &[]);
    assert_fails(code, &checks, &[("config", "agent.toml")]);
    assert_eq!(checks.len(), 2, "{checks:#?}");

    // tart missing, and a tart that fails.
    let config = fx.config("", "");
    let text = fs::read_to_string(&config).unwrap();
    let double = format!("{:?}", tartan_testkit::tart_double());
    fs::write(&config, text.replace(&double, "\"/nonexistent/tart\"")).unwrap();
    let (code, checks) = fx.doctor(&config, &[]);
    assert_fails(code, &checks, &[("tart", "cannot run `/nonexistent/tart --version`")]);
    assert_eq!(check(&checks, "images")["verdict"], "skip");
    let failing = fx.root.join("failing-tart");
    executable(&failing, "#!/bin/sh\necho 'dyld: Library not loaded' >&2\nexit 1\n");
    fs::write(&config, text.replace(&double, &format!("{failing:?}"))).unwrap();
    let (code, checks) = fx.doctor(&config, &[]);
    assert_fails(code, &checks, &[("tart", "Library not loaded")]);

    // A configured local image tart does not have.
    let config = fx.config("", "");
    let text = fs::read_to_string(&config).unwrap();
    fs::write(
        &config,
        text.replace(
            &format!("local_images = [{LOCAL_IMAGE:?}]"),
            &format!("local_images = [{LOCAL_IMAGE:?}, \"sonoma-gone\"]"),
        ),
    )
    .unwrap();
    let (code, checks) = fx.doctor(&config, &[]);
    assert_fails(code, &checks, &[("images", "sonoma-gone")]);

    // The disk floor above what the filesystems have (both are the same temp filesystem).
    let config = fx.config("", "");
    let text = fs::read_to_string(&config).unwrap();
    fs::write(&config, text.replace("min_free_gib = 0", "min_free_gib = 1000000")).unwrap();
    let (code, checks) = fx.doctor(&config, &[]);
    assert_fails(
        code,
        &checks,
        &[
            ("disk state_dir", "below [disk] min_free_gib"),
            ("disk tart_home", "below [disk] min_free_gib"),
        ],
    );

    // The journal's folder is a file: neither written nor replayed.
    let config = fx.config("", "");
    fs::create_dir_all(fx.state_dir()).unwrap();
    fs::write(fx.state_dir().join("journal"), "not a folder").unwrap();
    let (code, checks) = fx.doctor(&config, &[]);
    assert_fails(
        code,
        &checks,
        &[("journal writable", "not a directory"), ("journal replays", "journal")],
    );
    fs::remove_file(fx.state_dir().join("journal")).unwrap();

    // A journal file of a newer format (as a downgraded agent finds it): refused, as the agent would.
    let journal = fx.state_dir().join("journal");
    fs::create_dir_all(&journal).unwrap();
    let mut header = Vec::new();
    header.extend_from_slice(b"TRTNJRNL");
    header.extend_from_slice(&2u32.to_le_bytes());
    header.extend_from_slice(&1u32.to_le_bytes());
    header.extend_from_slice(&1u64.to_le_bytes());
    let crc = crc32fast::hash(&header);
    header.extend_from_slice(&crc.to_le_bytes());
    header.extend_from_slice(&[0; 4]);
    fs::write(journal.join(format!("{:020}.journal", 1)), header).unwrap();
    let (code, checks) = fx.doctor(&config, &[]);
    assert_fails(code, &checks, &[("journal replays", "newer than version 1")]);
    fs::remove_dir_all(&journal).unwrap();

    // The watchdog's deadline folder is a file.
    fs::write(fx.state_dir().join("deadlines"), "").unwrap();
    let (code, checks) = fx.doctor(&config, &[]);
    assert_fails(code, &checks, &[("watchdog deadlines", "not a directory")]);
    fs::remove_file(fx.state_dir().join("deadlines")).unwrap();

    // The API server unreachable: a port nobody listens on (bounded by api_timeout).
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let elsewhere = fx.root.join("kubeconfig-elsewhere");
    tartan_testkit::emulator::write_kubeconfig(&format!("http://127.0.0.1:{port}"), &elsewhere).unwrap();
    let config = fx.config("", "");
    let text = fs::read_to_string(&config).unwrap();
    fs::write(
        &config,
        text.replace(&format!("{:?}", fx.kubeconfig), &format!("{elsewhere:?}")),
    )
    .unwrap();
    let started = std::time::Instant::now();
    let (code, checks) = fx.doctor(&config, &[]);
    assert_fails(code, &checks, &[("API server", &format!("127.0.0.1:{port}"))]);
    assert_eq!(check(&checks, "clock")["verdict"], "skip");
    assert_eq!(check(&checks, "Lease")["verdict"], "skip");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );

    // An API server that does not answer in time (the emulator holding every request).
    let config = fx.config("", "");
    emu.set_latency(std::time::Duration::from_secs(10));
    let (code, checks) = fx.doctor(&config, &[]);
    emu.set_latency(std::time::Duration::ZERO);
    assert_fails(code, &checks, &[("API server", "no answer within 3s")]);
}

const FAKE_LAUNCHCTL: &str = r#"#!/bin/sh
case "$1" in
print)
    label="${2##*/}"
    if [ -f "$FAKE_DIR/print.$label" ]; then cat "$FAKE_DIR/print.$label"; exit 0; fi
    echo "Could not find service \"$label\" in domain for user gui: 501" >&2
    exit 113 ;;
esac
exit 64
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_agents_not_loaded_or_not_running_fail() {
    let emu = emulator().await;
    let fx = Fixture::new(&emu);
    let config = fx.config("", "");
    let fake = fx.root.join("fake");
    let home = fx.root.join("home");
    fs::create_dir_all(&fake).unwrap();
    fs::create_dir_all(&home).unwrap();
    let launchctl = fake.join("launchctl");
    executable(&launchctl, FAKE_LAUNCHCTL);
    let env = [
        ("TARTAN_ALLOW_LAUNCHCTL_ON_LINUX", "1"),
        ("TARTAN_LAUNCHCTL", launchctl.to_str().unwrap()),
        ("FAKE_DIR", fake.to_str().unwrap()),
        ("HOME", home.to_str().unwrap()),
    ];
    let running = |label: &str| {
        format!("gui/501/{label} = {{\n\tstate = running\n\tpid = 77\n\tlast exit code = (never exited)\n}}\n")
    };
    fs::write(fake.join("print.dev.tartan.agent"), running("dev.tartan.agent")).unwrap();
    let (code, checks) = fx.doctor(&config, &env);
    assert_fails(code, &checks, &[("LaunchAgent dev.tartan.watchdog", "not loaded")]);
    assert!(
        check(&checks, "LaunchAgent dev.tartan.agent")["detail"]
            .as_str()
            .unwrap()
            .contains("state running, pid 77")
    );
    fs::write(
        fake.join("print.dev.tartan.watchdog"),
        "gui/501/dev.tartan.watchdog = {\n\tstate = waiting\n\tpid = 0\n\tlast exit code = 78\n}\n",
    )
    .unwrap();
    let (code, checks) = fx.doctor(&config, &env);
    assert_fails(code, &checks, &[("LaunchAgent dev.tartan.watchdog", "state waiting")]);
    fs::write(fake.join("print.dev.tartan.watchdog"), running("dev.tartan.watchdog")).unwrap();
    let (code, checks) = fx.doctor(&config, &env);
    assert_eq!(code, 0, "{checks:#?}");
}

fn executable(path: &Path, text: &str) {
    tartan_testkit::write_program(path, text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn softnet_is_checked_only_when_configured_and_as_tart_checks_it() {
    let emu = emulator().await;
    let fx = Fixture::new(&emu);
    let config = fx.config("network = \"softnet\"", "");
    let bin = fx.root.join("bin");
    fs::create_dir_all(&bin).unwrap();
    let path = bin.to_str().unwrap().to_string();
    let env = [("PATH", path.as_str())];

    let (code, checks) = fx.doctor(&config, &env);
    assert_fails(code, &checks, &[("softnet", "no softnet on PATH")]);

    // A softnet without the SUID bit, and no sudo.
    let softnet = bin.join("softnet");
    executable(&softnet, "#!/bin/sh\nexit 0\n");
    let (code, checks) = fx.doctor(&config, &env);
    assert_fails(code, &checks, &[("softnet", "no sudo on PATH")]);

    // A sudo that lets it run without a password (a stand-in running its arguments).
    executable(
        &bin.join("sudo"),
        "#!/bin/sh\n[ \"$1\" = --non-interactive ] || exit 1\nshift\nexec \"$@\"\n",
    );
    let (code, checks) = fx.doctor(&config, &env);
    assert_eq!(code, 0, "{checks:#?}");
    assert!(
        check(&checks, "softnet")["detail"]
            .as_str()
            .unwrap()
            .contains("through sudo")
    );
    fs::remove_file(bin.join("sudo")).unwrap();

    // Root's with the SUID bit (only a test running as root can make that file).
    if nix::unistd::geteuid().is_root() {
        let mut perms = fs::metadata(&softnet).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o4755);
        fs::set_permissions(&softnet, perms).unwrap();
        let (code, checks) = fx.doctor(&config, &env);
        assert_eq!(code, 0, "{checks:#?}");
        assert!(check(&checks, "softnet")["detail"].as_str().unwrap().contains("SUID"));
    } else {
        eprintln!("not root: the SUID case is covered by the unit table only");
    }

    // Not configured: no softnet line at all.
    let config = fx.config("", "");
    let (code, checks) = fx.doctor(&config, &env);
    assert_eq!(code, 0, "{checks:#?}");
    assert!(checks.iter().all(|c| c["name"] != "softnet"));
}

/// Adversary finding: every other check of doctor is bounded (tart 30 s, the API server
/// `timing.api_timeout`), but the LaunchAgents check runs `launchctl print` with no limit (and
/// on the async runtime's thread): a launchctl that does not answer (launchd wedged, as it is
/// when a Mac's login session is stuck) hangs doctor for ever, so the operator never sees the
/// report. The fake launchctl here never answers; doctor should say so and finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launchctl_that_never_answers_does_not_hang_doctor() {
    let emu = emulator().await;
    let fx = Fixture::new(&emu);
    let config = fx.config("", "");
    let fake = fx.root.join("fake");
    let home = fx.root.join("home");
    fs::create_dir_all(&fake).unwrap();
    fs::create_dir_all(&home).unwrap();
    let launchctl = fake.join("launchctl");
    executable(&launchctl, "#!/bin/sh\nexec sleep 90\n");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tartan-agent"))
        .args(["doctor", "--json", "--config"])
        .arg(&config)
        .env("TARTAN_ALLOW_LAUNCHCTL_ON_LINUX", "1")
        .env("TARTAN_LAUNCHCTL", &launchctl)
        .env("HOME", &home)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Well past the tart (30 s) and API (3 s) limits together.
    let limit = std::time::Duration::from_secs(60);
    let start = std::time::Instant::now();
    let exited = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if start.elapsed() > limit {
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    if exited.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    assert!(
        exited.is_some(),
        "doctor still runs after {limit:?}: a launchctl that never answers hangs it"
    );
}

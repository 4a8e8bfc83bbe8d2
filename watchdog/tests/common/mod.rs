//! Test support: a tart home served by the real `tart-double`, a state directory, VMs with running
//! `tart-double run` processes, deadline files, and the watchdog either in-process or as a real
//! `tartan-agent watchdog` process. Everything started here is killed and reaped on drop.

#![allow(dead_code)] // each test binary uses a different part of this module

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tartan_api::deadline::{DEADLINES_DIR, DeadlineFile, write_deadline_file};
use tartan_watchdog::{Config, Line, RECORD_FILE, read_lines};

/// The source image every test VM is cloned from (the double synthesises it).
const IMAGE: &str = "ghcr.io/cirruslabs/macos-sequoia-base:latest";

pub use tartan_testkit::{tart_double, wait_for, workspace_bin};

pub fn tartan_agent() -> PathBuf {
    workspace_bin("tartan-agent", "tartan-agent")
}

pub fn secs_f(s: f64) -> SignedDuration {
    SignedDuration::from_secs_f64(s)
}

/// `ts + d`.
pub fn plus(ts: Timestamp, d: SignedDuration) -> Timestamp {
    ts.checked_add(d).unwrap()
}

/// A line's `time` as a timestamp.
pub fn time_of(line: &Line) -> Timestamp {
    line.time.parse().unwrap()
}

/// A tart home plus a state directory in one temp dir.
pub struct Host {
    _tmp: tempfile::TempDir,
    pub root: PathBuf,
    pub home: PathBuf,
    pub state: PathBuf,
    pub double: PathBuf,
    runs: HashMap<String, Child>,
    others: Vec<Child>,
}

impl Host {
    pub fn new() -> Host {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        let home = root.join("tart-home");
        let state = root.join("state");
        std::fs::create_dir_all(&home).unwrap();
        std::fs::create_dir_all(state.join(DEADLINES_DIR)).unwrap();
        Host {
            _tmp: tmp,
            root,
            home,
            state,
            double: tart_double(),
            runs: HashMap::new(),
            others: Vec::new(),
        }
    }

    /// The watchdog's configuration for this host: fast retries, the double as tart.
    pub fn config(&self, grace: SignedDuration) -> Config {
        let mut config = Config::new(&self.state);
        config.grace = grace;
        config.tart_program = self.double.clone();
        config.tart_home = Some(self.home.clone());
        config.retry_base = Duration::from_millis(200);
        config.retry_cap = Duration::from_millis(400);
        config
    }

    pub fn tart(&self, args: &[&str]) -> std::process::Output {
        Command::new(&self.double)
            .args(args)
            .env("TART_HOME", &self.home)
            .output()
            .unwrap()
    }

    pub fn clone_vm(&self, name: &str) {
        let out = self.tart(&["clone", IMAGE, name]);
        assert!(
            out.status.success(),
            "clone {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Clones `name` and starts `tart-double run` for it; returns once it holds the VM lock.
    pub async fn running_vm(&mut self, name: &str) -> u32 {
        self.clone_vm(name);
        let child = Command::new(&self.double)
            .args(["run", "--no-graphics", name])
            .env("TART_HOME", &self.home)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        self.runs.insert(name.to_string(), child);
        let (home, vm) = (self.home.clone(), name.to_string());
        wait_for(
            &format!("tart-double run {name} to hold the VM lock"),
            Duration::from_secs(10),
            || match tartan_tart::run_pid(&home, &vm) {
                Ok(Some(p)) if p.as_raw() as u32 == pid => Some(()),
                _ => None,
            },
        )
        .await;
        pid
    }

    /// Whether the `tart run` started for `name` is still running (reaps it if it exited).
    pub fn run_alive(&mut self, name: &str) -> bool {
        let child = self.runs.get_mut(name).expect("a run started by this host");
        child.try_wait().unwrap().is_none()
    }

    pub fn vm_exists(&self, name: &str) -> bool {
        tartan_tart::vm_dir(&self.home, name).exists()
    }

    pub fn deadlines(&self) -> PathBuf {
        self.state.join(DEADLINES_DIR)
    }

    pub fn deadline_file(&self, vm: &str) -> PathBuf {
        self.deadlines().join(format!("{vm}.json"))
    }

    /// Writes `vm`'s deadline file as the agent does.
    pub fn write_deadline(&self, vm: &str, deadline: Timestamp) {
        let file = DeadlineFile {
            vm: vm.to_string(),
            namespace: "ci".into(),
            name: format!("build-{vm}"),
            uid: "00000000-0000-0000-0000-000000000001".into(),
            attempt: 1,
            deadline,
            agent: "test-agent".into(),
            written_at: Timestamp::now(),
        };
        write_deadline_file(&self.deadlines(), &file).unwrap();
    }

    /// Writes a file into the deadline folder verbatim (for files the agent would never write).
    pub fn write_raw(&self, file_name: &str, contents: &str) {
        std::fs::write(self.deadlines().join(file_name), contents).unwrap();
    }

    /// Sets the double's fault file (`{"vms": {...}}`); `None` lifts every fault.
    pub fn faults(&self, json: Option<&str>) {
        let path = self.home.join("double-faults.json");
        match json {
            Some(json) => {
                let tmp = self.home.join(".faults.tmp");
                std::fs::write(&tmp, json).unwrap();
                std::fs::rename(&tmp, &path).unwrap();
            }
            None => std::fs::remove_file(&path).unwrap(),
        }
    }

    pub fn record_path(&self) -> PathBuf {
        self.state.join(RECORD_FILE)
    }

    pub fn lines(&self) -> Vec<Line> {
        read_lines(&self.record_path()).unwrap()
    }

    pub fn lines_for(&self, vm: &str) -> Vec<Line> {
        self.lines().into_iter().filter(|l| l.vm == vm).collect()
    }

    /// Waits until the record has a line for `vm` with `action`, and returns the first such line.
    pub async fn wait_line(&self, vm: &str, action: &str, limit: Duration) -> Line {
        wait_for(&format!("a {action:?} line for {vm}"), limit, || {
            self.lines()
                .into_iter()
                .find(|l| l.vm == vm && l.action.as_str() == action)
        })
        .await
    }

    /// Starts `tartan-agent watchdog` for this host as a real process (stderr to `<root>/<log>`).
    pub fn spawn_watchdog_process(&mut self, extra: &[&str], log: &str) -> u32 {
        let log = File::create(self.root.join(log)).unwrap();
        let child = Command::new(tartan_agent())
            .arg("watchdog")
            .arg("--state-dir")
            .arg(&self.state)
            .arg("--tart")
            .arg(&self.double)
            .args(extra)
            .env("TART_HOME", &self.home)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let pid = child.id();
        self.others.push(child);
        pid
    }

    /// Starts any helper process that must be cleaned up with the host.
    pub fn spawn_other(&mut self, cmd: &mut Command) -> u32 {
        let child = cmd.spawn().unwrap();
        let pid = child.id();
        self.others.push(child);
        pid
    }

    /// SIGKILLs a process this host started and reaps it.
    pub fn kill(&mut self, pid: u32) {
        if let Some(child) = self.others.iter_mut().find(|c| c.id() == pid) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends SIGTERM to a process this host started and waits (failing the test after `limit`)
    /// for it to exit; returns its exit status.
    pub async fn terminate(&mut self, pid: u32, limit: Duration) -> std::process::ExitStatus {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let child = self
            .others
            .iter_mut()
            .find(|c| c.id() == pid)
            .expect("a process started by this host");
        wait_for(&format!("process {pid} to exit after SIGTERM"), limit, || {
            child.try_wait().unwrap()
        })
        .await
    }

    /// Waits (bounded) until the watchdog process has opened its record, i.e. it is running.
    pub async fn wait_watchdog_started(&self) {
        let path = self.record_path();
        wait_for("the watchdog to create its record", Duration::from_secs(30), || {
            path.exists().then_some(())
        })
        .await;
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        for child in self.runs.values_mut().chain(self.others.iter_mut()) {
            // SIGCONT first, in case a test left it stopped; SIGKILL works either way.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGCONT,
            );
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The watchdog running in-process on a tokio task; stopped (and awaited) by [`InProcess::stop`].
pub struct InProcess {
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    handle: Option<tokio::task::JoinHandle<Result<(), tartan_watchdog::Error>>>,
}

impl InProcess {
    pub fn start(config: Config) -> InProcess {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let handle = tokio::spawn(tartan_watchdog::run(config, async move {
            let _ = rx.await;
        }));
        InProcess {
            shutdown: Some(tx),
            handle: Some(handle),
        }
    }

    pub async fn stop(mut self) -> Result<(), tartan_watchdog::Error> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let handle = self.handle.take().unwrap();
        tokio::time::timeout(Duration::from_secs(30), handle)
            .await
            .expect("the watchdog stops within 30s of shutdown")
            .expect("the watchdog task did not panic")
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(handle) = &self.handle {
            handle.abort();
        }
    }
}

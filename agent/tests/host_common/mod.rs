//! Test support for the host executor: a `tart-double` home, a state directory, an in-memory
//! journal behind `AttemptHooks`, and a guard that kills every `tart run` left in the home.

#![allow(dead_code)] // each test binary uses a different part of this module

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tart_double::Faults;
use tartan_agent::host::{AttemptExecutor, AttemptHooks, CancelSignal, ExecutorConfig, HostAttempt, UploadPolicy};
use tartan_agent::machine::{Action, Attempt, Event, Transition};
use tartan_agent::record::{BuildRef, Record};
use tartan_api::{AttemptState, MacBuildSpec, Step};
use tartan_tart::{Tart, Timeouts};

pub const IMAGE: &str = "ghcr.io/cirruslabs/macos-sequoia-base:latest";

/// A tart home and a state directory; on drop, SIGKILLs any `tart run` still holding a VM lock.
pub struct Rig {
    pub home: tempfile::TempDir,
    pub state: tempfile::TempDir,
    pub tart: Tart,
}

impl Rig {
    pub fn new() -> Rig {
        let home = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let timeouts = Timeouts {
            clone: Duration::from_secs(120),
            set: Duration::from_secs(20),
            delete: Duration::from_secs(20),
            list: Duration::from_secs(20),
            get: Duration::from_secs(20),
            ip_margin: Duration::from_secs(5),
            stop_margin: Duration::from_secs(10),
        };
        let tart = Tart::new(tartan_testkit::tart_double(), Some(home.path().to_path_buf())).with_timeouts(timeouts);
        Rig { home, state, tart }
    }

    pub fn set_faults(&self, f: &Faults) {
        f.store(self.home.path()).unwrap();
    }

    pub fn vm_dir(&self, vm: &str) -> PathBuf {
        self.home.path().join("vms").join(vm)
    }

    /// VM folders in the home.
    pub fn vms(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.home.path().join("vms"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Entries in the home's tmp/ (in-flight or killed clones).
    pub fn tmp_entries(&self) -> Vec<String> {
        std::fs::read_dir(self.home.path().join("tmp"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn config(&self) -> ExecutorConfig {
        let mut cfg = ExecutorConfig::new(self.state.path());
        cfg.boot_timeout = Duration::from_secs(30);
        cfg.probe_interval = Duration::from_millis(100);
        cfg.probe_timeout = Duration::from_secs(5);
        cfg.stop_timeout = Duration::from_secs(5);
        cfg.step_no_pid_limit = Duration::from_secs(2);
        // Tests publish into their own temp folders; the state dir and tart home stay protected.
        cfg.artifacts.allowed_file_roots = vec![std::env::temp_dir()];
        cfg.upload = UploadPolicy {
            attempts: 3,
            backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(400),
            attempt_timeout: Duration::from_secs(30),
        };
        cfg
    }

    pub fn deadline_file(&self, vm: &str) -> PathBuf {
        self.state.path().join("deadlines").join(format!("{vm}.json"))
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        for vm in self.vms() {
            if let Ok(Some(pid)) = tartan_tart::run_pid(self.home.path(), &vm) {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
    }
}

pub fn build(name: &str) -> BuildRef {
    BuildRef {
        namespace: "ci".into(),
        name: name.into(),
        uid: format!("uid-{name}"),
    }
}

pub fn step(name: &str, script: &str) -> Step {
    Step {
        name: name.into(),
        run: vec!["sh".into(), "-c".into(), script.into()],
        timeout_seconds: None,
    }
}

pub fn spec(steps: Vec<Step>) -> MacBuildSpec {
    MacBuildSpec {
        timeout_seconds: 600,
        ..MacBuildSpec::new(IMAGE, steps)
    }
}

/// A fresh attempt (Requested) and its executor; the deadline comes from the admission.
pub fn attempt(rig: &Rig, name: &str, spec: MacBuildSpec, cancel: CancelSignal) -> (Attempt, AttemptExecutor) {
    attempt_with(rig, name, spec, cancel, rig.config())
}

/// [`attempt`] with an executor config of the caller's.
pub fn attempt_with(
    rig: &Rig,
    name: &str,
    spec: MacBuildSpec,
    cancel: CancelSignal,
    cfg: ExecutorConfig,
) -> (Attempt, AttemptExecutor) {
    let b = build(name);
    let vm = tartan_api::vm_name(&b.namespace, &b.name, &b.uid, 1);
    let a = Attempt::new(b.clone(), 1, vm.clone(), 2);
    let host = HostAttempt {
        build: b,
        attempt: 1,
        vm,
        spec,
        deadline: Timestamp::now() + SignedDuration::from_secs(3600),
        agent: "mac-test".into(),
    };
    (a, AttemptExecutor::new(host, rig.tart.clone(), cfg, cancel))
}

pub fn admit(timeout_secs: i64) -> Event {
    Event::Admit {
        slot: 0,
        slots: 1,
        timeout: SignedDuration::from_secs(timeout_secs),
    }
}

/// The journal in memory, shared with the test; `on_record` runs after each record (e.g. to
/// check that no side effect preceded it, or to inject a fault at a phase).
#[derive(Clone)]
pub struct MemJournal {
    pub records: Arc<Mutex<Vec<Record>>>,
    pub other_actions: Arc<Mutex<Vec<Action>>>,
    #[allow(clippy::type_complexity)]
    pub on_record: Arc<dyn Fn(&Record) + Send + Sync>,
    /// Once this many records are written, every further write fails (a journal gone bad).
    pub fail_after: Option<usize>,
    /// The step logs' location the executor reported with each record (`status.logs`).
    pub logs: Arc<Mutex<Vec<Option<String>>>>,
}

impl MemJournal {
    pub fn new() -> MemJournal {
        MemJournal {
            records: Default::default(),
            other_actions: Default::default(),
            on_record: Arc::new(|_| {}),
            fail_after: None,
            logs: Default::default(),
        }
    }

    pub fn with_hook(f: impl Fn(&Record) + Send + Sync + 'static) -> MemJournal {
        MemJournal {
            on_record: Arc::new(f),
            ..MemJournal::new()
        }
    }

    pub fn lines(&self) -> Vec<String> {
        self.records.lock().unwrap().iter().map(|r| r.to_string()).collect()
    }

    pub fn states(&self) -> Vec<AttemptState> {
        self.records.lock().unwrap().iter().map(|r| r.to).collect()
    }

    pub fn last(&self) -> Record {
        self.records.lock().unwrap().last().cloned().expect("a record")
    }

    pub fn has_state(&self, s: AttemptState) -> bool {
        self.records.lock().unwrap().iter().any(|r| r.to == s)
    }
}

impl AttemptHooks for MemJournal {
    fn journal(
        &mut self,
        attempt: &Attempt,
        t: &Transition,
        _results: &tartan_api::BuildResults,
        logs: Option<&str>,
    ) -> impl std::future::Future<Output = Result<Record, String>> + Send {
        let mut records = self.records.lock().unwrap();
        if self.fail_after.is_some_and(|n| records.len() >= n) {
            return futures::future::Either::Left(async {
                Err("journal write failed: No space left on device".to_string())
            });
        }
        let r = attempt.record(t, records.len() as u64 + 1);
        records.push(r.clone());
        self.logs.lock().unwrap().push(logs.map(str::to_string));
        drop(records);
        (self.on_record)(&r);
        futures::future::Either::Right(async move { Ok(r) })
    }

    fn act(&mut self, _attempt: &Attempt, action: &Action) -> impl std::future::Future<Output = Option<Event>> + Send {
        self.other_actions.lock().unwrap().push(action.clone());
        async { None }
    }
}

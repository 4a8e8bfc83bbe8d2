//! The tart CLI contract (docs/tart-contract.md), asserted through the driver and through raw invocations.
//!
//! By default these run against `tart-double` with a fresh temporary `TART_HOME` per test. With
//! `TARTAN_REAL_TART=1` (on a Mac) they run against the real `tart` on PATH (or `TARTAN_REAL_TART_PROGRAM`) and its
//! default home, cloning `TARTAN_REAL_TART_IMAGE`; tests that need the double's fault injection or host-side
//! details are skipped there (they say so on stderr).
//!
//! Every process a test starts is owned by a guard that SIGKILLs and reaps it, also when the test panics.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::sys::wait::waitpid;
use tart_double::{Fault, Faults};
use tartan_tart::{
    ExecOptions, Pid, RunOptions, RunningVm, SetOptions, Tart, TartError, Timeouts, VmState, process_alive,
};

const REGISTRY_IMAGE: &str = "ghcr.io/cirruslabs/macos-sequoia-base:latest";
static SEQ: AtomicUsize = AtomicUsize::new(0);

struct Harness {
    _tmp: tempfile::TempDir,
    /// A scratch folder for logs (not tart's home).
    scratch: PathBuf,
    home: PathBuf,
    program: PathBuf,
    real: bool,
    image: String,
    created: std::cell::RefCell<Vec<String>>,
}

impl Harness {
    fn new() -> Self {
        let tmp = tempfile::tempdir().expect("create a temp dir");
        let scratch = tmp.path().join("scratch");
        std::fs::create_dir(&scratch).expect("create scratch dir");
        if std::env::var("TARTAN_REAL_TART").as_deref() == Ok("1") {
            let program = std::env::var_os("TARTAN_REAL_TART_PROGRAM")
                .map(PathBuf::from)
                .unwrap_or("tart".into());
            let image = std::env::var("TARTAN_REAL_TART_IMAGE").expect("TARTAN_REAL_TART_IMAGE must name an image");
            let home = tartan_tart::tart_home().expect("tart home");
            Harness {
                _tmp: tmp,
                scratch,
                home,
                program,
                real: true,
                image,
                created: Default::default(),
            }
        } else {
            let home = tmp.path().join("tart-home");
            Harness {
                _tmp: tmp,
                scratch,
                home,
                program: PathBuf::from(env!("CARGO_BIN_EXE_tart-double")),
                real: false,
                image: REGISTRY_IMAGE.to_string(),
                created: Default::default(),
            }
        }
    }

    /// Skips a test that needs the double; returns true if the caller should return.
    fn double_only(&self, why: &str) -> bool {
        if self.real {
            eprintln!("skipped against real tart: {why}");
        }
        self.real
    }

    fn tart(&self) -> Tart {
        Tart::new(&self.program, (!self.real).then(|| self.home.clone()))
    }

    /// A VM name: as given for the double; unique (and cleaned up) for real tart.
    fn vm(&self, base: &str) -> String {
        let name = if self.real {
            format!(
                "{base}-tartan-test-{}-{}",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::SeqCst)
            )
        } else {
            base.to_string()
        };
        self.created.borrow_mut().push(name.clone());
        name
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.args(args).stdin(Stdio::null());
        if !self.real {
            cmd.env("TART_HOME", &self.home);
        }
        cmd
    }

    /// Runs tart to completion (bounded: a hang fails the test and the process is killed).
    fn raw(&self, args: &[&str]) -> Raw {
        let child = self
            .command(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn tart");
        let mut guard = ChildGuard(Some(child));
        let deadline = Instant::now() + Duration::from_secs(if self.real { 900 } else { 60 });
        loop {
            let child = guard.0.as_mut().expect("child");
            if child.try_wait().expect("poll tart").is_some() {
                let out: Output = guard
                    .0
                    .take()
                    .expect("child")
                    .wait_with_output()
                    .expect("collect output");
                return Raw {
                    code: out.status.code(),
                    stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                    stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
                };
            }
            assert!(Instant::now() < deadline, "tart {args:?} hung");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts tart in the background, owned by a guard.
    fn spawn(&self, args: &[&str], log: &Path) -> ChildGuard {
        let out = std::fs::File::create(log).expect("create log");
        let err = out.try_clone().expect("dup log");
        ChildGuard(Some(
            self.command(args).stdout(out).stderr(err).spawn().expect("spawn tart"),
        ))
    }

    fn clone_image(&self, name: &str) {
        let r = self.raw(&["clone", &self.image, name]);
        assert_eq!(r.code, Some(0), "clone {} {name}: {r:?}", self.image);
    }

    fn set_faults(&self, faults: &Faults) {
        faults.store(&self.home).expect("write the fault file");
    }

    fn vm_dir(&self, name: &str) -> PathBuf {
        tartan_tart::vm_dir(&self.home, name)
    }

    fn list_json(&self) -> Vec<serde_json::Value> {
        let r = self.raw(&["list", "--format", "json"]);
        assert_eq!(r.code, Some(0), "{r:?}");
        serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("list JSON: {e}: {}", r.stdout))
    }

    fn listed(&self, name: &str) -> Option<serde_json::Value> {
        self.list_json().into_iter().find(|v| v["Name"] == name)
    }

    async fn start(&self, name: &str) -> VmGuard {
        let log = self.scratch.join(format!("{name}-run.log"));
        let mut vm = self
            .tart()
            .run(
                name,
                &RunOptions {
                    log_path: Some(log),
                    ..Default::default()
                },
            )
            .expect("spawn run");
        let guard_pid = vm.pid();
        vm.wait_until_running(Duration::from_secs(if self.real { 120 } else { 20 }))
            .await
            .expect("VM running");
        VmGuard {
            vm: Some(vm),
            pid: guard_pid,
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if !self.real {
            // Processes are owned by guards, except guest jobs a test left behind in a VM (its `run` may
            // have been killed at once); the temp home goes with `_tmp`.
            for name in self.created.borrow().iter() {
                if let Err(e) = tart_double::guests::sweep(&self.vm_dir(name), None) {
                    eprintln!("cleanup: {e}");
                }
            }
            return;
        }
        for name in self.created.borrow().iter() {
            let _ = Command::new(&self.program)
                .args(["stop", name, "--timeout", "5"])
                .status();
            let _ = Command::new(&self.program).args(["delete", name]).status();
        }
    }
}

#[derive(Debug)]
struct Raw {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Owns a std child: SIGKILL and reap on drop.
struct ChildGuard(Option<Child>);

impl ChildGuard {
    fn pid(&self) -> Pid {
        Pid::from_raw(self.0.as_ref().expect("child").id() as i32)
    }

    fn kill_and_wait(&mut self) -> std::process::ExitStatus {
        let mut child = self.0.take().expect("child");
        let _ = child.kill();
        child.wait().expect("reap child")
    }

    /// Waits (bounded) for the child to exit by itself.
    fn wait_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.0.as_mut().expect("child").try_wait().expect("poll child") {
                self.0 = None;
                return status;
            }
            assert!(Instant::now() < deadline, "child did not exit within {within:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Owns a `tart run` started through the driver: SIGKILL and reap on drop.
struct VmGuard {
    vm: Option<RunningVm>,
    pid: Pid,
}

impl VmGuard {
    fn vm(&mut self) -> &mut RunningVm {
        self.vm.as_mut().expect("vm")
    }
}

impl Drop for VmGuard {
    fn drop(&mut self) {
        if self.vm.take().is_some() {
            let _ = kill(self.pid, Signal::SIGKILL);
            let _ = waitpid(self.pid, None); // ECHILD if tokio reaped it first
        }
    }
}

/// Polls `cond` every 20 ms until it holds; fails the test after `within`.
fn wait_for(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for: {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn exec_opts(h: &Harness, name: &str, timeout: Duration) -> ExecOptions {
    ExecOptions::new(h.scratch.join(format!("{name}-exec.log")), timeout)
}

fn argv(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

// ------------------------------------------------------------------------------------------------------------

#[test]
fn running_vm_refuses_delete_until_its_run_is_killed() {
    let h = Harness::new();
    let vm = h.vm("mb-x");
    h.clone_image(&vm);
    let mut run = h.spawn(&["run", "--no-graphics", &vm], &h.scratch.join("run.log"));
    let run_pid = run.pid();
    wait_for("run holds the VM lock", Duration::from_secs(120), || {
        tartan_tart::run_pid(&h.home, &vm).unwrap() == Some(run_pid)
    });

    let r = h.raw(&["delete", &vm]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(r.stderr.contains(&format!("VM \"{vm}\" is running")), "{r:?}");
    let entry = h.listed(&vm).expect("VM listed");
    assert_eq!(entry["Running"], true, "{entry}");
    assert_eq!(entry["State"], "running", "{entry}");

    let status = run.kill_and_wait(); // kill -9
    assert!(!status.success());
    let entry = h.listed(&vm).expect("VM still listed after its run died");
    assert_eq!(entry["Running"], false, "{entry}");
    assert_eq!(entry["State"], "stopped", "{entry}");
    assert_eq!(tartan_tart::run_pid(&h.home, &vm).unwrap(), None);

    let r = h.raw(&["delete", &vm]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(!h.vm_dir(&vm).exists());
    let r = h.raw(&["delete", &vm]);
    assert_eq!(r.code, Some(2), "{r:?}");
    assert!(
        r.stderr.contains(&format!("the specified VM \"{vm}\" does not exist")),
        "{r:?}"
    );
}

#[tokio::test]
async fn driver_reports_the_same_story_with_typed_errors() {
    let h = Harness::new();
    let vm = h.vm("mb-d");
    let tart = h.tart();
    tart.clone_vm(&h.image, &vm).await.expect("clone");
    tart.set(
        &vm,
        &SetOptions {
            cpu: Some(4),
            memory_mb: Some(4096),
            random_mac: true,
        },
    )
    .await
    .expect("set");
    let mut guard = h.start(&vm).await;

    let err = tart.delete(&vm).await.expect_err("delete of a running VM");
    assert!(matches!(err, TartError::VmRunning { .. }), "{err}");
    let listed = tart.list().await.expect("list");
    let entry = listed.iter().find(|e| e.name == vm).expect("listed");
    assert!(
        entry.running && entry.state == VmState::Running && entry.is_local(),
        "{entry:?}"
    );
    let info = tart.get(&vm).await.expect("get");
    assert_eq!((info.cpu, info.memory, info.running), (4, 4096, true));
    let again = tart.run(&vm, &RunOptions::default()).expect("spawn second run");
    let mut again = VmGuard {
        pid: again.pid(),
        vm: Some(again),
    };
    let exit = again.vm().wait().await.expect("second run exits");
    // Real tart validates the VZ configuration first and may fail with "Failed to lock auxiliary storage", exit 1.
    let expected: &[i32] = if h.real { &[1, 2] } else { &[2] };
    assert!(exit.code.is_some_and(|c| expected.contains(&c)), "second run: {exit}");

    guard.vm().kill().await.expect("kill run");
    tart.delete(&vm).await.expect("delete stopped VM");
    let err = tart.delete(&vm).await.expect_err("second delete");
    assert!(err.is_vm_missing(), "{err}");
    let err = tart.get(&vm).await.expect_err("get of a deleted VM");
    assert!(err.is_vm_missing(), "{err}");
    let err = tart
        .stop(&vm, Duration::from_secs(1))
        .await
        .expect_err("stop of a deleted VM");
    assert!(err.is_vm_missing(), "{err}");
}

#[tokio::test]
async fn f_getlk_finds_the_run_pid_without_taking_the_lock() {
    let h = Harness::new();
    let vm = h.vm("mb-lock");
    h.clone_image(&vm);
    let guard = h.start(&vm).await;
    for _ in 0..20 {
        assert_eq!(tartan_tart::run_pid(&h.home, &vm).unwrap(), Some(guard.pid));
    }
    assert_eq!(h.tart().run_pid(&vm).unwrap(), Some(guard.pid));
    #[cfg(target_os = "linux")]
    {
        let me = std::process::id().to_string();
        let locks = std::fs::read_to_string("/proc/locks").expect("/proc/locks");
        assert!(
            !locks.lines().any(|l| l.split_whitespace().nth(4) == Some(me.as_str())),
            "this process holds a lock:\n{locks}"
        );
    }
    // The run still holds it: a second run is refused, and so is delete.
    let r = h.raw(&["run", "--no-graphics", &vm]);
    if !h.real {
        assert_eq!(r.code, Some(2), "{r:?}");
        assert!(r.stderr.contains(&format!("VM \"{vm}\" is already running!")), "{r:?}");
    }
    assert_ne!(r.code, Some(0), "a second run must be refused: {r:?}");
    assert_eq!(h.raw(&["delete", &vm]).code, Some(1));
    assert_eq!(tartan_tart::run_pid(&h.home, "no-such-vm").unwrap(), None);
}

#[tokio::test]
async fn stop_interrupts_the_run_which_exits_zero() {
    let h = Harness::new();
    let vm = h.vm("mb-stop");
    h.clone_image(&vm);
    let log = h.scratch.join("run.log");
    let mut run = h.spawn(&["run", "--no-graphics", &vm], &log);
    let pid = run.pid();
    wait_for("run holds the lock", Duration::from_secs(120), || {
        tartan_tart::run_pid(&h.home, &vm).unwrap() == Some(pid)
    });

    h.tart().stop(&vm, Duration::from_secs(20)).await.expect("stop");
    let status = run.wait_exit(Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "run after SIGINT: {status:?}");
    assert!(std::fs::read_to_string(&log).unwrap().contains("Stopping VM..."));
    assert_eq!(tartan_tart::run_pid(&h.home, &vm).unwrap(), None);

    let err = h
        .tart()
        .stop(&vm, Duration::from_secs(1))
        .await
        .expect_err("stop of a stopped VM");
    assert!(err.is_not_running(), "{err}");
    let r = h.raw(&["stop", &vm]);
    assert_eq!(r.code, Some(2), "{r:?}");
    assert!(r.stderr.contains(&format!("VM \"{vm}\" is not running")), "{r:?}");
}

#[tokio::test]
async fn sigusr2_is_a_guest_shutdown_and_sigterm_kills_at_once() {
    let h = Harness::new();
    let vm = h.vm("mb-sig");
    h.clone_image(&vm);
    let mut guard = h.start(&vm).await;
    assert!(guard.vm().signal(Signal::SIGUSR2).expect("SIGUSR2"));
    assert_eq!(guard.vm().wait().await.unwrap().code, Some(0));
    assert!(
        !guard.vm().signal(Signal::SIGINT).unwrap(),
        "an exited run is not signalled"
    );
    let mut guard = h.start(&vm).await;
    assert!(guard.vm().signal(Signal::SIGTERM).expect("SIGTERM"));
    assert_eq!(guard.vm().wait().await.unwrap().signal, Some(Signal::SIGTERM as i32));
    assert_eq!(tartan_tart::run_pid(&h.home, &vm).unwrap(), None);
}

#[tokio::test]
async fn exec_propagates_exit_codes_and_streams_output() {
    let h = Harness::new();
    let vm = h.vm("mb-exec");
    h.clone_image(&vm);
    let tart = h.tart();
    let mut guard = h.start(&vm).await;
    let opts = exec_opts(&h, &vm, Duration::from_secs(120));

    let out = tart
        .exec(
            &vm,
            &argv(&["sh", "-c", "echo to-stdout; echo to-stderr >&2; exit 7"]),
            &opts,
        )
        .await
        .unwrap();
    assert_eq!(out.exit_code, 7);
    assert!(
        out.tail.contains("to-stdout") && out.tail.contains("to-stderr"),
        "{out:?}"
    );
    let log = std::fs::read_to_string(&opts.log_path).unwrap();
    assert!(log.contains("to-stdout") && log.contains("to-stderr"), "{log}");
    // Guest exit codes 1 and 2 are results, not tart errors.
    assert_eq!(tart.exec(&vm, &argv(&["false"]), &opts).await.unwrap().exit_code, 1);
    assert_eq!(
        tart.exec(&vm, &argv(&["sh", "-c", "exit 2"]), &opts)
            .await
            .unwrap()
            .exit_code,
        2
    );
    let err = tart.exec(&vm, &[], &opts).await.expect_err("exec without a command");
    assert!(matches!(err, TartError::Usage { .. }), "{err}");
    // A guest process killed by a signal comes back as 255.
    assert_eq!(
        tart.exec(&vm, &argv(&["sh", "-c", "kill -9 $$"]), &opts)
            .await
            .unwrap()
            .exit_code,
        255
    );
    // argv goes through without a host shell.
    let out = tart
        .exec(&vm, &argv(&["echo", "a b", "$HOME", "-n"]), &opts)
        .await
        .unwrap();
    assert!(out.tail.ends_with("a b $HOME -n\n"), "{:?}", out.tail);

    if !h.real {
        let out = tart.exec(&vm, &argv(&["pwd"]), &opts).await.unwrap();
        let pwd = PathBuf::from(out.tail.lines().last().unwrap());
        assert_eq!(pwd.canonicalize().unwrap(), h.vm_dir(&vm).canonicalize().unwrap());
        let r = h.raw(&["exec", &vm, "sh", "-c", "echo out; echo err >&2"]);
        assert_eq!(
            (r.stdout.as_str(), r.stderr.as_str()),
            ("out\n", "err\n"),
            "separate streams"
        );
        let r = h.raw(&["exec", "-t", &vm, "sh", "-c", "echo out; echo err >&2"]);
        assert_eq!(
            (r.stdout.as_str(), r.stderr.as_str()),
            ("out\nerr\n", ""),
            "-t merges stderr"
        );
    }

    // The log cap holds; the tail still has the end.
    let capped = ExecOptions {
        log_cap: 1000,
        tail_bytes: 64,
        ..exec_opts(&h, "capped", Duration::from_secs(60))
    };
    let out = tart
        .exec(
            &vm,
            &argv(&[
                "sh",
                "-c",
                "i=0; while [ $i -lt 2000 ]; do echo line-$i; i=$((i+1)); done",
            ]),
            &capped,
        )
        .await
        .unwrap();
    assert!(out.truncated && out.output_bytes > 10_000, "{out:?}");
    assert!(out.tail.ends_with("line-1999\n"), "{:?}", out.tail);
    let log_len = std::fs::metadata(&capped.log_path).unwrap().len();
    assert!(log_len < 1200, "log is {log_len} bytes");

    // Stopping at the cap: an endless output (a guest file that is /dev/zero) ends the exec at
    // the cap, long before its timeout, instead of being pumped until then.
    let stop = ExecOptions {
        log_cap: 100_000,
        stop_at_cap: true,
        ..exec_opts(&h, "stop-at-cap", Duration::from_secs(600))
    };
    let started = std::time::Instant::now();
    let out = tart.exec(&vm, &argv(&["cat", "/dev/zero"]), &stop).await.unwrap();
    assert!(out.truncated && out.exit_code == -1, "{out:?}");
    assert!(started.elapsed() < Duration::from_secs(60), "{:?}", started.elapsed());
    assert!(out.output_bytes < 10 << 20, "{out:?}");
    let log_len = std::fs::metadata(&stop.log_path).unwrap().len();
    assert!((100_000..100_200).contains(&log_len), "log is {log_len} bytes");

    guard.vm().kill().await.unwrap();
    let err = tart
        .exec(&vm, &argv(&["true"]), &opts)
        .await
        .expect_err("exec on a stopped VM");
    assert!(err.is_not_running(), "{err}");
    let r = h.raw(&["exec", &vm, "true"]);
    assert_eq!(r.code, Some(2), "{r:?}");
    let err = tart
        .exec("mb-missing", &argv(&["true"]), &opts)
        .await
        .expect_err("exec on a missing VM");
    assert!(err.is_vm_missing(), "{err}");
}

#[tokio::test]
async fn exec_before_boot_fails_until_the_fault_is_lifted() {
    let h = Harness::new();
    if h.double_only("boot delay is a double fault") {
        return;
    }
    let vm = h.vm("mb-boot");
    h.clone_image(&vm);
    let mut faults = Faults::default();
    faults.vms.insert(
        vm.clone(),
        Fault {
            boot_delay_secs: Some(3600.0),
            ..Fault::default()
        },
    );
    h.set_faults(&faults);
    let _guard = h.start(&vm).await;
    let tart = h.tart();
    let opts = exec_opts(&h, &vm, Duration::from_secs(30));

    let err = tart
        .exec(&vm, &argv(&["true"]), &opts)
        .await
        .expect_err("exec while booting");
    assert!(matches!(err, TartError::GuestAgentUnavailable { .. }), "{err}");
    let r = h.raw(&["exec", &vm, "true"]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.stderr
            .contains("Failed to connect to the VM using its control socket"),
        "{r:?}"
    );
    assert!(r.stderr.contains("is the Tart Guest Agent running?"), "{r:?}");
    let r = h.raw(&["ip", &vm]);
    assert_eq!((r.code, r.stderr.trim()), (Some(1), "no IP address found"), "{r:?}");

    h.set_faults(&Faults::default()); // the guest "finished booting"
    assert_eq!(tart.exec(&vm, &argv(&["true"]), &opts).await.unwrap().exit_code, 0);
    let ip = tart.ip(&vm, Duration::from_secs(5)).await.expect("ip");
    assert!(ip.to_string().starts_with("192.168.64."), "{ip}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_exec_times_out_and_its_client_is_killed() {
    let h = Harness::new();
    if h.double_only("exec_hangs is a double fault") {
        return;
    }
    let vm = h.vm("mb-hang");
    h.clone_image(&vm);
    let guard = h.start(&vm).await;
    let mut faults = Faults::default();
    faults.vms.insert(
        vm.clone(),
        Fault {
            exec_hangs: Some(true),
            ..Fault::default()
        },
    );
    h.set_faults(&faults);

    let tart = h.tart();
    let opts = exec_opts(&h, &vm, Duration::from_secs(2));
    let (t, v, o) = (tart.clone(), vm.clone(), opts.clone());
    let exec = tokio::spawn(async move { t.exec(&v, &argv(&["true"]), &o).await });
    let mut clients = Vec::new();
    wait_for("the exec client appears", Duration::from_secs(10), || {
        clients = tart
            .client_pids(&vm)
            .unwrap()
            .into_iter()
            .filter(|p| *p != guard.pid)
            .collect();
        !clients.is_empty()
    });
    let err = exec.await.unwrap().expect_err("hung exec");
    assert!(
        matches!(err, TartError::ExecTimeout { .. }) && err.is_timeout(),
        "{err}"
    );
    wait_for("the timed-out exec client is gone", Duration::from_secs(10), || {
        clients.iter().all(|p| !process_alive(*p))
    });
    assert!(
        std::fs::read_to_string(&opts.log_path)
            .unwrap()
            .contains("killed after")
    );

    h.set_faults(&Faults::default());
    assert_eq!(tart.exec(&vm, &argv(&["true"]), &opts).await.unwrap().exit_code, 0);
}

#[tokio::test]
async fn client_pids_and_kill_vm_processes_find_and_end_everything() {
    let h = Harness::new();
    let vm = h.vm("mb-x");
    h.clone_image(&vm);
    let tart = h.tart();
    let guard = h.start(&vm).await;
    let mut exec = h.spawn(&["exec", &vm, "sleep", "30"], &h.scratch.join("exec.log"));
    let exec_pid = exec.pid();
    wait_for("client_pids lists the exec client", Duration::from_secs(10), || {
        tart.client_pids(&vm).unwrap().contains(&exec_pid)
    });
    assert!(
        tart.client_pids(&vm).unwrap().contains(&guard.pid),
        "`run NAME` is a client too"
    );
    assert!(tart.client_pids("mb-other").unwrap().is_empty());
    // A different home does not match.
    let other = tartan_tart::ClientFilter::new(&h.program).in_home(h.scratch.clone());
    if !h.real {
        assert!(!tartan_tart::client_pids(&vm, &other).contains(&exec_pid));
    }

    let report = tart.kill_vm_processes(&vm).await.expect("kill");
    assert_eq!(report.count(), 2, "{report:?}");
    assert_eq!(report.killed[0], guard.pid, "the lock holder comes first");
    assert_eq!(
        exec.wait_exit(Duration::from_secs(10)).code(),
        None,
        "exec client SIGKILLed"
    );
    assert_eq!(tart.run_pid(&vm).unwrap(), None);
    assert!(tart.client_pids(&vm).unwrap().is_empty());
    assert_eq!(
        tart.kill_vm_processes(&vm).await.unwrap().count(),
        0,
        "nothing left to kill"
    );
    tart.delete(&vm).await.expect("delete after kill");
}

#[tokio::test]
async fn delete_fault_fails_until_lifted() {
    let h = Harness::new();
    if h.double_only("delete_fails is a double fault") {
        return;
    }
    let vm = h.vm("mb-del");
    h.clone_image(&vm);
    h.set_faults(&Faults {
        global: Fault {
            delete_fails: Some(true),
            ..Fault::default()
        },
        ..Faults::default()
    });
    let err = h.tart().delete(&vm).await.expect_err("injected delete failure");
    assert!(
        matches!(&err, TartError::Failed { code: 1, stderr, .. } if stderr.contains("delete_fails")),
        "{err}"
    );
    assert!(h.vm_dir(&vm).join("config.json").exists());
    // A per-VM entry overrides the global one.
    let mut faults = Faults {
        global: Fault {
            delete_fails: Some(true),
            ..Fault::default()
        },
        ..Faults::default()
    };
    faults.vms.insert(
        vm.clone(),
        Fault {
            delete_fails: Some(false),
            ..Fault::default()
        },
    );
    h.set_faults(&faults);
    h.tart().delete(&vm).await.expect("delete after the fault is lifted");
    assert!(!h.vm_dir(&vm).exists());
}

#[test]
fn delete_delay_fault_delays_each_delete_and_a_lift_reaches_the_next() {
    let h = Harness::new();
    if h.double_only("delete_delay_secs is a double fault") {
        return;
    }
    let (slow, other) = (h.vm("mb-slow-del"), h.vm("mb-other"));
    h.clone_image(&slow);
    h.clone_image(&other);
    let delay = Duration::from_millis(1500);
    let mut faults = Faults::default();
    faults.vms.insert(
        slow.clone(),
        Fault {
            delete_delay_secs: Some(delay.as_secs_f64()),
            ..Fault::default()
        },
    );
    h.set_faults(&faults);

    // Only the named VM's delete waits; it holds no lock meanwhile and the VM stays whole.
    let started = Instant::now();
    assert_eq!(h.raw(&["delete", &other]).code, Some(0));
    assert!(started.elapsed() < delay, "another VM's delete is not delayed");
    let started = Instant::now();
    let mut pending = h.spawn(&["delete", &slow], &h.scratch.join("delete.log"));
    std::thread::sleep(Duration::from_millis(300));
    let entry = h.listed(&slow).expect("the VM is untouched while its delete sleeps");
    assert_eq!(entry["Running"], false, "the sleeping delete holds no VM lock: {entry}");
    // Lifting the fault mid-way is read by the next invocation, not by the one asleep.
    h.set_faults(&Faults::default());
    let status = pending.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status:?}");
    assert!(
        started.elapsed() >= delay,
        "the delayed delete took {:?}, less than {delay:?}",
        started.elapsed()
    );
    assert!(!h.vm_dir(&slow).exists(), "then it deleted normally");

    h.clone_image(&slow);
    let started = Instant::now();
    assert_eq!(h.raw(&["delete", &slow]).code, Some(0));
    assert!(started.elapsed() < delay, "the next delete reads the lifted fault");
    assert!(!h.vm_dir(&slow).exists());

    // A killed delete (the fault back on) leaves the VM in place.
    h.set_faults(&faults);
    h.clone_image(&slow);
    let mut killed = h.spawn(&["delete", &slow], &h.scratch.join("delete-killed.log"));
    std::thread::sleep(Duration::from_millis(200));
    killed.kill_and_wait();
    assert!(h.listed(&slow).is_some(), "a killed delete leaves the VM whole");
}

#[tokio::test]
async fn run_dies_after_fault_leaves_a_stopped_vm() {
    let h = Harness::new();
    if h.double_only("run_dies_after_secs is a double fault") {
        return;
    }
    let vm = h.vm("mb-die");
    h.clone_image(&vm);
    let mut faults = Faults::default();
    faults.vms.insert(
        vm.clone(),
        Fault {
            run_dies_after_secs: Some(0.3),
            ..Fault::default()
        },
    );
    h.set_faults(&faults);
    let mut guard = h.start(&vm).await;
    let exit = guard.vm().wait().await.unwrap();
    assert_eq!(exit.signal, Some(Signal::SIGKILL as i32), "{exit}");
    let entry = h.listed(&vm).unwrap();
    assert_eq!(
        (entry["Running"].clone(), entry["State"].clone()),
        (false.into(), "stopped".into())
    );
    assert!(
        h.vm_dir(&vm).join("control.sock").exists(),
        "a stale control.sock remains"
    );
}

#[tokio::test]
async fn clone_overwrites_silently_and_validates_names() {
    let h = Harness::new();
    let (a, b) = (h.vm("mb-a"), h.vm("mb-b"));
    h.clone_image(&a);
    assert_eq!(h.raw(&["clone", &a, &b]).code, Some(0));
    let marker = h.vm_dir(&b).join("marker");
    std::fs::write(&marker, "old clone").unwrap();
    let r = h.raw(&["clone", &a, &b]);
    assert_eq!(r.code, Some(0), "a second clone onto an existing name succeeds: {r:?}");
    assert!(!marker.exists(), "the old VM was replaced");

    let r = h.raw(&["clone", "mb-missing", "mb-c"]);
    assert_eq!(r.code, Some(2), "{r:?}");
    assert!(
        r.stderr.contains("the specified VM \"mb-missing\" does not exist"),
        "{r:?}"
    );
    let r = h.raw(&["clone", &a, "x/y"]);
    assert_eq!(r.code, Some(64), "{r:?}");
    assert!(r.stderr.starts_with("Error: "), "{r:?}");
    let err = h.tart().clone_vm(&a, "x/y").await.expect_err("slash in the new name");
    assert!(matches!(err, TartError::Usage { .. }), "{err}");
}

#[tokio::test]
async fn a_clone_timeout_kills_tart_and_the_next_command_collects_its_temp_dir() {
    let h = Harness::new();
    if h.double_only("clone_delay_secs is a double fault") {
        return;
    }
    let src = h.vm("mb-src");
    h.clone_image(&src);
    let mut faults = Faults::default();
    faults.vms.insert(
        "mb-slow".into(),
        Fault {
            clone_delay_secs: Some(3600.0),
            ..Fault::default()
        },
    );
    h.set_faults(&faults);
    let tart = h.tart().with_timeouts(Timeouts {
        clone: Duration::from_secs(1),
        ..Timeouts::default()
    });
    let err = tart.clone_vm(&src, "mb-slow").await.expect_err("clone must time out");
    assert!(matches!(err, TartError::Timeout { command: "clone", .. }), "{err}");
    wait_for("the killed clone is gone", Duration::from_secs(10), || {
        tart.client_pids("mb-slow").unwrap().is_empty()
    });
    assert!(!h.vm_dir("mb-slow").exists(), "never a half VM in vms/");
    assert_eq!(
        std::fs::read_dir(h.home.join("tmp")).unwrap().count(),
        1,
        "a leftover tmp/<uuid>"
    );
    assert!(tart.list().await.unwrap().iter().all(|e| e.name != "mb-slow"));
    assert_eq!(
        std::fs::read_dir(h.home.join("tmp")).unwrap().count(),
        0,
        "list's GC removed it"
    );
}

#[test]
fn garbage_collection_spares_locked_temp_dirs_and_clone_skips_it() {
    let h = Harness::new();
    if h.double_only("inspects the double's home") {
        return;
    }
    assert_eq!(h.raw(&["list"]).code, Some(0)); // creates the layout
    for sub in ["vms", "cache/OCIs", "cache/IPSWs", "tmp"] {
        assert!(h.home.join(sub).is_dir(), "{sub}");
    }
    let tmp = h.home.join("tmp");
    std::fs::create_dir(tmp.join("free")).unwrap();
    std::fs::create_dir(tmp.join("held")).unwrap();
    let held = std::fs::File::open(tmp.join("held")).unwrap();
    held.lock().unwrap();
    h.clone_image("mb-gc");
    assert!(tmp.join("free").exists(), "clone does not collect garbage");
    assert_eq!(h.raw(&["list", "-q"]).code, Some(0));
    assert!(!tmp.join("free").exists() && tmp.join("held").exists());
    drop(held);
    assert_eq!(h.raw(&["get", "mb-gc"]).code, Some(0));
    assert!(!tmp.join("held").exists());
}

/// tart creates a clone's `tmp/<uuid>` before it locks it (`Clone.swift`): a command that runs in
/// that window collects the directory, and the clone fails with nothing in `vms/`. The double
/// keeps the window and can widen it, so the agent's handling of that failure can be tested.
#[test]
fn a_command_between_clone_creating_and_locking_its_temp_dir_deletes_it_and_the_clone_fails() {
    let h = Harness::new();
    if h.double_only("clone_tmp_unlocked_secs is a double fault") {
        return;
    }
    let src = h.vm("mb-src");
    h.clone_image(&src);
    let mut faults = Faults::default();
    faults.vms.insert(
        "mb-race".into(),
        Fault {
            clone_tmp_unlocked_secs: Some(3.0),
            ..Fault::default()
        },
    );
    h.set_faults(&faults);
    let tmp = h.home.join("tmp");
    let log = h.scratch.join("clone-race.log");
    let mut clone = h.spawn(&["clone", &src, "mb-race"], &log);
    wait_for("the clone's temp dir to appear", Duration::from_secs(10), || {
        std::fs::read_dir(&tmp).unwrap().count() == 1
    });
    assert_eq!(h.raw(&["list", "-q"]).code, Some(0));
    assert_eq!(
        std::fs::read_dir(&tmp).unwrap().count(),
        0,
        "list's GC deleted the unlocked temp dir"
    );
    let status = clone.wait_exit(Duration::from_secs(20));
    let out = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.code(), Some(1), "the clone fails: {out}");
    assert!(out.contains("failed to lock"), "tart's FileLock message: {out}");
    assert!(!h.vm_dir("mb-race").exists(), "nothing in vms/");
    // Once the window passes unhindered, the same clone succeeds.
    h.set_faults(&Faults::default());
    h.clone_image("mb-race");
}

#[test]
fn list_and_get_print_tarts_fields() {
    let h = Harness::new();
    let vm = h.vm("mb-fields");
    h.clone_image(&vm);
    let entry = h.listed(&vm).expect("listed");
    let keys: BTreeSet<&str> = entry.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        BTreeSet::from(["Source", "Name", "Disk", "Size", "Accessed", "Running", "State"])
    );
    assert_eq!(
        (entry["Source"].as_str(), entry["Running"].as_bool()),
        (Some("local"), Some(false))
    );
    assert!(entry["Disk"].is_u64() && entry["Size"].is_u64(), "{entry}");
    let r = h.raw(&["get", &vm, "--format", "json"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let info: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    for key in [
        "OS",
        "CPU",
        "Memory",
        "Disk",
        "DiskFormat",
        "Size",
        "Display",
        "Running",
        "State",
    ] {
        assert!(info.get(key).is_some(), "get lacks {key}: {info}");
    }
    assert!(info["Size"].is_string(), "Size is a string: {info}");
    if h.real {
        return;
    }
    assert!(
        r.stdout.contains("\"Running\" : false"),
        "Swift-style pretty JSON: {}",
        r.stdout
    );
    assert_eq!(h.raw(&["list", "-q"]).stdout.lines().collect::<Vec<_>>()[0], vm);

    // Local entries first, each group sorted; OCI entries exist for the pulled image.
    std::fs::create_dir(h.vm_dir("mb-aaa-incomplete")).unwrap();
    std::fs::write(h.vm_dir("mb-aaa-incomplete").join("config.json"), "{}").unwrap();
    h.raw(&["clone", &vm, "mb-0"]);
    let names: Vec<String> = h
        .list_json()
        .iter()
        .map(|v| v["Name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(&names[..2], ["mb-0".to_string(), vm.clone()], "{names:?}");
    assert!(names[2..].iter().all(|n| n.starts_with("ghcr.io/")), "{names:?}");
    assert!(
        !names.iter().any(|n| n == "mb-aaa-incomplete"),
        "dirs without disk.img are omitted"
    );
    let local = h.raw(&["list", "--source", "local", "-q"]).stdout;
    assert_eq!(local.lines().count(), 2, "{local}");

    let mac = || {
        let c: serde_json::Value =
            serde_json::from_slice(&std::fs::read(h.vm_dir(&vm).join("config.json")).unwrap()).unwrap();
        c["macAddress"].as_str().unwrap().to_string()
    };
    let before = mac();
    let r = h.raw(&["set", &vm, "--cpu", "6", "--memory", "5120", "--random-mac"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert_ne!(mac(), before);
    let info: serde_json::Value = serde_json::from_str(&h.raw(&["get", &vm, "--format", "json"]).stdout).unwrap();
    assert_eq!((info["CPU"].as_u64(), info["Memory"].as_u64()), (Some(6), Some(5120)));
    assert_eq!(h.raw(&["set", "mb-missing", "--cpu", "2"]).code, Some(2));
}

#[test]
fn usage_errors_exit_64_and_run_of_a_missing_vm_exits_1() {
    let h = Harness::new();
    if !h.real {
        let r = h.raw(&["exec", "mb-x"]);
        assert_eq!(r.code, Some(64), "{r:?}");
    }
    let r = h.raw(&["list", "--format", "yaml"]);
    assert_eq!(r.code, Some(64), "{r:?}");
    assert!(r.stderr.starts_with("Error: "), "{r:?}");
    let r = h.raw(&["run", "--no-graphics", "mb-nope"]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.stderr.contains("Error: the specified VM \"mb-nope\" does not exist"),
        "{r:?}"
    );
    let r = h.raw(&["ip", "mb-nope"]);
    assert_eq!(r.code, Some(2), "{r:?}");
}

#[test]
fn the_double_works_from_a_shell_script() {
    let h = Harness::new();
    if h.double_only("scripts use the double") {
        return;
    }
    let script = r#"
        set -e
        TART_HOME="$HOME_DIR" "$TART" clone ghcr.io/cirruslabs/macos-sequoia-base:latest mb-sh
        export TART_HOME="$HOME_DIR"
        "$TART" set mb-sh --cpu 4 --memory 4096 --random-mac
        "$TART" run --no-graphics mb-sh & run=$!
        until "$TART" exec mb-sh true 2>/dev/null; do :; done
        "$TART" exec mb-sh sh -c 'echo hello-from-$(basename "$PWD")'
        "$TART" list --format json | grep -q '"Running" : true'
        "$TART" stop mb-sh --timeout 5
        wait $run
        "$TART" delete mb-sh
        "$TART" list -q --source local | grep -c . || true
        "$TART" --help | grep -q double-faults.json
    "#;
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .env("TART", &h.program)
        .env("HOME_DIR", &h.home)
        .stdin(Stdio::null())
        .output()
        .expect("run sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains("hello-from-mb-sh"), "{stdout}");
    assert!(stdout.trim_end().ends_with('0'), "no local VM left: {stdout}");
}

// ------------------------------------------------------------------------------------------------------------
// Detached runs (issue 13): a VM that outlives the agent that started it.

/// Env var of the `agent_role_starting_a_vm` child: `<program>\n<home or empty>\n<vm>\n<detached: 0|1>\n<log>`.
const AGENT_ROLE: &str = "TARTAN_TEST_AGENT_ROLE";

/// SIGKILLs a `tart run` that is nobody's child here (its handle is gone, or its agent) on drop, so a test that
/// fails half-way leaves no VM running: unless it has ended, and only if its pid still names the same process
/// (same start time).
struct KillOnDrop {
    pid: Pid,
    started: Option<u64>,
}

impl KillOnDrop {
    fn new(pid: Pid) -> Self {
        KillOnDrop {
            pid,
            started: start_time(pid),
        }
    }
}

fn start_time(pid: Pid) -> Option<u64> {
    use sysinfo::{ProcessRefreshKind, ProcessesToUpdate, System};
    let mut sys = System::new().ok()?;
    let spid = sysinfo::Pid::from_u32(pid.as_raw() as u32);
    sys.refresh_processes_specifics(ProcessesToUpdate::Some(&[spid]), true, ProcessRefreshKind::nothing());
    sys.process(spid).map(|p| p.start_time())
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.started.is_some() && process_alive(self.pid) && start_time(self.pid) == self.started {
            let _ = kill(self.pid, Signal::SIGKILL);
        }
    }
}

#[tokio::test]
#[ignore = "child process of a_detached_run_survives_the_process_group_kill_of_its_agents_job; starts a VM, then waits to be killed"]
async fn agent_role_starting_a_vm() {
    let spec =
        std::env::var(AGENT_ROLE).expect("run by a_detached_run_survives_the_process_group_kill_of_its_agents_job");
    let [program, home, vm, detached, log]: [&str; 5] =
        spec.split('\n').collect::<Vec<_>>().try_into().expect("five lines");
    let tart = Tart::new(program, (!home.is_empty()).then(|| PathBuf::from(home)));
    let options = RunOptions {
        log_path: Some(log.into()),
        detached: detached == "1",
        ..Default::default()
    };
    let mut run = tart.run(vm, &options).expect("spawn run");
    run.wait_until_running(Duration::from_secs(120))
        .await
        .expect("VM running");
    println!("\nRUNNING {}", run.pid());
    std::future::pending::<()>().await;
}

/// Starts `agent_role_starting_a_vm` as an "agent" in a process group of its own (as launchd starts a job);
/// returns it and the pid of the `tart run` it started.
fn start_agent(h: &Harness, vm: &str, detached: bool) -> (ChildGuard, Pid) {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let log = h.scratch.join(format!("{vm}-run.log"));
    let spec = [
        h.program.to_str().expect("UTF-8 program path"),
        if h.real {
            ""
        } else {
            h.home.to_str().expect("UTF-8 home")
        },
        vm,
        if detached { "1" } else { "0" },
        log.to_str().expect("UTF-8 scratch path"),
    ]
    .join("\n");
    let mut child = ChildGuard(Some(
        Command::new(std::env::current_exe().expect("the test knows its own path"))
            .args([
                "--exact",
                "agent_role_starting_a_vm",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(AGENT_ROLE, spec)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the agent role"),
    ));
    let stdout = child.0.as_mut().expect("child").stdout.take().expect("piped stdout");
    // Bounded by the child: it gives up (exits, closing stdout) after wait_until_running's timeout.
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.expect("read the agent role's stdout");
        if let Some(pid) = line.strip_prefix("RUNNING ") {
            return (child, Pid::from_raw(pid.trim().parse().expect("a pid")));
        }
    }
    panic!("the agent role ended without starting {vm}");
}

#[tokio::test]
async fn a_detached_run_survives_the_process_group_kill_of_its_agents_job() {
    use nix::sys::signal::killpg;
    use nix::unistd::getpgid;
    let h = Harness::new();
    let tart = h.tart();

    // Default: `tart run` is in the agent's process group and dies when launchd kills the group.
    let vm = h.vm("mb-grouped");
    h.clone_image(&vm);
    let (mut agent, run) = start_agent(&h, &vm, false);
    let _run_guard = KillOnDrop::new(run);
    assert_eq!(
        getpgid(Some(run)).unwrap(),
        agent.pid(),
        "tart run in the agent's group"
    );
    killpg(agent.pid(), Signal::SIGKILL).expect("kill the agent's process group");
    agent.wait_exit(Duration::from_secs(10));
    wait_for(
        "the grouped tart run dies with its agent",
        Duration::from_secs(30),
        || !process_alive(run) && tart.run_pid(&vm).unwrap().is_none(),
    );

    // Detached: `tart run` leads a process group of its own, outside the agent's, and the VM stays usable.
    let vm = h.vm("mb-detached");
    h.clone_image(&vm);
    let (mut agent, run) = start_agent(&h, &vm, true);
    let _run_guard = KillOnDrop::new(run);
    assert_eq!(getpgid(Some(run)).unwrap(), run, "tart run leads its own process group");
    killpg(agent.pid(), Signal::SIGKILL).expect("kill the agent's process group");
    agent.wait_exit(Duration::from_secs(10));
    let opts = exec_opts(&h, &vm, Duration::from_secs(120));
    let out = tart
        .exec(&vm, &argv(&["true"]), &opts)
        .await
        .expect("exec after the agent died");
    assert_eq!(out.exit_code, 0);
    assert!(process_alive(run));
    assert_eq!(
        tart.run_pid(&vm).unwrap(),
        Some(run),
        "the next agent finds it with F_GETLK"
    );
    let report = tart.kill_vm_processes(&vm).await.expect("kill the detached run");
    assert_eq!(report.killed.first(), Some(&run), "{report:?}");
    assert_eq!(tart.run_pid(&vm).unwrap(), None);
    tart.delete(&vm).await.expect("delete after kill");
}

#[tokio::test]
async fn a_detached_run_leads_its_own_session_and_is_found_and_killed_after_its_handle_drops() {
    use nix::unistd::{getpgid, getsid};
    let h = Harness::new();
    let tart = h.tart();
    let vm = h.vm("mb-session");
    h.clone_image(&vm);
    let options = RunOptions {
        log_path: Some(h.scratch.join("session-run.log")),
        detached: true,
        ..Default::default()
    };
    let mut handle = tart.run(&vm, &options).expect("spawn run");
    let run = handle.pid();
    let _run_guard = KillOnDrop::new(run);
    handle
        .wait_until_running(Duration::from_secs(if h.real { 120 } else { 20 }))
        .await
        .expect("VM running");
    assert_eq!(getsid(Some(run)).unwrap(), run, "a session of its own");
    assert_eq!(getpgid(Some(run)).unwrap(), run, "a process group of its own");
    drop(handle);

    assert!(process_alive(run), "dropping the handle does not stop the VM");
    assert_eq!(tart.run_pid(&vm).unwrap(), Some(run));
    assert!(
        tart.client_pids(&vm).unwrap().contains(&run),
        "`run NAME` is a client too"
    );
    let report = tart.kill_vm_processes(&vm).await.expect("kill the detached run");
    assert_eq!(report.killed.first(), Some(&run), "{report:?}");
    assert!(!process_alive(run));
    assert_eq!(tart.run_pid(&vm).unwrap(), None);

    // The default stays in the caller's process group.
    let mut grouped = tart
        .run(
            &vm,
            &RunOptions {
                log_path: Some(h.scratch.join("grouped-run.log")),
                ..Default::default()
            },
        )
        .expect("spawn run");
    assert_eq!(getpgid(Some(grouped.pid())).unwrap(), getpgid(None).unwrap());
    grouped.kill().await.expect("kill the grouped run");
}

// ------------------------------------------------------------------------------------------------------------
// tart-double: guest processes die with their VM.

/// Starts a job in the guest that outlives its `exec`, as a step detaches with `nohup … &`; returns the pid
/// of its `sh` (whose `sleep` child is part of the job too).
fn start_guest_job(h: &Harness, vm: &str, tag: &str) -> Pid {
    let pidfile = h.scratch.join(format!("{tag}.pid"));
    let script = format!(
        "nohup sh -c 'sleep 300' >/dev/null 2>&1 & echo $! > '{}'",
        pidfile.display()
    );
    let r = h.raw(&["exec", vm, "sh", "-c", &script]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let text = std::fs::read_to_string(&pidfile).expect("the job's pid file");
    let pid = Pid::from_raw(text.trim().parse().unwrap_or_else(|e| panic!("{text:?}: {e}")));
    assert!(process_alive(pid), "the job {tag} outlives its exec");
    pid
}

/// Asserts that no process of VM `name` is left, the job's `sleep` included (a sweep finds nothing to kill).
fn assert_no_guest_left(h: &Harness, name: &str) {
    assert_eq!(
        tart_double::guests::sweep(&h.vm_dir(name), None),
        Ok(0),
        "guest processes of {name} were left"
    );
}

#[tokio::test]
async fn a_guest_job_outlives_its_exec_but_not_its_vm_and_no_other_vm_touches_it() {
    let h = Harness::new();
    if h.double_only("guest processes are host processes only in the double") {
        return;
    }
    let (a, b) = (h.vm("mb-a"), h.vm("mb-b"));
    h.clone_image(&a);
    h.clone_image(&b);
    let _guard_a = h.start(&a).await;
    let _guard_b = h.start(&b).await;
    let job_a = start_guest_job(&h, &a, "a");
    let job_b = start_guest_job(&h, &b, "b");

    let r = h.raw(&["stop", &b, "--timeout", "5"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(!process_alive(job_b), "B's job died with B");
    assert_no_guest_left(&h, &b);
    assert!(process_alive(job_a), "stopping B leaves A's job alone");
    let r = h.raw(&["delete", &b]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(process_alive(job_a), "deleting B leaves A's job alone");
    assert_eq!(h.listed(&a).expect("A listed")["Running"], true);

    let r = h.raw(&["stop", &a, "--timeout", "5"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(!process_alive(job_a), "A's job died with A");
    assert_no_guest_left(&h, &a);
}

#[tokio::test]
async fn guest_jobs_of_a_killed_run_linger_until_the_next_stop_run_or_delete_of_the_vm() {
    let h = Harness::new();
    if h.double_only("guest processes are host processes only in the double") {
        return;
    }
    let vm = h.vm("mb-killed");
    h.clone_image(&vm);

    let mut guard = h.start(&vm).await;
    let job = start_guest_job(&h, &vm, "job1");
    guard.vm().kill().await.expect("SIGKILL the run");
    assert!(
        process_alive(job),
        "a SIGKILLed run cannot take its guest along (the double's limit)"
    );
    let entry = h.listed(&vm).expect("listed");
    assert_eq!(
        (entry["Running"].clone(), entry["State"].clone()),
        (false.into(), "stopped".into()),
        "the leftover job does not make the VM look running"
    );
    let r = h.raw(&["stop", &vm]);
    assert_eq!(r.code, Some(2), "still not running: {r:?}");
    assert!(!process_alive(job), "stop swept the leftover job");
    assert_no_guest_left(&h, &vm);

    let mut guard = h.start(&vm).await;
    let job = start_guest_job(&h, &vm, "job2");
    guard.vm().kill().await.expect("SIGKILL the run");
    let mut guard = h.start(&vm).await;
    wait_for("the next run sweeps the leftover job", Duration::from_secs(10), || {
        !process_alive(job)
    });
    let job = start_guest_job(&h, &vm, "job3");
    let r = h.raw(&["exec", &vm, "true"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(process_alive(job), "the run's own guests are not leftovers");
    guard.vm().kill().await.expect("SIGKILL the run");
    let r = h.raw(&["delete", &vm]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(!process_alive(job), "delete swept the leftover job");
    assert_no_guest_left(&h, &vm);
}

#[test]
fn an_execd_command_dies_with_its_exec_client() {
    let h = Harness::new();
    if h.double_only("the guest command is a host process only in the double") {
        return;
    }
    let vm = h.vm("mb-client");
    h.clone_image(&vm);
    let mut run = h.spawn(&["run", "--no-graphics", &vm], &h.scratch.join("run.log"));
    wait_for("run holds the VM lock", Duration::from_secs(20), || {
        tartan_tart::run_pid(&h.home, &vm).unwrap() == Some(run.pid())
    });
    let pidfile = h.scratch.join("child.pid");
    let script = format!(
        "echo $$ > '{0}.tmp' && mv '{0}.tmp' '{0}' && exec sleep 300",
        pidfile.display()
    );
    let mut exec = h.spawn(&["exec", &vm, "sh", "-c", &script], &h.scratch.join("exec.log"));
    let mut child = None;
    wait_for("the exec'd command writes its pid", Duration::from_secs(10), || {
        child = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .map(Pid::from_raw);
        child.is_some()
    });
    let child = child.expect("pid");
    assert!(process_alive(child));
    exec.kill_and_wait();
    wait_for("the command dies with its exec client", Duration::from_secs(10), || {
        !process_alive(child)
    });
    run.kill_and_wait();
}

#[tokio::test]
async fn exec_input_hands_the_guest_its_stdin_and_plain_exec_none() {
    let h = Harness::new();
    let vm = h.vm("mb-exec-input");
    h.clone_image(&vm);
    let tart = h.tart();
    let _guard = h.start(&vm).await;
    let opts = exec_opts(&h, &vm, Duration::from_secs(120));
    // More than a pipe holds, so the input is written while the output is read.
    let input: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8 + 1).collect();
    let script = "cat > got && wc -c < got && echo done";
    let out = tart
        .exec_input(&vm, &argv(&["sh", "-c", script]), input.clone(), &opts)
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
    assert_eq!(std::fs::read(h.home.join("vms").join(&vm).join("got")).unwrap(), input);
    assert!(out.tail.contains("1048576") && out.tail.ends_with("done\n"), "{out:?}");
    // Without input the guest command reads an empty stdin.
    let out = tart
        .exec(&vm, &argv(&["sh", "-c", "cat > none && wc -c < none"]), &opts)
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0);
    assert_eq!(std::fs::read(h.home.join("vms").join(&vm).join("none")).unwrap(), b"");
}

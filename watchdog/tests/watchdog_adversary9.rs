//! Adversary 9 against the watchdog. Each test names the promise it attacks, the input and (for
//! a finding) what happened. Every wait is bounded.

mod common;

use common::{Host, InProcess, plus, secs_f, time_of, wait_for};
use k8s_openapi::jiff::Timestamp;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(30);

/// FINDING (promise: "only tartan's own VMs, never another's"; the watchdog kills "its tart
/// processes"). Input: an overdue deadline file for `mb-victim` while someone on the same host
/// (same tart home) runs a tart client for a *different* VM whose later argument merely equals
/// `mb-victim`, e.g. `tart exec devbox grep mb-victim /var/log/build.log` or
/// `tart clone mb-victim keep-for-debugging`. What happened: `client_pids` matches any process
/// whose argv[0] is `tart` and *any* later argument equals the VM name, so the watchdog SIGKILLs
/// the foreign `tart exec devbox …` too. Severity: medium (kills another user's work on another VM;
/// a killed `tart clone` can leave a half-made foreign VM).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_tart_client_whose_argument_merely_equals_the_vm_name_is_not_killed() {
    let mut host = Host::new();
    host.clone_vm("mb-victim");
    host.clone_vm("devbox");
    // argv: tart exec devbox grep mb-victim /var/log/build.log  (argv[0] basename "tart"),
    // implemented by sh so it just waits; TART_HOME is the same home, as on a shared Mac.
    let foreign = host.spawn_other(
        Command::new("/bin/sh")
            .arg0("tart")
            .args([
                "-c",
                "sleep 60; true",
                "exec",
                "devbox",
                "grep",
                "mb-victim",
                "/var/log/build.log",
            ])
            .env("TART_HOME", &host.home)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    let deadline = plus(Timestamp::now(), secs_f(-5.0));
    host.write_deadline("mb-victim", deadline);
    let watchdog = InProcess::start(host.config(secs_f(1.0)));
    let line = host.wait_line("mb-victim", "deleted", LIMIT).await;
    let alive = nix::sys::signal::kill(nix::unistd::Pid::from_raw(foreign as i32), None).is_ok()
        && std::fs::read_to_string(format!("/proc/{foreign}/stat"))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(true);
    watchdog.stop().await.unwrap();
    assert!(host.vm_exists("devbox"), "the foreign VM is untouched");
    assert!(
        alive,
        "the foreign `tart exec devbox grep mb-victim …` (pid {foreign}) was SIGKILLed by the watchdog \
         deleting mb-victim: {line:?}"
    );
}

/// FINDING (promise: "keeps going after a bad file", "thousands of files", "never hangs").
/// Input: 3000 garbage `mb-*.json` files next to one real, already overdue VM, present when the
/// watchdog starts. What happened: the rescan runs synchronously on the loop and writes one
/// fsync'd `bad-deadline-file` record line per bad file before the loop ever looks at what is
/// due, so the overdue VM is acted on only after every bad file was recorded (its `deleted` line
/// comes after all 3000 bad lines; measured 5-6.5 s late on this Linux box, and each line is an
/// F_FULLFSYNC on macOS, so tens of seconds there; SIGTERM is not seen meanwhile either).
/// Severity: low-medium (needs write access to the deadline folder; delays, does not prevent).
/// Fixed: the bad files' lines are written off the loop after the VMs due are dispatched.
///
/// What decides is the order of the watchdog's own log events: the overdue VM's dispatch
/// ("VM overdue; deleting it") must come before the first bad line is appended to the record.
/// That order is a happens-before in the loop, not a race: the order of the record's lines is
/// not (where fsync is nearly free, the writer finishes all 3000 lines while `tart delete` runs).
/// The lateness bound is only a hang detector.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_bad_files_do_not_hold_back_an_overdue_vm() {
    let events = EventLog::install();
    let mut host = Host::new();
    host.running_vm("mb-real").await;
    let n = 3000;
    for i in 0..n {
        host.write_raw(&format!("mb-bad-{i:05}.json"), "{\"version\":1,\"vm\":");
    }
    // Already past deadline + grace when the watchdog starts: due on its first pass, the same
    // pass whose rescan finds the bad files.
    let deadline = plus(Timestamp::now(), secs_f(-5.0));
    host.write_deadline("mb-real", deadline);
    let started = Timestamp::now();
    let watchdog = InProcess::start(host.config(secs_f(1.0)));
    let line = host.wait_line("mb-real", "deleted", Duration::from_secs(120)).await;
    let due = plus(deadline, secs_f(1.0)).max(started);
    let late = time_of(&line).duration_since(due);
    wait_for("all bad files recorded", Duration::from_secs(120), || {
        (host
            .lines()
            .iter()
            .filter(|l| l.action.as_str() == "bad-deadline-file")
            .count()
            >= n)
            .then_some(())
    })
    .await;
    watchdog.stop().await.unwrap();
    let bad = host
        .lines()
        .iter()
        .filter(|l| l.action.as_str() == "bad-deadline-file")
        .count();
    assert_eq!(bad, n, "each bad file recorded once");
    let log = events.lines();
    let dispatched = log
        .iter()
        .position(|l| l.contains("VM overdue; deleting it") && l.contains("mb-real"))
        .expect("the watchdog logs the overdue VM's dispatch");
    let recorded_before = log[..dispatched]
        .iter()
        .filter(|l| l.contains(r#""action":"bad-deadline-file""#) && l.contains("mb-bad-"))
        .count();
    assert_eq!(
        recorded_before, 0,
        "{recorded_before} of {n} bad files were appended to the record before the overdue VM \
         was dispatched: the rescan's record lines (one fsync each) held it back"
    );
    assert!(
        late <= secs_f(30.0),
        "the real overdue VM was deleted {late} after it was due"
    );
}

/// Every log event of this test binary, formatted, in the order they were written. Installed as
/// the global subscriber: the watchdog runs on the runtime's threads, not the test's.
#[derive(Clone, Default)]
struct EventLog(Arc<Mutex<Vec<u8>>>);

impl EventLog {
    fn install() -> EventLog {
        let log = EventLog::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one global subscriber per test binary");
        log
    }

    fn lines(&self) -> Vec<String> {
        let bytes = self.0.lock().unwrap().clone();
        String::from_utf8_lossy(&bytes).lines().map(str::to_owned).collect()
    }
}

impl std::io::Write for EventLog {
    // The formatter hands over each event whole, so one lock per write keeps events apart.
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

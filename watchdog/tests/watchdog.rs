//! The watchdog against the real `tart-double`: running `tart run` processes, real deadline files,
//! real kills. Graces are short except in the one test that keeps the source's 60 s default.

mod common;

use common::{Host, InProcess, plus, secs_f, time_of, wait_for};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;
use tartan_watchdog::Action;

/// Generous bounds for waits; the benchmark measures lateness precisely.
const LIMIT: Duration = Duration::from_secs(30);
/// How late a deletion may be in these tests (rescan 1 s + tart work + a slow CI machine).
const SLACK: f64 = 3.0;

fn assert_on_time(line: &tartan_watchdog::Line, due: Timestamp) {
    let at = time_of(line);
    assert!(at >= due, "acted at {at}, before deadline + grace {due}: {line:?}");
    assert!(
        at <= plus(due, secs_f(SLACK)),
        "acted at {at}, more than {SLACK}s after {due}: {line:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_an_overdue_vm_at_deadline_plus_grace_and_kills_its_run() {
    let mut host = Host::new();
    host.running_vm("mb-due").await;
    let grace = secs_f(2.0);
    let deadline = plus(Timestamp::now(), secs_f(1.0));
    host.write_deadline("mb-due", deadline);
    let watchdog = InProcess::start(host.config(grace));

    let line = host.wait_line("mb-due", "deleted", LIMIT).await;
    assert_on_time(&line, plus(deadline, grace));
    assert_eq!(line.deadline.as_deref(), Some(deadline.to_string().as_str()));
    assert!(
        line.detail
            .starts_with("killed 1 tart process(es); stopped and deleted in "),
        "detail: {}",
        line.detail
    );
    assert!(!host.vm_exists("mb-due"), "the VM directory is gone");
    assert!(!host.run_alive("mb-due"), "the tart run process was killed");
    // The line is recorded before the deadline file goes (a crash in between re-runs the job).
    wait_for("the deadline file to be removed after the deletion", LIMIT, || {
        (!host.deadline_file("mb-due").exists()).then_some(())
    })
    .await;
    assert_eq!(host.lines().len(), 1, "exactly one line: {:?}", host.lines());
    watchdog.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_grace_is_sixty_seconds_in_the_real_subcommand() {
    common::tartan_agent(); // build it before any deadline is set
    let mut host = Host::new();
    host.running_vm("mb-default").await;
    // The deadline passed 58.5 s ago: with the default 60 s grace it is due in 1.5 s.
    let deadline = plus(Timestamp::now(), secs_f(-58.5));
    host.write_deadline("mb-default", deadline);
    host.spawn_watchdog_process(&[], "watchdog.log");

    let line = host.wait_line("mb-default", "deleted", LIMIT).await;
    assert_on_time(&line, plus(deadline, SignedDuration::from_secs(60)));
    assert!(!host.vm_exists("mb-default"));
    assert!(!host.run_alive("mb-default"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_watchdog_still_deletes_on_time() {
    common::tartan_agent(); // build it first: the deadline below must not pass while cargo works
    let mut host = Host::new();
    host.running_vm("mb-restart").await;
    let grace = secs_f(1.0);
    let deadline = plus(Timestamp::now(), secs_f(2.0));
    host.write_deadline("mb-restart", deadline);

    let first = host.spawn_watchdog_process(&["--grace", "1s"], "first.log");
    host.wait_watchdog_started().await;
    host.kill(first); // SIGKILL, before the VM is due
    assert!(
        host.vm_exists("mb-restart") && host.run_alive("mb-restart"),
        "nothing was due yet"
    );

    host.spawn_watchdog_process(&["--grace", "1s"], "second.log");
    let line = host.wait_line("mb-restart", "deleted", LIMIT).await;
    assert_on_time(&line, plus(deadline, grace));
    assert!(!host.vm_exists("mb-restart"));
    assert!(!host.run_alive("mb-restart"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_delete_is_recorded_and_retried_until_the_fault_is_lifted() {
    let mut host = Host::new();
    host.running_vm("mb-stuck").await;
    host.faults(Some(r#"{"vms": {"mb-stuck": {"delete_fails": true}}}"#));
    let deadline = plus(Timestamp::now(), secs_f(-5.0));
    host.write_deadline("mb-stuck", deadline);
    let watchdog = InProcess::start(host.config(secs_f(1.0)));

    // Two failures prove the retry; neither is reported as a deletion.
    wait_for("two delete-failed lines", LIMIT, || {
        let failed: Vec<_> = host
            .lines_for("mb-stuck")
            .into_iter()
            .filter(|l| l.action == Action::DeleteFailed)
            .collect();
        (failed.len() >= 2).then_some(failed)
    })
    .await;
    let lines = host.lines_for("mb-stuck");
    assert!(lines.iter().all(|l| l.action == Action::DeleteFailed), "{lines:?}");
    assert!(
        lines[0].detail.contains("injected fault delete_fails") && lines[0].detail.contains("retry 1 in"),
        "tart's message and the retry are recorded: {}",
        lines[0].detail
    );
    assert!(
        time_of(&lines[1]) >= plus(time_of(&lines[0]), secs_f(0.2)),
        "the retry waited for the backoff"
    );
    assert!(host.vm_exists("mb-stuck"), "the VM is still there");
    assert!(
        host.deadline_file("mb-stuck").exists(),
        "the deadline file stays until the VM is gone"
    );

    host.faults(None);
    let deleted = host.wait_line("mb-stuck", "deleted", LIMIT).await;
    assert!(!host.vm_exists("mb-stuck"));
    wait_for("the deadline file to be removed after the deletion", LIMIT, || {
        (!host.deadline_file("mb-stuck").exists()).then_some(())
    })
    .await;
    let after: Vec<_> = host
        .lines_for("mb-stuck")
        .into_iter()
        .skip_while(|l| l != &deleted)
        .collect();
    assert_eq!(
        after.len(),
        1,
        "nothing is recorded for the VM after its deletion: {after:?}"
    );
    watchdog.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vms_without_prefix_or_deadline_file_are_never_touched_and_bad_files_are_recorded_once() {
    let mut host = Host::new();
    host.running_vm("mb-no-file").await;
    host.running_vm("foreign-vm").await;
    host.running_vm("mb-first-due").await;
    let past = plus(Timestamp::now(), secs_f(-600.0));
    // A file the agent would never write: a VM without the prefix. And a malformed file.
    host.write_raw(
        "foreign-vm.json",
        &format!(
            r#"{{"version":1,"vm":"foreign-vm","namespace":"ci","name":"x","uid":"u","attempt":1,"deadline":"{past}","agent":"a","writtenAt":"{past}"}}"#
        ),
    );
    host.write_raw("mb-garbled.json", "{\"version\":1,\"vm\":");
    host.write_deadline("mb-first-due", past);
    let watchdog = InProcess::start(host.config(secs_f(0.5)));

    host.wait_line("mb-first-due", "deleted", LIMIT).await;
    // A deadline file written while it runs is noticed within a rescan; its deletion also proves
    // that later rescans happened without recording the bad files again.
    host.running_vm("mb-later").await;
    let written = Timestamp::now();
    host.write_deadline("mb-later", plus(written, secs_f(-1.0)));
    let line = host.wait_line("mb-later", "deleted", LIMIT).await;
    assert_on_time(&line, written);
    host.running_vm("mb-last").await;
    host.write_deadline("mb-last", plus(Timestamp::now(), secs_f(-1.0)));
    host.wait_line("mb-last", "deleted", LIMIT).await;

    for vm in ["mb-no-file", "foreign-vm"] {
        assert!(host.vm_exists(vm), "{vm} still exists");
        assert!(host.run_alive(vm), "{vm}'s tart run is still running");
        assert!(
            host.lines_for(vm).iter().all(|l| l.action == Action::BadDeadlineFile),
            "{:?}",
            host.lines_for(vm)
        );
    }
    let bad: Vec<_> = host
        .lines()
        .into_iter()
        .filter(|l| l.action == Action::BadDeadlineFile)
        .collect();
    let mut bad_vms: Vec<_> = bad.iter().map(|l| l.vm.as_str()).collect();
    bad_vms.sort();
    assert_eq!(
        bad_vms,
        vec!["foreign-vm", "mb-garbled"],
        "each bad file is recorded exactly once: {bad:?}"
    );
    assert!(bad.iter().all(|l| l.detail.contains("left in place")), "{bad:?}");
    assert!(host.deadlines().join("foreign-vm.json").exists() && host.deadlines().join("mb-garbled.json").exists());
    watchdog.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_file_removed_before_its_time_means_hands_off() {
    let mut host = Host::new();
    host.running_vm("mb-finished").await;
    host.running_vm("mb-barrier").await;
    let grace = secs_f(0.5);
    let now = Timestamp::now();
    host.write_deadline("mb-finished", plus(now, secs_f(1.5)));
    host.write_deadline("mb-barrier", plus(now, secs_f(2.5)));
    let watchdog = InProcess::start(host.config(grace));
    // Wait for the watchdog to be up, then the agent finishes with the VM and removes the file.
    common::wait_for("the record to exist", LIMIT, || {
        host.record_path().exists().then_some(())
    })
    .await;
    std::fs::remove_file(host.deadline_file("mb-finished")).unwrap();

    host.wait_line("mb-barrier", "deleted", LIMIT).await;
    assert!(
        host.vm_exists("mb-finished") && host.run_alive("mb-finished"),
        "the VM was left alone"
    );
    assert!(host.lines_for("mb-finished").is_empty(), "{:?}", host.lines());
    watchdog.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absent_vm_is_recorded_as_already_absent_and_its_file_removed() {
    let host = Host::new();
    let deadline = plus(Timestamp::now(), secs_f(-1.0));
    host.write_deadline("mb-ghost", deadline);
    let watchdog = InProcess::start(host.config(secs_f(0.5)));
    let line = host.wait_line("mb-ghost", "already-absent", LIMIT).await;
    assert!(line.detail.contains("already absent"), "{}", line.detail);
    wait_for("the deadline file to be removed", LIMIT, || {
        (!host.deadline_file("mb-ghost").exists()).then_some(())
    })
    .await;
    assert_eq!(host.lines().len(), 1, "{:?}", host.lines());
    watchdog.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigstopped_agent_holding_the_state_lock_does_not_block_it() {
    common::tartan_agent(); // build it before any deadline is set
    let mut host = Host::new();
    host.running_vm("mb-paused-agent").await;
    // Stand-in for a paused agent: a process holding flock(<state>/.lock), then SIGSTOPped.
    let lock = host.state.join(".lock");
    let ready = host.root.join("locked");
    let holder = host.spawn_other(
        Command::new("perl")
            .arg("-e")
            .arg("use Fcntl qw(:flock); open(my $f, '>>', $ARGV[0]) or die; flock($f, LOCK_EX) or die; open(my $r, '>', $ARGV[1]) or die; close($r); sleep 300;")
            .arg(&lock)
            .arg(&ready)
            .stdin(Stdio::null())
            .process_group(0),
    );
    wait_for("the stand-in agent to hold the lock", LIMIT, || {
        ready.exists().then_some(())
    })
    .await;
    killpg(Pid::from_raw(holder as i32), Signal::SIGSTOP).unwrap();

    let deadline = plus(Timestamp::now(), secs_f(0.5));
    host.write_deadline("mb-paused-agent", deadline);
    host.spawn_watchdog_process(&["--grace", "1s"], "watchdog.log");
    let line = host.wait_line("mb-paused-agent", "deleted", LIMIT).await;
    assert_on_time(&line, plus(deadline, secs_f(1.0)));
    assert!(!host.vm_exists("mb-paused-agent"));
    // The agent's lock was never taken from it.
    let held = std::fs::File::open(&lock).unwrap().try_lock();
    assert!(
        matches!(held, Err(std::fs::TryLockError::WouldBlock)),
        "the paused agent still holds its lock"
    );
    kill(Pid::from_raw(holder as i32), Signal::SIGCONT).unwrap();
}

/// A tart wrapper whose `delete` of `slow_vm` creates `<release>.entered`, then blocks until
/// `release` exists (at most 30 s), then runs the double.
fn slow_delete_tart(host: &Host, slow_vm: &str, release: &std::path::Path) -> std::path::PathBuf {
    let path = host.root.join("tart-slow-delete");
    let script = format!(
        "#!/bin/sh\nif [ \"$1\" = delete ] && [ \"$2\" = {slow_vm} ]; then\n  : > '{r}.entered'\n  i=0\n  while [ ! -e '{r}' ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done\nfi\nexec '{}' \"$@\"\n",
        host.double.display(),
        r = release.display(),
    );
    tartan_testkit::write_program(&path, &script);
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slow_delete_does_not_make_another_vm_late() {
    let mut host = Host::new();
    host.running_vm("mb-slow").await;
    host.running_vm("mb-fast").await;
    let release = host.root.join("release");
    let mut config = host.config(secs_f(0.5));
    config.tart_program = slow_delete_tart(&host, "mb-slow", &release);
    let now = Timestamp::now();
    host.write_deadline("mb-slow", plus(now, secs_f(0.5)));
    host.write_deadline("mb-fast", plus(now, secs_f(0.7)));
    let watchdog = InProcess::start(config);

    let fast = host.wait_line("mb-fast", "deleted", LIMIT).await;
    assert_on_time(&fast, plus(now, secs_f(1.2)));
    assert!(!release.exists());
    assert!(
        host.lines_for("mb-slow").is_empty(),
        "mb-slow's delete is still blocked"
    );
    assert!(host.vm_exists("mb-slow"));

    std::fs::write(&release, "").unwrap();
    host.wait_line("mb-slow", "deleted", LIMIT).await;
    assert!(!host.vm_exists("mb-slow"));
    watchdog.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_is_bounded() {
    let mut host = Host::new();
    host.running_vm("mb-slow-first").await;
    host.running_vm("mb-next").await;
    let release = host.root.join("release");
    let mut config = host.config(secs_f(0.5));
    config.tart_program = slow_delete_tart(&host, "mb-slow-first", &release);
    config.concurrency = 1;
    // Both are due at the first wake; mb-slow-first is more overdue, so it goes first.
    let now = Timestamp::now();
    host.write_deadline("mb-slow-first", plus(now, secs_f(-10.0)));
    host.write_deadline("mb-next", plus(now, secs_f(-9.0)));
    let watchdog = InProcess::start(config);

    // With one job at a time, mb-next waits for mb-slow-first. Once mb-slow-first's delete is blocked, give an
    // unbounded watchdog ample time (1 s) to have started on mb-next, and check it did not.
    let entered = host.root.join("release.entered");
    wait_for("mb-slow-first's delete to start", LIMIT, || {
        entered.exists().then_some(())
    })
    .await;
    let looked = Timestamp::now();
    wait_for("a second to pass", LIMIT, || {
        (Timestamp::now() > plus(looked, secs_f(1.0))).then_some(())
    })
    .await;
    assert!(
        host.run_alive("mb-next") && host.lines_for("mb-next").is_empty(),
        "held back by the bound"
    );

    std::fs::write(&release, "").unwrap();
    host.wait_line("mb-slow-first", "deleted", LIMIT).await;
    host.wait_line("mb-next", "deleted", LIMIT).await;
    assert!(!host.vm_exists("mb-next"));
    watchdog.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_watchdog_on_the_same_state_dir_refuses_to_start() {
    let host = Host::new();
    let first = InProcess::start(host.config(secs_f(1.0)));
    common::wait_for("the first watchdog to start", LIMIT, || {
        host.record_path().exists().then_some(())
    })
    .await;
    let second = tartan_watchdog::run(host.config(secs_f(1.0)), std::future::pending::<()>());
    let err = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, tartan_watchdog::Error::AlreadyRunning { .. }), "{err}");
    assert!(err.to_string().contains("another watchdog holds"), "{err}");
    first.stop().await.unwrap();
}

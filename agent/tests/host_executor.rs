//! The host executor against real `tart-double` processes: whole attempts driven through the
//! attempt machine with an in-memory journal, from admission to the VM's confirmed deletion.

mod host_common;

use host_common::*;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tart_double::{Fault, Faults};
use tartan_agent::host::{AttemptExecutor, CancelHandle, DriveError, ExecutorConfig, Withdrawal, cancel_pair, drive};
use tartan_agent::machine::{Attempt, Config};
use tartan_api::{Artifacts, AttemptState as S, Outcome, Reason, Step};
use tartan_testkit::wait_for;

const LIMIT: Duration = Duration::from_secs(90);

const JUNIT: &str =
    r#"<testsuites><testsuite name="AppTests"><testcase name="a"/><testcase name="b"/></testsuite></testsuites>"#;

fn machine() -> Config {
    Config {
        quarantine_retry: k8s_openapi::jiff::SignedDuration::from_millis(200),
        ..Config::default()
    }
}

fn vm_fault(vm: &str, f: Fault) -> Faults {
    let mut faults = Faults::default();
    faults.vms.insert(vm.to_string(), f);
    faults
}

/// Drives the attempt (admitted with 600 s) on a task that journals into `journal` and returns
/// how it ended together with the executor.
fn spawn_drive(
    mut exec: AttemptExecutor,
    mut a: Attempt,
    journal: &MemJournal,
) -> tokio::task::JoinHandle<(Result<S, DriveError>, AttemptExecutor)> {
    let mut hooks = journal.clone();
    tokio::spawn(async move {
        let end = drive(&mut exec, &mut a, admit(600), &machine(), &mut hooks).await;
        (end, exec)
    })
}

/// Cancels the attempt `task` drives, then measures (and prints) how long until the tart
/// processes `pids` are dead and the attempt is Retired; the kill must take under 2 s.
async fn cancel_and_measure(
    phase: &str,
    cancel: &CancelHandle,
    why: Withdrawal,
    pids: &[tartan_tart::Pid],
    task: tokio::task::JoinHandle<(Result<S, DriveError>, AttemptExecutor)>,
) -> AttemptExecutor {
    let t0 = Instant::now();
    cancel.cancel(why);
    wait_for("the tart processes to die", Duration::from_secs(5), || {
        pids.iter().all(|p| !tartan_tart::process_alive(*p)).then_some(())
    })
    .await;
    let killed_after = t0.elapsed();
    let (end, exec) = tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    let retired_after = t0.elapsed();
    assert_eq!(end.unwrap(), S::Retired);
    eprintln!(
        "cancel during {phase}: executor interrupted in {:?}, tart processes dead after {killed_after:?}, Retired after {retired_after:?}",
        exec.interrupt_latency().unwrap()
    );
    assert!(
        killed_after < Duration::from_secs(2),
        "tart processes killed after {killed_after:?}"
    );
    exec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successful_attempt_counts_tests_publishes_the_artifact_and_deletes_the_vm() {
    let rig = Rig::new();
    let dest = tempfile::tempdir().unwrap();
    let mut spec = spec(vec![
        step("build", "mkdir -p out && printf built > out/App.ipa && echo compiling"),
        step("test", &format!("printf '%s' '{JUNIT}' > out/junit.xml && echo tested")),
    ]);
    spec.test_report = Some("out/junit.xml".into());
    spec.artifacts = Some(Artifacts {
        paths: vec!["out/App.ipa".into()],
        destination: format!("file://{}/", dest.path().display()),
    });
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt(&rig, "ok", spec, signal);
    let vm = a.vm.clone();
    // Journal first, then act: at each record, nothing of its actions has happened yet.
    let (deadline_file, vm_dir) = (rig.deadline_file(&vm), rig.vm_dir(&vm));
    let journal = MemJournal::with_hook(move |r| match r.to {
        S::Admitted => assert!(
            !deadline_file.exists(),
            "deadline file written before Admitted was journaled"
        ),
        S::Booting => {
            assert!(deadline_file.is_file(), "Booting journaled without a deadline file");
            assert!(!vm_dir.exists(), "VM cloned before Booting was journaled");
        }
        _ => {}
    });
    let mut hooks = journal.clone();
    let end = tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(600), &machine(), &mut hooks))
        .await
        .expect("attempt finished in time")
        .unwrap();
    assert_eq!(end, S::Retired);
    let lines = journal.lines();
    assert_eq!(
        journal.states(),
        vec![
            S::Admitted,
            S::Booting,
            S::Running,
            S::Running,
            S::Collecting,
            S::Retiring,
            S::Retired
        ],
        "{lines:#?}"
    );
    assert!(
        lines[2].contains("Booting -> Running (GuestReady) tart exec ready after "),
        "{lines:#?}"
    );
    assert!(
        lines[3].ends_with("Running -> Running (StepStarted) step build exited 0; starting test (2/2)"),
        "each step's start is journaled before it runs: {lines:#?}"
    );
    assert!(
        lines[4].contains("Running -> Collecting 2 step(s) succeeded"),
        "{lines:#?}"
    );
    assert!(
        lines[5].ends_with("Collecting -> Retiring (TestsPassed) 2/2 tests passed outcome=Succeeded"),
        "{lines:#?}"
    );
    assert!(
        lines[6].contains("Retiring -> Retired (VMDeleted) stopped and deleted in "),
        "{lines:#?}"
    );
    let results = exec.results();
    assert_eq!((results.tests_passed, results.tests_total), (Some(2), Some(2)));
    let url = results.artifact_url.expect("artifact url");
    let published = dest.path().join(&vm).join("out/App.ipa");
    assert_eq!(url, format!("file://{}", published.display()));
    assert_eq!(std::fs::read_to_string(&published).unwrap(), "built");
    // The VM, its processes, its deadline file and the host copies are gone; the logs stay.
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
    assert!(rig.tart.client_pids(&vm).unwrap().is_empty());
    assert!(!rig.deadline_file(&vm).exists());
    assert!(!rig.state.path().join("tmp").join(&vm).exists());
    let log = std::fs::read_to_string(rig.state.path().join("logs").join(&vm).join("build.log")).unwrap();
    assert_eq!(log, "compiling\n");
    assert_eq!(exec.last_step(), Some(("test", "tested\n")));
    // Status deliveries went to the runtime, not to the executor.
    let others = journal.other_actions.lock().unwrap().clone();
    assert!(
        others.contains(&tartan_agent::machine::Action::DeliverStatus),
        "{others:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_step_stops_the_build_with_its_exit_code_and_deletes_the_vm() {
    let rig = Rig::new();
    let spec = spec(vec![
        step("build", "echo oops >&2; exit 3"),
        step("never", "touch ran-never"),
    ]);
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt(&rig, "fail", spec, signal);
    let mut journal = MemJournal::new();
    let end = tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(600), &machine(), &mut journal))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(end, S::Retired);
    let retiring = &journal.records.lock().unwrap()[3];
    assert_eq!(
        (retiring.reason, retiring.outcome, retiring.detail.as_str()),
        (
            Some(Reason::StepFailed),
            Some(Outcome::Failed),
            "step build exited 3; its output ends:\noops"
        )
    );
    assert_eq!(exec.last_step(), Some(("build", "oops")));
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
    assert!(!rig.deadline_file(&a.vm).exists());
}

/// Found by the crash-point sweep (2 slots, `step.start.after`, group kill): the agent's process
/// group died while another build's step start was between its `mkdir` and the launch. The step
/// never ran, so the attempt is interrupted (and retried), not failed as if the step had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_start_was_cut_before_the_launch_interrupts_the_attempt() {
    let rig = Rig::new();
    let spec = spec(vec![step("build", "touch ran")]);
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt(&rig, "cut", spec, signal);
    let (vm, vm_dir) = (a.vm.clone(), rig.vm_dir(&a.vm));
    let folder = vm_dir.join(tartan_agent::host::guest_job::job_dir(&vm, 0, "build"));
    let planted = folder.clone();
    // As if a start call was killed between its mkdir and the launch, before this one.
    let mut journal = MemJournal::with_hook(move |r| {
        if r.to == S::Running {
            std::fs::create_dir_all(&planted).unwrap();
        }
    });
    let t0 = Instant::now();
    let end = tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(600), &machine(), &mut journal))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(end, S::Retired);
    let retiring = journal
        .records
        .lock()
        .unwrap()
        .iter()
        .find(|r| r.to == S::Retiring)
        .cloned()
        .unwrap();
    assert_eq!(
        (retiring.reason, retiring.outcome),
        (Some(Reason::AgentFault), Some(Outcome::Interrupted)),
        "{retiring}"
    );
    assert!(retiring.detail.contains("never launched"), "{retiring}");
    assert!(t0.elapsed() >= rig.config().step_no_pid_limit);
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
}

/// The status the runtime would report after each of `records` (as `Shared::journal` does).
fn status_after(records: &[tartan_agent::record::Record]) -> tartan_api::MacBuildStatus {
    let mut attempt = Attempt::from_record(&records[0], 2).unwrap();
    let mut status = tartan_api::MacBuildStatus::default();
    for r in records {
        attempt.observe(r);
        let who = tartan_agent::status::Reporter {
            holder: "mac-test",
            epoch: 1,
            results: None,
            retry_follows: false,
            generation: Some(1),
            logs: None,
        };
        status = tartan_agent::status::next_status(&status, &attempt, r, &who);
    }
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_step_reports_its_name_exit_code_and_last_lines_cleaned() {
    let rig = Rig::new();
    // 100 lines with colour codes, a NUL and an invalid byte each, then exit 3.
    let script = r#"i=1; while [ $i -le 100 ]; do printf '\033[1;31mline %d\033[0m\000\377 end\r\n' $i; i=$((i+1)); done; exit 3"#;
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt(&rig, "noisy", spec(vec![step("build", script)]), signal);
    let mut journal = MemJournal::new();
    let end = tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(600), &machine(), &mut journal))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(end, S::Retired);
    let records = journal.records.lock().unwrap().clone();
    let retiring = &records[3];
    let last: Vec<String> = (72..=100).map(|i| format!("line {i} end")).collect();
    let want = format!("step build exited 3; its output ends:\n…\n{}", last.join("\n"));
    assert_eq!(
        (retiring.reason, retiring.outcome, retiring.detail.as_str()),
        (Some(Reason::StepFailed), Some(Outcome::Failed), want.as_str())
    );
    // The output part: at most 30 lines, 4 KiB, no control characters but newlines.
    let output = &want["step build exited 3; its output ends:\n".len()..];
    assert_eq!(output.lines().count(), 30);
    assert!(output.len() <= 4096);
    assert!(retiring.detail.chars().all(|c| c == '\n' || !c.is_control()));
    // The status (journaled with the terminal records, so recovery delivers the same) says it.
    let status = status_after(&records);
    assert_eq!(status.message, Some(format!("attempt 1 failed: {want}")));
    assert_eq!(status.attempts[0].message.as_deref(), Some(want.as_str()));
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_argv_the_os_refuses_fails_with_that_cause() {
    let rig = Rig::new();
    // Over Linux's 128 KiB per argument and macOS's 1 MiB in all.
    let huge = Step {
        name: "build".into(),
        run: vec!["echo".into(), "x".repeat(4 << 20)],
        timeout_seconds: None,
    };
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt(&rig, "e2big", spec(vec![huge]), signal);
    let mut journal = MemJournal::new();
    tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(600), &machine(), &mut journal))
        .await
        .unwrap()
        .unwrap();
    let retiring = journal.records.lock().unwrap()[3].clone();
    assert_eq!(retiring.reason, Some(Reason::StepFailed));
    assert!(
        retiring
            .detail
            .starts_with("step build could not be run: step \"build\" in mb-ci-e2big-")
            && retiring.detail.contains("could not be started: could not start `"),
        "{}",
        retiring.detail
    );
    assert!(
        retiring
            .detail
            .contains("bytes in all, are more than the operating system accepts (Argument list too long); nothing ran"),
        "{}",
        retiring.detail
    );
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());

    // A NUL byte cannot be passed to any program either; the cause names the argument.
    let nul = Step {
        name: "build".into(),
        run: vec!["echo".into(), "a\0b".into()],
        timeout_seconds: None,
    };
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt(&rig, "nul", spec(vec![nul]), signal);
    let mut journal = MemJournal::new();
    tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(600), &machine(), &mut journal))
        .await
        .unwrap()
        .unwrap();
    let retiring = journal.records.lock().unwrap()[3].clone();
    assert!(
        retiring
            .detail
            .contains("contains a NUL byte, which no program can receive; nothing ran"),
        "{}",
        retiring.detail
    );
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_test_report_fails_the_attempt_with_the_parse_error() {
    let rig = Rig::new();
    let mut spec = spec(vec![step(
        "test",
        "mkdir -p out && echo '<testsuite><testcase>' > out/junit.xml",
    )]);
    spec.test_report = Some("out/junit.xml".into());
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt(&rig, "badxml", spec, signal);
    let mut journal = MemJournal::new();
    tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(600), &machine(), &mut journal))
        .await
        .unwrap()
        .unwrap();
    let retiring = journal.records.lock().unwrap()[4].clone();
    assert_eq!(
        (retiring.to, retiring.reason, retiring.outcome),
        (S::Retiring, Some(Reason::TestsFailed), Some(Outcome::Failed))
    );
    let why = exec.report_error().expect("the parse error is kept");
    assert!(
        why.starts_with("test report out/junit.xml is not well-formed XML: "),
        "{why}"
    );
    // The parse error is the journaled cause, so it reaches the status and the pipeline.
    assert_eq!(
        retiring.detail,
        format!("test report unusable, so the build is not counted as passed: {why}")
    );
    assert!(rig.vms().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_delete_quarantines_the_vm_until_the_fault_is_lifted() {
    let rig = Rig::new();
    let (_cancel, signal) = cancel_pair();
    let (a, exec) = attempt(&rig, "stuck", spec(vec![step("build", "true")]), signal);
    let vm = a.vm.clone();
    rig.set_faults(&vm_fault(
        &vm,
        Fault {
            delete_fails: Some(true),
            ..Fault::default()
        },
    ));
    let journal = MemJournal::new();
    let task = spawn_drive(exec, a, &journal);
    wait_for("Quarantined", LIMIT, || journal.has_state(S::Quarantined).then_some(())).await;
    let q = journal.last();
    assert_eq!(q.reason, Some(Reason::DeleteFailed));
    assert!(q.detail.contains("injected fault delete_fails"), "{q}");
    assert_eq!(
        rig.vms(),
        vec![vm.clone()],
        "the quarantined VM is named and still there"
    );
    assert!(
        rig.deadline_file(&vm).is_file(),
        "the watchdog keeps its deadline file meanwhile"
    );
    rig.set_faults(&Faults::default());
    let (end, _exec) = tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    assert_eq!(end.unwrap(), S::Retired);
    assert_eq!(
        journal.last().to_string(),
        format!(
            "#{} a1 Quarantined -> Retired (Resolved) clone directory gone (deleted on retry); slot released",
            journal.records.lock().unwrap().len()
        )
    );
    assert!(rig.vms().is_empty());
    assert!(!rig.deadline_file(&vm).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_vm_directory_is_never_cloned_over_nor_deleted() {
    let rig = Rig::new();
    let (_cancel, signal) = cancel_pair();
    let (a, exec) = attempt(&rig, "taken", spec(vec![step("build", "true")]), signal);
    let vm = a.vm.clone();
    rig.tart.clone_vm(IMAGE, &vm).await.unwrap();
    let marker = rig.vm_dir(&vm).join("operator-was-here");
    std::fs::write(&marker, "x").unwrap();
    let journal = MemJournal::new();
    let task = spawn_drive(exec, a, &journal);
    wait_for("Quarantined", LIMIT, || journal.has_state(S::Quarantined).then_some(())).await;
    let lines = journal.lines();
    assert!(lines[2].contains("(VMStartFailed) VM did not start: "), "{lines:#?}");
    assert!(
        lines[2].contains("already exists before the clone; refusing to clone"),
        "{lines:#?}"
    );
    assert!(
        lines[3].contains("it existed before this attempt's clone, so it is not deleted"),
        "{lines:#?}"
    );
    assert!(marker.is_file(), "the foreign VM was not touched");
    // An operator removes it; the quarantine resolves.
    rig.tart.delete(&vm).await.unwrap();
    assert_eq!(
        tokio::time::timeout(LIMIT, task).await.unwrap().unwrap().0.unwrap(),
        S::Retired
    );
    assert!(journal.last().to_string().contains("Quarantined -> Retired (Resolved)"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_during_a_slow_clone_kills_the_clone_at_once() {
    let rig = Rig::new();
    let (cancel, signal) = cancel_pair();
    let (a, exec) = attempt(&rig, "cancel-clone", spec(vec![step("build", "true")]), signal);
    let vm = a.vm.clone();
    rig.set_faults(&vm_fault(
        &vm,
        Fault {
            clone_delay_secs: Some(60.0),
            ..Fault::default()
        },
    ));
    let journal = MemJournal::new();
    let task = spawn_drive(exec, a, &journal);
    let clone_pids = wait_for("the tart clone process", LIMIT, || {
        let pids = rig.tart.client_pids(&vm).unwrap();
        (!pids.is_empty()).then_some(pids)
    })
    .await;
    assert!(!rig.tmp_entries().is_empty(), "the clone is in flight in tmp/");
    let exec = cancel_and_measure("clone", &cancel, Withdrawal::CancelRequested, &clone_pids, task).await;
    let lines = journal.lines();
    assert!(
        lines[2].ends_with("Booting -> Retiring (CancelRequested) cancel requested outcome=Cancelled"),
        "{lines:#?}"
    );
    assert!(
        lines[3].contains("Retiring -> Retired (VMDeleted) stopped and deleted in "),
        "{lines:#?}"
    );
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
    assert!(
        rig.tmp_entries().is_empty(),
        "tart's GC removed the killed clone's tmp dir"
    );
    assert!(!rig.deadline_file(&exec.attempt().vm).exists());
}

/// The journal fails once the guest is running (a full disk): the attempt stops where the
/// journal left it, but its VM is stopped and deleted anyway instead of running until the
/// watchdog's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_that_fails_mid_build_still_gets_the_vm_deleted() {
    let rig = Rig::new();
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt(&rig, "full-disk", spec(vec![step("build", "true")]), signal);
    let vm = a.vm.clone();
    // Requested is the caller's; Admitted, Booting and Running are written, Collecting fails.
    let mut journal = MemJournal {
        fail_after: Some(3),
        ..MemJournal::new()
    };
    let end = tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(600), &machine(), &mut journal))
        .await
        .expect("drive ends");
    assert!(matches!(end, Err(DriveError::Journal { .. })), "{end:?}");
    assert_eq!(journal.states().last(), Some(&S::Running), "{:#?}", journal.lines());
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
    assert!(
        rig.tart.client_pids(&vm).unwrap().is_empty(),
        "no tart process of {vm} is left"
    );
}

/// Another tart command collects the clone's temporary directory before the clone locked it (tart
/// creates `tmp/<uuid>` first): the clone fails "failed to lock", nothing is made, and the
/// executor clones again within the attempt instead of failing the build `VMStartFailed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_whose_tmp_dir_is_collected_is_cloned_again() {
    let rig = Rig::new();
    let (_cancel, signal) = cancel_pair();
    let (a, exec) = attempt(&rig, "tmp-race", spec(vec![step("build", "true")]), signal);
    let vm = a.vm.clone();
    rig.set_faults(&vm_fault(
        &vm,
        Fault {
            clone_tmp_unlocked_secs: Some(8.0),
            ..Fault::default()
        },
    ));
    let journal = MemJournal::new();
    let task = spawn_drive(exec, a, &journal);
    wait_for("the clone's unlocked tmp entry", LIMIT, || {
        (!rig.tmp_entries().is_empty()).then_some(())
    })
    .await;
    // Any other tart command collects it; the next clone has no such window.
    rig.set_faults(&Faults::default());
    rig.tart.list().await.expect("tart list");
    assert!(
        rig.tmp_entries().is_empty(),
        "tart list collected the unlocked tmp entry"
    );
    let (end, _exec) = tokio::time::timeout(LIMIT, task).await.expect("attempt ends").unwrap();
    assert_eq!(end.unwrap(), S::Retired);
    let records = journal.records.lock().unwrap().clone();
    let retiring = records
        .iter()
        .find(|r| r.to == S::Retiring)
        .expect("Retiring journaled");
    assert_eq!(retiring.outcome, Some(Outcome::Succeeded), "{:#?}", journal.lines());
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
}

/// A clone that hangs until the host deadline: no VM ever existed, so the watchdog cannot have
/// deleted it — the attempt fails `DeadlinePassed` (not `WatchdogDeadline`), and the hung tart
/// clone is killed, not left running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_hanging_past_the_deadline_is_killed_and_recorded_as_deadline_passed() {
    let rig = Rig::new();
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt(&rig, "hung-clone", spec(vec![step("build", "true")]), signal);
    let vm = a.vm.clone();
    rig.set_faults(&vm_fault(
        &vm,
        Fault {
            clone_delay_secs: Some(600.0),
            ..Fault::default()
        },
    ));
    let mut journal = MemJournal::new();
    let end = tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(3), &machine(), &mut journal))
        .await
        .expect("the deadline ends the hung clone")
        .unwrap();
    assert_eq!(end, S::Retired);
    let records = journal.records.lock().unwrap().clone();
    let retiring = records
        .iter()
        .find(|r| r.to == S::Retiring)
        .expect("Retiring journaled");
    assert_eq!(
        (retiring.from, retiring.reason, retiring.outcome),
        (Some(S::Booting), Some(Reason::DeadlinePassed), Some(Outcome::Failed)),
        "{:#?}",
        journal.lines()
    );
    assert!(!retiring.detail.contains("watchdog"), "{retiring}");
    wait_for("the hung tart clone to be gone", Duration::from_secs(5), || {
        rig.tart.client_pids(&vm).unwrap().is_empty().then_some(())
    })
    .await;
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
}

/// Attempt `name` held in a 60 s boot, then withdrawn for `why` (checked to kill `tart run` at
/// once): the rig, the journal and the VM's name, for the caller's assertions.
async fn withdrawn_during_boot(name: &str, why: Withdrawal) -> (Rig, MemJournal, String) {
    let rig = Rig::new();
    let (cancel, signal) = cancel_pair();
    let (a, exec) = attempt(&rig, name, spec(vec![step("build", "true")]), signal);
    let vm = a.vm.clone();
    rig.set_faults(&vm_fault(
        &vm,
        Fault {
            boot_delay_secs: Some(60.0),
            ..Fault::default()
        },
    ));
    let journal = MemJournal::new();
    let task = spawn_drive(exec, a, &journal);
    let home = rig.home.path().to_path_buf();
    let run = wait_for("tart run holding the VM lock", LIMIT, || {
        tartan_tart::run_pid(&home, &vm).ok().flatten()
    })
    .await;
    let _exec = cancel_and_measure("boot", &cancel, why, &[run], task).await;
    (rig, journal, vm)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_during_boot_kills_tart_run_at_once() {
    let (rig, journal, vm) = withdrawn_during_boot("cancel-boot", Withdrawal::OwnerDeleted).await;
    let lines = journal.lines();
    assert!(
        lines[2].ends_with("Booting -> Retiring (OwnerDeleted) owner deleted outcome=Cancelled"),
        "{lines:#?}"
    );
    assert_eq!(journal.states().last(), Some(&S::Retired));
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
    assert!(
        rig.tart.client_pids(&vm).unwrap().is_empty(),
        "no tart process of the VM is left"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_interrupts_a_hanging_exec_and_fails_the_attempt() {
    let rig = Rig::new();
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt(&rig, "late", spec(vec![step("build", "true")]), signal);
    let vm = a.vm.clone();
    // Once the guest answered, every exec of this VM hangs: the build step never returns.
    let (home, hang_vm) = (rig.home.path().to_path_buf(), vm.clone());
    let journal = MemJournal::with_hook(move |r| {
        if r.to == S::Running {
            vm_fault(
                &hang_vm,
                Fault {
                    exec_hangs: Some(true),
                    ..Fault::default()
                },
            )
            .store(&home)
            .unwrap();
        }
    });
    let mut hooks = journal.clone();
    let started = Instant::now();
    let end = tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(4), &machine(), &mut hooks))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(end, S::Retired);
    let records = journal.records.lock().unwrap().clone();
    let deadline = records[0].deadline.unwrap();
    let retiring = &records[3];
    assert_eq!(
        (retiring.from, retiring.reason, retiring.outcome),
        (Some(S::Running), Some(Reason::DeadlinePassed), Some(Outcome::Failed)),
        "{:#?}",
        journal.lines()
    );
    assert!(retiring.time >= deadline);
    assert!(
        retiring.time < deadline + k8s_openapi::jiff::SignedDuration::from_secs(2),
        "interrupted {} after the deadline",
        deadline.duration_until(retiring.time)
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(records[4].to, S::Retired);
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
    assert!(
        rig.tart.client_pids(&vm).unwrap().is_empty(),
        "the hanging tart exec was killed"
    );
}

/// An agent paused past the deadline (here: the journal hook blocks the executor at Running) that
/// finds, on waking, both the deadline passed and a cancel requested meanwhile reports the
/// deadline, whose time came first. Found by e2e `watchdog-frozen-agent` on a real apiserver: the
/// thawed agent said "cancel requested" though the watchdog had deleted its VM after the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_seen_only_after_the_deadline_passed_ends_the_attempt_on_the_deadline() {
    let rig = Rig::new();
    let (cancel, signal) = cancel_pair();
    let cancel = Arc::new(Mutex::new(cancel));
    let (mut a, mut exec) = attempt(&rig, "paused", spec(vec![step("build", "true")]), signal);
    let deadline_seen = Arc::new(Mutex::new(None));
    let journal = {
        let (cancel, deadline_seen) = (cancel.clone(), deadline_seen.clone());
        MemJournal::with_hook(move |r| {
            if r.to == S::Admitted {
                *deadline_seen.lock().unwrap() = r.deadline;
            }
            if r.to == S::Running {
                // The pause: the executor is held here until past its deadline, and the cancel
                // comes in meanwhile.
                let deadline = deadline_seen.lock().unwrap().expect("Admitted names the deadline");
                while k8s_openapi::jiff::Timestamp::now() <= deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
                cancel.lock().unwrap().cancel(Withdrawal::CancelRequested);
            }
        })
    };
    let mut hooks = journal.clone();
    let end = tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(1), &machine(), &mut hooks))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(end, S::Retired);
    let records = journal.records.lock().unwrap().clone();
    let retiring = records
        .iter()
        .find(|r| r.to == S::Retiring)
        .unwrap_or_else(|| panic!("no Retiring record: {:#?}", journal.lines()));
    assert_eq!(
        (retiring.from, retiring.reason, retiring.outcome),
        (Some(S::Running), Some(Reason::DeadlinePassed), Some(Outcome::Failed)),
        "{:#?}",
        journal.lines()
    );
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
}

/// The other order: the cancel is seen before the deadline, but the executor gets to act on it
/// only after the deadline (here: the journal write after Running takes past it, as a slow sync
/// may). The cancel came first, so the pipeline is told Cancelled, not that the time ran out;
/// before the fix any withdrawal found waiting past the deadline was reported as the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_seen_before_the_deadline_but_acted_on_after_it_cancels_the_attempt() {
    let rig = Rig::new();
    let (cancel, signal) = cancel_pair();
    let cancel = Arc::new(Mutex::new(cancel));
    let (mut a, mut exec) = attempt(&rig, "slow-sync", spec(vec![step("build", "true")]), signal);
    let deadline_seen = Arc::new(Mutex::new(None));
    let journal = {
        let (cancel, deadline_seen) = (cancel.clone(), deadline_seen.clone());
        MemJournal::with_hook(move |r| {
            if r.to == S::Admitted {
                *deadline_seen.lock().unwrap() = r.deadline;
            }
            if r.to == S::Running {
                let deadline = deadline_seen.lock().unwrap().expect("Admitted names the deadline");
                assert!(
                    k8s_openapi::jiff::Timestamp::now() < deadline,
                    "Running came after the deadline"
                );
                cancel.lock().unwrap().cancel(Withdrawal::CancelRequested);
                // The slow sync: the record is done only after the deadline.
                while k8s_openapi::jiff::Timestamp::now() <= deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        })
    };
    let mut hooks = journal.clone();
    let end = tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(2), &machine(), &mut hooks))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(end, S::Retired);
    let records = journal.records.lock().unwrap().clone();
    let retiring = records
        .iter()
        .find(|r| r.to == S::Retiring)
        .unwrap_or_else(|| panic!("no Retiring record: {:#?}", journal.lines()));
    assert_eq!(
        (retiring.from, retiring.reason, retiring.outcome),
        (
            Some(S::Running),
            Some(Reason::CancelRequested),
            Some(Outcome::Cancelled)
        ),
        "{:#?}",
        journal.lines()
    );
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_macbuild_without_a_destination_publishes_to_the_configured_default() {
    let rig = Rig::new();
    let dest = tempfile::tempdir().unwrap();
    let mut spec = spec(vec![step("build", "mkdir -p out && printf built > out/App.ipa")]);
    spec.artifacts = Some(Artifacts {
        paths: vec!["out/App.ipa".into()],
        destination: String::new(),
    });
    let (_cancel, signal) = cancel_pair();
    let b = host_common::build("default-dest");
    let vm = tartan_api::vm_name(&b.namespace, &b.name, &b.uid, 1);
    let mut a = Attempt::new(b.clone(), 1, vm.clone(), 2);
    let mut cfg = rig.config();
    cfg.artifacts.destination = Some(format!("file://{}/", dest.path().display()));
    let host = tartan_agent::host::HostAttempt {
        build: b,
        attempt: 1,
        vm: vm.clone(),
        spec,
        deadline: k8s_openapi::jiff::Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_secs(3600),
        agent: "mac-test".into(),
    };
    let mut exec = AttemptExecutor::new(host, rig.tart.clone(), cfg, signal);
    let mut journal = MemJournal::new();
    let end = tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(600), &machine(), &mut journal))
        .await
        .expect("attempt finished in time")
        .unwrap();
    assert_eq!(end, S::Retired);
    assert_eq!(a.outcome, Some(Outcome::Succeeded), "{:?}", journal.lines());
    let published = dest.path().join(&vm).join("out/App.ipa");
    assert_eq!(std::fs::read_to_string(&published).unwrap(), "built");
    assert_eq!(
        exec.results().artifact_url,
        Some(format!("file://{}", published.display()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_the_agent_config_refuses_fails_the_build_before_anything_is_cloned() {
    let elsewhere = tempfile::tempdir().unwrap();
    // (destination, allowed_file_roots emptied?, what the reason must say)
    let cases = |rig: &Rig| {
        vec![
            (
                format!("file://{}/journal/", rig.state.path().display()),
                false,
                "inside the agent's state_dir".to_string(),
            ),
            (
                format!("file://{}/vms/mb-other/", rig.home.path().display()),
                false,
                "inside the agent's tart_home".to_string(),
            ),
            (
                format!("file://{}/", elsewhere.path().display()),
                true,
                "only under [artifacts] allowed_file_roots, which lists none".to_string(),
            ),
        ]
    };
    for case in 0..3 {
        let rig = Rig::new();
        let (destination, no_roots, why) = cases(&rig).swap_remove(case);
        let mut spec = spec(vec![step("build", "printf built > App.ipa")]);
        spec.artifacts = Some(Artifacts {
            paths: vec!["App.ipa".into()],
            destination: destination.clone(),
        });
        let b = host_common::build(&format!("refused-{case}"));
        let vm = tartan_api::vm_name(&b.namespace, &b.name, &b.uid, 1);
        let mut a = Attempt::new(b.clone(), 1, vm.clone(), 2);
        let mut cfg = rig.config();
        if no_roots {
            cfg.artifacts.allowed_file_roots.clear();
        }
        let host = tartan_agent::host::HostAttempt {
            build: b,
            attempt: 1,
            vm: vm.clone(),
            spec,
            deadline: k8s_openapi::jiff::Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_secs(3600),
            agent: "mac-test".into(),
        };
        let (_cancel, signal) = cancel_pair();
        let mut exec = AttemptExecutor::new(host, rig.tart.clone(), cfg, signal);
        let journal = MemJournal::new();
        let mut hooks = journal.clone();
        let end = tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(600), &machine(), &mut hooks))
            .await
            .expect("attempt finished in time")
            .unwrap();
        assert_eq!(end, S::Retired);
        assert_eq!(a.outcome, Some(Outcome::Failed));
        assert_eq!(
            journal.states(),
            vec![S::Admitted, S::Retiring, S::Retired],
            "{destination}"
        );
        let refused = journal.lines()[1].clone();
        assert!(refused.contains("(VMStartFailed)"), "{refused}");
        assert!(refused.contains(&format!("{destination:?} is refused")), "{refused}");
        assert!(refused.contains(&why), "{refused}");
        assert!(refused.contains("; nothing was cloned"), "{refused}");
        assert!(rig.vms().is_empty(), "nothing was cloned");
        assert!(!rig.deadline_file(&vm).exists());
        assert!(
            !rig.state.path().join("journal").exists(),
            "nothing was written at {destination}"
        );
        assert!(std::fs::read_dir(elsewhere.path()).unwrap().next().is_none());
    }
}

/// A resumed attempt whose journal started a step the MacBuild no longer has (an admin patch
/// removed steps while the agent was stopped): never `StepsSucceeded` (that ended a build `True`
/// with "0/0 tests passed"), but `SpecChanged`, which interrupts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_index_past_the_end_of_the_steps_is_never_a_success() {
    use k8s_openapi::jiff::{SignedDuration, Timestamp};
    use tartan_agent::host::Performed;
    use tartan_agent::machine::{Action, Event};
    let rig = Rig::new();
    let (_cancel, signal) = cancel_pair();
    let (a, mut exec) = attempt(&rig, "spec-shrunk", spec(vec![step("build", "echo built")]), signal);
    let vm = a.vm.clone();
    let deadline = Timestamp::now() + SignedDuration::from_secs(600);
    for action in [
        Action::WriteDeadlineFile {
            vm: vm.clone(),
            deadline,
        },
        Action::CloneVm { vm: vm.clone() },
        Action::SetVm { vm: vm.clone() },
        Action::StartVm { vm: vm.clone() },
    ] {
        assert_eq!(exec.perform(&action).await, Performed::Done, "{action:?}");
    }
    assert!(matches!(
        exec.perform(&Action::ProbeReady { vm: vm.clone() }).await,
        Performed::Event(Event::GuestReady { .. })
    ));
    let past_the_end = tokio::time::timeout(
        LIMIT,
        exec.perform(&Action::RunStep {
            vm: vm.clone(),
            index: 1,
            since: Timestamp::now(),
        }),
    )
    .await
    .unwrap();
    match past_the_end {
        Performed::Event(Event::SpecChanged { change, at_start: None }) => assert_eq!(
            change,
            "the journal started step 2 of the attempt, the MacBuild now has 1 step(s) in all"
        ),
        other => panic!("{other:?}"),
    }
    let deleted = exec
        .perform(&Action::StopAndDeleteVm {
            vm: vm.clone(),
            context: tartan_agent::machine::DeleteContext::Normal,
        })
        .await;
    assert!(
        matches!(deleted, Performed::Event(Event::VmDeleted { .. })),
        "{deleted:?}"
    );
}

/// A holder whose claim moved (a status write of its attempt fenced out) stops the attempt at
/// once, deletes its own VM and frees the slot, with no outcome of its own (the new holder's is
/// the build's). Before the fix nothing withdrew it and it ran its copy of the build to the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_moved_to_another_holder_stops_the_attempt_and_deletes_its_vm() {
    let (rig, journal, _) = withdrawn_during_boot("fenced-boot", Withdrawal::ClaimMoved).await;
    let lines = journal.lines();
    assert!(
        lines[2].ends_with(
            "Booting -> Retiring (ClaimLost) claim moved to another holder (a status write of this attempt was fenced \
             out); this attempt stops and deletes its VM"
        ),
        "{lines:#?}"
    );
    assert_eq!(journal.states().last(), Some(&S::Retired));
    assert!(journal.records.lock().unwrap().iter().all(|r| r.outcome.is_none()));
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
}

/// Drives attempt `name` of `spec` with `cfg` to its end within 30 s (once a hostile guest file
/// held it until its deadline) and returns the journal's Collecting -> Retiring line.
async fn collecting_ends(rig: &Rig, name: &str, spec: tartan_api::MacBuildSpec, cfg: ExecutorConfig) -> String {
    let within = Duration::from_secs(30);
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt_with(rig, name, spec, signal, cfg);
    let mut journal = MemJournal::new();
    let started = Instant::now();
    let end = tokio::time::timeout(within, drive(&mut exec, &mut a, admit(600), &machine(), &mut journal))
        .await
        .unwrap_or_else(|_| panic!("{name}: still not over after {within:?} (held in Collecting?)"))
        .unwrap();
    assert_eq!(end, S::Retired, "{name}");
    eprintln!("{name}: over in {:?}", started.elapsed());
    journal
        .lines()
        .into_iter()
        .find(|l| l.contains("Collecting -> Retiring"))
        .unwrap_or_else(|| panic!("{name}: no Collecting -> Retiring in {:#?}", journal.lines()))
}

/// Once a JUnit report that is a FIFO or /dev/zero held the build in Collecting until its
/// deadline while the agent pumped zeros, and the message never named the file. Now only a
/// regular file within the cap is read, at once refused otherwise, naming it and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_test_report_that_is_no_regular_file_or_too_big_fails_at_once_naming_it() {
    let rig = Rig::new();
    let cap = rig.config().report_cap;
    let too_big = format!("out/junit.xml is 68719476736 bytes, more than the {cap}-byte limit");
    for (name, script, why) in [
        ("fifo", "mkfifo out/junit.xml", "out/junit.xml is not a regular file"),
        (
            "zero",
            "ln -s /dev/zero out/junit.xml",
            "out/junit.xml is not a regular file",
        ),
        (
            "device",
            "ln -s /dev/null out/junit.xml",
            "out/junit.xml is not a regular file",
        ),
        ("folder", "mkdir out/junit.xml", "out/junit.xml is not a regular file"),
        // 64 GiB that take no room: measured from the metadata, never read.
        (
            "sparse",
            "dd if=/dev/zero of=out/junit.xml bs=1 count=0 seek=68719476736 2>/dev/null",
            too_big.as_str(),
        ),
        ("missing", "true", "out/junit.xml does not exist"),
    ] {
        let mut spec = spec(vec![step("test", &format!("mkdir -p out && {script}"))]);
        spec.test_report = Some("out/junit.xml".into());
        let line = collecting_ends(&rig, name, spec, rig.config()).await;
        assert!(
            line.contains("(TestsFailed)")
                && line.contains("test report out/junit.xml could not be read from the guest: ")
                && line.contains(why),
            "{name}: {line}"
        );
    }
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
}

/// The same for artifacts: a FIFO, /dev/zero, a folder and a file over the cap each fail the
/// upload at once, naming the file; nothing is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_artifact_that_is_no_regular_file_or_too_big_fails_at_once_naming_it() {
    let rig = Rig::new();
    let dest = tempfile::tempdir().unwrap();
    let mut cfg = rig.config();
    cfg.artifact_cap = 1 << 20;
    for (name, script, why) in [
        ("fifo", "mkfifo out/App.ipa", "out/App.ipa is not a regular file"),
        (
            "zero",
            "ln -s /dev/zero out/App.ipa",
            "out/App.ipa is not a regular file",
        ),
        ("folder", "mkdir out/App.ipa", "out/App.ipa is not a regular file"),
        (
            "big",
            "dd if=/dev/zero of=out/App.ipa bs=1 count=0 seek=1048577 2>/dev/null",
            "out/App.ipa is 1048577 bytes, more than the 1048576-byte limit",
        ),
    ] {
        let mut spec = spec(vec![step("build", &format!("mkdir -p out && {script}"))]);
        spec.artifacts = Some(Artifacts {
            paths: vec!["out/App.ipa".into()],
            destination: format!("file://{}/", dest.path().display()),
        });
        let line = collecting_ends(&rig, name, spec, cfg.clone()).await;
        assert!(
            line.contains("artifact out/App.ipa could not be read from the guest: ") && line.contains(why),
            "{name}: {line}"
        );
    }
    // Only the step logs went there.
    for vm in std::fs::read_dir(dest.path()).unwrap() {
        let names: Vec<_> = std::fs::read_dir(vm.unwrap().path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec!["logs"], "nothing but the logs published");
    }
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
}

/// The adversary's run, whole: a build that can write where its artifacts go (here the guest is
/// the host, as with a read-write mount inside an allowed root) replaces its attempt folder with
/// a link to the state dir's `deadlines/` and names an artifact after another build's deadline
/// file. Once the upload wrote through the link (the watchdog then deleted the other build's VM)
/// and the build reported success; now the upload fails naming the link and nothing lands there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_folder_replaced_by_a_link_is_never_written_through() {
    let rig = Rig::new();
    let dest = tempfile::tempdir().unwrap();
    let dest_dir = std::fs::canonicalize(dest.path()).unwrap();
    let deadlines = rig.state.path().join("deadlines");
    std::fs::create_dir_all(&deadlines).unwrap();
    let other = deadlines.join("mb-other.json");
    std::fs::write(&other, b"the other build's deadline").unwrap();
    let (_cancel, signal) = cancel_pair();
    // The VM name is known once the attempt exists; the step needs it, so make the attempt
    // twice: the first only tells the name the second (same build, same attempt) gets.
    let vm = attempt(&rig, "links", spec(vec![]), signal.clone()).0.vm;
    let plant = format!(
        "printf forged > mb-other.json && rm -rf {d}/{vm} && ln -s {deadlines} {d}/{vm}",
        d = dest_dir.display(),
        deadlines = deadlines.display()
    );
    let mut spec = spec(vec![step("build", &plant)]);
    spec.artifacts = Some(Artifacts {
        paths: vec!["mb-other.json".into()],
        destination: format!("file://{}/", dest_dir.display()),
    });
    let (mut a, mut exec) = attempt(&rig, "links", spec, signal);
    assert_eq!(a.vm, vm);
    let mut journal = MemJournal::new();
    tokio::time::timeout(LIMIT, drive(&mut exec, &mut a, admit(600), &machine(), &mut journal))
        .await
        .expect("attempt finished in time")
        .unwrap();
    let line = journal
        .lines()
        .into_iter()
        .find(|l| l.contains("Collecting -> Retiring"))
        .unwrap();
    assert!(
        line.contains("(ArtifactUploadFailed)")
            && line.contains(&format!("{} is a symbolic link", dest_dir.join(&vm).display())),
        "{line}"
    );
    assert_eq!(std::fs::read(&other).unwrap(), b"the other build's deadline");
    let left: Vec<_> = std::fs::read_dir(&deadlines)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec!["mb-other.json"], "only the other build's file is there");
    assert!(rig.vms().is_empty());
}

/// A guest path that looks like an option is still a file name: once `cat -n` read the exec's
/// (empty) input instead of the report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_test_report_named_like_an_option_is_read_as_a_file() {
    let rig = Rig::new();
    let mut spec = spec(vec![step("test", &format!("printf '%s' '{JUNIT}' > ./-n"))]);
    spec.test_report = Some("-n".into());
    let line = collecting_ends(&rig, "dash", spec, rig.config()).await;
    assert!(line.contains("(TestsPassed) 2/2 tests passed"), "{line}");
}

//! Issue 13: an agent restart or upgrade no longer costs a build. The agent is stopped (SIGTERM,
//! as launchd's `bootout` during an upgrade) or `kill -9`ed mid-step; `tart run` and the step's
//! guest job outlive it, and the next agent (for the upgrade: another binary) resumes the same
//! attempt: `True/TestsPassed` as `#1`, the long step run once, no attempt 2. When the VM dies
//! with the agent, when the build is cancelled meanwhile, or when the agent stays away past the
//! deadline, the old paths apply.

use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::Duration;
use tartan_agent::record::Record;
use tartan_api::{AttemptState, Outcome, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack, wait_for};

/// launchd's `ExitTimeOut` for the agent: the stop must end well inside it.
const EXIT_TIME_OUT: Duration = Duration::from_secs(60);

/// A build whose second step counts its own runs in `long-step-runs` and then waits for the gate.
fn long_step_params(s: &Stack) -> Vec<(&'static str, Value)> {
    let dir = s.dir.display();
    let mut params = s.build_params(false);
    let steps = json!([
        format!("echo \"$PWD\" >> {dir}/started"),
        format!("echo run >> {dir}/long-step-runs; while [ ! -e {dir}/gate ]; do sleep 0.1; done; echo long step done"),
        "mkdir -p out && printf '<testsuite name=\"App\" tests=\"2\" failures=\"0\"><testcase name=\"a\"/><testcase name=\"b\"/></testsuite>' > out/junit.xml && echo app > out/App.ipa",
    ]);
    for p in params.iter_mut() {
        if p.0 == "steps" {
            p.1 = steps.clone();
        }
    }
    params.push(("timeout-seconds", json!("600")));
    params
}

fn long_step_runs(s: &Stack) -> usize {
    std::fs::read_to_string(s.dir.join("long-step-runs"))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

/// A stack with one agent (`opts`) and a build in its long step.
async fn in_the_long_step(name: &str, opts: AgentOptions) -> Stack {
    let mut s = Stack::new(name).await;
    s.add_agent("agent-a", opts);
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.create_run("build-1", &long_step_params(&s), None).await;
    wait_for("the long step to start", Duration::from_secs(60), || {
        (long_step_runs(&s) == 1)
            .then_some(())
            .ok_or(format!("{} run(s)", long_step_runs(&s)))
    })
    .await;
    s
}

fn journal_of(s: &Stack, pred: impl Fn(&Record) -> bool) -> Vec<Record> {
    s.journal("agent-a").into_iter().filter(|r| pred(r)).collect()
}

/// The attempt resumed, ended `True/TestsPassed` as `#1`, ran its long step once, and no attempt 2 exists.
async fn assert_resumed_and_passed(s: &Stack) -> Record {
    let resumed = s
        .wait_journal(
            "agent-a",
            "Running -> Running (Resumed)",
            Duration::from_secs(30),
            |r| r.reason == Some(Reason::Resumed) && r.to == AttemptState::Running,
        )
        .await;
    assert_eq!(resumed.attempt, Some(1), "{resumed}");
    s.open_gate();
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    assert_eq!(
        result(&run, "attempt"),
        Some("build-1#1"),
        "the same attempt ends the build"
    );
    assert_eq!(long_step_runs(s), 1, "the long step ran once");
    assert_eq!(s.builds_started(), 1, "the first step ran once");
    assert!(
        journal_of(s, |r| r.attempt == Some(2)).is_empty(),
        "no attempt 2:\n{}",
        s.journal_text("agent-a")
    );
    assert!(
        journal_of(s, |r| r.reason == Some(Reason::AgentRestarted)).is_empty(),
        "nothing interrupted"
    );
    resumed
}

/// Seconds from the agent's start to the step being followed again, as the Resumed record says.
fn resume_after(r: &Record) -> String {
    r.detail
        .split(" answering ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .unwrap_or("?")
        .to_string()
}

fn copy_of_the_agent(s: &Stack) -> PathBuf {
    let copy = s.dir.join("tartan-agent-upgraded");
    std::fs::copy(tartan_e2e::bins::bin("tartan-agent"), &copy).expect("copying the agent binary");
    copy
}

// scenario: agent-upgrade
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_upgrade_mid_step_resumes_the_same_attempt() {
    let mut s = in_the_long_step("agent-upgrade", AgentOptions::default()).await;
    let took = s.stop_agent("agent-a", EXIT_TIME_OUT);
    let detached = journal_of(&s, |r| r.reason == Some(Reason::Detached));
    assert_eq!(detached.len(), 1, "one Detached record:\n{}", s.journal_text("agent-a"));
    assert_eq!(detached[0].to, AttemptState::Running);
    // The VM and the step run on without the agent.
    let vms: Vec<String> = s.vms("agent-a").into_iter().filter(|v| v.starts_with("mb-")).collect();
    assert_eq!(vms.len(), 1, "{vms:?}");
    assert!(!s.tart_pids("agent-a").is_empty(), "tart run outlives the agent");
    let binary = copy_of_the_agent(&s);
    s.set_agent_binary("agent-a", &binary);
    s.start_agent("agent-a").await;
    let resumed = assert_resumed_and_passed(&s).await;
    eprintln!(
        "[e2e] agent-upgrade: SIGTERM to exit {took:?}; agent start to the step followed again: {}",
        resume_after(&resumed)
    );
    s.finish().await;
}

/// Two upgrades in a row: the second agent is stopped again at once, while it starts and
/// recovers (before or during its resume probe). The third resumes the same attempt; the step
/// ran once.
// scenario: two-quick-restarts
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_quick_restarts_mid_step_resume_the_same_attempt() {
    let mut s = in_the_long_step("two-quick-restarts", AgentOptions::default()).await;
    s.stop_agent("agent-a", EXIT_TIME_OUT);
    s.spawn_agent("agent-a");
    s.stop_agent("agent-a", EXIT_TIME_OUT);
    s.spawn_agent("agent-a");
    wait_for("the second agent's recovery", Duration::from_secs(30), || {
        let log = std::fs::read_to_string(s.dir.join("agent-a/agent-3.log")).unwrap_or_default();
        log.contains("recovery planned")
            .then_some(())
            .ok_or("not yet".to_string())
    })
    .await;
    s.stop_agent("agent-a", EXIT_TIME_OUT);
    s.start_agent("agent-a").await;
    assert_resumed_and_passed(&s).await;
    assert!(
        s.vms("agent-a").iter().all(|v| !v.starts_with("mb-")),
        "{:?}",
        s.vms("agent-a")
    );
    s.finish().await;
}

// scenario: agent-killed-resume
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_alone_mid_step_resumes_the_same_attempt() {
    let mut s = in_the_long_step("agent-killed-resume", AgentOptions::default()).await;
    s.kill_agent("agent-a", KillMode::Alone);
    s.start_agent("agent-a").await;
    let resumed = assert_resumed_and_passed(&s).await;
    eprintln!(
        "[e2e] agent-killed-resume: agent start to the step followed again: {}",
        resume_after(&resumed)
    );
    s.finish().await;
}

// scenario: agent-group-killed-resume
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_group_killed_mid_step_resumes_the_same_attempt() {
    // launchd's kill of the agent's process group: the VM is in its own session and survives.
    let mut s = in_the_long_step("agent-group-killed-resume", AgentOptions::default()).await;
    s.kill_agent("agent-a", KillMode::Group);
    s.start_agent("agent-a").await;
    assert_resumed_and_passed(&s).await;
    s.finish().await;
}

// scenario: agent-and-vm-killed
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_with_its_vms_retries_as_attempt_2() {
    let mut s = in_the_long_step("agent-and-vm-killed", AgentOptions::default()).await;
    s.kill_agent("agent-a", KillMode::GroupAndVms);
    s.open_gate();
    s.start_agent("agent-a").await;
    let r = s
        .wait_journal("agent-a", "Retiring (AgentRestarted)", Duration::from_secs(30), |r| {
            r.to == AttemptState::Retiring && r.reason == Some(Reason::AgentRestarted)
        })
        .await;
    assert_eq!(r.outcome, Some(Outcome::Interrupted));
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    assert_eq!(result(&run, "attempt"), Some("build-1#2"));
    assert!(journal_of(&s, |r| r.reason == Some(Reason::Resumed)).is_empty());
    assert_eq!(long_step_runs(&s), 2, "the long step ran in each attempt");
    s.finish().await;
}

// scenario: resume-cancelled
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_while_the_agent_is_away_the_vm_is_deleted_on_its_return() {
    let mut s = in_the_long_step("resume-cancelled", AgentOptions::default()).await;
    s.stop_agent("agent-a", EXIT_TIME_OUT);
    s.cancel_run("build-1").await;
    s.wait_macbuild("build-1", "cancel requested", Duration::from_secs(30), |m| {
        m["spec"]["cancelRequested"] == json!(true)
    })
    .await;
    s.start_agent("agent-a").await;
    let r = s
        .wait_journal("agent-a", "Retiring (CancelRequested)", Duration::from_secs(30), |r| {
            r.to == AttemptState::Retiring && r.reason == Some(Reason::CancelRequested)
        })
        .await;
    assert_eq!(r.outcome, Some(Outcome::Cancelled));
    s.wait_journal("agent-a", "the VM deleted", Duration::from_secs(30), |r| {
        r.to == AttemptState::Retired && r.reason == Some(Reason::VMDeleted)
    })
    .await;
    assert!(journal_of(&s, |r| r.reason == Some(Reason::Resumed)).is_empty());
    s.wait_run("build-1", "False", "CustomRunCancelled", Duration::from_secs(30))
        .await;
    assert!(
        s.vms("agent-a").iter().all(|v| !v.starts_with("mb-")),
        "{:?}",
        s.vms("agent-a")
    );
    s.finish().await;
}

// scenario: resume-past-deadline
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn away_past_the_deadline_the_watchdog_deletes_and_nothing_resumes() {
    let mut s = Stack::new("resume-past-deadline").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let mut params = long_step_params(&s);
    params.retain(|p| p.0 != "timeout-seconds");
    params.push(("timeout-seconds", json!("8")));
    params.push(("max-attempts", json!("1")));
    s.create_run("build-1", &params, None).await;
    wait_for("the long step to start", Duration::from_secs(60), || {
        (long_step_runs(&s) == 1).then_some(()).ok_or("not yet".to_string())
    })
    .await;
    let (vm, _) = s.admitted_vm("agent-a").await;
    s.stop_agent("agent-a", EXIT_TIME_OUT);
    s.start_watchdog("agent-a");
    s.wait_watchdog("agent-a", "the VM deleted", Duration::from_secs(30), |l| {
        l.vm == vm && l.action == tartan_watchdog::Action::Deleted
    })
    .await;
    s.start_agent("agent-a").await;
    let r = s
        .wait_journal("agent-a", "Retiring (WatchdogDeadline)", Duration::from_secs(30), |r| {
            r.to == AttemptState::Retiring && r.reason == Some(Reason::WatchdogDeadline)
        })
        .await;
    assert_eq!(r.outcome, Some(Outcome::Failed));
    assert!(journal_of(&s, |r| r.reason == Some(Reason::Resumed)).is_empty());
    let run = s.wait_run_ended("build-1", Duration::from_secs(30)).await;
    assert_eq!(
        run["status"]["conditions"][0]["status"],
        "False",
        "{}",
        tartan_e2e::stack::condition_text(&run)
    );
    s.finish().await;
}

/// Stopped while a slow guest boots (macOS may take a minute; `boot_timeout` allows 180 s): the
/// VM runs, its guest does not answer yet. The resumed boot's own probe waits for the guest
/// under the boot limit; the resume must not give up on a booting guest after
/// `timing.resume_probe` (30 s), interrupt the attempt and delete a VM that was about to answer.
/// A one-attempt build (`max-attempts 1`: an interruption would fail it) in `Booting` on a stack
/// of one agent (`opts`); with `slow_clone`, its `tart clone` takes 30 s.
async fn booting_one_attempt_build(name: &str, opts: AgentOptions, slow_clone: bool) -> Stack {
    let mut s = Stack::new(name).await;
    s.add_agent("agent-a", opts);
    s.start_controller(ControllerOptions::default());
    if slow_clone {
        s.tart_faults("agent-a", json!({"global": {"clone_delay_secs": 30.0}}));
    }
    s.start_agent("agent-a").await;
    let mut params = s.build_params(false);
    params.push(("max-attempts", json!("1")));
    s.create_run("build-1", &params, None).await;
    s.wait_journal("agent-a", "Booting", Duration::from_secs(30), |r| {
        r.to == AttemptState::Booting
    })
    .await;
    s
}

/// The CustomRun ended `TestsPassed` as attempt `#1`.
async fn assert_passed_as_attempt_1(s: &Stack) {
    let run = s.wait_run_ended("build-1", Duration::from_secs(60)).await;
    assert_eq!(
        run["status"]["conditions"][0]["reason"],
        "TestsPassed",
        "{}\n{}",
        tartan_e2e::stack::condition_text(&run),
        s.journal_text("agent-a")
    );
    assert_eq!(
        result(&run, "attempt"),
        Some("build-1#1"),
        "the same attempt ends the build"
    );
}

// scenario: agent-upgrade-mid-boot
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_upgrade_mid_boot_waits_for_a_slow_guest() {
    let opts = AgentOptions {
        boot_delay_secs: 12.0,
        resume_probe: "3s",
        ..AgentOptions::default()
    };
    let mut s = booting_one_attempt_build("agent-upgrade-mid-boot", opts, false).await;
    wait_for("tart run of the booting VM", Duration::from_secs(30), || {
        let booting = journal_of(&s, |r| r.to == AttemptState::Booting).len() == 1;
        // `tart run` itself, not the clone or `tart set` before it: a VM cloned but not yet
        // running is interrupted at the restart, not resumed (a known limit of recovery).
        let running = s
            .tart_commands("agent-a")
            .iter()
            .any(|(_, argv)| argv.get(1).is_some_and(|a| a == "run"));
        (booting && running).then_some(()).ok_or("not booting yet".to_string())
    })
    .await;
    s.stop_agent("agent-a", EXIT_TIME_OUT);
    s.start_agent("agent-a").await;
    assert_passed_as_attempt_1(&s).await;
    assert!(
        journal_of(&s, |r| r.reason == Some(Reason::AgentRestarted)).is_empty(),
        "nothing interrupted:\n{}",
        s.journal_text("agent-a")
    );
    s.finish().await;
}

/// `kill -9`ed alone while the image is still being cloned: its `tart clone` lives on. The next
/// agent kills it before cloning again, so there is one clone and one VM.
// scenario: agent-killed-mid-clone
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_alone_mid_clone_resumes_the_same_attempt() {
    let mut s = booting_one_attempt_build("agent-killed-mid-clone", AgentOptions::default(), true).await;
    wait_for("the clone to run", Duration::from_secs(30), || {
        (!s.tart_pids("agent-a").is_empty())
            .then_some(())
            .ok_or("no tart process".to_string())
    })
    .await;
    s.kill_agent("agent-a", KillMode::Alone);
    assert!(!s.tart_pids("agent-a").is_empty(), "the clone outlives its agent");
    s.tart_faults("agent-a", json!({}));
    s.start_agent("agent-a").await;
    assert_passed_as_attempt_1(&s).await;
    assert_eq!(s.builds_started(), 1);
    assert!(
        s.vms("agent-a").iter().all(|v| !v.starts_with("mb-")),
        "{:?}",
        s.vms("agent-a")
    );
    s.finish().await;
}

/// Stopped while the image is still being cloned (a pull can take minutes): the `Detached`
/// record says the boot "is resumed at the next start", and the next agent must keep that
/// promise: clone again within the same attempt rather than interrupt it, which costs an
/// attempt (here the only one: the build would fail `Interrupted`).
// scenario: agent-upgrade-mid-clone
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_upgrade_mid_clone_resumes_the_same_attempt() {
    let mut s = booting_one_attempt_build("agent-upgrade-mid-clone", AgentOptions::default(), true).await;
    s.stop_agent("agent-a", EXIT_TIME_OUT);
    let detached = journal_of(&s, |r| r.reason == Some(Reason::Detached));
    assert_eq!(detached.len(), 1, "one Detached record:\n{}", s.journal_text("agent-a"));
    assert_eq!(detached[0].to, AttemptState::Booting);
    s.tart_faults("agent-a", json!({}));
    s.start_agent("agent-a").await;
    assert_passed_as_attempt_1(&s).await;
    assert!(
        journal_of(&s, |r| r.reason == Some(Reason::AgentRestarted)).is_empty(),
        "nothing interrupted:\n{}",
        s.journal_text("agent-a")
    );
    assert!(
        s.vms("agent-a").iter().all(|v| !v.starts_with("mb-")),
        "{:?}",
        s.vms("agent-a")
    );
    s.finish().await;
}

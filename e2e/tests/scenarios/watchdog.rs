//! Issue 5's watchdog cases on short timings (host timeout 6 s, watchdog grace 3 s: `AgentOptions::default`): the agent
//! killed with its tart children surviving (as under `nohup`), with and without the watchdog;
//! the watchdog itself killed and restarted mid-wait; a failing delete.

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde_json::json;
use std::time::Duration;
use tartan_api::{AttemptState, Outcome, Reason};
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack, wait_for};
use tartan_watchdog::{Action, Line};

const GRACE_SECS: i64 = 3;

/// A stack whose build hangs in its first step; returns it with the VM and its deadline.
async fn hung_build(name: &str) -> (Stack, String, Timestamp) {
    let mut s = Stack::new(name).await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("6")));
    params.push(("max-attempts", json!("1")));
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    let (vm, deadline) = s.admitted_vm("agent-a").await;
    (s, vm, deadline)
}

/// deletion time − (deadline + grace), in seconds.
fn lateness(line: &Line, grace_secs: i64) -> f64 {
    let time: Timestamp = line.time.parse().expect("watchdog time");
    let deadline: Timestamp = line.deadline.as_deref().expect("deadline").parse().expect("deadline");
    let due = deadline + SignedDuration::from_secs(grace_secs);
    time.duration_since(due).as_secs_f64()
}

fn tart_alive_for(s: &Stack, vm: &str) -> bool {
    s.tart_pids("agent-a").iter().any(|pid| {
        std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == vm.as_bytes()))
    })
}

async fn restarted_agent_records(s: &mut Stack, reason: Reason) {
    s.start_agent("agent-a").await;
    let r = s
        .wait_journal(
            "agent-a",
            &format!("Retiring ({reason})"),
            Duration::from_secs(30),
            |r| r.to == AttemptState::Retiring && r.reason == Some(reason),
        )
        .await;
    assert_eq!(r.outcome, Some(Outcome::Failed), "{r}");
    let run = s.wait_run_ended("build-1", Duration::from_secs(30)).await;
    assert_eq!(
        run["status"]["conditions"][0]["status"],
        "False",
        "{}",
        tartan_e2e::stack::condition_text(&run)
    );
}

// scenario: watchdog-killed-agent
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_agent_tart_children_survive_watchdog_deletes() {
    let (mut s, vm, _) = hung_build("watchdog-killed-agent").await;
    s.start_watchdog("agent-a");
    s.kill_agent("agent-a", KillMode::Alone);
    assert!(tart_alive_for(&s, &vm), "tart run/exec of {vm} survive the agent");
    let line = s
        .wait_watchdog("agent-a", "deleted", Duration::from_secs(30), |l| {
            l.vm == vm && l.action == Action::Deleted
        })
        .await;
    let late = lateness(&line, GRACE_SECS);
    eprintln!("[e2e] watchdog: {}", serde_json::to_string(&line).unwrap());
    eprintln!("[e2e] lateness = deletion - (deadline + grace) = {late:.3}s");
    assert!((0.0..3.0).contains(&late), "deleted {late:.3}s after deadline + grace");
    assert!(!s.vms("agent-a").contains(&vm));
    wait_for("the VM's tart processes to be gone", Duration::from_secs(5), || {
        (!tart_alive_for(&s, &vm))
            .then_some(())
            .ok_or(format!("{:?}", s.tart_pids("agent-a")))
    })
    .await;
    restarted_agent_records(&mut s, Reason::WatchdogDeadline).await;
    s.finish().await;
}

// scenario: no-watchdog
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_agent_without_watchdog_restart_deletes() {
    let (mut s, vm, deadline) = hung_build("no-watchdog").await;
    s.kill_agent("agent-a", KillMode::Alone);
    wait_for("the host execution deadline to pass", Duration::from_secs(30), || {
        let now = Timestamp::now();
        (now > deadline)
            .then_some(())
            .ok_or(format!("now {now}, deadline {deadline}"))
    })
    .await;
    assert!(
        s.vms("agent-a").contains(&vm),
        "nobody deletes the VM while the agent is down"
    );
    assert!(tart_alive_for(&s, &vm), "its tart processes still run");
    restarted_agent_records(&mut s, Reason::DeadlinePassed).await;
    assert!(!s.vms("agent-a").contains(&vm));
    assert!(!tart_alive_for(&s, &vm), "recovery killed the surviving tart processes");
    s.finish().await;
}

// scenario: watchdog-restarted
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchdog_restarted_mid_wait_is_on_time() {
    let (mut s, vm, deadline) = hung_build("watchdog-restarted").await;
    s.start_watchdog("agent-a");
    s.kill_agent("agent-a", KillMode::Alone);
    s.kill_watchdog("agent-a");
    assert!(Timestamp::now() < deadline, "the restart happens before the deadline");
    s.start_watchdog("agent-a");
    let line = s
        .wait_watchdog("agent-a", "deleted", Duration::from_secs(30), |l| {
            l.vm == vm && l.action == Action::Deleted
        })
        .await;
    let late = lateness(&line, GRACE_SECS);
    eprintln!("[e2e] watchdog: {}", serde_json::to_string(&line).unwrap());
    eprintln!("[e2e] lateness = {late:.3}s");
    assert!((0.0..3.0).contains(&late), "deleted {late:.3}s after deadline + grace");
    restarted_agent_records(&mut s, Reason::WatchdogDeadline).await;
    s.finish().await;
}

// scenario: watchdog-delete-failed
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchdog_delete_failed_then_deleted() {
    let (mut s, vm, _) = hung_build("watchdog-delete-failed").await;
    s.tart_faults("agent-a", json!({"vms": {vm.clone(): {"delete_fails": true}}}));
    s.start_watchdog("agent-a");
    s.kill_agent("agent-a", KillMode::Alone);
    let failed = s
        .wait_watchdog("agent-a", "delete-failed", Duration::from_secs(30), |l| {
            l.vm == vm && l.action == Action::DeleteFailed
        })
        .await;
    eprintln!("[e2e] watchdog: {}", serde_json::to_string(&failed).unwrap());
    assert!(s.vms("agent-a").contains(&vm));
    s.tart_faults("agent-a", json!({}));
    let line = s
        .wait_watchdog(
            "agent-a",
            "deleted after the fault is lifted",
            Duration::from_secs(30),
            |l| l.vm == vm && l.action == Action::Deleted,
        )
        .await;
    eprintln!("[e2e] watchdog: {}", serde_json::to_string(&line).unwrap());
    assert!(!s.vms("agent-a").contains(&vm));
    restarted_agent_records(&mut s, Reason::WatchdogDeadline).await;
    s.finish().await;
}

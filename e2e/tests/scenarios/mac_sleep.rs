//! Issue 14: the Mac sleeps mid-build. Everything on the host (the agent, the watchdog, every
//! tart process, the guest's step job) is stopped together for longer than the Lease and past the
//! build's host execution deadline plus the watchdog's grace, then continued.
//!
//! The decision: the host execution deadline is a wall-clock time (it is written in the journal
//! and the deadline file, and the cluster's clocks are wall clocks), and the Mac's monotonic clock
//! does not advance while it sleeps. So every timer that guards a deadline re-reads the wall
//! clock: the agent's `until()` (agent/src/host/executor.rs) sleeps at most 60 s at a time, the
//! watchdog at most its rescan interval (1 s), each then comparing `Timestamp::now()` with the
//! deadline. After the wake the overdue attempt ends at once, by whichever comes first: the agent
//! (`DeadlinePassed`) or the watchdog (`WatchdogDeadline`); the VM is deleted, the attempt is
//! `Failed` (never retried) and the CustomRun ends `False`. While the host sleeps, its Lease
//! expires and the CustomRun shows `HostUnreachable`.
//!
//! A shorter sleep (past the Lease, not the deadline) costs nothing: on the wake the Lease is
//! renewed (`HostUnreachable` back to `False/LeaseRenewed`) and the same attempt passes.
//!
//! On Linux SIGSTOP does not stop the monotonic clock, so this test cannot show a monotonic timer
//! that forgets the sleep; it shows that nothing on the host needs the stopped time to have passed
//! on its own clock, and bounds the time from the wake to the VM's deletion.
//!
//! scenario: mac-sleep

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde_json::json;
use std::time::{Duration, Instant};
use tartan_api::{AttemptState, Outcome, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::stack::condition_text;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack, wait_for, wait_for_async};

/// `AgentOptions::default().watchdog_grace`.
const GRACE: SignedDuration = SignedDuration::from_secs(3);

/// Waits until build-1's CustomRun has a `HostUnreachable` condition with `status`.
async fn wait_host_unreachable(s: &Stack, status: &str) {
    wait_for_async(
        &format!("the CustomRun's HostUnreachable condition to be {status}"),
        Duration::from_secs(30),
        || async {
            let run = s.customrun("build-1").await.unwrap_or_default();
            let conditions = run["status"]["conditions"].as_array().cloned().unwrap_or_default();
            conditions
                .iter()
                .any(|c| c["type"] == "HostUnreachable" && c["status"] == status)
                .then_some(())
                .ok_or(format!("conditions {conditions:?}"))
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_sleep_past_the_deadline_the_overdue_attempt_ends_at_once() {
    let mut s = Stack::new("mac-sleep").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.start_watchdog("agent-a");
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("10")));
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    let (vm, deadline) = s.admitted_vm("agent-a").await;

    let stopped = s.sleep_host("agent-a");
    wait_host_unreachable(&s, "True").await;
    let due = deadline + GRACE + SignedDuration::from_secs(1);
    wait_for(
        "the deadline plus the watchdog's grace to pass",
        Duration::from_secs(30),
        || {
            let now = Timestamp::now();
            (now > due).then_some(()).ok_or(format!("now {now}, due {due}"))
        },
    )
    .await;
    assert!(
        s.vms("agent-a").contains(&vm),
        "nothing deleted the VM while the host slept"
    );
    let woke = Instant::now();
    s.wake_host("agent-a", &stopped);

    wait_for("the overdue VM to be deleted", Duration::from_secs(20), || {
        (!s.vms("agent-a").contains(&vm))
            .then_some(())
            .ok_or(format!("VMs {:?}", s.vms("agent-a")))
    })
    .await;
    let deleted_after = woke.elapsed();
    let run = s.wait_run_ended("build-1", Duration::from_secs(30)).await;
    let reason = run["status"]["conditions"][0]["reason"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(
        run["status"]["conditions"][0]["status"],
        "False",
        "{}",
        condition_text(&run)
    );
    assert!(
        reason == "DeadlinePassed" || reason == "WatchdogDeadline",
        "the deadline ended the build: {}",
        condition_text(&run)
    );
    let retiring = s
        .wait_journal("agent-a", "Retiring", Duration::from_secs(5), |r| {
            r.to == AttemptState::Retiring
        })
        .await;
    assert_eq!(retiring.outcome, Some(Outcome::Failed), "{retiring}");
    assert!(
        matches!(retiring.reason, Some(Reason::DeadlinePassed | Reason::WatchdogDeadline)),
        "{retiring}"
    );
    assert!(
        s.journal("agent-a").iter().all(|r| r.attempt != Some(2)),
        "a Failed attempt is never retried"
    );
    assert_eq!(s.builds_started(), 1);
    let by = if retiring.reason == Some(Reason::WatchdogDeadline) {
        "the watchdog"
    } else {
        "the agent"
    };
    eprintln!(
        "[e2e] mac-sleep: slept {} process(es) past deadline + grace; VM deleted by {by} {:.1}s after the wake; {}",
        stopped.len(),
        deleted_after.as_secs_f64(),
        condition_text(&run)
    );
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_sleep_past_the_lease_only_the_same_attempt_passes() {
    let mut s = Stack::new("mac-sleep-short").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.start_watchdog("agent-a");
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("600")));
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;

    let stopped = s.sleep_host("agent-a");
    wait_host_unreachable(&s, "True").await;
    s.wake_host("agent-a", &stopped);
    wait_host_unreachable(&s, "False").await;
    s.open_gate();
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    assert_eq!(result(&run, "attempt"), Some("build-1#1"));
    assert_eq!(s.builds_started(), 1);
    assert!(
        s.journal("agent-a").iter().all(|r| r.attempt == Some(1)),
        "one attempt:\n{}",
        s.journal_text("agent-a")
    );
    assert!(s.watchdog_lines("agent-a").is_empty(), "{}", s.watchdog_text("agent-a"));
    s.finish().await;
}

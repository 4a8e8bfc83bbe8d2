//! Issue 5, the paused agent, on the source's default timings (lease 5 s / 20 s, controller grace
//! 45 s, watchdog grace 60 s): the agent is SIGSTOPped with its build running past the host
//! execution deadline. The controller ends the CustomRun `False/CustomRunTimedOut` with
//! `vmRetirement=unconfirmed` once the lease expired; the watchdog deletes the VM at deadline +
//! 60 s; the resumed agent records `WatchdogDeadline`. Prints the watchdog's line and lateness.

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde_json::json;
use std::time::Duration;
use tartan_api::{AttemptState, Outcome, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::stack::condition_text;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack, wait_for_async};
use tartan_watchdog::Action;

// scenario: watchdog-frozen-agent slow
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_agent_watchdog_deletes_at_deadline_plus_grace() {
    let mut s = Stack::new("watchdog-frozen-agent").await;
    s.add_agent("agent-a", AgentOptions::source_defaults());
    s.start_controller(ControllerOptions::source_defaults());
    s.start_agent("agent-a").await;
    s.start_watchdog("agent-a");
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("10")));
    params.push(("max-attempts", json!("1")));
    s.create_run("build-1", &params, Some("10s")).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    let (vm, deadline) = s.admitted_vm("agent-a").await;
    s.freeze_agent("agent-a");

    let run = s
        .wait_run("build-1", "False", "CustomRunTimedOut", Duration::from_secs(90))
        .await;
    let run_ended = Timestamp::now();
    eprintln!("[e2e] {}", condition_text(&run));
    assert_eq!(result(&run, "vmRetirement"), Some("unconfirmed"));
    assert!(
        s.vms("agent-a").contains(&vm),
        "the CustomRun ends before the VM is removed"
    );

    let line = s
        .wait_watchdog("agent-a", "deleted", Duration::from_secs(90), |l| {
            l.vm == vm && l.action == Action::Deleted
        })
        .await;
    let deleted: Timestamp = line.time.parse().unwrap();
    let due = deadline + SignedDuration::from_secs(60);
    let late = deleted.duration_since(due).as_secs_f64();
    println!("{}", serde_json::to_string(&line).unwrap());
    println!("lateness = deletion time - (deadline + grace) = {deleted} - ({deadline} + 60s) = {late:.3}s");
    println!(
        "CustomRun earlier by {:.1}s; VM removed {:.2}s after the host execution deadline",
        deleted.duration_since(run_ended).as_secs_f64(),
        deleted.duration_since(deadline).as_secs_f64()
    );
    assert!(
        (0.0..3.0).contains(&late),
        "watchdog deleted {late:.3}s after deadline + grace"
    );

    s.thaw_agent("agent-a");
    let r = s
        .wait_journal("agent-a", "Retiring (WatchdogDeadline)", Duration::from_secs(60), |r| {
            r.to == AttemptState::Retiring && r.reason == Some(Reason::WatchdogDeadline)
        })
        .await;
    assert_eq!(r.outcome, Some(Outcome::Failed));
    wait_for_async(
        "the MacBuild to go once the agent releases it",
        Duration::from_secs(60),
        || async {
            match s.macbuild("build-1").await {
                None => Ok(()),
                Some(m) => Err(format!(
                    "finalizers {} status {}",
                    m["metadata"]["finalizers"], m["status"]
                )),
            }
        },
    )
    .await;
    s.finish().await;
}

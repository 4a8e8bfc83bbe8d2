//! Issue 14: `on_restart = "restart"` with the agent killed alone, as under launchd with
//! `AbandonProcessGroup` set: its `tart run` and `tart exec` children survive it. The restarted
//! agent kills those survivors before it deletes the VM (the journal says how many), then retries
//! the build as attempt 2.

use serde_json::json;
use std::time::Duration;
use tartan_api::{AttemptState, Outcome, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack, wait_for};

/// The number in a detail's "killed N tart process(es)".
fn killed_count(detail: &str) -> Option<usize> {
    let (before, _) = detail.split_once(" tart process(es)")?;
    before.rsplit(' ').next()?.parse().ok()
}

// scenario: abandon-process-group
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_of_an_abandoned_group_are_killed_before_the_retry() {
    let mut s = Stack::new("abandon-process-group").await;
    s.add_agent(
        "agent-a",
        AgentOptions {
            on_restart: "restart",
            ..AgentOptions::default()
        },
    );
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("600")));
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    let (vm, _) = s.admitted_vm("agent-a").await;

    s.kill_agent("agent-a", KillMode::Alone);
    let survivors = s.tart_commands("agent-a");
    eprintln!("[e2e] tart processes surviving the agent: {survivors:?}");
    assert!(
        survivors
            .iter()
            .any(|(_, argv)| argv.iter().any(|a| a == "run") && argv.contains(&vm)),
        "`tart run {vm}` outlives the agent: {survivors:?}"
    );
    s.open_gate();
    s.start_agent("agent-a").await;

    let r = s
        .wait_journal("agent-a", "Retiring (AgentRestarted)", Duration::from_secs(30), |r| {
            r.to == AttemptState::Retiring && r.reason == Some(Reason::AgentRestarted)
        })
        .await;
    assert_eq!(r.outcome, Some(Outcome::Interrupted), "{r}");
    let killed = killed_count(&r.detail).unwrap_or_else(|| panic!("no kill count in {r}"));
    assert!(killed >= 1, "recovery killed the survivors (`tart run` at least): {r}");
    let deleted = s
        .wait_journal("agent-a", "attempt 1's VM deleted", Duration::from_secs(30), |x| {
            x.attempt == Some(1) && x.to == AttemptState::Retired && x.reason == Some(Reason::VMDeleted)
        })
        .await;
    assert!(r.seq < deleted.seq, "killed before deleted");
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    assert_eq!(result(&run, "attempt"), Some("build-1#2"));
    assert!(!s.vms("agent-a").contains(&vm), "attempt 1's VM is deleted");
    wait_for("attempt 1's tart processes to be gone", Duration::from_secs(5), || {
        let left: Vec<_> = s
            .tart_commands("agent-a")
            .into_iter()
            .filter(|(_, a)| a.contains(&vm))
            .collect();
        left.is_empty().then_some(()).ok_or(format!("{left:?}"))
    })
    .await;
    assert_eq!(s.builds_started(), 2, "the first step ran in each attempt");
    s.finish().await;
}

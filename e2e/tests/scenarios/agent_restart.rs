//! With `on_restart = "restart"`, the agent `kill -9`ed mid-build (its process group dies, as
//! under launchd, `tart run` with it): the clone stays
//! on disk; the restarted agent records `Retiring (AgentRestarted)` with `Interrupted`, deletes
//! the clone, and attempt 2 succeeds. Uses the source's timing (lease 5 s / 20 s, retry window
//! 120 s).

use std::time::Duration;
use tartan_api::{AttemptState, Outcome, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack, wait_for};

// scenario: agent-killed slow
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_mid_build_retries_once() {
    let mut s = Stack::new("agent-killed").await;
    // The source's behaviour: the VMs die with the agent's process group.
    let opts = AgentOptions {
        on_restart: "restart",
        ..AgentOptions::source_defaults()
    };
    s.add_agent("agent-a", opts);
    s.start_controller(ControllerOptions::source_defaults());
    s.start_agent("agent-a").await;
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", serde_json::json!("600")));
    s.create_run("build-1", &params, None).await;
    wait_for("the build step to start", Duration::from_secs(60), || {
        (s.builds_started() == 1)
            .then_some(())
            .ok_or(format!("{} started", s.builds_started()))
    })
    .await;

    s.kill_agent("agent-a", KillMode::Group);
    wait_for(
        "tart run/exec to be gone with the agent's group",
        Duration::from_secs(5),
        || {
            let pids = s.tart_pids("agent-a");
            pids.is_empty().then_some(()).ok_or(format!("tart pids {pids:?}"))
        },
    )
    .await;
    let left: Vec<String> = s.vms("agent-a").into_iter().filter(|v| v.starts_with("mb-")).collect();
    assert_eq!(left.len(), 1, "the clone stays on disk after the kill: {left:?}");
    s.open_gate();
    s.start_agent("agent-a").await;

    let r = s
        .wait_journal("agent-a", "Retiring (AgentRestarted)", Duration::from_secs(30), |r| {
            r.to == AttemptState::Retiring && r.reason == Some(Reason::AgentRestarted)
        })
        .await;
    assert_eq!(r.outcome, Some(Outcome::Interrupted));
    assert!(r.detail.contains("killed 0 tart process(es)"), "{r}");
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(90))
        .await;
    assert_eq!(result(&run, "attempt"), Some("build-1#2"));
    assert_eq!(s.builds_started(), 2, "the build started twice and finished once");
    assert!(!s.vms("agent-a").contains(&left[0]), "attempt 1's clone is deleted");
    s.finish().await;
}

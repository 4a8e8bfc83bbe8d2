//! The controller killed mid-build: the agent finishes alone, a fresh controller reads the
//! finished status; no second attempt.

use std::time::Duration;
use tartan_api::{AttemptState, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack, wait_for};

// scenario: controller-killed
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_killed_mid_build() {
    let mut s = Stack::new("controller-killed").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.create_run("build-1", &s.build_params(true), None).await;
    wait_for("the build step to start", Duration::from_secs(60), || {
        (s.builds_started() == 1)
            .then_some(())
            .ok_or(format!("{} started", s.builds_started()))
    })
    .await;

    s.kill_controller();
    s.open_gate();
    s.wait_journal(
        "agent-a",
        "Retired (VMDeleted) with the controller down",
        Duration::from_secs(60),
        |r| r.to == AttemptState::Retired && r.reason == Some(Reason::VMDeleted),
    )
    .await;
    s.restart_controller();

    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(30))
        .await;
    assert_eq!(result(&run, "attempt"), Some("build-1#1"));
    assert_eq!(s.builds_started(), 1, "the build ran once");
    assert!(s.journal("agent-a").iter().all(|r| r.attempt == Some(1)));
    s.finish().await;
}

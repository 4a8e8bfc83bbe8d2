//! The agent is killed mid-build (alone: its `tart run` survives), the API goes down, and the
//! agent starts again while it is down. Recovery must not wait for the cluster to do the host's
//! part: the survivors are killed and the VM deleted within seconds of the start, from the
//! journal and `tart list` alone. Once the API answers (after 60 s), the rest follows: attempt 2
//! runs and the CustomRun ends `True/TestsPassed` on `#2`. Source timings (api timeout 4 s).

use std::time::{Duration, Instant};
use tartan_api::{AttemptState, Outcome, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack, wait_for};

// scenario: api-down-at-start slow
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_started_while_the_api_is_down_deletes_the_vm_at_once() {
    let mut s = Stack::new("api-down-at-start").await;
    s.add_agent("agent-a", AgentOptions::source_defaults());
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
    let vm = s.admitted_vm("agent-a").await.0;

    s.kill_agent("agent-a", KillMode::Alone);
    assert!(
        !s.tart_pids("agent-a").is_empty(),
        "tart run survives an agent killed alone"
    );
    s.api_down().await;
    let down_at = Instant::now();
    s.open_gate();
    s.spawn_agent("agent-a");

    let r = s
        .wait_journal("agent-a", "a1 Retired (VMDeleted)", Duration::from_secs(20), |r| {
            r.attempt == Some(1) && r.to == AttemptState::Retired && r.reason == Some(Reason::VMDeleted)
        })
        .await;
    let took = down_at.elapsed();
    eprintln!("[e2e] VM of a1 deleted {took:?} after the agent started with the API down: {r}");
    assert!(!s.vms("agent-a").contains(&vm), "{vm} is deleted while the API is down");
    assert!(
        s.tart_pids("agent-a").is_empty(),
        "the surviving tart processes are killed"
    );
    let retiring = s
        .journal("agent-a")
        .into_iter()
        .find(|r| r.attempt == Some(1) && r.to == AttemptState::Retiring)
        .expect("a1 Retiring is journaled");
    assert_eq!(retiring.reason, Some(Reason::AgentRestarted), "{retiring}");
    assert_eq!(retiring.outcome, Some(Outcome::Interrupted));
    let log = s.agent_log("agent-a");
    assert!(
        log.contains("recovering the host side now"),
        "the agent says why it goes on without the cluster; log:\n{log}"
    );
    assert!(
        s.agent_alive("agent-a"),
        "the agent does not exit while the API is down"
    );

    // The API comes back after 60 s in all; attempt 2 then runs to the end.
    let outage = Duration::from_secs(60);
    wait_for("the 60 s outage to pass", outage + Duration::from_secs(5), || {
        (down_at.elapsed() >= outage)
            .then_some(())
            .ok_or("still down".to_string())
    })
    .await;
    s.api_up().await;
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(120))
        .await;
    assert_eq!(result(&run, "attempt"), Some("build-1#2"));
    s.finish().await;
}

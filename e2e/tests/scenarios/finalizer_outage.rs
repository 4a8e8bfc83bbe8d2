//! Host-side recovery retires an attempt while the API is down (issue 10's scenario), and the
//! outage lasts longer than `release_finalizer` once tried (eight tries, about 95 s, after which
//! nothing removed it in this agent's life and compaction dropped the build, so no later start
//! did either: the MacBuild could never be deleted). The promise: once the API answers, our
//! finalizer comes off.

use serde_json::json;
use std::time::Duration;
use tartan_api::{AttemptState, FINALIZER};
use tartan_e2e::stack::condition_text;
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack, wait_for, wait_for_async};

// scenario: finalizer-outage slow
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finalizer_owed_during_a_long_outage_is_removed_once_the_api_answers() {
    let mut s = Stack::new("finalizer-outage").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("600")));
    params.push(("max-attempts", json!("1")));
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    s.kill_agent("agent-a", KillMode::Group);
    s.api_down().await;
    s.open_gate();
    s.spawn_agent("agent-a");
    let retired = s
        .wait_journal(
            "agent-a",
            "a1 Retired while the API is down",
            Duration::from_secs(30),
            |r| r.attempt == Some(1) && r.to == AttemptState::Retired,
        )
        .await;
    eprintln!("[e2e] journaled: {retired}");
    // An outage longer than the old eight tries (about 95 s): the agent must still be trying.
    let retired_at = std::time::Instant::now();
    wait_for("a 100 s outage", Duration::from_secs(110), || {
        (retired_at.elapsed() >= Duration::from_secs(100))
            .then_some(())
            .ok_or("still down".to_string())
    })
    .await;
    assert!(
        !s.agent_log("agent-a").contains("finalizer still on after"),
        "the agent gave up removing the finalizer during the outage"
    );
    s.api_up().await;
    let run = s.wait_run_ended("build-1", Duration::from_secs(60)).await;
    eprintln!("[e2e] build-1: {}", condition_text(&run));
    wait_for_async(
        "our finalizer off the MacBuild once the API answers",
        Duration::from_secs(60),
        || async {
            match s.macbuild("build-1").await {
                Some(m)
                    if m["metadata"]["finalizers"]
                        .as_array()
                        .is_some_and(|f| f.iter().any(|x| x == FINALIZER)) =>
                {
                    Err(format!(
                        "finalizers {} deletionTimestamp {}",
                        m["metadata"]["finalizers"], m["metadata"]["deletionTimestamp"]
                    ))
                }
                _ => Ok(()),
            }
        },
    )
    .await;
    s.finish().await;
}

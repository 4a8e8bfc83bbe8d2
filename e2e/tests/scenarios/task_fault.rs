//! The API returns an absurd claim epoch (the largest an apiserver holds, int64's maximum) while a
//! retry is `Requested`: the claim for attempt 2 is computed from it. `epoch + 1` once overflowed
//! (a panic in the build's task; u64 in the emulator, which also held what no apiserver holds),
//! and the supervisor then left the retry `Requested` with its slot reserved for ever. The
//! promise: the build ends and the slot is free for the next one.

use serde_json::json;
use std::time::Duration;
use tartan_api::AttemptState;
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack, wait_for};

// scenario: task-fault
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_while_a_retry_is_requested_does_not_hold_the_slot_for_ever() {
    let mut s = Stack::new("task-fault").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("600")));
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    s.kill_agent("agent-a", KillMode::GroupAndVms);
    wait_for(
        "tart processes gone with the agent and its VMs",
        Duration::from_secs(5),
        || {
            let pids = s.tart_pids("agent-a");
            pids.is_empty().then_some(()).ok_or(format!("tart pids {pids:?}"))
        },
    )
    .await;
    // The API answers an absurd claim epoch (garbage from the API, issue 10's adversarial class).
    let patch = json!({"status": {"claim": {"epoch": i64::MAX}}});
    s.macbuilds()
        .patch_status(
            "build-1",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .expect("patch the MacBuild's status");
    s.open_gate();
    s.start_agent("agent-a").await;
    let requested = s
        .wait_journal("agent-a", "a2 Requested", Duration::from_secs(30), |r| {
            r.attempt == Some(2) && r.to == AttemptState::Requested
        })
        .await;
    eprintln!("[e2e] journaled: {requested}");
    // The panic (or, once `epoch + 1` is checked, the claim's error) happens right after the
    // request; what the agent said about it is printed, the slot is what the test checks.
    let log_lines = |s: &Stack| -> String {
        s.agent_log("agent-a")
            .lines()
            .filter(|l| l.contains("panicked") || l.contains("task failed") || l.contains("build stopped"))
            .collect::<Vec<_>>()
            .join("\n")
    };

    // The slot must be free again: a new build runs to the end.
    s.create_run("build-2", &s.build_params(false), None).await;
    let r = s
        .wait_journal(
            "agent-a",
            "build-2 admitted (the slot freed)",
            Duration::from_secs(60),
            |r| r.build.as_ref().is_some_and(|b| b.name == "build-2") && r.to == AttemptState::Admitted,
        )
        .await;
    eprintln!("[e2e] journaled: {r}");
    eprintln!("[e2e] agent log about the build's task:\n{}", log_lines(&s));
    s.wait_run_ended("build-1", Duration::from_secs(60)).await;
    s.wait_run("build-2", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    s.finish().await;
}

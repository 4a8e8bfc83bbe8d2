//! Cancellation during boot, and the owner deleted while the agent is down.

use serde_json::json;
use std::time::Duration;
use tartan_api::{AttemptState, Outcome};
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack, wait_for_async};

// scenario: cancel-during-boot
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_during_boot() {
    let mut s = Stack::new("cancel-boot").await;
    s.add_agent(
        "agent-a",
        AgentOptions {
            boot_delay_secs: 30.0,
            ..AgentOptions::default()
        },
    );
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.create_run("build-1", &s.build_params(false), None).await;
    s.wait_journal("agent-a", "Booting", Duration::from_secs(30), |r| {
        r.to == AttemptState::Booting
    })
    .await;
    s.cancel_run("build-1").await;
    let run = s
        .wait_run("build-1", "False", "CustomRunCancelled", Duration::from_secs(30))
        .await;
    eprintln!("[e2e] {}", tartan_e2e::stack::condition_text(&run));
    let j = s.journal("agent-a");
    assert!(
        j.iter().any(|r| r.outcome == Some(Outcome::Cancelled)),
        "journal:\n{}",
        s.journal_text("agent-a")
    );
    assert!(j.iter().any(|r| r.to == AttemptState::Retired));
    assert_eq!(s.builds_started(), 0, "no step ran");
    assert!(s.vms("agent-a").iter().all(|v| !v.starts_with("mb-")));
    s.finish().await;
}

// scenario: owner-deleted needs-cm
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_deleted_while_agent_down() {
    let mut s = Stack::new("owner-deleted").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("600")));
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    let (vm, _) = s.admitted_vm("agent-a").await;

    s.kill_agent("agent-a", KillMode::Group);
    s.delete_run("build-1").await;
    // A real kube-controller-manager's garbage collector learns a new CRD kind at its discovery
    // resync (~30 s): the first cascading delete of a fresh cluster can take that long.
    s.wait_macbuild(
        "build-1",
        "deletion held by the agent's finalizer",
        Duration::from_secs(90),
        |m| m["metadata"]["deletionTimestamp"].is_string(),
    )
    .await;
    s.open_gate();
    s.start_agent("agent-a").await;
    let r = s
        .wait_journal("agent-a", "outcome Cancelled", Duration::from_secs(30), |r| {
            r.outcome == Some(Outcome::Cancelled)
        })
        .await;
    eprintln!("[e2e] {r}");
    wait_for_async(
        "the MacBuild to go once the finalizer is released",
        Duration::from_secs(30),
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
    assert!(!s.vms("agent-a").contains(&vm));
    let j = s.journal("agent-a");
    assert!(
        !j.iter().any(|r| r.attempt == Some(2)),
        "not retried:\n{}",
        s.journal_text("agent-a")
    );
    assert_eq!(s.builds_started(), 1);
    s.finish().await;
}

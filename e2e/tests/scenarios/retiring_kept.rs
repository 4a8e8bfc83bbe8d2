//! The agent dies right after journaling `Retiring` with outcome `Succeeded`, while its
//! `tart delete` is still in flight (the whole process group dies, as under launchd): the restarted
//! agent finishes the deletion at start (`Retiring -> Retired (VMDeleted)`), keeps the outcome and
//! never runs the build again. The CustomRun shows `Unknown/DeletingVM` until the VM is gone, then
//! `True/TestsPassed` on attempt 1.

use serde_json::json;
use std::time::Duration;
use tartan_api::{AttemptState, Outcome, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::stack::condition_text;
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack, wait_for};

// scenario: retiring-kept
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_at_retiring_keeps_the_outcome() {
    let mut s = Stack::new("retiring-kept").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("600")));
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    let (vm, _) = s.admitted_vm("agent-a").await;

    // The VM's `tart delete` will sleep (holding nothing) long enough to kill the agent in it.
    s.tart_faults("agent-a", json!({"vms": {vm.clone(): {"delete_delay_secs": 30}}}));
    s.open_gate();
    let retiring = s
        .wait_journal(
            "agent-a",
            "Collecting -> Retiring (TestsPassed) outcome=Succeeded",
            Duration::from_secs(60),
            |r| {
                r.attempt == Some(1)
                    && r.from == Some(AttemptState::Collecting)
                    && r.to == AttemptState::Retiring
                    && r.reason == Some(Reason::TestsPassed)
            },
        )
        .await;
    eprintln!("[e2e] journaled: {retiring}");
    assert_eq!(retiring.outcome, Some(Outcome::Succeeded), "{retiring}");
    let run = s
        .wait_run("build-1", "Unknown", "DeletingVM", Duration::from_secs(15))
        .await;
    eprintln!("[e2e] CustomRun while the VM is deleted: {}", condition_text(&run));
    let delete = wait_for(
        "the agent's `tart delete` of the VM in flight",
        Duration::from_secs(20),
        || {
            let cmds = s.tart_commands("agent-a");
            cmds.iter()
                .find(|(_, argv)| argv.iter().any(|a| a == "delete") && argv.contains(&vm))
                .cloned()
                .ok_or(format!("tart processes {cmds:?}"))
        },
    )
    .await;
    eprintln!("[e2e] tart delete in flight: pid {} {:?}", delete.0, delete.1);

    s.kill_agent("agent-a", KillMode::Group);
    wait_for(
        "tart delete to be gone with the agent's group",
        Duration::from_secs(5),
        || {
            let pids = s.tart_pids("agent-a");
            pids.is_empty().then_some(()).ok_or(format!("tart pids {pids:?}"))
        },
    )
    .await;
    assert!(s.vms("agent-a").contains(&vm), "the killed delete left the VM on disk");
    assert!(
        !s.journal("agent-a").iter().any(|r| r.to == AttemptState::Retired),
        "nothing retired before the restart:\n{}",
        s.journal_text("agent-a")
    );

    s.tart_faults("agent-a", json!({}));
    s.start_agent("agent-a").await;
    let retired = s
        .wait_journal(
            "agent-a",
            "Retiring -> Retired (VMDeleted) at agent start",
            Duration::from_secs(30),
            |r| {
                r.attempt == Some(1)
                    && r.from == Some(AttemptState::Retiring)
                    && r.to == AttemptState::Retired
                    && r.reason == Some(Reason::VMDeleted)
            },
        )
        .await;
    assert!(
        retired.detail.contains("deleted (or already absent) at agent start"),
        "{retired}"
    );
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(30))
        .await;
    assert_eq!(result(&run, "attempt"), Some("build-1#1"));
    assert_eq!(result(&run, "vmRetirement"), Some("deleted"));

    let journal = s.journal("agent-a");
    assert!(
        !journal.iter().any(|r| r.attempt.is_some_and(|a| a >= 2)),
        "no attempt 2 is ever requested:\n{}",
        s.journal_text("agent-a")
    );
    let outcomes: Vec<Outcome> = journal
        .iter()
        .filter(|r| r.attempt == Some(1))
        .filter_map(|r| r.outcome)
        .collect();
    assert!(
        outcomes.iter().all(|o| *o == Outcome::Succeeded),
        "the outcome recorded at Retiring is kept: {outcomes:?}\n{}",
        s.journal_text("agent-a")
    );
    let mb = s.macbuild("build-1").await.expect("MacBuild");
    assert_eq!(mb["status"]["outcome"], "Succeeded", "MacBuild status {}", mb["status"]);
    assert_eq!(s.builds_started(), 1, "the build ran once");
    assert!(!s.vms("agent-a").contains(&vm), "the VM is deleted");
    s.finish().await;
}

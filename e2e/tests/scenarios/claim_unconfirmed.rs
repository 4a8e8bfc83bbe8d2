//! A claim that lands after its agent gave up on it (issue 29, seen at 100 hosts): the API holds
//! every claim write of the build for longer than the build's whole timeout, so the agent never
//! gets an answer, journals `Requested -> Retired (ClaimUnconfirmed)` (nothing cloned), and its
//! status write is refused for want of the claim. Then the first held claim write is applied: the
//! MacBuild names the agent as its holder. The agent must answer for that claim (its status says
//! the build was never admitted, `VMDeleted` true), or the run would end `unconfirmed` with a live
//! holder that never speaks; and the controller must tell the pipeline the truth: `none`, no VM
//! was ever created, not `deleted`.

use serde_json::json;
use std::time::Duration;
use tartan_api::{AttemptState, FINALIZER, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::stack::condition_text;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack};

// scenario: claim-unconfirmed emulator-only
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_applied_after_its_agent_gave_up_is_answered_and_reported_as_no_vm() {
    let mut s = Stack::new("claim-unconfirmed").await;
    s.add_agent("agent-a", AgentOptions::default());
    // A grace long enough for the late answer on a loaded machine; the timeout path is the same.
    s.start_controller(ControllerOptions {
        grace: "20s",
        ..ControllerOptions::default()
    });
    s.start_agent("agent-a").await;
    // Every status write of the build is held 12 s, longer than the claim's retries last; its
    // answer never comes in time.
    s.cluster.emulator_faults(&json!({"heldWrites": [{
        "resource": "macbuilds", "subresource": "status", "namespace": s.ns, "name": "build-1",
        "holdMs": 12_000, "count": 100,
    }]}));
    // The claim's retries stop after the MacBuild's 8 s; the run allows 40 s, so the held claim
    // lands while the run is still waiting (an unclaimed MacBuild past the run's deadline is
    // deleted, and a late claim then lands nowhere).
    let mut params = s.build_params(false);
    params.push(("timeout-seconds", json!("8")));
    s.create_run("build-1", &params, Some("40s")).await;
    let gave_up = s
        .wait_journal("agent-a", "Retired (ClaimUnconfirmed)", Duration::from_secs(60), |r| {
            r.to == AttemptState::Retired && r.reason == Some(Reason::ClaimUnconfirmed)
        })
        .await;
    eprintln!("[e2e] the agent gave up on its claim: {gave_up}");
    // Writes from now on are served at once; the claim writes already held are applied on time.
    s.cluster.emulator_faults(&json!({"heldWrites": []}));

    let mb = s
        .wait_macbuild("build-1", "the late claim answered", Duration::from_secs(60), |m| {
            m["status"]["journalSeq"].as_u64() >= Some(gave_up.seq)
        })
        .await;
    eprintln!(
        "[e2e] MacBuild: holder {}, phase {}, conditions {}",
        mb["status"]["claim"]["holder"], mb["status"]["phase"], mb["status"]["conditions"]
    );
    assert_eq!(mb["status"]["claim"]["holder"], "agent-a", "the held claim landed");
    let run = s
        .wait_run("build-1", "False", "CustomRunTimedOut", Duration::from_secs(60))
        .await;
    let ended = condition_text(&run);
    eprintln!("[e2e] {ended}");
    assert_eq!(result(&run, "vmRetirement"), Some("none"), "{ended}");
    assert!(ended.contains("no VM was created"), "{ended}");

    let journal = s.journal("agent-a");
    assert!(
        journal
            .iter()
            .all(|r| r.to == AttemptState::Requested || r.to == AttemptState::Retired),
        "nothing admitted, nothing cloned:\n{}",
        s.journal_text("agent-a")
    );
    assert_eq!(s.builds_started(), 0);
    let mb = s.macbuild("build-1").await.expect("MacBuild");
    assert!(
        !mb["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| f.iter().any(|x| x == FINALIZER)),
        "no finalizer of the agent is left: {}",
        mb["metadata"]
    );
    s.finish().await;
}

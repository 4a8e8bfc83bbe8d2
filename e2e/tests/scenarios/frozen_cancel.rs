//! Cancellation while the holder's lease is expired (issue 14): the agent is frozen (SIGSTOP)
//! mid-step past its lease, then the CustomRun is cancelled. The controller cannot know whether
//! the VM is gone, so it ends the run `False/CustomRunCancelled` with `vmRetirement=unconfirmed`
//! at once and leaves the cancel request on the MacBuild, whose finalizer keeps it. On SIGCONT the
//! agent reads the request, deletes its VM, journals `Cancelled`, and removes the finalizer; the
//! ended CustomRun is never reopened. The thaw waits for the finished label on the MacBuild (30 s
//! after the run ended), which takes it out of the agents' watch of unfinished builds: the holder
//! must still see the request.

use serde_json::json;
use std::time::{Duration, Instant};
use tartan_api::{AttemptState, FINALIZER, FINISHED_LABEL, Outcome};
use tartan_e2e::invariants::result;
use tartan_e2e::stack::{condition_of, condition_text};
use tartan_e2e::{AgentOptions, ControllerOptions, Stack, wait_for_async};

// scenario: frozen-cancel
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_agent_cancelled_run_is_unconfirmed_then_cleaned_up_on_thaw() {
    let mut s = Stack::new("frozen-cancel").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    // Gated: the step waits in the VM for a gate that never opens; only the cancel ends it.
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("300")));
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    let (vm, _) = s.admitted_vm("agent-a").await;

    let frozen_at = Instant::now();
    s.freeze_agent("agent-a");
    let run = s.wait_host_unreachable("build-1", Duration::from_secs(30)).await;
    let (_, c) = condition_of(&run, "HostUnreachable").unwrap();
    eprintln!(
        "[e2e] {:.1}s after SIGSTOP: HostUnreachable {}: {}",
        frozen_at.elapsed().as_secs_f64(),
        c["reason"],
        c["message"]
    );

    // On the emulator its watch connections are dropped now (the API refuses connections for a
    // moment), before the cancel, and their history is compacted below: at the thaw the agent
    // lists again and never got the cancel as an event on a watch of unfinished builds.
    let emulator = s.cluster.is_emulator();
    if emulator {
        s.cluster
            .emulator_faults(&json!({"availability": "refuse", "forMs": 300}));
    }
    wait_for_async("the cancel, once the API answers", Duration::from_secs(10), || async {
        s.try_cancel_run("build-1").await.map_err(|e| e.to_string())
    })
    .await;
    let run = s
        .wait_run("build-1", "False", "CustomRunCancelled", Duration::from_secs(30))
        .await;
    let ended = condition_text(&run);
    eprintln!("[e2e] cancelled while frozen: {ended}");
    assert_eq!(result(&run, "vmRetirement"), Some("unconfirmed"), "{ended}");
    let message = run["status"]["conditions"][0]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("VM retirement unconfirmed") && message.contains("agent agent-a lease expired"),
        "the message names the agent and its expired lease: {message}"
    );
    // Ending the run deleted nothing: the VM is still there, the MacBuild holds the request and
    // the finalizer, and nothing was journaled (the agent is frozen).
    assert!(
        s.vms("agent-a").contains(&vm),
        "VM {vm} still exists while the agent is frozen"
    );
    let mb = s
        .macbuild("build-1")
        .await
        .expect("the MacBuild stays while its finalizer holds it");
    assert_eq!(
        mb["spec"]["cancelRequested"], true,
        "the cancel request waits on the MacBuild"
    );
    assert!(
        mb["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| f.iter().any(|x| x == FINALIZER)),
        "finalizer {FINALIZER} still on: {}",
        mb["metadata"]
    );
    assert!(
        s.journal("agent-a").iter().all(|r| r.outcome.is_none()),
        "no outcome journaled while frozen:\n{}",
        s.journal_text("agent-a")
    );

    // The run is finished: 30 s after it (the controller's default) its MacBuild is labelled
    // finished and leaves the agents' watch of unfinished builds. The holder still reads the
    // request, from its watch of the finished builds it holds.
    let labelled = s
        .wait_macbuild("build-1", "the finished label", Duration::from_secs(45), |m| {
            m["metadata"]["labels"][FINISHED_LABEL] == "true"
        })
        .await;
    eprintln!("[e2e] MacBuild labelled finished: {}", labelled["metadata"]["labels"]);
    if emulator {
        s.cluster.compact_watch_history();
    }

    s.thaw_agent("agent-a");
    let thawed_at = Instant::now();
    let retired = s
        .wait_journal("agent-a", "the attempt retired", Duration::from_secs(30), |r| {
            r.to == AttemptState::Retired
        })
        .await;
    eprintln!(
        "[e2e] {:.1}s after SIGCONT: {retired}",
        thawed_at.elapsed().as_secs_f64()
    );
    let j = s.journal("agent-a");
    assert!(
        j.iter()
            .any(|r| r.to == AttemptState::Retiring && r.outcome == Some(Outcome::Cancelled)),
        "the attempt ends Cancelled:\n{}",
        s.journal_text("agent-a")
    );
    assert!(!s.vms("agent-a").contains(&vm), "VM {vm} deleted after the thaw");
    let mb = s
        .wait_macbuild("build-1", "the finalizer removed", Duration::from_secs(30), |m| {
            !m["metadata"]["finalizers"]
                .as_array()
                .is_some_and(|f| f.iter().any(|x| x == FINALIZER))
        })
        .await;
    eprintln!(
        "[e2e] {:.1}s after SIGCONT: MacBuild released, phase {}, finalizers {}",
        thawed_at.elapsed().as_secs_f64(),
        mb["status"]["phase"],
        mb["metadata"]["finalizers"]
    );
    assert_eq!(mb["status"]["phase"], "Cancelled");

    // The ended run is never reopened, and says what it said at the end.
    let run = s.customrun("build-1").await.expect("CustomRun");
    assert_eq!(condition_text(&run), ended, "the ended CustomRun is not rewritten");
    assert!(
        j.iter().all(|r| r.attempt.is_none_or(|n| n == 1)),
        "no retry after a cancel"
    );
    assert_eq!(s.builds_started(), 1);
    s.finish().await;
}

//! Terminal status refused past the controller deadline (seed: "If writes remain refused past the
//! controller deadline, Tekton receives a timeout even though the host journal records
//! `Succeeded`"): an admission policy refuses terminal `macbuilds/status` writes and is never
//! lifted; the CustomRun's timeout is a few seconds more than the build needs, with the shortened
//! controller grace (3 s). The journal reaches `Retired` with outcome `Succeeded` while the
//! CustomRun ends `False/CustomRunTimedOut`; the agent stays alive (its Lease is live throughout).
//! The invariant checker is told the cluster refuses terminal writes (`Stack::deny_terminal_status`),
//! which is invariant 6's exception for the undelivered result.

use std::time::Duration;
use tartan_api::{AttemptState, Outcome, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::stack::condition_text;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack, wait_for_async};

// scenario: refused-past-deadline
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_terminal_status_past_deadline_times_out() {
    let mut s = Stack::new("refused-past-deadline").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.deny_terminal_status().await;
    // The build needs well under a second on tart-double; the CustomRun allows 5 s (+ 3 s grace).
    s.create_run("build-1", &s.build_params(false), Some("5s")).await;

    let retiring = s
        .wait_journal("agent-a", "Retiring with an outcome", Duration::from_secs(60), |r| {
            r.to == AttemptState::Retiring && r.outcome.is_some()
        })
        .await;
    assert_eq!(retiring.outcome, Some(Outcome::Succeeded), "{retiring}");
    let retired = s
        .wait_journal("agent-a", "Retired (VMDeleted)", Duration::from_secs(30), |r| {
            r.to == AttemptState::Retired && r.reason == Some(Reason::VMDeleted)
        })
        .await;
    let mb = s.macbuild("build-1").await.expect("MacBuild");
    assert_ne!(mb["status"]["phase"], "Succeeded", "the terminal write was refused");
    assert!(mb["status"]["journalSeq"].as_u64() < Some(retired.seq));

    let run = s
        .wait_run("build-1", "False", "CustomRunTimedOut", Duration::from_secs(60))
        .await;
    eprintln!("[e2e] {}", condition_text(&run));
    eprintln!("[e2e] results {}", run["status"]["results"]);
    assert_eq!(result(&run, "attempt"), Some("build-1#1"));
    // The controller's rule (controller/src/decide.rs, `decide_timeout`): past timeout + grace
    // without the holder confirming the VM deleted (`VMDeleted=True` on the MacBuild, which the
    // refused terminal write would have carried), the CustomRun ends `CustomRunTimedOut` with
    // `VmRetirement::Unconfirmed` whatever the lease says; with a live lease the message reads
    // "lease is live ... but has not confirmed the VM deleted". `deleted` is only for a
    // cancel-confirmed deletion, `none` only for an unclaimed build.
    assert_eq!(result(&run, "vmRetirement"), Some("unconfirmed"));
    let message = run["status"]["conditions"][0]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("agent agent-a lease is live") && message.contains("has not confirmed the VM deleted"),
        "{message}"
    );
    let lease = s.lease("agent-a").await.expect("the agent's Lease");
    eprintln!(
        "[e2e] agent-a's Lease at the end: renewed {:?}",
        lease.spec.and_then(|l| l.renew_time).map(|t| t.0.to_string())
    );

    // The controller requested the MacBuild's deletion at timeout + grace; the agent, whose VM is
    // gone, lets it go. The result stays in the host journal only.
    wait_for_async(
        "the MacBuild to go after the timeout",
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
    assert_eq!(s.builds_started(), 1);
    eprintln!("{}", s.journal_text("agent-a"));

    // The agent's Lease stayed live: `unconfirmed` is allowed here only because the cluster
    // refused the agent's confirmation (the checker knows, through `deny_terminal_status`).
    s.finish().await;
}

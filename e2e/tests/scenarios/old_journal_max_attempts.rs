//! An agent upgraded across this release restarts while the API is down. Its journal was written
//! by the previous version, whose `Requested` records carry no `max_attempts`; replay then uses
//! `default_max_attempts` (2). Had host-side recovery decided the retry from that journal alone,
//! attempt 2 would run once the API answers although the MacBuild's `spec.maxAttempts` is 1
//! (invariant 5). Such an attempt is left to the cluster's view: it is retired, and no retry
//! follows, once the API answers.

use serde_json::json;
use std::time::Duration;
use tartan_agent::journal::{JOURNAL_DIR, Journal, JournalOptions, read_records};
use tartan_agent::lock::StateLock;
use tartan_api::AttemptState;
use tartan_e2e::invariants::result;
use tartan_e2e::stack::condition_text;
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack, wait_for};

// scenario: old-journal-max-attempts
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_without_max_attempts_never_runs_more_attempts_than_the_macbuild_allows() {
    let mut s = Stack::new("old-journal-max-attempts").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("600")));
    params.push(("max-attempts", json!("1")));
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

    // The same journal as the previous release wrote it: no `max_attempts` on `Requested`.
    let state = s.agent("agent-a").state_dir.clone();
    let records = s.journal("agent-a");
    assert_eq!(
        records
            .iter()
            .find(|r| r.to == AttemptState::Requested)
            .and_then(|r| r.max_attempts),
        Some(1),
        "this release journals maxAttempts 1"
    );
    std::fs::remove_dir_all(state.join(JOURNAL_DIR)).unwrap();
    {
        let lock = StateLock::acquire(&state).unwrap();
        let (mut journal, _) = Journal::open(&lock, JournalOptions::default()).unwrap();
        for r in &records {
            let mut old = r.clone();
            old.max_attempts = None;
            assert_eq!(journal.append(&mut old).unwrap(), r.seq, "same sequence numbers");
        }
    }
    assert!(
        read_records(&state)
            .unwrap()
            .records
            .iter()
            .all(|r| r.max_attempts.is_none())
    );

    s.api_down().await;
    s.open_gate();
    s.spawn_agent("agent-a");
    // Without a journaled maxAttempts the attempt is not retired from the journal alone: the
    // retry decision (and so the retirement) waits for the cluster's view.
    let log_says = || s.agent_log("agent-a").contains("recovering the host side now");
    wait_for(
        "the agent to go on without the cluster",
        Duration::from_secs(30),
        || log_says().then_some(()).ok_or("not yet".to_string()),
    )
    .await;
    assert!(
        !s.journal("agent-a")
            .iter()
            .any(|r| r.attempt == Some(1) && r.to == AttemptState::Retiring),
        "an attempt without a journaled maxAttempts is left to the cluster's view"
    );
    s.api_up().await;
    let run = s.wait_run_ended("build-1", Duration::from_secs(90)).await;
    eprintln!(
        "[e2e] build-1: {} attempt={:?}",
        condition_text(&run),
        result(&run, "attempt")
    );
    let beyond: Vec<String> = s
        .journal("agent-a")
        .iter()
        .filter(|r| r.attempt.is_some_and(|n| n > 1))
        .map(|r| r.to_string())
        .collect();
    assert!(
        beyond.is_empty(),
        "maxAttempts is 1, yet the agent journaled:\n{}",
        beyond.join("\n")
    );
    s.finish().await;
}

//! Issue 14: the Mac reboots mid-build. Every process of the host dies at once (the agent, the
//! watchdog, `tart run`, the guests' step jobs); the VM folders, deadline files and the journal stay
//! on disk. The agent and the watchdog start fresh: every VM of an open attempt is deleted (nothing
//! is left to kill: `killed 0 tart process(es)`), and each build ends as specified: the one allowed
//! a retry passes as `#2`, the one with `max-attempts: 1` ends `False/AttemptsExhausted`.

use serde_json::json;
use std::time::Duration;
use tartan_api::{AttemptState, Outcome, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::stack::condition_text;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack};

// scenario: reboot
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reboot_deletes_every_open_vm_and_retries_what_may_retry() {
    let mut s = Stack::new("reboot").await;
    s.add_agent(
        "agent-a",
        AgentOptions {
            slots: 2,
            ..AgentOptions::default()
        },
    );
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.start_watchdog("agent-a");
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("600")));
    s.create_run("retried", &params, None).await;
    params.push(("max-attempts", json!("1")));
    s.create_run("single", &params, None).await;
    s.wait_builds_started(2, Duration::from_secs(60)).await;
    let before: Vec<String> = s.vms("agent-a").into_iter().filter(|v| v.starts_with("mb-")).collect();
    assert_eq!(before.len(), 2, "{before:?}");

    s.reboot_host("agent-a");
    assert_eq!(
        s.vms("agent-a")
            .into_iter()
            .filter(|v| v.starts_with("mb-"))
            .collect::<Vec<_>>(),
        before,
        "the VM folders survive the reboot"
    );
    s.open_gate();
    s.start_watchdog("agent-a");
    s.start_agent("agent-a").await;

    for b in ["retried", "single"] {
        let r = s
            .wait_journal(
                "agent-a",
                &format!("{b}: Retiring (AgentRestarted)"),
                Duration::from_secs(30),
                |r| {
                    r.build.as_ref().is_some_and(|x| x.name == b)
                        && r.to == AttemptState::Retiring
                        && r.reason == Some(Reason::AgentRestarted)
                },
            )
            .await;
        assert_eq!(r.outcome, Some(Outcome::Interrupted), "{r}");
        assert!(
            r.detail.contains("killed 0 tart process(es)"),
            "nothing survives a reboot: {r}"
        );
    }
    let run = s
        .wait_run("retried", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    assert_eq!(result(&run, "attempt"), Some("retried#2"));
    let run = s.wait_run_ended("single", Duration::from_secs(30)).await;
    assert_eq!(
        run["status"]["conditions"][0]["reason"],
        "AttemptsExhausted",
        "{}",
        condition_text(&run)
    );
    for vm in &before {
        assert!(!s.vms("agent-a").contains(vm), "{vm} of an open attempt is deleted");
    }
    assert!(
        s.watchdog_lines("agent-a").is_empty(),
        "the watchdog had nothing to do: {}",
        s.watchdog_text("agent-a")
    );
    s.finish().await;
}

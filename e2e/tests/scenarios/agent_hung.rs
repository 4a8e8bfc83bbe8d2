//! The agent hung (SIGSTOP) mid-build, on shortened timings (lease 1 s / 4 s): while it is frozen
//! its Lease expires and the CustomRun shows `HostUnreachable=True/LeaseExpired` after `Succeeded`
//! (still `Unknown`); the build step goes on in the VM. After SIGCONT the same attempt ends
//! `True/TestsPassed`, no attempt 2 is ever requested, and `HostUnreachable` is no longer `True`.

use serde_json::{Value, json};
use std::time::{Duration, Instant};
use tartan_api::{AttemptState, Outcome};
use tartan_e2e::invariants::result;
use tartan_e2e::stack::condition_text;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack, wait_for_async};

/// The build step sleeps this long after it starts: longer than the freeze needs (lease 4 s,
/// then a reconcile).
const STEP_SLEEP_SECS: u64 = 8;

fn host_unreachable(run: &Value) -> Option<(usize, &Value)> {
    run["status"]["conditions"]
        .as_array()?
        .iter()
        .enumerate()
        .find(|(_, c)| c["type"] == "HostUnreachable")
}

// scenario: agent-hung
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_hung_same_attempt_succeeds() {
    let mut s = Stack::new("agent-hung").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let mut params = s.build_params(false);
    for (name, value) in params.iter_mut() {
        if *name == "steps" {
            let steps = value.as_array_mut().expect("steps list");
            // After the "started" marker, before the JUnit report.
            steps.insert(1, json!(format!("sleep {STEP_SLEEP_SECS}")));
        }
    }
    params.push(("timeout-seconds", json!("300")));
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    let frozen_at = Instant::now();
    s.freeze_agent("agent-a");

    let run = wait_for_async(
        "HostUnreachable=True after Succeeded=Unknown on CustomRun build-1",
        Duration::from_secs(30),
        || async {
            let run = s.customrun("build-1").await.ok_or("no CustomRun")?;
            let first = &run["status"]["conditions"][0];
            match host_unreachable(&run) {
                Some((i, c)) if i > 0 && c["status"] == "True" && first["type"] == "Succeeded" => Ok(run),
                other => Err(format!(
                    "conditions[0] {first}; HostUnreachable {:?}",
                    other.map(|(i, c)| format!("at {i}: {c}"))
                )),
            }
        },
    )
    .await;
    let (_, c) = host_unreachable(&run).unwrap();
    eprintln!(
        "[e2e] {:.1}s after SIGSTOP: HostUnreachable {}/{}: {}; Succeeded {}",
        frozen_at.elapsed().as_secs_f64(),
        c["status"],
        c["reason"],
        c["message"],
        condition_text(&run)
    );
    assert_eq!(c["reason"], "LeaseExpired");
    assert_eq!(
        run["status"]["conditions"][0]["status"], "Unknown",
        "the build is not over while the agent is frozen"
    );
    let step_running = s.tart_pids("agent-a").len();
    s.thaw_agent("agent-a");
    eprintln!(
        "[e2e] SIGCONT after {:.1}s frozen ({step_running} tart process(es) alive at thaw)",
        frozen_at.elapsed().as_secs_f64()
    );

    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    eprintln!("[e2e] {}", condition_text(&run));
    assert_eq!(result(&run, "attempt"), Some("build-1#1"), "the same attempt");
    assert_eq!(result(&run, "testsPassed"), Some("2"));
    assert_eq!(result(&run, "vmRetirement"), Some("deleted"));
    if let Some((_, c)) = host_unreachable(&run) {
        assert_ne!(c["status"], "True", "HostUnreachable still True on the ended run: {c}");
        eprintln!(
            "[e2e] HostUnreachable at the end {}/{}: {}",
            c["status"], c["reason"], c["message"]
        );
    }

    // No attempt 2 was ever requested: not in the journal, not in the MacBuild's status.
    let journal = s.journal("agent-a");
    assert!(
        journal.iter().all(|r| r.attempt.is_none_or(|n| n == 1)),
        "only attempt 1 in the journal:\n{}",
        s.journal_text("agent-a")
    );
    assert!(
        journal
            .iter()
            .any(|r| r.to == AttemptState::Retiring && r.attempt == Some(1) && r.outcome == Some(Outcome::Succeeded))
    );
    let mb = s.macbuild("build-1").await.expect("MacBuild");
    let numbers: Vec<u64> = mb["status"]["attempts"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x["number"].as_u64()).collect())
        .unwrap_or_default();
    assert_eq!(numbers, vec![1], "MacBuild attempts {}", mb["status"]["attempts"]);
    assert_eq!(s.builds_started(), 1, "the build step ran once");
    s.finish().await;
}

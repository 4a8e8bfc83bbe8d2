//! A one-sided partition (issue 14): the agent cannot reach the API (the emulator drops every
//! request and watch of the agent's ServiceAccount) while the controller can, for longer than the
//! agent's lease. The agent goes on with its build; the controller sees the lease expire and shows
//! `HostUnreachable=True/LeaseExpired` on the CustomRun. Then either
//! - the partition heals before the deadline: the build, finished during the partition, is
//!   delivered (the same attempt, `True/TestsPassed`, `vmRetirement=deleted`), or
//! - it lasts past the deadline: the agent's own host deadline deletes the VM during the
//!   partition, the controller ends the run `False/CustomRunTimedOut` with `vmRetirement=unconfirmed`
//!   (it cannot know) and requests the MacBuild's deletion, which the finalizer holds until the
//!   agent is back and releases it.

use serde_json::json;
use std::time::{Duration, Instant};
use tartan_api::{AttemptState, Outcome};
use tartan_e2e::invariants::result;
use tartan_e2e::stack::{condition_of, condition_text};
use tartan_e2e::{AgentOptions, ControllerOptions, Stack, wait_for_async};

/// Starts agent-a (and its watchdog) and the controller, creates a gated build and waits until
/// its step runs; returns the stack and the VM.
async fn partitioned_build(name: &str, params_timeout: Option<&str>, run_timeout: Option<&str>) -> (Stack, String) {
    let mut s = Stack::new(name).await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.start_watchdog("agent-a");
    let mut params = s.build_params(true);
    if let Some(t) = params_timeout {
        params.push(("timeout-seconds", json!(t)));
    }
    s.create_run("build-1", &params, run_timeout).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    let (vm, _) = s.admitted_vm("agent-a").await;

    let cut_at = Instant::now();
    s.partition_agents();
    let run = s.wait_host_unreachable("build-1", Duration::from_secs(30)).await;
    let (_, c) = condition_of(&run, "HostUnreachable").unwrap();
    eprintln!(
        "[e2e] {:.1}s into the partition: HostUnreachable {}: {}; Succeeded {}",
        cut_at.elapsed().as_secs_f64(),
        c["reason"],
        c["message"],
        condition_text(&run)
    );
    assert_eq!(c["reason"], "LeaseExpired");
    assert_eq!(
        run["status"]["conditions"][0]["status"], "Unknown",
        "the build is not over"
    );
    (s, vm)
}

// scenario: partition-healed emulator-only
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_healed_before_the_deadline_delivers_the_result() {
    let (s, vm) = partitioned_build("partition-healed", Some("300"), None).await;
    // The agent, cut off, still runs its build to the end and deletes its VM.
    assert!(s.vms("agent-a").contains(&vm), "the VM runs on during the partition");
    s.open_gate();
    let retired = s
        .wait_journal(
            "agent-a",
            "Retired during the partition",
            Duration::from_secs(30),
            |r| r.to == AttemptState::Retired,
        )
        .await;
    eprintln!("[e2e] during the partition: {retired}");
    assert!(!s.vms("agent-a").contains(&vm));
    let run = s.customrun("build-1").await.expect("CustomRun");
    assert_eq!(
        run["status"]["conditions"][0]["status"],
        "Unknown",
        "nothing reached the cluster yet: {}",
        condition_text(&run)
    );
    let mb = s.macbuild("build-1").await.expect("MacBuild");
    assert!(
        mb["status"]["journalSeq"].as_u64() < Some(retired.seq),
        "the MacBuild is behind the journal: {}",
        mb["status"]
    );

    let healed_at = Instant::now();
    s.heal_partition();
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    eprintln!(
        "[e2e] {:.1}s after healing: {}",
        healed_at.elapsed().as_secs_f64(),
        condition_text(&run)
    );
    assert_eq!(result(&run, "attempt"), Some("build-1#1"), "the same attempt");
    assert_eq!(result(&run, "testsPassed"), Some("2"));
    assert_eq!(result(&run, "vmRetirement"), Some("deleted"));
    if let Some((_, c)) = condition_of(&run, "HostUnreachable") {
        assert_ne!(c["status"], "True", "HostUnreachable still True on the ended run: {c}");
    }
    let j = s.journal("agent-a");
    assert!(
        j.iter()
            .any(|r| r.to == AttemptState::Retiring && r.outcome == Some(Outcome::Succeeded)),
        "{}",
        s.journal_text("agent-a")
    );
    assert!(j.iter().all(|r| r.attempt.is_none_or(|n| n == 1)), "no second attempt");
    assert_eq!(s.builds_started(), 1);
    assert!(
        s.watchdog_lines("agent-a").is_empty(),
        "the watchdog had nothing to do: {}",
        s.watchdog_text("agent-a")
    );
    s.finish().await;
}

// scenario: partition-past-deadline emulator-only
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_past_the_deadline_times_out_unconfirmed_and_the_vm_is_still_deleted() {
    // Host deadline and CustomRun timeout 20 s (+ 3 s controller grace); the gate never opens.
    let (s, vm) = partitioned_build("partition-past-deadline", None, Some("20s")).await;
    let mb = s.macbuild("build-1").await.expect("MacBuild");
    assert_eq!(
        mb["spec"]["timeoutSeconds"], 20,
        "the host deadline follows the CustomRun's"
    );

    // The VM is deleted during the partition: by the agent at its host deadline (or by the
    // watchdog, 3 s later, if the agent failed to).
    wait_for_async(
        "the VM deleted during the partition",
        Duration::from_secs(60),
        || async {
            if s.vms("agent-a").contains(&vm) {
                Err(format!("VMs {:?}", s.vms("agent-a")))
            } else {
                Ok(())
            }
        },
    )
    .await;
    let j = s.journal("agent-a");
    let by_agent = j.iter().find(|r| r.to == AttemptState::Retired);
    let by_watchdog = s.watchdog_lines("agent-a");
    eprintln!(
        "[e2e] VM {vm} deleted during the partition; agent: {}; watchdog: {}",
        by_agent.map_or("nothing journaled".into(), |r| r.to_string()),
        s.watchdog_text("agent-a").trim()
    );
    assert!(
        by_agent.is_some() || !by_watchdog.is_empty(),
        "someone recorded the deletion:\n{}",
        s.journal_text("agent-a")
    );

    let run = s
        .wait_run("build-1", "False", "CustomRunTimedOut", Duration::from_secs(60))
        .await;
    let ended = condition_text(&run);
    eprintln!("[e2e] {ended}");
    assert_eq!(result(&run, "vmRetirement"), Some("unconfirmed"), "{ended}");
    assert!(ended.contains("agent agent-a lease expired"), "{ended}");
    // Deletion requested, held by the finalizer of the agent that cannot be reached.
    let mb = s
        .wait_macbuild("build-1", "deletion requested", Duration::from_secs(30), |m| {
            m["metadata"]["deletionTimestamp"].is_string()
        })
        .await;
    eprintln!("[e2e] MacBuild held by finalizers {}", mb["metadata"]["finalizers"]);

    let healed_at = Instant::now();
    s.heal_partition();
    wait_for_async(
        "the MacBuild to go once the agent is back",
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
    eprintln!(
        "[e2e] {:.1}s after healing: the MacBuild is gone",
        healed_at.elapsed().as_secs_f64()
    );
    let run = s.customrun("build-1").await.expect("CustomRun");
    assert_eq!(condition_text(&run), ended, "the ended CustomRun is not rewritten");
    assert!(
        s.journal("agent-a").iter().all(|r| r.attempt.is_none_or(|n| n == 1)),
        "no second attempt past the deadline:\n{}",
        s.journal_text("agent-a")
    );
    assert_eq!(s.builds_started(), 1);
    s.finish().await;
}

//! Issue 11's three defects, each reproduced on purpose: results erased by a restarted agent that
//! resolves a quarantine, a cancelled build's quarantined VM never deleted after a restart, and a
//! finished build claimed and cloned again from a stale view of the cluster.

use serde_json::json;
use std::time::Duration;
use tartan_api::{AttemptState, FINALIZER, Outcome, Reason};
use tartan_e2e::invariants::{journaled_results, result};
use tartan_e2e::stack::condition_text;
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack, wait_for, wait_for_async};

/// Starts one agent (one slot) and the controller, runs gated `build-1` until its step started,
/// makes every `tart delete` fail and opens the gate: the attempt retires with its results and
/// ends `Quarantined (DeleteFailed)`. Returns the stack and the VM.
async fn quarantined_with_results(name: &str) -> (Stack, String) {
    let mut s = Stack::new(name).await;
    s.add_agent("agent-a", AgentOptions::default());
    // A grace long enough that the restarted agent's confirmation, not the machine's speed,
    // decides what the CustomRun says after a cancel while the agent was down.
    s.start_controller(ControllerOptions {
        grace: "30s",
        ..ControllerOptions::default()
    });
    s.start_agent("agent-a").await;
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("600")));
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    let (vm, _) = s.admitted_vm("agent-a").await;
    s.tart_faults("agent-a", json!({"global": {"delete_fails": true}}));
    s.open_gate();
    let retiring = s
        .wait_journal(
            "agent-a",
            "Collecting -> Retiring (TestsPassed)",
            Duration::from_secs(60),
            |r| r.to == AttemptState::Retiring && r.reason == Some(Reason::TestsPassed),
        )
        .await;
    eprintln!("[e2e] journaled: {retiring}");
    let results = retiring.status.as_ref().map(|st| st["results"].clone());
    assert_eq!(
        results.as_ref().map(|r| r["testsPassed"].clone()),
        Some(json!(2)),
        "the Retiring record carries the results: {retiring:?}"
    );
    let q = s
        .wait_journal("agent-a", "Quarantined (DeleteFailed)", Duration::from_secs(30), |r| {
            r.to == AttemptState::Quarantined && r.reason == Some(Reason::DeleteFailed)
        })
        .await;
    eprintln!("[e2e] journaled: {q}");
    assert_eq!(q.vm.as_deref(), Some(vm.as_str()));
    (s, vm)
}

/// Defect 1: the restarted agent resolves the quarantine; the CustomRun must show the results
/// journaled at `Retiring` (2/2 and the artifact), not empty ones.
// scenario: results-kept
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_agent_resolving_a_quarantine_keeps_the_results() {
    let (mut s, vm) = quarantined_with_results("results-kept").await;
    s.kill_agent("agent-a", KillMode::Group);
    s.tart_faults("agent-a", json!({}));
    s.start_agent("agent-a").await;
    let resolved = s
        // The quarantine's delete is retried every 30 s (`quarantine_retry`).
        .wait_journal(
            "agent-a",
            "Quarantined -> Retired at restart",
            Duration::from_secs(60),
            |r| r.from == Some(AttemptState::Quarantined) && r.to == AttemptState::Retired,
        )
        .await;
    eprintln!("[e2e] journaled: {resolved}");
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(30))
        .await;
    let world = s.world().await;
    let (want, at) = journaled_results(&world, "build-1#1").expect("attempt 1's outcome is journaled");
    let got = ["testsPassed", "testsTotal", "artifact"].map(|n| result(&run, n).unwrap_or("").to_string());
    eprintln!("[e2e] CustomRun results {got:?}; journaled at #{} {want:?}", at.seq);
    for v in tartan_e2e::invariants::check(&world) {
        eprintln!("[e2e] checker: {v}");
    }
    assert_eq!(
        got,
        want,
        "the CustomRun's results are those journaled with the outcome ({at}); the resolution journaled {:?}",
        resolved.status.as_ref().map(|st| &st["results"])
    );
    assert!(!s.vms("agent-a").contains(&vm));
    assert_eq!(s.builds_started(), 1, "the build ran once");
    s.finish().await;
}

/// Defect 2: quarantined, the agent killed, the CustomRun cancelled while it is down: the
/// restarted agent deletes the VM at once (not at the watchdog's deadline), releases the
/// finalizer's hold, and frees the slot for the next build.
// scenario: quarantine-cancelled
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_while_down_in_quarantine_the_vm_is_deleted_at_restart() {
    let (mut s, vm) = quarantined_with_results("quarantine-cancelled").await;
    s.kill_agent("agent-a", KillMode::Group);
    s.cancel_run("build-1").await;
    s.wait_macbuild("build-1", "cancel requested", Duration::from_secs(15), |m| {
        m["spec"]["cancelRequested"] == true
    })
    .await;
    s.tart_faults("agent-a", json!({}));
    s.start_agent("agent-a").await;
    // Promptly: the quarantine's delete is retried 1 s after the start, long before the
    // deadline (600 s) the watchdog would act on.
    wait_for(
        &format!("the restarted agent to delete {vm}"),
        Duration::from_secs(45),
        || {
            let vms = s.vms("agent-a");
            (!vms.contains(&vm)).then_some(()).ok_or_else(|| {
                let tail: Vec<String> = s
                    .journal("agent-a")
                    .iter()
                    .rev()
                    .take(6)
                    .map(|r| r.to_string())
                    .collect();
                format!("VMs {vms:?}; journal ends (newest first):\n{}", tail.join("\n"))
            })
        },
    )
    .await;
    let retired = s
        .wait_journal("agent-a", "attempt 1 Retired", Duration::from_secs(15), |r| {
            r.attempt == Some(1) && r.to == AttemptState::Retired
        })
        .await;
    eprintln!("[e2e] journaled: {retired}");
    let run = s.wait_run_ended("build-1", Duration::from_secs(30)).await;
    eprintln!(
        "[e2e] build-1: {} vmRetirement={:?}",
        condition_text(&run),
        result(&run, "vmRetirement")
    );
    assert_eq!(
        result(&run, "vmRetirement"),
        Some("deleted"),
        "{}",
        condition_text(&run)
    );
    wait_for_async("the agent's finalizer released", Duration::from_secs(15), || async {
        match s.macbuild("build-1").await {
            Some(m)
                if m["metadata"]["finalizers"]
                    .as_array()
                    .is_some_and(|f| f.iter().any(|x| x == FINALIZER)) =>
            {
                Err(format!("finalizers {}", m["metadata"]["finalizers"]))
            }
            _ => Ok(()),
        }
    })
    .await;
    // The slot is free: the next build runs.
    s.create_run("build-2", &s.build_params(false), None).await;
    s.wait_run("build-2", "True", "TestsPassed", Duration::from_secs(30))
        .await;
    let outcomes: Vec<Outcome> = s
        .journal("agent-a")
        .iter()
        .filter(|r| r.build.as_ref().is_some_and(|b| b.name == "build-1"))
        .filter_map(|r| r.outcome)
        .collect();
    eprintln!("[e2e] build-1 outcomes journaled: {outcomes:?}");
    s.finish().await;
}

/// Defect 3: the agent's view of the cluster goes stale (its MacBuild watch stalls) while a
/// build it saw unclaimed waits for its only slot; that build is then claimed, run and retired
/// (its terminal status write refused, so still in flight) — and, still unclaimed in the stale
/// view, must never be claimed, admitted or cloned again: the journal says it is finished.
// scenario: stale-view
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_build_is_never_claimed_again_from_a_stale_view() {
    let mut s = Stack::new("stale-view").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let mut gated = s.build_params(true);
    gated.push(("timeout-seconds", json!("600")));
    s.create_run("build-1", &gated, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;

    // build-2 waits for the slot build-1 holds. Its MacBuild exists, so the watch event went out;
    // one more Lease renewal (a second) gives the agent's watch time to take it in.
    s.create_run("build-2", &s.build_params(false), None).await;
    s.wait_macbuild("build-2", "created, unclaimed", Duration::from_secs(15), |m| {
        m["status"]["claim"].is_null()
    })
    .await;
    let renewed = s.lease("agent-a").await.and_then(|l| l.spec?.renew_time).map(|t| t.0);
    wait_for_async("one more Lease renewal by agent-a", Duration::from_secs(10), || async {
        let now = s.lease("agent-a").await.and_then(|l| l.spec?.renew_time).map(|t| t.0);
        match (renewed, now) {
            (Some(a), Some(b)) if b > a => Ok(()),
            _ => Err(format!("renewTime {now:?}, was {renewed:?}")),
        }
    })
    .await;

    // A real apiserver cannot stall one client's watches: there the step is skipped and the rest
    // (retired with its terminal write refused, then delivered, never claimed again) still runs.
    let stalls = s.cluster.is_emulator();
    if stalls {
        s.cluster.emulator_faults(&json!({"watchesStalled": true}));
    } else {
        eprintln!(
            "[e2e] stale-view: the watch stall and the watch-history compaction need the emulator; skipped on the real apiserver"
        );
    }
    s.deny_terminal_status().await;
    s.open_gate();
    let retired = s
        .wait_journal(
            "agent-a",
            "build-2 a1 Retired (VMDeleted)",
            Duration::from_secs(60),
            |r| {
                r.build.as_ref().is_some_and(|b| b.name == "build-2")
                    && r.attempt == Some(1)
                    && r.to == AttemptState::Retired
                    && r.reason == Some(Reason::VMDeleted)
            },
        )
        .await;
    eprintln!("[e2e] journaled: {retired}");

    // Restart the watch: lift the stall (stalled watches end and resume), drop the history so
    // a resumed watch gets 410 Gone and relists; let the terminal writes through.
    if stalls {
        s.cluster.compact_watch_history();
        s.cluster.emulator_faults(&json!({"watchesStalled": false}));
    }
    s.allow_terminal_status().await;
    s.wait_run("build-2", "True", "TestsPassed", Duration::from_secs(30))
        .await;
    s.wait_run("build-1", "True", "TestsPassed", Duration::from_secs(30))
        .await;
    // A later build runs on the same slot: any second claim of build-2 (older, so first in the
    // queue) would have come before it.
    s.create_run("build-3", &s.build_params(false), None).await;
    s.wait_run("build-3", "True", "TestsPassed", Duration::from_secs(30))
        .await;
    let again: Vec<String> = s
        .journal("agent-a")
        .iter()
        .filter(|r| r.build.as_ref().is_some_and(|b| b.name == "build-2") && r.seq > retired.seq)
        .map(|r| r.to_string())
        .collect();
    assert!(
        again.is_empty(),
        "build-2 was finished (#{}) and yet journaled again:\n{}",
        retired.seq,
        again.join("\n")
    );
    s.finish().await;
}

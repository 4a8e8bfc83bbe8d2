//! A live stale writer (issue 14): agent A is frozen (SIGSTOP) mid-step past its lease; an
//! operator hands the build on by resetting the MacBuild's claim (a fenced status patch, as
//! `kubectl patch --subresource=status` would), and agent B claims it anew and runs it. Then A
//! thaws: its first status write tests A's claim (holder and attempt), which is no longer on the
//! MacBuild, so the API refuses it (the fence), and A stops its copy at once, `Retiring
//! (ClaimLost)` with no outcome, deletes its own VM and never touches B's; B's build ends the
//! CustomRun `True/TestsPassed`.
//!
//! Each host has its own gate (the step runs in the VM's folder, under the agent's tart home), so
//! that A ends while B is still running: A's refused writes and A's cleanup happen while B holds
//! the build.

use kube::api::{Patch, PatchParams};
use serde_json::json;
use std::time::{Duration, Instant};
use tartan_api::{AttemptState, FINALIZER, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::stack::{IMAGE, condition_text};
use tartan_e2e::{AgentOptions, ControllerOptions, Stack};

fn holder(mb: &serde_json::Value) -> &str {
    mb["status"]["claim"]["holder"].as_str().unwrap_or("")
}

fn has_finalizer(mb: &serde_json::Value) -> bool {
    mb["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| f.iter().any(|x| x == FINALIZER))
}

// scenario: stale-writer
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thawed_stale_holder_is_fenced_out_and_cleans_up_only_its_own_vm() {
    let mut s = Stack::new("stale-writer").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.add_agent("agent-b", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;

    let dir = s.dir.display().to_string();
    let artifacts = s.artifacts_dir().display().to_string();
    let params = vec![
        ("image", json!(IMAGE)),
        (
            "steps",
            json!([
                format!("echo \"$PWD\" >> {dir}/started"),
                format!(
                    "case \"$PWD\" in */agent-a/tart/*) g=gate-a ;; *) g=gate-b ;; esac; \
                     while [ ! -e {dir}/$g ]; do sleep 0.1; done"
                ),
                "mkdir -p out && printf '<testsuite name=\"App\" tests=\"2\" failures=\"0\"><testcase name=\"a\"/><testcase name=\"b\"/></testsuite>' > out/junit.xml && echo app > out/App.ipa",
            ]),
        ),
        ("test-report", json!("out/junit.xml")),
        ("artifact-paths", json!(["out/App.ipa"])),
        ("artifact-destination", json!(format!("file://{artifacts}/"))),
        ("timeout-seconds", json!("300")),
    ];
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    let (vm_a, _) = s.admitted_vm("agent-a").await;
    // B starts only now: the build is A's.
    s.start_agent("agent-b").await;

    let frozen_at = Instant::now();
    s.freeze_agent("agent-a");
    s.wait_host_unreachable("build-1", Duration::from_secs(30)).await;
    eprintln!(
        "[e2e] {:.1}s after SIGSTOP: A's lease expired",
        frozen_at.elapsed().as_secs_f64()
    );

    // The operator's hand-over: the claim is removed, fenced on A still holding it.
    let reset = json!([
        {"op": "test", "path": "/status/claim/holder", "value": "agent-a"},
        {"op": "remove", "path": "/status/claim"},
        {"op": "replace", "path": "/status/phase", "value": "Pending"},
        {"op": "replace", "path": "/status/message", "value": "claim reset by an operator: agent-a is unreachable"},
    ]);
    let patch: json_patch::Patch = serde_json::from_value(reset).unwrap();
    s.macbuilds()
        .patch_status("build-1", &PatchParams::default(), &Patch::Json::<()>(patch))
        .await
        .expect("resetting the claim");
    eprintln!("[e2e] the claim of agent-a on build-1 reset");

    s.wait_builds_started(2, Duration::from_secs(60)).await;
    let (vm_b, _) = s.admitted_vm("agent-b").await;
    let mb = s.macbuild("build-1").await.expect("MacBuild");
    assert_eq!(holder(&mb), "agent-b", "B holds the build: {}", mb["status"]);
    let claim_b = mb["status"]["claim"].clone();
    eprintln!("[e2e] B claimed it: {claim_b}; B's VM {vm_b}");

    let thawed = k8s_openapi::jiff::Timestamp::now();
    s.thaw_agent("agent-a");
    s.wait_lease_renewed("agent-a", thawed).await;
    // A's step ends while B still runs; the status write of that transition is fenced out, and A
    // learns from it that the claim moved.
    std::fs::write(s.dir.join("gate-a"), b"open").unwrap();
    let retired_a = s
        .wait_journal("agent-a", "A retired its attempt", Duration::from_secs(30), |r| {
            r.to == AttemptState::Retired
        })
        .await;
    eprintln!("[e2e] A: {retired_a}");
    assert!(
        s.journal("agent-a")
            .iter()
            .any(|r| r.to == AttemptState::Retiring && r.reason == Some(Reason::ClaimLost) && r.outcome.is_none()),
        "A stopped its copy once the claim moved, with no outcome of its own:\n{}",
        s.journal_text("agent-a")
    );
    assert!(!s.vms("agent-a").contains(&vm_a), "A deleted its own VM {vm_a}");
    assert!(s.vms("agent-b").contains(&vm_b), "B's VM {vm_b} untouched by A");
    // Every write of A after the thaw was refused: its terminal record was fenced out, and the
    // MacBuild shows B's claim, B's phase, none of A's journal sequence numbers.
    let fenced = tartan_e2e::wait_for(
        "A's log to report its writes fenced out",
        Duration::from_secs(30),
        || {
            let log = s.agent_log("agent-a");
            log.lines()
                .find(|l| l.contains("fenced out"))
                .map(str::to_string)
                .ok_or("no \"fenced out\" line yet".to_string())
        },
    )
    .await;
    eprintln!("[e2e] A's log: {fenced}");
    let mb = s.macbuild("build-1").await.expect("MacBuild");
    assert_eq!(mb["status"]["claim"], claim_b, "B's claim stands: {}", mb["status"]);
    assert_ne!(
        mb["status"]["phase"], "Succeeded",
        "A's result was not written: {}",
        mb["status"]
    );
    let seq = mb["status"]["journalSeq"].as_u64();
    assert!(
        s.journal("agent-b").iter().any(|r| Some(r.seq) == seq),
        "journalSeq {seq:?} is one of B's records:\n{}",
        s.journal_text("agent-b")
    );
    assert!(
        has_finalizer(&mb),
        "A's cleanup left the finalizer that keeps B's build: {}",
        mb["metadata"]
    );

    std::fs::write(s.dir.join("gate-b"), b"open").unwrap();
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    eprintln!("[e2e] {}", condition_text(&run));
    // B's claim continues the numbering: A's attempt 1 (still running when B claimed) is never
    // reused, nor its VM name.
    assert_eq!(result(&run, "attempt"), Some("build-1#2"));
    assert_eq!(result(&run, "vmRetirement"), Some("deleted"));
    let mb = s.macbuild("build-1").await.expect("MacBuild");
    assert_eq!(holder(&mb), "agent-b");
    assert!(!s.vms("agent-b").contains(&vm_b), "B deleted its VM");
    assert!(
        s.watchdog_lines("agent-a").is_empty() && s.watchdog_lines("agent-b").is_empty(),
        "no watchdog action"
    );
    assert_eq!(s.builds_started(), 2, "one step run on each host");
    s.finish().await;
}

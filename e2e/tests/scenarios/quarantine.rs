//! A VM that cannot be confirmed gone keeps its slot: a failing `tart delete` at agent start
//! quarantines the slot until deletion succeeds (`Quarantined -> Retired (Resolved)`), then
//! attempt 2 runs; an `mb-` VM with no open attempt (`UnknownVM`) blocks admission until an
//! operator removes it.

use serde_json::json;
use std::time::Duration;
use tartan_api::{AttemptState, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::stack::IMAGE;
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack, wait_for_async};

// scenario: quarantine
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_delete_quarantines_then_resolves() {
    let mut s = Stack::new("quarantine").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("600")));
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    let (vm, _) = s.admitted_vm("agent-a").await;

    s.tart_faults("agent-a", json!({"global": {"delete_fails": true}}));
    s.kill_agent("agent-a", KillMode::GroupAndVms);
    s.open_gate();
    s.start_agent("agent-a").await;
    let q = s
        .wait_journal("agent-a", "Quarantined (DeleteFailed)", Duration::from_secs(30), |r| {
            r.to == AttemptState::Quarantined && r.reason == Some(Reason::DeleteFailed)
        })
        .await;
    assert_eq!(q.vm.as_deref(), Some(vm.as_str()));
    let mb = s
        .wait_macbuild(
            "build-1",
            "Pending and naming the quarantined VM",
            Duration::from_secs(15),
            |m| m["status"]["phase"] == "Pending" && m["status"]["vm"] == vm.as_str(),
        )
        .await;
    eprintln!("[e2e] MacBuild while quarantined: {}", mb["status"]["message"]);
    assert!(s.vms("agent-a").contains(&vm));
    assert!(
        !s.journal("agent-a")
            .iter()
            .any(|r| r.attempt == Some(2) && r.to == AttemptState::Admitted),
        "no attempt 2 while the slot is quarantined"
    );

    s.tart_faults("agent-a", json!({}));
    s.wait_journal(
        "agent-a",
        "Quarantined -> Retired (Resolved)",
        Duration::from_secs(60),
        |r| r.to == AttemptState::Retired && r.reason == Some(Reason::Resolved),
    )
    .await;
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    assert_eq!(result(&run, "attempt"), Some("build-1#2"));
    assert!(!s.vms("agent-a").contains(&vm));
    s.finish().await;
}

// scenario: unknown-vm
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_vm_blocks_the_slot_until_removed() {
    let mut s = Stack::new("unknown-vm").await;
    s.add_agent("agent-a", AgentOptions::default());
    let stray = "mb-e2e-stray-0000beef";
    let out = s.tart("agent-a", &["clone", IMAGE, stray]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    s.plant_vm("agent-a", "operator-vm");
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.wait_journal("agent-a", "Quarantined (UnknownVM)", Duration::from_secs(30), |r| {
        r.to == AttemptState::Quarantined && r.reason == Some(Reason::UnknownVM) && r.vm.as_deref() == Some(stray)
    })
    .await;

    s.create_run("build-1", &s.build_params(false), None).await;
    s.wait_macbuild("build-1", "created", Duration::from_secs(30), |_| true)
        .await;
    // The agent keeps renewing (so it is looking at the build) and admits nothing.
    let lease_seen = s.lease("agent-a").await.and_then(|l| l.spec?.renew_time).map(|t| t.0);
    wait_for_async(
        "two more Lease renewals by agent-a",
        Duration::from_secs(15),
        || async {
            let now = s.lease("agent-a").await.and_then(|l| l.spec?.renew_time).map(|t| t.0);
            match (lease_seen, now) {
                (Some(a), Some(b)) if b.as_second() >= a.as_second() + 2 => Ok(()),
                _ => Err(format!("renewTime {now:?}, was {lease_seen:?}")),
            }
        },
    )
    .await;
    assert!(
        !s.journal("agent-a").iter().any(|r| r.to == AttemptState::Admitted),
        "nothing is admitted while the unknown VM holds the slot:\n{}",
        s.journal_text("agent-a")
    );
    assert!(
        s.vms("agent-a").contains(&stray.to_string()),
        "the agent never deletes an unknown VM"
    );

    s.operator_delete_vm("agent-a", stray);
    s.wait_journal("agent-a", "the unknown VM resolved", Duration::from_secs(30), |r| {
        r.to == AttemptState::Retired && r.vm.as_deref() == Some(stray)
    })
    .await;
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    assert_eq!(result(&run, "attempt"), Some("build-1#1"));
    s.finish().await;
}

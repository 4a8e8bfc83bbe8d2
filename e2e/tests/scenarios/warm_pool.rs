//! The warm pool (`[pool]`, docs/warm-pool.md): a build whose image matches a ready warm VM starts
//! in it with no clone and no boot, and the VM is deleted after that one build; a build of another
//! image evicts a warm VM first and starts cold; warm VMs an earlier agent run left are deleted,
//! never handed to a build, by the next start or, with the agent gone, by the watchdog; an adopted
//! build resumes across an upgrade; a cancel while the adoption's probe hangs ends the build.

use serde_json::json;
use std::time::Duration;
use tartan_agent::record::Record;
use tartan_api::{AttemptState, Outcome, Reason};
use tartan_e2e::stack::{IMAGE, POOL_OF_ONE};
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack};

/// Another image, which no warm VM serves.
pub(crate) const OTHER_IMAGE: &str = "ghcr.io/cirruslabs/macos-sonoma-base:latest";

pub(crate) fn pool_agent() -> AgentOptions {
    AgentOptions {
        pool: POOL_OF_ONE,
        ..AgentOptions::default()
    }
}

pub(crate) fn is_warm(r: &Record) -> bool {
    r.build.is_none() && r.warm.is_some()
}

pub(crate) fn of_build<'a>(journal: &'a [Record], name: &str) -> Vec<&'a Record> {
    journal
        .iter()
        .filter(|r| r.build.as_ref().is_some_and(|b| b.name == name))
        .collect()
}

/// Waits until agent `id` journals a warm VM ready that is not in `except`; its name.
pub(crate) async fn warm_ready(s: &Stack, id: &str, except: &[String]) -> String {
    let r = s
        .wait_journal(id, "a warm VM ready", Duration::from_secs(60), |r| {
            is_warm(r) && r.to == AttemptState::Running && r.vm.as_ref().is_some_and(|vm| !except.contains(vm))
        })
        .await;
    r.vm.expect("a warm record names its VM")
}

// scenario: warm-pool-adoption
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_starts_in_the_warm_vm_without_clone_or_boot_and_the_pool_refills() {
    let mut s = Stack::new("warm-pool-adoption").await;
    s.add_agent("agent-a", pool_agent());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let warm = warm_ready(&s, "agent-a", &[]).await;
    assert!(tartan_api::is_warm_vm(&warm), "{warm}");

    s.create_run("build-1", &s.build_params(false), None).await;
    s.wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    let journal = s.journal("agent-a");
    let build = of_build(&journal, "build-1");
    let admitted = build.iter().find(|r| r.to == AttemptState::Admitted).expect("admitted");
    assert_eq!(admitted.vm.as_deref(), Some(warm.as_str()), "admitted into the warm VM");
    assert!(admitted.warm.is_some());
    assert!(
        build
            .iter()
            .any(|r| r.to == AttemptState::Running && r.reason == Some(Reason::Adopted)),
        "{}",
        s.journal_text("agent-a")
    );
    assert!(
        !build.iter().any(|r| r.to == AttemptState::Booting),
        "no clone and no boot for the build:\n{}",
        s.journal_text("agent-a")
    );
    // The hand-over is the record right after the admission (one write).
    let handed = journal
        .iter()
        .find(|r| r.seq == admitted.seq + 1)
        .expect("a record after the admission");
    assert!(
        is_warm(handed) && handed.to == AttemptState::Retired && handed.reason == Some(Reason::Adopted),
        "{handed}"
    );
    assert!(
        build
            .iter()
            .any(|r| r.to == AttemptState::Retired && r.reason == Some(Reason::VMDeleted)),
        "the warm VM is deleted after its one build"
    );
    assert!(!s.vms("agent-a").contains(&warm));
    let mb = s.macbuild("build-1").await.expect("MacBuild");
    assert_eq!(mb["status"]["attempts"][0]["vm"], json!(warm));

    let next = warm_ready(&s, "agent-a", std::slice::from_ref(&warm)).await;
    assert_ne!(next, warm, "the pool refills with a fresh VM");
    let got = s
        .kubectl_tartan(&["get", "build-1"])
        .output()
        .expect("kubectl-tartan get");
    let text = String::from_utf8_lossy(&got.stdout);
    assert!(
        got.status.success() && text.contains("START") && text.contains("warm"),
        "{text}"
    );
    let (code, metrics) = s.agent_http("agent-a", "/metrics");
    assert_eq!(code, 200);
    assert!(metrics.contains("tartan_agent_warm_adoptions_total 1"), "{metrics}");
    s.finish().await;
}

// scenario: warm-pool-eviction
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_of_another_image_evicts_the_warm_vm_and_starts_cold_before_any_refill() {
    let mut s = Stack::new("warm-pool-eviction").await;
    s.add_agent("agent-a", pool_agent());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let warm = warm_ready(&s, "agent-a", &[]).await;
    let mut params = s.build_params(false);
    params.retain(|(k, _)| *k != "image");
    params.push(("image", json!(OTHER_IMAGE)));
    s.create_run("other", &params, None).await;
    s.wait_run("other", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    let journal = s.journal("agent-a");
    let seq_of = |pred: &dyn Fn(&Record) -> bool| journal.iter().find(|r| pred(r)).map(|r| r.seq);
    let evicted = seq_of(&|r| is_warm(r) && r.vm.as_deref() == Some(&warm) && r.reason == Some(Reason::Evicted))
        .expect("the warm VM evicted");
    let deleted = seq_of(&|r| is_warm(r) && r.vm.as_deref() == Some(&warm) && r.reason == Some(Reason::VMDeleted))
        .expect("its deletion confirmed");
    let admitted = seq_of(&|r| r.to == AttemptState::Admitted && r.build.is_some()).expect("admitted");
    assert!(evicted < deleted && deleted < admitted, "{}", s.journal_text("agent-a"));
    // A build wins over a refill: no warm VM took the slot between the deletion and the admission.
    assert!(
        !journal
            .iter()
            .any(|r| is_warm(r) && r.from.is_none() && r.seq > deleted && r.seq < admitted),
        "a refill came before the build:\n{}",
        s.journal_text("agent-a")
    );
    let build = of_build(&journal, "other");
    assert!(
        build.iter().any(|r| r.to == AttemptState::Booting),
        "the build started cold"
    );
    assert!(!build.iter().any(|r| r.warm.is_some()));
    // Once the build is done, the pool refills.
    warm_ready(&s, "agent-a", std::slice::from_ref(&warm)).await;
    s.finish().await;
}

// scenario: warm-pool-agent-killed
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_vms_of_a_killed_agent_are_deleted_at_its_next_start_and_never_handed_out() {
    let mut s = Stack::new("warm-pool-agent-killed").await;
    s.add_agent("agent-a", pool_agent());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let old = warm_ready(&s, "agent-a", &[]).await;
    s.kill_agent("agent-a", KillMode::Group);
    s.start_agent("agent-a").await;
    s.wait_journal("agent-a", "the old warm VM deleted", Duration::from_secs(30), |r| {
        is_warm(r) && r.vm.as_deref() == Some(&old) && r.to == AttemptState::Retired
    })
    .await;
    s.create_run("build-1", &s.build_params(false), None).await;
    s.wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    let journal = s.journal("agent-a");
    let old_records: Vec<&Record> = journal.iter().filter(|r| r.vm.as_deref() == Some(&old)).collect();
    assert!(
        old_records.iter().all(|r| r.build.is_none()),
        "the old warm VM was handed to a build:\n{}",
        s.journal_text("agent-a")
    );
    assert!(
        old_records
            .iter()
            .any(|r| r.to == AttemptState::Retiring && r.reason == Some(Reason::AgentRestarted)),
        "{}",
        s.journal_text("agent-a")
    );
    assert!(!s.vms("agent-a").contains(&old));
    s.finish().await;
}

// scenario: warm-pool-watchdog
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdog_deletes_a_warm_vm_whose_agent_stays_dead() {
    let mut s = Stack::new("warm-pool-watchdog").await;
    s.add_agent(
        "agent-a",
        AgentOptions {
            pool: r#"images = [{ image = "ghcr.io/cirruslabs/macos-sequoia-xcode:16", size = 1 }]
prepull = true
max_idle = "10s""#,
            ..AgentOptions::default()
        },
    );
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.start_watchdog("agent-a");
    let warm = warm_ready(&s, "agent-a", &[]).await;
    s.kill_agent("agent-a", KillMode::Alone);
    // Its deadline: 10 s (max_idle) + 60 s after its clone; the watchdog's grace is 3 s.
    let line = s
        .wait_watchdog("agent-a", "the warm VM deleted", Duration::from_secs(120), |l| {
            l.vm == warm && l.action == tartan_watchdog::Action::Deleted
        })
        .await;
    eprintln!("[e2e] watchdog: {line:?}");
    assert!(!s.vms("agent-a").contains(&warm));
    // The next start finds it gone and closes its records.
    s.start_agent("agent-a").await;
    s.wait_journal("agent-a", "its records closed", Duration::from_secs(30), |r| {
        is_warm(r) && r.vm.as_deref() == Some(&warm) && r.to == AttemptState::Retired
    })
    .await;
    s.finish().await;
}

// scenario: warm-pool-upgrade
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_build_resumes_across_an_agent_upgrade() {
    let mut s = Stack::new("warm-pool-upgrade").await;
    s.add_agent("agent-a", pool_agent());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let warm = warm_ready(&s, "agent-a", &[]).await;
    s.create_run("build-1", &s.build_params(true), None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    s.stop_agent("agent-a", Duration::from_secs(20));
    s.start_agent("agent-a").await;
    s.wait_journal("agent-a", "resumed", Duration::from_secs(30), |r| {
        r.reason == Some(Reason::Resumed) && r.vm.as_deref() == Some(&warm)
    })
    .await;
    s.open_gate();
    s.wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    assert_eq!(s.builds_started(), 1, "no step ran twice");
    assert!(!s.vms("agent-a").contains(&warm));
    s.finish().await;
}

// scenario: warm-pool-cancel
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_while_the_adoption_waits_for_the_guest_ends_the_build_and_deletes_the_vm() {
    let mut s = Stack::new("warm-pool-cancel").await;
    s.add_agent("agent-a", pool_agent());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let warm = warm_ready(&s, "agent-a", &[]).await;
    // The warm VM's guest stops answering: the adoption's probe hangs.
    s.tart_faults("agent-a", json!({"vms": {warm.clone(): {"exec_hangs": true}}}));
    s.create_run("build-1", &s.build_params(false), None).await;
    s.wait_journal("agent-a", "admitted into the warm VM", Duration::from_secs(30), |r| {
        r.to == AttemptState::Admitted && r.vm.as_deref() == Some(&warm)
    })
    .await;
    s.cancel_run("build-1").await;
    s.wait_run("build-1", "False", "CustomRunCancelled", Duration::from_secs(30))
        .await;
    let journal = s.journal("agent-a");
    let build = of_build(&journal, "build-1");
    assert!(build.iter().any(|r| r.outcome == Some(Outcome::Cancelled)));
    assert!(
        build
            .iter()
            .any(|r| r.to == AttemptState::Retired && r.reason == Some(Reason::VMDeleted)),
        "{}",
        s.journal_text("agent-a")
    );
    assert_eq!(s.builds_started(), 0, "no step ran");
    assert!(!s.vms("agent-a").contains(&warm));
    s.tart_faults("agent-a", json!({}));
    s.finish().await;
}

// scenario: warm-pool-two-agents
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_free_agents_the_one_with_a_warm_vm_takes_the_build() {
    let mut s = Stack::new("warm-pool-two-agents").await;
    // The agent's own claim spread (500 ms), not the scenarios' shortened one.
    let spread = AgentOptions {
        claim_spread: "500ms",
        ..AgentOptions::default()
    };
    s.add_agent(
        "warm",
        AgentOptions {
            pool: POOL_OF_ONE,
            ..spread.clone()
        },
    );
    s.add_agent("cold", spread);
    // The cold host holds the image too (a clone pulled it once): only the warm VM tells them apart.
    for args in [["clone", IMAGE, "seed"].as_slice(), &["delete", "seed"]] {
        assert!(s.tart("cold", args).status.success());
    }
    s.start_controller(ControllerOptions::default());
    s.start_agent("warm").await;
    s.start_agent("cold").await;
    let runs = 20;
    let mut used: Vec<String> = Vec::new();
    let mut won = 0;
    for i in 0..runs {
        // A warm VM is ready (a fresh one after each adoption), and the warm agent's Lease says so.
        let vm = warm_ready(&s, "warm", &used).await;
        tartan_e2e::wait_for_async("the warm image on the Lease", Duration::from_secs(20), || async {
            let lease = s.lease("warm").await;
            let warm = lease
                .and_then(|l| l.metadata.annotations)
                .and_then(|a| a.get("tartan.dev/warm-images").cloned());
            match warm {
                Some(w) if w.contains(IMAGE) => Ok(()),
                other => Err(format!("tartan.dev/warm-images: {other:?}")),
            }
        })
        .await;
        let name = format!("build-{i}");
        s.create_run(&name, &s.build_params(false), None).await;
        s.wait_run(&name, "True", "TestsPassed", Duration::from_secs(60)).await;
        let adopted = of_build(&s.journal("warm"), &name)
            .iter()
            .any(|r| r.reason == Some(Reason::Adopted));
        if adopted {
            won += 1;
            used.push(vm);
        }
    }
    eprintln!("[e2e] warm-pool-two-agents: the warm agent took {won} of {runs} builds");
    assert!(won >= 19, "the warm agent took only {won} of {runs}");
    s.finish().await;
}

// scenario: warm-pool-reboot
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reboot_warm_vms_are_deleted_and_the_adopted_build_is_retried() {
    let mut s = Stack::new("warm-pool-reboot").await;
    s.add_agent(
        "agent-a",
        AgentOptions {
            slots: 2,
            ..pool_agent()
        },
    );
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.start_watchdog("agent-a");
    let adopted = warm_ready(&s, "agent-a", &[]).await;
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("600")));
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    // The pool refills the free slot while the build runs in the adopted VM.
    let spare = warm_ready(&s, "agent-a", std::slice::from_ref(&adopted)).await;

    s.reboot_host("agent-a");
    s.open_gate();
    s.start_watchdog("agent-a");
    s.start_agent("agent-a").await;
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    assert_eq!(tartan_e2e::invariants::result(&run, "attempt"), Some("build-1#2"));
    let journal = s.journal("agent-a");
    assert!(
        journal.iter().any(|r| is_warm(r)
            && r.vm.as_deref() == Some(&spare)
            && r.to == AttemptState::Retiring
            && r.reason == Some(Reason::AgentRestarted)),
        "the spare warm VM is deleted at the start:\n{}",
        s.journal_text("agent-a")
    );
    assert!(
        journal
            .iter()
            .filter(|r| r.vm.as_deref() == Some(&spare))
            .all(|r| r.build.is_none()),
        "a warm VM of the run before the reboot was handed to a build"
    );
    for vm in [&adopted, &spare] {
        assert!(!s.vms("agent-a").contains(vm), "{vm} left on disk");
    }
    s.finish().await;
}

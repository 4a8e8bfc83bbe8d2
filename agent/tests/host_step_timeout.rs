//! `steps[].timeoutSeconds` against real `tart-double` processes: a step running past its limit
//! is killed in the guest and the build fails `StepTimedOut` naming it; a re-attached step keeps
//! the limit counted from its original start.

mod host_common;

use host_common::*;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::time::{Duration, Instant};
use tartan_agent::host::{Performed, cancel_pair, drive};
use tartan_agent::machine::{Action, Config, Event};
use tartan_api::{AttemptState as S, Outcome, Reason};

const LIMIT: Duration = Duration::from_secs(90);

fn timed(name: &str, script: &str, secs: u32) -> tartan_api::Step {
    let mut s = step(name, script);
    s.timeout_seconds = Some(secs);
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_past_its_timeout_is_killed_in_the_guest_and_the_build_fails_naming_it() {
    let rig = Rig::new();
    // The step forks a child that would outlive it, says so, then hangs.
    let spec = spec(vec![
        step("setup", "echo ready"),
        timed("build", "sleep 300 & echo compiling; sleep 300", 2),
        step("never", "touch ran-never"),
    ]);
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt(&rig, "step-timeout", spec, signal);
    let mut journal = MemJournal::new();
    let started = Instant::now();
    let end = tokio::time::timeout(
        LIMIT,
        drive(&mut exec, &mut a, admit(600), &Config::default(), &mut journal),
    )
    .await
    .expect("attempt finished in time")
    .unwrap();
    assert_eq!(end, S::Retired);
    let took = started.elapsed();
    assert!(took < Duration::from_secs(60), "took {took:?}");
    let records = journal.records.lock().unwrap().clone();
    let retiring = records.iter().find(|r| r.to == S::Retiring).unwrap();
    assert_eq!(
        (retiring.reason, retiring.outcome),
        (Some(Reason::StepTimedOut), Some(Outcome::Failed))
    );
    let detail = &retiring.detail;
    assert!(
        detail.starts_with("step build ran longer than its timeoutSeconds (2s); it was killed in the guest ("),
        "{detail}"
    );
    // The step's shell and both sleeps (one a child it left behind).
    let killed: u32 = detail
        .split("killed in the guest (")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(killed >= 2, "{detail}");
    assert!(detail.ends_with("its output ends:\ncompiling"), "{detail}");
    assert_eq!(exec.last_step(), Some(("build", "compiling")));
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
    assert!(!rig.home.path().join("vms").join(&a.vm).join("ran-never").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_that_ends_within_its_timeout_is_not_touched() {
    let rig = Rig::new();
    let spec = spec(vec![timed("build", "echo done", 30)]);
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt(&rig, "step-in-time", spec, signal);
    let mut journal = MemJournal::new();
    let end = tokio::time::timeout(
        LIMIT,
        drive(&mut exec, &mut a, admit(600), &Config::default(), &mut journal),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(end, S::Retired);
    assert_eq!(a.outcome, Some(Outcome::Succeeded));
}

/// A restarted agent re-attaching to a step gets the step's start from the journal: a step that
/// started long ago is stopped at once, not given its whole limit again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reattached_step_counts_its_timeout_from_its_original_start() {
    let rig = Rig::new();
    let spec = spec(vec![timed("build", "echo compiling; sleep 300", 60)]);
    let (_cancel, signal) = cancel_pair();
    let (a, mut exec) = attempt(&rig, "step-resumed", spec, signal);
    let vm = a.vm.clone();
    let deadline = Timestamp::now() + SignedDuration::from_secs(600);
    for action in [
        Action::WriteDeadlineFile {
            vm: vm.clone(),
            deadline,
        },
        Action::CloneVm { vm: vm.clone() },
        Action::SetVm { vm: vm.clone() },
        Action::StartVm { vm: vm.clone() },
    ] {
        assert_eq!(exec.perform(&action).await, Performed::Done, "{action:?}");
    }
    assert!(matches!(
        exec.perform(&Action::ProbeReady { vm: vm.clone() }).await,
        Performed::Event(Event::GuestReady { .. })
    ));
    // The journal says the step started 100 s ago (before the agent restarted).
    let since = Timestamp::now() - SignedDuration::from_secs(100);
    let t0 = Instant::now();
    let done = tokio::time::timeout(
        LIMIT,
        exec.perform(&Action::RunStep {
            vm: vm.clone(),
            index: 0,
            since,
        }),
    )
    .await
    .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
    match done {
        Performed::Event(Event::StepTimedOut {
            step,
            timeout_seconds,
            killed,
            ..
        }) => {
            assert_eq!((step.as_str(), timeout_seconds), ("build", 60));
            // Stopped at once: it had not even started when its limit had passed; the start
            // still happens (the guest job must exist to be stopped) and is killed.
            assert!(
                killed.starts_with("it was killed in the guest") || killed.contains("no pid"),
                "{killed}"
            );
        }
        other => panic!("{other:?}"),
    }
    let deleted = exec
        .perform(&Action::StopAndDeleteVm {
            vm: vm.clone(),
            context: tartan_agent::machine::DeleteContext::Normal,
        })
        .await;
    assert!(
        matches!(deleted, Performed::Event(Event::VmDeleted { .. })),
        "{deleted:?}"
    );
}

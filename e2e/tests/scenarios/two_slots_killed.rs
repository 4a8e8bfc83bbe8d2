//! Issue 14: both slots of a 2-slot agent busy when the agent is `kill -9`ed. Killed with its
//! process group (launchd, `on_restart = "resume"`), both VMs and their steps live on and the next
//! agent resumes both attempts: `True/TestsPassed` as `#1`, each step run once. Killed with its VMs
//! (the Mac's tart processes too), both attempts are interrupted and retried as `#2`. Either way the
//! two builds never share a slot (invariant 1, checked by `finish`).
//!
//! scenario: two-slots-killed

use serde_json::json;
use std::time::Duration;
use tartan_agent::record::Record;
use tartan_api::{AttemptState, Outcome, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack, wait_for};

const BUILDS: [&str; 2] = ["build-1", "build-2"];

/// A 2-slot agent running two builds, each in its gated step.
async fn both_slots_busy(name: &str) -> Stack {
    let mut s = Stack::new(name).await;
    s.add_agent(
        "agent-a",
        AgentOptions {
            slots: 2,
            ..AgentOptions::default()
        },
    );
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("600")));
    for b in BUILDS {
        s.create_run(b, &params, None).await;
    }
    s.wait_builds_started(2, Duration::from_secs(60)).await;
    let slots: Vec<(String, u8)> = s
        .journal("agent-a")
        .iter()
        .filter(|r| r.to == AttemptState::Admitted)
        .map(|r| (build_of(r).to_string(), r.slot.expect("an admission names its slot")))
        .collect();
    eprintln!("[e2e] {name}: admitted {slots:?}");
    assert_eq!(slots.len(), 2, "{slots:?}");
    s
}

fn build_of(r: &Record) -> &str {
    r.build.as_ref().map_or("", |b| b.name.as_str())
}

/// For each build, the first record matching `pred`, waiting until both have one.
async fn wait_both(s: &Stack, what: &str, pred: impl Fn(&Record) -> bool) -> Vec<Record> {
    wait_for(
        &format!("agent-a's journal: {what} for both builds"),
        Duration::from_secs(30),
        || {
            let journal = s.journal("agent-a");
            let found: Vec<Record> = BUILDS
                .iter()
                .filter_map(|b| journal.iter().find(|r| build_of(r) == *b && pred(r)).cloned())
                .collect();
            (found.len() == BUILDS.len())
                .then_some(found.clone())
                .ok_or_else(|| format!("found {:?}", found.iter().map(|r| r.to_string()).collect::<Vec<_>>()))
        },
    )
    .await
}

async fn both_pass_as(s: &Stack, attempt: u32) {
    for b in BUILDS {
        let run = s.wait_run(b, "True", "TestsPassed", Duration::from_secs(60)).await;
        assert_eq!(result(&run, "attempt"), Some(format!("{b}#{attempt}").as_str()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_killed_both_builds_resume() {
    let mut s = both_slots_busy("two-slots-killed-resume").await;
    s.kill_agent("agent-a", KillMode::Group);
    assert!(!s.tart_pids("agent-a").is_empty(), "both VMs run on without the agent");
    s.start_agent("agent-a").await;
    let resumed = wait_both(&s, "Running -> Running (Resumed)", |r| {
        r.reason == Some(Reason::Resumed) && r.to == AttemptState::Running
    })
    .await;
    assert!(resumed.iter().all(|r| r.attempt == Some(1)), "{resumed:?}");
    s.open_gate();
    both_pass_as(&s, 1).await;
    assert_eq!(s.builds_started(), 2, "each build's first step ran once");
    let journal = s.journal("agent-a");
    assert!(
        journal
            .iter()
            .all(|r| r.attempt != Some(2) && r.reason != Some(Reason::AgentRestarted)),
        "nothing interrupted, no attempt 2:\n{}",
        s.journal_text("agent-a")
    );
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_and_vms_killed_both_builds_retry_as_attempt_2() {
    let mut s = both_slots_busy("two-slots-killed-vms").await;
    s.kill_agent("agent-a", KillMode::GroupAndVms);
    s.open_gate();
    s.start_agent("agent-a").await;
    let interrupted = wait_both(&s, "Retiring (AgentRestarted)", |r| {
        r.to == AttemptState::Retiring && r.reason == Some(Reason::AgentRestarted)
    })
    .await;
    for r in &interrupted {
        assert_eq!(r.outcome, Some(Outcome::Interrupted), "{r}");
        assert_eq!(r.attempt, Some(1), "{r}");
    }
    both_pass_as(&s, 2).await;
    assert_eq!(s.builds_started(), 4, "each build's first step ran in each attempt");
    assert!(s.journal("agent-a").iter().all(|r| r.reason != Some(Reason::Resumed)));
    s.finish().await;
}

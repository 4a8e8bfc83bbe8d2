//! Issue 15, step timeouts: a step with `timeoutSeconds` that runs longer is killed in the guest
//! and the CustomRun ends `False/StepTimedOut` naming the step; a step re-attached by a
//! restarted agent keeps the limit counted from its original start.

use serde_json::{Value, json};
use std::time::Duration;
use tartan_api::{AttemptState, Reason};
use tartan_e2e::stack::{IMAGE, condition_text};
use tartan_e2e::{AgentOptions, ControllerOptions, Stack, wait_for};

/// A build whose step `build` says it compiles, notes its start, and hangs; its limit is `secs`.
fn hanging_step_params(s: &Stack, secs: u32) -> Vec<(&'static str, Value)> {
    let dir = s.dir.display();
    let steps = format!(
        "[{{name: setup, run: [sh, -c, 'echo ready']}}, \
         {{name: build, timeoutSeconds: {secs}, run: [sh, -c, 'echo compiling; echo x >> {dir}/build-started; sleep 300']}}, \
         {{name: never, run: [sh, -c, 'echo x >> {dir}/never-ran']}}]"
    );
    vec![
        ("image", json!(IMAGE)),
        ("steps", json!(steps)),
        ("timeout-seconds", json!("600")),
    ]
}

fn started(s: &Stack) -> usize {
    std::fs::read_to_string(s.dir.join("build-started"))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

fn assert_timed_out(s: &Stack, run: &Value, secs: u32) {
    let text = condition_text(run);
    eprintln!("[e2e] CustomRun: {text}");
    assert!(text.starts_with("False/StepTimedOut: MacBuild"), "{text}");
    assert!(
        text.contains(&format!(
            "step build ran longer than its timeoutSeconds ({secs}s); it was killed in the guest"
        )),
        "{text}"
    );
    assert!(text.contains("its output ends:\ncompiling"), "{text}");
    assert!(!s.dir.join("never-ran").exists(), "the step after it never ran");
    assert!(
        s.vms("agent-a").iter().all(|v| !v.starts_with("mb-")),
        "{:?}",
        s.vms("agent-a")
    );
    assert!(
        s.journal("agent-a").iter().all(|r| r.attempt != Some(2)),
        "a timed-out step is a failure, never retried"
    );
}

// scenario: step-timeout
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_past_its_timeout_fails_the_build_step_timed_out() {
    let mut s = Stack::new("step-timeout").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.create_run("build-1", &hanging_step_params(&s, 3), None).await;
    let run = s
        .wait_run("build-1", "False", "StepTimedOut", Duration::from_secs(90))
        .await;
    assert_eq!(started(&s), 1);
    assert_timed_out(&s, &run, 3);
    s.finish().await;
}

// scenario: step-timeout-resumed
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_step_keeps_the_timeout_of_its_original_start() {
    const LIMIT: u32 = 20;
    let mut s = Stack::new("step-timeout-resumed").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.create_run("build-1", &hanging_step_params(&s, LIMIT), None).await;
    wait_for("the build step to start", Duration::from_secs(60), || {
        (started(&s) == 1)
            .then_some(())
            .ok_or(format!("{} start(s)", started(&s)))
    })
    .await;
    s.stop_agent("agent-a", Duration::from_secs(60));
    // The agent stays away for half the step's limit (the step has run that long, by its own
    // start note), so a limit counted from the resume would end well after the original one.
    let note = std::fs::metadata(s.dir.join("build-started"))
        .unwrap()
        .modified()
        .unwrap();
    let half = Duration::from_secs(u64::from(LIMIT / 2));
    wait_for("the step to have run half its limit", half * 2, || {
        let ran = note.elapsed().unwrap_or_default();
        (ran >= half).then_some(()).ok_or(format!("ran {ran:?}"))
    })
    .await;
    s.start_agent("agent-a").await;
    let run = s
        .wait_run("build-1", "False", "StepTimedOut", Duration::from_secs(90))
        .await;
    assert_timed_out(&s, &run, LIMIT);
    assert_eq!(started(&s), 1, "the step was re-attached, not started again");
    let journal = s.journal("agent-a");
    let step_started = journal
        .iter()
        .find(|r| r.reason == Some(Reason::StepStarted) && r.step == Some(1))
        .expect("the build step's StepStarted record");
    let resumed = journal
        .iter()
        .find(|r| r.reason == Some(Reason::Resumed) && r.to == AttemptState::Running)
        .expect("a Resumed record");
    let timed_out = journal
        .iter()
        .find(|r| r.reason == Some(Reason::StepTimedOut))
        .expect("the StepTimedOut record");
    let limit = k8s_openapi::jiff::SignedDuration::from_secs(i64::from(LIMIT));
    // Counted from the step's start, not from the resume (which would end it at resume + limit).
    assert!(timed_out.time >= step_started.time + limit, "{timed_out}");
    assert!(timed_out.time < resumed.time + limit, "{resumed}\n{timed_out}");
    eprintln!(
        "[e2e] step started {}, resumed {}, timed out {}",
        step_started.time, resumed.time, timed_out.time
    );
    s.finish().await;
}

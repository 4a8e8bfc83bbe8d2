//! A refused terminal status (an admission policy denies terminal `macbuilds/status` writes):
//! the journal reaches `Retired` while the API shows the build running; after a kill, the policy
//! lifted and a restart, the agent delivers the saved status again.

use std::time::Duration;
use tartan_api::{AttemptState, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::{AgentOptions, ControllerOptions, KillMode, Stack};

// scenario: redelivery
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_terminal_status_is_redelivered_after_restart() {
    let mut s = Stack::new("redelivery").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.cluster.deny_terminal_status(&s.ns).await;
    s.create_run("build-1", &s.build_params(false), None).await;

    let retired = s
        .wait_journal("agent-a", "Retired (VMDeleted)", Duration::from_secs(60), |r| {
            r.to == AttemptState::Retired && r.reason == Some(Reason::VMDeleted)
        })
        .await;
    let mb = s.macbuild("build-1").await.expect("MacBuild");
    assert_ne!(mb["status"]["phase"], "Succeeded", "the terminal write was refused");
    assert!(mb["status"]["journalSeq"].as_u64() < Some(retired.seq));
    let run = s.customrun("build-1").await.unwrap();
    assert_eq!(run["status"]["conditions"][0]["status"], "Unknown");

    s.kill_agent("agent-a", KillMode::Group);
    s.cluster.allow_terminal_status(&s.ns).await;
    s.start_agent("agent-a").await;
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(30))
        .await;
    assert_eq!(result(&run, "attempt"), Some("build-1#1"));
    let log = std::fs::read_to_string(s.agent("agent-a").state_dir.parent().unwrap().join("agent-2.log")).unwrap();
    assert!(
        log.contains(&format!("status behind journal (record {})", retired.seq)),
        "the restarted agent says it redelivers; its log:\n{log}"
    );
    assert_eq!(s.builds_started(), 1);
    s.finish().await;
}

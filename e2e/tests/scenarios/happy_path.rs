//! Happy path: CustomRun -> MacBuild -> VM -> steps -> JUnit + artifact -> VM deleted ->
//! `True/TestsPassed` with results; a VM planted without the `mb-` prefix survives.

use std::time::Duration;
use tartan_api::{AttemptState, Outcome, Reason};
use tartan_e2e::invariants::result;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack};

// scenario: happy-path
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn happy_path() {
    let mut s = Stack::new("happy-path").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.plant_vm("agent-a", "operator-base");
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.create_run("build-1", &s.build_params(false), None).await;

    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(90))
        .await;
    assert_eq!(result(&run, "attempt"), Some("build-1#1"));
    assert_eq!(result(&run, "testsPassed"), Some("2"));
    assert_eq!(result(&run, "testsTotal"), Some("2"));
    assert_eq!(result(&run, "vmRetirement"), Some("deleted"));
    let artifact = result(&run, "artifact").expect("artifact result");
    assert!(
        artifact.contains("App.ipa") || artifact.starts_with("file://"),
        "artifact {artifact}"
    );

    let journal = s.journal("agent-a");
    let has = |to: AttemptState, reason: Reason| journal.iter().any(|r| r.to == to && r.reason == Some(reason));
    assert!(has(AttemptState::Admitted, Reason::SlotFree));
    assert!(has(AttemptState::Running, Reason::GuestReady));
    assert!(
        journal
            .iter()
            .any(|r| r.to == AttemptState::Retiring && r.outcome == Some(Outcome::Succeeded))
    );
    assert!(has(AttemptState::Retired, Reason::VMDeleted));
    assert_eq!(
        s.vms("agent-a"),
        vec!["operator-base".to_string()],
        "only the planted VM is left"
    );
    assert_eq!(s.builds_started(), 1);
    s.finish().await;
}

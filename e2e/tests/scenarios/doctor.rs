//! `tartan-agent doctor` on the e2e stack: run beside a live agent (it takes no lock), after a
//! build went through, with the agent's own config and environment, it passes every check that
//! applies here (the LaunchAgents and RBAC checks skip off macOS and on the emulator) and exits 0;
//! the agent and its build are untouched by it.

use std::process::Command;
use std::time::Duration;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack};

// scenario: doctor
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_passes_beside_a_live_agent_after_a_build() {
    let mut s = Stack::new("doctor").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.create_run("build-1", &s.build_params(false), None).await;
    s.wait_run("build-1", "True", "TestsPassed", Duration::from_secs(90))
        .await;

    let agent = s.agent("agent-a");
    let out = Command::new(tartan_e2e::bins::bin("tartan-agent"))
        .args(["doctor", "--json", "--config"])
        .arg(&agent.config)
        .env("TART_HOME", &agent.tart_home)
        .output()
        .expect("running tartan-agent doctor");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("[e2e] doctor: {text}");
    let report: serde_json::Value = serde_json::from_str(&text).expect("doctor --json prints JSON");
    let checks = report["checks"].as_array().expect("checks");
    let failed: Vec<&serde_json::Value> = checks.iter().filter(|c| c["verdict"] == "fail").collect();
    assert!(out.status.success() && failed.is_empty(), "doctor failed: {failed:?}");
    assert_eq!(report["ok"], true);
    for name in ["config", "tart", "journal replays", "API server", "clock", "Lease"] {
        assert!(
            checks.iter().any(|c| c["name"] == name && c["verdict"] == "pass"),
            "no passed {name} check in {checks:?}"
        );
    }
    assert_eq!(s.builds_started(), 1);
    s.finish().await;
}

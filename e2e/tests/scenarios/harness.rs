//! The harness itself, without an agent: the API and the controller as real processes, a
//! CustomRun turned into a MacBuild, a planted VM, and the invariant check at the end.
//!
//! scenario: harness

mod monitoring;
mod scenario_names;

use std::time::Duration;
use tartan_e2e::{ControllerOptions, Stack};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_creates_the_macbuild_and_invariants_hold() {
    let mut s = Stack::new("harness").await;
    s.add_agent("agent-a", Default::default());
    s.plant_vm("agent-a", "operator-base");
    s.start_controller(ControllerOptions::default());
    s.create_run("build-1", &s.build_params(false), None).await;
    let mb = s
        .wait_macbuild("build-1", "created by the controller", Duration::from_secs(30), |m| {
            m["spec"]["image"] == tartan_e2e::stack::IMAGE
        })
        .await;
    assert_eq!(mb["metadata"]["ownerReferences"][0]["kind"], "CustomRun");
    assert_eq!(s.vms("agent-a"), vec!["operator-base".to_string()]);
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_controller_is_gone_with_its_group() {
    let mut s = Stack::new("harness-kill").await;
    s.start_controller(ControllerOptions::default());
    s.kill_controller();
    s.restart_controller();
    s.create_run("build-1", &s.build_params(false), None).await;
    s.wait_macbuild(
        "build-1",
        "created by the restarted controller",
        Duration::from_secs(30),
        |_| true,
    )
    .await;
    s.finish().await;
}

//! A MacBuild's `image` is handed to `tart clone IMAGE NEW` as given. A name without a `/` is a
//! *local* VM for tart: `image: <another build's VM>` (its name is in that MacBuild's
//! `status.vm`) clones that build's whole disk — its checkout, its secrets, its signing keys —
//! into the attacker's VM, where its steps can read it. Issue 10: no path from a MacBuild may
//! resolve inside `TART_HOME`. The agent must refuse such an image before cloning (the build
//! fails naming the image), and never clone a VM of its own (`mb-` prefix) or any local VM the
//! operator did not allow.

use serde_json::json;
use std::time::Duration;
use tartan_api::AttemptState;
use tartan_e2e::stack::condition_text;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack};

// scenario: image-local-vm
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_cannot_clone_another_builds_vm_by_naming_it_as_its_image() {
    let mut s = Stack::new("image-local-vm").await;
    s.add_agent(
        "agent-a",
        AgentOptions {
            slots: 2,
            ..AgentOptions::default()
        },
    );
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    // The victim: runs (gated) with its VM on the host.
    let mut victim = s.build_params(true);
    victim.push(("timeout-seconds", json!("600")));
    s.create_run("victim", &victim, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    let (victim_vm, _) = s.admitted_vm("agent-a").await;

    // The attacker names the victim's VM (MacBuild status.vm) as its image.
    let mut attacker = s.build_params(false);
    attacker.retain(|(k, _)| *k != "image");
    attacker.push(("image", json!(victim_vm)));
    s.create_run("attacker", &attacker, None).await;
    let run = s.wait_run_ended("attacker", Duration::from_secs(60)).await;
    let log = s.agent_log("agent-a");
    let cloned_from_victim: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" cloned ") && l.contains(&format!("image={victim_vm}")))
        .collect();
    eprintln!(
        "[e2e] attacker: {}; clones from {victim_vm}: {cloned_from_victim:?}",
        condition_text(&run)
    );
    let attacker_records: Vec<String> = s
        .journal("agent-a")
        .iter()
        .filter(|r| r.build.as_ref().is_some_and(|b| b.name == "attacker"))
        .map(|r| r.to_string())
        .collect();
    eprintln!("[e2e] attacker's journal:\n{}", attacker_records.join("\n"));
    assert!(
        cloned_from_victim.is_empty(),
        "the agent cloned another build's VM {victim_vm} for the attacker: {cloned_from_victim:?}"
    );
    assert!(
        !s.journal("agent-a")
            .iter()
            .any(|r| r.build.as_ref().is_some_and(|b| b.name == "attacker") && r.to == AttemptState::Booting),
        "refused before any clone"
    );
    s.open_gate();
    s.wait_run("victim", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    s.finish().await;
}

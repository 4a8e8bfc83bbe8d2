//! Two agents (separate state dirs and tart homes), one MacBuild at a time: the claim, not a host
//! lock, separates them; the loser journals `ClaimLost` and clones nothing. (With `claim_spread = 0s`:
//! the rendezvous wait would otherwise keep them from racing.)

use std::time::Duration;
use tartan_api::{AttemptState, Reason};
use tartan_e2e::{AgentOptions, ControllerOptions, Stack};

// scenario: two-agents
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_one_macbuild() {
    let mut s = Stack::new("two-agents").await;
    // Both claim at once (no rendezvous wait), so that they do race.
    let racing = AgentOptions {
        claim_spread: "0s",
        ..AgentOptions::default()
    };
    s.add_agent("agent-a", racing.clone());
    s.add_agent("agent-b", racing);
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.start_agent("agent-b").await;
    let mut claim_lost = 0;
    // Either may win each build; a contest is likely but not certain, so up to three builds.
    for i in 1..=3 {
        let name = format!("build-{i}");
        s.create_run(&name, &s.build_params(false), None).await;
        s.wait_run(&name, "True", "TestsPassed", Duration::from_secs(60)).await;
        let mut winners = vec![];
        for id in ["agent-a", "agent-b"] {
            let j = s.journal(id);
            let mine = |r: &&tartan_agent::record::Record| r.build.as_ref().is_some_and(|b| b.name == name);
            if j.iter().filter(mine).any(|r| r.to == AttemptState::Admitted) {
                winners.push(id);
            }
            let lost: Vec<_> = j
                .iter()
                .filter(mine)
                .filter(|r| r.reason == Some(Reason::ClaimLost))
                .collect();
            for r in &lost {
                assert!(
                    !j.iter()
                        .filter(mine)
                        .any(|x| x.attempt == r.attempt && x.to == AttemptState::Booting),
                    "{id} lost the claim but booted: {r}"
                );
            }
            claim_lost += lost.len();
        }
        assert_eq!(winners.len(), 1, "{name}: exactly one agent admits it, got {winners:?}");
        if claim_lost > 0 {
            break;
        }
    }
    assert!(claim_lost >= 1, "no ClaimLost in three contested builds");
    s.finish().await;
}
